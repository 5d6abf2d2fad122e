"""Notebook 01's power analysis: Boschloo power of "the treated rate exceeds every control's"."""

import numpy as np
import pytest

from stabstudy.analysis import stats
from stabstudy.analysis.studies.rl import power as D


def test_power_reproduces_the_planning_numbers_and_simulation_agrees_with_enumeration():
    # issue 26's planning numbers for 8 prefixes per algorithm: PPO's rate against SAC's and TD3's,
    # both one-sided tests at 0.025 (the two tests' alpha split) must reject
    assert D.boschloo_power(0.95, [0.05, 0.05], 8, alpha=0.025) == pytest.approx(0.988, abs=1e-3)
    assert D.boschloo_power(0.9, [0.1, 0.1], 8, alpha=0.025) == pytest.approx(0.889, abs=1e-3)
    exact = D.boschloo_power(0.8, [0.2, 0.3], 6)
    sim = D.boschloo_power(0.8, [0.2, 0.3], 6, method="simulation", sims=4000, seed=1)
    assert abs(sim - exact) < 3 * 0.5 / 4000 ** 0.5
    # equal rates reject at most alpha of the time; two controls need both to reject
    assert D.boschloo_power(0.5, 0.5, 8) <= 0.05
    assert D.boschloo_power(0.9, [0.1, 0.1], 6) < D.boschloo_power(0.9, 0.1, 6)


def test_prefixes_for_power_is_the_smallest_n_that_reaches_the_target():
    n, power = D.prefixes_for_power(0.9, [0.1, 0.1], target=0.8)
    assert power >= 0.8 > D.boschloo_power(0.9, [0.1, 0.1], n - 1)
    assert D.prefixes_for_power(0.6, 0.5, target=0.9, n_max=5) == (6, D.boschloo_power(0.6, 0.5, 5))
    t = D.power_table([(0.9, 0.1)], [4, 8])
    assert list(t.prefixes) == [4, 8] and t.power.is_monotonic_increasing


@pytest.mark.parametrize(("kw", "match"), [(dict(p_treated=1.5), "p_treated"), (dict(n_treated=0), "at least one"),
                                           (dict(method="bayes"), "exact, simulation"),
                                           (dict(n_controls=[3, 4, 5]), "3 entries")])
def test_power_rejects_impossible_inputs(kw, match):
    args = {"p_treated": 0.9, "p_controls": [0.1, 0.1], "n_treated": 4, **kw}
    with pytest.raises(ValueError, match=match):
        D.boschloo_power(**args)


def test_the_design_measures_a_critical_dose_by_its_sequence_of_doses():
    low, high = D.measured_bracket([2.0, 12.0, 500.0, 0.5, 10.0])
    # 2: x10 collapsed -> 3.16 collapsed -> 1.78 survived: (1.78, 3.16]; 12: x10 survived -> 31.6 collapsed -> 17.8;
    # 500: survived 10, 31.6, 56.2: above every dose; 0.5: collapsed at 10, 3.16, 1.78: (1, 1.78] (the control: 1)
    np.testing.assert_allclose(low, [1.78, 10.0, 56.2, 1.0, 5.62])
    np.testing.assert_allclose(high, [3.16, 17.8, np.inf, 1.78, 10.0])
    # never forked above a dose it collapsed at
    lo, hi = D.measured_bracket([9.0], start=10.0, steps=(0.5, 0.25, 0.125))
    assert (lo[0], hi[0]) <= (9.0, 10.0) and lo[0] < 9.0 <= hi[0]


def test_the_critical_dose_rule_has_power_where_the_doses_differ_and_decides_neither_way_by_chance():
    assert stats.smallest_p(3, 3) == pytest.approx(0.05)
    assert D.critical_dose_power(3, 3, alpha=0.025) == {"supported": 0.0, "not supported": 0.0}  # 1/20 > 0.025
    p4 = D.critical_dose_power(4, 4, alpha=0.025, sims=200)["supported"]
    p8 = D.critical_dose_power(8, 8, alpha=0.025, sims=200)["supported"]
    assert 0 < p4 < p8 and p8 > 0.8
    same = D.critical_dose_power(8, 8, medians=(20.0, 20.0), alpha=0.025, sims=200)
    assert same["supported"] < 0.1
    tight = D.critical_dose_power(12, 12, medians=(20.0, 20.0), sd=0.05, alpha=0.025, sims=100)
    assert tight["not supported"] > 0.5  # equal doses, little spread: within x2 is shown


def test_sign_test_power_is_exact():
    # 6 prefixes all up is p = 1/64 < 0.05, 5 of 6 is 7/64 > 0.05: power = P(6 of 6 up)
    assert D.sign_test_power(6, 0.9) == pytest.approx(0.9**6)
    assert D.sign_test_power(4, 1.0) == 0.0  # 1/16 > 0.05
    with pytest.raises(ValueError, match="p_up"):
        D.sign_test_power(6, 1.2)
