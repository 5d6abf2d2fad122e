"""Notebook 01 (RL algorithm comparison): its grids, summaries and claims computed from its runs."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import xarray as xr

from stabstudy.hparams import defaults
from stabstudy.interventions.perturb import Perturbation
from stabstudy.registry import NOISE_KNOB, ON_POLICY, hparams_class
from stabstudy.spec import RunSpec

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


def summarize(ds: xr.Dataset, *, final_points: int = 3, frac: float = 0.5, recover_frac: float = 0.8,
              window: int | None = None, scale: float | None = None, min_gain_frac: float = 0.1):
    """One row per run (pandas DataFrame): learner, perturbation, seed, noise knobs,
    ``pre_return`` (baseline before the perturbation start), ``final_return`` (mean
    of the last ``final_points`` evaluations), ``collapsed`` (:func:`stabstudy.analysis.events.collapse`
    with ``frac``/``recover_frac``/``window`` in env steps and ``min_gain =
    min_gain_frac * scale``, so a run that learned little before the event must
    still lose ``(1 - frac) * min_gain_frac`` of the scale), ``min_level``,
    ``max_drawdown``, ``recovery_time`` (env steps), ``stability`` (:func:`stabstudy.analysis.stats.stability_score`
    with a shared ``scale``: default the spread between the median untrained return
    and the best evaluation over all runs). Runs without a perturbation use the
    grid's median perturbation start as a pseudo-event (so baselines get a
    collapse rate too). A run with status ``diverged`` counts as collapsed.

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
        res = events.collapse(c, ev, frac=frac, recover_frac=recover_frac, window=window,
                              min_gain=min_gain_frac * scale)
        fin = c.values[np.isfinite(c.values)]
        row = {k: curves[k].values[i] for k in ("spec_hash", "learner", "seed", "pert_kind", "pert_dose", "pert_start",
                                                  "status") if k in curves.coords}
        for knob in set(NOISE_KNOB.values()):
            if f"hp_{knob}" in curves.coords:
                row[knob] = curves[f"hp_{knob}"].values[i]
        row.update(
            event=ev, pre_return=res.baseline, final_return=float(np.mean(fin[-final_points:])) if fin.size else np.nan,
            collapsed=1.0 if row.get("status") == "diverged" else (float(res.collapsed) if np.isfinite(res.baseline) else np.nan),
            min_level=res.min_level,
            max_drawdown=events.max_drawdown(c, start=ev),
            recovery_time=events.recovery_time(c, ev, abs_tol=0.1 * scale),
            stability=stats.stability_score(c, ev, scale=scale),
        )
        rows.append(row)
    out = pd.DataFrame(rows)
    out.attrs["scale"] = scale
    return out


# -- group statistics and the claims ----------------------------------------------------


def group_summary(table, by: Sequence[str] = ("learner", "pert_kind")):
    """Per group of :func:`summarize` rows: ``n`` (runs with a collapse verdict), IQM of ``pre_return``, ``final_return``,
    ``stability``, collapse fraction ``p_collapse`` with a Clopper-Pearson 95% CI
    (``p_low``, ``p_high``) and the number of ``diverged`` runs."""
    import pandas as pd

    from stabstudy.analysis import stats

    rows = []
    for key, g in table.groupby(list(by), sort=True, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        p, lo, hi = stats.collapse_probability(g["collapsed"].values)
        # n: runs with a verdict, the denominator of p_collapse (a run without one is NaN there)
        n = int(np.isfinite(g["collapsed"].to_numpy(float)).sum())
        rows.append({**dict(zip(by, key, strict=True)), "n": n, "pre_return": stats.iqm(g["pre_return"]),
                     "final_return": stats.iqm(g["final_return"]), "stability": stats.iqm(g["stability"]),
                     "p_collapse": p, "p_low": lo, "p_high": hi,
                     "diverged": int((g.get("status", pd.Series(dtype=str)) == "diverged").sum())})
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


def _p(g, learner, kind):
    row = g[(g.learner == learner) & (g.pert_kind == kind)]
    if row.empty:
        return None
    r = row.iloc[0]
    return r


def _fmt_p(r) -> str:
    return f"{r.p_collapse:.0%} of {int(r.n)} runs collapsed (95% CI {r.p_low:.0%}-{r.p_high:.0%})"


def claims_table(comp, scale: float, dose_crit: Mapping[str, Any] | None = None, noise=None,
                 on_policy: str = "ppo", off_policy: Sequence[str] = ("sac", "td3"), comparable_tol: float = 0.25):
    """The claims of the original report against our data, one row per claim.

    Args:
        comp: :func:`summarize` table of the comparison grid (all perturbation kinds).
        scale: the return scale used for stability (for "comparable returns").
        dose_crit: ``{learner: CriticalDose}`` from :func:`dose_response`.
        noise: :func:`noise_response` table.

    Verdict rules (point estimates; the measurement column always gives n and the
    Clopper-Pearson 95% CI; ``decisive`` says whether the CI excludes the 50% threshold):

    * "X collapses": supported when X's collapse fraction >= 50% and above its
      unperturbed rate; not supported otherwise. When the CI straddles 50% the
      verdict is "inconclusive (leans for/against)" instead.
    * "Y keeps learning": supported when Y's collapse fraction < 50% and the median
      of (final - pre-perturbation return) >= 0; not supported otherwise.
    * "comparable returns before": supported when the IQM pre-perturbation returns
      differ by at most ``comparable_tol * scale``.
    * "same pattern under K": supported when the on-policy collapse fraction >= 50%
      and every off-policy one < 50%.
    * decoupling: Spearman rho between final return and stability over perturbed
      runs; supported when |rho| < 0.3, not supported when rho >= 0.3 with
      p < 0.05, inconclusive otherwise (or n < 6).
    * stochasticity buffers: mean over learners of Spearman rho(stability, noise
      knob); supported when > 0.3, not supported when < -0.3, else inconclusive.
    * critical dose: supported when the on-policy critical dose is below every
      off-policy one (a NaN = never reached = above the tested range).
    Any group with no runs gives "inconclusive".
    """
    import pandas as pd
    from scipy.stats import spearmanr

    g = group_summary(comp)
    rows = []

    def add(claim, meas, verdict, decisive=""):
        rows.append({"claim": claim, "our measurement": meas, "supported?": verdict, "decisive": decisive})

    def verdict(ok: bool, dec: str) -> str:
        # A point estimate whose 95% interval straddles 50% decides nothing: say which way it leans.
        if dec == "no":
            return f"inconclusive (leans {'for' if ok else 'against'})"
        return "supported" if ok else "not supported"

    def med_gain(a, kind):
        h = comp[(comp.learner == a) & (comp.pert_kind == kind)]
        return float(np.nanmedian(h.final_return - h.pre_return)) if len(h) else np.nan

    # 1. on-policy collapse under lr spike
    for kind, label in (("lr_spike", "a single learning-rate spike"), ("action_noise", "action noise"),
                        ("reward_scale", "a reward-scale perturbation")):
        r, r0 = _p(g, on_policy, kind), _p(g, on_policy, "none")
        if r is None:
            add(f"{on_policy.upper()} collapses irreversibly after {label}", "no runs", "inconclusive")
            continue
        p0 = r0.p_collapse if r0 is not None else 0.0
        sup = r.p_collapse >= 0.5 and r.p_collapse > p0
        meas = _fmt_p(r) + (f"; unperturbed: {r0.p_collapse:.0%} of {int(r0.n)}" if r0 is not None else "")
        dec = "yes" if (r.p_low > 0.5 or r.p_high < 0.5) else "no"
        add(f"{on_policy.upper()} collapses irreversibly after {label}", meas, verdict(sup, dec), dec)
        for a in off_policy:
            q = _p(g, a, kind)
            if q is None:
                add(f"{a.upper()} keeps learning after {label}", "no runs", "inconclusive")
                continue
            gain = med_gain(a, kind)
            ok = q.p_collapse < 0.5 and gain >= 0
            dec = "yes" if (q.p_high < 0.5 or q.p_low > 0.5) else "no"
            add(f"{a.upper()} keeps learning after {label}",
                _fmt_p(q) + f"; median final - pre-perturbation return {gain:+.0f}", verdict(ok, dec), dec)
        if kind == "lr_spike":
            pre_on = r.pre_return
            pre_off = [(_p(g, a, kind).pre_return if _p(g, a, kind) is not None else np.nan) for a in off_policy]
            diffs = [abs(pre_on - x) for x in pre_off if np.isfinite(x)]
            if diffs and np.isfinite(pre_on):
                ok = max(diffs) <= comparable_tol * scale
                add("returns before the spike are comparable across algorithms",
                    f"IQM pre-spike return {on_policy}: {pre_on:.0f}; "
                    + ", ".join(f"{a}: {x:.0f}" for a, x in zip(off_policy, pre_off, strict=True))
                    + f" (tolerance {comparable_tol:.0%} of the return scale {scale:.0f})",
                    "supported" if ok else "not supported")
        else:
            qs = [_p(g, a, kind) for a in off_policy]
            if r is not None and all(q is not None for q in qs):
                ok = r.p_collapse >= 0.5 and all(q.p_collapse < 0.5 for q in qs)
                add(f"same pattern under {label} ({on_policy} collapses, {', '.join(off_policy)} do not)",
                    f"collapse: {on_policy} {r.p_collapse:.0%}, "
                    + ", ".join(f"{a} {q.p_collapse:.0%}" for a, q in zip(off_policy, qs, strict=True)),
                    "supported" if ok else "not supported")
    # decoupling
    pert = comp[(comp.pert_kind != "none") & comp.final_return.notna() & comp.stability.notna()]
    if len(pert) >= 6 and pert.stability.nunique() > 1 and pert.final_return.nunique() > 1:
        res = spearmanr(pert.final_return, pert.stability)
        rho, pv = float(res.statistic), float(res.pvalue)
        verdict = "supported" if abs(rho) < 0.3 else ("not supported" if rho >= 0.3 and pv < 0.05 else "inconclusive")
        order_f = g[g.pert_kind != "none"].groupby("learner").final_return.mean().sort_values(ascending=False)
        order_s = g[g.pert_kind != "none"].groupby("learner").stability.mean().sort_values(ascending=False)
        add("high final return is decoupled from stability",
            f"Spearman rho(final return, stability) = {rho:+.2f} (p = {pv:.2g}, n = {len(pert)} perturbed runs); "
            f"rank by final return: {' > '.join(order_f.index)}; by stability: {' > '.join(order_s.index)}",
            verdict, "yes" if pv < 0.05 else "no")
    else:
        add("high final return is decoupled from stability", f"only {len(pert)} perturbed runs", "inconclusive")
    # controlled stochasticity
    if noise is not None and len(noise) and noise["rho"].notna().any():
        per = noise.groupby("learner").rho.first().dropna()
        m = float(per.mean())
        verdict = "supported" if m > 0.3 else ("not supported" if m < -0.3 else "inconclusive")
        add("more of the algorithm's own noise buffers the spike (higher stability)",
            "Spearman rho(stability, noise knob): " + ", ".join(f"{a} {v:+.2f}" for a, v in per.items()), verdict)
    else:
        add("more of the algorithm's own noise buffers the spike (higher stability)", "not enough runs", "inconclusive")
    # critical dose
    if dose_crit:
        def val(a):
            c = dose_crit.get(a)
            return np.inf if c is None or not np.isfinite(c.dose) else c.dose
        if on_policy in dose_crit and any(a in dose_crit for a in off_policy):
            cd = {a: val(a) for a in [on_policy, *off_policy] if a in dose_crit}
            finite = [v for v in cd.values() if np.isfinite(v)]
            verdict = "inconclusive" if not finite else (
                "supported" if all(cd[on_policy] < v for a, v in cd.items() if a != on_policy) else "not supported")
            add(f"{on_policy.upper()} has a lower critical lr-spike dose than {', '.join(off_policy)}",
                "critical dose (50% collapse): " + ", ".join(
                    f"{a} {'never reached' if not np.isfinite(v) else f'{v:.3g}'}" for a, v in cd.items()), verdict)
    return pd.DataFrame(rows)


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
