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
    with pytest.raises(ValueError, match="valid profiles: smoke, quick, paper"):
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
    monkeypatch.setattr(study, "run_study", lambda profile, only, scheduler: [("00_x", 1.0)])
    assert main(["study", "--profile", "smoke", "--only", "00"]) == 0
    out = capsys.readouterr().out
    assert f"figures in {tmp_path / 'figs'}/" in out and f"runs in {tmp_path / 'data' / 'runs'}/" in out
