"""Optimizer telemetry for any PyTorch training loop: :class:`Monitor`."""

from stabstudy.instruments.telemetry.monitor import (
    LONG_NAMES,
    OPT_CHANNELS,
    Monitor,
    MonitorCost,
    gradient_coherence,
)

__all__ = ["LONG_NAMES", "OPT_CHANNELS", "Monitor", "MonitorCost", "gradient_coherence"]
