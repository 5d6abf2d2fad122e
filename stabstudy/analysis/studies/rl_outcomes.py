"""Notebook 01's outcomes: each perturbed fork against its paired control at the same env step, over a
horizon the algorithm's own learning curve sets, with the independent prefix as the unit.

* :func:`learning_horizon`: the env steps a prefix needed to reach ``frac`` (80%) of its final return
  gain; :func:`horizons` per algorithm (median over its prefixes). "Irreversible" means "not back
  within H", and a fork and its control both run to H.
* :func:`paired_outcome`: collapse, recovery and damage of one perturbed fork against its control
  (same prefix, same continuation), both read at the same env steps. A run that diverged has its
  floor after it stopped (:func:`floored`): never its last, pre-spike evaluations.
* :func:`paired_table`: :func:`paired_outcome` for every perturbed fork of a
  :func:`~stabstudy.analysis.studies.rl_comparison.summarize` table.
* The prefix as the unit: :func:`by_prefix` (one row per prefix: the mean over its forks),
  :func:`prefix_bootstrap` (an interval that resamples prefixes, not forks),
  :func:`design_effect`, :func:`prefix_critical_doses` (each prefix's own bracketed critical dose)
  and :func:`critical_dose_claim` (a one-sided Mann-Whitney test over prefixes).
* Manipulation checks (:func:`spiked_updates`, :func:`knob_changed`, :func:`checked`): a perturbation
  that changed nothing makes its claim ``not tested``, with the reason.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import xarray as xr

from stabstudy.analysis.claims import Claim, not_tested

#: States of :func:`paired_outcome`.
OUTCOME_STATES = ("collapsed", "recovered", "no_drop", "no_verdict")


def _pairs(curve: xr.DataArray | tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Finite ``(env steps, returns)`` of a 1-D curve over ``env_step`` (or such a pair), sorted."""
    if isinstance(curve, tuple):
        s, v = (np.asarray(a, dtype=float) for a in curve)
    else:
        s, v = np.asarray(curve["env_step"].values, dtype=float), np.asarray(curve.values, dtype=float)
    ok = np.isfinite(s) & np.isfinite(v)
    order = np.argsort(s[ok], kind="stable")
    return s[ok][order], v[ok][order]


def _at(s: np.ndarray, v: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """The last measured value at or before each grid point (NaN before the first, after the last)."""
    out = np.full(grid.size, np.nan)
    if s.size:
        idx = np.searchsorted(s, grid, side="right") - 1
        ok = (idx >= 0) & (grid <= s[-1])
        out[ok] = v[idx[ok]]
    return out


def learning_horizon(curve: Any, frac: float = 0.8, final_points: int = 3) -> float:
    """Env steps a prefix trained from scratch needed to reach ``frac`` of its final return gain:
    the first evaluation at or above ``untrained + frac * (final - untrained)`` (untrained: its first
    evaluation; final: the mean of its last ``final_points``). NaN when it gained nothing or has
    fewer than two evaluations. ``curve``: 1-D over ``env_step`` (``eval_curves`` of one run)."""
    s, v = _pairs(curve)
    if s.size < 2:
        return np.nan
    gain = float(np.mean(v[-final_points:])) - v[0]
    if not gain > 0:
        return np.nan
    return float(s[np.argmax(v >= v[0] + frac * gain)])


def horizons(prefix_curves: xr.DataArray, frac: float = 0.8, final_points: int = 3):
    """:func:`learning_horizon` of every prefix of ``prefix_curves`` (``eval_curves`` of the prefix
    runs, with a ``learner`` coordinate) and per learner the median over its prefixes.
    Returns ``(per_prefix DataFrame [learner, spec_hash, horizon], {learner: H})``."""
    import pandas as pd

    rows = [{"learner": str(prefix_curves["learner"].values[i]), "spec_hash": str(prefix_curves["spec_hash"].values[i]),
             "horizon": learning_horizon(prefix_curves.isel(run=i), frac, final_points)}
            for i in range(prefix_curves.sizes["run"])]
    per = pd.DataFrame(rows, columns=["learner", "spec_hash", "horizon"])
    return per, {a: float(np.nanmedian(g.horizon)) if g.horizon.notna().any() else np.nan
                 for a, g in per.groupby("learner")}


def floored(curve: Any, stop: float, floor: float, end: float) -> tuple[np.ndarray, np.ndarray]:
    """A run that diverged at env step ``stop``: its evaluations up to ``stop``, then ``floor`` from
    just after ``stop`` to ``end`` (the broken policy does not come back; its last evaluations, made
    before it broke, say nothing about it afterwards)."""
    s, v = _pairs(curve)
    keep = s <= stop
    s, v = s[keep], v[keep]
    after = np.array([np.nextafter(float(stop), np.inf), float(end)]) if end > stop else np.array([])
    return np.concatenate([s, after]), np.concatenate([v, np.full(after.size, float(floor))])


def paired_outcome(treated: Any, control: Any, event: float, horizon: float, *, floor: float,
                   diverged_at: float | None = None, frac: float = 0.5, recover_frac: float = 0.8,
                   final_points: int = 3, min_after: int = 2, min_gain: float = 1e-8) -> dict[str, Any]:
    """One perturbed fork against its control, both read at the same env steps in ``[event, event + horizon]``.

    ``level(t) = (treated(t) - floor) / (control(t) - floor)`` (denominator at least
    ``min_gain``): 1 = as good as the control at that time, 0 = the prefix's untrained return
    (``floor``). ``no_drop``: the level never falls below ``frac``; ``recovered``: it did, and its
    last ``min_after`` points are back at ``recover_frac`` or more (``recovery_time``: env steps from
    the event to the point from which it stays there); ``collapsed``: it did and is not back by
    ``event + horizon``; ``no_verdict`` (with ``reason``): the control (or a treated run that did not
    diverge) ends before ``event + horizon``, or too few points follow the event. A treated run
    that diverged (``diverged_at``) is at its floor after it stopped: ``min(floor, its worst
    return)``. ``damage``: treated - control, mean of the last ``final_points`` common points.
    """
    end = float(event) + float(horizon)
    out = {"state": "no_verdict", "collapsed": np.nan, "recovery_time": np.nan, "damage": np.nan,
           "min_level": np.nan, "end": end, "reason": ""}
    if not np.isfinite(end):
        return {**out, "reason": "no horizon"}
    cs, cv = _pairs(control)
    ts, tv = _pairs(treated)
    if diverged_at is not None and np.isfinite(diverged_at):
        broken = min(float(floor), float(tv.min())) if tv.size else float(floor)
        ts, tv = floored((ts, tv), float(diverged_at), broken, end)
    if not cs.size or cs[-1] < end:
        return {**out, "reason": f"the control's evaluations end at {cs[-1] if cs.size else np.nan:.0f}, "
                                 f"before event + H = {end:.0f}"}
    if not ts.size or ts[-1] < end:
        return {**out, "reason": f"the treated run's evaluations end at {ts[-1] if ts.size else np.nan:.0f} "
                                 f"(it did not diverge), before event + H = {end:.0f}"}
    grid = np.union1d(ts, cs)
    grid = grid[(grid >= event) & (grid <= end)]
    t, c = _at(ts, tv, grid), _at(cs, cv, grid)
    ok = np.isfinite(t) & np.isfinite(c)
    grid, t, c = grid[ok], t[ok], c[ok]
    if grid.size < min_after + 1:
        return {**out, "reason": f"{grid.size} common evaluations in the window, fewer than {min_after + 1}"}
    level = (t - floor) / np.maximum(c - floor, min_gain)
    below = level < frac
    out.update(damage=float(np.mean(t[-final_points:] - c[-final_points:])), min_level=float(level.min()))
    if not below.any():
        return {**out, "state": "no_drop", "collapsed": 0.0}
    if (level[-min_after:] >= recover_frac).all():
        back = level >= recover_frac
        last_bad = np.flatnonzero(~back)[-1]
        return {**out, "state": "recovered", "collapsed": 0.0, "recovery_time": float(grid[last_bad + 1] - event)}
    return {**out, "state": "collapsed", "collapsed": 1.0}


def paired_table(ds: xr.Dataset, table, *, horizon: Mapping[str, float], floors: Mapping[str, float],
                 prefix_of: Mapping[str, str], **kw: Any):
    """:func:`paired_outcome` of every perturbed row of ``table`` (``rl_comparison.summarize`` of the
    runs of ``ds``, a ``load_runs`` Dataset) against its control (the unperturbed fork with the
    same ``rl_comparison.PAIR_KEY``). ``horizon``: per learner (:func:`horizons`); ``floors``: per
    run, its prefix's untrained return; ``prefix_of``: run -> its prefix's hash (the unit).
    One row per perturbed run: its keys, ``control``, ``prefix``, ``event``, ``horizon`` and the outcome."""
    import pandas as pd

    from stabstudy.analysis.studies.rl_comparison import PAIR_KEY, _stop_env_step, eval_curves

    key = [k for k in PAIR_KEY if k in table]
    controls = table[table.pert_kind == "none"].drop_duplicates(key).set_index(key)["spec_hash"]
    index = {str(h): i for i, h in enumerate(ds.run.values)}
    rows = []
    for _, r in table[table.pert_kind != "none"].iterrows():
        k = tuple(r[c] for c in key)
        ctrl = controls.get(k if len(key) > 1 else k[0])
        h, a = str(r.spec_hash), str(r.learner)
        base = {"spec_hash": h, "control": ctrl, "prefix": prefix_of.get(h), "learner": a, "seed": r.get("seed"),
                "pert_kind": r.pert_kind, "pert_dose": r.pert_dose, "event": float(r.pert_start),
                "horizon": float(horizon.get(a, np.nan))}
        if ctrl is None or str(ctrl) not in index:
            rows.append({**base, "state": "no_verdict", "collapsed": np.nan, "reason": "no paired control"})
            continue
        stop = _stop_env_step(ds, index[h]) if r.get("status") == "diverged" else None
        res = paired_outcome(eval_curves(ds.isel(run=index[h])).isel(run=0),
                             eval_curves(ds.isel(run=index[str(ctrl)])).isel(run=0), base["event"], base["horizon"],
                             floor=float(floors.get(h, np.nan)), diverged_at=stop, **kw)
        rows.append({**base, **res})
    return pd.DataFrame(rows)


# -- the prefix as the unit -----------------------------------------------------------------


def by_prefix(outcomes, by: Sequence[str] = ("learner", "pert_kind", "pert_dose"),
              values: Sequence[str] = ("collapsed", "damage", "recovery_time")):
    """One row per group of ``by`` and prefix: ``forks`` (with a verdict), the mean of each of
    ``values`` over its forks, and ``collapsed_prefix`` (1 when most of its forks collapsed, 0 when
    most did not, NaN on a tie or without verdicts): the prefix-level outcome its tests count."""
    rows = []
    for key, g in outcomes.groupby([*by, "prefix"], sort=True, dropna=False):
        c = g["collapsed"].to_numpy(float)
        c = c[np.isfinite(c)]
        row = dict(zip([*by, "prefix"], key, strict=True))
        row["forks"] = int(c.size)
        row.update({v: float(np.nanmean(g[v].to_numpy(float))) if np.isfinite(g[v].to_numpy(float)).any() else np.nan
                    for v in values if v in g})
        m = float(c.mean()) if c.size else np.nan
        row["collapsed_prefix"] = np.nan if not c.size or m == 0.5 else float(m > 0.5)
        rows.append(row)
    import pandas as pd

    return pd.DataFrame(rows)


def prefix_bootstrap(values: Sequence[float], prefixes: Sequence[Any], statistic: Callable[[np.ndarray], float] = np.mean,
                     *, reps: int = 2000, confidence: float = 0.95, seed: int = 0) -> tuple[float, float, float]:
    """``(estimate, low, high)`` of ``statistic`` over forks, with a percentile interval from a
    bootstrap that resamples *prefixes* (each drawn prefix brings all its forks): forks of one
    prefix share its training, so resampling them one by one would treat them as independent."""
    v, p = np.asarray(values, dtype=float), np.asarray(prefixes, dtype=object)
    ok = np.isfinite(v)
    v, p = v[ok], p[ok]
    if not v.size:
        return np.nan, np.nan, np.nan
    groups = [v[p == u] for u in dict.fromkeys(p.tolist())]
    rng = np.random.default_rng(seed)
    draws = [statistic(np.concatenate([groups[i] for i in rng.integers(0, len(groups), len(groups))]))
             for _ in range(int(reps))]
    q = (1 - confidence) / 2
    lo, hi = np.quantile(draws, [q, 1 - q])
    return float(statistic(v)), float(lo), float(hi)


def design_effect(values: Sequence[float], prefixes: Sequence[Any]) -> tuple[float, float]:
    """``(icc, deff)``: the intraclass correlation of ``values`` within prefixes (one-way ANOVA
    estimator, at least 0) and the design effect ``1 + (m - 1) icc`` (``m``: mean forks per prefix):
    how many forks are worth one independent prefix."""
    v, p = np.asarray(values, dtype=float), np.asarray(prefixes, dtype=object)
    ok = np.isfinite(v)
    v, p = v[ok], p[ok]
    groups = [v[p == u] for u in dict.fromkeys(p.tolist())]
    k, n = len(groups), v.size
    if k < 2 or n <= k:
        return np.nan, np.nan
    m0 = (n - sum(g.size**2 for g in groups) / n) / (k - 1)
    msb = sum(g.size * (g.mean() - v.mean()) ** 2 for g in groups) / (k - 1)
    msw = sum(((g - g.mean()) ** 2).sum() for g in groups) / (n - k)
    icc = max(0.0, (msb - msw) / (msb + (m0 - 1) * msw)) if msb + (m0 - 1) * msw > 0 else 0.0
    return float(icc), float(1 + (n / k - 1) * icc)


def prefix_critical_doses(prefix_rows, dose_col: str = "pert_dose"):
    """Each prefix's own critical dose from :func:`by_prefix` rows of one kind (``collapsed_prefix``
    per dose; the control is dose 0 or 1, below every tested dose): the geometric mean of the
    largest dose it survived below the smallest dose it collapsed at and that dose (``where``
    "bracketed", with ``low``/``high``), ``inf`` "above the grid" when it collapsed at no dose,
    the smallest dose "below the grid" when it collapsed already there. One row per learner and prefix."""
    import pandas as pd

    rows = []
    for (a, pre), g in prefix_rows.groupby(["learner", "prefix"], sort=True):
        g = g[np.isfinite(g["collapsed_prefix"].to_numpy(float))].sort_values(dose_col)
        d, c = g[dose_col].to_numpy(float), g["collapsed_prefix"].to_numpy(float)
        row = {"learner": a, "prefix": pre, "doses": int(d.size)}
        if not d.size:
            rows.append({**row, "dose": np.nan, "low": np.nan, "high": np.nan, "where": "no data"})
            continue
        hit = np.flatnonzero(c == 1)
        if not hit.size:
            rows.append({**row, "dose": np.inf, "low": float(d.max()), "high": np.inf, "where": "above the grid"})
        elif hit[0] == 0:
            rows.append({**row, "dose": float(d[0]), "low": 0.0, "high": float(d[0]), "where": "below the grid"})
        else:
            lo, hi = float(d[hit[0] - 1]), float(d[hit[0]])
            rows.append({**row, "dose": float(np.sqrt(lo * hi)), "low": lo, "high": hi, "where": "bracketed"})
    return pd.DataFrame(rows)


def critical_dose_claim(claim: str, source: str, lower: Sequence[float], higher: Sequence[float], *,
                        alpha: float = 0.05, min_n: int = 3) -> Claim:
    """Claim: the prefixes of ``lower`` have lower critical doses than those of ``higher``
    (:func:`prefix_critical_doses`; ``inf`` = above the grid, ranked last): one-sided Mann-Whitney
    U over prefixes, one value per prefix. ``supported`` when "lower" rejects at ``alpha``, ``not
    supported`` when "greater" does, else ``inconclusive``; fewer than ``min_n`` prefixes in either
    arm: ``not tested`` (none) or ``inconclusive``."""
    from scipy.stats import mannwhitneyu

    a, b = np.asarray(lower, dtype=float), np.asarray(higher, dtype=float)
    a, b = a[~np.isnan(a)], b[~np.isnan(b)]
    test = "Mann-Whitney U over prefixes (one-sided)"
    n = int(a.size + b.size)
    if min(a.size, b.size) == 0:
        return not_tested(claim, source, "no prefix-level critical doses", n=n)
    if min(a.size, b.size) < min_n:
        return Claim(claim, source, "inconclusive", f"{a.size} vs {b.size} prefixes, fewer than {min_n}", n=n, test=test)
    if np.all(np.concatenate([a, b]) == a[0]):
        return Claim(claim, source, "inconclusive", "every prefix has the same critical dose", n=n, test=test)
    p_for = float(mannwhitneyu(a, b, alternative="less").pvalue)
    p_against = float(mannwhitneyu(a, b, alternative="greater").pvalue)
    verdict = "supported" if p_for < alpha else "not supported" if p_against < alpha else "inconclusive"
    med = lambda x: float(np.median(x))  # noqa: E731 - inf stays inf
    reason = (f"median critical dose {med(a):.3g} ({a.size} prefixes) vs {med(b):.3g} ({b.size}); "
              f"one-sided p = {p_for:.3g}" + (f", against: p = {p_against:.3g}" if verdict == "not supported" else ""))
    return Claim(claim, source, verdict, reason, med(a) - med(b) if np.isfinite(med(a) - med(b)) else np.nan,
                 n=n, test=test, p=p_for if verdict != "not supported" else p_against, p_decides=verdict != "inconclusive")


# -- manipulation checks --------------------------------------------------------------------


def spiked_updates(run: xr.Dataset, start: float, duration: float) -> dict[str, int]:
    """Gradient updates of one run (dim ``step``) made while its lr spike was on: rows with
    ``env_step`` in ``[start, start + duration)`` past the run's first row, per optimizer the
    Monitor measured (``update_norm`` = the primary optimizer: the critic off-policy, PPO's policy;
    ``update_norm_actor``: the actor, which TD3 updates every ``policy_delay`` rows)."""
    env = np.asarray(run["env_step"].values, dtype=float)
    inside = (env >= start) & (env < start + duration)
    inside[:1] = False  # a fork's first row is its prefix's last update, made before the window
    out = {}
    for name, ch in (("updates", "update_norm"), ("actor_updates", "update_norm_actor")):
        if ch in run:
            out[name] = int((inside & np.isfinite(run[ch].values)).sum())
    if "updates" not in out:  # no Monitor: every row after the first is an update
        out["updates"] = int(inside.sum())
    return out


#: The channel that shows each learner's own noise knob acting on its policy.
KNOB_CHANNELS = {"ppo": "policy_std", "a2c": "policy_std", "sac": "ent_coef", "td3": None, "ddpg": None}


def knob_changed(treated: xr.Dataset, control: xr.Dataset, learner: str, at: float, *, lookback: float,
                 rtol: float = 0.05) -> tuple[bool | None, str]:
    """Did a fork's changed noise knob change its policy's noise at the spike (env step ``at``)?
    Compares :data:`KNOB_CHANNELS` (PPO: ``policy_std``; SAC: ``ent_coef``, its alpha) averaged over
    ``[at - lookback, at)`` with the control fork's (same prefix, default knob). ``(True, reason)``
    when they differ by more than ``rtol`` (relative), ``(False, reason)`` when not, ``(None, reason)``
    when nothing measures it (TD3's exploration noise acts on behaviour, not on the policy)."""
    ch = KNOB_CHANNELS.get(learner)
    if ch is None:
        return None, f"{learner.upper()}'s knob acts on behaviour; no policy channel measures it"

    def mean(ds):
        env = np.asarray(ds["env_step"].values, dtype=float)
        v = ds[ch].values[(env >= at - lookback) & (env < at)] if ch in ds else np.array([])
        v = v[np.isfinite(v)]
        return float(v.mean()) if v.size else np.nan

    a, b = mean(treated), mean(control)
    if not (np.isfinite(a) and np.isfinite(b)):
        return False, f"no {ch} measured in the {lookback:.0f} env steps before the spike"
    rel = abs(a - b) / max(abs(b), 1e-12)
    verb = "changed" if rel > rtol else "did not change"
    return rel > rtol, f"the knob {verb} {ch} before the spike ({a:.3g} vs {b:.3g} in the control, {100 * rel:.1f}%)"


def checked(claim: Claim, ok: bool, reason: str) -> Claim:
    """``claim`` when its manipulation check passed (``ok``), else ``not tested`` with ``reason``:
    a perturbation that changed nothing tests nothing, whatever the outcome."""
    if ok:
        return claim
    return not_tested(claim.claim, claim.source, f"manipulation check failed: {reason}", n=claim.n)


# -- the headline claims over prefixes ------------------------------------------------------


def collapse_at_dose_claims(per_prefix, dose: float, *, on_policy: str = "ppo", off_policy: Sequence[str] = ("sac", "td3"),
                            kind: str = "lr_spike", spiked: Mapping[str, int] | None = None, alpha: float = 0.05,
                            planning: tuple[float, float] = (0.9, 0.1)) -> list[Claim]:
    """Claim (a): "``on_policy`` collapses at ``dose`` where every ``off_policy`` learner does not".

    ``per_prefix``: :func:`by_prefix` rows (one per prefix: ``collapsed_prefix``). One row per
    off-policy learner, a one-sided Boschloo test over prefixes (``rate_comparison``: the
    on-policy learner's rate above its rate, each at ``alpha / len(off_policy)``), then the joint
    row: ``supported`` only when every comparison is, ``not supported`` when any is, else
    ``inconclusive``. ``spiked``: per learner, the updates the perturbation reached (median over
    its forks, :func:`spiked_updates`); a learner with none is ``not tested`` (the manipulation
    check). Every reason states the power of its test at the ``planning`` rates for its numbers of prefixes
    (:func:`stabstudy.analysis.studies.rl_design.boschloo_power`)."""
    from stabstudy.analysis import claims as C
    from stabstudy.analysis.studies.rl_design import boschloo_power

    level = alpha / max(1, len(off_policy))
    cols = {"learner", "pert_kind", "pert_dose", "collapsed_prefix"}
    at = per_prefix[(per_prefix.pert_kind == kind) & (per_prefix.pert_dose == dose)] if cols <= set(per_prefix) else None

    def counts(a):
        if at is None:
            return 0, 0
        c = at[at.learner == a]["collapsed_prefix"].to_numpy(float)
        c = c[np.isfinite(c)]
        return int(c.sum()), int(c.size)

    k1, n1 = counts(on_policy)
    rows = []
    for a in off_policy:
        k0, n0 = counts(a)
        text = f"{on_policy.upper()} collapses at x{dose:g} more often than {a.upper()} (over prefixes, against the paired control)"
        power = boschloo_power(*planning, max(n1, 1), max(n0, 1), alpha=level) if n1 and n0 else np.nan
        claim = C.rate_comparison(text, "source paper: the report under test", k1, n1, k0, n0, direction="greater",
                                  alpha=level)
        claim = replace_reason(claim, f"{claim.reason}; power {power:.2f} at planning rates {planning[0]:g} vs "
                                      f"{planning[1]:g} with {n1} and {n0} prefixes, alpha {level:.3g}")
        missing = [x for x in (on_policy, a) if spiked is not None and int(spiked.get(x, 0)) == 0]
        rows.append(checked(claim, not missing, f"the perturbation reached no update of {', '.join(m.upper() for m in missing)}"))
    verdicts = [r.verdict for r in rows]
    joint = ("supported" if verdicts and all(v == "supported" for v in verdicts) else
             "not supported" if "not supported" in verdicts else
             "not tested" if verdicts and all(v == "not tested" for v in verdicts) else "inconclusive")
    others = " and ".join(a.upper() for a in off_policy)
    rows.append(Claim(f"{on_policy.upper()} collapses at x{dose:g} where {others} do not (every comparison must hold)",
                      "source paper: the report under test", joint,
                      "; ".join(f"{a.upper()}: {v}" for a, v in zip(off_policy, verdicts, strict=True)),
                      n=sum(r.n for r in rows), test="intersection of one-sided Boschloo tests"))
    return rows


def replace_reason(claim: Claim, reason: str) -> Claim:
    """``claim`` with another reason (same verdict and numbers)."""
    from dataclasses import replace

    return replace(claim, reason=reason)
