"""Forks: train a prefix once, store its full training state, continue it many times.

A run whose hyperparameter ``prefix_steps`` is ``P > 0`` does not train from scratch:

* ``P == spec.steps``: the run *is* a prefix. It trains from scratch for ``P`` env steps
  (recording evaluations, episode returns and diagnostics: its learning curve) and stores
  a checkpoint of the whole training state at the end;
* ``0 < P < spec.steps``: the run is a *fork*. It restores the checkpoint of its prefix
  and trains on for ``spec.steps - P`` env steps. Every time (perturbation windows,
  evaluations, ``env_step``) counts env steps from the start of the prefix, and update
  numbers (``step``) continue the prefix's, so a fork's Dataset reads like the tail of
  the uninterrupted run.

A run with ``match_return`` (and no ``prefix_steps``) is a *matching prefix*: it trains from
scratch, evaluating every ``spec.eval_every`` env steps (a multiple of the fork unit), until the
mean of two consecutive evaluations first reaches ``match_return`` or ``spec.steps`` (its cap) is
spent, and stores its checkpoint there, at env step ``T``, as the checkpoint of the plain prefix of
``T`` env steps (:func:`matched_prefix`): a fork with ``prefix_steps = T`` continues it. Training does
not depend on the evaluation cadence or on where ``learn()`` was asked to stop, so that checkpoint
is the one the plain prefix would store (``tests/test_rl_forks.py`` checks it).

The prefix of a fork is keyed by :func:`prefix_key`: the spec with its perturbations and
continuation-only hyperparameters (:data:`CONTINUATION_ONLY`) removed, ``steps = P``, and
the recording cadence of a prefix (evaluation every ``P // 20`` env steps, no curvature),
which does not change training. Its checkpoint is content-addressed by that key's hash:
``<checkpoints_dir>/<hash>.v<FORMAT>.zip`` with a sidecar ``<hash>.v<FORMAT>.json`` recording the
file's SHA-256 when it was written. Every fork of one (algorithm, seed, hyperparameters, P)
shares it, whatever its perturbation. The format is in the name: a checkpoint of another
format is never read (it is absent to this version, so its prefix is trained again).

A checkpoint holds everything that decides the continuation, as plain data and tensors, never
as pickles (:mod:`~stabstudy.learners.rl.plainstate`): the policy and value nets, target nets
and every optimizer's state, SAC's entropy coefficient and its optimizer (``tensors.pt``, read
with ``torch.load(weights_only=True)``); the model's counters, the last observation, TD3's
action noise, the observation normalisation statistics (``normalize_obs``), the global RNG
states (Python, NumPy, torch), the action space's RNG, the training env's state (every
wrapper's counters, the env's ``np_random``, MuJoCo's full integration state) and the
recorder's counters (``state.json`` and ``arrays.npz``, read with ``json`` and
``numpy.load(allow_pickle=False)``); the replay buffer's arrays (``buffer.npz``). A fork is
not loaded with SB3's ``load`` (whose model file unpickles objects): it is built afresh from
its spec (:func:`stabstudy.learners.rl.learner.build_model`) and the stored state is put into
it (:func:`restore`), so loading cannot run code, whatever the file holds. The SHA-256 of the
sidecar guards against accidental damage (a truncated copy, a flipped bit): a checkpoint is
loaded only after its bytes match it, from the verified bytes in memory, never from a second
read of the file. A refused checkpoint raises :class:`CheckpointError` saying which files to
delete (:func:`remedy`).

Workers reach checkpoints through their own ``checkpoints_dir()`` (``$STABSTUDY_CHECKPOINTS``,
else ``data/checkpoints``): on one machine it is the same folder for every worker; on a
cluster without a shared file system, :func:`share_checkpoints` moves the bytes through
Dask (worker that trained it -> client -> every worker lacking it). A fork that still finds
no checkpoint trains its prefix itself (same result, with a warning), so a missing file
costs time, never correctness.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import io
import json
import os
import random
import shlex
import zipfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.noise import NormalActionNoise
from stable_baselines3.common.vec_env import VecEnv

from stabstudy import paths
from stabstudy.learners.rl.plainstate import Plain
from stabstudy.registry import NOISE_KNOB, ON_POLICY
from stabstudy.spec import RunSpec

#: Version of the checkpoint layout, part of the file name (a checkpoint of another version is not
#: read: its prefix is trained again). 1: SB3's model zip and a pickle of the rest (loaded only after
#: its SHA-256 matched, but a file with a recomputed sidecar ran code); 2: plain data and tensors only.
FORMAT = 2
#: Hyperparameters that act only after the fork: not part of the prefix key (a controlled fork
#: continues the same prefix as the uncontrolled one).
CONTINUATION_ONLY = ("noise_after_fork", "controller", "controller_threshold", "controller_window",
                     "controller_backoff", "controller_recovery", "controller_snapshot_every")
#: Arrays of an SB3 replay buffer that a checkpoint keeps.
BUFFER_ARRAYS = ("observations", "next_observations", "actions", "rewards", "dones", "timeouts")
#: Wrapper attributes that are configuration of the new run, not state of the old one.
_NOT_STATE = ("env", "schedule")
#: Model attributes not stored with the model's: the env and the buffers (stored on their own or
#: refilled before use), SB3's logger (configured by ``learn``), and the replay capacity, which is the
#: continuation's own (``build_model``: ``min(buffer_size, spec.steps)``), not the prefix's.
_MODEL_ELSEWHERE = ("env", "_vec_normalize_env", "replay_buffer", "rollout_buffer", "_logger", "buffer_size")
#: Key of a MuJoCo env's integration state in its layer's stored state.
_MUJOCO = "__mujoco_state__"

Role = Literal["scratch", "prefix", "fork", "match"]
#: Hyperparameters of a matching prefix that its stored prefix does not carry.
MATCH_ONLY = ("match_return",)


class CheckpointError(RuntimeError):
    """A stored checkpoint that must not be loaded (damaged, tampered with, or of another format)."""


# -- specs ---------------------------------------------------------------------------------


def prefix_steps(spec: RunSpec) -> int:
    """The spec's ``prefix_steps`` hyperparameter (0 when absent)."""
    return int(spec.hp.get("prefix_steps", 0))


def role(spec: RunSpec) -> Role:
    """``scratch`` (``prefix_steps`` 0), ``prefix`` (``prefix_steps == steps``), ``fork``, or
    ``match`` (a ``match_return`` and no ``prefix_steps``: a prefix matched by return)."""
    p = prefix_steps(spec)
    if p == 0 and spec.hp.get("match_return", "none") != "none":
        return "match"
    return "scratch" if p == 0 else "prefix" if p == spec.steps else "fork"


def matched_prefix(spec: RunSpec, steps: int) -> RunSpec:
    """The plain prefix (:func:`prefix_key`'s spec) whose checkpoint a matching prefix ``spec`` stores
    when it stops at env step ``steps``: what a fork with ``prefix_steps = steps`` continues."""
    if role(spec) != "match":
        raise ValueError(f"{spec.label} is not a matching prefix (it has no match_return)")
    hp = {k: v for k, v in spec.hp.items() if k not in MATCH_ONLY}
    return RunSpec(spec.domain, spec.learner, spec.task, int(steps), spec.seed, hparams={**hp, "prefix_steps": int(steps)},
                   perturbations=(), log_every=spec.log_every, eval_every=0, curvature_every=0)


def check(spec: RunSpec, hp: dict[str, Any]) -> None:
    """Raise ``ValueError`` for a spec whose fork does not describe one uninterrupted run.

    ``hp``: the spec's merged hyperparameters. A prefix has no perturbations; a fork's
    perturbations start at or after the fork; the fork point must lie where a ``learn()``
    call can stop without changing what follows (a rollout end for PPO/A2C, a train call
    for off-policy learners)."""
    p, r = prefix_steps(spec), role(spec)
    if hp.get("match_return", "none") != "none" and r != "match":
        raise ValueError("match_return applies to a matching prefix only (no prefix_steps): its forks name the "
                         "env step it stopped at as their prefix_steps")
    if r == "match":
        unit = int(hp["n_steps"]) if spec.learner in ON_POLICY else int(hp["train_freq"])
        if spec.perturbations:
            raise ValueError("a matching prefix has no perturbations; they belong to its forks")
        if spec.eval_every <= 0 or spec.eval_every % unit:
            raise ValueError(f"a matching prefix checks its target at its evaluations: eval_every ({spec.eval_every}) "
                             f"must be a positive multiple of the fork unit {unit}")
        return
    if p < 0 or p > spec.steps:
        raise ValueError(f"prefix_steps must lie in [0, steps = {spec.steps}], got {p}")
    if r != "fork" and hp.get("noise_after_fork", "same") != "same":
        raise ValueError("noise_after_fork applies to forks only (0 < prefix_steps < steps)")
    if r == "prefix" and spec.perturbations:
        raise ValueError("a prefix run (prefix_steps == steps) has no perturbations; they belong to its forks")
    if r == "scratch":
        return
    early = [q.kind for q in spec.perturbations if q.start < p]
    if early:
        raise ValueError(f"perturbations {early} start before the fork at env step {p}; a fork's prefix is unperturbed")
    unit = int(hp["n_steps"]) if spec.learner in ON_POLICY else int(hp["train_freq"])
    if p % unit:
        what = "n_steps (a rollout end)" if spec.learner in ON_POLICY else "train_freq (a train call)"
        raise ValueError(f"prefix_steps {p} must be a multiple of {what} = {unit}")


def prefix_key(spec: RunSpec) -> RunSpec:
    """The spec of the prefix a fork continues (see the module docstring)."""
    p = prefix_steps(spec)
    if p <= 0:
        raise ValueError(f"{spec.label} has no prefix (prefix_steps = {p})")
    hp = {k: v for k, v in spec.hp.items() if k not in CONTINUATION_ONLY}
    return RunSpec(spec.domain, spec.learner, spec.task, p, spec.seed, hparams=hp, perturbations=(),
                   log_every=spec.log_every, eval_every=0, curvature_every=0)


def prefix_specs(specs: Iterable[RunSpec]) -> list[RunSpec]:
    """The distinct prefixes of the forks among ``specs``, in order (run them before the forks)."""
    keys = [prefix_key(s) for s in specs if s.domain == "rl" and role(s) == "fork"]
    return list(dict.fromkeys(keys))


# -- the checkpoint store --------------------------------------------------------------


def checkpoints_dir() -> Path:
    """``$STABSTUDY_CHECKPOINTS``, else ``<data>/checkpoints`` (cleaned with the data by ``make clean``)."""
    env = os.environ.get("STABSTUDY_CHECKPOINTS")
    return Path(env).resolve() if env else paths.data_dir() / "checkpoints"


def checkpoint_path(key: RunSpec | str, root: Path | None = None) -> Path:
    """Where the checkpoint of prefix ``key`` (a spec or its hash) lives."""
    h = key.spec_hash if isinstance(key, RunSpec) else key
    return (root or checkpoints_dir()) / f"{h}.v{FORMAT}.zip"


def sidecar_path(key: RunSpec | str, root: Path | None = None) -> Path:
    """The sidecar (JSON: SHA-256, size, prefix spec, versions) of a checkpoint."""
    return checkpoint_path(key, root).with_suffix(".json")


def write_checkpoint(h: str, blob: bytes, meta: dict[str, Any], root: Path | None = None) -> Path:
    """Store ``blob`` as the checkpoint of prefix hash ``h``: the zip, then its sidecar, each atomically
    (temporary file, then rename). The sidecar records the blob's SHA-256; a reader that finds a zip
    whose sidecar does not match refuses it (:func:`read_checkpoint`)."""
    meta = {**meta, "format": FORMAT, "spec_hash": h, "sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob)}
    path = checkpoint_path(h, root)
    paths.atomic_write(path, blob)
    paths.atomic_write(sidecar_path(h, root), json.dumps(meta, indent=1, sort_keys=True).encode())
    return path


def read_sidecar(h: str, root: Path | None = None) -> dict[str, Any]:
    """The sidecar of checkpoint ``h``; ``FileNotFoundError`` when the checkpoint or its sidecar is absent."""
    path, side = checkpoint_path(h, root), sidecar_path(h, root)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint {path}")
    if not side.exists():
        raise FileNotFoundError(f"checkpoint {path} has no sidecar {side.name} recording its SHA-256")
    try:
        meta = json.loads(side.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint sidecar {side} is unreadable ({e}); refusing to load {path}. "
                              f"{remedy(h, root)}") from e
    if meta.get("spec_hash") != h or meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint sidecar {side} describes {meta.get('spec_hash')!r} format "
                              f"{meta.get('format')!r}, not {h!r} format {FORMAT}; refusing to load {path}. "
                              f"{remedy(h, root)}")
    return meta


def read_checkpoint(h: str, root: Path | None = None) -> tuple[bytes, dict[str, Any]]:
    """The verified bytes and sidecar of checkpoint ``h``.

    Raises ``FileNotFoundError`` when absent and :class:`CheckpointError`, naming the file,
    when its SHA-256 differs from the one recorded when it was written (accidental damage: a
    changed file is never loaded)."""
    meta = read_sidecar(h, root)
    path = checkpoint_path(h, root)
    blob = path.read_bytes()
    sha = hashlib.sha256(blob).hexdigest()
    if sha != meta.get("sha256"):
        raise CheckpointError(f"checkpoint {path} has SHA-256 {sha}, but {meta.get('sha256')} was recorded when it "
                              f"was written (a damaged file): refusing to load it. {remedy(h, root)}")
    return blob, meta


def remedy(h: str, root: Path | None = None) -> str:
    """What to run about a refused checkpoint ``h``: delete it (a fork without a checkpoint trains
    its prefix again)."""
    files = " ".join(shlex.quote(str(p)) for p in (checkpoint_path(h, root), sidecar_path(h, root)))
    return (f"To train the prefix again and recompute its forks stored as failed, run `rm {files}` then "
            "`stabstudy study --retry-failed` (in a notebook: retry_failed = True; in Python: "
            "run_grid(..., retry_failed=True))")


def load(h: str, model: BaseAlgorithm, root: Path | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Put the verified checkpoint of prefix hash ``h`` into ``model`` (freshly built for the
    continuation: :func:`restore`); returns ``(extra, sidecar)``. ``FileNotFoundError`` when absent,
    :class:`CheckpointError` (with :func:`remedy`) when damaged or not a plain-data checkpoint."""
    blob, meta = read_checkpoint(h, root)
    try:
        extra = restore(blob, model, f"checkpoint {checkpoint_path(h, root)}")
    except CheckpointError as e:
        raise CheckpointError(f"{e}: refusing to load it. {remedy(h, root)}") from e
    return extra, meta


def has_checkpoint(key: RunSpec | str, root: Path | None = None) -> bool:
    """A checkpoint and its sidecar are present (cheap: the SHA-256 is checked on load)."""
    try:
        read_sidecar(key.spec_hash if isinstance(key, RunSpec) else key, root)
        return True
    except (FileNotFoundError, CheckpointError):
        return False


# -- the training state as plain data ---------------------------------------------------------


def _is_mujoco(v: Any) -> bool:
    return type(v).__module__.split(".")[0] == "mujoco" or "mujoco_rendering" in type(v).__module__


def env_layers(vec_env: VecEnv) -> list[tuple[str, Any, dict[str, Any]]]:
    """``(class name, layer, state)`` of each layer of the single env of a ``DummyVecEnv``, outermost
    wrapper first: every attribute but the inner env, the perturbation schedule and MuJoCo objects;
    for a MuJoCo env its full integration state (``mj_getState``, ``mjSTATE_INTEGRATION``)."""
    out = []
    env = vec_env.envs[0]
    while env is not None:
        state = {k: v for k, v in vars(env).items() if k not in _NOT_STATE and not _is_mujoco(v)}
        if _is_mujoco(getattr(env, "data", None)):
            import mujoco

            spec = mujoco.mjtState.mjSTATE_INTEGRATION
            arr = np.empty(mujoco.mj_stateSize(env.model, spec))
            mujoco.mj_getState(env.model, env.data, arr, spec)
            state[_MUJOCO] = arr
        out.append((type(env).__name__, env, state))
        env = getattr(env, "env", None)
    return out


def _set_env_state(vec_env: VecEnv, layers: Any, plain: Plain) -> None:
    """Put the stored layers back into a fresh env of the same construction (:func:`env_layers`)."""
    fresh = env_layers(vec_env)
    if not isinstance(layers, list) or [n for n, *_ in fresh] != [n for n, _ in layers]:
        raise CheckpointError(f"the env of the checkpoint has layers {[n for n, _ in layers] if isinstance(layers, list) else layers!r}, "
                              f"this env {[n for n, *_ in fresh]}")
    for (name, env, _), (_, tree) in zip(fresh, layers, strict=True):
        tree = dict(tree)
        mj = tree.pop(_MUJOCO, None)
        plain.decode_into(env, tree, name)
        if mj is not None:
            import mujoco

            mujoco.mj_setState(env.model, env.data, plain.decode(mj, None, name), mujoco.mjtState.mjSTATE_INTEGRATION)
            mujoco.mj_forward(env.model, env.data)  # derived quantities (positions, contacts) of that state


def rng_state(model: BaseAlgorithm) -> dict[str, Any]:
    """The global generators' states (Python, NumPy, torch) and the model's action-space generator."""
    return {"python": random.getstate(), "numpy": np.random.get_state(legacy=False), "torch": torch.get_rng_state(),
            "action_space": model.action_space.np_random.bit_generator.state}


def set_rng_state(model: BaseAlgorithm, st: dict[str, Any]) -> None:
    """Undo the seeding of a freshly built model with the states :func:`rng_state` captured."""
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])
    model.action_space.np_random.bit_generator.state = st["action_space"]


def _model_attrs(model: BaseAlgorithm) -> dict[str, Any]:
    return {k: v for k, v in vars(model).items() if k not in _MODEL_ELSEWHERE}


def snapshot(model: BaseAlgorithm, extra: dict[str, Any]) -> bytes:
    """The checkpoint bytes of ``model`` now (see the module docstring): a zip of ``state.json`` (the
    tree of :mod:`~stabstudy.learners.rl.plainstate`), ``arrays.npz``, ``tensors.pt`` (``torch.save`` of
    tensors and state dicts) and, off-policy, ``buffer.npz``."""
    plain = Plain()
    vec = model.get_env()
    norm = model.get_vec_normalize_env()
    dummy = norm.venv if norm is not None else vec
    tree = {
        "format": FORMAT,
        # the policy first: the actor/critic attributes are parts of it
        "model": plain.encode_vars(dict(sorted(_model_attrs(model).items(), key=lambda kv: kv[0] != "policy")), "model"),
        "vec_normalize": None if norm is None else plain.encode_vars(
            {k: v for k, v in vars(norm).items() if k not in ("venv", "class_attributes")}, "vec_normalize"),
        "vec_env": plain.encode_vars({k: v for k, v in vars(dummy).items() if k != "envs"}, "vec_env"),
        "env": [[name, plain.encode_vars(state, f"env.{i}")] for i, (name, _, state) in enumerate(env_layers(dummy))],
        "rng": plain.encode(rng_state(model), "rng"),
        "extra": plain.encode(extra, "extra"),
    }
    out = io.BytesIO()
    # stored, not deflated: the buffer compresses poorly (floats), so deflating would cost seconds to
    # save a few percent
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        z.writestr("state.json", json.dumps(tree))
        z.writestr("arrays.npz", _npz(plain.arrays))
        t = io.BytesIO()
        torch.save(plain.tensors, t)
        z.writestr("tensors.pt", t.getvalue())
        rb = getattr(model, "replay_buffer", None)
        if rb is not None:
            n = rb.buffer_size if rb.full else rb.pos
            arrays = {k: getattr(rb, k)[:n] for k in BUFFER_ARRAYS if isinstance(getattr(rb, k, None), np.ndarray)}
            z.writestr("buffer.npz", _npz(dict(pos=np.int64(rb.pos), full=np.bool_(rb.full),
                                               capacity=np.int64(rb.buffer_size), **arrays)))
    return out.getvalue()


def _npz(arrays: dict[str, np.ndarray]) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _fill_buffer(model: BaseAlgorithm, data: Any) -> None:
    """Copy a stored replay buffer into the model's (whose capacity may be larger: a prefix's buffer
    holds at most its own length; the uninterrupted run's holds the whole run)."""
    rb = model.replay_buffer
    pos, full, cap = int(data["pos"]), bool(data["full"]), int(data["capacity"])
    n = cap if full else pos
    if full and pos != 0 and cap != rb.buffer_size:
        raise CheckpointError(f"the stored replay buffer wrapped around (capacity {cap}); it can continue only "
                              f"with that capacity, not {rb.buffer_size}")
    if n > rb.buffer_size:
        raise CheckpointError(f"the stored replay buffer holds {n} transitions, more than the capacity {rb.buffer_size}")
    for k in BUFFER_ARRAYS:
        if k in data.files:
            getattr(rb, k)[:n] = data[k]
    if cap == rb.buffer_size:
        rb.pos, rb.full = pos, full
    else:  # filled in order and not wrapped: the larger buffer continues behind it
        rb.pos, rb.full = n % rb.buffer_size, n == rb.buffer_size


def _read_plain(blob: bytes) -> tuple[dict[str, Any], Plain, dict[str, np.ndarray] | None]:
    """The tree, arrays and tensors, and the replay buffer of checkpoint bytes, read without pickle:
    ``json``, ``numpy.load(allow_pickle=False)``, ``torch.load(weights_only=True)``."""
    with zipfile.ZipFile(io.BytesIO(blob)) as z:
        names = set(z.namelist())
        missing = sorted({"state.json", "arrays.npz", "tensors.pt"} - names)
        if missing:
            raise CheckpointError(f"it lacks {', '.join(missing)}")
        tree = json.loads(z.read("state.json"))
        if not isinstance(tree, dict) or tree.get("format") != FORMAT:
            raise CheckpointError(f"its state is not of format {FORMAT}")
        with np.load(io.BytesIO(z.read("arrays.npz")), allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
        try:
            tensors = torch.load(io.BytesIO(z.read("tensors.pt")), map_location="cpu", weights_only=True)
        except Exception as e:  # torch's own message advises weights_only=False: not repeated here
            raise CheckpointError("its tensors.pt is refused by torch.load(weights_only=True), which reads tensors "
                                  f"and plain data only ({type(e).__name__})") from e
        if not isinstance(tensors, dict):
            raise CheckpointError("its tensor file does not hold a dict")
        buffer = None
        if "buffer.npz" in names:
            with np.load(io.BytesIO(z.read("buffer.npz")), allow_pickle=False) as npz:
                buffer = {k: npz[k] for k in npz.files}
    return tree, Plain(arrays, tensors), buffer


class _Arrays(dict):
    """A dict of arrays with ``.files``, as ``numpy.load`` gives (for :func:`_fill_buffer`)."""

    @property
    def files(self) -> list[str]:
        return list(self)


def restore(blob: bytes, model: BaseAlgorithm, source: str = "checkpoint") -> dict[str, Any]:
    """Put checkpoint bytes (verified by the caller: :func:`read_checkpoint`) into ``model``, freshly
    built for the continuation (:func:`stabstudy.learners.rl.learner.build_model` of the fork's
    spec: its env, its replay capacity), and return ``extra``. Raises :class:`CheckpointError`,
    naming ``source``, when the bytes are not a checkpoint of this format or do not fit the model;
    nothing in them is executed (:mod:`~stabstudy.learners.rl.plainstate`)."""
    try:
        tree, plain, buffer = _read_plain(blob)
        norm = model.get_vec_normalize_env()
        if (tree["vec_normalize"] is None) != (norm is None):
            raise CheckpointError("its observation normalisation (normalize_obs) differs from the model's")
        plain.decode_into(model, tree["model"], "model")
        dummy = model.get_env()
        if norm is not None:
            plain.decode_into(norm, tree["vec_normalize"], "vec_normalize")
            dummy = norm.venv
        plain.decode_into(dummy, tree["vec_env"], "vec_env")
        _set_env_state(dummy, tree["env"], plain)
        if (buffer is None) != (getattr(model, "replay_buffer", None) is None):
            raise CheckpointError("its replay buffer does not fit the model")
        if buffer is not None:
            _fill_buffer(model, _Arrays(buffer))
        set_rng_state(model, plain.decode(tree["rng"], None, "rng"))
        return plain.decode(tree["extra"], None, "extra")
    except CheckpointError as e:
        raise CheckpointError(f"{source}: {e}") from e
    except Exception as e:  # whatever a damaged or foreign file raises in the readers: refused, never run
        first = (str(e).splitlines() or [""])[0][:200]
        raise CheckpointError(f"{source} cannot be read as a plain-data checkpoint of format {FORMAT} "
                              f"({type(e).__name__}: {first})") from e


def set_noise(model: BaseAlgorithm, learner: str, value: float) -> None:
    """Set ``learner``'s own noise knob (:data:`stabstudy.registry.NOISE_KNOB`) on a live model."""
    knob = NOISE_KNOB[learner]
    if knob == "ent_coef":
        model.ent_coef = float(value)
    elif knob == "target_entropy":
        model.target_entropy = float(value)
    elif knob == "action_noise_std":
        n = model.action_space.shape[0]
        model.action_noise = NormalActionNoise(np.zeros(n), float(value) * np.ones(n)) if value > 0 else None
    else:  # pragma: no cover - a new knob in the registry needs a line here
        raise ValueError(f"no rule to set {knob!r} of {learner!r} after a fork")


def versions() -> dict[str, str]:
    """Versions that a checkpoint depends on (recorded in its sidecar)."""
    import stable_baselines3

    return {"stable_baselines3": stable_baselines3.__version__, "torch": torch.__version__,
            "numpy": np.__version__}


def save(key: RunSpec, model: BaseAlgorithm, extra: dict[str, Any], status: str = "ok", reason: str = "",
         root: Path | None = None) -> tuple[Path, str]:
    """Snapshot ``model`` as the checkpoint of prefix ``key``; returns ``(path, sha256)``."""
    blob = snapshot(model, extra)
    meta = {"spec": key.to_json(), "env_steps": int(model.num_timesteps), "status": status, "reason": reason,
            "created_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"), **versions()}
    path = write_checkpoint(key.spec_hash, blob, meta, root)
    return path, hashlib.sha256(blob).hexdigest()


# -- Dask: checkpoints to and from workers ---------------------------------------------------


def _worker_sha(h: str) -> str | None:
    """On a worker: the SHA-256 of its verified copy of checkpoint ``h``, or None."""
    try:
        return read_checkpoint(h)[1]["sha256"]
    except (FileNotFoundError, CheckpointError):
        return None


def _worker_read(h: str) -> tuple[bytes, dict[str, Any]]:
    return read_checkpoint(h)


def _worker_install(h: str, blob: bytes, meta: dict[str, Any]) -> str:
    """On a worker: verify the received bytes against the sidecar, then store them."""
    if hashlib.sha256(blob).hexdigest() != meta.get("sha256"):
        raise CheckpointError(f"checkpoint {h} arrived with bytes that do not match its recorded SHA-256")
    write_checkpoint(h, blob, {k: v for k, v in meta.items() if k not in ("sha256", "bytes")})
    return meta["sha256"]


def share_checkpoints(keys: Sequence[RunSpec], scheduler: str | None = None) -> dict[str, int]:
    """Make every checkpoint of ``keys`` present, verified, here and on every worker of ``scheduler``.

    ``scheduler``: a Dask scheduler address; None reads ``$STABSTUDY_SCHEDULER``; none (an
    embedded LocalCluster, whose workers share this machine's folder) or ``"serial"`` is a
    no-op. A checkpoint absent here is fetched from a worker that has it; then it is sent to
    each worker that lacks it or holds other bytes. Returns counts: ``fetched``, ``sent``.
    """
    address = scheduler or os.environ.get("STABSTUDY_SCHEDULER") or ""
    counts = {"fetched": 0, "sent": 0}
    if not address or address == "serial":
        return counts
    from distributed import Client

    with Client(address, set_as_default=False) as client:
        for key in keys:
            h = key.spec_hash
            have = client.run(_worker_sha, h)
            try:
                blob, meta = read_checkpoint(h)
            except FileNotFoundError:
                holder = next((w for w, s in have.items() if s is not None), None)
                if holder is None:
                    continue  # nobody trained it yet: the fork will (see the module docstring)
                blob, meta = client.run(_worker_read, h, workers=[holder])[holder]
                _worker_install(h, blob, meta)
                counts["fetched"] += 1
            lacking = [w for w, s in have.items() if s != meta["sha256"]]
            if lacking:
                client.run(_worker_install, h, blob, meta, workers=lacking)
                counts["sent"] += len(lacking)
    return counts
