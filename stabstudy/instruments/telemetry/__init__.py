"""Optimizer telemetry for any PyTorch training loop: :class:`Monitor`."""

from stabstudy.instruments.telemetry.channels import (
    LONG_NAMES,
    OPT_CHANNELS,
    TELEMETRY_VERSION,
    MonitorCost,
    PreStepStats,
    gradient_coherence,
)
from stabstudy.instruments.telemetry.monitor import Monitor

__all__ = ["LONG_NAMES", "OPT_CHANNELS", "TELEMETRY_VERSION", "Monitor", "MonitorCost", "PreStepStats",
           "gradient_coherence"]
