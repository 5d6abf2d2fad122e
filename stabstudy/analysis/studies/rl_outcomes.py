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
  :func:`prefix_bootstrap` (an interval that resamples prefixes, not forks), :func:`design_effect`.
* Claim (a), "PPO collapses at a dose where SAC and TD3 do not": :func:`collapse_at_dose_claims`.
* Claim (b), "PPO's critical dose is lower": :func:`dose_brackets` (each prefix's interval-censored
  bracket from its grid forks), :func:`bisection_doses` (the next forks inside it),
  :func:`prefix_critical_doses` (the bracket's geometric midpoint, also as an absolute learning rate,
  :func:`base_lr`, and as the policy change it caused, :func:`policy_change_table`),
  :func:`critical_dose_claims` (one-sided Mann-Whitney tests over prefixes, :func:`critical_dose_claim`,
  with their power).
* Claim (c), "more of the learner's own noise buffers the spike", over the same prefixes:
  :mod:`stabstudy.analysis.studies.rl_noise`.
* Manipulation checks (:func:`spiked_updates`, :func:`spike_policy_change`, :func:`checked`; the
  noise knob's: :func:`stabstudy.analysis.studies.rl_noise.knob_changed`): a perturbation that changed
  nothing makes its claim ``not tested``, with the reason.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import xarray as xr

from stabstudy.analysis.claims import Claim, all_of, not_tested

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
    ``onset``: the env step of the first point in the window whose level is below ``frac`` (where a
    collapse is first seen against the control; NaN for ``no_drop`` and ``no_verdict``).
    """
    end = float(event) + float(horizon)
    out = {"state": "no_verdict", "collapsed": np.nan, "recovery_time": np.nan, "damage": np.nan,
           "min_level": np.nan, "onset": np.nan, "end": end, "reason": ""}
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
    out["onset"] = float(grid[np.argmax(below)])
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
    One row per perturbed run: its keys (``noise_after_fork`` among them: the knob its fork and control
    ran with), ``control``, ``prefix``, ``event``, ``horizon`` and the outcome."""
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
                "pert_kind": r.pert_kind, "pert_dose": r.pert_dose, "noise_after_fork": r.get("noise_after_fork", "same"),
                "event": float(r.pert_start),
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
    import pandas as pd

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
    into equal steps of log dose (:func:`stabstudy.analysis.studies.rl_design.geometric_points`,
    3 significant digits).

    Two ways to spend two bisection forks per prefix (the notebook chooses): ``points=2`` once (both
    forks in one round; the bracket shrinks to ``(high / low) ** (1 / 3)``, 1.49 for the grid's 10/3)
    or ``points=1`` twice (two rounds, the second on the outcomes of the first: ``(high / low) **
    (1 / 4)``, 1.35). Prefixes above the grid get none (right-censored: no upper end to bisect
    towards; they rank above every bracketed prefix in :func:`critical_dose_claim`), nor those
    without data; one below the grid is bisected between the control and its smallest dose. A
    dose the prefix was already forked at is not proposed again."""
    import pandas as pd

    from stabstudy.analysis.studies.rl_design import geometric_points

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
    from stabstudy.hparams import defaults
    from stabstudy.registry import hparams_class

    return float((hparams or {}).get("lr", defaults(hparams_class("rl", learner))["lr"]))


def policy_change_table(ds: xr.Dataset, rows, *, duration: Mapping[str, float], prefix_of: Mapping[str, str],
                        control_dose: float = CONTROL_DOSE):
    """:func:`spike_policy_change` of every run of ``rows`` (``rl_comparison.summarize`` rows of the runs
    of ``ds``, a ``load_runs`` Dataset: perturbed forks and their controls) over its spike window
    (``pert_start``, ``duration[learner]`` env steps); a control (``pert_kind`` "none") over the window
    of the perturbed forks of its prefix (their median start), at dose ``control_dose``. One row per
    run: ``spec_hash``, ``learner``, ``prefix`` (``prefix_of``), ``pert_kind``, ``pert_dose`` and the
    measured change: what :func:`prefix_critical_doses` reads as ``changes``."""
    import pandas as pd

    rows = rows.assign(prefix=rows.spec_hash.map(lambda h: prefix_of.get(str(h))))
    starts = rows[rows.pert_kind != "none"].groupby(["learner", "prefix"]).pert_start.median().to_dict()
    out = []
    for r in rows.itertuples():
        control = r.pert_kind == "none"
        start = starts.get((r.learner, r.prefix), np.nan) if control else float(r.pert_start)
        if not np.isfinite(start) or r.learner not in duration:
            continue
        out.append({"spec_hash": r.spec_hash, "learner": r.learner, "prefix": r.prefix, "pert_kind": r.pert_kind,
                    "pert_dose": control_dose if control else float(r.pert_dose),
                    **spike_policy_change(ds.sel(run=r.spec_hash), start, float(duration[r.learner]))})
    return pd.DataFrame(out)


def prefix_critical_doses(prefix_rows, dose_col: str = "pert_dose", *, kind: str | None = "lr_spike",
                          control_dose: float = CONTROL_DOSE, base_lrs: Mapping[str, float] | None = None,
                          changes=None, change: str = "update_path"):
    """Each prefix's own critical dose (:func:`dose_brackets` of its :func:`by_prefix` rows): ``dose``
    is the geometric midpoint of its bracket ``(low, high]`` (``inf`` above the grid, where it ranks
    above every bracketed dose; NaN without data). One row per learner and prefix, however many forks
    each prefix has: the prefix is the unit.

    ``base_lrs`` (learner -> the lr the factor multiplies, :func:`base_lr`): ``lr``, ``lr_low``,
    ``lr_high``, the same as an absolute learning rate. ``changes`` (:func:`policy_change_table`):
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


#: The least arrangements of a two-sample rank test computed exactly (``scipy.stats.PermutationMethod``
#: enumerates them all, ties included); beyond, 9,999 random ones (8 vs 8 prefixes: 12,870, exact).
EXACT_ARRANGEMENTS = 20_000


def rank_test_p(a: Sequence[float], b: Sequence[float], alternative: str, *, seed: int = 0) -> float:
    """One-sided Mann-Whitney U p-value of ``a`` against ``b`` (``alternative`` "less": ``a`` lower),
    by the permutation distribution of U given the ties (exact up to :data:`EXACT_ARRANGEMENTS`
    arrangements, else 9,999 random ones seeded with ``seed``): the normal approximation is not
    trustworthy for the few prefixes and the many ties (every "above the grid" is one value) here."""
    from math import comb

    from scipy import stats

    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    n = np.inf if comb(a.size + b.size, a.size) <= EXACT_ARRANGEMENTS else 9999
    method = stats.PermutationMethod(n_resamples=n, rng=np.random.default_rng(seed))
    return float(stats.mannwhitneyu(a, b, alternative=alternative, method=method).pvalue)


def critical_dose_claim(claim: str, source: str, lower: Sequence[float], higher: Sequence[float], *,
                        alpha: float = 0.05, min_n: int = 3, lower_high: Sequence[float] | None = None,
                        higher_low: Sequence[float] | None = None, power: str = "", seed: int = 0) -> Claim:
    """Claim: the prefixes of ``lower`` have lower critical doses than those of ``higher`` (one value
    per prefix, :func:`prefix_critical_doses`; ``inf`` = above the grid, ranked above every finite
    value): a one-sided Mann-Whitney U test over prefixes (:func:`rank_test_p`). ``supported`` when
    "lower" rejects at ``alpha``, ``not supported`` when "greater" does, else ``inconclusive``; no
    prefix in an arm: ``not tested``; fewer than ``min_n`` in one, or so few that even complete
    separation cannot reach ``alpha``: ``inconclusive``, saying so.

    The values are the brackets' midpoints; ``lower_high`` / ``higher_low`` (each arm's bracket end
    least favourable to the claim, same order) add the p-value at those ends to the reason: how much
    the verdict leans on where within its bracket each prefix's dose lies. ``power``: a sentence on
    the test's power, appended to the reason. ``effect``: log10 of the ratio of the medians (NaN when
    one is above the grid)."""
    from stabstudy.analysis.studies.rl_design import smallest_p

    a, b = np.asarray(lower, dtype=float), np.asarray(higher, dtype=float)
    keep_a, keep_b = ~np.isnan(a), ~np.isnan(b)
    a, b = a[keep_a], b[keep_b]
    test = "Mann-Whitney U over prefixes (one-sided, permutation); effect: log10 ratio of median critical doses"
    n = int(a.size + b.size)
    tail = f"; {power}" if power else ""
    if min(a.size, b.size) == 0:
        return not_tested(claim, source, "no prefix-level critical doses", n=n)
    if min(a.size, b.size) < min_n:
        return Claim(claim, source, "inconclusive", f"{a.size} vs {b.size} prefixes, fewer than {min_n}{tail}", n=n,
                     test=test)
    if smallest_p(a.size, b.size) >= alpha:
        return Claim(claim, source, "inconclusive", f"{a.size} vs {b.size} prefixes: the smallest attainable p is "
                     f"{smallest_p(a.size, b.size):.3g}, not below alpha {alpha:.3g}{tail}", n=n, test=test)
    if np.all(np.concatenate([a, b]) == a[0]):
        return Claim(claim, source, "inconclusive", f"every prefix has the same critical dose{tail}", n=n, test=test)
    p_for = rank_test_p(a, b, "less", seed=seed)
    p_against = rank_test_p(a, b, "greater", seed=seed)
    verdict = "supported" if p_for < alpha else "not supported" if p_against < alpha else "inconclusive"
    med_a, med_b = float(np.median(a)), float(np.median(b))
    worst = ""
    if lower_high is not None and higher_low is not None:
        wa = np.asarray(lower_high, dtype=float)[keep_a]
        wb = np.asarray(higher_low, dtype=float)[keep_b]
        worst = f"; at the brackets' ends least favourable to it p = {rank_test_p(wa, wb, 'less', seed=seed):.3g}"

    def fmt(m, x):
        return f"above the grid ({int(np.isinf(x).sum())} of {x.size})" if np.isinf(m) else f"{m:.3g}"

    reason = (f"median critical dose {fmt(med_a, a)} ({a.size} prefixes) vs {fmt(med_b, b)} ({b.size}); one-sided "
              f"p = {p_for:.3g}" + (f", against: p = {p_against:.3g}" if verdict == "not supported" else "")
              + worst + tail)
    effect = float(np.log10(med_a / med_b)) if np.isfinite(med_a) and np.isfinite(med_b) else np.nan
    return Claim(claim, source, verdict, reason, effect, n=n, test=test, p_for=p_for, p_against=p_against)


#: Each :func:`prefix_critical_doses` value claim (b) can test, with its bracket's columns.
CRITICAL_VALUES = {"dose": ("low", "high"), "lr": ("lr_low", "lr_high"),
                   "change_at_dose": ("change_low", "change_high")}


def critical_dose_claims(crit, *, on_policy: str = "ppo", off_policy: Sequence[str] = ("sac", "td3"),
                         value: str = "dose", spiked: Mapping[str, int] | None = None, alpha: float = 0.05,
                         min_n: int = 3, planning: tuple[float, float, float] = (5.0, 50.0, 0.4),
                         bisections: int = 2, sims: int = 400, seed: int = 0) -> list[Claim]:
    """Claim (b): "``on_policy``'s critical lr-spike dose is lower than each ``off_policy`` learner's",
    over prefixes (``crit``: :func:`prefix_critical_doses`, one row per prefix: forks of one prefix
    are one value).

    ``value``: ``"dose"`` (the factor), ``"lr"`` (the absolute learning rate: needs ``base_lrs``) or
    ``"change_at_dose"`` (the policy change it caused: needs ``changes``); :data:`CRITICAL_VALUES`.
    One :func:`critical_dose_claim` per off-policy learner at ``alpha / len(off_policy)``, then the
    joint row: ``supported`` only when every comparison is, ``not supported`` when any is, else
    ``inconclusive``. ``spiked`` (learner -> median spiked updates, :func:`spiked_updates`): a learner
    the spike reached no update of is ``not tested``. Every reason states its power
    (:func:`~stabstudy.analysis.studies.rl_design.critical_dose_power` at the ``planning`` medians of
    the two arms and spread, in decades, with ``bisections`` midpoints, for its numbers of prefixes;
    for ``value="dose"`` only: the planning is in dose units)."""
    from stabstudy.analysis.studies.rl_design import critical_dose_power

    if value not in CRITICAL_VALUES:
        raise ValueError(f"value must be one of {', '.join(CRITICAL_VALUES)}; got {value!r}")
    if value not in crit:
        raise ValueError(f"crit has no column {value!r}: pass base_lrs (lr) or changes (change_at_dose) to "
                         "prefix_critical_doses")
    lo_col, hi_col = CRITICAL_VALUES[value]
    level = alpha / max(1, len(off_policy))
    label = {"dose": "critical lr-spike dose", "lr": "critical learning rate (dose x base lr)",
             "change_at_dose": "policy change at its critical lr-spike dose"}[value]

    def arm(a):
        return crit[crit.learner == a]

    on = arm(on_policy)
    rows = []
    for a in off_policy:
        off = arm(a)
        n1, n2 = int(on[value].notna().sum()), int(off[value].notna().sum())
        if value == "dose":
            pw = critical_dose_power(n1, n2, medians=planning[:2], sd=planning[2], bisections=bisections, alpha=level,
                                     sims=sims, seed=seed)
            power = (f"power {pw:.2f} at planning medians x{planning[0]:g} vs x{planning[1]:g}, spread {planning[2]:g} "
                     f"decades, {bisections} bisections, {n1} and {n2} prefixes, alpha {level:.3g} (simulated, {sims} "
                     "draws)")
        else:
            power = "power not computed: the planning is in dose units (see the dose row)"
        claim = critical_dose_claim(f"{on_policy.upper()}'s {label} is lower than {a.upper()}'s (each prefix's own, "
                                    "bracketed by bisection; over prefixes)", "source paper: the report under test",
                                    on[value], off[value], alpha=level, min_n=min_n, lower_high=on[hi_col],
                                    higher_low=off[lo_col], power=power, seed=seed)
        missing = [x for x in (on_policy, a) if spiked is not None and int(spiked.get(x, 0)) == 0]
        rows.append(checked(claim, not missing, f"the perturbation reached no update of {', '.join(m.upper() for m in missing)}"))
    others = " and ".join(x.upper() for x in off_policy)
    return [*rows, intersection(f"{on_policy.upper()}'s {label} is lower than {others}'s (every comparison must hold)",
                                rows, off_policy, int(crit[crit.learner.isin([on_policy, *off_policy])][value].notna().sum()),
                                "intersection of one-sided Mann-Whitney tests")]


# -- manipulation checks --------------------------------------------------------------------


#: Per-update count names of :func:`spiked_updates`: ``updates`` is the primary optimizer's (off-policy the
#: critic, PPO/A2C the policy), then one per optimizer of a multi-optimizer Monitor.
SPIKED_COUNTS = {"": "updates", "critic": "critic_updates", "actor": "actor_updates", "ent_coef": "ent_coef_updates"}


def _window(run: xr.Dataset, start: float, duration: float) -> np.ndarray:
    """Rows of ``run`` with ``env_step`` in ``[start, start + duration)``, past its first row (a fork's
    first row is its prefix's last update, made before the window)."""
    env = np.asarray(run["env_step"].values, dtype=float)
    inside = (env >= start) & (env < start + duration)
    inside[:1] = False
    return inside


def _measured(run: xr.Dataset, channel: str) -> bool:
    """Whether ``run`` holds a finite value of ``channel``."""
    return channel in run and bool(np.isfinite(np.asarray(run[channel].values, dtype=float)).any())


def spiked_updates(run: xr.Dataset, start: float, duration: float, *, rtol: float = 1e-6) -> dict[str, int]:
    """Gradient updates of one run (dim ``step``) that its lr spike reached, per optimizer: rows with
    ``env_step`` in ``[start, start + duration)`` (past the run's first row) where the learning rate the
    optimizer actually applied (``lr``, ``lr_<optimizer>``: recorded on every update it made, whatever
    the Monitor's ``every``) differs by more than ``rtol`` from its median outside the window.

    Keys (:data:`SPIKED_COUNTS`, those the run measured): ``updates`` (the primary optimizer: the
    critic off-policy, the policy for PPO/A2C), ``critic_updates``, ``actor_updates`` (TD3's delayed
    actor steps every ``policy_delay`` updates: about half the critic's), ``ent_coef_updates`` (SAC's
    entropy coefficient: 0 unless ``spike_ent_coef``). A run without the ``lr`` channel (no Monitor):
    ``updates`` = every row in the window. Rows a run thinned (``log_every`` > 1) are not counted."""
    inside = _window(run, start, duration)
    if "lr" not in run:
        return {"updates": int(inside.sum())}
    out = {}
    for opt, name in SPIKED_COUNTS.items():
        ch = f"lr_{opt}" if opt else "lr"
        if ch not in run:
            continue
        lr = np.asarray(run[ch].values, dtype=float)
        base = lr[~inside & np.isfinite(lr)]
        if not base.size:  # nothing outside the window to compare with: every update in it counts as reached
            out[name] = int((inside & np.isfinite(lr)).sum())
            continue
        ref = float(np.median(base))
        out[name] = int((inside & np.isfinite(lr) & (np.abs(lr - ref) > rtol * abs(ref))).sum())
    return out


def spike_policy_change(run: xr.Dataset, start: float, duration: float) -> dict[str, float]:
    """How much one run's policy moved in ``[start, start + duration)`` (env steps; past its first
    row), the spike's window, or the same window of a control fork:

    * ``policy_updates``: updates of the policy's optimizer in the window (rows where it applied a
      learning rate: ``lr_actor`` off-policy, ``lr`` for PPO/A2C);
    * ``update_norm``: the mean L2 norm of those updates (``update_norm_actor`` / ``update_norm``,
      over the rows the Monitor measured them: every ``monitor_every``-th);
    * ``update_path``: ``update_norm x policy_updates``, the length of the path the policy's
      parameters travelled (an estimate when the Monitor skipped rows);
    * ``relative_path``: the same with ``update_ratio`` (update / parameter norm): comparable
      across network sizes;
    * ``kl``: PPO's mean ``approx_kl`` of the window's ``train()`` calls (nats; NaN for learners
      without it).

    NaN where the run lacks the channel or has no measured row in the window."""
    inside = _window(run, start, duration)
    # by values, not by name: in a Dataset of PPO, SAC and TD3 runs every run carries the actor's
    # variables, all NaN for PPO (reading them gave PPO no policy change at all)
    sfx = "_actor" if _measured(run, "update_norm_actor") else ""

    def mean(ch):
        if ch not in run:
            return np.nan
        v = np.asarray(run[ch].values, dtype=float)[inside]
        v = v[np.isfinite(v)]
        return float(v.mean()) if v.size else np.nan

    lr_ch = f"lr{sfx}" if f"lr{sfx}" in run else None
    n = int((inside & np.isfinite(np.asarray(run[lr_ch].values, dtype=float))).sum()) if lr_ch else int(inside.sum())
    norm, ratio = mean(f"update_norm{sfx}"), mean(f"update_ratio{sfx}")
    return {"policy_updates": n, "update_norm": norm, "update_path": norm * n, "relative_path": ratio * n,
            "kl": mean("approx_kl")}


def intersection(claim: str, rows: Sequence[Claim], names: Sequence[str], n: int, test: str) -> Claim:
    """The claim that every one of ``rows`` (one per name of ``names``) holds (:func:`~stabstudy.analysis.claims.all_of`)."""
    return all_of(claim, "source paper: the report under test", rows, [a.upper() for a in names], n=n, test=test)


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
    others = " and ".join(x.upper() for x in off_policy)
    return [*rows, intersection(f"{on_policy.upper()} collapses at x{dose:g} where {others} do not (every comparison must hold)",
                                rows, off_policy, sum(r.n for r in rows), "intersection of one-sided Boschloo tests")]


def replace_reason(claim: Claim, reason: str) -> Claim:
    """``claim`` with another reason (same verdict and numbers)."""
    from dataclasses import replace

    return replace(claim, reason=reason)
