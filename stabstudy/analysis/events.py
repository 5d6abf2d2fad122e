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
* A verdict needs data: a run without a baseline, without points after the
  event, or without enough points after a drop to tell a dip from a collapse
  gets NaN (not tested), never a verdict either way. A run that was already
  broken before the event (diverged, non-finite, or collapsed) is
  ``pre_event_invalid``: it says nothing about the event.

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
    "COLLAPSE_STATES",
    "RECOVERY_STATES",
    "CollapseResult",
    "as_series",
    "baseline",
    "collapse",
    "is_collapsed",
    "max_drawdown",
    "map_runs",
    "recovery_state",
    "recovery_time",
]

#: Outcomes of :func:`collapse`; only ``collapsed`` and ``diverged`` count as a collapse,
#: only ``no_drop`` and ``recovered`` as none, the others are no verdict (NaN).
COLLAPSE_STATES = ("collapsed", "diverged", "no_drop", "recovered", "unobserved", "pre_event_invalid", "no_data")
#: Outcomes of :func:`recovery_state`.
RECOVERY_STATES = ("never_left", "recovered", "not_recovered", "undefined")


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


def recovery_state(
    x: Any,
    event_step: float,
    steps: Any = None,
    *,
    tol: float = 0.1,
    abs_tol: float | None = None,
    baseline_points: int = 3,
    higher_is_better: bool = True,
    dim: str = "step",
) -> tuple[str, float]:
    """``(state, time)`` of the curve's return to its pre-event band (see :func:`recovery_time`).

    ``state`` is one of :data:`RECOVERY_STATES`: ``never_left`` (no point after the
    event outside the band: nothing to recover from, time NaN), ``recovered`` (left,
    then back: time = first step back in the band - ``event_step``),
    ``not_recovered`` (left and never back within the data: time inf) or
    ``undefined`` (no finite point before ``event_step`` or none at or after it:
    time NaN).
    """
    s, v = as_series(x, steps, dim)
    event_step = _scalar(event_step)
    b = baseline(x, event_step, baseline_points, steps, dim)
    post = s >= event_step
    if math.isnan(b) or not post.any():
        return "undefined", math.nan
    width = abs_tol if abs_tol is not None else tol * abs(b)
    post_s, post_v = s[post], v[post]
    inside = post_v >= b - width if higher_is_better else post_v <= b + width
    out = np.flatnonzero(~inside)
    if out.size == 0:
        return "never_left", math.nan
    back = np.flatnonzero(inside[out[0]:])
    if back.size == 0:
        return "not_recovered", math.inf
    return "recovered", float(post_s[out[0] + back[0]] - event_step)


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
        ``inf`` when it leaves and never comes back (within the data);
        ``NaN`` when the curve never leaves the band after the event (a run that
        was never hit has not "recovered": :func:`recovery_state` says
        ``never_left``) and when undefined (no finite point before ``event_step``
        or none after it).

    Example: loss 1.0 before a spike at step 100, 3.0 at steps 100-109, 1.05 from
    step 110 -> ``recovery_time(loss, 100, higher_is_better=False) == 10``.
    """
    if _multi(x, dim):
        return map_runs(recovery_time, x, dim, event_step=event_step, tol=tol, abs_tol=abs_tol,
                        baseline_points=baseline_points, higher_is_better=higher_is_better)
    return recovery_state(x, event_step, steps, tol=tol, abs_tol=abs_tol, baseline_points=baseline_points,
                          higher_is_better=higher_is_better, dim=dim)[1]


# -- collapse ----------------------------------------------------------------------


@dataclass(frozen=True)
class CollapseResult:
    """Outcome of :func:`collapse` (all numbers in the curve's units / steps)."""

    collapsed: bool
    """True: ``state`` is ``collapsed`` or ``diverged``."""
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
    state: str = "no_data"
    """One of :data:`COLLAPSE_STATES`."""

    @property
    def outcome(self) -> float:
        """1.0 collapsed, 0.0 not collapsed, NaN no verdict (unobserved, pre-event invalid, no data)."""
        if self.state in ("collapsed", "diverged"):
            return 1.0
        if self.state in ("no_drop", "recovered"):
            return 0.0
        return math.nan

    @property
    def pre_event_invalid(self) -> bool:
        """The run was already broken before the event (diverged, non-finite or collapsed)."""
        return self.state == "pre_event_invalid"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: float(v) for k, v in asdict(self).items() if k != "state"}
        out["state"] = self.state
        return out


def _raw_values(x: Any, steps: Any, dim: str) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, values)`` with non-finite values kept (``as_series`` drops them)."""
    if isinstance(x, xr.DataArray):
        s = np.asarray(x[x.dims[0]].values if x.dims[0] in x.coords else np.arange(x.size), dtype=float)
        return s, np.asarray(x.values, dtype=float)
    v = np.asarray(x, dtype=float)
    return (np.arange(v.size) if steps is None else np.asarray(steps, dtype=float)), v


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
    min_after: int = 1,
    diverged_at: float | None = None,
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
    below ``frac`` and does not climb back to ``recover_frac`` or more within
    ``window`` steps after ``t`` (``window=None``: until the end of the run), *and*
    that was observed: at least ``min_after`` points after ``t`` within the window,
    and data reaching ``t + window`` when a window is given. A drop that is not
    observed that long is ``unobserved`` (no verdict): data ending right after a
    dip cannot tell a dip from a collapse.

    States (:data:`COLLAPSE_STATES`, :attr:`CollapseResult.outcome`):

    * ``pre_event_invalid`` (NaN): the run was broken before the event: it diverged
      before it (``diverged_at < event_step``), has a non-finite value (inf) before
      it, or had already collapsed (its baseline and its last pre-event value both
      below ``frac`` of its best pre-event gain over the floor, that gain at least
      ``min_gain``);
    * ``no_data`` (NaN): no baseline or no finite point at or after the event;
    * ``diverged`` (1): training diverged at or after the event (``diverged_at``);
    * ``collapsed`` (1), ``unobserved`` (NaN), ``recovered`` (0: dropped, then back
      within the window), ``no_drop`` (0: never below ``frac``).

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
        min_after: points after a drop needed to call it irreversible (at least 1).
        diverged_at: step at which training stopped as diverged (None: it did not).
    """
    if min_after < 1:
        raise ValueError(f"min_after must be at least 1, got {min_after}")
    s, v = as_series(x, steps, dim)
    event_step = _scalar(event_step)
    b = baseline(x, event_step, baseline_points, steps, dim)
    f = (float(v[0]) if v.size else math.nan) if floor is None else float(floor)
    rs, rv = _raw_values(x, steps, dim)
    pre = s < event_step
    if ((diverged_at is not None and np.isfinite(diverged_at) and diverged_at < event_step)
            or np.isinf(rv[rs < event_step]).any()):
        return CollapseResult(False, math.nan, b, f, math.nan, math.nan, "pre_event_invalid")
    if math.isnan(b) or v.size == 0:
        return CollapseResult(False, math.nan, b, f, math.nan, math.nan, "no_data")
    # already collapsed: both the baseline and the last pre-event point lost half the best gain (the
    # baseline alone would flag a run still climbing, whose baseline averages in its lower past)
    best, recent = float(np.max(v[pre])), max(b, float(v[pre][-1]))
    if best - f >= min_gain and recent - f < frac * (best - f):
        return CollapseResult(False, math.nan, b, f, math.nan, math.nan, "pre_event_invalid")
    gain = max(b - f, min_gain)
    level = (v - b) / gain + 1.0
    ps, pl = s[~pre], level[~pre]
    if diverged_at is not None and np.isfinite(diverged_at):
        low = float(np.min(pl)) if pl.size else math.nan
        return CollapseResult(True, float(diverged_at), b, f, low, float(level[-1]), "diverged")
    if ps.size == 0:
        return CollapseResult(False, math.nan, b, f, math.nan, float(level[-1]), "no_data")
    state, drop_step = "no_drop", math.nan
    for i in np.flatnonzero(pl < frac):
        if math.isnan(drop_step):
            drop_step = float(ps[i])
        horizon = ps[i] + window if window is not None else math.inf
        later = (ps > ps[i]) & (ps <= horizon)
        if np.any(pl[later] >= recover_frac):
            state = "recovered"
            continue
        seen = int(later.sum()) >= min_after and (window is None or ps[-1] >= horizon)
        state, drop_step = ("collapsed" if seen else "unobserved"), float(ps[i])
        break
    return CollapseResult(state == "collapsed", drop_step, b, f, float(np.min(pl)), float(level[-1]), state)


def is_collapsed(x: Any, event_step: Any, dim: str = "step", **kw) -> bool | xr.DataArray:
    """``collapse(...).collapsed``; for a multi-curve DataArray a 0/1/NaN DataArray over the other dims.

    ``event_step`` may be a DataArray over the other dims (e.g. ``ds.pert_start``);
    curves whose event step is NaN (no perturbation) get NaN, and so do curves
    without a verdict (:attr:`CollapseResult.outcome`).
    """
    if _multi(x, dim):
        def one(c, event_step, **k):
            if event_step is None or not np.isfinite(event_step):
                return math.nan
            return collapse(c, event_step, **k).outcome
        return map_runs(one, x, dim, event_step=event_step, **kw)
    return collapse(x, event_step, dim=dim, **kw).collapsed
