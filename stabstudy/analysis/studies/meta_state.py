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
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pandas as pd
import xarray as xr

from stabstudy.analysis import claims as C
from stabstudy.analysis.studies import lm_spikes
from stabstudy.analysis.warning import crossdomain as X
from stabstudy.analysis.warning import evaluation as E
from stabstudy.analysis.warning import outcomes as O
from stabstudy.analysis.warning import specificity as S
from stabstudy.analysis.warning.labels import LabelRule, label_runs
from stabstudy.online import MetaConfig, PCAModel
from stabstudy.online import features as F
from stabstudy.spec import Perturbation, RunSpec

SOURCE = "source paper (arXiv 2601.13160)"
#: The performance-only detector the specificity claims compare with.
LOSS = "loss robust z (performance)"
#: Specificity targets: which outcome classes (:data:`stabstudy.analysis.warning.outcomes.OUTCOMES`) count.
TARGETS: dict[str, tuple[str, ...]] = {"explodes": ("explodes",),
                                       "lasting damage": ("explodes", "silently degrades")}
#: Event families the sensitivity claims ask about (:data:`stabstudy.analysis.warning.evaluation.FAMILY`).
FAMILIES: tuple[str, ...] = ("slow-onset", "shock", "spontaneous")
#: The channels every domain's meta-state reads, whose pre-onset directions the cross-domain claim compares.
SHARED_CHANNELS: tuple[str, ...] = ("grad_norm", "xgrad", "update_ratio/lr", "update_grad_cos", "adam_m_norm",
                                    "adam_v_mean")


def grid(steps: int, seeds: Sequence[int], *, ramp_start: int, ramps: Sequence[Sequence[float]],
         shock_step: int, shocks: Sequence[Sequence[Any]], spontaneous: dict[str, Any] | None = None,
         spontaneous_seeds: Sequence[int] = (), null_seeds: Sequence[int] = (), curvature_every: int = 0,
         curvature_iters: int = 20, **hp: Any) -> list[RunSpec]:
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
        null_seeds: seeds of further unperturbed runs (the null the thresholds are calibrated on;
            they cost one run each, and no perturbed run shares their steps).
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
    specs += [base_spec(steps, seed, **hp) for seed in null_seeds]
    if spontaneous:
        specs += [base_spec(steps, seed, **{**hp, **spontaneous}) for seed in spontaneous_seeds]
    return list(dict.fromkeys(specs))


#: The toy learner's telemetry of the meta-state (knob-free; the toy MLP has no attention), with the
#: output layer's channels the slingshot is read from (logit and last-layer norm growth, Thilak et al. 2022).
TOY_CHANNELS: tuple[str, ...] = ("grad_norm", "xgrad", "update_norm/lr", "update_ratio/lr", "update_grad_cos",
                                 "adam_m_norm", "adam_v_mean", "out_logit_max", "last_weight_norm")
#: The name of the step-count baseline in the claims.
STEP_COUNT = "step count (baseline)"


def toy_spontaneous_grid(steps: int, seeds: Sequence[int], *, lr_range: tuple[float, float], null_beta2: float = 0.999,
                         **hp: Any) -> list[RunSpec]:
    """Unperturbed toy runs that spike by themselves, and their nulls.

    Full-batch Adam with a small ``beta2`` and a constant learning rate gives cyclic loss spikes
    (the slingshot of Thilak et al. 2022); ``hp`` sets that configuration (notebook 04's
    parameters). Each seed gets its own learning rate in ``lr_range`` (a golden-ratio sequence in
    log space, so both halves of any seed split cover the range and the onsets spread), and a null
    run at the same learning rate with ``beta2 = null_beta2`` (no spikes).
    """
    lo, hi = lr_range
    specs = []
    for s in seeds:
        lr = float(lo * (hi / lo) ** ((s * 0.6180339887498949) % 1.0))
        for beta2 in (hp.get("beta2", 0.95), null_beta2):
            specs.append(RunSpec("toy", "adam", "digits", steps, s, hparams={**hp, "lr": lr, "beta2": beta2}))
    return list(dict.fromkeys(specs))


def runs_with(ds: xr.Dataset, **hp: float) -> list[str]:
    """The runs of ``ds`` whose hyperparameters (``hp_<name>`` variables) equal ``hp``."""
    keep = np.ones(ds.sizes["run"], bool)
    for k, v in hp.items():
        keep &= ds[f"hp_{k}"].values == v
    return [str(r) for r in ds["run"].values[keep]]


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
    outcomes: pd.DataFrame = field(default_factory=pd.DataFrame)
    specificity: dict[str, pd.DataFrame] = field(default_factory=dict)
    """target -> :func:`stabstudy.analysis.warning.specificity.separation` of the evaluation runs"""
    specificity_choice: dict[str, tuple[str, str]] = field(default_factory=dict)
    """target -> (meta-state statistic, single channel) with the largest calibration AUC"""
    specificity_diffs: dict[str, dict[str, tuple[float, tuple[float, float], int]]] = field(default_factory=dict)
    """target -> comparison name -> :func:`stabstudy.analysis.warning.specificity.auc_difference`"""


def _families(info: pd.DataFrame) -> list[str]:
    return ["all", *sorted(info[info.event].family.unique())]


def analyse(ds: xr.Dataset, specs: Sequence[RunSpec], *, calibration_seeds: Sequence[int], rule: LabelRule,
            meta_features: Sequence[str] = F.LM_CHANNELS, config: MetaConfig | None = None,
            n_components: int | float = 0.9, budget: float = 1.0, horizon: int = 100, late: int = 20,
            n_boot: int = 1000, seed: int = 0, outcome_rule: O.OutcomeRule | None = None,
            null: Sequence[str] | None = None, max_in_alarm: float = 0.05) -> MetaStudy:
    """The whole comparison of notebook 04 on loaded runs ``ds`` (dims run, step).

    1. labels from the loss alone (``rule``); 2. run table with the seed split; 3. outcome classes
    against the unperturbed ensemble (``outcome_rule``); then :func:`analyse_labelled` (the meta-state,
    every detector, sensitivity, specificity, held-out kinds).

    ``null`` names the unperturbed runs when the default (:func:`stabstudy.analysis.warning.evaluation.run_info`)
    does not fit, e.g. a spontaneous family where every run is one where nothing was done (its event
    runs then count with their quiet steps before each warning window, :func:`~stabstudy.analysis.warning.evaluation.event_free`).
    """
    labels = label_runs(ds, rule)
    info = E.run_info(ds, labels, calibration_seeds)
    if null is not None:
        info["null"] = info.index.isin(list(null))
    cal_null = E.null_runs(info, "calibration")
    outcomes = O.classify(ds, info, cal_null.index, outcome_rule or O.OutcomeRule(burn_in=rule.burn_in))
    return analyse_labelled(ds, info, kinds_of(specs), burn_in=rule.burn_in, outcomes=outcomes,
                            meta_features=meta_features, config=config, n_components=n_components, budget=budget,
                            horizon=horizon, late=late, n_boot=n_boot, seed=seed, max_in_alarm=max_in_alarm)


def analyse_labelled(ds: xr.Dataset, info: pd.DataFrame, kinds: Sequence[str], *, burn_in: int,
                     outcomes: pd.DataFrame, targets: dict[str, tuple[str, ...]] | None = None,
                     families: Sequence[str] = FAMILIES, meta_features: Sequence[str] = F.LM_CHANNELS,
                     config: MetaConfig | None = None, n_components: int | float = 0.9, budget: float = 1.0,
                     horizon: int = 100, late: int = 20, n_boot: int = 1000, seed: int = 0,
                     pairwise: bool = True, replay: bool = False, max_in_alarm: float = 0.05) -> MetaStudy:
    """The comparison on runs already labelled: ``info`` (rows of
    :func:`stabstudy.analysis.warning.evaluation.run_info`: event, onset, split, null, ...) and
    ``outcomes`` (index run, column ``outcome``; ``targets`` says which outcomes each specificity
    target counts, default :data:`TARGETS`). Steps count rows of ``ds``; ``kinds``: the perturbation
    kinds in play (the leakage guard); ``families``: the event families the sensitivity claims ask about.

    1. meta-state PCA fitted on in-control steps of the *unperturbed* calibration runs; 2. every
    detector of :func:`stabstudy.analysis.warning.evaluation.suite` streamed over every run; 3.
    thresholds at ``budget`` false alarms per 1,000 steps on the unperturbed calibration runs,
    evaluation on the others (*sensitivity*); 4. per event family, the best single-channel
    (knob-free) detector and the best meta-state statistic chosen on the *calibration* events
    (largest mean penalised lead); 5. pairwise Wilcoxon tests of those meta-state statistics against
    every detector (Holm); 6. *collapse specificity* among perturbed runs, per target, the detectors
    chosen by their calibration AUC; 7. held-out kinds (:func:`held_out_kinds`).

    Nothing of a perturbed run enters a threshold or the PCA, so both are blind to every kind.
    ``pairwise=False`` leaves step 5 out (an empty table). ``replay=True`` computes the meta-state
    with the vectorised replay (:func:`stabstudy.analysis.warning.evaluation.meta_replay`, equal to the
    stream to 1e-9), for many long runs.
    """
    config = config or MetaConfig()
    targets = dict(TARGETS if targets is None else targets)
    kinds = tuple(kinds)
    cal = info[info.split == "calibration"]
    cal_null = E.null_runs(info, "calibration")
    pca = E.fit_meta(ds, cal_null, meta_features, config, kinds, burn_in, horizon, n_components)
    meta = (E.meta_replay if replay else E.meta_streams)(ds, meta_features, pca, config, kinds)
    dspecs = E.suite(kinds, meta_features, window=config.window, ewma=config.ewma, clip=config.clip,
                     lambda_max=bool(np.isfinite(ds["lambda_max"].values).any()) if "lambda_max" in ds else False)
    scores = E.score_runs(ds, dspecs, meta)
    ev = E.evaluate(scores, info, dspecs, budget=budget, horizon=horizon, late=late, burn_in=burn_in,
                    n_boot=n_boot, seed=seed)
    cal_leads = E.leads(scores, cal, ev.thresholds, horizon=horizon, late=late, burn_in=burn_in)
    singles = [s.name for s in dspecs if s.family == "single"]
    metas = [s.name for s in dspecs if s.family == "meta"]
    best_single, best_meta = choose(cal, cal_leads, singles, metas, late)
    pw = E.pairwise(ev.leads, metas, late) if pairwise else pd.DataFrame()
    spec_tables, spec_choice, spec_diffs = {}, {}, {}
    pert = info[info.kind != "none"]
    for target, classes in targets.items():
        y = outcomes.outcome.reindex(info.index).isin(classes)
        windows = S.window_scores(scores, info, S.spans(pert[pert.split == "calibration"], y))
        on_cal = S.separation(windows.loc[pert[pert.split == "calibration"].index], info, y, ev.thresholds,
                              singles + metas, n_boot=0)
        m, s1 = (str(on_cal.auc.reindex(c).fillna(-np.inf).idxmax()) for c in (metas, singles))
        ev_rows = windows.loc[pert[pert.split == "evaluation"].index]
        spec_choice[target] = (m, s1)
        spec_tables[target] = S.separation(ev_rows, info, y, ev.thresholds, list(dict.fromkeys([m, s1, LOSS])),
                                           n_boot=n_boot, seed=seed)
        spec_diffs[target] = {other: S.auc_difference(ev_rows, info, y, m, other, n_boot=n_boot, seed=seed)
                              for other in (s1, LOSS)}
    ho = held_out_kinds(info, cal_leads, ev.leads, singles, metas, late)
    step_t, step_leads = step_count(info, late, horizon, burn_in)
    params = {"budget": budget, "max_in_alarm": max_in_alarm, "horizon": horizon, "late": late, "burn_in": burn_in,
              "kinds": kinds,
              "targets": targets, "families": tuple(families),
              "step_count_at": step_t, "step_count_leads": step_leads,
              "n_null_calibration": len(cal_null), "n_null_evaluation": len(E.null_runs(info, "evaluation")),
              **clip_bounds(pca, config)}
    return MetaStudy(info, pca, meta, scores, dspecs, ev, cal_leads, best_single, best_meta, pw, ho, params,
                     outcomes, spec_tables, spec_choice, spec_diffs)


def step_count(info: pd.DataFrame, late: int, horizon: int, burn_in: int) -> tuple[float, pd.Series]:
    """The step-count baseline of unperturbed (spontaneous) events: one alarm at a fixed step, the
    one with the largest mean penalised lead on the calibration events, scored on the evaluation
    events (NaN where it falls outside an event's warning window). A detector that only counts
    steps does well when every seed breaks at about the same step: this says how well.

    Returns the step (NaN without calibration events) and the evaluation events' leads.
    """
    spont = info[info.event & (info.kind == "none")]
    cal, ev = spont[spont.split == "calibration"], spont[spont.split == "evaluation"]

    def leads(t: float, rows: pd.DataFrame) -> pd.Series:
        lo = rows.apply(lambda x: E.warn_from(x, horizon, burn_in), axis=1) if len(rows) else pd.Series(dtype=float)
        ok = (t >= lo) & (t <= rows.onset + late)
        return (rows.onset - t).where(ok)

    if cal.empty:
        return np.nan, pd.Series(np.nan, index=ev.index)
    cand = np.unique(np.concatenate([cal.onset - d for d in range(-late, horizon + 1)]))
    scores = [E.penalised(leads(float(t), cal).to_frame(), late).iloc[:, 0].mean() for t in cand]
    t = float(cand[int(np.argmax(scores))])
    return t, leads(t, ev)


def choose(cal: pd.DataFrame, cal_leads: pd.DataFrame, singles: Sequence[str], metas: Sequence[str],
           late: int) -> tuple[dict[str, str], dict[str, str]]:
    """Per event family of ``cal``'s events (and ``all``): the single channel and the meta-state
    statistic with the largest mean penalised lead on those calibration events."""
    best_single, best_meta = {}, {}
    for fam in _families(cal):
        rows = cal[cal.event & ((cal.family == fam) | (fam == "all"))].index
        best_single[fam] = E.best(cal_leads.loc[rows], singles, late)
        best_meta[fam] = E.best(cal_leads.loc[rows], metas, late)
    return best_single, best_meta


def clip_bounds(pca: PCAModel, config: MetaConfig) -> dict[str, float]:
    """The largest T^2 and Q the clipped z-scores can reach: ``|z| <= clip`` per channel (and its
    EWMA too), so ``||z - mean|| <= sqrt(d) clip + ||mean||``, T^2 at most that squared over the
    smallest retained variance and Q at most that squared. A threshold at or above its bound
    would mean the clip, not the data, decides the alarms."""
    r = np.sqrt(len(pca.features)) * config.clip + float(np.linalg.norm(pca.mean))
    return {"t2_bound": float(r * r / pca.variances.min()), "q_bound": float(r * r)}


def held_out_kinds(info: pd.DataFrame, cal_leads: pd.DataFrame, ev_leads: pd.DataFrame, singles: Sequence[str],
                   metas: Sequence[str], late: int) -> pd.DataFrame:
    """Each perturbation kind with evaluation events, held out for real.

    Thresholds and the PCA never see a perturbed run (:func:`analyse`), so the only thing a kind
    could teach is which detector and statistic to trust: here both are chosen on the calibration
    events of the *other* kinds, then scored once on the held-out kind's evaluation events.

    Columns: ``kind, meta, single`` (chosen without it), ``n_events, meta_detected,
    single_detected, meta_lead, single_lead`` (median penalised leads, steps) and ``meta_pen``,
    ``single_pen`` (the penalised leads, for the paired claim).
    """
    rows = []
    ev = info[(info.split == "evaluation") & info.event]
    cal = info[(info.split == "calibration") & info.event]
    for kind in sorted(k for k in ev.kind.unique() if k != "none"):
        others = cal[cal.kind != kind].index
        m, s1 = E.best(cal_leads.loc[others], metas, late), E.best(cal_leads.loc[others], singles, late)
        target = ev[ev.kind == kind].index
        pen = E.penalised(ev_leads.loc[target, [m, s1]], late)
        rows.append({"kind": kind, "meta": m, "single": s1, "n_events": len(target),
                     "meta_detected": int(ev_leads.loc[target, m].notna().sum()),
                     "single_detected": int(ev_leads.loc[target, s1].notna().sum()),
                     "meta_lead": float(pen[m].median()), "single_lead": float(pen[s1].median()),
                     "meta_pen": pen[m].to_numpy(float), "single_pen": pen[s1].to_numpy(float)})
    return pd.DataFrame(rows)


def detector_table(study: MetaStudy) -> pd.DataFrame:
    """The detector table: one row per detector, per event family ``rate`` (k/n), ``lead`` (median
    [bootstrap interval], steps) and ``AUC`` [interval], plus ``FA/1k``, ``in alarm %`` (share of
    event-free steps spent above the threshold) and the detector's family."""
    t = study.evaluation.table
    out = {}
    for det, g in t.groupby("detector", sort=False):
        if not np.isfinite(study.scores.sel(detector=det).values).any():
            continue  # the runs do not record what it reads (attention channels of the toy MLP)
        row: dict[str, Any] = {"family": g.family.iloc[0], "FA/1k": round(float(g.fa_per_1k.iloc[0]), 2),
                               "null runs": int(g.n_null.iloc[0]) if "n_null" in g else np.nan,
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
    recalibrated on the unperturbed calibration runs, then the false alarms per 1,000 event-free
    steps of the unperturbed evaluation runs, the detection rate and the median penalised lead, per event family.

    Columns: ``detector, budget, events, fa_per_1k, rate, lead_median``.
    """
    p, info, sc = study.params, study.info, study.scores
    runs = list(sc["run"].values)
    row = {r: i for i, r in enumerate(runs)}
    ev_info = info[info.split == "evaluation"]
    cal_seg = {row[r]: ab for r, ab in E.event_free(E.null_runs(info, "calibration"), p["burn_in"],
                                                     p["horizon"]).items()}
    ev_seg = {row[r]: ab for r, ab in E.event_free(E.null_runs(info, "evaluation"), p["burn_in"],
                                                    p["horizon"]).items()}
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
    """The claims of notebook 04 (before Holm: pass them to :func:`stabstudy.analysis.claims.table`):
    :func:`sensitivity_claims`, :func:`specificity_claims` and :func:`held_out_claims`."""
    return [*sensitivity_claims(study, alpha), *specificity_claims(study), *held_out_claims(study, alpha)]


def sensitivity_claims(study: MetaStudy, alpha: float = 0.05) -> list[C.Claim]:
    """Sensitivity, at one false-alarm budget set on unperturbed runs, about blow-ups (the label):

    * per event family: the best meta-state statistic warns earlier than the best single channel,
      both chosen on the calibration events (paired over the evaluation events, Wilcoxon
      signed-rank, a miss scored as the worst lead);
    * per family: the meta-state alarms before the performance label (paired lead against 0);
    * the meta-state stays quiet on the unperturbed evaluation runs (every null run's event-free
      steps, the steps the table's rate counts): per-run false alarms per 1,000 steps below the
      budget *and* per-run share of steps in alarm below ``max_in_alarm`` (t-tests over those runs,
      both must hold: an alarm that comes on once and stays on passes the first alone).
    A family with no evaluation events is "not tested".
    """
    info, ev, late = study.info, study.evaluation, study.params["late"]
    out = []
    evs = info[(info.split == "evaluation") & info.event]
    pen = E.penalised(ev.leads, late)
    for fam in study.params.get("families", FAMILIES):
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
        steps = study.params.get("step_count_leads")
        if fam == "spontaneous" and steps is not None:
            base = E.penalised(steps.reindex(idx).to_frame(), late).iloc[:, 0]
            out.append(C.paired_difference(
                f"the meta-state ({m}) warns earlier than a step count (an alarm at step "
                f"{study.params['step_count_at']:g}, chosen on the calibration events) ({fam} events)", "our own",
                pen.loc[idx, m], base, direction="greater", test="wilcoxon", alpha=alpha))
    out.append(quiet_claim(study, alpha))
    return out


def quiet_claim(study: MetaStudy, alpha: float = 0.05) -> C.Claim:
    """"The meta-state stays quiet on unperturbed runs" (:func:`sensitivity_claims`): both the
    false-alarm rate and the time in alarm below their bounds, per seed (the mean of its null runs:
    the toy's spiking and beta2-null runs of one seed share its initialisation and batches)."""
    m, ev = study.best_meta["all"], study.evaluation
    budget, most = study.params["budget"], study.params.get("max_in_alarm", 0.05)

    def per_seed(df):
        if df is None or m not in df:
            return np.empty(0)
        x = df[m]
        seeds = study.info.seed.reindex(x.index) if "seed" in study.info else pd.Series(x.index, index=x.index)
        return x.groupby(seeds.fillna(-1).to_numpy()).mean().to_numpy(float)

    fa, on = per_seed(ev.fa_runs), per_seed(ev.in_alarm_runs)
    name = f"the meta-state ({m}) stays quiet on unperturbed runs"
    parts = [C.paired_difference(f"{name}: false alarms", "our own", fa, np.full(fa.size, budget), direction="less",
                                 test="ttest", alpha=alpha),
             C.paired_difference(f"{name}: in alarm", "our own", on, np.full(on.size, most), direction="less",
                                 test="ttest", alpha=alpha) if on.size else
             C.not_tested(f"{name}: in alarm", "our own", "time in alarm not measured")]
    return C.all_of(f"{name}: false alarms per 1,000 steps below the budget of {budget:g} and at most "
                    f"{most:.0%} of the steps in alarm", "our own", parts,
                    [f"false alarms {np.nanmean(fa) if fa.size else np.nan:.2f}/1k",
                     f"in alarm {100 * np.nanmean(on) if on.size else np.nan:.1f}%"],
                    n=int(np.isfinite(fa).sum()), test="intersection of two one-sided t-tests over seeds")


def specificity_claims(study: MetaStudy) -> list[C.Claim]:
    """Collapse specificity among the perturbed evaluation runs, per target of :data:`TARGETS`
    (seed-bootstrap intervals, :mod:`stabstudy.analysis.warning.specificity`):

    * the meta-state statistic chosen on the calibration runs separates runs that will reach the
      target from those that will not, before the label (ROC-AUC above 0.5);
    * it separates them better than the best single channel, and better than the loss itself
      (difference of AUC above 0).
    A target that no evaluation run (or every one) reaches is "not tested".
    """
    out = []
    for target in study.params.get("targets", TARGETS):
        tab = study.specificity.get(target)
        where = f"(perturbed runs, outcome: {target})"
        if tab is None or tab.empty or not (tab.n_pos.iloc[0] and tab.n_neg.iloc[0]):
            why = "no perturbed evaluation run" if tab is None or tab.empty else (
                f"{int(tab.n_pos.iloc[0])} runs reach the outcome and {int(tab.n_neg.iloc[0])} do not: "
                "both are needed")
            out.append(C.not_tested(f"the meta-state tells collapsing from surviving runs {where}", SOURCE, why))
            continue
        m, s1 = study.specificity_choice[target]
        r = tab.loc[m]
        n = int(r.n_seeds)
        out.append(C.interval_above(f"the meta-state ({m}) tells collapsing from surviving runs before the label "
                                    f"{where}: ROC-AUC above 0.5", SOURCE, r.auc, (r.auc_lo, r.auc_hi), n,
                                    above=0.5, test="ROC-AUC, seed bootstrap"))
        for other, (d, ci, n_d) in study.specificity_diffs[target].items():
            out.append(C.interval_above(f"the meta-state ({m}) tells collapsing from surviving runs better than "
                                        f"{'the loss' if other == LOSS else 'the best single channel (' + other + ')'} "
                                        f"{where}: AUC difference above 0", SOURCE, d, ci, n_d, above=0.0,
                                        test="AUC difference, seed bootstrap"))
    return out


def held_out_claims(study: MetaStudy, alpha: float = 0.05) -> list[C.Claim]:
    """Per held-out kind (:func:`held_out_kinds`): the meta-state chosen without that kind warns
    earlier than the single channel chosen without it, on its evaluation events (Wilcoxon)."""
    return [C.paired_difference(f"held-out kind {r.kind}: the meta-state ({r.meta}) warns earlier than the best "
                                f"single channel ({r.single}), both chosen without {r.kind}", SOURCE, r.meta_pen,
                                r.single_pen, direction="greater", test="wilcoxon", alpha=alpha)
            for r in study.held_out.itertuples()] if len(study.held_out) else []


def _studies(x: MetaStudy | Sequence[MetaStudy]) -> list[MetaStudy]:
    return [x] if isinstance(x, MetaStudy) else list(x)


def domain_directions(studies: MetaStudy | Sequence[MetaStudy], features: Sequence[str], window: int) -> pd.DataFrame:
    """Every labelled event's pre-onset direction (:func:`stabstudy.analysis.warning.crossdomain.pre_onset_directions`)
    of one domain. A domain of several studies (RL: one per algorithm) pools their events; each
    study's seeds are kept apart (``<k>:<seed>``), since the prefix of one algorithm is another
    independent unit than the same seed of another."""
    studies = _studies(studies)
    if len(studies) == 1:
        return X.pre_onset_directions(studies[0].meta, studies[0].info, features, window)
    parts = [X.pre_onset_directions(s.meta, s.info, features, window) for s in studies]
    parts = [d.assign(seed=[f"{k}:{u}" for u in d.seed]) for k, d in enumerate(parts)]
    return pd.concat(parts) if parts else pd.DataFrame(columns=[*features, "seed"])


def cross_domain(a: MetaStudy | Sequence[MetaStudy], b: MetaStudy | Sequence[MetaStudy], names: tuple[str, str], *,
                 window: int, features: Sequence[str] | None = None, n_boot: int = 1000,
                 seed: int = 0) -> tuple[pd.DataFrame, C.Claim]:
    """The cross-domain claim (:mod:`stabstudy.analysis.warning.crossdomain`): the channels both
    meta-states read depart in the same direction before an event in both domains (every labelled
    event of either split; no choice is made on them). ``a``, ``b``: a domain's study, or its
    studies pooled (:func:`domain_directions`); ``features``: the channels to compare (default: all
    those every study reads; those some study lacks are left out). Returns each domain's mean
    pre-onset direction (rows: domain; columns: channel, and ``events``) and the claim; a domain
    without studies or events makes the claim "not tested"."""
    sa, sb = _studies(a), _studies(b)
    pool = [*sa, *sb]
    cand = features if features is not None else (pool[0].pca.features if pool else ())
    feats = [f for f in cand if all(f in s.pca.features for s in pool)]
    text = (f"the channels {names[0]} and {names[1]} share ({', '.join(feats)}) depart in the same direction "
            f"before an event in both (cosine of the mean pre-onset z, against every matching of the channels)")
    if not sa or not sb or len(feats) < 2:
        why = (f"no {names[0] if not sa else names[1]} study" if not sa or not sb
               else f"fewer than 2 shared channels ({', '.join(feats) or 'none'})")
        return pd.DataFrame(columns=[*feats, "events"]), C.not_tested(text, SOURCE, why)
    da, db = (domain_directions(s, feats, window) for s in (sa, sb))
    r = X.similarity(da, db, feats, n_boot=n_boot, seed=seed)
    claim = C.from_p(text, SOURCE, r["cos"], (r["ci_low"], r["ci_high"]), r["n"], p_for=r["p_greater"],
                     p_against=r["p_less"], test="exact permutation of channels; seed bootstrap")
    dirs = pd.DataFrame([da[feats].mean(), db[feats].mean()], index=list(names))
    return dirs.assign(events=[r["n_a"], r["n_b"]]), claim


def verdict_stability(study: MetaStudy, n_resamples: int = 200, seed: int = 0) -> pd.DataFrame:
    """How often :func:`sensitivity_claims` keep their verdict when the calibration seeds are resampled.

    Each resample draws the calibration seeds with replacement, recalibrates every single-channel
    and meta-state threshold on the drawn seeds' unperturbed runs, re-chooses the best detectors on
    their events, and re-scores the evaluation runs (Holm within the sensitivity claims, as for the
    point verdict here). Columns: ``claim`` (as at the point estimate), ``verdict``, ``same`` (share
    of resamples with that verdict), ``n_resamples``. Resamples that draw the same seeds (in any order)
    share one computation: with one calibration seed every resample is the point estimate.
    """
    info, p, sc = study.info, study.params, study.scores
    late, horizon, burn_in, budget = p["late"], p["horizon"], p["burn_in"], p["budget"]
    dets = [s.name for s in study.specs if s.family in ("single", "meta")]
    arr = sc.sel(detector=dets).transpose("detector", "run", "step").values
    row = {r: i for i, r in enumerate(sc["run"].values)}
    cal_null = E.null_runs(info, "calibration")
    segs = E.event_free(cal_null, burn_in, horizon)
    pairs = {(d, r): E.step_pairs(arr[k], {row[r]: segs[r]}) for k, d in enumerate(dets) for r in cal_null.index}
    cal = info[info.split == "calibration"]
    ev_info = info[info.split == "evaluation"]
    ev_null = E.null_runs(info, "evaluation")
    free = E.event_free(ev_null, burn_in, horizon)
    ev_pairs = {(d, r): E.step_pairs(arr[k], {row[r]: free[r]}) for k, d in enumerate(dets) for r in ev_null.index}
    base = C.table(sensitivity_claims(study), power=False)
    singles = [s.name for s in study.specs if s.family == "single"]
    metas = [s.name for s in study.specs if s.family == "meta"]
    rng = np.random.default_rng(seed)
    seeds = np.unique(cal.seed)
    same = np.zeros(len(base))
    seen: dict[tuple, np.ndarray] = {}  # the verdicts depend on the drawn seeds, not on their order
    for _ in range(n_resamples):
        draw = rng.choice(seeds, size=seeds.size, replace=True)
        key = tuple(sorted(draw.tolist()))
        if key in seen:
            same += seen[key]
            continue
        nulls = [r for u in draw for r in cal_null.index[cal_null.seed == u]]
        thr = pd.Series({d: E.threshold_for(*(np.concatenate([pairs[d, r][i] for r in nulls]) for i in (0, 1)),
                                            sum(pairs[d, r][2] for r in nulls), budget) if nulls else np.inf
                         for d in dets})
        drawn = [r for u in draw for r in cal.index[cal.seed == u]]
        ld = E.leads(sc.sel(detector=dets), cal.loc[sorted(set(drawn))], thr, horizon=horizon, late=late,
                     burn_in=burn_in)
        rep = cal.loc[drawn]
        rep = rep[rep.event]  # one row per drawn event, a seed drawn twice counting twice
        best_single, best_meta = choose(rep.reset_index(drop=True), ld.loc[rep.index].reset_index(drop=True),
                                        singles, metas, late)
        best_single = {**study.best_single, **best_single}
        best_meta = {**study.best_meta, **best_meta}
        leads = E.leads(sc.sel(detector=dets), ev_info, thr, horizon=horizon, late=late, burn_in=burn_in)
        # E.count_alarms and E.time_in_alarm, from the evaluation nulls' step pairs
        th = thr.to_dict()
        fa = pd.DataFrame({d: [1000.0 * np.count_nonzero((lo <= th[d]) & (hi > th[d])) / n if n else np.nan
                               for lo, hi, n in (ev_pairs[d, r] for r in ev_null.index)] for d in dets},
                          index=ev_null.index)
        on = pd.DataFrame({d: [np.count_nonzero(hi > th[d]) / n if n else np.nan
                               for _, hi, n in (ev_pairs[d, r] for r in ev_null.index)] for d in dets},
                          index=ev_null.index)
        b = replace(study, evaluation=replace(study.evaluation, thresholds=thr, leads=leads,
                                              fa_runs=fa, in_alarm_runs=on),
                    best_single=best_single, best_meta=best_meta)
        seen[key] = C.table(sensitivity_claims(b), power=False).verdict.to_numpy() == base.verdict.to_numpy()
        same += seen[key]
    return pd.DataFrame({"claim": base.claim, "verdict": base.verdict, "same": same / max(n_resamples, 1),
                         "n_resamples": n_resamples})


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
