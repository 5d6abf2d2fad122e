"""Reinforcement-learning learners (stable-baselines3) with perturbation auditing.

``run(spec)`` trains PPO, SAC, TD3, A2C or DDPG from stable-baselines3 on any
gymnasium environment (``spec.task``, e.g. ``HalfCheetah-v5`` or
``Pendulum-v1``) and returns an :class:`xarray.Dataset` per the learner contract.
:class:`StabilityCallback` is the public SB3 callback doing the work; it can be
used in any SB3 script::

    env = make_env("HalfCheetah-v5", schedule, seed=0)        # perturbation wrappers
    model = SAC("MlpPolicy", env, seed=0)
    cb = StabilityCallback(schedule, eval_env=make_eval_env("HalfCheetah-v5"), eval_every=5000)
    model.learn(100_000, callback=cb)
    ds = cb.to_dataset()

Step axis and timing
--------------------
* Perturbation windows ``[start, start + duration)`` and ``spec.steps`` are in
  **environment steps** (``model.num_timesteps``; one training env).
* The Dataset dimension ``step`` counts **gradient updates completed**: row ``s``
  describes the state after ``s`` updates; ``step = 0`` is the untrained policy.
  Optimizer channels (``grad_norm``, ``lr``, ...; :class:`stabstudy.telemetry.Monitor`)
  at row ``s`` describe the ``s``-th update. One update = one round of the
  algorithm's optimizers (SAC: entropy coefficient, critic, actor; TD3: critic and,
  every ``policy_delay`` rounds, actor; PPO/A2C: one minibatch step).
* Coordinate ``env_step`` (along ``step``): environment steps consumed when the
  update happened (0 for row 0).
* ``perf`` = mean undiscounted return of ``eval_episodes`` deterministic episodes
  on a separate evaluation env (no perturbation wrappers; episode ``i`` of every
  evaluation resets with seed ``seed + 10_000 + i``, so every evaluation sees the
  same initial states), every ``eval_every`` env steps, written on the row of the
  updates completed at that time (NaN elsewhere). Two evaluations between the same
  two updates (PPO within a rollout, off-policy before ``learning_starts``)
  evaluate the same policy; the later one is kept. ``perf_env_step`` says when
  each was measured. ``episode_return`` = mean true (unscaled) training-episode
  return of the episodes finished at that row.
* ``grad_norm`` etc. are measured at ``optimizer.step()``, i.e. *after* SB3's gradient
  clipping (PPO/A2C ``max_grad_norm = 0.5``): for those the channel saturates at the
  clip value; SAC/TD3 do not clip.
* Per-``train()`` diagnostics (``entropy``, ``approx_kl``, ``clip_fraction``,
  ``value_loss``, ``loss``, ``q_mean``, ``action_saturation``, ...) are written on
  the last row of each ``train()`` call. Off-policy: read every ``diag_every``
  train calls (cost knob). Channels an algorithm does not have are NaN
  (``approx_kl``/``clip_fraction``: PPO only; ``q_mean``: SAC/TD3/DDPG; ``entropy``:
  PPO/A2C (SB3's ``-entropy_loss``) and SAC (Monte-Carlo estimate of the squashed
  Gaussian's entropy on the most recent replay observations with a private RNG);
  NaN for the deterministic TD3/DDPG policies).

Perturbations (``spec.perturbations``)
--------------------------------------
* ``lr_spike``: every optimizer's learning rate is multiplied by ``dose`` for each
  optimizer step taken while ``num_timesteps`` is in the window. Applied in an
  optimizer step pre-hook (and restored in the post-hook), i.e. *after* SB3's own
  ``_update_learning_rate``, so it truly applies. On-policy algorithms update only
  at rollout ends (every ``n_steps`` env steps): a window must contain a rollout
  end to have any effect (:func:`comparison_grid` sizes it so).
* ``action_noise``: Gaussian noise of std ``dose * (high - low) / 2`` added to the
  action the env receives (then clipped to the bounds).
* ``obs_noise``: Gaussian noise of std ``dose`` added to the observations the agent sees.
* ``reward_scale``: training rewards multiplied by ``dose``.
* ``weight_noise``: once, at the first env step >= ``start``: Gaussian noise of
  relative std ``dose`` on every policy parameter (:func:`stabstudy.perturb.add_weight_noise`).
* ``reinit_layer``: once, at ``start``; ``params={"layer": <policy submodule>}``.
The env wrappers count their own ``env.step`` calls (one training env).

Divergence: non-finite or exploding (``> diverge_threshold``) losses, gradient
norms, Q values, evaluation returns or parameters stop training; the run is
returned with ``attrs["status"] = "diverged"`` and the data up to there.

Hyperparameters (``spec.hparams``; defaults in :data:`DEFAULTS`): ``hidden``,
``layers`` (MLP size of policy and value nets), ``lr``, ``batch_size``, ``n_steps``,
``n_epochs``, ``gamma``, ``gae_lambda``, ``clip_range``, ``ent_coef`` (PPO/A2C: float;
SAC: ``"auto"`` or float), ``target_entropy`` (SAC: ``"auto"`` or float),
``action_noise_std`` (TD3/DDPG exploration noise), ``learning_starts``, ``buffer_size``,
``train_freq``, ``gradient_steps``, ``tau``, ``policy_delay``, ``eval_episodes``,
``eval_max_steps`` (0 = env default), ``max_episode_steps`` (0 = env default),
``monitor_every`` (Monitor's ``every``), ``diag_every``, ``diverge_threshold``.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import xarray as xr

from stabstudy.perturb import Schedule, add_weight_noise, reinit_layer
from stabstudy.seeding import seed_everything
from stabstudy.spec import Perturbation, RunSpec

#: Bump when a change to this learner alters the results it stores: the runner then
#: recomputes stored runs of other versions instead of reusing them.
#: 2: the divergence check reads the Monitor's gradient norm (version 1 read a logged value
#: that was never logged, so a non-finite or exploding gradient norm went unnoticed there).
#: 3: the finite-parameter check sums norms in float64 (in float32 finite weights above ~1e19
#: overflowed the norm and were flagged as non-finite).
RESULTS_VERSION = 3

ALGOS = ("ppo", "sac", "td3", "a2c", "ddpg")
ON_POLICY = ("ppo", "a2c")

#: Hyperparameter defaults per learner (SB3 defaults unless noted; ``hidden`` x ``layers`` MLPs).
DEFAULTS: dict[str, dict[str, Any]] = {
    "ppo": dict(hidden=64, layers=2, lr=3e-4, batch_size=64, n_steps=2048, n_epochs=10, gamma=0.99,
                gae_lambda=0.95, clip_range=0.2, ent_coef=0.0),
    "a2c": dict(hidden=64, layers=2, lr=7e-4, n_steps=5, gamma=0.99, gae_lambda=1.0, ent_coef=0.0),
    "sac": dict(hidden=256, layers=2, lr=3e-4, batch_size=256, learning_starts=100, buffer_size=1_000_000,
                train_freq=1, gradient_steps=1, tau=0.005, gamma=0.99, ent_coef="auto", target_entropy="auto"),
    "td3": dict(hidden=256, layers=2, lr=1e-3, batch_size=256, learning_starts=100, buffer_size=1_000_000,
                train_freq=1, gradient_steps=1, tau=0.005, gamma=0.99, policy_delay=2, action_noise_std=0.1),
    "ddpg": dict(hidden=256, layers=2, lr=1e-3, batch_size=256, learning_starts=100, buffer_size=1_000_000,
                 train_freq=1, gradient_steps=1, tau=0.005, gamma=0.99, action_noise_std=0.1),
}
#: Hyperparameters common to every learner.
COMMON_DEFAULTS: dict[str, Any] = dict(eval_episodes=2, eval_max_steps=0, max_episode_steps=0, monitor_every=1,
                                       diag_every=10, diverge_threshold=1e8)

#: The algorithm's own stochasticity knob (hyperparameter name) per learner.
NOISE_KNOB = {"ppo": "ent_coef", "a2c": "ent_coef", "sac": "target_entropy", "td3": "action_noise_std",
              "ddpg": "action_noise_std"}

#: Channels this module records in addition to the Monitor's.
RL_CHANNELS = ("perf", "episode_return", "entropy", "approx_kl", "clip_fraction", "value_loss", "q_mean",
               "action_saturation", "loss")

EVAL_SEED_OFFSET = 10_000


# -- environments --------------------------------------------------------------------


def _gym():
    import gymnasium as gym

    return gym


def check_env_id(task: str) -> None:
    """Raise ``ValueError`` with a clear message when ``task`` is not a registered gymnasium env id."""
    gym = _gym()
    if task not in gym.registry:
        close = [k for k in gym.registry if task.split("-")[0].lower() in k.lower()][:8]
        raise ValueError(
            f"unknown gymnasium environment {task!r}; examples of valid ids: HalfCheetah-v5, Pendulum-v1"
            + (f"; similar registered ids: {', '.join(close)}" if close else "")
        )


def _route_mujoco_warnings() -> None:
    """Send MuJoCo's C-level warnings through Python's ``warnings`` (shown once per process)
    instead of printing them on every model compile (gymnasium's HalfCheetah-v5 XML triggers a
    deprecation warning each time) and appending them to MUJOCO_LOG.TXT. A handler the user
    installed is left alone."""
    import mujoco  # a dependency (gymnasium[mujoco]); imported here to keep `import stabstudy.rl` light

    if mujoco.get_mju_user_warning() is None:
        mujoco.set_mju_user_warning(lambda msg: warnings.warn(f"MuJoCo: {msg}", RuntimeWarning, stacklevel=2))


def _make_base(task: str, max_episode_steps: int = 0):
    check_env_id(task)
    _route_mujoco_warnings()
    gym = _gym()
    kw = {"max_episode_steps": int(max_episode_steps)} if max_episode_steps else {}
    return gym.make(task, **kw)


class _StepCounter:
    """Mixin: counts this env's ``step`` calls (the global env step with one training env)."""

    env_step = 0


def _wrappers():
    gym = _gym()

    class PerturbationWrapper(gym.Wrapper):
        """Applies the env-side perturbations of a schedule, switched on/off by env step.

        Counts its own ``step`` calls (``env_step``, 0-based index of the step being
        taken). ``action_noise``: std ``dose * (high - low) / 2`` added to the
        action, then clipped; ``obs_noise``: std ``dose`` added to the returned
        observation; ``reward_scale``: reward multiplied by ``dose``. Noise comes
        from a private ``numpy.random.Generator(seed)``.
        """

        def __init__(self, env, schedule: Schedule, seed: int = 0):
            super().__init__(env)
            self.schedule = schedule
            self.env_step = 0
            self.rng = np.random.default_rng(seed)
            box = env.action_space
            self._low = getattr(box, "low", None)
            self._high = getattr(box, "high", None)

        def reset(self, **kwargs):
            obs, info = self.env.reset(**kwargs)
            on = self.schedule.of_kind("obs_noise", self.env_step)
            if on is not None:
                obs = (obs + self.rng.normal(size=np.shape(obs)) * on.dose).astype(obs.dtype)
            return obs, info

        def step(self, action):
            t = self.env_step
            an = self.schedule.of_kind("action_noise", t)
            if an is not None and self._low is not None:
                half = (self._high - self._low) / 2.0
                action = np.clip(np.asarray(action, dtype=np.float64) + self.rng.normal(size=half.shape) * an.dose * half,
                                 self._low, self._high).astype(self.action_space.dtype)
            obs, reward, terminated, truncated, info = self.env.step(action)
            self.env_step += 1
            rs = self.schedule.of_kind("reward_scale", t)
            if rs is not None:
                reward = float(reward) * rs.dose
            on = self.schedule.of_kind("obs_noise", t)
            if on is not None:
                obs = (obs + self.rng.normal(size=np.shape(obs)) * on.dose).astype(obs.dtype)
            return obs, reward, terminated, truncated, info

    return PerturbationWrapper


def make_env(task: str, schedule: Schedule | Sequence[Perturbation] = (), seed: int = 0, max_episode_steps: int = 0):
    """Training env: ``gym.make(task)`` -> SB3 ``Monitor`` (true returns) -> perturbation wrapper -> ``DummyVecEnv``.

    The SB3 Monitor sits inside the perturbation wrapper, so ``info["episode"]``
    holds the *unperturbed* episode return even under ``reward_scale``.
    """
    from stable_baselines3.common.monitor import Monitor as SB3Monitor
    from stable_baselines3.common.vec_env import DummyVecEnv

    schedule = schedule if isinstance(schedule, Schedule) else Schedule(tuple(schedule))
    check_env_id(task)
    wrapper = _wrappers()

    def thunk():
        return wrapper(SB3Monitor(_make_base(task, max_episode_steps)), schedule, seed=seed + 1)

    return DummyVecEnv([thunk])


def make_eval_env(task: str, max_episode_steps: int = 0):
    """Clean evaluation env (no perturbation)."""
    return _make_base(task, max_episode_steps)


def env_wrapper(vec_env):
    """The :class:`PerturbationWrapper` inside a ``make_env`` VecEnv (for tests and inspection)."""
    env = vec_env.envs[0]
    while env is not None and not hasattr(env, "schedule"):
        env = getattr(env, "env", None)
    return env


# -- optimizers and diagnostics ------------------------------------------------------


def optimizers_of(model) -> dict[str, Any]:
    """Every optimizer of an SB3 algorithm, named: ``policy`` (PPO/A2C), ``actor``,
    ``critic``, ``ent_coef`` (SAC with learned entropy coefficient)."""
    opts: dict[str, Any] = {}
    policy = model.policy
    if hasattr(model, "actor") and getattr(model, "actor", None) is not None and hasattr(model.actor, "optimizer"):
        opts["actor"] = model.actor.optimizer
        opts["critic"] = model.critic.optimizer
        if getattr(model, "ent_coef_optimizer", None) is not None:
            opts["ent_coef"] = model.ent_coef_optimizer
    else:
        opts["policy"] = policy.optimizer
    return opts


def _finite_params(module) -> bool:
    from stabstudy.precision import all_finite

    return all_finite(module.parameters())


def _numerical_blowup(e: Exception) -> bool:
    """An exception raised by a numerically blown-up policy: torch.distributions rejecting
    non-finite / out-of-range parameters (e.g. ``exp(log_std)`` overflowing to inf), or
    NaN/inf in a simulator error message."""
    msg = str(e).lower()
    return (isinstance(e, ValueError) and ("expected parameter" in msg or "invalid values" in msg)) or \
        any(w in msg for w in ("nan", " inf", "unstable", "overflow"))


def _sb3_callback_base():
    from stable_baselines3.common.callbacks import BaseCallback

    return BaseCallback


def _build_callback_class():
    import torch

    BaseCallback = _sb3_callback_base()

    class StabilityCallback(BaseCallback):
        """SB3 callback: telemetry (:class:`stabstudy.telemetry.Monitor` on every
        optimizer), perturbation schedule (``lr_spike``, ``weight_noise``,
        ``reinit_layer``; env-side kinds need :func:`make_env`'s wrapper),
        evaluation and RL diagnostics, divergence detection.

        Args:
            schedule: a :class:`stabstudy.perturb.Schedule` (or perturbations); timing in env steps.
            eval_env: a gymnasium env (not vectorised) for evaluation; None: no ``perf``.
            eval_every: evaluate every this many env steps (0: only at start and end).
            eval_episodes: episodes per evaluation (deterministic policy).
            eval_seed: episode ``i`` of each evaluation resets with ``eval_seed + i``.
            monitor: attach the Monitor (False: only evaluation/diagnostics/perturbations).
            monitor_every: the Monitor's ``every``.
            diag_every: read diagnostics every this many ``train()`` calls (off-policy;
                on-policy algorithms read them after every ``train()``).
            diverge_threshold: absolute value beyond which a loss / grad norm / Q value /
                return counts as exploding.
            seed: seed of the private generators (weight noise, entropy estimate).
            log_every: keep every this many Monitor rows in :meth:`to_dataset` (rows with
                evaluation, episode or diagnostic records are always kept).

        After ``learn``: :meth:`to_dataset` and :attr:`diverged`.
        """

        def __init__(self, schedule: Schedule | Sequence[Perturbation] = (), eval_env=None, eval_every: int = 0,
                     eval_episodes: int = 2, eval_seed: int = EVAL_SEED_OFFSET, monitor: bool = True,
                     monitor_every: int = 1, diag_every: int = 10, diverge_threshold: float = 1e8, seed: int = 0,
                     log_every: int = 1, verbose: int = 0):
            super().__init__(verbose)
            self.schedule = schedule if isinstance(schedule, Schedule) else Schedule(tuple(schedule))
            self.eval_env = eval_env
            self.eval_every = int(eval_every)
            self.eval_episodes = int(eval_episodes)
            self.eval_seed = int(eval_seed)
            self.use_monitor = monitor
            self.monitor_every = monitor_every
            self.diag_every = max(1, int(diag_every))
            self.diverge_threshold = float(diverge_threshold)
            self.seed = int(seed)
            self.log_every = max(1, int(log_every))
            self.mon = None
            self.diverged = False
            self.diverge_reason = ""
            self.n_updates = 0  # rounds completed (counted on the optimizer that steps every round)
            self._rows: dict[int, dict[str, float]] = {}
            self._seg_end: list[int] = [0]  # last update index of each train() call ...
            self._seg_env: list[int] = [0]  # ... and the env step it happened at
            self._ep_sum: dict[int, list[float]] = {}
            self._handles: list[Any] = []
            self._seen_updates = 0
            self._train_calls = 0
            self._fired: set[int] = set()
            self._parametric_pending = False  # a weight_noise / reinit_layer since the last update
            self._last_eval_env_step = -1
            self._gen = torch.Generator().manual_seed(self.seed + 7)
            self._applied: dict[tuple[int, int], tuple[float, float]] = {}  # (base lr, lr we wrote)

        # -- set-up -----------------------------------------------------------------
        def _on_training_start(self) -> None:
            model = self.model
            self.algo = type(model).__name__.lower()
            self.on_policy = self.algo in ON_POLICY or not hasattr(model, "replay_buffer")
            self.opts = optimizers_of(model)
            env_kinds = sorted({p.kind for p in self.schedule.perturbations} & {"action_noise", "obs_noise", "reward_scale"})
            if env_kinds:
                envs = getattr(self.training_env, "envs", None)
                if envs is None or env_wrapper(self.training_env) is None:
                    import warnings

                    warnings.warn(f"StabilityCallback: the schedule has env-side perturbations {env_kinds}; they act only "
                                  "through the wrapper of stabstudy.rl.make_env, which this training env lacks",
                                  stacklevel=2)
            # 1) lr-spike hooks first, so the Monitor (registered after) sees the applied lr
            for opt in self.opts.values():
                self._handles.append(opt.register_step_pre_hook(self._lr_pre))
            counter = self.opts.get("critic", self.opts.get("policy"))
            self._handles.append(counter.register_step_post_hook(self._count))
            if self.use_monitor:
                from stabstudy.telemetry import Monitor

                self.mon = Monitor(model.policy, self.opts, every=self.monitor_every)
            self._evaluate()  # step 0: the untrained policy

        def _lr_pre(self, opt, args, kwargs):
            """Before any optimizer step: every optimizer's lr = (lr SB3 set) x spike factor.

            Applied to all optimizers at once (so a Monitor reading the primary's lr
            during another optimizer's step sees the applied value); a value SB3
            reset in ``_update_learning_rate`` is recognised (it differs from what we
            wrote) and becomes the new base.
            """
            f = self.schedule.lr_factor(self.model.num_timesteps)
            if f == 1.0 and not self._applied:
                return
            for o in self.opts.values():
                for gi, g in enumerate(o.param_groups):
                    key = (id(o), gi)
                    applied = self._applied.get(key)
                    base = applied[0] if applied is not None and g["lr"] == applied[1] else g["lr"]
                    g["lr"] = base * f
                    if f != 1.0:
                        self._applied[key] = (base, g["lr"])
                    else:
                        self._applied.pop(key, None)

        def _count(self, opt, args, kwargs):
            self.n_updates += 1
            self._parametric_pending = False

        # -- per env step -------------------------------------------------------------
        def _on_step(self) -> bool:
            t = self.model.num_timesteps
            infos = self.locals.get("infos") or ()
            for info in infos:
                ep = info.get("episode") if isinstance(info, dict) else None
                if ep is not None:
                    self._ep_sum.setdefault(self.n_updates, []).append(float(ep["r"]))
            # evaluate before a parametric perturbation of this step: the row is the policy after
            # n_updates updates, which the perturbation then replaces (see _evaluate)
            if self.eval_every and t % self.eval_every == 0:
                self._evaluate()
            for p in self.schedule.perturbations:
                if p.kind in ("weight_noise", "reinit_layer") and t >= p.start and id(p) not in self._fired:
                    self._fired.add(id(p))
                    self._apply_parametric(p)
                    self._parametric_pending = True
            return not self.diverged

        def _apply_parametric(self, p: Perturbation) -> None:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + p.start)
            if p.kind == "weight_noise":
                add_weight_noise(self.model.policy, p.dose, gen)
            else:
                layer = p.p.get("layer")
                if layer is None:
                    names = [n for n, _ in self.model.policy.named_modules() if n]
                    raise ValueError(f"reinit_layer needs params={{'layer': ...}}; policy submodules: {', '.join(names[:30])}")
                reinit_layer(self.model.policy, layer, p.dose, gen)

        def _on_rollout_start(self) -> None:
            self._after_train()

        def _on_training_end(self) -> None:
            self._after_train()
            if self._last_eval_env_step != self.model.num_timesteps and not self.diverged:
                self._evaluate()

        # -- after each train() -------------------------------------------------------
        def _after_train(self) -> None:
            n = self.n_updates
            if n == self._seen_updates:
                return
            t = self.model.num_timesteps
            self._seg_end.append(n)
            self._seg_env.append(t)
            self._seen_updates = n
            self._train_calls += 1
            diag = self.on_policy or self._train_calls % self.diag_every == 0 or self._train_calls == 1
            vals = getattr(self.model.logger, "name_to_value", {})
            # the last update's gradient norm (None without a Monitor or before any update)
            gn = self.mon.grad_norm() if self.mon is not None and self.mon.step >= 0 else None
            if not diag:  # cheap divergence check only
                for k in ("train/critic_loss", "train/actor_loss"):
                    v = vals.get(k)
                    if v is not None and (not math.isfinite(v) or abs(v) > self.diverge_threshold):
                        self._diverge(f"exploding/non-finite {k} {v!r} after {n} updates")
                if gn is not None and (not math.isfinite(gn) or abs(gn) > self.diverge_threshold):
                    self._diverge(f"exploding/non-finite grad_norm {gn!r} after {n} updates")
                return
            vals = dict(vals)
            row = self._rows.setdefault(n, {})

            def get(key):
                v = vals.get(key)
                return float(v) if v is not None else math.nan

            # values SB3 actually logged in this train() call: checked for divergence
            check = [float(vals[k]) for k in ("train/loss", "train/value_loss", "train/critic_loss",
                                              "train/actor_loss", "train/policy_loss") if k in vals]
            if self.on_policy:
                row["entropy"] = -get("train/entropy_loss")
                row["approx_kl"] = get("train/approx_kl")
                row["clip_fraction"] = get("train/clip_fraction")
                row["value_loss"] = get("train/value_loss")
                if "train/loss" in vals:
                    row["loss"] = get("train/loss")
                else:  # A2C: SB3's own objective
                    m = self.model
                    row["loss"] = get("train/policy_loss") + m.ent_coef * get("train/entropy_loss") + m.vf_coef * row["value_loss"]
                row["policy_std"] = get("train/std")
                self._rollout_diag(row)
                if not _finite_params(self.model.policy):
                    self._diverge("non-finite parameters")
            else:
                row["value_loss"] = get("train/critic_loss")
                row["loss"] = row["value_loss"]
                row["actor_loss"] = get("train/actor_loss")
                if "train/ent_coef" in vals:
                    row["ent_coef"] = get("train/ent_coef")
                self._replay_diag(row)
                check.append(row.get("q_mean", 0.0))
                if not _finite_params(self.model.policy):
                    self._diverge("non-finite parameters")
            if gn is not None:
                check.append(gn)
            for v in check:
                if not math.isfinite(v) or abs(v) > self.diverge_threshold:
                    self._diverge(f"exploding/non-finite training value {v!r} after {n} updates")
                    break

        def _diverge(self, reason: str) -> None:
            if not self.diverged:
                self.diverged = True
                self.diverge_reason = reason

        def _rollout_diag(self, row: dict) -> None:
            buf = self.model.rollout_buffer
            row["value_mean"] = float(np.mean(buf.values))
            space = self.model.action_space
            if hasattr(space, "low"):
                a = np.clip(buf.actions.reshape(-1, space.shape[0]), space.low, space.high)
                scaled = 2.0 * (a - space.low) / (space.high - space.low) - 1.0
                row["action_saturation"] = float(np.mean(np.abs(scaled) > 0.99))

        def _replay_diag(self, row: dict, n_obs: int = 256) -> None:
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
                if self.algo == "sac":
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

        # -- evaluation ---------------------------------------------------------------
        def _evaluate(self) -> None:
            """Return of the deterministic policy, filed in row ``n_updates`` (the policy after
            that many updates). Skipped between a ``weight_noise`` / ``reinit_layer`` and the
            next update: the policy then is not the one of that row (whose env step and
            ``perturbed`` flag lie before the event); the damage shows from the first
            evaluation after the next update."""
            if self.eval_env is None or self._parametric_pending:
                return
            t = self.model.num_timesteps
            self._last_eval_env_step = t
            rets = []
            try:
                for i in range(self.eval_episodes):
                    obs, _ = self.eval_env.reset(seed=self.eval_seed + i)
                    done, ret = False, 0.0
                    while not done:
                        action, _ = self.model.predict(obs, deterministic=True)
                        obs, r, term, trunc, _ = self.eval_env.step(action)
                        ret += float(r)
                        done = term or trunc
                    rets.append(ret)
                perf = float(np.mean(rets))
            except Exception as e:  # a NaN policy can crash the simulator
                perf = math.nan
                self._diverge(f"evaluation failed: {type(e).__name__}: {e}")
            row = self._rows.setdefault(self.n_updates, {})
            row["perf"] = perf
            row["perf_env_step"] = float(t)
            if not math.isfinite(perf) or abs(perf) > self.diverge_threshold:
                self._diverge(f"evaluation return {perf!r}")

        # -- output -------------------------------------------------------------------
        def close(self) -> None:
            """Remove the hooks and undo a still-applied lr factor."""
            for o in getattr(self, "opts", {}).values():
                for gi, g in enumerate(o.param_groups):
                    applied = self._applied.pop((id(o), gi), None)
                    if applied is not None and g["lr"] == applied[1]:
                        g["lr"] = applied[0]
            for h in self._handles:
                h.remove()
            self._handles.clear()
            if self.mon is not None:
                self.mon.close()

        def to_dataset(self) -> xr.Dataset:
            """All rows: dim ``step`` (updates completed), coordinate ``env_step``."""
            rows = {s: dict(r) for s, r in self._rows.items()}
            for s, eps in self._ep_sum.items():
                rows.setdefault(s, {})["episode_return"] = float(np.mean(eps))
            mon_ds = None
            if self.mon is not None:
                mon_ds = self.mon.to_dataset()
                mon_ds = mon_ds.assign_coords(step=mon_ds.step.values + 1)
            steps = set(rows) | {0}
            if mon_ds is not None:
                mon_steps = mon_ds.step.values
                if self.log_every > 1:  # thin the per-update rows; rows with RL records are kept
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
            # env steps: known at update rows; eval-only rows take the eval's env step; forward-fill the rest
            # env step of row s: that of the train() call containing update s (row 0: 0)
            ends, envs = np.asarray(self._seg_end), np.asarray(self._seg_env)
            idx = np.minimum(np.searchsorted(ends, steps_arr, side="left"), len(ends) - 1)
            env = envs[idx]
            ds = ds.assign_coords(env_step=("step", env.astype(np.int64)))
            # rollout that update round's train() consumed (on-policy): env steps (prev, env]
            prev = np.where(idx > 0, envs[np.maximum(idx - 1, 0)], env)
            mask = np.zeros(env.size)
            for p in self.schedule.perturbations:
                if getattr(self, "on_policy", False) and p.kind in ROLLOUT_FLAGGED:
                    mask[(idx > 0) & (p.start <= env) & (p.end > prev + 1)] = 1.0
                else:
                    mask[(env >= p.start) & (env < p.end)] = 1.0
            ds["perturbed"] = ("step", mask)
            ds["intervened"] = ("step", np.zeros(ds.sizes["step"]))
            ds["step"].attrs["long_name"] = "gradient updates completed"
            ds["env_step"].attrs["long_name"] = "environment steps consumed"
            return ds

    return StabilityCallback


_CB_CLASS = None


def __getattr__(name: str):
    """Lazy ``StabilityCallback`` (importing SB3/torch only when used)."""
    global _CB_CLASS
    if name == "StabilityCallback":
        if _CB_CLASS is None:
            _CB_CLASS = _build_callback_class()
        return _CB_CLASS
    raise AttributeError(f"module 'stabstudy.rl' has no attribute {name!r}")


# -- learner -------------------------------------------------------------------------


def hparams_for(spec: RunSpec) -> dict[str, Any]:
    """Defaults of the learner merged with ``spec.hparams`` (unknown names raise)."""
    base = {**COMMON_DEFAULTS, **DEFAULTS[spec.learner]}
    unknown = sorted(set(spec.hp) - set(base))
    if unknown:
        raise ValueError(f"unknown hyperparameters for {spec.learner}: {', '.join(unknown)}; valid: {', '.join(sorted(base))}")
    return {**base, **spec.hp}


def build_model(spec: RunSpec, env=None):
    """The SB3 algorithm for ``spec`` (seeded with ``spec.seed``) on its training env."""
    import stable_baselines3 as sb3
    from stable_baselines3.common.noise import NormalActionNoise

    if spec.learner not in ALGOS:
        raise ValueError(f"unknown RL learner {spec.learner!r}; valid: {', '.join(ALGOS)}")
    hp = hparams_for(spec)
    env = env if env is not None else make_env(spec.task, spec.perturbations, spec.seed, hp["max_episode_steps"])
    arch = [int(hp["hidden"])] * int(hp["layers"])
    common = dict(learning_rate=float(hp["lr"]), gamma=float(hp["gamma"]), seed=spec.seed, verbose=0, device="cpu")
    L = spec.learner
    if L in ON_POLICY:
        kw = dict(n_steps=int(hp["n_steps"]), gae_lambda=float(hp["gae_lambda"]), ent_coef=float(hp["ent_coef"]),
                  policy_kwargs=dict(net_arch=dict(pi=arch, vf=arch)))
        if L == "ppo":
            kw.update(batch_size=int(hp["batch_size"]), n_epochs=int(hp["n_epochs"]), clip_range=float(hp["clip_range"]))
            return sb3.PPO("MlpPolicy", env, **kw, **common)
        return sb3.A2C("MlpPolicy", env, **kw, **common)
    kw = dict(batch_size=int(hp["batch_size"]), learning_starts=int(hp["learning_starts"]),
              buffer_size=int(min(hp["buffer_size"], spec.steps)), train_freq=int(hp["train_freq"]),
              gradient_steps=int(hp["gradient_steps"]), tau=float(hp["tau"]), policy_kwargs=dict(net_arch=arch))
    if L == "sac":
        ent = hp["ent_coef"]
        te = hp["target_entropy"]
        return sb3.SAC("MlpPolicy", env, ent_coef=ent if isinstance(ent, str) else float(ent),
                       target_entropy=te if isinstance(te, str) else float(te), **kw, **common)
    n_act = env.action_space.shape[0]
    noise = NormalActionNoise(np.zeros(n_act), float(hp["action_noise_std"]) * np.ones(n_act)) if hp["action_noise_std"] > 0 else None
    if L == "td3":
        return sb3.TD3("MlpPolicy", env, action_noise=noise, policy_delay=int(hp["policy_delay"]), **kw, **common)
    return sb3.DDPG("MlpPolicy", env, action_noise=noise, **kw, **common)


def make_callback(spec: RunSpec, monitor: bool = True):
    """The :class:`StabilityCallback` configured from ``spec`` (eval env, cadences, schedule)."""
    hp = hparams_for(spec)
    eval_every = spec.eval_every or max(1, spec.steps // 20)
    return __getattr__("StabilityCallback")(
        Schedule(spec.perturbations), eval_env=make_eval_env(spec.task, hp["eval_max_steps"]), eval_every=eval_every,
        eval_episodes=int(hp["eval_episodes"]), eval_seed=spec.seed + EVAL_SEED_OFFSET, monitor=monitor,
        monitor_every=max(int(hp["monitor_every"]), spec.log_every), diag_every=int(hp["diag_every"]),
        diverge_threshold=float(hp["diverge_threshold"]), seed=spec.seed, log_every=spec.log_every)


def run(spec: RunSpec) -> xr.Dataset:
    """Train ``spec.learner`` on ``spec.task`` for ``spec.steps`` env steps; see the module docstring.

    Returns the Dataset (dim ``step`` = updates completed, coordinate ``env_step``),
    ``attrs["status"]`` ``"ok"`` or ``"diverged"`` (with ``diverge_reason``).
    """
    if spec.domain != "rl":
        raise ValueError(f"stabstudy.rl.run handles domain 'rl', got {spec.domain!r}")
    check_env_id(spec.task)
    seed_everything(spec.seed)
    t0 = time.perf_counter()
    model = build_model(spec)
    cb = make_callback(spec)
    try:
        model.learn(total_timesteps=spec.steps, callback=cb, progress_bar=False)
    except Exception as e:  # a diverged policy can crash SB3 (NaN distribution parameters) or MuJoCo
        if cb.diverged or not _finite_params(model.policy) or _numerical_blowup(e):
            cb._diverge(f"{type(e).__name__}: {str(e)[:200]}")
        else:
            raise
    finally:
        cb.close()
    ds = cb.to_dataset()
    ds.attrs.update(status="diverged" if cb.diverged else "ok", diverge_reason=cb.diverge_reason,
                    env_steps=int(model.num_timesteps), n_updates=int(cb.n_updates), algo=spec.learner,
                    learner_wall_s=float(time.perf_counter() - t0), perturbation_rows=PERTURBATION_ROWS,
                    monitor_own_steps=MONITOR_OWN_STEPS)
    model.env.close()
    return ds


#: Version of the bookkeeping of perturbations in the stored rows (the ``perturbation_rows``
#: attribute), which affects only runs with the kinds in :func:`stale`; they alone are
#: recomputed, not every stored RL run as a RESULTS_VERSION bump would. 1: an evaluation
#: between a ``weight_noise`` / ``reinit_layer`` and the next update is skipped (before, it
#: filed the damaged policy's return in the pre-event row); on-policy rows are flagged
#: ``perturbed`` when their rollout overlapped an env-side or parametric window (before,
#: only when the rollout *ended* inside it, so a window within one rollout flagged nothing).
PERTURBATION_ROWS = 1
#: 1: the Monitor samples (``every``) and links ``xgrad`` by each optimizer's own steps; before,
#: by rows, so TD3's delayed actor (every other row) had no ``xgrad_actor`` and, at an even
#: ``monitor_every``, no measured update at all. Only TD3 runs are affected (:func:`stale`).
MONITOR_OWN_STEPS = 1
#: kinds whose effect reaches an on-policy update through the rollout it trains on
ROLLOUT_FLAGGED = ("action_noise", "obs_noise", "reward_scale", "weight_noise", "reinit_layer")


def stale(spec: RunSpec, attrs: dict) -> str | None:
    """Why a stored run of ``spec`` no longer describes it, or None (see
    :func:`stabstudy.runner.pending`)."""
    kinds = {p.kind for p in spec.perturbations}
    affected = kinds & {"weight_noise", "reinit_layer"} or (spec.learner in ON_POLICY and kinds & set(ROLLOUT_FLAGGED))
    have = int(attrs.get("perturbation_rows", 0))
    if affected and have != PERTURBATION_ROWS:
        return f"keeps the rows of its perturbation by an older rule (perturbation_rows {have}, now {PERTURBATION_ROWS})"
    if spec.learner == "td3" and int(attrs.get("monitor_own_steps", 0)) != MONITOR_OWN_STEPS:
        return "sampled the delayed actor's telemetry by rows, not by its own steps (monitor_own_steps 0)"
    return None


# -- grids -----------------------------------------------------------------------------

#: Default dose per perturbation kind for the comparison grid.
DEFAULT_DOSES = {"lr_spike": 10.0, "action_noise": 0.5, "obs_noise": 0.5, "reward_scale": 10.0, "weight_noise": 0.5}


def perturbation(kind: str, start: int, duration: int, dose: float | None = None, learner: str = "sac",
                 hparams: Mapping[str, Any] | None = None) -> tuple[Perturbation, ...]:
    """One perturbation (empty for ``"none"``). On-policy ``lr_spike`` windows are
    widened to at least one rollout (``n_steps``) so they contain an update."""
    if kind == "none":
        return ()
    dose = DEFAULT_DOSES.get(kind, 1.0) if dose is None else float(dose)
    if kind == "lr_spike" and learner in ON_POLICY:
        n_steps = int({**DEFAULTS[learner], **(hparams or {})}["n_steps"])
        duration = max(duration, n_steps)
    if kind in ("weight_noise", "reinit_layer"):
        duration = max(duration, 1)
    return (Perturbation(kind, int(start), int(duration), dose),)


def comparison_grid(algos: Sequence[str], perturbations: Sequence[str], seeds: Iterable[int], steps: int, *,
                    task: str = "HalfCheetah-v5", start: int | None = None, duration: int | None = None,
                    doses: Mapping[str, float] | None = None, hparams: Mapping[str, Mapping[str, Any]] | None = None,
                    common_hparams: Mapping[str, Any] | None = None, eval_every: int = 0,
                    log_every: int = 1) -> list[RunSpec]:
    """Specs for algorithms x perturbation kinds (``"none"`` = baseline) x seeds.

    ``start`` (default ``steps // 2``) and ``duration`` (default ``steps // 20``) in
    env steps; ``doses`` per kind (default :data:`DEFAULT_DOSES`); ``hparams`` per
    algorithm merged over ``common_hparams``; ``eval_every`` (env steps, 0: ``steps // 20``)
    and ``log_every`` (keep every this many per-update rows) go to the RunSpec.
    """
    start = steps // 2 if start is None else start
    duration = max(1, steps // 20) if duration is None else duration
    doses = {**DEFAULT_DOSES, **(doses or {})}
    specs = []
    for a in algos:
        hp = {**(common_hparams or {}), **((hparams or {}).get(a, {}))}
        for k in perturbations:
            for s in seeds:
                specs.append(RunSpec("rl", a, task, int(steps), int(s), hparams=hp,
                                     perturbations=perturbation(k, start, duration, doses.get(k), a, hp),
                                     eval_every=int(eval_every), log_every=int(log_every)))
    return specs


def dose_grid(algos: Sequence[str], doses: Sequence[float], seeds: Iterable[int], steps: int, *,
              kind: str = "lr_spike", **kw) -> list[RunSpec]:
    """Dose sweep of one perturbation kind: algorithms x doses x seeds (kwargs as :func:`comparison_grid`)."""
    seeds = list(seeds)
    out: list[RunSpec] = []
    for d in doses:
        out += comparison_grid(algos, [kind], seeds, steps, doses={kind: float(d)}, **kw)
    return out


def noise_grid(knob_values: Mapping[str, Sequence[Any]], seeds: Iterable[int], steps: int, *,
               kind: str = "lr_spike", dose: float | None = None,
               hparams: Mapping[str, Mapping[str, Any]] | None = None, **kw) -> list[RunSpec]:
    """Controlled stochasticity: for each algorithm, vary its own noise knob
    (:data:`NOISE_KNOB`) over ``knob_values[algo]`` under the same perturbation."""
    seeds = list(seeds)
    out: list[RunSpec] = []
    for a, values in knob_values.items():
        for v in values:
            hp = {a: {**((hparams or {}).get(a, {})), NOISE_KNOB[a]: v}}
            out += comparison_grid([a], [kind], seeds, steps, doses={kind: dose} if dose is not None else None,
                                   hparams=hp, **kw)
    return out


# -- analysis helpers ------------------------------------------------------------------


def eval_curves(ds: xr.Dataset, env_grid: Sequence[int] | None = None) -> xr.DataArray:
    """Evaluation returns on a common env-step axis: DataArray ``(run, env_step)``.

    ``ds``: from :func:`stabstudy.store.load_runs` (dims ``(run, step)``, 2-D
    ``env_step`` coordinate) or one run (dim ``step``). ``perf`` at row ``s`` is the
    return of the policy after ``s`` updates, which is the policy acting from env
    step ``env_step[s]`` until the next update; each run's ``(env_step, perf)``
    pairs are therefore placed on ``env_grid`` (default: the union of those env
    steps) as a step function: the last measured policy at or before each grid
    point (NaN before the first and after a run stopped).
    """
    if "run" not in ds.dims:
        ds = ds.expand_dims(run=[0])
    perf = ds["perf"].transpose("run", "step").values
    env = ds["env_step"]
    when = np.asarray(env.transpose("run", "step").values if "run" in env.dims
                      else np.broadcast_to(env.values, perf.shape), dtype=float)
    pairs = []
    for i in range(perf.shape[0]):
        ok = np.isfinite(perf[i]) & np.isfinite(when[i])
        order = np.argsort(when[i][ok], kind="stable")
        pairs.append((when[i][ok][order], perf[i][ok][order]))
    if env_grid is None:
        env_grid = np.unique(np.concatenate([w for w, _ in pairs])) if pairs else np.array([])
    grid = np.asarray(env_grid, dtype=float)
    out = np.full((perf.shape[0], grid.size), np.nan)
    for i, (w, v) in enumerate(pairs):
        if w.size == 0:
            continue
        idx = np.searchsorted(w, grid, side="right") - 1
        ok = (idx >= 0) & (grid <= w[-1])
        out[i, ok] = v[idx[ok]]
    coords = {c: ("run", ds[c].values) for c in ds.coords if ds[c].dims == ("run",)}
    coords.setdefault("spec_hash", ("run", ds["run"].values))  # load_runs: the run coordinate is the spec hash
    coords["env_step"] = grid.astype(np.int64)
    return xr.DataArray(out, dims=("run", "env_step"), coords=coords, name="perf")


def summarize(ds: xr.Dataset, *, final_points: int = 3, frac: float = 0.5, recover_frac: float = 0.8,
              window: int | None = None, scale: float | None = None, min_gain_frac: float = 0.1):
    """One row per run (pandas DataFrame): learner, perturbation, seed, noise knobs,
    ``pre_return`` (baseline before the perturbation start), ``final_return`` (mean
    of the last ``final_points`` evaluations), ``collapsed`` (:func:`stabstudy.events.collapse`
    with ``frac``/``recover_frac``/``window`` in env steps and ``min_gain =
    min_gain_frac * scale``, so a run that learned little before the event must
    still lose ``(1 - frac) * min_gain_frac`` of the scale), ``min_level``,
    ``max_drawdown``, ``recovery_time`` (env steps), ``stability`` (:func:`stabstudy.stats.stability_score`
    with a shared ``scale``: default the spread between the median untrained return
    and the best evaluation over all runs). Runs without a perturbation use the
    grid's median perturbation start as a pseudo-event (so baselines get a
    collapse rate too). A run with status ``diverged`` counts as collapsed.

    Each run's numbers come from its own evaluations only (its own env steps): on the
    union grid of all runs, the "last points" before an event or at the end would
    include copies of its values placed at other runs' env steps, and a run's verdict
    would depend on which other runs are in ``ds``.
    """
    import pandas as pd

    from stabstudy import events, stats

    if "run" not in ds.dims:
        ds = ds.expand_dims(run=[0])
    curves = eval_curves(ds)
    starts = curves["pert_start"].values.astype(float) if "pert_start" in curves.coords else np.full(curves.sizes["run"], np.nan)
    pseudo = float(np.nanmedian(starts)) if np.isfinite(starts).any() else float(curves.env_step.values[len(curves.env_step) // 2])
    vals = curves.values
    first = vals[:, 0] if vals.shape[1] else np.array([np.nan])
    if scale is None:
        scale = float(np.nanmax(vals) - np.nanmedian(first)) if np.isfinite(vals).any() else 1.0
    rows = []
    for i in range(curves.sizes["run"]):
        c = eval_curves(ds.isel(run=[i])).isel(run=0).rename(env_step="step")
        ev = starts[i] if np.isfinite(starts[i]) else pseudo
        res = events.collapse(c, ev, frac=frac, recover_frac=recover_frac, window=window,
                              min_gain=min_gain_frac * scale)
        fin = c.values[np.isfinite(c.values)]
        row = {k: curves[k].values[i] for k in ("spec_hash", "learner", "seed", "pert_kind", "pert_dose", "pert_start",
                                                  "status") if k in curves.coords}
        for knob in set(NOISE_KNOB.values()):
            if f"hp_{knob}" in curves.coords:
                row[knob] = curves[f"hp_{knob}"].values[i]
        row.update(
            event=ev, pre_return=res.baseline, final_return=float(np.mean(fin[-final_points:])) if fin.size else np.nan,
            collapsed=1.0 if row.get("status") == "diverged" else (float(res.collapsed) if np.isfinite(res.baseline) else np.nan),
            min_level=res.min_level,
            max_drawdown=events.max_drawdown(c, start=ev),
            recovery_time=events.recovery_time(c, ev, abs_tol=0.1 * scale),
            stability=stats.stability_score(c, ev, scale=scale),
        )
        rows.append(row)
    out = pd.DataFrame(rows)
    out.attrs["scale"] = scale
    return out


# -- group statistics and the claims ----------------------------------------------------


def group_summary(table, by: Sequence[str] = ("learner", "pert_kind")):
    """Per group of :func:`summarize` rows: ``n`` (runs with a collapse verdict), IQM of ``pre_return``, ``final_return``,
    ``stability``, collapse fraction ``p_collapse`` with a Clopper-Pearson 95% CI
    (``p_low``, ``p_high``) and the number of ``diverged`` runs."""
    import pandas as pd

    from stabstudy import stats

    rows = []
    for key, g in table.groupby(list(by), sort=True, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        p, lo, hi = stats.collapse_probability(g["collapsed"].values)
        # n: runs with a verdict, the denominator of p_collapse (a run without one is NaN there)
        n = int(np.isfinite(g["collapsed"].to_numpy(float)).sum())
        rows.append({**dict(zip(by, key, strict=True)), "n": n, "pre_return": stats.iqm(g["pre_return"]),
                     "final_return": stats.iqm(g["final_return"]), "stability": stats.iqm(g["stability"]),
                     "p_collapse": p, "p_low": lo, "p_high": hi,
                     "diverged": int((g.get("status", pd.Series(dtype=str)) == "diverged").sum())})
    return pd.DataFrame(rows)


def dose_response(table, dose_col: str = "pert_dose", level: float = 0.5):
    """Collapse probability per learner and dose, and the critical dose per learner.

    Returns ``(per_dose, critical)``: a DataFrame (learner, dose, n, p_collapse,
    p_low, p_high) and ``{learner: stats.CriticalDose}``.
    """
    from stabstudy import stats

    per = group_summary(table, by=("learner", dose_col)).rename(columns={dose_col: "dose"})
    crit = {a: stats.critical_dose(g[dose_col].values, g["collapsed"].values, level=level)
            for a, g in table.groupby("learner")}
    return per, crit


def noise_response(table):
    """Controlled stochasticity: per learner and value of its own noise knob
    (:data:`NOISE_KNOB`), collapse probability and IQM stability / final return,
    plus Spearman's rho of stability vs the knob value per learner (``rho``, ``p_value``).
    Larger knob values = more stochasticity for every learner."""
    import pandas as pd
    from scipy.stats import spearmanr

    from stabstudy import stats

    rows, rhos = [], {}
    for a, g in table.groupby("learner"):
        knob = NOISE_KNOB[a]
        if knob not in g:
            continue
        g = g.assign(noise=pd.to_numeric(g[knob], errors="coerce"))
        for v, h in g.groupby("noise"):
            p, lo, hi = stats.collapse_probability(h["collapsed"].values)
            rows.append({"learner": a, "knob": knob, "noise": v, "n": len(h), "p_collapse": p, "p_low": lo,
                         "p_high": hi, "stability": stats.iqm(h["stability"]), "final_return": stats.iqm(h["final_return"])})
        ok = g["noise"].notna() & g["stability"].notna()
        if ok.sum() >= 3 and g.loc[ok, "noise"].nunique() > 1 and g.loc[ok, "stability"].nunique() > 1:
            r = spearmanr(g.loc[ok, "noise"], g.loc[ok, "stability"])
            rhos[a] = (float(r.statistic), float(r.pvalue))
    out = pd.DataFrame(rows)
    if len(out):
        out["rho"] = out["learner"].map(lambda a: rhos.get(a, (np.nan, np.nan))[0])
        out["p_value"] = out["learner"].map(lambda a: rhos.get(a, (np.nan, np.nan))[1])
    return out


def _p(g, learner, kind):
    row = g[(g.learner == learner) & (g.pert_kind == kind)]
    if row.empty:
        return None
    r = row.iloc[0]
    return r


def _fmt_p(r) -> str:
    return f"{r.p_collapse:.0%} of {int(r.n)} runs collapsed (95% CI {r.p_low:.0%}-{r.p_high:.0%})"


def claims_table(comp, scale: float, dose_crit: Mapping[str, Any] | None = None, noise=None,
                 on_policy: str = "ppo", off_policy: Sequence[str] = ("sac", "td3"), comparable_tol: float = 0.25):
    """The claims of the original report against our data, one row per claim.

    Args:
        comp: :func:`summarize` table of the comparison grid (all perturbation kinds).
        scale: the return scale used for stability (for "comparable returns").
        dose_crit: ``{learner: CriticalDose}`` from :func:`dose_response`.
        noise: :func:`noise_response` table.

    Verdict rules (point estimates; the measurement column always gives n and the
    Clopper-Pearson 95% CI; ``decisive`` says whether the CI excludes the 50% threshold):

    * "X collapses": supported when X's collapse fraction >= 50% and above its
      unperturbed rate; not supported otherwise. When the CI straddles 50% the
      verdict is "inconclusive (leans for/against)" instead.
    * "Y keeps learning": supported when Y's collapse fraction < 50% and the median
      of (final - pre-perturbation return) >= 0; not supported otherwise.
    * "comparable returns before": supported when the IQM pre-perturbation returns
      differ by at most ``comparable_tol * scale``.
    * "same pattern under K": supported when the on-policy collapse fraction >= 50%
      and every off-policy one < 50%.
    * decoupling: Spearman rho between final return and stability over perturbed
      runs; supported when |rho| < 0.3, not supported when rho >= 0.3 with
      p < 0.05, inconclusive otherwise (or n < 6).
    * stochasticity buffers: mean over learners of Spearman rho(stability, noise
      knob); supported when > 0.3, not supported when < -0.3, else inconclusive.
    * critical dose: supported when the on-policy critical dose is below every
      off-policy one (a NaN = never reached = above the tested range).
    Any group with no runs gives "inconclusive".
    """
    import pandas as pd
    from scipy.stats import spearmanr

    g = group_summary(comp)
    rows = []

    def add(claim, meas, verdict, decisive=""):
        rows.append({"claim": claim, "our measurement": meas, "supported?": verdict, "decisive": decisive})

    def verdict(ok: bool, dec: str) -> str:
        # A point estimate whose 95% interval straddles 50% decides nothing: say which way it leans.
        if dec == "no":
            return f"inconclusive (leans {'for' if ok else 'against'})"
        return "supported" if ok else "not supported"

    def med_gain(a, kind):
        h = comp[(comp.learner == a) & (comp.pert_kind == kind)]
        return float(np.nanmedian(h.final_return - h.pre_return)) if len(h) else np.nan

    # 1. on-policy collapse under lr spike
    for kind, label in (("lr_spike", "a single learning-rate spike"), ("action_noise", "action noise"),
                        ("reward_scale", "a reward-scale perturbation")):
        r, r0 = _p(g, on_policy, kind), _p(g, on_policy, "none")
        if r is None:
            add(f"{on_policy.upper()} collapses irreversibly after {label}", "no runs", "inconclusive")
            continue
        p0 = r0.p_collapse if r0 is not None else 0.0
        sup = r.p_collapse >= 0.5 and r.p_collapse > p0
        meas = _fmt_p(r) + (f"; unperturbed: {r0.p_collapse:.0%} of {int(r0.n)}" if r0 is not None else "")
        dec = "yes" if (r.p_low > 0.5 or r.p_high < 0.5) else "no"
        add(f"{on_policy.upper()} collapses irreversibly after {label}", meas, verdict(sup, dec), dec)
        for a in off_policy:
            q = _p(g, a, kind)
            if q is None:
                add(f"{a.upper()} keeps learning after {label}", "no runs", "inconclusive")
                continue
            gain = med_gain(a, kind)
            ok = q.p_collapse < 0.5 and gain >= 0
            dec = "yes" if (q.p_high < 0.5 or q.p_low > 0.5) else "no"
            add(f"{a.upper()} keeps learning after {label}",
                _fmt_p(q) + f"; median final - pre-perturbation return {gain:+.0f}", verdict(ok, dec), dec)
        if kind == "lr_spike":
            pre_on = r.pre_return
            pre_off = [(_p(g, a, kind).pre_return if _p(g, a, kind) is not None else np.nan) for a in off_policy]
            diffs = [abs(pre_on - x) for x in pre_off if np.isfinite(x)]
            if diffs and np.isfinite(pre_on):
                ok = max(diffs) <= comparable_tol * scale
                add("returns before the spike are comparable across algorithms",
                    f"IQM pre-spike return {on_policy}: {pre_on:.0f}; "
                    + ", ".join(f"{a}: {x:.0f}" for a, x in zip(off_policy, pre_off, strict=True))
                    + f" (tolerance {comparable_tol:.0%} of the return scale {scale:.0f})",
                    "supported" if ok else "not supported")
        else:
            qs = [_p(g, a, kind) for a in off_policy]
            if r is not None and all(q is not None for q in qs):
                ok = r.p_collapse >= 0.5 and all(q.p_collapse < 0.5 for q in qs)
                add(f"same pattern under {label} ({on_policy} collapses, {', '.join(off_policy)} do not)",
                    f"collapse: {on_policy} {r.p_collapse:.0%}, "
                    + ", ".join(f"{a} {q.p_collapse:.0%}" for a, q in zip(off_policy, qs, strict=True)),
                    "supported" if ok else "not supported")
    # decoupling
    pert = comp[(comp.pert_kind != "none") & comp.final_return.notna() & comp.stability.notna()]
    if len(pert) >= 6 and pert.stability.nunique() > 1 and pert.final_return.nunique() > 1:
        res = spearmanr(pert.final_return, pert.stability)
        rho, pv = float(res.statistic), float(res.pvalue)
        verdict = "supported" if abs(rho) < 0.3 else ("not supported" if rho >= 0.3 and pv < 0.05 else "inconclusive")
        order_f = g[g.pert_kind != "none"].groupby("learner").final_return.mean().sort_values(ascending=False)
        order_s = g[g.pert_kind != "none"].groupby("learner").stability.mean().sort_values(ascending=False)
        add("high final return is decoupled from stability",
            f"Spearman rho(final return, stability) = {rho:+.2f} (p = {pv:.2g}, n = {len(pert)} perturbed runs); "
            f"rank by final return: {' > '.join(order_f.index)}; by stability: {' > '.join(order_s.index)}",
            verdict, "yes" if pv < 0.05 else "no")
    else:
        add("high final return is decoupled from stability", f"only {len(pert)} perturbed runs", "inconclusive")
    # controlled stochasticity
    if noise is not None and len(noise) and noise["rho"].notna().any():
        per = noise.groupby("learner").rho.first().dropna()
        m = float(per.mean())
        verdict = "supported" if m > 0.3 else ("not supported" if m < -0.3 else "inconclusive")
        add("more of the algorithm's own noise buffers the spike (higher stability)",
            "Spearman rho(stability, noise knob): " + ", ".join(f"{a} {v:+.2f}" for a, v in per.items()), verdict)
    else:
        add("more of the algorithm's own noise buffers the spike (higher stability)", "not enough runs", "inconclusive")
    # critical dose
    if dose_crit:
        def val(a):
            c = dose_crit.get(a)
            return np.inf if c is None or not np.isfinite(c.dose) else c.dose
        if on_policy in dose_crit and any(a in dose_crit for a in off_policy):
            cd = {a: val(a) for a in [on_policy, *off_policy] if a in dose_crit}
            finite = [v for v in cd.values() if np.isfinite(v)]
            verdict = "inconclusive" if not finite else (
                "supported" if all(cd[on_policy] < v for a, v in cd.items() if a != on_policy) else "not supported")
            add(f"{on_policy.upper()} has a lower critical lr-spike dose than {', '.join(off_policy)}",
                "critical dose (50% collapse): " + ", ".join(
                    f"{a} {'never reached' if not np.isfinite(v) else f'{v:.3g}'}" for a, v in cd.items()), verdict)
    return pd.DataFrame(rows)


def algo_hparams(algos: Sequence[str], task: str, common: Mapping[str, Any] | None = None,
                 per_algo: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """Per-learner hyperparameters with the learner's own noise knob made explicit
    (so the noise study shares its default-noise runs with the comparison grid):
    PPO/A2C ``ent_coef`` 0.0, SAC ``target_entropy = -dim(action space)`` (SB3's
    "auto"), TD3/DDPG ``action_noise_std`` 0.1. ``common`` applies to every
    learner where the name is valid; ``per_algo`` overrides."""
    env = _make_base(task)
    n_act = int(np.prod(env.action_space.shape))
    env.close()
    out = {}
    for a in algos:
        valid = set(DEFAULTS[a]) | set(COMMON_DEFAULTS)
        hp = {k: v for k, v in (common or {}).items() if k in valid}
        knob = NOISE_KNOB[a]
        hp[knob] = -float(n_act) if knob == "target_entropy" else float(DEFAULTS[a][knob])
        hp.update((per_algo or {}).get(a, {}))
        out[a] = hp
    return out


def reliability_table(curves: xr.DataArray, by: Sequence[str] = ("learner", "pert_kind"), window: int = 5,
                      alpha: float = 0.05, smooth: int = 3, final_points: int = 3):
    """Chan et al. 2020 reliability metrics per group of runs of :func:`eval_curves` output.

    Columns: ``dispersion_time`` (median over runs of DT, window ``window``
    evaluations), ``short_term_risk`` (median SRT, CVaR ``alpha`` of differences),
    ``long_term_risk`` (median LRT, CVaR of drawdown), ``dispersion_runs`` (mean
    over evaluation points of DR after a ``smooth``-point moving average),
    ``risk_runs`` (RR: CVaR ``alpha`` of the final returns = mean of the last
    ``final_points`` evaluations).
    """
    import pandas as pd

    from stabstudy import stats

    c = curves.rename(env_step="step")
    keys = pd.DataFrame({k: c[k].values for k in by})
    rows = []
    for key, idx in keys.groupby(list(by)).groups.items():
        sub = c.isel(run=np.asarray(list(idx)))
        finals = [float(np.mean(v[np.isfinite(v)][-final_points:])) if np.isfinite(v).any() else np.nan
                  for v in sub.values]
        key = key if isinstance(key, tuple) else (key,)
        rows.append({**dict(zip(by, key, strict=True)), "n": sub.sizes["run"],
                     "dispersion_time": float(np.nanmedian(stats.dispersion_across_time(sub, window=window).values)),
                     "short_term_risk": float(np.nanmedian(stats.short_term_risk(sub, alpha=alpha).values)),
                     "long_term_risk": float(np.nanmedian(stats.long_term_risk(sub, alpha=alpha).values)),
                     "dispersion_runs": float(np.nanmean(stats.dispersion_across_runs(sub, smooth=smooth).values))
                     if sub.sizes["run"] > 1 else np.nan,
                     "risk_runs": stats.risk_across_runs(finals, alpha=alpha)})
    return pd.DataFrame(rows)


def run_frame(ds: xr.Dataset, spec_hash: str, channels: Sequence[str], agg: str | None = None):
    """One run of a :func:`stabstudy.store.load_runs` Dataset as a pandas DataFrame
    indexed by ``env_step`` (rows of updates; channels absent in the Dataset are skipped).
    ``agg`` (e.g. ``"median"``): aggregate the rows sharing an env step (the updates of
    one on-policy ``train()`` call) with that pandas reduction."""
    import pandas as pd

    one = ds.sel(run=spec_hash)
    env = one["env_step"].values
    ok = np.isfinite(env.astype(float))
    data = {ch: one[ch].values[ok] for ch in channels if ch in one}
    frame = pd.DataFrame(data, index=pd.Index(env[ok].astype(np.int64), name="env_step"))
    return frame.groupby(level=0).agg(agg) if agg else frame
