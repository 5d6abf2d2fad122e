"""stable-baselines3 agents on gymnasium tasks, with telemetry and perturbations.

:mod:`~stabstudy.learners.rl.envs` builds the envs, :mod:`~stabstudy.learners.rl.callbacks`
holds the SB3 callbacks (one job each, usable in any SB3 script) and
:mod:`~stabstudy.learners.rl.recorder` the :class:`Recorder` they share,
:mod:`~stabstudy.learners.rl.learner` composes them into ``run(spec)``, and
:mod:`~stabstudy.learners.rl.forks` stores a prefix's training state once and forks runs from it.
"""

from stabstudy.learners.rl.callbacks import (
    ControllerCallback,
    DiagnosticsCallback,
    DivergenceCallback,
    EpisodeReturnCallback,
    EvaluationCallback,
    PerturbationCallback,
    RecorderCallback,
    TelemetryCallback,
)
from stabstudy.learners.rl.envs import PerturbationWrapper, make_env, make_eval_env
from stabstudy.learners.rl.learner import build_model, callbacks_for, run
from stabstudy.learners.rl.recorder import Recorder

__all__ = [
    "ControllerCallback",
    "DiagnosticsCallback",
    "DivergenceCallback",
    "EpisodeReturnCallback",
    "EvaluationCallback",
    "PerturbationCallback",
    "PerturbationWrapper",
    "Recorder",
    "RecorderCallback",
    "TelemetryCallback",
    "build_model",
    "callbacks_for",
    "make_env",
    "make_eval_env",
    "run",
]
