"""Notebook 01's power: of its rate comparisons, its rank test of critical doses and its sign test,
and the number of prefixes that gives it.

The independent unit of the RL comparison is the separately trained prefix (forks of one prefix
share its training, so they are not independent replicates). A claim such as "PPO collapses at
a dose where SAC and TD3 do not" is decided by one-sided Boschloo tests over prefixes (one
verdict per prefix per arm), and every such test must reject. :func:`boschloo_power` is the
probability of that, for planning rates, by simulation (``scipy.stats.boschloo_exact`` on each
simulated table) or exactly (every outcome enumerated, weighted by its binomial probability;
the number simulation converges to). :func:`prefixes_for_power` is the smallest number of
prefixes per arm that reaches a target power.

Claim (b), "PPO's critical dose is lower", is a rank test over prefixes of each prefix's critical
dose as the design measures it: the grid :data:`DOSE_GRID`, bisected at geometric midpoints
(:func:`stabstudy.analysis.studies.rl.design.geometric_points`, :func:`measured_critical_dose`);
:func:`critical_dose_power` simulates it (:func:`stabstudy.analysis.stats.smallest_p` says when no
outcome could decide). Claim (c) counts prefixes whose critical dose (or collapse) moved up or down
with the noise knob: :func:`sign_test_power`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Literal

import numpy as np
import pandas as pd
from scipy import stats as sps

from stabstudy.analysis.stats import smallest_p
from stabstudy.analysis.studies.rl.design import geometric_points

Method = Literal["exact", "simulation"]


@functools.lru_cache(maxsize=100_000)
def _p_greater(k1: int, n1: int, k0: int, n0: int) -> float:
    """One-sided Boschloo p-value for "rate 1 > rate 0" (cached: planning repeats tables)."""
    return float(sps.boschloo_exact(np.array([[k1, n1 - k1], [k0, n0 - k0]]), alternative="greater").pvalue)


def boschloo_power(p_treated: float, p_controls: float | Sequence[float], n_treated: int,
                   n_controls: int | Sequence[int] | None = None, *, alpha: float = 0.05,
                   method: Method = "exact", sims: int = 2000, seed: int = 0) -> float:
    """Probability that every one-sided Boschloo test "the treated arm's rate is greater than
    control ``j``'s" rejects at ``alpha`` (the treated arm shared by the tests).

    Args:
        p_treated: the treated arm's planning rate (e.g. PPO's collapse rate at the dose).
        p_controls: one planning rate per control arm (e.g. SAC's and TD3's).
        n_treated: independent units (prefixes) of the treated arm.
        n_controls: units per control arm (default ``n_treated`` each).
        alpha: level of each test (not adjusted: all must reject).
        method: ``"exact"`` (enumerate every outcome) or ``"simulation"`` (``sims`` draws,
            generator seeded with ``seed``; its Monte Carlo standard error is at most ``0.5 / sqrt(sims)``).
    """
    pcs = [float(p_controls)] if np.isscalar(p_controls) else [float(p) for p in p_controls]
    ncs = [int(n_treated)] * len(pcs) if n_controls is None else (
        [int(n_controls)] * len(pcs) if np.isscalar(n_controls) else [int(n) for n in n_controls])
    if len(ncs) != len(pcs):
        raise ValueError(f"n_controls has {len(ncs)} entries for {len(pcs)} control rates")
    for name, p in (("p_treated", p_treated), *((f"p_controls[{j}]", p) for j, p in enumerate(pcs))):
        if not 0.0 <= float(p) <= 1.0:
            raise ValueError(f"{name} must lie in [0, 1], got {p}")
    if n_treated < 1 or min(ncs) < 1:
        raise ValueError(f"every arm needs at least one unit; got n_treated={n_treated}, n_controls={ncs}")
    if method not in ("exact", "simulation"):
        raise ValueError(f"method must be one of exact, simulation; got {method!r}")
    n1 = int(n_treated)
    if method == "simulation":
        rng = np.random.default_rng(seed)
        k1 = rng.binomial(n1, p_treated, sims)
        k0 = [rng.binomial(n, p, sims) for n, p in zip(ncs, pcs, strict=True)]
        ok = np.ones(sims, bool)
        for j, n in enumerate(ncs):
            ok &= np.array([_p_greater(int(a), n1, int(b), n) < alpha for a, b in zip(k1, k0[j], strict=True)])
        return float(ok.mean())
    # exact: given the treated arm's count, the control arms are independent
    w1 = sps.binom.pmf(np.arange(n1 + 1), n1, p_treated)
    power = 0.0
    for k1 in range(n1 + 1):
        joint = 1.0
        for n, p in zip(ncs, pcs, strict=True):
            w0 = sps.binom.pmf(np.arange(n + 1), n, p)
            joint *= sum(w0[k0] for k0 in range(n + 1) if _p_greater(k1, n1, k0, n) < alpha)
        power += w1[k1] * joint
    return float(power)


def prefixes_for_power(p_treated: float, p_controls: float | Sequence[float], *, target: float = 0.8,
                       alpha: float = 0.05, n_max: int = 30, method: Method = "exact") -> tuple[int, float]:
    """The smallest number of prefixes per arm (equal arms) whose :func:`boschloo_power` reaches
    ``target``, and that power; ``(n_max + 1, power at n_max)`` when none up to ``n_max`` does."""
    if not 0.0 < target < 1.0:
        raise ValueError(f"target power must lie in (0, 1), got {target}")
    power = 0.0
    for n in range(1, int(n_max) + 1):
        power = boschloo_power(p_treated, p_controls, n, alpha=alpha, method=method)
        if power >= target:
            return n, power
    return int(n_max) + 1, power


def power_table(rates: Sequence[tuple[float, float]], ns: Sequence[int], n_controls: int = 2, *,
                alpha: float = 0.05):
    """Planning table (pandas DataFrame): exact power of the joint test with ``n_controls`` control
    arms at each planning ``(p_treated, p_control)`` of ``rates`` (one rate for every control arm)
    and each number of prefixes per arm of ``ns``."""
    rows = [{"p_treated": pt, "p_control": pc, "prefixes": n,
             "power": boschloo_power(pt, [pc] * n_controls, n, alpha=alpha)} for pt, pc in rates for n in ns]
    return pd.DataFrame(rows)


# -- claim (b): the critical dose of each prefix, bracketed by bisection ---------------------

#: The lr-spike factors every prefix is forked at before bisection (the control is factor 1).
DOSE_GRID = (3.0, 10.0, 30.0, 100.0)


def measured_critical_dose(true: Sequence[float], grid: Sequence[float] = DOSE_GRID, bisections: int = 2,
                           control_dose: float = 1.0) -> np.ndarray:
    """What the design measures for prefixes whose true critical doses are ``true`` (a prefix collapses
    at every dose at or above its own): the bracket of ``grid`` (the control at ``control_dose``
    never collapses against itself), narrowed by ``bisections`` sequential geometric midpoints
    (:func:`geometric_points`), reported as the bracket's geometric midpoint; ``inf`` above the grid."""
    g = np.sort(np.asarray(grid, dtype=float))
    out = np.empty(len(true))
    for i, x in enumerate(np.asarray(true, dtype=float)):
        if x > g[-1]:
            out[i] = np.inf
            continue
        below = g[g < x]
        lo, hi = (float(below[-1]) if below.size else float(control_dose)), float(g[g >= x][0])
        for _ in range(int(bisections)):
            mid = geometric_points(lo, hi)[0]
            if not lo < mid < hi:  # a bracket too narrow for 3 digits
                break
            lo, hi = (lo, mid) if mid >= x else (mid, hi)
        out[i] = np.sqrt(lo * hi)
    return out


def critical_dose_power(n_lower: int, n_higher: int, *, medians: tuple[float, float] = (5.0, 50.0),
                        sd: float = 0.4, grid: Sequence[float] = DOSE_GRID, bisections: int = 2,
                        alpha: float = 0.05, sims: int = 400, seed: int = 0) -> float:
    """Power of claim (b)'s one-sided Mann-Whitney test "the lower arm's critical doses are lower",
    by simulation: each prefix's true critical dose is log-normal (``medians`` of the two arms,
    ``sd`` in decades), measured as the design measures it (:func:`measured_critical_dose`: the grid,
    ``bisections`` midpoints, ``inf`` above the grid), then tested. Each simulated test uses the
    tie-corrected normal approximation (the claim itself uses the exact permutation test where it
    can, :func:`stabstudy.analysis.studies.rl.claims.critical_dose_claim`); the power is 0 when even
    complete separation cannot reach ``alpha`` (:func:`smallest_p`). Monte Carlo standard error at
    most ``0.5 / sqrt(sims)``."""
    if min(n_lower, n_higher) < 1:
        return 0.0
    if smallest_p(n_lower, n_higher) >= alpha:
        return 0.0
    rng = np.random.default_rng(seed)
    hits = 0
    for _ in range(int(sims)):
        a = measured_critical_dose(10 ** rng.normal(np.log10(medians[0]), sd, n_lower), grid, bisections)
        b = measured_critical_dose(10 ** rng.normal(np.log10(medians[1]), sd, n_higher), grid, bisections)
        if np.all(np.concatenate([a, b]) == a[0]):
            continue
        hits += sps.mannwhitneyu(a, b, alternative="less", method="asymptotic").pvalue < alpha
    return hits / int(sims)


def sign_test_power(n: int, p_up: float, alpha: float = 0.05) -> float:
    """Exact power of the one-sided sign test "more prefixes move up than down" (``binomtest``, p 0.5)
    over ``n`` prefixes whose change is resolved, each up with probability ``p_up``."""
    if n < 1:
        return 0.0
    if not 0.0 <= p_up <= 1.0:
        raise ValueError(f"p_up must lie in [0, 1], got {p_up}")
    ks = [k for k in range(n + 1) if sps.binomtest(k, n, 0.5, alternative="greater").pvalue < alpha]
    return float(sum(sps.binom.pmf(k, n, p_up) for k in ks))
