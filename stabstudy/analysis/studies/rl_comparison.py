"""Notebook 01 (RL algorithm comparison): its grids, summaries and claims computed from its runs."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import xarray as xr

from stabstudy.hparams import defaults
from stabstudy.interventions.perturb import Perturbation
from stabstudy.registry import NOISE_KNOB, ON_POLICY, hparams_class
from stabstudy.spec import RunSpec

if TYPE_CHECKING:
    from stabstudy.analysis.claims import Claim

# -- grids -----------------------------------------------------------------------------

#: Default dose per perturbation kind for the comparison grid.
DEFAULT_DOSES = {"lr_spike": 10.0, "action_noise": 0.5, "obs_noise": 0.5, "reward_scale": 10.0, "weight_noise": 0.5}


def perturbation(kind: str, start: int, duration: int, dose: float | None = None, learner: str = "sac",
                 hparams: Mapping[str, Any] | None = None) -> tuple[Perturbation, ...]:
    """One perturbation (empty for ``"none"``). On-policy ``lr_spike`` windows are
    widened to at least one rollout (``n_steps``) so they contain an update."""
    if kind == "none":
        return ()
    dose = DEFAULT_DOSES.get(kind, 1.0) if dose is None else float(dose)
    if kind == "lr_spike" and learner in ON_POLICY:
        n_steps = int({**defaults(hparams_class("rl", learner)), **(hparams or {})}["n_steps"])
        duration = max(duration, n_steps)
    if kind in ("weight_noise", "reinit_layer"):
        duration = max(duration, 1)
    return (Perturbation(kind, int(start), int(duration), dose),)


def comparison_grid(algos: Sequence[str], perturbations: Sequence[str], seeds: Iterable[int], steps: int, *,
                    task: str = "HalfCheetah-v5", start: int | None = None, duration: int | None = None,
                    doses: Mapping[str, float] | None = None, hparams: Mapping[str, Mapping[str, Any]] | None = None,
                    common_hparams: Mapping[str, Any] | None = None, eval_every: int = 0,
                    log_every: int = 1) -> list[RunSpec]:
    """Specs for algorithms x perturbation kinds (``"none"`` = baseline) x seeds.

    ``start`` (default ``steps // 2``) and ``duration`` (default ``steps // 20``) in
    env steps; ``doses`` per kind (default :data:`DEFAULT_DOSES`); ``hparams`` per
    algorithm merged over ``common_hparams``; ``eval_every`` (env steps, 0: ``steps // 20``)
    and ``log_every`` (keep every this many per-update rows) go to the RunSpec.
    """
    start = steps // 2 if start is None else start
    duration = max(1, steps // 20) if duration is None else duration
    doses = {**DEFAULT_DOSES, **(doses or {})}
    specs = []
    for a in algos:
        hp = {**(common_hparams or {}), **((hparams or {}).get(a, {}))}
        for k in perturbations:
            for s in seeds:
                specs.append(RunSpec("rl", a, task, int(steps), int(s), hparams=hp,
                                     perturbations=perturbation(k, start, duration, doses.get(k), a, hp),
                                     eval_every=int(eval_every), log_every=int(log_every)))
    return specs


def dose_grid(algos: Sequence[str], doses: Sequence[float], seeds: Iterable[int], steps: int, *,
              kind: str = "lr_spike", **kw) -> list[RunSpec]:
    """Dose sweep of one perturbation kind: algorithms x doses x seeds (kwargs as :func:`comparison_grid`)."""
    seeds = list(seeds)
    out: list[RunSpec] = []
    for d in doses:
        out += comparison_grid(algos, [kind], seeds, steps, doses={kind: float(d)}, **kw)
    return out


def noise_grid(knob_values: Mapping[str, Sequence[Any]], seeds: Iterable[int], steps: int, *,
               kind: str = "lr_spike", dose: float | None = None,
               hparams: Mapping[str, Mapping[str, Any]] | None = None, **kw) -> list[RunSpec]:
    """Controlled stochasticity: for each algorithm, vary its own noise knob
    (:data:`NOISE_KNOB`) over ``knob_values[algo]`` under the same perturbation."""
    seeds = list(seeds)
    out: list[RunSpec] = []
    for a, values in knob_values.items():
        for v in values:
            hp = {a: {**((hparams or {}).get(a, {})), NOISE_KNOB[a]: v}}
            out += comparison_grid([a], [kind], seeds, steps, doses={kind: dose} if dose is not None else None,
                                   hparams=hp, **kw)
    return out


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


def _stop_env_step(ds: xr.Dataset, i: int) -> float:
    """Last env step run ``i`` recorded (where training stopped; NaN when none)."""
    env = ds["env_step"]
    e = np.asarray(env.isel(run=i).values if "run" in env.dims else env.values, dtype=float)
    return float(np.nanmax(e)) if np.isfinite(e).any() else np.nan


def summarize(ds: xr.Dataset, *, final_points: int = 3, frac: float = 0.5, recover_frac: float = 0.8,
              window: int | None = None, scale: float | None = None, min_gain_frac: float = 0.1,
              min_evals_after: int = 3):
    """One row per run (pandas DataFrame): learner, perturbation, seed, noise knobs,
    ``pre_return`` (baseline before the perturbation start), ``final_return`` (mean
    of the last ``final_points`` evaluations), ``collapsed`` (:func:`stabstudy.analysis.events.collapse`
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
    (:data:`stabstudy.analysis.events.RECOVERY_STATES`), ``stability``
    (:func:`stabstudy.analysis.stats.stability_score` with a shared ``scale``: default
    the spread between the median untrained return and the best evaluation over
    all runs; NaN without evaluations after the event). Runs without a
    perturbation use the grid's median perturbation start as a pseudo-event (so
    baselines get a collapse rate at the same budget). A run with status
    ``diverged`` counts as collapsed when it diverged at or after the event.

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
    starts = curves["pert_start"].values.astype(float) if "pert_start" in curves.coords else np.full(curves.sizes["run"], np.nan)
    pseudo = float(np.nanmedian(starts)) if np.isfinite(starts).any() else float(curves.env_step.values[len(curves.env_step) // 2])
    vals = curves.values
    first = vals[:, 0] if vals.shape[1] else np.array([np.nan])
    if scale is None:
        scale = float(np.nanmax(vals) - np.nanmedian(first)) if np.isfinite(vals).any() else 1.0
    rows = []
    for i in range(curves.sizes["run"]):
        c = eval_curves(ds.isel(run=[i])).isel(run=0).rename(env_step="step")
        ev = starts[i] if np.isfinite(starts[i]) else pseudo
        row = {k: curves[k].values[i] for k in ("spec_hash", "learner", "seed", "pert_kind", "pert_dose", "pert_start",
                                                  "status") if k in curves.coords}
        stop = _stop_env_step(ds, i) if row.get("status") == "diverged" else None
        res = events.collapse(c, ev, frac=frac, recover_frac=recover_frac, window=window,
                              min_gain=min_gain_frac * scale, min_after=min_evals_after, diverged_at=stop)
        fin = c.values[np.isfinite(c.values)]
        for knob in set(NOISE_KNOB.values()):
            if f"hp_{knob}" in curves.coords:
                row[knob] = curves[f"hp_{knob}"].values[i]
        rec_state, rec_time = events.recovery_state(c, ev, abs_tol=0.1 * scale)
        row.update(
            event=ev, pre_return=res.baseline, final_return=float(np.mean(fin[-final_points:])) if fin.size else np.nan,
            collapsed=res.outcome, collapse_state=res.state, pre_event_invalid=res.pre_event_invalid,
            min_level=res.min_level, max_drawdown=events.max_drawdown(c, start=ev),
            recovery_time=rec_time, recovery_state=rec_state,
            stability=np.nan if res.pre_event_invalid else stats.stability_score(c, ev, scale=scale),
        )
        rows.append(row)
    out = pd.DataFrame(rows)
    out.attrs["scale"] = scale
    return out


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


def dose_response(table, dose_col: str = "pert_dose", level: float = 0.5):
    """Collapse probability per learner and dose, and the critical dose per learner.

    Returns ``(per_dose, critical)``: a DataFrame (learner, dose, n, p_collapse,
    p_low, p_high) and ``{learner: stats.CriticalDose}``.
    """
    from stabstudy.analysis import stats

    per = group_summary(table, by=("learner", dose_col)).rename(columns={dose_col: "dose"})
    crit = {a: stats.critical_dose(g[dose_col].values, g["collapsed"].values, level=level)
            for a, g in table.groupby("learner")}
    return per, crit


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


def claims_table(comp, scale: float, *, dose=None, noise=None, on_policy: str = "ppo",
                 off_policy: Sequence[str] = ("sac", "td3"), comparable_tol: float = 0.25,
                 decoupling_margin: float = 0.3, alpha: float = 0.05) -> list[Claim]:
    """The claims of the report under test and the study's own, as :class:`stabstudy.analysis.claims.Claim` rows.

    Args:
        comp: :func:`summarize` table of the comparison grid (all perturbation kinds, ``none`` included).
        scale: the return scale shared by the stability scores.
        dose: :func:`summarize` rows of the lr-spike dose sweep (None: not run).
        noise: :func:`summarize` rows of the controlled-stochasticity grid, with each
            learner's noise knob (:data:`NOISE_KNOB`) as a column (None: not run).
        comparable_tol: equivalence margin of the pre-perturbation returns, as a
            fraction of ``scale``.
        decoupling_margin: equivalence margin of Spearman's rho for "decoupled".

    Rules (:mod:`stabstudy.analysis.claims`; runs already broken before the event,
    ``pre_event_invalid``, are in no claim):

    * "X collapses irreversibly after K": :func:`~stabstudy.analysis.claims.rate_comparison`
      of X's collapse rate under K against X's unperturbed rate at the same budget;
    * "Y keeps learning after K": :func:`~stabstudy.analysis.claims.paired_difference`
      of each run's final return over its own pre-perturbation return (greater);
    * "comparable returns before the spike": :func:`~stabstudy.analysis.claims.equivalence`
      (Welch TOST) of the pre-spike returns, margin ``comparable_tol * scale``;
    * decoupling: :func:`~stabstudy.analysis.claims.correlation` of final return and
      stability over perturbed runs, ``expect="none"`` with ``decoupling_margin``;
    * stochasticity buffers: per learner, rho(noise knob, stability) positive;
    * lower critical dose: the on-policy collapse rate over the whole dose sweep
      against each off-policy one over the same doses and seeds.
    """
    import pandas as pd

    from stabstudy.analysis import claims as C

    paper, own = "source paper: the report under test", "our own"
    rows = []

    def valid(t):  # a run broken before its event says nothing about the event, in any claim
        return t[~t["pre_event_invalid"].fillna(False).astype(bool)] if t is not None and len(t) and \
            "pre_event_invalid" in t else t

    comp, dose, noise = valid(comp), valid(dose), valid(noise)
    kinds = [k for k in KIND_LABELS if k in set(comp.pert_kind)] if len(comp) else []
    for kind in kinds or ["lr_spike"]:
        label = KIND_LABELS[kind]
        runs = comp[comp.pert_kind == kind] if len(comp) else comp
        base = comp[comp.pert_kind == "none"] if len(comp) else comp
        on = runs[runs.learner == on_policy] if len(runs) else runs
        rows.append(C.rate_comparison(
            f"{on_policy.upper()} collapses irreversibly after {label} (collapse rate above its unperturbed rate)",
            paper, *_rate(on), *_rate(base[base.learner == on_policy] if len(base) else base),
            direction="greater", alpha=alpha))
        for a in off_policy:
            r = runs[runs.learner == a] if len(runs) else runs
            rows.append(C.paired_difference(
                f"{a.upper()} keeps learning after {label} (final return above its pre-perturbation return)",
                paper, r.final_return.to_numpy(float) if len(r) else [],
                r.pre_return.to_numpy(float) if len(r) else [], direction="greater", alpha=alpha))
        if kind == "lr_spike":
            for a in off_policy:
                x = on.pre_return.to_numpy(float) if len(on) else []
                r = runs[runs.learner == a] if len(runs) else runs
                y = r.pre_return.to_numpy(float) if len(r) else []
                rows.append(C.equivalence(
                    f"returns before the spike are comparable: {on_policy.upper()} vs {a.upper()} "
                    f"(within {comparable_tol:g} of the return scale)", paper, x, y,
                    margin=comparable_tol * scale, relative=False, paired=False, alpha=alpha))
    pert = comp[(comp.pert_kind != "none")] if len(comp) else comp
    rows.append(C.correlation("high final return is decoupled from stability (perturbed runs)", own,
                              pert.final_return.to_numpy(float) if len(pert) else [],
                              pert.stability.to_numpy(float) if len(pert) else [],
                              expect="none", margin=decoupling_margin, alpha=alpha))
    for a in [on_policy, *off_policy]:
        knob = NOISE_KNOB.get(a, "")
        g = noise[noise.learner == a] if noise is not None and len(noise) else None
        x = pd.to_numeric(g[knob], errors="coerce").to_numpy(float) if g is not None and knob in g else []
        y = g.stability.to_numpy(float) if g is not None and knob in g else []
        rows.append(C.correlation(f"more of {a.upper()}'s own noise ({knob}) buffers the spike (higher stability)",
                                  own, x, y, expect="positive", alpha=alpha))
    for a in off_policy:
        d = dose if dose is not None and len(dose) else None
        rows.append(C.rate_comparison(
            f"{on_policy.upper()} has a lower critical lr-spike dose than {a.upper()} "
            "(collapses more often over the same doses and seeds)", own,
            *_rate(d[d.learner == on_policy] if d is not None else comp.iloc[:0]),
            *_rate(d[d.learner == a] if d is not None else comp.iloc[:0]), direction="greater", alpha=alpha))
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
