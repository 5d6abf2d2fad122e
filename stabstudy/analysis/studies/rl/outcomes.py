"""Notebook 01's outcomes: each perturbed fork against its paired control at the same env steps,
over a horizon the algorithm's own learning curve sets, with the independent prefix as the unit.

* :func:`paired_outcome`: collapse, recovery and damage of one perturbed fork against its control
  (same prefix, same continuation), both read at the same env steps. A run that diverged has its
  floor after it stopped (:func:`floored`): never its last, pre-spike evaluations.
* :func:`paired_table`: :func:`paired_outcome` for every perturbed fork of a run table
  (:func:`stabstudy.analysis.studies.rl.runs.summarize`); :func:`horizon_outcomes` judges each fork over what
  it ran (H, or its short window), :func:`stated_outcomes` the claim as stated (fresh runs).
* The prefix as the unit: :func:`by_prefix` (one row per prefix: the mean over its forks) and
  :func:`prefix_summary` (rates and damage over prefixes, :func:`stabstudy.analysis.stats.cluster_bootstrap`).
* Each prefix's critical dose: :func:`dose_brackets` (its interval-censored bracket from its forks),
  :func:`bisection_doses` (the next forks inside it), :func:`prefix_critical_doses` (the bracket's
  geometric midpoint, also as an absolute learning rate, :func:`base_lr`, and as the policy change it
  caused); claim (c)'s paired changes of it with the noise knob: :func:`knob_dose_changes`,
  :func:`knob_collapse_changes`.
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
from stabstudy.analysis.studies.rl.design import geometric_points
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
    ``onset``: the env step of the first point in the window whose level is below ``frac`` (where a
    collapse is first seen against the control; NaN for ``no_drop`` and ``no_verdict``).
    """
    end = float(event) + float(horizon)
    out = {"state": "no_verdict", "collapsed": np.nan, "recovery_time": np.nan, "damage": np.nan,
           "min_level": np.nan, "onset": np.nan, "end": end, "reason": ""}
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
    ok = np.isfinite(t) & np.isfinite(c)
    grid, t, c = grid[ok], t[ok], c[ok]
    if grid.size < min_after + 1:
        return {**out, "reason": f"{grid.size} common evaluations in the window, fewer than {min_after + 1}"}
    level = (t - floor) / np.maximum(c - floor, min_gain)
    below = level < frac
    out.update(damage=float(np.mean(t[-final_points:] - c[-final_points:])), min_level=float(level.min()))
    if not below.any():
        return {**out, "state": "no_drop", "collapsed": 0.0}
    out["onset"] = float(grid[np.argmax(below)])
    if (level[-min_after:] >= recover_frac).all():
        back = level >= recover_frac
        last_bad = np.flatnonzero(~back)[-1]
        return {**out, "state": "recovered", "collapsed": 0.0, "recovery_time": float(grid[last_bad + 1] - event)}
    return {**out, "state": "collapsed", "collapsed": 1.0}


def paired_table(ds: xr.Dataset, table, *, horizon: Mapping[str, float], floors: Mapping[str, float],
                 prefix_of: Mapping[str, str], **kw: Any):
    """:func:`paired_outcome` of every perturbed row of ``table`` (:func:`.runs.summarize` of the
    runs of ``ds``, a ``load_runs`` Dataset) against its control (the unperturbed fork with the
    same :data:`PAIR_KEY`). ``horizon``: per learner (:func:`.design.horizons`); ``floors``: per
    run, its prefix's untrained return; ``prefix_of``: run -> its prefix's hash (the unit).
    One row per perturbed run: its keys (``noise_after_fork`` among them: the knob its fork and control
    ran with), ``control``, ``prefix``, ``event``, ``horizon`` and the outcome."""
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
                "event": float(r.pert_start),
                "horizon": float(horizon.get(a, np.nan))}
        if ctrl is None or str(ctrl) not in index:
            rows.append({**base, "state": "no_verdict", "collapsed": np.nan, "reason": "no paired control"})
            continue
        stop = stop_env_step(ds, index[h]) if r.get("status") == "diverged" else None
        res = paired_outcome(eval_curves(ds.isel(run=index[h])).isel(run=0),
                             eval_curves(ds.isel(run=index[str(ctrl)])).isel(run=0), base["event"], base["horizon"],
                             floor=float(floors.get(h, np.nan)), diverged_at=stop, **kw)
        rows.append({**base, **res})
    return pd.DataFrame(rows)


def stated_outcomes(ds: xr.Dataset, table, **kw: Any):
    """Paired outcomes of the claim as stated (:func:`paired_table`): each spiked fresh run
    (rows of ``table``, :func:`.runs.summarize` of ``ds``) against the unperturbed run of its seed over
    ``[spike, end of the budget]`` (the control's last evaluation), read at the same env steps; the
    floor is the control's first evaluation (the untrained policy) and the unit its seed (a fresh run
    is its own prefix)."""
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
        end = stop_env_step(ds, index[str(c)])
        horizon[r.learner] = min(horizon.get(r.learner, np.inf), end - float(r.pert_start))
        floors[r.spec_hash] = float(untrained.get(c, np.nan))
    return paired_table(ds, table, horizon=horizon, floors=floors, prefix_of=unit, **kw)


# -- the drop rule and the outcomes over what each fork ran ----------------------------------------


def dropped_forks(short_outcomes, table) -> list[str]:
    """Spec hashes of the short forks to run on to H (:func:`.design.to_horizon`): those whose return fell
    below the paired control's (``collapse_frac`` of its gain) inside their short window.

    ``short_outcomes``: :func:`paired_table` of the short forks
    with ``horizon`` = their window; a drop is state ``collapsed`` or ``recovered`` there (a return
    that came back within the window may fall again). ``table``: :func:`.runs.summarize` of the same runs
    (their ``status``). A fork that diverged is not run on: it stopped, and it is at its floor from
    then on over any horizon. No verdict in the window (no control, too few evaluations) extends
    nothing: that fork has no verdict over H either, and says why."""
    if not len(short_outcomes):
        return []
    diverged = set(table.spec_hash[table["status"] == "diverged"]) if "status" in table else set()
    drop = short_outcomes.state.isin(["collapsed", "recovered"]) & ~short_outcomes.spec_hash.isin(diverged)
    return [str(h) for h in short_outcomes.spec_hash[drop]]


def horizon_outcomes(ds: xr.Dataset, table, *, horizon: Mapping[str, float], window: Mapping[str, float],
                     long: Collection[str], floors: Mapping[str, float], prefix_of: Mapping[str, str], **kw: Any):
    """Paired outcomes (:func:`paired_table`) of every fork of
    ``table``, each over what it ran: a fork that ran to its event + H (``long``: its spec hash) or
    diverged (at its floor after it stopped) is judged over ``horizon`` (per arm); a short fork over
    its ``window`` (per arm), where it did not drop (``no_drop``: not collapsed), and a short fork
    that dropped there but was not run to H has no verdict (with that reason). Column
    ``judged_over``: ``"H"`` or ``"short window"``; ``dropped``: a short fork whose return fell below
    ``frac`` of the control's gain inside its window (what :func:`dropped_forks` runs on to H)."""
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


def bisection_doses(per_prefix, *, points: int = 1, kind: str | None = "lr_spike", dose_col: str = "pert_dose",
                    control_dose: float = CONTROL_DOSE):
    """The next doses to fork each prefix at, inside its bracket (:func:`dose_brackets`), as a tidy
    table ``(learner, prefix, dose, low, high, where)``: the ``points`` doses that split the bracket
    into equal steps of log dose (:func:`.design.geometric_points`,
    3 significant digits).

    Two ways to spend two bisection forks per prefix (the notebook chooses): ``points=2`` once (both
    forks in one round; the bracket shrinks to ``(high / low) ** (1 / 3)``, 1.49 for the grid's 10/3)
    or ``points=1`` twice (two rounds, the second on the outcomes of the first: ``(high / low) **
    (1 / 4)``, 1.35). Prefixes above the grid get none (right-censored: no upper end to bisect
    towards; they rank above every bracketed prefix in :func:`critical_dose_claim`), nor those
    without data; one below the grid is bisected between the control and its smallest dose. A
    dose the prefix was already forked at is not proposed again."""
    tested = {(a, p): set(g[dose_col].to_numpy(float)) for (a, p), g in _of_kind(per_prefix, kind, dose_col)
              .groupby(["learner", "prefix"])} if len(per_prefix) else {}
    rows = []
    for r in dose_brackets(per_prefix, kind=kind, dose_col=dose_col, control_dose=control_dose).itertuples():
        if r.where not in ("bracketed", "below the grid"):
            continue
        for d in geometric_points(r.low, r.high, points):
            if r.low < d < r.high and d not in tested.get((r.learner, r.prefix), ()):
                rows.append({"learner": r.learner, "prefix": r.prefix, "dose": d, "low": r.low, "high": r.high,
                             "where": r.where})
    return pd.DataFrame(rows, columns=["learner", "prefix", "dose", "low", "high", "where"])


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


def knob_dose_changes(default, raised):
    """Claim (c)'s outcome, rule 1: the paired change of each prefix's critical dose when its noise
    knob is raised (``default`` and ``raised``: :func:`prefix_critical_doses` of the same prefixes at
    the default knob and at the raised one; each bisected at its own knob). One row per learner and
    prefix in both: ``low0``/``high0``/``dose0`` and ``low1``/``high1``/``dose1``, ``log10_change``
    (log10 of dose1 / dose0; NaN when both are above the grid) and ``direction``: +1 when the raised
    knob's bracket lies wholly above the default's (``low1 >= high0``), -1 wholly below (``high1 <=
    low0``), 0 when the brackets overlap (unresolved: the design cannot tell; both above the grid
    too), NaN when either has no data."""
    key = ["learner", "prefix"]
    cols = ["low", "high", "dose", "where"]
    m = default[key + cols].merge(raised[key + cols], on=key, suffixes=("0", "1"))
    lo0, hi0, lo1, hi1 = (m[c].to_numpy(float) for c in ("low0", "high0", "low1", "high1"))
    missing = (m.where0 == "no data") | (m.where1 == "no data")
    direction = np.where(lo1 >= hi0, 1.0, np.where(hi1 <= lo0, -1.0, 0.0))
    m["direction"] = np.where(missing, np.nan, direction)
    with np.errstate(invalid="ignore", divide="ignore"):
        m["log10_change"] = np.log10(m.dose1.to_numpy(float) / m.dose0.to_numpy(float))
    return m.drop(columns=["where0", "where1"])


def knob_collapse_changes(default, raised, dose: float, *, kind: str = "lr_spike", dose_col: str = "pert_dose"):
    """Claim (c)'s outcome, rule 2 (one dose instead of a bisection per knob level): the paired change
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
