"""Evaluation curves of RL runs: returns on a common env-step axis, read as step functions.

``perf`` at row ``s`` of a run is the return of the policy after ``s`` updates, which is the policy
acting from env step ``env_step[s]`` until the next update: a curve is a step function of env steps.
:func:`finite_pairs` and :func:`step_at` are the one way this package reads one (every comparison at
"the same env step" goes through them); :func:`eval_curves` puts the runs of a Dataset on one axis.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import xarray as xr

from stabstudy.analysis import stats


def finite_pairs(curve: xr.DataArray | tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Finite ``(env steps, returns)`` of a 1-D curve over ``env_step`` (or such a pair), sorted by env step."""
    if isinstance(curve, tuple):
        s, v = (np.asarray(a, dtype=float) for a in curve)
    else:
        s, v = np.asarray(curve["env_step"].values, dtype=float), np.asarray(curve.values, dtype=float)
    ok = np.isfinite(s) & np.isfinite(v)
    order = np.argsort(s[ok], kind="stable")
    return s[ok][order], v[ok][order]


def step_at(s: np.ndarray, v: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """The step function of sorted ``(s, v)`` at each point of ``grid``: the last value at or before
    it (NaN before the first point and after the last: where the run has not started or has stopped)."""
    grid = np.asarray(grid, dtype=float)
    out = np.full(grid.size, np.nan)
    if s.size:
        idx = np.searchsorted(s, grid, side="right") - 1
        ok = (idx >= 0) & (grid <= s[-1])
        out[ok] = v[idx[ok]]
    return out


def stop_env_step(ds: xr.Dataset, i: int) -> float:
    """Last env step run ``i`` of ``ds`` recorded (where training stopped; NaN when none)."""
    env = ds["env_step"]
    e = np.asarray(env.isel(run=i).values if "run" in env.dims else env.values, dtype=float)
    return float(np.nanmax(e)) if np.isfinite(e).any() else np.nan


def eval_curves(ds: xr.Dataset, env_grid: Sequence[int] | None = None) -> xr.DataArray:
    """Evaluation returns on a common env-step axis: DataArray ``(run, env_step)``.

    ``ds``: from :func:`stabstudy.run.store.load_runs` (dims ``(run, step)``, 2-D ``env_step``
    coordinate) or one run (dim ``step``). Each run's ``(env_step, perf)`` pairs are placed on
    ``env_grid`` (default: the union of those env steps) by :func:`step_at`.
    """
    if "run" not in ds.dims:
        ds = ds.expand_dims(run=[0])
    perf = ds["perf"].transpose("run", "step").values
    env = ds["env_step"]
    when = np.asarray(env.transpose("run", "step").values if "run" in env.dims
                      else np.broadcast_to(env.values, perf.shape), dtype=float)
    pairs = [finite_pairs((when[i], perf[i])) for i in range(perf.shape[0])]
    if env_grid is None:
        env_grid = np.unique(np.concatenate([w for w, _ in pairs])) if pairs else np.array([])
    grid = np.asarray(env_grid, dtype=float)
    out = np.stack([step_at(w, v, grid) for w, v in pairs]) if pairs else np.full((0, grid.size), np.nan)
    coords = {c: ("run", ds[c].values) for c in ds.coords if ds[c].dims == ("run",)}
    coords.setdefault("spec_hash", ("run", ds["run"].values))  # load_runs: the run coordinate is the spec hash
    coords["env_step"] = grid.astype(np.int64)
    return xr.DataArray(out, dims=("run", "env_step"), coords=coords, name="perf")


def first_last_returns(ds: xr.Dataset) -> pd.DataFrame:
    """Per run of ``ds`` (:func:`stabstudy.run.store.load_runs`, dims ``(run, step)``): its first
    evaluation return (``untrained`` for a prefix trained from scratch) and its last (``final``),
    NaN for a run without evaluations. Indexed by the run (spec hash)."""
    rows = {}
    for run in ds.run.values:
        perf = ds.perf.sel(run=run).dropna("step").values
        rows[run] = (perf[0], perf[-1]) if perf.size else (np.nan, np.nan)
    return pd.DataFrame.from_dict(rows, orient="index", columns=["untrained", "final"])


def evaluation_spread(ds: xr.Dataset) -> pd.DataFrame:
    """Per run of ``ds`` (:func:`stabstudy.run.store.load_runs`): ``evaluations`` (rows with a return)
    and the median and largest ``perf_std`` over them (the standard deviation of an evaluation's
    episode returns, seeded starts; NaN with one episode per evaluation). Indexed by the run, with
    its ``learner``."""
    rows = {}
    for i, run in enumerate(ds.run.values):
        one = ds.isel(run=i)
        ok = np.isfinite(one["perf"].values)
        sd = one["perf_std"].values[ok] if "perf_std" in ds else np.full(int(ok.sum()), np.nan)
        fin = sd[np.isfinite(sd)]
        rows[str(run)] = {"learner": str(one["learner"].values) if "learner" in ds.coords else "",
                          "evaluations": int(ok.sum()), "perf_std_median": float(np.median(fin)) if fin.size else np.nan,
                          "perf_std_max": float(fin.max()) if fin.size else np.nan}
    return pd.DataFrame.from_dict(rows, orient="index")


def return_reference(prefix_ds: xr.Dataset, fork_curves: xr.DataArray,
                     prefix_of: Mapping[str, str]) -> tuple[dict[str, float], float]:
    """``floors`` (per fork of ``prefix_of``, fork hash -> its prefix's hash: the prefix's untrained
    return, towards which a collapse falls) and the return ``scale`` shared by every stability score
    (the best evaluation of the prefixes and of ``fork_curves``, :func:`eval_curves`, minus the
    median untrained return of the prefixes)."""
    untrained = first_last_returns(prefix_ds).untrained.to_dict()
    floors = {f: untrained[p] for f, p in prefix_of.items()}
    best = max(np.nanmax(eval_curves(prefix_ds).values), np.nanmax(fork_curves.values))
    return floors, float(best - np.nanmedian(list(untrained.values())))


def run_frame(ds: xr.Dataset, spec_hash: str, channels: Sequence[str], agg: str | None = None) -> pd.DataFrame:
    """One run of a :func:`stabstudy.run.store.load_runs` Dataset indexed by ``env_step`` (rows of
    updates; channels absent in the Dataset are skipped). ``agg`` (e.g. ``"median"``): aggregate
    the rows sharing an env step (the updates of one on-policy ``train()`` call) with that pandas
    reduction."""
    one = ds.sel(run=spec_hash)
    env = one["env_step"].values
    ok = np.isfinite(env.astype(float))
    data = {ch: one[ch].values[ok] for ch in channels if ch in one}
    frame = pd.DataFrame(data, index=pd.Index(env[ok].astype(np.int64), name="env_step"))
    return frame.groupby(level=0).agg(agg) if agg else frame


def reliability_table(curves: xr.DataArray, by: Sequence[str] = ("learner", "pert_kind"), window: int = 5,
                      alpha: float = 0.05, smooth: int = 3, final_points: int = 3) -> pd.DataFrame:
    """Chan et al. 2020 reliability metrics per group of runs of :func:`eval_curves` output.

    Columns: ``dispersion_time`` (median over runs of DT, window ``window`` evaluations),
    ``short_term_risk`` (median SRT, CVaR ``alpha`` of differences), ``long_term_risk`` (median
    LRT, CVaR of drawdown), ``dispersion_runs`` (mean over evaluation points of DR after a
    ``smooth``-point moving average), ``risk_runs`` (RR: CVaR ``alpha`` of the final returns =
    mean of the last ``final_points`` evaluations).
    """
    c = curves.rename(env_step="step")
    keys = pd.DataFrame({k: c[k].values for k in by})
    rows = []
    for key, idx in keys.groupby(list(by)).groups.items():
        sub = c.isel(run=np.asarray(list(idx)))
        finals = [float(np.mean(v[np.isfinite(v)][-final_points:])) if np.isfinite(v).any() else np.nan
                  for v in sub.values]
        key = key if isinstance(key, tuple) else (key,)
        rows.append({**dict(zip(by, key, strict=True)), "n": sub.sizes["run"],
                     "dispersion_time": float(np.nanmedian(stats.dispersion_across_time(sub, window=window).values)),
                     "short_term_risk": float(np.nanmedian(stats.short_term_risk(sub, alpha=alpha).values)),
                     "long_term_risk": float(np.nanmedian(stats.long_term_risk(sub, alpha=alpha).values)),
                     "dispersion_runs": float(np.nanmean(stats.dispersion_across_runs(sub, smooth=smooth).values))
                     if sub.sizes["run"] > 1 else np.nan,
                     "risk_runs": stats.risk_across_runs(finals, alpha=alpha)})
    return pd.DataFrame(rows)


def run_coord(curves: xr.DataArray, name: str, default: Any = np.nan) -> np.ndarray:
    """The per-run coordinate ``name`` of ``curves`` (``default`` for every run where it is absent)."""
    n = curves.sizes["run"]
    return curves[name].values if name in curves.coords else np.full(n, default, dtype=object)
