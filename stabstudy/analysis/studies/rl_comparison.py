"""Notebook 01 (RL algorithm comparison): its summaries and claims computed from its runs.

Its grids are :mod:`stabstudy.analysis.studies.rl_grid` (re-exported here: ``fork_grid``,
``stated_grid`` and their helpers, which notebook 05 and the closed-loop study share).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import xarray as xr

from stabstudy.analysis.studies.rl_grid import (  # noqa: F401 - the grids, re-exported for their callers
    env_step_of_update,
    fork_grid,
    spike_env_steps,
    stated_grid,
    updates_per_rollout,
)
from stabstudy.registry import NOISE_KNOB

if TYPE_CHECKING:
    from stabstudy.analysis.claims import Claim

# -- analysis helpers ------------------------------------------------------------------


def eval_curves(ds: xr.Dataset, env_grid: Sequence[int] | None = None) -> xr.DataArray:
    """Evaluation returns on a common env-step axis: DataArray ``(run, env_step)``.

    ``ds``: from :func:`stabstudy.run.store.load_runs` (dims ``(run, step)``, 2-D
    ``env_step`` coordinate) or one run (dim ``step``). ``perf`` at row ``s`` is the
    return of the policy after ``s`` updates, which is the policy acting from env
    step ``env_step[s]`` until the next update; each run's ``(env_step, perf)``
    pairs are therefore placed on ``env_grid`` (default: the union of those env
    steps) as a step function: the last measured policy at or before each grid
    point (NaN before the first and after a run stopped).
    """
    if "run" not in ds.dims:
        ds = ds.expand_dims(run=[0])
    perf = ds["perf"].transpose("run", "step").values
    env = ds["env_step"]
    when = np.asarray(env.transpose("run", "step").values if "run" in env.dims
                      else np.broadcast_to(env.values, perf.shape), dtype=float)
    pairs = []
    for i in range(perf.shape[0]):
        ok = np.isfinite(perf[i]) & np.isfinite(when[i])
        order = np.argsort(when[i][ok], kind="stable")
        pairs.append((when[i][ok][order], perf[i][ok][order]))
    if env_grid is None:
        env_grid = np.unique(np.concatenate([w for w, _ in pairs])) if pairs else np.array([])
    grid = np.asarray(env_grid, dtype=float)
    out = np.full((perf.shape[0], grid.size), np.nan)
    for i, (w, v) in enumerate(pairs):
        if w.size == 0:
            continue
        idx = np.searchsorted(w, grid, side="right") - 1
        ok = (idx >= 0) & (grid <= w[-1])
        out[i, ok] = v[idx[ok]]
    coords = {c: ("run", ds[c].values) for c in ds.coords if ds[c].dims == ("run",)}
    coords.setdefault("spec_hash", ("run", ds["run"].values))  # load_runs: the run coordinate is the spec hash
    coords["env_step"] = grid.astype(np.int64)
    return xr.DataArray(out, dims=("run", "env_step"), coords=coords, name="perf")


def first_last_returns(ds: xr.Dataset):
    """Per run of ``ds`` (:func:`stabstudy.run.store.load_runs`, dims ``(run, step)``): its first
    evaluation return (``untrained`` for a prefix trained from scratch) and its last (``final``),
    NaN for a run without evaluations. A pandas DataFrame indexed by the run (spec hash)."""
    import pandas as pd

    rows = {}
    for run in ds.run.values:
        perf = ds.perf.sel(run=run).dropna("step").values
        rows[run] = (perf[0], perf[-1]) if perf.size else (np.nan, np.nan)
    return pd.DataFrame.from_dict(rows, orient="index", columns=["untrained", "final"])


def evaluation_spread(ds: xr.Dataset):
    """Per run of ``ds`` (:func:`stabstudy.run.store.load_runs`): ``evaluations`` (rows with a return)
    and the median and largest ``perf_std`` over them (the standard deviation of an evaluation's
    episode returns, seeded starts; NaN with one episode per evaluation). A pandas DataFrame indexed
    by the run, with its ``learner``."""
    import pandas as pd

    rows = {}
    for i, run in enumerate(ds.run.values):
        one = ds.isel(run=i)
        ok = np.isfinite(one["perf"].values)
        sd = one["perf_std"].values[ok] if "perf_std" in ds else np.full(int(ok.sum()), np.nan)
        fin = sd[np.isfinite(sd)]
        rows[str(run)] = {"learner": str(one["learner"].values) if "learner" in ds.coords else "",
                          "evaluations": int(ok.sum()), "perf_std_median": float(np.median(fin)) if fin.size else np.nan,
                          "perf_std_max": float(fin.max()) if fin.size else np.nan}
    return pd.DataFrame.from_dict(rows, orient="index")


def return_reference(prefix_ds: xr.Dataset, fork_curves: xr.DataArray,
                     prefix_of: Mapping[str, str]) -> tuple[dict[str, float], float]:
    """What :func:`summarize` needs for forks: ``floors`` (per fork of ``prefix_of``, fork hash ->
    its prefix's hash: the prefix's untrained return, towards which a collapse falls) and the return
    ``scale`` shared by every stability score (the best evaluation of the prefixes and of
    ``fork_curves``, :func:`eval_curves`, minus the median untrained return of the prefixes)."""
    untrained = first_last_returns(prefix_ds).untrained.to_dict()
    floors = {f: untrained[p] for f, p in prefix_of.items()}
    best = max(np.nanmax(eval_curves(prefix_ds).values), np.nanmax(fork_curves.values))
    return floors, float(best - np.nanmedian(list(untrained.values())))


def comparison_rows(table, doses: Mapping[str, float]):
    """The rows of :func:`summarize` that the algorithm comparison reads: the unperturbed forks and
    each perturbation kind of ``doses`` at its comparison dose, all at the prefix's own noise knob."""
    keep = table.pert_kind == "none"
    for kind, dose in doses.items():
        keep |= (table.pert_kind == kind) & (table.pert_dose == dose)
    return table[keep & (table.noise_after_fork == "same")]


def _stop_env_step(ds: xr.Dataset, i: int) -> float:
    """Last env step run ``i`` recorded (where training stopped; NaN when none)."""
    env = ds["env_step"]
    e = np.asarray(env.isel(run=i).values if "run" in env.dims else env.values, dtype=float)
    return float(np.nanmax(e)) if np.isfinite(e).any() else np.nan


def _run_coord(curves: xr.DataArray, name: str, default: Any = np.nan) -> np.ndarray:
    n = curves.sizes["run"]
    return curves[name].values if name in curves.coords else np.full(n, default, dtype=object)


def summarize(ds: xr.Dataset, *, final_points: int = 3, frac: float = 0.5, recover_frac: float = 0.8,
              window: int | None = None, scale: float | None = None, min_gain_frac: float = 0.1,
              min_evals_after: int = 3, floors: Mapping[str, float] | None = None):
    """One row per run (pandas DataFrame): learner, perturbation, seed, ``prefix_steps`` (0: from
    scratch), noise knobs and ``noise`` (the learner's own knob in effect during the event: a
    fork's ``noise_after_fork``, else its knob), ``pre_return`` (baseline before the perturbation
    start), ``final_return`` (mean of the last ``final_points`` evaluations), ``post_return`` (mean
    of the evaluations from the event on), ``collapsed`` (:func:`stabstudy.analysis.events.collapse`
    with ``frac``/``recover_frac``/``window`` in env steps, ``min_gain =
    min_gain_frac * scale``, so a run that learned little before the event must
    still lose ``(1 - frac) * min_gain_frac`` of the scale, and ``min_after =
    min_evals_after``: a drop counts as irreversible only after that many
    evaluations without recovery; 1 / 0 / NaN = no verdict), ``collapse_state``
    (:data:`stabstudy.analysis.events.COLLAPSE_STATES`), ``pre_event_invalid``
    (the run diverged, was non-finite or had already collapsed before the event:
    left out of every collapse rate and counted separately), ``min_level``,
    ``max_drawdown``, ``recovery_time`` (env steps; NaN when the return never left
    the band: nothing to recover from), ``recovery_state``
    (:data:`stabstudy.analysis.events.RECOVERY_STATES`), ``recovery_steps`` (0 when it never
    left the band, the end of the run when it did not come back: censored there),
    ``stability`` (:func:`stabstudy.analysis.stats.stability_score` with a shared ``scale``: default
    the spread between the median untrained return and the best evaluation over
    all runs; NaN without evaluations after the event). Runs without a
    perturbation use the median perturbation start of the runs of the same learner and
    prefix as a pseudo-event (so baselines get a collapse rate at the same budget). A run with
    status ``diverged`` counts as collapsed when it diverged at or after the event.

    ``floors``: spec hash -> the return a collapse falls towards, for runs whose first
    evaluation is not the untrained policy's (a fork starts trained: pass its prefix's
    untrained return); default the run's first evaluation. Pass ``scale`` with forks too.

    Each run's numbers come from its own evaluations only (its own env steps): on the
    union grid of all runs, the "last points" before an event or at the end would
    include copies of its values placed at other runs' env steps, and a run's verdict
    would depend on which other runs are in ``ds``.
    """
    import pandas as pd

    from stabstudy.analysis import events, stats

    if "run" not in ds.dims:
        ds = ds.expand_dims(run=[0])
    curves = eval_curves(ds)
    n = curves.sizes["run"]
    starts = curves["pert_start"].values.astype(float) if "pert_start" in curves.coords else np.full(n, np.nan)
    prefix = pd.to_numeric(pd.Series(_run_coord(curves, "hp_prefix_steps", 0)), errors="coerce").fillna(0).to_numpy()
    learners = _run_coord(curves, "learner", "")
    pseudo_all = float(np.nanmedian(starts)) if np.isfinite(starts).any() else \
        float(curves.env_step.values[len(curves.env_step) // 2])
    vals = curves.values
    first = vals[:, 0] if vals.shape[1] else np.array([np.nan])
    if scale is None:
        scale = float(np.nanmax(vals) - np.nanmedian(first)) if np.isfinite(vals).any() else 1.0
    after = _run_coord(curves, "hp_noise_after_fork", "same")
    rows = []
    for i in range(n):
        c = eval_curves(ds.isel(run=[i])).isel(run=0).rename(env_step="step")
        peers = starts[(learners == learners[i]) & (prefix == prefix[i])]
        ev = starts[i] if np.isfinite(starts[i]) else (
            float(np.nanmedian(peers)) if np.isfinite(peers).any() else pseudo_all)
        row = {k: curves[k].values[i] for k in ("spec_hash", "learner", "seed", "pert_kind", "pert_dose", "pert_start",
                                                  "status") if k in curves.coords}
        row["prefix_steps"] = int(prefix[i])
        row["noise_after_fork"] = "same" if not isinstance(after[i], int | float) or np.isnan(after[i]) else after[i]
        stop = _stop_env_step(ds, i) if row.get("status") == "diverged" else None
        floor = (floors or {}).get(str(row.get("spec_hash")))
        res = events.collapse(c, ev, frac=frac, recover_frac=recover_frac, window=window, floor=floor,
                              min_gain=min_gain_frac * scale, min_after=min_evals_after, diverged_at=stop)
        cs, cv = events.as_series(c)
        for knob in set(NOISE_KNOB.values()):
            if f"hp_{knob}" in curves.coords:
                row[knob] = curves[f"hp_{knob}"].values[i]
        own = row.get(NOISE_KNOB.get(str(row.get("learner")), ""), np.nan)
        row["noise"] = pd.to_numeric(pd.Series([row["noise_after_fork"] if row["noise_after_fork"] != "same"
                                                else own]), errors="coerce").iloc[0]
        rec_state, rec_time = events.recovery_state(c, ev, abs_tol=0.1 * scale)
        end = float(cs[-1] - ev) if cs.size else np.nan
        row.update(
            event=ev, pre_return=res.baseline, final_return=float(np.mean(cv[-final_points:])) if cv.size else np.nan,
            post_return=float(np.mean(cv[cs >= ev])) if (cs >= ev).any() else np.nan,
            collapsed=res.outcome, collapse_state=res.state, pre_event_invalid=res.pre_event_invalid,
            min_level=res.min_level, max_drawdown=events.max_drawdown(c, start=ev),
            recovery_time=rec_time, recovery_state=rec_state,
            recovery_steps={"never_left": 0.0, "recovered": rec_time, "not_recovered": end}.get(rec_state, np.nan),
            stability=np.nan if res.pre_event_invalid else stats.stability_score(c, ev, scale=scale),
        )
        rows.append(row)
    out = pd.DataFrame(rows)
    out.attrs["scale"] = scale
    return out


def prefix_summary(paired, by: Sequence[str] = ("learner", "pert_kind", "pert_dose"), *, reps: int = 1000,
                   alpha: float = 0.05, seed: int = 0):
    """Per group of ``by`` of paired outcomes (:func:`horizon_outcomes` or ``rl_outcomes.paired_table``
    rows), with the prefix as the unit: ``prefixes`` (with a verdict), ``forks``, ``collapsed``
    (prefixes whose forks mostly collapsed, ``rl_outcomes.by_prefix``) and ``p_collapse`` with a
    Clopper-Pearson interval over prefixes (``p_low``, ``p_high``), the mean ``damage`` with a
    bootstrap interval that resamples prefixes (``damage_low``, ``damage_high``), the design effect
    of the damage (``deff``: how many forks one prefix is worth) and ``no_verdict`` (forks without one)."""
    import pandas as pd

    from stabstudy.analysis import stats
    from stabstudy.analysis.studies import rl_outcomes

    rows = []
    if not len(paired):
        return pd.DataFrame(columns=[*by, "prefixes", "forks", "collapsed", "p_collapse", "p_low", "p_high",
                                     "damage", "damage_low", "damage_high", "deff", "no_verdict"])
    per = rl_outcomes.by_prefix(paired, by=by)
    for key, g in paired.groupby(list(by), sort=True, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        mask = np.logical_and.reduce([per[b] == k for b, k in zip(by, key, strict=True)]) if len(per) else []
        c = per[mask]["collapsed_prefix"].to_numpy(float) if len(per) else np.array([])
        c = c[np.isfinite(c)]
        p, lo, hi = stats.collapse_probability(c, confidence=1 - alpha) if c.size else (np.nan,) * 3
        est, dlo, dhi = rl_outcomes.prefix_bootstrap(g["damage"], g["prefix"], reps=reps, seed=seed)
        rows.append({**dict(zip(by, key, strict=True)), "prefixes": int(c.size), "forks": len(g),
                     "collapsed": int(c.sum()), "p_collapse": p, "p_low": lo, "p_high": hi, "damage": est,
                     "damage_low": dlo, "damage_high": dhi, "deff": rl_outcomes.design_effect(g["damage"], g["prefix"])[1],
                     "no_verdict": int((g["state"] == "no_verdict").sum())})
    return pd.DataFrame(rows)


def stated_outcomes(ds: xr.Dataset, table, **kw: Any):
    """Paired outcomes of the claim as stated (``rl_outcomes.paired_table``): each spiked fresh run
    (rows of ``table``, :func:`summarize` of ``ds``) against the unperturbed run of its seed over
    ``[spike, end of the budget]`` (the control's last evaluation), read at the same env steps; the
    floor is the control's first evaluation (the untrained policy) and the unit its seed (a fresh run
    is its own prefix)."""
    from stabstudy.analysis.studies import rl_outcomes

    if not len(table):
        return rl_outcomes.paired_table(ds, table, horizon={}, floors={}, prefix_of={}, **kw)
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
        end = _stop_env_step(ds, index[str(c)])
        horizon[r.learner] = min(horizon.get(r.learner, np.inf), end - float(r.pert_start))
        floors[r.spec_hash] = float(untrained.get(c, np.nan))
    return rl_outcomes.paired_table(ds, table, horizon=horizon, floors=floors, prefix_of=unit, **kw)


# -- group statistics and the claims ----------------------------------------------------


def group_summary(table, by: Sequence[str] = ("learner", "pert_kind")):
    """Per group of :func:`summarize` rows: ``n`` (runs with a collapse verdict), IQM of ``pre_return``, ``final_return``,
    ``stability``, collapse fraction ``p_collapse`` with a Clopper-Pearson 95% CI
    (``p_low``, ``p_high``), the number of ``diverged`` runs and of runs already
    broken before the event (``pre_event_invalid``, not in ``n``)."""
    import pandas as pd

    from stabstudy.analysis import stats

    rows = []
    for key, g in table.groupby(list(by), sort=True, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        p, lo, hi = stats.collapse_probability(g["collapsed"].values)
        # n: runs with a verdict, the denominator of p_collapse (a run without one is NaN there)
        n = int(np.isfinite(g["collapsed"].to_numpy(float)).sum())
        invalid = g["pre_event_invalid"] if "pre_event_invalid" in g else pd.Series(False, index=g.index)
        rows.append({**dict(zip(by, key, strict=True)), "n": n, "pre_return": stats.iqm(g["pre_return"]),
                     "final_return": stats.iqm(g["final_return"]), "stability": stats.iqm(g["stability"]),
                     "p_collapse": p, "p_low": lo, "p_high": hi,
                     "diverged": int((g.get("status", pd.Series(dtype=str)) == "diverged").sum()),
                     "pre_event_invalid": int(invalid.astype(bool).sum())})
    return pd.DataFrame(rows)


def as_dose_table(table, kind: str = "lr_spike"):
    """The rows of one perturbation kind with the unperturbed runs as its zero-effect dose: factor 1
    for ``lr_spike`` and ``reward_scale`` (a factor of 1 changes nothing), 0 for noise kinds."""
    import pandas as pd

    control = 0.0 if kind.endswith("noise") else 1.0
    base = table[table.pert_kind == "none"].assign(pert_kind=kind, pert_dose=control)
    return pd.concat([table[table.pert_kind == kind], base], ignore_index=True)


def _bracket(c, level: float) -> tuple[float, str]:
    """A :class:`stats.CriticalDose` as (value, where): ``inf`` "above the grid" when the fitted
    probability never reaches ``level`` in the tested doses, ``0`` "below the grid" when it is
    reached at the smallest already, else the dose and "bracketed"."""
    if not len(c.prob):
        return np.nan, "no data"
    if c.prob[0] >= level:
        return 0.0, "below the grid"
    if not np.isfinite(c.dose):
        return np.inf, "above the grid"
    return float(c.dose), "bracketed"


def critical_doses(table, dose_col: str = "pert_dose", level: float = 0.5, reps: int = 1000,
                   confidence: float = 0.95, seed: int = 0):
    """Critical dose (fitted collapse probability ``level``, :func:`stabstudy.analysis.stats.critical_dose`:
    logistic regression on log dose) per learner with a bootstrap interval (runs resampled with
    replacement within each dose). Returns ``(rows, fits)``: a DataFrame (learner, dose, where,
    ci_low, ci_high, bracketed_frac, method, message) with ``where`` "bracketed", "above the grid"
    (never reaches ``level`` up to the largest dose: dose ``inf``) or "below the grid" (reached at the
    smallest: dose 0), the interval's ends likewise; and ``{learner: CriticalDose}`` for plotting.

    A bracketed interval reaches at least the tested doses on either side of the point: between
    two tested doses the fitted curve is the model's, not data (with outcomes that separate
    perfectly there, every resample fits the same curve and the bootstrap interval would be a
    point)."""
    import pandas as pd

    from stabstudy.analysis import stats

    rng = np.random.default_rng(seed)
    rows, fits = [], {}
    for a, g in table.groupby("learner"):
        d, c = g[dose_col].to_numpy(float), g["collapsed"].to_numpy(float)
        ok = np.isfinite(d) & np.isfinite(c)
        d, c = d[ok], c[ok]
        fit = stats.critical_dose(d, c, level=level)
        fits[a] = fit
        value, where = _bracket(fit, level)
        draws = []
        groups = [np.flatnonzero(d == u) for u in np.unique(d)]
        for _ in range(reps if d.size else 0):
            idx = np.concatenate([rng.choice(gi, gi.size) for gi in groups])
            draws.append(_bracket(stats.critical_dose(d[idx], c[idx], level=level), level)[0])
        draws = np.asarray(draws, dtype=float)
        q = (1 - confidence) / 2
        lo, hi = (np.quantile(draws, [q, 1 - q], method="inverted_cdf") if draws.size else (np.nan, np.nan))
        if where == "bracketed":
            tested = np.unique(d[d > 0])
            below, above = tested[tested <= value], tested[tested >= value]
            lo = min(lo, below.max()) if below.size else lo
            hi = max(hi, above.min()) if above.size else hi
        rows.append({"learner": a, "dose": value, "where": where, "ci_low": float(lo), "ci_high": float(hi),
                     "bracketed_frac": float(np.mean(np.isfinite(draws) & (draws > 0))) if draws.size else np.nan,
                     "n": int(d.size), "method": fit.method, "message": fit.message})
    return pd.DataFrame(rows), fits


def dose_response(table, dose_col: str = "pert_dose", level: float = 0.5, reps: int = 1000):
    """Collapse probability per learner and dose, and the critical dose per learner.

    Returns ``(per_dose, critical)``: a DataFrame (learner, dose, n, p_collapse, p_low, p_high,
    ...) and :func:`critical_doses` ``rows`` (with bootstrap intervals, ``reps`` resamples)."""
    per = group_summary(table, by=("learner", dose_col)).rename(columns={dose_col: "dose"})
    return per, critical_doses(table, dose_col, level, reps)[0]


#: Columns that identify a fork's control: the unperturbed fork of the same checkpoint and noise.
PAIR_KEY = ("learner", "seed", "prefix_steps", "noise_after_fork")


def paired_effects(table, by: Sequence[str] = ("learner", "pert_kind", "pert_dose"), alpha: float = 0.05):
    """Each perturbed run against its control (same :data:`PAIR_KEY`, no perturbation): per group of
    ``by``, ``n`` (pairs with a collapse verdict), the collapse rate with a Clopper-Pearson interval,
    and :func:`stabstudy.analysis.claims.paired_difference` (paired t-test, bootstrap interval) of
    ``damage`` (final return, perturbed - control; ``damage_low``/``damage_high``, one-sided ``p``
    for "lower"), ``post_damage`` (mean return from the event on) and ``recovery`` (``recovery_steps``,
    perturbed - control, censored at the end of the runs)."""
    import pandas as pd

    from stabstudy.analysis import claims as C
    from stabstudy.analysis import stats

    key = [k for k in PAIR_KEY if k in table]
    base = table[table.pert_kind == "none"].drop_duplicates(key).set_index(key)
    rows = []
    for gk, g in table[table.pert_kind != "none"].groupby(list(by), sort=True):
        ctrl = base.reindex(pd.MultiIndex.from_frame(g[key].astype(object)) if len(key) > 1 else g[key[0]])
        p, lo, hi = stats.collapse_probability(g["collapsed"].to_numpy(float))
        row = {**dict(zip(by, gk if isinstance(gk, tuple) else (gk,), strict=True)),
               "n": int(np.isfinite(g["collapsed"].to_numpy(float)).sum()), "p_collapse": p, "p_low": lo, "p_high": hi}
        for name, col, direction in (("damage", "final_return", "less"), ("post_damage", "post_return", "less"),
                                     ("recovery", "recovery_steps", "greater")):
            c = C.paired_difference(name, "our own", g[col].to_numpy(float), ctrl[col].to_numpy(float),
                                    direction=direction, alpha=alpha)
            row.update({name: c.effect, f"{name}_low": c.ci[0], f"{name}_high": c.ci[1], f"{name}_p": c.p,
                        f"{name}_pairs": c.n})
        rows.append(row)
    return pd.DataFrame(rows)


def noise_response(table):
    """Controlled stochasticity: per learner and value of its own noise knob
    (:data:`NOISE_KNOB`), collapse probability and IQM stability / final return,
    plus Spearman's rho of stability vs the knob value per learner (``rho``, ``p_value``).
    Larger knob values = more stochasticity for every learner."""
    import pandas as pd
    from scipy.stats import spearmanr

    from stabstudy.analysis import stats

    rows, rhos = [], {}
    for a, g in table.groupby("learner"):
        knob = NOISE_KNOB[a]
        if "noise" not in g:
            if knob not in g:
                continue
            g = g.assign(noise=pd.to_numeric(g[knob], errors="coerce"))
        for v, h in g.groupby("noise"):
            p, lo, hi = stats.collapse_probability(h["collapsed"].values)
            rows.append({"learner": a, "knob": knob, "noise": v, "n": len(h), "p_collapse": p, "p_low": lo,
                         "p_high": hi, "stability": stats.iqm(h["stability"]), "final_return": stats.iqm(h["final_return"])})
        ok = g["noise"].notna() & g["stability"].notna()
        if ok.sum() >= 3 and g.loc[ok, "noise"].nunique() > 1 and g.loc[ok, "stability"].nunique() > 1:
            r = spearmanr(g.loc[ok, "noise"], g.loc[ok, "stability"])
            rhos[a] = (float(r.statistic), float(r.pvalue))
    out = pd.DataFrame(rows)
    if len(out):
        out["rho"] = out["learner"].map(lambda a: rhos.get(a, (np.nan, np.nan))[0])
        out["p_value"] = out["learner"].map(lambda a: rhos.get(a, (np.nan, np.nan))[1])
    return out


def _rate(runs) -> tuple[int, int]:
    """(collapses, runs with a verdict) of :func:`summarize` rows."""
    c = runs["collapsed"].to_numpy(float) if len(runs) else np.array([])
    c = c[np.isfinite(c)]
    return int(c.sum()), int(c.size)


#: Label of each perturbation kind in the claims' wording.
KIND_LABELS = {"lr_spike": "a single learning-rate spike", "action_noise": "action noise",
               "reward_scale": "a reward-scale perturbation", "obs_noise": "observation noise",
               "weight_noise": "weight noise"}


#: The regime of the comparison grid in the claims' wording (the claim as meant).
MEANT = "as meant: after training, forked from the stored checkpoint"


def claims_table(comp, scale: float, *, stated=None, dose=None, noise=None, on_policy: str = "ppo",
                 off_policy: Sequence[str] = ("sac", "td3"), comparable_tol: float = 0.25,
                 decoupling_margin: float = 0.3, alpha: float = 0.05) -> list[Claim]:
    """The claims of the report under test and the study's own, as :class:`stabstudy.analysis.claims.Claim` rows.

    Args:
        comp: :func:`summarize` table of the comparison grid (all perturbation kinds, ``none``
            included): the claim as meant (:data:`MEANT`), the forks of trained prefixes.
        scale: the return scale shared by the stability scores.
        stated: the claim as stated: ``{reading: summarize table}`` of fresh runs with and without
            the spike at "step 2000" under each reading of "step" (None: not run).
        dose: :func:`summarize` rows of the lr-spike dose sweep (None: the pooled "lower critical dose" rows are left out).
        noise: :func:`summarize` rows of the controlled-stochasticity grid, with each
            learner's knob in effect as column ``noise`` (None: not run).
        comparable_tol: equivalence margin of the pre-perturbation returns, as a
            fraction of ``scale``; also the non-inferiority margin of "not worse".
        decoupling_margin: equivalence margin of Spearman's rho for "decoupled".

    Rules (:mod:`stabstudy.analysis.claims`; runs already broken before the event,
    ``pre_event_invalid``, are in no claim); the lr-spike rows once per regime:

    * "X collapses irreversibly after K": :func:`~stabstudy.analysis.claims.rate_comparison`
      of X's collapse rate under K against X's unperturbed rate at the same budget;
    * "Y keeps learning after K": :func:`~stabstudy.analysis.claims.paired_difference`
      of each run's final return over its own pre-perturbation return (greater);
    * "comparable returns before the spike": :func:`~stabstudy.analysis.claims.equivalence`
      (Welch TOST) of the pre-spike returns, margin ``comparable_tol * scale``;
    * "X's final return is not worse than Y's" (unperturbed, as meant): non-inferiority,
      :func:`~stabstudy.analysis.claims.difference` of X's final returns plus the margin
      against Y's (greater; the effect includes the margin);
    * decoupling: :func:`~stabstudy.analysis.claims.correlation` of final return and
      stability over perturbed runs, ``expect="none"`` with ``decoupling_margin``;
    * stochasticity buffers: per learner, rho(noise knob, stability) positive;
    * lower critical dose: the on-policy collapse rate over the whole dose sweep
      against each off-policy one over the same doses and seeds.
    """
    from stabstudy.analysis import claims as C

    paper, own = "source paper: the report under test", "our own"
    rows = []

    def valid(t):  # a run broken before its event says nothing about the event, in any claim
        return t[~t["pre_event_invalid"].fillna(False).astype(bool)] if t is not None and len(t) and \
            "pre_event_invalid" in t else t

    def of(t, **eq):
        return t[np.logical_and.reduce([t[k] == v for k, v in eq.items()])] if t is not None and len(t) else t

    def col(t, c):
        return t[c].to_numpy(float) if t is not None and len(t) and c in t else []

    comp, dose, noise = valid(comp), valid(dose), valid(noise)
    regimes = [(f"as stated: spike at {r}", valid(t), ["lr_spike"]) for r, t in (stated or {}).items()]
    kinds = [k for k in KIND_LABELS if len(comp) and k in set(comp.pert_kind)]
    regimes.append((MEANT, comp, kinds or ["lr_spike"]))
    for regime, table, ks in regimes:
        for kind in ks:
            label = KIND_LABELS[kind]
            on = of(table, pert_kind=kind, learner=on_policy)
            rows.append(C.rate_comparison(
                f"{on_policy.upper()} collapses irreversibly after {label} (collapse rate above its unperturbed "
                f"rate; {regime})", paper, *_rate(on if on is not None else comp.iloc[:0]),
                *_rate(of(table, pert_kind="none", learner=on_policy) if table is not None else comp.iloc[:0]),
                direction="greater", alpha=alpha))
            for a in off_policy:
                r = of(table, pert_kind=kind, learner=a)
                rows.append(C.paired_difference(
                    f"{a.upper()} keeps learning after {label} (final return above its pre-perturbation return; "
                    f"{regime})", paper, col(r, "final_return"), col(r, "pre_return"), direction="greater", alpha=alpha))
                if kind == "lr_spike":
                    rows.append(C.equivalence(
                        f"returns before the spike are comparable: {on_policy.upper()} vs {a.upper()} "
                        f"(within {comparable_tol:g} of the return scale; {regime})", paper, col(on, "pre_return"),
                        col(r, "pre_return"), margin=comparable_tol * scale, relative=False, paired=False, alpha=alpha))
    for a in off_policy:
        margin = comparable_tol * scale
        rows.append(C.difference(
            f"{on_policy.upper()}'s final return is not worse than {a.upper()}'s (unperturbed, non-inferiority margin "
            f"{comparable_tol:g} of the return scale; {MEANT})", paper,
            np.asarray(col(of(comp, pert_kind="none", learner=on_policy), "final_return")) + margin,
            col(of(comp, pert_kind="none", learner=a), "final_return"), direction="greater", alpha=alpha))
    pert = comp[(comp.pert_kind != "none")] if len(comp) else comp
    rows.append(C.correlation("high final return is decoupled from stability (perturbed runs)", own,
                              col(pert, "final_return"), col(pert, "stability"),
                              expect="none", margin=decoupling_margin, alpha=alpha))
    for a in [on_policy, *off_policy]:
        g = of(noise, learner=a)
        rows.append(C.correlation(f"more of {a.upper()}'s own noise ({NOISE_KNOB.get(a, '')}) buffers the spike "
                                  "(higher stability)", own, col(g, "noise"), col(g, "stability") if len(col(g, "noise"))
                                  else [], expect="positive", alpha=alpha))
    for a in off_policy if dose is not None else ():  # pooled over doses and forks: prefer the prefix-level claim (b)
        empty = comp.iloc[:0]
        rows.append(C.rate_comparison(
            f"{on_policy.upper()} has a lower critical lr-spike dose than {a.upper()} "
            "(collapses more often over the same doses and seeds)", own,
            *_rate(of(dose, learner=on_policy) if dose is not None and len(dose) else empty),
            *_rate(of(dose, learner=a) if dose is not None and len(dose) else empty), direction="greater", alpha=alpha))
    return rows


def reliability_table(curves: xr.DataArray, by: Sequence[str] = ("learner", "pert_kind"), window: int = 5,
                      alpha: float = 0.05, smooth: int = 3, final_points: int = 3):
    """Chan et al. 2020 reliability metrics per group of runs of :func:`eval_curves` output.

    Columns: ``dispersion_time`` (median over runs of DT, window ``window``
    evaluations), ``short_term_risk`` (median SRT, CVaR ``alpha`` of differences),
    ``long_term_risk`` (median LRT, CVaR of drawdown), ``dispersion_runs`` (mean
    over evaluation points of DR after a ``smooth``-point moving average),
    ``risk_runs`` (RR: CVaR ``alpha`` of the final returns = mean of the last
    ``final_points`` evaluations).
    """
    import pandas as pd

    from stabstudy.analysis import stats

    c = curves.rename(env_step="step")
    keys = pd.DataFrame({k: c[k].values for k in by})
    rows = []
    for key, idx in keys.groupby(list(by)).groups.items():
        sub = c.isel(run=np.asarray(list(idx)))
        finals = [float(np.mean(v[np.isfinite(v)][-final_points:])) if np.isfinite(v).any() else np.nan
                  for v in sub.values]
        key = key if isinstance(key, tuple) else (key,)
        rows.append({**dict(zip(by, key, strict=True)), "n": sub.sizes["run"],
                     "dispersion_time": float(np.nanmedian(stats.dispersion_across_time(sub, window=window).values)),
                     "short_term_risk": float(np.nanmedian(stats.short_term_risk(sub, alpha=alpha).values)),
                     "long_term_risk": float(np.nanmedian(stats.long_term_risk(sub, alpha=alpha).values)),
                     "dispersion_runs": float(np.nanmean(stats.dispersion_across_runs(sub, smooth=smooth).values))
                     if sub.sizes["run"] > 1 else np.nan,
                     "risk_runs": stats.risk_across_runs(finals, alpha=alpha)})
    return pd.DataFrame(rows)


def run_frame(ds: xr.Dataset, spec_hash: str, channels: Sequence[str], agg: str | None = None):
    """One run of a :func:`stabstudy.run.store.load_runs` Dataset as a pandas DataFrame
    indexed by ``env_step`` (rows of updates; channels absent in the Dataset are skipped).
    ``agg`` (e.g. ``"median"``): aggregate the rows sharing an env step (the updates of
    one on-policy ``train()`` call) with that pandas reduction."""
    import pandas as pd

    one = ds.sel(run=spec_hash)
    env = one["env_step"].values
    ok = np.isfinite(env.astype(float))
    data = {ch: one[ch].values[ok] for ch in channels if ch in one}
    frame = pd.DataFrame(data, index=pd.Index(env[ok].astype(np.int64), name="env_step"))
    return frame.groupby(level=0).agg(agg) if agg else frame
