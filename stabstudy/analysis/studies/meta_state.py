"""Notebook 04 (meta-state analysis): its grid, its analysis plan, the analysis pipeline and its claims.

The grid bracketing the critical dose: slow-onset learning-rate ramps (:data:`lr_ramp`), shocks
(LR spikes, outlier batches) at one step, harmless doses of both, unperturbed runs, *held-out* kinds
added only after the protocol was frozen (on evaluation seeds alone), and optionally a *spontaneous*
configuration (unperturbed runs meant to be unstable at a constant learning rate). Runs of notebook
02 are reused where the specs match (same hyperparameter names and values, steps, spike step and
seeds). The pipeline (:func:`analyse`) labels events from the loss alone (the onset speed setting each
event's family), fits the meta-state PCA and calibrates every detector on the calibration seeds, and
evaluates on the others (:mod:`stabstudy.analysis.warning.evaluation`). The claims take seeds as
their units (:mod:`stabstudy.analysis.warning.units`), compare the meta-state with the loss and with
the best single channel, count alarms on harmless perturbations, and are recomputed under every
declared variation of the protocol (:func:`stabstudy.analysis.studies.meta_robustness.robustness`). What the
notebook shows besides them: :mod:`stabstudy.analysis.studies.meta_summaries`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pandas as pd
import xarray as xr

from stabstudy.analysis import claims as C
from stabstudy.analysis.plan import Planned
from stabstudy.analysis.studies import lm_spikes
from stabstudy.analysis.warning import evaluation as E
from stabstudy.analysis.warning import outcomes as O
from stabstudy.analysis.warning import specificity as S
from stabstudy.analysis.warning import units as U
from stabstudy.analysis.warning.labels import FAMILIES as SPEEDS
from stabstudy.analysis.warning.labels import LabelRule, label_runs
from stabstudy.online import MetaConfig, PCAModel
from stabstudy.online import features as F
from stabstudy.spec import Perturbation, RunSpec

SOURCE = "source paper (arXiv 2601.13160)"
#: The performance-only detector every sensitivity claim compares with ("before performance degradation
#: becomes visible" is the source paper's claim).
LOSS = "loss robust z (performance)"
#: Specificity targets: which outcome classes (:data:`stabstudy.analysis.warning.outcomes.OUTCOMES`) count.
TARGETS: dict[str, tuple[str, ...]] = {"explodes": ("explodes",),
                                       "lasting damage": ("explodes", "silently degrades")}
#: Outcome classes of a harmful perturbation (lasting damage) and of a harmless one (nuisance alarms).
HARMFUL: tuple[str, ...] = TARGETS["lasting damage"]
HARMLESS: tuple[str, ...] = ("unaffected",)
#: Event families the sensitivity claims ask about: the onset speeds the label measures
#: (:func:`stabstudy.analysis.warning.labels.family`), never a perturbation kind.
FAMILIES: tuple[str, ...] = SPEEDS
#: Smallest effects of interest of the lead-time claims, in steps per family (the project's margins:
#: 10 steps on a 100-step horizon, 1 step for shocks).
SESOI: dict[str, float] = {"slow-onset": 10.0, "shock": 1.0}
#: Smallest effect of interest of the alarm-share claims (harmful against harmless runs): 20 points.
SESOI_SHARE = 0.2
#: Smallest effects of interest of the specificity claims: a ROC-AUC of 0.6 at least, and 0.05 of AUC
#: between two detectors.
SESOI_AUC, SESOI_AUC_DIFF = 0.1, 0.05
#: The channels every domain's meta-state reads, whose pre-onset directions the cross-domain claim compares.
SHARED_CHANNELS: tuple[str, ...] = ("grad_norm", "xgrad", "update_ratio/lr", "update_grad_cos", "adam_m_norm",
                                    "adam_v_mean")
#: The commit that froze every protocol choice of notebook 04 (label, families, windows, budget, meta-state,
#: detectors, claims, variations) before the held-out kinds were added to its grid; empty until then.
PROTOCOL_FROZEN_AT = "47e4656"


def plan(domain: str, *, sesoi: Mapping[str, float] | None = None, budget: float = 1.0,
         max_in_alarm: float = 0.05, held_out: Sequence[str] = (), step_count: bool = False,
         families: Sequence[str] = FAMILIES) -> dict[str, Planned]:
    """Notebook 04's analysis plan for one ``domain`` (GPT, toy, ...), fixed before the runs: each
    confirmatory claim's family (one question in one domain, named in parentheses: Holm adjusts within
    it) and smallest effect of interest, keyed as :func:`claims` looks them up. ``sesoi``: lead-time
    margins per event family (default :data:`SESOI`)."""
    lead = dict(sesoi or SESOI)
    domain = f" ({domain})" if domain else ""
    why_lead = "the project's margins for leads: 10 steps on a 100-step horizon, 1 step for a shock"
    out = {}
    for fam in families:
        m = float(lead.get(fam, min(lead.values())))
        out[f"loss/{fam}"] = Planned(f"warns earlier than the loss{domain}", m, "steps of lead, mean per seed",
                                     why_lead + "; the source paper's claim: before performance degradation shows")
        out[f"single/{fam}"] = Planned(f"warns earlier than the best single channel{domain}", m,
                                       "steps of lead, mean per seed", why_lead)
        out[f"zero/{fam}"] = Planned(f"deviates before the collapse{domain}", m, "steps of lead, mean per seed",
                                     why_lead)
        if step_count:
            out[f"steps/{fam}"] = Planned(f"warns earlier than a step count{domain}", m,
                                          "steps of lead, mean per seed", why_lead)
    out["quiet/fa"] = Planned(f"quiet on unperturbed runs{domain}", 0.0, "false alarms per 1,000 steps, per seed",
                              f"the budget itself ({budget:g}): below it or not")
    out["quiet/on"] = Planned(f"quiet on unperturbed runs{domain}", 0.0, "share of steps in alarm, per seed",
                              f"the bound itself ({max_in_alarm:.0%}): below it or not")
    out["harm"] = Planned(f"alarms on harmful more than on harmless perturbations{domain}", SESOI_SHARE,
                          "share of a seed's runs alarmed", "the project's margin: an alarm worth acting on marks "
                          "20 points more of the harmful runs than of the harmless ones")
    for t in TARGETS:
        fam = f"tells collapsing from surviving runs{domain}"
        out[f"auc/{t}"] = Planned(fam, SESOI_AUC, "ROC-AUC above 0.5", "the project's margin: an AUC of 0.6 at least")
        out[f"auc-single/{t}"] = Planned(fam, SESOI_AUC_DIFF, "difference of ROC-AUC", "the project's margin")
        out[f"auc-loss/{t}"] = Planned(fam, SESOI_AUC_DIFF, "difference of ROC-AUC", "the project's margin")
    for k in held_out:
        fam = f"held-out kinds{domain}"
        out[f"held/{k}/loss"] = Planned(fam, min(lead.values()), "steps of lead, mean per seed",
                                        why_lead + " (the smaller: a kind's events may be of either speed)")
        out[f"held/{k}/single"] = Planned(fam, min(lead.values()), "steps of lead, mean per seed",
                                          why_lead + " (the smaller: a kind's events may be of either speed)")
        out[f"held/{k}/harm"] = Planned(fam, SESOI_SHARE, "share of runs alarmed", "as for the trained-on kinds")
    return out


def grid(steps: int, seeds: Sequence[int], *, ramp_start: int, ramps: Sequence[Sequence[float]],
         shock_step: int, shocks: Sequence[Sequence[Any]], spontaneous: dict[str, Any] | None = None,
         spontaneous_seeds: Sequence[int] = (), null_seeds: Sequence[int] = (),
         held_out: Sequence[Sequence[Any]] = (), held_out_seeds: Sequence[int] = (), curvature_every: int = 0,
         curvature_iters: int = 20, **hp: Any) -> list[RunSpec]:
    """The runs of notebook 04.

    Args:
        steps: optimizer updates per run.
        seeds: every seed gets an unperturbed run, each ramp and each shock.
        ramp_start: first step of every ``lr_ramp``.
        ramps: ``[dose, duration]`` pairs of ``lr_ramp`` perturbations (the factor climbs from 1 to
            ``dose`` over ``duration`` steps and stays there).
        shock_step: step at which every shock (and every held-out kind) starts.
        shocks: ``[kind, dose, duration]`` triples (``lr_spike``, ``outlier_batch``, ...).
        spontaneous: hyperparameters laid over ``hp`` for unperturbed runs of the spontaneous family
            (none when empty).
        spontaneous_seeds: seeds of those runs.
        null_seeds: seeds of further unperturbed runs (the null the thresholds are calibrated on;
            they cost one run each, and no perturbed run shares their steps).
        held_out: ``[kind, dose, duration]`` triples of kinds no protocol choice saw, on ``held_out_seeds``.
        held_out_seeds: their seeds (evaluation seeds: nothing of theirs may enter a choice).
        curvature_every: measure ``lambda_max`` every this many steps in every run (0: never, and
            the specs stay those of notebook 02).
        curvature_iters: Hessian-vector products per measurement.
        hp: learner hyperparameters of every run (give them as notebook 02 does to share its runs).
    """
    if curvature_every:
        hp = {**hp, "curvature_iters": curvature_iters}

    def base_spec(steps: int, seed: int, **kw: Any) -> RunSpec:
        return lm_spikes.base_spec(steps, seed, curvature_every=curvature_every, **kw)

    def one(seed: int, kind: str, start: int, dose: Any, duration: Any) -> RunSpec:
        return base_spec(steps, seed, perturbations=(Perturbation(str(kind), start, int(duration), dose=float(dose)),),
                         **hp)

    specs = []
    for seed in seeds:
        specs.append(base_spec(steps, seed, **hp))
        specs += [one(seed, "lr_ramp", ramp_start, dose, duration) for dose, duration in ramps]
        specs += [one(seed, kind, shock_step, dose, duration) for kind, dose, duration in shocks]
    specs += [base_spec(steps, seed, **hp) for seed in null_seeds]
    if spontaneous:
        specs += [base_spec(steps, seed, **{**hp, **spontaneous}) for seed in spontaneous_seeds]
    specs += [one(seed, kind, shock_step, dose, duration) for seed in held_out_seeds for kind, dose, duration in held_out]
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
    params: dict[str, Any] = field(default_factory=dict)
    outcomes: pd.DataFrame = field(default_factory=pd.DataFrame)
    specificity: dict[str, pd.DataFrame] = field(default_factory=dict)
    """target -> :func:`stabstudy.analysis.warning.specificity.separation` of the evaluation runs"""
    specificity_choice: dict[str, tuple[str, str]] = field(default_factory=dict)
    """target -> (meta-state statistic, single channel) with the largest calibration AUC"""
    specificity_diffs: dict[str, dict[str, tuple[float, tuple[float, float], int, np.ndarray]]] = field(
        default_factory=dict)
    """target -> comparison name -> :func:`stabstudy.analysis.warning.specificity.auc_difference`"""
    alarms: pd.DataFrame = field(default_factory=pd.DataFrame)
    """every run x detector: :func:`stabstudy.analysis.warning.evaluation.alarmed`"""
    held_out_leads: pd.DataFrame = field(default_factory=pd.DataFrame)
    """the evaluation events of the held-out kinds x detector: leads (NaN when missed)"""


def families_in(info: pd.DataFrame) -> list[str]:
    """``all`` and the event families of ``info``'s events."""
    return ["all", *sorted(info[info.event].family.unique())]


def analyse(ds: xr.Dataset, specs: Sequence[RunSpec], *, calibration_seeds: Sequence[int], rule: LabelRule,
            meta_features: Sequence[str] = F.LM_CHANNELS, config: MetaConfig | None = None,
            n_components: int | float = 0.9, budget: float = 1.0, horizon: int = 100, late: int = 20,
            n_boot: int = 1000, seed: int = 0, outcome_rule: O.OutcomeRule | None = None,
            null: Sequence[str] | None = None, max_in_alarm: float = 0.05, held_out: Sequence[str] = (),
            step_count: bool = False, sesoi: Mapping[str, float] | None = None, reuse: MetaStudy | None = None,
            intervals: bool = True, replay: bool = False, pairwise: bool = True, domain: str = "") -> MetaStudy:
    """The whole comparison of notebook 04 on loaded runs ``ds`` (dims run, step).

    1. labels from the loss alone (``rule``), with each event's onset speed (its family); 2. run table
    with the seed split; 3. outcome classes against the unperturbed ensemble (``outcome_rule``); then
    :func:`analyse_labelled` (the meta-state, every detector, sensitivity, specificity, alarms).

    ``null`` names the unperturbed runs when the default (:func:`stabstudy.analysis.warning.evaluation.run_info`)
    does not fit, e.g. a spontaneous family where every run is one where nothing was done (its event
    runs then count with their quiet steps before each warning window, :func:`~stabstudy.analysis.warning.evaluation.event_free`).
    ``held_out``, ``step_count``, ``sesoi``, ``reuse``, ``intervals``, ``replay``, ``pairwise``, ``domain``: as
    in :func:`analyse_labelled`.
    """
    labels = label_runs(ds, rule)
    info = E.run_info(ds, labels, calibration_seeds)
    if null is not None:
        info["null"] = info.index.isin(list(null))
    cal_null = E.null_runs(info, "calibration")
    outcomes = O.classify(ds, info, cal_null.index, outcome_rule or O.OutcomeRule(burn_in=rule.burn_in))
    return analyse_labelled(ds, info, kinds_of(specs), burn_in=rule.burn_in, outcomes=outcomes,
                            meta_features=meta_features, config=config, n_components=n_components, budget=budget,
                            horizon=horizon, late=late, n_boot=n_boot, seed=seed, max_in_alarm=max_in_alarm,
                            held_out=held_out, step_count=step_count, sesoi=sesoi, reuse=reuse, intervals=intervals,
                            replay=replay, pairwise=pairwise, domain=domain)


def _same_pca(a: PCAModel, b: PCAModel) -> bool:
    return (tuple(a.features) == tuple(b.features) and a.components.shape == b.components.shape
            and bool(np.array_equal(a.components, b.components)) and bool(np.array_equal(a.mean, b.mean))
            and bool(np.array_equal(a.variances, b.variances)))


def _scores(ds: xr.Dataset, dspecs: list[E.DetectorSpec], meta_features: Sequence[str], pca: PCAModel,
            config: MetaConfig, kinds: Sequence[str], replay: bool,
            reuse: MetaStudy | None) -> tuple[xr.Dataset, xr.DataArray]:
    """The meta-state and every detector's scores; from ``reuse`` what it computed the same way: all of
    it when the meta-state's configuration and PCA are the same, else every detector but those that read
    the meta-state (a new PCA) or the suite's window, EWMA and clip (a new configuration)."""
    same_runs = reuse is not None and list(reuse.scores["run"].values) == list(ds["run"].values)
    if same_runs and reuse.params.get("config") == config and _same_pca(reuse.pca, pca) \
            and [s.name for s in reuse.specs] == [s.name for s in dspecs]:
        return reuse.meta, reuse.scores
    meta = (E.meta_replay if replay else E.meta_streams)(ds, meta_features, pca, config, kinds)
    if not same_runs or [s.name for s in reuse.specs] != [s.name for s in dspecs]:
        return meta, E.score_runs(ds, dspecs, meta)
    redo = [s for s in dspecs if s.family == "meta" or (s.windowed and reuse.params.get("config") != config)]
    scores = reuse.scores.copy()
    scores.loc[{"detector": [s.name for s in redo]}] = E.score_runs(ds, redo, meta, progress=False).values
    return meta, scores


def analyse_labelled(ds: xr.Dataset, info: pd.DataFrame, kinds: Sequence[str], *, burn_in: int,
                     outcomes: pd.DataFrame, targets: dict[str, tuple[str, ...]] | None = None,
                     families: Sequence[str] = FAMILIES, meta_features: Sequence[str] = F.LM_CHANNELS,
                     config: MetaConfig | None = None, n_components: int | float = 0.9, budget: float = 1.0,
                     horizon: int = 100, late: int = 20, n_boot: int = 1000, seed: int = 0,
                     pairwise: bool = True, replay: bool = False, max_in_alarm: float = 0.05,
                     held_out: Sequence[str] = (), step_count: bool = False, sesoi: Mapping[str, float] | None = None,
                     reuse: MetaStudy | None = None, intervals: bool = True, domain: str = "") -> MetaStudy:
    """The comparison on runs already labelled: ``info`` (rows of
    :func:`stabstudy.analysis.warning.evaluation.run_info`: event, onset, family, split, null, ...) and
    ``outcomes`` (index run, column ``outcome``; ``targets`` says which outcomes each specificity
    target counts, default :data:`TARGETS`). Steps count rows of ``ds``; ``kinds``: the perturbation
    kinds in play (the leakage guard); ``families``: the event families the sensitivity claims ask about.

    1. meta-state PCA fitted on in-control steps of the *unperturbed* calibration runs; 2. every
    detector of :func:`stabstudy.analysis.warning.evaluation.suite` streamed over every run; 3.
    thresholds at ``budget`` false alarms per 1,000 steps on the unperturbed calibration runs,
    evaluation on the others (*sensitivity*); 4. per event family, the best single-channel
    (knob-free) detector and the best meta-state statistic chosen on the *calibration* events
    (largest mean penalised lead); 5. pairwise Wilcoxon tests of those meta-state statistics against
    every detector (Holm; descriptive: events are not independent); 6. *collapse specificity* among
    perturbed runs, per target, the detectors chosen by their calibration AUC; 7. whether each
    detector alarmed on each run (false, nuisance and justified alarms).

    ``held_out``: kinds no protocol choice may see (the runs of those kinds enter no calibration, no
    choice and no claim but their own: :func:`held_out_claims`). ``step_count``: the claims compare the
    meta-state with a step count too (a domain where nothing is done to any run). ``sesoi``: smallest
    effects of interest per family (default :data:`SESOI`). Nothing of a perturbed run enters a
    threshold or the PCA, so both are blind to every kind. ``pairwise=False`` leaves step 5 out (an
    empty table). ``replay=True`` computes the meta-state with the vectorised replay
    (:func:`stabstudy.analysis.warning.evaluation.meta_replay`, equal to the stream to 1e-9), for many
    long runs. ``reuse``: a study of the same runs whose scores are taken where nothing they depend on
    changed (:func:`stabstudy.analysis.studies.meta_robustness.vary`). ``intervals=False`` leaves the detector table's bootstrap intervals out.
    ``domain`` names the claims' families (:func:`plan`).
    """
    config = config or MetaConfig()
    targets = dict(TARGETS if targets is None else targets)
    kinds, held_out = tuple(kinds), tuple(held_out)
    unseen = info.kind.isin(held_out)
    main = info[~unseen]
    cal = main[main.split == "calibration"]
    cal_null = E.null_runs(main, "calibration")
    pca = E.fit_meta(ds, cal_null, meta_features, config, kinds, burn_in, horizon, n_components)
    dspecs = E.suite(kinds, meta_features, window=config.window, ewma=config.ewma, clip=config.clip,
                     lambda_max=bool(np.isfinite(ds["lambda_max"].values).any()) if "lambda_max" in ds else False)
    meta, scores = _scores(ds, dspecs, meta_features, pca, config, kinds, replay, reuse)
    ev = E.evaluate(scores.sel(run=main.index.values), main, dspecs, budget=budget, horizon=horizon, late=late,
                    burn_in=burn_in, n_boot=n_boot if intervals else 0, seed=seed)
    cal_leads = E.leads(scores, cal, ev.thresholds, horizon=horizon, late=late, burn_in=burn_in)
    ho_ev = info[unseen & (info.split == "evaluation")]
    ho_leads = E.leads(scores, ho_ev, ev.thresholds, horizon=horizon, late=late, burn_in=burn_in)
    alarms = E.alarmed(scores, info, ev.thresholds, late=late, burn_in=burn_in)
    singles = [s.name for s in dspecs if s.family == "single"]
    metas = [s.name for s in dspecs if s.family == "meta"]
    best_single, best_meta = choose(cal, cal_leads, singles, metas, late)
    pw = E.pairwise(ev.leads, metas, late) if pairwise else pd.DataFrame()
    spec_tables, spec_choice, spec_diffs = {}, {}, {}
    pert = main[main.kind != "none"]
    windows = S.window_scores(scores, info, burn_in)
    for target, classes in targets.items():
        y = outcomes.outcome.reindex(info.index).isin(classes)
        on_cal = S.separation(windows.loc[pert[pert.split == "calibration"].index], info, y, ev.thresholds,
                              singles + metas, n_boot=0)
        m, s1 = (str(on_cal.auc.reindex(c).fillna(-np.inf).idxmax()) for c in (metas, singles))
        ev_rows = windows.loc[pert[pert.split == "evaluation"].index]
        spec_choice[target] = (m, s1)
        spec_tables[target] = S.separation(ev_rows, info, y, ev.thresholds, list(dict.fromkeys([m, s1, LOSS])),
                                           n_boot=n_boot, seed=seed)
        spec_diffs[target] = {other: S.auc_difference(ev_rows, info, y, m, other, n_boot=n_boot, seed=seed)
                              for other in (s1, LOSS)}
    step_t, step_leads = step_count_baseline(main, late, horizon, burn_in) if step_count else (np.nan, None)
    params = {"budget": budget, "max_in_alarm": max_in_alarm, "horizon": horizon, "late": late, "burn_in": burn_in,
              "kinds": kinds, "held_out": held_out, "config": config, "n_components": n_components,
              "n_boot": n_boot, "seed": seed,
              "targets": targets, "families": tuple(families), "sesoi": dict(sesoi or SESOI),
              "step_count": step_count, "step_count_at": step_t, "step_count_leads": step_leads, "domain": domain,
              "plan": plan(domain, sesoi=sesoi, budget=budget, max_in_alarm=max_in_alarm,
                           held_out=held_out, step_count=step_count, families=families),
              "n_null_calibration": len(cal_null), "n_null_evaluation": len(E.null_runs(main, "evaluation")),
              **clip_bounds(pca, config)}
    return MetaStudy(info, pca, meta, scores, dspecs, ev, cal_leads, best_single, best_meta, pw, params,
                     outcomes, spec_tables, spec_choice, spec_diffs, alarms, ho_leads)


def step_count_baseline(info: pd.DataFrame, late: int, horizon: int, burn_in: int) -> tuple[float, pd.Series]:
    """The step-count baseline: one alarm at a fixed step, the one with the largest mean penalised lead
    on the calibration events of ``info``, scored on its evaluation events (NaN where it falls outside
    an event's warning window). A detector that only counts steps does well when every seed breaks at
    about the same step: this says how well (the toy, where nothing is done to any run).

    Returns the step (NaN without calibration events) and the evaluation events' leads.
    """
    events = info[info.event]
    cal, ev = events[events.split == "calibration"], events[events.split == "evaluation"]

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
    for fam in families_in(cal):
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


def claims(study: MetaStudy, alpha: float = 0.05) -> list[C.Claim]:
    """The confirmatory claims of notebook 04 (before Holm: pass them to :func:`stabstudy.analysis.claims.table`):
    :func:`sensitivity_claims`, :func:`specificity_claims` and :func:`held_out_claims`. Claim texts name
    no chosen detector (the ``test`` column does), so that a claim keeps its text under every variation
    of the protocol (:func:`stabstudy.analysis.studies.meta_robustness.robustness`)."""
    return [*sensitivity_claims(study, alpha), *specificity_claims(study, alpha), *held_out_claims(study, alpha)]


def seeds_of(study: MetaStudy, runs: pd.Index) -> pd.Series:
    """The seed of each of ``runs`` (each its own unit where ``info`` has no seeds)."""
    info = study.info
    return info.seed.reindex(runs) if "seed" in info else pd.Series(np.arange(len(runs)), index=runs)


def seed_leads(study: MetaStudy, events: pd.Index, detectors: Mapping[str, Sequence[str] | str],
               leads: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per seed (rows) and role (columns, the keys of ``detectors``): the mean penalised lead over the
    seed's ``events``; a role's detector may differ per event (a sequence aligned with ``events``:
    each event's family's choice). ``leads``: the events' leads (default: the evaluation's)."""
    late = study.params["late"]
    ld = E.penalised(study.evaluation.leads if leads is None else leads, late)
    cols = {}
    for role, det in detectors.items():
        dets = [det] * len(events) if isinstance(det, str) else list(det)
        vals = [ld.at[r, d] if d in ld.columns else np.nan for r, d in zip(events, dets, strict=True)]
        cols[role] = U.per_seed(pd.Series(vals, index=events, dtype=float), seeds_of(study, events))
    return pd.DataFrame(cols)


def _plan(study: MetaStudy) -> dict[str, Planned]:
    p = study.params
    return p.get("plan") or plan(p.get("domain", ""), sesoi=p.get("sesoi"), budget=p.get("budget", 1.0),
                                 max_in_alarm=p.get("max_in_alarm", 0.05), held_out=p.get("held_out", ()),
                                 step_count=p.get("step_count", False), families=p.get("families", FAMILIES))


def _lead_claim(claim: str, source: str, per_seed: pd.DataFrame, a: str, b: str | None, *, what: str,
                planned: Planned, alpha: float) -> C.Claim:
    x = per_seed[a].to_numpy(float)
    y = per_seed[b].to_numpy(float) if b is not None else np.zeros(len(per_seed))
    c = C.paired_difference(claim, source, x, y, direction="greater", test="ttest", alpha=alpha, **planned.rule)
    return replace(c, test=f"{c.test} over seeds (mean penalised lead per seed): {what}")


def _untested(text: str, source: str, why: str, planned: Planned) -> C.Claim:
    return C.not_tested(text, source, why, family=planned.family, sesoi=planned.sesoi)


def sensitivity_claims(study: MetaStudy, alpha: float = 0.05) -> list[C.Claim]:
    """Sensitivity, at one false-alarm budget set on unperturbed runs, about blow-ups (the label), with
    seeds as the units (each seed's mean penalised lead over its evaluation events of the family; a miss
    counts as the worst lead), per event family (the onset speed), each decided at the plan's smallest
    effect (:func:`plan`):

    * the best meta-state statistic (chosen on the calibration events) warns earlier than the loss
      itself (:data:`LOSS`: the source paper's "before performance degradation becomes visible");
    * it warns earlier than the best single channel, chosen on the calibration events too;
    * it alarms before the performance label (lead above 0);
    * where ``params["step_count"]``, it warns earlier than a step count (:func:`step_count_baseline`);
    * it stays quiet on the unperturbed evaluation runs (:func:`quiet_claim`).
    A family with no evaluation events is "not tested". The runs of held-out kinds are left out (their
    own claims: :func:`held_out_claims`).
    """
    info, pl = study.info, _plan(study)
    out = []
    held = set(study.params.get("held_out", ()))
    evs = info[(info.split == "evaluation") & info.event & ~info.kind.isin(held)]
    for fam in study.params.get("families", FAMILIES):
        idx = evs[evs.family == fam].index
        texts = {"loss": f"the meta-state warns earlier than the loss at the same false-alarm budget ({fam} events)",
                 "single": f"the meta-state warns earlier than the best single channel at the same false-alarm budget "
                           f"({fam} events)",
                 "zero": f"the meta-state deviates before performance collapses ({fam} events: lead > 0)"}
        if study.params.get("step_count"):
            texts["steps"] = f"the meta-state warns earlier than a step count ({fam} events)"
        if len(idx) == 0:
            why = f"no {fam} event in the evaluation runs"
            out += [_untested(t, SOURCE if k != "steps" else "our own", why, pl[f"{k}/{fam}"]) for k, t in texts.items()]
            continue
        m, s = study.best_meta.get(fam, study.best_meta["all"]), study.best_single.get(fam, study.best_single["all"])
        ps = seed_leads(study, idx, {"meta": m, "loss": LOSS, "single": s})
        out.append(_lead_claim(texts["loss"], SOURCE, ps, "meta", "loss", what=f"{m} vs {LOSS}",
                               planned=pl[f"loss/{fam}"], alpha=alpha))
        out.append(_lead_claim(texts["single"], SOURCE, ps, "meta", "single", what=f"{m} vs {s}",
                               planned=pl[f"single/{fam}"], alpha=alpha))
        out.append(_lead_claim(texts["zero"], SOURCE, ps, "meta", None, what=f"{m} vs 0",
                               planned=pl[f"zero/{fam}"], alpha=alpha))
        if "steps" in texts:
            steps = study.params.get("step_count_leads")
            base = E.penalised((steps if steps is not None else pd.Series(np.nan, index=idx)).reindex(idx).to_frame(),
                               study.params["late"]).iloc[:, 0]
            ps["steps"] = U.per_seed(base, seeds_of(study, idx))
            out.append(_lead_claim(texts["steps"], "our own", ps, "meta", "steps",
                                   what=f"{m} vs one alarm at step {study.params['step_count_at']:g} "
                                        "(chosen on the calibration events)", planned=pl[f"steps/{fam}"], alpha=alpha))
    out.append(quiet_claim(study, alpha))
    return out


def quiet_claim(study: MetaStudy, alpha: float = 0.05) -> C.Claim:
    """"The meta-state stays quiet on unperturbed runs" (:func:`sensitivity_claims`): both the
    false-alarm rate and the time in alarm below their bounds, per seed (the mean of its null runs:
    the toy's spiking and beta2-null runs of one seed share its initialisation and batches); each
    part "not supported" when shown above its bound."""
    m, ev, pl = study.best_meta["all"], study.evaluation, _plan(study)
    budget, most = study.params["budget"], study.params.get("max_in_alarm", 0.05)

    def per_seed(df):
        if df is None or m not in df:
            return np.empty(0)
        x = df[m]
        seeds = study.info.seed.reindex(x.index) if "seed" in study.info else pd.Series(x.index, index=x.index)
        return x.groupby(seeds.fillna(-1).to_numpy()).mean().to_numpy(float)

    fa, on = per_seed(ev.fa_runs), per_seed(ev.in_alarm_runs)
    name = "the meta-state stays quiet on unperturbed runs"
    fam = pl["quiet/fa"].family
    parts = [C.paired_difference(f"{name}: false alarms", "our own", fa, np.full(fa.size, budget), direction="less",
                                 test="ttest", alpha=alpha, planning=budget / 2, **pl["quiet/fa"].rule),
             C.paired_difference(f"{name}: in alarm", "our own", on, np.full(on.size, most), direction="less",
                                 test="ttest", alpha=alpha, planning=most / 2, **pl["quiet/on"].rule) if on.size else
             C.not_tested(f"{name}: in alarm", "our own", "time in alarm not measured")]
    return C.all_of(f"{name}: false alarms per 1,000 steps below the budget and at most {most:.0%} of the steps "
                    "in alarm", "our own", parts,
                    [f"false alarms {np.nanmean(fa) if fa.size else np.nan:.2f}/1k (budget {budget:g})",
                     f"in alarm {100 * np.nanmean(on) if on.size else np.nan:.1f}%"],
                    n=int(np.isfinite(fa).sum()), test=f"intersection of two one-sided t-tests over seeds: {m}",
                    family=fam)


def harm_shares(study: MetaStudy, detector: str, runs: pd.Index) -> pd.DataFrame:
    """Per seed (rows): the share of its perturbed ``runs`` with lasting damage (:data:`HARMFUL`) on which
    ``detector`` alarmed (``harmful``) and the share of those that end unaffected (``harmless``: nuisance
    alarms), with their counts (``n_harmful``, ``n_harmless``); NaN where a seed has none of a kind."""
    y = study.outcomes.outcome.reindex(runs)
    a = study.alarms.loc[runs, detector].astype(float)
    seeds = seeds_of(study, runs)
    out = {}
    for name, classes in (("harmful", HARMFUL), ("harmless", HARMLESS)):
        sel = y.isin(classes)
        out[name] = a[sel].groupby(seeds[sel].to_numpy()).mean()
        out[f"n_{name}"] = sel.groupby(seeds.to_numpy()).sum()
    return pd.DataFrame(out)


def specificity_claims(study: MetaStudy, alpha: float = 0.05) -> list[C.Claim]:
    """Does the meta-state tell harmful perturbations from harmless ones (perturbed evaluation runs of
    the kinds the protocol was built on)?

    * at the calibrated threshold: it alarms on more of a seed's harmful runs (lasting damage) than of
      its harmless ones (ending unaffected: nuisance alarms), paired over the seeds with both
      (:func:`harm_shares`, the statistic chosen on the calibration events);
    * per target of :data:`TARGETS`, before the label (seed-bootstrap intervals,
      :mod:`stabstudy.analysis.warning.specificity`): the statistic chosen on the calibration runs'
      AUC separates the runs that reach the target from those that do not (ROC-AUC above 0.5), and
      better than the best single channel and than the loss (difference of AUC above 0).
    A target that no evaluation run (or every one) reaches is "not tested".
    """
    out, pl = [], _plan(study)
    info, m = study.info, study.best_meta["all"]
    held = set(study.params.get("held_out", ()))
    pert = info[(info.split == "evaluation") & (info.kind != "none") & ~info.kind.isin(held)].index
    text = "the meta-state alarms on harmful perturbations more often than on harmless ones (lasting damage vs unaffected)"
    if len(pert) and len(study.alarms) and m in study.alarms:
        sh = harm_shares(study, m, pert).dropna(subset=["harmful", "harmless"])
        c = C.paired_difference(text, SOURCE, sh.harmful.to_numpy(float), sh.harmless.to_numpy(float),
                                direction="greater", test="ttest", alpha=alpha, **pl["harm"].rule)
        out.append(replace(c, test=f"{c.test} over seeds (share of runs alarmed): {m}"))
    else:
        out.append(_untested(text, SOURCE, "no perturbed evaluation run", pl["harm"]))
    for target in study.params.get("targets", TARGETS):
        tab = study.specificity.get(target)
        where = f"(perturbed runs, outcome: {target})"
        texts = {"auc": f"the meta-state tells collapsing from surviving runs before the label {where}: ROC-AUC above 0.5",
                 "auc-single": f"the meta-state tells collapsing from surviving runs better than the best single channel "
                               f"{where}: AUC difference above 0",
                 "auc-loss": f"the meta-state tells collapsing from surviving runs better than the loss {where}: AUC "
                             "difference above 0"}
        planned = {k: pl.get(f"{k}/{target}", Planned("tells collapsing from surviving runs", SESOI_AUC, "AUC", ""))
                   for k in texts}
        if tab is None or tab.empty or not (tab.n_pos.iloc[0] and tab.n_neg.iloc[0]):
            why = "no perturbed evaluation run" if tab is None or tab.empty else (
                f"{int(tab.n_pos.iloc[0])} runs reach the outcome and {int(tab.n_neg.iloc[0])} do not: "
                "both are needed")
            out += [_untested(t, SOURCE, why, planned[k]) for k, t in texts.items()]
            continue
        m_, s1 = study.specificity_choice[target]
        r = tab.loc[m_]
        out.append(C.interval_above(texts["auc"], SOURCE, r.auc, (r.auc_lo, r.auc_hi), int(r.n_seeds), above=0.5,
                                    test=f"ROC-AUC, seed bootstrap: {m_}", boot=r.get("boot"), alpha=alpha,
                                    family=planned["auc"].family, sesoi=planned["auc"].sesoi))
        for key, other in (("auc-single", s1), ("auc-loss", LOSS)):
            d, ci, n_d, dist = study.specificity_diffs[target][other]
            out.append(C.interval_above(texts[key], SOURCE, d, ci, n_d, above=0.0, boot=dist, alpha=alpha,
                                        test=f"AUC difference, seed bootstrap: {m_} vs {other}",
                                        family=planned[key].family, sesoi=planned[key].sesoi))
    return out


def held_out_claims(study: MetaStudy, alpha: float = 0.05) -> list[C.Claim]:
    """Per held-out kind (``params["held_out"]``: kinds added after the protocol was frozen, on
    evaluation seeds only), scored with every choice made without them (each event's family's
    meta-state statistic and single channel): the meta-state warns earlier than the loss and than the
    best single channel (per-seed means, as :func:`sensitivity_claims`), and alarms on the kind's
    harmful runs more often than on its harmless ones (one run per seed: an exact test of two rates)."""
    out, info, pl = [], study.info, _plan(study)
    for kind in study.params.get("held_out", ()):
        runs = info[(info.kind == kind) & (info.split == "evaluation")]
        idx = runs[runs.event].index
        texts = {"loss": f"held-out kind {kind}: the meta-state warns earlier than the loss",
                 "single": f"held-out kind {kind}: the meta-state warns earlier than the best single channel"}
        if len(idx):
            fams = runs.loc[idx, "family"]
            m = [study.best_meta.get(f, study.best_meta["all"]) for f in fams]
            s = [study.best_single.get(f, study.best_single["all"]) for f in fams]
            ps = seed_leads(study, idx, {"meta": m, "loss": LOSS, "single": s}, leads=study.held_out_leads)
            what = ", ".join(sorted(set(m)))
            out.append(_lead_claim(texts["loss"], SOURCE, ps, "meta", "loss", what=f"{what} vs {LOSS}",
                                   planned=pl[f"held/{kind}/loss"], alpha=alpha))
            out.append(_lead_claim(texts["single"], SOURCE, ps, "meta", "single",
                                   what=f"{what} vs {', '.join(sorted(set(s)))}", planned=pl[f"held/{kind}/single"],
                                   alpha=alpha))
        else:
            out += [_untested(t, SOURCE, f"no evaluation run of {kind} is labelled", pl[f"held/{kind}/{k}"])
                    for k, t in texts.items()]
        m_all = study.best_meta["all"]
        y = study.outcomes.outcome.reindex(runs.index)
        a = study.alarms.loc[runs.index, m_all] if m_all in study.alarms else pd.Series(False, index=runs.index)
        harm, calm = a[y.isin(HARMFUL)], a[y.isin(HARMLESS)]
        c = C.rate_comparison(f"held-out kind {kind}: the meta-state alarms on its harmful runs more often than on its "
                              "harmless ones", SOURCE, int(harm.sum()), len(harm), int(calm.sum()), len(calm),
                              direction="greater", alpha=alpha, **pl[f"held/{kind}/harm"].rule)
        out.append(replace(c, test=f"{c.test} over runs (one per seed): {m_all}"))
    return out
