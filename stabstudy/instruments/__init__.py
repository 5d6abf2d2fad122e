"""Read-only, online measurements of training: the telemetry Monitor, curvature probes, precision.

Instruments observe and never change training; they import no learner, intervention or analysis.
"""
