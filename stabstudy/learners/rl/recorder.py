"""The :class:`Recorder`: what the callbacks of :mod:`stabstudy.learners.rl.callbacks` share.

It counts updates, marks where each ``train()`` call ended, holds the records the
callbacks file per row and the run's status, runs the work that must happen in a
fixed order whatever the order of the callbacks, and builds the Dataset (its step
axis is described in :mod:`stabstudy.learners.rl.callbacks`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import xarray as xr
from stable_baselines3.common.base_class import BaseAlgorithm

from stabstudy import registry
from stabstudy.instruments.telemetry import Monitor
from stabstudy.interventions.perturb import Schedule
from stabstudy.learners.rl.envs import ENV_KINDS
from stabstudy.registry import ON_POLICY

#: Channels every RL Dataset carries from the callbacks (beside the Monitor's): the registry's
#: ``rl`` channels carried always, with the shared ``perf`` and ``loss`` the callbacks record.
RL_CHANNELS = ("perf", *registry.channel_names(source="rl", always=True), "loss")
#: Kinds that change the policy's parameters once, at their start.
PARAMETRIC_KINDS = ("weight_noise", "reinit_layer")
#: Kinds whose effect reaches an on-policy update through the rollout it trains on.
ROLLOUT_FLAGGED = ENV_KINDS + PARAMETRIC_KINDS


def optimizers_of(model: BaseAlgorithm) -> dict[str, torch.optim.Optimizer]:
    """Every optimizer of an SB3 algorithm, named: ``policy`` (PPO/A2C), ``actor``,
    ``critic``, ``ent_coef`` (SAC with learned entropy coefficient)."""
    opts: dict[str, torch.optim.Optimizer] = {}
    if getattr(model, "actor", None) is not None and hasattr(model.actor, "optimizer"):
        opts["actor"] = model.actor.optimizer
        opts["critic"] = model.critic.optimizer
        if getattr(model, "ent_coef_optimizer", None) is not None:
            opts["ent_coef"] = model.ent_coef_optimizer
    else:
        opts["policy"] = model.policy.optimizer
    return opts


def exploding(v: float, threshold: float) -> bool:
    """Non-finite, or beyond ``threshold`` in absolute value."""
    return not math.isfinite(v) or abs(v) > threshold


class Recorder:
    """What the callbacks of one ``learn()`` call share, and the Dataset they build.

    It counts updates (a post-hook on the optimizer that steps every round: the critic,
    or PPO/A2C's policy), marks the env step at which each ``train()`` call ended, and
    holds the records the callbacks file per row (:meth:`row`), the Monitor, the
    schedule (for the ``perturbed`` channel) and the status (:meth:`diverge`).

    Some work must happen in a fixed order whatever the order of the callbacks in the
    ``CallbackList``; the callbacks register it here, the recorder runs it:

    * after each ``train()`` call (:meth:`train_ended`, called by every callback at
      rollout start and training end; it runs once per call): the :meth:`on_train_end`
      handlers by phase, diagnostics (:attr:`DIAGNOSE`) before checks (:attr:`CHECK`);
    * before a parametric perturbation changes the weights (:meth:`parameters_changing`):
      the :meth:`on_parameter_change` handlers (an evaluation due at that env step);
    * after each evaluation (:meth:`evaluated`): the :meth:`on_evaluation` handlers.

    Args:
        log_every: keep every this many Monitor rows in :meth:`to_dataset` (rows with
            evaluation, episode or diagnostic records are always kept).
    """

    DIAGNOSE = 0
    CHECK = 1

    def __init__(self, log_every: int = 1):
        self.log_every = max(1, int(log_every))
        self.schedule = Schedule()
        self.monitor: Monitor | None = None
        self.rows: dict[int, dict[str, float]] = {}
        self.episode_returns: dict[int, list[float]] = {}
        #: update rounds completed
        self.n_updates = 0
        #: train() calls that made at least one update
        self.train_calls = 0
        self.seg_end: list[int] = [0]  # last update index of each train() call ...
        self.seg_env: list[int] = [0]  # ... and the env step it happened at
        #: updates before this recorder's learn() call (a fork continues its prefix's numbering)
        self.start_update = 0
        #: a weight_noise / reinit_layer happened since the last update
        self.parametric_pending = False
        self.diverged = False
        self.diverge_reason = ""
        self.algo = ""
        self.on_policy = False
        self._model: BaseAlgorithm | None = None
        self._handles: list[Any] = []
        self._closed = False
        self._seen_updates = 0
        self._after_train: list[tuple[int, Callable[[int], None]]] = []
        self._before_change: list[Callable[[], None]] = []
        self._after_eval: list[Callable[[float], None]] = []

    # -- registration -------------------------------------------------------------
    def on_train_end(self, fn: Callable[[int], None], phase: int) -> None:
        """Run ``fn(n_updates)`` after each ``train()`` call, after the handlers of earlier phases."""
        self._after_train.append((phase, fn))
        self._after_train.sort(key=lambda h: h[0])

    def on_parameter_change(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` before a parametric perturbation changes the policy's weights."""
        self._before_change.append(fn)

    def on_evaluation(self, fn: Callable[[float], None]) -> None:
        """Run ``fn(perf)`` after each evaluation."""
        self._after_eval.append(fn)

    # -- lifecycle ----------------------------------------------------------------
    def attach(self, model: BaseAlgorithm) -> None:
        """Start following ``model`` (every callback calls this; the first call does the work)."""
        if self._closed:
            raise RuntimeError("this Recorder already recorded a learn() call; make new callbacks and a new "
                               "Recorder for another one")
        if self._model is model:
            return
        if self._model is not None:
            raise ValueError("a Recorder and its callbacks follow one model")
        self._model = model
        self.algo = type(model).__name__.lower()
        self.on_policy = self.algo in ON_POLICY or not hasattr(model, "replay_buffer")
        opts = optimizers_of(model)
        self._handles.append(opts.get("critic", opts.get("policy")).register_step_post_hook(self._count))

    def resume(self, n_updates: int, train_calls: int, env_step: int) -> None:
        """Continue the numbering of an earlier ``learn()`` call (a fork): its update and
        ``train()`` counts and the env step it ended at; before training starts."""
        if self._model is not None:
            raise RuntimeError("resume() a Recorder before its callbacks start")
        self.start_update = self.n_updates = self._seen_updates = int(n_updates)
        self.train_calls = int(train_calls)
        self.seg_end, self.seg_env = [int(n_updates)], [int(env_step)]

    def _count(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.n_updates += 1
        self.parametric_pending = False

    def train_ended(self) -> None:
        """Mark the end of a ``train()`` call and run the :meth:`on_train_end` handlers
        (nothing when no update happened since the last call)."""
        n = self.n_updates
        if n == self._seen_updates or self._model is None:
            return
        self.seg_end.append(n)
        self.seg_env.append(self._model.num_timesteps)
        self._seen_updates = n
        self.train_calls += 1
        for _, fn in self._after_train:
            fn(n)

    def parameters_changing(self) -> None:
        """Run the :meth:`on_parameter_change` handlers."""
        for fn in self._before_change:
            fn()

    def evaluated(self, perf: float) -> None:
        """Run the :meth:`on_evaluation` handlers."""
        for fn in self._after_eval:
            fn(perf)

    def close(self) -> None:
        """Remove the update counter (the records stay); the recorder takes no further ``learn()``."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._closed = self._model is not None

    # -- records ------------------------------------------------------------------
    def row(self, step: int) -> dict[str, float]:
        """The records of row ``step`` (updates completed), created empty when absent."""
        return self.rows.setdefault(step, {})

    def diverge(self, reason: str) -> None:
        """Mark the run diverged (the first reason is kept); the callbacks then stop training."""
        if not self.diverged:
            self.diverged = True
            self.diverge_reason = reason

    def to_dataset(self) -> xr.Dataset:
        """All rows: dim ``step`` (updates completed; a fork's first row is its prefix's last
        update), coordinate ``env_step``."""
        rows = {s: dict(r) for s, r in self.rows.items()}
        for s, eps in self.episode_returns.items():
            rows.setdefault(s, {})["episode_return"] = float(np.mean(eps))
        mon_ds = None
        if self.monitor is not None:
            mon_ds = self.monitor.to_dataset(stored=True)
            mon_ds = mon_ds.assign_coords(step=mon_ds.step.values + 1 + self.start_update)
        steps = set(rows) | {self.start_update}
        if mon_ds is not None:
            mon_steps = mon_ds.step.values
            if self.log_every > 1:  # rows with RL records are kept whatever their index
                mon_steps = mon_steps[mon_steps % self.log_every == 0]
            steps |= set(int(s) for s in mon_steps)
        steps_arr = np.array(sorted(steps), dtype=np.int64)
        chans = list(dict.fromkeys(RL_CHANNELS + tuple(k for r in rows.values() for k in r)))
        data = {c: ("step", np.array([rows.get(int(s), {}).get(c, np.nan) for s in steps_arr], dtype=np.float64))
                for c in chans}
        ds = xr.Dataset(data, coords={"step": steps_arr})
        if mon_ds is not None:
            mon_ds = mon_ds.reindex(step=steps_arr)
            for v in mon_ds.data_vars:
                if v in ds and v in RL_CHANNELS:
                    continue
                ds[v] = mon_ds[v]
            ds.attrs.update(mon_ds.attrs)
        # env step of row s: that of the train() call containing update s (row 0: 0)
        ends, envs = np.asarray(self.seg_end), np.asarray(self.seg_env)
        idx = np.minimum(np.searchsorted(ends, steps_arr, side="left"), len(ends) - 1)
        env = envs[idx]
        ds = ds.assign_coords(env_step=("step", env.astype(np.int64)))
        # an on-policy update trains on the rollout of env steps (prev, env]: it is perturbed
        # when that rollout overlapped the window of a kind that acts through the data
        prev = np.where(idx > 0, envs[np.maximum(idx - 1, 0)], env)
        mask = np.zeros(env.size)
        for p in self.schedule.perturbations:
            if self.on_policy and p.kind in ROLLOUT_FLAGGED:
                mask[(idx > 0) & (p.start <= env) & (p.end > prev + 1)] = 1.0
            else:
                mask[(env >= p.start) & (env < p.end)] = 1.0
        ds["perturbed"] = ("step", mask)
        # a ControllerCallback files the updates it acted on; every other row (and run) acted on none
        ds["intervened"] = ("step", np.nan_to_num(ds["intervened"].values) if "intervened" in ds
                            else np.zeros(ds.sizes["step"]))
        ds["step"].attrs["long_name"] = "gradient updates completed"
        ds["env_step"].attrs["long_name"] = "environment steps consumed"
        return registry.annotate(ds)
