"""ForkPlan: which forks run in which round, planned from synthetic outcome tables (no MuJoCo, no runs)."""

import dataclasses

import pandas as pd
import pytest

from stabstudy.analysis.studies.rl import design
from stabstudy.analysis.studies.rl.plan import ForkPlan
from stabstudy.learners.rl import forks

TINY = {"ppo": dict(hidden=16, n_steps=64, batch_size=32, n_epochs=2, eval_episodes=1, eval_max_steps=50),
        "sac": dict(hidden=16, batch_size=32, learning_starts=50, eval_episodes=1, eval_max_steps=50)}
H = {"return-matched": {"ppo": 640, "sac": 500}}


def _design(**kw):
    base = dict(algos=("ppo", "sac"), seeds=(0, 1), subset_seeds=(0,), prefix_steps={"ppo": 256, "sac": 200},
                fork_lead={"ppo": 128, "sac": 40}, fork_post={"ppo": 128, "sac": 60},
                fork_eval_every={"ppo": 64, "sac": 20}, claim_dose=10.0, lr_doses=(3.0, 10.0, 30.0),
                task="Pendulum-v1", action_noise_doses=(1.0,), spike_updates=20, env_pert_duration=64)
    return design.ForkDesign.from_parameters({**base, **kw})


def _plan(**kw):
    d = _design(**kw)
    prefixes = list(dict.fromkeys(p for v in d.prefix_forks(TINY).values() for p in forks.prefix_specs(v)))
    horizon = {r: {"ppo": 640, "sac": 500} for r in d.regimes()}
    return ForkPlan.of(d, TINY, horizon, prefixes)


def _outcomes(plan, dropped=(), collapsed=None):
    """A judge-like table for every fork of ``plan``: ``dropped`` (spec hashes) dropped in their window;
    ``collapsed(row) -> 0/1`` the verdict of the others (default 0)."""
    rows = []
    for f in plan.rows:
        if not f.spec.perturbations:
            continue
        p = f.spec.perturbations[0]
        h = f.spec.spec_hash
        c = (collapsed or (lambda f: 0.0))(f)
        rows.append({"regime": f.regime, "spec_hash": h, "learner": f.arm, "prefix": f.prefix, "pert_kind": p.kind,
                     "pert_dose": p.dose, "noise_after_fork": "same", "dropped": h in dropped,
                     "state": "no_verdict" if h in dropped else ("collapsed" if c else "no_drop"),
                     "collapsed": float("nan") if h in dropped else c, "damage": -c, "recovery_time": float("nan")})
    return pd.DataFrame(rows)


def test_the_first_round_is_every_grid_with_roles_and_prefixes():
    plan = _plan().first_round()
    assert plan.stage == "grids" and plan.round == 1 and plan.new == plan.specs
    t = plan.table()
    assert set(t.role) == {"control", "to H", "short"}
    assert (t[t.role == "control"].kind == "none").all()
    assert set(t[t.role == "to H"].dose) == {10.0}  # the claim's dose runs to H
    assert set(t[t.role == "short"].group) == {"lr_spike short", "action_noise"}
    assert set(t[t.judged_over == "H"].role) == {"control", "to H"}
    # every fork names the prefix it continues, that prefix's seed and arm
    for f in plan.rows:
        p = plan.prefixes[f.prefix]
        assert (p.seed, p.steps, plan.prefix_arms[f.prefix]) == (f.spec.seed, f.spec.hp["prefix_steps"], f.arm)
        assert forks.prefix_key(f.spec).spec_hash == f.prefix
    with pytest.raises(ValueError, match="planned already"):
        plan.first_round()
    with pytest.raises(ValueError, match="first round first"):
        _plan().next_round(pd.DataFrame())
    with pytest.raises(ValueError, match="no horizon for regime"):
        ForkPlan.of(_design(), TINY, {}, [])


def test_a_short_fork_that_dropped_runs_on_to_h_and_replaces_itself_in_the_final_grid():
    plan = _plan().first_round()
    t = plan.table()
    spike = t[(t.role == "short") & (t.kind == "lr_spike")].spec_hash.iloc[0]
    noise = t[(t.role == "short") & (t.kind == "action_noise")].spec_hash.iloc[0]  # not an extend_kind
    nxt = plan.next_round(_outcomes(plan, dropped={spike, noise}))
    assert nxt.stage == "extensions" and nxt.round == 2
    (ext,) = [f for f in nxt.rows if f.round == 2]
    short = next(f for f in plan.rows if f.spec.spec_hash == spike)
    assert ext.role == "extension" and ext.replaces == spike and ext.judged_over == "H"
    assert ext.spec == design.to_horizon(short.spec, H["return-matched"][short.arm]) and nxt.new == [ext.spec]
    final = nxt.final()["return-matched"]
    assert ext.spec in final["lr_spike short"] and short.spec not in final["lr_spike short"]
    assert ext.spec.spec_hash in nxt.long and spike not in nxt.long
    # pure: the same plan and outcomes give the same next round, and the plan it came from is unchanged
    assert plan.next_round(_outcomes(plan, dropped={spike, noise})) == nxt and plan.stage == "grids"
    # nothing more without bisections
    done = nxt.next_round(_outcomes(nxt))
    assert done.stage == "done" and done.new == [] and done.rows == nxt.rows


def test_a_round_without_forks_is_skipped_and_bisection_forks_bracket_each_prefix():
    plan = _plan(bisections=1).first_round()
    # the prefix of SAC seed 0 collapses at 10 and above; every other prefix never does
    sac0 = next(f.prefix for f in plan.rows if f.arm == "sac" and f.spec.seed == 0)

    def collapsed(f):
        return float(f.prefix == sac0 and f.spec.perturbations[0].kind == "lr_spike" and f.spec.perturbations[0].dose >= 10)

    nxt = plan.next_round(_outcomes(plan, collapsed=collapsed))  # nothing dropped: straight to the bisection
    assert nxt.stage == "bisection" and nxt.round == 2
    new = [f for f in nxt.rows if f.round == 2]
    assert [(f.arm, f.prefix, f.spec.perturbations[0].dose, f.group, f.role) for f in new] == \
        [("sac", sac0, design.geometric_points(3.0, 10.0)[0], "lr_spike bisection", "short")]
    # the bisection fork dropped: it runs on to H, then nothing is left
    ext = nxt.next_round(_outcomes(nxt, dropped={new[0].spec.spec_hash}, collapsed=collapsed))
    assert ext.stage == "bisection extensions" and [f.replaces for f in ext.rows if f.round == 3] == [new[0].spec.spec_hash]
    assert ext.final()["return-matched"]["lr_spike bisection"] == [ext.rows[-1].spec]
    assert ext.next_round(_outcomes(ext, collapsed=collapsed)).stage == "done"


def test_a_fork_shared_by_two_regimes_is_planned_once_per_regime_and_run_once():
    plan = _plan(long_prefix_steps={"sac": 400}).first_round()
    t = plan.table()
    assert set(t.regime) == {"return-matched", "long prefixes"}
    shared = t.groupby("spec_hash").regime.nunique()
    assert (shared > 1).any()  # PPO's prefixes are the same in both regimes
    assert len(plan.new) == t.spec_hash.nunique()
    assert not (t[t.regime == "long prefixes"].group.isin(["action_noise"])).any()  # lr grids only there
    assert dataclasses.replace(plan) == plan
