"""Claims that can fail: one verdict type, and the rules that produce verdicts.

Every row of a notebook's claims table is a :class:`Claim`. Its verdict is one of
:data:`VERDICTS` and comes from a rule below, never typed in. Each rule can fail:
it says ``supported`` only with evidence for the claim, ``not supported`` only with
evidence against it, ``inconclusive`` when the data cannot tell, and ``not tested``
when there are no data to test with. Too few data (fewer than the rule's ``min_n``)
give ``not tested`` (none) or ``inconclusive`` (some), never a verdict either way.

Tests:

* differences: paired t-test or Wilcoxon signed-rank when runs are paired (same
  seed), Welch's t-test otherwise, with a bootstrap interval (``scipy.stats.bootstrap``);
* equivalence: two one-sided tests (TOST) against a stated margin, never "the
  interval contains zero";
* proportions: Boschloo's exact test; rates with Clopper-Pearson intervals; paired binary
  outcomes (collapse with vs without a controller): the exact McNemar test;
* correlations: Spearman's rho with a bootstrap interval; "no correlation" is an
  equivalence claim (the interval inside +-margin);
* closed forms: measured values within a relative tolerance of their target.

:func:`table` adjusts the p-values of one notebook's table with Holm's method
(``statsmodels``): a verdict that rests on a p-value is ``inconclusive`` when its
adjusted p-value is not below ``alpha``.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import numpy as np
import pandas as pd
from scipy import stats as sps

VERDICTS = ("supported", "not supported", "inconclusive", "not tested")
SOURCES = ("source paper", "textbook", "our own")
NAN = float("nan")
Direction = Literal["greater", "less"]


@dataclass(frozen=True)
class Claim:
    """One row of a claims table.

    ``effect`` and ``ci`` are in the units the ``test`` names (e.g. a paired
    difference of final losses); ``n`` counts the runs, pairs or measurements used;
    ``p`` is the raw p-value the verdict rests on (NaN where the rule uses none): the
    test for the claim, or for "not supported" the test against it. ``p_decides``
    marks verdicts that rest on ``p < alpha``, which :func:`table` re-checks after Holm.
    """

    claim: str
    source: str
    verdict: str
    reason: str
    effect: float = NAN
    ci: tuple[float, float] = (NAN, NAN)
    n: int = 0
    test: str = ""
    p: float = NAN
    p_decides: bool = False

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"unknown verdict {self.verdict!r}; valid verdicts: {', '.join(VERDICTS)}")
        if not self.source.startswith(SOURCES):
            raise ValueError(f"source must start with one of {', '.join(SOURCES)}; got {self.source!r}")


def not_tested(claim: str, source: str, reason: str, n: int = 0) -> Claim:
    """A claim the data at hand cannot test (say why)."""
    return Claim(claim, source, "not tested", reason, n=n)


def all_of(claim: str, source: str, rows: Sequence[Claim], names: Sequence[str], *, n: int, test: str) -> Claim:
    """The claim that every one of ``rows`` holds (an intersection-union test; ``names`` label them in
    the reason): supported only if all are, with the largest of their p-values (so that Holm
    re-checks it); not supported if any is not, with that row's p; not tested if all are; else
    inconclusive."""
    verdicts = [r.verdict for r in rows]
    reason = "; ".join(f"{a}: {v}" for a, v in zip(names, verdicts, strict=True))
    if verdicts and all(v == "supported" for v in verdicts):
        p = max(r.p for r in rows)
        return Claim(claim, source, "supported", reason, n=n, test=test, p=p,
                     p_decides=all(r.p_decides for r in rows) and np.isfinite(p))
    against = [r for r in rows if r.verdict == "not supported"]
    if against:
        return Claim(claim, source, "not supported", reason, n=n, test=test, p=against[0].p,
                     p_decides=against[0].p_decides)
    joint = "not tested" if verdicts and all(v == "not tested" for v in verdicts) else "inconclusive"
    return Claim(claim, source, joint, reason or "no component claim", n=n, test=test)


def _too_few(claim: str, source: str, n: int, min_n: int, test: str) -> Claim | None:
    if n == 0:
        return Claim(claim, source, "not tested", "no data", n=0, test=test)
    if n < min_n:
        return Claim(claim, source, "inconclusive", f"{n} < {min_n} needed", n=n, test=test)
    return None


def _finite(x: Sequence[float]) -> np.ndarray:
    a = np.asarray(x, dtype=float).ravel()
    return a[np.isfinite(a)]


def _boot_ci(data: tuple[np.ndarray, ...], statistic, confidence: float, seed: int, paired: bool = False,
             vectorized: bool = False) -> tuple[float, float]:
    if any(len(d) < 2 for d in data) or all(np.ptp(d) == 0 for d in data):
        v = float(statistic(*data))
        return v, v  # a constant sample: the interval is the point
    with warnings.catch_warnings():
        # a resample can be constant where the sample is not (few, tied values): its statistic is
        # then undefined (NaN), and so is the interval; the verdicts treat a NaN interval as no
        # evidence, and the reason says so
        warnings.simplefilter("ignore", sps.ConstantInputWarning)
        warnings.simplefilter("ignore", sps.DegenerateDataWarning)
        res = sps.bootstrap(data, statistic, confidence_level=confidence, n_resamples=2000, paired=paired,
                            vectorized=vectorized, method="percentile", random_state=np.random.default_rng(seed))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def _directional(p_for: float, p_against: float, alpha: float) -> str:
    if p_for < alpha:
        return "supported"
    if p_against < alpha:
        return "not supported"
    return "inconclusive"


def _deciding_p(verdict: str, p_for: float, p_against: float) -> float:
    """The p-value a directional verdict rests on (the one :func:`table` re-checks after Holm):
    a "not supported" rests on the test in the opposite direction, as in :func:`equivalence`."""
    return p_against if verdict == "not supported" else p_for


def _against(verdict: str, p_against: float) -> str:
    return f", opposite direction p = {p_against:.3g}" if verdict == "not supported" else ""


def signed_rank_p(d: np.ndarray, alternative: Literal["greater", "less", "two-sided"]) -> float:
    """``scipy.stats.wilcoxon(d, alternative=alternative).pvalue`` (its defaults: zeros dropped,
    method ``auto``), with scipy's exact permutation branch vectorised.

    With ties or zeros and at most 13 pairs scipy enumerates the 2^n sign flips, computing the
    statistic flip by flip (about 0.2 s a test; notebook 04's verdict-stability resamples ask for
    hundreds). Flipping signs leaves ``|d|``, and so the ranks, unchanged: the signed-rank sum of
    every flip is one product with the ranks, and ``scipy.stats.permutation_test`` enumerates the same
    flips vectorised (tests/test_claims.py holds the two p-values equal)."""
    d = np.asarray(d, dtype=float)
    nonzero = d != 0
    ties = np.unique(np.abs(d[nonzero])).size < nonzero.sum()
    if d.size > 13 or nonzero.all() and not ties:  # scipy's exact or asymptotic branch: no enumeration
        return float(sps.wilcoxon(d, alternative=alternative).pvalue)
    ranks = np.zeros(d.size)
    ranks[nonzero] = sps.rankdata(np.abs(d[nonzero]))  # a zero adds nothing to either rank sum

    def r_plus(x: np.ndarray, axis: int = -1) -> np.ndarray:
        return np.sum((x > 0) * ranks, axis=axis)

    return float(sps.permutation_test((d,), r_plus, permutation_type="samples", vectorized=True, n_resamples=9999,
                                      alternative=alternative).pvalue)


def paired_difference(claim: str, source: str, treated: Sequence[float], control: Sequence[float], *,
                      direction: Direction, alpha: float = 0.05, min_n: int = 3,
                      test: Literal["ttest", "wilcoxon"] = "ttest", seed: int = 0) -> Claim:
    """Claim: ``treated - control`` is ``direction`` than 0, over pairs (same seed).

    Pairs with a non-finite member are dropped. ``wilcoxon`` cannot reach p < 0.05
    one-sided below 5 pairs; the t-test can, at the price of assuming normal
    differences: the test used is named in the row.
    """
    t, c = np.asarray(treated, dtype=float).ravel(), np.asarray(control, dtype=float).ravel()
    if t.shape != c.shape:
        raise ValueError(f"paired samples differ in length: {t.size} vs {c.size}")
    d = (t - c)[np.isfinite(t) & np.isfinite(c)]
    return _paired(claim, source, d.tobytes(), direction, alpha, min_n, test, seed)


@functools.lru_cache(maxsize=4096)
def _paired(claim: str, source: str, d_bytes: bytes, direction: Direction, alpha: float, min_n: int,
            test: str, seed: int) -> Claim:
    """:func:`paired_difference` of the differences ``d`` (as bytes: a pure function of them,
    cached, because a verdict-stability resample often asks again with the same numbers and a
    Wilcoxon test with ties is a permutation test)."""
    d = np.frombuffer(d_bytes, dtype=float)
    name = "paired t-test" if test == "ttest" else "Wilcoxon signed-rank"
    if (early := _too_few(claim, source, d.size, min_n, name)) is not None:
        return early
    other: Direction = "less" if direction == "greater" else "greater"
    if np.all(d == 0):
        p_for = p_against = 1.0
    elif test == "ttest":
        if np.ptp(d) == 0:  # constant non-zero difference: the t statistic is infinite
            p_for, p_against = (0.0, 1.0) if (d[0] > 0) == (direction == "greater") else (1.0, 0.0)
        else:
            p_for = float(sps.ttest_1samp(d, 0.0, alternative=direction).pvalue)
            p_against = float(sps.ttest_1samp(d, 0.0, alternative=other).pvalue)
    elif test == "wilcoxon":
        p_for, p_against = signed_rank_p(d, direction), signed_rank_p(d, other)
    else:
        raise ValueError(f"unknown test {test!r}; valid: ttest, wilcoxon")
    effect = float(np.mean(d) if test == "ttest" else np.median(d))
    # np.mean and np.median take an axis: scipy resamples alike either way, and one call replaces 2,000
    ci = _boot_ci((d,), np.mean if test == "ttest" else np.median, 1 - alpha, seed, vectorized=True)
    verdict = _directional(p_for, p_against, alpha)
    # an exact signed-rank test of n pairs cannot give p below 2**-n: say the design could not decide
    floor = f"; with {d.size} pairs the smallest attainable one-sided p is {0.5 ** d.size:.3g}, not below alpha " \
        f"{alpha:.3g}: this design cannot decide" if test == "wilcoxon" and 0.5 ** d.size >= alpha else ""
    return Claim(claim, source, verdict, f"{'mean' if test == 'ttest' else 'median'} paired difference "
                 f"{effect:.3g}, one-sided p = {p_for:.3g}{_against(verdict, p_against)}{floor}", effect, ci, int(d.size),
                 name, _deciding_p(verdict, p_for, p_against), p_decides=verdict != "inconclusive")


def difference(claim: str, source: str, a: Sequence[float], b: Sequence[float], *, direction: Direction,
               alpha: float = 0.05, min_n: int = 3, seed: int = 0) -> Claim:
    """Claim: mean(a) - mean(b) is ``direction`` than 0, for unpaired samples (Welch's t-test)."""
    x, y = _finite(a), _finite(b)
    n = min(x.size, y.size)
    if (early := _too_few(claim, source, n, min_n, "Welch t-test")) is not None:
        return replace(early, n=x.size + y.size)
    other: Direction = "less" if direction == "greater" else "greater"
    if np.ptp(x) == 0 and np.ptp(y) == 0:
        diff = float(x[0] - y[0])
        p_for, p_against = (1.0, 1.0) if diff == 0 else (
            (0.0, 1.0) if (diff > 0) == (direction == "greater") else (1.0, 0.0))
    else:
        p_for = float(sps.ttest_ind(x, y, equal_var=False, alternative=direction).pvalue)
        p_against = float(sps.ttest_ind(x, y, equal_var=False, alternative=other).pvalue)
    effect = float(x.mean() - y.mean())
    ci = _boot_ci((x, y), lambda u, v: np.mean(u) - np.mean(v), 1 - alpha, seed)
    verdict = _directional(p_for, p_against, alpha)
    return Claim(claim, source, verdict, f"difference of means {effect:.3g}, one-sided p = {p_for:.3g}"
                 f"{_against(verdict, p_against)}", effect, ci, int(x.size + y.size), "Welch t-test",
                 _deciding_p(verdict, p_for, p_against), p_decides=verdict != "inconclusive")


def equivalence(claim: str, source: str, a: Sequence[float], b: Sequence[float], *, margin: float,
                relative: bool = True, paired: bool = True, alpha: float = 0.05, min_n: int = 3) -> Claim:
    """Claim: ``a`` and ``b`` are equivalent within ``margin`` (TOST).

    ``margin`` is relative to ``|mean(b)|`` when ``relative`` (e.g. 0.02 = within 2%),
    absolute otherwise. Supported when both one-sided tests reject (the 1 - 2 alpha
    interval lies inside the margin); not supported when the difference is
    significantly beyond the margin on one side; inconclusive otherwise.
    """
    if paired:
        x, y = np.asarray(a, dtype=float).ravel(), np.asarray(b, dtype=float).ravel()
        if x.shape != y.shape:
            raise ValueError(f"paired samples differ in length: {x.size} vs {y.size}")
        keep = np.isfinite(x) & np.isfinite(y)
        x, y = x[keep], y[keep]
    else:
        x, y = _finite(a), _finite(b)
    test = f"TOST ({'paired' if paired else 'Welch'}), margin {margin:g}{' relative' if relative else ''}"
    n = min(x.size, y.size)
    if (early := _too_few(claim, source, n, min_n, test)) is not None:
        return early
    delta = margin * abs(float(y.mean())) if relative else margin
    if paired:
        d = x - y
        diff, se, df = float(d.mean()), float(d.std(ddof=1) / math.sqrt(d.size)), d.size - 1
    else:
        vx, vy = x.var(ddof=1) / x.size, y.var(ddof=1) / y.size
        diff, se = float(x.mean() - y.mean()), float(math.sqrt(vx + vy))
        df = (vx + vy) ** 2 / (vx ** 2 / (x.size - 1) + vy ** 2 / (y.size - 1)) if vx + vy > 0 else x.size + y.size - 2
    if se == 0:
        inside = abs(diff) < delta
        p_lower = p_upper = 0.0 if inside else 1.0
        beyond = 0.0 if not inside else 1.0
    else:
        p_lower = float(sps.t.sf((diff + delta) / se, df))   # H0: diff <= -delta
        p_upper = float(sps.t.cdf((diff - delta) / se, df))  # H0: diff >= +delta
        beyond = float(min(sps.t.sf((diff - delta) / se, df), sps.t.cdf((diff + delta) / se, df)))
    p_tost = max(p_lower, p_upper)
    half = float(sps.t.ppf(1 - alpha, df)) * se if se > 0 else 0.0
    ci = (diff - half, diff + half)
    if p_tost < alpha:
        verdict = "supported"
    elif beyond < alpha:
        verdict = "not supported"
    else:
        verdict = "inconclusive"
    return Claim(claim, source, verdict, f"difference {diff:.3g}, margin +-{delta:.3g}, "
                 f"{100 * (1 - 2 * alpha):.0f}% CI [{ci[0]:.3g}, {ci[1]:.3g}]", diff, ci, int(n), test,
                 p_tost if verdict != "not supported" else beyond, p_decides=verdict != "inconclusive")


def rate_ci(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Clopper-Pearson (exact binomial) interval of the rate ``k / n``; (nan, nan) when ``n == 0``."""
    if n == 0:
        return NAN, NAN
    ci = sps.binomtest(int(k), int(n)).proportion_ci(confidence_level=confidence, method="exact")
    return float(ci.low), float(ci.high)


def rate_below(claim: str, source: str, k: int, n: int, target: float, *, alpha: float = 0.05, min_n: int = 3,
               scale: float = 1.0, unit: str = "") -> Claim:
    """Claim: the rate ``k / n`` is at most ``target`` (e.g. false interventions per step under a
    budget): the exact binomial test, one-sided. Supported when ``k`` is significantly below
    ``target * n``, not supported when significantly above; ``effect`` and the Clopper-Pearson
    interval are in ``scale`` units (1000: per 1,000)."""
    test = f"exact binomial vs {target * scale:g}{' ' + unit if unit else ''}"
    if (early := _too_few(claim, source, int(n), min_n, test)) is not None:
        return early
    p_for = float(sps.binomtest(int(k), int(n), target, alternative="less").pvalue)
    p_against = float(sps.binomtest(int(k), int(n), target, alternative="greater").pvalue)
    lo, hi = rate_ci(k, n, 1 - 2 * alpha)
    verdict = _directional(p_for, p_against, alpha)
    reason = (f"{k}/{n} = {scale * k / n:.3g}{' ' + unit if unit else ''}, {100 * (1 - 2 * alpha):.0f}% CI "
              f"[{scale * lo:.3g}, {scale * hi:.3g}] (Clopper-Pearson) vs {target * scale:g}, one-sided p = "
              f"{p_for:.3g}{_against(verdict, p_against)}")
    return Claim(claim, source, verdict, reason, scale * k / n, (scale * lo, scale * hi), int(n), test,
                 _deciding_p(verdict, p_for, p_against), p_decides=verdict != "inconclusive")


def rate_comparison(claim: str, source: str, k_treated: int, n_treated: int, k_control: int, n_control: int,
                    *, direction: Direction = "greater", alpha: float = 0.05, min_n: int = 3) -> Claim:
    """Claim: the rate ``k_treated / n_treated`` is ``direction`` than ``k_control / n_control`` (Boschloo)."""
    test = "Boschloo exact"
    n = min(n_treated, n_control)
    if (early := _too_few(claim, source, n, min_n, test)) is not None:
        return replace(early, n=n_treated + n_control)
    table_ = np.array([[k_treated, n_treated - k_treated], [k_control, n_control - k_control]])
    other: Direction = "less" if direction == "greater" else "greater"
    p_for = float(sps.boschloo_exact(table_, alternative=direction).pvalue)
    p_against = float(sps.boschloo_exact(table_, alternative=other).pvalue)
    r1, r0 = k_treated / n_treated, k_control / n_control
    c1, c0 = rate_ci(k_treated, n_treated, 1 - alpha), rate_ci(k_control, n_control, 1 - alpha)
    verdict = _directional(p_for, p_against, alpha)
    reason = (f"{k_treated}/{n_treated} [{c1[0]:.2f}, {c1[1]:.2f}] vs {k_control}/{n_control} "
              f"[{c0[0]:.2f}, {c0[1]:.2f}] (Clopper-Pearson), one-sided p = {p_for:.3g}"
              f"{_against(verdict, p_against)}")
    return Claim(claim, source, verdict, reason, r1 - r0, (NAN, NAN), int(n_treated + n_control), test,
                 _deciding_p(verdict, p_for, p_against), p_decides=verdict != "inconclusive")


def paired_outcomes(claim: str, source: str, treated: Sequence[float], control: Sequence[float], *,
                    direction: Direction = "less", alpha: float = 0.05, min_n: int = 3) -> Claim:
    """Claim: a binary outcome (1 = e.g. collapse) is ``direction`` frequent with treatment than
    without, over pairs (same seed, same data order): the exact McNemar test, one-sided.

    Only discordant pairs inform it: ``b`` pairs with the outcome under control only, ``c`` under
    treatment only; one-sided p = P(Binomial(b + c, 1/2) >= b) for ``less`` (the two-sided p is
    ``statsmodels``' exact McNemar). Pairs with a missing (NaN) member are dropped; no discordant
    pair gives p = 1 (inconclusive). ``effect`` is the paired difference of rates, treated minus control.
    """
    t, c = np.asarray(treated, dtype=float).ravel(), np.asarray(control, dtype=float).ravel()
    if t.shape != c.shape:
        raise ValueError(f"paired samples differ in length: {t.size} vs {c.size}")
    keep = np.isfinite(t) & np.isfinite(c)
    t, c = t[keep] > 0.5, c[keep] > 0.5
    test = "exact McNemar (one-sided)"
    if (early := _too_few(claim, source, int(t.size), min_n, test)) is not None:
        return early
    b, cc = int(np.sum(c & ~t)), int(np.sum(t & ~c))  # outcome under control only / under treatment only
    fewer, more = (b, cc) if direction == "less" else (cc, b)
    if fewer + more == 0:
        p_for = p_against = 1.0
    else:
        p_for = float(sps.binomtest(fewer, fewer + more, 0.5, alternative="greater").pvalue)
        p_against = float(sps.binomtest(more, fewer + more, 0.5, alternative="greater").pvalue)
    verdict = _directional(p_for, p_against, alpha)
    n = int(t.size)
    reason = (f"{int(c.sum())}/{n} without vs {int(t.sum())}/{n} with; discordant pairs: {b} only without, "
              f"{cc} only with; one-sided p = {p_for:.3g}{_against(verdict, p_against)}")
    return Claim(claim, source, verdict, reason, float(t.mean() - c.mean()), (NAN, NAN), n, test,
                 _deciding_p(verdict, p_for, p_against), p_decides=verdict != "inconclusive")


def correlation(claim: str, source: str, x: Sequence[float], y: Sequence[float], *,
                expect: Literal["positive", "negative", "none"], margin: float = 0.3, alpha: float = 0.05,
                min_n: int = 5, seed: int = 0) -> Claim:
    """Claim about Spearman's rho of paired observations ``(x, y)``.

    ``positive`` / ``negative``: a one-sided test. ``none``: an equivalence claim,
    supported only when the 1 - 2 alpha bootstrap interval of rho lies inside
    ``+-margin`` (a non-significant rho is absence of evidence, not evidence of
    absence); not supported when the interval lies entirely beyond the margin.
    """
    a, b = np.asarray(x, dtype=float).ravel(), np.asarray(y, dtype=float).ravel()
    keep = np.isfinite(a) & np.isfinite(b)
    a, b = a[keep], b[keep]
    test = "Spearman rho" + (f", equivalence margin +-{margin:g}" if expect == "none" else "")
    if (early := _too_few(claim, source, a.size, min_n, test)) is not None:
        return early
    if np.ptp(a) == 0 or np.ptp(b) == 0:
        return Claim(claim, source, "inconclusive", "a constant variable has no rank correlation", n=int(a.size),
                     test=test)

    def rho(u, v):
        return sps.spearmanr(u, v).statistic

    r = float(rho(a, b))
    if expect == "none":
        ci = _boot_ci((a, b), rho, 1 - 2 * alpha, seed, paired=True)
        if -margin < ci[0] and ci[1] < margin:
            verdict = "supported"
        elif ci[0] >= margin or ci[1] <= -margin:
            verdict = "not supported"
        else:
            verdict = "inconclusive"
        undefined = "" if np.isfinite(ci).all() else " (undefined: resamples with a constant variable)"
        return Claim(claim, source, verdict, f"rho = {r:.2f}, {100 * (1 - 2 * alpha):.0f}% CI "
                     f"[{ci[0]:.2f}, {ci[1]:.2f}]{undefined} vs +-{margin:g}", r, ci, int(a.size), test)
    if expect not in ("positive", "negative"):
        raise ValueError(f"unknown expectation {expect!r}; valid: positive, negative, none")
    direction: Direction = "greater" if expect == "positive" else "less"
    other: Direction = "less" if direction == "greater" else "greater"
    p_for = float(sps.spearmanr(a, b, alternative=direction).pvalue)
    p_against = float(sps.spearmanr(a, b, alternative=other).pvalue)
    ci = _boot_ci((a, b), rho, 1 - alpha, seed, paired=True)
    verdict = _directional(p_for, p_against, alpha)
    return Claim(claim, source, verdict, f"rho = {r:.2f}, one-sided p = {p_for:.3g}{_against(verdict, p_against)}",
                 r, ci, int(a.size), test, _deciding_p(verdict, p_for, p_against),
                 p_decides=verdict != "inconclusive")


def within_tolerance(claim: str, source: str, measured: Sequence[float], target: Sequence[float] | float, *,
                     rel_tol: float, min_n: int = 1) -> Claim:
    """Claim: each measurement lies within ``rel_tol`` of its (closed-form) target.

    Supported when every relative error is within the tolerance, not supported
    when none is, inconclusive when some are (the interval reported is the range
    of relative errors).
    """
    m = np.asarray(measured, dtype=float).ravel()
    t = np.broadcast_to(np.asarray(target, dtype=float), m.shape)
    keep = np.isfinite(m) & np.isfinite(t) & (t != 0)
    err = (m[keep] - t[keep]) / np.abs(t[keep])
    test = f"relative error within {rel_tol:g}"
    if (early := _too_few(claim, source, err.size, min_n, test)) is not None:
        return early
    ok = np.abs(err) <= rel_tol
    verdict = "supported" if ok.all() else "not supported" if not ok.any() else "inconclusive"
    return Claim(claim, source, verdict, f"{int(ok.sum())}/{err.size} within {rel_tol:.0%}; relative error "
                 f"{float(np.median(err)):+.3g} (median)", float(np.median(err)),
                 (float(err.min()), float(err.max())), int(err.size), test)


def interval_above(claim: str, source: str, effect: float, ci: tuple[float, float], n: int, *, above: float,
                   test: str, min_n: int = 3) -> Claim:
    """Claim: a statistic lies above ``above``, judged by an interval that resamples the ``n``
    independent units (e.g. a seed bootstrap of an ROC-AUC). Supported when the whole interval is
    above, not supported when the whole interval is at or below, inconclusive when it straddles
    ``above`` or is undefined; "not tested" without data."""
    if (early := _too_few(claim, source, int(n), min_n, test)) is not None:
        return replace(early, effect=float(effect))
    lo, hi = (float(c) for c in ci)
    if not (np.isfinite(lo) and np.isfinite(hi) and np.isfinite(effect)):
        return Claim(claim, source, "inconclusive", f"{effect:.3g}: the interval is undefined (a resample lacked "
                     "one of the classes)", float(effect), (lo, hi), int(n), test)
    verdict = "supported" if lo > above else "not supported" if hi <= above else "inconclusive"
    return Claim(claim, source, verdict, f"{effect:.3g} [{lo:.3g}, {hi:.3g}] vs {above:g} over {n} units",
                 float(effect), (lo, hi), int(n), test)


def from_p(claim: str, source: str, effect: float, ci: tuple[float, float], n: int, *, p_for: float,
           p_against: float, test: str, alpha: float = 0.05, min_n: int = 3) -> Claim:
    """Claim decided by one-sided p-values computed elsewhere (e.g. an exact permutation null):
    supported when ``p_for < alpha``, not supported when ``p_against < alpha``, inconclusive
    otherwise (NaN p-values included); "not tested" without data."""
    if (early := _too_few(claim, source, int(n), min_n, test)) is not None:
        return replace(early, effect=float(effect))
    verdict = _directional(p_for, p_against, alpha) if np.isfinite(p_for) and np.isfinite(p_against) else "inconclusive"
    reason = (f"{effect:.3g} [{ci[0]:.3g}, {ci[1]:.3g}] over {n} units, one-sided p = {p_for:.3g}"
              f"{_against(verdict, p_against)}")
    return Claim(claim, source, verdict, reason, float(effect), (float(ci[0]), float(ci[1])), int(n), test,
                 _deciding_p(verdict, p_for, p_against), p_decides=verdict != "inconclusive")


def holm(p: Sequence[float]) -> np.ndarray:
    """Holm-adjusted p-values (step-down, monotone, capped at 1), in the order given.

    The same numbers as ``statsmodels.stats.multitest.multipletests(p, method="holm")[1]`` (a test
    holds them equal), without its ``gc.collect()`` on every call: half a second in a notebook's
    heap, paid once per resample where a verdict's stability is measured."""
    p = np.asarray(p, dtype=float)
    order = np.argsort(p, kind="stable")
    steps = p[order] * np.arange(p.size, 0, -1)
    out = np.empty_like(p)
    out[order] = np.minimum(np.maximum.accumulate(steps), 1.0)
    return out


def table(claims: Sequence[Claim], alpha: float = 0.05) -> pd.DataFrame:
    """The claims of one notebook as a DataFrame, p-values Holm-adjusted within it.

    A verdict that rests on ``p < alpha`` whose adjusted p-value is not below
    ``alpha`` becomes ``inconclusive``.
    """
    claims = list(claims)
    p = np.array([c.p for c in claims], dtype=float)
    adj = np.full(p.shape, np.nan)
    finite = np.isfinite(p)
    if finite.any():
        adj[finite] = holm(p[finite])
    rows = []
    for c, pa in zip(claims, adj, strict=True):
        verdict, reason = c.verdict, c.reason
        if c.p_decides and np.isfinite(pa) and pa >= alpha:
            verdict, reason = "inconclusive", f"{reason}; Holm-adjusted p = {pa:.3g} >= {alpha:g}"
        rows.append({"claim": c.claim, "source": c.source, "effect": c.effect, "ci_low": c.ci[0],
                     "ci_high": c.ci[1], "n": c.n, "test": c.test, "p": c.p, "p_holm": pa,
                     "verdict": verdict, "reason": reason})
    return pd.DataFrame(rows, columns=["claim", "source", "effect", "ci_low", "ci_high", "n", "test", "p",
                                       "p_holm", "verdict", "reason"])


def save(df: pd.DataFrame, notebook: str, profile: str) -> Path:
    """Write a notebook's claims table where ``stabstudy report`` collects it (build/<profile>/claims/)."""
    from stabstudy import paths

    out = paths.claims_dir(profile) / f"{notebook}.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".csv.tmp")
    df.to_csv(tmp, index=False, float_format="%.6g")
    tmp.replace(out)
    return out


def _fmt(v: float) -> str:
    return "" if not np.isfinite(v) else f"{v:.3g}"


def to_markdown(df: pd.DataFrame) -> str:
    """A claims table as a Markdown table (no tabulate dependency; numbers to 3 significant digits)."""
    head = "| claim | source | effect [CI] | n | test | p (Holm) | verdict | reason |"
    lines = [head, "|" + "---|" * 8]
    for r in df.itertuples(index=False):
        ci = f" [{_fmt(r.ci_low)}, {_fmt(r.ci_high)}]" if np.isfinite(r.ci_low) else ""
        p = f"{_fmt(r.p)} ({_fmt(r.p_holm)})" if np.isfinite(r.p) else ""
        cells = [r.claim, r.source, f"{_fmt(r.effect)}{ci}", str(r.n), r.test, p, f"**{r.verdict}**", r.reason]
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"
