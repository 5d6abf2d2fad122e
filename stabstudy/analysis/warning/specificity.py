"""Collapse specificity: among perturbed runs, does a score tell the runs that will collapse from those
that will not, before the label fires?

A detector that alarms on every perturbation warns of every collapse, and says nothing about which
perturbations are harmful. This module asks that second question on perturbed runs only, with
windows a deployed monitor could use (it knows neither the kind nor when a perturbation started):

* a run's *window* is the whole run from ``burn_in`` on, cut before the onset for a run that
  collapses, so that no score after the label enters; a collapsing run with no step before its
  onset has no window and is left out (counted in ``n_no_window``). Windows of runs that do not
  collapse are never shorter, which can only favour the null side;
* its score is the largest value of the detector in the window;
* ROC-AUC (scikit-learn) of collapsing against non-collapsing runs, and the precision and recall of
  an alarm (score above the detector's calibrated threshold) in the window;
* intervals resample *seeds* (the independent unit: every perturbed run of a seed shares its
  unperturbed prefix): a resample draws the seeds with replacement and takes every run of each drawn
  seed as often as it was drawn; its AUC comes from the Mann-Whitney sums of every pair of seeds at
  once (:func:`_pairs_by_seed`, equal to the AUC of the resampled runs); a difference of two
  detectors' AUC is resampled on the same seeds.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import xarray as xr
from scipy import stats as sps


def window_scores(scores: xr.DataArray, info: pd.DataFrame, burn_in: int) -> pd.DataFrame:
    """Largest score of each detector (columns) in each perturbed run's window (rows; module
    docstring); NaN where a collapsing run has no step before its onset."""
    pert = info[info.kind != "none"]
    vals = scores.transpose("run", "detector", "step").sel(run=pert.index.values).values
    out = pd.DataFrame(np.nan, index=pert.index, columns=scores["detector"].values)
    for i, (run, x) in enumerate(pert.iterrows()):
        b = int(x.onset) if x.event else int(x.end)
        w = vals[i, :, burn_in:b]
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


def _pairs_by_seed(score: np.ndarray, y: np.ndarray, idx: np.ndarray, n_units: int) -> tuple[np.ndarray, ...]:
    """The Mann-Whitney sums of every pair of seeds: ``A[s, t]`` adds, over the positive runs of seed
    ``s`` and the negative runs of seed ``t``, 1 where the positive scores higher and 1/2 on a tie;
    with ``n_pos[s]`` and ``n_neg[t]`` the AUC of any multiset of seeds with counts ``w`` is
    ``w A w / ((w n_pos)(w n_neg))``, the AUC of its runs (each drawn as often as its seed)."""
    big = np.finfo(float).max
    x = np.clip(score, -big, big)
    pos, neg = x[y], x[~y]
    k = (pos[:, None] > neg[None, :]) + 0.5 * (pos[:, None] == neg[None, :])
    one_pos = np.eye(n_units)[idx[y]]
    one_neg = np.eye(n_units)[idx[~y]]
    return one_pos.T @ k @ one_neg, one_pos.sum(axis=0), one_neg.sum(axis=0)


def _resampled_auc(parts: tuple[np.ndarray, ...], w: np.ndarray) -> np.ndarray:
    """The AUC of each resample (rows of seed counts ``w``), NaN where one lacks a class."""
    a, n_pos, n_neg = parts
    num = np.einsum("bs,st,bt->b", w, a, w)
    den = (w @ n_pos) * (w @ n_neg)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / den, np.nan)


def _seed_counts(seeds: np.ndarray, n_boot: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Each run's seed as an index into the distinct seeds, and ``n_boot`` resamples of those seeds
    with replacement (rows: how often each seed is drawn); no resample with fewer than 2 seeds."""
    units, idx = np.unique(seeds, return_inverse=True)
    if units.size < 2 or n_boot < 1:
        return idx, np.empty((0, units.size))
    draws = np.random.default_rng(seed).integers(0, units.size, (n_boot, units.size))
    w = np.zeros((n_boot, units.size))
    np.add.at(w, (np.arange(n_boot)[:, None], draws), 1.0)
    return idx, w


def _interval(dist: np.ndarray) -> tuple[float, float]:
    """Percentile 95% interval of a bootstrap distribution; undefined (NaN) when any resample is."""
    if dist.size == 0 or np.isnan(dist).any():
        return np.nan, np.nan
    lo, hi = np.percentile(dist, [2.5, 97.5])
    return float(lo), float(hi)


def separation(windows: pd.DataFrame, info: pd.DataFrame, target: pd.Series, thresholds: pd.Series,
               detectors: Sequence[str], *, n_boot: int = 1000, seed: int = 0) -> pd.DataFrame:
    """Per detector: ``auc, auc_lo, auc_hi`` (seed bootstrap) and ``boot`` (the resamples' AUCs),
    ``precision, recall`` of an alarm at ``thresholds``, ``n_pos, n_neg`` (runs), ``n_seeds`` and
    ``n_no_window``, on the runs of ``windows`` (rows of :func:`window_scores`) with ``target`` (bool
    per run: it will collapse)."""
    y_all = target.loc[windows.index].to_numpy(bool)
    seeds_all = info.loc[windows.index, "seed"].to_numpy()
    rows = []
    for k, det in enumerate(detectors):
        s_all = windows[det].to_numpy(float)
        ok = ~np.isnan(s_all)
        s, y, seeds = s_all[ok], y_all[ok], seeds_all[ok]
        alarm = s > thresholds.get(det, np.inf)
        idx, w = _seed_counts(seeds, n_boot, seed + k)
        dist = _resampled_auc(_pairs_by_seed(s, y, idx, w.shape[1]), w) if len(w) else np.empty(0)
        lo, hi = _interval(dist)
        rows.append({"detector": det, "auc": _auc(s, y), "auc_lo": lo, "auc_hi": hi, "boot": dist,
                     "precision": float(y[alarm].mean()) if alarm.any() else np.nan,
                     "recall": float(alarm[y].mean()) if y.any() else np.nan,
                     "n_pos": int(y.sum()), "n_neg": int((~y).sum()), "n_seeds": int(np.unique(seeds).size),
                     "n_no_window": int((np.isnan(s_all) & y_all).sum())})
    return pd.DataFrame(rows).set_index("detector")


def auc_difference(windows: pd.DataFrame, info: pd.DataFrame, target: pd.Series, a: str, b: str, *,
                   n_boot: int = 1000, seed: int = 0) -> tuple[float, tuple[float, float], int, np.ndarray]:
    """AUC of detector ``a`` minus that of ``b`` on the same runs, its seed-bootstrap interval, the
    number of seeds and the resamples' differences."""
    s = windows[[a, b]].to_numpy(float)
    ok = ~np.isnan(s).any(axis=1)
    s, y = s[ok], target.loc[windows.index].to_numpy(bool)[ok]
    seeds = info.loc[windows.index, "seed"].to_numpy()[ok]
    idx, w = _seed_counts(seeds, n_boot, seed)
    dist = (_resampled_auc(_pairs_by_seed(s[:, 0], y, idx, w.shape[1]), w)
            - _resampled_auc(_pairs_by_seed(s[:, 1], y, idx, w.shape[1]), w)) if len(w) else np.empty(0)
    return _auc(s[:, 0], y) - _auc(s[:, 1], y), _interval(dist), int(np.unique(seeds).size), dist
