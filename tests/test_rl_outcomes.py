"""Notebook 01's outcomes against the paired control, the prefix as the unit, and manipulation checks."""

import numpy as np
import pandas as pd
import pytest
import xarray as xr

from stabstudy.analysis import claims as C
from stabstudy.analysis.studies import rl_outcomes as O

STEPS = np.arange(0, 21) * 1000.0  # evaluations every 1,000 env steps


def curve(values, steps=STEPS):
    return xr.DataArray(np.asarray(values, float), dims="env_step", coords={"env_step": np.asarray(steps)})


CONTROL = curve(np.full(STEPS.size, 1000.0))
EVENT, H = 5000.0, 10_000.0  # window [5000, 15000]


def test_learning_horizon_is_where_the_prefix_reached_80_percent_of_its_gain():
    rising = curve(np.minimum(STEPS / 5, 1000.0))  # 0 -> 1000 by env step 5000, then flat
    assert O.learning_horizon(rising) == 4000.0
    assert np.isnan(O.learning_horizon(curve(np.full(STEPS.size, 5.0))))  # learned nothing: no horizon
    per, H_by = O.horizons(xr.concat([rising, rising.assign_coords(env_step=STEPS * 2)], "run", join="outer").assign_coords(
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
    assert O.paired_outcome(slow, CONTROL, EVENT, 4000.0, floor=0.0)["state"] == "collapsed"
    assert O.paired_outcome(slow, CONTROL, EVENT, H, floor=0.0)["state"] == "recovered"


def test_a_run_that_diverged_at_the_spike_is_at_its_floor_after_it_never_its_pre_spike_returns():
    before = STEPS <= EVENT
    stopped = curve(np.full(before.sum(), 1000.0), STEPS[before])  # evaluations end at the spike
    res = O.paired_outcome(stopped, CONTROL, EVENT, H, floor=-300.0, diverged_at=EVENT)
    assert res["state"] == "collapsed" and res["damage"] == pytest.approx(-1300.0)
    # the same run not marked diverged ends before the horizon: no verdict, never "no damage"
    res = O.paired_outcome(stopped, CONTROL, EVENT, H, floor=-300.0)
    assert res["state"] == "no_verdict" and np.isnan(res["damage"]) and "treated" in res["reason"]


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
    icc, deff = O.design_effect(ppo.damage, ppo.prefix)
    assert icc > 0.99 and deff == pytest.approx(1 + 5 * icc)
    est, lo, hi = O.prefix_bootstrap(ppo.damage, ppo.prefix, reps=500)
    naive = O.prefix_bootstrap(ppo.damage, np.arange(len(ppo)), reps=500)  # every fork its own unit
    assert est == pytest.approx(-667.67, abs=0.01) and (hi - lo) > 1.5 * (naive[2] - naive[1])


def test_prefix_critical_doses_and_their_comparison():
    def prefix(learner, name, collapses_from):
        return [{"learner": learner, "prefix": name, "pert_dose": d, "collapsed_prefix": float(d >= collapses_from)}
                for d in (3.0, 10.0, 30.0, 100.0)]
    rows = pd.DataFrame(prefix("ppo", "p0", 30.0) + prefix("ppo", "p1", np.inf) + prefix("ppo", "p2", 3.0))
    crit = O.prefix_critical_doses(rows).set_index("prefix")
    assert crit.loc["p0", "where"] == "bracketed" and crit.loc["p0", "dose"] == pytest.approx(np.sqrt(300.0))
    assert crit.loc["p1", "dose"] == np.inf and crit.loc["p1", "where"] == "above the grid"
    assert crit.loc["p2", "where"] == "below the grid" and crit.loc["p2", "dose"] == 3.0
    low, high = [3.0, 5.5, 17.3, 17.3], [54.8, np.inf, np.inf, 54.8]
    assert O.critical_dose_claim("lower", "our own", low, high).verdict == "supported"
    assert O.critical_dose_claim("lower", "our own", high, low).verdict == "not supported"
    assert O.critical_dose_claim("lower", "our own", low[:2], high).verdict == "inconclusive"
    assert O.critical_dose_claim("lower", "our own", [], high).verdict == "not tested"


def _run(env_steps, **channels):
    return xr.Dataset({k: ("step", np.asarray(v, float)) for k, v in channels.items()},
                      coords={"step": np.arange(len(env_steps)), "env_step": ("step", np.asarray(env_steps))})


def test_a_spike_that_no_update_fell_into_is_not_tested_and_one_that_did_stays():
    claim = C.rate_comparison("collapses", "source paper", 3, 3, 0, 3)
    before_learning = _run([2000, 2000, 10_001, 10_002], update_norm=[np.nan, np.nan, 1, 1])  # learning_starts 10k
    n = O.spiked_updates(before_learning, 2000, 256)
    assert n["updates"] == 0
    out = O.checked(claim, n["updates"] > 0, "no gradient update in the spike window")
    assert out.verdict == "not tested" and "manipulation check failed" in out.reason
    trained = _run([1900, 2000, 2001, 2002, 2300], update_norm=[1, 1, 1, 1, 1], update_norm_actor=[1, np.nan, 1, np.nan, 1])
    n = O.spiked_updates(trained, 2000, 256)
    assert n == {"updates": 3, "actor_updates": 1}
    assert O.checked(claim, n["updates"] > 0, "") is claim


def test_a_knob_that_did_not_change_the_policys_noise_is_caught():
    control = _run([100, 200, 300], ent_coef=[0.1, 0.1, 0.1])
    assert O.knob_changed(_run([100, 200, 300], ent_coef=[0.3, 0.3, 0.3]), control, "sac", 300, lookback=250)[0] is True
    same, reason = O.knob_changed(_run([100, 200, 300], ent_coef=[0.1, 0.1, 0.101]), control, "sac", 300, lookback=250)
    assert same is False and "did not change ent_coef" in reason
    assert O.knob_changed(control, control, "td3", 300, lookback=250)[0] is None
    missing, reason = O.knob_changed(_run([100], loss=[1.0]), control, "sac", 300, lookback=250)
    assert missing is False and "no ent_coef" in reason


def _prefix_rows(rates):
    return pd.DataFrame([{"learner": a, "pert_kind": "lr_spike", "pert_dose": 10.0, "prefix": f"{a}{i}",
                          "collapsed_prefix": float(i < k)} for a, (k, n) in rates.items() for i in range(n)])


@pytest.mark.parametrize(("rates", "joint"), [
    ({"ppo": (8, 8), "sac": (0, 8), "td3": (0, 8)}, "supported"),
    ({"ppo": (8, 8), "sac": (0, 8), "td3": (7, 8)}, "inconclusive"),
    ({"ppo": (0, 8), "sac": (8, 8), "td3": (0, 8)}, "not supported"),
    ({"ppo": (0, 0), "sac": (0, 0), "td3": (0, 0)}, "not tested"),
])
def test_the_headline_claim_is_decided_over_prefixes_with_its_power(rates, joint):
    rows = O.collapse_at_dose_claims(_prefix_rows(rates), 10.0)
    assert rows[-1].verdict == joint and len(rows) == 3
    if rates["ppo"][1]:
        assert all("power" in r.reason for r in rows[:2])


def test_a_learner_the_spike_reached_no_update_of_is_not_tested():
    rows = O.collapse_at_dose_claims(_prefix_rows({"ppo": (8, 8), "sac": (0, 8), "td3": (0, 8)}), 10.0,
                                     spiked={"ppo": 20, "sac": 0, "td3": 40})
    assert rows[0].verdict == "not tested" and "no update of SAC" in rows[0].reason
    assert rows[1].verdict == "supported" and rows[2].verdict == "inconclusive"
