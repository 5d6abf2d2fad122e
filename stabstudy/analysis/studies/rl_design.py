"""Notebook 01's design: the power of its rate comparisons, and the number of prefixes that gives it.

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
(:func:`geometric_points`, :func:`measured_critical_dose`); :func:`critical_dose_power` simulates it,
:func:`smallest_p` says when no outcome could decide. Claim (c) counts prefixes whose critical dose (or
collapse) moved up or down with the noise knob: :func:`sign_test_power`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Literal

import numpy as np
from scipy import stats as sps

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
    import pandas as pd

    rows = [{"p_treated": pt, "p_control": pc, "prefixes": n,
             "power": boschloo_power(pt, [pc] * n_controls, n, alpha=alpha)} for pt, pc in rates for n in ns]
    return pd.DataFrame(rows)


# -- claim (b): the critical dose of each prefix, bracketed by bisection ---------------------

#: The lr-spike factors every prefix is forked at before bisection (the control is factor 1).
DOSE_GRID = (3.0, 10.0, 30.0, 100.0)


def geometric_points(low: float, high: float, points: int = 1) -> list[float]:
    """The ``points`` doses that split ``[low, high]`` into ``points + 1`` equal steps of log dose,
    rounded to 3 significant digits (so a dose reads as it is stored, and the same bracket always gives
    the same dose): ``points=1`` is the geometric midpoint ``sqrt(low * high)``."""
    if not (0 < low < high < np.inf):
        raise ValueError(f"a bracket needs 0 < low < high < inf, got [{low}, {high}]")
    if points < 1:
        raise ValueError(f"points must be at least 1, got {points}")
    return [float(f"{low * (high / low) ** (i / (points + 1)):.3g}") for i in range(1, int(points) + 1)]


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


def smallest_p(n1: int, n2: int) -> float:
    """The smallest one-sided p-value a rank test of ``n1`` against ``n2`` values can give (the two
    samples completely separated, no ties): ``1 / C(n1 + n2, n1)``."""
    from math import comb

    return 1.0 / comb(int(n1) + int(n2), int(n1)) if n1 and n2 else 1.0


def critical_dose_power(n_lower: int, n_higher: int, *, medians: tuple[float, float] = (5.0, 50.0),
                        sd: float = 0.4, grid: Sequence[float] = DOSE_GRID, bisections: int = 2,
                        alpha: float = 0.05, sims: int = 400, seed: int = 0) -> float:
    """Power of claim (b)'s one-sided Mann-Whitney test "the lower arm's critical doses are lower",
    by simulation: each prefix's true critical dose is log-normal (``medians`` of the two arms,
    ``sd`` in decades), measured as the design measures it (:func:`measured_critical_dose`: the grid,
    ``bisections`` midpoints, ``inf`` above the grid), then tested. Each simulated test uses the
    tie-corrected normal approximation (the claim itself uses the exact permutation test where it
    can, :func:`stabstudy.analysis.studies.rl_outcomes.critical_dose_claim`); the power is 0 when even
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


# -- the cost of a design ---------------------------------------------------------------------

#: Training env steps per second of one worker (``OMP_NUM_THREADS=1``) on HalfCheetah-v5 with the
#: study's callbacks (Monitor every update), evaluations left out: the ``callback`` row of
#: ``benchmarks/rl_overhead.py --algo A --repeats 1 --checkpoint-buffer 0`` on the idle 2-core
#: development machine, 2026-12-04 20:29 UTC (load 0.7): PPO 1132, SAC 187, TD3 356. Under a load of
#: 5-8 (03:00 UTC that day) the same command gave SAC 60 and TD3 70: the rates fall with the
#: load, so :func:`calibration` rescales them from the wall times of stored prefixes where there are some.
TRAIN_RATES = {"ppo": 1100.0, "a2c": 1100.0, "sac": 185.0, "td3": 350.0, "ddpg": 350.0}
#: Env steps per second of a deterministic evaluation (five episodes side by side, one batched forward
#: pass per step, MuJoCo steps) of an untrained 64-unit policy on HalfCheetah-v5, one thread, on the
#: idle development machine, 2026-12-04 20:35 UTC: PPO 9978, SAC 8989, TD3 10182 (one episode at a
#: time: 3888, 3306, 4327).
EVAL_RATES = {"ppo": 9500.0, "a2c": 9500.0, "sac": 8500.0, "td3": 9500.0, "ddpg": 9500.0}


def run_cost(spec, episode_steps: int = 1000) -> dict[str, float]:
    """What one RL run computes: ``train_steps`` (env steps it trains: a fork only its continuation)
    and ``eval_steps`` (env steps of its evaluation episodes: one evaluation at the start, every
    ``eval_every`` env steps, at the end; ``eval_max_steps`` or ``episode_steps`` per episode)."""
    hp = spec.hp
    prefix = int(hp.get("prefix_steps", 0))
    span = spec.steps - (prefix if 0 < prefix < spec.steps else 0)
    every = spec.eval_every or max(1, span // 20)
    episodes = int(hp.get("eval_episodes", 2))
    length = int(hp.get("eval_max_steps", 0)) or int(episode_steps)
    return {"train_steps": float(span), "eval_steps": float((span // every + 2) * episodes * length)}


def calibration(specs, wall_s, rates: dict[str, float] | None = None, eval_rates: dict[str, float] | None = None,
                episode_steps: int = 1000) -> dict[str, float]:
    """Per learner, measured over predicted wall time of stored runs (``specs`` with their
    ``wall_s``, e.g. the prefixes): the factor :func:`worker_seconds` multiplies its estimate by
    (1 where none is stored). It carries what the constants do not: this machine's load, the
    Monitor's cadence, the prefixes' own hyperparameters."""
    pred: dict[str, float] = {}
    meas: dict[str, float] = {}
    for s, w in zip(specs, wall_s, strict=True):
        if w is None or not np.isfinite(w):
            continue
        c = run_cost(s, episode_steps)
        pred[s.learner] = pred.get(s.learner, 0.0) + c["train_steps"] / (rates or TRAIN_RATES)[s.learner] + \
            c["eval_steps"] / (eval_rates or EVAL_RATES)[s.learner]
        meas[s.learner] = meas.get(s.learner, 0.0) + float(w)
    return {a: meas[a] / pred[a] for a in pred if pred[a] > 0}


def worker_seconds(grids, *, rates: dict[str, float] | None = None, eval_rates: dict[str, float] | None = None,
                   factor: dict[str, float] | None = None, episode_steps: int = 1000):
    """Estimated worker-seconds of ``grids`` (``{name: specs}``; a spec in several grids counts
    once, in the first): per grid and learner, ``runs``, ``train_steps``, ``eval_steps`` and
    ``worker_s`` = train steps / :data:`TRAIN_RATES` + eval steps / :data:`EVAL_RATES`, times the
    learner's ``factor`` (:func:`calibration`; default 1). A pandas DataFrame."""
    import pandas as pd

    rates, eval_rates, seen, rows = rates or TRAIN_RATES, eval_rates or EVAL_RATES, set(), []
    for name, specs in grids.items():
        for s in specs:
            if s.spec_hash in seen:
                continue
            seen.add(s.spec_hash)
            if s.learner not in rates:
                raise ValueError(f"no training rate for {s.learner!r}; known: {', '.join(rates)}")
            c = run_cost(s, episode_steps)
            sec = (c["train_steps"] / rates[s.learner] + c["eval_steps"] / eval_rates[s.learner]) * \
                (factor or {}).get(s.learner, 1.0)
            rows.append({"grid": name, "learner": s.learner, "runs": 1, **c, "worker_s": sec})
    cols = ["grid", "learner", "runs", "train_steps", "eval_steps", "worker_s"]
    out = pd.DataFrame(rows, columns=cols)
    return out.groupby(["grid", "learner"], sort=False, as_index=False).sum() if len(out) else out
