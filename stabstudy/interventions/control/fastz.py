""":class:`FastRobustZ`: the robust z of :class:`~stabstudy.analysis.warning.detectors.RobustZ`, with
the window kept sorted (``bisect``) so that a step costs a few microseconds instead of two numpy
medians (about a hundred): the controller runs it on every optimizer step. Scores are equal to
RobustZ's bit for bit (tested): the median of an even count is the mean of the two middle values,
``(a + b) / 2``, as numpy computes it."""

from __future__ import annotations

import bisect
import math
from collections import deque

from stabstudy.analysis.warning.detectors import RobustZ


def _median(s: list[float]) -> float:
    n = len(s)
    h = n // 2
    return s[h] if n % 2 else (s[h - 1] + s[h]) / 2


class FastRobustZ(RobustZ):
    """:class:`RobustZ` (same arguments, same scores) for per-step use."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._order: deque[float] = deque()
        self._sorted: list[float] = []

    def z(self, value: float) -> float:
        x = float(value)
        z = math.nan
        s = self._sorted
        if math.isfinite(x) and len(s) >= self.min_periods:
            med = _median(s)
            mad = _median(sorted(abs(v - med) for v in s))
            z = min(max((x - med) / max(1.4826 * mad, self.floor), -self.clip), self.clip)
        if math.isfinite(x):
            if len(self._order) == self.window:
                s.pop(bisect.bisect_left(s, self._order.popleft()))
            self._order.append(x)
            bisect.insort(s, x)
        return z
