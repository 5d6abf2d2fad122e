"""What notebook 04 shows from its studies (:mod:`stabstudy.analysis.studies.meta_state`): the detector
table, lead time against false alarms, event-aligned traces, false and nuisance alarms per detector,
the detector a Controller should run (chosen with both rates), seeds as the units of each claim (the
design effect and the power), the held-out kinds, the manipulation check, the loss's drift before an
onset, and the cross-domain direction."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import xarray as xr

from stabstudy.analysis import claims as C
from stabstudy.analysis import power as PW
from stabstudy.analysis.studies.meta_state import (
    FAMILIES,
    HARMFUL,
    HARMLESS,
    LOSS,
    SESOI,
    SOURCE,
    MetaStudy,
    families_in,
    seeds_of,
)
from stabstudy.analysis.warning import crossdomain as X
from stabstudy.analysis.warning import evaluation as E
from stabstudy.analysis.warning import outcomes as O
from stabstudy.analysis.warning import units as U

#: Detectors a :class:`stabstudy.interventions.control.Controller` runs (it reads the loss and the
#: gradient norm before each update lands, and the meta-state on the Monitor's previous row), with the
#: line that builds each (``{threshold}``: the calibrated threshold; ``{window}``: the z window).
CONTROLLER: dict[str, str] = {
    "loss robust z (performance)": 'Controller({{"loss": RobustZ(side="up", window={window}, threshold={threshold:.3g})}}, '
                                   "policy) with ctrl.observe(loss)",
    "OLMo z loss": 'Controller({{"loss": WindowZ(window=128, threshold={threshold:.3g})}}, policy) with ctrl.observe(loss)',
    "OLMo z grad_norm": "Controller(WindowZ(window=128, threshold={threshold:.3g}), policy)",
    "ZClip z grad_norm": "Controller(ZClipZ(threshold={threshold:.3g}), policy)",
    "meta-state t2": 'Controller(calibrate_detector(nulls, features, statistic="t2", budget={budget:g}), policy, '
                     'signal="meta")',
    "meta-state q": 'Controller(calibrate_detector(nulls, features, statistic="q", budget={budget:g}), policy, '
                    'signal="meta")',
}

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
    p, sc = study.params, study.scores
    info = study.info[~study.info.kind.isin(set(p.get("held_out", ())))]
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
            for fam in families_in(info):
                idx = ev_info[ev_info.event & ((ev_info.family == fam) | (fam == "all"))].index
                x = ld.loc[idx]
                rows.append({"detector": det, "budget": b, "events": fam, "fa_per_1k": 1000.0 * fa / n if n else np.nan,
                             "rate": float(x.notna().mean()) if len(x) else np.nan,
                             "lead_median": float(E.penalised(x.to_frame(), p["late"]).iloc[:, 0].median())
                             if len(x) else np.nan})
    return pd.DataFrame(rows)


def aligned(study: MetaStudy, ds: xr.Dataset, detectors: Sequence[str], family: str, before: int,
            after: int) -> xr.Dataset:
    """Event-aligned traces of the evaluation events of ``family`` (the trained-on kinds): each detector's score divided by
    its calibrated threshold (1 = alarm level) and the loss minus its level at the onset.

    Returns variables ``score`` (dims detector, event, lag) and ``loss`` (dims event, lag), with
    ``lag`` = step - onset in ``[-before, after]``.
    """
    info = study.info[~study.info.kind.isin(set(study.params.get("held_out", ())))]
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


def alarm_table(study: MetaStudy) -> pd.DataFrame:
    """False and nuisance alarms at the common budget, per detector (rows), on the evaluation runs:
    ``FA/1k`` (up-crossings per 1,000 event-free steps of the unperturbed runs), and the share of runs
    with any alarm (:func:`stabstudy.analysis.warning.evaluation.alarmed`) among the unperturbed runs
    (``false``), the perturbed runs that end unaffected (``nuisance``: an alarm that acting on would only
    cost), those that recover and those with lasting damage (``harmful``); ``held-out nuisance`` and
    ``held-out harmful`` on the held-out kinds' runs. Each share with its ``k/n``."""
    info, y = study.info, study.outcomes.outcome.reindex(study.info.index)
    ev = info[info.split == "evaluation"]
    held = ev.kind.isin(set(study.params.get("held_out", ())))
    groups = {"false": ev[ev.index.isin(E.null_runs(info, "evaluation").index)].index,
              "nuisance": ev[~held & (ev.kind != "none") & y.reindex(ev.index).isin(HARMLESS)].index,
              "recovers": ev[~held & (ev.kind != "none") & (y.reindex(ev.index) == "recovers")].index,
              "harmful": ev[~held & (ev.kind != "none") & y.reindex(ev.index).isin(HARMFUL)].index,
              "held-out nuisance": ev[held & y.reindex(ev.index).isin(HARMLESS)].index,
              "held-out harmful": ev[held & y.reindex(ev.index).isin(HARMFUL)].index}
    fa = study.evaluation.table.drop_duplicates("detector").set_index("detector").fa_per_1k
    rows = {}
    for det in study.scores["detector"].values:
        if not np.isfinite(study.scores.sel(detector=det).values).any():
            continue  # the runs do not record what it reads
        row: dict[str, Any] = {"FA/1k": round(float(fa.get(det, np.nan)), 2)}
        for g, idx in groups.items():
            a = study.alarms.loc[idx, det] if len(idx) else pd.Series(dtype=bool)
            row[g] = float(a.mean()) if len(a) else np.nan
            row[f"{g} k/n"] = f"{int(a.sum())}/{len(a)}"
        rows[det] = row
    return pd.DataFrame.from_dict(rows, orient="index")


def recommend(study: MetaStudy, max_nuisance: float, candidates: Mapping[str, str] = CONTROLLER) -> pd.DataFrame:
    """The detector a Controller should run, chosen on the *calibration* runs with both rates: among the
    ``candidates`` the runs record, those that alarm on at most ``max_nuisance`` of the calibration
    perturbed runs that end unaffected (every threshold holds the same false-alarm budget on the
    calibration nulls), the one with the largest mean penalised lead over the calibration events; if
    none qualifies, the one with the fewest nuisance alarms. Returns one row per candidate:
    ``calibration lead``, ``calibration nuisance``, the evaluation's ``FA/1k``, ``nuisance`` and
    ``lead`` (median penalised lead over all evaluation events), ``threshold``, ``chosen`` and ``line``
    (the Controller that runs it)."""
    info, late, y = study.info, study.params["late"], study.outcomes.outcome.reindex(study.info.index)
    held = info.kind.isin(set(study.params.get("held_out", ())))
    cal = info[(info.split == "calibration") & ~held]
    calm = cal[(cal.kind != "none") & y.reindex(cal.index).isin(HARMLESS)].index
    alarms = alarm_table(study)
    ev_pen = E.penalised(study.evaluation.leads, late)
    cal_pen = E.penalised(study.calibration_leads.loc[cal[cal.event].index], late)
    rows = []
    for det, line in candidates.items():
        if det not in alarms.index:
            continue
        thr = float(study.evaluation.thresholds[det])
        rows.append({"detector": det, "calibration lead": float(cal_pen[det].mean()) if len(cal_pen) else np.nan,
                     "calibration nuisance": float(study.alarms.loc[calm, det].mean()) if len(calm) else np.nan,
                     "FA/1k": alarms.loc[det, "FA/1k"], "nuisance": alarms.loc[det, "nuisance"],
                     "lead": float(ev_pen[det].median()) if len(ev_pen) else np.nan, "threshold": thr,
                     "line": line.format(threshold=thr, window=study.params["config"].window,
                                         budget=study.params["budget"])})
    out = pd.DataFrame(rows).set_index("detector") if rows else pd.DataFrame()
    if out.empty:
        return out
    ok = out[out["calibration nuisance"] <= max_nuisance]
    pick = (ok["calibration lead"].idxmax() if len(ok) else
            out.sort_values(["calibration nuisance", "calibration lead"], ascending=[True, False]).index[0])
    return out.assign(chosen=out.index == pick)


def design(study: MetaStudy, alpha: float = 0.05) -> pd.DataFrame:
    """Seeds as the units of each lead-time claim (:func:`sensitivity_claims`), per family and comparator:
    the evaluation ``events`` and ``seeds``, the design effect of pooling the events
    (:func:`stabstudy.analysis.warning.units.design_effect` of the meta-state's lead minus the
    comparator's: how much a test over events would have overstated the evidence), the per-seed mean
    and spread, the smallest effect of interest, the power of the rule as applied (a t-test over
    seeds at ``alpha`` over the family's rows, :func:`stabstudy.analysis.power.t_test`: P(supported) at
    the smallest effect, P(not supported) at none) and the seeds that would give both 0.8."""
    info, late = study.info, study.params["late"]
    held = set(study.params.get("held_out", ()))
    evs = info[(info.split == "evaluation") & info.event & ~info.kind.isin(held)]
    pen = E.penalised(study.evaluation.leads, late)
    fams = study.params.get("families", FAMILIES)
    rows = []
    for fam in fams:
        idx = evs[evs.family == fam].index
        m, s = study.best_meta.get(fam, study.best_meta["all"]), study.best_single.get(fam, study.best_single["all"])
        sesoi = float(study.params.get("sesoi", SESOI).get(fam, np.nan))
        for other, name in ((LOSS, "the loss"), (s, "the best single channel"), (None, "0")):
            d = pen.loc[idx, m] - (pen.loc[idx, other] if other is not None else 0.0) if len(idx) else pd.Series(dtype=float)
            de = U.design_effect(d, seeds_of(study, d.index))
            ps = U.per_seed(d, seeds_of(study, d.index))
            sd = float(ps.std(ddof=1)) if len(ps) > 1 else np.nan
            fn = PW.t_test(len(ps), sd, planning=sesoi, minimum=0.0, sesoi=sesoi) if len(ps) > 1 else None
            a = alpha / len(fams)
            pw = fn(a, 1.0) if fn is not None else (np.nan, np.nan)
            need = PW.units_needed(fn, len(ps), a) if fn is not None and np.isfinite(sd) else None
            rows.append({"events": fam, "vs": name, "n events": int(de["n"]), "seeds": int(de["k"]),
                         "events/seed": de["m"], "ICC": de["icc"], "design effect": de["deff"],
                         "mean per seed": float(ps.mean()) if len(ps) else np.nan, "sd per seed": sd, "sesoi": sesoi,
                         "power S": pw[0], "power NS": pw[1],
                         "seeds for 0.8": need if need is not None else np.nan})
    return pd.DataFrame(rows)


def held_out_table(study: MetaStudy) -> pd.DataFrame:
    """Per held-out kind: its evaluation runs, their outcome classes and event families, and per role
    (the meta-state and single channel of each event's family, the loss) the events detected and the
    median penalised lead."""
    info, late = study.info, study.params["late"]
    pen = E.penalised(study.held_out_leads, late) if len(study.held_out_leads) else pd.DataFrame()
    rows = []
    for kind in study.params.get("held_out", ()):
        runs = info[(info.kind == kind) & (info.split == "evaluation")]
        idx = runs[runs.event].index
        y = study.outcomes.outcome.reindex(runs.index)
        row: dict[str, Any] = {"kind": kind, "runs": len(runs), **{o: int((y == o).sum()) for o in O.OUTCOMES},
                               **{f"{f} events": int((runs.loc[idx, "family"] == f).sum()) for f in FAMILIES}}
        for role, pick in (("meta", study.best_meta), ("single", study.best_single)):
            dets = [pick.get(f, pick["all"]) for f in runs.loc[idx, "family"]]
            v = np.array([pen.at[r, d] for r, d in zip(idx, dets, strict=True)]) if len(idx) else np.empty(0)
            row[f"{role} detected"] = f"{int((v > -(late + 1)).sum())}/{len(idx)}"
            row[f"{role} lead"] = float(np.median(v)) if v.size else np.nan
        v = pen.loc[idx, LOSS].to_numpy(float) if len(idx) else np.empty(0)
        row["loss detected"], row["loss lead"] = f"{int((v > -(late + 1)).sum())}/{len(idx)}", (
            float(np.median(v)) if v.size else np.nan)
        rows.append(row)
    return pd.DataFrame(rows)


def manipulation_check(info: pd.DataFrame) -> pd.DataFrame:
    """The one place the perturbation kind meets the family: per kind, dose and duration of ``info``
    (:func:`stabstudy.analysis.warning.evaluation.run_info`), the events per family the label measured,
    beside the family the kind was designed to give (:data:`stabstudy.analysis.warning.evaluation.DESIGNED`;
    empty for a kind with no design)."""
    ev = info[info.event]
    tab = pd.crosstab([ev.kind, ev.dose, ev.duration], ev.family)
    designed = [E.DESIGNED.get(k, "") for k in tab.index.get_level_values(0)]
    return tab.assign(designed=designed)


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
