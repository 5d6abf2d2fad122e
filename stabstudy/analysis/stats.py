"""Reliability statistics for training curves (generic: RL returns, LM ``perf``, ...).

Inputs are either numpy arrays with the shapes stated per function, or
:class:`xarray.DataArray` curves with a dimension ``step`` (NaN = not measured;
NaNs are dropped per curve) and, for across-run statistics, a dimension ``run``.
Per-curve functions applied to a DataArray with more dims than ``step`` return
one value per curve (a DataArray over the other dims), like
:mod:`stabstudy.analysis.events`.

Definitions follow Chan et al. 2020, "Measuring the reliability of reinforcement
learning algorithms" (ICLR):

* dispersion across time (DT): IQR of the differenced curve within a sliding
  window (mean over windows);
* short-term risk across time (SRT): CVaR of the one-step differences (lower tail);
* long-term risk across time (LRT): CVaR of the drawdown (upper tail);
* dispersion across runs (DR): IQR across runs at each evaluation point after a
  low-pass (moving-average) filter;
* risk across runs (RR): CVaR of the final performance across runs (lower tail).

Aggregates follow Agarwal et al. 2021 (rliable): interquartile mean (IQM) with
stratified percentile-bootstrap confidence intervals, computed with
``scipy.stats.bootstrap`` (each task's runs resampled independently, i.e. the
stratified bootstrap). rliable 1.2 draws its bootstrap from NumPy's global
generator and ignores its ``random_state``, so its intervals are not
reproducible without global side effects; its IQM definition is the one used.

The stability score and the critical dose are this study's definitions (see
their docstrings).

Clustered units (forks of one RL prefix share its training): :func:`cluster_bootstrap` resamples
clusters, :func:`design_effect` says how many observations one cluster is worth. Rates:
:func:`clopper_pearson`. Two samples of ranks with ties and censoring: :func:`rank_test_p`,
:func:`smallest_p`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from math import comb
from typing import Any

import numpy as np
import xarray as xr
from scipy import ndimage
from scipy import stats as sps

from stabstudy.analysis import events
from stabstudy.analysis.events import _multi, as_series, map_runs

__all__ = [
    "CriticalDose",
    "bootstrap_band",
    "clopper_pearson",
    "cluster_bootstrap",
    "collapse_probability",
    "critical_dose",
    "cvar",
    "design_effect",
    "dispersion_across_runs",
    "dispersion_across_time",
    "iqm",
    "iqm_ci",
    "long_term_risk",
    "rank_test_p",
    "risk_across_runs",
    "short_term_risk",
    "smallest_p",
    "stability_score",
]


# -- basic tail / central statistics ----------------------------------------------


def cvar(values: Any, alpha: float = 0.05, tail: str = "lower") -> float:
    """Conditional value at risk: mean of the worst ``alpha`` fraction of ``values``.

    ``values``: array-like of shape ``(n,)`` (non-finite entries dropped).
    ``tail="lower"``: worst = smallest (returns, differences); ``"upper"``: worst =
    largest (drawdowns, losses). At least one value is always included
    (``k = max(1, ceil(alpha * n))``). NaN for an empty input.
    """
    v = np.asarray(values, dtype=float).ravel()
    v = v[np.isfinite(v)]
    if v.size == 0:
        return math.nan
    if tail not in ("lower", "upper"):
        raise ValueError(f"tail must be 'lower' or 'upper', got {tail!r}")
    k = max(1, math.ceil(alpha * v.size))
    v = np.sort(v)
    return float(np.mean(v[:k] if tail == "lower" else v[-k:]))


def iqm(values: Any, axis: int | None = None) -> float | np.ndarray:
    """Interquartile mean: mean of the middle 50% (``scipy.stats.trim_mean(values, 0.25)``)."""
    v = np.asarray(values, dtype=float)
    if axis is None:
        v = v[np.isfinite(v)]
        return float(sps.trim_mean(v, 0.25)) if v.size else math.nan
    return sps.trim_mean(v, 0.25, axis=axis)


def iqm_ci(
    scores: Mapping[str, Any],
    reps: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> dict[str, tuple[float, float, float]]:
    """IQM with stratified percentile-bootstrap CIs per algorithm (Agarwal et al. 2021).

    Args:
        scores: ``{algorithm: array of shape (n_runs,) or (n_runs, n_tasks)}``. Runs
            are resampled independently within each task (stratified bootstrap).
        reps: bootstrap resamples (the cost knob).
        confidence: confidence level of the interval.
        seed: random state of the bootstrap.

    Returns:
        ``{algorithm: (iqm, ci_low, ci_high)}``; CI = (iqm, iqm) when no task has two
        finite runs (nothing to resample). NaN scores (failed runs) are left out; a task
        left with one run enters every resample with that run.
    """
    out = {}
    for name, arr in scores.items():
        a = np.asarray(arr, dtype=float)
        if a.ndim == 1:
            a = a[:, None]
        cols = [a[np.isfinite(a[:, j]), j] for j in range(a.shape[1])]
        cols = [c for c in cols if c.size]
        if not cols:
            out[name] = (math.nan, math.nan, math.nan)
            continue
        point = iqm(np.concatenate(cols))
        # a task with one finite run (the others failed) resamples to itself: it enters every
        # resample as a constant (scipy's bootstrap needs two observations per sample)
        fixed = np.concatenate([c for c in cols if c.size == 1] or [np.empty(0)])
        cols = [c for c in cols if c.size >= 2]
        if not cols:
            out[name] = (point, point, point)
            continue

        def stat(*samples, axis=-1, fixed=fixed):
            const = np.broadcast_to(fixed, samples[0].shape[:-1] + fixed.shape)
            return sps.trim_mean(np.concatenate([*samples, const], axis=-1), 0.25, axis=-1)

        res = sps.bootstrap(tuple(cols), stat, n_resamples=reps, confidence_level=confidence,
                            method="percentile", paired=False, vectorized=True,
                            random_state=np.random.default_rng(seed))
        out[name] = (point, float(res.confidence_interval.low), float(res.confidence_interval.high))
    return out


def bootstrap_band(x: xr.DataArray, run_dim: str = "run", statistic: str = "mean", reps: int = 1000,
                   confidence: float = 0.95, seed: int = 0) -> xr.Dataset:
    """Center and percentile-bootstrap band of curves across runs, at every point.

    ``x``: DataArray with dims ``(run_dim, ...)`` (e.g. ``(run, env_step)``), NaN
    where a run has no value. ``statistic``: ``"mean"`` or ``"iqm"``. Runs are
    resampled with replacement (``reps`` times, ``seed``) independently at each
    point among the runs with a value there. Returns a Dataset with ``center``,
    ``low``, ``high`` and ``n`` (runs with a value) over the other dims; the band
    collapses to the center where ``n < 2``.
    """
    if statistic not in ("mean", "iqm"):
        raise ValueError(f"statistic must be 'mean' or 'iqm', got {statistic!r}")
    others = [d for d in x.dims if d != run_dim]
    v = np.asarray(x.transpose(run_dim, *others).values, dtype=float)
    flat = v.reshape(v.shape[0], -1)
    rng = np.random.default_rng(seed)
    center = np.full(flat.shape[1], np.nan)
    low, high = center.copy(), center.copy()
    n = np.isfinite(flat).sum(0)
    fn = (lambda a, axis: np.mean(a, axis=axis)) if statistic == "mean" else (lambda a, axis: sps.trim_mean(a, 0.25, axis=axis))
    alpha = (1 - confidence) / 2
    for j in range(flat.shape[1]):
        col = flat[np.isfinite(flat[:, j]), j]
        if col.size == 0:
            continue
        center[j] = fn(col, axis=0)
        if col.size < 2:
            low[j] = high[j] = center[j]
            continue
        boot = fn(col[rng.integers(0, col.size, (reps, col.size))], axis=1)
        low[j], high[j] = np.quantile(boot, [alpha, 1 - alpha])
    shape = v.shape[1:]
    coords = {d: x[d].values for d in others if d in x.coords}
    return xr.Dataset({k: (others, a.reshape(shape)) for k, a in
                       (("center", center), ("low", low), ("high", high), ("n", n.astype(float)))}, coords=coords)


# -- Chan et al. 2020: across time (one curve) -----------------------------------


def dispersion_across_time(x: Any, window: int = 5, steps: Any = None, dim: str = "step") -> float | xr.DataArray:
    """DT: mean over sliding windows of the IQR of the differenced curve.

    ``x``: curve (see module docstring), shape ``(n_points,)``. ``window``: number of
    consecutive differences per window (windows slide by one point). Detrending
    by first differences removes the learning trend. Lower = steadier. NaN when
    fewer than ``window`` differences.
    """
    if _multi(x, dim):
        return map_runs(dispersion_across_time, x, dim, window=window)
    _, v = as_series(x, steps, dim)
    d = np.diff(v)
    if d.size < window or window < 2:
        return math.nan
    w = np.lib.stride_tricks.sliding_window_view(d, window)
    return float(np.mean(sps.iqr(w, axis=1)))


def short_term_risk(x: Any, alpha: float = 0.05, steps: Any = None, dim: str = "step") -> float | xr.DataArray:
    """SRT: CVaR (lower tail, ``alpha``) of the one-step differences of the curve.

    The expected size of the worst ``alpha`` fraction of changes between
    consecutive evaluations; negative = drops (higher = safer). NaN with < 2 points.
    """
    if _multi(x, dim):
        return map_runs(short_term_risk, x, dim, alpha=alpha)
    _, v = as_series(x, steps, dim)
    return cvar(np.diff(v), alpha, "lower") if v.size >= 2 else math.nan


def long_term_risk(x: Any, alpha: float = 0.05, steps: Any = None, dim: str = "step") -> float | xr.DataArray:
    """LRT: CVaR (upper tail, ``alpha``) of the drawdown ``D_t = max_{s<=t} x_s - x_t``.

    Expected size of the worst ``alpha`` fraction of drawdowns, >= 0 (lower = safer).
    The maximum drawdown itself is :func:`stabstudy.analysis.events.max_drawdown`.
    """
    if _multi(x, dim):
        return map_runs(long_term_risk, x, dim, alpha=alpha)
    _, v = as_series(x, steps, dim)
    if v.size == 0:
        return math.nan
    return cvar(np.maximum.accumulate(v) - v, alpha, "upper")


# -- Chan et al. 2020: across runs ------------------------------------------------


def dispersion_across_runs(x: xr.DataArray, smooth: int = 1, run_dim: str = "run", dim: str = "step") -> xr.DataArray:
    """DR: IQR across runs at each evaluation point, after a moving-average low-pass filter.

    ``x``: DataArray with dims ``(run_dim, dim)``; steps where no run has a finite
    value are dropped (evaluation points only). ``smooth``: moving-average width
    in evaluation points (1 = no filter), applied per run along ``dim``.
    Returns a DataArray over ``dim`` (lower = more consistent across runs).
    """
    x = x.transpose(run_dim, dim)
    x = x.isel({dim: np.flatnonzero(np.isfinite(x.values).any(axis=0))})
    v = np.asarray(x.values, dtype=float)
    if smooth > 1:
        filled = np.where(np.isfinite(v), v, 0.0)
        w = ndimage.uniform_filter1d(np.isfinite(v).astype(float), smooth, axis=1, mode="nearest")
        with np.errstate(invalid="ignore", divide="ignore"):
            v = ndimage.uniform_filter1d(filled, smooth, axis=1, mode="nearest") / w
        v[~np.isfinite(x.values)] = np.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        iqr = sps.iqr(v, axis=0, nan_policy="omit")
    return xr.DataArray(np.asarray(iqr, dtype=float), dims=[dim], coords={dim: x[dim].values}, name="dispersion_across_runs")


def risk_across_runs(final: Any, alpha: float = 0.05) -> float:
    """RR: CVaR (lower tail, ``alpha``) of the final performance across runs.

    ``final``: array-like of shape ``(n_runs,)`` (e.g. mean of each run's last
    evaluations). With fewer than ``1/alpha`` runs this is the worst run.
    """
    return cvar(final, alpha, "lower")


# -- stability score ----------------------------------------------------------------


def stability_score(
    x: Any,
    event_step: float | None = None,
    scale: float | None = None,
    steps: Any = None,
    *,
    tol: float = 0.1,
    baseline_points: int = 3,
    dim: str = "step",
) -> float | xr.DataArray:
    """A stability score in [0, 1] that does not reward the level of the return.

    ``S = 1 - 0.5 * min(1, MDD / scale) - 0.5 * R`` where

    * ``MDD`` is the maximum drawdown (:func:`stabstudy.analysis.events.max_drawdown`) of
      the pre-event baseline (mean of the last ``baseline_points`` values before
      ``event_step``) followed by the curve from ``event_step`` on; of the whole
      curve when ``event_step`` is None;
    * ``scale`` is a positive return scale shared by all runs being compared
      (e.g. the spread between the untrained and the best return over all runs of
      the task); default: this curve's own range ``max - min`` (then a flat curve
      scores 1 whatever its level);
    * ``R`` is the recovery penalty: ``recovery_time / (last_step - event_step)``
      clipped to [0, 1], 1 when never recovered, 0 when the curve never left the
      band (``tol`` as in :func:`stabstudy.analysis.events.recovery_state`); 0 when
      ``event_step`` is None.

    Only losses (drops and their duration) enter the score, never the level, so
    a run with a low but steady return scores as high as a high steady one:
    this is what lets the notebook test whether final return and stability are
    decoupled. 1 = never lost anything; 0 = lost the whole scale and never recovered.

    NaN (no score) with fewer than two finite points, and, given an event, when no
    finite point lies before it (no baseline) or none at or after it: a run with no
    data after the event has shown nothing, which must not read as a perfect 1.
    """
    if _multi(x, dim):
        return map_runs(stability_score, x, dim, event_step=event_step, scale=scale, tol=tol,
                        baseline_points=baseline_points)
    s, v = as_series(x, steps, dim)
    if v.size < 2:
        return math.nan
    if event_step is not None and not np.isfinite(event_step):
        event_step = None
    sc = float(scale) if scale is not None else float(np.max(v) - np.min(v))
    if event_step is None:
        mdd = events.max_drawdown(v, s)
    else:  # drawdown measured from the pre-event baseline on
        b = events.baseline(v, event_step, baseline_points, s)
        post = v[s >= event_step]
        if not np.isfinite(b) or post.size == 0:
            return math.nan
        mdd = events.max_drawdown(np.r_[b, post])
    d = 0.0 if sc <= 0 else min(1.0, mdd / sc)
    r = 0.0
    if event_step is not None:
        state, rt = events.recovery_state(v, event_step, s, tol=tol, abs_tol=tol * sc if sc > 0 else None,
                                          baseline_points=baseline_points)
        horizon = s[-1] - event_step
        if state == "not_recovered":
            r = 1.0
        elif state == "recovered" and horizon > 0:
            r = min(1.0, rt / horizon)
    return 1.0 - 0.5 * d - 0.5 * r


# -- dose response ------------------------------------------------------------------


def collapse_probability(collapsed: Any, confidence: float = 0.95) -> tuple[float, float, float]:
    """Fraction of collapsed runs with a Clopper-Pearson interval.

    ``collapsed``: array-like of shape ``(n_runs,)`` of 0/1 (NaN dropped).
    Returns ``(p, ci_low, ci_high)``; NaNs for no runs.
    """
    c = np.asarray(collapsed, dtype=float)
    c = c[np.isfinite(c)]
    if c.size == 0:
        return (math.nan, math.nan, math.nan)
    k, n = int(c.sum()), int(c.size)
    return (k / n, *clopper_pearson(k, n, confidence))


def clopper_pearson(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Clopper-Pearson (exact binomial) interval of the rate ``k / n``; (nan, nan) when ``n == 0``."""
    if n == 0:
        return math.nan, math.nan
    ci = sps.binomtest(int(k), int(n)).proportion_ci(confidence_level=confidence, method="exact")
    return float(ci.low), float(ci.high)


@dataclass(frozen=True)
class CriticalDose:
    """Result of :func:`critical_dose`."""

    dose: float
    """Smallest dose whose fitted collapse probability reaches ``level`` (NaN if never)."""
    method: str
    """``"logistic"`` or ``"interpolation"``."""
    message: str
    """Why the dose is NaN / how it was obtained."""
    grid: np.ndarray
    """Dose grid of shape ``(n_grid,)`` for plotting the fit."""
    prob: np.ndarray
    """Fitted collapse probability on ``grid``, shape ``(n_grid,)``."""


def critical_dose(doses: Sequence[float], collapsed: Sequence[float], level: float = 0.5, log_dose: bool = True,
                  n_grid: int = 200) -> CriticalDose:
    """Smallest dose at which the collapse probability reaches ``level`` (default 50%).

    ``doses``, ``collapsed``: arrays of shape ``(n_runs,)`` (one entry per run:
    its lr-spike factor and 0/1 collapse outcome; NaN outcomes dropped).
    A logistic regression of collapse on ``log(dose)`` (scikit-learn, weak L2
    penalty) gives ``p(dose)``; the critical dose solves ``p = level`` and is
    reported only inside the tested range ``[min dose, max dose]``. When all
    outcomes are equal (a logistic fit is impossible) linear interpolation of the
    per-dose collapse fractions is used. NaN with a message when the level is
    never reached within the tested doses; the smallest dose when it is reached
    already there (the message says it is an upper bound).
    """
    from sklearn.linear_model import LogisticRegression

    d = np.asarray(doses, dtype=float)
    c = np.asarray(collapsed, dtype=float)
    ok = np.isfinite(d) & np.isfinite(c) & (d > 0 if log_dose else True)
    d, c = d[ok], c[ok]
    if d.size == 0:
        return CriticalDose(math.nan, "none", "no runs with a finite dose and outcome", np.array([]), np.array([]))
    f = np.log if log_dose else (lambda z: z)
    lo, hi = d.min(), d.max()
    grid = np.geomspace(lo, hi, n_grid) if log_dose and lo > 0 else np.linspace(lo, hi, n_grid)
    if np.unique(c).size == 2:
        model = LogisticRegression(C=1e4).fit(f(d)[:, None], c.astype(int))
        prob = model.predict_proba(f(grid)[:, None])[:, 1]
        method = "logistic"
    else:
        ud = np.unique(d)
        frac = np.array([c[d == u].mean() for u in ud])
        prob = np.interp(f(grid), f(ud), frac)
        method = "interpolation"
    reached = np.flatnonzero(prob >= level)
    if reached.size == 0:
        return CriticalDose(math.nan, method,
                            f"collapse probability never reaches {level:.0%} for doses in [{lo:g}, {hi:g}] "
                            f"(max fitted {prob.max():.2f})", grid, prob)
    i = reached[0]
    if i == 0:
        return CriticalDose(float(grid[0]), method,
                            f"collapse probability already >= {level:.0%} at the smallest dose {lo:g} "
                            "(the critical dose is at most this)", grid, prob)
    # refine between grid[i-1] and grid[i]
    x0, x1, p0, p1 = f(grid[i - 1]), f(grid[i]), prob[i - 1], prob[i]
    xc = x0 + (level - p0) * (x1 - x0) / (p1 - p0) if p1 != p0 else x1
    dose = float(np.exp(xc) if log_dose else xc)
    return CriticalDose(dose, method, f"{method} fit: p(collapse) = {level:.0%} at dose {dose:.3g}", grid, prob)


# -- clustered units ------------------------------------------------------------------


def cluster_bootstrap(values: Sequence[float], clusters: Sequence[Any],
                      statistic: Callable[[np.ndarray], float] = np.mean, *, reps: int = 2000,
                      confidence: float = 0.95, seed: int = 0) -> tuple[float, float, float]:
    """``(estimate, low, high)`` of ``statistic`` over observations, with a percentile interval from a
    bootstrap that resamples *clusters* (each drawn cluster brings all its observations): observations
    of one cluster (the forks of one RL prefix) share it, so resampling them one by one would treat
    them as independent. Non-finite values are left out; NaNs without any."""
    v, p = np.asarray(values, dtype=float), np.asarray(clusters, dtype=object)
    ok = np.isfinite(v)
    v, p = v[ok], p[ok]
    if not v.size:
        return math.nan, math.nan, math.nan
    groups = [v[p == u] for u in dict.fromkeys(p.tolist())]
    rng = np.random.default_rng(seed)
    draws = [statistic(np.concatenate([groups[i] for i in rng.integers(0, len(groups), len(groups))]))
             for _ in range(int(reps))]
    q = (1 - confidence) / 2
    lo, hi = np.quantile(draws, [q, 1 - q])
    return float(statistic(v)), float(lo), float(hi)


def design_effect(values: Sequence[float], clusters: Sequence[Any]) -> tuple[float, float]:
    """``(icc, deff)``: the intraclass correlation of ``values`` within clusters (one-way ANOVA
    estimator, at least 0) and the design effect ``1 + (m - 1) icc`` (``m``: mean observations per
    cluster): how many observations are worth one independent cluster. NaNs with fewer than two
    clusters or no cluster of two."""
    v, p = np.asarray(values, dtype=float), np.asarray(clusters, dtype=object)
    ok = np.isfinite(v)
    v, p = v[ok], p[ok]
    groups = [v[p == u] for u in dict.fromkeys(p.tolist())]
    k, n = len(groups), v.size
    if k < 2 or n <= k:
        return math.nan, math.nan
    m0 = (n - sum(g.size**2 for g in groups) / n) / (k - 1)
    msb = sum(g.size * (g.mean() - v.mean()) ** 2 for g in groups) / (k - 1)
    msw = sum(((g - g.mean()) ** 2).sum() for g in groups) / (n - k)
    icc = max(0.0, (msb - msw) / (msb + (m0 - 1) * msw)) if msb + (m0 - 1) * msw > 0 else 0.0
    return float(icc), float(1 + (n / k - 1) * icc)


# -- a two-sample rank test for few, tied, censored values ---------------------------------

#: The most arrangements of a two-sample rank test computed exactly (``scipy.stats.PermutationMethod``
#: enumerates them all, ties included); beyond, 9,999 random ones (8 vs 8 units: 12,870, exact).
EXACT_ARRANGEMENTS = 20_000


def rank_test_p(a: Sequence[float], b: Sequence[float], alternative: str, *, seed: int = 0) -> float:
    """One-sided Mann-Whitney U p-value of ``a`` against ``b`` (``alternative`` "less": ``a`` lower),
    by the permutation distribution of U given the ties (exact up to :data:`EXACT_ARRANGEMENTS`
    arrangements, else 9,999 random ones seeded with ``seed``): the normal approximation is not
    trustworthy for few units and many ties (``inf`` for a right-censored value ranks above every
    finite one, all ``inf`` tied)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    n = np.inf if comb(a.size + b.size, a.size) <= EXACT_ARRANGEMENTS else 9999
    method = sps.PermutationMethod(n_resamples=n, rng=np.random.default_rng(seed))
    return float(sps.mannwhitneyu(a, b, alternative=alternative, method=method).pvalue)


def smallest_p(n1: int, n2: int) -> float:
    """The smallest one-sided p-value a rank test of ``n1`` against ``n2`` values can give (the two
    samples completely separated, no ties): ``1 / C(n1 + n2, n1)``."""
    return 1.0 / comb(int(n1) + int(n2), int(n1)) if n1 and n2 else 1.0
