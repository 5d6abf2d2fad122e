"""Notebook 06 (gradients through depth and time): its grids, slopes, tables and claims.

Reads arrays and Datasets only (the networks are built in :mod:`stabstudy.learners.depth`
and :mod:`stabstudy.learners.seq`). The closed forms:

* a deep linear network with weights ``sigma * Q`` (``Q`` orthogonal) scales the
  backpropagated gradient by exactly ``sigma`` per layer, so ``log ||dL/dh||`` grows by
  ``log sigma`` per layer away from the output; a linear RNN with recurrent matrix
  ``sigma * Q`` does the same per time step;
* a tanh network follows the mean-field recursion (Poole et al. 2016; Schoenholz et al.
  2017): the pre-activation variance ``q_l = sigma^2 E[tanh^2(sqrt(q_{l-1}) z)]`` and the
  per-layer gradient factor ``chi_l = sigma^2 E[tanh'(sqrt(q_l) z)^2]``, ``z ~ N(0, 1)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import xarray as xr

from stabstudy.analysis import claims as C
from stabstudy.spec import RunSpec

# -- grids -------------------------------------------------------------------------------


def seq_grid(learners: Sequence[str], lrs: Mapping[str, float] | float, seeds: Sequence[int],
             clips: Sequence[float], *, steps: int, log_every: int = 1, eval_every: int = 0,
             **hp: Any) -> list[RunSpec]:
    """Adding-problem runs: every learner x clip (0 = off) x seed; ``lrs`` per learner or one for all.
    ``hp`` (as :class:`~stabstudy.hparams.SeqHParams`) go to every spec; ``grad_clip`` and ``lr`` are
    always stored, so that both are coordinates of the loaded runs. ``eval_every``: test-loss cadence
    (0 = the learner's default; the last step is always evaluated)."""
    out = []
    for learner in learners:
        lr = float(lrs[learner] if isinstance(lrs, Mapping) else lrs)
        for clip in clips:
            for seed in seeds:
                out.append(RunSpec("seq", learner, "adding", int(steps), int(seed), log_every=int(log_every),
                                   eval_every=int(eval_every), hparams={**hp, "lr": lr, "grad_clip": float(clip)}))
    return out


def gpt_depth_grid(depths: Sequence[int], seeds: Sequence[int], *, warmups: Sequence[int],
                   post_ln: Sequence[bool] = (False, True), steps: int, log_every: int = 1,
                   **hp: Any) -> list[RunSpec]:
    """GPT runs on the stdlib corpus: every depth x LayerNorm placement x warmup x seed. ``n_layer``,
    ``post_ln`` and ``warmup`` are always stored (coordinates of the loaded runs); ``hp`` as
    :class:`~stabstudy.hparams.GPTHParams`."""
    return [RunSpec("lm", "gpt", "stdlib", int(steps), int(seed), log_every=int(log_every),
                    hparams={**hp, "n_layer": int(n), "post_ln": bool(pl), "warmup": int(w)})
            for n in depths for pl in post_ln for w in warmups for seed in seeds]


# -- slopes and closed forms --------------------------------------------------------------


def _slope_1d(x: np.ndarray, y: np.ndarray) -> float:
    keep = np.isfinite(y) & (y > 0)
    if keep.sum() < 2:
        return np.nan
    return float(np.polyfit(x[keep], np.log(y[keep]), 1)[0])


def log_slope(norms: xr.DataArray, dim: str) -> xr.DataArray:
    """Least-squares slope of ``log(norms)`` against the coordinate of ``dim``, for every other index.

    ``norms``: positive values with dimension ``dim`` (e.g. ``from_output`` or ``lag``); entries
    that are not finite and positive are left out. Returns ``norms`` without ``dim`` (NaN where
    fewer than two points remain). For ``sigma^k`` profiles the slope is ``log sigma``.
    """
    x = np.asarray(norms[dim].values, dtype=float)
    return xr.apply_ufunc(lambda y: _slope_1d(x, y), norms, input_core_dims=[[dim]], vectorize=True,
                          output_dtypes=[float]).rename("log_slope")


def tanh_mean_field_log_profile(sigma: float, depth: int, q0: float = 1.0, n_points: int = 101) -> np.ndarray:
    """Mean-field prediction of ``log(||dL/dh_l|| / ||dL/dh_L||)`` of a plain tanh network with
    weights ``sigma * Q`` and inputs of mean square ``q0``, shape (depth + 1,), index = layers from
    the output (``L - l``). Gauss-Hermite quadrature with ``n_points`` nodes."""
    z, w = np.polynomial.hermite_e.hermegauss(n_points)
    w = w / w.sum()
    log_chi = np.empty(depth)
    q = sigma ** 2 * q0  # layer 1 reads the raw input
    for layer in range(depth):
        if layer > 0:
            q = sigma ** 2 * float(np.sum(w * np.tanh(np.sqrt(q) * z) ** 2))
        chi = sigma ** 2 * float(np.sum(w * (1.0 - np.tanh(np.sqrt(q) * z) ** 2) ** 2))
        log_chi[layer] = 0.5 * np.log(chi)
    return np.concatenate([[0.0], np.cumsum(log_chi[::-1])])


def mean_field_slopes(sigmas: Sequence[float], depth: int, q0: float = 1.0) -> xr.DataArray:
    """:func:`log_slope` of :func:`tanh_mean_field_log_profile` per sigma: the slope a plain tanh
    network of ``depth`` layers should show, fitted the same way as the measured one (dim ``sigma``)."""
    k = np.arange(depth + 1, dtype=float)
    vals = [_slope_1d(k, np.exp(tanh_mean_field_log_profile(float(s), depth, q0))) for s in sigmas]
    return xr.DataArray(vals, dims=("sigma",), coords={"sigma": [float(s) for s in sigmas]}, name="mean_field_slope")


def slope_table(slopes: xr.DataArray, predicted: xr.DataArray | None = None) -> pd.DataFrame:
    """One row per sigma of ``slopes`` (dims ``sigma``, ``seed``): the mean and spread over seeds,
    ``log sigma`` and the relative error against it (NaN where ``log sigma`` is 0), and, with
    ``predicted`` (dim ``sigma``), the prediction and the relative error against it."""
    rows = []
    for s in slopes.sigma.values:
        v = slopes.sel(sigma=s).values.ravel()
        v = v[np.isfinite(v)]
        m = float(v.mean()) if v.size else np.nan
        target = float(np.log(s))
        row = {"sigma": float(s), "slope": m, "slope_sd": float(v.std(ddof=1)) if v.size > 1 else np.nan,
               "n": int(v.size), "log_sigma": target,
               "rel_error": (m - target) / abs(target) if target != 0 else np.nan}
        if predicted is not None:
            p = float(predicted.sel(sigma=s))
            row.update(predicted=p, rel_error_predicted=(m - p) / abs(p) if p != 0 else np.nan)
        rows.append(row)
    return pd.DataFrame(rows)


def closed_form_claims(slopes: xr.DataArray, what: str, source: str, *, rel_tol: float = 0.05,
                       flat_margin: float = 0.005) -> list[C.Claim]:
    """One claim per sigma that the slopes (dims ``sigma``, ``seed``) equal ``log sigma``:
    :func:`~stabstudy.analysis.claims.within_tolerance` at ``rel_tol`` where ``log sigma != 0``; at
    sigma = 1, where a relative error is undefined, a TOST :func:`~stabstudy.analysis.claims.equivalence`
    of the slopes with 0 within ``+-flat_margin`` (per layer or step)."""
    out = []
    for s in slopes.sigma.values:
        v = slopes.sel(sigma=s).values.ravel()
        target = float(np.log(s))
        if target != 0:
            out.append(C.within_tolerance(f"{what}: slope = log sigma at sigma = {s:g}", source, v, target,
                                          rel_tol=rel_tol))
        else:
            out.append(C.equivalence(f"{what}: flat profile (slope 0) at sigma = 1", source, v, np.zeros_like(v),
                                     margin=flat_margin, relative=False, paired=True))
    return out


# -- training runs -------------------------------------------------------------------------


def spike_count(x: np.ndarray, factor: float = 10.0, window: int = 20) -> int:
    """Steps where ``x`` exceeds ``factor`` times the median of the ``window`` steps before (NaNs skipped)."""
    s = pd.Series(np.asarray(x, dtype=float)).dropna()
    ref = s.rolling(window, min_periods=max(window // 2, 1)).median().shift(1)
    return int((s > factor * ref).sum())


def _last_finite(x: np.ndarray) -> float:
    v = np.asarray(x, dtype=float)
    v = v[np.isfinite(v)]
    return float(v[-1]) if v.size else np.nan


def _coord(runs: xr.Dataset, name: str, i: int, default: Any = np.nan) -> Any:
    return runs[name].values[i].item() if name in runs.coords else default


def seq_runs_table(runs: xr.Dataset, *, spike_factor: float = 10.0, spike_window: int = 20) -> pd.DataFrame:
    """One row per adding-problem run of ``runs`` (dims ``run``, ``step`` from ``load_runs``):
    learner, clip, lr, seed, status, ``diverged``, the step it diverged at, gradient-norm spikes
    (:func:`spike_count` of ``grad_norm_raw``), the largest pre-clip gradient norm, the share of
    clipped steps and the final test loss (NaN for diverged runs: they have no final model)."""
    rows = []
    for i in range(runs.sizes["run"]):
        one = runs.isel(run=i)
        status = str(one.status.values)
        # load_runs pads shorter runs with NaN; `perturbed` (0 or 1) is recorded on every step of a run
        n_steps = int(np.isfinite(one["perturbed"].values).sum())
        gn = one["grad_norm_raw"].values
        rows.append({"learner": str(one.learner.values), "grad_clip": float(_coord(runs, "hp_grad_clip", i)),
                     "lr": float(_coord(runs, "hp_lr", i)), "seed": int(one.seed.values), "status": status,
                     "diverged": status == "diverged",
                     "diverged_at": n_steps - 1 if status == "diverged" else np.nan,
                     "spikes": spike_count(gn, spike_factor, spike_window),
                     "max_grad_norm_raw": float(np.nanmax(gn)) if np.isfinite(gn).any() else np.nan,
                     "clipped_frac": float(np.nanmean(one["clipped"].values)) if np.isfinite(one["clipped"].values).any() else np.nan,
                     "final_test_loss": _last_finite(one["test_loss"].values) if status == "ok" else np.nan})
    return pd.DataFrame(rows)


def gpt_runs_table(runs: xr.Dataset, tail: float = 0.1) -> pd.DataFrame:
    """One row per GPT run of ``runs``: depth, post_ln, warmup, seed, status, ``diverged``, the
    training loss at the first step and averaged over the last ``tail`` of the run (NaN for
    diverged runs), the last validation loss, and the largest gradient norm."""
    rows = []
    for i in range(runs.sizes["run"]):
        one = runs.isel(run=i)
        status = str(one.status.values)
        loss = one["loss"].values
        fin = loss[np.isfinite(loss)]
        k = max(1, int(round(tail * fin.size)))
        gn = one["grad_norm"].values
        rows.append({"n_layer": int(_coord(runs, "hp_n_layer", i)), "post_ln": bool(_coord(runs, "hp_post_ln", i)),
                     "warmup": int(_coord(runs, "hp_warmup", i)), "seed": int(one.seed.values), "status": status,
                     "diverged": status == "diverged",
                     "initial_loss": float(fin[0]) if fin.size else np.nan,
                     "final_loss": float(fin[-k:].mean()) if fin.size and status == "ok" else np.nan,
                     "final_val_loss": _last_finite(one["val_loss"].values) if status == "ok" else np.nan,
                     "max_grad_norm": float(np.nanmax(gn)) if np.isfinite(gn).any() else np.nan})
    return pd.DataFrame(rows)


def rate_table(per_run: pd.DataFrame, by: Sequence[str], loss: str) -> pd.DataFrame:
    """Divergence per group of ``per_run`` (a table of :func:`seq_runs_table` or :func:`gpt_runs_table`):
    runs, diverged, rate with its Clopper-Pearson 95% interval, and the median and range of ``loss``
    over the runs that did not diverge."""
    rows = []
    for key, g in per_run.groupby(list(by), sort=True):
        key = key if isinstance(key, tuple) else (key,)
        k, n = int(g.diverged.sum()), int(len(g))
        lo, hi = C.rate_ci(k, n)
        vals = g[loss].dropna()
        rows.append({**dict(zip(by, key, strict=True)), "runs": n, "diverged": k, "rate": k / n if n else np.nan,
                     "rate_ci_low": lo, "rate_ci_high": hi, f"median_{loss}": float(vals.median()) if len(vals) else np.nan,
                     f"min_{loss}": float(vals.min()) if len(vals) else np.nan,
                     f"max_{loss}": float(vals.max()) if len(vals) else np.nan})
    return pd.DataFrame(rows)


def block_profile_table(block_norms: xr.DataArray) -> pd.DataFrame:
    """Per depth and LayerNorm placement of ``block_norms`` (dims ``post_ln``, ``n_layer``, ``seed``,
    ``block``): the gradient norm of the last block over the first (median over seeds) and the
    slope of log norm per block toward the output (:func:`log_slope` along ``block``)."""
    rows = []
    slopes = log_slope(block_norms, "block")
    for pl in block_norms.post_ln.values:
        for n in block_norms.n_layer.values:
            one = block_norms.sel(post_ln=pl, n_layer=n).isel(block=slice(0, int(n)))
            ratio = (one.isel(block=-1) / one.isel(block=0)).median("seed")
            rows.append({"post_ln": bool(pl), "n_layer": int(n), "last_over_first": float(ratio),
                         "slope_per_block": float(slopes.sel(post_ln=pl, n_layer=n).median("seed"))})
    return pd.DataFrame(rows)


# -- claims ------------------------------------------------------------------------------


def rate_claim(per_run: pd.DataFrame, claim: str, source: str, treated: Mapping[str, Any],
               control: Mapping[str, Any], *, where: Any = None) -> C.Claim:
    """:func:`~stabstudy.analysis.claims.rate_comparison` of divergence between the runs of
    ``per_run`` matching ``treated`` and those matching ``control`` (column -> value), among the
    rows selected by the boolean Series ``where`` (all when None): treated diverges more often."""
    df = per_run if where is None else per_run[where]

    def pick(sel: Mapping[str, Any]) -> pd.DataFrame:
        mask = np.ones(len(df), dtype=bool)
        for col, val in sel.items():
            mask &= (df[col] == val).to_numpy()
        return df[mask]

    t, c = pick(treated), pick(control)
    return C.rate_comparison(claim, source, int(t.diverged.sum()), len(t), int(c.diverged.sum()), len(c),
                             direction="greater")


def paired_loss_claim(per_run: pd.DataFrame, claim: str, source: str, loss: str, treated: Mapping[str, Any],
                      control: Mapping[str, Any], on: Sequence[str], *, direction: C.Direction,
                      where: Any = None) -> C.Claim:
    """:func:`~stabstudy.analysis.claims.paired_difference` of ``loss`` (treated - control) over runs
    paired by the columns ``on`` (e.g. seed and depth); a pair with a diverged member drops out."""
    df = per_run if where is None else per_run[where]

    def pick(sel: Mapping[str, Any]) -> pd.DataFrame:
        mask = np.ones(len(df), dtype=bool)
        for col, val in sel.items():
            mask &= (df[col] == val).to_numpy()
        return df[mask].set_index(list(on))[loss]

    both = pd.concat([pick(treated).rename("t"), pick(control).rename("c")], axis=1, join="inner")
    return C.paired_difference(claim, source, both.t.to_numpy(), both.c.to_numpy(), direction=direction)


def block_growth_claim(block_norms: xr.DataArray, post_ln: bool, claim: str, source: str,
                       expect: str = "positive") -> C.Claim:
    """:func:`~stabstudy.analysis.claims.correlation` (Spearman) of block index with the block's
    gradient norm at init, at the largest depth of ``block_norms`` for the given LayerNorm placement,
    every seed pooled."""
    n = int(block_norms.n_layer.max())
    one = block_norms.sel(post_ln=post_ln, n_layer=n).isel(block=slice(0, n))
    x = np.broadcast_to(one.block.values, one.shape)
    return C.correlation(claim, source, x.ravel(), one.values.ravel(), expect=expect)
