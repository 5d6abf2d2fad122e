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
    with pytest.raises(KeyboardInterrupt):
        run_grid(specs, scheduler="serial", store=tmp_store, progress=False)
    assert sorted(p.name for p in tmp_store.root.iterdir()) == [f"{specs[0].spec_hash}.nc"]
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
