"""Notebook 05's claims over units: an RL prefix with forks at several doses is one unit, not several."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from stabstudy.analysis.studies import closed_loop as study
from stabstudy.analysis.studies import closed_loop_claims as loop_claims
from stabstudy.spec import Perturbation, RunSpec


def _out(damage_with, damage_without, collapse_with=None, collapse_without=None, doses=("x10", "x30")):
    """Perturbed PPO forks of prefixes p0, p1, ... (seed i = prefix i), one per dose, with and without z_skip."""
    rows = []
    n = len(damage_with)
    for i in range(n):
        for j, dose in enumerate(doses):
            for ctrl, dmg, col in (("z_skip", damage_with, collapse_with), ("none", damage_without, collapse_without)):
                rows.append({"domain": "ppo", "seed": i, "prefix": f"p{i}", "event": f"lr_spike {dose}/64",
                             "controller": ctrl, "damage": dmg[i][j], "collapse": 0.0 if col is None else col[i][j],
                             "interventions": 0, "n_steps": 100, "final": 1.0})
    for i in range(n):  # the unperturbed forks: selectivity and intrusiveness
        for ctrl in ("z_skip", "none"):
            rows.append({"domain": "ppo", "seed": i, "prefix": f"p{i}", "event": "none", "controller": ctrl,
                         "damage": 0.0, "collapse": 0.0, "interventions": 0, "n_steps": 100, "final": 1.0})
    return pd.DataFrame(rows)


def _claims(out, **plan):
    """The claims by their text up to the first parenthesis, without the domain: 'z_skip reduces damage on ppo'."""
    cl = loop_claims.claims(out, primary="z_skip", evaluation_seeds=sorted(out.seed.unique()),
                      plan=loop_claims.Plan(**{"margin": 0.05, **plan}), comparators=[])
    return {f"{c.claim.split(' (')[0].split(': ', 1)[1]} on {c.claim.split(':')[0]}": c for c in cl}


def test_two_doses_of_one_prefix_are_one_unit():
    out = _out([[0.1, 0.2]], [[0.5, 0.9]], [[0.0, 0.0]], [[1.0, 0.0]])
    pert = out[out.event != "none"]
    units = loop_claims.unit_pairs(pert[pert.controller == "z_skip"], pert[pert.controller == "none"])
    assert len(units) == 1 and units.forks.tolist() == [2]
    u = units.iloc[0]
    assert u.collapse_without == 1.0 and u.collapse_with == 0.0  # any of its forks
    assert u.damage_diff == pytest.approx(((0.1 - 0.5) + (0.2 - 0.9)) / 2)
    cl = _claims(out)
    damage = cl["z_skip reduces damage on ppo"]
    assert damage.n == 1 and damage.verdict == "inconclusive"  # 1 prefix, not 2 forks
    assert "1 units of 2 runs" in damage.reason
    assert cl["z_skip prevents collapse on ppo"].n == 1


def test_damage_over_prefixes_supported_not_supported_and_not_tested():
    less = _claims(_out([[0.1, 0.2]] * 6, [[0.5, 0.9]] * 6))["z_skip reduces damage on ppo"]
    assert less.verdict == "supported" and less.n == 6 and less.test == "Wilcoxon signed-rank"
    assert "design effect" in less.reason
    more = _claims(_out([[0.5, 0.9]] * 6, [[0.1, 0.2]] * 6))["z_skip reduces damage on ppo"]
    assert more.verdict == "not supported" and more.n == 6
    none = _claims(_out([[math.nan, math.nan]] * 6, [[0.1, 0.2]] * 6))["z_skip reduces damage on ppo"]
    assert none.verdict == "not tested" and none.n == 0


def test_a_prefix_with_a_fork_without_verdict_collapses_only_if_another_did():
    out = _out([[0.1, 0.2], [0.1, 0.2]], [[0.5, 0.9], [0.5, 0.9]], [[0.0, math.nan], [1.0, math.nan]],
               [[0.0, 0.0], [0.0, 0.0]])
    pert = out[out.event != "none"]
    units = loop_claims.unit_pairs(pert[pert.controller == "z_skip"], pert[pert.controller == "none"]).set_index("unit")
    assert math.isnan(units.loc["p0", "collapse_with"]) and units.loc["p1", "collapse_with"] == 1.0


def test_runs_from_scratch_stay_their_own_units():
    out = _out([[0.1]] * 3, [[0.5]] * 3, doses=("x10",)).assign(domain="toy", prefix="")
    cl = _claims(out)["z_skip reduces damage on toy"]
    assert cl.n == 3 and cl.test == "paired t-test" and "units of" not in cl.reason


def test_runs_from_scratch_of_one_seed_at_several_events_are_one_unit():
    """A GPT or toy seed's runs at two events share everything up to the event step: one unit each seed."""
    out = _out([[0.1, 0.2]] * 3, [[0.5, 0.9]] * 3).assign(domain="toy", prefix="")
    cl = _claims(out)["z_skip reduces damage on toy"]
    assert cl.n == 3 and "3 units of 6 runs" in cl.reason


def _fork(learner="ppo", dose=None, seed=0, **hp):
    pert = (Perturbation("lr_spike", 384, 64, dose=dose),) if dose else ()
    return RunSpec("rl", learner, "Pendulum-v1", 640, seed, hparams={"n_steps": 64, "prefix_steps": 256, **hp},
                   perturbations=pert, eval_every=64)


def test_forks_of_notebook_01s_grid_keep_the_arm_the_events_and_the_controls():
    hp = {"n_steps": 64, "eval_episodes": 1}
    grid = [_fork(seed=s, dose=d, eval_episodes=5) for s in (0, 1) for d in (None, 10.0, 30.0, 100.0)]
    tuned = [_fork(seed=0, dose=d, lr=2e-5) for d in (None, 10.0)]  # another arm of the same learner
    knob = [_fork(seed=0, dose=10.0, noise_after_fork=0.05)]
    got = study.forks_of(grid + tuned + knob, "ppo", [["lr_spike", 10.0], ["lr_spike", 30.0]], hp)
    assert sorted((s.seed, s.perturbations[0].dose if s.perturbations else 1.0) for s in got) == \
        [(0, 1.0), (0, 10.0), (0, 30.0), (1, 1.0), (1, 10.0), (1, 30.0)]
    with pytest.raises(ValueError, match=r"no ppo fork at \[\('lr_spike', 3.0\)\]"):
        study.forks_of(grid, "ppo", [["lr_spike", 3.0]], hp)
    with pytest.raises(ValueError, match="trains with"):
        study.forks_of(grid, "ppo", [["lr_spike", 10.0]], {"n_steps": 128})
    with pytest.raises(ValueError, match="no unperturbed fork"):
        study.forks_of([s for s in grid if s.perturbations or s.seed == 0], "ppo", [["lr_spike", 10.0]], hp)


def test_controlled_twins_continue_the_same_prefix():
    from stabstudy.learners.rl import forks

    free = [_fork(seed=0), _fork(seed=0, dose=10.0)]
    twins = study.with_controllers(free, ["z_skip", "clip1"], {"z": 7.0}, controller_hp={"controller_window": 8})
    assert [forks.prefix_key(t) for t in twins] == [forks.prefix_key(s) for s in free] * 2
    assert [t.hp.get("controller_threshold") for t in twins] == [7.0, 7.0, None, None]
    watch = study.watch_grid(free + twins, [0], window=8)
    assert len(watch) == 1 and watch[0].hp["controller_threshold"] == study.WATCH and not watch[0].perturbations
    table = study.run_table(free + twins, prefix_of={s.spec_hash: forks.prefix_key(s).spec_hash for s in free + twins})
    assert table.prefix.nunique() == 1 and set(table.fork_at) == {256}
    assert np.all(table.prefix != "")


def test_the_forks_come_from_notebook_01s_manifest(tmp_path, monkeypatch):
    from stabstudy.learners.rl import forks
    from stabstudy.run import grids

    monkeypatch.setenv("STABSTUDY_DATA", str(tmp_path / "data"))
    ran = [_fork(seed=s, dose=d) for s in (0, 1, 2) for d in (None, 10.0, 100.0)]
    assert grids.load_grid("01_rl_algorithm_comparison", "smoke") is None  # the notebook then builds its own
    grids.save_grid("01_rl_algorithm_comparison", "smoke", {"prefixes": forks.prefix_specs(ran), "lr_spike": ran})
    g = grids.load_grid("01_rl_algorithm_comparison", "smoke")
    free = study.forks_of(g.specs("lr_spike"), "ppo", [["lr_spike", 100.0]], {"n_steps": 64})
    assert len(free) == 6 and forks.prefix_specs(free) == g.specs("prefixes")
    twins = study.with_controllers(free, ["z_skip"], {"z": 6.0})
    assert forks.prefix_specs(twins) == g.specs("prefixes")  # the same three independent prefixes
