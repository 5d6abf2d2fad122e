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

The prefix of a fork is keyed by :func:`prefix_key`: the spec with its perturbations and
continuation-only hyperparameters (:data:`CONTINUATION_ONLY`) removed, ``steps = P``, and
the recording cadence of a prefix (evaluation every ``P // 20`` env steps, no curvature),
which does not change training. Its checkpoint is content-addressed by that key's hash:
``<checkpoints_dir>/<hash>.zip`` with a sidecar ``<hash>.json`` recording the file's
SHA-256 when it was written. Every fork of one (algorithm, seed, hyperparameters, P)
shares it, whatever its perturbation.

A checkpoint holds everything that decides the continuation: SB3's model file (policy and
value nets, target nets, every optimizer's state, SAC's entropy coefficient, TD3's action
noise, step and update counters, the last observation), the replay buffer's arrays
(``numpy`` ``.npz``, no pickle), the observation normalisation statistics (``normalize_obs``),
the global RNG states (Python, NumPy, torch), the action space's RNG, the training env's state (every wrapper's counters, the env's ``np_random``,
MuJoCo's full integration state) and the recorder's counters. SB3's model file unpickles
objects, so a checkpoint is loaded only after its bytes match the SHA-256 of the sidecar
(:class:`CheckpointError` otherwise), and from the verified bytes in memory, never from a
second read of the file.

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
import pickle
import random
import uuid
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
from stabstudy.registry import NOISE_KNOB, ON_POLICY
from stabstudy.spec import RunSpec

#: Version of the checkpoint layout; a checkpoint of another version is refused.
FORMAT = 1
#: Hyperparameters that act only after the fork: not part of the prefix key (a controlled fork
#: continues the same prefix as the uncontrolled one).
CONTINUATION_ONLY = ("noise_after_fork", "controller", "controller_threshold", "controller_window",
                     "controller_backoff", "controller_recovery", "controller_snapshot_every")
#: Arrays of an SB3 replay buffer that a checkpoint keeps.
BUFFER_ARRAYS = ("observations", "next_observations", "actions", "rewards", "dones", "timeouts")
#: Wrapper attributes that are configuration of the new run, not state of the old one.
_NOT_STATE = ("env", "schedule")

Role = Literal["scratch", "prefix", "fork"]


class CheckpointError(RuntimeError):
    """A stored checkpoint that must not be loaded (damaged, tampered with, or of another format)."""


# -- specs ---------------------------------------------------------------------------------


def prefix_steps(spec: RunSpec) -> int:
    """The spec's ``prefix_steps`` hyperparameter (0 when absent)."""
    return int(spec.hp.get("prefix_steps", 0))


def role(spec: RunSpec) -> Role:
    """``scratch`` (``prefix_steps`` 0), ``prefix`` (``prefix_steps == steps``) or ``fork``."""
    p = prefix_steps(spec)
    return "scratch" if p == 0 else "prefix" if p == spec.steps else "fork"


def check(spec: RunSpec, hp: dict[str, Any]) -> None:
    """Raise ``ValueError`` for a spec whose fork does not describe one uninterrupted run.

    ``hp``: the spec's merged hyperparameters. A prefix has no perturbations; a fork's
    perturbations start at or after the fork; the fork point must lie where a ``learn()``
    call can stop without changing what follows (a rollout end for PPO/A2C, a train call
    for off-policy learners)."""
    p, r = prefix_steps(spec), role(spec)
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
    return (root or checkpoints_dir()) / f"{h}.zip"


def sidecar_path(key: RunSpec | str, root: Path | None = None) -> Path:
    """The sidecar (JSON: SHA-256, size, prefix spec, versions) of a checkpoint."""
    return checkpoint_path(key, root).with_suffix(".json")


def _atomic_write(target: Path, data: bytes) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.{uuid.uuid4().hex}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_checkpoint(h: str, blob: bytes, meta: dict[str, Any], root: Path | None = None) -> Path:
    """Store ``blob`` as the checkpoint of prefix hash ``h``: the zip, then its sidecar, each atomically
    (temporary file, then rename). The sidecar records the blob's SHA-256; a reader that finds a zip
    whose sidecar does not match refuses it (:func:`read_checkpoint`)."""
    meta = {**meta, "format": FORMAT, "spec_hash": h, "sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob)}
    path = checkpoint_path(h, root)
    _atomic_write(path, blob)
    _atomic_write(sidecar_path(h, root), json.dumps(meta, indent=1, sort_keys=True).encode())
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
        raise CheckpointError(f"checkpoint sidecar {side} is unreadable ({e}); refusing to load {path}") from e
    if meta.get("spec_hash") != h or meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint sidecar {side} describes {meta.get('spec_hash')!r} format "
                              f"{meta.get('format')!r}, not {h!r} format {FORMAT}; refusing to load {path}")
    return meta


def read_checkpoint(h: str, root: Path | None = None) -> tuple[bytes, dict[str, Any]]:
    """The verified bytes and sidecar of checkpoint ``h``.

    Raises ``FileNotFoundError`` when absent and :class:`CheckpointError`, naming the file,
    when its SHA-256 differs from the one recorded when it was written: the file unpickles
    objects, so a changed file is never loaded."""
    meta = read_sidecar(h, root)
    path = checkpoint_path(h, root)
    blob = path.read_bytes()
    sha = hashlib.sha256(blob).hexdigest()
    if sha != meta.get("sha256"):
        raise CheckpointError(f"checkpoint {path} has SHA-256 {sha}, but {meta.get('sha256')} was recorded when it "
                              "was written: refusing to load it (it unpickles objects). Delete it and its sidecar "
                              "to train the prefix again.")
    return blob, meta


def has_checkpoint(key: RunSpec | str, root: Path | None = None) -> bool:
    """A checkpoint and its sidecar are present (cheap: the SHA-256 is checked on load)."""
    try:
        read_sidecar(key.spec_hash if isinstance(key, RunSpec) else key, root)
        return True
    except (FileNotFoundError, CheckpointError):
        return False


# -- state that SB3's model file does not hold -------------------------------------------


def _is_mujoco(v: Any) -> bool:
    return type(v).__module__.split(".")[0] == "mujoco" or "mujoco_rendering" in type(v).__module__


def env_state(vec_env: VecEnv) -> list[tuple[str, dict[str, Any]]]:
    """State of the single env of a ``DummyVecEnv``, layer by layer (outermost wrapper first):
    every attribute but the inner env, the perturbation schedule and MuJoCo objects; for a
    MuJoCo env its full integration state (``mj_getState``, ``mjSTATE_INTEGRATION``)."""
    out = []
    env = vec_env.envs[0]
    while env is not None:
        state = {k: v for k, v in vars(env).items() if k not in _NOT_STATE and not _is_mujoco(v)}
        if _is_mujoco(getattr(env, "data", None)):
            import mujoco

            spec = mujoco.mjtState.mjSTATE_INTEGRATION
            arr = np.empty(mujoco.mj_stateSize(env.model, spec))
            mujoco.mj_getState(env.model, env.data, arr, spec)
            state["__mujoco_state__"] = arr
        out.append((type(env).__name__, state))
        env = getattr(env, "env", None)
    return out


def set_env_state(vec_env: VecEnv, layers: list[tuple[str, dict[str, Any]]]) -> None:
    """Put :func:`env_state` back into a fresh env of the same construction."""
    env = vec_env.envs[0]
    for name, state in layers:
        if env is None or type(env).__name__ != name:
            raise CheckpointError(f"the env of the checkpoint has layer {name}, this env "
                                  f"{type(env).__name__ if env is not None else 'none'}")
        state = dict(state)
        mj = state.pop("__mujoco_state__", None)
        vars(env).update(state)
        if mj is not None:
            import mujoco

            mujoco.mj_setState(env.model, env.data, mj, mujoco.mjtState.mjSTATE_INTEGRATION)
            mujoco.mj_forward(env.model, env.data)  # derived quantities (positions, contacts) of that state
        env = getattr(env, "env", None)


def rng_state(model: BaseAlgorithm) -> dict[str, Any]:
    """The global generators' states (Python, NumPy, torch) and the model's action-space generator."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "action_space": model.action_space.np_random.bit_generator.state}


def set_rng_state(model: BaseAlgorithm, st: dict[str, Any]) -> None:
    """Undo the reseeding of SB3's ``load`` with the states :func:`rng_state` captured."""
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])
    model.action_space.np_random.bit_generator.state = st["action_space"]


# -- snapshot and restore --------------------------------------------------------------------


def snapshot(model: BaseAlgorithm, extra: dict[str, Any]) -> bytes:
    """The checkpoint bytes of ``model`` now: a zip of ``model.zip`` (SB3), ``buffer.npz``
    (off-policy), ``state.pkl`` (RNGs, env, ``extra``: the recorder's counters)."""
    sb3 = io.BytesIO()
    model.save(sb3)
    norm = model.get_vec_normalize_env()
    # VecNormalize pickles its statistics without its env and without the running returns
    state = {"rng": rng_state(model), "env": env_state(model.get_env()), "extra": extra, "vec_normalize": norm,
             "vec_normalize_returns": norm.returns.copy() if norm is not None else None}
    out = io.BytesIO()
    # stored, not deflated: the model file is compressed already and the buffer compresses
    # poorly (floats), so deflating would cost seconds to save a few percent
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        z.writestr("model.zip", sb3.getvalue())
        rb = getattr(model, "replay_buffer", None)
        if rb is not None:
            n = rb.buffer_size if rb.full else rb.pos
            arrays = {k: getattr(rb, k)[:n] for k in BUFFER_ARRAYS if isinstance(getattr(rb, k, None), np.ndarray)}
            buf = io.BytesIO()
            np.savez(buf, pos=np.int64(rb.pos), full=np.bool_(rb.full), capacity=np.int64(rb.buffer_size), **arrays)
            z.writestr("buffer.npz", buf.getvalue())
        z.writestr("state.pkl", pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL))
    return out.getvalue()


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


def restore(blob: bytes, algo_cls: type[BaseAlgorithm], env: VecEnv,
            buffer_size: int | None = None) -> tuple[BaseAlgorithm, dict[str, Any]]:
    """The model and ``extra`` of checkpoint bytes (verified by the caller: :func:`read_checkpoint`)
    on ``env`` (a fresh :func:`~stabstudy.learners.rl.envs.make_env` env, whose state it sets).
    ``buffer_size``: replay capacity of the continuation (off-policy)."""
    with zipfile.ZipFile(io.BytesIO(blob)) as z:
        names = set(z.namelist())
        state = pickle.loads(z.read("state.pkl"))
        norm = state.get("vec_normalize")
        if norm is not None:
            norm.set_venv(env)
            norm.returns = state["vec_normalize_returns"]
            env = norm
        custom = {"buffer_size": int(buffer_size)} if buffer_size is not None and "buffer.npz" in names else None
        model = algo_cls.load(io.BytesIO(z.read("model.zip")), env=env, device="cpu", force_reset=False,
                              custom_objects=custom, print_system_info=False)
        if "buffer.npz" in names:
            with np.load(io.BytesIO(z.read("buffer.npz")), allow_pickle=False) as data:
                _fill_buffer(model, data)
    set_env_state(model.get_env(), state["env"])
    set_rng_state(model, state["rng"])
    return model, state["extra"]


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
