"""Every rule of stabstudy.analysis.claims passes on data for the claim, fails on data
against it, and gives only 'not tested' / 'inconclusive' on missing or too few data."""

import numpy as np
import pytest

from stabstudy.analysis import claims as C

SRC = "our own"
rng = np.random.default_rng(0)
MISSING = ("not tested", "inconclusive")


def test_claim_rejects_unknown_verdict_and_source():
    with pytest.raises(ValueError, match="valid verdicts: supported, not supported, inconclusive, not tested"):
        C.Claim("x", SRC, "yes", "")
    with pytest.raises(ValueError, match="source must start with"):
        C.Claim("x", "a blog", "supported", "")


@pytest.mark.parametrize("test", ["ttest", "wilcoxon"])
def test_paired_difference(test):
    control = rng.normal(0, 1, 8)
    up = control + 2 + rng.normal(0, 0.1, 8)
    assert C.paired_difference("up", SRC, up, control, direction="greater", test=test).verdict == "supported"
    assert C.paired_difference("down", SRC, up, control, direction="less", test=test).verdict == "not supported"
    zero = C.paired_difference("x", SRC, control, control, direction="greater", test=test)
    assert zero.verdict == "inconclusive"  # no difference is no evidence either way
    assert C.paired_difference("x", SRC, [], [], direction="greater", test=test).verdict == "not tested"
    few = C.paired_difference("x", SRC, [5.0, 6.0], [0.0, 0.0], direction="greater", test=test)
    assert few.verdict == "inconclusive" and few.n == 2
    nan_pairs = C.paired_difference("x", SRC, [np.nan] * 5, [1.0] * 5, direction="greater", test=test)
    assert nan_pairs.verdict == "not tested"


def test_a_signed_rank_test_of_too_few_pairs_says_it_cannot_decide():
    up = C.paired_difference("x", SRC, [1.0, 2.0, 3.0], [0.0, 0.0, 0.0], direction="greater", test="wilcoxon")
    assert up.verdict == "inconclusive" and "smallest attainable one-sided p is 0.125" in up.reason
    five = C.paired_difference("x", SRC, [1.0, 2.0, 3.0, 4.0, 5.0], [0.0] * 5, direction="greater", test="wilcoxon")
    assert five.verdict == "supported" and "cannot decide" not in five.reason
    t3 = C.paired_difference("x", SRC, [1.0, 2.1, 3.0], [0.0, 0.0, 0.0], direction="greater", test="ttest")
    assert "cannot decide" not in t3.reason  # a t-test of 3 pairs can reach any p


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
    assert C.difference("a>b", SRC, a, b, direction="greater").verdict == "supported"
    assert C.difference("a<b", SRC, a, b, direction="less").verdict == "not supported"
    assert C.difference("x", SRC, a[:2], b[:2], direction="greater").verdict in MISSING
    assert C.difference("x", SRC, [], b, direction="greater").verdict in MISSING


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
    assert C.rate_comparison("more collapses", SRC, 9, 10, 0, 10).verdict == "supported"
    assert C.rate_comparison("more collapses", SRC, 0, 10, 9, 10).verdict == "not supported"
    assert C.rate_comparison("more collapses", SRC, 1, 2, 0, 2).verdict in MISSING
    assert C.rate_comparison("more collapses", SRC, 0, 0, 0, 5).verdict == "not tested"


def test_correlation_none_needs_an_interval_inside_the_margin():
    x = np.arange(200.0)
    assert C.correlation("none", SRC, x, rng.normal(size=200), expect="none").verdict == "supported"
    assert C.correlation("none", SRC, x, x + rng.normal(size=200), expect="none").verdict == "not supported"
    # few points, no significant rho: absence of evidence is not evidence of absence
    few = C.correlation("none", SRC, x[:6], rng.normal(size=6), expect="none")
    assert few.verdict == "inconclusive"
    assert C.correlation("pos", SRC, x[:20], x[:20] ** 2, expect="positive").verdict == "supported"
    assert C.correlation("neg", SRC, x[:20], x[:20] ** 2, expect="negative").verdict == "not supported"
    assert C.correlation("pos", SRC, [], [], expect="positive").verdict == "not tested"
    assert C.correlation("pos", SRC, [1, 2], [1, 2], expect="positive").verdict == "inconclusive"


def test_correlation_with_tied_values_warns_nothing_and_stays_inconclusive():
    """Five tied values: many resamples are constant, rho undefined there; no warning reaches the
    notebook, and an undefined interval is no evidence of 'no correlation'."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = C.correlation("none", SRC, [0, 0, 0, 0, 1], [1, 2, 3, 4, 5], expect="none")
    assert c.verdict == "inconclusive" and "undefined" in c.reason


def test_within_tolerance():
    assert C.within_tolerance("slope", "textbook", [1.01, 0.99], [1.0, 1.0], rel_tol=0.05).verdict == "supported"
    assert C.within_tolerance("slope", "textbook", [1.2, 0.7], 1.0, rel_tol=0.05).verdict == "not supported"
    assert C.within_tolerance("slope", "textbook", [1.01, 1.2], 1.0, rel_tol=0.05).verdict == "inconclusive"
    assert C.within_tolerance("slope", "textbook", [np.nan], 1.0, rel_tol=0.05).verdict == "not tested"
    assert C.within_tolerance("slope", "textbook", [1.0], 1.0, rel_tol=0.05, min_n=3).verdict == "inconclusive"


def test_table_applies_holm_and_downgrades_verdicts_that_rest_on_p():
    strong = C.Claim("a", SRC, "supported", "r", p=0.001, p_decides=True)
    weak = C.Claim("b", SRC, "supported", "r", p=0.03, p_decides=True)
    other = C.Claim("c", SRC, "supported", "r", p=0.04, p_decides=True)
    untested = C.not_tested("d", SRC, "no runs")
    df = C.table([strong, weak, other, untested])
    assert list(df.verdict) == ["supported", "inconclusive", "inconclusive", "not tested"]
    assert df.p_holm.iloc[0] == pytest.approx(0.003)
    md = C.to_markdown(df)
    assert md.count("\n") == 6 and "**not tested**" in md and "Holm-adjusted" in md


def test_table_keeps_a_not_supported_verdict_that_rests_on_the_opposite_test():
    """A directional 'not supported' rests on the test against the claim; Holm re-checks that
    p-value, not the (large) one for the claim, which would demote every failure to inconclusive."""
    down = rng.normal(0, 1, 8)
    rows = [C.paired_difference("up", SRC, down - 3 + rng.normal(0, 0.5, 8), down, direction="greater"),
            C.difference("a>b", SRC, rng.normal(0, 1, 10), rng.normal(5, 1, 10), direction="greater"),
            C.rate_comparison("more collapses", SRC, 0, 10, 9, 10),
            C.correlation("pos", SRC, np.arange(20.0), -np.arange(20.0) ** 2, expect="positive")]
    assert [c.verdict for c in rows] == ["not supported"] * 4
    assert all(c.p < 0.01 and "opposite direction p" in c.reason for c in rows)
    assert list(C.table(rows).verdict) == ["not supported"] * 4


def test_paired_outcomes_is_an_exact_mcnemar_test():
    from statsmodels.stats.contingency_tables import mcnemar

    control = [1] * 8 + [0] * 4  # collapse without the controller
    treated = [0] * 7 + [1] + [0] * 4  # with it: 7 prevented, none caused
    c = C.paired_outcomes("prevents", "our own", treated, control)
    assert c.verdict == "supported" and c.n == 12 and c.effect == pytest.approx(1 / 12 - 8 / 12)
    assert c.p == pytest.approx(0.5 ** 7)
    two_sided = mcnemar(np.array([[1, 7], [0, 4]]), exact=True).pvalue  # rows: control, cols: treated
    assert min(1.0, 2 * c.p) == pytest.approx(two_sided)
    # the controller causing the collapses: evidence against the claim
    worse = C.paired_outcomes("prevents", "our own", control, treated)
    assert worse.verdict == "not supported" and worse.p == pytest.approx(0.5 ** 7)
    # no discordant pair, missing data, too few pairs
    assert C.paired_outcomes("prevents", "our own", control, control).verdict == "inconclusive"
    assert C.paired_outcomes("prevents", "our own", [np.nan] * 3, [1, 1, 1]).verdict == "not tested"
    assert C.paired_outcomes("prevents", "our own", [], []).verdict == "not tested"
    assert C.paired_outcomes("prevents", "our own", [0, 0], [1, 1]).verdict == "inconclusive"


def test_rate_below_a_budget():
    ok = C.rate_below("few false alarms", "our own", 0, 3000, 0.002, scale=1000)
    assert ok.verdict == "supported" and ok.effect == 0 and ok.ci[1] < 2
    bad = C.rate_below("few false alarms", "our own", 30, 3000, 0.002, scale=1000)
    assert bad.verdict == "not supported" and bad.effect == pytest.approx(10)
    assert C.rate_below("few false alarms", "our own", 1, 300, 0.002).verdict == "inconclusive"
    assert C.rate_below("few false alarms", "our own", 0, 0, 0.002).verdict == "not tested"


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
    yes = [C.paired_difference(f"up {i}", "our own", up + i * 0.1, np.zeros(12), direction="greater") for i in range(2)]
    no = C.paired_difference("down", "our own", -up, np.zeros(12), direction="greater")
    vague = C.paired_difference("flat", "our own", flat, np.zeros(12), direction="greater")
    both = C.all_of("both", "our own", yes, ["a", "b"], n=12, test="intersection")
    assert both.verdict == "supported" and both.p == max(c.p for c in yes) and both.p_decides
    assert both.reason == "a: supported; b: supported"
    assert C.all_of("x", "our own", [yes[0], no], ["a", "b"], n=12, test="t").verdict == "not supported"
    assert C.all_of("x", "our own", [yes[0], vague], ["a", "b"], n=12, test="t").verdict == "inconclusive"
    missing = [C.not_tested("a", "our own", "no data"), C.not_tested("b", "our own", "no data")]
    assert C.all_of("x", "our own", missing, ["a", "b"], n=0, test="t").verdict == "not tested"
    assert C.all_of("x", "our own", [], [], n=0, test="t").verdict == "inconclusive"
    # after Holm the joint falls with its weakest part
    weak = C.Claim("weak", "our own", "supported", "", n=12, test="t", p=0.03, p_decides=True)
    strong = C.Claim("strong", "our own", "supported", "", n=12, test="t", p=1e-4, p_decides=True)
    joint = C.all_of("joint", "our own", [weak, strong], ["weak", "strong"], n=12, test="t")
    verdicts = C.table([weak, strong, joint]).set_index("claim").verdict
    assert verdicts["weak"] == verdicts["joint"] == "inconclusive" and verdicts["strong"] == "supported"
    assert C.table([weak, strong, joint], alpha=0.2).set_index("claim").verdict["joint"] == "supported"
