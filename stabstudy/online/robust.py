"""The trailing median/MAD robust z-score: one streaming implementation and its batch twin.

``z_t = (x_t - median) / max(1.4826 MAD, floor)`` over the ``window`` values before ``t`` (causal:
``x_t`` is not in its own window), clipped to ``+-clip``; NaN for a missing (non-finite) ``x_t`` and
until ``min_periods`` past values are finite. ``window_of`` says what the window counts:

* ``"values"``: the last ``window`` finite values (a missing value is skipped, it ages nothing);
  what the univariate detector and the controller use;
* ``"steps"``: the last ``window`` steps, a missing value taking its slot as a gap; what the
  meta-state's scaler uses, so that every channel's window spans the same steps.

:class:`RobustZ` keeps its window sorted (``bisect``) and selects the MAD from it without sorting
(:func:`_mad`): a step costs a few microseconds, not the hundred of two numpy medians, so a
controller can run it on every optimizer step.
:func:`rolling_robust_z` computes the same scores for a whole series with vectorised windows, and
:func:`rolling_median_mad` is the one batch median/MAD that the meta-state replay and the
performance labels share. The tests hold the stream and the batch equal bit for bit: the median
of an even count is ``(a + b) / 2`` in both, as numpy computes it.

1.4826 is the normal-consistency factor to four digits. ``scipy.stats.median_abs_deviation(...,
scale="normal")`` uses ``1 / Phi^-1(3/4) = 1.482602...``: it would move every stored score by
1.5e-6 relative, so the constant stays (:data:`MAD_SCALE`). numpy only.
"""

from __future__ import annotations

import bisect
import math
from collections import deque

import numpy as np

from stabstudy.online.base import NAN, Detector, check_side, sided

#: MAD -> standard deviation of a normal distribution (to four digits, as every stored score used).
MAD_SCALE = 1.4826
#: What a window counts (module docstring).
WINDOW_OF = ("values", "steps")


def _check_window_of(window_of: str) -> str:
    if window_of not in WINDOW_OF:
        raise ValueError(f"unknown window_of {window_of!r}; valid: {', '.join(WINDOW_OF)}")
    return window_of


def _check_sizes(window: int, min_periods: int) -> None:
    if window < 1 or min_periods < 1:
        raise ValueError(f"window and min_periods must be >= 1, got window={window}, min_periods={min_periods}")


def _median(s: list[float]) -> float:
    """Median of a sorted, non-empty list (numpy's: the mean of the two middle values of an even count)."""
    n = len(s)
    h = n // 2
    return s[h] if n % 2 else (s[h - 1] + s[h]) / 2


def _mad(s: list[float], med: float) -> float:
    """Median of ``|v - med|`` over the sorted, non-empty list ``s`` (:func:`_median` of the sorted
    deviations, bit for bit), by selection: the deviations of the values below ``med`` and of those
    at or above it are two ascending runs (``med - v`` is exactly ``|v - med|``), so each middle
    order statistic is a binary search over how many come from the first run, not a sort."""
    n, p = len(s), bisect.bisect_left(s, med)

    def kth(k: int) -> float:  # the k-th smallest deviation (0-based)
        lo, hi = max(0, k + 1 - (n - p)), min(k + 1, p)
        while lo < hi:  # the fewest i taken from below such that below[i] >= above[k - i]
            i = (lo + hi) // 2
            if med - s[p - 1 - i] < s[p + k - i] - med:
                lo = i + 1
            else:
                hi = i
        below = med - s[p - lo] if lo > 0 else -math.inf
        above = s[p + k - lo] - med if k + 1 - lo > 0 else -math.inf
        return max(below, above)

    h = n // 2
    return kth(h) if n % 2 else (kth(h - 1) + kth(h)) / 2


class RobustZ(Detector):
    """The streaming robust z (module docstring), EWMA-smoothed with factor ``ewma`` (1 = none),
    then one- or two-sided (``side``: ``up``, ``down``, ``both``).

    ``clip`` is off by default: a clipped score saturates, and a calibrated threshold can land on
    the clip. State: the window in arrival order and the same values sorted, and the EWMA.
    :meth:`z` is the unsmoothed, unsided score (the input of the drift detectors).
    """

    def __init__(self, name: str = "robust_z", window: int = 64, min_periods: int = 16, side: str = "both",
                 ewma: float = 1.0, clip: float = math.inf, floor: float = 1e-3, threshold: float = 5.0,
                 window_of: str = "values"):
        _check_sizes(window, min_periods)
        self.name, self.window, self.min_periods, self.side = name, window, min_periods, check_side(side)
        self.ewma, self.clip, self.floor, self.threshold = ewma, clip, floor, threshold
        self.window_of = _check_window_of(window_of)
        self._order: deque[float] = deque()  # the window, oldest first (NaN: a gap when window_of="steps")
        self._sorted: list[float] = []  # its finite values, ascending
        self._s: float | None = None

    def z(self, value: float) -> float:
        """The unsmoothed, unsided robust z of ``value``; then ``value`` joins the window."""
        x = float(value)
        finite = math.isfinite(x)
        s = self._sorted
        z = NAN
        if finite and len(s) >= self.min_periods:
            med = _median(s)
            mad = _mad(s, med)
            z = min(max((x - med) / max(MAD_SCALE * mad, self.floor), -self.clip), self.clip)
        if finite or self.window_of == "steps":
            if len(self._order) == self.window:
                old = self._order.popleft()
                if math.isfinite(old):
                    s.pop(bisect.bisect_left(s, old))
            self._order.append(x if finite else NAN)
            if finite:
                bisect.insort(s, x)
        return z

    def update(self, value: float) -> float:
        z = self.z(value)
        if math.isnan(z):
            return NAN
        # ewma 1 is no smoothing: 0 * a past infinite z would make every later score NaN
        self._s = z if self._s is None or self.ewma == 1 else self.ewma * z + (1 - self.ewma) * self._s
        return sided(self._s, self.side)

    def fresh(self) -> bool:
        """Whether no value has reached the window yet (the array forms start from there)."""
        return not self._order and self._s is None

    def zs(self, values: np.ndarray) -> np.ndarray:
        """What a fresh copy's :meth:`z` returns fed ``values`` one by one (:func:`rolling_robust_z`)."""
        if not self.fresh():
            raise ValueError("zs replays a fresh detector; this one has seen values")
        return rolling_robust_z(values, self.window, self.min_periods, self.clip, self.floor, self.window_of)

    def replay(self, values: np.ndarray) -> np.ndarray:
        if not self.fresh():
            return super().replay(values)
        z = self.zs(values)
        if self.ewma == 1:
            return sided(z, self.side)
        out, s = np.full(z.shape, NAN), None
        for t in np.flatnonzero(~np.isnan(z)):  # the EWMA as update runs it, value by value
            zt = float(z[t])
            s = zt if s is None else self.ewma * zt + (1 - self.ewma) * s
            out[t] = sided(s, self.side)
        return out


class RobustScaler:
    """Causal robust standardisation of rows of ``n_features``, one :class:`RobustZ` per feature with
    ``window_of="steps"`` (each feature's window spans the same steps), clipped to ``+-clip``."""

    def __init__(self, n_features: int, window: int = 64, min_periods: int = 16, clip: float = 10.0,
                 floor: float = 1e-3):
        self.window, self.min_periods, self.clip, self.floor = window, min_periods, clip, floor
        self._z = [RobustZ(window=window, min_periods=min_periods, clip=clip, floor=floor, window_of="steps")
                   for _ in range(n_features)]

    def update(self, x: np.ndarray) -> np.ndarray:
        """The z-scores of row ``x`` (shape (feature,)) against the past window; then ``x`` joins it."""
        x = np.asarray(x, dtype=float)
        if x.shape != (len(self._z),):
            raise ValueError(f"a row of {len(self._z)} features was expected, got shape {x.shape}")
        return np.array([d.z(v) for d, v in zip(self._z, x.tolist(), strict=True)])


# -- batch ------------------------------------------------------------------------------------
def trailing_windows(x: np.ndarray, window: int) -> np.ndarray:
    """Row ``t`` holds ``x[t - window:t]`` (NaN-padded before the start; non-finite values as NaN):
    shape (step, ..., window) for ``x`` of shape (step, ...). A read-only view of a padded copy."""
    x = np.asarray(x, dtype=float)
    padded = np.concatenate([np.full((window, *x.shape[1:]), np.nan), np.where(np.isfinite(x), x, np.nan)])
    return np.lib.stride_tricks.sliding_window_view(padded[:-1], window, axis=0)[:x.shape[0]]


def _nanmedian(a: np.ndarray, axis: int) -> np.ndarray:
    """Median of the finite values along ``axis`` (NaN where none): ``np.nanmedian``'s result, by one
    sort (NaNs sort last), several times faster on the small windows of a stream."""
    srt = np.sort(a, axis=axis)
    n = np.isfinite(srt).sum(axis=axis, keepdims=True)
    lo = np.take_along_axis(srt, np.maximum((n - 1) // 2, 0), axis=axis)
    hi = np.take_along_axis(srt, np.maximum(n // 2, 0) - (n == 0), axis=axis)
    return np.where(n > 0, (lo + hi) / 2, np.nan).squeeze(axis)


def median_mad(past: np.ndarray, axis: int = -1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Median, (unscaled) MAD and count of the finite values of ``past`` along ``axis``; NaN where none."""
    past = np.asarray(past, dtype=float)
    med = _nanmedian(past, axis)
    mad = _nanmedian(np.abs(past - np.expand_dims(med, axis)), axis)
    return med, mad, np.isfinite(past).sum(axis=axis)


def rolling_median_mad(x: np.ndarray, window: int, window_of: str = "steps",
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`median_mad` of the trailing window (module docstring) of every step of ``x`` (shape
    (step,) or (step, feature), steps along axis 0); each result has the shape of ``x``."""
    x = np.asarray(x, dtype=float)
    if _check_window_of(window_of) == "steps":
        return median_mad(trailing_windows(x, window), axis=-1)
    if x.ndim == 2:
        cols = [rolling_median_mad(x[:, j], window, window_of) for j in range(x.shape[1])]
        return tuple(np.stack([c[i] for c in cols], axis=1) for i in range(3))  # type: ignore[return-value]
    finite = np.isfinite(x)
    # the window of step t is that of the k-th finite value, k = finite values before t; one extra
    # slot (k = all of them) serves the steps after the last finite value
    before = np.cumsum(finite) - finite
    med, mad, n = median_mad(trailing_windows(np.append(x[finite], np.nan), window), axis=-1)
    return med[before], mad[before], n[before]


def rolling_robust_z(x: np.ndarray, window: int = 64, min_periods: int = 16, clip: float = math.inf,
                     floor: float = 1e-3, window_of: str = "values") -> np.ndarray:
    """The robust z of every step of ``x`` (shape (step,) or (step, feature)) at once: what
    :meth:`RobustZ.z` returns fed the series step by step (per feature), bit for bit."""
    _check_sizes(window, min_periods)
    x = np.asarray(x, dtype=float)
    med, mad, n = rolling_median_mad(x, window, window_of)
    with np.errstate(all="ignore"):
        z = (x - med) / np.maximum(MAD_SCALE * mad, floor)
    return np.where((n >= min_periods) & np.isfinite(x), np.clip(z, -clip, clip), np.nan)
