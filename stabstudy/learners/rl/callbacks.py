"""Composable stable-baselines3 callbacks: telemetry, perturbations, evaluation, diagnostics, divergence.

Each callback does one job; the callbacks of one ``learn()`` call share a
:class:`Recorder` (the rows they file, the update count, the status) and are
composed with SB3's ``CallbackList``, in any order::

    rec = Recorder()
    cb = CallbackList([TelemetryCallback(rec), PerturbationCallback(rec, schedule),
                       EvaluationCallback(rec, make_eval_env("Pendulum-v1"), every=1000),
                       DiagnosticsCallback(rec), DivergenceCallback(rec), EpisodeReturnCallback(rec)])
    model.learn(10_000, callback=cb)
    ds = rec.to_dataset()

* :class:`TelemetryCallback`: the :class:`~stabstudy.instruments.telemetry.Monitor` on every SB3 optimizer;
* :class:`PerturbationCallback`: the schedule's ``lr_spike`` and ``lr_ramp`` through optimizer hooks,
  ``weight_noise`` / ``reinit_layer`` at their env step;
* :class:`EvaluationCallback`: deterministic evaluation every N env steps on its own seeded env (``perf``);
* :class:`DiagnosticsCallback`: per-``train()`` diagnostics (``entropy``, ``approx_kl``, ``q_mean``, ...);
* :class:`DivergenceCallback`: marks the run diverged on non-finite / exploding values, which stops training;
* :class:`EpisodeReturnCallback`: true returns of the finished training episodes.
* :class:`ControllerCallback`: closed-loop control (:mod:`stabstudy.interventions.control`) of the
  optimizer the updates are counted by, its actions filed per update.

:class:`RecorderCallback` is their base: subclass it for a callback of your own that
shares the recorder.

Every callback closes itself (hooks removed, an applied lr factor undone) at the end of
``learn()``; after an exception, call each callback's ``close`` and :meth:`Recorder.close`
(:func:`stabstudy.learners.rl.learner.close_callbacks`).
A Recorder and its callbacks serve one ``learn()`` call.

Step axis and timing
--------------------
* Perturbation windows ``[start, start + duration)`` are in **environment steps**
  (``model.num_timesteps``; one training env).
* The Dataset dimension ``step`` counts **gradient updates completed**: row ``s``
  describes the state after ``s`` updates; ``step = 0`` is the untrained policy.
  Optimizer channels (``grad_norm``, ``lr``, ...) at row ``s`` describe the ``s``-th
  update. One update = one round of the algorithm's optimizers (SAC: entropy
  coefficient, critic, actor; TD3: critic and, every ``policy_delay`` rounds, actor;
  PPO/A2C: one minibatch step).
* Coordinate ``env_step`` (along ``step``): environment steps consumed when the
  update happened (0 for row 0).
* ``perf`` = mean undiscounted return of ``episodes`` deterministic episodes on the
  evaluation env (episode ``i`` of every evaluation resets with seed ``seed + i``, so
  every evaluation sees the same initial states), every ``every`` env steps, at the
  start and at the end (the policy after the last update: a run's curve reaches its last
  env step), written on the row of the updates completed at that time (NaN
  elsewhere). Two evaluations between the same two updates (PPO within a rollout,
  off-policy before ``learning_starts``) evaluate the same policy; the later one is
  kept. ``perf_env_step`` says when each was measured, ``perf_std`` the standard deviation
  of its episodes' returns (NaN with one episode). An evaluation between a
  ``weight_noise`` / ``reinit_layer`` and the next update is skipped (that row's env
  step and ``perturbed`` flag lie before the event); one due at the event's env step
  runs before the event. ``episode_return`` = mean true (unscaled) training-episode
  return of the episodes finished at that row.
* ``grad_norm`` etc. are measured at ``optimizer.step()``, i.e. *after* SB3's gradient
  clipping (PPO/A2C ``max_grad_norm = 0.5``): for those the channel saturates at the
  clip value, as in every stored run; ``grad_norm_raw`` is the global norm before the
  clipping (the Monitor reads it where ``backward()`` left the gradient:
  :mod:`stabstudy.instruments.telemetry.backward`). SAC/TD3 do not clip: there the two are
  equal. SB3's logger gets the Monitor's own names (``stability/grad_norm`` before clipping,
  ``stability/grad_norm_applied`` after).
* Per-``train()`` diagnostics are written on the last row of each ``train()`` call.
  Off-policy: read every ``every`` train calls (cost knob). Channels an algorithm does
  not have are NaN (``approx_kl``/``clip_fraction``: PPO only; ``q_mean``:
  SAC/TD3/DDPG; ``entropy``: PPO/A2C (SB3's ``-entropy_loss``) and SAC (Monte-Carlo
  estimate of the squashed Gaussian's entropy on the most recent replay observations
  with a private RNG); NaN for the deterministic TD3/DDPG policies).

Perturbations
-------------
* ``lr_spike``: every optimizer's learning rate is multiplied by ``dose`` for each
  optimizer step taken while ``num_timesteps`` is in the window, in an optimizer step
  pre-hook, i.e. *after* SB3's own ``_update_learning_rate``, so it truly applies.
  On-policy algorithms update only at rollout ends (every ``n_steps`` env steps): a
  window must contain a rollout end to have any effect. SAC's entropy-coefficient
  optimizer is left out unless ``spike_ent_coef`` (so the dose is the same across
  algorithms: the networks' optimizers only; before, it was spiked too, and stored SAC lr-spike
  runs of that rule are recomputed: :func:`stabstudy.learners.rl.learner.stale`).
* ``lr_ramp``: the same hooks with the ramp's factor at the env step of each optimizer step: it
  climbs geometrically from 1 to ``dose`` over the window and stays at ``dose`` after it (a
  disturbance that does not go away; ``perturbed`` marks the climb). PPO's factor is the one at its
  rollout end, so its window must contain rollout ends to climb in more than one step.
* ``weight_noise``: once, at the first env step >= ``start``: Gaussian noise of
  relative std ``dose`` on every policy parameter
  (:func:`stabstudy.interventions.perturb.add_weight_noise`).
* ``reinit_layer``: once, at ``start``; ``params={"layer": <policy submodule>}``.
* ``action_noise``, ``obs_noise``, ``reward_scale`` act through the wrapper of
  :func:`stabstudy.learners.rl.envs.make_env`; the callback only warns when the
  training env lacks it. Rows are flagged ``perturbed`` for every kind. With
  ``purge_replay`` (off-policy), the transitions such a window touched (its env steps; for
  ``obs_noise`` one more, which starts from its last noisy observation; overlapping windows
  merged) leave the replay buffer when it ends (:func:`stabstudy.learners.rl.replay.drop_latest`:
  sampling never reaches them again, also in a buffer that had wrapped, whose older transitions
  they overwrote are gone): afterwards the learner trains on unperturbed data only, as PPO does
  once it discards the rollout. Only a window that alone fills the buffer is kept (removing it
  would leave nothing to sample); ``replay_purged`` / ``replay_kept`` count both. PPO normalises
  its advantages, so a reward factor reaches its policy update only through the value loss.

Divergence: non-finite or exploding (``> threshold``) losses, gradient norms, Q values,
evaluation returns or parameters stop training at the env step they are found; the
Recorder says ``diverged`` and why.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import xarray as xr
from stable_baselines3.common.callbacks import BaseCallback

from stabstudy.instruments.precision import all_finite
from stabstudy.instruments.telemetry import Monitor
from stabstudy.interventions.control import Controller, OlmoSkip
from stabstudy.interventions.perturb import Perturbation, Schedule, add_weight_noise, reinit_layer
from stabstudy.learners.rl.envs import ENV_KINDS, env_wrapper
from stabstudy.learners.rl.recorder import PARAMETRIC_KINDS, Recorder, exploding, optimizers_of
from stabstudy.learners.rl.replay import drop_latest, stored, touched_windows

#: Kinds that act through the learning rate (:meth:`~stabstudy.interventions.perturb.Schedule.lr_factor`).
LR_KINDS = ("lr_spike", "lr_ramp")
#: Default seed of an :class:`EvaluationCallback`'s first episode (the learner adds the run's seed).
EVAL_SEED_OFFSET = 10_000


class RecorderCallback(BaseCallback):
    """Base of the callbacks here: shares a :class:`Recorder` (``recorder``; None: a new one),
    ends ``train()`` segments, stops training once the recorder says diverged, closes itself
    at training end. Subclasses override ``_on_step`` returning ``super()._on_step()``,
    ``_training_end`` and ``close``."""

    def __init__(self, recorder: Recorder | None = None, verbose: int = 0):
        super().__init__(verbose)
        self.recorder = recorder if recorder is not None else Recorder()

    def _init_callback(self) -> None:
        self.recorder.attach(self.model)

    def _on_rollout_start(self) -> None:
        self.recorder.train_ended()

    def _on_step(self) -> bool:
        # every callback says stop, not only the one that found the divergence: a CallbackList
        # runs all of them and stops when any does, so training stops at the env step it was
        # found whatever their order
        return not self.recorder.diverged

    def _on_training_end(self) -> None:
        self.recorder.train_ended()
        self._training_end()
        self.close()
        self.recorder.close()

    def _training_end(self) -> None:
        """This callback's own work at the end of ``learn()`` (after the last train() handlers)."""

    def close(self) -> None:
        """Remove this callback's hooks (idempotent)."""

    def to_dataset(self) -> xr.Dataset:
        """The shared recorder's :meth:`Recorder.to_dataset`."""
        return self.recorder.to_dataset()


class TelemetryCallback(RecorderCallback):
    """The :class:`~stabstudy.instruments.telemetry.Monitor` on every optimizer of the algorithm
    (PPO/A2C: ``policy``; SAC: ``actor``, ``critic``, ``ent_coef``; TD3/DDPG: ``actor``, ``critic``).

    Args:
        recorder: the shared :class:`Recorder` (None: a new one, :attr:`recorder`).
        every: the Monitor's ``every`` (costly channels every this many steps of each optimizer).
        log_to_sb3: record the latest update's channels in SB3's own logger as
            ``stability/<channel>`` (NaN ones skipped) just before SB3 may dump its logs (on-policy:
            at the end of each rollout; off-policy: at an env step where an episode ended), so SB3
            writes them beside its own ``train/`` values to every output format it has
            (``tensorboard_log=``, csv, stdout, ...). Deriving the channels once per dump point,
            not once per ``train()`` call, keeps this cheap for off-policy learners that train
            every env step.
        **monitor_kwargs: further :class:`~stabstudy.instruments.telemetry.Monitor` arguments
            (``per_layer``, ``sync_every``, ``writer``).
    """

    def __init__(self, recorder: Recorder | None = None, every: int = 1, verbose: int = 0, log_to_sb3: bool = True,
                 **monitor_kwargs: Any):
        super().__init__(recorder, verbose)
        self.every = every
        self.monitor_kwargs = monitor_kwargs
        self.monitor: Monitor | None = None
        self.log_to_sb3 = log_to_sb3

    def _on_step(self) -> bool:
        # SB3's off-policy learners dump inside collect_rollouts, after this callback, at the env
        # step an episode ends (every log_interval episodes)
        if self.log_to_sb3 and not self.recorder.on_policy and np.any(self.locals.get("dones", False)):
            self._record_in_sb3_logger()
        return super()._on_step()

    def _on_rollout_end(self) -> None:
        # SB3's on-policy learners dump after the rollout, before the next train()
        if self.log_to_sb3 and self.recorder.on_policy:
            self._record_in_sb3_logger()

    def _record_in_sb3_logger(self) -> None:
        mon = self.monitor
        if mon is None or mon.step < 0:
            return
        for k, v in mon.row().items():
            if v == v:
                self.logger.record(f"stability/{k}", v)

    def _on_training_start(self) -> None:
        # here, not in _init_callback: SB3 initialises every callback of a CallbackList before it
        # starts any, so the lr-spike hooks (installed at init) run before the Monitor's and it
        # records the lr actually applied
        if self.recorder.monitor is not None:
            raise ValueError("this Recorder already has a Monitor: one TelemetryCallback per Recorder")
        self.monitor = Monitor(self.model.policy, optimizers_of(self.model), every=self.every, **self.monitor_kwargs)
        self.recorder.monitor = self.monitor

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()


class PerturbationCallback(RecorderCallback):
    """Applies a perturbation schedule (timed in env steps): ``lr_spike`` and ``lr_ramp`` through
    optimizer step hooks, ``weight_noise`` / ``reinit_layer`` once at their start. Env-side kinds
    need the wrapper of :func:`stabstudy.learners.rl.envs.make_env` (warned when absent).

    Args:
        recorder: the shared :class:`Recorder` (None: a new one); it gets the schedule.
        schedule: a :class:`~stabstudy.interventions.perturb.Schedule` or perturbations.
        seed: seeds the private generator of each parametric event (with the event's start).
        spike_ent_coef: the lr spike also scales SAC's entropy-coefficient optimizer.
        purge_replay: off-policy: transitions of an env-side window leave the replay buffer when it ends.
    """

    def __init__(self, recorder: Recorder | None = None, schedule: Schedule | Sequence[Perturbation] = (),
                 seed: int = 0, verbose: int = 0, spike_ent_coef: bool = False, purge_replay: bool = True):
        super().__init__(recorder, verbose)
        self.spike_ent_coef = bool(spike_ent_coef)
        self.purge_replay = bool(purge_replay)
        self.replay_purged = 0  # perturbed transitions removed from the replay buffer when their window ended
        self.replay_kept = 0  # perturbed transitions kept (they were all the buffer held, or the count did not match)
        self.schedule = schedule if isinstance(schedule, Schedule) else Schedule(tuple(schedule))
        self._touched = touched_windows([(p.kind, p.start, p.end) for p in self.schedule.perturbations
                                         if p.kind in ENV_KINDS])
        self._marks: dict[int, int] = {}  # touched interval's start -> the buffer's write position then
        if self.recorder.schedule.perturbations:
            raise ValueError("this Recorder already has a schedule: one PerturbationCallback per Recorder")
        self.recorder.schedule = self.schedule
        self.seed = int(seed)
        self._fired: set[int] = set()
        self._opts: dict[str, torch.optim.Optimizer] = {}
        self._handles: list[Any] = []
        self._applied: dict[tuple[int, int], tuple[float, float]] = {}  # (base lr, lr we wrote)

    def _init_callback(self) -> None:
        super()._init_callback()
        env_kinds = sorted({p.kind for p in self.schedule.perturbations} & set(ENV_KINDS))
        if env_kinds and env_wrapper(self.training_env) is None:
            warnings.warn(f"PerturbationCallback: the schedule has env-side perturbations {env_kinds}; they act only "
                          "through the wrapper of stabstudy.learners.rl.make_env, which this training env lacks",
                          stacklevel=2)
        # at init, before any callback starts: see TelemetryCallback._on_training_start
        if not self._handles and any(p.kind in LR_KINDS for p in self.schedule.perturbations):
            every = optimizers_of(self.model)
            self._opts = {k: o for k, o in every.items() if k != "ent_coef" or self.spike_ent_coef}
            # hooked on every optimizer, spiked or not: SAC's entropy optimizer steps first in a round,
            # and the factor must be in place on the others by then (the Monitor reads their lr there)
            for opt in every.values():
                self._handles.append(opt.register_step_pre_hook(self._lr_pre))

    def _lr_pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Before any optimizer step: every optimizer's lr = (lr SB3 set) x spike factor.

        Applied to all optimizers at once (so a Monitor reading the primary's lr
        during another optimizer's step sees the applied value); a value SB3
        reset in ``_update_learning_rate`` is recognised (it differs from what we
        wrote) and becomes the new base.
        """
        f = self.schedule.lr_factor(self.model.num_timesteps)
        if f == 1.0 and not self._applied:
            return
        for o in self._opts.values():
            for gi, g in enumerate(o.param_groups):
                key = (id(o), gi)
                applied = self._applied.get(key)
                base = applied[0] if applied is not None and g["lr"] == applied[1] else g["lr"]
                g["lr"] = base * f
                if f != 1.0:
                    self._applied[key] = (base, g["lr"])
                else:
                    self._applied.pop(key, None)

    def _on_step(self) -> bool:
        t = self.model.num_timesteps
        if self.purge_replay and getattr(self.model, "replay_buffer", None) is not None:
            self._purge(t)
        due = [p for p in self.schedule.perturbations
               if p.kind in PARAMETRIC_KINDS and t >= p.start and id(p) not in self._fired]
        if due:
            self.recorder.parameters_changing()
        for p in due:
            self._fired.add(id(p))
            self._apply(p)
            self.recorder.parametric_pending = True
        return super()._on_step()

    def _purge(self, t: int) -> None:
        """Called after env step ``t - 1`` was taken, before its transition is stored (SB3 stores it
        after the callbacks): at ``t = a + 1`` note the buffer's write position (the touched
        interval's first transition goes there), at ``t = b + 1`` (its last one stored) drop the
        latest ``b - a`` (:func:`~stabstudy.learners.rl.replay.drop_latest`) once the position
        says that many were written since."""
        rb = self.model.replay_buffer
        for a, b in self._touched:
            if t == a + 1:
                self._marks[a] = int(rb.pos)
            elif t == b + 1 and a in self._marks:
                n = b - a
                if (int(rb.pos) - self._marks.pop(a) - n) % rb.buffer_size == 0 and drop_latest(rb, n) == n:
                    self.replay_purged += n
                else:
                    self.replay_kept += n
                    warnings.warn(f"PerturbationCallback: kept the {n} transitions of env steps [{a}, {b}) in the "
                                  f"replay buffer (it holds {stored(rb)}; removing them would leave it empty, or "
                                  "they were not the latest written)", RuntimeWarning, stacklevel=2)

    def _apply(self, p: Perturbation) -> None:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + p.start)
        policy = self.model.policy
        if p.kind == "weight_noise":
            add_weight_noise(policy, p.dose, gen)
            return
        layer = p.p.get("layer")
        if layer is None:
            names = [n for n, _ in policy.named_modules() if n]
            raise ValueError(f"reinit_layer needs params={{'layer': ...}}; policy submodules: {', '.join(names[:30])}")
        reinit_layer(policy, layer, p.dose, gen)

    def close(self) -> None:
        """Remove the hooks and undo a still-applied lr factor."""
        for o in self._opts.values():
            for gi, g in enumerate(o.param_groups):
                applied = self._applied.pop((id(o), gi), None)
                if applied is not None and g["lr"] == applied[1]:
                    g["lr"] = applied[0]
        for h in self._handles:
            h.remove()
        self._handles.clear()


class EvaluationCallback(RecorderCallback):
    """Mean return of the deterministic policy on its own env (``perf``): at the start,
    every ``every`` env steps and at the end, filed in the row of the updates completed.

    Args:
        recorder: the shared :class:`Recorder` (None: a new one).
        eval_env: a gymnasium env (not vectorised, no perturbation wrappers), or one per episode: the
            episodes of an evaluation then step side by side, one batched ``predict`` per step (a
            single env runs them one after another). Both give the same returns up to the last
            bits of the batched forward pass.
        every: evaluate every this many env steps (0: only at start and end).
        episodes: episodes per evaluation.
        seed: episode ``i`` of each evaluation resets with ``seed + i``.
    """

    def __init__(self, recorder: Recorder | None, eval_env: Any, every: int = 0, episodes: int = 2,
                 seed: int = EVAL_SEED_OFFSET, verbose: int = 0):
        super().__init__(recorder, verbose)
        self.eval_envs = list(eval_env) if isinstance(eval_env, (list, tuple)) else [eval_env]
        if len(self.eval_envs) not in (1, int(episodes)):
            raise ValueError(f"EvaluationCallback needs one eval env or one per episode ({episodes}), "
                             f"got {len(self.eval_envs)}")
        self.every = int(every)
        self.episodes = int(episodes)
        self.seed = int(seed)
        self._last_env_step = -1
        self._last_updates = -1
        # an evaluation due at the env step of a parametric event sees the policy before it,
        # whichever of the two callbacks comes first in the list
        self.recorder.on_parameter_change(self._evaluate_if_due)

    def _on_training_start(self) -> None:
        self._evaluate()  # step 0: the untrained policy

    def _on_step(self) -> bool:
        self._evaluate_if_due()
        return super()._on_step()

    def _evaluate_if_due(self) -> None:
        t = self.model.num_timesteps
        if self.every and t % self.every == 0 and t != self._last_env_step:
            self._evaluate()

    def _training_end(self) -> None:
        # the policy after the last update: an evaluation due at the last env step ran before the
        # train() call that follows it (PPO's last rollout, an off-policy learner's last train call)
        t, n = self.model.num_timesteps, self.recorder.n_updates
        if (self._last_env_step != t or self._last_updates != n) and not self.recorder.diverged:
            self._evaluate()

    def _evaluate(self) -> None:
        """Return of the deterministic policy, filed in row ``n_updates`` (the policy after
        that many updates). Skipped between a ``weight_noise`` / ``reinit_layer`` and the
        next update: the policy then is not the one of that row (whose env step and
        ``perturbed`` flag lie before the event); the damage shows from the first
        evaluation after the next update."""
        if self.recorder.parametric_pending:
            return
        t = self.model.num_timesteps
        self._last_env_step, self._last_updates = t, self.recorder.n_updates
        try:
            batches = [range(self.episodes)] if len(self.eval_envs) > 1 else [[i] for i in range(self.episodes)]
            rets = [r for b in batches for r in self._episodes(list(b))]
            perf = float(np.mean(rets))
            spread = float(np.std(rets, ddof=1)) if len(rets) > 1 else math.nan
        except Exception as e:  # a NaN policy can crash the simulator
            perf = spread = math.nan
            self.recorder.diverge(f"evaluation failed: {type(e).__name__}: {e}")
        row = self.recorder.row(self.recorder.n_updates)
        row["perf"] = perf
        row["perf_std"] = spread
        row["perf_env_step"] = float(t)
        self.recorder.evaluated(perf)

    def _episodes(self, idx: list[int]) -> list[float]:
        """Returns of the episodes ``idx`` (episode ``i`` on env ``i`` of several, or all on the one
        env), stepped side by side: one ``predict`` for the envs still running."""
        envs = [self.eval_envs[i] if len(self.eval_envs) > 1 else self.eval_envs[0] for i in idx]
        norm = self.model.get_vec_normalize_env()  # the policy sees normalised observations
        obs = [env.reset(seed=self.seed + i)[0] for env, i in zip(envs, idx, strict=True)]
        rets, live = [0.0] * len(idx), list(range(len(idx)))
        while live:
            batch = np.stack([obs[j] for j in live])
            actions, _ = self.model.predict(norm.normalize_obs(batch) if norm is not None else batch,
                                            deterministic=True)
            still = []
            for j, a in zip(live, actions, strict=True):
                obs[j], r, term, trunc, _ = envs[j].step(a)
                rets[j] += float(r)
                if not (term or trunc):
                    still.append(j)
            live = still
        return rets


class DiagnosticsCallback(RecorderCallback):
    """RL diagnostics after ``train()`` calls, on their last row: PPO/A2C ``entropy``,
    ``approx_kl``, ``clip_fraction``, ``value_loss``, ``loss``, ``policy_std``,
    ``value_mean``, ``action_saturation`` (rollout); SAC/TD3/DDPG ``value_loss``
    (critic), ``loss``, ``actor_loss``, ``ent_coef``, ``q_mean``, ``action_saturation``
    and SAC's ``entropy`` (recent replay observations).

    Args:
        recorder: the shared :class:`Recorder` (None: a new one).
        every: off-policy: read every this many ``train()`` calls (and after the first);
            on-policy algorithms are read after every call.
        seed: seeds the private generator of SAC's entropy estimate (``seed + 7``).
    """

    def __init__(self, recorder: Recorder | None = None, every: int = 10, seed: int = 0, verbose: int = 0):
        super().__init__(recorder, verbose)
        self.every = max(1, int(every))
        self._gen = torch.Generator().manual_seed(int(seed) + 7)
        self.recorder.on_train_end(self._diagnose, Recorder.DIAGNOSE)

    @property
    def rng_state(self) -> torch.Tensor:
        """State of the private generator (a fork continues its prefix's)."""
        return self._gen.get_state()

    @rng_state.setter
    def rng_state(self, state: torch.Tensor) -> None:
        self._gen.set_state(state)

    def _diagnose(self, n: int) -> None:
        rec = self.recorder
        if not (rec.on_policy or rec.train_calls % self.every == 0 or rec.train_calls == 1):
            return
        vals = dict(getattr(self.model.logger, "name_to_value", {}))
        row = rec.row(n)

        def get(key: str) -> float:
            v = vals.get(key)
            return float(v) if v is not None else math.nan

        if rec.on_policy:
            row["entropy"] = -get("train/entropy_loss")
            row["approx_kl"] = get("train/approx_kl")
            row["clip_fraction"] = get("train/clip_fraction")
            row["value_loss"] = get("train/value_loss")
            if "train/loss" in vals:
                row["loss"] = get("train/loss")
            else:  # A2C logs no total: SB3's own objective
                m = self.model
                row["loss"] = get("train/policy_loss") + m.ent_coef * get("train/entropy_loss") + m.vf_coef * row["value_loss"]
            row["policy_std"] = get("train/std")
            self._rollout_diag(row)
        else:
            row["value_loss"] = get("train/critic_loss")
            row["loss"] = row["value_loss"]
            row["actor_loss"] = get("train/actor_loss")
            if "train/ent_coef" in vals:
                row["ent_coef"] = get("train/ent_coef")
            self._replay_diag(row)

    def _rollout_diag(self, row: dict[str, float]) -> None:
        buf = self.model.rollout_buffer
        row["value_mean"] = float(np.mean(buf.values))
        space = self.model.action_space
        if hasattr(space, "low"):
            a = np.clip(buf.actions.reshape(-1, space.shape[0]), space.low, space.high)
            scaled = 2.0 * (a - space.low) / (space.high - space.low) - 1.0
            row["action_saturation"] = float(np.mean(np.abs(scaled) > 0.99))

    def _replay_diag(self, row: dict[str, float], n_obs: int = 256) -> None:
        rb = self.model.replay_buffer
        end = rb.buffer_size if rb.full else rb.pos
        if end == 0:
            return
        idx = np.arange(max(0, end - n_obs), end) if not rb.full else (rb.pos - 1 - np.arange(min(n_obs, end))) % rb.buffer_size
        acts = rb.actions[idx, 0]
        row["action_saturation"] = float(np.mean(np.abs(acts) > 0.99))
        obs = torch.as_tensor(rb.observations[idx, 0], dtype=torch.float32)
        m = self.model
        with torch.no_grad():
            obs_t = m.policy.obs_to_tensor(obs.numpy())[0] if hasattr(m.policy, "obs_to_tensor") else obs
            actor = m.actor
            if self.recorder.algo == "sac":
                mean, log_std, _ = actor.get_action_dist_params(obs_t)
                std = log_std.exp()
                eps = torch.randn(mean.shape, generator=self._gen)
                pre = mean + std * eps
                logp = (-0.5 * eps.pow(2) - log_std - 0.5 * math.log(2 * math.pi)).sum(-1)
                logp = logp - torch.log(1 - torch.tanh(pre).pow(2) + 1e-6).sum(-1)
                row["entropy"] = float(-logp.mean())
                act = actor(obs_t, deterministic=True)
            else:
                act = actor(obs_t)
            q = m.critic(obs_t, act)[0]
            row["q_mean"] = float(q.mean())


class DivergenceCallback(RecorderCallback):
    """Marks the run diverged (:meth:`Recorder.diverge`), which stops training, on a
    non-finite or exploding (``abs > threshold``) value.

    After every ``train()`` call: the critic and actor losses SB3 logged and the last
    update's gradient norm (with a :class:`TelemetryCallback`). Every ``every`` calls
    (and after the first; on-policy after every call) the full check: finite
    parameters, every loss SB3 logged, and the Q value of a :class:`DiagnosticsCallback`.
    After every evaluation: the return.

    Args:
        recorder: the shared :class:`Recorder` (None: a new one).
        threshold: absolute value beyond which a value counts as exploding.
        every: full check every this many ``train()`` calls (off-policy).
    """

    def __init__(self, recorder: Recorder | None = None, threshold: float = 1e8, every: int = 10, verbose: int = 0):
        super().__init__(recorder, verbose)
        self.threshold = float(threshold)
        self.every = max(1, int(every))
        self.recorder.on_train_end(self._check_training, Recorder.CHECK)
        self.recorder.on_evaluation(self._check_return)

    def _check_training(self, n: int) -> None:
        rec = self.recorder
        vals = getattr(self.model.logger, "name_to_value", {})
        mon = rec.monitor
        # the norm the optimizer received, as the stored runs' check always read it (the one before
        # SB3's clipping is recorded as grad_norm_raw)
        gn = mon.grad_norm(applied=True) if mon is not None and mon.step >= 0 else None
        if not (rec.on_policy or rec.train_calls % self.every == 0 or rec.train_calls == 1):
            for k in ("train/critic_loss", "train/actor_loss"):
                v = vals.get(k)
                if v is not None and exploding(v, self.threshold):
                    rec.diverge(f"exploding/non-finite {k} {v!r} after {n} updates")
            if gn is not None and exploding(gn, self.threshold):
                rec.diverge(f"exploding/non-finite grad_norm {gn!r} after {n} updates")
            return
        # values SB3 actually logged in this train() call
        check = [float(vals[k]) for k in ("train/loss", "train/value_loss", "train/critic_loss",
                                          "train/actor_loss", "train/policy_loss") if k in vals]
        if not rec.on_policy:
            check.append(rec.rows.get(n, {}).get("q_mean", 0.0))
        if not all_finite(self.model.policy.parameters()):
            rec.diverge("non-finite parameters")
        if gn is not None:
            check.append(gn)
        for v in check:
            if exploding(v, self.threshold):
                rec.diverge(f"exploding/non-finite training value {v!r} after {n} updates")
                break

    def _check_return(self, perf: float) -> None:
        if exploding(perf, self.threshold):
            self.recorder.diverge(f"evaluation return {perf!r}")


class EpisodeReturnCallback(RecorderCallback):
    """True returns of the training episodes (SB3 ``Monitor``'s ``info["episode"]``), their
    mean filed as ``episode_return`` in the row of the updates completed when they ended."""

    def _on_step(self) -> bool:
        rec = self.recorder
        for info in self.locals.get("infos") or ():
            ep = info.get("episode") if isinstance(info, dict) else None
            if ep is not None:
                rec.episode_returns.setdefault(rec.n_updates, []).append(float(ep["r"]))
        return super()._on_step()


class ControllerCallback(RecorderCallback):
    """A closed-loop controller (:mod:`stabstudy.interventions.control`) on the optimizer the
    recorder counts updates by (PPO/A2C: ``policy``; SAC/TD3/DDPG: ``critic``), attached at
    training start with ``before_clip``: its detector reads the gradient norm before SB3's own
    clipping (PPO/A2C ``max_grad_norm``), which pins the norm the optimizer sees at the clip value.
    SB3 gives the optimizer's hooks no loss, so the detectors read the norm alone. To control
    another optimizer too, attach a :class:`~stabstudy.interventions.control.Controller` to it by
    hand.

    At training end it files, on the update rows the recorder keeps (``log_every``) and on those it
    acted on, ``intervened`` (1 where it acted), ``action`` (a code of
    :data:`~stabstudy.interventions.control.ACTION_CODES`) and ``controller_score`` (the largest
    score of its detectors; a controller with an unreachable threshold records what it would have
    seen, for calibration).

    Args:
        recorder: the shared :class:`Recorder` (None: a new one).
        controller: an unattached controller (e.g. ``control.build("z_lr")``).
    """

    def __init__(self, recorder: Recorder | None = None, controller: Controller | OlmoSkip | None = None,
                 verbose: int = 0):
        super().__init__(recorder, verbose)
        if controller is None:
            raise ValueError("ControllerCallback needs a controller (stabstudy.interventions.control.build)")
        self.controller = controller
        self._n0 = 0

    def _on_training_start(self) -> None:
        opts = optimizers_of(self.model)
        self._n0 = self.recorder.n_updates
        # through a TelemetryCallback's Monitor (started before this one) when there is one: it
        # hands over the norm it computed anyway
        self.controller.attach(opts.get("critic", opts.get("policy")), self.recorder.monitor, before_clip=True)

    def _training_end(self) -> None:
        # update i of this learn() call is row n0 + i + 1; a row filed here is kept whatever log_every,
        # so only the rows log_every keeps anyway and those it acted on are filed
        rec = self.recorder
        action = self.controller.records(rec.n_updates - self._n0)["action"]
        scores = getattr(self.controller, "scores", {})
        for i, a in enumerate(action):
            r = self._n0 + i + 1
            if a or r % rec.log_every == 0:
                rec.row(r).update(intervened=float(a > 0), action=float(a))
                if i in scores:
                    rec.row(r)["controller_score"] = float(scores[i])

    def attrs(self) -> dict[str, Any]:
        """What describes the controller in the run's attributes."""
        return self.controller.attrs()

    def close(self) -> None:
        self.controller.close()
