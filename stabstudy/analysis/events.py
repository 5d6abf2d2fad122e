"""Ground-truth events on performance / loss curves: collapse, recovery, drawdown.

Every function takes one curve either as an :class:`xarray.DataArray` with a
dimension ``step`` (NaN where the quantity was not measured: NaNs are dropped,
the ``step`` coordinate gives the time axis) or as a 1-D numpy array of shape
``(n_steps,)`` (time axis = ``steps`` argument, default ``arange(n_steps)``).

A DataArray with more dimensions than ``step`` (e.g. ``(run, step)`` from
:func:`stabstudy.run.store.load_runs`) is handled run by run and the result is a
DataArray over the remaining dimensions. ``event_step`` may then be a scalar
or a DataArray over those dimensions (e.g. ``ds.pert_start``).

Conventions (documented once, used everywhere):

* ``higher_is_better=True`` (default) for returns and ``perf``; pass ``False``
  for losses.
* Baseline = mean of the last ``baseline_points`` finite values strictly before
  ``event_step``.
* Times are in the units of the ``step`` axis and are measured from
  ``event_step``.

References: Chan et al. 2020 (drawdown, "Measuring the reliability of RL
algorithms"); collapse and recovery definitions are this study's, stated in the
docstrings below.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import xarray as xr

__all__ = [
    "CollapseResult",
    "as_series",
    "baseline",
    "collapse",
    "is_collapsed",
    "max_drawdown",
    "map_runs",
    "recovery_time",
]


# -- plumbing ----------------------------------------------------------------------


def as_series(x: Any, steps: Any = None, dim: str = "step") -> tuple[np.ndarray, np.ndarray]:
    """Return ``(steps, values)`` of a 1-D curve with non-finite values dropped.

    ``x``: DataArray with the single dimension ``dim``, or array-like of shape
    ``(n,)``; ``steps``: time axis of shape ``(n,)`` for numpy input.
    Every non-finite value (NaN, inf) counts as "not measured".
    """
    if isinstance(x, xr.DataArray):
        if x.ndim != 1:
            raise ValueError(f"expected a 1-D curve along {dim!r}, got dims {x.dims}; use map_runs")
        s = np.asarray(x[x.dims[0]].values if x.dims[0] in x.coords else np.arange(x.size))
        v = np.asarray(x.values, dtype=float)
    else:
        v = np.asarray(x, dtype=float)
        if v.ndim != 1:
            raise ValueError(f"expected a 1-D array of shape (n_steps,), got shape {v.shape}")
        s = np.arange(v.size) if steps is None else np.asarray(steps)
        if s.shape != v.shape:
            raise ValueError(f"steps shape {s.shape} != values shape {v.shape}")
    ok = np.isfinite(v)
    return s[ok].astype(float), v[ok]


def map_runs(func, x: xr.DataArray, dim: str = "step", event_step: Any = None, **kw) -> xr.DataArray:
    """Apply a 1-D curve function to every curve of ``x`` along ``dim``.

    ``x``: DataArray with ``dim`` and any other dimensions. ``event_step``: None,
    a scalar, or a DataArray broadcastable to the other dimensions. ``func`` is
    called as ``func(curve, **kw)`` (plus ``event_step=`` when given) and must
    return a number. Returns a float DataArray over the other dimensions.
    """
    others = [d for d in x.dims if d != dim]
    if not others:
        val = func(x, **kw) if event_step is None else func(x, event_step=_scalar(event_step), **kw)
        return xr.DataArray(float(val))
    x = x.transpose(*others, dim)
    template = x.isel({dim: 0}, drop=True)
    ev = event_step.broadcast_like(template).transpose(*others) if isinstance(event_step, xr.DataArray) else None
    out = np.full(template.shape, np.nan)
    for idx in np.ndindex(template.shape):
        curve = x.isel(dict(zip(others, idx, strict=True)))
        if event_step is None:
            out[idx] = func(curve, **kw)
        else:
            e = ev.values[idx] if ev is not None else event_step
            out[idx] = func(curve, event_step=e, **kw)
    return template.copy(data=out).rename(None)


def _scalar(v: Any) -> float:
    return float(v.item()) if hasattr(v, "item") else float(v)


def _multi(x: Any, dim: str) -> bool:
    return isinstance(x, xr.DataArray) and x.ndim > 1


def baseline(x: Any, event_step: float, baseline_points: int = 3, steps: Any = None, dim: str = "step") -> float:
    """Mean of the last ``baseline_points`` finite values strictly before ``event_step`` (NaN if none)."""
    s, v = as_series(x, steps, dim)
    pre = v[s < event_step]
    if pre.size == 0:
        return math.nan
    return float(np.mean(pre[-baseline_points:]))


# -- drawdown ----------------------------------------------------------------------


def max_drawdown(
    x: Any,
    steps: Any = None,
    *,
    start: float | None = None,
    higher_is_better: bool = True,
    relative_to: float | None = None,
    dim: str = "step",
) -> float | xr.DataArray:
    """Maximum drawdown MDD = max_t (max_{s<=t} x_s - x_t) (Chan et al. 2020).

    Args:
        x: curve, DataArray with dim ``step`` (any other dims: one value per curve)
            or array of shape ``(n_steps,)``.
        steps: time axis for numpy input.
        start: only consider points with step >= ``start`` (e.g. the perturbation
            step; the running maximum then starts there too). None: whole curve.
        higher_is_better: False for losses (the curve is negated: a drawdown is a
            rise of the loss).
        relative_to: divide the result by this positive scale (e.g. the learned
            return range) to make it unit-free.

    Returns:
        MDD >= 0 in the curve's units (0 for a non-decreasing curve); NaN when
        fewer than one finite point.
    """
    if _multi(x, dim):
        return map_runs(max_drawdown, x, dim, start=start, higher_is_better=higher_is_better,
                        relative_to=relative_to)
    s, v = as_series(x, steps, dim)
    if start is not None:
        v = v[s >= start]
    if v.size == 0:
        return math.nan
    if not higher_is_better:
        v = -v
    mdd = float(np.max(np.maximum.accumulate(v) - v))
    if relative_to is not None:
        mdd = mdd / relative_to if relative_to > 0 else math.nan
    return mdd


# -- recovery ----------------------------------------------------------------------


def recovery_time(
    x: Any,
    event_step: float,
    steps: Any = None,
    *,
    tol: float = 0.1,
    abs_tol: float | None = None,
    baseline_points: int = 3,
    higher_is_better: bool = True,
    dim: str = "step",
) -> float | xr.DataArray:
    """Steps from ``event_step`` until the curve is back within tolerance of its pre-event baseline.

    The tolerance band is ``baseline - tol * |baseline|`` (``higher_is_better``) or
    ``baseline + tol * |baseline|`` (losses); ``abs_tol`` replaces ``tol * |baseline|``
    by an absolute width. The curve must first *leave* the band at or after
    ``event_step``; the recovery time is then ``first step back in the band -
    event_step``.

    Returns:
        ``0.0`` when the curve never leaves the band after the event;
        ``inf`` when it leaves and never comes back (within the data);
        ``NaN`` when undefined (no finite point before ``event_step``).

    Example: loss 1.0 before a spike at step 100, 3.0 at steps 100-109, 1.05 from
    step 110 -> ``recovery_time(loss, 100, higher_is_better=False) == 10``.
    """
    if _multi(x, dim):
        return map_runs(recovery_time, x, dim, event_step=event_step, tol=tol, abs_tol=abs_tol,
                        baseline_points=baseline_points, higher_is_better=higher_is_better)
    s, v = as_series(x, steps, dim)
    event_step = _scalar(event_step)
    b = baseline(x, event_step, baseline_points, steps, dim)
    if math.isnan(b):
        return math.nan
    width = abs_tol if abs_tol is not None else tol * abs(b)
    post_s, post_v = s[s >= event_step], v[s >= event_step]
    inside = post_v >= b - width if higher_is_better else post_v <= b + width
    out = np.flatnonzero(~inside)
    if out.size == 0:
        return 0.0
    back = np.flatnonzero(inside[out[0]:])
    if back.size == 0:
        return math.inf
    return float(post_s[out[0] + back[0]] - event_step)


# -- collapse ----------------------------------------------------------------------


@dataclass(frozen=True)
class CollapseResult:
    """Outcome of :func:`collapse` (all numbers in the curve's units / steps)."""

    collapsed: bool
    """True: dropped below ``frac`` of the pre-event level and did not recover within ``window``."""
    drop_step: float
    """First step >= event with level < frac (NaN if never)."""
    baseline: float
    """Pre-event baseline (mean of the last ``baseline_points`` values before the event)."""
    floor: float
    """Reference floor the level is measured from (untrained performance by default)."""
    min_level: float
    """Lowest post-event level, ``1 + (x - baseline) / max(baseline - floor, min_gain)`` (1 = baseline, 0 = floor)."""
    final_level: float
    """Level of the last finite point."""

    def to_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items()}


def collapse(
    x: Any,
    event_step: float,
    steps: Any = None,
    *,
    frac: float = 0.5,
    recover_frac: float = 0.8,
    window: float | None = None,
    floor: float | None = None,
    baseline_points: int = 3,
    min_gain: float = 1e-8,
    dim: str = "step",
) -> CollapseResult:
    """Did performance collapse irreversibly after ``event_step``?

    The *level* of the curve is measured between a floor and the pre-event
    baseline: ``level(t) = (x_t - floor) / (baseline - floor)`` (denominator at
    least ``min_gain``), so level 1 is the
    pre-perturbation performance and 0 the untrained performance. This works for
    negative returns (Pendulum, early HalfCheetah) where "a fraction of the
    return" is meaningless.

    A collapse is declared when, at some step ``t >= event_step``, the level falls
    below ``frac`` and it does not climb back to ``recover_frac`` or more within
    ``window`` steps after ``t`` (``window=None``: until the end of the run; data
    ending before ``t + window`` counts as not recovered).

    Args:
        x: higher-is-better curve (evaluation return / ``perf``), DataArray with
            dim ``step`` or array of shape ``(n_steps,)`` (negate losses).
        event_step: perturbation start step.
        frac: drop threshold on the level (default 0.5: lost half of what was learned).
        recover_frac: level that counts as recovered (default 0.8).
        window: recovery window in steps (None = rest of the run).
        floor: reference floor; default the first finite value of the curve
            (the untrained policy's return).
        baseline_points: points before the event averaged into the baseline.
        min_gain: the denominator ``baseline - floor`` is clipped below at
            ``min_gain`` (in the curve's units), so a run that learned (almost)
            nothing before the event must still drop by ``(1 - frac) * min_gain`` to
            count as collapsed; pass e.g. 10% of the task's return scale.
    """
    s, v = as_series(x, steps, dim)
    event_step = _scalar(event_step)
    b = baseline(x, event_step, baseline_points, steps, dim)
    if math.isnan(b) or v.size == 0:
        return CollapseResult(False, math.nan, b, math.nan, math.nan, math.nan)
    f = float(v[0]) if floor is None else float(floor)
    gain = max(b - f, min_gain)
    level = (v - b) / gain + 1.0
    post = s >= event_step
    ps, pl = s[post], level[post]
    if ps.size == 0:
        return CollapseResult(False, math.nan, b, f, math.nan, float(level[-1]))
    collapsed, drop_step = False, math.nan
    for i in np.flatnonzero(pl < frac):
        if math.isnan(drop_step):
            drop_step = float(ps[i])
        horizon = ps[i] + window if window is not None else math.inf
        later = (ps > ps[i]) & (ps <= horizon)
        if not np.any(pl[later] >= recover_frac):
            collapsed, drop_step = True, float(ps[i])
            break
    return CollapseResult(collapsed, drop_step, b, f, float(np.min(pl)), float(level[-1]))


def is_collapsed(x: Any, event_step: Any, dim: str = "step", **kw) -> bool | xr.DataArray:
    """``collapse(...).collapsed``; for a multi-curve DataArray a 0/1 DataArray over the other dims.

    ``event_step`` may be a DataArray over the other dims (e.g. ``ds.pert_start``);
    curves whose event step is NaN (no perturbation) get NaN.
    """
    if _multi(x, dim):
        def one(c, event_step, **k):
            if event_step is None or not np.isfinite(event_step):
                return math.nan
            return float(collapse(c, event_step, **k).collapsed)
        return map_runs(one, x, dim, event_step=event_step, **kw)
    return collapse(x, event_step, dim=dim, **kw).collapsed
