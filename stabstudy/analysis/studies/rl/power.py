"""Notebook 01's power: what its design can decide, and with how many prefixes.

The independent unit of the RL comparison is the separately trained prefix (forks of one prefix
share its training, so they are not independent replicates). Claim (a), "PPO collapses at a dose
where SAC and TD3 do not", is decided by one-sided Boschloo tests over prefixes (one verdict per
prefix per arm), every one of which must reject for "supported": :func:`boschloo_power` is the
probability of that at planning rates, exactly (every outcome enumerated, weighted by its binomial
probability) or by simulation; :func:`prefixes_for_power` the smallest number of prefixes per arm that
reaches a target power. The power of the rule as the claims table applies it (both verdicts, at the
family's level) is :func:`stabstudy.analysis.power.rates`.

Claim (b), "PPO's critical dose is lower", compares each prefix's critical dose as the design measures
it (:func:`measured_bracket`: the claim's dose, then steps of half a decade and a quarter, down after
a collapse and up after none); :func:`critical_dose_power` simulates both verdicts of its rule
(:func:`.rules.dose_verdict`). Claim (c) counts prefixes whose collapse changed with the noise knob:
:func:`sign_test_power`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Literal

import numpy as np
import pandas as pd
from scipy import stats as sps

from stabstudy.analysis.stats import smallest_p
from stabstudy.analysis.studies.rl.rules import dose_verdict

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


# -- claim (b): each prefix's critical dose, bracketed by its sequence of doses ---------------


def measured_bracket(true: Sequence[float], start: float = 10.0, steps: Sequence[float] = (0.5, 0.25),
                     control_dose: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """What the design measures for prefixes whose true critical doses are ``true`` (a prefix collapses
    at every dose at or above its own): forked at ``start``, then ``steps`` decades down after a
    collapse and up after none, each from the last dose (3 significant digits); the bracket
    ``(low, high]``: the largest dose it survived (``control_dose`` when none: the control never
    collapses against itself) and the smallest it collapsed at (``inf`` when none)."""
    low, high = np.full(len(true), float(control_dose)), np.full(len(true), np.inf)
    for i, x in enumerate(np.asarray(true, dtype=float)):
        d = float(start)
        for k in range(len(steps) + 1):
            if d >= x:
                high[i] = min(high[i], d)
            else:
                low[i] = max(low[i], d)
            if k < len(steps):
                d = float(f"{d * 10 ** (-steps[k] if d >= x else steps[k]):.3g}")
    return low, high


def critical_dose_power(n_lower: int, n_higher: int, *, medians: tuple[float, float] = (5.0, 50.0), sd: float = 0.4,
                        start: float = 10.0, steps: Sequence[float] = (0.5, 0.25), sesoi: float = 2.0,
                        alpha: float = 0.05, sims: int = 400, seed: int = 0) -> dict[str, float]:
    """The probabilities of claim (b)'s verdicts (:func:`stabstudy.analysis.studies.rl.claims.critical_dose_claim`)
    by simulation: each prefix's true critical dose is log-normal (``medians`` of the two arms, ``sd`` in
    decades), measured as the design measures it (:func:`measured_bracket`), then decided: ``supported``
    when the rank test at the bracket ends least favourable to it (the lower arm's upper ends against
    the other's lower ends) says "lower" at ``alpha``; ``not supported`` when the test at the ends least
    favourable to that says the other arm's doses are less than ``sesoi`` times the lower arm's. Each
    simulated test uses the tie-corrected normal approximation (the claim uses the exact permutation
    test). Monte Carlo standard error at most ``0.5 / sqrt(sims)``; 0 where no outcome could decide
    (:func:`stabstudy.analysis.stats.smallest_p`)."""
    if min(n_lower, n_higher) < 1 or smallest_p(n_lower, n_higher) >= alpha:
        return {"supported": 0.0, "not supported": 0.0}
    rng = np.random.default_rng(seed)
    hits = {"supported": 0, "not supported": 0}
    for _ in range(int(sims)):
        lo_a, hi_a = measured_bracket(10 ** rng.normal(np.log10(medians[0]), sd, n_lower), start, steps)
        lo_b, hi_b = measured_bracket(10 ** rng.normal(np.log10(medians[1]), sd, n_higher), start, steps)
        verdict = dose_verdict(lo_a, hi_a, lo_b, hi_b, sesoi=sesoi, alpha=alpha, exact=False)[0]
        if verdict in hits:
            hits[verdict] += 1
    return {k: v / int(sims) for k, v in hits.items()}


def sign_test_power(n: int, p_up: float, alpha: float = 0.05) -> float:
    """Exact power of the one-sided sign test "more prefixes move up than down" (``binomtest``, p 0.5)
    over ``n`` prefixes whose change is resolved, each up with probability ``p_up``."""
    if n < 1:
        return 0.0
    if not 0.0 <= p_up <= 1.0:
        raise ValueError(f"p_up must lie in [0, 1], got {p_up}")
    ks = [k for k in range(n + 1) if sps.binomtest(k, n, 0.5, alternative="greater").pvalue < alpha]
    return float(sum(sps.binom.pmf(k, n, p_up) for k in ks))
