"""Notebook 04's RL family: the early-warning protocol on notebook 01's forks of trained prefixes.

The runs (one algorithm at a time): the forks of its stored prefixes, one prefix per seed (the
independent unit), recorded by notebook 01 in its grid manifest (:mod:`stabstudy.run.grids`): the
unperturbed fork of each prefix (its *control*: nothing was done to it, the clean null), lr spikes
(family ``shock``) and lr ramps (``slow-onset``) at several doses.

* *Rows* (:func:`on_rows`): the telemetry rows of the forks, the updates at which the Monitor
  measured its costly channels (every ``monitor_every`` updates of the primary optimizer, the critic
  off-policy, PPO's policy), numbered 0, 1, ... from the fork. Detectors and meta-state stream over
  them as over a GPT run's steps; burn-in, horizons and leads count rows. A perturbation starts at
  the first row at or after its env step.
* *Labels from the paired control* (:func:`row_labels`): each perturbed fork against the control of
  its prefix at the same env steps over ``[event, event + H]``
  (:func:`stabstudy.analysis.studies.rl.outcomes.paired_outcome`; ``H`` the algorithm's learning
  horizon). An *event* is a drop of the return below ``collapse_frac`` of the control's gain over
  the prefix's untrained return; its onset is the first row after the evaluation that first shows
  it (evaluations come every ``eval_every`` env steps, so a detector that fires at the drop itself
  leads by up to that many rows); its outcome is ``collapsed`` (not back within ``H``) or
  ``recovered``. A fork without a verdict (it or its control ends before ``event + H``) is left
  out, and counted.
* The protocol is notebook 04's (:func:`stabstudy.analysis.studies.meta_state.analyse_labelled`):
  the PCA and every threshold set on the control forks of the calibration prefixes only, the best
  detectors chosen on their events, sensitivity and specificity scored on the other prefixes.

No channel of the label (``perf``) is read by a detector, and none recording the perturbation
(``lr``, ``perturbed``): the update norm and ratio enter divided by the applied learning rate
(:mod:`stabstudy.online.features`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd
import xarray as xr

from stabstudy.analysis import claims as C
from stabstudy.analysis.studies import meta_state as M
from stabstudy.analysis.studies.rl import curves, design, runs
from stabstudy.analysis.studies.rl import outcomes as O
from stabstudy.analysis.warning import evaluation as E
from stabstudy.online import MetaConfig

#: The RL meta-state's channels: the telemetry every domain shares (knob-free).
RL_CHANNELS: tuple[str, ...] = ("grad_norm", "xgrad", "update_norm/lr", "update_ratio/lr", "update_grad_cos",
                                "adam_m_norm", "adam_v_mean")
#: Perturbation kinds the RL family reads (notebook 01's grid groups of the same names).
KINDS: tuple[str, ...] = ("lr_spike", "lr_ramp")
#: Event families of those kinds (:data:`stabstudy.analysis.warning.evaluation.FAMILY`).
FAMILIES: tuple[str, ...] = ("slow-onset", "shock")
#: Specificity targets: which paired outcomes count.
TARGETS: dict[str, tuple[str, ...]] = {"collapses": ("collapsed",), "drops": ("collapsed", "recovered")}
#: Why the RL family is not tested when notebook 01 recorded no grid.
ABSENT = "notebook 01 has not run at this profile"
#: The Monitor channel whose measured rows are the telemetry rows (costly: every ``monitor_every`` updates).
ROW_CHANNEL = "update_grad_cos"
#: Variables an RL row Dataset keeps (the detectors' inputs and the learning rate of the derived features).
KEEP = ("loss", "grad_norm", "xgrad", "update_norm", "update_ratio", "update_grad_cos", "adam_m_norm",
        "adam_v_mean", "lr", "perf")


def telemetry_rows(ds: xr.Dataset, channel: str = ROW_CHANNEL) -> np.ndarray:
    """The update indices (values of ``step``) at which some run of ``ds`` measured ``channel``:
    the Monitor's cadence (a diverged run stops early; its later rows are NaN, as data)."""
    x = ds[channel].transpose("run", "step").values if "run" in ds[channel].dims else ds[channel].values[None]
    return ds["step"].values[np.isfinite(x).any(axis=0)]


def _first_at_or_after(env: np.ndarray, t: float | np.ndarray) -> int | np.ndarray:
    """Row of the first finite env step at or after ``t`` (the row after the last when none); for an
    array ``t``, the row of each."""
    ok = np.flatnonzero(np.isfinite(env))
    if not ok.size:
        return 0 if np.ndim(t) == 0 else np.zeros(np.shape(t), dtype=int)
    i = np.searchsorted(env[ok], t, side="left")
    rows = np.where(i < ok.size, ok[np.minimum(i, ok.size - 1)], ok[-1] + 1)
    return int(rows) if np.ndim(t) == 0 else rows


def on_rows(ds: xr.Dataset, channel: str = ROW_CHANNEL) -> xr.Dataset:
    """One learner's forks (a ``load_runs`` Dataset, dims run, step) on their telemetry rows
    (:func:`telemetry_rows`): dims ``(run, step)`` with ``step`` = row 0, 1, ...; coordinates
    ``updates`` (updates completed at each row: the original ``step``), ``env_step`` (run, step); ``pert_start`` and
    ``pert_duration`` in rows (start: the first row at or after the perturbation's env step; at
    least one row long); variables :data:`KEEP` (NaN where absent)."""
    learners = set(np.atleast_1d(ds["learner"].values)) if "learner" in ds.coords else set()
    if len(learners) > 1:
        raise ValueError(f"on_rows reads one learner's forks at a time (their update counts differ); got {sorted(learners)}")
    rows = telemetry_rows(ds, channel)
    sub = ds.sel(step=rows)
    keep = {v: sub[v] if v in sub else xr.full_like(sub[channel], np.nan) for v in KEEP}
    coords = {k: v for k, v in sub.coords.items() if k not in ("step", "env_step")}
    out = xr.Dataset(keep, coords=coords).drop_vars("env_step", errors="ignore")
    # one Dataset's env steps are 1-D when every run has the same (load_runs keeps equal coordinates once)
    env = np.asarray(sub["env_step"].broadcast_like(sub[channel]).transpose("run", "step").values, dtype=float)
    start = np.asarray(ds["pert_start"].values, dtype=float)
    dur = np.asarray(ds["pert_duration"].values, dtype=float)
    s_row, d_row = np.full(start.shape, np.nan), np.full(start.shape, np.nan)
    for i in range(env.shape[0]):
        if np.isfinite(start[i]):
            s_row[i] = _first_at_or_after(env[i], start[i])
            d_row[i] = max(_first_at_or_after(env[i], start[i] + dur[i]) - s_row[i], 1)
    return out.assign_coords(step=np.arange(rows.size), updates=("step", rows), env_step=(("run", "step"), env),
                             pert_start=("run", s_row), pert_duration=("run", d_row))


def paired(fork_ds: xr.Dataset, prefix_ds: xr.Dataset, prefix_of: Mapping[str, str], *, collapse_frac: float = 0.5,
           lag: Mapping[str, float] | None = None, horizon: Mapping[str, float] | None = None,
           min_gain: float = 1e-8) -> tuple[pd.DataFrame, dict[str, float]]:
    """Every perturbed fork of ``fork_ds`` against its control (notebook 01's
    :func:`~stabstudy.analysis.studies.rl.outcomes.paired_table`, with its floors: the prefixes'
    untrained returns). ``horizon``: per learner (default: :func:`~stabstudy.analysis.studies.rl.design.horizons`
    of ``prefix_ds``'s learning curves, for every learner ``horizon`` does not name). Returns the table
    and the horizons."""
    learners = {str(a) for a in np.atleast_1d(fork_ds["learner"].values)}
    H = dict(horizon or {})
    if not learners <= set(H):  # a learner the given horizons do not name: from its prefixes
        H = {**design.horizons(curves.eval_curves(prefix_ds))[1], **H}
    missing = [str(h) for h in fork_ds["run"].values if str(h) not in prefix_of]
    if missing:
        raise ValueError(f"prefix_of names no prefix for fork(s) {missing[:3]}")
    prefix_of = {str(h): prefix_of[str(h)] for h in fork_ds["run"].values}
    floors, _ = curves.return_reference(prefix_ds, curves.eval_curves(fork_ds), prefix_of)
    out = O.paired_table(fork_ds, runs.run_table(fork_ds), horizon=H, floors=floors, prefix_of=prefix_of,
                         frac=collapse_frac, lag=lag, min_gain=min_gain)
    return out, H


def row_labels(rows: xr.Dataset, paired_rows: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Labels of the runs of ``rows`` (:func:`on_rows`) from ``paired_rows`` (:func:`paired`):
    ``(labels, left_out)``. ``labels`` (index run): ``event`` (a drop: ``collapsed`` or ``recovered``),
    ``onset`` (row of the first update after the evaluation that shows the drop; -1 for none),
    ``outcome`` (the paired state; ``control`` for an unperturbed fork). ``left_out``: the perturbed
    forks without a verdict (index run; ``reason``)."""
    p = paired_rows.set_index("spec_hash") if len(paired_rows) else pd.DataFrame(columns=["state", "onset", "reason"])
    env = rows["env_step"].transpose("run", "step").values
    lab, out = [], []
    for i, run in enumerate(rows["run"].values):
        kind = str(rows["pert_kind"].values[i])
        if kind == "none":
            lab.append({"run": run, "event": False, "onset": -1, "outcome": "control"})
            continue
        state = str(p.state.get(run, "no_verdict"))
        if state not in O.OUTCOME_STATES or state == "no_verdict":
            out.append({"run": run, "reason": str(p.reason.get(run, "no paired outcome")) or "no verdict"})
            continue
        drop = state in TARGETS["drops"]
        lab.append({"run": run, "event": drop, "outcome": state,
                    "onset": _first_at_or_after(env[i], float(p.onset[run])) if drop else -1})
    labels = pd.DataFrame(lab, columns=["run", "event", "onset", "outcome"]).set_index("run")
    return labels, pd.DataFrame(out, columns=["run", "reason"]).set_index("run")


@dataclass
class RLWarning:
    """What :func:`analyse` computes for one learner: ``paired`` (every perturbed fork against its
    control, :func:`paired`, with ``onset_row``), ``runs`` (one row per fork analysed:
    :func:`stabstudy.analysis.warning.evaluation.run_info` columns and ``outcome``), ``left_out``
    (forks without a verdict, ``reason``), ``study`` (the protocol's
    :class:`~stabstudy.analysis.studies.meta_state.MetaStudy`, None when it could not run: ``reason``
    says why), ``horizon`` (env steps), ``rows`` (telemetry rows per fork) and ``eval_rows`` (median
    rows between two evaluations: the resolution of the onset)."""

    learner: str
    paired: pd.DataFrame
    runs: pd.DataFrame
    left_out: pd.DataFrame
    study: M.MetaStudy | None
    reason: str = ""
    horizon: float = np.nan
    rows: int = 0
    eval_rows: float = np.nan
    params: dict = field(default_factory=dict)


def _eval_rows(ds: xr.Dataset, rows: xr.Dataset) -> float:
    """Median rows between two evaluations of ``ds``'s forks: evaluations are not telemetry rows, so
    each evaluation's env step is placed on the first row at or after it."""
    perf = ds["perf"].transpose("run", "step").values
    env = np.asarray(ds["env_step"].broadcast_like(ds["perf"]).transpose("run", "step").values, dtype=float)
    row_env = rows["env_step"].transpose("run", "step").values
    gaps: list[float] = []
    for i in range(perf.shape[0]):
        gaps += np.diff(_first_at_or_after(row_env[i], env[i][np.isfinite(perf[i])])).tolist()
    return float(np.median(gaps)) if gaps else np.nan


def analyse(fork_ds: xr.Dataset, prefix_ds: xr.Dataset, prefix_of: Mapping[str, str], *,
            calibration_seeds: Sequence[int], collapse_frac: float = 0.5, lag: Mapping[str, float] | None = None,
            horizon: Mapping[str, float] | None = None, min_gain: float = 1e-8, burn_in: int = 50,
            warn_horizon: int = 200, late: int = 20, meta_features: Sequence[str] = RL_CHANNELS, config: MetaConfig | None = None,
            n_components: int | float = 0.9, budget: float = 1.0, n_boot: int = 1000, seed: int = 0) -> RLWarning:
    """The protocol (module docstring) on one learner's forks.

    Args:
        fork_ds: its control and perturbed forks (``load_runs``; kinds of :data:`KINDS`).
        prefix_ds: their prefixes (``load_runs``): floors and learning horizons.
        prefix_of: fork hash -> its prefix's hash.
        calibration_seeds: the prefixes (seeds) whose control forks set the PCA and the thresholds
            and whose events choose the detectors; the others evaluate.
        collapse_frac, lag: notebook 01's collapse rule against the paired control (``lag``: per learner,
            env steps a fork may trail its control by).
        horizon: per learner, env steps of "irreversible" (notebook 01's, where its grid manifest records
            them; default: from the prefixes' learning curves).
        min_gain: a control at most this far above its floor at the end has no gain to lose (no verdict).
        burn_in: rows from the fork ignored by alarms, false-alarm counts and the PCA.
        warn_horizon: earliest alarm (rows before the onset) that counts as a warning.
        late: latest alarm (rows after the onset) that counts as a detection.
        meta_features, config, n_components, budget, n_boot, seed: as in
            :func:`stabstudy.analysis.studies.meta_state.analyse_labelled`.
    """
    learners = sorted(set(np.atleast_1d(fork_ds["learner"].values)))
    if len(learners) != 1:
        raise ValueError(f"analyse reads one learner's forks; got {learners}")
    a = str(learners[0])
    bad = sorted(set(fork_ds["pert_kind"].values) - {"none", *KINDS})
    if bad:
        raise ValueError(f"the RL family reads kinds {', '.join(KINDS)} and their controls; got {bad}")
    pair, H = paired(fork_ds, prefix_ds, prefix_of, collapse_frac=collapse_frac, lag=lag, horizon=horizon,
                     min_gain=min_gain)
    rows = on_rows(fork_ds)
    labels, left_out = row_labels(rows, pair)
    env = dict(zip(rows["run"].values, rows["env_step"].transpose("run", "step").values, strict=True))
    pair = pair.assign(onset_row=[_first_at_or_after(env[h], o) if np.isfinite(o) and h in env else -1
                                  for h, o in zip(pair.spec_hash, pair.onset, strict=True)])
    kept = rows.sel(run=labels.index.values)
    info = E.run_info(kept, labels, calibration_seeds)
    ends = np.isfinite(kept["grad_norm"].transpose("run", "step").values)
    info["end"] = [int(np.flatnonzero(r)[-1] + 1) if r.any() else 0 for r in ends]
    runs = info.join(labels.outcome)
    base = dict(learner=a, paired=pair, runs=runs, left_out=left_out, horizon=float(H.get(a, np.nan)),
                rows=int(rows.sizes["step"]), eval_rows=_eval_rows(fork_ds, rows),
                params={"burn_in": burn_in, "horizon": warn_horizon, "late": late, "collapse_frac": collapse_frac})
    why = _why_not(info, left_out, burn_in)
    if why:
        return RLWarning(study=None, reason=why, **base)
    kinds = tuple(k for k in KINDS if (info.kind == k).any())
    study = M.analyse_labelled(kept, info, kinds, burn_in=burn_in, outcomes=labels[["outcome"]], targets=TARGETS,
                               families=FAMILIES, meta_features=meta_features, config=config,
                               n_components=n_components, budget=budget, horizon=warn_horizon, late=late,
                               n_boot=n_boot, seed=seed, pairwise=False, replay=True)
    return RLWarning(study=study, **base)


def _why_not(info: pd.DataFrame, left_out: pd.DataFrame, burn_in: int) -> str:
    """Why the protocol cannot run on ``info`` ('' when it can)."""
    cal, ev = E.null_runs(info, "calibration"), E.null_runs(info, "evaluation")
    pert = info[info.kind != "none"]
    if not len(cal):
        return "no control fork of a calibration prefix (thresholds and the PCA need the clean null)"
    if not len(ev) and not len(pert[pert.split == "evaluation"]):
        return "no evaluation prefix: every prefix is a calibration prefix"
    if not len(pert):
        extra = f" ({len(left_out)} without a verdict: {left_out.reason.iloc[0]})" if len(left_out) else ""
        return "no perturbed fork with a paired verdict" + extra
    if int(cal.end.max()) <= burn_in + 1:
        return f"the control forks end within the burn-in ({burn_in} rows)"
    return ""


def claims(results: Mapping[str, RLWarning], alpha: float = 0.05) -> list[C.Claim]:
    """Notebook 04's claims (:func:`stabstudy.analysis.studies.meta_state.claims`) per learner, each
    prefixed ``RL <LEARNER>:``; a learner whose protocol could not run gets its rows ``not tested``
    with the reason (:func:`not_tested`)."""
    out = []
    for a, r in results.items():
        rows = M.claims(r.study, alpha) if r.study is not None else not_tested(r.reason, (a,), prefix=False)
        out += [replace(c, claim=f"RL {a.upper()}: {c.claim}") for c in rows]
    return out


def not_tested(reason: str, learners: Sequence[str] = ("ppo", "sac", "td3"), prefix: bool = True) -> list[C.Claim]:
    """The RL rows of the claims table, each ``not tested`` with ``reason`` (e.g. :data:`ABSENT`):
    per learner and family the sensitivity claims, per target the specificity claim."""
    texts = [f"the meta-state warns earlier than the best single channel at the same false-alarm budget ({fam} events)"
             for fam in FAMILIES]
    texts += [f"the meta-state deviates before performance collapses ({fam} events: lead > 0)" for fam in FAMILIES]
    texts += [f"the meta-state tells collapsing from surviving runs (perturbed runs, outcome: {t})" for t in TARGETS]
    return [C.not_tested(f"RL {a.upper()}: {t}" if prefix else t, M.SOURCE, reason) for a in learners for t in texts]


def studies(results: Mapping[str, RLWarning]) -> list[M.MetaStudy]:
    """The learners' studies that ran (the RL domain of the cross-domain claim)."""
    return [r.study for r in results.values() if r.study is not None]


def tables(results: Mapping[str, RLWarning]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The sensitivity and specificity rows per algorithm (learners whose protocol ran).

    Sensitivity: per learner and event family (and ``all``), the meta-state statistic and the single
    channel chosen on the calibration events and the loss, with ``detected`` (k/n evaluation events),
    ``lead`` (median [bootstrap interval], rows), ``FA/1k`` (false alarms per 1,000 event-free rows
    of the evaluation control forks) and ``null`` (their number: the independent unit). Specificity:
    per learner and target, the detectors chosen on calibration AUC and the loss: ``AUC`` [seed
    bootstrap], ``precision``, ``recall``, ``pos/neg`` (forks) and ``prefixes``.
    """
    sens, spec = [], []
    for a, r in results.items():
        s = r.study
        if s is None:
            continue
        t = s.evaluation.table.set_index(["detector", "events"])
        for fam in ("all", *FAMILIES):
            chosen = (s.best_meta.get(fam), s.best_single.get(fam), M.LOSS)
            for role, det in zip(("meta-state", "single channel", "training loss"), chosen, strict=True):
                if det is None or (det, fam) not in t.index:
                    continue
                x = t.loc[(det, fam)]
                sens.append({"learner": a, "events": fam, "role": role, "detector": det,
                             "detected": f"{int(x.n_detected)}/{int(x.n_events)}",
                             "lead": f"{x.lead_median:.0f} [{x.lead_lo:.0f}, {x.lead_hi:.0f}]"
                             if np.isfinite(x.lead_median) else "-",
                             "FA/1k": round(float(x.fa_per_1k), 2), "null": int(x.n_null)})
        for target, tab in s.specificity.items():
            for det, x in tab.iterrows():
                spec.append({"learner": a, "target": target, "detector": det,
                             "AUC": f"{x.auc:.2f} [{x.auc_lo:.2f}, {x.auc_hi:.2f}]" if np.isfinite(x.auc) else "-",
                             "precision": x.precision, "recall": x.recall, "pos/neg": f"{int(x.n_pos)}/{int(x.n_neg)}",
                             "prefixes": int(x.n_seeds)})
    return pd.DataFrame(sens), pd.DataFrame(spec)


def summary(results: Mapping[str, RLWarning]) -> pd.DataFrame:
    """One row per learner: forks analysed and left out, prefixes (calibration / evaluation), control
    forks (the null: calibration / evaluation), events per family, outcomes, rows per fork, rows
    between evaluations, horizon H (env steps) and why the protocol did not run (if it did not)."""
    out = []
    for a, r in results.items():
        x = r.runs
        row = {"learner": a, "forks": len(x), "left out": len(r.left_out),
               "prefixes cal/eval": f"{x[x.split == 'calibration'].seed.nunique()}/"
                                    f"{x[x.split == 'evaluation'].seed.nunique()}" if len(x) else "0/0",
               "null cal/eval": f"{len(E.null_runs(x, 'calibration'))}/{len(E.null_runs(x, 'evaluation'))}"
               if len(x) else "0/0"}
        for fam in FAMILIES:
            g = x[x.family == fam] if len(x) else x
            row[f"{fam} events"] = f"{int(g.event.sum())}/{len(g)}" if len(g) else "0/0"
        for state in ("collapsed", "recovered", "no_drop"):
            row[state] = int((x.outcome == state).sum()) if len(x) else 0
        row.update({"rows": r.rows, "rows/eval": r.eval_rows, "H": r.horizon, "not run because": r.reason})
        out.append(row)
    return pd.DataFrame(out).set_index("learner") if out else pd.DataFrame()
