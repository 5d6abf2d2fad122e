"""A prefix matched by return: the rule that stops it (:mod:`stabstudy.learners.rl.forks`).

Prefixes of different algorithms are compared at the same evaluation return, not after the same
number of env steps: each trains until its return first reaches a target fixed before the runs. The
stop must leave the model where a ``learn()`` that ended at that env step leaves it, so that the
checkpoint is the plain prefix's and forks of it continue one uninterrupted run.
"""

from __future__ import annotations

import numpy as np

from stabstudy.learners.rl.callbacks import RecorderCallback
from stabstudy.learners.rl.recorder import Recorder


class TargetReached(Exception):  # noqa: N818 - a stop, not an error
    """Raised by :class:`MatchCallback` where a matching prefix stops (see there)."""


class MatchCallback(RecorderCallback):
    """Stops a matching prefix (:mod:`stabstudy.learners.rl.forks`) once the mean of two consecutive
    evaluations on the cadence ``every`` (the first: the untrained policy's) reaches ``target``.

    ``reached``: ``(env step, mean)`` of the evaluation that met it, None until then. Training stops at
    the start of the next rollout (on-policy) or train call (off-policy), raising :class:`TargetReached`
    (``learner.run`` ends the run there): the update after that evaluation is made and nothing of the
    next one is, so the model is where a ``learn()`` that ended at that env step leaves it. Put it last
    in the callback list, so that the others saw the rollout start too.
    """

    def __init__(self, recorder: Recorder | None, target: float, every: int, verbose: int = 0):
        super().__init__(recorder, verbose)
        self.target, self.every = float(target), int(every)
        self.evaluations: list[tuple[int, float]] = []
        self.reached: tuple[int, float] | None = None
        self.recorder.on_evaluation(self._check)

    def _check(self, perf: float) -> None:
        t = int(self.model.num_timesteps)
        if self.reached is not None or t % self.every or (self.evaluations and self.evaluations[-1][0] == t):
            return  # off the cadence, or the closing evaluation of the same env step
        self.evaluations.append((t, float(perf)))
        mean = float(np.mean([p for _, p in self.evaluations[-2:]]))
        if len(self.evaluations) >= 2 and mean >= self.target:
            self.reached = (t, mean)

    def _on_rollout_start(self) -> None:
        super()._on_rollout_start()
        if self.reached is not None:
            raise TargetReached(f"mean of two evaluations {self.reached[1]:.4g} >= {self.target:g} at env step "
                                f"{self.reached[0]}")
