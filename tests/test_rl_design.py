"""Notebook 01's grids: forks to H and short, the drop rule that runs a short fork on to H, arms,
the claim as stated, and the design's cost."""

import numpy as np
import pandas as pd
import pytest
import xarray as xr

from stabstudy.analysis.studies.rl import cost, curves, design, outcomes
from stabstudy.registry import arm_learner
from stabstudy.spec import RunSpec

TINY = {"ppo": dict(hidden=16, n_steps=64, batch_size=32, n_epochs=2, eval_episodes=1, eval_max_steps=50),
        "ppo-tuned": dict(hidden=16, n_steps=32, batch_size=32, n_epochs=2, eval_episodes=1, eval_max_steps=50, lr=2e-5),
        "sac": dict(hidden=16, batch_size=32, learning_starts=50, eval_episodes=1, eval_max_steps=50, diag_every=5)}
PREFIX = {"ppo": 256, "ppo-tuned": 256, "sac": 200}
KW = dict(task="Pendulum-v1", hparams=TINY, lead={"ppo": 128, "ppo-tuned": 128, "sac": 40}, spike_updates=20,
          env_duration=64, eval_every={"ppo": 64, "ppo-tuned": 64, "sac": 20})


def test_an_arm_names_its_learner_and_a_bad_one_names_the_valid_learners():
    assert arm_learner("ppo") == "ppo" and arm_learner("ppo-tuned") == "ppo"
    with pytest.raises(ValueError, match="valid learners: ppo, sac"):
        arm_learner("pop-tuned")


def test_forks_to_h_end_at_event_plus_h_and_short_forks_after_their_window():
    to_h = design.fork_grid(["ppo", "sac"], [("none", 1.0), ("lr_spike", 10.0)], [0], PREFIX, horizon={"ppo": 640, "sac": 500},
                           **KW)
    short = design.fork_grid(["ppo", "sac"], [("lr_spike", 30.0)], [0], PREFIX, post={"ppo": 128, "sac": 60}, **KW)
    steps = {(s.learner, bool(s.perturbations)): s.steps for s in to_h}
    assert steps == {("ppo", False): 256 + 128 + 640, ("ppo", True): 1024, ("sac", False): 740, ("sac", True): 740}
    # the short window: the longer of the spike (one rollout; 20 SAC updates) and env_duration, then post
    assert {s.learner: s.steps for s in short} == {"ppo": 384 + 64 + 128, "sac": 240 + 64 + 60}
    with pytest.raises(ValueError, match="exactly one of post"):
        design.fork_grid(["ppo"], [("none", 1.0)], [0], PREFIX, **KW)
    # a horizon shorter than the window still covers the window
    assert design.fork_grid(["sac"], [("none", 1.0)], [0], PREFIX, horizon={"sac": 10}, **KW)[0].steps == 240 + 64


def test_to_horizon_runs_a_short_fork_on_and_refuses_a_control():
    short = design.fork_grid(["ppo"], [("none", 1.0), ("lr_spike", 30.0)], [0], PREFIX, post={"ppo": 128}, **KW)
    ctrl, spiked = sorted(short, key=lambda s: bool(s.perturbations))
    long = design.to_horizon(spiked, 600)
    assert long.steps == 384 + 640 and long.perturbations == spiked.perturbations and long.hp == spiked.hp
    assert long.seed == spiked.seed and long.eval_every == spiked.eval_every
    assert design.to_horizon(spiked, 10) == spiked  # already as long
    with pytest.raises(ValueError, match="control fork has no event"):
        design.to_horizon(ctrl, 600)


def test_a_tuned_variant_is_its_own_arm_with_its_own_prefixes_and_pairs():
    specs = design.fork_grid(["ppo", "ppo-tuned"], [("none", 1.0)], [0], PREFIX, post={"ppo": 128, "ppo-tuned": 128}, **KW)
    assert {s.learner for s in specs} == {"ppo"} and len(specs) == 2
    arms = design.arms_of(specs, TINY)
    assert sorted(arms.values()) == ["ppo", "ppo-tuned"]
    ds = xr.Dataset(coords={"run": [s.spec_hash for s in specs], "learner": ("run", ["ppo", "ppo"])})
    assert sorted(design.with_arms(ds, arms).learner.values) == ["ppo", "ppo-tuned"]
    with pytest.raises(ValueError, match="no arm"):
        design.arms_of(specs, {"ppo": TINY["ppo"]})


def _design(**kw):
    base = dict(algos=("ppo", "sac", "ppo-tuned"), seeds=(0, 1, 2), subset_seeds=(0,), subset_arms=("ppo-tuned",),
                target_return=-300.0, prefix_cap={"ppo": 512, "ppo-tuned": 512, "sac": 400},
                prefix_eval_every={"ppo": 64, "ppo-tuned": 32, "sac": 40}, horizon={"ppo": 600, "ppo-tuned": 600, "sac": 77},
                fork_lead=KW["lead"], fork_post={"ppo": 128, "ppo-tuned": 128, "sac": 60},
                fork_eval_every=KW["eval_every"], claim_dose=10.0, task="Pendulum-v1", lr_ramp_doses=(30.0,),
                env_doses={"action_noise": 1.0}, noise_levels={"sac": (-1.0, 0.0)}, noise_lead={"sac": 100},
                spike_updates=20, env_pert_duration=64)
    return design.ForkDesign.from_parameters({**base, **kw})


def test_h_is_rounded_to_the_fork_unit_and_never_shorter_than_a_short_forks_window():
    d = _design()
    assert d.h("ppo", TINY["ppo"]) == 640 and d.lag("ppo", TINY["ppo"]) == 160.0
    # SAC's 77 is shorter than its short window (the spike's 64 env steps and 60 after them)
    assert d.h("sac", TINY["sac"]) == d.window("sac", TINY["sac"]) == 124
    assert d.no_gain == 0.0
    with pytest.raises(ValueError, match="needs the parameters seeds, target_return"):
        design.ForkDesign.from_parameters({"algos": ["ppo"]})


def test_each_prefix_trains_to_the_target_and_its_forks_start_where_it_stopped():
    d = _design()
    m = d.match_specs(TINY)
    assert {(s.learner, s.seed, s.steps, s.eval_every) for s in m if s.learner == "sac"} == {
        ("sac", 0, 400, 40), ("sac", 1, 400, 40), ("sac", 2, 400, 40)}
    assert all(s.hp["match_return"] == -300.0 and "prefix_steps" not in s.hp for s in m)
    assert len(m) == 3 + 3 + 1  # ppo-tuned on the subset seeds
    prefix = {"ppo": {0: 256, 1: 320, 2: 512}, "sac": {0: 120, 1: 200}, "ppo-tuned": {0: 96}}  # sac seed 2: not forked
    g = d.first_forks(TINY, prefix)
    assert {(s.learner, s.seed, s.hp["prefix_steps"]) for s in g["control"] if s.learner == "sac"} == {
        ("sac", 0, 120), ("sac", 1, 200)}
    arms = design.arms_of(g["control"], TINY)
    ctrl = {(arms[s.spec_hash], s.seed): s for s in g["control"]}
    assert ctrl[("ppo-tuned", 0)].hp["prefix_steps"] == 96
    assert ctrl[("ppo", 0)].steps == 256 + 128 + 640 and not ctrl[("ppo", 0)].perturbations
    spikes = g["lr_spike"]
    assert {s.perturbations[0].dose for s in spikes} == {10.0}
    assert all(s.steps == s.perturbations[0].start + d.window(s.learner, TINY[s.learner]) for s in spikes
               if s.learner == "sac")
    assert {s.seed for s in g["action_noise"]} == {0} and {s.perturbations[0].kind for s in g["lr_ramp"]} == {"lr_ramp"}
    # the noise grid: the knob set noise_lead before the spike, each level its own control, apart from the main grid
    noise = g["noise"]
    assert {s.get("noise_after_fork") for s in noise} == {-1.0, 0.0}
    assert {s.perturbations[0].start for s in noise if s.perturbations} == {120 + 100}
    assert not set(noise) & set(g["control"])


def test_a_prefixs_doses_step_down_after_a_collapse_and_up_after_none():
    d = _design()
    assert d.next_dose(10.0, 0, collapsed=True) == 3.16 and d.next_dose(10.0, 0, collapsed=False) == 31.6
    assert d.next_dose(3.16, 1, collapsed=False) == 5.62 and d.next_dose(31.6, 1, collapsed=True) == 17.8
    assert d.next_dose(5.62, 2, collapsed=True) is None  # two steps: three doses per prefix


def test_the_claim_as_stated_reads_each_spiked_run_against_the_unperturbed_run_of_its_seed():
    d = _design(stated_steps={"ppo": 512, "sac": 400}, stated_at=64, stated_update=20,
                stated_hparams={"sac": {"learning_starts": 30}})
    specs, dropped = d.stated(TINY)
    spiked = [s for s in specs if s.perturbations]
    assert {s.learner for s in spiked} == {"ppo", "sac"} and len(spiked) == 6  # the variant is not the claim's
    assert all(s.perturbations[0].start == 64 and s.perturbations[0].dose == 10.0 for s in spiked)
    controls = {(s.learner, s.seed): s for s in specs if not s.perturbations}
    match = d.match_specs(TINY)
    arms = design.arms_of(match, TINY)
    ppo_prefix = {s.seed: s for s in match if arms[s.spec_hash] == "ppo"}
    for s in spiked:
        c = controls[(s.learner, s.seed)]
        assert c.eval_every == s.eval_every
        if s.learner == "ppo":  # trains as its prefix does: the prefix is its control, not run twice
            assert c == ppo_prefix[s.seed]
        else:  # its own learning_starts: an unperturbed fresh run of its own, the spiked run's twin
            assert c == s.replace(perturbations=()) and s.hp["learning_starts"] == 30


# -- the drop rule and the outcomes over what each fork ran -------------------------------------


def _runs(curves):
    """A load_runs-like Dataset and summarize-like table of {hash: (steps, returns, dose, status)}."""
    n = max(len(c[0]) for c in curves.values())
    perf = np.full((len(curves), n), np.nan)
    env = np.full((len(curves), n), np.nan)
    rows = []
    for i, (h, (steps, vals, dose, status)) in enumerate(curves.items()):
        perf[i, :len(vals)], env[i, :len(steps)] = vals, steps
        rows.append({"spec_hash": h, "learner": "ppo", "seed": 0, "prefix_steps": 1000, "noise_after_fork": "same",
                     "pert_kind": "none" if dose is None else "lr_spike", "pert_dose": dose or 1.0,
                     "pert_start": np.nan if dose is None else 2000.0, "status": status})
    ds = xr.Dataset({"perf": (("run", "step"), perf)},
                    coords={"run": list(curves), "env_step": (("run", "step"), env), "learner": ("run", ["ppo"] * len(curves))})
    return ds, pd.DataFrame(rows)


STEPS = np.arange(1000, 12001, 500.0)


def _curve(until, after=100.0, before=1000.0, drop_at=2000.0):
    s = STEPS[STEPS <= until]
    return s, np.where(s < drop_at, before, after)


def test_each_fork_is_judged_over_what_it_ran_and_a_short_one_that_dropped_says_so():
    ds, table = _runs({"ctrl": (*_curve(12000, after=1000.0), None, "ok"),
                       "drop+H": (*_curve(12000), 30.0, "ok"),  # ran on to H after it dropped
                       "fine": (*_curve(5000, after=950.0), 3.0, "ok"),  # stays near the control
                       "broke": (*_curve(2000), 100.0, "diverged"),  # stopped at the spike
                       "late": (*_curve(5000, drop_at=4000.0), 10.0, "ok"),  # dropped, not run on
                       "blind": (STEPS[:1], np.array([1000.0]), 300.0, "ok")})  # no evaluation after the event
    kw = dict(floors={h: 0.0 for h in table.spec_hash}, prefix_of={h: "p0" for h in table.spec_hash})
    out = outcomes.horizon_outcomes(ds, table, horizon={"ppo": 9000.0}, window={"ppo": 3000.0}, long={"drop+H"},
                                    **kw).set_index("spec_hash")
    assert out.loc["drop+H", "judged_over"] == "H" and out.loc["drop+H", "state"] == "collapsed"
    assert out.loc["broke", "judged_over"] == "H" and out.loc["broke", "state"] == "collapsed"  # at its floor
    assert out.loc["fine", "judged_over"] == "short window" and out.loc["fine", "state"] == "no_drop"
    assert out.loc["fine", "collapsed"] == 0.0 and not out.loc["fine", "dropped"]
    assert out.loc["late", "state"] == "no_verdict" and out.loc["late", "dropped"] and np.isnan(out.loc["late", "collapsed"])
    assert "not run on to H" in out.loc["late", "reason"]
    assert out.loc["blind", "state"] == "no_verdict" and not out.loc["blind", "dropped"]  # nothing to run on
    assert not out.loc["broke", "dropped"] and not out.loc["drop+H", "dropped"]


def test_a_short_fork_repeats_the_head_of_its_long_version_bit_for_bit(tmp_path, monkeypatch):
    from stabstudy.learners.rl import forks
    from stabstudy.run.runner import run_grid
    from stabstudy.run.store import RunStore, load_runs

    monkeypatch.setenv("STABSTUDY_DATA", str(tmp_path / "data"))
    short = design.fork_grid(["sac"], [("lr_spike", 30.0)], [0], PREFIX, post={"sac": 40}, **KW)[0]
    long = design.to_horizon(short, 300)
    store = RunStore(tmp_path / "runs")
    for specs in (forks.prefix_specs([short]), [short, long]):
        assert all(r.status == "ok" for r in run_grid(specs, scheduler="serial", store=store, progress=False))
    a, b = (load_runs([s], store=store).isel(run=0) for s in (short, long))
    assert b.env_step.max() > a.env_step.max()
    n = int(np.isfinite(a.env_step.values).sum())
    head = b.isel(step=slice(0, n))
    for ch in ("loss", "grad_norm", "update_norm", "env_step"):
        np.testing.assert_array_equal(a[ch].values[:n], head[ch].values, err_msg=ch)
    # every evaluation but the short run's closing one (at its end, off the evaluation cadence)
    np.testing.assert_array_equal(a.perf.values[:n - 1], head.perf.values[:n - 1])
    assert np.isfinite(a.perf.values[n - 1])


# -- the claim as stated ---------------------------------------------------------------------------


def test_update_2000_is_read_as_stable_baselines3_counts_updates():
    # PPO: n_updates += n_epochs per rollout, so update 20 with n_epochs 2 is the 10th rollout end
    assert design.env_step_of_update("ppo", TINY["ppo"], 20) == 640
    assert design.env_step_of_update("ppo-tuned", TINY["ppo-tuned"], 20) == 320
    assert design.env_step_of_update("sac", TINY["sac"], 20) == 51 + 19  # after learning_starts, one per env step


def test_the_claim_as_stated_drops_a_reading_it_cannot_test_and_says_why():
    specs, dropped = design.stated_grid(["ppo", "sac"], {"ppo": [0], "sac": [0]}, {"ppo": 512, "sac": 200}, at=64,
                                        update=20, dose=10.0, spike_updates=20, task="Pendulum-v1", hparams=TINY)
    assert sorted((s.learner, s.perturbations[0].start) for s in specs) == [("ppo", 64), ("sac", 64)]
    assert "does not end before the budget of 512" in dropped["ppo, update 20"]
    assert "within one spike window" in dropped["sac, update 20"]  # env step 70 against 64: the same spike
    late = {"sac": {**TINY["sac"], "learning_starts": 150}}
    specs, dropped = design.stated_grid(["sac"], {"sac": [0]}, {"sac": 400}, at=64, update=20, dose=10.0,
                                        spike_updates=20, task="Pendulum-v1", hparams=late)
    assert not specs and "no gradient update" in dropped["sac, env step 64"]
    assert "not run" in dropped["sac, update 20"]  # update 20 at env step 170: another spike, not the design's


# -- what the design costs -------------------------------------------------------------------------


def test_the_cost_of_a_design_counts_training_and_evaluation_per_learner():
    fork = RunSpec("rl", "sac", "Pendulum-v1", 1200, 0, hparams={"prefix_steps": 200, "eval_episodes": 5,
                                                                 "eval_max_steps": 100}, eval_every=100)
    scratch = RunSpec("rl", "ppo", "Pendulum-v1", 2000, 0, hparams={"eval_episodes": 1})
    assert cost.run_cost(fork) == {"train_steps": 1000.0, "eval_steps": (10 + 2) * 5 * 100.0}
    assert cost.run_cost(scratch, episode_steps=200) == {"train_steps": 2000.0, "eval_steps": 22 * 200.0}
    rates, evals = {"sac": 100.0, "ppo": 1000.0}, {"sac": 1000.0, "ppo": 1000.0}
    t = cost.worker_seconds({"a": [fork, scratch], "b": [fork]}, rates=rates, eval_rates=evals, episode_steps=200)
    assert list(t.grid) == ["a", "a"] and t.set_index("learner").worker_s.to_dict() == pytest.approx(
        {"sac": 1000 / 100 + 6000 / 1000, "ppo": 2 + 4.4})
    # stored runs that took twice the estimate double it
    f = cost.calibration([fork], [32.0], rates=rates, eval_rates=evals)
    assert f == pytest.approx({"sac": 2.0})
    assert cost.calibration([fork], [np.nan], rates=rates, eval_rates=evals) == {}
    t2 = cost.worker_seconds({"a": [fork]}, rates=rates, eval_rates=evals, factor=f)
    assert t2.worker_s.iloc[0] == pytest.approx(32.0)
    with pytest.raises(ValueError, match="no training rate for 'sac'; known: ppo"):
        cost.worker_seconds({"a": [fork]}, rates={"ppo": 1.0})


def test_the_plan_of_a_design_holds_its_prefixes_its_forks_and_the_most_the_rule_adds():
    d = _design(stated_steps={"ppo": 512, "sac": 300}, stated_at=64, stated_update=20)
    plan = d.plan(TINY)
    assert {(s.learner, s.steps) for s in plan["prefixes"]} == {("ppo", 512), ("sac", 400)}  # at their caps
    assert len(plan["doses"]) == 2 * (3 + 3 + 1)  # two dose steps per prefix
    assert {s.learner for s in plan["stated"]} == {"ppo", "sac"}
    assert plan["extensions (at most)"] and not set(plan["extensions (at most)"]) & set(plan["lr_spike"])
    assert all(s.perturbations[0].kind == "lr_spike" for s in plan["extensions (at most)"])
    stopped = d.plan(TINY, {"ppo": {0: 256, 1: 256, 2: 256}, "sac": {0: 120, 1: 120, 2: 120}, "ppo-tuned": {0: 96}})
    assert {s.steps for s in stopped["prefixes"]} == {256, 120, 96}


def test_evaluation_spread_per_run():
    ds = xr.Dataset({"perf": (("run", "step"), [[1.0, np.nan, 2.0], [np.nan] * 3]),
                     "perf_std": (("run", "step"), [[10.0, np.nan, 30.0], [np.nan] * 3])},
                    coords={"run": ["a", "b"], "learner": ("run", ["sac", "td3"])})
    t = curves.evaluation_spread(ds)
    assert t.loc["a"].to_dict() == {"learner": "sac", "evaluations": 2, "perf_std_median": 20.0, "perf_std_max": 30.0}
    assert t.loc["b", "evaluations"] == 0 and np.isnan(t.loc["b", "perf_std_median"])


def test_the_summary_over_prefixes_counts_prefixes_not_forks():
    rows = [{"learner": "ppo", "pert_kind": "lr_spike", "pert_dose": 10.0, "prefix": f"p{p}", "state": "collapsed",
             "collapsed": 1.0, "damage": -1000.0 - p, "recovery_time": np.nan} for p in range(2) for _ in range(3)]
    rows += [{"learner": "ppo", "pert_kind": "lr_spike", "pert_dose": 10.0, "prefix": "p2", "state": "no_verdict",
              "collapsed": np.nan, "damage": np.nan, "recovery_time": np.nan}]
    t = outcomes.prefix_summary(pd.DataFrame(rows), reps=200).iloc[0]
    assert (t.prefixes, t.forks, t.collapsed, t.no_verdict) == (2, 7, 2, 1)
    assert t.p_collapse == 1.0 and t.p_low < 0.5  # two prefixes: a wide interval, whatever six forks say
    assert t.damage == pytest.approx(-1000.5) and t.deff > 1
    assert outcomes.prefix_summary(pd.DataFrame(columns=["learner", "pert_kind", "pert_dose"])).empty


def test_the_claim_as_stated_is_read_against_the_unperturbed_run_of_its_seed_to_the_earlier_end():
    steps = np.arange(0, 10001, 1000.0)
    ds, table = _runs({"ctrl": (steps, np.minimum(steps / 5, 1500.0), None, "ok"),  # the matching prefix
                       "hit": (steps[:9], np.where(steps[:9] < 2000, steps[:9] / 5, 50.0), 10.0, "ok")})  # budget 8000
    table["prefix_steps"] = 0
    out = outcomes.stated_outcomes(ds, table, lag_frac=0.25)
    assert len(out) == 1 and out.iloc[0].state == "collapsed" and out.iloc[0].horizon == 6000.0
    assert out.iloc[0].lag == 1500.0 and out.iloc[0].prefix == "ppo seed 0"
    assert out.iloc[0].damage == pytest.approx(50.0 - (1200.0 + 1400.0 + 1500.0) / 3)  # the last three common points
    # without its control: no verdict, and says so
    alone = outcomes.stated_outcomes(ds.sel(run=["hit"]), table[table.spec_hash == "hit"])
    assert alone.iloc[0].state == "no_verdict" and alone.iloc[0].reason == "no paired control"


# -- the profiles ----------------------------------------------------------------------------------

NB01 = "01_rl_algorithm_comparison"


def test_the_standard_profile_is_quick_for_every_notebook_but_01_and_the_full_design_for_01():
    from stabstudy.run import study as S

    q, st = S.load_profile("quick"), S.load_profile("standard")
    assert all(q.get(k, {}) == st.get(k, {}) for k in (set(q) | set(st)) - {NB01})
    quick, standard = S.resolved_parameters(NB01, "quick"), S.resolved_parameters(NB01, "standard")
    assert quick["seeds"] == S.notebook_defaults(NB01)["seeds"] and quick["profile"] == "quick"
    assert len(standard["seeds"]) >= 8 and standard["env_doses"] and standard["noise_levels"]
    assert not quick["env_doses"] and not quick["noise_levels"]  # no env-side kinds, no claim (c) at quick
    assert quick["claim_dose"] == 10.0 and quick["eval_episodes"] >= 5 and quick["stated_steps"]
    # the fresh runs of the claim as stated learn before the spike (their own learning_starts)
    assert all(quick["stated_hparams"][a]["learning_starts"] < quick["stated_at"] for a in ("sac", "td3"))


@pytest.mark.parametrize("profile", ["smoke", "quick", "standard", "paper"])
def test_every_profile_builds_a_valid_design(profile):
    """Every spec of every profile's design is valid (fork points and ends on the fork unit, windows inside
    the runs): a bad length fails here, not hours into a study."""
    from stabstudy.learners.rl import learner as rl
    from stabstudy.run import study as S

    p = S.resolved_parameters(NB01, profile)
    hp = rl.algo_hparams(p["algos"], p["task"], common={k: p[k] for k in ("eval_episodes", "eval_max_steps", "monitor_every")},
                         per_algo=p["hparams"])
    plan = design.ForkDesign.from_parameters(p).plan(hp)
    assert plan["prefixes"] and plan["control"] and plan["lr_spike"]
    assert (cost.worker_seconds(plan).worker_s > 0).all()


def test_the_default_knob_reads_as_same():
    t = pd.DataFrame({"learner": ["sac", "sac", "ppo"], "noise_after_fork": [-1.0, 0.0, "same"]})
    out = design.default_knob_as_same(t, {"sac": {"target_entropy": -1.0}, "ppo": {}})
    assert list(out.noise_after_fork) == ["same", 0.0, "same"]
