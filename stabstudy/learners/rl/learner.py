"""Reinforcement-learning learner: ``run(spec)`` trains a stable-baselines3 agent with the stability callbacks.

``run(spec)`` trains PPO, SAC, TD3, A2C or DDPG from stable-baselines3 on any
gymnasium environment (``spec.task``, e.g. ``HalfCheetah-v5`` or
``Pendulum-v1``) for ``spec.steps`` environment steps and returns an
:class:`xarray.Dataset` per the learner contract. The work is done by the
callbacks of :mod:`stabstudy.learners.rl.callbacks` (one job each, composed by
:func:`callbacks_for`; their module docstring defines the step axis, the timing of
evaluations, diagnostics and perturbations, and divergence) on the envs of
:mod:`stabstudy.learners.rl.envs`. Evaluation: ``eval_episodes`` episodes every
``spec.eval_every`` env steps (default ``spec.steps // 20``) on an unperturbed env,
episode ``i`` reset with seed ``spec.seed + 10_000 + i``.

Hyperparameters (``spec.hparams``; fields and defaults per learner in :mod:`stabstudy.hparams`): ``hidden``,
``layers`` (MLP size of policy and value nets), ``lr``, ``batch_size``, ``n_steps``,
``n_epochs``, ``gamma``, ``gae_lambda``, ``clip_range``, ``ent_coef`` (PPO/A2C: float;
SAC: ``"auto"`` or float), ``target_entropy`` (SAC: ``"auto"`` or float),
``action_noise_std`` (TD3/DDPG exploration noise), ``learning_starts``, ``buffer_size``,
``train_freq``, ``gradient_steps``, ``tau``, ``policy_delay``, ``eval_episodes``,
``eval_max_steps`` (0 = env default), ``max_episode_steps`` (0 = env default),
``monitor_every`` (Monitor's ``every``), ``diag_every`` (diagnostics and full divergence
check every this many ``train()`` calls, off-policy), ``diverge_threshold``, ``normalize_obs``
(SB3 ``VecNormalize`` of the observations; evaluation normalises with the training statistics),
``prefix_steps`` and ``noise_after_fork`` (forks of stored prefixes: :mod:`stabstudy.learners.rl.forks`).
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import stable_baselines3 as sb3
import xarray as xr
from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.callbacks import BaseCallback, CallbackList
from stable_baselines3.common.noise import NormalActionNoise
from stable_baselines3.common.vec_env import VecEnv, VecNormalize

from stabstudy.hparams import defaults, merged
from stabstudy.instruments.precision import all_finite
from stabstudy.interventions import control
from stabstudy.learners.rl import forks
from stabstudy.learners.rl.callbacks import (
    EVAL_SEED_OFFSET,
    ControllerCallback,
    DiagnosticsCallback,
    DivergenceCallback,
    EpisodeReturnCallback,
    EvaluationCallback,
    PerturbationCallback,
    TelemetryCallback,
)
from stabstudy.learners.rl.envs import ENV_KINDS, check_env_id, make_base, make_env, make_eval_env
from stabstudy.learners.rl.matching import MatchCallback, TargetReached
from stabstudy.learners.rl.recorder import ROLLOUT_FLAGGED, Recorder
from stabstudy.registry import LEARNERS, NOISE_KNOB, ON_POLICY, arm_learner, hparams_class
from stabstudy.seeding import seed_everything
from stabstudy.spec import RunSpec

#: Bump when a change to this learner alters the results it stores: the runner then
#: recomputes stored runs of other versions instead of reusing them.
#: 2: the divergence check reads the Monitor's gradient norm (version 1 read a logged value
#: that was never logged, so a non-finite or exploding gradient norm went unnoticed there).
#: 3: the finite-parameter check sums norms in float64 (in float32 finite weights above ~1e19
#: overflowed the norm and were flagged as non-finite).
#: 4: the closing evaluation is of the policy after the last update (before, an evaluation due at the
#: last env step ran before the train() call that follows it, so a run's curve ended one rollout, or
#: one train call, short of its end and the last update of a prefix was never evaluated).
#: 5: an evaluation's episodes step side by side, one batched forward pass per step (returns equal
#: to the one-at-a-time episodes' up to the last bits of the forward pass; 2.3-2.8x faster).
RESULTS_VERSION = 5

ALGOS = tuple(LEARNERS["rl"])
#: The stable-baselines3 class of each learner.
ALGO_CLASSES: dict[str, type[BaseAlgorithm]] = {"ppo": sb3.PPO, "sac": sb3.SAC, "td3": sb3.TD3, "a2c": sb3.A2C,
                                                "ddpg": sb3.DDPG}


def hparams_for(spec: RunSpec) -> dict[str, Any]:
    """The spec's hyperparameters over its learner's dataclass defaults (:mod:`stabstudy.hparams`)."""
    return merged(hparams_class("rl", spec.learner), spec.hp, f"rl learner {spec.learner!r}")


def build_model(spec: RunSpec, env: VecEnv | None = None) -> BaseAlgorithm:
    """The SB3 algorithm for ``spec`` (seeded with ``spec.seed``) on its training env
    (default: :func:`stabstudy.learners.rl.envs.make_env` with the spec's perturbations)."""
    if spec.learner not in ALGOS:
        raise ValueError(f"unknown RL learner {spec.learner!r}; valid: {', '.join(ALGOS)}")
    hp = hparams_for(spec)
    if env is None:
        env = make_env(spec.task, spec.perturbations, spec.seed, hp["max_episode_steps"])
        if hp["normalize_obs"]:
            env = VecNormalize(env, norm_obs=True, norm_reward=False, gamma=float(hp["gamma"]))
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


def callbacks_for(spec: RunSpec, monitor: bool = True, evaluation: bool = True) -> tuple[Recorder, CallbackList]:
    """The callbacks of ``spec`` (telemetry, perturbations, evaluation, diagnostics, divergence,
    episode returns) sharing one :class:`Recorder`; ``monitor`` / ``evaluation`` False leave
    out the telemetry / the evaluation."""
    hp = hparams_for(spec)
    rec = Recorder(log_every=spec.log_every)
    cbs: list[BaseCallback] = [EpisodeReturnCallback(rec)]
    if monitor:
        cbs.append(TelemetryCallback(rec, every=max(int(hp["monitor_every"]), spec.log_every)))
    cbs.append(PerturbationCallback(rec, spec.perturbations, seed=spec.seed,
                                    spike_ent_coef=bool(hp.get("spike_ent_coef", False)),
                                    purge_replay=bool(hp.get("purge_replay", False))))
    if evaluation:
        span = spec.steps - (forks.prefix_steps(spec) if forks.role(spec) == "fork" else 0)
        cbs.append(EvaluationCallback(rec, [make_eval_env(spec.task, hp["eval_max_steps"])
                                            for _ in range(int(hp["eval_episodes"]))],
                                      every=spec.eval_every or max(1, span // 20),
                                      episodes=int(hp["eval_episodes"]), seed=spec.seed + EVAL_SEED_OFFSET))
    cbs.append(DiagnosticsCallback(rec, every=int(hp["diag_every"]), seed=spec.seed))
    cbs.append(DivergenceCallback(rec, threshold=float(hp["diverge_threshold"]), every=int(hp["diag_every"])))
    ctrl = control.from_hparams(hp)
    if ctrl is not None:  # after the lr-spike hooks (installed at init), so that its lr back-off acts on the spiked lr
        cbs.append(ControllerCallback(rec, ctrl))
    if forks.role(spec) == "match":  # last: it stops training at a rollout start the others have seen
        cbs.append(MatchCallback(rec, float(hp["match_return"]), spec.eval_every))
    return rec, CallbackList(cbs)


def close_callbacks(rec: Recorder, cb: CallbackList) -> None:
    """Remove every hook of ``rec`` and its callbacks (they close themselves when ``learn()``
    ends normally; this is for the run that raised)."""
    for c in cb.callbacks:
        c.close()
    rec.close()


def _numerical_blowup(e: Exception) -> bool:
    """An exception raised by a numerically blown-up policy: torch.distributions rejecting
    non-finite / out-of-range parameters (e.g. ``exp(log_std)`` overflowing to inf), or
    NaN/inf in a simulator error message."""
    msg = str(e).lower()
    return (isinstance(e, ValueError) and ("expected parameter" in msg or "invalid values" in msg)) or \
        any(w in msg for w in ("nan", " inf", "unstable", "overflow"))


def _diagnostics(cb: CallbackList) -> DiagnosticsCallback:
    return next(c for c in cb.callbacks if isinstance(c, DiagnosticsCallback))


def resume(spec: RunSpec) -> tuple[BaseAlgorithm, dict[str, Any]]:
    """The model of a fork at its fork point, restored from its prefix's verified checkpoint
    (:mod:`stabstudy.learners.rl.forks`), and what the prefix's recorder left (``n_updates``,
    ``train_calls``, ``diag_rng``) with the checkpoint's ``status``, ``reason`` and ``sha256``.
    Without a checkpoint the prefix is trained here first (and stored)."""
    hp = hparams_for(spec)
    key = forks.prefix_key(spec)
    try:
        forks.read_sidecar(key.spec_hash)
    except FileNotFoundError:
        warnings.warn(f"no checkpoint of the prefix {key.label} in {forks.checkpoints_dir()}; training it here "
                      "(run the prefixes first: forks.prefix_specs)", RuntimeWarning, stacklevel=2)
        run(key)
        seed_everything(spec.seed)
    # built afresh from the fork's own spec (its env, its replay capacity), then the prefix's state put into it
    model = build_model(spec)
    extra, meta = forks.load(key.spec_hash, model)
    if hp["noise_after_fork"] != "same":
        forks.set_noise(model, spec.learner, float(hp["noise_after_fork"]))
    return model, {**extra, "status": meta["status"], "reason": meta["reason"], "sha256": meta["sha256"]}


def run(spec: RunSpec) -> xr.Dataset:
    """Train ``spec.learner`` on ``spec.task`` for ``spec.steps`` env steps; see the module docstring.

    With ``prefix_steps`` (:mod:`stabstudy.learners.rl.forks`): a prefix run trains from
    scratch without the Monitor (nothing perturbs it; its record is the learning curve) and
    stores its checkpoint; a fork continues its prefix's checkpoint to ``spec.steps``. With
    ``match_return``: a matching prefix, which stops where its return first reached the target
    (at most ``spec.steps``) and stores the checkpoint of the plain prefix of that length
    (``attrs``: ``matched``, ``match_env_step``, ``match_return``, ``prefix_hash``).

    Returns the Dataset (dim ``step`` = updates completed, coordinate ``env_step``),
    ``attrs["status"]`` ``"ok"`` or ``"diverged"`` (with ``diverge_reason``).
    """
    if spec.domain != "rl":
        raise ValueError(f"stabstudy.learners.rl.learner.run handles domain 'rl', got {spec.domain!r}")
    check_env_id(spec.task)
    kind = forks.role(spec)
    forks.check(spec, hparams_for(spec))
    seed_everything(spec.seed)
    t0 = time.perf_counter()
    resumed: dict[str, Any] = {}
    if kind == "fork":
        model, resumed = resume(spec)
    else:
        model = build_model(spec)
    rec, cb = callbacks_for(spec, monitor=kind not in ("prefix", "match"))
    if resumed:
        rec.resume(resumed["n_updates"], resumed["train_calls"], model.num_timesteps)
        _diagnostics(cb).rng_state = resumed["diag_rng"]
        if resumed["status"] == "diverged":
            rec.diverge(f"the prefix diverged: {resumed['reason']}")
    try:
        if not rec.diverged:
            model.learn(total_timesteps=spec.steps - model.num_timesteps, callback=cb, progress_bar=False,
                        reset_num_timesteps=kind != "fork")
    except TargetReached:
        cb.on_training_end()  # what learn() calls where it ends: the closing evaluation, the callbacks closed
    except Exception as e:  # a diverged policy can crash SB3 (NaN distribution parameters) or MuJoCo
        if rec.diverged or not all_finite(model.policy.parameters()) or _numerical_blowup(e):
            rec.diverge(f"{type(e).__name__}: {str(e)[:200]}")
        else:
            raise
    finally:
        close_callbacks(rec, cb)
    ds = rec.to_dataset()
    for c in cb.callbacks:
        if isinstance(c, ControllerCallback):
            ds.attrs.update(c.attrs())
        if isinstance(c, PerturbationCallback):
            ds.attrs.update(replay_purged=c.replay_purged, replay_kept=c.replay_kept)
    ds.attrs.update(status="diverged" if rec.diverged else "ok", diverge_reason=rec.diverge_reason,
                    env_steps=int(model.num_timesteps), n_updates=int(rec.n_updates), algo=spec.learner,
                    learner_wall_s=float(time.perf_counter() - t0), perturbation_rows=PERTURBATION_ROWS,
                    monitor_own_steps=MONITOR_OWN_STEPS, fork_role=kind, dose_rules=DOSE_RULES,
                    replay_rule=REPLAY_RULE)
    if kind in ("prefix", "match"):
        key = spec if kind == "prefix" else forks.matched_prefix(spec, int(model.num_timesteps))
        _, sha = forks.save(key, model, {"n_updates": rec.n_updates, "train_calls": rec.train_calls,
                                         "diag_rng": _diagnostics(cb).rng_state},
                            ds.attrs["status"], rec.diverge_reason)
        ds.attrs.update(checkpoint_sha256=sha)
        if kind == "match":
            match = next(c for c in cb.callbacks if isinstance(c, MatchCallback))
            ds.attrs.update(prefix_hash=key.spec_hash, matched=int(match.reached is not None),
                            match_env_step=int(model.num_timesteps),
                            match_return=match.reached[1] if match.reached else math.nan)
    elif kind == "fork":
        ds.attrs.update(prefix_hash=forks.prefix_key(spec).spec_hash, checkpoint_sha256=resumed["sha256"])
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


#: 1: SAC's lr spike leaves the entropy-coefficient optimizer alone (``spike_ent_coef``) and an
#: off-policy learner's replay buffer drops an env-side window's transitions when it ends
#: (``purge_replay``); before, both were not so. Only SAC lr-spike runs and off-policy runs
#: with env-side kinds are affected (:func:`stale`), so other stored runs are kept.
DOSE_RULES = 1
#: 1: an env-side window's transitions leave a replay buffer that had wrapped too (before, a full buffer
#: kept them: ``replay_kept``), and ``obs_noise`` drops one more (the transition that starts from the
#: window's last noisy observation). Only off-policy runs with ``obs_noise`` or with ``replay_kept`` are
#: affected (:func:`stale`).
REPLAY_RULE = 1


def stale(spec: RunSpec, attrs: dict) -> str | None:
    """Why a stored run of ``spec`` no longer describes it, or None (see
    :func:`stabstudy.run.runner.pending`)."""
    kinds = {p.kind for p in spec.perturbations}
    affected = kinds & {"weight_noise", "reinit_layer"} or (spec.learner in ON_POLICY and kinds & set(ROLLOUT_FLAGGED))
    have = int(attrs.get("perturbation_rows", 0))
    if affected and have != PERTURBATION_ROWS:
        return f"keeps the rows of its perturbation by an older rule (perturbation_rows {have}, now {PERTURBATION_ROWS})"
    if int(attrs.get("dose_rules", 0)) != DOSE_RULES and (
            (spec.learner == "sac" and "lr_spike" in kinds) or (spec.learner not in ON_POLICY and kinds & set(ENV_KINDS))):
        return (f"made by older dose rules (dose_rules {int(attrs.get('dose_rules', 0))}, now {DOSE_RULES}: SAC's "
                "entropy-coefficient optimizer spiked, env-side transitions kept in the replay buffer)")
    if int(attrs.get("replay_rule", 0)) != REPLAY_RULE and spec.learner not in ON_POLICY and (
            "obs_noise" in kinds or int(attrs.get("replay_kept", 0)) > 0):
        return (f"purged its replay buffer by an older rule (replay_rule {int(attrs.get('replay_rule', 0))}, now "
                f"{REPLAY_RULE}: a wrapped buffer kept the window, obs_noise left its last transition)")
    if spec.learner == "td3" and int(attrs.get("monitor_own_steps", 0)) != MONITOR_OWN_STEPS:
        return "sampled the delayed actor's telemetry by rows, not by its own steps (monitor_own_steps 0)"
    if forks.role(spec) == "prefix" and attrs.get("status") in ("ok", "diverged") and not forks.has_checkpoint(spec):
        # its forks need the checkpoint, which only training the prefix again makes
        return f"is a prefix whose checkpoint is not in {forks.checkpoints_dir()}"
    if forks.role(spec) == "match" and attrs.get("status") in ("ok", "diverged") and not forks.has_checkpoint(
            forks.matched_prefix(spec, int(attrs.get("env_steps", 0)))):
        return f"is a matching prefix whose checkpoint is not in {forks.checkpoints_dir()}"
    return None


def algo_hparams(algos: Sequence[str], task: str, common: Mapping[str, Any] | None = None,
                 per_algo: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """Per-learner hyperparameters with the learner's own noise knob made explicit
    (so the noise study shares its default-noise runs with the comparison grid):
    PPO/A2C ``ent_coef`` 0.0, SAC ``target_entropy = -dim(action space)`` (SB3's
    "auto"), TD3/DDPG ``action_noise_std`` 0.1. ``common`` applies to every
    learner where the name is valid; ``per_algo`` overrides. ``algos`` may name arms
    (``"ppo-tuned"``: :func:`stabstudy.registry.arm_learner`), each with its own ``per_algo`` entry."""
    env = make_base(task)
    n_act = int(np.prod(env.action_space.shape))
    env.close()
    out = {}
    for a in algos:
        base = defaults(hparams_class("rl", arm_learner(a)))
        hp = {k: v for k, v in (common or {}).items() if k in base}
        knob = NOISE_KNOB[arm_learner(a)]
        hp[knob] = -float(n_act) if knob == "target_entropy" else float(base[knob])
        hp.update((per_algo or {}).get(a, {}))
        out[a] = hp
    return out
