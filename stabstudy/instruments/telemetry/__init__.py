"""Optimizer telemetry for any PyTorch training loop: :class:`Monitor`."""

from stabstudy.instruments.telemetry.channels import (
    LONG_NAMES,
    OPT_CHANNELS,
    TELEMETRY_VERSION,
    MonitorCost,
    PreStepStats,
    gradient_coherence,
)
from stabstudy.instruments.telemetry.frame import to_frame
from stabstudy.instruments.telemetry.monitor import Monitor
from stabstudy.instruments.telemetry.sink import ScalarWriter, WriterSink

__all__ = ["LONG_NAMES", "OPT_CHANNELS", "TELEMETRY_VERSION", "Monitor", "MonitorCost", "PreStepStats",
           "ScalarWriter", "WriterSink", "gradient_coherence", "to_frame"]
