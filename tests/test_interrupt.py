"""Ctrl-C stops `stabstudy study`: the kernel's grid cancels its pending runs and drops those in flight,
no later cell or notebook starts, the executed copy is marked interrupted, and the command exits 130."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import nbformat
import pytest

#: The slow notebook's grid: toy runs of about a second each, one Dask worker, far more runs
#: than can finish between the first stored one and the interrupt.
RUNS, STEPS = 20, 500

SLOW = f"""
import os
from pathlib import Path
from stabstudy.run.runner import get_client, run_grid
from stabstudy.spec import RunSpec
data = Path(os.environ["STABSTUDY_DATA"])
workers = list(get_client(None, 1).run(os.getpid).values())
(data / "pids.json").write_text(__import__("json").dumps([os.getpid(), *workers]))
specs = [RunSpec("toy", "gd", "digits", steps={STEPS}, seed=s, hparams={{"width": 8}}) for s in range({RUNS})]
run_grid(specs, scheduler=scheduler or None, n_workers=1, retry_failed=retry_failed)
"""


def _project(root):
    """A project root holding two notebooks: 00 runs the slow grid, 01 must never start."""
    (root / "notebooks").mkdir(parents=True)
    for stem, body in (("00_slow", SLOW), ("01_after", "open('AFTER', 'w').close()")):
        nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "language": "python",
                                                               "display_name": "Python 3"}})
        nb.cells = [nbformat.v4.new_code_cell('profile = "smoke"\nscheduler = ""\nretry_failed = False',
                                              metadata={"tags": ["parameters"]}),
                    nbformat.v4.new_code_cell(body),
                    nbformat.v4.new_code_cell("open('AFTER', 'w').close()")]
        nbformat.write(nb, root / "notebooks" / f"{stem}.ipynb")


def _gone(pids, within_s=60.0):
    import psutil

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return []
        time.sleep(0.5)
    return alive


@pytest.mark.notebook
def test_ctrl_c_stops_the_study_and_marks_the_notebook_interrupted(tmp_path):
    from stabstudy.run import report
    from stabstudy.run.store import RunStore

    root, data = tmp_path / "project", tmp_path / "data"
    _project(root)
    data.mkdir()
    env = {**os.environ, "STABSTUDY_ROOT": str(root), "STABSTUDY_DATA": str(data),
           "STABSTUDY_FIGURES": str(tmp_path / "figures"), "OMP_NUM_THREADS": "1"}
    env.pop("STABSTUDY_SCHEDULER", None)
    # its own process group, as a terminal starts a command: Ctrl-C is a SIGINT to that whole group
    proc = subprocess.Popen([sys.executable, "-m", "stabstudy", "study", "--profile", "smoke"], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    runs = data / "runs"
    try:
        while not list(runs.glob("*.nc")):  # the first run stored
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, (out, err)
    assert "stabstudy study: interrupted in 00_slow" in err and "resumes" in err, err
    # the kernel and its Dask worker are gone, not computing on unseen
    assert _gone(json.loads((data / "pids.json").read_text())) == []
    stored = sorted(runs.glob("*.nc"))
    assert 1 <= len(stored) < RUNS  # the pending runs were cancelled
    assert not list(runs.glob(".*.tmp"))  # nothing half-written; every stored run whole
    store = RunStore(runs)
    assert all(store.status(p.stem) == "ok" for p in stored)
    assert not (root / "AFTER").exists()  # no later cell, no later notebook
    assert not (root / "build" / "smoke" / "01_after.ipynb").exists()
    executed = nbformat.read(root / "build" / "smoke" / "00_slow.ipynb", as_version=4)
    assert executed.metadata["stabstudy"]["interrupted"] is True
    assert "interrupted" in report.unfinished(executed)


#: A cell that sends Ctrl-C to the study (its kernel's parent) and returns once the study has passed it
#: on, having caught it itself: the kernel is then idle when the signal has come, between two cells.
BETWEEN = """
import os, signal, threading
passed_on = threading.Event()
signal.signal(signal.SIGINT, lambda *a: passed_on.set())
os.kill(os.getppid(), signal.SIGINT)
assert passed_on.wait(120)
"""


@pytest.mark.notebook
def test_ctrl_c_between_two_cells_starts_no_further_cell(tmp_path, monkeypatch):
    from stabstudy.run import study

    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "language": "python",
                                                           "display_name": "Python 3"}})
    nb.cells = [nbformat.v4.new_code_cell('profile = "smoke"\nscheduler = ""\nretry_failed = False',
                                          metadata={"tags": ["parameters"]}),
                nbformat.v4.new_code_cell(BETWEEN), nbformat.v4.new_code_cell(f"open({str(tmp_path / 'AFTER')!r}, 'w')")]
    src = tmp_path / "00_between.ipynb"
    nbformat.write(nb, src)
    monkeypatch.setattr(study, "notebooks", lambda: [src])
    with pytest.raises(study.StudyInterrupted) as exc:
        study.run_study("smoke", out_dir=tmp_path / "build")
    assert exc.value.notebook == "00_between" and exc.value.executed == tmp_path / "build" / src.name
    assert not (tmp_path / "AFTER").exists()
    executed = nbformat.read(tmp_path / "build" / src.name, as_version=4)
    assert executed.metadata["stabstudy"]["interrupted"] is True
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the study gave Ctrl-C back
