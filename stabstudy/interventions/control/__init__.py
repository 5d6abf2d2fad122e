"""Closed-loop control: a streaming detector watches each optimizer step before it lands and a
policy acts on an alarm (:class:`Controller`); named controllers and comparators for the learners
(:func:`build`, :data:`CONTROLLERS`). See :mod:`.controller`, :mod:`.actions`, :mod:`.comparators`."""

from stabstudy.interventions.control.actions import (
    ACTION_CODES,
    Action,
    AdamSecondMoment,
    AdaptiveClip,
    LrBackoff,
    RaiseNoise,
    Rollback,
    Skip,
    StepContext,
)
from stabstudy.interventions.control.comparators import (
    CONTROLLERS,
    OlmoSkip,
    ZClipController,
    build,
    from_hparams,
)
from stabstudy.interventions.control.controller import Controller, Policy
from stabstudy.online import NonFinite  # a detector; importable here, where the controllers are

__all__ = ["ACTION_CODES", "CONTROLLERS", "Action", "AdamSecondMoment", "AdaptiveClip", "Controller", "LrBackoff",
           "NonFinite", "OlmoSkip", "Policy", "RaiseNoise", "Rollback", "Skip", "StepContext", "ZClipController",
           "build", "from_hparams"]
