"""ForkPlan: which forks run in which round, planned from synthetic outcome tables (no MuJoCo, no runs)."""

import pandas as pd
import pytest

from stabstudy.analysis.studies.rl import design
from stabstudy.analysis.studies.rl.plan import ForkPlan

TINY = {"ppo": dict(hidden=16, n_steps=64, batch_size=32, n_epochs=2, eval_episodes=1, eval_max_steps=50),
        "sac": dict(hidden=16, batch_size=32, learning_starts=50, eval_episodes=1, eval_max_steps=50)}
PREFIXES = pd.DataFrame([{"spec_hash": f"{a}{s}", "arm": a, "seed": s, "steps": n}
                         for a, n in (("ppo", 256), ("sac", 200)) for s in (0, 1, 2)])


def _design(**kw):
    base = dict(algos=("ppo", "sac"), seeds=(0, 1, 2), subset_seeds=(0,), target_return=-300.0,
                prefix_cap={"ppo": 1024, "sac": 600}, prefix_eval_every={"ppo": 64, "sac": 40},
                horizon={"ppo": 640, "sac": 500}, fork_lead={"ppo": 128, "sac": 40}, fork_post={"ppo": 128, "sac": 60},
                fork_eval_every={"ppo": 64, "sac": 20}, claim_dose=10.0, task="Pendulum-v1",
                env_doses={"action_noise": 1.0}, spike_updates=20, env_pert_duration=64)
    return design.ForkDesign.from_parameters({**base, **kw})


def _plan(**kw):
    return ForkPlan.of(_design(**kw), TINY, PREFIXES)


def _outcomes(plan, dropped=(), collapsed=lambda f: 0.0):
    """A judge-like table for every perturbed fork of ``plan``: ``dropped`` (spec hashes) dropped in their
    window; ``collapsed(fork)``: the verdict of the others."""
    rows = []
    for f in plan.rows:
        if f.spec.perturbations:
            h, c = f.spec.spec_hash, collapsed(f)
            rows.append({"spec_hash": h, "dropped": h in dropped, "collapsed": float("nan") if h in dropped else c})
    return pd.DataFrame(rows)


def test_the_first_round_forks_every_prefix_where_it_stopped():
    plan = _plan().first_round()
    assert plan.stage == "first" and plan.round == 1 and plan.new == plan.specs
    t = plan.table()
    assert set(t.role) == {"control", "short"} and (t[t.role == "control"].kind == "none").all()
    assert set(t[t.group == "lr_spike"].dose) == {10.0} and (t[t.group == "lr_spike"].step == 0).all()
    assert set(t[t.group == "action_noise"].seed) == {0}  # the subset seeds only
    assert set(t[t.role == "control"].judged_over) == {"H"} and set(t[t.role == "short"].judged_over) == {"short window"}
    for f in plan.rows:  # each fork starts where its own prefix stopped, and names it
        p = PREFIXES.set_index("spec_hash").loc[f.prefix]
        assert (p.arm, p.seed, p.steps) == (f.arm, f.spec.seed, f.spec.hp["prefix_steps"])
    with pytest.raises(ValueError, match="planned already"):
        plan.first_round()
    with pytest.raises(ValueError, match="first round first"):
        _plan().next_round(pd.DataFrame())
    with pytest.raises(ValueError, match="columns arm"):
        ForkPlan.of(_design(), TINY, PREFIXES.drop(columns="arm"))


def test_a_short_fork_that_dropped_runs_on_to_h_and_replaces_itself_in_the_final_forks():
    plan = _plan().first_round()
    t = plan.table()
    spike = t[(t.group == "lr_spike") & (t.arm == "ppo")].spec_hash.iloc[0]
    noise = t[t.group == "action_noise"].spec_hash.iloc[0]  # not an extend_kind: no verdict, not run on
    nxt = plan.next_round(_outcomes(plan, dropped={spike, noise}))
    assert nxt.stage == "extensions" and nxt.round == 2
    (ext,) = [f for f in nxt.rows if f.round == 2]
    short = next(f for f in plan.rows if f.spec.spec_hash == spike)
    assert ext.role == "extension" and ext.replaces == spike and ext.judged_over == "H" and ext.step == 0
    assert ext.spec == design.to_horizon(short.spec, 640) and nxt.new == [ext.spec]
    final = nxt.final()
    assert ext.spec in final["lr_spike"] and short.spec not in final["lr_spike"]
    assert ext.spec.spec_hash in nxt.long and spike not in nxt.long
    # pure: the same plan and outcomes give the same next round, and the plan it came from is unchanged
    assert plan.next_round(_outcomes(plan, dropped={spike, noise})) == nxt and plan.stage == "first"


def test_each_prefix_gets_its_next_dose_from_its_last_verdict_and_never_one_above_a_collapse():
    # ppo seed 0 collapses at 10 and above, every other prefix at 50 and above
    def collapsed(f):
        p = f.spec.perturbations[0]
        return float(p.kind == "lr_spike" and p.dose >= (10 if f.prefix == "ppo0" else 50))

    plan = _plan().first_round()
    rounds = [plan]
    while plan.stage != "done":
        plan = plan.next_round(_outcomes(plan, collapsed=collapsed))
        rounds.append(plan)
    # nothing dropped in a window here: no extension round; two dose rounds
    assert [r.stage for r in rounds] == ["first", "dose", "dose", "done"] and plan.new == []
    doses = plan.table().query("group == 'lr_spike'").groupby("prefix").dose.apply(list).to_dict()
    assert doses["ppo0"] == [10.0, 3.16, 5.62]  # collapsed at 10, survived 3.16: bracket (5.62, 10] next
    assert doses["ppo1"] == doses["sac0"] == [10.0, 31.6, 56.2]  # survived 10 and 31.6, collapsed at 56.2
    for prefix, ds in doses.items():  # no dose at or above one the prefix collapsed at
        threshold = 10 if prefix == "ppo0" else 50
        assert all(d < c for i, d in enumerate(ds) for c in ds[:i] if c >= threshold)


def test_a_prefix_without_a_verdict_gets_no_further_dose_and_a_dropped_dose_fork_runs_on_to_h():
    plan = _plan().first_round()
    nv = {f.spec.spec_hash for f in plan.rows if f.prefix == "sac1" and f.group == "lr_spike"}
    nxt = plan.next_round(_outcomes(plan, dropped=nv).assign(collapsed=lambda d: d.collapsed))  # dropped: no verdict
    # the dropped x10 fork of sac1 ran on to H first
    assert nxt.stage == "extensions" and [f.prefix for f in nxt.rows if f.round == 2] == ["sac1"]
    ext = nxt.rows[-1].spec.spec_hash
    nv_out = _outcomes(nxt).assign(collapsed=lambda d: d.collapsed.where(d.spec_hash != ext))  # still no verdict over H
    dose = nxt.next_round(nv_out)
    assert dose.stage == "dose" and "sac1" not in {f.prefix for f in dose.rows if f.round == 3}
    assert len([f for f in dose.rows if f.round == 3]) == len(PREFIXES) - 1


def test_a_short_window_as_long_as_h_is_judged_over_h():
    plan = _plan(horizon={"ppo": 640, "sac": 1}).first_round()  # SAC's H: no longer than its short window
    sac = {f.spec.spec_hash for f in plan.rows if f.arm == "sac" and f.role == "short" and f.group == "lr_spike"}
    assert sac and sac <= plan.long
    nxt = plan.next_round(_outcomes(plan, dropped=sac))  # a drop there needs no run on to H: it ran that long
    assert not [f for f in nxt.rows if f.role == "extension" and f.arm == "sac"]
