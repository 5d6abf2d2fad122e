"""Grid manifests: a notebook records the specs it ran, by role; another reads them back, or learns that
they are absent, damaged or stale."""

from __future__ import annotations

import json
import os

import pytest

from stabstudy.run import grids
from stabstudy.spec import Perturbation, RunSpec

NB = "01_rl_algorithm_comparison"


@pytest.fixture(autouse=True)
def _data(tmp_path, monkeypatch):
    monkeypatch.setenv("STABSTUDY_DATA", str(tmp_path / "data"))


def _specs():
    pre = RunSpec("toy", "adam", "digits", 100, 0, hparams={"lr": 0.01})
    ctrl = RunSpec("toy", "adam", "digits", 200, 0, hparams={"lr": 0.01})
    spike = ctrl.replace(perturbations=(Perturbation("lr_spike", 150, 5, 30.0),))
    ramp = ctrl.replace(perturbations=(Perturbation("lr_ramp", 150, 20, 10.0),))
    return {"prefixes": [pre], "lr_spike": [ctrl, spike], "lr_ramp": [ramp]}


def test_round_trip_keeps_groups_roles_order_and_meta(tmp_path):
    groups = _specs()
    path = grids.save_grid(NB, "quick", groups, meta={"collapse_frac": 0.5, "algos": ["ppo", "sac"]})
    assert path == tmp_path / "data" / "grids" / f"{NB}.quick.json"
    g = grids.load_grid(NB, "quick")
    assert g.groups == groups and g.meta == {"collapse_frac": 0.5, "algos": ["ppo", "sac"]}
    assert [s.spec_hash for s in g.specs("lr_spike", "lr_ramp")] == [s.spec_hash for s in groups["lr_spike"] + groups["lr_ramp"]]
    assert g.roles(groups["lr_spike"][1]) == ["lr_spike"] and g.roles(groups["prefixes"][0].spec_hash) == ["prefixes"]
    assert len(g.specs()) == 4 and g.git_commit and g.created_utc
    with pytest.raises(KeyError, match="recorded: prefixes, lr_spike, lr_ramp"):
        g.specs("noise")
    # profiles are kept apart; a notebook that has not run at a profile has no manifest there
    assert grids.load_grid(NB, "paper") is None
    assert grids.load_grid("02_nanogpt_spike_studies", "quick") is None


def test_save_replaces_atomically_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    grids.save_grid(NB, "quick", _specs())
    first = grids.load_grid(NB, "quick")

    def crash(src, dst):
        raise OSError("disk full")

    with monkeypatch.context() as m, pytest.raises(OSError, match="disk full"):
        m.setattr(os, "replace", crash)
        grids.save_grid(NB, "quick", {"prefixes": _specs()["prefixes"]})
    folder = tmp_path / "data" / "grids"
    assert [p.name for p in folder.iterdir()] == [f"{NB}.quick.json"]  # the temporary file is gone
    assert grids.load_grid(NB, "quick").groups == first.groups  # the old manifest is whole
    grids.save_grid(NB, "quick", {"prefixes": _specs()["prefixes"]})
    assert list(grids.load_grid(NB, "quick").groups) == ["prefixes"]


@pytest.mark.parametrize("damage", ["truncate", "edit", "stale_hash", "format"])
def test_a_damaged_or_stale_manifest_is_refused_with_the_remedy(damage):
    path = grids.save_grid(NB, "quick", _specs())
    text = path.read_text()
    if damage == "truncate":
        path.write_text(text[: len(text) // 2])
    else:
        doc = json.loads(text)
        if damage == "edit":
            doc["meta"]["collapse_frac"] = 0.9
        elif damage == "stale_hash":  # a spec that hashes differently under this code, checksum recomputed
            doc["groups"][1]["specs"][0]["spec_hash"] = "0" * 16
            doc["sha256"] = grids._digest({k: v for k, v in doc.items() if k != "sha256"})
        else:
            doc["format"] = 99
            doc["sha256"] = grids._digest({k: v for k, v in doc.items() if k != "sha256"})
        path.write_text(json.dumps(doc))
    match = {"truncate": "unreadable", "edit": "checksum", "stale_hash": "stale", "format": "format 99"}[damage]
    with pytest.raises(grids.CorruptGridError, match=match) as e:
        grids.load_grid(NB, "quick")
    assert str(path) in str(e.value) and f"run notebook {NB} at profile 'quick' again" in str(e.value)


def test_bad_input_names_the_valid_choices():
    from stabstudy.run.study import PROFILES

    with pytest.raises(ValueError, match="valid profiles: " + ", ".join(PROFILES)):
        grids.save_grid(NB, "fast", _specs())
    with pytest.raises(ValueError, match="valid profiles"):
        grids.load_grid(NB, "fast")
    with pytest.raises(ValueError, match="file stem"):
        grids.grid_path("../x", "quick")
    with pytest.raises(ValueError, match="not RunSpec"):
        grids.save_grid(NB, "quick", {"a": ["abc"]})
    with pytest.raises(ValueError, match="JSON literals"):
        grids.save_grid(NB, "quick", _specs(), meta={"x": float("nan")})
    with pytest.raises(ValueError, match="at least one group"):
        grids.save_grid(NB, "quick", {})
