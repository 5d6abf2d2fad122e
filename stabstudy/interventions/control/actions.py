"""What a controller can do to one optimizer step: the actions and their codes.

Every action acts inside the optimizer's step pre-hook, after the gradient exists and before
the update lands, through :class:`StepContext`; some keep state across steps (the learning-rate
back-off recovers over a stated schedule, the rollback keeps a ring of snapshots). An action
changes nothing on a step where it is neither triggered nor recovering, so a controller whose
detector never alarms leaves the trajectory bit for bit as it was (tested).

Codes (the ``action`` channel; 0 = no action): :data:`ACTION_CODES`.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

#: The ``action`` channel's codes; 0 is a step on which the controller did not act.
ACTION_CODES: dict[str, int] = {"none": 0, "lr_backoff": 1, "skip": 2, "adam_v": 3, "rollback": 4, "clip": 5,
                                "noise": 6}


@dataclass
class StepContext:
    """The step about to land, as an action sees it."""

    optimizer: torch.optim.Optimizer
    step: int  #: the controller's step index (the learner's step when it tells it)
    grad_norm: float  #: global gradient norm of this step (as read before any action; NaN where no action needs it)
    params: list[torch.Tensor] = field(default_factory=list)  #: parameters with a gradient this step

    def scale_grads(self, factor: float) -> None:
        """Multiply every gradient in place (clipping)."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, factor)

    def drop_grads(self) -> None:
        """Set every gradient to None: torch's optimizers then leave those parameters and their
        state (step count included) untouched, so the step is skipped exactly, weight decay too."""
        for p in self.params:
            p.grad = None


class Action:
    """Base class: ``apply`` on an alarm; ``before`` and ``after`` on every step (default: nothing)."""

    name = "none"

    @property
    def code(self) -> int:
        return ACTION_CODES[self.name]

    def apply(self, ctx: StepContext) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def before(self, ctx: StepContext) -> None:
        """Every step, after any ``apply`` and before the update."""

    def after(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        """Every step, after the update."""

    def describe(self) -> str:
        return self.name


class Skip(Action):
    """Skip the step: no parameter and no optimizer state moves."""

    name = "skip"

    def apply(self, ctx: StepContext) -> None:
        ctx.drop_grads()


class LrBackoff(Action):
    """Multiply every group's learning rate by ``factor`` on the alarm step, then recover linearly
    to 1 over ``recovery`` steps (step k after the alarm: ``factor + (1 - factor) k / recovery``).
    A new alarm restarts the schedule. The learner's own lr is restored after each step, so a
    learner that sets its schedule every step keeps it."""

    name = "lr_backoff"

    def __init__(self, factor: float = 0.1, recovery: int = 50):
        if not 0 < factor <= 1 or recovery < 0:
            raise ValueError(f"need 0 < factor <= 1 and recovery >= 0, got {factor}, {recovery}")
        self.factor, self.recovery = factor, recovery
        self._k = -1  # steps since the last alarm; -1: idle
        self._saved: list[Any] | None = None

    def current(self) -> float:
        """The factor applied this step (1 when idle)."""
        if self._k < 0:
            return 1.0
        if self.recovery == 0:
            return self.factor if self._k == 0 else 1.0
        return self.factor + (1 - self.factor) * min(self._k / self.recovery, 1.0)

    def apply(self, ctx: StepContext) -> None:
        self._k = 0

    def before(self, ctx: StepContext) -> None:
        f = self.current()
        if f < 1.0:
            self._saved = [g["lr"] for g in ctx.optimizer.param_groups]
            for g in ctx.optimizer.param_groups:
                g["lr"] = g["lr"] * f

    def after(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        if self._saved is not None:
            for g, lr in zip(optimizer.param_groups, self._saved, strict=True):
                g["lr"] = lr
            self._saved = None
        if self._k >= 0:
            self._k += 1
            if self._k > self.recovery:
                self._k = -1

    def describe(self) -> str:
        return f"lr x{self.factor:g}, linear recovery over {self.recovery} steps"


class AdamSecondMoment(Action):
    """Raise Adam's second moment so that this step's gradient is fully in it: per coordinate
    ``v <- max(v, g^2 (1 - beta2^(t-1)))`` before the step, so that after Adam's own update the
    bias-corrected ``v_hat >= g^2`` and no coordinate moves by more than about ``lr * |m_hat| / |g|``
    (a spike cannot move weights by more than a sign step; later steps stay damped as ``v`` decays).
    Needs Adam/AdamW state (``exp_avg_sq``, ``step``); a parameter without state is left alone."""

    name = "adam_v"

    def apply(self, ctx: StepContext) -> None:
        opt = ctx.optimizer
        with torch.no_grad():
            for group in opt.param_groups:
                beta2 = float(group.get("betas", (0.9, 0.999))[1])
                for p in group["params"]:
                    st = opt.state.get(p)
                    if p.grad is None or not st or "exp_avg_sq" not in st:
                        continue
                    t = float(st["step"])
                    v = st["exp_avg_sq"]
                    v.copy_(torch.maximum(v, p.grad.to(v.dtype).square() * (1.0 - beta2 ** t)))


class AdaptiveClip(Action):
    """Scale the gradient down to ``mult`` times the median norm of the last ``window`` steps
    that did not alarm (the controller keeps them); with ``max_norm`` a fixed clip instead."""

    name = "clip"

    def __init__(self, mult: float = 1.0, max_norm: float | None = None):
        self.mult, self.max_norm = mult, max_norm
        self.reference: Callable[[], float] = lambda: math.nan  # set by the controller

    def apply(self, ctx: StepContext) -> None:
        target = self.max_norm if self.max_norm is not None else self.mult * self.reference()
        if math.isfinite(target) and math.isfinite(ctx.grad_norm) and ctx.grad_norm > target:
            ctx.scale_grads(target / (ctx.grad_norm + 1e-6))

    def describe(self) -> str:
        return f"clip to {self.max_norm:g}" if self.max_norm is not None else f"clip to {self.mult:g} x median norm"


@dataclass
class _Snapshot:
    step: int
    params: list[torch.Tensor]
    state: list[dict[str, Any]]


class Rollback(Action):
    """Restore the oldest of a ring of ``size`` snapshots (parameters and optimizer state), taken
    after every ``every`` steps, and skip the step (the data stream goes on: the bad batches are
    not replayed). ``cost_s`` and ``bytes`` measure what the snapshots cost. With no snapshot yet,
    the step is only skipped."""

    name = "rollback"

    def __init__(self, every: int = 25, size: int = 2):
        if every < 1 or size < 1:
            raise ValueError(f"need every >= 1 and size >= 1, got {every}, {size}")
        self.every, self.size = every, size
        self.ring: deque[_Snapshot] = deque(maxlen=size)
        self.cost_s, self.bytes, self.restored = 0.0, 0, 0

    @staticmethod
    def _params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
        return [p for g in opt.param_groups for p in g["params"]]

    def after(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        if (step + 1) % self.every:
            return
        t0 = time.perf_counter()
        with torch.no_grad():
            params = self._params(optimizer)
            snap = _Snapshot(step, [p.detach().clone() for p in params],
                             [{k: (v.clone() if isinstance(v, torch.Tensor) else v)
                               for k, v in optimizer.state.get(p, {}).items()} for p in params])
        self.ring.append(snap)
        self.bytes = sum(t.numel() * t.element_size() for s in self.ring for t in
                         [*s.params, *(v for d in s.state for v in d.values() if isinstance(v, torch.Tensor))])
        self.cost_s += time.perf_counter() - t0

    def apply(self, ctx: StepContext) -> None:
        if self.ring:
            t0 = time.perf_counter()
            snap = self.ring[0]
            opt = ctx.optimizer
            with torch.no_grad():
                for p, saved, st in zip(self._params(opt), snap.params, snap.state, strict=True):
                    p.copy_(saved)
                    opt.state[p] = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items()}
            self.restored += 1
            self.cost_s += time.perf_counter() - t0
        ctx.drop_grads()

    def describe(self) -> str:
        return f"roll back to the oldest of {self.size} snapshots taken every {self.every} steps, skip the step"


class RaiseNoise(Action):
    """Multiply an algorithm's own noise knob (RL: PPO's ``ent_coef``, TD3's action-noise std) by
    ``factor`` for ``duration`` steps, through ``get`` and ``set`` callables; then restore it."""

    name = "noise"

    def __init__(self, get: Callable[[], float], set: Callable[[float], None], factor: float = 2.0,
                 duration: int = 100):
        self.get, self.set, self.factor, self.duration = get, set, factor, duration
        self._left, self._base = 0, None

    def apply(self, ctx: StepContext) -> None:
        if self._left == 0:
            self._base = self.get()
            self.set(self._base * self.factor)
        self._left = self.duration

    def after(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        if self._left > 0:
            self._left -= 1
            if self._left == 0 and self._base is not None:
                self.set(self._base)
