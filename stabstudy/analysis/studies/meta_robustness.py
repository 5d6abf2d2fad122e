"""Notebook 04's verdicts under scrutiny: recomputed under every declared variation of the protocol
(:func:`robustness`: a verdict is reported only where every variation gives it) and under resamples of
the calibration seeds (:func:`verdict_stability`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np
import pandas as pd
import xarray as xr

from stabstudy.analysis import claims as C
from stabstudy.analysis.studies.meta_state import (
    LOSS,
    MetaStudy,
    analyse,
    choose,
    claims,
    sensitivity_claims,
)
from stabstudy.analysis.warning import evaluation as E
from stabstudy.analysis.warning import outcomes as O
from stabstudy.analysis.warning.labels import LabelRule
from stabstudy.spec import RunSpec

#: The declared variations of the protocol, one change at a time (keys: ``budget``, false alarms per
#: 1,000 steps; ``window``, the meta-state's and every robust z's trailing window; ``ewma``, the z-scores'
#: EWMA factor, 1 = off; ``horizon``, steps before an onset an alarm may warn from; ``k``, ``slow``: the
#: label's band width and onset-speed threshold; ``min_excess``: a factor on the label's smallest
#: band half-width). A verdict is robust when every one of them gives it too (:func:`robustness`).
VARIATIONS: dict[str, dict[str, float]] = {
    "budget 0.5/1k": {"budget": 0.5}, "budget 2/1k": {"budget": 2.0},
    "meta window 32": {"window": 32}, "meta window 128": {"window": 128}, "EWMA off": {"ewma": 1.0},
    "horizon 50": {"horizon": 50},
    "label k 4": {"k": 4.0}, "label k 8": {"k": 8.0},
    "label min_excess x0.5": {"min_excess": 0.5}, "label min_excess x2": {"min_excess": 2.0},
    "onset speed 0.1": {"slow": 0.1}, "onset speed 0.5": {"slow": 0.5},
}


def vary(study: MetaStudy, ds: xr.Dataset, specs: Sequence[RunSpec], change: Mapping[str, float], *,
         calibration_seeds: Sequence[int], rule: LabelRule, outcome_rule: O.OutcomeRule | None = None,
         null: Sequence[str] | None = None) -> MetaStudy:
    """``study`` (of the runs ``ds``, labelled by ``rule``) analysed again with one declared change of
    the protocol (a value of :data:`VARIATIONS`); a new window keeps the notebook's ``min_periods``
    rule (a quarter of the window, at least 4). Scores are reused where the change leaves them as they
    were; the detector table's intervals and the pairwise tests are left out."""
    bad = sorted(set(change) - {"budget", "window", "ewma", "horizon", "k", "min_excess", "slow"})
    if bad:
        raise ValueError(f"unknown protocol setting(s) {bad}; valid: budget, window, ewma, horizon, k, min_excess, slow")
    p = study.params
    cfg = p["config"]
    window = int(change.get("window", cfg.window))
    config = replace(cfg, window=window, min_periods=cfg.min_periods if window == cfg.window else max(window // 4, 4),
                     ewma=float(change.get("ewma", cfg.ewma)))
    rule = replace(rule, k=float(change.get("k", rule.k)), min_excess=rule.min_excess * float(change.get("min_excess", 1.0)),
                   slow=float(change.get("slow", rule.slow)))
    return analyse(ds, specs, calibration_seeds=calibration_seeds, rule=rule, meta_features=study.pca.features,
                   config=config, n_components=p["n_components"], budget=float(change.get("budget", p["budget"])),
                   horizon=int(change.get("horizon", p["horizon"])), late=p["late"], n_boot=p["n_boot"], seed=p["seed"],
                   outcome_rule=outcome_rule, null=null, max_in_alarm=p["max_in_alarm"], held_out=p["held_out"],
                   step_count=p["step_count"], sesoi=p["sesoi"], reuse=study, intervals=False, replay=True,
                   pairwise=False, domain=p.get("domain", ""))


def robust_verdicts(base: pd.DataFrame, varied: Mapping[str, pd.DataFrame]) -> pd.DataFrame:
    """One row per claim of ``base`` (a :func:`stabstudy.analysis.claims.table`): its verdict under each
    variation (columns named as ``varied``'s keys; "-" where a variation has no such claim) and the
    ``robust`` verdict: the base verdict where every variation gives it too, else ``inconclusive`` with
    the ``why`` (the variations that give another verdict); a claim not tested at the base stays so."""
    out = base[["claim", "verdict"]].rename(columns={"verdict": "base"}).set_index("claim")
    for name, t in varied.items():
        out[name] = t.set_index("claim").verdict.reindex(out.index).fillna("-")
    robust, why = [], []
    for _, r in out.iterrows():
        other = {n: r[n] for n in varied if r[n] != r.base}
        if r.base == "not tested" or not other:
            robust.append(r.base)
            why.append("")
        else:
            robust.append("inconclusive")
            why.append("not robust: " + "; ".join(f"{n}: {v}" for n, v in other.items()))
    return out.assign(robust=robust, why=why).reset_index()


def robustness(study: MetaStudy, ds: xr.Dataset, specs: Sequence[RunSpec], *, calibration_seeds: Sequence[int],
               rule: LabelRule, outcome_rule: O.OutcomeRule | None = None, null: Sequence[str] | None = None,
               variations: Mapping[str, Mapping[str, float]] = VARIATIONS,
               alpha: float = 0.05) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The confirmatory verdicts of ``study`` (:func:`claims`, Holm within each family) recomputed under
    every declared variation of the protocol (:func:`vary`; one change at a time). Returns the claims
    table with each verdict replaced by its robust verdict (:func:`robust_verdicts`: the reason gains the
    variations that disagree) and the robustness table itself."""
    base = C.table(claims(study, alpha), alpha)
    varied = {name: C.table(claims(vary(study, ds, specs, change, calibration_seeds=calibration_seeds, rule=rule,
                                        outcome_rule=outcome_rule, null=null), alpha), alpha, power=False)
              for name, change in variations.items()}
    rob = robust_verdicts(base, varied)
    why = dict(zip(rob.claim, rob.why, strict=True))
    table = base.assign(verdict=rob.robust.to_numpy(),
                        reason=[f"{r}; {why[c]}" if why[c] else r for c, r in zip(base.claim, base.reason, strict=True)])
    return table, rob


def in_domain(table: pd.DataFrame, name: str) -> pd.DataFrame:
    """A claims table (:func:`stabstudy.analysis.claims.table`) with every claim prefixed by its domain
    ``name``, as the notebook's table shows them beside other domains."""
    return table.assign(claim=[f"{name}: {c}" for c in table.claim])


def verdict_stability(study: MetaStudy, n_resamples: int = 200, seed: int = 0) -> pd.DataFrame:
    """How often :func:`sensitivity_claims` keep their verdict when the calibration seeds are resampled.

    Each resample draws the calibration seeds with replacement, recalibrates every single-channel,
    meta-state and loss threshold on the drawn seeds' unperturbed runs, re-chooses the best detectors on
    their events, and re-scores the evaluation runs (Holm within the sensitivity claims, as for the
    point verdict here). Columns: ``claim`` (as at the point estimate), ``verdict``, ``same`` (share
    of resamples with that verdict), ``n_resamples``. Resamples that draw the same seeds (in any order)
    share one computation: with one calibration seed every resample is the point estimate.
    """
    info, p, sc = study.info, study.params, study.scores
    late, horizon, burn_in, budget = p["late"], p["horizon"], p["burn_in"], p["budget"]
    dets = [s.name for s in study.specs if s.family in ("single", "meta") or s.name == LOSS]
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


