"""Notebook 01's power analysis: Boschloo power of "the treated rate exceeds every control's"."""

import pytest

from stabstudy.analysis.studies import rl_design as D


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
