"""Shared fixtures: every test writes runs and figures into temporary folders."""

from __future__ import annotations

import os

import pytest

# One torch thread per test process: CI has 2 cores and the tests also start Dask workers.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def tmp_store(tmp_path, monkeypatch):
    """A RunStore in a temporary folder; STABSTUDY_DATA/FIGURES point there too."""
    from stabstudy.run.store import RunStore

    monkeypatch.setenv("STABSTUDY_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("STABSTUDY_FIGURES", str(tmp_path / "figures"))
    return RunStore(tmp_path / "data" / "runs")


#: Holds the lock of run ``argv[2]`` in store ``argv[1]`` until killed (a writer that crashes).
_HOLD_LOCK = """
import sys, time
from stabstudy.run.store import RunStore
assert RunStore(sys.argv[1]).claim(sys.argv[2])
print("locked", flush=True)
time.sleep(600)
"""


@pytest.fixture
def hold_lock():
    """``hold_lock(root, spec_hash)``: another process holding that run's lock in the store at
    ``root`` (SIGKILL it to crash it); any still running are killed after the test."""
    import subprocess
    import sys

    procs = []

    def start(root, h):
        proc = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(root), h], stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        assert proc.stdout.readline().strip() == "locked"
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
