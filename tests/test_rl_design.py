"""Notebook 01's grids: forks to H and short, the drop rule that runs a short fork on to H, arms,
the claim as stated, and the design's cost."""

import numpy as np
import pandas as pd
import pytest
import xarray as xr

from stabstudy.analysis.studies.rl import cost, curves, design, outcomes, power
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


def test_the_horizon_is_rounded_to_the_fork_unit_and_a_learner_without_one_gets_its_prefix():
    h = design.horizon_steps({"ppo": 1000.0, "sac": 77.4, "ppo-tuned": np.nan}, PREFIX, TINY)
    assert h == {"ppo": 1024, "sac": 78, "ppo-tuned": 256}
    # never shorter than the short window: a control reaches the end of every short fork of its prefix
    assert design.horizon_steps({"ppo": 1000.0, "sac": 77.4}, {"ppo": 256, "sac": 200}, TINY,
                              at_least={"ppo": 1500, "sac": 50}) == {"ppo": 1536, "sac": 78}


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
                prefix_steps=PREFIX, fork_lead=KW["lead"], fork_post={"ppo": 128, "ppo-tuned": 128, "sac": 60},
                fork_eval_every=KW["eval_every"], claim_dose=10.0, lr_doses=(3.0, 10.0, 30.0), task="Pendulum-v1",
                action_noise_doses=(1.0,), reward_scale_doses=(), noise_levels={"sac": (-1.0, 0.0)},
                noise_lead={"sac": 100}, spike_updates=20, env_pert_duration=64)
    return design.ForkDesign.from_parameters({**base, **kw})


def test_the_design_runs_the_control_and_the_claim_dose_to_h_and_the_rest_short():
    d = _design()
    h = {"ppo": 640, "ppo-tuned": 640, "sac": 500}
    g = d.grids(TINY, h)
    arms = design.arms_of([s for v in g.values() for s in v], TINY)
    to_h = pd.DataFrame([{"arm": arms[s.spec_hash], "seed": s.seed, "dose": s.perturbations[0].dose if s.perturbations else 1.0}
                         for s in g["lr_spike to H"]])
    assert sorted(to_h[to_h.arm == "ppo"].dose.unique()) == [1.0, 10.0] and set(to_h[to_h.arm == "ppo"].seed) == {0, 1, 2}
    assert set(to_h[to_h.arm == "ppo-tuned"].seed) == {0}  # a subset arm runs on the subset seeds
    assert {s.perturbations[0].dose for s in g["lr_spike short"]} == {3.0, 30.0}
    assert all(s.steps == s.perturbations[0].start + d.window(arms[s.spec_hash], TINY[arms[s.spec_hash]])
               for s in g["lr_spike short"])
    assert {s.seed for s in g["action_noise"]} == {0} and not g["reward_scale"]
    # the noise grid: the knob is set noise_lead before the spike; each level (the default, -1, among them)
    # keeps its own control, apart from the main grid's (another event)
    noise = g["noise"]
    assert {s.get("noise_after_fork") for s in noise} == {-1.0, 0.0}
    assert all(s not in g["lr_spike to H"] for s in noise)
    assert {s.perturbations[0].start for s in noise if s.perturbations} == {200 + 100}
    assert d.grids(TINY, h, lr_only=True)["noise"] == []
    # the most the drop rule can add: every short fork of the grids, run on to H
    up = d.upper_bound(g, h, arms)
    assert len(up) == len(g["lr_spike short"]) + len(g["action_noise"]) + len([s for s in noise if s.perturbations])
    with pytest.raises(ValueError, match="needs the parameters seeds"):
        design.ForkDesign.from_parameters({"algos": ["ppo"]})


def test_the_regimes_share_the_prefixes_they_do_not_change():
    r = design.regimes({"ppo": 256, "sac": 200}, {"sac": 400})
    assert r == {"return-matched": {"ppo": 256, "sac": 200}, "long prefixes": {"ppo": 256, "sac": 400}}
    assert list(design.regimes({"ppo": 256})) == ["return-matched"]
    with pytest.raises(ValueError, match="without a prefix: \\['td3'\\]"):
        design.regimes({"ppo": 256}, {"td3": 1})


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


def test_a_short_fork_that_dropped_below_its_control_is_run_on_and_others_are_not():
    ds, table = _runs({"ctrl": (*_curve(12000, after=1000.0), None, "ok"),
                       "drop": (*_curve(5000), 30.0, "ok"),  # falls to 100 against 1000: dropped
                       "fine": (*_curve(5000, after=950.0), 3.0, "ok"),  # stays near the control
                       "broke": (*_curve(2000), 100.0, "diverged"),  # stopped at the spike
                       "blind": (STEPS[:1], np.array([1000.0]), 300.0, "ok")})  # no evaluation after the event
    kw = dict(floors={h: 0.0 for h in table.spec_hash}, prefix_of={h: "p0" for h in table.spec_hash})
    short = outcomes.paired_table(ds, table, horizon={"ppo": 3000.0}, **kw)
    assert dict(zip(short.spec_hash, short.state, strict=True)) == {"drop": "collapsed", "fine": "no_drop", "broke": "collapsed",
                                                       "blind": "no_verdict"}
    assert outcomes.dropped_forks(short, table) == ["drop"]  # diverged: at its floor anyway; no verdict: nothing to extend
    assert outcomes.dropped_forks(short.iloc[:0], table) == []

    # after the rule: the dropped fork ran on to H (a new run, "drop+H"); each fork is judged over what it ran
    ds2, table2 = _runs({"ctrl": (*_curve(12000, after=1000.0), None, "ok"), "drop+H": (*_curve(12000), 30.0, "ok"),
                         "fine": (*_curve(5000, after=950.0), 3.0, "ok"), "broke": (*_curve(2000), 100.0, "diverged"),
                         "late": (*_curve(5000, drop_at=4000.0), 10.0, "ok")})  # dropped, never run on
    kw2 = dict(floors={h: 0.0 for h in table2.spec_hash}, prefix_of={h: "p0" for h in table2.spec_hash})
    out = outcomes.horizon_outcomes(ds2, table2, horizon={"ppo": 9000.0}, window={"ppo": 3000.0}, long={"drop+H"}, **kw2)
    got = out.set_index("spec_hash")
    assert got.loc["drop+H", "judged_over"] == "H" and got.loc["drop+H", "state"] == "collapsed"
    assert got.loc["broke", "judged_over"] == "H" and got.loc["broke", "state"] == "collapsed"
    assert got.loc["fine", "judged_over"] == "short window" and got.loc["fine", "state"] == "no_drop"
    assert got.loc["fine", "collapsed"] == 0.0
    assert got.loc["late", "state"] == "no_verdict" and np.isnan(got.loc["late", "collapsed"])
    assert "not run on to H" in got.loc["late", "reason"]


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
    grids, dropped = design.stated_grid(["ppo", "sac"], [0], {"ppo": 512, "sac": 200}, at=64, update=20, dose=10.0,
                                       spike_updates=20, task="Pendulum-v1", hparams=TINY)
    starts = {r: sorted((s.learner, s.perturbations[0].start) for s in v if s.perturbations) for r, v in grids.items()}
    assert starts == {"env step 64": [("ppo", 64), ("sac", 64)], "update 20": [("sac", 70)]}
    assert "does not end before the budget of 512" in dropped["ppo, update 20"]
    late = {"sac": {**TINY["sac"], "learning_starts": 150}}
    grids, dropped = design.stated_grid(["sac"], [0], {"sac": 400}, at=64, update=20, dose=10.0, spike_updates=20,
                                       task="Pendulum-v1", hparams=late)
    assert not grids["env step 64"] and "no gradient update" in dropped["sac, env step 64"]
    assert len(grids["update 20"]) == 2  # the control and the spiked run


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


def test_the_plan_of_a_design_holds_its_prefixes_its_grids_and_the_most_the_rule_adds():
    d = _design(long_prefix_steps={"sac": 400}, stated_steps={"ppo": 512, "sac": 300}, stated_at=64, stated_update=20)
    # planning H (0.6 of the prefix) is within the return-matched regime's short windows here, not the long one's
    assert {s.hp["prefix_steps"] for s in d.plan(TINY)["extensions (at most)"]} == {400}
    plan = d.plan(TINY, horizon={"return-matched": {"ppo": 640, "ppo-tuned": 640, "sac": 500}})
    pre = plan["prefixes"]
    assert {(s.learner, s.steps) for s in pre} == {("ppo", 256), ("sac", 200), ("sac", 400)}
    assert len(pre) == 3 + 3 + 1 + 3  # ppo, sac, ppo-tuned (subset), sac long
    assert all(s.steps == s.hp["prefix_steps"] and not s.perturbations for s in pre)
    assert {s.learner for s in plan["stated"]} == {"ppo", "sac"}  # the variant is not in the claim as stated
    assert plan["extensions (at most)"] and not set(plan["extensions (at most)"]) & set(plan["lr_spike short"])


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


def test_the_claim_as_stated_is_read_against_the_unperturbed_run_of_its_seed_at_the_budget():
    steps = np.arange(0, 10001, 1000.0)
    ds, table = _runs({"ctrl": (steps, np.minimum(steps / 5, 1500.0), None, "ok"),
                       "hit": (steps, np.where(steps < 2000, steps / 5, 50.0), 10.0, "ok")})
    table["prefix_steps"] = 0
    out = outcomes.stated_outcomes(ds, table)
    assert len(out) == 1 and out.iloc[0].state == "collapsed" and out.iloc[0].horizon == 8000.0
    assert out.iloc[0].prefix == "ppo seed 0" and out.iloc[0].damage == pytest.approx(50.0 - 1500.0)
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
    assert len(standard["seeds"]) >= 8 and standard["long_prefix_steps"] and standard["noise_levels"]
    assert not quick["long_prefix_steps"] and not quick["noise_levels"]  # one regime, no claim (c) at quick
    assert quick["claim_dose"] in quick["lr_doses"] and quick["eval_episodes"] >= 5
    # quick's prefixes: each of claim (a)'s comparisons has power >= 0.8 at the planning rates 0.9 vs 0.1, both
    # together >= 0.9 at 0.95 vs 0.05 (issue 26), and one prefix fewer would not
    n, a = len(quick["seeds"]), 0.025
    assert power.boschloo_power(0.9, 0.1, n, n, alpha=a) >= 0.8 > power.boschloo_power(0.9, 0.1, n - 1, n - 1, alpha=a)
    assert power.boschloo_power(0.95, [0.05, 0.05], n, n, alpha=a) >= 0.9


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
    assert plan["prefixes"] and plan["lr_spike to H"]
    assert (cost.worker_seconds(plan).worker_s > 0).all()


def test_bisection_forks_fork_each_prefix_at_its_own_doses_and_the_default_knob_reads_as_same():
    d = _design()
    prefix = RunSpec("rl", "sac", "Pendulum-v1", 200, 3, hparams={**TINY["sac"], "prefix_steps": 200})
    doses = pd.DataFrame([{"learner": "sac", "prefix": prefix.spec_hash, "dose": 5.48},
                          {"learner": "sac", "prefix": prefix.spec_hash, "dose": 5.48}])
    (f,) = d.bisection_forks(TINY, doses, {prefix.spec_hash: prefix})
    assert f.seed == 3 and f.perturbations[0].dose == 5.48 and f.steps == 240 + 64 + 60
    from stabstudy.learners.rl import forks

    assert forks.prefix_key(f) == prefix
    t = pd.DataFrame({"learner": ["sac", "sac", "ppo"], "noise_after_fork": [-1.0, 0.0, "same"]})
    out = design.default_knob_as_same(t, {"sac": {"target_entropy": -1.0}, "ppo": {}})
    assert list(out.noise_after_fork) == ["same", 0.0, "same"]
