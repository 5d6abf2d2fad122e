"""Do the channels depart in the same direction before an event, whatever is being trained?

The source paper's claim is cross-domain: instability shows one shape in the telemetry shared by
learning paradigms. Here each event's *pre-onset direction* is the mean robust z-score (the
meta-state's causal standardisation, :mod:`stabstudy.online.metastate`) of each shared channel over
the ``window`` steps before the label's onset; a domain's direction is the mean over its events.
Two domains agree when the cosine of their directions is larger than it would be if the channels
were matched at random: the null permutes the channels of one domain's direction (exactly, over
every permutation up to ``max_perm``, else a seeded sample). The interval resamples seeds within
each domain (the independent unit).
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Sequence

import numpy as np
import pandas as pd
import xarray as xr
from scipy import stats as sps


def pre_onset_directions(meta: xr.Dataset, info: pd.DataFrame, features: Sequence[str], window: int) -> pd.DataFrame:
    """One row per event run of ``info``: the mean z of each of ``features`` (columns) over
    ``[onset - window, onset)``, and its ``seed``. ``meta`` holds ``z`` (dims run, step, feature)."""
    ev = info[info.event]
    z = meta["z"].sel(feature=list(features))
    rows = {}
    for run, x in ev.iterrows():
        a, b = max(int(x.onset) - window, 0), int(x.onset)
        w = z.sel(run=run).values[a:b]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a channel all NaN in the window stays NaN
            rows[run] = np.nanmean(w, axis=0) if len(w) else np.full(len(features), np.nan)
    out = pd.DataFrame.from_dict(rows, orient="index", columns=list(features))
    return out.assign(seed=ev.seed.reindex(out.index))


def _cos(u: np.ndarray, v: np.ndarray) -> float:
    n = np.linalg.norm(u) * np.linalg.norm(v)
    return float(u @ v / n) if n > 0 else np.nan


def _direction(d: pd.DataFrame, features: Sequence[str]) -> np.ndarray:
    x = d[list(features)].to_numpy(float)
    x = x[np.isfinite(x).all(axis=1)]
    return x.mean(axis=0) if len(x) else np.full(len(features), np.nan)


def similarity(a: pd.DataFrame, b: pd.DataFrame, features: Sequence[str], *, n_boot: int = 1000, seed: int = 0,
               max_perm: int = 5040) -> dict[str, float]:
    """Cosine of the mean pre-onset directions of two domains (rows of :func:`pre_onset_directions`).

    Returns ``cos``, ``p_greater`` / ``p_less`` (share of channel permutations whose cosine is at
    least / at most the observed one), ``ci_low``, ``ci_high`` (seed bootstrap within each domain),
    ``n_a``, ``n_b`` (events with a finite direction) and ``n`` (seeds, the smaller domain's).
    """
    features = list(features)
    u, v = _direction(a, features), _direction(b, features)
    n_a = int(np.isfinite(a[features].to_numpy(float)).all(axis=1).sum())
    n_b = int(np.isfinite(b[features].to_numpy(float)).all(axis=1).sum())
    n_units = min(a.seed.nunique(), b.seed.nunique()) if n_a and n_b else 0
    out = {"cos": _cos(u, v), "p_greater": np.nan, "p_less": np.nan, "ci_low": np.nan, "ci_high": np.nan,
           "n_a": n_a, "n_b": n_b, "n": n_units}
    if not np.isfinite(out["cos"]):
        return out
    rng = np.random.default_rng(seed)
    d = len(features)
    perms = (np.array(list(itertools.permutations(range(d)))) if math.factorial(d) <= max_perm
             else np.array([rng.permutation(d) for _ in range(max_perm)]))
    null = np.array([_cos(u, v[p]) for p in perms])
    out["p_greater"] = float(np.mean(null >= out["cos"] - 1e-12))
    out["p_less"] = float(np.mean(null <= out["cos"] + 1e-12))
    if n_boot and n_units >= 2:
        def stat(sa: np.ndarray, sb: np.ndarray) -> float:
            return _cos(_direction(a.loc[_draw(a, sa)], features), _direction(b.loc[_draw(b, sb)], features))

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            res = sps.bootstrap((np.unique(a.seed), np.unique(b.seed)), stat, n_resamples=n_boot, vectorized=False,
                                method="percentile", random_state=rng)
        out["ci_low"], out["ci_high"] = float(res.confidence_interval.low), float(res.confidence_interval.high)
    return out


def _draw(d: pd.DataFrame, seeds: np.ndarray) -> list:
    """The rows of the drawn ``seeds``, a seed drawn twice counting twice."""
    return [r for s in seeds for r in d.index[d.seed == s]]
