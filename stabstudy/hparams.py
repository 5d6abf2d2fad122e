"""Typed hyperparameters: one dataclass per learner, one documented field per knob.

A :class:`~stabstudy.spec.RunSpec` stores only the hyperparameters it was given (so
its hash does not change when a default does not); the learner merges them over
the dataclass defaults. :func:`validate` runs when the spec is built, so a misspelt,
mistyped or out-of-range value fails at once, naming the field and the valid names,
types or range, instead of minutes later on a Dask worker. Every field carries a
one-line docstring (as CleanRL's ``Args``); :func:`field_docs` reads them for the docs
and the tests. The valid range of a numeric field is declared once, in its annotation
(``lr: Positive``, an ``Annotated`` type carrying a :class:`Range`); validation and the
docs read it from there. No torch import here.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import math
import textwrap
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Literal


@dataclass(frozen=True)
class Range:
    """The closed or open interval a numeric hyperparameter must lie in (``typing.Annotated`` metadata)."""

    lo: float = -math.inf
    hi: float = math.inf
    lo_open: bool = False
    """exclude ``lo`` itself"""
    hi_open: bool = False
    """exclude ``hi`` itself"""

    def __contains__(self, value: float) -> bool:
        above = value > self.lo if self.lo_open else value >= self.lo
        below = value < self.hi if self.hi_open else value <= self.hi
        return above and below

    def __str__(self) -> str:
        if self.hi == math.inf:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        if self.lo == -math.inf:
            return f"{'<' if self.hi_open else '<='} {self.hi:g}"
        return f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"


# The ranges of the fields below; ints pass for floats, as everywhere in a spec.
Positive = Annotated[float, Range(0, lo_open=True)]
NonNegative = Annotated[float, Range(0)]
Fraction = Annotated[float, Range(0, 1)]
OpenFraction = Annotated[float, Range(0, 1, lo_open=True, hi_open=True)]
Factor = Annotated[float, Range(0, 1, lo_open=True)]
Beta = Annotated[float, Range(0, 1, hi_open=True)]
Count = Annotated[int, Range(1)]
Size = Annotated[int, Range(0)]


def plain(value: Any) -> Any:
    """A numpy scalar or array, or a torch tensor, as the Python scalar or list it holds; anything else as is.

    Duck-typed (``tolist`` and ``ndim``) so that no torch import is needed: numpy and torch
    values are treated alike wherever a spec takes a literal.
    """
    if hasattr(value, "tolist") and hasattr(value, "ndim"):
        return value.tolist()
    return value


#: Closed-loop controllers and comparators a toy, LM or RL run can attach (stabstudy.interventions.control).
ControllerName = Literal["none", "z_skip", "z_lr", "z_adam", "z_rollback", "z_clip", "olmo", "zclip", "clip1",
                         "nonfinite"]


@dataclass(frozen=True)
class ControlHParams:
    """The closed-loop controller a toy, LM or RL run attaches (stabstudy.interventions.control).
    RL: the controller watches the optimizer the updates are counted by (policy; SAC/TD3: critic) and reads the
    gradient norm before SB3's clipping; its steps are gradient updates."""

    controller: ControllerName = "none"
    """closed-loop controller or comparator attached to the optimizer (interventions.control.CONTROLLERS)"""
    controller_threshold: NonNegative = 0.0
    """alarm threshold of the controller's detector (0 = its default: z 6, ZClip 2.5, clip at 1.0)"""
    controller_window: Count = 64
    """trailing steps of the controller's robust z"""
    controller_backoff: Factor = 0.1
    """lr factor of the controller's lr back-off at an alarm"""
    controller_recovery: Size = 50
    """steps over which the lr back-off recovers linearly to 1"""
    controller_snapshot_every: Count = 25
    """steps between the snapshots of the rollback's ring of two"""


@dataclass(frozen=True)
class ToyHParams(ControlHParams):
    """Small MLPs for instrument calibration (learners ``gd``, ``sgd``, ``adam``)."""

    lr: Positive = 0.05
    """learning rate"""
    warmup: Size = 0
    """linear learning-rate warmup steps: lr x (step + 1) / warmup before step warmup (0 = none)"""
    width: Count = 64
    """hidden units per layer"""
    depth: Size = 2
    """hidden layers"""
    n_train: Count = 512
    """training examples (full batch for gd)"""
    n_test: Count = 512
    """test examples"""
    batch_size: Size = 0
    """minibatch size; 0 = full batch (sgd uses 64 then)"""
    beta1: Beta = 0.9
    """Adam beta1"""
    beta2: Beta = 0.999
    """Adam beta2"""
    eps: Positive = 1e-8
    """Adam epsilon"""
    momentum: Beta = 0.0
    """heavy-ball momentum for gd/sgd"""
    weight_decay: NonNegative = 0.0
    """L2 (gd/sgd) or decoupled (adam: AdamW) weight decay"""
    activation: Literal["tanh", "relu", "elu", "gelu"] = "tanh"
    """hidden-layer nonlinearity"""
    loss: Literal["mse", "ce"] = "mse"
    """mse (0.5 * squared error summed over outputs) or ce (cross-entropy)"""
    curv_iters: Count = 20
    """Hessian-vector products per lambda_max measurement (Lanczos budget)"""
    curv_tol: NonNegative = 1e-5
    """eigensolver relative tolerance (instruments.curvature.TOL)"""
    probe_size: Size = 0
    """curvature probe batch (0 = the whole training set)"""
    diverge_loss: Positive = 1e6
    """a training loss above this counts as diverged"""
    data_seed: Size = 0
    """which subset of the data (fixed across seeds by default)"""
    outlier_scale: NonNegative = 10.0
    """std of the outlier inputs of an outlier_batch"""
    synthetic_dim: Count = 16
    """synthetic task: input dimension"""
    synthetic_out: Count = 4
    """synthetic task: output dimension"""


@dataclass(frozen=True)
class GPTArch:
    """The architecture of the byte-level GPT: the fields :class:`GPTHParams` and
    :class:`stabstudy.learners.gpt.GPTConfig` share (defined once, here)."""

    n_layer: Count = 2
    """transformer blocks"""
    n_head: Count = 2
    """attention heads per block (must divide n_embd)"""
    n_embd: Count = 64
    """residual-stream width"""
    block_size: Count = 64
    """context length (tokens, positions)"""
    dropout: Beta = 0.0
    """dropout probability on attention weights and residual branches"""
    qk_layernorm: bool = False
    """LayerNorm on queries and keys before the dot product (Wortsman et al. 2023)"""
    z_loss: NonNegative = 0.0
    """coefficient of the z-loss coef * mean(log^2 Z) added to the cross-entropy (1e-4 in Wortsman et al. 2023)"""
    init_scale: Positive = 1.0
    """multiplier of the initial weight std (base std 0.02, residual projections / sqrt(2 n_layer))"""
    tie_weights: bool = True
    """share the token-embedding matrix with the output head"""
    post_ln: bool = False
    """post-LayerNorm blocks x = LN(x + f(x)) (original Transformer) instead of pre-LN x = x + f(LN(x))"""


@dataclass(frozen=True)
class GPTHParams(GPTArch, ControlHParams):
    """The byte-level GPT of the ``lm`` domain (learner ``gpt``)."""

    batch_size: Count = 16
    """sequences per step"""
    lr: Positive = 1e-3
    """peak learning rate"""
    min_lr_frac: Fraction = 0.1
    """final lr of the cosine as a fraction of lr"""
    warmup: Size = 10
    """linear warmup steps"""
    weight_decay: NonNegative = 0.1
    """AdamW decoupled weight decay (matrices only)"""
    beta1: Beta = 0.9
    """Adam beta1"""
    beta2: Beta = 0.95
    """Adam beta2"""
    eps: Positive = 1e-8
    """Adam epsilon"""
    grad_clip: NonNegative = 0.0
    """global grad-norm clip (0 = off)"""
    corpus_bytes: Count = 1_000_000
    """corpus size cap (bytes)"""
    val_frac: OpenFraction = 0.1
    """validation fraction of the corpus"""
    eval_batches: Count = 4
    """validation batches per evaluation"""
    diag_every: Size = 0
    """cadence of attention/logit diagnostics (0 = spec.log_every)"""
    curvature_iters: Count = 20
    """Hessian-vector products per lambda_max measurement (Lanczos budget)"""
    autocast_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """autocast dtype of the forward pass"""
    param_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """storage dtype of parameters and Adam state"""
    grad_scaler: bool = False
    """dynamic loss scaling with torch.amp.GradScaler"""
    scaler_growth_interval: Count = 2000
    """clean steps before the GradScaler doubles its scale (torch default 2000)"""
    skip_nonfinite_loss: bool = False
    """with grad_scaler: a non-finite loss is skipped like an inf/NaN gradient (scale halved), not divergence"""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """where to train: auto = CUDA when present"""


@dataclass(frozen=True)
class SeqHParams:
    """Recurrent networks on a long-range sequence task (learners ``rnn_tanh``, ``rnn_linear``, ``lstm``)."""

    hidden: Count = 64
    """recurrent units"""
    T: Count = 50
    """sequence length (time steps) of the task"""
    lr: Positive = 0.01
    """learning rate"""
    batch_size: Count = 32
    """sequences per step (fresh ones each step)"""
    grad_clip: NonNegative = 0.0
    """global grad-norm clip with torch.nn.utils.clip_grad_norm_ (0 = off)"""
    sigma: NonNegative = 1.0
    """recurrent init: a random orthogonal matrix times sigma (per gate for the LSTM)"""
    optimizer: Literal["sgd", "adam"] = "sgd"
    """sgd (with momentum) or adam"""
    momentum: Beta = 0.0
    """heavy-ball momentum of sgd"""
    beta1: Beta = 0.9
    """Adam beta1"""
    beta2: Beta = 0.999
    """Adam beta2"""
    forget_bias: float = 1.0
    """LSTM forget-gate bias at init"""
    diverge_loss: Positive = 1000.0
    """a training loss above this (or non-finite) counts as diverged"""
    eval_size: Count = 512
    """held-out sequences for test_loss (one fixed set for every seed)"""


@dataclass(frozen=True)
class RLCommon(ControlHParams):
    """What every stable-baselines3 learner shares (network size, evaluation, telemetry)."""

    hidden: Count = 64
    """units per hidden layer of the policy and value networks"""
    layers: Size = 2
    """hidden layers of the policy and value networks"""
    lr: Positive = 3e-4
    """learning rate of every optimizer"""
    gamma: Fraction = 0.99
    """discount factor"""
    eval_episodes: Count = 2
    """deterministic evaluation episodes per evaluation"""
    eval_max_steps: Size = 0
    """episode cap of the evaluation env (0 = env default)"""
    max_episode_steps: Size = 0
    """episode cap of the training env (0 = env default)"""
    monitor_every: Count = 1
    """the Monitor's every: costly channels every this many updates"""
    diag_every: Count = 10
    """off-policy: read algorithm diagnostics every this many train calls"""
    diverge_threshold: Positive = 1e8
    """a loss, gradient norm, Q value or return above this counts as diverged"""
    normalize_obs: bool = False
    """normalise observations by their running mean and std (SB3 VecNormalize; rewards stay raw)"""
    prefix_steps: Size = 0
    """env steps of the stored prefix this run continues (0: from scratch; = steps: train and store the prefix)"""
    noise_after_fork: float | Literal["same"] = "same"
    """a fork's own noise knob (registry.NOISE_KNOB) from the fork on; "same": the prefix's value"""
    match_return: float | Literal["none"] = "none"
    """a prefix matched by return: train until the mean of two consecutive evaluations first reaches this ("none": no target)"""


@dataclass(frozen=True)
class OnPolicyHParams(RLCommon):
    """PPO and A2C: rollouts of n_steps, then updates."""

    n_steps: Count = 2048
    """environment steps per rollout"""
    gae_lambda: Fraction = 0.95
    """GAE lambda"""
    ent_coef: NonNegative = 0.0
    """entropy bonus coefficient (the algorithm's own noise knob)"""


@dataclass(frozen=True)
class PPOHParams(OnPolicyHParams):
    """Proximal policy optimisation (stable-baselines3 defaults)."""

    batch_size: Count = 64
    """minibatch size of each PPO epoch"""
    n_epochs: Count = 10
    """passes over each rollout"""
    clip_range: Positive = 0.2
    """PPO clipping range"""


@dataclass(frozen=True)
class A2CHParams(OnPolicyHParams):
    """Advantage actor-critic (stable-baselines3 defaults)."""

    lr: Positive = 7e-4
    """learning rate of every optimizer"""
    n_steps: Count = 5
    """environment steps per rollout"""
    gae_lambda: Fraction = 1.0
    """GAE lambda"""


@dataclass(frozen=True)
class OffPolicyHParams(RLCommon):
    """SAC, TD3 and DDPG: a replay buffer, updates every train_freq steps."""

    hidden: Count = 256
    """units per hidden layer of the actor and critics"""
    batch_size: Count = 256
    """replay minibatch size"""
    learning_starts: Size = 100
    """environment steps before the first update"""
    buffer_size: Count = 1_000_000
    """replay capacity (capped at the run length)"""
    train_freq: Count = 1
    """environment steps between train calls"""
    gradient_steps: Count = 1
    """gradient steps per train call"""
    tau: Factor = 0.005
    """Polyak coefficient of the target networks"""
    purge_replay: bool = True
    """transitions of an env-side perturbation window leave the replay buffer when it ends"""


@dataclass(frozen=True)
class SACHParams(OffPolicyHParams):
    """Soft actor-critic (stable-baselines3 defaults)."""

    ent_coef: NonNegative | Literal["auto"] = "auto"
    """entropy coefficient: a float, or "auto" to learn it"""
    target_entropy: float | Literal["auto"] = "auto"
    """entropy target of the learnt coefficient (the noise knob); "auto" = -dim(action)"""
    spike_ent_coef: bool = False
    """the lr spike also scales the entropy coefficient's optimizer (False: actor and critic only)"""


@dataclass(frozen=True)
class TD3HParams(OffPolicyHParams):
    """Twin delayed DDPG (stable-baselines3 defaults)."""

    lr: Positive = 1e-3
    """learning rate of every optimizer"""
    policy_delay: Count = 2
    """critic updates per actor update"""
    action_noise_std: NonNegative = 0.1
    """Gaussian exploration noise, relative to the action range (the noise knob)"""


@dataclass(frozen=True)
class DDPGHParams(OffPolicyHParams):
    """Deep deterministic policy gradient (stable-baselines3 defaults)."""

    lr: Positive = 1e-3
    """learning rate of every optimizer"""
    action_noise_std: NonNegative = 0.1
    """Gaussian exploration noise, relative to the action range (the noise knob)"""


def defaults(cls: type) -> dict[str, Any]:
    """Every field of a hyperparameter dataclass with its default."""
    return {f.name: f.default for f in dataclasses.fields(cls)}


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The one-line docstring under each field, read from the class sources (inherited first)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for stmt, nxt in zip(body, body[1:], strict=False):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[stmt.target.id] = nxt.value.value.strip()
    return docs


def _accepts(tp: Any, value: Any) -> bool:
    """Does ``value`` (a spec literal) fit the annotation ``tp``, range included? ints pass for floats, bools never
    for numbers."""
    origin = typing.get_origin(tp)
    if origin is Annotated:
        base, *meta = typing.get_args(tp)
        return _accepts(base, value) and all(value in m for m in meta if isinstance(m, Range))
    if origin is Literal:
        return any(type(value) is type(a) and value == a for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(a, value) for a in typing.get_args(tp))
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    return isinstance(value, tp)


def describe(tp: Any) -> str:
    """What an annotation accepts, in words: ``float > 0``, ``int >= 1``, ``one of 'mse', 'ce'``."""
    origin = typing.get_origin(tp)
    if origin is Annotated:
        base, *meta = typing.get_args(tp)
        return " ".join([describe(base), *(str(m) for m in meta if isinstance(m, Range))])
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


@functools.cache
def annotations(cls: type) -> dict[str, Any]:
    """Each field's annotation, ``Annotated`` ranges kept."""
    return typing.get_type_hints(cls, include_extras=True)


def validate(cls: type, given: dict[str, Any], where: str) -> None:
    """Raise ``ValueError`` for a name that is not a field of ``cls``, or a value of the wrong type or out of range."""
    hints = annotations(cls)
    unknown = sorted(set(given) - set(hints))
    if unknown:
        raise ValueError(f"unknown hyperparameter(s) {unknown} for {where}; valid: {', '.join(sorted(hints))}")
    for name, value in given.items():
        if not _accepts(hints[name], value):
            raise ValueError(f"hyperparameter {name!r} of {where} must be {describe(hints[name])}, "
                             f"got {value!r} ({type(value).__name__})")


def merged(cls: type, given: dict[str, Any], where: str) -> dict[str, Any]:
    """The defaults of ``cls`` with ``given`` over them, validated."""
    validate(cls, given, where)
    return {**defaults(cls), **given}
