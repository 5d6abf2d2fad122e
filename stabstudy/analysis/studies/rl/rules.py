"""The decision rule of notebook 01's claim (b), a function of each prefix's bracket of its critical dose (used by
:mod:`.claims` to decide and by :mod:`.power` to simulate it)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy import stats as sps

from stabstudy.analysis.stats import rank_test_p


def dose_verdict(low_a: Sequence[float], high_a: Sequence[float], low_b: Sequence[float], high_b: Sequence[float], *,
                 sesoi: float = 2.0, alpha: float = 0.05, exact: bool = True, seed: int = 0) -> tuple[str, float, float]:
    """Claim (b)'s rule for arm a (lower) against arm b, from each prefix's bracket ``(low, high]``:
    ``(verdict, p_for, p_against)``. ``p_for``: one-sided rank test "a's doses are lower" at the ends
    least favourable to it (a's ``high``, b's ``low``); ``p_against``: "b's doses are less than
    ``sesoi`` times a's" at the ends least favourable to that (a's ``low`` times ``sesoi``, b's
    ``high``). Supported when ``p_for < alpha``, not supported when ``p_against < alpha``, else
    inconclusive. ``inf`` (above every dose tried) ranks above every finite value; ``exact``: the
    permutation test (:func:`stabstudy.analysis.stats.rank_test_p`), else the normal approximation."""
    def p(x, y, alternative):
        x, y = np.log10(np.asarray(x, float)), np.log10(np.asarray(y, float))
        if np.all(np.concatenate([x, y]) == x[0]):
            return 1.0
        if exact:
            return rank_test_p(x, y, alternative, seed=seed)
        return float(sps.mannwhitneyu(x, y, alternative=alternative, method="asymptotic").pvalue)

    p_for = p(high_a, low_b, "less")
    p_against = p(np.asarray(low_a, float) * sesoi, high_b, "greater")
    verdict = "supported" if p_for < alpha else "not supported" if p_against < alpha else "inconclusive"
    return verdict, p_for, p_against
