"""Which perturbations are active at each step, and the learning-rate factor they apply.

Timing is in the run's own step unit (see :class:`stabstudy.spec.RunSpec`): optimizer
updates for the ``toy``, ``lm`` and ``seq`` domains, environment steps for ``rl``.
"""

from __future__ import annotations

import numpy as np

from stabstudy.interventions.perturb.effects import EFFECTS
from stabstudy.spec import Perturbation


class Schedule:
    """Which perturbations are active at each step.

    ``Schedule(perturbations)`` answers ``active(step)`` (the perturbations whose
    window ``[start, start + duration)`` contains ``step``), ``starts_at(step)``
    (instantaneous kinds fire exactly once) and ``lr_factor(step)``; a learner applies it
    through a :class:`~stabstudy.interventions.perturb.perturber.Perturber`.
    """

    def __init__(self, perturbations: tuple[Perturbation, ...] | list[Perturbation] = ()):
        self.perturbations = tuple(perturbations)

    def active(self, step: int) -> tuple[Perturbation, ...]:
        return tuple(p for p in self.perturbations if p.start <= step < p.start + max(p.duration, 1))

    def is_active(self, step: int) -> bool:
        return bool(self.active(step))

    def of_kind(self, kind: str, step: int) -> Perturbation | None:
        """The active perturbation of ``kind`` at ``step``, if any."""
        for p in self.active(step):
            if p.kind == kind:
                return p
        return None

    def starts_at(self, step: int, kind: str | None = None) -> tuple[Perturbation, ...]:
        return tuple(p for p in self.perturbations if p.start == step and (kind is None or p.kind == kind))

    def lr_factor(self, step: int) -> float:
        """Learning-rate factor at ``step``: the product of every perturbation's
        :meth:`~stabstudy.interventions.perturb.effects.Effect.lr_factor` (1.0 when none), kind by
        kind in registration order (``lr_spike``'s dose while active, then ``lr_ramp``'s climb).
        """
        f = 1.0
        for kind, e in EFFECTS.items():
            for p in self.perturbations:
                if p.kind == kind:
                    f *= e.lr_factor(p, step)
        return f

    def mask(self, steps: np.ndarray) -> np.ndarray:
        """The ``perturbed`` channel (0/1 floats) over ``steps``."""
        return np.array([1.0 if self.is_active(int(s)) else 0.0 for s in steps])
