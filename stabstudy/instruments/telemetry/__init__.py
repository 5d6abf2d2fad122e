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
from stabstudy.instruments.telemetry.summary import Summary, summarize

__all__ = ["LONG_NAMES", "OPT_CHANNELS", "TELEMETRY_VERSION", "Monitor", "MonitorCost", "PreStepStats",
           "ScalarWriter", "Summary", "WriterSink", "gradient_coherence", "summarize", "to_frame"]
