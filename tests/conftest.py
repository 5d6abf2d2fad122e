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
