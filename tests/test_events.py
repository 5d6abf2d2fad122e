"""Collapse / recovery / drawdown on constructed curves (hand-computed answers)."""

import math

import numpy as np
import pytest
import xarray as xr

from stabstudy.analysis import events


def curve(values, steps=None):
    steps = np.arange(len(values)) * 10 if steps is None else np.asarray(steps)
    return xr.DataArray(np.asarray(values, dtype=float), dims=["step"], coords={"step": steps})


def test_max_drawdown_hand_computed():
    x = [0, 5, 3, 8, 2, 6]
    assert events.max_drawdown(np.array(x)) == 6.0  # peak 8 -> 2
    assert events.max_drawdown(np.arange(5.0)) == 0.0
    # losses: a rise is a drawdown
    assert events.max_drawdown(np.array([3.0, 1.0, 4.0, 2.0]), higher_is_better=False) == 3.0
    # start: running max restarts at the event
    assert events.max_drawdown(curve(x), start=40) == 0.0  # [2, 6]
    assert events.max_drawdown(np.array(x), relative_to=12.0) == 0.5


def test_max_drawdown_ignores_nan_and_maps_runs():
    x = curve([0, np.nan, 5, np.nan, 1])
    assert events.max_drawdown(x) == 4.0
    two = xr.concat([curve([0, 5, 1]), curve([1, 2, 3])], dim="run").assign_coords(run=[0, 1])
    out = events.max_drawdown(two)
    assert out.dims == ("run",)
    np.testing.assert_allclose(out.values, [4.0, 0.0])


def test_recovery_time_loss_spike_example():
    loss = np.r_[np.ones(100), 3 * np.ones(10), 1.05 * np.ones(20)]
    assert events.recovery_time(loss, 100, higher_is_better=False) == 10.0
    # never leaves the band: nothing to recover from, which is not "recovered at once"
    assert math.isnan(events.recovery_time(np.ones(50), 20, higher_is_better=False))
    assert events.recovery_state(np.ones(50), 20, higher_is_better=False)[0] == "never_left"
    assert events.recovery_state(loss, 100, higher_is_better=False) == ("recovered", 10.0)
    # never comes back
    assert math.isinf(events.recovery_time(np.r_[np.ones(20), 5 * np.ones(10)], 20, higher_is_better=False))
    # no baseline, or no point after the event
    assert math.isnan(events.recovery_time(np.ones(10), 0))
    assert events.recovery_state(np.ones(10), 20)[0] == "undefined"
    assert events.recovery_state(np.r_[np.ones(20), 5 * np.ones(10)], 20, higher_is_better=False)[0] == "not_recovered"


def test_recovery_time_returns_with_step_axis_and_abs_tol():
    # eval every 10 steps; return 100 before the event at step 50, drop to 20, back to 95 at step 90
    x = curve([0, 50, 90, 100, 100, 20, 30, 60, 80, 95, 100])
    assert events.recovery_time(x, 50) == 40.0  # band: >= 90
    assert events.recovery_time(x, 50, abs_tol=25) == 30.0  # band: >= 75 -> step 80
    ev = xr.DataArray([50, 50], dims=["run"])
    two = xr.concat([x, x], dim="run")
    np.testing.assert_allclose(events.recovery_time(two, ev).values, [40.0, 40.0])


def test_collapse_detects_irreversible_drop_not_transient_dip():
    # learns from -300 to 700, perturbation at step 50
    collapsed = curve([-300, 100, 400, 700, 700, -200, -250, -250, -240, -260])
    transient = curve([-300, 100, 400, 700, 700, -200, 500, 680, 700, 710])
    noisy = curve([-300, 100, 400, 700, 700, 650, 720, 690, 700, 710])
    r = events.collapse(collapsed, 50)
    assert r.collapsed and r.drop_step == 50 and r.baseline == pytest.approx(600.0)
    assert r.floor == -300 and r.min_level == pytest.approx((-260 + 300) / 900)
    assert not events.collapse(transient, 50).collapsed
    assert events.collapse(transient, 50).drop_step == 50  # it dropped, but recovered
    assert not events.collapse(noisy, 50).collapsed
    # with a short window the transient dip counts as collapse only if recovery is slower than the window
    assert events.collapse(curve([-300, 100, 400, 700, 700, -200, -200, -200, 700, 700]), 50, window=20).collapsed
    assert not events.collapse(curve([-300, 100, 400, 700, 700, -200, -200, -200, 700, 700]), 50, window=40).collapsed


def test_collapse_negative_returns_and_no_learning():
    # Pendulum-like: -1500 untrained, -200 before the event, back to -1400 after
    assert events.collapse(curve([-1500, -800, -200, -200, -1400, -1450, -1400]), 40).collapsed
    assert not events.collapse(curve([-1500, -800, -200, -200, -250, -210, -190]), 40).collapsed
    # nothing learned before the event: the gain is clipped at min_gain
    flat = curve([100, 100, 100, 100, 10, 10])
    assert events.collapse(flat, 40).collapsed
    assert not events.collapse(flat, 40, min_gain=1000).collapsed  # a 90-point drop is < 50% of 1000
    assert events.collapse(flat, 40, min_gain=100).collapsed


def test_is_collapsed_over_runs_with_nan_event():
    a = curve([-300, 100, 700, 700, -250, -250])
    b = curve([-300, 100, 700, 700, 690, 700])
    two = xr.concat([a, b, a], dim="run").assign_coords(run=[0, 1, 2])
    ev = xr.DataArray([30.0, 30.0, np.nan], dims=["run"], coords={"run": [0, 1, 2]})
    out = events.is_collapsed(two, ev)
    assert out.values[0] == 1.0 and out.values[1] == 0.0 and np.isnan(out.values[2])


def test_collapse_states_and_outcome():
    r = events.collapse(curve([-300, 100, 400, 700, 700, -200, -250, -250, -240, -260]), 50)
    assert (r.state, r.outcome) == ("collapsed", 1.0)
    r = events.collapse(curve([-300, 100, 400, 700, 700, -200, 500, 680, 700, 710]), 50)
    assert (r.state, r.outcome) == ("recovered", 0.0)
    r = events.collapse(curve([-300, 100, 400, 700, 700, 650, 720, 690, 700, 710]), 50)
    assert (r.state, r.outcome) == ("no_drop", 0.0)
    assert r.to_dict()["state"] == "no_drop" and r.to_dict()["baseline"] == pytest.approx(600.0)


def test_irreversible_needs_an_observation_window_after_the_dip():
    late_dip = curve([-300, 100, 400, 700, 700, 690, 700, 710, 700, -200])  # dip at the last evaluation
    r = events.collapse(late_dip, 50)
    assert r.state == "unobserved" and np.isnan(r.outcome) and not r.collapsed and r.drop_step == 90
    two_after = curve([-300, 100, 400, 700, 700, 690, 700, -200, -210, -220])  # two evaluations after the dip
    assert events.collapse(two_after, 50, min_after=2).state == "collapsed"
    assert events.collapse(two_after, 50, min_after=3).state == "unobserved"
    # a window the data do not cover cannot show that the run stayed down for the whole window
    assert events.collapse(two_after, 50, window=100).state == "unobserved"
    assert events.collapse(two_after, 50, window=20).state == "collapsed"
    with pytest.raises(ValueError, match="min_after"):
        events.collapse(two_after, 50, min_after=0)


def test_no_data_after_the_event_is_no_verdict():
    r = events.collapse(curve([-300, 100, 700, 700]), 50)
    assert r.state == "no_data" and np.isnan(r.outcome)
    assert events.collapse(curve([np.nan, np.nan]), 5).state == "no_data"


def test_runs_broken_before_the_event_are_pre_event_invalid():
    ok = curve([-300, 100, 700, 700, -250, -250, -250])
    # training stopped as diverged before the event: no verdict, counted separately
    r = events.collapse(curve([-300, 100, 700, np.nan, np.nan, np.nan, np.nan]), 40, diverged_at=25)
    assert r.state == "pre_event_invalid" and r.pre_event_invalid and np.isnan(r.outcome)
    # diverged after the event: a collapse
    r = events.collapse(ok, 40, diverged_at=45)
    assert r.state == "diverged" and r.outcome == 1.0 and r.collapsed
    # a non-finite value before the event
    assert events.collapse(curve([-300, np.inf, 700, 700, -250, -250, -250]), 40).state == "pre_event_invalid"
    # already collapsed before the event: the baseline lost more than half of the best pre-event gain
    already = curve([-300, 700, 700, -200, -250, -250, -250, -250])
    assert events.collapse(already, 60).state == "pre_event_invalid"
    assert events.collapse(ok, 40).state == "collapsed"


def test_is_collapsed_gives_nan_without_a_verdict():
    late = curve([-300, 100, 700, 700, 700, -250])
    two = xr.concat([late, late], dim="run").assign_coords(run=[0, 1])
    ev = xr.DataArray([30.0, 50.0], dims=["run"], coords={"run": [0, 1]})
    out = events.is_collapsed(two, ev)
    assert np.isnan(out.values[0]) and np.isnan(out.values[1])  # one dip at the last point; no point after 50
