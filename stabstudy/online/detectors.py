"""Streaming detectors with one interface: ``update(value) -> score``; an alarm is ``score > threshold``.

Every detector reads one stream of floats (a feature of :mod:`stabstudy.online.features`: the
transforms, log10 included, happen before ``update``), keeps its own state, and answers NaN while it
warms up or when the value is missing. The threshold a detector is born with is its published
default; an evaluation may replace it by a threshold calibrated to a common false-alarm budget.

* :class:`WindowZ`: OLMo-core's spike rule, z of the value against the mean and standard
  deviation of the last ``window`` values (z > 6 over 128 steps);
* :class:`ZClipZ`: ZClip's z-score of the gradient norm against an EMA mean and variance, fed
  back with ZClip's own clipped value (Kumar et al. 2025, package ``zclip``);
* :class:`~stabstudy.online.robust.RobustZ` (:mod:`.robust`): z against the trailing median and MAD;
* :class:`Level`: the value itself (sharpness against 2/lr; a meta-state statistic);
* :class:`NonFinite`: 1 for an inf/NaN value, else 0;
* :class:`KendallEWS`: critical slowing down: Kendall's tau, over the last ``span`` steps, of the
  rolling variance or lag-1 autocorrelation of causally detrended values (Scheffer et al. 2009);
* river's drift detectors on robust z-scores are in :mod:`.drift`.

numpy only. The ZClip rule is re-implemented here because the ``zclip`` package imports torch and
``torch.distributed`` and its public entry point, ``ZClip.step(model)``, reads the gradients of a
model; the tests drive the package's own EMA methods on the same stream of norms and hold the two
equal.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from stabstudy.online.base import NAN, Detector, check_side, sided


class _Past:
    """The last ``window`` finite values, oldest first, as a numpy array on demand."""

    def __init__(self, window: int):
        self.values: deque[float] = deque(maxlen=window)

    def array(self) -> np.ndarray:
        return np.fromiter(self.values, dtype=float, count=len(self.values))

    def push(self, x: float) -> None:
        if math.isfinite(x):
            self.values.append(x)


class WindowZ(Detector):
    """``(x - mean) / std`` over the previous ``window`` finite values (OLMo-core: 128, alarm at 6).

    ``side``: ``up`` (spikes), ``down`` or ``both``; ``min_periods``: past values needed.
    """

    def __init__(self, name: str = "olmo_z", window: int = 128, min_periods: int = 32, side: str = "up",
                 threshold: float = 6.0):
        self.name, self.window, self.min_periods, self.threshold = name, window, min_periods, threshold
        self.side = check_side(side)
        self._past = _Past(window)

    def update(self, value: float) -> float:
        x = float(value)
        p = self._past.array()
        score = NAN
        if math.isfinite(x) and p.size >= self.min_periods:
            sd = p.std(ddof=1)
            score = sided((x - p.mean()) / sd, self.side) if sd > 0 else NAN
        self._past.push(x)
        return score

    def replay(self, values: np.ndarray) -> np.ndarray:
        if self._past.values:
            return super().replay(values)
        x = np.asarray(values, dtype=float)
        finite = np.isfinite(x)
        f = x[finite]
        before = np.cumsum(finite) - finite  # finite values before each step: its window's count
        # mean and sd of the window of k past values, k = 0 .. f.size (row by row: numpy's own
        # reductions, as update computes them on each window)
        mean, sd = np.full(f.size + 1, np.nan), np.full(f.size + 1, np.nan)
        for k in range(self.min_periods, min(self.window, f.size + 1)):
            mean[k], sd[k] = f[:k].mean(), f[:k].std(ddof=1)
        if f.size >= self.window:
            w = np.lib.stride_tricks.sliding_window_view(f, self.window)
            mean[self.window:], sd[self.window:] = w.mean(axis=-1), w.std(ddof=1, axis=-1)
        m, s = mean[before], sd[before]
        ok = finite & (before >= self.min_periods) & (s > 0)
        with np.errstate(all="ignore"):
            return np.where(ok, sided((x - m) / s, self.side), NAN)


class ZClipZ(Detector):
    """ZClip's z-score of the gradient norm (zscore mode, adaptive scaling; package defaults).

    Warm-up: the first ``warmup_steps`` norms initialise the EMA mean and variance (score NaN).
    Then ``z = (g - mean) / (std + eps)``; when ``z > z_thresh`` ZClip clips the norm to
    ``mean + z_thresh * std / (z / z_thresh)`` (times ``clip_factor``) and updates the EMA with
    that value instead of ``g``. The score is ``z``; ZClip itself acts at ``z > 2.5``.
    """

    def __init__(self, name: str = "zclip_z", alpha: float = 0.97, z_thresh: float = 2.5, eps: float = 1e-6,
                 warmup_steps: int = 25, clip_factor: float = 1.0, threshold: float = 2.5):
        self.name, self.alpha, self.z_thresh, self.eps = name, alpha, z_thresh, eps
        self.warmup_steps, self.clip_factor, self.threshold = warmup_steps, clip_factor, threshold
        self._buffer: list[float] = []
        self.mean: float | None = None
        self.var: float | None = None

    def update(self, value: float) -> float:
        g = float(value)
        if not math.isfinite(g):
            return NAN
        if self.mean is None or self.var is None:
            self._buffer.append(g)
            if len(self._buffer) >= self.warmup_steps:
                self.mean = sum(self._buffer) / len(self._buffer)
                self.var = sum((x - self.mean) ** 2 for x in self._buffer) / len(self._buffer)
                self._buffer = []
            return NAN
        std = self.var ** 0.5
        z = (g - self.mean) / (std + self.eps)
        fed = g
        if z > self.z_thresh:
            fed = (self.mean + (self.z_thresh * std) / (z / self.z_thresh)) * self.clip_factor
        self.mean = self.alpha * self.mean + (1 - self.alpha) * fed
        self.var = self.alpha * self.var + (1 - self.alpha) * (fed - self.mean) ** 2
        return z


class Level(Detector):
    """The value itself, signed by ``side`` (``down``: the negated value); a missing value
    repeats the last score (a quantity measured every k steps, like ``lambda_max``)."""

    def __init__(self, name: str = "level", side: str = "up", hold: bool = True, threshold: float = math.inf):
        self.name, self.side, self.hold, self.threshold = name, check_side(side), hold, threshold
        self._last = NAN

    def update(self, value: float) -> float:
        x = float(value)
        if math.isfinite(x):
            self._last = sided(x, self.side)
            return self._last
        return self._last if self.hold else NAN


def kendall_tau(y: np.ndarray) -> float:
    """Kendall's tau-b of ``y`` (shape (n,)) against time 0..n-1 (no ties in time), as scipy and
    ewstools compute it; NaN when ``y`` has a NaN or is constant."""
    y = np.asarray(y, dtype=float)
    if y.size < 3 or not np.isfinite(y).all():
        return NAN
    i, j = np.triu_indices(y.size, 1)
    s = np.sign(y[j] - y[i])
    n0 = s.size
    ties = int(np.count_nonzero(s == 0))
    if ties == n0:
        return NAN
    return float(s.sum() / math.sqrt(n0 * (n0 - ties)))


def ews_indicator(x: np.ndarray, indicator: str) -> float:
    """Variance (ddof 1) or lag-1 autocorrelation (Pearson of ``x[:-1]``, ``x[1:]``, as pandas'
    ``autocorr``) of one window ``x`` (shape (window,))."""
    if indicator == "variance":
        return float(np.var(x, ddof=1))
    if indicator == "ac1":
        a, b = x[:-1], x[1:]
        da, db = a - a.mean(), b - b.mean()
        den = math.sqrt(float(np.sum(da * da) * np.sum(db * db)))
        return float(np.sum(da * db) / den) if den > 0 else NAN
    raise ValueError(f"unknown indicator {indicator!r}; valid: variance, ac1")


class _TauWindow:
    """The last ``span`` values and the sums of :func:`kendall_tau` over them, kept as values come
    and go: a value costs O(span), not the O(span^2) of recounting every pair. The sums are
    integers (pair signs and ties, over pairs of finite values), so :meth:`tau` equals
    :func:`kendall_tau` of the window exactly; a non-finite value in the window makes it NaN."""

    def __init__(self, span: int):
        self.values: deque[float] = deque(maxlen=span)
        self.span, self._sign, self._ties, self._missing = span, 0, 0, 0

    def _pairs(self, x: float, later: bool) -> tuple[int, int]:
        """Signed count and ties of ``x`` against the finite values in the window (``later``: ``x``
        comes after them)."""
        up = down = ties = 0
        for v in self.values:
            if not math.isfinite(v):
                continue
            if v == x:
                ties += 1
            elif (x > v) == later:
                up += 1
            else:
                down += 1
        return up - down, ties

    def push(self, x: float) -> None:
        if len(self.values) == self.span:
            old = self.values.popleft()
            if math.isfinite(old):
                s, t = self._pairs(old, later=False)
                self._sign, self._ties = self._sign - s, self._ties - t
            else:
                self._missing -= 1
        if math.isfinite(x):
            s, t = self._pairs(x, later=True)
            self._sign, self._ties = self._sign + s, self._ties + t
        else:
            self._missing += 1
        self.values.append(x)

    def tau(self) -> float:
        n = len(self.values)
        n0 = n * (n - 1) // 2
        if n < 3 or self._missing or self._ties == n0:
            return NAN
        return float(self._sign / math.sqrt(n0 * (n0 - self._ties)))


class KendallEWS(Detector):
    """Critical-slowing-down trend: Kendall's tau of an indicator over the last ``span`` steps.

    Per step: the residual ``r = x - mean(previous detrend values)`` (a causal detrending: the
    usual Gaussian or Lowess smoother looks ahead), the ``indicator`` (``variance`` or ``ac1``)
    of the last ``window`` residuals, and the tau of the last ``span`` indicator values against
    time. Missing values (NaN) make the score NaN until the windows are full again.
    """

    def __init__(self, name: str = "ews", indicator: str = "variance", detrend: int = 20, window: int = 30,
                 span: int = 40, threshold: float = 0.8):
        if indicator not in ("variance", "ac1"):
            raise ValueError(f"unknown indicator {indicator!r}; valid: variance, ac1")
        self.name, self.indicator, self.threshold = name, indicator, threshold
        self.detrend, self.window, self.span = detrend, window, span
        self._x: deque[float] = deque(maxlen=detrend)
        self._r: deque[float] = deque(maxlen=window)
        self._ind = _TauWindow(span)

    def update(self, value: float) -> float:
        x = float(value)
        r = NAN
        if len(self._x) == self.detrend and all(math.isfinite(v) for v in self._x) and math.isfinite(x):
            r = x - float(np.mean(np.fromiter(self._x, dtype=float)))
        self._x.append(x)
        self._r.append(r)
        ind = NAN
        if len(self._r) == self.window:
            w = np.fromiter(self._r, dtype=float)
            if np.isfinite(w).all():
                ind = ews_indicator(w, self.indicator)
        self._ind.push(ind)
        return self._ind.tau() if len(self._ind.values) == self.span else NAN

    def replay(self, values: np.ndarray) -> np.ndarray:
        if self._x:
            return super().replay(values)
        from stabstudy.online.robust import trailing_windows

        x = np.asarray(values, dtype=float)
        past = trailing_windows(x, self.detrend)  # row t: the detrend values before t, NaN-padded
        ok = np.isfinite(x) & np.isfinite(past).all(axis=-1)
        with np.errstate(all="ignore"):
            r = np.where(ok, x - past.mean(axis=-1), NAN)
        ind = np.full(x.size, NAN)
        if x.size >= self.window:
            w = np.lib.stride_tricks.sliding_window_view(r, self.window)  # row j: r[j .. j + window - 1]
            ind[self.window - 1:] = np.where(np.isfinite(w).all(axis=-1), _indicators(w, self.indicator), NAN)
        return _taus(ind, self.span)


def _indicators(w: np.ndarray, indicator: str) -> np.ndarray:
    """:func:`ews_indicator` of every row of ``w`` (shape (row, window)), by the same operations."""
    with np.errstate(all="ignore"):
        if indicator == "variance":
            return np.var(w, ddof=1, axis=-1)
        a, b = w[:, :-1], w[:, 1:]
        da, db = a - a.mean(axis=-1, keepdims=True), b - b.mean(axis=-1, keepdims=True)
        den = np.sqrt(np.sum(da * da, axis=-1) * np.sum(db * db, axis=-1))
        return np.where(den > 0, np.sum(da * db, axis=-1) / den, NAN)


def _taus(y: np.ndarray, span: int) -> np.ndarray:
    """:func:`kendall_tau` of every window ``y[t - span + 1 .. t]`` of the series ``y`` (NaN for
    ``t < span - 1``): for each lag ``k`` the signs and ties of the pairs ``(i, i + k)`` summed over
    each window by a cumulative sum, O(span) a step. The sums are integers, so the taus are
    kendall_tau's exactly; a window with a non-finite value gets NaN."""
    out = np.full(y.size, NAN)
    rows = y.size - span + 1
    if span < 3 or rows < 1:
        return out
    finite = np.isfinite(y)
    signs, ties = np.zeros(rows, dtype=np.int64), np.zeros(rows, dtype=np.int64)
    for k in range(1, span):
        with np.errstate(all="ignore"):
            d = y[k:] - y[:-k]
        both = finite[k:] & finite[:-k]
        for total, x in ((signs, np.where(both, np.sign(d), 0)), (ties, both & (d == 0))):
            c = np.concatenate([[0], np.cumsum(x, dtype=np.int64)])
            total += c[span - k:span - k + rows] - c[:rows]  # window j holds the pairs i = j .. j + span - 1 - k
    n0 = span * (span - 1) // 2
    ok = np.lib.stride_tricks.sliding_window_view(finite, span).all(axis=-1) & (ties < n0)
    with np.errstate(all="ignore"):
        out[span - 1:] = np.where(ok, signs / np.sqrt((n0 * (n0 - ties)).astype(float)), NAN)
    return out


class NonFinite(Detector):
    """Score 1 for a non-finite value, 0 otherwise; alarm above 0.5 (skip on inf/NaN gradients, as
    GradScaler does with fp16). Stateless."""

    def __init__(self, name: str = "nonfinite"):
        self.name, self.threshold = name, 0.5

    def update(self, value: float) -> float:
        return 0.0 if math.isfinite(float(value)) else 1.0
