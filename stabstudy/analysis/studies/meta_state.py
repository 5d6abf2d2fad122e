"""Notebook 04 (meta-state analysis): its grid, the analysis pipeline and the claims table.

The grid bracketing the critical dose: slow-onset learning-rate ramps (:data:`lr_ramp`), shocks
(LR spikes, outlier batches) at one step, unperturbed runs, and optionally a *spontaneous* family
(unperturbed runs of a configuration meant to be unstable at a constant learning rate). Runs of
notebook 02 are reused where the specs match (same hyperparameter names and values, steps, spike
step and seeds). The pipeline (:func:`analyse`) labels events from the loss alone, fits the
meta-state PCA and calibrates every detector on the calibration seeds, and evaluates on the others
(:mod:`stabstudy.analysis.warning.evaluation`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import xarray as xr

from stabstudy.analysis import claims as C
from stabstudy.analysis.studies import lm_spikes
from stabstudy.analysis.warning import evaluation as E
from stabstudy.analysis.warning.labels import LabelRule, label_runs
from stabstudy.online import MetaConfig, PCAModel
from stabstudy.online import features as F
from stabstudy.spec import Perturbation, RunSpec

SOURCE = "source paper (arXiv 2601.13160)"


def grid(steps: int, seeds: Sequence[int], *, ramp_start: int, ramps: Sequence[Sequence[float]],
         shock_step: int, shocks: Sequence[Sequence[Any]], spontaneous: dict[str, Any] | None = None,
         spontaneous_seeds: Sequence[int] = (), curvature_every: int = 0, curvature_iters: int = 20,
         **hp: Any) -> list[RunSpec]:
    """The runs of notebook 04.

    Args:
        steps: optimizer updates per run.
        seeds: every seed gets an unperturbed run, each ramp and each shock.
        ramp_start: first step of every ``lr_ramp``.
        ramps: ``[dose, duration]`` pairs of ``lr_ramp`` perturbations (the factor climbs from 1 to
            ``dose`` over ``duration`` steps and stays there).
        shock_step: step at which every shock starts.
        shocks: ``[kind, dose, duration]`` triples (``lr_spike``, ``outlier_batch``, ...).
        spontaneous: hyperparameters laid over ``hp`` for unperturbed runs of the spontaneous family
            (none when empty).
        spontaneous_seeds: seeds of those runs.
        curvature_every: measure ``lambda_max`` every this many steps in every run (0: never, and
            the specs stay those of notebook 02).
        curvature_iters: Hessian-vector products per measurement.
        hp: learner hyperparameters of every run (give them as notebook 02 does to share its runs).
    """
    if curvature_every:
        hp = {**hp, "curvature_iters": curvature_iters}

    def base_spec(steps: int, seed: int, **kw: Any) -> RunSpec:
        return lm_spikes.base_spec(steps, seed, curvature_every=curvature_every, **kw)

    specs = []
    for seed in seeds:
        specs.append(base_spec(steps, seed, **hp))
        for dose, duration in ramps:
            specs.append(base_spec(steps, seed, perturbations=(
                Perturbation("lr_ramp", ramp_start, int(duration), dose=float(dose)),), **hp))
        for kind, dose, duration in shocks:
            specs.append(base_spec(steps, seed, perturbations=(
                Perturbation(str(kind), shock_step, int(duration), dose=float(dose)),), **hp))
    if spontaneous:
        specs += [base_spec(steps, seed, **{**hp, **spontaneous}) for seed in spontaneous_seeds]
    return list(dict.fromkeys(specs))


def kinds_of(specs: Sequence[RunSpec]) -> tuple[str, ...]:
    """The perturbation kinds present in ``specs`` (sorted)."""
    return tuple(sorted({p.kind for s in specs for p in s.perturbations}))


@dataclass
class MetaStudy:
    """Everything :func:`analyse` computes (see its docstring)."""

    info: pd.DataFrame
    pca: PCAModel
    meta: xr.Dataset
    scores: xr.DataArray
    specs: list[E.DetectorSpec]
    evaluation: E.Evaluation
    calibration_leads: pd.DataFrame
    best_single: dict[str, str]
    best_meta: dict[str, str]
    pairwise: pd.DataFrame
    held_out: pd.DataFrame
    params: dict[str, Any] = field(default_factory=dict)


def _families(info: pd.DataFrame) -> list[str]:
    return ["all", *sorted(info[info.event].family.unique())]


def analyse(ds: xr.Dataset, specs: Sequence[RunSpec], *, calibration_seeds: Sequence[int], rule: LabelRule,
            meta_features: Sequence[str] = F.LM_CHANNELS, config: MetaConfig | None = None,
            n_components: int | float = 0.9, budget: float = 1.0, horizon: int = 100, late: int = 20,
            n_boot: int = 1000, seed: int = 0, held_out: bool = True) -> MetaStudy:
    """The whole comparison of notebook 04 on loaded runs ``ds`` (dims run, step).

    1. labels from the loss alone (``rule``); 2. run table with the seed split; 3. meta-state PCA
    fitted on in-control steps of the calibration runs; 4. every detector of
    :func:`stabstudy.analysis.warning.evaluation.suite` streamed over every run; 5. thresholds at
    ``budget`` false alarms per 1,000 steps on the calibration nulls, evaluation on the others;
    6. per event family, the best single-channel (knob-free) detector and the best meta-state
    statistic chosen on the *calibration* events (largest mean penalised lead); 7. pairwise
    Wilcoxon tests of those meta-state statistics against every detector (Holm); 8. held-out
    kinds: the PCA and the meta-state thresholds refitted without one perturbation kind and
    evaluated on that kind's events.
    """
    config = config or MetaConfig()
    kinds = kinds_of(specs)
    burn_in = rule.burn_in
    labels = label_runs(ds, rule)
    info = E.run_info(ds, labels, calibration_seeds)
    cal = info[info.split == "calibration"]
    pca = E.fit_meta(ds, cal, meta_features, config, kinds, burn_in, horizon, n_components)
    meta = E.meta_streams(ds, meta_features, pca, config, kinds)
    dspecs = E.suite(kinds, meta_features, window=config.window, ewma=config.ewma, clip=config.clip,
                     lambda_max=bool(np.isfinite(ds["lambda_max"].values).any()) if "lambda_max" in ds else False)
    scores = E.score_runs(ds, dspecs, meta)
    ev = E.evaluate(scores, info, dspecs, budget=budget, horizon=horizon, late=late, burn_in=burn_in,
                    n_boot=n_boot, seed=seed)
    cal_leads = E.leads(scores, cal, ev.thresholds, horizon=horizon, late=late, burn_in=burn_in)
    singles = [s.name for s in dspecs if s.family == "single"]
    metas = [s.name for s in dspecs if s.family == "meta"]
    best_single, best_meta = {}, {}
    for fam in _families(info):
        rows = cal[cal.event & ((cal.family == fam) | (fam == "all"))].index
        best_single[fam] = E.best(cal_leads.loc[rows], singles, late)
        best_meta[fam] = E.best(cal_leads.loc[rows], metas, late)
    pw = E.pairwise(ev.leads, metas, late)
    ho = held_out_kinds(ds, info, meta_features, config, kinds, pca, scores, ev.thresholds, budget=budget,
                        horizon=horizon, late=late, burn_in=burn_in, n_components=n_components) if held_out else pd.DataFrame()
    params = {"budget": budget, "horizon": horizon, "late": late, "burn_in": burn_in, "kinds": kinds}
    return MetaStudy(info, pca, meta, scores, dspecs, ev, cal_leads, best_single, best_meta, pw, ho, params)


def held_out_kinds(ds: xr.Dataset, info: pd.DataFrame, meta_features: Sequence[str], config: MetaConfig,
                   kinds: Sequence[str], pca_all: PCAModel, scores_all: xr.DataArray, thresholds_all: pd.Series, *,
                   budget: float, horizon: int, late: int, burn_in: int, n_components: int | float) -> pd.DataFrame:
    """For each perturbation kind with evaluation events: the meta-state refitted (PCA and thresholds)
    on the calibration runs of the *other* kinds and the unperturbed runs, against the fit on all
    kinds, on that kind's evaluation events (the refits use the batch replay, equal to the stream).

    Columns: ``kind, stat, fit`` (``all kinds`` | ``without <kind>``), ``n_events, n_detected,
    lead_median`` (over detected events), ``n_fit`` (in-control rows of the PCA).
    """
    rows = []
    ev_all = info[(info.split == "evaluation") & info.event]
    for kind in sorted(k for k in ev_all.kind.unique() if k != "none"):
        target = ev_all[ev_all.kind == kind]
        fit_info = info[(info.split == "calibration") & (info.kind != kind)]
        pca = E.fit_meta(ds, fit_info, meta_features, config, kinds, burn_in, horizon, n_components)
        sub = info[(info.kind != kind) | (info.split == "evaluation")]
        meta = E.meta_replay(ds.sel(run=sub.index.values), meta_features, pca, config, kinds)
        row = {r: i for i, r in enumerate(meta["run"].values)}
        cal_null = sub[(sub.split == "calibration") & ~sub.event]
        segs = {row[r]: ab for r, ab in E.event_free(cal_null, burn_in, horizon).items()}
        for stat in E.META_STATS:
            name = f"meta-state {stat}"
            s = meta[stat].expand_dims(detector=[name])
            thr = pd.Series({name: E.calibrate(s.sel(detector=name).values, segs, budget)})
            for fit, sc, th, n_fit in (("all kinds", scores_all, thresholds_all, pca_all.n_fit),
                                       (f"without {kind}", s, thr, pca.n_fit)):
                ld = E.leads(sc.sel(detector=[name]), target, th, horizon=horizon, late=late, burn_in=burn_in)[name]
                rows.append({"kind": kind, "stat": stat, "fit": fit, "n_events": len(target),
                             "n_detected": int(ld.notna().sum()), "lead_median": float(ld.median()),
                             "threshold": float(th[name]), "n_fit": n_fit})
    return pd.DataFrame(rows)


def detector_table(study: MetaStudy) -> pd.DataFrame:
    """The detector table: one row per detector, per event family ``rate`` (k/n), ``lead`` (median
    [bootstrap interval], steps) and ``AUC`` [interval], plus ``FA/1k``, ``in alarm %`` (share of
    event-free steps spent above the threshold) and the detector's family."""
    t = study.evaluation.table
    out = {}
    for det, g in t.groupby("detector", sort=False):
        row: dict[str, Any] = {"family": g.family.iloc[0], "FA/1k": round(float(g.fa_per_1k.iloc[0]), 2),
                               "in alarm %": round(100 * float(g.in_alarm.iloc[0]), 1)}
        for _, r in g.iterrows():
            fam = r.events
            row[f"{fam} rate"] = f"{r.n_detected}/{r.n_events}"
            row[f"{fam} lead"] = (f"{r.lead_median:.0f} [{r.lead_lo:.0f}, {r.lead_hi:.0f}]"
                                  if np.isfinite(r.lead_median) else "-")
            row[f"{fam} AUC"] = f"{r.auc:.2f} [{r.auc_lo:.2f}, {r.auc_hi:.2f}]" if np.isfinite(r.auc) else "-"
        out[det] = row
    return pd.DataFrame.from_dict(out, orient="index")


def tradeoff(study: MetaStudy, budgets: Sequence[float], detectors: Sequence[str]) -> pd.DataFrame:
    """Lead time against false alarms: per detector and budget (per 1,000 steps), thresholds
    recalibrated on the calibration nulls, then on the evaluation runs the false alarms per 1,000
    event-free steps, the detection rate and the median penalised lead, per event family.

    Columns: ``detector, budget, events, fa_per_1k, rate, lead_median``.
    """
    p, info, sc = study.params, study.info, study.scores
    runs = list(sc["run"].values)
    row = {r: i for i, r in enumerate(runs)}
    cal_null = info[(info.split == "calibration") & ~info.event]
    ev_info = info[info.split == "evaluation"]
    cal_seg = {row[r]: ab for r, ab in E.event_free(cal_null, p["burn_in"], p["horizon"]).items()}
    ev_seg = {row[r]: ab for r, ab in E.event_free(ev_info, p["burn_in"], p["horizon"]).items()}
    rows = []
    for det in detectors:
        s = sc.sel(detector=det).values
        for b in budgets:
            thr = pd.Series({det: E.calibrate(s, cal_seg, b)})
            fa, n = E.count_alarms(s, thr[det], ev_seg)
            ld = E.leads(sc.sel(detector=[det]), ev_info, thr, horizon=p["horizon"], late=p["late"],
                         burn_in=p["burn_in"])[det]
            for fam in _families(info):
                idx = ev_info[ev_info.event & ((ev_info.family == fam) | (fam == "all"))].index
                x = ld.loc[idx]
                rows.append({"detector": det, "budget": b, "events": fam, "fa_per_1k": 1000.0 * fa / n if n else np.nan,
                             "rate": float(x.notna().mean()) if len(x) else np.nan,
                             "lead_median": float(E.penalised(x.to_frame(), p["late"]).iloc[:, 0].median())
                             if len(x) else np.nan})
    return pd.DataFrame(rows)


def aligned(study: MetaStudy, ds: xr.Dataset, detectors: Sequence[str], family: str, before: int,
            after: int) -> xr.Dataset:
    """Event-aligned traces of the evaluation events of ``family``: each detector's score divided by
    its calibrated threshold (1 = alarm level) and the loss minus its level at the onset.

    Returns variables ``score`` (dims detector, event, lag) and ``loss`` (dims event, lag), with
    ``lag`` = step - onset in ``[-before, after]``.
    """
    info = study.info
    ev = info[(info.split == "evaluation") & info.event & (info.family == family)]
    lags = np.arange(-before, after + 1)
    n = ds.sizes["step"]
    sc = np.full((len(detectors), len(ev), lags.size), np.nan)
    loss = np.full((len(ev), lags.size), np.nan)
    for j, (run, x) in enumerate(ev.iterrows()):
        idx = x.onset + lags
        ok = (idx >= 0) & (idx < n)
        for i, det in enumerate(detectors):
            thr = study.evaluation.thresholds[det]
            s = study.scores.sel(detector=det, run=run).values
            sc[i, j, ok] = s[idx[ok]] / thr if np.isfinite(thr) and thr != 0 else np.nan
        lo = ds["loss"].sel(run=run).values
        loss[j, ok] = lo[idx[ok]] - lo[x.onset - 1] if x.onset >= 1 else np.nan
    return xr.Dataset({"score": (("detector", "event", "lag"), sc), "loss": (("event", "lag"), loss)},
                      coords={"detector": list(detectors), "event": ev.index.values, "lag": lags})


def claims(study: MetaStudy, alpha: float = 0.05) -> list[C.Claim]:
    """The claims of notebook 04 (before Holm: pass them to :func:`stabstudy.analysis.claims.table`).

    * per event family: the best meta-state statistic warns earlier than the best single channel,
      both chosen on the calibration events, thresholds at the same budget (paired over the
      evaluation events, Wilcoxon signed-rank, a miss scored as the worst lead);
    * per family: the meta-state alarms before the performance label (paired lead against 0);
    * the meta-state stays quiet on the evaluation null runs: per-run false alarms per 1,000
      steps below the budget (paired t-test of the rates against the budget).
    A family with no evaluation events is "not tested".
    """
    info, ev, late = study.info, study.evaluation, study.params["late"]
    out = []
    evs = info[(info.split == "evaluation") & info.event]
    pen = E.penalised(ev.leads, late)
    for fam in ("slow-onset", "shock", "spontaneous"):
        idx = evs[evs.family == fam].index
        claim = f"the meta-state warns earlier than the best single channel at the same false-alarm budget ({fam} events)"
        if len(idx) == 0:
            why = ("no spontaneous event (constant learning rate, no perturbation) appeared in these runs"
                   if fam == "spontaneous" else f"no {fam} event in the evaluation runs")
            out.append(C.not_tested(claim, SOURCE, why))
            continue
        m, s = study.best_meta.get(fam, study.best_meta["all"]), study.best_single.get(fam, study.best_single["all"])
        c = C.paired_difference(f"{claim}: {m} vs {s}", SOURCE, pen.loc[idx, m], pen.loc[idx, s],
                                direction="greater", test="wilcoxon", alpha=alpha)
        out.append(c)
        c = C.paired_difference(f"the meta-state ({m}) deviates before performance collapses ({fam} events: lead > 0)",
                                SOURCE, pen.loc[idx, m], np.zeros(len(idx)), direction="greater", test="wilcoxon",
                                alpha=alpha)
        out.append(c)
    m = study.best_meta["all"]
    budget = study.params["budget"]
    fa = ev.fa_runs[m].to_numpy(float)
    out.append(C.paired_difference(f"the meta-state ({m}) stays quiet on null runs: false alarms per 1,000 steps "
                                   f"below the budget of {budget:g}", "our own", fa, np.full(fa.size, budget),
                                   direction="less", test="ttest", alpha=alpha))
    return out


def pre_onset_drift(ds: xr.Dataset, info: pd.DataFrame, horizon: int, burn_in: int, width: int = 10) -> pd.DataFrame:
    """How much the loss had already moved inside each event's warning window, before the label fired.

    Per event run: ``drift`` = mean loss over the ``width`` steps before the onset minus the mean over
    the ``width`` steps from its warning window's start (:func:`stabstudy.analysis.warning.evaluation.warn_from`),
    in nats, with the run's ``family``, ``kind`` and ``window`` (steps from that start to the onset).
    A trailing band follows a slow drift, so a slow-onset label fires at the blow-up, after the loss
    has crept up: this says by how much.
    """
    rows = []
    for run, x in info[info.event].iterrows():
        a = E.warn_from(x, horizon, burn_in)
        loss = ds["loss"].sel(run=run).values
        before = loss[max(x.onset - width, a):x.onset]
        start = loss[a:min(a + width, x.onset)]
        rows.append({"run": run, "family": x.family, "kind": x.kind, "window": x.onset - a,
                     "drift": float(np.nanmean(before) - np.nanmean(start)) if before.size and start.size else np.nan})
    return pd.DataFrame(rows).set_index("run") if rows else pd.DataFrame(columns=["family", "kind", "window", "drift"])
