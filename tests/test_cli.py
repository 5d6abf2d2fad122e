import os
import subprocess
import sys

import pytest

from stabstudy.run import study
from stabstudy.run.cli import main


def test_unknown_profile_exits_2_and_writes_nothing(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["study", "--profile", "bogus"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "smoke" in err and "quick" in err and "paper" in err


def test_unknown_notebook_exits_2_listing_valid_ones(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(study.paths, "build_dir", lambda: tmp_path / "build")
    assert main(["study", "--profile", "smoke", "--only", "99"]) == 2
    err = capsys.readouterr().err
    assert "unknown notebook '99'" in err
    for nb in study.notebooks():
        assert nb.stem in err
    assert not (tmp_path / "build").exists()


def test_unknown_profile_in_library_names_choices():
    with pytest.raises(ValueError, match="valid profiles: smoke, quick, standard, paper"):
        study.load_profile("fast")


def test_select_by_number_and_name():
    nbs = study.notebooks()
    first = nbs[0]
    assert study.select([first.stem.split("_")[0]]) == [first]
    assert study.select([first.stem]) == [first]
    assert study.select(None) == nbs


def test_help_and_module_entry_point():
    out = subprocess.run([sys.executable, "-m", "stabstudy", "study", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--profile" in out.stdout and "--scheduler" in out.stdout
    out = subprocess.run([sys.executable, "-m", "stabstudy", "runs", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--status" in out.stdout


def test_runs_lists_stored_runs(tmp_store, capsys):
    import numpy as np
    import xarray as xr

    from stabstudy.spec import RunSpec

    s = RunSpec("toy", "gd", "digits", 5, 0, {"lr": 0.1})
    tmp_store.save(xr.Dataset({"loss": ("step", np.ones(5))}), s, "diverged", 1.0)
    assert main(["runs", "--data", str(tmp_store.root)]) == 0
    out = capsys.readouterr().out
    assert s.spec_hash in out and "diverged" in out and "1 runs" in out


def test_study_summary_names_where_things_went(tmp_path, capsys, monkeypatch):
    """The closing line points at the folders actually used ($STABSTUDY_DATA / _FIGURES honoured)."""
    monkeypatch.setenv("STABSTUDY_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("STABSTUDY_FIGURES", str(tmp_path / "figs"))
    monkeypatch.setattr(study, "run_study", lambda profile, only, scheduler, **kw: [("00_x", 1.0, 2.0)])
    assert main(["study", "--profile", "smoke", "--only", "00"]) == 0
    out = capsys.readouterr().out
    assert f"figures in {tmp_path / 'figs'}/" in out and f"runs in {tmp_path / 'data' / 'runs'}/" in out


def _nb_with_outputs(outputs: list) -> object:
    import nbformat

    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("run()")
    cell.outputs = outputs
    nb.cells = [cell]
    return nb


def _stream(name: str, text: str) -> object:
    import nbformat

    return nbformat.v4.new_output("stream", name=name, text=text)


def test_terminal_text_keeps_what_a_terminal_shows():
    assert study.terminal_text("\rruns: 0/3\rruns: 1/3\rruns: 3/3\n") == "runs: 3/3\n"
    assert study.terminal_text("a\r\nb\rc\n") == "a\nc\n"
    assert study.terminal_text("plain\nlines\n") == "plain\nlines\n"


def test_collapse_streams_merges_bar_redraws_and_keeps_figures_in_place():
    import nbformat

    figure = nbformat.v4.new_output("display_data", data={"text/plain": "<Figure>"})
    nb = _nb_with_outputs([
        _stream("stderr", "\rruns:   0%| 0/60"), _stream("stdout", "stabstudy: run x failed\n"),
        *[_stream("stderr", f"\rruns:  {i}%| {i}/60") for i in range(1, 60)],
        _stream("stderr", "\rruns: 100%| 60/60\n"), figure, _stream("stdout", "after\n")])
    outs = study.collapse_streams(nb).cells[0].outputs
    assert [(o.output_type, o.get("name"), o.get("text")) for o in outs] == [
        ("stream", "stderr", "runs: 100%| 60/60\n"), ("stream", "stdout", "stabstudy: run x failed\n"),
        ("display_data", None, None), ("stream", "stdout", "after\n")]


def test_warnings_in_finds_warning_lines_of_stderr_only():
    nb = _nb_with_outputs([
        _stream("stderr", "/x/plots.py:9: OverlapWarning: figure nb/f: panel 0 ...\n  warnings.warn(\n"),
        _stream("stdout", "the word Warning: in a print is not one\n"), _stream("stderr", "\rruns: 1/2\n")])
    assert study.warnings_in(nb) == ["/x/plots.py:9: OverlapWarning: figure nb/f: panel 0 ..."]


def test_terminal_progress_draws_one_bar_per_grid_and_ignores_garbage(tmp_path, capsys, monkeypatch):
    import time

    from stabstudy.run.runner import GridProgress, write_progress

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # a terminal: redrawn at every poll
    f = tmp_path / "p.json"
    t0 = time.time() - 20  # the grid started 20 s ago in the kernel
    bars = study.TerminalProgress("02_nb", f, interval_s=60)
    bars.poll()  # no file yet
    f.write_text("{not json")
    bars.poll()
    assert bars.bar is None
    write_progress(f, GridProgress(pid=1, grid=1, done=2, total=6, cached=2, started_at=t0, elapsed_s=0.0))
    bars.poll()
    first = bars.bar
    write_progress(f, GridProgress(pid=1, grid=1, done=4, total=6, cached=2, started_at=t0, elapsed_s=20.0))
    bars.poll()
    assert bars.bar is first and (first.n, first.total, first.initial) == (4, 6, 2)
    write_progress(f, GridProgress(pid=1, grid=1, done=6, total=6, cached=2, started_at=t0, elapsed_s=20.0,
                                 finished=True))
    bars.poll()
    bars.poll()  # the finished grid is not reopened
    assert bars.bar is None
    write_progress(f, GridProgress(pid=1, grid=2, done=0, total=3, cached=0, started_at=t0 + 20,
                                 elapsed_s=0.0))
    bars.poll()
    assert bars.bar is not first and bars.bar.total == 3
    bars._close()
    assert bars.runs == (4 + 3, 2)  # computed, found stored: what the page will say its time was
    err = capsys.readouterr().err
    assert "02_nb grid 1" in err and "6/6" in err and "02_nb grid 2" in err and "0/3" in err
    assert "4/6 [00:20<00:20" in err  # ETA from the kernel's clock: 2 runs in 20 s, 2 to go


def test_study_shows_grid_progress_and_stores_collapsed_streams(tmp_store, tmp_path, monkeypatch, capsys):
    """run_study hands the kernel a progress file, draws its bar, and stores the notebook as read;
    papermill is replaced by a fake that runs a grid in this process, as the kernel would."""
    import nbformat
    import papermill

    from stabstudy.run import runner
    from stabstudy.spec import RunSpec

    src = tmp_path / "00_fake.ipynb"
    nbformat.write(nbformat.v4.new_notebook(), src)
    monkeypatch.setattr(study, "notebooks", lambda: [src])
    monkeypatch.delenv(runner.PROGRESS_ENV, raising=False)
    seen = {}

    def fake_execute(input_path, output_path, **kw):
        seen["env"] = os.environ.get(runner.PROGRESS_ENV)
        specs = [RunSpec("toy", "gd", "digits", steps=10, seed=s, hparams={"lr": 0.05, "width": 8}) for s in range(2)]
        runner.run_grid(specs, scheduler="serial", store=tmp_store, progress=False)
        nb = _nb_with_outputs([_stream("stderr", f"\rruns: {i}/2") for i in range(3)]
                              + [_stream("stderr", "\n/x.py:1: UserWarning: careful\n")])
        nbformat.write(nb, output_path)

    monkeypatch.setattr(papermill, "execute_notebook", fake_execute)
    study.run_study("smoke", out_dir=tmp_path / "build")
    assert seen["env"] and runner.PROGRESS_ENV not in os.environ
    stored = nbformat.read(tmp_path / "build" / "00_fake.ipynb", as_version=4)
    assert [o.text for o in stored.cells[0].outputs] == ["runs: 2/2\n/x.py:1: UserWarning: careful\n"]
    captured = capsys.readouterr()
    assert "00_fake grid" in captured.err and "2/2" in captured.err
    assert "00_fake printed 1 warning(s):" in captured.out and "UserWarning: careful" in captured.out


def test_terminal_progress_in_a_log_file_draws_start_and_end_only(tmp_path, capsys):
    """stderr no terminal (CI log): each redraw would stay in the log, so runs done in between are not drawn."""
    import time

    from stabstudy.run.runner import GridProgress, write_progress

    f = tmp_path / "p.json"
    bars = study.TerminalProgress("02_nb", f)
    for done in range(11):
        write_progress(f, GridProgress(pid=1, grid=1, done=done, total=10, cached=0, started_at=time.time(),
                                       elapsed_s=0.0, finished=done == 10))
        bars.poll()
    err = capsys.readouterr().err
    assert err.count("\r") == 2 and "0/10" in err and "10/10" in err


def test_retry_failed_reaches_every_notebooks_grids(monkeypatch):
    """--retry-failed becomes the notebooks' retry_failed parameter, which each passes to every grid."""
    import ast
    import re

    import nbformat

    seen = {}
    monkeypatch.setattr(study, "run_study", lambda profile, only, scheduler, **kw: seen.update(kw) or [])
    assert main(["study", "--profile", "smoke", "--only", "00", "--retry-failed"]) == 0
    assert seen == {"retry_failed": True}
    assert main(["study", "--profile", "smoke", "--only", "00"]) == 0 and seen == {"retry_failed": False}
    for nb in study.notebooks():
        assert study.parameters_for(nb, "smoke", None, True)["retry_failed"] is True
        cells = nbformat.read(nb, as_version=4).cells
        (params,) = [c.source for c in cells if "parameters" in c.metadata.get("tags", [])]
        names = {t.id: ast.literal_eval(n.value) for n in ast.parse(params).body for t in n.targets}
        assert names.get("retry_failed") is False, nb.name
        calls = [m for c in cells if c.cell_type == "code" for m in re.findall(r"run_grid\(.*\)", c.source)]
        assert calls and all("retry_failed=retry_failed" in m for m in calls), (nb.name, calls)


def test_an_unreachable_scheduler_is_reported_before_papermill_starts(monkeypatch, capsys):
    import time

    import papermill

    monkeypatch.setattr(papermill, "execute_notebook", lambda *a, **k: pytest.fail("papermill started"))
    t0 = time.monotonic()
    assert main(["study", "--profile", "smoke", "--only", "00", "--scheduler", "tcp://127.0.0.1:1"]) == 2
    assert time.monotonic() - t0 < 20  # distributed's default waits 30 s
    err = capsys.readouterr().err
    assert "stabstudy study: error: no Dask scheduler answers at 'tcp://127.0.0.1:1'" in err


def test_corrupt_and_failed_runs_are_listed_on_the_terminal(tmp_store, tmp_path, monkeypatch, capsys):
    """What the kernel's grids say about stored runs shows on the study's terminal, named by notebook."""
    import nbformat
    import papermill

    from stabstudy.run import runner
    from stabstudy.spec import RunSpec

    good = RunSpec("toy", "gd", "digits", steps=3, seed=0, hparams={"width": 8})
    bad = good.replace(hparams={"width": 8, "n_train": 5000})  # raises in the learner (digits has 1797 images)
    runner.run_grid([good], scheduler="serial", store=tmp_store, progress=False)
    tmp_store.path(good).write_bytes(b"damaged")
    src = tmp_path / "00_fake.ipynb"
    nbformat.write(nbformat.v4.new_notebook(), src)
    monkeypatch.setattr(study, "notebooks", lambda: [src])

    def fake_execute(input_path, output_path, **kw):  # the kernel, in this process
        runner.run_grid([good, bad], scheduler="serial", store=tmp_store, progress=False)
        nbformat.write(nbformat.v4.new_notebook(), output_path)

    monkeypatch.setattr(papermill, "execute_notebook", fake_execute)
    study.run_study("smoke", out_dir=tmp_path / "build")
    err = capsys.readouterr().err
    assert f"00_fake: stored run {good.spec_hash}.nc is corrupt (unreadable); recomputing" in err
    assert f"00_fake: run {bad.label} failed; traceback stored in {bad.spec_hash}.nc" in err


def test_cpu_meter_counts_a_child_process_that_has_exited():
    with study.CpuMeter(interval_s=0.05) as meter:
        subprocess.run([sys.executable, "-c", "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass\n"
                        "time.sleep(0.2)"], check=True)
    assert 0.4 < meter.seconds < 5.0
    with study.CpuMeter(interval_s=0.05) as idle:
        subprocess.run([sys.executable, "-c", "import time; time.sleep(0.3)"], check=True)
    assert idle.seconds < 0.4


def test_the_study_says_how_long_its_notebooks_took_last_time(tmp_path, monkeypatch):
    """Stored-run times are never passed off as from-scratch ones: the page says which it was."""
    import json

    monkeypatch.setenv("STABSTUDY_ROOT", str(tmp_path))
    monkeypatch.setenv("STABSTUDY_DATA", str(tmp_path / "data"))
    assert study.expected_times("quick", ["00_a"]) is None
    (tmp_path / "results" / "quick").mkdir(parents=True)
    when = {"commit": "abcdef123", "end": "2026-12-04T10:00:00"}
    pages = {"00_a": {"wall_s": 600.0, "runs_computed": 50, "runs_stored": 0, **when},
             "01_b": {"wall_s": 60.0, "runs_computed": 0, "runs_stored": 166, **when,
                      "from_scratch": {"wall_s": 6780.0, "cpu_s": 13000.0, "runs": 166, **when}},
             "02_c": {"wall_s": 120.0, **when},
             "03_d": {"wall_s": float("nan"), "commit": "abcdef123", "end": ""}}
    (tmp_path / "results" / "quick" / "manifest.json").write_text(json.dumps({"notebooks": pages}))
    line = study.expected_times("quick", ["00_a", "01_b", "03_d"])
    assert "00 10 min computing its 50 runs (abcdef1, 2026-12-04)" in line
    assert "01 1 min (abcdef1, 2026-12-04; 166 of 166 runs stored), from scratch 113 min (abcdef1, 2026-12-04)" in line
    assert "never measured: 03" in line and "Runs stored here now: 0; from scratch the selected notebooks took 123 min" in line
    line = study.expected_times("quick", ["02_c"])
    assert "runs stored or not: not recorded), from scratch: not measured" in line and "took unknown" in line
    (tmp_path / "data" / "runs").mkdir(parents=True)
    (tmp_path / "data" / "runs" / "0123.nc").write_bytes(b"")
    assert study.expected_times("quick", ["00_a"]).endswith("Runs stored here now: 1")


def test_a_time_measured_on_another_design_is_flagged(tmp_path, monkeypatch):
    """A page made before its notebook changed does not pass its time off as the new design's."""
    import hashlib
    import json

    monkeypatch.setenv("STABSTUDY_ROOT", str(tmp_path))
    monkeypatch.setenv("STABSTUDY_DATA", str(tmp_path / "data"))
    nb = tmp_path / "notebooks" / "01_b.ipynb"
    nb.parent.mkdir()
    nb.write_text("design 1")
    page = {"wall_s": 6780.0, "runs_computed": 166, "runs_stored": 0, "commit": "abcdef123", "end": "2026-12-04",
            "sources": {"notebooks/01_b.ipynb": hashlib.sha256(b"design 1").hexdigest()}}
    (tmp_path / "results" / "quick").mkdir(parents=True)
    (tmp_path / "results" / "quick" / "manifest.json").write_text(json.dumps({"notebooks": {"01_b": page}}))
    assert "changed since" not in study.expected_times("quick", ["01_b"])
    nb.write_text("design 2: more prefixes")
    line = study.expected_times("quick", ["01_b"])
    assert "01 113 min computing its 166 runs (abcdef1, 2026-12-04) [its notebook has changed since: this time may not hold]" in line


def test_a_page_keeps_the_last_from_scratch_measurement_of_its_notebook():
    from stabstudy.run.report import from_scratch

    own = {"wall_s": 900.0, "cpu_s": 1700.0, "commit": "c2", "end": "e2", "runs_computed": 172, "runs_stored": 0}
    assert from_scratch(own, None) == {"wall_s": 900.0, "cpu_s": 1700.0, "commit": "c2", "end": "e2", "runs": 172}
    warm = own | {"wall_s": 60.0, "runs_computed": 0, "runs_stored": 172}
    assert from_scratch(warm, {"from_scratch": from_scratch(own, None)})["wall_s"] == 900.0
    assert from_scratch(warm, None) is None
    assert from_scratch(own | {"runs_computed": 10, "runs_stored": 162}, None) is None  # partly stored: neither


def test_runs_of_a_folder_that_does_not_exist_exits_2(tmp_path, capsys):
    missing = tmp_path / "nonexistent"
    assert main(["runs", "--data", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"stabstudy runs: error: no run store at {missing}" in err
    assert not missing.exists()  # looking did not create it


def test_a_notebook_that_fails_on_a_full_disk_ends_the_study_with_the_cause_not_a_traceback(
        tmp_store, tmp_path, monkeypatch, capsys):
    """The kernel's grid raises RunWriteError (tests/test_store.py); the terminal gets one line naming the
    notebook, the folder and the cause, and where the executed copy with the traceback is."""
    import nbformat
    import papermill

    from stabstudy.run.store import RunWriteError
    from stabstudy.spec import RunSpec

    src = tmp_path / "00_fake.ipynb"
    nbformat.write(nbformat.v4.new_notebook(), src)
    monkeypatch.setattr(study, "notebooks", lambda: [src])
    monkeypatch.setattr(study.paths, "build_dir", lambda: tmp_path / "build")
    s = RunSpec("toy", "gd", "digits", steps=3, seed=0, hparams={"width": 8})

    def fake_execute(input_path, output_path, **kw):  # the kernel, in this process
        from stabstudy.run import store

        try:
            raise store._write_error(OSError(28, "No space left on device"), s, tmp_store.root, 10**6)
        except RunWriteError as e:
            nbformat.write(nbformat.v4.new_notebook(), output_path)
            raise papermill.PapermillExecutionError(3, 2, "run_grid(specs)", "RunWriteError", str(e), ["..."]) from e

    monkeypatch.setattr(papermill, "execute_notebook", fake_execute)
    assert main(["study", "--profile", "smoke"]) == 1
    err = capsys.readouterr().err
    assert (f"stabstudy study: error: 00_fake failed: cell 4 raised RunWriteError: cannot store run {s.spec_hash} "
            f"in {tmp_store.root}: no space left on device") in err
    assert f"the executed copy with the traceback: {tmp_path / 'build' / 'smoke' / '00_fake.ipynb'}" in err
    assert "Traceback" not in err
