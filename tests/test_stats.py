"""Reliability statistics against hand computations."""

import math

import numpy as np
import pytest
import xarray as xr

from stabstudy.analysis import stats


def test_cvar_hand_computed():
    v = np.arange(1, 21, dtype=float)  # 20 values
    assert stats.cvar(v, 0.05) == 1.0  # worst 1 of 20
    assert stats.cvar(v, 0.10) == 1.5
    assert stats.cvar(v, 0.10, "upper") == 19.5
    assert stats.cvar([3.0], 0.05) == 3.0
    assert math.isnan(stats.cvar([np.nan]))


def test_iqm_and_bootstrap_ci():
    v = np.array([0.0, 1, 2, 3, 4, 5, 6, 100])
    assert stats.iqm(v) == pytest.approx(np.mean([2, 3, 4, 5]))
    rng = np.random.default_rng(0)
    res = stats.iqm_ci({"a": rng.normal(10, 1, 20), "b": rng.normal(0, 1, (10, 2)), "one": [5.0]}, reps=500)
    lo, hi = res["a"][1], res["a"][2]
    assert lo < res["a"][0] < hi and 9 < lo and hi < 11
    assert res["b"][1] < 0 < res["b"][2]
    assert res["one"] == (5.0, 5.0, 5.0)
    # a task left with one finite run (the others failed) is a constant in every resample
    mixed = np.array([[1.0, 5.0], [2.0, np.nan], [3.0, np.nan], [4.0, np.nan]])
    point, lo, hi = stats.iqm_ci({"m": mixed}, reps=500)["m"]
    assert point == stats.iqm([1.0, 2.0, 3.0, 4.0, 5.0])
    assert lo < point < hi and 1.0 <= lo and hi <= 5.0
    # with the constant 5.0 in every resample, the IQM of {x1..x4, 5} never falls below IQM(1,1,1,1,5)
    assert lo >= stats.iqm([1.0, 1.0, 1.0, 1.0, 5.0])
    # deterministic given the seed
    assert stats.iqm_ci({"a": np.arange(10.0)}, reps=200, seed=1) == stats.iqm_ci({"a": np.arange(10.0)}, reps=200, seed=1)


def test_across_time_metrics():
    steady = np.arange(20, dtype=float) * 2  # constant differences
    assert stats.dispersion_across_time(steady, window=5) == 0.0
    assert stats.short_term_risk(steady) == 2.0
    assert stats.long_term_risk(steady) == 0.0
    saw = np.tile([0.0, 4.0], 10)  # differences alternate +4, -4
    # IQR of a window of 5 alternating +-4 values: quantiles of {-4,-4,4,4,4} or {4,4,-4,-4,-4} -> 8
    assert stats.dispersion_across_time(saw, window=5) == 8.0
    assert stats.short_term_risk(saw) == -4.0
    # drawdowns: 0,4,0,4,... -> upper 5% of 20 values = the single worst = 4
    assert stats.long_term_risk(saw) == 4.0
    da = xr.DataArray(np.stack([steady, saw]), dims=["run", "step"])
    np.testing.assert_allclose(stats.long_term_risk(da).values, [0.0, 4.0])


def test_across_runs_metrics():
    x = xr.DataArray([[0.0, 1, 2], [0.0, 2, 4], [0.0, 3, 6], [0.0, 4, 8]], dims=["run", "step"],
                     coords={"step": [0, 10, 20]})
    dr = stats.dispersion_across_runs(x)
    np.testing.assert_allclose(dr.values, [0.0, 1.5, 3.0])  # IQR of {1,2,3,4} = 3.25-1.75
    # NaN-only steps are dropped; smoothing with width 3 averages neighbours
    xn = x.reindex(step=[0, 5, 10, 20])
    assert list(stats.dispersion_across_runs(xn).step.values) == [0, 10, 20]
    sm = stats.dispersion_across_runs(x, smooth=3)
    assert sm.sel(step=10) == pytest.approx(1.5)
    assert stats.risk_across_runs([5.0, 1.0, 3.0]) == 1.0


def test_stability_score_ignores_level():
    low_steady = np.linspace(0, 10, 30)
    high_steady = np.linspace(0, 1000, 30)
    assert stats.stability_score(low_steady, scale=1000.0) == 1.0
    assert stats.stability_score(high_steady, scale=1000.0) == 1.0
    steps = np.arange(30) * 10
    collapsed = np.r_[np.linspace(0, 1000, 15), np.zeros(15)]
    base = np.mean(np.linspace(0, 1000, 15)[-3:])  # pre-event baseline
    s = stats.stability_score(collapsed, event_step=150, scale=base, steps=steps)
    assert s == pytest.approx(0.0)  # lost the whole scale and never recovered
    s1 = stats.stability_score(collapsed, event_step=150, scale=2000.0, steps=steps)
    assert s1 == pytest.approx(1 - 0.5 * base / 2000 - 0.5)
    dip = np.r_[np.linspace(0, 1000, 15), [500.0], np.full(14, 1000.0)]
    s_dip = stats.stability_score(dip, event_step=150, scale=1000.0, steps=steps)
    # drawdown (baseline - 500)/1000; back within 0.1*scale of the baseline 10 steps later (of 140)
    assert s_dip == pytest.approx(1 - 0.5 * (base - 500) / 1000 - 0.5 * 10 / 140)


def test_stability_score_is_nan_without_data_around_the_event():
    """Missing is not perfect: a run with nothing after the event (it stopped, or was never
    evaluated there) or nothing before it has no score, not 1.0."""
    steps = np.arange(30) * 10
    stopped = np.r_[np.linspace(0, 1000, 15), np.full(15, np.nan)]
    assert math.isnan(stats.stability_score(stopped, event_step=150, scale=1000.0, steps=steps))
    no_baseline = np.r_[np.full(15, np.nan), np.full(15, 1000.0)]
    assert math.isnan(stats.stability_score(no_baseline, event_step=150, scale=1000.0, steps=steps))
    da = xr.DataArray(np.stack([stopped, np.r_[np.linspace(0, 1000, 15), np.full(15, 1000.0)]]), dims=["run", "step"],
                      coords={"step": steps})
    out = stats.stability_score(da, event_step=150, scale=1000.0).values
    assert math.isnan(out[0]) and out[1] == 1.0  # a flat run after the event never left the band


def test_collapse_probability_and_critical_dose():
    p, lo, hi = stats.collapse_probability([1, 0, 1, 1, np.nan])
    assert p == 0.75 and lo < 0.75 < hi
    doses = np.repeat([1, 3, 10, 30, 100], 4).astype(float)
    coll = np.r_[[0, 0, 0, 0], [0, 0, 0, 1], [0, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]]
    cd = stats.critical_dose(doses, coll)
    assert cd.method == "logistic" and 3 < cd.dose < 30
    never = stats.critical_dose(doses, np.zeros_like(doses))
    assert math.isnan(never.dose) and "never reaches" in never.message
    interp = stats.critical_dose([1, 10, 100], [0, 0.0, 1])  # two classes -> logistic
    assert 10 < interp.dose <= 100
    always = stats.critical_dose([2, 4], [1, 1])
    assert always.dose == 2 and "at most" in always.message


def test_bootstrap_band():
    x = xr.DataArray([[0.0, 1.0, np.nan], [2.0, 1.0, 5.0], [4.0, 1.0, np.nan]], dims=["run", "env_step"],
                     coords={"env_step": [0, 10, 20]})
    b = stats.bootstrap_band(x, reps=500)
    np.testing.assert_allclose(b.center.values, [2.0, 1.0, 5.0])
    np.testing.assert_allclose(b.n.values, [3, 3, 1])
    assert 0.0 <= b.low.values[0] < 2.0 < b.high.values[0] <= 4.0
    assert b.low.values[1] == b.high.values[1] == 1.0  # no spread
    assert b.low.values[2] == b.high.values[2] == 5.0  # one run: no band
    assert list(b.env_step.values) == [0, 10, 20]
