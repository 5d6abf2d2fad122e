"""The one registry: domains, learners, tasks, perturbation kinds and channels.

The CLI, spec validation, the runner, the docs and the tests all read these tables;
nothing else lists them. Learner code is named by ``"module:function"`` strings and
imported only when a run executes, so validating a spec never imports torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from stabstudy import hparams as H


@dataclass(frozen=True)
class Domain:
    """A family of learners that share a step unit, a learner entry point and tasks."""

    name: str
    entry: str
    """``"module:function"`` of ``run(spec) -> xr.Dataset``"""
    step_unit: str
    """what ``RunSpec.steps`` and perturbation windows count"""
    tasks: str
    """which tasks the domain accepts (checked by the learner)"""
    learners: dict[str, type]
    """learner name -> its hyperparameter dataclass"""


DOMAINS: dict[str, Domain] = {d.name: d for d in (
    Domain("toy", "stabstudy.learners.toy:run", "optimizer updates",
           "digits | synthetic", {"gd": H.ToyHParams, "sgd": H.ToyHParams, "adam": H.ToyHParams}),
    Domain("rl", "stabstudy.learners.rl.learner:run", "environment steps",
           "a gymnasium env id (HalfCheetah-v5, Pendulum-v1, ...)",
           {"ppo": H.PPOHParams, "sac": H.SACHParams, "td3": H.TD3HParams, "a2c": H.A2CHParams,
            "ddpg": H.DDPGHParams}),
    Domain("lm", "stabstudy.learners.lm:run", "optimizer updates",
           "stdlib (the Python standard library sources) or a text-file path", {"gpt": H.GPTHParams}),
    Domain("seq", "stabstudy.learners.seq:run", "optimizer updates",
           "adding (the adding problem, generated from the seed)",
           {"rnn_tanh": H.SeqHParams, "rnn_linear": H.SeqHParams, "lstm": H.SeqHParams}),
)}

#: Valid learners per domain.
LEARNERS: dict[str, tuple[str, ...]] = {d.name: tuple(d.learners) for d in DOMAINS.values()}
#: RL learners that update at rollout ends.
ON_POLICY = ("ppo", "a2c")
#: Each RL learner's own stochasticity knob (a hyperparameter name).
NOISE_KNOB = {"ppo": "ent_coef", "a2c": "ent_coef", "sac": "target_entropy", "td3": "action_noise_std",
              "ddpg": "action_noise_std"}


def domain(name: str) -> Domain:
    """The :class:`Domain` called ``name``; ``ValueError`` naming the valid domains otherwise."""
    if name not in DOMAINS:
        raise ValueError(f"unknown domain {name!r}; valid domains: {', '.join(DOMAINS)}")
    return DOMAINS[name]


def hparams_class(domain_name: str, learner: str) -> type:
    """The hyperparameter dataclass of ``learner``; ``ValueError`` naming the valid learners otherwise."""
    d = domain(domain_name)
    if learner not in d.learners:
        raise ValueError(f"unknown learner {learner!r} for domain {domain_name!r}; "
                         f"valid learners: {', '.join(d.learners)}")
    return d.learners[learner]


def learner_for(domain_name: str) -> Callable:
    """Import the learner function of ``domain_name``."""
    mod, fn = domain(domain_name).entry.split(":")
    return getattr(importlib.import_module(mod), fn)


# -- perturbation kinds ------------------------------------------------------------------

DIMENSIONS = ("optimization", "environment-data", "parametric", "learning-signal")
_ALL = tuple(DOMAINS)


@dataclass(frozen=True)
class Kind:
    """What a perturbation kind does and where it applies."""

    name: str
    dimension: str
    domains: tuple[str, ...]
    dose: str
    """meaning of ``Perturbation.dose`` for this kind"""
    instantaneous: bool = False
    """applied once at ``start`` (duration is then the observation window only)"""


KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("lr_spike", "optimization", _ALL, "factor multiplying the learning rate"),
    Kind("lr_ramp", "optimization", ("toy", "lm"), "final learning-rate factor: it climbs geometrically from 1 "
         "over the window, reaches dose at its last step and stays there until the run ends"),
    Kind("beta2_shift", "optimization", ("toy", "lm"), "new Adam beta2 while active"),
    Kind("grad_noise", "optimization", ("toy", "lm"), "Gaussian noise std relative to the gradient RMS"),
    Kind("no_warmup", "optimization", ("lm",), "ignored (1.0): the warmup phase is removed"),
    Kind("weight_noise", "parametric", _ALL, "Gaussian noise std relative to each tensor's RMS", instantaneous=True),
    Kind("reinit_layer", "parametric", _ALL, "fraction of the layer re-initialised (1.0 = whole layer)",
         instantaneous=True),
    Kind("outlier_batch", "environment-data", ("toy", "lm"), "fraction of the batch replaced by outliers"),
    Kind("action_noise", "environment-data", ("rl",), "Gaussian std added to actions, relative to the action range"),
    Kind("obs_noise", "environment-data", ("rl",), "Gaussian std added to observations"),
    Kind("reward_scale", "learning-signal", ("rl",), "factor multiplying the reward"),
    Kind("loss_scale", "learning-signal", ("toy", "lm"), "factor multiplying the loss"),
    Kind("precision_switch", "learning-signal", ("lm",), "ignored (1.0): params['dtype'] names the new autocast dtype"),
)}


_ADDED: set[str] = set()


def add_kind(kind: Kind) -> None:
    """Add a kind at run time (what :func:`stabstudy.interventions.perturb.register` does for a new
    :class:`Kind`); ``ValueError`` for a taken name, an unknown dimension or domain."""
    if not isinstance(kind, Kind):
        raise TypeError(f"add_kind needs a Kind, got {type(kind).__name__}")
    if not kind.name.isidentifier() or kind.name in KINDS:
        raise ValueError(f"perturbation kind name {kind.name!r} is taken or not an identifier; "
                         f"taken: {', '.join(KINDS)}")
    if kind.dimension not in DIMENSIONS:
        raise ValueError(f"kind {kind.name!r}: unknown dimension {kind.dimension!r}; valid: {', '.join(DIMENSIONS)}")
    bad = [d for d in kind.domains if d not in DOMAINS] if isinstance(kind.domains, tuple) else [kind.domains]
    if bad or not kind.domains:
        raise ValueError(f"kind {kind.name!r}: domains must be a non-empty tuple of {', '.join(DOMAINS)}; got {kind.domains!r}")
    KINDS[kind.name] = kind
    _ADDED.add(kind.name)


def remove_kind(name: str) -> bool:
    """Remove a kind :func:`add_kind` added; whether there was one (the built-in kinds stay)."""
    if name not in _ADDED:
        return False
    _ADDED.discard(name)
    del KINDS[name]
    return True


def check_kind(kind: str, domain_name: str | None = None) -> Kind:
    """The :class:`Kind` called ``kind``; ``ValueError`` naming the valid choices otherwise."""
    if kind not in KINDS:
        raise ValueError(f"unknown perturbation kind {kind!r}; valid kinds: {', '.join(sorted(KINDS))}")
    k = KINDS[kind]
    if domain_name is not None and domain_name not in k.domains:
        valid = sorted(n for n, v in KINDS.items() if domain_name in v.domains)
        raise ValueError(
            f"perturbation {kind!r} does not apply to domain {domain_name!r} "
            f"(it applies to {', '.join(k.domains)}); kinds valid for {domain_name!r}: {', '.join(valid)}"
        )
    return k


# -- channels ------------------------------------------------------------------------------

#: Channels every stored run carries (NaN where its learner cannot measure them): name -> meaning.
SHARED: dict[str, str] = {
    "loss": "training objective at that update",
    "perf": "higher-is-better performance (RL: evaluation return; LM: minus validation loss)",
    "grad_norm": "global L2 norm of the gradient",
    "xgrad": "gradient-direction coherence cos(g_t, g_{t-1})",
    "update_norm": "L2 norm of the applied update",
    "update_ratio": "update norm / parameter norm",
    "update_grad_cos": "cos(applied update, -gradient)",
    "adam_m_norm": "norm of Adam's bias-corrected first moment",
    "adam_v_mean": "mean of Adam's bias-corrected second moment",
    "adam_eps_frac": "fraction of coordinates where sqrt(v) < eps",
    "lambda_max": "top Hessian eigenvalue (NaN between measurements)",
    "lr": "learning rate actually applied",
    "perturbed": "1 while a perturbation is active",
    "intervened": "1 where a controller acted",
}
SHARED_CHANNELS: tuple[str, ...] = tuple(SHARED)

#: Channels a domain adds to the shared ones: domain -> name -> meaning.
DOMAIN_CHANNELS: dict[str, dict[str, str]] = {
    "rl": {
        "episode_return": "return of the last finished training episode",
        "entropy": "policy entropy", "approx_kl": "PPO's approximate KL of an update",
        "clip_fraction": "PPO's clipped fraction", "value_loss": "critic / value loss",
        "q_mean": "mean Q value of a replay batch", "action_saturation": "fraction of actions at the bounds",
    },
    "lm": {
        "val_loss": "validation loss", "ce_loss": "cross-entropy part of the loss", "z_loss": "z-loss part",
        "attn_logit_max": "largest attention logit", "out_logit_max": "largest output logit",
        "attn_entropy_min": "smallest attention entropy of a head",
        "nonfinite_grads": "non-finite gradient entries", "loss_scale": "GradScaler's scale",
        "skipped_step": "1 where the scaler skipped the step", "lost_update_frac": "share of updates rounded away",
        "fp16_headroom": "headroom of the largest logit below float16's limit",
        "adam_state_nonfinite": "non-finite Adam state entries",
        "action": "code of the controller's action (0 none; interventions.control.ACTION_CODES)",
    },
    "toy": {"test_loss": "loss on held-out data", "train_acc": "training accuracy (classification)",
            "action": "code of the controller's action (0 none; interventions.control.ACTION_CODES)"},
    "seq": {"test_loss": "loss on held-out data", "grad_norm_raw": "gradient norm before clipping",
            "clipped": "1 where clipping scaled the gradient down"},
}
#: Channels of the curvature probe (toy and LM runs with ``curvature_every > 0``).
CURVATURE: dict[str, str] = {
    "sharpness_grad": "directional curvature along the gradient", "sharpness_update": "along the update",
    "precond_sharpness": "top eigenvalue of Adam's preconditioned Hessian",
    "lambda_max_cost_s": "seconds spent in one lambda_max", "lambda_max_iters": "Hessian-vector products used",
}
