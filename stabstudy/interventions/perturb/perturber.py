"""One perturbation skeleton for every learner: the :class:`Perturber` and its hooks.

A learner makes one ``Perturber(schedule, generator)`` and calls its hooks at fixed points of
its training step; each kind's :class:`~stabstudy.interventions.perturb.effects.Effect` says
what it does at those points, so no learner dispatches kinds by hand::

    pert = Perturber(Schedule(spec.perturbations), generator, layer="layers.0", outliers=fn)
    hp = pert.hparams(hp)                              # once, before training
    for step in range(steps):
        lr = pert.on_step_start(step, opt, base_lr)   # lr x the schedule's factor; betas
        pert.on_params(step, model)                   # weight noise, re-initialisation
        batch = pert.on_batch(step, batch)            # outliers
        loss = ...; pert.on_loss(step, loss).backward()
        pert.on_grads(step, params)                   # gradient noise, before clipping
        opt.step()

Every random draw of every kind comes from ``generator``, in the order of the hooks, then
of the kinds' registration (:mod:`.kinds`), then of the schedule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from stabstudy.interventions.perturb.effects import EFFECTS, Effect, effect
from stabstudy.interventions.perturb.schedule import Schedule
from stabstudy.registry import KINDS
from stabstudy.spec import Perturbation


class Perturber:
    """Applies a :class:`Schedule` to one training run through hooks the learner calls.

    Args:
        schedule: the run's perturbations (a :class:`Schedule` or a sequence of them).
        generator: the seeded ``torch.Generator`` every random draw of a perturbation uses.
        layer: the submodule ``reinit_layer`` re-initialises when its params name none.
        outliers: ``outliers(batch, p, generator) -> batch``, the domain's outlier batch
            (``outlier_batch`` refuses to act without it).
    """

    def __init__(self, schedule: Schedule | tuple[Perturbation, ...] | list[Perturbation], generator: Any, *,
                 layer: str = "", outliers: Callable[[tuple, Perturbation, Any], tuple] | None = None):
        self.schedule = schedule if isinstance(schedule, Schedule) else Schedule(tuple(schedule))
        self.generator, self.layer, self.outliers = generator, layer, outliers
        for p in self.schedule.perturbations:
            effect(p.kind)  # a kind with no effect here is a clear error now, not a silent no-op
        # (effect, instantaneous, its perturbations) for the kinds present, in registration order
        self._acting = [(e, KINDS[k].instantaneous, [p for p in self.schedule.perturbations if p.kind == k])
                        for k, e in EFFECTS.items() if any(p.kind == k for p in self.schedule.perturbations)]
        self._base_betas: list[Any] | None = None
        self._now: tuple[int, list[tuple[Effect, Perturbation]]] = (-1, [])

    def acting(self, step: int) -> list[tuple[Effect, Perturbation]]:
        """The (effect, perturbation) pairs acting at ``step``: an instantaneous kind at its start
        only, the others on every step of their window (the first listed while windows overlap)."""
        if self._now[0] != step:
            out = []
            for e, instantaneous, perts in self._acting:
                if instantaneous:
                    out += [(e, p) for p in perts if p.start == step]
                else:
                    first = next((p for p in perts if p.start <= step < p.end), None)
                    if first is not None:
                        out.append((e, first))
            self._now = (step, out)
        return self._now[1]

    def hparams(self, hp: dict[str, Any]) -> dict[str, Any]:
        """The hyperparameters the learner should train with (e.g. no warmup), asked once."""
        for e, _, perts in self._acting:
            for p in perts:
                hp = e.hparams(p, hp)
        return hp

    def on_step_start(self, step: int, optimizer: Any, lr: float) -> float:
        """Write ``lr`` times the schedule's factor into every parameter group, restore the betas the
        optimizer had at the first call, let acting kinds change them; return the lr applied."""
        applied = lr * self.schedule.lr_factor(step)
        if self._base_betas is None:
            self._base_betas = [g.get("betas") for g in optimizer.param_groups]
        for g, betas in zip(optimizer.param_groups, self._base_betas, strict=True):
            g["lr"] = applied
            if betas is not None:
                g["betas"] = betas
        for e, p in self.acting(step):
            e.on_step_start(p, optimizer, self)
        return applied

    def overrides(self, name: str) -> bool:
        """Whether a perturbation of the schedule may change the learner setting ``name``."""
        return any(name in e.SETTINGS for e, _, _ in self._acting)

    def setting(self, step: int, name: str, default: Any) -> Any:
        """The value of the learner setting ``name`` at ``step`` (``default`` when no kind changes it)."""
        for e, p in self.acting(step):
            if name in e.SETTINGS:
                return e.settings(p)[name]
        return default

    def on_params(self, step: int, model: Any) -> None:
        for e, p in self.acting(step):
            e.on_params(p, model, self)

    def on_batch(self, step: int, batch: tuple) -> tuple:
        for e, p in self.acting(step):
            batch = e.on_batch(p, batch, self)
        return batch

    def on_loss(self, step: int, loss: Any) -> Any:
        for e, p in self.acting(step):
            loss = e.on_loss(p, loss, self)
        return loss

    def on_grads(self, step: int, params: list) -> None:
        for e, p in self.acting(step):
            e.on_grads(p, params, self)

    def mask(self, steps: np.ndarray) -> np.ndarray:
        """The ``perturbed`` channel over ``steps``."""
        return self.schedule.mask(steps)
