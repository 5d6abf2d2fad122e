"""A fair comparison of streaming detectors: one false-alarm budget, thresholds and choices made on
runs not used for evaluation, lead times paired over the same events, and a protocol that knows
nothing a deployed monitor would not know.

Protocol (every step index below is an optimizer update):

1. every detector of a :func:`suite` is fed each run step by step (:func:`score_runs`), over the
   whole run;
2. its threshold is the lowest one whose alarms (up-crossings: the score rising above the
   threshold) on the *calibration* unperturbed runs stay within ``budget`` per 1,000 steps
   (:func:`calibrate`). Only runs where nothing was done count as the null (column ``null`` of
   :func:`run_info`): a perturbed run that did not collapse still moves every channel, and its
   steps before the perturbation are bit-identical to its unperturbed twin, so counting them
   would count the same steps once per perturbation. The split is by seed, so no trajectory is
   used twice;
3. each event's *family* is its onset speed, measured on the loss by the label
   (:func:`stabstudy.analysis.warning.labels.onset_rise`), never the perturbation kind's name; every
   window is set by the labelled onset and ``horizon``, the same for every family;
4. on the *evaluation* runs, an event is detected when the first alarm (up-crossing) falls in its
   warning window ``[warn_from, onset + late]``, ``warn_from = max(onset - horizon, burn_in)``
   (lead = onset - alarm step, negative when late). Where the run's perturbation start is known, an
   alarm before it is no warning of what the perturbation causes: it is a false alarm, the same one
   its unperturbed twin raises on the same steps (and counts), and the warning window opens at the
   start; a run whose start is unknown (NaN) is scored from ``onset - horizon``. False alarms are
   up-crossings on the evaluation unperturbed runs, per 1,000 of their event-free steps, and the table
   says how many such runs (the independent unit) there were; an alarm anywhere on a perturbed run
   that ends unaffected is a *nuisance alarm* (:func:`alarmed`). ROC-AUC compares the detector's
   largest score over ``[onset - horizon, onset]`` with a window as long, ending at the median onset
   of the same family's events, of each unperturbed run (:func:`window_max`, :func:`evaluate`);
5. lead times of two detectors are compared over the same events with the Wilcoxon signed-rank
   test, a missed event counting as the worst lead ``-(late + 1)`` (:func:`pairwise`; the claims
   of notebook 04 compare per-seed means, seeds being the independent units).

The perturbation kind and start enter nothing above except that ground truth of step 4 (an alarm before a
perturbation cannot warn of it) and the manipulation checks (:data:`DESIGNED`).

Whether a score tells the perturbed runs that will collapse from those that will not is a
separate question, answered among perturbed runs only (:mod:`stabstudy.analysis.warning.specificity`).

Steps before ``burn_in`` count for nothing (the loss falls fastest there).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import xarray as xr
from tqdm.std import tqdm  # not tqdm.auto: without ipywidgets it warns into every executed notebook

from stabstudy import online as D
from stabstudy.analysis.warning.metastate import fit_pca, replay
from stabstudy.online import META_STATISTICS, MetaConfig, MetaDetector, MetaState, PCAModel
from stabstudy.online import features as F

#: The event family each perturbation kind was designed to give: read by the manipulation check only
#: (does the onset speed the label measures agree with the design?), never by the protocol, whose
#: families come from the data (:func:`run_info`).
DESIGNED: dict[str, str] = {"lr_ramp": "slow-onset", "lr_spike": "shock", "outlier_batch": "shock"}
#: Meta-state statistics a suite can read (``meta:<stat>``).
META_STATS = ("t2", "q", "coordination")


@dataclass(frozen=True)
class DetectorSpec:
    """One row of the comparison: a ``name``, the ``feature`` it reads (``meta:<stat>`` for the
    meta-state), its ``family`` (``performance``, ``single``, ``meta`` or ``knob-aware``), a
    factory of fresh :class:`stabstudy.online.Detector` objects and whether it reads the suite's
    trailing ``window``, ``ewma`` or ``clip`` (``windowed``: a change of those re-scores it alone)."""

    name: str
    feature: str
    family: str
    make: Callable[[], D.Detector] = field(compare=False, repr=False)
    windowed: bool = False


def suite(kinds: Sequence[str], meta_features: Sequence[str], *, olmo_window: int = 128, window: int = 64,
          ewma: float = 0.2, clip: float = 10.0, ews: tuple[int, int, int] = (20, 30, 40), river: bool = True,
          lambda_max: bool = True) -> list[DetectorSpec]:
    """The detectors compared in notebook 04, checked against the leakage guard for ``kinds``.

    Args:
        kinds: perturbation kinds present in the runs.
        meta_features: the meta-state's features; each also gets a univariate twin (the same
            robust z and EWMA, two-sided), so that "joint" is compared with "one channel, same chart".
        olmo_window: OLMo-core's window (128).
        window: trailing window of the robust z-scores.
        ewma: EWMA factor of the twins (the meta-state's own is in its :class:`MetaConfig`).
        clip: the twins' z clip (the meta-state's); the other robust z-scores are not clipped.
        ews: ``(detrend, window, span)`` of the critical-slowing-down detectors.
        river: include ADWIN and Page-Hinkley (imports ``river``).
        lambda_max: include the knob-aware sharpness detector ``lambda_max * lr / 2``.
    """
    def robust(name, side, ewma_=1.0, clip_=math.inf):
        return lambda: D.RobustZ(name, window=window, side=side, ewma=ewma_, clip=clip_)

    # OLMo's z scores from 32 past values on (the window then fills up to 128), so that a short run
    # is watched over the same steps as by the other detectors
    specs = [
        DetectorSpec("loss robust z (performance)", "loss", "performance", robust("loss_z", "up"), True),
        DetectorSpec("OLMo z loss", "loss", "performance", lambda: D.WindowZ("olmo_loss", olmo_window)),
        DetectorSpec("OLMo z grad_norm", "grad_norm", "single", lambda: D.WindowZ("olmo_grad", olmo_window)),
        DetectorSpec("ZClip z grad_norm", "grad_norm", "single", lambda: D.ZClipZ("zclip")),
        DetectorSpec("update-norm z", "update_norm/lr", "single", robust("update_z", "up"), True),
        DetectorSpec("cos(update, -g) z", "update_grad_cos", "single", robust("cos_z", "down"), True),
        DetectorSpec("xgrad z", "xgrad", "single", robust("xgrad_z", "down"), True),
        DetectorSpec("attn_logit_max z", "attn_logit_max", "single", robust("attn_logit_z", "up"), True),
        DetectorSpec("attn_entropy_min z", "attn_entropy_min", "single", robust("attn_entropy_z", "down"), True),
    ]
    d, w, s = ews
    for ch, perf in (("loss", "performance"), ("grad_norm", "single")):
        for ind in ("variance", "ac1"):
            specs.append(DetectorSpec(f"EWS tau({ind}) {ch}", ch, perf,
                                      lambda ind=ind: D.KendallEWS(f"ews_{ind}", ind, d, w, s)))
    if river:
        specs += [DetectorSpec("ADWIN grad_norm", "grad_norm", "single", lambda: D.ADWINGrid(window=window), True),
                  DetectorSpec("Page-Hinkley grad_norm", "grad_norm", "single", lambda: D.PageHinkley(window=window),
                               True)]
    if lambda_max:
        specs.append(DetectorSpec("lambda_max vs 2/lr", "lambda_max*lr/2", "knob-aware",
                                  lambda: D.Level("lambda_max_lr", threshold=1.0)))
    for f in meta_features:
        specs.append(DetectorSpec(f"EWMA z {f}", f, "single", robust(f"ewma_z_{f}", "both", ewma, clip), True))
    for stat in META_STATS:
        specs.append(DetectorSpec(f"meta-state {stat}", f"meta:{stat}", "meta", lambda stat=stat: D.Level(stat), True))
    for sp in specs:
        if not sp.feature.startswith("meta:"):
            F.check([sp.feature], kinds, knob_aware=sp.family == "knob-aware")
    F.check(meta_features, kinds)
    return specs


#: The attribute :func:`before_clip` says how many runs it changed in.
BEFORE_CLIP_ATTR = "grad_norm_before_clip"


def before_clip(ds: xr.Dataset) -> xr.Dataset:
    """``ds`` (dimension ``run``) with ``grad_norm`` as ``backward()`` produced it, before clipping,
    where a run recorded it (``grad_norm_raw``), so that the detectors judge what OLMo's and ZClip's
    rules judge: a learner's stored ``grad_norm`` is the norm its optimizer received, pinned at the
    clip value where it clips (PPO/A2C at stable-baselines3's ``max_grad_norm``). Runs stored before
    ``grad_norm_raw`` was recorded keep their ``grad_norm``; ``attrs[BEFORE_CLIP_ATTR]`` says how
    many runs read the norm before clipping ("k of n")."""
    n = ds.sizes.get("run", 1)
    if "grad_norm_raw" not in ds:
        return ds.assign_attrs({BEFORE_CLIP_ATTR: f"0 of {n}"})
    raw = ds["grad_norm_raw"]
    has = raw.notnull().any("step")
    out = ds.assign(grad_norm=xr.where(has, raw, ds["grad_norm"], keep_attrs=True))
    out["grad_norm"].attrs = dict(ds["grad_norm"].attrs)
    return out.assign_attrs({BEFORE_CLIP_ATTR: f"{int(has.sum())} of {n}"})


class _Channels:
    """The (run, step) arrays of the channels ``names`` that ``ds`` records, read once: one run's are
    rows of them (selecting by label run after run costs more than the detectors)."""

    def __init__(self, ds: xr.Dataset, names: set[str]):
        self.arrays = {c: np.asarray(ds[c].transpose("run", "step").values, dtype=float) for c in names if c in ds}
        self.row = {r: i for i, r in enumerate(ds["run"].values)}

    def __call__(self, run: str) -> dict[str, np.ndarray]:
        i = self.row[run]
        return {c: a[i] for c, a in self.arrays.items()}


def meta_streams(ds: xr.Dataset, meta_features: Sequence[str], pca: PCAModel | None, config: MetaConfig,
                 kinds: Sequence[str] = ()) -> xr.Dataset:
    """The streaming :class:`MetaState` of every run (:meth:`MetaState.replay`: update's rows
    exactly): variables ``t2``, ``q``, ``coordination``, ``eff_dim`` (dims run, step) and ``z``
    (dims run, step, feature)."""
    F.check(meta_features, kinds)
    need = F.channels_of(meta_features)
    n_run, n_step = ds.sizes["run"], ds.sizes["step"]
    out = {k: np.full((n_run, n_step), np.nan) for k in ("t2", "q", "coordination", "eff_dim")}
    z = np.full((n_run, n_step, len(meta_features)), np.nan)
    channels = _Channels(ds, need)
    for i, run in enumerate(ds["run"].values):
        x = F.matrix(channels(run), meta_features, kinds)
        for t, r in enumerate(MetaState(meta_features, pca, config, kinds).replay(x[:n_step])):
            out["t2"][i, t], out["q"][i, t], out["coordination"][i, t], out["eff_dim"][i, t] = r[:4]
            z[i, t] = r.z
    coords = {"run": ds["run"].values, "step": ds["step"].values, "feature": list(meta_features)}
    return xr.Dataset({**{k: (("run", "step"), v) for k, v in out.items()}, "z": (("run", "step", "feature"), z)},
                      coords=coords)


def meta_replay(ds: xr.Dataset, meta_features: Sequence[str], pca: PCAModel | None, config: MetaConfig,
                kinds: Sequence[str] = ()) -> xr.Dataset:
    """:func:`meta_streams` computed with the vectorised :func:`replay` (equal to 1e-9, much faster):
    for refits that repeat the meta-state over many runs."""
    F.check(meta_features, kinds)
    need = F.channels_of(meta_features)
    stats = ("t2", "q", "coordination", "eff_dim")
    channels = _Channels(ds, need)
    parts = [replay(F.matrix(channels(run), meta_features, kinds), pca, config) for run in ds["run"].values]
    coords = {"run": ds["run"].values, "step": ds["step"].values, "feature": list(meta_features)}
    return xr.Dataset({**{k: (("run", "step"), np.stack([p[k] for p in parts])) for k in stats},
                       "z": (("run", "step", "feature"), np.stack([p["z"] for p in parts]))}, coords=coords)


def score_runs(ds: xr.Dataset, specs: Sequence[DetectorSpec], meta: xr.Dataset | None = None,
               progress: bool = True) -> xr.DataArray:
    """Feed every run of ``ds`` (dims run, step) to a fresh detector of every spec, step by step
    (:meth:`stabstudy.online.Detector.replay`: the array form of a detector's update where it has
    one, equal bit for bit).

    ``meta``: :func:`meta_streams` of the same runs (needed by ``meta:`` specs). Returns the
    scores, dims ``(detector, run, step)``.
    """
    feats = [s.feature for s in specs if not s.feature.startswith("meta:")]
    need = F.channels_of(feats)
    out = np.full((len(specs), ds.sizes["run"], ds.sizes["step"]), np.nan)
    runs = ds["run"].values
    channels = _Channels(ds, need)
    for i, run in enumerate(tqdm(runs, desc="detectors", disable=not progress, mininterval=10)):  # few redraws
        data = channels(run)
        cols = {f: F.column(data, f) for f in set(feats) if F.channels_of([f]) <= set(data)}
        for j, sp in enumerate(specs):
            if sp.feature.startswith("meta:"):
                if meta is None:
                    raise ValueError(f"{sp.name} reads the meta-state: pass meta=meta_streams(...)")
                x = meta[sp.feature.split(":", 1)[1]].sel(run=run).values
            elif sp.feature in cols:
                x = cols[sp.feature]
            else:
                continue  # the runs do not record this channel: the detector stays NaN
            out[j, i] = sp.make().replay(x)  # = update fed value by value, bit for bit
    return xr.DataArray(out, dims=("detector", "run", "step"),
                        coords={"detector": [s.name for s in specs], "run": runs, "step": ds["step"].values})


def run_info(ds: xr.Dataset, labels: pd.DataFrame, calibration_seeds: Sequence[int]) -> pd.DataFrame:
    """One row per run (index run): ``seed, kind, dose, start, duration``, ``event, onset``,
    ``family`` (the event's onset speed from ``labels``; empty without an event), ``end`` (steps with
    a finite loss), ``split`` (``calibration`` when the seed is in ``calibration_seeds``, else
    ``evaluation``) and ``null``: nothing was done to the run (no perturbation, and the
    hyperparameters of the perturbed runs, so a spontaneous family's other configuration is not the
    null); ``labels`` from :func:`stabstudy.analysis.warning.labels.label_runs`.

    ``kind``, ``dose``, ``start`` and ``duration`` are what was done, for the scoring's ground truth
    and the manipulation checks; the family never reads them. Labels without a ``family`` column (an
    event judged from sparse evaluations, as RL's, whose resolution cannot tell a creeping onset from
    a sudden one) make every event a ``shock``."""
    # load_runs attaches the hyperparameters as coordinates along run (a hand-built Dataset may hold
    # them as data variables): both are read, or every run would look like one configuration
    hp = sorted(str(v) for v in ds.variables if str(v).startswith("hp_") and ds[v].dims == ("run",))
    col = {v: np.asarray(ds[v].values) for v in ("pert_kind", "seed", "pert_dose", "pert_start", "pert_duration", *hp)}
    loss = np.asarray(ds["loss"].transpose("run", "step").values, dtype=float)
    rows = []
    for i, run in enumerate(ds["run"].values):
        fin = np.flatnonzero(np.isfinite(loss[i]))
        seed = int(col["seed"][i])
        event = bool(labels.loc[run, "event"])
        fam = str(labels.loc[run, "family"]) if "family" in labels else "shock"
        rows.append({"run": run, "seed": seed, "kind": str(col["pert_kind"][i]), "dose": float(col["pert_dose"][i]),
                     "start": float(col["pert_start"][i]), "duration": float(col["pert_duration"][i]),
                     "family": fam if event else "", "event": event,
                     "onset": int(labels.loc[run, "onset"]), "end": int(fin[-1] + 1) if fin.size else 0,
                     "split": "calibration" if seed in set(calibration_seeds) else "evaluation",
                     "config": repr([col[v][i].item() if hasattr(col[v][i], "item") else col[v][i] for v in hp])})
    info = pd.DataFrame(rows).set_index("run")
    perturbed = info[info.kind != "none"]
    base = (perturbed if len(perturbed) else info).config.mode().iloc[0]
    info["null"] = (info.kind == "none") & (info.config == base)
    return info.drop(columns="config")


def null_runs(info: pd.DataFrame, split: str) -> pd.DataFrame:
    """The unperturbed runs of ``split`` (``null`` of :func:`run_info`; without that column, every
    run of kind ``none``)."""
    null = info["null"] if "null" in info else info.kind == "none"
    return info[null & (info.split == split)]


def warn_from(x: pd.Series, horizon: int, burn_in: int) -> int:
    """First step of an event's warning window: ``max(onset - horizon, burn_in)``, and not before the
    perturbation's start where it is known (``x.start`` finite; module docstring, step 4)."""
    start = x.start if "start" in x and np.isfinite(x.start) else -np.inf
    return int(max(x.onset - horizon, start, burn_in))


def event_free(info: pd.DataFrame, burn_in: int, horizon: int) -> dict[str, tuple[int, int]]:
    """Run -> the event-free step interval ``[a, b)``: a null run from ``burn_in`` to its end, an
    event run from ``burn_in`` to its :func:`warn_from`."""
    return {r: (burn_in, warn_from(x, horizon, burn_in) if x.event else int(x.end)) for r, x in info.iterrows()}


def step_pairs(scores: np.ndarray, segments: dict[int, tuple[int, int]]) -> tuple[np.ndarray, np.ndarray, int]:
    """(lo, hi) of every masked step (an up-crossing over theta iff lo <= theta < hi) and the step count."""
    los, his, n = [], [], 0
    for i, (a, b) in segments.items():
        if b <= a:
            continue
        s = scores[i, a:b]
        prev = np.concatenate([[-np.inf], s[:-1]])
        prev = np.where(np.isfinite(prev) | (prev == np.inf), prev, -np.inf)
        ok = ~np.isnan(s)
        los.append(prev[ok])
        his.append(s[ok])
        n += b - a
    if not los:
        return np.empty(0), np.empty(0), 0
    return np.concatenate(los), np.concatenate(his), n


def count_alarms(scores: np.ndarray, threshold: float, segments: dict[int, tuple[int, int]]) -> tuple[int, int]:
    """Up-crossings of ``threshold`` and steps, over ``segments`` (row of ``scores`` (run, step) ->
    ``[a, b)``); the first step of a segment counts as an up-crossing when above."""
    lo, hi, n = step_pairs(scores, segments)
    return int(np.count_nonzero((lo <= threshold) & (hi > threshold))), n


def time_in_alarm(scores: np.ndarray, threshold: float, segments: dict[int, tuple[int, int]]) -> float:
    """Share of the steps of ``segments`` whose score exceeds ``threshold``: an alarm that stays on
    for long counts once in :func:`count_alarms`, and this says for how long."""
    _, hi, n = step_pairs(scores, segments)
    return float(np.count_nonzero(hi > threshold) / n) if n else np.nan


def calibrate(scores: np.ndarray, segments: dict[int, tuple[int, int]], budget: float = 1.0) -> float:
    """The lowest threshold whose up-crossings over ``segments`` are at most ``budget`` per 1,000
    steps, at that threshold and every higher one (inf when the detector never scores)."""
    return threshold_for(*step_pairs(scores, segments), budget)


def threshold_for(lo: np.ndarray, hi: np.ndarray, n: int, budget: float = 1.0) -> float:
    """:func:`calibrate` from the step pairs of :func:`step_pairs` (so that a resample of runs can
    concatenate the pairs of the runs it draws)."""
    seen = hi[np.isfinite(hi)]
    keep = lo < hi
    lo, hi = np.sort(lo[keep]), np.sort(hi[keep])
    if hi.size == 0:  # the score never rises: no threshold can alarm here; the highest value seen is safe
        return float(seen.max()) if seen.size else np.inf
    cand = np.unique(np.concatenate([lo[np.isfinite(lo)], hi[np.isfinite(hi)]]))
    counts = np.searchsorted(lo, cand, side="right") - np.searchsorted(hi, cand, side="right")
    bad = np.flatnonzero(counts > budget * n / 1000.0)
    if not bad.size:
        return float(cand[0])
    return float(cand[bad[-1] + 1]) if bad[-1] + 1 < cand.size else np.inf


def first_alarm(s: np.ndarray, threshold: float, a: int, b: int) -> int:
    """First up-crossing of ``threshold`` in ``[a, b]`` (a step above it whose previous step is not,
    the step before ``a`` included), or -1.

    An alarm standing since before ``a`` was raised before the warning window opened: in a
    spontaneous family (no perturbation start to bound the window) a detector that sits above
    its threshold for a whole run, for example because the run's configuration differs from the
    null's, would otherwise be credited the whole horizon as lead. It counts as a warning only
    if it falls and rises again inside the window, as alarms are counted everywhere else."""
    return int(first_alarms(np.asarray(s)[None], np.array([threshold]), a, b)[0])


def first_alarms(s: np.ndarray, thresholds: np.ndarray, a: int, b: int) -> np.ndarray:
    """:func:`first_alarm` of every row of ``s`` (shape (detector, step)) against its own threshold
    (shape (detector,)), over the same window ``[a, b]``."""
    a = max(a, 0)
    above = s[:, max(a - 1, 0):b + 1] > np.asarray(thresholds, dtype=float)[:, None]
    rise = above[:, 1:] & ~above[:, :-1]
    if a == 0:
        rise = np.concatenate([above[:, :1], rise], axis=1)
    if not rise.shape[1]:
        return np.full(s.shape[0], -1)
    return np.where(rise.any(axis=1), a + rise.argmax(axis=1), -1)


def leads(scores: xr.DataArray, info: pd.DataFrame, thresholds: pd.Series, *, horizon: int, late: int,
          burn_in: int) -> pd.DataFrame:
    """Lead time (onset - first alarm in ``[warn_from, onset + late]``, NaN when missed) of every
    detector (columns) on every event run of ``info`` (rows)."""
    ev = info[info.event]
    dets = scores["detector"].values
    vals = scores.transpose("detector", "run", "step").sel(run=ev.index.values).values
    thr = thresholds.loc[dets].to_numpy(dtype=float)
    out = np.full((len(ev), len(dets)), np.nan)
    for i, (_, x) in enumerate(ev.iterrows()):
        t = first_alarms(vals[:, i], thr, warn_from(x, horizon, burn_in), x.onset + late)
        out[i] = np.where(t >= 0, x.onset - t, np.nan)
    return pd.DataFrame(out, index=ev.index, columns=dets)


def penalised(lead: pd.DataFrame, late: int) -> pd.DataFrame:
    """Leads with a missed event scored as ``-(late + 1)``, worse than any detection (for paired ranks)."""
    return lead.fillna(-(late + 1.0))


def _median_ci(x: np.ndarray, n_boot: int, seed: int) -> tuple[float, float, float]:
    from scipy import stats as sps

    x = x[np.isfinite(x)]
    if x.size == 0:
        return np.nan, np.nan, np.nan
    if x.size < 2 or np.ptp(x) == 0:
        return float(np.median(x)), float(np.median(x)), float(np.median(x))
    res = sps.bootstrap((x,), np.median, n_resamples=n_boot, method="percentile", vectorized=True,
                        random_state=np.random.default_rng(seed))
    return float(np.median(x)), float(res.confidence_interval.low), float(res.confidence_interval.high)


def auc_pairs(pos: np.ndarray, neg: np.ndarray, axis: int = -1) -> np.ndarray:
    """ROC-AUC as the Mann-Whitney probability ``P(pos > neg) + P(pos = neg) / 2`` along ``axis``
    (vectorised over resamples; equal to scikit-learn's ``roc_auc_score``)."""
    p = np.moveaxis(np.asarray(pos, dtype=float), axis, -1)[..., :, None]
    n = np.moveaxis(np.asarray(neg, dtype=float), axis, -1)[..., None, :]
    return (p > n).mean(axis=(-1, -2)) + 0.5 * (p == n).mean(axis=(-1, -2))


def auc(pos: np.ndarray, neg: np.ndarray, n_boot: int, seed: int) -> tuple[float, float, float]:
    """ROC-AUC (scikit-learn) of window scores ``pos`` (events) against ``neg`` (nulls), with a
    percentile bootstrap interval resampling each group; NaNs dropped, NaN when a group is empty."""
    from scipy import stats as sps
    from sklearn.metrics import roc_auc_score

    pos, neg = pos[np.isfinite(pos) | (pos == np.inf)], neg[np.isfinite(neg) | (neg == np.inf)]
    if pos.size == 0 or neg.size == 0:
        return np.nan, np.nan, np.nan
    value = float(roc_auc_score(np.r_[np.ones(pos.size), np.zeros(neg.size)],
                                np.nan_to_num(np.r_[pos, neg], posinf=np.finfo(float).max)))
    if pos.size < 2 or neg.size < 2 or np.ptp(np.r_[pos, neg]) == 0:
        return value, value, value
    res = sps.bootstrap((pos, neg), auc_pairs, n_resamples=n_boot, method="percentile", vectorized=True,
                        random_state=np.random.default_rng(seed))
    return value, float(res.confidence_interval.low), float(res.confidence_interval.high)


def horizon_from(x: pd.Series, horizon: int, burn_in: int) -> int:
    """First step of an event's AUC window, ``max(onset - horizon, burn_in)``: the same for every
    event whatever was done to its run (no perturbation start)."""
    return int(max(x.onset - horizon, burn_in))


def window_max(scores: xr.DataArray, info: pd.DataFrame, horizon: int, burn_in: int,
               events: pd.DataFrame | None = None) -> pd.DataFrame:
    """Largest score of each detector (columns) over ``[onset - horizon, onset]`` (:func:`horizon_from`)
    of each event run and over a window as long as the median of those, ending at their median onset,
    of each null run (rows).

    ``events`` (default: the event runs of ``info``) sets the null windows' position, so that a
    family's events are compared with null runs at the same point of training.
    """
    ev = info[info.event] if events is None else events
    t0 = int(np.median(ev.onset)) if len(ev) else int(info.end.median()) - 1
    span = int(np.median([x.onset - horizon_from(x, horizon, burn_in) for _, x in ev.iterrows()])) if len(ev) else horizon
    out = pd.DataFrame(np.nan, index=info.index, columns=scores["detector"].values)
    vals = scores.transpose("run", "detector", "step").sel(run=info.index.values).values
    for i, (run, x) in enumerate(info.iterrows()):
        end = int(x.onset) if x.event else min(t0, int(x.end) - 1)
        a = horizon_from(x, horizon, burn_in) if x.event else max(end - span, burn_in)
        w = vals[i, :, a:end + 1]
        if w.shape[1]:
            seen = ~np.isnan(w)
            out.loc[run] = np.where(seen.any(axis=1), np.where(seen, w, -np.inf).max(axis=1), np.nan)
    return out


def alarmed(scores: xr.DataArray, info: pd.DataFrame, thresholds: pd.Series, *, late: int,
            burn_in: int) -> pd.DataFrame:
    """Whether each detector (columns) alarmed at all on each run of ``info`` (rows): an up-crossing of
    its threshold anywhere from ``burn_in`` to the end of the run (an event run: to ``onset + late``,
    the end of its warning window). Blind to what was done to the run: on an unperturbed run it is a
    false alarm, on a perturbed run that ends unaffected a nuisance alarm, on a harmed run an alarm
    the harm may justify."""
    dets = scores["detector"].values
    vals = scores.transpose("detector", "run", "step").sel(run=info.index.values).values
    thr = thresholds.loc[dets].to_numpy(dtype=float)
    out = np.zeros((len(info), len(dets)), bool)
    for i, (_, x) in enumerate(info.iterrows()):
        stop = int(x.onset + late) if x.event else int(x.end) - 1
        out[i] = first_alarms(vals[:, i], thr, burn_in, stop) >= 0
    return pd.DataFrame(out, index=info.index, columns=dets)


@dataclass
class Evaluation:
    """What :func:`evaluate` returns: ``thresholds`` (detector -> calibrated threshold), ``table``
    (one row per detector and event family), ``leads`` (evaluation event runs x detectors, NaN
    when missed), ``fa_runs`` (evaluation null runs x detectors: false alarms per 1,000 of the
    run's event-free steps), ``windows`` (event family -> :func:`window_max` of the evaluation
    runs for that family), ``in_alarm_runs`` (like ``fa_runs``: the share of those steps above
    the threshold, :func:`time_in_alarm`; None where not measured), ``alarmed``."""

    thresholds: pd.Series
    table: pd.DataFrame
    leads: pd.DataFrame
    fa_runs: pd.DataFrame
    windows: dict[str, pd.DataFrame]
    in_alarm_runs: pd.DataFrame | None = None
    alarmed: pd.DataFrame | None = None
    """evaluation runs x detectors: :func:`alarmed` (None where not measured)"""


def evaluate(scores: xr.DataArray, info: pd.DataFrame, specs: Sequence[DetectorSpec], *, budget: float = 1.0,
             horizon: int = 100, late: int = 20, burn_in: int = 50, n_boot: int = 1000, seed: int = 0,
             thresholds: pd.Series | None = None) -> Evaluation:
    """Calibrate on the calibration unperturbed runs (unless ``thresholds`` are given), then score
    the evaluation runs (module docstring). ``table`` columns: ``detector, family`` (of the
    detector), ``events`` (event family), ``n_events, n_detected, rate, rate_lo, rate_hi``
    (Clopper-Pearson), ``lead_median, lead_lo, lead_hi`` (bootstrap over detected events),
    ``fa_per_1k`` (event-free steps of the evaluation unperturbed runs), ``n_null`` (those runs:
    the independent unit of the false-alarm rate), ``in_alarm`` (share of those steps above the
    threshold), ``auc, auc_lo, auc_hi``, ``threshold``. ``n_boot=0`` leaves the bootstrap intervals
    out (NaN): a recomputation that reads only thresholds, leads and alarms."""
    from stabstudy.analysis.claims import rate_ci

    runs = list(scores["run"].values)
    row = {r: i for i, r in enumerate(runs)}
    cal = null_runs(info, "calibration")
    ev_info = info[info.split == "evaluation"]
    nulls = null_runs(info, "evaluation")
    free = event_free(nulls, burn_in, horizon)
    if thresholds is None:
        segs = {row[r]: ab for r, ab in event_free(cal, burn_in, horizon).items()}
        thresholds = pd.Series({d: calibrate(scores.sel(detector=d).values, segs, budget)
                                for d in scores["detector"].values})
    lead = leads(scores, ev_info, thresholds, horizon=horizon, late=late, burn_in=burn_in)
    # the false alarms count on every null run's event-free steps (a spontaneous event's run up to its
    # warning window too), the same steps as fa_per_1k; the AUC's null side is the runs without an event
    fa_runs = pd.DataFrame(np.nan, index=nulls.index, columns=scores["detector"].values)
    in_alarm_runs = fa_runs.copy()
    quiet = nulls
    nulls = nulls[~nulls.event]
    win = {}
    kind_of = {s.name: s.family for s in specs}
    rows = []
    for k, det in enumerate(scores["detector"].values):
        s = scores.sel(detector=det).values
        segs = {row[r]: ab for r, ab in free.items()}
        n_fa, n_steps = count_alarms(s, thresholds[det], segs)
        on = time_in_alarm(s, thresholds[det], segs)
        for r in quiet.index:
            c, n = count_alarms(s, thresholds[det], {row[r]: free[r]})
            fa_runs.loc[r, det] = 1000.0 * c / n if n else np.nan
            in_alarm_runs.loc[r, det] = time_in_alarm(s, thresholds[det], {row[r]: free[r]})
        for fam in ["all", *sorted(ev_info[ev_info.event].family.unique())]:
            evs = ev_info[ev_info.event & ((ev_info.family == fam) | (fam == "all"))]
            if fam not in win:
                win[fam] = window_max(scores, pd.concat([evs, nulls]), horizon, burn_in, events=evs)
            ld = lead.loc[evs.index, det].to_numpy(float)
            hit = int(np.isfinite(ld).sum())
            lo, hi = rate_ci(hit, len(evs))
            pos, neg = win[fam].loc[evs.index, det].to_numpy(float), win[fam].loc[nulls.index, det].to_numpy(float)
            if n_boot:
                med, mlo, mhi = _median_ci(ld, n_boot, seed + k)
                a, alo, ahi = auc(pos, neg, n_boot, seed + k)
            else:
                med, mlo, mhi = float(np.nanmedian(ld)) if np.isfinite(ld).any() else np.nan, np.nan, np.nan
                p_, n_ = pos[~np.isnan(pos) & (pos != -np.inf)], neg[~np.isnan(neg) & (neg != -np.inf)]
                a, alo, ahi = (float(auc_pairs(p_, n_)) if p_.size and n_.size else np.nan), np.nan, np.nan
            rows.append({"detector": det, "family": kind_of.get(det, ""), "events": fam, "n_events": len(evs),
                         "n_detected": hit, "rate": hit / len(evs) if len(evs) else np.nan, "rate_lo": lo,
                         "rate_hi": hi, "lead_median": med, "lead_lo": mlo, "lead_hi": mhi,
                         "fa_per_1k": 1000.0 * n_fa / n_steps if n_steps else np.nan, "in_alarm": on,
                         "n_null": len(quiet),
                         "auc": a, "auc_lo": alo,
                         "auc_hi": ahi, "threshold": thresholds[det]})
    alarms = alarmed(scores, ev_info, thresholds, late=late, burn_in=burn_in)
    return Evaluation(thresholds, pd.DataFrame(rows), lead, fa_runs, win, in_alarm_runs, alarms)


def best(lead: pd.DataFrame, candidates: Sequence[str], late: int) -> str:
    """The candidate with the largest mean penalised lead (:func:`penalised`) over the events of ``lead``;
    ties broken by the order of ``candidates``."""
    if lead.empty:
        return candidates[0]
    m = penalised(lead[list(candidates)], late).mean()
    return str(m.idxmax())


def pairwise(lead: pd.DataFrame, reference: Sequence[str], late: int, alpha: float = 0.05) -> pd.DataFrame:
    """Two-sided Wilcoxon signed-rank tests of penalised leads, each ``reference`` detector against
    every other detector over the same events; Holm-adjusted (statsmodels) across all rows.

    Columns: ``a, b, n, median_diff`` (a - b, steps), ``p``, ``p_holm``, ``a_earlier`` (median > 0 and
    p_holm < alpha)."""
    from statsmodels.stats.multitest import multipletests

    from stabstudy.analysis.claims import signed_rank_p

    pen = penalised(lead, late)
    rows = []
    for a in reference:
        for b in pen.columns:
            if b == a:
                continue
            d = (pen[a] - pen[b]).to_numpy(float)
            p = signed_rank_p(d, "two-sided") if np.any(d != 0) and d.size >= 2 else 1.0
            rows.append({"a": a, "b": b, "n": d.size, "median_diff": float(np.median(d)) if d.size else np.nan, "p": p})
    out = pd.DataFrame(rows)
    if out.empty:
        return out
    out["p_holm"] = multipletests(out.p.to_numpy(), alpha=alpha, method="holm")[1]
    out["a_earlier"] = (out.median_diff > 0) & (out.p_holm < alpha)
    return out


def in_control_rows(ds: xr.Dataset, info: pd.DataFrame, meta_features: Sequence[str], config: MetaConfig,
                    kinds: Sequence[str], burn_in: int, horizon: int) -> np.ndarray:
    """Smoothed z rows (shape (row, feature)) of the in-control steps of the runs of ``info``:
    from ``burn_in`` to the first of the perturbation start, ``onset - horizon`` and the run's end."""
    need = F.channels_of(meta_features)
    channels = _Channels(ds, need)
    rows = []
    for run, x in info.iterrows():
        stop = int(x.end)
        if np.isfinite(x.start):
            stop = min(stop, int(x.start))
        if x.event:
            stop = min(stop, int(x.onset - horizon))
        if stop <= burn_in:
            continue
        zs = replay(F.matrix(channels(run), meta_features, kinds), None, config)["zs"]
        rows.append(zs[burn_in:stop])
    return np.concatenate(rows) if rows else np.empty((0, len(meta_features)))


def fit_meta(ds: xr.Dataset, info: pd.DataFrame, meta_features: Sequence[str], config: MetaConfig,
             kinds: Sequence[str], burn_in: int, horizon: int, n_components: int | float = 0.9) -> PCAModel:
    """:func:`stabstudy.analysis.warning.metastate.fit_pca` on :func:`in_control_rows` of ``info``'s runs."""
    z = in_control_rows(ds, info, meta_features, config, kinds, burn_in, horizon)
    return fit_pca(z, meta_features, n_components)


def calibrate_detector(runs: Sequence[xr.Dataset], features: Sequence[str], *, statistic: str = "t2",
                       budget: float = 1.0, burn_in: int | None = None, config: MetaConfig | None = None,
                       n_components: int | float = 0.9, kinds: Sequence[str] = ()) -> MetaDetector:
    """The meta-state as a Controller detector, calibrated as notebook 04 calibrates it on its null:
    the PCA fitted on the smoothed z rows of ``runs`` (unperturbed runs, e.g. ``Monitor.to_dataset()``
    of each; dim ``step``) past ``burn_in`` (default: the standardisation window), and the threshold,
    the lowest at which ``statistic`` crosses up at most ``budget`` times per 1,000 of those steps.

    Raises ``ValueError`` naming the channels the runs lack."""
    if statistic not in META_STATISTICS:
        raise ValueError(f"unknown meta-state statistic {statistic!r}; valid: {', '.join(META_STATISTICS)}")
    cfg = config or MetaConfig()
    burn = cfg.window if burn_in is None else int(burn_in)
    need = F.channels_of(features)
    for i, run in enumerate(runs):
        missing = sorted(need - set(run.data_vars))
        if missing:
            raise ValueError(f"run {i} lacks channel(s) {missing} that {list(features)} read")
    xs = [F.matrix(run, features, kinds) for run in runs]
    pca = fit_pca(np.concatenate([replay(x, None, cfg)["zs"][burn:] for x in xs]), features, n_components)
    scores = np.full((len(xs), max(len(x) for x in xs)), np.nan)
    for i, x in enumerate(xs):
        scores[i, :len(x)] = replay(x, pca, cfg)[statistic]
    threshold = calibrate(scores, {i: (burn, len(x)) for i, x in enumerate(xs)}, budget)
    return MetaDetector(pca, statistic, threshold, cfg, kinds, burn_in=burn)


def ews_reference(x: np.ndarray, indicator: str, detrend: int, window: int, span: int) -> np.ndarray:
    """The critical-slowing-down score of :class:`stabstudy.online.detectors.KendallEWS`
    computed with ``ewstools`` on a whole series ``x`` (shape (step,)): the same causal residuals,
    ewstools' rolling variance / lag-1 autocorrelation (trailing windows, so causal), and at each step
    ewstools' Kendall tau of the last ``span`` indicator values. Slow (one ewstools call per step):
    the reference the streaming detector is checked against.
    """
    import ewstools

    x = np.asarray(x, dtype=float)
    n = x.size
    res = np.full(n, np.nan)
    for t in range(detrend, n):
        past = x[t - detrend:t]
        if np.isfinite(past).all() and np.isfinite(x[t]):
            res[t] = x[t] - past.mean()
    ts = ewstools.TimeSeries(pd.Series(res, index=pd.RangeIndex(n, name="time")))
    if indicator == "variance":
        ts.compute_var(rolling_window=window)
        col = "variance"
    elif indicator == "ac1":
        ts.compute_auto(rolling_window=window, lag=1)
        col = "ac1"
    else:
        raise ValueError(f"unknown indicator {indicator!r}; valid: variance, ac1")
    ind = ts.ews[col].to_numpy(float)
    out = np.full(n, np.nan)
    for t in range(span - 1, n):
        w = ind[t - span + 1:t + 1]
        if np.isfinite(w).all() and np.ptp(w) > 0:
            ts.ktau = {}
            ts.compute_ktau(tmin=t - span + 1, tmax=t)
            out[t] = ts.ktau[col]
    return out
