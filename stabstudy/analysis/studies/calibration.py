"""Notebook 00 (instrument calibration): its grid and the checks computed from its runs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import xarray as xr

from stabstudy.analysis.plan import Planned
from stabstudy.spec import Perturbation, RunSpec

if TYPE_CHECKING:
    from stabstudy.analysis.claims import Claim

# -- grid builders and calibration analyses (notebook 00) ---------------------------------


def base_spec(learner: str, steps: int, seed: int = 0, task: str = "digits", *, log_every: int = 1,
              eval_every: int = 0, curvature_every: int = 0,
              perturbations: Sequence[Perturbation] = (), **hp: Any) -> RunSpec:
    """A toy RunSpec storing only the given hyperparameters (the rest are :data:`DEFAULTS`)."""
    return RunSpec(domain="toy", learner=learner, task=task, steps=steps, seed=seed, hparams=hp,
                   perturbations=tuple(perturbations), log_every=log_every, eval_every=eval_every,
                   curvature_every=curvature_every)


def adam_eos_target(lr: float, beta1: float) -> float:
    """Adaptive edge of stability (Cohen et al. 2022): (2 + 2 beta1) / ((1 - beta1) lr)."""
    return (2.0 + 2.0 * beta1) / ((1.0 - beta1) * lr)


def calibration_grid(gd_lrs: Sequence[float], adam_lrs: Sequence[float], *, gd_steps: int, adam_steps: int,
                     seeds: Sequence[int] = (0,), spike_seeds: Sequence[int] | None = None,
                     curvature_every: int = 10, spike_lr: float | None = None,
                     spike_dose: float = 2.0, spike_start: int | None = None, spike_duration: int = 10,
                     spike_steps: int | None = None, spike_curvature_every: int = 2,
                     task: str = "digits", **hp: Any) -> dict[str, list[RunSpec]]:
    """Specs for notebook 00: full-batch GD at each of ``gd_lrs`` (edge of stability),
    full-batch Adam at each of ``adam_lrs`` (adaptive edge of stability), and a
    baseline / ``lr_spike`` pair of GD runs at ``spike_lr`` (default: the first GD
    lr) of ``spike_steps`` (default ``gd_steps``) steps, the spike multiplying the
    lr by ``spike_dose`` on ``[spike_start, spike_start + spike_duration)``
    (default start: 80% of the run), curvature every ``spike_curvature_every``, for
    each of ``spike_seeds`` (default ``seeds``: the pairs are the catapult claims'
    units, cheaper than a GD sweep). ``hp`` go to every spec.

    Returns ``{"gd": [...], "adam": [...], "spike": [...]}`` (spike: baseline then
    spiked, per seed).
    """
    out: dict[str, list[RunSpec]] = {"gd": [], "adam": [], "spike": []}
    for seed in seeds:
        for lr in gd_lrs:
            out["gd"].append(base_spec("gd", gd_steps, seed, task, curvature_every=curvature_every, lr=float(lr), **hp))
        for lr in adam_lrs:
            out["adam"].append(base_spec("adam", adam_steps, seed, task, curvature_every=curvature_every,
                                         lr=float(lr), **hp))
    s_lr = float(spike_lr if spike_lr is not None else gd_lrs[0])
    s_steps = int(spike_steps or gd_steps)
    start = spike_start if spike_start is not None else (s_steps * 4) // 5
    pert = Perturbation("lr_spike", start=int(start), duration=int(spike_duration), dose=float(spike_dose))
    for seed in seeds if spike_seeds is None else spike_seeds:
        for perts in ((), (pert,)):
            out["spike"].append(base_spec("gd", s_steps, seed, task, curvature_every=spike_curvature_every,
                                          lr=s_lr, perturbations=perts, **hp))
    return out


def _tail(da: xr.DataArray, frac: float) -> xr.DataArray:
    """The last ``frac`` of the run's steps (NaN-free values of ``da``)."""
    steps = da.step.values
    finite = steps[np.isfinite(da.values)]
    if finite.size == 0:
        return da.isel(step=slice(0, 0))
    cut = finite.max() - frac * (finite.max() + 1)
    return da.where(da.step > cut).dropna("step")


def eos_table(runs: xr.Dataset, *, tail: float = 0.4, tolerance: float = 0.2,
              channel: str = "lambda_max", beta1: float | None = None) -> Any:
    """Edge-of-stability check per run of ``runs`` (dims ``run, step`` from ``load_runs``).

    For each run: the median of ``channel`` over the last ``tail`` fraction of
    training, the target (2/lr for GD; :func:`adam_eos_target` when ``beta1`` is
    given, for ``precond_sharpness``), their ratio and whether it lies within
    ``1 +- tolerance``. Returns a pandas DataFrame.
    """
    import pandas as pd

    rows = []
    for r in range(runs.sizes["run"]):
        one = runs.isel(run=r)
        lr = float(one["hp_lr"])
        target = 2.0 / lr if beta1 is None else adam_eos_target(lr, beta1)
        vals = _tail(one[channel], tail).values
        med = float(np.median(vals)) if vals.size else float("nan")
        ratio = med / target
        rows.append({"learner": str(one.learner.values), "seed": int(one.seed.values), "lr": lr, "target": target,
                     f"median_{channel}": med, "ratio": ratio, "n_measurements": int(vals.size),
                     "status": str(one.status.values),
                     "passed": bool(np.isfinite(ratio) and abs(ratio - 1.0) <= tolerance)})
    return pd.DataFrame(rows)


def spike_response(baseline: xr.Dataset, spiked: xr.Dataset, start: int, duration: int,
                   window: int = 20) -> dict[str, float]:
    """Response of one run to an ``lr_spike`` on ``[start, start + duration)``, vs its baseline.

    Returns: ``loss_jump`` (max loss in the window / baseline loss there),
    ``grad_norm_jump`` (same for grad_norm), ``sharpness_before`` (median
    lambda_max over ``window`` steps before the spike), ``sharpness_after``
    (median over ``window`` steps after the window ends, in the spiked run),
    ``sharpness_drop`` = 1 - after / before, and the same for the baseline run.
    """
    def win(ds, var, a, b):
        da = ds[var].sel(step=slice(a, b - 1))
        return da.values[np.isfinite(da.values)]

    end = start + duration
    a, b = start, end + window
    loss_jump = np.max(win(spiked, "loss", a, b)) / np.max(win(baseline, "loss", a, b))
    gn_jump = np.max(win(spiked, "grad_norm", a, b)) / np.max(win(baseline, "grad_norm", a, b))
    before = np.median(win(spiked, "lambda_max", start - window, start))
    after = np.median(win(spiked, "lambda_max", end + 1, end + 1 + window))
    base_after = np.median(win(baseline, "lambda_max", end + 1, end + 1 + window))
    return {"loss_jump": float(loss_jump), "grad_norm_jump": float(gn_jump),
            "sharpness_before": float(before), "sharpness_after": float(after),
            "sharpness_drop": float(1.0 - after / before),
            "baseline_sharpness_after": float(base_after),
            "baseline_sharpness_drop": float(1.0 - base_after / before)}


def spike_checks(resp: dict[str, float], *, min_jump: float = 2.0, min_extra_drop: float = 0.2) -> list[dict[str, Any]]:
    """Pass/fail of check (d) from :func:`spike_response`: the loss and the gradient
    norm jump at least ``min_jump``-fold over the baseline, and the sharpness after
    the spike falls by at least ``min_extra_drop`` (fraction of its value before)
    more than the baseline's does over the same steps (the catapult)."""
    extra = resp["sharpness_drop"] - resp["baseline_sharpness_drop"]
    return [
        {"check": "loss jump (x baseline)", "measured": resp["loss_jump"], "threshold": min_jump,
         "passed": bool(resp["loss_jump"] >= min_jump)},
        {"check": "grad-norm jump (x baseline)", "measured": resp["grad_norm_jump"], "threshold": min_jump,
         "passed": bool(resp["grad_norm_jump"] >= min_jump)},
        {"check": "extra sharpness drop after spike", "measured": extra, "threshold": min_extra_drop,
         "passed": bool(np.isfinite(extra) and extra >= min_extra_drop)},
    ]


def _per_lr(tab: Any) -> tuple[np.ndarray, np.ndarray]:
    """Median ``ratio`` over seeds at each learning rate of an :func:`eos_table` (NaN: no
    measurement), and the learning rates, in increasing order."""
    if tab is None or len(tab) == 0:
        return np.array([]), np.array([])
    out, lrs = [], []
    for lr, g in tab.groupby("lr"):
        r = g["ratio"].to_numpy(float)
        out.append(float(np.median(r[np.isfinite(r)])) if np.isfinite(r).any() else np.nan)
        lrs.append(float(lr))
    return np.asarray(out), np.asarray(lrs)


def plan(*, gd_tolerance: float = 0.2, adam_tolerance: float = 0.2, min_jump: float = 2.0,
         min_extra_drop: float = 0.2) -> dict[str, Planned]:
    """Notebook 00's analysis plan, from its parameters: each claim's family and smallest effect.

    The checks against a closed form are universal (every learning rate within its tolerance), so their
    tolerance is what they are decided at; the catapult's claims are "at least" claims, whose stated
    minimum is their smallest effect of interest."""
    lewkowycz = "the claim's own words (its threshold, Lewkowycz et al. 2020's catapult)"
    return {
        "lanczos": Planned("curvature instrument (toy MLP)", 0.02, "relative error",
                           "the measurement's precision: Lanczos converged to a relative residual of 1e-5, 0.02 "
                           "is loose enough for 20 Hessian-vector products"),
        "gd_eos": Planned("edge of stability (toy MLP, full batch)", gd_tolerance, "relative error of the median",
                          "Cohen et al. 2021 report sharpness 'hovering just above' 2/lr: a band of +-20%"),
        "adam_eos": Planned("edge of stability (toy MLP, full batch)", adam_tolerance, "relative error of the median",
                            "Cohen et al. 2022: the same band for the adaptive threshold"),
        "loss_jump": Planned("catapult after an lr spike (toy MLP)", float(np.log(min_jump)), "log ratio",
                             lewkowycz, minimum=float(np.log(min_jump))),
        "grad_jump": Planned("catapult after an lr spike (toy MLP)", float(np.log(min_jump)), "log ratio",
                             lewkowycz, minimum=float(np.log(min_jump))),
        "sharpness_drop": Planned("catapult after an lr spike (toy MLP)", float(min_extra_drop),
                                  "relative sharpness drop beyond the baseline's", lewkowycz,
                                  minimum=float(min_extra_drop)),
    }


def claims_table(dense: dict[str, Any] | None, gd: Any, adam: Any, spikes: Any, *, gd_tolerance: float = 0.2,
                 adam_tolerance: float = 0.2, min_jump: float = 2.0, min_extra_drop: float = 0.2,
                 min_lrs: int = 3, min_adam_lrs: int = 2, alpha: float = 0.05) -> list[Claim]:
    """Notebook 00's claims as :class:`stabstudy.analysis.claims.Claim` rows, decided by :func:`plan`.

    Args:
        dense: :func:`stabstudy.learners.toy.lambda_max_check` (check a; None: not run).
        gd, adam: :func:`eos_table` of the GD and Adam runs (checks b and c).
        spikes: one :func:`spike_response` per seed (a DataFrame or list of dicts; check d).
        gd_tolerance, adam_tolerance: relative tolerance of the median sharpness
            against 2/lr and (2 + 2 beta1) / ((1 - beta1) lr).
        min_jump: loss and grad-norm factor over the baseline the spike must exceed.
        min_extra_drop: relative sharpness drop after the spike beyond the baseline's.
        min_lrs, min_adam_lrs: learning rates the GD / Adam claims need.

    Rules: (a) one measurement against a closed form: ``within_tolerance`` with ``min_n=1`` (the claim
    is about this one check); (b, c) ``within_tolerance`` of the median ratio over seeds at each learning
    rate, universal over the learning rates (n = learning rates; a failing one is named); (d)
    ``paired_difference`` over seeds of the log jump (at least ``log(min_jump)``) and of the spiked
    run's sharpness drop minus the baseline's (at least ``min_extra_drop``).
    """
    import pandas as pd

    from stabstudy.analysis import claims as C

    p = plan(gd_tolerance=gd_tolerance, adam_tolerance=adam_tolerance, min_jump=min_jump,
             min_extra_drop=min_extra_drop)
    rows = []
    if dense is None:
        rows.append(C.not_tested("Lanczos lambda_max matches the dense Hessian's top eigenvalue", "our own",
                                 "check (a) not run", family=p["lanczos"].family))
    else:
        rows.append(C.within_tolerance(
            f"Lanczos lambda_max matches the dense Hessian's top eigenvalue ({dense.get('iters_used', '?')} HVPs)",
            "textbook: Pearlmutter 1994 (exact Hessian-vector products)", [dense["measured"]], dense["target"],
            rel_tol=float(dense["tolerance"]), min_n=1, family=p["lanczos"].family))
    for key, tab, claim, source, tol, need in (
            ("gd_eos", gd, f"full-batch GD: sharpness hovers at 2/lr, for at least {min_lrs} learning rates",
             "source paper: Cohen et al. 2021", gd_tolerance, min_lrs),
            ("adam_eos", adam, "full-batch Adam: preconditioned sharpness settles near (2 + 2 beta1) / ((1 - beta1) lr)",
             "source paper: Cohen et al. 2022", adam_tolerance, min_adam_lrs)):
        ratios, lrs = _per_lr(tab)
        rows.append(C.within_tolerance(claim, source, ratios, 1.0, rel_tol=tol, min_n=need,
                                       labels=[f"lr {lr:g}" for lr in lrs], family=p[key].family))
    sp = pd.DataFrame(list(spikes) if not isinstance(spikes, pd.DataFrame) else spikes)

    def col(name: str) -> np.ndarray:
        return sp[name].to_numpy(float) if name in sp else np.array([])

    with np.errstate(divide="ignore", invalid="ignore"):
        for key, name, what in (("loss_jump", "loss_jump", "loss"), ("grad_jump", "grad_norm_jump", "gradient norm")):
            jump = np.log(col(name))
            rows.append(C.paired_difference(
                f"an lr spike at the edge of stability makes the {what} jump at least {min_jump:g}-fold over "
                "the baseline run (log ratio)", "source paper: Lewkowycz et al. 2020", jump, np.zeros(jump.shape),
                direction="greater", alpha=alpha, **p[key].rule))
    drop, base = col("sharpness_drop"), col("baseline_sharpness_drop")
    rows.append(C.paired_difference(
        f"after the spike the sharpness falls at least {min_extra_drop:g} (relative) more than in the baseline "
        "run (catapult)", "source paper: Lewkowycz et al. 2020", drop, base, direction="greater", alpha=alpha,
        **p["sharpness_drop"].rule))
    return rows
