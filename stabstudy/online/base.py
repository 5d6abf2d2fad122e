"""The one interface of every streaming detector: ``update(value) -> score``; an alarm is ``score > threshold``."""

from __future__ import annotations

import math

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

    def alarm(self, score: float) -> bool:
        """Whether ``score`` raises an alarm (NaN never does)."""
        return bool(score > self.threshold)


def check_side(side: str) -> str:
    """``side`` if it is one of :data:`SIDES`, else ``ValueError`` naming them."""
    if side not in SIDES:
        raise ValueError(f"unknown side {side!r}; valid: {', '.join(SIDES)}")
    return side


def sided(z: float, side: str) -> float:
    """``z`` for ``up``, ``-z`` for ``down``, ``|z|`` for ``both``."""
    return z if side == "up" else -z if side == "down" else abs(z)
