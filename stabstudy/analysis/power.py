"""The power of a decision rule as applied: how often it decides, either way, at the design's size.

Every confirmatory claim of the study ends in one of three verdicts (see
:mod:`stabstudy.analysis.claims`). Its rule says *supported* when a one-sided test of
``H0: effect <= minimum`` rejects, and *not supported* when a one-sided test of
``H0: effect >= sesoi`` rejects (the smallest effect of interest is excluded). A design that can
decide has, at the family's alpha, a high probability of both:

* ``P(supported)`` when the true effect is the *planning effect* (what the claim expects);
* ``P(not supported)`` when the true effect is the *null effect* (no effect at all).

A :data:`PowerFn` maps ``(alpha, scale)`` to that pair, ``scale`` multiplying every group's size,
so that :func:`units_needed` can say how many units would decide a row that stayed inconclusive.
The computations are exact where a closed form exists (t-tests under normality: the noncentral t;
binomial and paired-binary outcomes: enumeration of every possible outcome) and simulated where not
(signed-rank tests, Spearman's rho, two one-sided tests), always with a fixed seed. Effects are in
the claim's direction: a claim that something *lowers* a quantity has ``effect = -(difference)``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np
from scipy import stats as sps

from stabstudy.analysis import proportions

PowerFn = Callable[[float, float], tuple[float, float]]
"""``(alpha, scale) -> (P(supported | planning effect), P(not supported | null effect))``."""

SIMS = 2000
"""Simulated samples per power estimate (its standard error is at most 0.011)."""

TARGET = 0.8
"""The power a design should reach either way, as the study plans it."""

ENUMERATION_LIMIT = 150
"""The largest group size whose outcomes are enumerated when units are sought (cost grows as n^2)."""


def _size(n: int, scale: float) -> int:
    return max(int(round(n * scale)), 1)


def t_test(n: int, sd: float, *, planning: float, minimum: float, sesoi: float, null: float = 0.0,
           n_other: int = 0, sd_other: float = 0.0) -> PowerFn:
    """A one-sample (paired) t-test over ``n`` units of spread ``sd``, or Welch's test when
    ``n_other`` is given (the second group's size and spread): exact under normal data."""

    @functools.lru_cache(maxsize=32)  # a table asks again at the same alpha; units_needed walks scales
    def fn(alpha: float, scale: float = 1.0) -> tuple[float, float]:
        m = _size(n, scale)
        if n_other:
            k = _size(n_other, scale)
            vx, vy = sd ** 2 / m, sd_other ** 2 / k
            se = math.sqrt(vx + vy)
            df = (vx + vy) ** 2 / (vx ** 2 / max(m - 1, 1) + vy ** 2 / max(k - 1, 1)) if vx + vy > 0 else m + k - 2
        else:
            se, df = sd / math.sqrt(m), m - 1
        if df < 1 or not np.isfinite(se):
            return math.nan, math.nan
        if se == 0:  # a spread of zero: every sample is the point, and decides if the point does
            return float(planning > minimum), float(null < sesoi)
        tc = sps.t.ppf(1 - alpha, df)
        return (float(sps.nct.sf(tc, df, (planning - minimum) / se)),
                float(sps.nct.cdf(-tc, df, (null - sesoi) / se)))

    return fn


def signed_rank(residuals: np.ndarray, *, planning: float, minimum: float, sesoi: float, null: float = 0.0,
                seed: int = 0) -> PowerFn:
    """Wilcoxon's signed-rank test, simulated: samples drawn from the observed residuals about their
    median (a smoothed bootstrap: a little normal jitter so that draws do not tie) shifted to the
    planning and the null effect."""
    r = np.asarray(residuals, dtype=float)
    r = r - np.median(r)
    spread = float(np.std(r))
    jitter = 0.05 * spread if spread > 0 else 1e-6 * max(abs(planning - minimum), abs(sesoi - null), 1e-12)

    @functools.lru_cache(maxsize=32)  # a table asks again at the same alpha; units_needed walks scales
    def fn(alpha: float, scale: float = 1.0) -> tuple[float, float]:
        m = _size(r.size, scale)
        rng = np.random.default_rng(seed)
        draw = rng.choice(r, size=(SIMS, m)) + rng.normal(0.0, jitter, size=(SIMS, m))
        p_s = sps.wilcoxon(draw + (planning - minimum), axis=1, alternative="greater").pvalue
        p_n = sps.wilcoxon(draw + (null - sesoi), axis=1, alternative="less").pvalue
        return float(np.mean(p_s < alpha)), float(np.mean(p_n < alpha))

    return fn


def binomial(n: int, *, target: float, planning: float, harmful: float) -> PowerFn:
    """The exact binomial test of a rate against ``target`` (lower is better): P(the rate is shown
    below ``target``) at the ``planning`` rate, P(shown above it) at the ``harmful`` rate."""

    @functools.lru_cache(maxsize=32)  # a table asks again at the same alpha; units_needed walks scales
    def fn(alpha: float, scale: float = 1.0) -> tuple[float, float]:
        m = _size(n, scale)
        k = np.arange(m + 1)
        below = sps.binom.cdf(k, m, target) < alpha   # binomtest(k, m, target, "less").pvalue
        above = sps.binom.sf(k - 1, m, target) < alpha  # binomtest(k, m, target, "greater").pvalue
        return (float(sps.binom.pmf(k, m, planning)[below].sum()),
                float(sps.binom.pmf(k, m, harmful)[above].sum()))

    return fn


def rates(n1: int, n0: int, *, sign: int, minimum: float, sesoi: float, planning: tuple[float, float],
          null: float) -> PowerFn:
    """Two independent rates (exact unconditional score tests), every outcome table enumerated:
    P(supported) with the rates at ``planning`` (treated, control), P(not supported) with both at
    ``null``; ``sign`` -1 for a claim that the treated rate is lower."""

    @functools.lru_cache(maxsize=32)
    def fn(alpha: float, scale: float = 1.0) -> tuple[float, float]:
        m1, m0 = _size(n1, scale), _size(n0, scale)
        if max(m1, m0) > ENUMERATION_LIMIT:
            return math.nan, math.nan
        yes = proportions.independent_table_p(m1, m0, sign * minimum, "larger" if sign > 0 else "smaller") < alpha
        no = proportions.independent_table_p(m1, m0, sign * sesoi, "smaller" if sign > 0 else "larger") < alpha
        k1, k0 = np.arange(m1 + 1), np.arange(m0 + 1)

        def prob(r1: float, r0: float, region: np.ndarray) -> float:
            return float(np.outer(sps.binom.pmf(k1, m1, r1), sps.binom.pmf(k0, m0, r0))[region].sum())

        return prob(*planning, yes), prob(null, null, no)

    return fn


def paired_rates(n: int, *, discordant: float, minimum: float, sesoi: float, planning: float) -> PowerFn:
    """Paired binary outcomes (exact unconditional score tests), every ``(n10, n01)`` enumerated, in
    the claim's direction (``n10``: pairs with the outcome the claim expects more of); ``discordant``
    is the probability that a pair disagrees (at least the effect)."""

    @functools.lru_cache(maxsize=32)
    def fn(alpha: float, scale: float = 1.0) -> tuple[float, float]:
        m = _size(n, scale)
        if m > ENUMERATION_LIMIT:
            return math.nan, math.nan
        a, b = np.meshgrid(np.arange(m + 1), np.arange(m + 1), indexing="ij")
        ok = a + b <= m
        yes = (proportions.paired_table_p(m, minimum, "larger") < alpha)[ok]
        no = (proportions.paired_table_p(m, sesoi, "smaller") < alpha)[ok]
        a, b = a[ok], b[ok]

        def prob(effect: float, region: np.ndarray) -> float:
            d = max(discordant, abs(effect))
            p10, p01 = (d + effect) / 2, (d - effect) / 2
            pmf = sps.multinomial.pmf(np.stack([a, b, m - a - b], axis=1), m, [p10, p01, 1 - d])
            return float(np.nan_to_num(pmf)[region].sum())

        return prob(planning, yes), prob(0.0, no)

    return fn


def fisher_p(rho, n: int, value: float):
    """One-sided p that Spearman's rho exceeds ``value`` (H0: rho <= value): Fisher's z with Bonett
    and Wright's variance, (1 + rho^2 / 2) / (n - 3)."""
    rho = np.clip(np.asarray(rho, dtype=float), -1 + 1e-12, 1 - 1e-12)
    se = np.sqrt((1 + rho ** 2 / 2) / max(n - 3, 1))
    return sps.norm.sf((np.arctanh(rho) - np.arctanh(np.clip(value, -1 + 1e-12, 1 - 1e-12))) / se)


def spearman_p(rho, n: int, *, minimum: float, sesoi: float):
    """One-sided p-values of Spearman's rho (in the claim's direction) above ``minimum`` (scipy's t
    approximation where the minimum is zero, :func:`fisher_p` otherwise) and below ``sesoi``."""
    rho = np.clip(np.asarray(rho, dtype=float), -1 + 1e-12, 1 - 1e-12)
    if minimum == 0:
        p_for = sps.t.sf(rho * np.sqrt((n - 2) / (1 - rho ** 2)), n - 2)
    else:
        p_for = fisher_p(rho, n, minimum)
    return p_for, 1 - fisher_p(rho, n, sesoi)


def _spearman_draws(rho_s: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """``SIMS`` values of Spearman's rho of ``n`` bivariate normal pairs whose rank correlation is
    ``rho_s`` (Pearson's r = 2 sin(pi rho / 6))."""
    r = 2 * np.sin(np.pi * rho_s / 6)
    x = rng.standard_normal((SIMS, n))
    y = r * x + math.sqrt(max(1 - r * r, 0.0)) * rng.standard_normal((SIMS, n))
    rx, ry = sps.rankdata(x, axis=1), sps.rankdata(y, axis=1)
    rx, ry = rx - rx.mean(axis=1, keepdims=True), ry - ry.mean(axis=1, keepdims=True)
    return (rx * ry).sum(axis=1) / np.sqrt((rx ** 2).sum(axis=1) * (ry ** 2).sum(axis=1))


def spearman(n: int, *, planning: float, minimum: float, sesoi: float, null: float = 0.0, seed: int = 0) -> PowerFn:
    """Spearman's rho, simulated at the planning and at the null rank correlation."""

    @functools.lru_cache(maxsize=32)  # a table asks again at the same alpha; units_needed walks scales
    def fn(alpha: float, scale: float = 1.0) -> tuple[float, float]:
        m = _size(n, scale)
        if m < 4:
            return math.nan, math.nan
        rng = np.random.default_rng(seed)
        p_s, _ = spearman_p(_spearman_draws(planning, m, rng), m, minimum=minimum, sesoi=sesoi)
        _, p_n = spearman_p(_spearman_draws(null, m, rng), m, minimum=minimum, sesoi=sesoi)
        return float(np.mean(p_s < alpha)), float(np.mean(p_n < alpha))

    return fn


def spearman_equivalence(n: int, *, margin: float, harmful: float, seed: int = 0) -> PowerFn:
    """"No correlation" within ``+-margin``, simulated: P(shown inside) at rho 0, P(shown beyond) at
    the ``harmful`` rho."""

    @functools.lru_cache(maxsize=32)  # a table asks again at the same alpha; units_needed walks scales
    def fn(alpha: float, scale: float = 1.0) -> tuple[float, float]:
        m = _size(n, scale)
        if m < 4:
            return math.nan, math.nan
        rng = np.random.default_rng(seed)
        r0, r1 = _spearman_draws(0.0, m, rng), _spearman_draws(harmful, m, rng)
        inside = np.maximum(fisher_p(r0, m, -margin), 1 - fisher_p(r0, m, margin)) < alpha
        beyond = np.minimum(fisher_p(r1, m, margin), 1 - fisher_p(r1, m, -margin)) < alpha
        return float(np.mean(inside)), float(np.mean(beyond))

    return fn


def tost(n: int, sd: float, *, margin: float, harmful: float, n_other: int = 0, sd_other: float = 0.0,
         seed: int = 0) -> PowerFn:
    """Two one-sided tests, simulated from the normal model's exact sampling distribution of the
    mean and variance: P(equivalence shown) at no difference, P(a difference beyond the margin shown)
    at the ``harmful`` difference."""

    @functools.lru_cache(maxsize=32)  # a table asks again at the same alpha; units_needed walks scales
    def fn(alpha: float, scale: float = 1.0) -> tuple[float, float]:
        m = _size(n, scale)
        rng = np.random.default_rng(seed)
        if n_other:
            k = _size(n_other, scale)
            vx = sd ** 2 * rng.chisquare(max(m - 1, 1), SIMS) / max(m - 1, 1) / m
            vy = sd_other ** 2 * rng.chisquare(max(k - 1, 1), SIMS) / max(k - 1, 1) / k
            se_true = math.sqrt(sd ** 2 / m + sd_other ** 2 / k)
            se = np.sqrt(vx + vy)
            with np.errstate(divide="ignore", invalid="ignore"):
                df = (vx + vy) ** 2 / (vx ** 2 / max(m - 1, 1) + vy ** 2 / max(k - 1, 1))
        else:
            if m < 2:
                return math.nan, math.nan
            se_true = sd / math.sqrt(m)
            se = se_true * np.sqrt(rng.chisquare(m - 1, SIMS) / (m - 1))
            df = np.full(SIMS, m - 1.0)
        if se_true == 0:
            return 1.0, float(abs(harmful) > margin)
        tc = sps.t.ppf(1 - alpha, df)
        z = rng.standard_normal(SIMS) * se_true
        out = []
        for mean in (0.0, harmful):
            d = mean + z
            equivalent = (d - tc * se > -margin) & (d + tc * se < margin)
            beyond = (d - tc * se > margin) | (d + tc * se < -margin)
            out.append(equivalent if mean == 0.0 else beyond)
        return float(np.mean(out[0])), float(np.mean(out[1]))

    return fn


def bootstrap_normal(se: float, *, planning: float, minimum: float, sesoi: float, null: float) -> PowerFn:
    """A statistic judged by its bootstrap distribution, whose spread ``se`` shrinks as one over the
    square root of the units: the normal model of that distribution (the bootstrap rows' own
    approximation; say so beside them)."""

    @functools.lru_cache(maxsize=32)  # a table asks again at the same alpha; units_needed walks scales
    def fn(alpha: float, scale: float = 1.0) -> tuple[float, float]:
        s = se / math.sqrt(scale)
        if not np.isfinite(s):
            return math.nan, math.nan
        if s == 0:
            return float(planning > minimum), float(null < sesoi)
        z = sps.norm.ppf(1 - alpha)
        return float(sps.norm.sf(z - (planning - minimum) / s)), float(sps.norm.sf(z - (sesoi - null) / s))

    return fn


SCALES = (1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0)
"""The multiples of the design's units :func:`units_needed` tries."""


def units_needed(fn: PowerFn, n: int, alpha: float, target: float = TARGET) -> int | None:
    """About how many units the rule needs to decide either way with probability ``target`` (both
    powers at least that); None when 16 times the design's units do not reach it."""
    for s in (1.0, *SCALES):
        ps, pn = fn(alpha, s)
        if np.isfinite(ps) and np.isfinite(pn) and min(ps, pn) >= target:
            return _size(n, s)
    return None
