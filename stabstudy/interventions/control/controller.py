"""``Controller(detector, policy)``: a streaming detector watches each step before it lands; on an
alarm the policy's action acts on it (skip, lr back-off, Adam's second moment, rollback, clip).

It attaches to any torch optimizer through its step hooks (``register_step_pre_hook`` /
``register_step_post_hook``), or through a :class:`~stabstudy.instruments.telemetry.Monitor`'s
pre-step view (:meth:`Monitor.add_pre_step_hook`), which hands over the gradient norm the Monitor
computed anyway. The detectors are those of :mod:`stabstudy.online` (any
object with ``update(value) -> score`` and ``alarm(score)``), fed with ``grad_norm`` (read in the
pre-hook) and ``loss`` (given with :meth:`Controller.observe` before ``optimizer.step()``), or
with ``meta``: the Monitor's last complete row (every channel of the previous update) for a
:class:`~stabstudy.online.MetaDetector`, the meta-state's T^2 or Q; it needs ``attach(opt, monitor)``.

With ``attach(..., before_clip=True)`` the detectors judge the gradient as ``backward()`` left it,
read in each parameter's post-accumulate-grad hook, not as the optimizer receives it: a learner
that clips between ``backward()`` and ``step()`` (stable-baselines3's PPO at norm 0.5, nanoGPT's
``grad_clip``) otherwise shows the detector a norm pinned at the clip value. The actions still see
the gradient the optimizer steps with.

Reading the norm as a float is one host sync per step on a GPU (none on a CPU); the OLMo rule of
:mod:`~stabstudy.interventions.control.comparators` decides on the device instead.

Per step it records ``intervened`` (1 where it acted) and ``action`` (a code of
:data:`~stabstudy.interventions.control.actions.ACTION_CODES`), keyed by the learner's step when
:meth:`observe` names it, else by its own count of steps (:meth:`Controller.records`). Attached
through a Monitor it also logs, in the row of each update it saw, ``controller_score`` (the largest
score of its detectors), ``controller_alarm`` (1 where one alarmed) and ``controller_action`` (the
action's name, "none" where it did not act): one ``mon.to_dataset()`` holds the telemetry and the
decisions, and the Monitor's writer (TensorBoard, W&B, MLflow) and the framework callbacks get them.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from stabstudy.interventions.control.actions import ACTION_CODES, Action, AdaptiveClip, StepContext
from stabstudy.online import Detector

SIGNALS = ("grad_norm", "loss", "meta")


class Policy:
    """Maps an alarm to an action: ``action`` on every alarm step; with ``escalate``, that action
    instead once ``after`` consecutive steps alarmed (e.g. skip, then roll back)."""

    def __init__(self, action: Action, escalate: Action | None = None, after: int = 3):
        self.action, self.escalate, self.after = action, escalate, after
        self._run = 0

    @property
    def actions(self) -> list[Action]:
        return [a for a in (self.action, self.escalate) if a is not None]

    def choose(self, alarm: bool) -> Action | None:
        self._run = self._run + 1 if alarm else 0
        if not alarm:
            return None
        if self.escalate is not None and self._run >= self.after:
            return self.escalate
        return self.action

    def describe(self) -> str:
        s = self.action.describe()
        return s if self.escalate is None else f"{s}; after {self.after} alarms in a row: {self.escalate.describe()}"


def as_records(codes: Mapping[int, float], n: int) -> dict[str, np.ndarray]:
    """``intervened`` (0/1) and ``action`` (codes) for steps ``0 .. n - 1`` from ``step -> code``."""
    action = np.zeros(n)
    for s, c in codes.items():
        if 0 <= s < n:
            action[s] = c
    return {"intervened": (action > 0).astype(float), "action": action}


#: The Monitor channels a controller attached through it logs (the registry's ``control`` source).
MONITOR_CHANNELS = ("controller_score", "controller_alarm", "controller_action")


class StepHooks:
    """What every controller shares: the optimizer it is attached to, the hooks :meth:`close`
    removes (the records stay; attaching again resumes), the norm of the gradients as
    ``backward()`` left them (:meth:`_watch_raw`), and the Monitor it logs its decisions to
    (:meth:`_log_to`). A context manager."""

    optimizer: torch.optim.Optimizer | None
    _handles: list[Any]
    _raw: dict[int, torch.Tensor] | None = None

    def _log_to(self, monitor: Any, actions: list[Any]) -> None:
        """Name the action codes this controller logs as ``controller_action`` in ``monitor``."""
        monitor.name_codes("controller_action", {ACTION_CODES["none"]: "none", **{a.code: a.name for a in actions}})

    def _watch_raw(self, optimizer: torch.optim.Optimizer) -> None:
        """Keep each parameter's squared gradient norm from its post-accumulate-grad hook, i.e.
        before anything between ``backward()`` and ``step()`` (clipping) changes it. Keyed by
        parameter, so with gradient accumulation the last (accumulated) value counts."""
        self._raw = {}
        raw = self._raw
        for g in optimizer.param_groups:
            for p in g["params"]:
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(
                        lambda t: raw.__setitem__(id(t), torch.linalg.vector_norm(t.grad.detach(), dtype=torch.float32) ** 2)))

    def _raw_norm(self) -> torch.Tensor | None:
        """The norm of this step's gradients before any clipping (on the device), or None when not
        watched or no backward ran; resets for the next step."""
        if not self._raw:
            return None
        out = torch.stack(list(self._raw.values())).sum().sqrt()
        self._raw.clear()
        return out

    def close(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.optimizer = None

    def __enter__(self) -> StepHooks:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Controller(StepHooks):
    """A detector (or ``{signal: detector}``) and a :class:`Policy` (or a bare :class:`Action`).

    Args:
        detector: one detector fed with ``signal``, or a mapping ``signal -> detector``; an alarm
            of any of them triggers the policy. Signals: ``grad_norm``, ``loss``, ``meta`` (a
            :class:`~stabstudy.online.MetaDetector` of the Monitor's previous row).
        policy: what to do on an alarm.
        signal: the signal of a single detector.
        log: feed ``log10`` of the scalar signals (the detectors of notebook 04 read log-scaled norms).
        warmup: steps before the controller may act (the detectors still learn).
        ref_window: non-alarm gradient norms kept as the adaptive clip's reference.

    Use: ``ctrl = Controller(RobustZ(side="up"), Skip()).attach(opt)``; per step, optionally
    ``ctrl.observe(loss)`` before ``opt.step()``; ``ctrl.records()`` at the end.
    """

    def __init__(self, detector: Detector | Mapping[str, Detector], policy: Policy | Action, *,
                 signal: str = "grad_norm", log: bool = False, warmup: int = 0, ref_window: int = 64,
                 name: str = "controller"):
        self.detectors = dict(detector) if isinstance(detector, Mapping) else {signal: detector}
        bad = set(self.detectors) - set(SIGNALS)
        if bad:
            raise ValueError(f"unknown signal(s) {sorted(bad)}; valid: {', '.join(SIGNALS)}")
        self.policy = policy if isinstance(policy, Policy) else Policy(policy)
        self.log, self.warmup, self.name = log, warmup, name
        self._ref: deque[float] = deque(maxlen=ref_window)
        self._clips = False
        for a in self.policy.actions:
            if isinstance(a, AdaptiveClip):
                a.reference = self.reference
                self._clips = True
        self._handles: list[Any] = []
        self._loss: float = math.nan
        self._row: Mapping[str, float] | None = None  # the Monitor's previous row, for the meta signal
        self._step: int | None = None  # the learner's step, when observe() names it
        self._count = 0  # steps seen
        self._acted: dict[int, int] = {}  # step -> action code
        self.scores: dict[int, float] = {}  # step -> largest finite score of its detectors
        self.optimizer: torch.optim.Optimizer | None = None
        #: the latest step's decision: the largest finite score of its detectors (NaN: none), whether
        #: one alarmed, the action's code (0: none)
        self.last: tuple[float, bool, int] = (math.nan, False, 0)

    # -- attaching ----------------------------------------------------------------------
    def attach(self, optimizer: torch.optim.Optimizer, monitor: Any = None, *,
               before_clip: bool = False) -> Controller:
        """Hook into ``optimizer`` (through ``monitor``'s pre-step view when given: the Monitor
        must watch that optimizer). ``before_clip``: the detectors judge the gradient norm as
        ``backward()`` left it (see the module docstring). Returns self."""
        if self.optimizer is not None:
            raise RuntimeError("this controller is attached already; build one per optimizer")
        if "meta" in self.detectors and monitor is None:
            raise ValueError("the 'meta' signal is the Monitor's previous row: attach(optimizer, monitor)")
        self.optimizer = optimizer
        if before_clip:
            self._watch_raw(optimizer)
        if monitor is not None:
            self._log_to(monitor, self.logged_actions())

            def via_monitor(opt, stats):
                if opt is optimizer:
                    if "meta" in self.detectors:  # the previous update's row is complete, this one's not yet
                        self._row = monitor.row(stats.step - 1) if stats.step > 0 else None
                    # the norm the optimizer is about to get: what the actions rescale (and the
                    # detectors judge, unless they read the norm before clipping: _watch_raw)
                    self._pre(opt, stats.grad_norm_applied)
                    score, alarm, code = self.last
                    monitor.log(step=stats.step, controller_score=score, controller_alarm=float(alarm),
                                controller_action=float(code))
            self._handles.append(monitor.add_pre_step_hook(via_monitor))
        else:
            self._handles.append(optimizer.register_step_pre_hook(lambda opt, args, kwargs: self._pre(opt, None)))
        self._handles.append(optimizer.register_step_post_hook(lambda opt, args, kwargs: self._post(opt)))
        return self

    def observe(self, loss: Any = None, step: int | None = None) -> None:
        """Give this step's loss (a float or tensor; read as a float only when a detector reads
        ``loss``) and/or its index, before ``optimizer.step()``."""
        if loss is not None and "loss" in self.detectors:
            self._loss = float(loss.detach() if isinstance(loss, torch.Tensor) else loss)
        if step is not None:
            self._step = int(step)

    def logged_actions(self) -> list[Action]:
        """The actions whose codes this controller logs (its policy's)."""
        return self.policy.actions

    # -- per step -----------------------------------------------------------------------
    def reference(self) -> float:
        """Median gradient norm of the recent steps that did not alarm (NaN before any)."""
        return float(np.median(self._ref)) if self._ref else math.nan

    def _current_step(self) -> int:
        return self._step if self._step is not None else self._count

    def _pre(self, opt: torch.optim.Optimizer, grad_norm: torch.Tensor | None) -> None:
        params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
        raw = self._raw_norm()
        # the norm of the gradient the optimizer gets: the detector's input unless it reads the
        # pre-clip norm, and the adaptive clip's; otherwise not worth a pass over the gradients
        if grad_norm is None and (raw is None or self._clips):
            if not params:
                return
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        g = float(grad_norm) if grad_norm is not None else math.nan
        values = {"grad_norm": g if raw is None else float(raw), "loss": self._loss, "meta": self._row}
        alarm, worst = False, -math.inf
        for sig, det in self.detectors.items():  # every detector sees every step
            v = values[sig]
            if v is None:  # the first update has no previous row
                continue
            if self.log and sig != "meta":
                v = math.log10(v) if v > 0 else (math.nan if math.isfinite(v) else v)
            score = det.update(v)
            if det.alarm(score):
                alarm = True
            if math.isfinite(score):
                worst = max(worst, score)
        step = self._current_step()
        if worst > -math.inf:
            self.scores[step] = worst
        ctx = StepContext(opt, step, g, params)
        action = self.policy.choose(alarm) if self._count >= self.warmup else None
        if action is not None:
            action.apply(ctx)
            self._acted[step] = action.code
        elif math.isfinite(g):
            self._ref.append(g)
        self.last = (worst if worst > -math.inf else math.nan, alarm, action.code if action is not None else 0)
        for a in self.policy.actions:
            a.before(ctx)

    def _post(self, opt: torch.optim.Optimizer) -> None:
        step = self._current_step()
        for a in self.policy.actions:
            a.after(opt, step)
        self._count += 1
        self._loss = math.nan
        self._step = None

    # -- records ------------------------------------------------------------------------
    @property
    def n_actions(self) -> int:
        return len(self._acted)

    def records(self, steps: int | None = None) -> dict[str, np.ndarray]:
        """``intervened`` (0/1) and ``action`` (codes) for steps ``0 .. steps - 1`` (default: every
        step seen)."""
        n = steps if steps is not None else max([self._count - 1, *self._acted]) + 1
        return as_records(self._acted, n)

    def attrs(self) -> dict[str, Any]:
        """What describes the controller in a run's attributes (rollback cost included)."""
        out: dict[str, Any] = {"controller_policy": self.policy.describe(),
                               "controller_detectors": ", ".join(f"{type(d).__name__}({s}) > {d.threshold:g}"
                                                                 for s, d in self.detectors.items())}
        for a in self.policy.actions:
            if hasattr(a, "cost_s"):
                out.update(rollback_cost_s=float(a.cost_s), rollback_bytes=int(a.bytes),
                           rollback_restored=int(a.restored))
        return out
