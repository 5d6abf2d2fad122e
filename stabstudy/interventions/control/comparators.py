"""The controllers a learner can run by name (hyperparameter ``controller``), comparators included.

* ``none``: no controller;
* ``z_skip``, ``z_lr``, ``z_adam``, ``z_rollback``, ``z_clip``: our controller, a robust z-score
  (:class:`~stabstudy.online.robust.RobustZ`: trailing median and MAD, one-sided up)
  of ``log10`` of the gradient norm and of the loss, alarm at ``threshold`` (default 6), with one
  action each: skip the step, learning-rate back-off, raise Adam's second moment, roll back, clip;
* ``olmo``: OLMo-core's skip-step rule, loss or gradient-norm z > 6 against the last 128 steps,
  decided on the device with no host sync (:class:`OlmoSkip`);
* ``zclip``: the ``zclip`` package's ``ZClip`` (package defaults, ``max_grad_norm=None`` so that
  it is the adaptive rule alone, not also a fixed clip at 1.0);
* ``clip1``: fixed clipping of the global norm at 1.0 (acts, and is recorded, where the norm is above);
* ``nonfinite``: skip a step whose gradient norm is inf or NaN (what GradScaler does with fp16).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from stabstudy.interventions.control.actions import (
    ACTION_CODES,
    AdamSecondMoment,
    AdaptiveClip,
    LrBackoff,
    Rollback,
    Skip,
)
from stabstudy.interventions.control.controller import Controller, StepHooks, as_records
from stabstudy.online import Level, NonFinite, RobustZ

#: Names a learner accepts (``hparams.controller``), with what each does.
CONTROLLERS: dict[str, str] = {
    "none": "no controller",
    "z_skip": "robust z of log grad norm and loss > threshold: skip the step",
    "z_lr": "robust z > threshold: lr back-off (x backoff, linear recovery)",
    "z_adam": "robust z > threshold: raise Adam's second moment to the step's g^2",
    "z_rollback": "robust z > threshold: roll back to the older of 2 snapshots (every snapshot_every steps), skip the step",
    "z_clip": "robust z > threshold: clip to the median recent norm",
    "olmo": "OLMo-core skip-step: loss or grad-norm z > 6 over 128 steps, on the device",
    "zclip": "the zclip package (adaptive z-score clipping, package defaults, no fixed max norm)",
    "clip1": "fixed clipping of the global gradient norm at 1.0",
    "nonfinite": "skip steps with a non-finite gradient norm",
}


class _ParamsModel:
    """What ``ZClip.step(model)`` reads of a model: its parameters (and no FSDP submodules)."""

    def __init__(self, params: list[torch.Tensor]):
        self._params = params

    def parameters(self):
        return iter(self._params)

    def modules(self):
        return iter(())


class ZClipController(Controller):
    """The real ``zclip.ZClip`` in the optimizer's pre-step hook; a step counts as intervened
    where ZClip's own rule clips (its threshold below the norm)."""

    def __init__(self, name: str = "zclip", **zclip_kwargs: Any):
        from zclip import ZClip

        super().__init__(Level(), Skip(), name=name)
        self.zclip = ZClip(**{"max_grad_norm": None, **zclip_kwargs})
        self._model: _ParamsModel | None = None

    def logged_actions(self) -> list[Any]:
        return [AdaptiveClip()]  # ZClip's own clipping, in its step

    def _pre(self, opt: torch.optim.Optimizer, grad_norm: torch.Tensor | None) -> None:
        if self._model is None:
            self._model = _ParamsModel([p for g in opt.param_groups for p in g["params"]])
        zc = self.zclip
        # ZClip's own test, read before its step (it only reads the EMA state); the norm it computes
        # in step() is the same (float32 sum of squares) up to rounding
        if grad_norm is None:
            grads = [p.grad for p in self._model.parameters() if p.grad is not None]
            grad_norm = torch.nn.utils.get_total_norm(grads) if grads else None
        g = float(grad_norm) if grad_norm is not None else math.nan
        clip_at = zc._compute_clip_val(g) if zc.initialized and math.isfinite(g) else None
        zc.step(self._model)
        clipped = clip_at is not None and clip_at < g
        if clipped:
            self._acted[self._current_step()] = ACTION_CODES["clip"]
        self.last = (math.nan, clipped, ACTION_CODES["clip"] if clipped else 0)


class OlmoSkip(StepHooks):
    """OLMo-core's skip-step rule with the decision on the device (no host sync).

    As ``SkipStepOptimizer.get_step_factor`` of OLMo-core: the last ``window`` losses and gradient
    norms stay in device ring buffers; once ``min_periods`` past values are in (OLMo-core: 64 values
    with the latest, ``rolling_interval_length // 2``), the step proceeds only where
    ``x - mean <= sigma * std`` (``torch.std_mean``, ddof 1) for both the loss and the norm, so a NaN
    skips too. The parameters and optimizer state are copied before the step, and after it
    ``torch.where(skip, saved, new)`` puts the old values back: the step is undone exactly, on the
    device, whatever the optimizer (OLMo-core multiplies the update by the factor inside its own
    AdamW instead). The values enter the window whether skipped or not, as in OLMo-core and as in
    :class:`~stabstudy.online.detectors.WindowZ`, which the tests hold it equal to on
    finite values. The copies cost two passes over the state per step. A step whose loss was never
    given (:meth:`observe`) is judged by its gradient norm alone (stable-baselines3 hands no loss to
    the optimizer's hooks). ``attach(..., before_clip=True)`` judges the norm before the learner's
    clipping, as OLMo-core does (it reads the norm its clipping returns).
    """

    name = "olmo"

    def __init__(self, window: int = 128, min_periods: int = 63, sigma: float = 6.0):
        self.window, self.min_periods, self.sigma = window, min_periods, sigma
        self.optimizer: torch.optim.Optimizer | None = None
        self._handles: list[Any] = []
        self._n = 0  # values in the window (host-side count: no sync)
        self._loss: torch.Tensor | None = None
        self._step: int | None = None
        self._count = 0
        self._flags: list[tuple[int, torch.Tensor]] = []
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._skip: torch.Tensor | None = None
        self._monitor: Any = None

    def attach(self, optimizer: torch.optim.Optimizer, monitor: Any = None, *, before_clip: bool = False) -> OlmoSkip:
        """Hook into ``optimizer``; with ``monitor``, also log each step's decision there (as device
        values: no host sync) as ``controller_alarm`` and ``controller_action`` (build the Monitor
        first: this controller's pre-hook must run after the Monitor's opened the step's row)."""
        self.optimizer = optimizer
        self._monitor = monitor
        if monitor is not None:
            self._log_to(monitor, [Skip()])
        if before_clip:
            self._watch_raw(optimizer)
        dev = optimizer.param_groups[0]["params"][0].device
        if getattr(self, "_buf", None) is None or self._buf.device != dev:  # a re-attach keeps the window
            self._buf = torch.zeros((2, self.window), dtype=torch.float32, device=dev)
        self._handles += [optimizer.register_step_pre_hook(lambda o, a, k: self._pre(o)),
                          optimizer.register_step_post_hook(lambda o, a, k: self._post(o))]
        return self

    def observe(self, loss: Any = None, step: int | None = None) -> None:
        if loss is not None:
            self._loss = loss.detach().reshape(()) if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
        if step is not None:
            self._step = int(step)

    def _within(self, row: int, x: torch.Tensor) -> torch.Tensor:
        std, mean = torch.std_mean(self._buf[row, :min(self._n, self.window)])
        return (x - mean) <= self.sigma * std

    @torch.no_grad()
    def _pre(self, opt: torch.optim.Optimizer) -> None:
        params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
        if not params:
            return
        dev = self._buf.device
        gn = self._raw_norm()
        if gn is None:
            gn = torch.nn.utils.get_total_norm([p.grad for p in params])
        gn = gn.to(dev, torch.float32)
        loss = self._loss.to(dev, torch.float32) if self._loss is not None else torch.tensor(math.nan, device=dev)
        if self._n >= self.min_periods:
            ok = self._within(1, gn)
            skip = ~(torch.logical_and(self._within(0, loss), ok) if self._loss is not None else ok)
        else:
            skip = torch.zeros((), dtype=torch.bool, device=dev)
        self._buf[:, self._n % self.window] = torch.stack([loss, gn])
        self._n += 1
        self._skip = skip
        self._flags.append((self._step if self._step is not None else self._count, skip))
        if self._monitor is not None and self._monitor.step >= 0:  # the row of this step: its pre-hook ran first
            self._monitor.log(controller_alarm=skip.float(), controller_action=skip.float() * ACTION_CODES["skip"])
        self._saved = [(t, t.clone()) for t in self._state_tensors(opt)]

    @staticmethod
    def _state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
        out = []
        for g in opt.param_groups:
            for p in g["params"]:
                out.append(p)
                out += [v for v in opt.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
        return out

    @torch.no_grad()
    def _post(self, opt: torch.optim.Optimizer) -> None:
        if self._skip is not None:
            saved = {id(t): old for t, old in self._saved}
            for t in self._state_tensors(opt):  # state created by this step (first step) has nothing saved
                old = saved.get(id(t))
                if old is not None:
                    t.copy_(torch.where(self._skip.to(t.device), old, t))
        self._saved, self._skip = [], None
        self._count += 1
        self._loss, self._step = None, None

    @property
    def n_actions(self) -> int:
        return int(self.records()["intervened"].sum()) if self._flags else 0

    def records(self, steps: int | None = None) -> dict[str, np.ndarray]:
        n = steps if steps is not None else (max(s for s, _ in self._flags) + 1 if self._flags else 0)
        flags = torch.stack([f for _, f in self._flags]).cpu().numpy() if self._flags else []  # the one host copy
        return as_records({s: ACTION_CODES["skip"] for (s, _), f in zip(self._flags, flags, strict=True) if f}, n)

    def attrs(self) -> dict[str, Any]:
        return {"controller_policy": "skip (device-side undo)",
                "controller_detectors": f"loss or grad-norm z > {self.sigma:g} over {self.window} steps"}


def build(name: str, *, threshold: float = 0.0, window: int = 64, backoff: float = 0.1, recovery: int = 50,
          snapshot_every: int = 25, warmup: int = 0) -> Controller | OlmoSkip | None:
    """The controller called ``name`` (:data:`CONTROLLERS`), unattached; None for ``none``.
    ``threshold`` 0 keeps each detector's default; ``snapshot_every``: steps between the rollback's
    snapshots (its ring must reach back past the detection delay to restore an undamaged state)."""
    if name not in CONTROLLERS:
        raise ValueError(f"unknown controller {name!r}; valid: {', '.join(CONTROLLERS)}")
    if name == "none":
        return None
    if name == "olmo":
        return OlmoSkip(sigma=threshold or 6.0)
    if name == "zclip":
        return ZClipController(**({"z_thresh": threshold} if threshold else {}))
    if name == "clip1":
        return Controller(Level(threshold=threshold or 1.0), AdaptiveClip(max_norm=threshold or 1.0), name=name)
    if name == "nonfinite":
        return Controller(NonFinite(), Skip(), name=name)
    thr = threshold or 6.0
    dets = {s: RobustZ(name=f"robust_z {s}", window=window, min_periods=max(window // 4, 4), side="up",
                   threshold=thr) for s in ("grad_norm", "loss")}
    action = {"z_skip": Skip(), "z_lr": LrBackoff(backoff, recovery), "z_adam": AdamSecondMoment(),
              "z_rollback": Rollback(every=snapshot_every), "z_clip": AdaptiveClip()}[name]
    return Controller(dets, action, log=True, warmup=warmup, name=name)


def from_hparams(hp: dict[str, Any]) -> Controller | OlmoSkip | None:
    """The controller a learner's merged hyperparameters name (fields ``controller*`` of
    :class:`~stabstudy.hparams.ToyHParams` / :class:`~stabstudy.hparams.GPTHParams`)."""
    return build(str(hp["controller"]), threshold=float(hp["controller_threshold"]),
                 window=int(hp["controller_window"]), backoff=float(hp["controller_backoff"]),
                 recovery=int(hp["controller_recovery"]), snapshot_every=int(hp["controller_snapshot_every"]))
