"""One row per RL run: its keys (learner, perturbation, seed, prefix, noise knob) and a per-run
summary of its own curve (:func:`summarize`), with group statistics over such rows.

The per-run verdicts here judge each run against its own past (:func:`stabstudy.analysis.events.collapse`);
the study's outcomes judge each fork against its paired control
(:mod:`stabstudy.analysis.studies.rl.outcomes`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
import xarray as xr
from scipy.stats import spearmanr

from stabstudy.analysis import claims as C
from stabstudy.analysis import events, stats
from stabstudy.analysis.studies.rl.curves import eval_curves, run_coord, stop_env_step
from stabstudy.analysis.studies.rl.outcomes import PAIR_KEY
from stabstudy.registry import NOISE_KNOB


def comparison_rows(table, doses: Mapping[str, float]):
    """The rows of :func:`summarize` that the algorithm comparison reads: the unperturbed forks and
    each perturbation kind of ``doses`` at its comparison dose, all at the prefix's own noise knob."""
    keep = table.pert_kind == "none"
    for kind, dose in doses.items():
        keep |= (table.pert_kind == kind) & (table.pert_dose == dose)
    return table[keep & (table.noise_after_fork == "same")]


#: The columns of :func:`run_table` every run has (then each noise knob the runs set, and ``noise``).
KEYS = ("spec_hash", "learner", "seed", "pert_kind", "pert_dose", "pert_start", "status")


def _keys(ds: xr.Dataset) -> list[dict]:
    """:func:`run_table`'s rows as dicts."""
    n = ds.sizes["run"]

    def coord(name, default):
        return ds[name].values if name in ds.coords and ds[name].dims == ("run",) else np.full(n, default, dtype=object)

    names = {k: ds[k].values for k in KEYS if k in ds.coords and ds[k].dims == ("run",)}
    if "spec_hash" not in names:
        names = {"spec_hash": ds["run"].values, **names}  # load_runs: the run coordinate is the spec hash
    prefix = pd.to_numeric(pd.Series(coord("hp_prefix_steps", 0)), errors="coerce").fillna(0).to_numpy()
    after = coord("hp_noise_after_fork", "same")
    rows = []
    for i in range(n):
        row = {k: names[k][i] for k in KEYS if k in names}
        row["prefix_steps"] = int(prefix[i])
        row["noise_after_fork"] = "same" if not isinstance(after[i], int | float) or np.isnan(after[i]) else after[i]
        for knob in dict.fromkeys(NOISE_KNOB.values()):
            if f"hp_{knob}" in ds.coords:
                row[knob] = ds[f"hp_{knob}"].values[i]
        own = row.get(NOISE_KNOB.get(str(row.get("learner")), ""), np.nan)
        row["noise"] = pd.to_numeric(pd.Series([row["noise_after_fork"] if row["noise_after_fork"] != "same"
                                                else own]), errors="coerce").iloc[0]
        rows.append(row)
    return rows


def run_table(ds: xr.Dataset) -> pd.DataFrame:
    """One row per run of ``ds`` (:func:`stabstudy.run.store.load_runs`): its keys (:data:`KEYS` where
    the Dataset has them), ``prefix_steps`` (0: from scratch), ``noise_after_fork`` ("same" where the
    fork kept its prefix's knob), each learner's noise knob the runs set and ``noise`` (the learner's
    own knob in effect during the event: a fork's ``noise_after_fork``, else its knob). What
    :func:`.outcomes.paired_table` pairs forks with their controls by."""
    if "run" not in ds.dims:
        ds = ds.expand_dims(run=[0])
    return pd.DataFrame(_keys(ds))


def summarize(ds: xr.Dataset, *, final_points: int = 3, frac: float = 0.5, recover_frac: float = 0.8,
              window: int | None = None, scale: float | None = None, min_gain_frac: float = 0.1,
              min_evals_after: int = 3, floors: Mapping[str, float] | None = None):
    """One row per run (pandas DataFrame): :func:`run_table`'s keys, then ``pre_return`` (baseline before the perturbation
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
    if "run" not in ds.dims:
        ds = ds.expand_dims(run=[0])
    curves = eval_curves(ds)
    keys = _keys(ds)
    n = curves.sizes["run"]
    starts = curves["pert_start"].values.astype(float) if "pert_start" in curves.coords else np.full(n, np.nan)
    prefix = np.array([k["prefix_steps"] for k in keys])
    learners = run_coord(curves, "learner", "")
    pseudo_all = float(np.nanmedian(starts)) if np.isfinite(starts).any() else \
        float(curves.env_step.values[len(curves.env_step) // 2])
    vals = curves.values
    first = vals[:, 0] if vals.shape[1] else np.array([np.nan])
    if scale is None:
        scale = float(np.nanmax(vals) - np.nanmedian(first)) if np.isfinite(vals).any() else 1.0
    rows = []
    for i, row in enumerate(keys):
        c = eval_curves(ds.isel(run=[i])).isel(run=0).rename(env_step="step")
        peers = starts[(learners == learners[i]) & (prefix == prefix[i])]
        ev = starts[i] if np.isfinite(starts[i]) else (
            float(np.nanmedian(peers)) if np.isfinite(peers).any() else pseudo_all)
        stop = stop_env_step(ds, i) if row.get("status") == "diverged" else None
        floor = (floors or {}).get(str(row.get("spec_hash")))
        res = events.collapse(c, ev, frac=frac, recover_frac=recover_frac, window=window, floor=floor,
                              min_gain=min_gain_frac * scale, min_after=min_evals_after, diverged_at=stop)
        cs, cv = events.as_series(c)
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


def group_summary(table, by: Sequence[str] = ("learner", "pert_kind")):
    """Per group of :func:`summarize` rows: ``n`` (runs with a collapse verdict), IQM of ``pre_return``, ``final_return``,
    ``stability``, collapse fraction ``p_collapse`` with a Clopper-Pearson 95% CI
    (``p_low``, ``p_high``), the number of ``diverged`` runs and of runs already
    broken before the event (``pre_event_invalid``, not in ``n``)."""
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


def paired_effects(table, by: Sequence[str] = ("learner", "pert_kind", "pert_dose"), alpha: float = 0.05):
    """Each perturbed run against its control (same :data:`PAIR_KEY`, no perturbation): per group of
    ``by``, ``n`` (pairs with a collapse verdict), the collapse rate with a Clopper-Pearson interval,
    and :func:`stabstudy.analysis.claims.paired_difference` (paired t-test, bootstrap interval) of
    ``damage`` (final return, perturbed - control; ``damage_low``/``damage_high``, one-sided ``p``
    for "lower"), ``post_damage`` (mean return from the event on) and ``recovery`` (``recovery_steps``,
    perturbed - control, censored at the end of the runs)."""
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
