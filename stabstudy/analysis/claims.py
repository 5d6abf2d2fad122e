"""Claims that decide: one verdict type, one three-way rule, and Holm within a family.

Every row of a notebook's claims table is a :class:`Claim`. A *confirmatory* claim states, before
the runs, its direction, its **smallest effect of interest** (``sesoi``, in the claim's own units)
and its **family** (one question in one domain). Its verdict comes from two one-sided tests over
independent units (Lakens 2017, 2018: a minimum-effect test and an equivalence-style test):

* ``supported``: the effect is shown in the claim's direction beyond ``minimum`` (zero, or the
  stated minimum of an "at least X" claim): ``H0: effect <= minimum`` rejected;
* ``not supported``: every effect as large as the smallest effect of interest is excluded:
  ``H0: effect >= sesoi`` rejected (the effect, if any, is too small to matter, or opposite; where
  both tests reject, an effect is shown but it is smaller than what the claim is about);
* ``inconclusive``: neither; the table then says how many units would decide it;
* ``not tested``: no data.

Effects are measured in the claim's direction: a claim that something *lowers* a quantity has the
effect ``-(treated - control)``; ``sesoi`` and ``minimum`` are magnitudes in that direction, and the
table prints them with the sign of the raw difference. Without a declared ``sesoi`` the
rule falls back to ``sesoi = minimum`` (the opposite one-sided test), and the row says so.

:func:`table` adjusts each family's p-values with Holm's method (Holm 1979), separately for the two
tests (the error of a false "supported" and of a false "not supported" are each controlled at
``alpha`` within the family), re-decides every row from the adjusted p-values, and prints the power
of the rule as applied (:mod:`stabstudy.analysis.power`) at ``alpha / k`` (Holm's strictest step
in a family of ``k``): P(supported) at the planning effect, P(not supported) at no effect.
*Exploratory* rows (:func:`exploratory`) describe rather than test: raw p-values and intervals,
no verdict, no adjustment, in a table of their own. Intervals are the ``1 - 2 alpha`` two-sided
intervals (the two one-sided ``1 - alpha`` bounds the tests use), unadjusted.

Tests: paired t or Wilcoxon signed-rank (shifted to the minimum and to the sesoi), Welch's t,
TOST for equivalence, exact unconditional score tests for two rates (Miettinen-Nurminen order) and
for paired binary outcomes (Tango's order), the exact binomial test for a rate
against a budget, Spearman's rho (Fisher's z for a margin), bootstrap distributions of a statistic
(e.g. a seed bootstrap of an ROC-AUC), and universal closed-form checks (every case within tolerance).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import numpy as np
import pandas as pd
from scipy import stats as sps

from stabstudy.analysis import power as PW
from stabstudy.analysis import proportions

VERDICTS = ("supported", "not supported", "inconclusive", "not tested")
SOURCES = ("source paper", "textbook", "our own")
NAN = float("nan")
Direction = Literal["greater", "less"]
NO_SESOI = "no smallest effect of interest declared"


@dataclass(frozen=True)
class Claim:
    """One row of a claims table.

    ``effect`` and ``ci`` are in the units the ``test`` names, as raw differences (treated minus
    control); ``sesoi`` and ``minimum`` carry the sign of the claim's direction in those units;
    ``n`` counts the independent units. ``p_for`` is the one-sided p of ``H0: effect <= minimum``,
    ``p_against`` that of ``H0: effect >= sesoi`` (NaN where the rule uses none); ``power`` maps
    ``(alpha, scale)`` to the rule's power (:data:`stabstudy.analysis.power.PowerFn`); ``meaning``
    says in words what "supported" and "not supported" show.
    """

    claim: str
    source: str
    verdict: str
    reason: str
    effect: float = NAN
    ci: tuple[float, float] = (NAN, NAN)
    n: int = 0
    test: str = ""
    p_for: float = NAN
    p_against: float = NAN
    family: str = ""
    sesoi: float = NAN
    minimum: float = NAN
    power: PW.PowerFn | None = field(default=None, compare=False, repr=False)
    meaning: tuple[str, str] = ("the test for the claim rejects", "the test against it rejects")
    confirmatory: bool = True

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"unknown verdict {self.verdict!r}; valid verdicts: {', '.join(VERDICTS)}")
        if not self.source.startswith(SOURCES):
            raise ValueError(f"source must start with one of {', '.join(SOURCES)}; got {self.source!r}")

    @property
    def p(self) -> float:
        """The p-value the verdict rests on: ``p_against`` for "not supported", else ``p_for``."""
        return self.p_against if self.verdict == "not supported" else self.p_for


def decide(p_for: float, p_against: float, alpha: float) -> str:
    """The three-way verdict from the two one-sided p-values (NaN rejects nothing)."""
    if p_against < alpha:
        return "not supported"
    if p_for < alpha:
        return "supported"
    return "inconclusive"


def exploratory(c: Claim) -> Claim:
    """The row as a description: its numbers are shown, raw, with no verdict and no adjustment."""
    return replace(c, confirmatory=False)


def not_tested(claim: str, source: str, reason: str, n: int = 0, *, family: str = "",
               sesoi: float = NAN) -> Claim:
    """A claim the data at hand cannot test (say why)."""
    return Claim(claim, source, "not tested", reason, n=n, family=family, sesoi=sesoi)


def all_of(claim: str, source: str, rows: Sequence[Claim], names: Sequence[str], *, n: int, test: str,
           family: str = "") -> Claim:
    """The claim that every one of ``rows`` holds (an intersection-union test; ``names`` label them):
    supported only if all are, with the largest of their ``p_for``; not supported if any is not,
    with the smallest ``p_against`` times the number of parts (Bonferroni over the parts); not
    tested if all are; else inconclusive."""
    verdicts = [r.verdict for r in rows]
    reason = "; ".join(f"{a}: {v}" for a, v in zip(names, verdicts, strict=True))
    p_for = max((r.p_for for r in rows), default=NAN)
    p_against = min(1.0, len(rows) * min((r.p_against for r in rows), default=NAN)) if rows else NAN
    if verdicts and all(v == "not tested" for v in verdicts):
        return Claim(claim, source, "not tested", reason, n=n, test=test, family=family)
    if not rows:
        return Claim(claim, source, "inconclusive", "no component claim", n=n, test=test, family=family)
    if all(v == "supported" for v in verdicts):
        verdict = "supported"
    elif "not supported" in verdicts:
        verdict = "not supported"
    else:
        verdict = "inconclusive"
    p_for = p_for if all(np.isfinite(r.p_for) for r in rows) else NAN
    p_against = p_against if np.isfinite(p_against) else NAN
    return Claim(claim, source, verdict, reason, n=n, test=test, p_for=p_for, p_against=p_against, family=family)


def _too_few(claim: str, source: str, n: int, min_n: int, test: str, family: str) -> Claim | None:
    if n == 0:
        return Claim(claim, source, "not tested", "no data", n=0, test=test, family=family)
    if n < min_n:
        return Claim(claim, source, "inconclusive", f"{n} < {min_n} needed", n=n, test=test, family=family)
    return None


def _finite(x: Sequence[float]) -> np.ndarray:
    a = np.asarray(x, dtype=float).ravel()
    return a[np.isfinite(a)]


def _sign(direction: Direction) -> int:
    if direction not in ("greater", "less"):
        raise ValueError(f"unknown direction {direction!r}; valid: greater, less")
    return 1 if direction == "greater" else -1


def _margins(sesoi: float | None, minimum: float, planning: float | None) -> tuple[float, float, float, str]:
    """``(sesoi, minimum, planning, note)`` in the claim's direction; the note flags a row without
    a declared smallest effect of interest. The planning effect defaults to the sesoi, or to twice
    the minimum for an "at least" claim (sesoi equal to the minimum)."""
    if minimum < 0:
        raise ValueError(f"minimum is a magnitude in the claim's direction, >= 0; got {minimum}")
    note = ""
    if sesoi is None or not np.isfinite(sesoi):
        sesoi, note = minimum, f"; {NO_SESOI}"
    if sesoi < minimum:
        raise ValueError(f"the smallest effect of interest ({sesoi}) is below the claim's minimum ({minimum})")
    if planning is None:
        planning = sesoi if sesoi > minimum else 2 * minimum if minimum > 0 else NAN
    return float(sesoi), float(minimum), float(planning), note


def _boot_ci(data: tuple[np.ndarray, ...], statistic, confidence: float, seed: int, paired: bool = False,
             vectorized: bool = False) -> tuple[float, float]:
    if any(len(d) < 2 for d in data) or all(np.ptp(d) == 0 for d in data):
        v = float(statistic(*data))
        return v, v  # a constant sample: the interval is the point
    with warnings.catch_warnings():
        # a resample can be constant where the sample is not (few, tied values): its statistic is
        # then undefined (NaN), and so is the interval; the verdicts treat a NaN interval as no
        # evidence, and the reason says so
        warnings.simplefilter("ignore", sps.ConstantInputWarning)
        warnings.simplefilter("ignore", sps.DegenerateDataWarning)
        res = sps.bootstrap(data, statistic, confidence_level=confidence, n_resamples=2000, paired=paired,
                            vectorized=vectorized, method="percentile", random_state=np.random.default_rng(seed))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def _tests(what: str, p_for: float, p_against: float, minimum: float, sesoi: float, sign: int) -> str:
    return (f"{what}; p(beyond {sign * minimum + 0.0:.3g}) = {p_for:.3g}, "
            f"p(short of {sign * sesoi + 0.0:.3g}) = {p_against:.3g}")


def _directional(minimum: float, sesoi: float, sign: int) -> tuple[str, str]:
    return (f"an effect beyond {sign * minimum + 0.0:.3g} is shown",
            f"every effect of {sign * sesoi + 0.0:.3g} or more is excluded")


def signed_rank_p(d: np.ndarray, alternative: Literal["greater", "less", "two-sided"]) -> float:
    """``scipy.stats.wilcoxon(d, alternative=alternative).pvalue`` (its defaults: zeros dropped,
    method ``auto``), with scipy's exact permutation branch vectorised.

    With ties or zeros and at most 13 pairs scipy enumerates the 2^n sign flips, computing the
    statistic flip by flip (about 0.2 s a test; notebook 04's verdict-stability resamples ask for
    hundreds). Flipping signs leaves ``|d|``, and so the ranks, unchanged: the signed-rank sum of
    every flip is one product with the ranks, and ``scipy.stats.permutation_test`` enumerates the same
    flips vectorised (tests/test_claims.py holds the two p-values equal)."""
    d = np.asarray(d, dtype=float)
    nonzero = d != 0
    ties = np.unique(np.abs(d[nonzero])).size < nonzero.sum()
    if d.size > 13 or nonzero.all() and not ties:  # scipy's exact or asymptotic branch: no enumeration
        return float(sps.wilcoxon(d, alternative=alternative).pvalue)
    ranks = np.zeros(d.size)
    ranks[nonzero] = sps.rankdata(np.abs(d[nonzero]))  # a zero adds nothing to either rank sum

    def r_plus(x: np.ndarray, axis: int = -1) -> np.ndarray:
        return np.sum((x > 0) * ranks, axis=axis)

    return float(sps.permutation_test((d,), r_plus, permutation_type="samples", vectorized=True, n_resamples=9999,
                                      alternative=alternative).pvalue)


def paired_difference(claim: str, source: str, treated: Sequence[float], control: Sequence[float], *,
                      direction: Direction, sesoi: float | None = None, minimum: float = 0.0,
                      planning: float | None = None, family: str = "", alpha: float = 0.05, min_n: int = 3,
                      test: Literal["ttest", "wilcoxon"] = "ttest", seed: int = 0) -> Claim:
    """Claim: ``treated - control`` lies beyond ``minimum`` in ``direction``, over pairs (same seed);
    not supported when the pairs exclude every difference as large as ``sesoi``.

    Pairs with a non-finite member are dropped. ``wilcoxon`` cannot reach p < 0.05 one-sided below
    5 pairs; the t-test can, at the price of assuming normal differences: the row names its test.
    """
    t, c = np.asarray(treated, dtype=float).ravel(), np.asarray(control, dtype=float).ravel()
    if t.shape != c.shape:
        raise ValueError(f"paired samples differ in length: {t.size} vs {c.size}")
    if test not in ("ttest", "wilcoxon"):
        raise ValueError(f"unknown test {test!r}; valid: ttest, wilcoxon")
    d = (t - c)[np.isfinite(t) & np.isfinite(c)]
    return _paired(claim, source, d.tobytes(), _sign(direction), *_margins(sesoi, minimum, planning), family,
                   alpha, min_n, test, seed)


@functools.lru_cache(maxsize=4096)
def _paired(claim: str, source: str, d_bytes: bytes, sign: int, sesoi: float, minimum: float, planning: float,
            note: str, family: str, alpha: float, min_n: int, test: str, seed: int) -> Claim:
    """:func:`paired_difference` of the differences ``d`` (as bytes: a pure function of them,
    cached, because a verdict-stability resample often asks again with the same numbers and a
    Wilcoxon test with ties is a permutation test)."""
    d = np.frombuffer(d_bytes, dtype=float)
    name = "paired t-test" if test == "ttest" else "Wilcoxon signed-rank"
    if (early := _too_few(claim, source, d.size, min_n, name, family)) is not None:
        return replace(early, sesoi=sign * sesoi, minimum=sign * minimum)
    x = sign * d  # the effect in the claim's direction
    if test == "ttest":
        if np.ptp(x) == 0:  # a constant difference: the t statistic is infinite or undefined
            p_for, p_against = float(x[0] <= minimum), float(x[0] >= sesoi)
        else:
            with warnings.catch_warnings():  # nearly equal differences: scipy warns of lost precision; t is huge anyway
                warnings.simplefilter("ignore", RuntimeWarning)
                p_for = float(sps.ttest_1samp(x, minimum, alternative="greater").pvalue)
                p_against = float(sps.ttest_1samp(x, sesoi, alternative="less").pvalue)
        effect = float(np.mean(d))
        half = float(sps.t.ppf(1 - alpha, d.size - 1) * np.std(d, ddof=1) / math.sqrt(d.size))
        ci = (effect - half, effect + half)
        sd = float(np.std(d, ddof=1))
        power = PW.t_test(d.size, sd, planning=planning, minimum=minimum, sesoi=sesoi) if np.isfinite(planning) \
            else None
    else:
        p_for = signed_rank_p(x - minimum, "greater") if np.any(x != minimum) else 1.0
        p_against = signed_rank_p(x - sesoi, "less") if np.any(x != sesoi) else 1.0
        effect = float(np.median(d))
        ci = _boot_ci((d,), np.median, 1 - 2 * alpha, seed, vectorized=True)
        power = PW.signed_rank(x, planning=planning, minimum=minimum, sesoi=sesoi, seed=seed) \
            if np.isfinite(planning) else None
    what = f"{'mean' if test == 'ttest' else 'median'} paired difference {effect:.3g}"
    # an exact signed-rank test of n pairs cannot give p below 2**-n: say the design could not decide
    floor = f"; with {d.size} pairs the smallest attainable one-sided p is {0.5 ** d.size:.3g}, not below alpha " \
        f"{alpha:.3g}: this design cannot decide" if test == "wilcoxon" and 0.5 ** d.size >= alpha else ""
    return Claim(claim, source, decide(p_for, p_against, alpha),
                 _tests(what, p_for, p_against, minimum, sesoi, sign) + note + floor, effect, ci, int(d.size), name,
                 p_for, p_against, family, sign * sesoi, sign * minimum, power,
                 meaning=_directional(minimum, sesoi, sign))


def difference(claim: str, source: str, a: Sequence[float], b: Sequence[float], *, direction: Direction,
               sesoi: float | None = None, minimum: float = 0.0, planning: float | None = None, family: str = "",
               alpha: float = 0.05, min_n: int = 3) -> Claim:
    """Claim: mean(a) - mean(b) lies beyond ``minimum`` in ``direction``, for unpaired samples
    (Welch's t-test); not supported when every difference as large as ``sesoi`` is excluded."""
    x, y = _finite(a), _finite(b)
    sign = _sign(direction)
    sesoi, minimum, planning, note = _margins(sesoi, minimum, planning)
    if (early := _too_few(claim, source, min(x.size, y.size), min_n, "Welch t-test", family)) is not None:
        return replace(early, n=x.size + y.size, sesoi=sign * sesoi, minimum=sign * minimum)
    diff = float(x.mean() - y.mean())
    vx, vy = x.var(ddof=1) / x.size, y.var(ddof=1) / y.size
    se = math.sqrt(vx + vy)
    if se == 0:
        p_for, p_against = float(sign * diff <= minimum), float(sign * diff >= sesoi)
        half = 0.0
    else:
        df = (vx + vy) ** 2 / (vx ** 2 / (x.size - 1) + vy ** 2 / (y.size - 1))
        p_for = float(sps.t.sf((sign * diff - minimum) / se, df))
        p_against = float(sps.t.cdf((sign * diff - sesoi) / se, df))
        half = float(sps.t.ppf(1 - alpha, df) * se)
    power = PW.t_test(x.size, float(x.std(ddof=1)), n_other=y.size, sd_other=float(y.std(ddof=1)),
                      planning=planning, minimum=minimum, sesoi=sesoi) if np.isfinite(planning) else None
    return Claim(claim, source, decide(p_for, p_against, alpha),
                 _tests(f"difference of means {diff:.3g}", p_for, p_against, minimum, sesoi, sign) + note,
                 diff, (diff - half, diff + half), int(x.size + y.size), "Welch t-test", p_for, p_against, family,
                 sign * sesoi, sign * minimum, power)


def equivalence(claim: str, source: str, a: Sequence[float], b: Sequence[float], *, margin: float,
                relative: bool = True, paired: bool = True, family: str = "", alpha: float = 0.05,
                min_n: int = 3) -> Claim:
    """Claim: ``a`` and ``b`` are equivalent within ``margin`` (TOST; the margin is the smallest
    difference of interest).

    ``margin`` is relative to ``|mean(b)|`` when ``relative`` (e.g. 0.02 = within 2%), absolute
    otherwise. Supported when both one-sided tests reject (the ``1 - 2 alpha`` interval lies inside
    the margin); not supported when the difference is shown beyond the margin on one side. The power
    printed: P(supported) at no difference, P(not supported) at twice the margin.
    """
    if paired:
        x, y = np.asarray(a, dtype=float).ravel(), np.asarray(b, dtype=float).ravel()
        if x.shape != y.shape:
            raise ValueError(f"paired samples differ in length: {x.size} vs {y.size}")
        keep = np.isfinite(x) & np.isfinite(y)
        x, y = x[keep], y[keep]
    else:
        x, y = _finite(a), _finite(b)
    test = f"TOST ({'paired' if paired else 'Welch'}), margin {margin:g}{' relative' if relative else ''}"
    n = min(x.size, y.size)
    if (early := _too_few(claim, source, n, min_n, test, family)) is not None:
        return early
    delta = margin * abs(float(y.mean())) if relative else margin
    if paired:
        d = x - y
        diff, se, df = float(d.mean()), float(d.std(ddof=1) / math.sqrt(d.size)), d.size - 1
        power = PW.tost(d.size, float(d.std(ddof=1)), margin=delta, harmful=2 * delta)
    else:
        vx, vy = x.var(ddof=1) / x.size, y.var(ddof=1) / y.size
        diff, se = float(x.mean() - y.mean()), float(math.sqrt(vx + vy))
        df = (vx + vy) ** 2 / (vx ** 2 / (x.size - 1) + vy ** 2 / (y.size - 1)) if vx + vy > 0 else x.size + y.size - 2
        power = PW.tost(x.size, float(x.std(ddof=1)), n_other=y.size, sd_other=float(y.std(ddof=1)), margin=delta,
                        harmful=2 * delta)
    if se == 0:
        p_for = 0.0 if abs(diff) < delta else 1.0
        p_against = 0.0 if abs(diff) > delta else 1.0
    else:
        p_for = max(float(sps.t.sf((diff + delta) / se, df)), float(sps.t.cdf((diff - delta) / se, df)))
        p_against = float(min(sps.t.sf((diff - delta) / se, df), sps.t.cdf((diff + delta) / se, df)))
    half = float(sps.t.ppf(1 - alpha, df)) * se if se > 0 else 0.0
    ci = (diff - half, diff + half)
    return Claim(claim, source, decide(p_for, p_against, alpha),
                 f"difference {diff:.3g}, margin +-{delta:.3g}; p(inside) = {p_for:.3g}, p(beyond) = {p_against:.3g}",
                 diff, ci, int(n), test, p_for, p_against, family, delta, NAN, power,
                 meaning=(f"the difference is shown inside +-{delta:.3g}", f"the difference is shown beyond +-{delta:.3g}"))


def rate_ci(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Clopper-Pearson (exact binomial) interval of the rate ``k / n``; (nan, nan) when ``n == 0``."""
    if n == 0:
        return NAN, NAN
    ci = sps.binomtest(int(k), int(n)).proportion_ci(confidence_level=confidence, method="exact")
    return float(ci.low), float(ci.high)


def rate_below(claim: str, source: str, k: int, n: int, target: float, *, planning: float | None = None,
               harmful: float | None = None, family: str = "", alpha: float = 0.05, min_n: int = 3,
               scale: float = 1.0, unit: str = "") -> Claim:
    """Claim: the rate ``k / n`` over independent units is at most ``target`` (a budget): the exact
    binomial test, one-sided each way. Supported when the rate is shown below ``target``, not
    supported when shown above it; ``effect`` and the Clopper-Pearson interval are in ``scale``
    units (1000: per 1,000). The power printed: P(supported) at the ``planning`` rate (default half
    the target), P(not supported) at the ``harmful`` rate (default twice the target)."""
    test = f"exact binomial vs {target * scale:g}{' ' + unit if unit else ''}"
    if (early := _too_few(claim, source, int(n), min_n, test, family)) is not None:
        return early
    p_for = float(sps.binomtest(int(k), int(n), target, alternative="less").pvalue)
    p_against = float(sps.binomtest(int(k), int(n), target, alternative="greater").pvalue)
    lo, hi = rate_ci(k, n, 1 - 2 * alpha)
    u = f" {unit}" if unit else ""
    reason = (f"{k}/{n} = {scale * k / n:.3g}{u}, {100 * (1 - 2 * alpha):.0f}% CI [{scale * lo:.3g}, {scale * hi:.3g}] "
              f"(Clopper-Pearson) vs {target * scale:g}; p(below) = {p_for:.3g}, p(above) = {p_against:.3g}")
    power = PW.binomial(int(n), target=target, planning=target / 2 if planning is None else planning,
                        harmful=min(2 * target, 1.0) if harmful is None else harmful)
    return Claim(claim, source, decide(p_for, p_against, alpha), reason, scale * k / n, (scale * lo, scale * hi),
                 int(n), test, p_for, p_against, family, NAN, scale * target, power,
                 meaning=(f"the rate is shown below {target * scale:g}", f"the rate is shown above {target * scale:g}"))


def rate_comparison(claim: str, source: str, k_treated: int, n_treated: int, k_control: int, n_control: int,
                    *, direction: Direction = "greater", sesoi: float | None = None, minimum: float = 0.0,
                    planning: tuple[float, float] | None = None, family: str = "", alpha: float = 0.05,
                    min_n: int = 3) -> Claim:
    """Claim: the rate ``k_treated / n_treated`` exceeds (``greater``) or falls short of (``less``)
    ``k_control / n_control`` by more than ``minimum``; not supported when every difference as
    large as ``sesoi`` is excluded.

    Both are exact unconditional score tests (:mod:`stabstudy.analysis.proportions`). The power
    enumerates every outcome table: P(supported) at ``planning`` (treated, control rates; default:
    the control's observed rate, moved by ``sesoi``), P(not supported) at equal rates.
    """
    sign = _sign(direction)
    sesoi_, minimum, _, note = _margins(sesoi, minimum, None)
    test = "exact unconditional score (Miettinen-Nurminen)"
    if (early := _too_few(claim, source, min(n_treated, n_control), min_n, test, family)) is not None:
        return replace(early, n=n_treated + n_control, sesoi=sign * sesoi_)
    k1, n1, k0, n0 = int(k_treated), int(n_treated), int(k_control), int(n_control)
    larger, smaller = ("larger", "smaller") if sign > 0 else ("smaller", "larger")
    p_for = proportions.independent_p(k1, n1, k0, n0, sign * minimum, larger)
    p_against = proportions.independent_p(k1, n1, k0, n0, sign * sesoi_, smaller)
    r1, r0 = k1 / n1, k0 / n0
    c1, c0 = rate_ci(k1, n1, 1 - 2 * alpha), rate_ci(k0, n0, 1 - 2 * alpha)
    if planning is None and sesoi_ > 0:
        base = min(max(r0, 0.05), 0.95 - sesoi_) if sign > 0 else max(min(r0, 0.95), 0.05 + sesoi_)
        planning = (base + sign * sesoi_, base)
    pooled = (k1 + k0) / (n1 + n0)
    power = PW.rates(n1, n0, sign=sign, minimum=minimum, sesoi=sesoi_, planning=planning, null=pooled) \
        if planning is not None else None
    what = (f"{k1}/{n1} [{c1[0]:.2f}, {c1[1]:.2f}] vs {k0}/{n0} [{c0[0]:.2f}, {c0[1]:.2f}] (Clopper-Pearson), "
            f"difference {r1 - r0:.3g}")
    return Claim(claim, source, decide(p_for, p_against, alpha),
                 _tests(what, p_for, p_against, minimum, sesoi_, sign) + note, r1 - r0, (NAN, NAN), n1 + n0, test,
                 p_for, p_against, family, sign * sesoi_, sign * minimum, power,
                 meaning=_directional(minimum, sesoi_, sign))


def paired_outcomes(claim: str, source: str, treated: Sequence[float], control: Sequence[float], *,
                    direction: Direction = "less", sesoi: float | None = None, minimum: float = 0.0,
                    planning: float | None = None, family: str = "", alpha: float = 0.05, min_n: int = 3) -> Claim:
    """Claim: a binary outcome (1 = e.g. collapse) is ``direction`` frequent with treatment than
    without, over pairs (same seed, same data order), by more than ``minimum``; not supported when
    every paired rate difference as large as ``sesoi`` is excluded.

    Both are exact unconditional tests ordered by Tango's score statistic
    (:mod:`stabstudy.analysis.proportions`); only discordant pairs move it. Pairs with a missing
    member are dropped. ``effect`` is the paired difference of rates, treated minus control.
    """
    sign = _sign(direction)
    sesoi_, minimum, planning_, note = _margins(sesoi, minimum, planning)
    t, c = np.asarray(treated, dtype=float).ravel(), np.asarray(control, dtype=float).ravel()
    if t.shape != c.shape:
        raise ValueError(f"paired samples differ in length: {t.size} vs {c.size}")
    keep = np.isfinite(t) & np.isfinite(c)
    t, c = t[keep] > 0.5, c[keep] > 0.5
    test = "exact unconditional score (Tango)"
    if (early := _too_few(claim, source, int(t.size), min_n, test, family)) is not None:
        return replace(early, sesoi=sign * sesoi_)
    n = int(t.size)
    only_c, only_t = int(np.sum(c & ~t)), int(np.sum(t & ~c))  # outcome under control only / treatment only
    more, fewer = (only_t, only_c) if sign > 0 else (only_c, only_t)  # pairs for the claim / against it
    p_for = proportions.paired_p(more, fewer, n, minimum, "larger")
    p_against = proportions.paired_p(more, fewer, n, sesoi_, "smaller")
    power = PW.paired_rates(n, discordant=(more + fewer) / n, minimum=minimum, sesoi=sesoi_, planning=planning_) \
        if np.isfinite(planning_) else None
    what = (f"{int(c.sum())}/{n} without vs {int(t.sum())}/{n} with; discordant pairs: {only_c} only without, "
            f"{only_t} only with")
    return Claim(claim, source, decide(p_for, p_against, alpha),
                 _tests(what, p_for, p_against, minimum, sesoi_, sign) + note, float(t.mean() - c.mean()),
                 (NAN, NAN), n, test, p_for, p_against, family, sign * sesoi_, sign * minimum, power,
                 meaning=_directional(minimum, sesoi_, sign))


def correlation(claim: str, source: str, x: Sequence[float], y: Sequence[float], *,
                expect: Literal["positive", "negative", "none"], sesoi: float | None = None, minimum: float = 0.0,
                planning: float | None = None, margin: float = 0.3, family: str = "", alpha: float = 0.05,
                min_n: int = 5, seed: int = 0) -> Claim:
    """Claim about Spearman's rho of paired observations ``(x, y)``, over independent units.

    ``positive`` / ``negative``: rho beyond ``minimum`` in that direction; not supported when every
    rho as large as ``sesoi`` is excluded (Fisher's z with Bonett and Wright's variance). ``none``:
    an equivalence claim, supported when rho is shown inside ``+-margin``, not supported when shown
    beyond it (a non-significant rho is absence of evidence, not evidence of absence).
    """
    a, b = np.asarray(x, dtype=float).ravel(), np.asarray(y, dtype=float).ravel()
    keep = np.isfinite(a) & np.isfinite(b)
    a, b = a[keep], b[keep]
    if expect not in ("positive", "negative", "none"):
        raise ValueError(f"unknown expectation {expect!r}; valid: positive, negative, none")
    test = "Spearman rho" + (f", equivalence margin +-{margin:g}" if expect == "none" else "")
    if (early := _too_few(claim, source, a.size, min_n, test, family)) is not None:
        return early
    if np.ptp(a) == 0 or np.ptp(b) == 0:
        return Claim(claim, source, "inconclusive", "a constant variable has no rank correlation", n=int(a.size),
                     test=test, family=family)
    n = int(a.size)
    r = float(sps.spearmanr(a, b).statistic)
    se = math.sqrt((1 + r * r / 2) / max(n - 3, 1))
    z = sps.norm.ppf(1 - alpha)
    ci = tuple(float(np.tanh(np.arctanh(np.clip(r, -1 + 1e-12, 1 - 1e-12)) + s * z * se)) for s in (-1, 1))
    if expect == "none":
        p_lo, p_hi = PW.fisher_p(r, n, -margin), 1 - PW.fisher_p(r, n, margin)  # rho above -margin, below +margin
        p_for, p_against = float(max(p_lo, p_hi)), float(min(1 - p_lo, 1 - p_hi))
        power = PW.spearman_equivalence(n, margin=margin, harmful=min(2 * margin, 0.95), seed=seed)
        return Claim(claim, source, decide(p_for, p_against, alpha),
                     f"rho = {r:.2f}, {100 * (1 - 2 * alpha):.0f}% CI [{ci[0]:.2f}, {ci[1]:.2f}] vs +-{margin:g}; "
                     f"p(inside) = {p_for:.3g}, p(beyond) = {p_against:.3g}", r, ci, n, test, p_for, p_against,
                     family, margin, NAN, power,
                     meaning=(f"rho is shown inside +-{margin:g}", f"rho is shown beyond +-{margin:g}"))
    sign = 1 if expect == "positive" else -1
    sesoi_, minimum, planning_, note = _margins(sesoi, minimum, planning)
    p_for, p_against = (float(v) for v in PW.spearman_p(sign * r, n, minimum=minimum, sesoi=sesoi_))
    power = PW.spearman(n, planning=planning_, minimum=minimum, sesoi=sesoi_, seed=seed) \
        if np.isfinite(planning_) else None
    return Claim(claim, source, decide(p_for, p_against, alpha),
                 _tests(f"rho = {r:.2f}", p_for, p_against, minimum, sesoi_, sign) + note, r, ci, n, test, p_for,
                 p_against, family, sign * sesoi_, sign * minimum, power)


def within_tolerance(claim: str, source: str, measured: Sequence[float], target: Sequence[float] | float, *,
                     rel_tol: float, abs_tol: float = 0.0, labels: Sequence[str] | None = None, min_n: int = 1,
                     family: str = "") -> Claim:
    """Universal claim: every measurement lies within ``max(rel_tol * |target|, abs_tol)`` of its
    (closed-form) target. Supported when every case does, not supported when any case fails (the
    reason names the failing cases, by ``labels``); the absolute floor keeps a target near zero from
    asking for a relative precision no measurement has."""
    m = np.asarray(measured, dtype=float).ravel()
    t = np.broadcast_to(np.asarray(target, dtype=float), m.shape)
    names = np.asarray(list(labels) if labels is not None else [str(i) for i in range(m.size)], dtype=object)
    if names.shape != m.shape:
        raise ValueError(f"{names.size} labels for {m.size} measurements")
    keep = np.isfinite(m) & np.isfinite(t) & ((t != 0) | (abs_tol > 0))
    m, t, names = m[keep], t[keep], names[keep]
    tol = np.maximum(rel_tol * np.abs(t), abs_tol)
    test = f"every case within {rel_tol:g} relative" + (f" or {abs_tol:g} absolute" if abs_tol else "")
    if (early := _too_few(claim, source, m.size, min_n, test, family)) is not None:
        return early
    ok = np.abs(m - t) <= tol
    with np.errstate(divide="ignore", invalid="ignore"):
        err = np.where(t != 0, (m - t) / np.abs(t), np.nan)
    failed = ", ".join(str(s) for s in names[~ok][:5]) + (" ..." if (~ok).sum() > 5 else "")
    verdict = "supported" if ok.all() else "not supported"
    reason = f"{int(ok.sum())}/{m.size} within tolerance" + (f"; outside: {failed}" if not ok.all() else "")
    med = float(np.nanmedian(err)) if np.isfinite(err).any() else NAN
    lo, hi = (float(np.nanmin(err)), float(np.nanmax(err))) if np.isfinite(err).any() else (NAN, NAN)
    return Claim(claim, source, verdict, reason, med, (lo, hi), int(m.size), test, family=family)


def interval_above(claim: str, source: str, effect: float, ci: tuple[float, float], n: int, *, above: float,
                   test: str, boot: Sequence[float] | None = None, sesoi: float | None = None,
                   planning: float | None = None, family: str = "", alpha: float = 0.05, min_n: int = 3) -> Claim:
    """Claim: a statistic lies above ``above``, judged by its bootstrap distribution ``boot`` over
    the ``n`` independent units (e.g. a seed bootstrap of an ROC-AUC): supported when at most a
    share ``alpha`` of it lies at or below ``above`` (``p_for``), not supported when at most that
    share lies at or above ``above + sesoi``. Without ``boot`` the interval ``ci`` decides alone
    (supported above, not supported at or below ``above``) and the row carries no p-value.
    The power uses the normal model of the bootstrap distribution."""
    if (early := _too_few(claim, source, int(n), min_n, test, family)) is not None:
        return replace(early, effect=float(effect))
    lo, hi = (float(c) for c in ci)
    sesoi_, _, planning_, note = _margins(sesoi, 0.0, planning)
    if boot is None:
        if not (np.isfinite(lo) and np.isfinite(hi) and np.isfinite(effect)):
            return Claim(claim, source, "inconclusive", f"{effect:.3g}: the interval is undefined (a resample lacked "
                         "one of the classes)", float(effect), (lo, hi), int(n), test, family=family)
        verdict = "supported" if lo > above else "not supported" if hi <= above else "inconclusive"
        return Claim(claim, source, verdict, f"{effect:.3g} [{lo:.3g}, {hi:.3g}] vs {above:g} over {n} units{note}",
                     float(effect), (lo, hi), int(n), test, family=family)
    b = _finite(boot)
    if b.size == 0:
        return Claim(claim, source, "inconclusive", f"{effect:.3g}: no defined bootstrap resample", float(effect),
                     (lo, hi), int(n), test, family=family)
    p_for = float((1 + np.sum(b <= above)) / (1 + b.size))
    p_against = float((1 + np.sum(b >= above + sesoi_)) / (1 + b.size))
    power = PW.bootstrap_normal(float(np.std(b)), planning=planning_, minimum=0.0, sesoi=sesoi_,
                                null=0.0) if np.isfinite(planning_) else None
    return Claim(claim, source, decide(p_for, p_against, alpha),
                 _tests(f"{effect:.3g} [{lo:.3g}, {hi:.3g}] vs {above:g} over {n} units (bootstrap)", p_for,
                        p_against, above, above + sesoi_, 1) + note,
                 float(effect), (lo, hi), int(n), test, p_for, p_against, family, sesoi_, above, power,
                 meaning=_directional(above, above + sesoi_, 1))


def from_p(claim: str, source: str, effect: float, ci: tuple[float, float], n: int, *, p_for: float,
           p_against: float, test: str, sesoi: float = NAN, power: PW.PowerFn | None = None, family: str = "",
           alpha: float = 0.05, min_n: int = 3) -> Claim:
    """Claim decided by one-sided p-values computed elsewhere (e.g. an exact permutation null):
    ``p_for`` that the effect is beyond its minimum, ``p_against`` that it is short of ``sesoi``;
    NaN p-values decide nothing; "not tested" without data."""
    if (early := _too_few(claim, source, int(n), min_n, test, family)) is not None:
        return replace(early, effect=float(effect))
    reason = f"{effect:.3g} [{ci[0]:.3g}, {ci[1]:.3g}] over {n} units; p_for = {p_for:.3g}, p_against = {p_against:.3g}"
    return Claim(claim, source, decide(p_for, p_against, alpha), reason + ("" if np.isfinite(sesoi) else f"; {NO_SESOI}"),
                 float(effect), (float(ci[0]), float(ci[1])), int(n), test, float(p_for), float(p_against), family,
                 sesoi, NAN, power)


def holm(p: Sequence[float]) -> np.ndarray:
    """Holm-adjusted p-values (step-down, monotone, capped at 1), in the order given.

    The same numbers as ``statsmodels.stats.multitest.multipletests(p, method="holm")[1]`` (a test
    holds them equal), without its ``gc.collect()`` on every call: half a second in a notebook's
    heap, paid once per resample where a verdict's stability is measured."""
    p = np.asarray(p, dtype=float)
    order = np.argsort(p, kind="stable")
    steps = p[order] * np.arange(p.size, 0, -1)
    out = np.empty_like(p)
    out[order] = np.minimum(np.maximum.accumulate(steps), 1.0)
    return out


COLUMNS = ["role", "family", "claim", "source", "sesoi", "effect", "ci_low", "ci_high", "n", "test", "p_for",
           "p_against", "p_for_holm", "p_against_holm", "power_supported", "power_not_supported", "verdict", "reason"]
LEGACY_FAMILY = "(one notebook-wide family)"
"""Where rows declare no family, Holm runs over all of them, as it did before families existed."""


def _explain(c: Claim, verdict: str, p_for: float, p_against: float, alpha: float, k: int, with_units: bool) -> str:
    """The decision in words, after Holm: what was shown, or what would decide it."""
    shown, excluded = c.meaning
    if verdict == "supported":
        return f"{shown} (Holm p = {p_for:.3g})"
    if verdict == "not supported":
        also = f"; {shown}, but it is smaller than the claim is about (Holm p = {p_for:.3g})" if p_for < alpha else ""
        return f"{excluded} (Holm p = {p_against:.3g}){also}"
    text = f"at alpha {alpha:g} in the family, neither '{shown}' (Holm p = {p_for:.3g}) nor '{excluded}' " \
        f"(Holm p = {p_against:.3g})"
    if with_units and c.power is not None:
        need = PW.units_needed(c.power, c.n, alpha / k)
        text += (f"; about {need} units would decide it either way with power {PW.TARGET:g} at the observed spread"
                 if need is not None else f"; even {int(PW.SCALES[-1])} times the units would not decide it")
    return text


def table(claims: Sequence[Claim], alpha: float = 0.05, *, power: bool = True) -> pd.DataFrame:
    """The claims of one notebook as a DataFrame: confirmatory rows first, decided after Holm within
    their family, with the power of the rule as applied (at ``alpha / k`` in a family of ``k``
    tests) and, where a row stays inconclusive, the units that would decide it; exploratory rows
    after them, raw, without a verdict. ``power=False`` skips the power (a resampling loop that only
    needs the verdicts)."""
    claims = list(claims)
    fam = [c.family or LEGACY_FAMILY for c in claims]
    adj_for, adj_against = np.full(len(claims), NAN), np.full(len(claims), NAN)
    size: dict[str, int] = {}
    for f in dict.fromkeys(fam):
        idx = [i for i, c in enumerate(claims) if c.confirmatory and fam[i] == f]
        size[f] = max(sum(np.isfinite(claims[i].p_for) or np.isfinite(claims[i].p_against) for i in idx), 1)
        for p, out in ((np.array([claims[i].p_for for i in idx], dtype=float), adj_for),
                       (np.array([claims[i].p_against for i in idx], dtype=float), adj_against)):
            ok = np.isfinite(p)
            if ok.any():
                out[np.asarray(idx)[ok]] = holm(p[ok])
    rows = []
    for i, c in enumerate(claims):
        row = {"role": "confirmatory" if c.confirmatory else "exploratory", "family": fam[i], "claim": c.claim,
               "source": c.source, "sesoi": c.sesoi, "effect": c.effect, "ci_low": c.ci[0], "ci_high": c.ci[1],
               "n": c.n, "test": c.test, "p_for": c.p_for, "p_against": c.p_against, "p_for_holm": NAN,
               "p_against_holm": NAN, "power_supported": NAN, "power_not_supported": NAN, "verdict": "",
               "reason": c.reason}
        if c.confirmatory:
            k = size[fam[i]]
            pw = c.power(alpha / k, 1.0) if power and c.power is not None and c.verdict != "not tested" else (NAN, NAN)
            verdict, reason = c.verdict, c.reason
            if c.verdict != "not tested" and (np.isfinite(c.p_for) or np.isfinite(c.p_against)):
                verdict = decide(adj_for[i], adj_against[i], alpha)
                reason = f"{reason}; {_explain(c, verdict, adj_for[i], adj_against[i], alpha, k, power)}"
            row |= {"p_for_holm": adj_for[i], "p_against_holm": adj_against[i], "power_supported": pw[0],
                    "power_not_supported": pw[1], "verdict": verdict, "reason": reason}
        rows.append(row)
    df = pd.DataFrame(rows, columns=COLUMNS)
    return df.sort_values("role", kind="stable", key=lambda r: r != "confirmatory").reset_index(drop=True)


def save(df: pd.DataFrame, notebook: str, profile: str) -> Path:
    """Write a notebook's claims table where ``stabstudy report`` collects it (build/<profile>/claims/)."""
    from stabstudy import paths

    out = paths.claims_dir(profile) / f"{notebook}.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".csv.tmp")
    df.to_csv(tmp, index=False, float_format="%.6g")
    tmp.replace(out)
    return out
