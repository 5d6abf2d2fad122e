"""The one registry: domains, learners, tasks, perturbation kinds and channels.

The CLI, spec validation (task names included), the runner, the docs (docs/registry.md is generated from here), the
instruments' channel lists, the Datasets' ``long_name``/``units`` attributes (:func:`annotate`) and
the tests all read these tables; nothing else lists them. Learner code is named by ``"module:function"`` strings and
imported only when a run executes, so validating a spec never imports torch.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path, PurePath

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
    """which tasks the domain accepts, in words (:func:`check_task` checks them)"""
    learners: dict[str, type]
    """learner name -> its hyperparameter dataclass"""
    task_names: tuple[str, ...] = ()
    """the built-in tasks"""
    other_tasks: str = ""
    """what else names a task: ``"gymnasium"`` (a registered env id), ``"path"`` (a text file) or nothing"""


DOMAINS: dict[str, Domain] = {d.name: d for d in (
    Domain("toy", "stabstudy.learners.toy:run", "optimizer updates",
           "digits | synthetic", {"gd": H.ToyHParams, "sgd": H.ToyHParams, "adam": H.ToyHParams},
           task_names=("digits", "synthetic")),
    Domain("rl", "stabstudy.learners.rl.learner:run", "environment steps",
           "a gymnasium env id (HalfCheetah-v5, Pendulum-v1, ...)",
           {"ppo": H.PPOHParams, "sac": H.SACHParams, "td3": H.TD3HParams, "a2c": H.A2CHParams,
            "ddpg": H.DDPGHParams}, other_tasks="gymnasium"),
    Domain("lm", "stabstudy.learners.lm:run", "optimizer updates",
           "stdlib (the Python standard library sources) or a text-file path", {"gpt": H.GPTHParams},
           task_names=("stdlib",), other_tasks="path"),
    Domain("seq", "stabstudy.learners.seq:run", "optimizer updates",
           "adding (the adding problem, generated from the seed)",
           {"rnn_tanh": H.SeqHParams, "rnn_linear": H.SeqHParams, "lstm": H.SeqHParams},
           task_names=("adding",)),
)}

#: Valid learners per domain.
LEARNERS: dict[str, tuple[str, ...]] = {d.name: tuple(d.learners) for d in DOMAINS.values()}
#: RL learners that update at rollout ends.
ON_POLICY = ("ppo", "a2c")
#: Each RL learner's own stochasticity knob (a hyperparameter name).
NOISE_KNOB = {"ppo": "ent_coef", "a2c": "ent_coef", "sac": "target_entropy", "td3": "action_noise_std",
              "ddpg": "action_noise_std"}


def arm_learner(arm: str, domain_name: str = "rl") -> str:
    """The learner of a study arm: ``"ppo"`` itself, or ``"ppo-tuned"`` (a variant: the same learner with
    other hyperparameters, labelled apart in tables); ``ValueError`` naming the valid learners otherwise."""
    learner = str(arm).split("-", 1)[0]
    hparams_class(domain_name, learner)
    return learner


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


def _did_you_mean(name: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(choices), n=3, cutoff=0.6)
    if not close:
        return ""
    return f"; did you mean {close[0]!r}" + (f" (or {', '.join(map(repr, close[1:]))})" if close[1:] else "") + "?"


def check_task(domain_name: str, task: str) -> None:
    """``ValueError`` naming the valid tasks (and the closest ones) when ``task`` is not one of the domain's.

    rl: an id in gymnasium's registry (imported here, on the first RL spec; it imports no torch).
    lm: ``"stdlib"``, or anything that reads as a file path (a directory part or a suffix) or is a file
    here: the file itself is read where the run executes, which may be another machine.
    """
    d = domain(domain_name)
    if task in d.task_names:
        return
    if d.other_tasks == "gymnasium":
        import gymnasium

        if task in gymnasium.registry:
            return
        raise ValueError(f"unknown gymnasium environment {task!r} for domain {domain_name!r}: not in gymnasium's "
                         f"registry (examples: HalfCheetah-v5, Pendulum-v1){_did_you_mean(task, gymnasium.registry)}")
    if d.other_tasks == "path":
        p = PurePath(task)
        if len(p.parts) > 1 or p.suffix or Path(task).expanduser().is_file():
            return
        raise ValueError(f"unknown {domain_name} task {task!r}: use {', '.join(map(repr, d.task_names))} or the path "
                         f"of a text file{_did_you_mean(task, d.task_names)}")
    raise ValueError(f"unknown {domain_name} task {task!r}; valid tasks: {', '.join(d.task_names)}"
                     f"{_did_you_mean(task, d.task_names)}")


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
    Kind("lr_ramp", "optimization", ("toy", "lm", "rl"), "final learning-rate factor: it climbs geometrically from 1 "
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

#: Learner modules with channels but no ``run(spec)`` domain: :mod:`stabstudy.learners.depth`'s profiles at init.
PROFILES = ("depth",)
#: Who records a channel.
SOURCES = ("learner", "optimizer", "layers", "curvature", "precision", "model", "rl", "control", "schedule")
#: Names the Monitor gives the optimizers of an SB3 algorithm (its channels per optimizer end in ``_<name>``).
OPTIMIZERS = ("policy", "actor", "critic", "ent_coef")


@dataclass(frozen=True)
class Channel:
    """One recorded quantity: what the Dataset variable of that name means, wherever it is stored.

    ``unit`` (the variable's ``units`` attribute) is ``"1"`` for a dimensionless ratio, cosine,
    fraction, flag or code, ``"loss"`` for the training objective's own unit (MSE, nats per token,
    an RL algorithm's loss), ``"param"`` / ``"grad"`` for norms in the parameters' / the gradient's
    units, else a plain unit (``s``, ``nats``, ``env steps``, ...).
    """

    name: str
    meaning: str
    unit: str
    domains: tuple[str, ...]
    """the domains (or :data:`PROFILES`) whose Datasets may carry it"""
    source: str
    """who records it (one of :data:`SOURCES`)"""
    always: bool = False
    """every run of its domains carries it (NaN where it is not measured), not only those that measure it"""
    per: str = ""
    """``"optimizer"``: also one ``<name>_<optimizer>`` per optimizer of a multi-optimizer Monitor;
    ``"layer"``: also one ``<name>_l<i>`` per transformer layer"""


_LM_TOY = ("toy", "lm")
CHANNELS: dict[str, Channel] = {c.name: c for c in (
    # shared by every domain: the schema's contract between notebooks
    Channel("loss", "training objective at that update", "loss", _ALL, "learner", True),
    Channel("perf", "higher-is-better performance (toy: test accuracy (digits) or minus the test loss; RL: "
            "evaluation return; LM: minus the validation loss; seq: minus the test loss)", "accuracy, -loss or return",
            _ALL, "learner", True),
    Channel("grad_norm", "global L2 norm of the gradient as backward() produced it: before any clipping, unscaled "
            "(a GradScaler's scale divided out), the whole accumulated gradient. A learner's stored run keeps here "
            "the norm its optimizer received, as it always did (it differs where the learner clips: PPO/A2C at "
            "SB3's max_grad_norm, runs with grad_clip), and the norm before clipping in grad_norm_raw", "grad",
            _ALL, "optimizer", True, "optimizer"),
    Channel("grad_norm_applied", "global L2 norm of the gradient the optimizer received, after any clipping "
            "(the Monitor's Dataset; equal to grad_norm where nothing changed the gradient between backward() "
            "and the step)", "grad", _ALL, "optimizer", per="optimizer"),
    Channel("xgrad", "gradient-direction coherence cos(g_t, g_{t-1})", "1", _ALL, "optimizer", True, "optimizer"),
    Channel("update_norm", "L2 norm of the applied parameter update", "param", _ALL, "optimizer", True, "optimizer"),
    Channel("update_ratio", "update norm / parameter norm (before the update)", "1", _ALL, "optimizer", True,
            "optimizer"),
    Channel("update_grad_cos", "cos(applied update, -gradient)", "1", _ALL, "optimizer", True, "optimizer"),
    Channel("adam_m_norm", "L2 norm of Adam's bias-corrected first moment m_hat", "grad", _ALL, "optimizer", True,
            "optimizer"),
    Channel("adam_v_mean", "mean of Adam's bias-corrected second moment v_hat", "grad^2", _ALL, "optimizer", True,
            "optimizer"),
    Channel("adam_eps_frac", "fraction of coordinates with sqrt(v_hat) < eps (bias-corrected)", "1", _ALL,
            "optimizer", True, "optimizer"),
    Channel("lambda_max", "top Hessian eigenvalue (Lanczos on Hessian-vector products; NaN between measurements)",
            "loss/param^2", _ALL, "curvature", True),
    Channel("lr", "learning rate actually applied (param_groups[0]['lr'] of the primary optimizer)", "lr", _ALL,
            "optimizer", True, "optimizer"),
    Channel("perturbed", "1 while a perturbation is active", "1", _ALL, "schedule", True),
    Channel("intervened", "1 where a controller acted", "1", _ALL, "control", True),
    # the Monitor's optional channels
    Channel("grad_coherence", "microbatch gradient coherence ||mean_k g_k||^2 / mean_k ||g_k||^2", "1", _ALL,
            "learner"),
    Channel("layer_grad_norm", "L2 norm of the gradient per parameter tensor", "grad", _ALL, "layers"),
    Channel("layer_update_ratio", "update norm / parameter norm per parameter tensor", "1", _ALL, "layers"),
    # closed-loop control
    Channel("action", "code of the controller's action (0 none; interventions.control.ACTION_CODES)", "1",
            ("toy", "lm", "rl"), "control"),
    Channel("controller_score", "largest score of the controller's detectors at that update (recorded also "
            "below the threshold, for calibration)", "1", _ALL, "control"),
    Channel("controller_alarm", "1 where one of the controller's detectors alarmed (the Monitor's Dataset)", "1",
            _ALL, "control"),
    Channel("controller_action", "name of the controller's action at that update: 'none' where it did not act, "
            "else a name of interventions.control.ACTION_CODES (the Monitor's Dataset; loggers get one 0/1 "
            "series per action, controller_action/<name>)", "1", _ALL, "control"),
    # curvature probe (toy and LM runs with curvature_every > 0)
    Channel("sharpness_grad", "directional curvature along the gradient", "loss/param^2", _LM_TOY, "curvature"),
    Channel("sharpness_update", "directional curvature along the applied update", "loss/param^2", _LM_TOY,
            "curvature"),
    Channel("precond_sharpness", "top eigenvalue of Adam's preconditioned Hessian", "1/lr", _LM_TOY, "curvature"),
    Channel("lambda_max_cost_s", "seconds spent in one lambda_max", "s", _LM_TOY, "curvature"),
    Channel("lambda_max_iters", "Hessian-vector products used by one lambda_max", "1", _LM_TOY, "curvature"),
    Channel("lambda_max_resid", "how converged lambda_max is: relative residual ||Hx - lambda x|| / |lambda| of "
            "the Ritz pair (power iteration: relative change of its last step)", "1", _LM_TOY, "curvature"),
    # the output layer (the slingshot's logit and last-layer norm growth, Thilak et al. 2022)
    Channel("out_logit_max", "largest |output logit| on the training batch (toy: the network's output, also "
            "under MSE)", "logit", _LM_TOY, "model"),
    Channel("last_weight_norm", "Frobenius norm of the output layer's weight (before the update)", "param",
            ("toy",), "model"),
    # toy and seq
    Channel("test_loss", "loss on held-out data", "loss", ("toy", "seq"), "learner"),
    Channel("train_acc", "training accuracy (digits)", "1", ("toy",), "learner"),
    Channel("grad_norm_raw", "global L2 norm of the gradient before clipping, in a learner's stored run (the "
            "Monitor's grad_norm; the run's own grad_norm is the norm the optimizer received)", "grad",
            ("toy", "lm", "seq", "rl"), "learner"),
    Channel("clipped", "1 where clipping scaled the gradient down", "1", ("seq",), "learner"),
    Channel("state_grad_norm", "norm of the loss gradient with respect to a hidden state, at init (seq: lag steps "
            "before the loss; depth: layers below the output)", "grad", ("seq", "depth"), "learner"),
    Channel("block_grad_norm", "gradient norm of one transformer block's parameters at init", "grad", ("depth",),
            "learner"),
    # language models
    Channel("val_loss", "validation loss", "nats/token", ("lm",), "learner"),
    Channel("ce_loss", "cross-entropy part of the loss", "nats/token", ("lm",), "learner"),
    Channel("z_loss", "z-loss part of the loss", "loss", ("lm",), "learner"),
    Channel("attn_logit_max", "largest attention logit", "logit", ("lm",), "model", per="layer"),
    Channel("attn_entropy_min", "smallest attention entropy of a head", "nats", ("lm",), "model"),
    # precision (LM runs other than float32, with a loss scaler or a precision_switch)
    Channel("nonfinite_grads", "non-finite gradient entries", "1", ("lm",), "precision"),
    Channel("loss_scale", "GradScaler's scale", "1", ("lm",), "precision"),
    Channel("skipped_step", "1 where the scaler skipped the step", "1", ("lm",), "precision"),
    Channel("lost_update_frac", "share of the update's coordinates rounded away in storage", "1", ("lm",),
            "precision"),
    Channel("fp16_headroom", "largest logit as float16 would materialise it / float16's largest value "
            "(>= 1: overflow)", "1", ("lm",), "precision"),
    Channel("adam_state_nonfinite", "non-finite Adam state entries", "1", ("lm",), "precision"),
    # reinforcement learning (stable-baselines3 callbacks)
    Channel("episode_return", "return of the last finished training episode (unscaled)", "return", ("rl",), "rl",
            True),
    Channel("entropy", "policy entropy", "nats", ("rl",), "rl", True),
    Channel("approx_kl", "PPO's approximate KL of an update", "nats", ("rl",), "rl", True),
    Channel("clip_fraction", "PPO's clipped fraction", "1", ("rl",), "rl", True),
    Channel("value_loss", "critic / value loss", "loss", ("rl",), "rl", True),
    Channel("q_mean", "mean Q value of a replay batch", "return", ("rl",), "rl", True),
    Channel("action_saturation", "fraction of actions at the bounds", "1", ("rl",), "rl", True),
    Channel("actor_loss", "SAC/TD3/DDPG's actor loss", "loss", ("rl",), "rl"),
    Channel("ent_coef", "SAC's entropy coefficient", "1", ("rl",), "rl"),
    Channel("policy_std", "PPO/A2C's policy standard deviation (SB3's train/std)", "action", ("rl",), "rl"),
    Channel("value_mean", "mean value prediction over the rollout", "return", ("rl",), "rl"),
    Channel("perf_env_step", "environment step at which perf was measured", "env steps", ("rl",), "rl"),
    Channel("perf_std", "standard deviation of an evaluation's episode returns (NaN with one episode)", "return",
            ("rl",), "rl"),
)}

#: Channel name -> meaning (the ``long_name`` attribute of a Dataset variable).
LONG_NAMES: dict[str, str] = {c.name: c.meaning for c in CHANNELS.values()}
#: Channels every stored run carries (NaN where its learner cannot measure them): name -> meaning.
SHARED: dict[str, str] = {c.name: c.meaning for c in CHANNELS.values() if c.always and c.domains == _ALL}
SHARED_CHANNELS: tuple[str, ...] = tuple(SHARED)


def channel_names(*, source: str | None = None, domain: str | None = None, always: bool | None = None) -> tuple[str, ...]:
    """Names of the registered channels (in registry order) from ``source``, of ``domain``, carried always or not."""
    for value, valid, what in ((source, SOURCES, "source"), (domain, (*DOMAINS, *PROFILES), "domain")):
        if value is not None and value not in valid:
            raise ValueError(f"unknown channel {what} {value!r}; valid: {', '.join(valid)}")
    return tuple(c.name for c in CHANNELS.values() if (source is None or c.source == source)
                 and (domain is None or domain in c.domains) and (always is None or c.always == always))


def channel(name: str, optimizers: tuple[str, ...] = OPTIMIZERS) -> tuple[Channel, str] | None:
    """The :class:`Channel` a variable called ``name`` records, with what its suffix names (``""``,
    an optimizer of ``optimizers`` or ``"layer <i>"``); None for an unregistered name."""
    if name in CHANNELS:
        return CHANNELS[name], ""
    base, _, tail = name.rpartition("_l")
    if base in CHANNELS and CHANNELS[base].per == "layer" and tail.isdigit():
        return CHANNELS[base], f"layer {tail}"
    for opt in optimizers:
        base = name.removesuffix("_" + opt)
        if base != name and base in CHANNELS and CHANNELS[base].per == "optimizer":
            return CHANNELS[base], opt
    return None


def long_name(name: str, optimizers: tuple[str, ...] = OPTIMIZERS) -> str:
    """The ``long_name`` of variable ``name``: its channel's meaning (``(actor)``, ``(layer 0)`` for a family
    member); the name itself when unregistered."""
    found = channel(name, optimizers)
    if found is None:
        return name
    ch, which = found
    return f"{ch.meaning} ({which})" if which else ch.meaning


def annotate(ds, optimizers: tuple[str, ...] = OPTIMIZERS):
    """Set ``long_name`` and ``units`` of every registered data variable of the xarray Dataset ``ds``
    from the registry (in place; unregistered variables keep theirs); returns ``ds``."""
    for name, var in ds.data_vars.items():
        found = channel(str(name), optimizers)
        if found is not None:
            var.attrs.update(long_name=long_name(str(name), optimizers), units=found[0].unit)
    return ds
