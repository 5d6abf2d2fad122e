"""Exact tests of a rate difference against a margin, for independent and for paired binary outcomes.

A claim such as "PPO collapses more often than TD3, by at least 0.5" is *not supported* when the
data exclude every difference that large: a test of ``H0: difference >= margin``, which the exact
tests of equality (Boschloo, McNemar) cannot do, and whose asymptotic score tests reject too often
at the sizes the study can afford (6 prefixes an arm). The tests here are *exact unconditional*
score tests (Chan 1998, Statistics in Medicine 17:1403): every possible outcome table is ordered by
the score statistic, and the p-value is the largest probability, over the nuisance rate on the
boundary of H0, of a table at least as extreme as the one observed; so a test never rejects more
often than ``alpha`` under H0 (up to the grid of nuisance rates, :data:`GRID` points).

* independent samples: Miettinen and Nurminen's score statistic of a risk difference, as
  ``statsmodels.stats.proportion.test_proportions_2indep(method="score")`` computes it;
* paired samples (the same seed with and without a treatment): Tango's score statistic (Tango 1998,
  Statistics in Medicine 17:891), whose constrained maximum-likelihood estimate has a closed form (a
  test holds it equal to a numerical optimum).

p-values are one-sided; ``alternative="larger"`` means H1: difference > ``value``. The p-values of
every table of a size come at once (cached), which is what the power enumeration needs.
"""

from __future__ import annotations

import functools
import warnings
from typing import Literal

import numpy as np
from scipy import stats as sps
from scipy.special import gammaln
from statsmodels.stats.proportion import test_proportions_2indep

Alternative = Literal["larger", "smaller"]
GRID = 201
"""Nuisance rates tried on the boundary of H0."""


def _sup_tail(z: np.ndarray, pmf: np.ndarray, alternative: Alternative) -> np.ndarray:
    """Each table's p-value: over the nuisance grid (rows of ``pmf``), the largest probability of
    the tables whose statistic ``z`` is at least as extreme (ties included; NaN is least extreme)."""
    s = np.where(np.isfinite(z), z if alternative == "smaller" else -z, np.inf)
    order = np.argsort(s, kind="stable")
    cum = np.cumsum(pmf[:, order], axis=1)
    last = np.searchsorted(s[order], s[order] + 1e-9 * (1 + np.abs(s[order])), side="right") - 1
    last = np.where(np.isfinite(s[order]), last, s.size - 1)
    p = np.empty(s.size)
    p[order] = np.minimum(cum[:, last].max(axis=0), 1.0)
    return p


def _mn_statistic(k1: int, n1: int, k0: int, n0: int, value: float) -> float:
    with warnings.catch_warnings(), np.errstate(divide="ignore", invalid="ignore"):
        # statsmodels also computes the ratio and odds ratio of the rates, undefined at a zero count
        warnings.simplefilter("ignore", RuntimeWarning)
        return float(test_proportions_2indep(k1, n1, k0, n0, value=value, method="score", compare="diff").statistic)


@functools.lru_cache(maxsize=256)
def independent_table_p(n1: int, n0: int, value: float, alternative: Alternative) -> np.ndarray:
    """The exact unconditional p-value of every table ``[k1, k0]`` (shape ``(n1 + 1, n0 + 1)``) for
    ``H0: p1 - p0 <= value`` (``larger``) or ``>= value`` (``smaller``)."""
    k1, k0 = np.meshgrid(np.arange(n1 + 1), np.arange(n0 + 1), indexing="ij")
    z = np.array([_mn_statistic(int(a), n1, int(b), n0, value) for a, b in zip(k1.ravel(), k0.ravel(), strict=True)])
    p0 = np.linspace(max(0.0, -value), min(1.0, 1.0 - value), GRID)[:, None]
    pmf = sps.binom.pmf(k1.ravel()[None, :], n1, p0 + value) * sps.binom.pmf(k0.ravel()[None, :], n0, p0)
    return _sup_tail(z, pmf, alternative).reshape(k1.shape)


def independent_p(k1: int, n1: int, k0: int, n0: int, value: float, alternative: Alternative) -> float:
    """One-sided exact unconditional p of ``k1/n1 - k0/n0`` against ``value`` (Miettinen-Nurminen order)."""
    return float(independent_table_p(int(n1), int(n0), float(value), alternative)[int(k1), int(k0)])


def tango_mle(n10, n01, n: int, value: float):
    """The maximum-likelihood ``p01`` of paired binary outcomes under ``p10 - p01 = value``
    (arrays of counts broadcast)."""
    n10, n01 = np.asarray(n10, dtype=float), np.asarray(n01, dtype=float)
    a = 2.0 * n
    b = (2.0 * n - n10 + n01) * value - (n10 + n01)
    c = -n01 * value * (1.0 - value)
    return (-b + np.sqrt(np.maximum(b * b - 4.0 * a * c, 0.0))) / (2.0 * a)


def tango_z(n10, n01, n: int, value: float):
    """Tango's score statistic of the paired rate difference ``(n10 - n01) / n`` against ``value``
    (``n10``: pairs with the outcome under treatment only; ``n01``: under control only); NaN
    where it carries no information (a zero variance)."""
    n10, n01 = np.asarray(n10, dtype=float), np.asarray(n01, dtype=float)
    var = n * (2.0 * tango_mle(n10, n01, n, value) + value * (1.0 - value))
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(var > 0, (n10 - n01 - n * value) / np.sqrt(var), np.nan)


@functools.lru_cache(maxsize=256)
def paired_table_p(n: int, value: float, alternative: Alternative) -> np.ndarray:
    """The exact unconditional p-value of every paired table ``[n10, n01]`` (shape ``(n + 1, n + 1)``,
    NaN where ``n10 + n01 > n``) for ``H0: p10 - p01 <= value`` (``larger``) or ``>= value``."""
    a, b = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
    ok = a + b <= n
    a_, b_ = a[ok], b[ok]
    p01 = np.linspace(max(0.0, -value), (1.0 - value) / 2, GRID)[:, None]
    p10 = p01 + value
    with np.errstate(divide="ignore", invalid="ignore"):
        logp = (gammaln(n + 1) - gammaln(a_ + 1) - gammaln(b_ + 1) - gammaln(n - a_ - b_ + 1)
                + np.where(a_ > 0, a_ * np.log(p10), 0.0) + np.where(b_ > 0, b_ * np.log(p01), 0.0)
                + np.where(n - a_ - b_ > 0, (n - a_ - b_) * np.log1p(-p10 - p01), 0.0))
    out = np.full(a.shape, np.nan)
    out[ok] = _sup_tail(tango_z(a_, b_, n, value), np.exp(logp), alternative)
    return out


def paired_p(n10: int, n01: int, n: int, value: float, alternative: Alternative) -> float:
    """One-sided exact unconditional p of the paired rate difference ``(n10 - n01) / n`` against
    ``value`` (Tango's order)."""
    if n == 0:
        return 1.0
    return float(paired_table_p(int(n), float(value), alternative)[int(n10), int(n01)])
