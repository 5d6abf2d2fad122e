"""Collapse specificity: among perturbed runs, does a score tell the runs that will collapse from those
that will not, at the same time since the perturbation started and before the label fires?

A detector that alarms on every perturbation warns of every collapse, and says nothing about which
perturbations are harmful. This module asks that second question on perturbed runs only:

* a run's *window* is ``[start, start + span)`` (``span`` per event family: the median time from
  the start to the onset of that family's collapsing runs, at least 1 step), cut at the onset for a
  run that collapses, so that no score after the label enters; a collapsing run with no step
  before its onset has no window and is left out (counted in ``n_no_window``). Windows of runs
  that do not collapse are never shorter, which can only favour the null side;
* its score is the largest value of the detector in the window;
* ROC-AUC (scikit-learn) of collapsing against non-collapsing runs, and the precision and recall of
  an alarm (score above the detector's calibrated threshold) in the window;
* intervals resample *seeds* (the independent unit: every perturbed run of a seed shares its
  unperturbed prefix), with scipy's bootstrap; a difference of two detectors' AUC is resampled on
  the same seeds.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import xarray as xr
from scipy import stats as sps


def spans(info: pd.DataFrame, target: pd.Series) -> dict[str, int]:
    """Family -> window length: the median ``onset - start`` of the family's perturbed runs whose
    ``target`` is true (at least 1; the family's median perturbation duration when none collapse)."""
    out = {}
    for fam, g in info[info.kind != "none"].groupby("family"):
        pos = g[target.loc[g.index] & g.event]
        d = (pos.onset - pos.start) if len(pos) else g.duration
        out[str(fam)] = max(int(np.nanmedian(d)), 1) if len(d) and np.isfinite(np.nanmedian(d)) else 1
    return out


def window_scores(scores: xr.DataArray, info: pd.DataFrame, span: dict[str, int]) -> pd.DataFrame:
    """Largest score of each detector (columns) in each perturbed run's window (rows; module
    docstring); NaN where a collapsing run has no step before its onset."""
    pert = info[info.kind != "none"]
    vals = scores.transpose("run", "detector", "step").sel(run=pert.index.values).values
    out = pd.DataFrame(np.nan, index=pert.index, columns=scores["detector"].values)
    for i, (run, x) in enumerate(pert.iterrows()):
        a = int(x.start)
        b = a + span.get(x.family, 1)
        if x.event:
            b = min(b, int(x.onset))
        w = vals[i, :, a:b]
        if w.shape[1]:
            seen = ~np.isnan(w)
            out.loc[run] = np.where(seen.any(axis=1), np.where(seen, w, -np.inf).max(axis=1), np.nan)
    return out


def _auc(score: np.ndarray, y: np.ndarray) -> float:
    """ROC-AUC of ``score`` for labels ``y``, NaN scores dropped: scikit-learn's ``roc_auc_score`` (a tie
    counts one half) as the Mann-Whitney statistic from average ranks, a hundred times faster inside
    a bootstrap."""
    ok = ~np.isnan(score)
    big = np.finfo(float).max
    score, y = np.clip(score[ok], -big, big), np.asarray(y[ok], dtype=bool)
    n1 = int(y.sum())
    n0 = y.size - n1
    if not (n1 and n0):
        return np.nan
    r = sps.rankdata(score)
    return float((r[y].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def _by_seed(seeds: np.ndarray, units: np.ndarray) -> np.ndarray:
    """Row indices of the runs of the drawn seeds ``units``, with their multiplicity."""
    return np.concatenate([np.flatnonzero(seeds == u) for u in units])


def _boot(stat, seeds: np.ndarray, n_boot: int, seed: int) -> tuple[float, float]:
    units = np.unique(seeds)
    if units.size < 2 or n_boot < 1:
        return np.nan, np.nan
    with np.errstate(invalid="ignore"):
        res = sps.bootstrap((units,), lambda u: stat(_by_seed(seeds, u)), n_resamples=n_boot, vectorized=False,
                            method="percentile", random_state=np.random.default_rng(seed))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def separation(windows: pd.DataFrame, info: pd.DataFrame, target: pd.Series, thresholds: pd.Series,
               detectors: Sequence[str], *, n_boot: int = 1000, seed: int = 0) -> pd.DataFrame:
    """Per detector: ``auc, auc_lo, auc_hi`` (seed bootstrap), ``precision, recall`` of an alarm at
    ``thresholds``, ``n_pos, n_neg`` (runs), ``n_seeds`` and ``n_no_window``, on the runs of
    ``windows`` (rows of :func:`window_scores`) with ``target`` (bool per run: it will collapse)."""
    y_all = target.loc[windows.index].to_numpy(bool)
    seeds_all = info.loc[windows.index, "seed"].to_numpy()
    rows = []
    for k, det in enumerate(detectors):
        s_all = windows[det].to_numpy(float)
        ok = ~np.isnan(s_all)
        s, y, seeds = s_all[ok], y_all[ok], seeds_all[ok]
        alarm = s > thresholds.get(det, np.inf)
        lo, hi = _boot(lambda i, s=s, y=y: _auc(s[i], y[i]), seeds, n_boot, seed + k)
        rows.append({"detector": det, "auc": _auc(s, y), "auc_lo": lo, "auc_hi": hi,
                     "precision": float(y[alarm].mean()) if alarm.any() else np.nan,
                     "recall": float(alarm[y].mean()) if y.any() else np.nan,
                     "n_pos": int(y.sum()), "n_neg": int((~y).sum()), "n_seeds": int(np.unique(seeds).size),
                     "n_no_window": int((np.isnan(s_all) & y_all).sum())})
    return pd.DataFrame(rows).set_index("detector")


def auc_difference(windows: pd.DataFrame, info: pd.DataFrame, target: pd.Series, a: str, b: str, *,
                   n_boot: int = 1000, seed: int = 0) -> tuple[float, tuple[float, float], int]:
    """AUC of detector ``a`` minus that of ``b`` on the same runs, its seed-bootstrap interval and
    the number of seeds."""
    s = windows[[a, b]].to_numpy(float)
    ok = ~np.isnan(s).any(axis=1)
    s, y = s[ok], target.loc[windows.index].to_numpy(bool)[ok]
    seeds = info.loc[windows.index, "seed"].to_numpy()[ok]

    def diff(i):
        return _auc(s[i, 0], y[i]) - _auc(s[i, 1], y[i])

    return diff(np.arange(len(y))), _boot(diff, seeds, n_boot, seed), int(np.unique(seeds).size)
