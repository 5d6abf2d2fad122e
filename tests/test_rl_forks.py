"""Forks of stored RL prefixes: a fork continues exactly like the uninterrupted run, checkpoints hold
plain data only (loading cannot run code) and are verified before they are read, and they reach the
workers of an existing Dask scheduler."""

import hashlib
import io
import json
import pickle
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from stabstudy.interventions.perturb import Perturbation
from stabstudy.learners.rl import forks
from stabstudy.learners.rl import learner as rl
from stabstudy.learners.rl.recorder import optimizers_of
from stabstudy.seeding import seed_everything
from stabstudy.spec import RunSpec

torch.set_num_threads(1)

TINY = {
    "ppo": dict(hidden=16, n_steps=64, batch_size=32, n_epochs=2, eval_episodes=1, eval_max_steps=50),
    "sac": dict(hidden=16, batch_size=32, learning_starts=50, eval_episodes=1, eval_max_steps=50, diag_every=5),
    "td3": dict(hidden=16, batch_size=32, learning_starts=50, eval_episodes=1, eval_max_steps=50, diag_every=5),
}
P, K = 256, 192  # prefix and continuation env steps (P mid-episode: Pendulum episodes last 200 steps)
#: Recorded channels compared bit for bit.
EXACT = ("perf", "perf_env_step", "episode_return", "loss", "value_loss", "actor_loss", "q_mean", "entropy",
         "approx_kl", "clip_fraction", "lr", "grad_norm_critic", "update_norm", "update_norm_actor", "adam_v_mean",
         "adam_v_mean_actor", "adam_m_norm", "update_ratio", "ent_coef", "action_saturation")
#: The Monitor's readings of TD3's delayed actor gradient: to float32 rounding (see the test's docstring).
ROUNDED = ("grad_norm", "grad_norm_actor")


@pytest.fixture(autouse=True)
def _data(tmp_path, monkeypatch):
    monkeypatch.setenv("STABSTUDY_DATA", str(tmp_path / "data"))
    monkeypatch.delenv("STABSTUDY_CHECKPOINTS", raising=False)
    monkeypatch.delenv("STABSTUDY_SCHEDULER", raising=False)


def specs(algo, perts=(), task="Pendulum-v1", **hp):
    """(uninterrupted run, its fork at P) of ``P + K`` env steps."""
    full = RunSpec("rl", algo, task, P + K, 0, hparams={**TINY[algo], **hp}, perturbations=perts,
                   eval_every=64)
    return full, full.replace(hparams={"prefix_steps": P})


def test_prefix_key_drops_perturbations_and_continuation_only_hparams():
    full, fork = specs("sac", (Perturbation("lr_spike", 300, 20, 10.0),))
    key = forks.prefix_key(fork.replace(hparams={"noise_after_fork": -2.0}))
    assert key.steps == P and key.perturbations == () and key.hp == {**TINY["sac"], "prefix_steps": P}
    assert forks.role(key) == "prefix" and forks.role(fork) == "fork" and forks.role(full) == "scratch"
    # every fork of one seed shares the prefix, whatever its perturbation and recording cadence
    assert forks.prefix_key(specs("sac")[1].replace(eval_every=32)) == key
    assert forks.prefix_specs([fork, specs("sac")[1], full]) == [key]
    # ... and whatever controller it continues with
    assert forks.prefix_key(fork.replace(hparams={"controller": "z_lr", "controller_threshold": 4.0})) == key
    # the default keeps every existing spec (and hash): prefix_steps is stored only when given
    assert "prefix_steps" not in full.hp


@pytest.mark.parametrize(("change", "match"), [
    (dict(perturbations=(Perturbation("lr_spike", 100, 20, 10.0),)), "start before the fork"),
    (dict(hparams={"prefix_steps": 250}), "multiple of n_steps"),
    (dict(hparams={"prefix_steps": 0, "noise_after_fork": 0.1}), "forks only"),
])
def test_forks_that_would_not_describe_one_run_are_refused(change, match):
    with pytest.raises(ValueError, match=match):
        rl.run(specs("ppo")[1].replace(**change))


@pytest.mark.parametrize(("algo", "hp"), [("sac", {}), ("td3", {}), ("ppo", {}), ("ppo", {"normalize_obs": True})],
                         ids=["sac", "td3", "ppo", "ppo-normalize_obs"])
def test_fork_continues_exactly_like_the_uninterrupted_run(algo, hp):
    """Bit-identical on CPU: returns, losses, learning rates, updates, Adam statistics, diagnostics.
    The Monitor's norm of TD3's delayed actor gradient (and the combined ``grad_norm`` and ``xgrad``
    built from it) may differ in the last float32 bit in a few rows: a float32 reduction of the
    measurement, not of training (the actor's updates and Adam state are equal bit for bit). The
    fork's first row has no previous gradient for ``xgrad``; it is left out of the comparison."""
    _assert_fork_equals_full(algo, *specs(algo, (Perturbation("lr_spike", P + 64, 64, 30.0),), **hp))


@pytest.mark.parametrize("algo", ["ppo", "sac"])
def test_a_halfcheetah_fork_continues_exactly_like_the_uninterrupted_run(algo):
    """The study's own task (MuJoCo: the fork restores the simulator's full integration state),
    forked mid-episode (episodes last 1,000 steps) and continued 192 env steps through a spike."""
    _assert_fork_equals_full(algo, *specs(algo, (Perturbation("lr_spike", P + 64, 64, 30.0),), task="HalfCheetah-v5"))


@pytest.mark.parametrize("algo", ["ppo", "sac"])
def test_a_prefix_matched_by_return_stops_at_its_target_and_its_forks_continue_the_uninterrupted_run(algo):
    """A matching prefix stops at the first evaluation whose mean with the one before reaches its
    target (here every return does: the second evaluation, env step 128) and stores the checkpoint of
    the plain prefix of that length; a fork of it continues like the uninterrupted run. One it never
    reaches trains to its cap and says so."""
    cap = 640
    match = RunSpec("rl", algo, "Pendulum-v1", cap, 0, hparams={**TINY[algo], "match_return": -1e9}, eval_every=128)
    assert forks.role(match) == "match"
    ds = rl.run(match)
    assert (ds.attrs["matched"], ds.attrs["match_env_step"], ds.attrs["env_steps"]) == (1, 128, 128)
    assert np.isfinite(ds.attrs["match_return"]) and ds.attrs["prefix_hash"] == forks.matched_prefix(match, 128).spec_hash
    perf = ds.perf.values[np.isfinite(ds.perf.values)]
    assert perf.size == 3  # untrained, env step 128, and the closing evaluation after the last update
    full = RunSpec("rl", algo, "Pendulum-v1", 128 + K, 0, hparams=TINY[algo], eval_every=64,
                   perturbations=(Perturbation("lr_spike", 128 + 64, 64, 30.0),))
    fork = full.replace(hparams={"prefix_steps": 128})
    assert forks.prefix_key(fork) == forks.matched_prefix(match, 128) and forks.has_checkpoint(forks.prefix_key(fork))
    _assert_fork_equals_full(algo, full, fork, prefix=None, steps=128 + K)
    never = rl.run(match.replace(hparams={"match_return": 1e9}))
    assert (never.attrs["matched"], never.attrs["env_steps"]) == (0, cap) and np.isnan(never.attrs["match_return"])
    assert forks.has_checkpoint(forks.matched_prefix(match.replace(hparams={"match_return": 1e9}), cap))


@pytest.mark.parametrize(("hp", "eval_every", "match"), [
    ({"match_return": 0.0}, 96, "multiple of the fork unit 64"),
    ({"match_return": 0.0}, 0, "multiple of the fork unit"),
    ({"match_return": 0.0, "prefix_steps": 64}, 64, "matching prefix only"),
])
def test_a_matching_prefix_that_could_not_stop_cleanly_is_refused(hp, eval_every, match):
    spec = RunSpec("rl", "ppo", "Pendulum-v1", 640, 0, hparams={**TINY["ppo"], **hp}, eval_every=eval_every)
    with pytest.raises(ValueError, match=match):
        rl.run(spec)


def _assert_fork_equals_full(algo, full, fork, prefix=True, steps=P + K):
    if prefix:
        rl.run(forks.prefix_key(fork))
    a, b = rl.run(full), rl.run(fork)
    assert b.attrs["fork_role"] == "fork" and b.attrs["status"] == a.attrs["status"] == "ok"
    assert b.attrs["checkpoint_sha256"] == forks.read_sidecar(forks.prefix_key(fork).spec_hash)["sha256"]
    assert b.attrs["n_updates"] == a.attrs["n_updates"] and b.attrs["env_steps"] == a.attrs["env_steps"] == steps
    tail = a.sel(step=b.step.values)
    np.testing.assert_array_equal(tail.env_step.values, b.env_step.values)
    assert b.env_step.values[0] == forks.prefix_steps(fork) and b.perf.values[0] == b.perf.values[0]  # evaluated at the fork
    for ch in EXACT:
        if ch in a:
            np.testing.assert_array_equal(tail[ch].values[1:], b[ch].values[1:], err_msg=f"{algo} {ch}")
    for ch in ROUNDED:
        if ch in a:
            np.testing.assert_allclose(tail[ch].values[1:], b[ch].values[1:], rtol=1e-6, err_msg=f"{algo} {ch}")
    for ch in [c for c in a.data_vars if str(c).startswith("xgrad")]:
        # until every optimizer stepped once in the fork (TD3's actor: every other update) a
        # previous gradient is missing there
        np.testing.assert_allclose(tail[ch].values[3:], b[ch].values[3:], rtol=1e-6, err_msg=f"{algo} {ch}")


def _state(model):
    opts = optimizers_of(model)
    out = {f"p.{k}": v.detach().clone() for k, v in model.policy.state_dict().items()}
    for name, o in opts.items():
        for i, st in enumerate(o.state.values()):
            out.update({f"{name}.{i}.{k}": v.clone() for k, v in st.items() if torch.is_tensor(v)})
    rb = getattr(model, "replay_buffer", None)
    if rb is not None:
        n = rb.pos
        out.update({f"rb.{k}": torch.as_tensor(getattr(rb, k)[:n].copy()) for k in forks.BUFFER_ARRAYS})
    return out


@pytest.mark.parametrize("algo", ["sac", "td3"])
def test_fork_ends_in_the_same_training_state(algo):
    """Parameters, every optimizer's state and the replay buffer after ``learn(P + K)`` equal those of
    the prefix (trained with its callbacks, stored, restored) continued for K steps."""
    full, fork = specs(algo)
    seed_everything(0)
    m1 = rl.build_model(full)
    m1.learn(P + K)
    rl.run(forks.prefix_key(fork))
    m2, _ = rl.resume(fork)
    m2.learn(K, reset_num_timesteps=False)
    assert m1.num_timesteps == m2.num_timesteps == P + K and m1._n_updates == m2._n_updates
    s1, s2 = _state(m1), _state(m2)
    assert s1.keys() == s2.keys() and len(s1) > 10
    for k in s1:
        assert torch.equal(s1[k], s2[k]), k


def test_checkpoint_is_stored_atomically_with_its_sha256_and_reused(tmp_path):
    _, fork = specs("sac")
    key = forks.prefix_key(fork)
    ds = rl.run(key)
    path, side = forks.checkpoint_path(key), forks.sidecar_path(key)
    assert path.parent == tmp_path / "data" / "checkpoints" and path.name == f"{key.spec_hash}.v{forks.FORMAT}.zip"
    with zipfile.ZipFile(path) as z:  # plain data and tensors only
        assert set(z.namelist()) == {"state.json", "arrays.npz", "tensors.pt", "buffer.npz"}
    meta = json.loads(side.read_text())
    assert meta["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest() == ds.attrs["checkpoint_sha256"]
    assert meta["spec_hash"] == key.spec_hash and meta["env_steps"] == P
    assert not [p for p in path.parent.iterdir() if p.suffix == ".tmp"]
    # forks do not train the prefix again: the checkpoint's file is untouched
    before = path.stat().st_mtime_ns
    rl.run(fork)
    rl.run(fork.replace(perturbations=(Perturbation("reward_scale", P, 50, 10.0),)))
    assert path.stat().st_mtime_ns == before
    # the prefix's stored run goes stale when its checkpoint is gone (its forks need it)
    assert rl.stale(key, {"status": "ok", "monitor_own_steps": 1}) is None
    path.unlink()
    assert "checkpoint" in rl.stale(key, {"status": "ok", "monitor_own_steps": 1})


def test_a_damaged_checkpoint_is_refused_before_it_is_read_and_the_error_says_what_to_run(tmp_path):
    _, fork = specs("td3")
    key = forks.prefix_key(fork)
    rl.run(key)
    path, side = forks.checkpoint_path(key), forks.sidecar_path(key)
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    path.write_bytes(bytes(blob))
    with pytest.raises(forks.CheckpointError, match=f"{path}.*SHA-256.*refusing to load.*rm {path} {side}"):
        rl.run(fork)
    side.unlink()  # a zip without the record of its hash is not loaded either
    with pytest.raises(FileNotFoundError, match="no sidecar"):
        forks.read_checkpoint(key.spec_hash)


class _Payload:
    """Unpickled, it creates the file ``marker``: code run by loading."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _planted(member: str, marker: Path) -> bytes:
    """A malicious file in place of checkpoint member ``member``."""
    buf = io.BytesIO()
    if member == "tensors.pt":  # a torch file whose pickle runs code
        torch.save({"policy": _Payload(marker)}, buf)
    elif member.endswith(".npz"):  # an object array, pickled inside the npz
        np.savez(buf, pos=np.array([_Payload(marker)], dtype=object))
    else:
        return pickle.dumps(_Payload(marker))
    return buf.getvalue()


@pytest.mark.parametrize("member", ["tensors.pt", "arrays.npz", "buffer.npz", "state.json", "whole file"])
def test_a_malicious_pickle_with_a_matching_sidecar_is_not_executed(tmp_path, member):
    """The SHA-256 of the sidecar catches accidents, not tampering: here the sidecar is recomputed
    for the planted file, so the hash matches. Loading still runs no code (every reader refuses
    pickled objects) and the load is refused with the command that trains the prefix again."""
    _, fork = specs("sac")
    key = forks.prefix_key(fork)
    rl.run(key)
    path, side = forks.checkpoint_path(key), forks.sidecar_path(key)
    marker = tmp_path / f"code-ran-{member.replace(' ', '-')}"
    pickle.loads(pickle.dumps(_Payload(marker)))  # the payload does run code when unpickled
    assert marker.exists()
    marker.unlink()
    if member == "whole file":
        blob = _planted(member, marker)
    else:
        with zipfile.ZipFile(path) as z:
            members = {n: z.read(n) for n in z.namelist()}
        members[member] = _planted(member, marker)
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w") as z:
            for n, b in members.items():
                z.writestr(n, b)
        blob = out.getvalue()
    meta = forks.read_sidecar(key.spec_hash)
    forks.write_checkpoint(key.spec_hash, blob, {k: v for k, v in meta.items() if k not in ("sha256", "bytes")})
    assert forks.read_checkpoint(key.spec_hash)[1]["sha256"] == hashlib.sha256(blob).hexdigest()  # the hash matches
    with pytest.raises(forks.CheckpointError, match=f"(?s){path}.*refusing to load it.*rm {path} {side}"):
        rl.run(fork)
    assert not marker.exists()
    # the error's advice works: delete both files, and the fork trains its prefix again
    path.unlink()
    side.unlink()
    with pytest.warns(RuntimeWarning, match="training it here"):
        assert rl.run(fork).attrs["status"] == "ok"
    assert not marker.exists()


def test_a_checkpoint_of_the_old_format_is_trained_again_not_misread():
    """Format 1 (SB3's model zip and a pickle) lived at ``<hash>.zip``: this version never reads it."""
    _, fork = specs("td3")
    key = forks.prefix_key(fork)
    rl.run(key)
    root = forks.checkpoints_dir()
    old, old_side = root / f"{key.spec_hash}.zip", root / f"{key.spec_hash}.json"
    forks.checkpoint_path(key).rename(old)
    meta = json.loads(forks.sidecar_path(key).read_text())
    old_side.write_text(json.dumps({**meta, "format": 1}))
    forks.sidecar_path(key).unlink()
    assert not forks.has_checkpoint(key)
    assert "checkpoint" in rl.stale(key, {"status": "ok", "monitor_own_steps": 1})
    with pytest.warns(RuntimeWarning, match="training it here"):
        assert rl.run(fork).attrs["status"] == "ok"
    assert forks.has_checkpoint(key) and old.exists()


def test_a_fork_without_checkpoint_trains_its_prefix_and_noise_applies_after_the_fork():
    _, fork = specs("td3")
    with pytest.warns(RuntimeWarning, match="training it here"):
        model, extra = rl.resume(fork.replace(hparams={"noise_after_fork": 0.3}))
    assert forks.has_checkpoint(forks.prefix_key(fork)) and extra["n_updates"] > 0
    assert model.num_timesteps == P and np.allclose(model.action_noise._sigma, 0.3)


def test_a_fork_of_a_diverged_prefix_is_diverged_before_its_event():
    _, fork = specs("sac", diverge_threshold=1e-3)
    assert rl.run(forks.prefix_key(fork)).attrs["status"] == "diverged"
    ds = rl.run(fork.replace(perturbations=(Perturbation("lr_spike", P + 10, 10, 10.0),)))
    assert ds.attrs["status"] == "diverged" and "prefix diverged" in ds.attrs["diverge_reason"]
    assert ds.env_step.values.max() < P + 10  # where the prefix stopped: before the event


@pytest.mark.notebook
def test_forks_on_an_existing_dask_scheduler_without_a_shared_folder(tmp_path, monkeypatch):
    """The worker keeps checkpoints in its own folder: share_checkpoints fetches what it trained and
    sends it back to a worker that lost it; the forks computed there equal the ones computed here."""
    from distributed import LocalCluster

    from stabstudy.run.runner import close_clients, run_grid
    from stabstudy.run.store import RunStore

    worker_dir, here = tmp_path / "worker", tmp_path / "client"
    monkeypatch.setenv("STABSTUDY_CHECKPOINTS", str(here))
    _, fork = specs("sac")
    grid = [fork, fork.replace(perturbations=(Perturbation("lr_spike", P + 64, 64, 30.0),))]
    keys = forks.prefix_specs(grid)
    store = RunStore(tmp_path / "runs")
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0",
                      env={"STABSTUDY_CHECKPOINTS": str(worker_dir), "OMP_NUM_THREADS": "1"}) as cluster:
        addr = cluster.scheduler_address
        assert [r.status for r in run_grid(keys, scheduler=addr, store=store, progress=False)] == ["ok"]
        assert forks.has_checkpoint(keys[0], worker_dir) and not forks.has_checkpoint(keys[0], here)
        assert forks.share_checkpoints(keys, addr) == {"fetched": 1, "sent": 0}
        assert forks.read_checkpoint(keys[0].spec_hash, here)[1]["sha256"] == \
            forks.read_checkpoint(keys[0].spec_hash, worker_dir)[1]["sha256"]
        forks.checkpoint_path(keys[0], worker_dir).unlink()
        assert forks.share_checkpoints(keys, addr) == {"fetched": 0, "sent": 1}
        try:
            recs = run_grid(grid, scheduler=addr, store=store, progress=False)
        finally:
            close_clients()  # the runner keeps a client per address: close it with its cluster
    assert [r.status for r in recs] == ["ok", "ok"]
    remote = store.load(grid[1])
    local = rl.run(grid[1])
    np.testing.assert_array_equal(remote.perf.values, local.perf.values)
    np.testing.assert_array_equal(remote.loss.values, local.loss.values)


def test_plain_state_round_trips_state_and_refuses_what_it_cannot_store():
    from collections import deque

    from stabstudy.learners.rl.plainstate import Plain, PlainStateError

    class Thing:
        pass

    live, fresh = Thing(), Thing()
    for t in (live, fresh):
        t.gen = np.random.default_rng(0)
        t.cfg = len
    live.gen.random(3)
    live.__dict__.update(n=3, x=np.float32(0.25), big=2**100, nan=float("nan"), seq=deque([1.5, (2, "a")], maxlen=4),
                         d={1: [np.arange(3)], "k": None}, t=torch.arange(4.0))
    plain = Plain()
    tree = json.loads(json.dumps(plain.encode_vars(vars(live), "thing")))
    Plain(plain.arrays, plain.tensors).decode_into(fresh, tree)
    assert fresh.gen.random() == live.gen.random() and fresh.cfg is len
    assert fresh.n == 3 and type(fresh.x) is np.float32 and fresh.x == live.x and fresh.big == 2**100
    assert fresh.nan != fresh.nan and fresh.seq == live.seq and fresh.seq.maxlen == 4
    assert fresh.d.keys() == {1, "k"} and np.array_equal(fresh.d[1][0], live.d[1][0]) and torch.equal(fresh.t, live.t)
    # an object of a kind it does not know is refused when written, never dropped silently
    with pytest.raises(TypeError, match="thing.o: .*Thing.*without pickle"):
        Plain().encode_vars({"o": Thing()}, "thing")
    # the file names no class to build: an unknown bit generator or object class is refused
    with pytest.raises(PlainStateError, match="unknown bit generator"):
        Plain().decode({"__generator__": {"__dict__": [["bit_generator", "os.system"]], "ordered": False}})
    with pytest.raises(PlainStateError, match="stored Popen"):
        Plain().decode({"__object__": "Popen", "state": {}}, Thing())
