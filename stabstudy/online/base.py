"""The one interface of every streaming detector: ``update(value) -> score``; an alarm is ``score > threshold``."""

from __future__ import annotations

import copy
import math

import numpy as np

NAN = float("nan")
#: Sides a score can take: ``up`` (spikes), ``down`` (drops) or ``both`` (``|z|``).
SIDES = ("up", "down", "both")


class Detector:
    """Base class: ``name``, ``threshold`` (alarm when ``score > threshold``) and ``update``."""

    name: str = "detector"
    threshold: float = math.inf

    def update(self, value: float) -> float:  # pragma: no cover - interface
        """Feed one value; return the score at this step (NaN in warm-up or for a missing value)."""
        raise NotImplementedError

    def replay(self, values: np.ndarray) -> np.ndarray:
        """The scores a copy of this detector gives when fed ``values`` (shape (step,)) one by one;
        this detector's own state is left as it is. A detector whose update has an array form (a
        stored run's whole series at once) uses it from a fresh state and falls back to this loop
        otherwise; tests/test_online.py holds the two equal bit for bit. The early-warning analysis
        scores stored runs this way; a training loop calls :meth:`update`."""
        d = copy.deepcopy(self)
        return np.array([d.update(v) for v in np.asarray(values, dtype=float)], dtype=float)

    def alarm(self, score: float) -> bool:
        """Whether ``score`` raises an alarm (NaN never does)."""
        return bool(score > self.threshold)


def check_side(side: str) -> str:
    """``side`` if it is one of :data:`SIDES`, else ``ValueError`` naming them."""
    if side not in SIDES:
        raise ValueError(f"unknown side {side!r}; valid: {', '.join(SIDES)}")
    return side


def sided(z: float | np.ndarray, side: str) -> float | np.ndarray:
    """``z`` for ``up``, ``-z`` for ``down``, ``|z|`` for ``both`` (a float or an array)."""
    return z if side == "up" else -z if side == "down" else abs(z)
