"""The runner on real tiny toy runs: cache, resume, failures, corrupt files, a real 2-worker cluster."""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr

from stabstudy.interventions.perturb import Perturbation
from stabstudy.run import runner
from stabstudy.run.runner import run_grid, summarize
from stabstudy.run.store import load_runs
from stabstudy.spec import RunSpec


def toy(seed: int = 0, steps: int = 25, **hp) -> RunSpec:
    return RunSpec("toy", "gd", "digits", steps=steps, seed=seed, hparams={"lr": 0.05, "width": 16, **hp})


def test_serial_grid_stores_every_run_and_then_uses_the_cache(tmp_store, monkeypatch):
    specs = [toy(0), toy(1), toy(0)]  # duplicate runs once
    recs = run_grid(specs, scheduler="serial", store=tmp_store, progress=False)
    assert [r.status for r in recs] == ["ok", "ok"] and not any(r.cached for r in recs)
    calls = []
    monkeypatch.setattr(runner, "execute", lambda s, threads=None: calls.append(s))
    recs = run_grid(specs, scheduler="serial", store=tmp_store, progress=False)
    assert calls == [] and all(r.cached for r in recs)


def test_same_spec_same_trajectory(tmp_store):
    a, _, _, _ = runner.execute(toy(3))
    b, _, _, _ = runner.execute(toy(3))
    c, _, _, _ = runner.execute(toy(4))
    xr.testing.assert_identical(a[["loss", "grad_norm"]], b[["loss", "grad_norm"]])
    assert not np.allclose(a["loss"].values, c["loss"].values)


def test_failure_is_recorded_and_the_grid_goes_on(tmp_store):
    bad = toy(0).replace(hparams={"n_train": 5000})  # valid spec, raises in the learner (digits has 1797 images)
    good = toy(1)
    recs = run_grid([bad, good], scheduler="serial", store=tmp_store, progress=False)
    assert [r.status for r in recs] == ["failed", "ok"]
    stored = tmp_store.load(bad)
    assert stored.attrs["status"] == "failed" and "digits has 1797 images" in stored.attrs["error"]
    # failed runs are data: not retried unless asked
    assert run_grid([bad], scheduler="serial", store=tmp_store, progress=False)[0].cached
    assert not run_grid([bad], scheduler="serial", store=tmp_store, progress=False, retry_failed=True)[0].cached


def test_interrupt_leaves_no_partial_file_and_rerun_resumes(tmp_store, monkeypatch):
    specs = [toy(s) for s in range(3)]
    real = runner.execute
    seen = []

    def interrupted(spec, threads=None):
        if len(seen) == 1:
            raise KeyboardInterrupt
        seen.append(spec)
        return real(spec, threads)

    monkeypatch.setattr(runner, "execute", interrupted)
    with pytest.raises(KeyboardInterrupt, match="1 of the 3 runs to compute were stored") as exc:
        run_grid(specs, scheduler="serial", store=tmp_store, progress=False)
    assert exc.value.__suppress_context__  # a short traceback: the frames it came through are left out
    assert sorted(p.name for p in tmp_store.root.iterdir()) == [".locks", f"{specs[0].spec_hash}.nc"]
    monkeypatch.setattr(runner, "execute", real)
    recs = run_grid(specs, scheduler="serial", store=tmp_store, progress=False)
    assert [r.cached for r in recs] == [True, False, False]


def test_corrupt_file_is_recomputed(tmp_store, capsys):
    s = toy(0)
    run_grid([s], scheduler="serial", store=tmp_store, progress=False)
    good = tmp_store.load(s)
    tmp_store.path(s).write_bytes(tmp_store.path(s).read_bytes()[:200])
    recs = run_grid([s], scheduler="serial", store=tmp_store, progress=False)
    assert not recs[0].cached and "corrupt" in capsys.readouterr().out
    np.testing.assert_array_equal(tmp_store.load(s)["loss"].values, good["loss"].values)


def test_diverged_run_is_data(tmp_store):
    s = toy(0, steps=40, lr=50.0)
    rec = run_grid([s], scheduler="serial", store=tmp_store, progress=False)[0]
    assert rec.status == "diverged"
    ds = tmp_store.load(s)
    assert ds.attrs["status"] == "diverged" and ds.sizes["step"] >= 1


def test_two_worker_local_cluster_matches_serial(tmp_store, tmp_path):
    from stabstudy.run.store import RunStore

    specs = [toy(s) for s in range(3)] + [
        toy(0).replace(perturbations=(Perturbation("lr_spike", 10, duration=3, dose=5.0),))]
    try:
        recs = run_grid(specs, store=tmp_store, progress=False, n_workers=2)
    finally:
        runner.close_clients()
    assert summarize(recs)["ok"] == 4
    serial = RunStore(tmp_path / "serial")
    run_grid(specs, scheduler="serial", store=serial, progress=False)
    a, b = load_runs(specs, store=tmp_store), load_runs(specs, store=serial)
    np.testing.assert_array_equal(a["loss"].values, b["loss"].values)
    assert (a["perturbed"].sel(run=specs[-1].spec_hash).sum() == 3)


def test_runs_of_another_results_version_are_recomputed(tmp_store, monkeypatch, capsys):
    from stabstudy.learners import toy as toy_learner

    s = toy(0)
    run_grid([s], scheduler="serial", store=tmp_store, progress=False)
    assert tmp_store.load(s).attrs["results_version"] == toy_learner.RESULTS_VERSION
    monkeypatch.setattr(toy_learner, "RESULTS_VERSION", toy_learner.RESULTS_VERSION + 1)
    rec = run_grid([s], scheduler="serial", store=tmp_store, progress=False)[0]
    assert not rec.cached and "results version" in capsys.readouterr().out
    assert tmp_store.load(s).attrs["results_version"] == toy_learner.RESULTS_VERSION
    assert run_grid([s], scheduler="serial", store=tmp_store, progress=False)[0].cached


def test_grid_of_non_specs_is_a_clear_error(tmp_store):
    with pytest.raises(TypeError, match="run_grid takes RunSpec objects, got dict"):
        run_grid([{"domain": "toy"}], scheduler="serial", store=tmp_store, progress=False)


def test_stored_provenance_is_the_producing_processes(tmp_store):
    """A Dask worker's code may differ from the client's: its identity and results version
    are what the stored run records."""
    s = toy(5)
    result, producer = runner._worker_task(s)
    assert producer == runner.made_by("toy") and set(producer) == {
        "stabstudy_version", "git_commit", "torch_version", "results_version", "python_version", "numpy_version",
        "xarray_version", "scipy_version", "telemetry_version"}
    other = {"stabstudy_version": "9.9", "git_commit": "abc123", "torch_version": "0.0", "results_version": 42}
    runner._store_result(tmp_store, s, result, other)
    attrs = tmp_store.load(s).attrs
    assert (attrs["stabstudy_version"], attrs["git_commit"], attrs["torch_version"], attrs["results_version"]) == \
        ("9.9", "abc123", "0.0", 42)
    # and a run stored by another results version is recomputed
    assert runner.pending([s], tmp_store) == [s]


def test_progress_file_round_trip_and_garbage_reads_as_none(tmp_path):
    f = tmp_path / "progress.json"
    assert runner.read_progress(f) is None  # absent
    state = runner.GridProgress(pid=7, grid=2, done=3, total=5, cached=1, started_at=1e9, elapsed_s=4.5)
    runner.write_progress(f, state)
    assert runner.read_progress(f) == state
    assert [p.name for p in tmp_path.iterdir()] == ["progress.json"]  # no temporary file left
    for garbage in ("", "{", "[1, 2]", '{"pid": 1}', '{"pid": "x", "grid": 1, "done": 0, "total": 1, '
                    '"cached": 0, "started_at": 0, "elapsed_s": 0}', "\x00\xff"):
        f.write_text(garbage)
        assert runner.read_progress(f) is None, garbage


def test_grid_reports_its_progress_where_the_study_asks(tmp_store, tmp_path, monkeypatch):
    """With $STABSTUDY_PROGRESS_FILE set, run_grid writes its state at the start, after each run
    and at the end; a second grid gets the next number; unset, nothing is written."""
    f = tmp_path / "progress.json"
    run_grid([toy(0)], scheduler="serial", store=tmp_store, progress=False)
    assert not f.exists()
    monkeypatch.setenv(runner.PROGRESS_ENV, str(f))
    written: list[runner.GridProgress] = []
    real = runner.write_progress
    monkeypatch.setattr(runner, "write_progress", lambda path, state: (written.append(state), real(path, state)))
    run_grid([toy(0), toy(1), toy(2)], scheduler="serial", store=tmp_store, progress=False)
    assert [(s.done, s.total, s.cached, s.finished) for s in written] == [
        (1, 3, 1, False), (2, 3, 1, False), (3, 3, 1, False), (3, 3, 1, True)]
    assert runner.read_progress(f) == written[-1]
    run_grid([toy(0)], scheduler="serial", store=tmp_store, progress=False)
    assert written[-1].grid == written[0].grid + 1 and written[-1].pid == written[0].pid


def test_bar_outside_a_terminal_is_drawn_at_start_and_end_only(tmp_store, capsys):
    """In a notebook (stderr no terminal) every redraw is stored: a grid of quick runs draws twice."""
    run_grid([toy(s) for s in range(4)], scheduler="serial", store=tmp_store, progress=True)
    err = capsys.readouterr().err
    assert err.count("\r") == 2 and "0/4" in err and "4/4" in err


#: One study's grid on a shared store, in its own process: waits until both processes are ready,
#: runs the grid with each run slowed to 1 s (so that the two overlap), writes the hashes it computed.
GRID = """
import json, sys, time
from pathlib import Path
from stabstudy.run import runner
from stabstudy.run.store import RunStore
from stabstudy.spec import RunSpec

root, me, n = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
specs = [RunSpec("toy", "gd", "digits", steps=4, seed=s, hparams={"width": 8}) for s in range(n)]
real = runner.execute
runner.execute = lambda spec, threads=None: (time.sleep(1.0), real(spec, threads))[1]
(root / f"ready-{me}").touch()
while len(list(root.glob("ready-*"))) < 2:
    time.sleep(0.05)
recs = runner.run_grid(specs, scheduler="serial", store=RunStore(root / "runs"), progress=False)
(root / f"computed-{me}.json").write_text(json.dumps([r.spec.spec_hash for r in recs if not r.cached]))
"""


def test_two_studies_on_one_store_compute_each_run_once_and_count_the_others_runs_as_stored(tmp_path):
    """Each study's page then says how many runs it computed: a run the other stored is not one of them."""
    import json
    import os
    import subprocess
    import sys

    from stabstudy.run.study import TerminalProgress

    n = 6
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", GRID, str(tmp_path), me, str(n)],
                              env={**env, runner.PROGRESS_ENV: str(tmp_path / f"progress-{me}.json")}) for me in "ab"]
    assert [p.wait(timeout=600) for p in procs] == [0, 0]
    computed = {me: json.loads((tmp_path / f"computed-{me}.json").read_text()) for me in "ab"}
    every = computed["a"] + computed["b"]
    assert len(every) == len(set(every)) == n  # each run computed once, by one of the two
    assert computed["a"] and computed["b"]  # and both did some: the second computed other runs
    for me in "ab":  # what `stabstudy study` reads from the kernel's progress file
        bars = TerminalProgress(me, tmp_path / f"progress-{me}.json")
        bars.poll()
        bars._close()
        assert bars.runs == (len(computed[me]), n - len(computed[me])), me


def test_a_grid_waits_for_a_run_another_process_holds_and_takes_it_over_when_that_process_dies(tmp_store, hold_lock):
    import signal
    import threading

    s = toy(0, steps=4)
    holder = hold_lock(tmp_store.root, s.spec_hash)
    out: list = []
    grid = threading.Thread(target=lambda: out.extend(
        run_grid([s], scheduler="serial", store=tmp_store, progress=False)))
    try:
        grid.start()
        grid.join(timeout=3 * runner.WAIT_POLL_S)
        assert grid.is_alive() and not tmp_store.path(s).exists()  # waiting for the holder
        assert any("being computed by another process" in n for n in runner._NOTES)
    finally:
        holder.send_signal(signal.SIGKILL)  # the holder crashes: its lock goes with it
        holder.wait()
    grid.join(timeout=120)
    assert not grid.is_alive() and out[0].status == "ok" and not out[0].cached


def test_a_run_another_process_stored_while_we_waited_is_reused(tmp_store, monkeypatch):
    s = toy(0, steps=4)
    other = runner.execute(s)
    assert tmp_store.claim(s)  # "another process": claims are per lock object, this one is shared
    calls = []
    real = runner._Claims._take

    def take(self, spec):
        if not calls:  # first look: held elsewhere; meanwhile the holder stores its result and lets go
            calls.append(spec)
            runner._store_result(tmp_store, spec, other)
            tmp_store.release(spec)
            return False
        return real(self, spec)

    monkeypatch.setattr(runner._Claims, "_take", take)
    monkeypatch.setattr(runner, "execute", lambda *a, **k: pytest.fail("recomputed a run another process stored"))
    (rec,) = run_grid([s], scheduler="serial", store=tmp_store, progress=False)
    assert rec.cached and rec.status == "ok"


def test_an_unreachable_scheduler_is_named_within_seconds():
    import time

    t0 = time.monotonic()
    with pytest.raises(runner.SchedulerUnreachableError, match="tcp://127.0.0.1:1.*dask scheduler"):
        runner.get_client("tcp://127.0.0.1:1")
    assert time.monotonic() - t0 < 4 * runner.SCHEDULER_TIMEOUT_S  # distributed's default waits 30 s


def test_a_refused_checkpoint_says_what_to_run_and_that_recomputes_the_fork(tmp_store, monkeypatch, capsys):
    """The error a fork stores names the files to delete and `--retry-failed`; doing that trains
    the prefix again and recomputes the fork, which plain reruns reuse as failed."""
    import re
    import shlex
    import subprocess

    from stabstudy.learners.rl import forks

    monkeypatch.delenv("STABSTUDY_CHECKPOINTS", raising=False)
    hp = dict(hidden=16, batch_size=32, learning_starts=50, eval_episodes=1, eval_max_steps=50, diag_every=5)
    fork = RunSpec("rl", "td3", "Pendulum-v1", 448, 0, hparams={**hp, "prefix_steps": 256}, eval_every=64)
    prefix = forks.prefix_key(fork)
    assert [r.status for r in run_grid([prefix], scheduler="serial", store=tmp_store, progress=False)] == ["ok"]
    path = forks.checkpoint_path(prefix)
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    path.write_bytes(bytes(blob))
    assert run_grid([fork], scheduler="serial", store=tmp_store, progress=False)[0].status == "failed"
    advice = tmp_store.load(fork).attrs["error"].strip().splitlines()[-1]
    assert "`stabstudy study --retry-failed`" in advice and "retry_failed=True" in advice
    rm = re.search(r"`(rm [^`]+)`", advice).group(1)
    subprocess.run(shlex.split(rm), check=True)
    assert not path.exists() and not forks.sidecar_path(prefix).exists()
    assert run_grid([fork], scheduler="serial", store=tmp_store, progress=False)[0].cached  # failed is data
    recs = run_grid([prefix], scheduler="serial", store=tmp_store, progress=False, retry_failed=True)
    assert not recs[0].cached and forks.has_checkpoint(prefix)  # trained again: its checkpoint was gone
    (rec,) = run_grid([fork], scheduler="serial", store=tmp_store, progress=False, retry_failed=True)
    assert (rec.status, rec.cached) == ("ok", False)


def test_on_dask_a_grid_computes_the_free_runs_then_takes_over_a_dead_holders(tmp_store, hold_lock):
    import signal
    import threading

    free, held = toy(0, steps=4), toy(1, steps=4)
    holder = hold_lock(tmp_store.root, held.spec_hash)
    out: list = []
    grid = threading.Thread(target=lambda: out.extend(
        run_grid([held, free], store=tmp_store, progress=False, n_workers=1)))
    try:
        grid.start()
        for _ in range(240):  # the cluster starts, computes the free run, then waits for the held one
            if tmp_store.path(free).exists() and any("being computed by another process" in n for n in runner._NOTES):
                break
            grid.join(timeout=0.5)
        assert grid.is_alive() and tmp_store.status(free) == "ok" and not tmp_store.path(held).exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    grid.join(timeout=120)
    runner.close_clients()
    assert not grid.is_alive() and [(r.status, r.cached) for r in out] == [("ok", False), ("ok", False)]
