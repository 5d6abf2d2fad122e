"""gymnasium environments for the RL learners: training env with perturbation wrappers, clean evaluation env.

:func:`make_env` builds the training env (``gym.make`` -> SB3 ``Monitor`` ->
:class:`PerturbationWrapper` -> ``DummyVecEnv``), :func:`make_eval_env` the
unperturbed evaluation env. The env-side perturbation kinds (``action_noise``,
``obs_noise``, ``reward_scale``) act only through :class:`PerturbationWrapper`,
which counts its own ``env.step`` calls (the global env step with one training env).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from stable_baselines3.common.monitor import Monitor as SB3Monitor
from stable_baselines3.common.vec_env import DummyVecEnv

from stabstudy.interventions.perturb import Perturbation, Schedule
from stabstudy.registry import check_task

#: MuJoCo's compile warning about gymnasium's HalfCheetah XML, silenced in :func:`make_base`.
MUJOCO_XML_WARNING = r"MuJoCo: .*settotalmass"
#: Env-side perturbation kinds: they act through :class:`PerturbationWrapper` only.
ENV_KINDS = ("action_noise", "obs_noise", "reward_scale")


def check_env_id(task: str) -> None:
    """Raise ``ValueError`` with a clear message (and the closest ids) when ``task`` is not a registered
    gymnasium env id: :func:`stabstudy.registry.check_task`, as when a spec is built."""
    check_task("rl", task)


def route_mujoco_warnings() -> None:
    """Send MuJoCo's C-level warnings through Python's ``warnings`` (shown once per process)
    instead of printing them on every model compile (gymnasium's HalfCheetah-v5 XML triggers a
    deprecation warning each time) and appending them to MUJOCO_LOG.TXT. A handler the user
    installed is left alone."""
    # imported here: only MuJoCo tasks need it, and importing it costs a shared-library load
    import mujoco

    if mujoco.get_mju_user_warning() is None:
        mujoco.set_mju_user_warning(lambda msg: warnings.warn(f"MuJoCo: {msg}", RuntimeWarning, stacklevel=2))


def make_base(task: str, max_episode_steps: int = 0) -> gym.Env:
    """``gym.make(task)`` (with ``max_episode_steps`` when non-zero), MuJoCo warnings routed, the one
    about gymnasium's HalfCheetah XML (:data:`MUJOCO_XML_WARNING`) silenced."""
    check_env_id(task)
    route_mujoco_warnings()
    kw = {"max_episode_steps": int(max_episode_steps)} if max_episode_steps else {}
    with warnings.catch_warnings():
        # gymnasium's own HalfCheetah-v5 XML uses MuJoCo's deprecated 'settotalmass': a warning at
        # every model compile about a file that neither we nor the user can change buries real ones
        warnings.filterwarnings("ignore", message=MUJOCO_XML_WARNING, category=RuntimeWarning)
        return gym.make(task, **kw)


class PerturbationWrapper(gym.Wrapper):
    """Applies the env-side perturbations of a schedule, switched on/off by env step.

    Counts its own ``step`` calls (``env_step``, 0-based index of the step being
    taken). ``action_noise``: std ``dose * (high - low) / 2`` added to the
    action, then clipped; ``obs_noise``: std ``dose`` added to the returned
    observation; ``reward_scale``: reward multiplied by ``dose``. Noise comes
    from a private ``numpy.random.Generator(seed)``.
    """

    def __init__(self, env: gym.Env, schedule: Schedule, seed: int = 0):
        super().__init__(env)
        self.schedule = schedule
        self.env_step = 0
        self.rng = np.random.default_rng(seed)
        box = env.action_space
        self._low = getattr(box, "low", None)
        self._high = getattr(box, "high", None)

    def reset(self, **kwargs: Any) -> tuple[Any, dict]:
        obs, info = self.env.reset(**kwargs)
        on = self.schedule.of_kind("obs_noise", self.env_step)
        if on is not None:
            obs = (obs + self.rng.normal(size=np.shape(obs)) * on.dose).astype(obs.dtype)
        return obs, info

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict]:
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


def make_env(task: str, schedule: Schedule | Sequence[Perturbation] = (), seed: int = 0,
             max_episode_steps: int = 0) -> DummyVecEnv:
    """Training env: ``gym.make(task)`` -> SB3 ``Monitor`` (true returns) -> :class:`PerturbationWrapper` -> ``DummyVecEnv``.

    The SB3 Monitor sits inside the perturbation wrapper, so ``info["episode"]``
    holds the *unperturbed* episode return even under ``reward_scale``.
    """
    schedule = schedule if isinstance(schedule, Schedule) else Schedule(tuple(schedule))
    check_env_id(task)

    def thunk() -> gym.Env:
        return PerturbationWrapper(SB3Monitor(make_base(task, max_episode_steps)), schedule, seed=seed + 1)

    return DummyVecEnv([thunk])


def make_eval_env(task: str, max_episode_steps: int = 0) -> gym.Env:
    """Clean evaluation env (no perturbation)."""
    return make_base(task, max_episode_steps)


def env_wrapper(vec_env: Any) -> PerturbationWrapper | None:
    """The :class:`PerturbationWrapper` inside a :func:`make_env` VecEnv, or None when it has none."""
    envs = getattr(vec_env, "envs", None)
    if not envs:
        return None
    env = envs[0]
    while env is not None and not isinstance(env, PerturbationWrapper):
        env = getattr(env, "env", None)
    return env
