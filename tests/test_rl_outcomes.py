"""Notebook 01's outcomes against the paired control, the prefix as the unit, and manipulation checks."""

import numpy as np
import pandas as pd
import pytest
import xarray as xr

from stabstudy.analysis import claims as C
from stabstudy.analysis import stats
from stabstudy.analysis.studies.rl import checks, design
from stabstudy.analysis.studies.rl import claims as rl_claims
from stabstudy.analysis.studies.rl import outcomes as O

STEPS = np.arange(0, 21) * 1000.0  # evaluations every 1,000 env steps


def curve(values, steps=STEPS):
    return xr.DataArray(np.asarray(values, float), dims="env_step", coords={"env_step": np.asarray(steps)})


CONTROL = curve(np.full(STEPS.size, 1000.0))
EVENT, H = 5000.0, 10_000.0  # window [5000, 15000]


def test_learning_horizon_is_where_the_prefix_reached_80_percent_of_its_gain():
    rising = curve(np.minimum(STEPS / 5, 1000.0))  # 0 -> 1000 by env step 5000, then flat
    assert design.learning_horizon(rising) == 4000.0
    assert np.isnan(design.learning_horizon(curve(np.full(STEPS.size, 5.0))))  # learned nothing: no horizon
    per, H_by = design.horizons(xr.concat([rising, rising.assign_coords(env_step=STEPS * 2)], "run", join="outer").assign_coords(
        learner=("run", ["ppo", "ppo"]), spec_hash=("run", ["a", "b"])))
    assert list(per.horizon) == [4000.0, 8000.0] and H_by == {"ppo": 6000.0}


@pytest.mark.parametrize(("treated", "state", "damage"), [
    (np.where(STEPS < EVENT, 1000.0, 100.0), "collapsed", -900.0),
    (np.where((STEPS >= EVENT) & (STEPS < 9000), 100.0, 1000.0), "recovered", 0.0),
    (np.where(STEPS < EVENT, 1000.0, 900.0), "no_drop", -100.0),
])
def test_outcomes_are_read_against_the_control_at_the_same_env_step(treated, state, damage):
    res = O.paired_outcome(curve(treated), CONTROL, EVENT, H, floor=0.0)
    assert res["state"] == state and res["damage"] == pytest.approx(damage)
    # where the drop is first seen against the control: the event's evaluation here; none without a drop
    if state == "no_drop":
        assert np.isnan(res["onset"])
    else:
        assert res["onset"] == EVENT
    if state == "recovered":
        assert res["recovery_time"] == 4000.0
    else:
        assert np.isnan(res["recovery_time"])


def test_a_run_compared_with_its_own_past_would_hide_what_the_control_shows():
    # the control keeps learning (0 -> 2000); the treated run stays where it was at the event:
    # against its own pre-spike return it "kept its return", against the control it lost most of it
    control = curve(np.minimum(STEPS / 5, 2000.0))
    flat = curve(np.minimum(STEPS / 5, 1000.0))
    res = O.paired_outcome(flat, control, EVENT, H, floor=0.0)
    assert res["state"] == "no_drop" and res["damage"] == pytest.approx(-1000.0)
    assert O.paired_outcome(curve(np.where(STEPS < EVENT, STEPS / 5, 500.0)), control, EVENT, H,
                            floor=0.0)["state"] == "collapsed"


def test_the_horizon_decides_irreversible():
    slow = curve(np.where(STEPS < EVENT, 1000.0, np.clip((STEPS - EVENT) / 10, 0, 1000)))  # back by 15000
    late = curve(np.where(STEPS < 8000, 1000.0, 100.0))  # drops three evaluations after the event
    assert O.paired_outcome(late, CONTROL, EVENT, H, floor=0.0)["onset"] == 8000.0
    assert O.paired_outcome(slow, CONTROL, EVENT, 4000.0, floor=0.0)["state"] == "collapsed"
    assert O.paired_outcome(slow, CONTROL, EVENT, H, floor=0.0)["state"] == "recovered"


def test_a_run_that_diverged_at_the_spike_is_at_its_floor_after_it_never_its_pre_spike_returns():
    before = STEPS <= EVENT
    stopped = curve(np.full(before.sum(), 1000.0), STEPS[before])  # evaluations end at the spike
    res = O.paired_outcome(stopped, CONTROL, EVENT, H, floor=-300.0, diverged_at=EVENT)
    assert res["state"] == "collapsed" and res["damage"] == pytest.approx(-1300.0)
    assert EVENT < res["onset"] < EVENT + 1  # just after it stopped, not at its last (pre-spike) evaluation
    # the same run not marked diverged ends before the horizon: no verdict, never "no damage"
    res = O.paired_outcome(stopped, CONTROL, EVENT, H, floor=-300.0)
    assert res["state"] == "no_verdict" and np.isnan(res["damage"]) and "treated" in res["reason"]


RISING = 100.0 + np.clip((STEPS - EVENT) / 5, 0, 2000)  # a control that learns fast from the event on


def _shifted(values, by):
    """``values`` (on STEPS) delayed by ``by`` env steps from the event on: paused at its event level."""
    return np.where(STEPS < EVENT, values, np.interp(np.maximum(STEPS - by, EVENT), STEPS, values))


def test_a_fork_that_trails_its_control_by_up_to_the_lag_is_not_collapsed_and_a_plateau_below_is():
    control = curve(RISING)
    # paused 6,000 env steps at the spike, then learns at the control's rate: 900 against 2,100 at the end of H
    late = curve(_shifted(RISING, 6000.0))
    assert O.paired_outcome(late, control, EVENT, H, floor=0.0, lag=6000.0)["state"] == "no_drop"
    # without a lag the same fork reads as a collapse: it ends below half of the control's gain
    assert O.paired_outcome(late, control, EVENT, H, floor=0.0)["state"] == "collapsed"
    # one that falls back and stays below half of what its control had gained by then collapsed, lag or not
    plateau = curve(np.where(STEPS < EVENT, RISING, 250.0))
    res = O.paired_outcome(plateau, control, EVENT, H, floor=0.0, lag=6000.0)
    assert res["state"] == "collapsed" and res["end_level"] < 0.5 and res["onset"] > EVENT
    # ... and one that drops, then climbs back to within the lag, recovered
    back = curve(np.where(STEPS < EVENT, RISING, np.where(STEPS < 9000, 0.0, _shifted(RISING, 6000.0))))
    res = O.paired_outcome(back, control, EVENT, H, floor=0.0, lag=6000.0)
    assert res["state"] == "recovered" and res["onset"] == EVENT and res["recovery_time"] == 4000.0


def test_a_control_at_or_below_the_floor_has_no_gain_to_lose():
    """The floor is the prefix's untrained return: a control that never rose above it (a prefix that
    learned nothing, TD3's negative returns of the old design) cannot say how much a fork lost."""
    flat = curve(np.full(STEPS.size, -100.0))
    fork = curve(np.where(STEPS < EVENT, -100.0, -400.0))
    for floor in (-100.0, 0.0):  # at, and above, the control
        res = O.paired_outcome(fork, flat, EVENT, H, floor=floor, lag=2500.0, min_gain=50.0)
        assert res["state"] == "no_verdict" and np.isnan(res["collapsed"]) and "no gain to lose" in res["reason"]
        assert res["damage"] == pytest.approx(-300.0)  # the difference is still measured
    # a control barely above the floor at the end: still none, below min_gain
    assert O.paired_outcome(fork, curve(np.full(STEPS.size, -70.0)), EVENT, H, floor=-100.0,
                            min_gain=50.0)["state"] == "no_verdict"


def test_no_verdict_without_a_control_that_reaches_the_horizon():
    short = curve(CONTROL.values[:12], STEPS[:12])  # ends at 11000 < 15000
    res = O.paired_outcome(CONTROL, short, EVENT, H, floor=0.0)
    assert res["state"] == "no_verdict" and np.isnan(res["collapsed"]) and "control" in res["reason"]


def _forks(k_prefixes, forks, collapsed_prefixes, learner):
    return pd.DataFrame([{"learner": learner, "pert_kind": "lr_spike", "pert_dose": 10.0, "prefix": f"{learner}{p}",
                          "collapsed": float(p < collapsed_prefixes), "damage": -1000.0 * (p < collapsed_prefixes) - p,
                          "recovery_time": np.nan}
                         for p in range(k_prefixes) for _ in range(forks)])


def test_forks_of_one_prefix_do_not_count_as_independent():
    # 3 prefixes x 6 forks each; whole prefixes collapse or not (the forks share their training)
    ppo, sac = _forks(3, 6, 2, "ppo"), _forks(3, 6, 0, "sac")
    pooled = C.rate_comparison("pooled forks", "our own", int(ppo.collapsed.sum()), len(ppo), int(sac.collapsed.sum()),
                               len(sac), direction="greater")
    assert pooled.verdict == "supported"  # 18 vs 18 "independent" runs: what pseudo-replication claims
    rows = O.by_prefix(pd.concat([ppo, sac]))
    assert len(rows) == 6 and set(rows.forks) == {6}
    k = {a: (int(g.collapsed_prefix.sum()), len(g)) for a, g in rows.groupby("learner")}
    over_prefixes = C.rate_comparison("over prefixes", "our own", *k["ppo"], *k["sac"], direction="greater")
    assert over_prefixes.n == 6 and over_prefixes.verdict == "inconclusive"  # 2/3 vs 0/3 prefixes
    icc, deff = stats.design_effect(ppo.damage, ppo.prefix)
    assert icc > 0.99 and deff == pytest.approx(1 + 5 * icc)
    est, lo, hi = stats.cluster_bootstrap(ppo.damage, ppo.prefix, reps=500)
    naive = stats.cluster_bootstrap(ppo.damage, np.arange(len(ppo)), reps=500)  # every fork its own unit
    assert est == pytest.approx(-667.67, abs=0.01) and (hi - lo) > 1.5 * (naive[2] - naive[1])


GRID = (3.0, 10.0, 30.0, 100.0)


def _dose_rows(learner, name, collapses_from, doses=GRID, forks=1):
    """by_prefix-style rows of one prefix that collapses at every dose from ``collapses_from`` on."""
    return [{"learner": learner, "pert_kind": "lr_spike", "prefix": name, "pert_dose": d,
             "collapsed_prefix": float(d >= collapses_from)} for d in doses for _ in range(forks)]


def test_each_prefix_is_bracketed_and_censored_honestly():
    rows = pd.DataFrame(_dose_rows("ppo", "p0", 30.0) + _dose_rows("ppo", "p1", np.inf) + _dose_rows("ppo", "p2", 3.0)
                        + [{"learner": "ppo", "pert_kind": "lr_spike", "prefix": "p3", "pert_dose": d,
                            "collapsed_prefix": c} for d, c in zip(GRID, (0.0, 1.0, 0.0, 1.0), strict=True)]
                        + [{"learner": "ppo", "pert_kind": "lr_spike", "prefix": "p4", "pert_dose": 10.0,
                            "collapsed_prefix": np.nan}])
    crit = O.prefix_critical_doses(rows, base_lrs={"ppo": 3e-4}).set_index("prefix")
    assert crit.loc["p0", "where"] == "bracketed" and (crit.loc["p0", "low"], crit.loc["p0", "high"]) == (10.0, 30.0)
    assert crit.loc["p0", "dose"] == pytest.approx(np.sqrt(300.0)) and crit.loc["p0", "lr"] == pytest.approx(3e-4 * np.sqrt(300))
    assert crit.loc["p1", "where"] == "above the grid" and crit.loc["p1", "dose"] == np.inf and crit.loc["p1", "low"] == 100
    # collapsed at the smallest dose: bracketed by the control (factor 1 never collapses against itself)
    assert crit.loc["p2", "where"] == "below the grid" and crit.loc["p2", "low"] == 1.0
    assert crit.loc["p2", "dose"] == pytest.approx(np.sqrt(3.0))
    assert not crit.loc["p3", "monotone"] and crit.loc["p3", "high"] == 10.0 and crit.loc["p0", "monotone"]
    assert crit.loc["p4", "where"] == "no data" and np.isnan(crit.loc["p4", "dose"])


def test_the_critical_dose_also_as_the_policy_change_it_caused():
    rows = pd.DataFrame(_dose_rows("sac", "s0", 30.0) + _dose_rows("sac", "s1", 3.0))
    changes = pd.DataFrame([{"learner": "sac", "prefix": p, "pert_kind": k, "pert_dose": d, "update_path": v}
                            for p, k, d, v in [("s0", "lr_spike", 10.0, 4.0), ("s0", "lr_spike", 10.0, 6.0),
                                               ("s0", "lr_spike", 30.0, 20.0), ("s1", "none", 1.0, 0.5),
                                               ("s1", "lr_spike", 3.0, 2.0)]])
    crit = O.prefix_critical_doses(rows, changes=changes).set_index("prefix")
    assert (crit.loc["s0", "change_low"], crit.loc["s0", "change_high"]) == (5.0, 20.0)  # mean over its forks
    assert crit.loc["s0", "change_at_dose"] == pytest.approx(10.0)
    assert crit.loc["s1", "change_low"] == 0.5 and crit.loc["s1", "change_at_dose"] == pytest.approx(1.0)  # the control's


def _crit(**arms):
    """prefix_critical_doses-like rows: per arm, one (low, high] bracket per prefix."""
    return pd.DataFrame([{"learner": a, "prefix": f"{a}{i}", "low": lo, "high": hi,
                          "dose": np.sqrt(lo * hi) if np.isfinite(hi) else np.inf}
                         for a, brackets in arms.items() for i, (lo, hi) in enumerate(brackets)])


LOW = [(1.0, 1.78), (1.78, 3.16), (3.16, 5.62), (1.78, 3.16), (3.16, 5.62), (1.0, 1.78)]  # x1-x6: PPO's fragile prefixes
HIGH = [(56.2, np.inf), (31.6, 56.2), (56.2, np.inf), (17.8, 31.6), (56.2, np.inf), (31.6, 56.2)]  # x18-x56 and above
SAME = [(3.16, 5.62), (5.62, 10.0), (3.16, 5.62), (5.62, 10.0), (3.16, 5.62), (5.62, 10.0)]


def _joint(rows):
    return rl_claims.joint("every comparison holds", rl_claims.adjusted(rows), ("sac", "td3"), test="", family="j")


@pytest.mark.parametrize(("arms", "joint"), [
    (dict(ppo=LOW, sac=HIGH, td3=HIGH), "supported"),
    (dict(ppo=HIGH, sac=LOW, td3=LOW), "not supported"),  # opposite
    (dict(ppo=LOW, sac=HIGH, td3=LOW), "inconclusive"),  # TD3 as PPO, but the brackets spread too wide to show x2
])
def test_the_critical_dose_claim_is_decided_over_prefixes_at_the_least_favourable_ends(arms, joint):
    rows = rl_claims.critical_dose_claims(_crit(**arms), sims=50, family="b")
    assert _joint(rows).verdict == joint and len(rows) == 2
    assert all(r.power is not None and r.family == "b" and r.n == 12 for r in rows)
    assert all("least favourable" in r.reason and "within x2" in r.reason for r in rows)
    sup, nsup = rows[0].power(0.025, 1.0)  # the rule's own sequence of doses, simulated
    assert 0 <= nsup <= 1 and sup > 0.2


def test_a_critical_dose_within_a_factor_of_two_is_not_supported_with_enough_prefixes():
    same = [(3.16, 5.62)] * 12  # every prefix bracketed alike: at most a factor 5.62 / 3.16 = 1.78 apart
    rows = rl_claims.critical_dose_claims(_crit(ppo=same, sac=same, td3=same), sims=10)
    assert rows[0].verdict == _joint(rows).verdict == "not supported"
    # a bracket just above PPO's: lower by a factor between 1 and 3.2, which the brackets cannot tell from 2
    above = [(5.62, 10.0)] * 12
    assert _joint(rl_claims.critical_dose_claims(_crit(ppo=same, sac=above, td3=above), sims=10)).verdict == "inconclusive"
    # a whole decade apart: supported
    far = [(31.6, 56.2)] * 12
    assert _joint(rl_claims.critical_dose_claims(_crit(ppo=same, sac=far, td3=far), sims=10)).verdict == "supported"
    # the same brackets as an absolute lr or a policy change: exploratory rows, no verdict in the table
    crit = _crit(ppo=same, sac=far, td3=far).assign(lr_low=1e-3, lr_high=2e-3)
    assert not any(r.confirmatory for r in rl_claims.critical_dose_claims(crit, value="lr", sims=10))


def test_the_critical_dose_claim_without_enough_prefixes_says_why():
    rows = rl_claims.critical_dose_claims(_crit(ppo=LOW[:2], sac=HIGH[:2], td3=HIGH[:2]), sims=10)
    assert rows[0].verdict == "inconclusive" and "fewer than 3" in rows[0].reason and np.isnan(rows[0].p_for)
    assert rl_claims.critical_dose_claims(_crit(ppo=LOW, td3=HIGH), sims=10)[0].verdict == "not tested"
    spiked = rl_claims.critical_dose_claims(_crit(ppo=LOW, sac=HIGH, td3=HIGH), spiked={"ppo": 40, "sac": 0, "td3": 40},
                                            sims=10)
    assert spiked[0].verdict == "not tested" and "no update of SAC" in spiked[0].reason
    assert spiked[1].verdict == "supported"
    with pytest.raises(ValueError, match="dose, lr, change_at_dose"):
        rl_claims.critical_dose_claims(_crit(ppo=LOW), value="kl")
    with pytest.raises(ValueError, match="base_lrs"):
        rl_claims.critical_dose_claims(_crit(ppo=LOW), value="lr")


def test_forks_of_one_prefix_give_one_critical_dose():
    # two forks of each prefix (e.g. two continuation seeds) at every dose: still one value per prefix
    forks = pd.DataFrame([{**r, "collapsed": r.pop("collapsed_prefix")} for r in
                          _dose_rows("ppo", "p0", 10.0, forks=2) + _dose_rows("sac", "s0", np.inf, forks=2)])
    crit = O.prefix_critical_doses(O.by_prefix(forks))
    assert crit.groupby("learner").size().to_dict() == {"ppo": 1, "sac": 1}
    rows = rl_claims.critical_dose_claims(crit, off_policy=("sac",), sims=10)
    assert rows[0].n == 2 and rows[0].verdict == "inconclusive"  # 1 vs 1 prefix, not 8 vs 8 forks


def test_the_rank_test_ranks_above_every_dose_last_and_is_exact_for_few_prefixes():
    assert stats.rank_test_p([3.0, 5.5, 17.3], [np.inf, np.inf, 54.8], "less") == pytest.approx(1 / 20)
    assert stats.rank_test_p([np.inf] * 3, [np.inf] * 3, "less") == 1.0


def _run(env_steps, **channels):
    return xr.Dataset({k: ("step", np.asarray(v, float)) for k, v in channels.items()},
                      coords={"step": np.arange(len(env_steps)), "env_step": ("step", np.asarray(env_steps))})


def test_a_spike_that_no_update_fell_into_is_not_tested_and_one_that_did_stays():
    claim = C.rate_comparison("collapses", "source paper", 3, 3, 0, 3)
    # learning_starts 10k: the spike window [2000, 2256) holds no update, so no applied lr changed
    before_learning = _run([2000, 2000, 10_001, 10_002], lr=[np.nan, np.nan, 1e-3, 1e-3])
    n = checks.spiked_updates(before_learning, 2000, 256)
    assert n["updates"] == 0
    out = checks.checked(claim, n["updates"] > 0, "no gradient update in the spike window")
    assert out.verdict == "not tested" and "manipulation check failed" in out.reason
    # TD3: the critic every row, the delayed actor every other one; the Monitor measured update_norm
    # only every 5th update (monitor_every), the applied lr on every update
    env = [1900, 2000, 2001, 2002, 2003, 2004, 2300]
    lr, spiked = 1e-3, 1e-2
    trained = _run(env, lr=[lr, spiked, spiked, spiked, spiked, spiked, lr],
                   lr_critic=[lr, spiked, spiked, spiked, spiked, spiked, lr],
                   lr_actor=[lr, np.nan, spiked, np.nan, spiked, np.nan, lr],
                   update_norm=[1, np.nan, np.nan, np.nan, np.nan, 1, 1],
                   update_norm_actor=[1, np.nan, np.nan, np.nan, 1, np.nan, 1])
    n = checks.spiked_updates(trained, 2000, 256)
    assert n == {"updates": 5, "critic_updates": 5, "actor_updates": 2}
    assert checks.checked(claim, n["updates"] > 0, "") is claim
    # SAC with its entropy coefficient left out of the spike: its updates were not reached
    sac = _run(env[:3], lr=[lr, spiked, spiked], lr_ent_coef=[lr, lr, lr])
    assert checks.spiked_updates(sac, 2000, 256) == {"updates": 2, "ent_coef_updates": 0}
    assert checks.spiked_updates(_run(env[:3], loss=[1, 1, 1]), 2000, 256) == {"updates": 2}  # no Monitor: rows


def test_the_policy_change_of_a_spike_window_is_measured_per_update_and_over_the_window():
    env = [1900, 2000, 2001, 2002, 2003, 2300]
    run = _run(env, lr_actor=[1, np.nan, 1, np.nan, 1, 1], update_norm_actor=[9, np.nan, 2.0, np.nan, 4.0, 9],
               update_ratio_actor=[9, np.nan, 0.1, np.nan, 0.3, 9], update_norm=[9, 1, 1, 1, 1, 9])
    ch = checks.spike_policy_change(run, 2000, 256)
    assert ch["policy_updates"] == 2 and ch["update_norm"] == 3.0 and ch["update_path"] == 6.0
    assert ch["relative_path"] == pytest.approx(0.4) and np.isnan(ch["kl"])  # the actor's, not the critic's
    ppo = checks.spike_policy_change(_run(env, lr=[1] * 6, update_norm=[1] * 6, approx_kl=[0, np.nan, 0.02, np.nan, 0.04, 0]),
                                2000, 256)
    assert ppo["policy_updates"] == 4 and ppo["kl"] == pytest.approx(0.03) and np.isnan(ppo["relative_path"])
    # PPO inside a Dataset of every learner's runs: its actor variables exist and are NaN
    merged = _run(env, lr=[1] * 6, update_norm=[2] * 6, lr_actor=[np.nan] * 6, update_norm_actor=[np.nan] * 6)
    assert checks.spike_policy_change(merged, 2000, 256)["update_path"] == 8.0


def _prefix_rows(rates):
    return pd.DataFrame([{"learner": a, "pert_kind": "lr_spike", "pert_dose": 10.0, "prefix": f"{a}{i}",
                          "collapsed_prefix": float(i < k)} for a, (k, n) in rates.items() for i in range(n)])


@pytest.mark.parametrize(("rates", "joint"), [
    ({"ppo": (8, 8), "sac": (0, 8), "td3": (0, 8)}, "supported"),
    ({"ppo": (4, 8), "sac": (1, 8), "td3": (1, 8)}, "inconclusive"),  # neither shown, nor a difference under 0.5
    ({"ppo": (6, 8), "sac": (0, 8), "td3": (6, 8)}, "not supported"),  # TD3 collapses as often
    ({"ppo": (0, 8), "sac": (8, 8), "td3": (0, 8)}, "not supported"),
    ({"ppo": (0, 0), "sac": (0, 0), "td3": (0, 0)}, "not tested"),
])
def test_the_headline_claim_is_decided_over_prefixes_with_its_power(rates, joint):
    rows = rl_claims.collapse_at_dose_claims(_prefix_rows(rates), 10.0, family="a")
    assert _joint(rows).verdict == joint and len(rows) == 2 and {r.family for r in rows} == {"a"}
    if rates["ppo"][1]:
        assert all(r.sesoi == rl_claims.SESOI_RATE and r.power is not None for r in rows)
        sup, nsup = rows[0].power(0.0125, 1.0)
        assert sup > 0.3 and nsup > 0.3  # both ways, at 8 prefixes per arm and the family's level


def test_a_family_of_four_is_adjusted_together_and_unmatched_prefixes_are_said():
    rates = {"ppo": (5, 6), "sac": (1, 6), "td3": (0, 6)}
    rows = rl_claims.collapse_at_dose_claims(_prefix_rows(rates), 10.0, family="h", unmatched={"td3": 2})
    assert "TD3: 2 prefixes unmatched" in rows[1].reason
    alone = rl_claims.adjusted(rows)
    four = rl_claims.adjusted(rows + rl_claims.critical_dose_claims(_crit(ppo=LOW, sac=HIGH, td3=HIGH), sims=10, family="h"))
    assert four[0].p_for >= alone[0].p_for >= rows[0].p_for  # Holm over four comparisons, not two
    table = C.table(rows + [_joint(rl_claims.adjusted(rows))])
    assert table.verdict.iloc[-1] == _joint(alone).verdict  # the joint row is not adjusted again


def test_a_learner_the_spike_reached_no_update_of_is_not_tested():
    rows = rl_claims.collapse_at_dose_claims(_prefix_rows({"ppo": (8, 8), "sac": (0, 8), "td3": (0, 8)}), 10.0,
                                             spiked={"ppo": 20, "sac": 0, "td3": 40}, family="a")
    assert rows[0].verdict == "not tested" and "no update of SAC" in rows[0].reason and rows[0].family == "a"
    assert rows[1].verdict == "supported" and _joint(rows).verdict == "inconclusive"


def test_forks_at_different_knobs_are_never_pooled_into_one_prefix_row():
    forks = pd.DataFrame({"learner": "ppo", "pert_kind": "lr_spike", "pert_dose": 10.0, "prefix": "P",
                          "noise_after_fork": ["same", "same", 0.05, 0.05], "collapsed": [1.0, 1.0, 0.0, 0.0]})
    rows = O.by_prefix(forks)
    assert len(rows) == 2 and dict(zip(rows.noise_after_fork, rows.collapsed_prefix, strict=True)) == {"same": 1.0, 0.05: 0.0}


def test_paired_table_pairs_each_fork_with_the_control_of_its_knob():
    steps = STEPS
    curves = {"c_same": np.full(steps.size, 1000.0), "t_same": np.where(steps < EVENT, 1000.0, 100.0),
              "c_hi": np.full(steps.size, 1000.0), "t_hi": np.full(steps.size, 1000.0)}
    ds = xr.Dataset({"perf": (("run", "step"), np.stack(list(curves.values())))},
                    coords={"run": list(curves), "step": np.arange(steps.size),
                            "env_step": (("run", "step"), np.tile(steps, (len(curves), 1)))})
    table = pd.DataFrame({"spec_hash": list(curves), "learner": "sac", "seed": 0, "prefix_steps": 100,
                          "noise_after_fork": ["same", "same", -6.0, -6.0],
                          "pert_kind": ["none", "lr_spike", "none", "lr_spike"], "pert_dose": [np.nan, 10.0, np.nan, 10.0],
                          "pert_start": [np.nan, EVENT, np.nan, EVENT], "status": "ok"})
    out = O.paired_table(ds, table, horizon={"sac": H}, floors=dict.fromkeys(curves, 0.0),
                         prefix_of=dict.fromkeys(curves, "P")).set_index("spec_hash")
    assert out.loc["t_same", "control"] == "c_same" and out.loc["t_hi", "control"] == "c_hi"
    assert out.loc["t_same", "state"] == "collapsed" and out.loc["t_hi", "state"] == "no_drop"
    per = O.by_prefix(out.reset_index())
    assert dict(zip(per.noise_after_fork, per.collapsed_prefix, strict=True)) == {"same": 1.0, -6.0: 0.0}
