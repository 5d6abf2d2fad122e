"""river's drift detectors on robust z-scores, as streaming detectors (``update(value) -> score``).

``river`` is imported when a detector is built, not when this module is: ``import stabstudy.online``
needs numpy only. :class:`PageHinkley` reads river's private ``_sum_increase``, ``_min_increase`` and
``_x_mean`` (river exposes only a drift flag), so pyproject bounds river from above.
"""

from __future__ import annotations

import copy
import math

import numpy as np

from stabstudy.online.base import NAN, Detector
from stabstudy.online.robust import RobustZ


class _OnRobustZ(Detector):
    """A river detector fed the robust z of each value: ``_score(z)`` after ``_z.z(value)``."""

    _z: RobustZ

    def _score(self, z: float) -> float:  # pragma: no cover - interface
        raise NotImplementedError

    def update(self, value: float) -> float:
        return self._score(self._z.z(value))

    def replay(self, values: np.ndarray) -> np.ndarray:
        if not self._z.fresh():
            return super().replay(values)
        d, z = copy.deepcopy(self), self._z.zs(values)  # the z-scores at once; river's updates stay a loop
        return np.array([d._score(float(v)) for v in z], dtype=float)


class ADWINGrid(_OnRobustZ):
    """river's ADWIN on robust z-scores, run at several confidences ``deltas`` at once.

    ADWIN answers only drift / no drift; the score is ``-log10`` of the largest ``delta``
    that flags a drift at this step (0 when none), so that a calibrated threshold picks a
    confidence. ``clock=1`` checks every step (river's default of 32 would delay alarms).
    """

    def __init__(self, name: str = "adwin", deltas: tuple[float, ...] = (0.5, 0.1, 2e-2, 2e-3, 2e-4, 2e-5, 2e-6),
                 window: int = 64, min_periods: int = 16, threshold: float = -math.log10(2e-3)):
        from river import drift

        self.name, self.threshold, self.deltas = name, threshold, tuple(sorted(deltas, reverse=True))
        self._z = RobustZ(window=window, min_periods=min_periods, clip=10.0)  # one wild value must not own the mean
        self._adwins = [drift.ADWIN(delta=d, clock=1) for d in self.deltas]

    def _score(self, z: float) -> float:
        if math.isnan(z):
            return NAN
        score = 0.0
        for d, a in zip(self.deltas, self._adwins, strict=True):
            a.update(z)
            if a.drift_detected and score == 0.0:
                score = -math.log10(d)
        return score


class PageHinkley(_OnRobustZ):
    """river's Page-Hinkley test for an increase of the mean of robust z-scores.

    river exposes only a drift flag; the score is its cumulative statistic
    ``sum_increase - min_increase`` (what river compares with its ``threshold``), read from the
    detector with river's own threshold set to infinity so that it never resets. ``delta`` is the
    shift tolerated per step, in robust standard deviations here: river's default of 0.005 (for raw
    data) lets the statistic random-walk on in-control z-scores.
    """

    def __init__(self, name: str = "page_hinkley", delta: float = 0.5, alpha: float = 1 - 1e-4,
                 min_instances: int = 30, window: int = 64, min_periods: int = 16, threshold: float = 50.0):
        from river import drift

        self.name, self.threshold = name, threshold
        self._z = RobustZ(window=window, min_periods=min_periods, clip=10.0)  # one wild value must not own the mean
        self._ph = drift.PageHinkley(min_instances=min_instances, delta=delta, threshold=math.inf, alpha=alpha,
                                     mode="up")

    def _score(self, z: float) -> float:
        if math.isnan(z):
            return NAN
        self._ph.update(z)
        if self._ph._x_mean.n < self._ph.min_instances:
            return NAN
        return float(self._ph._sum_increase - self._ph._min_increase)
