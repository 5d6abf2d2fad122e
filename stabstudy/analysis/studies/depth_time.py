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
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import xarray as xr
from scipy import stats as sps

from stabstudy.analysis import claims as C
from stabstudy.analysis.plan import Planned
from stabstudy.hparams import field_docs
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


def gpt_claim_grid(depth: int, seeds: Sequence[int], *, warmup: int, steps: int, log_every: int = 1,
                   **hp: Any) -> list[RunSpec]:
    """The arms the GPT claims compare, at ``depth`` blocks: post-LN without and with ``warmup``,
    pre-LN without (the seed is the unit: one run per arm and seed)."""
    kw = dict(steps=steps, log_every=log_every, **hp)
    return (gpt_depth_grid([depth], seeds, warmups=[0, warmup], post_ln=(True,), **kw)
            + gpt_depth_grid([depth], seeds, warmups=[0], post_ln=(False,), **kw))


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


def rate_table(per_run: pd.DataFrame, by: Sequence[str], loss: str, outcome: str = "diverged") -> pd.DataFrame:
    """The rate of ``outcome`` (a boolean column: ``diverged``, or ``failed`` of :func:`mark_failed`)
    per group of ``per_run`` (a table of :func:`seq_runs_table` or :func:`gpt_runs_table`): runs,
    the count (column named ``outcome``), rate with its Clopper-Pearson 95% interval, and the median
    and range of ``loss`` over the runs that did not diverge."""
    rows = []
    for key, g in per_run.groupby(list(by), sort=True):
        key = key if isinstance(key, tuple) else (key,)
        k, n = int(g[outcome].sum()), int(len(g))
        lo, hi = C.rate_ci(k, n)
        vals = g[loss].dropna()
        rows.append({**dict(zip(by, key, strict=True)), "runs": n, outcome: k, "rate": k / n if n else np.nan,
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


def unigram_entropy(tokens: np.ndarray) -> float:
    """Entropy (nats) of the byte frequencies of ``tokens``: the loss of a model that knows only
    how often each byte occurs, the plateau a language model must get below to have learned anything else."""
    counts = np.bincount(np.asarray(tokens, dtype=np.int64).ravel())
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def _outcome(diverged: pd.Series, value: pd.Series, if_diverged: float, ok: pd.Series) -> pd.Series:
    """1.0 / 0.0 where ``ok`` (boolean Series), ``if_diverged`` for a diverged run, NaN where a run
    that did not diverge has no ``value`` (no verdict)."""
    out = ok.astype(float).where(value.notna(), np.nan)
    return out.where(~diverged.astype(bool), if_diverged)


def mark_failed(per_run: pd.DataFrame, loss: str, threshold: float) -> pd.DataFrame:
    """``per_run`` with a column ``failed`` (1.0 or 0.0; NaN without a ``loss``): the run diverged,
    or its ``loss`` is not below ``threshold``."""
    return per_run.assign(failed=_outcome(per_run.diverged, per_run[loss], 1.0, per_run[loss] >= threshold))


def mark_solved(per_run: pd.DataFrame, loss: str, threshold: float) -> pd.DataFrame:
    """``per_run`` with a column ``solved`` (1.0 or 0.0; NaN without a ``loss``): the run did not
    diverge and its ``loss`` is below ``threshold``."""
    return per_run.assign(solved=_outcome(per_run.diverged, per_run[loss], 0.0, per_run[loss] < threshold))


# -- the analysis plan -----------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """Notebook 06's analysis plan, fixed before the runs: each confirmatory claim's smallest effect
    of interest, in the claim's own units, and its family (one question in one domain; Holm adjusts
    within a family only). Each field's doc says what it is and where its number comes from."""

    rel_tol: float = 0.05
    """closed forms, every sigma and draw (universal): relative tolerance of a slope against its target; the accuracy the mean-field recursion claims at width 128 (finite-width corrections of order 1/width)"""
    abs_tol: float = 0.005
    """closed forms: the tolerance's floor near a zero target (log units per layer or step), the project's flat-profile margin: a gradient that changes less than exp(0.005 x 64) = 1.38-fold over 64 layers is flat"""
    flatten: float = 0.005
    """pre-LN residual blocks flatten the depth profile: smallest drop of |slope| below the plain linear network's (log units per layer, per network over the sigmas that are not 1), the same flat-profile margin"""
    rate: float = 0.5
    """'clipping prevents divergence', 'lets the LSTM solve the task', 'post-LN fails without warmup / where pre-LN trains': smallest difference of two rates, the claims' own words (a remedy that prevents, or a design that fails, changes the outcome of at least half the runs)"""
    loss: float = 0.03
    """'post-LN ends at a higher training loss': smallest paired difference (nats), the project's 1% of the final loss (about 3 nats here; about the seed-to-seed spread)"""
    fail_margin: float = 0.1
    """a GPT run fails to train when it diverges or ends less than this many nats below the unigram entropy of its corpus (the loss of byte frequencies alone): the plateau where the pilot's post-LN runs stalled, at every learning rate, spans about this much around that entropy (the seed-to-seed spread of a final training loss at this batch size; pilot in the CHANGELOG)"""
    solved_frac: float = 0.1
    """an adding-problem run solves the task when its final test MSE is below this fraction of the constant predictor's (1/6): it explains 90% of what the constant leaves (Hochreiter & Schmidhuber 1997; Le et al. 2015 read the task against that baseline)"""
    growth: float = 0.3
    """post-LN's gradients grow toward the output: smallest mean over networks of Spearman's rho of block index with the block's gradient norm at init, the project's margin for correlations"""
    alpha: float = 0.05
    """family-wise error of each of a rule's two one-sided tests (Holm within the family)"""
    depth_family: str = "closed forms through depth (networks at init)"
    """the linear network against sigma^(L-l), the tanh network against the mean field and against log sigma"""
    time_family: str = "closed forms through time (linear RNN at init)"
    """the linear RNN against sigma^k"""
    flatten_family: str = "residual blocks and the depth profile (linear networks at init)"
    """pre-LN residual blocks against the plain network"""
    clip_family: str = "clipping and divergence (adding problem, SGD)"
    """one row per recurrent learner"""
    adam_family: str = "clipping and learning (adding problem, Adam)"
    """the Adam arm"""
    warmup_family: str = "post-LN and warmup (GPT at depth)"
    """post-LN without warmup against with it: failure rate and final loss"""
    placement_family: str = "post-LN against pre-LN (GPT at depth, no warmup)"
    """failure rate and final loss"""
    growth_family: str = "post-LN gradients at init (GPT)"
    """one row per initialisation"""

    def planned(self) -> dict[str, Planned]:
        """Each confirmatory question's family and smallest effect of interest, with where it comes
        from (the field docs), for :func:`stabstudy.analysis.plan.frame`."""
        why = field_docs(type(self))
        tol = f"{why['rel_tol']}; {why['abs_tol']}"
        return {
            "linear network and tanh network (closed forms)": Planned(self.depth_family, self.rel_tol,
                                                                      "relative error, every case", tol),
            "linear RNN (closed form)": Planned(self.time_family, self.rel_tol, "relative error, every case", tol),
            "pre-LN residual blocks flatten": Planned(self.flatten_family, self.flatten, "log units per layer",
                                                      why["flatten"]),
            "clipping prevents divergence (SGD)": Planned(self.clip_family, self.rate, "rate difference", why["rate"]),
            "clipping lets the LSTM solve the task (Adam)": Planned(self.adam_family, self.rate, "rate difference",
                                                                    f"{why['rate']}; {why['solved_frac']}"),
            "post-LN fails more often without warmup": Planned(self.warmup_family, self.rate, "rate difference",
                                                               f"{why['rate']}; {why['fail_margin']}"),
            "post-LN ends higher without warmup": Planned(self.warmup_family, self.loss, "nats", why["loss"]),
            "post-LN fails more often than pre-LN": Planned(self.placement_family, self.rate, "rate difference",
                                                            f"{why['rate']}; {why['fail_margin']}"),
            "post-LN ends higher than pre-LN": Planned(self.placement_family, self.loss, "nats", why["loss"]),
            "post-LN gradients grow toward the output": Planned(self.growth_family, self.growth,
                                                                "Spearman's rho, mean over networks", why["growth"]),
        }


# -- claims ------------------------------------------------------------------------------


def closed_form_claim(slopes: xr.DataArray, claim: str, source: str, plan: Plan, family: str,
                      target: xr.DataArray | None = None) -> C.Claim:
    """Universal: every slope of ``slopes`` (dims ``sigma``, ``seed``) lies within the plan's
    tolerance (relative, with its absolute floor) of its target, ``log sigma`` or ``target`` (dim
    ``sigma``); a failing case is named by its sigma and seed."""
    s = slopes.transpose("sigma", "seed")
    tgt = np.log(s.sigma.values) if target is None else target.sel(sigma=s.sigma).values
    labels = [f"sigma={sg:g} seed {sd}" for sg in s.sigma.values for sd in s.seed.values]
    return C.within_tolerance(claim, source, s.values.ravel(), np.repeat(np.asarray(tgt, dtype=float), s.sizes["seed"]),
                              rel_tol=plan.rel_tol, abs_tol=plan.abs_tol, labels=labels, family=family)


def flatten_claim(variant: xr.DataArray, plain: xr.DataArray, claim: str, source: str, plan: Plan) -> C.Claim:
    """The slopes of ``variant`` against those of ``plain`` (dims ``sigma``, ``seed``): per network
    (seed) the mean ``|slope|`` over the sigmas that are not 1 (where the plain network's profile
    explodes or vanishes), then a paired t-test over networks that ``variant``'s is lower by more
    than nothing, not supported when every drop of the plan's ``flatten`` is excluded."""
    away = variant.sigma.values != 1.0
    v = np.abs(variant.isel(sigma=away)).mean("sigma").transpose("seed")
    p = np.abs(plain.isel(sigma=away)).mean("sigma").sel(seed=v.seed)
    return C.paired_difference(claim, source, v.values, p.values, direction="less", sesoi=plan.flatten,
                               family=plan.flatten_family, alpha=plan.alpha)


def _pick(df: pd.DataFrame, sel: Mapping[str, Any]) -> pd.DataFrame:
    mask = np.ones(len(df), dtype=bool)
    for col, val in sel.items():
        mask &= (df[col] == val).to_numpy()
    return df[mask]


def rate_claim(per_run: pd.DataFrame, claim: str, source: str, treated: Mapping[str, Any],
               control: Mapping[str, Any], *, sesoi: float, family: str, outcome: str = "diverged",
               direction: C.Direction = "greater", where: Any = None, alpha: float = 0.05) -> C.Claim:
    """:func:`~stabstudy.analysis.claims.rate_comparison` of the binary ``outcome`` between the runs
    of ``per_run`` matching ``treated`` and those matching ``control`` (column -> value), among the
    rows selected by the boolean Series ``where`` (all when None): one run per seed and arm, the seed
    the unit."""
    df = per_run if where is None else per_run[where]
    df = df[df[outcome].notna()]  # a run without a verdict on the outcome is no unit
    t, c = _pick(df, treated), _pick(df, control)
    return C.rate_comparison(claim, source, int(t[outcome].astype(float).sum()), len(t),
                             int(c[outcome].astype(float).sum()), len(c),
                             direction=direction, sesoi=sesoi, family=family, alpha=alpha)


def paired_loss_claim(per_run: pd.DataFrame, claim: str, source: str, loss: str, treated: Mapping[str, Any],
                      control: Mapping[str, Any], on: Sequence[str], *, direction: C.Direction, sesoi: float,
                      family: str, where: Any = None, alpha: float = 0.05) -> C.Claim:
    """:func:`~stabstudy.analysis.claims.paired_difference` of ``loss`` (treated - control) over runs
    paired by the columns ``on`` (the seed: the unit); a pair with a diverged member drops out."""
    df = per_run if where is None else per_run[where]
    both = pd.concat([_pick(df, treated).set_index(list(on))[loss].rename("t"),
                      _pick(df, control).set_index(list(on))[loss].rename("c")], axis=1, join="inner")
    return C.paired_difference(claim, source, both.t.to_numpy(), both.c.to_numpy(), direction=direction,
                               sesoi=sesoi, family=family, alpha=alpha)


def growth_rho(block_norms: xr.DataArray, post_ln: bool) -> xr.DataArray:
    """Per network (seed), Spearman's rho of block index with the block's gradient norm at init, at
    the largest depth of ``block_norms`` for the given LayerNorm placement (dim ``seed``)."""
    n = int(block_norms.n_layer.max())
    one = block_norms.sel(post_ln=post_ln, n_layer=n).isel(block=slice(0, n)).transpose("seed", "block")
    rho = [float(sps.spearmanr(np.arange(n), row).statistic) if np.isfinite(row).all() else np.nan
           for row in one.values]
    return xr.DataArray(rho, dims=("seed",), coords={"seed": one.seed.values}, name="rho")


def growth_claim(block_norms: xr.DataArray, post_ln: bool, claim: str, source: str, plan: Plan) -> C.Claim:
    """The block gradient norms at init grow toward the output: :func:`growth_rho` per network, then
    a one-sample t-test over networks that their mean lies above 0, not supported when every mean
    rho of the plan's ``growth`` or more is excluded."""
    rho = growth_rho(block_norms, post_ln).values
    return C.paired_difference(claim, source, rho, np.zeros_like(rho), direction="greater", sesoi=plan.growth,
                               family=plan.growth_family, alpha=plan.alpha)


def claims_table(plan: Plan, *, slopes: xr.DataArray, time_slopes: xr.DataArray, mean_field: xr.DataArray,
                 sgd_runs: pd.DataFrame, adam_runs: pd.DataFrame, gpt_runs: pd.DataFrame,
                 grad_norms: Mapping[str, xr.DataArray], seq_clip: float, claim_depth: int, gpt_warmup: int,
                 fail_below: float) -> list[C.Claim]:
    """Notebook 06's claims from its measurements: ``slopes`` (dims ``activation``, ``variant``,
    ``sigma``, ``seed``) and ``time_slopes`` (``kind``, ``sigma``, ``seed``) of :func:`log_slope`,
    the tanh network's ``mean_field`` slopes (:func:`mean_field_slopes`), the adding-problem runs
    (:func:`seq_runs_table`, SGD and Adam), the GPT runs (:func:`gpt_runs_table`) of which those of
    ``claim_depth`` blocks decide (a run fails when it diverged or its final loss is not below
    ``fail_below``: :func:`mark_failed`), and the per-block gradient norms at init per
    initialisation (``grad_norms``)."""
    lin = slopes.sel(activation="linear", variant="plain")
    tanh = slopes.sel(activation="tanh", variant="plain")
    rows = [closed_form_claim(lin, "deep linear network: slope = log sigma at every sigma and draw",
                              "textbook (Saxe et al. 2014)", plan, plan.depth_family),
            closed_form_claim(time_slopes.sel(kind="rnn_linear"), "linear RNN through time: slope = log sigma at every "
                              "sigma and draw", "textbook (Bengio et al. 1994; Pascanu et al. 2013)", plan, plan.time_family),
            closed_form_claim(tanh, "tanh network: slope = the mean-field prediction at every sigma and draw",
                              "source paper (Schoenholz et al. 2017)", plan, plan.depth_family, target=mean_field),
            closed_form_claim(tanh, "tanh network: slope = log sigma (the linear closed form) at every sigma and draw",
                              "our own", plan, plan.depth_family)]
    if "preln_residual" in slopes.variant.values:
        rows.append(flatten_claim(slopes.sel(activation="linear", variant="preln_residual"), lin,
                                  "pre-LN residual blocks flatten the depth profile where the plain linear network's "
                                  "explodes or vanishes (|slope| per network, sigma != 1)", "our own", plan))
    for learner, lr in dict.fromkeys(zip(sgd_runs.learner, sgd_runs.lr, strict=True)):
        rows.append(rate_claim(sgd_runs, f"clipping prevents divergence ({learner}, SGD lr {lr:g})",
                               "source paper (Pascanu et al. 2013)", {"learner": learner, "grad_clip": 0.0},
                               {"learner": learner, "grad_clip": seq_clip}, sesoi=plan.rate, family=plan.clip_family,
                               alpha=plan.alpha))
    solved = mark_solved(adam_runs, "final_test_loss", plan.solved_frac / 6)
    for learner, lr in dict.fromkeys(zip(adam_runs.learner, adam_runs.lr, strict=True)):
        rows.append(rate_claim(solved, f"clipping lets the {learner} solve the adding problem more often (Adam lr "
                               f"{lr:g})", "our own",
                               {"learner": learner, "grad_clip": seq_clip}, {"learner": learner, "grad_clip": 0.0},
                               outcome="solved", sesoi=plan.rate, family=plan.adam_family, alpha=plan.alpha))
    gpt = mark_failed(gpt_runs[gpt_runs.n_layer == claim_depth], "final_loss", fail_below)
    nowarm, warm, pre = ({"post_ln": True, "warmup": 0}, {"post_ln": True, "warmup": gpt_warmup},
                         {"post_ln": False, "warmup": 0})
    xiong = "source paper (Xiong et al. 2020)"
    at = f"{claim_depth} blocks"
    rows += [rate_claim(gpt, f"post-LN fails to train more often without warmup than with it ({at})", xiong, nowarm,
                        warm, outcome="failed", sesoi=plan.rate, family=plan.warmup_family, alpha=plan.alpha),
             paired_loss_claim(gpt, f"post-LN ends at a higher training loss without warmup than with it ({at}, paired "
                               "by seed)", xiong, "final_loss", nowarm, warm, ["seed"], direction="greater",
                               sesoi=plan.loss, family=plan.warmup_family, alpha=plan.alpha),
             rate_claim(gpt, f"without warmup, post-LN fails to train more often than pre-LN ({at})", xiong, nowarm, pre,
                        outcome="failed", sesoi=plan.rate, family=plan.placement_family, alpha=plan.alpha),
             paired_loss_claim(gpt, f"without warmup, post-LN ends at a higher training loss than pre-LN ({at}, paired "
                               "by seed)", xiong, "final_loss", nowarm, pre, ["seed"], direction="greater",
                               sesoi=plan.loss, family=plan.placement_family, alpha=plan.alpha)]
    for name, g in grad_norms.items():
        rows.append(growth_claim(g, True, f"post-LN: gradient norms at init grow toward the output ({name} init, "
                                 f"{int(g.n_layer.max())} blocks, rho per network)", xiong, plan))
    return rows
