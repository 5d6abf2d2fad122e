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
  Optimizer channels (``grad_norm``, ``lr``, ...; :class:`stabstudy.instruments.telemetry.Monitor`)
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
  relative std ``dose`` on every policy parameter (:func:`stabstudy.interventions.perturb.add_weight_noise`).
* ``reinit_layer``: once, at ``start``; ``params={"layer": <policy submodule>}``.
The env wrappers count their own ``env.step`` calls (one training env).

Divergence: non-finite or exploding (``> diverge_threshold``) losses, gradient
norms, Q values, evaluation returns or parameters stop training; the run is
returned with ``attrs["status"] = "diverged"`` and the data up to there.

Hyperparameters (``spec.hparams``; fields and defaults per learner in :mod:`stabstudy.hparams`): ``hidden``,
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
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import xarray as xr

from stabstudy.hparams import defaults, merged
from stabstudy.interventions.perturb import Perturbation, Schedule, add_weight_noise, reinit_layer
from stabstudy.registry import LEARNERS, NOISE_KNOB, ON_POLICY, hparams_class
from stabstudy.seeding import seed_everything
from stabstudy.spec import RunSpec

#: Bump when a change to this learner alters the results it stores: the runner then
#: recomputes stored runs of other versions instead of reusing them.
#: 2: the divergence check reads the Monitor's gradient norm (version 1 read a logged value
#: that was never logged, so a non-finite or exploding gradient norm went unnoticed there).
#: 3: the finite-parameter check sums norms in float64 (in float32 finite weights above ~1e19
#: overflowed the norm and were flagged as non-finite).
RESULTS_VERSION = 3

ALGOS = tuple(LEARNERS["rl"])

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
    import mujoco  # a dependency (gymnasium[mujoco]); imported here to keep `import stabstudy.learners.rl.learner` light

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
    from stabstudy.instruments.precision import all_finite

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
        """SB3 callback: telemetry (:class:`stabstudy.instruments.telemetry.Monitor` on every
        optimizer), perturbation schedule (``lr_spike``, ``weight_noise``,
        ``reinit_layer``; env-side kinds need :func:`make_env`'s wrapper),
        evaluation and RL diagnostics, divergence detection.

        Args:
            schedule: a :class:`stabstudy.interventions.perturb.Schedule` (or perturbations); timing in env steps.
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
                                  "through the wrapper of stabstudy.learners.rl.learner.make_env, which this training env lacks",
                                  stacklevel=2)
            # 1) lr-spike hooks first, so the Monitor (registered after) sees the applied lr
            for opt in self.opts.values():
                self._handles.append(opt.register_step_pre_hook(self._lr_pre))
            counter = self.opts.get("critic", self.opts.get("policy"))
            self._handles.append(counter.register_step_post_hook(self._count))
            if self.use_monitor:
                from stabstudy.instruments.telemetry import Monitor

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
    raise AttributeError(f"module 'stabstudy.learners.rl.learner' has no attribute {name!r}")


# -- learner -------------------------------------------------------------------------


def hparams_for(spec: RunSpec) -> dict[str, Any]:
    """The spec's hyperparameters over its learner's dataclass defaults (:mod:`stabstudy.hparams`)."""
    return merged(hparams_class("rl", spec.learner), spec.hp, f"rl learner {spec.learner!r}")


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
        raise ValueError(f"stabstudy.learners.rl.learner.run handles domain 'rl', got {spec.domain!r}")
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
    :func:`stabstudy.run.runner.pending`)."""
    kinds = {p.kind for p in spec.perturbations}
    affected = kinds & {"weight_noise", "reinit_layer"} or (spec.learner in ON_POLICY and kinds & set(ROLLOUT_FLAGGED))
    have = int(attrs.get("perturbation_rows", 0))
    if affected and have != PERTURBATION_ROWS:
        return f"keeps the rows of its perturbation by an older rule (perturbation_rows {have}, now {PERTURBATION_ROWS})"
    if spec.learner == "td3" and int(attrs.get("monitor_own_steps", 0)) != MONITOR_OWN_STEPS:
        return "sampled the delayed actor's telemetry by rows, not by its own steps (monitor_own_steps 0)"
    return None


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
        base = defaults(hparams_class("rl", a))
        hp = {k: v for k, v in (common or {}).items() if k in base}
        knob = NOISE_KNOB[a]
        hp[knob] = -float(n_act) if knob == "target_entropy" else float(base[knob])
        hp.update((per_algo or {}).get(a, {}))
        out[a] = hp
    return out
