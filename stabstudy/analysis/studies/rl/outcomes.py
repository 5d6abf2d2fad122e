"""Notebook 01's outcomes: each perturbed fork against its paired control at the same env steps,
over the horizon H, allowing a lag; the independent prefix as the unit.

* :func:`paired_outcome`: collapse, recovery and damage of one perturbed fork against its control
  (same prefix, same continuation), both read at the same env steps, the fork allowed to trail the
  control by a lag. A run that diverged has its floor after it stopped (:func:`floored`): never its
  last, pre-spike evaluations. This is the study's one meaning of "collapsed".
* :func:`paired_table`: :func:`paired_outcome` for every perturbed run of a run table
  (:func:`.runs.run_table`); :func:`horizon_outcomes` judges each fork over what it ran (H, or its
  short window), :func:`stated_outcomes` the claim as stated (fresh runs).
* The prefix as the unit: :func:`by_prefix` (one row per prefix: the mean over its forks) and
  :func:`prefix_summary` (rates and damage over prefixes, :func:`stabstudy.analysis.stats.cluster_bootstrap`).
* Each prefix's critical dose: :func:`dose_brackets` (its interval-censored bracket from its forks) and
  :func:`prefix_critical_doses` (the bracket's geometric midpoint, also as an absolute learning rate,
  :func:`base_lr`, and as the policy change it caused); claim (c)'s paired change of a prefix's collapse
  with the noise knob: :func:`knob_collapse_changes`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import xarray as xr

from stabstudy.analysis import stats
from stabstudy.analysis.studies.rl.curves import (
    eval_curves,
    finite_pairs,
    first_last_returns,
    step_at,
    stop_env_step,
)
from stabstudy.hparams import defaults
from stabstudy.registry import hparams_class

#: States of :func:`paired_outcome`.
OUTCOME_STATES = ("collapsed", "recovered", "no_drop", "no_verdict")

#: Columns that identify a fork's control: the unperturbed fork of the same checkpoint and noise.
PAIR_KEY = ("learner", "seed", "prefix_steps", "noise_after_fork")


def floored(curve: Any, stop: float, floor: float, end: float) -> tuple[np.ndarray, np.ndarray]:
    """A run that diverged at env step ``stop``: its evaluations up to ``stop``, then ``floor`` from
    just after ``stop`` to ``end`` (the broken policy does not come back; its last evaluations, made
    before it broke, say nothing about it afterwards)."""
    s, v = finite_pairs(curve)
    keep = s <= stop
    s, v = s[keep], v[keep]
    after = np.array([np.nextafter(float(stop), np.inf), float(end)]) if end > stop else np.array([])
    return np.concatenate([s, after]), np.concatenate([v, np.full(after.size, float(floor))])


def paired_outcome(treated: Any, control: Any, event: float, horizon: float, *, floor: float, lag: float = 0.0,
                   diverged_at: float | None = None, frac: float = 0.5, final_points: int = 3, min_after: int = 2,
                   min_gain: float = 1e-8) -> dict[str, Any]:
    """One perturbed fork against its paired control, both read at the same env steps in ``[event, event + horizon]``,
    allowing the fork to trail its control by up to ``lag`` env steps.

    The reference at env step ``t`` is the control ``lag`` env steps earlier (never before the event):
    ``reference(t) = control(max(event, t - lag))``; ``level(t) = (treated(t) - floor) / (reference(t) -
    floor)``, where ``floor`` is the prefix's untrained return (1: as good as the control was ``lag``
    earlier, 0: back to the untrained return). A fork that is its control delayed by up to ``lag`` (it
    paused, or learns at the control's rate behind it) keeps a level near 1: a lag is not a loss.

    * ``collapsed``: it ends below ``frac``: the mean of its last ``final_points`` common evaluations
      over the floor is below ``frac`` times the reference's (it plateaued below ``frac`` of the
      control's gain, however late it dropped);
    * ``recovered``: its level fell below ``frac`` somewhere in the window but it does not end below
      (``recovery_time``: env steps from the event to the point from which it stays at ``frac`` or more);
    * ``no_drop``: its level never fell below ``frac``;
    * ``no_verdict`` (with ``reason``): the control, or a treated run that did not diverge, ends before
      ``event + horizon``; fewer than ``min_after + 1`` common evaluations in the window; or the control
      has no gain to lose: its reference at the end is at most ``min_gain`` above the floor.

    Points where the reference is at most ``min_gain`` above the floor have no level and are skipped.
    A treated run that diverged (``diverged_at``) is at its floor after it stopped (``min(floor, its
    worst return)``). ``damage``: treated - control (not lagged), mean of the last ``final_points``
    common points; ``onset``: the env step of the first point whose level is below ``frac``;
    ``end_level``: the ending level the verdict reads; ``min_level``: the lowest level.
    """
    end = float(event) + float(horizon)
    out = {"state": "no_verdict", "collapsed": np.nan, "recovery_time": np.nan, "damage": np.nan,
           "min_level": np.nan, "end_level": np.nan, "onset": np.nan, "end": end, "lag": float(lag), "reason": ""}
    if not np.isfinite(end):
        return {**out, "reason": "no horizon"}
    cs, cv = finite_pairs(control)
    ts, tv = finite_pairs(treated)
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
    t, c = step_at(ts, tv, grid), step_at(cs, cv, grid)
    r = step_at(cs, cv, np.maximum(float(event), grid - float(lag)))
    ok = np.isfinite(t) & np.isfinite(c) & np.isfinite(r)
    grid, t, c, r = grid[ok], t[ok], c[ok], r[ok]
    if grid.size < min_after + 1:
        return {**out, "reason": f"{grid.size} common evaluations in the window, fewer than {min_after + 1}"}
    out["damage"] = float(np.mean(t[-final_points:] - c[-final_points:]))
    gain_end = float(np.mean(r[-final_points:])) - floor
    if not gain_end > min_gain:
        return {**out, "reason": f"the control has no gain to lose: {gain_end:.3g} over the floor {floor:.4g} at the "
                                 f"end, at most {min_gain:.3g}"}
    judged = r - floor > min_gain
    level = np.where(judged, (t - floor) / np.where(judged, r - floor, 1.0), np.nan)
    end_level = (float(np.mean(t[-final_points:])) - floor) / gain_end
    below = judged & (level < frac)
    out.update(min_level=float(np.nanmin(level)), end_level=end_level)
    if not below.any():
        return {**out, "state": "no_drop", "collapsed": 0.0}
    out["onset"] = float(grid[np.argmax(below)])
    if end_level < frac:
        return {**out, "state": "collapsed", "collapsed": 1.0}
    last_bad = np.flatnonzero(below)[-1]
    back = grid[last_bad + 1] if last_bad + 1 < grid.size else end
    return {**out, "state": "recovered", "collapsed": 0.0, "recovery_time": float(back - event)}


def paired_table(ds: xr.Dataset, table, *, horizon: Mapping[str, float], floors: Mapping[str, float],
                 prefix_of: Mapping[str, str], lag: Mapping[str, float] | None = None, **kw: Any):
    """:func:`paired_outcome` of every perturbed row of ``table`` (:func:`.runs.run_table` of the
    runs of ``ds``, a ``load_runs`` Dataset) against its control (the unperturbed run with the same
    :data:`PAIR_KEY`). ``horizon`` and ``lag`` (env steps): per run (spec hash) or per learner (the
    run's own first); ``floors``: per run, its prefix's untrained return; ``prefix_of``: run -> its
    prefix (the unit). One row per perturbed run: its keys (``noise_after_fork`` among them: the knob
    its fork and control ran with), ``control``, ``prefix``, ``event``, ``horizon`` and the outcome."""
    key = [k for k in PAIR_KEY if k in table]
    controls = table[table.pert_kind == "none"].drop_duplicates(key).set_index(key)["spec_hash"]
    index = {str(h): i for i, h in enumerate(ds.run.values)}
    rows = []
    for _, r in table[table.pert_kind != "none"].iterrows():
        k = tuple(r[c] for c in key)
        ctrl = controls.get(k if len(key) > 1 else k[0])
        h, a = str(r.spec_hash), str(r.learner)
        base = {"spec_hash": h, "control": ctrl, "prefix": prefix_of.get(h), "learner": a, "seed": r.get("seed"),
                "pert_kind": r.pert_kind, "pert_dose": r.pert_dose, "noise_after_fork": r.get("noise_after_fork", "same"),
                "event": float(r.pert_start), "horizon": float(horizon.get(h, horizon.get(a, np.nan)))}
        if ctrl is None or str(ctrl) not in index:
            rows.append({**base, "state": "no_verdict", "collapsed": np.nan, "reason": "no paired control"})
            continue
        stop = stop_env_step(ds, index[h]) if r.get("status") == "diverged" else None
        res = paired_outcome(eval_curves(ds.isel(run=index[h])).isel(run=0),
                             eval_curves(ds.isel(run=index[str(ctrl)])).isel(run=0), base["event"], base["horizon"],
                             floor=float(floors.get(h, np.nan)), diverged_at=stop,
                             lag=float((lag or {}).get(h, (lag or {}).get(a, 0.0))), **kw)
        rows.append({**base, **res})
    return pd.DataFrame(rows)


def stated_outcomes(ds: xr.Dataset, table: pd.DataFrame, *, lag_frac: float = 0.0, **kw: Any) -> pd.DataFrame:
    """Paired outcomes of the claim as stated (:func:`paired_table`): each spiked fresh run of ``table``
    (:func:`.runs.run_table` of ``ds``) against the unperturbed run of its seed (the arm's matching
    prefix: same seed and hyperparameters, unperturbed), read at the same env steps over
    ``[spike, end]``, the end being the earlier of the two runs' last evaluations; ``lag_frac`` of that
    window is the lag it may trail by. The floor is the control's first evaluation (the untrained
    policy) and the unit its seed (a fresh run is its own prefix)."""
    if not len(table):
        return paired_table(ds, table, horizon={}, floors={}, prefix_of={}, **kw)
    key = [k for k in PAIR_KEY if k in table]
    ctrl = table[table.pert_kind == "none"].drop_duplicates(key).set_index(key)
    untrained = first_last_returns(ds).untrained
    index = {str(h): i for i, h in enumerate(ds.run.values)}
    horizon, floors, unit = {}, {}, {}
    for _, r in table[table.pert_kind != "none"].iterrows():
        k = tuple(r[c] for c in key)
        c = ctrl["spec_hash"].get(k if len(key) > 1 else k[0])
        unit[r.spec_hash] = f"{r.learner} seed {r.seed}"
        if c is None or str(c) not in index:
            continue
        end = min(stop_env_step(ds, index[str(c)]), stop_env_step(ds, index[str(r.spec_hash)]))
        horizon[r.spec_hash] = end - float(r.pert_start)
        floors[r.spec_hash] = float(untrained.get(c, np.nan))
    lag = {h: lag_frac * w for h, w in horizon.items()}
    return paired_table(ds, table, horizon=horizon, floors=floors, prefix_of=unit, lag=lag, **kw)


# -- the drop rule and the outcomes over what each fork ran ----------------------------------------


def horizon_outcomes(ds: xr.Dataset, table, *, horizon: Mapping[str, float], window: Mapping[str, float],
                     long: Collection[str], floors: Mapping[str, float], prefix_of: Mapping[str, str], **kw: Any):
    """Paired outcomes (:func:`paired_table`) of every fork of
    ``table``, each over what it ran: a fork that ran to its event + H (``long``: its spec hash) or
    diverged (at its floor after it stopped) is judged over ``horizon`` (per arm); a short fork over
    its ``window`` (per arm), where it did not drop (``no_drop``: not collapsed), and a short fork
    that dropped there but was not run to H has no verdict (with that reason). Column
    ``judged_over``: ``"H"`` or ``"short window"``; ``dropped``: a short fork whose return fell below
    ``frac`` of the control's gain inside its window (:class:`.plan.ForkPlan` runs it on to H). A fork
    that diverged is judged over H: it stopped, and it is at its floor from then on."""
    ctrl = table.pert_kind == "none"
    longer = table.spec_hash.isin(set(long))
    if "status" in table:
        longer |= table["status"] == "diverged"
    parts = []
    for name, rows, h in (("H", ctrl | longer, horizon), ("short window", ctrl | ~longer, window)):
        out = paired_table(ds, table[rows], horizon=h, floors=floors, prefix_of=prefix_of, **kw)
        if not len(out):
            continue
        if name == "short window":
            bad = out.state.isin(["collapsed", "recovered"])
            out.loc[bad, "state"] = "no_verdict"
            out.loc[bad, "collapsed"] = np.nan
            out.loc[bad, "reason"] = "dropped within its short window but not run on to H"
            out["dropped"] = bad
        else:
            out["dropped"] = False
        parts.append(out.assign(judged_over=name))
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()


# -- the prefix as the unit -----------------------------------------------------------------


def by_prefix(outcomes, by: Sequence[str] = ("learner", "pert_kind", "pert_dose"),
              values: Sequence[str] = ("collapsed", "damage", "recovery_time")):
    """One row per group of ``by`` and prefix: ``forks`` (with a verdict), the mean of each of
    ``values`` over its forks, and ``collapsed_prefix`` (1 when most of its forks collapsed, 0 when
    most did not, NaN on a tie or without verdicts): the prefix-level outcome its tests count.
    Forks at different noise knobs are never pooled: ``noise_after_fork`` joins ``by`` where
    ``outcomes`` has it."""
    if "noise_after_fork" in outcomes and "noise_after_fork" not in by:
        by = (*by, "noise_after_fork")
    # the knob column holds "same" beside numbers, which do not sort together
    mixed = any(outcomes[k].map(type).nunique() > 1 for k in by if k in outcomes)
    rows = []
    for key, g in outcomes.groupby([*by, "prefix"], sort=not mixed, dropna=False):
        c = g["collapsed"].to_numpy(float)
        c = c[np.isfinite(c)]
        row = dict(zip([*by, "prefix"], key, strict=True))
        row["forks"] = int(c.size)
        row.update({v: float(np.nanmean(g[v].to_numpy(float))) if np.isfinite(g[v].to_numpy(float)).any() else np.nan
                    for v in values if v in g})
        m = float(c.mean()) if c.size else np.nan
        row["collapsed_prefix"] = np.nan if not c.size or m == 0.5 else float(m > 0.5)
        rows.append(row)
    return pd.DataFrame(rows)


def prefix_summary(paired, by: Sequence[str] = ("learner", "pert_kind", "pert_dose"), *, reps: int = 1000,
                   alpha: float = 0.05, seed: int = 0):
    """Per group of ``by`` of paired outcomes (:func:`horizon_outcomes` or :func:`paired_table`
    rows), with the prefix as the unit: ``prefixes`` (with a verdict), ``forks``, ``collapsed``
    (prefixes whose forks mostly collapsed, :func:`by_prefix`) and ``p_collapse`` with a
    Clopper-Pearson interval over prefixes (``p_low``, ``p_high``), the mean ``damage`` with a
    bootstrap interval that resamples prefixes (``damage_low``, ``damage_high``), the design effect
    of the damage (``deff``: how many forks one prefix is worth) and ``no_verdict`` (forks without one)."""
    rows = []
    if not len(paired):
        return pd.DataFrame(columns=[*by, "prefixes", "forks", "collapsed", "p_collapse", "p_low", "p_high",
                                     "damage", "damage_low", "damage_high", "deff", "no_verdict"])
    per = by_prefix(paired, by=by)
    for key, g in paired.groupby(list(by), sort=True, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        mask = np.logical_and.reduce([per[b] == k for b, k in zip(by, key, strict=True)]) if len(per) else []
        c = per[mask]["collapsed_prefix"].to_numpy(float) if len(per) else np.array([])
        c = c[np.isfinite(c)]
        p, lo, hi = stats.collapse_probability(c, confidence=1 - alpha) if c.size else (np.nan,) * 3
        est, dlo, dhi = stats.cluster_bootstrap(g["damage"], g["prefix"], reps=reps, seed=seed)
        rows.append({**dict(zip(by, key, strict=True)), "prefixes": int(c.size), "forks": len(g),
                     "collapsed": int(c.sum()), "p_collapse": p, "p_low": lo, "p_high": hi, "damage": est,
                     "damage_low": dlo, "damage_high": dhi, "deff": stats.design_effect(g["damage"], g["prefix"])[1],
                     "no_verdict": int((g["state"] == "no_verdict").sum())})
    return pd.DataFrame(rows)


# -- claim (b): each prefix's own critical dose ---------------------------------------------

#: The lr factor of the control fork: a fork at factor 1 is its own control, so it never collapses against it,
#: and a prefix that collapses at the smallest tested dose is bracketed between this and that dose.
CONTROL_DOSE = 1.0


def _of_kind(rows, kind: str | None, dose_col: str):
    if kind is not None and "pert_kind" in rows:
        rows = rows[rows.pert_kind == kind]
    return rows[np.isfinite(rows["collapsed_prefix"].to_numpy(float)) & (rows[dose_col].to_numpy(float) > 0)]


def dose_brackets(per_prefix, *, kind: str | None = "lr_spike", dose_col: str = "pert_dose",
                  control_dose: float = CONTROL_DOSE):
    """Each prefix's bracket of its critical dose from its prefix-level outcomes at the doses it was
    forked at (:func:`by_prefix` rows: ``collapsed_prefix`` per ``learner``, ``prefix`` and dose; rows
    of other kinds than ``kind`` and without a verdict are left out). One row per learner and prefix:

    * ``high``: the smallest dose it collapsed at; ``low``: the largest dose it survived below that
      (interval-censored: its critical dose lies in ``(low, high]``);
    * ``where``: ``"bracketed"``; ``"below the grid"`` when it collapsed already at the smallest
      tested dose (``low`` is then ``control_dose``: the control cannot collapse against itself, so
      the bracket is still finite and can be bisected); ``"above the grid"`` when it collapsed at no
      dose (right-censored: ``low`` the largest tested dose, ``high`` inf); ``"no data"``;
    * ``monotone``: False when it survived a dose above one it collapsed at (the bracket is then the
      first collapse's; the forks of that prefix disagree with a threshold);
    * ``doses``: tested doses with a verdict.
    """
    rows = []
    for (a, pre), g in per_prefix.groupby(["learner", "prefix"], sort=True):
        g = _of_kind(g, kind, dose_col).sort_values(dose_col)
        d, c = g[dose_col].to_numpy(float), g["collapsed_prefix"].to_numpy(float)
        row = {"learner": a, "prefix": pre, "doses": int(d.size), "monotone": True}
        hit = np.flatnonzero(c == 1)
        if not d.size:
            row.update(low=np.nan, high=np.nan, where="no data")
        elif not hit.size:
            row.update(low=float(d.max()), high=np.inf, where="above the grid")
        else:
            first = hit[0]
            row.update(low=float(d[first - 1]) if first else float(control_dose), high=float(d[first]),
                       where="bracketed" if first else "below the grid", monotone=bool((c[first:] == 1).all()))
        rows.append(row)
    return pd.DataFrame(rows, columns=["learner", "prefix", "doses", "low", "high", "where", "monotone"])


def base_lr(learner: str, hparams: Mapping[str, Any] | None = None) -> float:
    """The learning rate an lr-spike factor multiplies: ``hparams["lr"]`` (a run's explicit
    hyperparameters) or the learner's default (:mod:`stabstudy.hparams`)."""
    return float((hparams or {}).get("lr", defaults(hparams_class("rl", learner))["lr"]))


def prefix_critical_doses(prefix_rows, dose_col: str = "pert_dose", *, kind: str | None = "lr_spike",
                          control_dose: float = CONTROL_DOSE, base_lrs: Mapping[str, float] | None = None,
                          changes=None, change: str = "update_path"):
    """Each prefix's own critical dose (:func:`dose_brackets` of its :func:`by_prefix` rows): ``dose``
    is the geometric midpoint of its bracket ``(low, high]`` (``inf`` above the grid, where it ranks
    above every bracketed dose; NaN without data). One row per learner and prefix, however many forks
    each prefix has: the prefix is the unit.

    ``base_lrs`` (learner -> the lr the factor multiplies, :func:`base_lr`): ``lr``, ``lr_low``,
    ``lr_high``, the same as an absolute learning rate. ``changes`` (:func:`.checks.policy_change_table`):
    ``change_low`` / ``change_high``, the mean measured policy change (column ``change``, e.g.
    ``update_path``, ``relative_path`` or ``kl``) of the prefix's forks at the bracket's two doses (the
    control's at ``control_dose``), and ``change_at_dose``, their geometric mean: the policy change
    the critical dose caused, interval-censored like the dose."""
    crit = dose_brackets(prefix_rows, kind=kind, dose_col=dose_col, control_dose=control_dose)
    hi = crit.high.to_numpy(float)
    crit["dose"] = np.where(np.isfinite(hi), np.sqrt(crit.low.to_numpy(float) * hi), hi)
    if base_lrs is not None:
        lr = crit.learner.map(lambda a: float(base_lrs.get(a, np.nan))).to_numpy(float)
        for c in ("dose", "low", "high"):
            crit["lr" if c == "dose" else f"lr_{c}"] = crit[c].to_numpy(float) * lr
    if changes is not None:
        ch = changes[changes.pert_kind.isin([kind, "none"])] if kind is not None and "pert_kind" in changes else changes
        mean = ch.groupby(["learner", "prefix", dose_col])[change].mean().to_dict()
        for c in ("low", "high"):
            crit[f"change_{c}"] = [mean.get((a, p, d), np.nan) for a, p, d in zip(crit.learner, crit.prefix, crit[c],
                                                                                   strict=True)]
        lo, up = crit.change_low.to_numpy(float), crit.change_high.to_numpy(float)
        with np.errstate(invalid="ignore"):
            crit["change_at_dose"] = np.where((lo > 0) & (up > 0), np.sqrt(lo * up), np.nan)
    return crit


# -- claim (c): the paired change of each prefix's outcome with its noise knob ---------------------


def knob_collapse_changes(default, raised, dose: float, *, kind: str = "lr_spike", dose_col: str = "pert_dose"):
    """Claim (c)'s outcome: the paired change
    of each prefix's collapse at ``dose`` (``default`` and ``raised``: :func:`by_prefix`
    rows at the two knob levels). One row per learner and prefix in both: ``collapsed0``, ``collapsed1`` and
    ``direction`` +1 (collapsed at the default knob, not at the raised: buffered), -1 (the reverse), 0
    (the same), NaN without a verdict at either."""
    key = ["learner", "prefix"]

    def at(rows):
        r = rows[(rows[dose_col] == dose) & ((rows.pert_kind == kind) if "pert_kind" in rows else True)]
        return r[key + ["collapsed_prefix"]]

    m = at(default).merge(at(raised), on=key, suffixes=("0", "1")).rename(
        columns={"collapsed_prefix0": "collapsed0", "collapsed_prefix1": "collapsed1"})
    m["direction"] = m.collapsed0 - m.collapsed1
    return m
