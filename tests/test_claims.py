"""Every rule of stabstudy.analysis.claims passes on data for the claim, fails on data against it,
says "not supported" when the effect is absent and the units are enough, and gives only
'not tested' / 'inconclusive' on missing or too few data."""

import numpy as np
import pytest

from stabstudy.analysis import claims as C
from stabstudy.analysis import claims_markdown

SRC = "our own"
rng = np.random.default_rng(0)
MISSING = ("not tested", "inconclusive")


def test_claim_rejects_unknown_verdict_source_and_direction():
    with pytest.raises(ValueError, match="valid verdicts: supported, not supported, inconclusive, not tested"):
        C.Claim("x", SRC, "yes", "")
    with pytest.raises(ValueError, match="source must start with"):
        C.Claim("x", "a blog", "supported", "")
    with pytest.raises(ValueError, match="valid: greater, less"):
        C.paired_difference("x", SRC, [1.0] * 3, [0.0] * 3, direction="up", sesoi=1.0)
    with pytest.raises(ValueError, match="below the claim's minimum"):
        C.paired_difference("x", SRC, [1.0] * 3, [0.0] * 3, direction="greater", sesoi=0.1, minimum=0.5)


@pytest.mark.parametrize("test", ["ttest", "wilcoxon"])
def test_paired_difference(test):
    control = rng.normal(0, 1, 12)
    up = control + 2 + rng.normal(0, 0.1, 12)
    assert C.paired_difference("up", SRC, up, control, direction="greater", sesoi=0.5, test=test).verdict == "supported"
    assert C.paired_difference("down", SRC, up, control, direction="less", sesoi=0.5,
                               test=test).verdict == "not supported"
    # no difference at all, with enough pairs: every effect of 0.5 or more is excluded
    flat = control + rng.normal(0, 0.1, 12)
    absent = C.paired_difference("x", SRC, flat, control, direction="greater", sesoi=0.5, test=test)
    assert absent.verdict == "not supported" and "every effect of 0.5 or more is excluded" in absent.meaning[1]
    # the same data without a smallest effect of interest cannot conclude absence
    bare = C.paired_difference("x", SRC, flat, control, direction="greater", test=test)
    assert bare.verdict == "inconclusive" and C.NO_SESOI in bare.reason
    assert C.paired_difference("x", SRC, [], [], direction="greater", sesoi=1.0, test=test).verdict == "not tested"
    few = C.paired_difference("x", SRC, [5.0, 6.0], [0.0, 0.0], direction="greater", sesoi=1.0, test=test)
    assert few.verdict == "inconclusive" and few.n == 2
    nan_pairs = C.paired_difference("x", SRC, [np.nan] * 5, [1.0] * 5, direction="greater", sesoi=1.0, test=test)
    assert nan_pairs.verdict == "not tested"


def test_an_at_least_claim_is_decided_on_both_sides_of_its_minimum():
    """'At least 2-fold' (log ratio): supported above log 2, not supported below it."""
    two = np.log(2.0)
    big = np.log(rng.uniform(3.5, 4.5, 8))
    small = np.log(rng.uniform(1.2, 1.4, 8))
    kw = dict(direction="greater", minimum=two, sesoi=two)
    assert C.paired_difference("x", SRC, big, np.zeros(8), **kw).verdict == "supported"
    assert C.paired_difference("x", SRC, small, np.zeros(8), **kw).verdict == "not supported"


def test_a_trivial_effect_is_not_supported_and_says_so():
    d = 0.05 + rng.normal(0, 0.01, 30)  # clearly above zero, clearly below the smallest effect of interest
    c = C.paired_difference("x", SRC, d, np.zeros(30), direction="greater", sesoi=0.5)
    assert c.p_for < 0.05 and c.p_against < 0.05 and c.verdict == "not supported"
    assert "smaller than the claim is about" in C.table([c]).reason[0]


def test_a_signed_rank_test_of_too_few_pairs_says_it_cannot_decide():
    up = C.paired_difference("x", SRC, [1.0, 2.0, 3.0], [0.0] * 3, direction="greater", sesoi=0.5, test="wilcoxon")
    assert up.verdict == "inconclusive" and "smallest attainable one-sided p is 0.125" in up.reason
    five = C.paired_difference("x", SRC, [1.0, 2.0, 3.0, 4.0, 5.0], [0.0] * 5, direction="greater", sesoi=0.5,
                               test="wilcoxon")
    assert five.verdict == "supported" and "cannot decide" not in five.reason


def test_the_vectorised_signed_rank_p_is_scipys_wilcoxon_p():
    from scipy import stats

    rng = np.random.default_rng(0)
    cases = [np.array([3.0, 0.0, 1.0, 1.0, -2.0]), np.array([0.0, 0.0, 2.0, 2.0, 2.0, -1.0, 5.0, 5.0]),
             rng.standard_normal(9), np.round(rng.standard_normal(13)), np.round(rng.standard_normal(20))]
    cases += [rng.integers(-3, 4, int(rng.integers(3, 11))).astype(float) for _ in range(30)]  # ties and zeros
    for d in cases:
        if np.all(d == 0):
            continue
        for alt in ("greater", "less", "two-sided"):
            assert C.signed_rank_p(d, alt) == stats.wilcoxon(d, alternative=alt).pvalue, (d, alt)


def test_difference_unpaired():
    a, b = rng.normal(5, 1, 10), rng.normal(0, 1, 10)
    assert C.difference("a>b", SRC, a, b, direction="greater", sesoi=1.0).verdict == "supported"
    assert C.difference("a<b", SRC, a, b, direction="less", sesoi=1.0).verdict == "not supported"
    same = C.difference("x", SRC, rng.normal(0, 1, 60), rng.normal(0, 1, 60), direction="greater", sesoi=1.0)
    assert same.verdict == "not supported"
    assert C.difference("x", SRC, a[:2], b[:2], direction="greater", sesoi=1.0).verdict in MISSING
    assert C.difference("x", SRC, [], b, direction="greater", sesoi=1.0).verdict in MISSING


def test_equivalence_is_tost_not_a_ci_containing_zero():
    ref = rng.normal(10, 0.01, 8)
    close = ref * (1 + rng.normal(0, 0.001, 8))
    assert C.equivalence("same", SRC, close, ref, margin=0.02).verdict == "supported"
    far = ref * 1.10 + rng.normal(0, 0.01, 8)
    assert C.equivalence("same", SRC, far, ref, margin=0.02).verdict == "not supported"
    # wide noise: the CI of the difference contains 0, yet equivalence is not shown
    noisy = ref + rng.normal(0, 2, 8)
    assert C.equivalence("same", SRC, noisy, ref, margin=0.02).verdict == "inconclusive"
    assert C.equivalence("same", SRC, [], [], margin=0.02).verdict == "not tested"
    assert C.equivalence("same", SRC, close[:2], ref[:2], margin=0.02).verdict == "inconclusive"
    unpaired = C.equivalence("same", SRC, close, ref, margin=0.02, paired=False)
    assert unpaired.verdict == "supported" and "Welch" in unpaired.test


def test_rates():
    assert C.rate_ci(0, 10) == pytest.approx((0.0, 0.3085), abs=1e-4)  # exact binomial
    assert np.isnan(C.rate_ci(0, 0)[0])
    kw = dict(direction="greater", sesoi=0.5)
    assert C.rate_comparison("more collapses", SRC, 9, 10, 0, 10, **kw).verdict == "supported"
    assert C.rate_comparison("more collapses", SRC, 0, 10, 9, 10, **kw).verdict == "not supported"
    # equal rates over enough runs exclude a difference of 0.5: the PPO 2/6 against a planned 0.9
    assert C.rate_comparison("more collapses", SRC, 3, 20, 3, 20, **kw).verdict == "not supported"
    assert C.rate_comparison("more collapses", SRC, 1, 2, 0, 2, **kw).verdict in MISSING
    assert C.rate_comparison("more collapses", SRC, 0, 0, 0, 5, **kw).verdict == "not tested"


def test_the_exact_unconditional_tests_never_reject_more_often_than_alpha_under_h0():
    """Their size, computed exactly at nuisance rates on the boundary of H0, is at most alpha,
    where the asymptotic score test's is not (6 runs an arm, a margin of 0.5)."""
    from scipy import stats
    from statsmodels.stats.proportion import test_proportions_2indep

    from stabstudy.analysis import proportions

    k = np.arange(7)
    reject = proportions.independent_table_p(6, 6, 0.5, "smaller") < 0.05
    with np.errstate(divide="ignore", invalid="ignore"):  # statsmodels' ratios of zero rates
        asym = np.array([[test_proportions_2indep(a, 6, b, 6, value=0.5, method="score", compare="diff",
                                                  alternative="smaller").pvalue < 0.05 for b in k] for a in k])
    sizes, asym_sizes = [], []
    for p0 in np.linspace(0.0, 0.5, 26):
        pmf = np.outer(stats.binom.pmf(k, 6, p0 + 0.5), stats.binom.pmf(k, 6, p0))
        sizes.append(pmf[reject].sum())
        asym_sizes.append(pmf[asym].sum())
    assert max(sizes) <= 0.05 + 1e-9 and max(asym_sizes) > 0.05
    paired = proportions.paired_table_p(12, -0.2, "larger") < 0.05  # H0: p10 - p01 <= -0.2
    for p01 in np.linspace(0.2, 0.6, 21):
        p10 = p01 - 0.2
        size = sum(stats.multinomial.pmf([a, b, 12 - a - b], 12, [p10, p01, 1 - p10 - p01])
                   for a in range(13) for b in range(13 - a) if paired[a, b])
        assert size <= 0.05 + 1e-9


def test_tangos_constrained_estimate_is_the_likelihood_maximum():
    from scipy.optimize import minimize_scalar

    from stabstudy.analysis import proportions

    for n10, n01, n, delta in ((7, 1, 20, 0.1), (0, 5, 12, -0.2), (3, 3, 30, 0.25), (0, 0, 10, 0.3)):
        def nll(p01, n10=n10, n01=n01, n=n, delta=delta):
            p10 = p01 + delta
            rest = 1 - p10 - p01
            return -(n10 * np.log(p10) + n01 * np.log(p01) + (n - n10 - n01) * np.log(rest))

        lo = max(0.0, -delta) + 1e-9
        hi = (1 - delta) / 2 - 1e-9
        best = minimize_scalar(nll, bounds=(lo, hi), method="bounded", options={"xatol": 1e-10}).x
        assert proportions.tango_mle(n10, n01, n, delta) == pytest.approx(best, abs=1e-5)
    # at a zero margin Tango's score statistic is McNemar's (n10 - n01) / sqrt(n10 + n01)
    assert proportions.tango_z(7, 2, 20, 0.0) == pytest.approx(5 / 3)


def test_paired_outcomes():
    control = [1] * 8 + [0] * 4  # collapse without the controller
    treated = [0] * 7 + [1] + [0] * 4  # with it: 7 prevented, none caused
    c = C.paired_outcomes("prevents", SRC, treated, control, sesoi=0.2)
    assert c.verdict == "supported" and c.n == 12 and c.effect == pytest.approx(1 / 12 - 8 / 12)
    assert c.p_for < 0.5 ** 7 * 2  # no less powerful than the exact McNemar test's 0.0078
    # the controller causing the collapses: evidence against the claim
    assert C.paired_outcomes("prevents", SRC, control, treated, sesoi=0.2).verdict == "not supported"
    # no effect over many pairs: a reduction of 0.2 or more is excluded
    same = [1] * 10 + [0] * 30
    assert C.paired_outcomes("prevents", SRC, same, same, sesoi=0.2).verdict == "not supported"
    # 8 agreeing pairs: 0.8^8 = 0.17 is the chance of no discordant pair if 0.2 of them disagreed
    assert C.paired_outcomes("prevents", SRC, control[:8], control[:8], sesoi=0.2).verdict == "inconclusive"
    assert C.paired_outcomes("prevents", SRC, [np.nan] * 3, [1, 1, 1], sesoi=0.2).verdict == "not tested"
    assert C.paired_outcomes("prevents", SRC, [], [], sesoi=0.2).verdict == "not tested"
    assert C.paired_outcomes("prevents", SRC, [0, 0], [1, 1], sesoi=0.2).verdict == "inconclusive"


def test_rate_below_a_budget():
    ok = C.rate_below("few false alarms", SRC, 0, 3000, 0.002, scale=1000)
    assert ok.verdict == "supported" and ok.effect == 0 and ok.ci[1] < 2
    bad = C.rate_below("few false alarms", SRC, 30, 3000, 0.002, scale=1000)
    assert bad.verdict == "not supported" and bad.effect == pytest.approx(10)
    assert C.rate_below("few false alarms", SRC, 1, 300, 0.002).verdict == "inconclusive"
    assert C.rate_below("few false alarms", SRC, 0, 0, 0.002).verdict == "not tested"


def test_correlation():
    x = np.arange(200.0)
    assert C.correlation("none", SRC, x, rng.normal(size=200), expect="none").verdict == "supported"
    assert C.correlation("none", SRC, x, x + rng.normal(size=200), expect="none").verdict == "not supported"
    # few points, no significant rho: absence of evidence is not evidence of absence
    assert C.correlation("none", SRC, x[:6], rng.normal(size=6), expect="none").verdict == "inconclusive"
    assert C.correlation("pos", SRC, x[:20], x[:20] ** 2, expect="positive", sesoi=0.3).verdict == "supported"
    assert C.correlation("neg", SRC, x[:20], x[:20] ** 2, expect="negative", sesoi=0.3).verdict == "not supported"
    unrelated = C.correlation("pos", SRC, x[:120], rng.normal(size=120), expect="positive", sesoi=0.3)
    assert unrelated.verdict == "not supported"
    assert C.correlation("pos", SRC, [], [], expect="positive", sesoi=0.3).verdict == "not tested"
    assert C.correlation("pos", SRC, [1, 2], [1, 2], expect="positive", sesoi=0.3).verdict == "inconclusive"
    with pytest.raises(ValueError, match="valid: positive, negative, none"):
        C.correlation("x", SRC, x, x, expect="up")


def test_a_universal_claim_fails_on_one_case_and_names_it():
    kw = dict(rel_tol=0.05)
    assert C.within_tolerance("slope", "textbook", [1.01, 0.99], [1.0, 1.0], **kw).verdict == "supported"
    one = C.within_tolerance("slope", "textbook", [1.01, 1.2], 1.0, labels=["depth 4", "depth 8"], **kw)
    assert one.verdict == "not supported" and "outside: depth 8" in one.reason
    assert C.within_tolerance("slope", "textbook", [np.nan], 1.0, **kw).verdict == "not tested"
    assert C.within_tolerance("slope", "textbook", [1.0], 1.0, min_n=3, **kw).verdict == "inconclusive"
    # a target near zero: a relative tolerance alone would ask for 1e-4 absolute precision
    near_zero = C.within_tolerance("decay", "textbook", [3e-3, 1.02], [1e-4, 1.0], abs_tol=0.01, **kw)
    assert near_zero.verdict == "supported"
    assert C.within_tolerance("decay", "textbook", [3e-3], [1e-4], **kw).verdict == "not supported"


def test_interval_above_with_a_bootstrap_distribution_has_p_values():
    above = rng.normal(0.8, 0.03, 2000)
    c = C.interval_above("auc", SRC, 0.8, (0.75, 0.85), 8, above=0.5, boot=above, sesoi=0.1, test="AUC")
    assert c.verdict == "supported" and c.p_for < 1e-3 and c.power is not None
    chance = C.interval_above("auc", SRC, 0.5, (0.45, 0.55), 8, above=0.5, boot=rng.normal(0.5, 0.03, 2000),
                              sesoi=0.1, test="AUC")
    assert chance.verdict == "not supported"
    assert C.interval_above("auc", SRC, 0.5, (0.1, 0.9), 0, above=0.5, test="AUC").verdict == "not tested"


def test_table_applies_holm_within_a_family_only():
    strong = C.Claim("a", SRC, "supported", "r", p_for=0.001, family="F")
    weak = C.Claim("b", SRC, "supported", "r", p_for=0.03, family="F")
    other = C.Claim("c", SRC, "supported", "r", p_for=0.04, family="F")
    untested = C.not_tested("d", SRC, "no runs", family="F")
    df = C.table([strong, weak, other, untested])
    assert list(df.verdict) == ["supported", "inconclusive", "inconclusive", "not tested"]
    assert df.p_for_holm.iloc[0] == pytest.approx(0.003)
    alone = C.table([C.Claim("b", SRC, "supported", "r", p_for=0.03, family="G")])
    assert alone.verdict.iloc[0] == "supported"


def test_no_verdict_changes_when_another_familys_rows_come_or_go():
    d = rng.normal(0.6, 0.5, 10)
    mine = [C.paired_difference(f"mine {i}", SRC, d + 0.05 * i, np.zeros(10), direction="greater", sesoi=0.2,
                                family="GPT: spikes") for i in range(3)]
    theirs = [C.paired_difference(f"theirs {i}", SRC, rng.normal(0.3, 1, 10), np.zeros(10), direction="greater",
                                  sesoi=0.2, family="RL: spikes") for i in range(6)]
    alone = C.table(mine, power=False).set_index("claim").verdict
    together = C.table(theirs + mine, power=False).set_index("claim").verdict
    assert (together[alone.index] == alone).all()
    legacy = [C.paired_difference(c.claim, SRC, d + 0.05 * i, np.zeros(10), direction="greater", sesoi=0.2)
              for i, c in enumerate(mine)]
    assert set(C.table(legacy).family) == {C.LEGACY_FAMILY}


def test_the_table_prints_the_power_at_the_familys_alpha_and_the_units_that_would_decide():
    from statsmodels.stats.power import TTestPower

    d = rng.normal(0.5, 1.0, 10)
    d = (d - d.mean()) / d.std(ddof=1) * 1.0 + 0.3  # sd 1, mean 0.3: neither shown nor excluded at 0.5
    rows = [C.paired_difference(f"r{i}", SRC, d, np.zeros(10), direction="greater", sesoi=0.5, family="F")
            for i in range(2)]
    df = C.table(rows)
    expected = TTestPower().power(effect_size=0.5, nobs=10, alpha=0.025, alternative="larger")
    assert df.power_supported.iloc[0] == pytest.approx(expected, rel=1e-6)
    assert df.power_not_supported.iloc[0] == pytest.approx(expected, rel=1e-6)  # symmetric at sd 1
    assert (df.verdict == "inconclusive").all() and "units would decide it" in df.reason.iloc[0]
    assert list(C.table(rows, power=False).power_supported.isna()) == [True, True]


def test_exploratory_rows_carry_no_verdict_and_no_adjustment():
    row = C.exploratory(C.difference("x", SRC, rng.normal(1, 1, 10), rng.normal(0, 1, 10), direction="greater",
                                     sesoi=0.5))
    conf = C.paired_difference("y", SRC, rng.normal(1, 0.2, 8), np.zeros(8), direction="greater", sesoi=0.5,
                               family="F")
    df = C.table([row, conf])
    assert list(df.role) == ["confirmatory", "exploratory"]
    assert df.verdict.iloc[1] == "" and np.isnan(df.p_for_holm.iloc[1])
    md = claims_markdown.to_markdown(df)
    assert "**Exploratory rows**" in md and md.count("**supported**") == 1


def test_holm_equals_statsmodels():
    from statsmodels.stats.multitest import multipletests

    rng = np.random.default_rng(3)
    for p in (rng.uniform(0, 0.2, 9), np.array([0.01, 0.01, 0.04, 0.5, 1.0]), np.array([0.03])):
        np.testing.assert_allclose(C.holm(p), multipletests(p, method="holm")[1], rtol=0, atol=1e-15)


def test_the_vectorized_bootstrap_gives_the_same_interval():
    d = np.random.default_rng(5).standard_normal(17)
    for stat in (np.mean, np.median):
        assert C._boot_ci((d,), stat, 0.95, 0, vectorized=True) == C._boot_ci((d,), stat, 0.95, 0)


def test_all_of_holds_only_when_every_part_does_and_carries_the_largest_p():
    rng = np.random.default_rng(0)
    up, flat = rng.normal(1.0, 0.2, 12), rng.normal(0.0, 0.2, 12)
    kw = dict(direction="greater", sesoi=0.5)
    yes = [C.paired_difference(f"up {i}", SRC, up + i * 0.1, np.zeros(12), **kw) for i in range(2)]
    no = C.paired_difference("down", SRC, -up, np.zeros(12), **kw)
    vague = C.paired_difference("vague", SRC, flat * 5 + 0.3, np.zeros(12), **kw)
    both = C.all_of("both", SRC, yes, ["a", "b"], n=12, test="intersection")
    assert both.verdict == "supported" and both.p_for == max(c.p_for for c in yes)
    assert both.reason == "a: supported; b: supported"
    assert C.all_of("x", SRC, [yes[0], no], ["a", "b"], n=12, test="t").verdict == "not supported"
    assert C.all_of("x", SRC, [yes[0], vague], ["a", "b"], n=12, test="t").verdict == "inconclusive"
    missing = [C.not_tested("a", SRC, "no data"), C.not_tested("b", SRC, "no data")]
    assert C.all_of("x", SRC, missing, ["a", "b"], n=0, test="t").verdict == "not tested"
    assert C.all_of("x", SRC, [], [], n=0, test="t").verdict == "inconclusive"
    # after Holm the joint falls with its weakest part
    weak = C.Claim("weak", SRC, "supported", "", n=12, test="t", p_for=0.03, family="F")
    strong = C.Claim("strong", SRC, "supported", "", n=12, test="t", p_for=1e-4, family="F")
    joint = C.all_of("joint", SRC, [weak, strong], ["weak", "strong"], n=12, test="t", family="F")
    verdicts = C.table([weak, strong, joint]).set_index("claim").verdict
    assert verdicts["weak"] == verdicts["joint"] == "inconclusive" and verdicts["strong"] == "supported"
    assert C.table([weak, strong, joint], alpha=0.2).set_index("claim").verdict["joint"] == "supported"
