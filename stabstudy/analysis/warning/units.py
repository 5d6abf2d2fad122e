"""Seeds as the units of the early-warning claims: per-seed summaries and the design effect of pooling
events.

Every run of a seed shares its initialisation, its data stream and (before a perturbation) its steps
with the seed's other runs, so the events of one seed are not independent: a test over events counts
one seed's luck several times. The claims of notebook 04 therefore summarise each seed (the mean of
its events' values) and test over seeds. How much pooling would have overstated the evidence is the
*design effect* ``1 + (m - 1) ICC`` (Kish 1965), with ``m`` events per seed and ``ICC`` the share of
the variance between seeds (the one-way ANOVA estimator).

The power of a claim decided over seeds is the claims' own (:mod:`stabstudy.analysis.power`).
"""

from __future__ import annotations

import numpy as np
import pandas as pd


def per_seed(values: pd.Series, seeds: pd.Series) -> pd.Series:
    """The mean of each seed's finite ``values`` (index: the seeds that have any), ``seeds`` giving the
    seed of every index of ``values``."""
    x = pd.Series(np.asarray(values, dtype=float), index=values.index)
    s = seeds.reindex(x.index)
    ok = np.isfinite(x.to_numpy()) & s.notna().to_numpy()
    return x[ok].groupby(s[ok].to_numpy()).mean()


def design_effect(values: pd.Series, seeds: pd.Series) -> dict[str, float]:
    """How much the events of ``values`` (index: run) cluster by seed: ``n`` events, ``k`` seeds,
    ``m`` mean events per seed, ``icc`` (one-way ANOVA estimator; NaN with fewer than 2 seeds or no
    seed with 2 events), ``deff = 1 + (m - 1) icc`` and ``n_eff = n / deff`` (the independent events
    the pooled test would have been worth)."""
    x = pd.Series(np.asarray(values, dtype=float), index=values.index)
    s = seeds.reindex(x.index)
    ok = np.isfinite(x.to_numpy()) & s.notna().to_numpy()
    x, s = x[ok].to_numpy(), s[ok].to_numpy()
    n = x.size
    groups = [x[s == u] for u in np.unique(s)]
    k = len(groups)
    out = {"n": float(n), "k": float(k), "m": n / k if k else np.nan, "icc": np.nan, "deff": np.nan, "n_eff": np.nan}
    if k < 2 or n - k < 1:
        if k and n == k:  # one event per seed: nothing is pooled
            out.update(deff=1.0, n_eff=float(n))
        return out
    sizes = np.array([g.size for g in groups], dtype=float)
    means = np.array([g.mean() for g in groups])
    msb = float(np.sum(sizes * (means - x.mean()) ** 2) / (k - 1))
    msw = float(sum(((g - g.mean()) ** 2).sum() for g in groups) / (n - k))
    m0 = (n - float(np.sum(sizes ** 2)) / n) / (k - 1)
    denom = msb + (m0 - 1) * msw
    icc = (msb - msw) / denom if denom > 0 else np.nan
    deff = 1 + (n / k - 1) * icc if np.isfinite(icc) else np.nan
    out.update(icc=float(icc), deff=float(deff), n_eff=float(n / deff) if np.isfinite(deff) and deff > 0 else np.nan)
    return out
