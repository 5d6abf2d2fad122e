"""Notebook 02 (nanoGPT spike studies): its grids and the analyses computed from its runs."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import xarray as xr

from stabstudy.analysis.plan import Planned
from stabstudy.hparams import GPTHParams, defaults
from stabstudy.spec import Perturbation, RunSpec

if TYPE_CHECKING:
    from stabstudy.analysis.claims import Claim


FAMILIES = {
    "lr_spike": "LR spike: loss spike, recovery, damage (GPT)",
    "outlier": "outlier batch: loss spike, recovery, damage, inflation (GPT)",
    "memory": "Adam's memory of an outlier batch (GPT)",
    "sensitivity": "LR sensitivity: qk-layernorm and z-loss (GPT, Wortsman et al. 2023)",
    "logits": "attention-logit growth with the LR (GPT, Wortsman et al. 2023)",
    "noise": "gradient noise buffers an LR spike (GPT)",
    "eos": "Adam's edge of stability around an LR spike (GPT, Cohen et al. 2022)",
}
"""Notebook 02's questions, one domain each: Holm adjusts within a family only."""


def plan(*, band: float = 0.05, min_ratio: float = 2.0, memory_tolerance: float = 0.5, loss_frac: float = 0.01,
         logit_fold: float = 2.0, correlation: float = 0.3, eos_tolerance: float = 0.2) -> dict[str, Planned]:
    """Notebook 02's analysis plan, from its parameters: each confirmatory claim's family and smallest
    effect of interest, fixed before the runs.

    The unit of every claim is the seed: a perturbed run against its unperturbed twin of the same seed
    (same initialisation and batches), or one summary per seed where a seed has several runs or
    measurements (the learning rates of the sweep, the sharpness measurements of a run).

    Args:
        band: the recovery band (nats) a spike exceeds and a transient one ends within.
        min_ratio: the factor an outlier batch inflates the gradient norm and Adam's v by, at least.
        memory_tolerance: the relative tolerance of "about 1/(1-beta2)".
        loss_frac: the project's margin, a fraction of the final loss (about the seed-to-seed spread).
        logit_fold: the smallest reduction of the maximum attention logit credited to qk-layernorm.
        correlation: the project's margin for correlations.
        eos_tolerance: "at Adam's threshold" means within this relative distance of it (notebook 00's
            calibration tolerance ``adam_tolerance``).
    """
    F = FAMILIES
    words = "the claim's own words"
    band_why = f"{words}: the {band:g}-nat recovery band"
    loss_why = f"the project's margin: {loss_frac:.0%} of the final loss, about the seed-to-seed spread"
    rho_why = f"the project's margin for correlations: rho {correlation:g}"
    eos_why = (f"{eos_tolerance:.0%} of the threshold: notebook 00's calibration tolerance for the preconditioned "
               "sharpness 'at' it")
    damage = "fraction of the twin's final validation loss"
    out: dict[str, Planned] = {}
    for kind in ("lr_spike", "outlier"):
        out |= {f"{kind} peak": Planned(F[kind], band, "nats of peak excess loss", band_why, minimum=band),
                f"{kind} transient": Planned(F[kind], band, "nats of final excess loss (TOST margin)", band_why),
                f"{kind} damage": Planned(F[kind], loss_frac, damage, loss_why)}
    fold = Planned(F["outlier"], float(np.log(min_ratio)), "log ratio to the twin", f"{words}: {min_ratio:g}-fold",
                   minimum=float(np.log(min_ratio)))
    return out | {
        "grad_norm inflation": fold,
        "adam_v inflation": fold,
        "memory efold": Planned(F["memory"], memory_tolerance, "relative error of the e-folding time (every run)",
                                f"{words}: 'about' 1/(1-beta2), at most {memory_tolerance:g} off"),
        "memory beta2": Planned(F["memory"], correlation, "Spearman rho over the runs", rho_why),
        "qk sensitivity": Planned(F["sensitivity"], loss_frac, "fraction of the baseline's best final loss",
                                  loss_why),
        "z sensitivity": Planned(F["sensitivity"], loss_frac, "fraction of the baseline's best final loss", loss_why),
        "logit growth": Planned(F["logits"], correlation, "Spearman rho per seed", rho_why),
        "qk logit": Planned(F["logits"], float(np.log(logit_fold)), "log ratio per seed",
                            f"the study's fold margin: {logit_fold:g}-fold, as in its 'at least 2-fold' claims"),
        "logit failure": Planned(F["logits"], correlation, "Spearman rho per seed", rho_why),
        "noise peak": Planned(F["noise"], band, "nats of peak excess loss", band_why),
        "noise damage": Planned(F["noise"], loss_frac, damage, loss_why),
        "eos outside": Planned(F["eos"], float(-np.log(1 - eos_tolerance)), "log ratio to Adam's threshold", eos_why),
        "eos spike": Planned(F["eos"], float(np.log(1 + eos_tolerance)), "log ratio to Adam's threshold", eos_why),
    }


def unit_costs(parts: Mapping[str, tuple[Sequence[RunSpec], str]], wall: Mapping[str, float]) -> pd.DataFrame:
    """The units of each part of a design and what they cost: one row per part with ``unit``,
    ``units`` (distinct seeds), ``runs``, ``worker_s`` (the stored runs' wall time on one worker,
    a run shared by several parts counted in each) and ``worker_s_per_unit``.

    ``parts``: name -> (its specs, the name of its unit); ``wall``: spec_hash -> seconds."""
    rows = []
    for name, (specs, unit) in parts.items():
        specs = list({s.spec_hash: s for s in specs}.values())
        seconds = float(sum(wall.get(s.spec_hash, np.nan) for s in specs)) if specs else 0.0
        n = len({s.seed for s in specs})
        rows.append({"part": name, "unit": unit, "units": n, "runs": len(specs), "worker_s": seconds,
                     "worker_s_per_unit": seconds / n if n else np.nan})
    return pd.DataFrame(rows).set_index("part")


def base_spec(steps: int, seed: int = 0, task: str = "stdlib", log_every: int = 1, eval_every: int = 0,
              curvature_every: int = 0, perturbations: tuple[Perturbation, ...] = (), **hp: Any) -> RunSpec:
    """A ``gpt`` RunSpec with ``hp`` over the learner defaults (only given names are stored)."""
    return RunSpec(domain="lm", learner="gpt", task=task, steps=steps, seed=seed, hparams=hp,
                   perturbations=perturbations, log_every=log_every, eval_every=eval_every,
                   curvature_every=curvature_every)


#: Architecture variants of the learning-rate sensitivity study (Wortsman et al. 2023).
VARIANTS: dict[str, dict[str, Any]] = {
    "baseline": {},
    "qk_layernorm": {"qk_layernorm": True},
    "z_loss": {"z_loss": 1e-4},
    "qk_layernorm+z_loss": {"qk_layernorm": True, "z_loss": 1e-4},
}
#: Perturbation kinds that are background conditions, not the studied event.
BACKGROUND_KINDS = ("grad_noise", "no_warmup")


def spike_grid(steps: int, spike_step: int, seeds: tuple[int, ...] = (0,),
               events: dict[str, tuple[float, int]] | None = None, beta2s: tuple[float, ...] = (0.95,),
               noise_levels: tuple[float, ...] = (0.0,), log_every: int = 1, eval_every: int = 0,
               curvature_every: int = 0, **hp: Any) -> list[RunSpec]:
    """Spike-anatomy grid: for every beta2 x noise level x seed, an unperturbed twin and one run per event.

    Args:
        steps: run length (optimizer updates).
        spike_step: step at which every event starts.
        seeds: one twin set per seed (the data stream depends on the seed only, so a
            perturbed run and its twin see the same batches).
        events: ``kind -> (dose, duration)``; default ``{"lr_spike": (10.0, 3),
            "outlier_batch": (1.0, 1)}``.
        beta2s: Adam beta2 values (Adam-memory study).
        noise_levels: ``grad_noise`` doses applied over the whole run (controlled
            stochasticity; 0 = none).
        hp: learner hyperparameters shared by every run.

    Returns:
        ``len(beta2s) * len(noise_levels) * len(seeds) * (1 + len(events))`` specs.
    """
    events = events if events is not None else {"lr_spike": (10.0, 3), "outlier_batch": (1.0, 1)}
    specs = []
    for beta2 in beta2s:
        for noise in noise_levels:
            for seed in seeds:
                background = (Perturbation("grad_noise", 0, steps, dose=noise),) if noise > 0 else ()
                h = {**hp, "beta2": beta2} if beta2 != GPTHParams.beta2 or "beta2" in hp else dict(hp)
                specs.append(base_spec(steps, seed, log_every=log_every, eval_every=eval_every,
                                       curvature_every=curvature_every, perturbations=background, **h))
                for kind, (dose, duration) in events.items():
                    ev = Perturbation(kind, spike_step, duration, dose=dose)
                    specs.append(base_spec(steps, seed, log_every=log_every, eval_every=eval_every,
                                           curvature_every=curvature_every, perturbations=(ev, *background), **h))
    return specs


def lr_sweep_grid(lrs: tuple[float, ...], steps: int, seeds: tuple[int, ...] = (0,),
                  variants: tuple[str, ...] = tuple(VARIANTS), log_every: int = 1, eval_every: int = 0,
                  **hp: Any) -> list[RunSpec]:
    """Learning-rate sweep x architecture variants (names in :data:`VARIANTS`) x seeds, unperturbed."""
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant(s) {unknown}; valid: {', '.join(VARIANTS)}")
    return [base_spec(steps, seed, log_every=log_every, eval_every=eval_every, **{**hp, **VARIANTS[v], "lr": float(lr)})
            for v in variants for lr in lrs for seed in seeds]


def variant_of(hp: dict[str, Any]) -> str:
    """Name of the :data:`VARIANTS` entry matching merged hyperparameters."""
    qk, z = bool(hp.get("qk_layernorm", False)), float(hp.get("z_loss", 0.0)) > 0
    return {(False, False): "baseline", (True, False): "qk_layernorm", (False, True): "z_loss",
            (True, True): "qk_layernorm+z_loss"}[(qk, z)]


def _event(spec: RunSpec) -> Perturbation | None:
    for p in spec.perturbations:
        if p.kind not in BACKGROUND_KINDS:
            return p
    return None


def _twin_key(spec: RunSpec) -> str:
    background = [p.to_dict() for p in spec.perturbations if p.kind in BACKGROUND_KINDS]
    # the cadences too: a twin logged every 5 steps is no step-by-step reference
    return json.dumps([spec.task, spec.steps, spec.seed, spec.hp, background, spec.log_every, spec.eval_every,
                       spec.curvature_every], sort_keys=True)


def run_table(specs: list[RunSpec]) -> pd.DataFrame:
    """One row per spec (index ``spec_hash``): seed, merged key hyperparameters, event and noise.

    Columns: ``seed, lr, beta2, batch_size, variant, event`` (kind of the first
    non-background perturbation or ``"none"``), ``dose, start, duration, noise``
    (``grad_noise`` dose, 0 when none) and ``twin`` (spec_hash of the unperturbed
    run with the same seed, hyperparameters, background and logging / evaluation /
    curvature cadences, "" when not in ``specs``).
    """
    rows, twins = [], {}
    for s in specs:
        if _event(s) is None:
            twins[_twin_key(s)] = s.spec_hash
    for s in specs:
        hp, ev = {**defaults(GPTHParams), **s.hp}, _event(s)
        noise = sum(p.dose for p in s.perturbations if p.kind == "grad_noise")
        rows.append({"spec_hash": s.spec_hash, "seed": s.seed, "lr": float(hp["lr"]), "beta2": float(hp["beta2"]),
                     "batch_size": int(hp["batch_size"]), "variant": variant_of(hp),
                     "event": ev.kind if ev else "none", "dose": ev.dose if ev else np.nan,
                     "start": ev.start if ev else np.nan, "duration": ev.duration if ev else np.nan,
                     "noise": float(noise), "twin": twins.get(_twin_key(s), "")})
    return pd.DataFrame(rows).set_index("spec_hash")


def _curve(ds: xr.Dataset, run: str, ch: str) -> np.ndarray:
    return np.asarray(ds[ch].sel(run=run).values, dtype=float)


def _smooth(x: np.ndarray, window: int) -> np.ndarray:
    if window <= 1:
        return x
    return pd.Series(x).rolling(window, min_periods=1, center=True).mean().to_numpy()


def _smooth_from(x: np.ndarray, start: int, window: int) -> np.ndarray:
    """``x`` smoothed (centred window) from ``start`` on, raw before it: a centred window
    reaching across ``start`` would carry the event back into the pre-event baseline."""
    out = np.array(x, dtype=float)
    out[start:] = _smooth(out[start:], window)
    return out


def _final(x: np.ndarray) -> float:
    ok = np.flatnonzero(np.isfinite(x))
    return float(x[ok[-1]]) if ok.size else np.nan


def spike_effects(ds: xr.Dataset, specs: list[RunSpec], smooth: int = 5, abs_tol: float = 0.05,
                  peak_window: int = 10) -> pd.DataFrame:
    """Per perturbed run, what the event did relative to its unperturbed twin (same seed and data).

    ``ds``: :func:`stabstudy.run.store.load_runs` output (dims run, step). The excess loss
    ``d(t) = loss_perturbed(t) - loss_twin(t)`` is 0 before the event because both runs see
    the same batches; from the event on it is smoothed over ``smooth`` steps (a centred
    window within the post-event part only, so that the baseline before the event stays
    the raw, zero excess). Columns:

    * ``peak_excess_loss``: max of ``d`` over ``[start, start + peak_window)`` (nats);
    * ``drawdown``: :func:`stabstudy.analysis.events.max_drawdown` of the smoothed perturbed loss
      from the event on (the largest rise of the loss, nats);
    * ``recovery_steps``: :func:`stabstudy.analysis.events.recovery_time` of ``d`` with an absolute band
      ``abs_tol`` nats (NaN: never left the band, nothing to recover from; inf: never came back
      within the run);
    * ``final_damage``: final ``val_loss`` minus the twin's (unrecovered damage, nats);
    * ``twin_final_loss``: the twin's final ``val_loss`` (the scale of the damage);
    * ``grad_norm_ratio``, ``update_ratio_ratio``, ``adam_v_ratio``: peak over the window
      divided by the twin's value at the same steps (max of the ratio);
    * ``xgrad_min``: lowest gradient coherence in the window;
    * ``attn_logit_peak``: max attention logit in the window.
    Plus the :func:`run_table` columns.
    """
    from stabstudy.analysis import events

    meta = run_table(specs)
    rows = []
    for h, r in meta.iterrows():
        if r.event == "none" or not r.twin or h not in ds.run.values or r.twin not in ds.run.values:
            continue
        s0 = int(r.start)
        win = slice(s0, s0 + peak_window)
        loss, twin = _curve(ds, h, "loss"), _curve(ds, r.twin, "loss")
        n = min(len(loss), len(twin))
        d = _smooth_from(loss[:n] - twin[:n], s0, smooth)
        steps = np.arange(n)
        out = {"spec_hash": h, **r.to_dict()}
        out["peak_excess_loss"] = float(np.nanmax(d[win])) if np.isfinite(d[win]).any() else np.nan
        out["drawdown"] = float(events.max_drawdown(_smooth_from(loss[:n], s0, smooth), steps, start=s0, higher_is_better=False))
        out["recovery_steps"] = float(events.recovery_time(d, s0, steps, abs_tol=abs_tol, higher_is_better=False))
        out["twin_final_loss"] = _final(_curve(ds, r.twin, "val_loss"))
        out["final_damage"] = _final(_curve(ds, h, "val_loss")) - out["twin_final_loss"]
        for ch, name in (("grad_norm", "grad_norm_ratio"), ("update_ratio", "update_ratio_ratio"),
                         ("adam_v_mean", "adam_v_ratio")):
            a, b = _curve(ds, h, ch)[win], _curve(ds, r.twin, ch)[win]
            with np.errstate(all="ignore"):
                ratio = a / b
            out[name] = float(np.nanmax(ratio)) if np.isfinite(ratio).any() else np.nan
        xg = _curve(ds, h, "xgrad")[win]
        out["xgrad_min"] = float(np.nanmin(xg)) if np.isfinite(xg).any() else np.nan
        al = _curve(ds, h, "attn_logit_max")[win]
        out["attn_logit_peak"] = float(np.nanmax(al)) if np.isfinite(al).any() else np.nan
        out["status"] = str(ds.status.sel(run=h).values) if "status" in ds.coords else ""
        rows.append(out)
    return pd.DataFrame(rows).set_index("spec_hash") if rows else pd.DataFrame()


def raw_adam_v(v_hat_mean: np.ndarray, beta2: float, steps: np.ndarray) -> np.ndarray:
    """Undo Adam's bias correction: mean of the stored ``v`` = ``mean(v_hat) * (1 - beta2^(t))``, t = step + 1."""
    return v_hat_mean * (1.0 - beta2 ** (np.asarray(steps, dtype=float) + 1.0))


def efold_time(excess: np.ndarray, fit_span: int | None = None) -> tuple[float, float, int]:
    """Decay time of a positive excess curve ``excess[k]``, k = steps since the event.

    Returns ``(t_efold, tau_fit, k_peak)``: ``t_efold`` = steps from the peak until the excess
    first falls to ``peak / e`` (inf when it never does within the data); ``tau_fit`` = ``-1 /
    slope`` of a least-squares line through ``log(excess)`` from the peak over ``fit_span``
    steps (all remaining by default; points with excess <= 0 are dropped), NaN when fewer
    than 3 points.
    """
    x = np.asarray(excess, dtype=float)
    if not np.isfinite(x).any() or np.nanmax(x) <= 0:
        return np.nan, np.nan, -1
    k0 = int(np.nanargmax(x))
    peak = x[k0]
    below = np.flatnonzero(x[k0:] <= peak / math.e)
    t_e = float(below[0]) if below.size else math.inf
    seg = x[k0:] if fit_span is None else x[k0:k0 + fit_span]
    k = np.arange(seg.size)
    ok = np.isfinite(seg) & (seg > 0)
    if ok.sum() < 3:
        return t_e, np.nan, k0
    slope = np.polyfit(k[ok], np.log(seg[ok]), 1)[0]
    tau = -1.0 / slope if slope < 0 else math.inf
    return t_e, float(tau), k0


def adam_memory(ds: xr.Dataset, specs: list[RunSpec], event: str = "outlier_batch",
                fit_span: int | None = None) -> pd.DataFrame:
    """How long inflated Adam second moments persist after an event, per beta2.

    For each perturbed run of kind ``event`` and its twin: the excess of the raw (not
    bias-corrected, see :func:`raw_adam_v`) mean second moment,
    ``dv(k) = v_perturbed(start + k) - v_twin(start + k)``, and its e-folding time and fitted
    decay constant (:func:`efold_time`), next to the EMA time constant ``1 / (1 - beta2)``
    (REFERENCES.md: a gradient's weight in v decays as beta2^k). ``fit_span`` defaults to
    ``min(2 / (1 - beta2), remaining steps)``. Columns: ``beta2, seed, noise, tau_theory,
    t_efold, tau_fit, peak_excess_rel`` (peak excess / twin value), ``steps_observed``.
    """
    meta = run_table(specs)
    rows = []
    for h, r in meta.iterrows():
        if r.event != event or not r.twin or h not in ds.run.values or r.twin not in ds.run.values:
            continue
        s0 = int(r.start)
        steps = ds.step.values
        v = raw_adam_v(_curve(ds, h, "adam_v_mean"), r.beta2, steps)
        vt = raw_adam_v(_curve(ds, r.twin, "adam_v_mean"), r.beta2, steps)
        dv = (v - vt)[s0:]
        dv = dv[: np.flatnonzero(np.isfinite(dv))[-1] + 1] if np.isfinite(dv).any() else dv
        tau_th = 1.0 / (1.0 - r.beta2)
        span = fit_span or int(min(2 * tau_th, dv.size))
        t_e, tau, k0 = efold_time(dv, span)
        with np.errstate(all="ignore"):
            rel = float(np.nanmax(dv) / vt[s0 + max(k0, 0)]) if k0 >= 0 else np.nan
        rows.append({"spec_hash": h, "beta2": r.beta2, "seed": r.seed, "noise": r.noise, "tau_theory": tau_th,
                     "t_efold": t_e, "tau_fit": tau, "peak_excess_rel": rel, "steps_observed": int(dv.size)})
    return pd.DataFrame(rows).set_index("spec_hash") if rows else pd.DataFrame()


def lr_sweep_table(ds: xr.Dataset, specs: list[RunSpec]) -> pd.DataFrame:
    """Per run of an LR sweep: ``variant, lr, seed, status, final_loss`` (last ``val_loss``;
    NaN when diverged), ``loss0`` (first training loss, i.e. at initialization),
    ``attn_logit_max`` and ``out_logit_max`` (max over the run), ``attn_entropy_min`` (min)."""
    meta = run_table(specs)
    rows = []
    for h, r in meta.iterrows():
        if h not in ds.run.values:
            continue
        status = str(ds.status.sel(run=h).values) if "status" in ds.coords else "ok"
        final = _final(_curve(ds, h, "val_loss")) if status == "ok" else np.nan
        row = {"spec_hash": h, "variant": r.variant, "lr": r.lr, "seed": r.seed, "status": status,
               "final_loss": final, "loss0": float(_curve(ds, h, "loss")[0])}
        for ch, f in (("attn_logit_max", np.nanmax), ("out_logit_max", np.nanmax), ("attn_entropy_min", np.nanmin)):
            c = _curve(ds, h, ch)
            row[ch] = float(f(c)) if np.isfinite(c).any() else np.nan
        rows.append(row)
    return pd.DataFrame(rows).set_index("spec_hash") if rows else pd.DataFrame()


def lr_sensitivity(final_loss: np.ndarray, loss0: float) -> float:
    """LR sensitivity (Wortsman et al. 2023): ``mean_lr [min(loss(lr), loss0)] - min_lr loss(lr)``.

    ``final_loss``: final losses over a log-spaced lr grid, shape (n_lr,); a diverged run
    (NaN/inf) counts as ``loss0``, the loss at initialization. 0 = every lr reaches the best
    loss; ``loss0 - min loss`` = only one lr trains at all (large = sensitive).
    """
    x = np.asarray(final_loss, dtype=float)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"final_loss must be a non-empty 1-D array over lr, got shape {x.shape}")
    x = np.where(np.isfinite(x), np.minimum(x, loss0), loss0)
    return float(x.mean() - x.min())


def lr_sensitivity_table(sweep: pd.DataFrame) -> pd.DataFrame:
    """:func:`lr_sensitivity` per variant (seed-averaged final loss per lr), with the best lr/loss,
    the lr range, and the largest attention logit reached at any lr."""
    rows = []
    for variant, g in sweep.groupby("variant", sort=False):
        # diverged seeds count as loss0 before averaging over seeds
        g = g.assign(fl=np.where(np.isfinite(g.final_loss), np.minimum(g.final_loss, g.loss0), g.loss0))
        per_lr = g.groupby("lr").agg(fl=("fl", "mean"), loss0=("loss0", "mean")).sort_index()
        loss0 = float(per_lr.loss0.mean())
        rows.append({"variant": variant, "lr_sensitivity": lr_sensitivity(per_lr.fl.to_numpy(), loss0),
                     "best_loss": float(per_lr.fl.min()), "best_lr": float(per_lr.fl.idxmin()),
                     "lr_min": float(per_lr.index.min()), "lr_max": float(per_lr.index.max()),
                     "n_diverged": int((g.status != "ok").sum()),
                     "attn_logit_max": float(g.attn_logit_max.max())})
    return pd.DataFrame(rows).set_index("variant")


def sharpness_table(ds: xr.Dataset, specs: list[RunSpec]) -> pd.DataFrame:
    """Measured sharpness against the stability thresholds, per run and measurement step.

    Columns: ``spec_hash, event, seed, step, lr`` (applied), ``lambda_max, two_over_lr, ratio``
    (= lambda_max / (2/lr), the gradient-descent threshold, which Adam is not bound by),
    ``precond_sharpness, adam_threshold, precond_ratio`` (top eigenvalue of P^-1 H against
    Adam's threshold (2 + 2 beta1) / ((1 - beta1) lr), Cohen et al. 2022; NaN where not
    measured), ``in_event`` (1 while the run's event is active). Empty when no
    ``lambda_max`` was measured.
    """
    from stabstudy.analysis.studies.calibration import adam_eos_target

    if "lambda_max" not in ds or not np.isfinite(ds.lambda_max.values).any():
        return pd.DataFrame()
    meta = run_table(specs)
    beta1 = {s.spec_hash: float(s.hp.get("beta1", GPTHParams.beta1)) for s in specs}
    rows = []
    for h, r in meta.iterrows():
        if h not in ds.run.values:
            continue
        lam, lr = _curve(ds, h, "lambda_max"), _curve(ds, h, "lr")
        pre = _curve(ds, h, "precond_sharpness") if "precond_sharpness" in ds else np.full_like(lam, np.nan)
        for s in np.flatnonzero(np.isfinite(lam) & np.isfinite(lr) & (lr > 0)):
            active = r.event != "none" and r.start <= s < r.start + r.duration
            thr = adam_eos_target(lr[s], beta1[h])
            rows.append({"spec_hash": h, "event": r.event, "seed": r.seed, "step": int(s), "lr": lr[s],
                         "lambda_max": lam[s], "two_over_lr": 2.0 / lr[s], "ratio": lam[s] * lr[s] / 2.0,
                         "precond_sharpness": pre[s], "adam_threshold": thr, "precond_ratio": pre[s] / thr,
                         "in_event": int(active)})
    return pd.DataFrame(rows)


def seed_sensitivity(sweep: pd.DataFrame) -> pd.DataFrame:
    """:func:`lr_sensitivity` per (variant, seed) of :func:`lr_sweep_table` rows: columns
    ``variant, seed, lr_sensitivity, best_loss`` (the lowest finite final loss over the learning
    rates), ``n_lr, n_finite``.

    NaN when no learning rate of that variant and seed reached a finite final loss: a
    sweep in which everything diverged has no data, which :func:`lr_sensitivity` (every
    lr at ``loss0``) would score 0, the best possible value.
    """
    rows = []
    if len(sweep):
        for (variant, seed), g in sweep.groupby(["variant", "seed"], sort=False):
            g = g.sort_values("lr")
            fl = g.final_loss.to_numpy(float)
            n_finite = int(np.isfinite(fl).sum())
            sens = lr_sensitivity(fl, float(g.loss0.mean())) if n_finite else np.nan
            best = float(np.nanmin(fl)) if n_finite else np.nan
            rows.append({"variant": variant, "seed": seed, "lr_sensitivity": sens, "best_loss": best, "n_lr": len(g),
                         "n_finite": n_finite})
    return pd.DataFrame(rows, columns=["variant", "seed", "lr_sensitivity", "best_loss", "n_lr", "n_finite"])


def _pair(a: pd.DataFrame, b: pd.DataFrame, key: list[str], col: str) -> tuple[np.ndarray, np.ndarray]:
    """``col`` of ``a`` and ``b`` aligned on ``key`` (outer join: a missing partner is NaN)."""
    if len(a) == 0 or len(b) == 0:
        return np.array([]), np.array([])
    m = a.groupby(key)[col].mean().to_frame("a").join(b.groupby(key)[col].mean().to_frame("b"), how="outer")
    return m["a"].to_numpy(float), m["b"].to_numpy(float)


def _seed_medians(sharp: pd.DataFrame, in_event: int, kind: str | None = None) -> pd.Series:
    """Per seed, the median ``precond_ratio`` over its measurements with ``in_event``, of the runs
    of event ``kind`` only when given (an LR spike's in-event set is not pooled with another
    kind's): one number per independent unit, since a seed's twin and spiked runs share every
    step before the event."""
    m = sharp[(sharp.in_event == in_event) & np.isfinite(sharp.precond_ratio.to_numpy(float))]
    if kind is not None:
        m = m[m.event == kind]
    return m.groupby("seed").precond_ratio.median() if len(m) else pd.Series(dtype=float)


def seed_correlations(sweep: pd.DataFrame, variant: str, x: str, y: str) -> pd.Series:
    """Per seed, Spearman's rho of columns ``x`` and ``y`` over the learning rates of ``variant``'s
    sweep runs (:func:`lr_sweep_table`), a diverged run's ``final_loss`` read as its ``loss0``;
    NaN where a seed has fewer than 3 finite pairs or a constant column."""
    from scipy import stats as sps

    out = {}
    g = sweep[sweep.variant == variant] if len(sweep) else sweep
    for seed, runs in (g.groupby("seed") if len(g) else []):
        vals = {c: runs.final_loss.fillna(runs.loss0).to_numpy(float) if c == "final_loss" else runs[c].to_numpy(float)
                for c in (x, y)}
        ok = np.isfinite(vals[x]) & np.isfinite(vals[y])
        a, b = vals[x][ok], vals[y][ok]
        out[seed] = float(sps.spearmanr(a, b).statistic) if ok.sum() >= 3 and np.ptp(a) > 0 and np.ptp(b) > 0 \
            else np.nan
    return pd.Series(out, dtype=float)


def _cite(c: Claim, planned: Planned) -> Claim:
    """The row with where its smallest effect of interest comes from after its own source."""
    return replace(c, source=f"{c.source}; smallest effect: {planned.why}")


def claims(effects: pd.DataFrame, memory: pd.DataFrame, sweep: pd.DataFrame, sharpness: pd.DataFrame | None = None,
           *, band: float = 0.05, min_ratio: float = 2.0, memory_tolerance: float = 0.5,
           alpha: float = 0.05) -> list[Claim]:
    """Notebook 02's claims as :class:`stabstudy.analysis.claims.Claim` rows, decided at the families
    and smallest effects of :func:`plan` (``band``, ``min_ratio``, ``memory_tolerance``: its
    parameters of the same names).

    Args:
        effects: :func:`spike_effects` (all spike-grid runs, any noise level); its
            ``peak_excess_loss`` and ``final_damage`` are already differences to the twin.
        memory: :func:`adam_memory`.
        sweep: :func:`lr_sweep_table`.
        sharpness: :func:`sharpness_table` (None or empty: those rows are not tested).

    Every test is over seeds. Rules: ``paired_difference`` (perturbed run minus its twin; "at
    least" claims with the band or the fold as minimum and smallest effect; the damage relative to
    the twin's final validation loss), ``equivalence`` (final validation loss within the band of the
    twin), ``within_tolerance`` (e-folding times of the runs that observed at least
    ``(1 + memory_tolerance) / (1 - beta2)`` steps), ``correlation`` (Spearman over the memory runs);
    for the LR sweep ``paired_difference`` by seed of :func:`seed_sensitivity` (relative to the
    baseline's best final loss of the seed), of the mean log ratio of the maximum attention logits
    and of the per-seed rhos of :func:`seed_correlations`; gradient noise: the largest dose against
    none, paired by seed; sharpness: one median log ratio per seed (:func:`_seed_medians`).
    """
    from stabstudy.analysis import claims as C

    P = plan(band=band, min_ratio=min_ratio, memory_tolerance=memory_tolerance)
    empty = np.array([])
    rows = []

    def col(df: pd.DataFrame, name: str) -> np.ndarray:
        return df[name].to_numpy(float) if len(df) and name in df else empty

    def relative_damage(df: pd.DataFrame) -> pd.DataFrame:
        return df.assign(damage=df.final_damage / df.twin_final_loss) if len(df) else df.assign(damage=[])

    clean = effects[effects.noise == 0] if len(effects) else effects
    for kind, key, label in (("lr_spike", "lr_spike", "an LR spike"), ("outlier_batch", "outlier", "an outlier batch")):
        e = clean[clean.event == kind] if len(clean) else clean
        peak, dmg = col(e, "peak_excess_loss"), col(e, "final_damage")
        rel = col(relative_damage(e), "damage")
        rows.append(_cite(C.paired_difference(
            f"{label} causes a loss spike (peak excess loss over the twin above the {band:g}-nat band)", "our own",
            peak, np.zeros(peak.shape), direction="greater", alpha=alpha, **P[f"{key} peak"].rule), P[f"{key} peak"]))
        rows.append(_cite(C.equivalence(
            f"the spike after {label} is transient (final validation loss within {band:g} nats of the twin)",
            "our own", dmg, np.zeros(dmg.shape), margin=P[f"{key} transient"].sesoi, relative=False, paired=True,
            family=P[f"{key} transient"].family, alpha=alpha), P[f"{key} transient"]))
        rows.append(_cite(C.paired_difference(
            f"{label} leaves unrecovered damage (final validation loss above the twin's, relative to it)", "our own",
            rel, np.zeros(rel.shape), direction="greater", alpha=alpha, **P[f"{key} damage"].rule),
            P[f"{key} damage"]))
    e = clean[clean.event == "outlier_batch"] if len(clean) else clean
    with np.errstate(divide="ignore", invalid="ignore"):
        for name, key, what in (("grad_norm_ratio", "grad_norm inflation", "the gradient norm"),
                                ("adam_v_ratio", "adam_v inflation", "Adam's second moment")):
            r = np.log(col(e, name))
            rows.append(_cite(C.paired_difference(
                f"an outlier batch inflates {what} at least {min_ratio:g}-fold over the twin (log ratio)", "our own",
                r, np.zeros(r.shape), direction="greater", alpha=alpha, **P[key].rule), P[key]))
    adam_src = "textbook: Kingma & Ba 2015 (v is an EMA with weight beta2^k)"
    # only runs that saw the whole tolerance band can fail it; one that never e-folded there lies beyond it
    seen = (memory[memory.steps_observed >= (1 + memory_tolerance) * memory.tau_theory] if len(memory)
            else memory)
    t_e = np.where(np.isposinf(col(seen, "t_efold")), col(seen, "steps_observed") + 1, col(seen, "t_efold"))
    rows.append(_cite(C.within_tolerance(
        "inflated Adam second moments persist about 1/(1-beta2) steps (e-folding time, every run)", adam_src, t_e,
        col(seen, "tau_theory"), rel_tol=P["memory efold"].sesoi, min_n=3, family=P["memory efold"].family,
        labels=[f"beta2 {b:g}, seed {int(s)}" for b, s in zip(col(seen, "beta2"), col(seen, "seed"), strict=True)]),
        P["memory efold"]))
    # an excess that never decays has the longest decay time: keep it as the top rank
    tau_fit = np.where(np.isposinf(col(memory, "tau_fit")), np.finfo(float).max, col(memory, "tau_fit"))
    rows.append(_cite(C.correlation(
        "their persistence grows with beta2 (fitted decay time vs 1/(1-beta2), Spearman over the runs)", adam_src,
        col(memory, "tau_theory"), tau_fit, expect="positive", alpha=alpha, **P["memory beta2"].rule),
        P["memory beta2"]))
    wortsman = "source paper: Wortsman et al. 2023"
    sens = seed_sensitivity(sweep)
    base_s = sens[sens.variant == "baseline"].set_index("seed")
    for v, key, label in (("qk_layernorm", "qk sensitivity", "qk-layernorm"), ("z_loss", "z sensitivity", "z-loss")):
        m = sens[sens.variant == v].set_index("seed")[["lr_sensitivity"]].rename(columns=lambda c: c + "_v").join(
            base_s[["lr_sensitivity", "best_loss"]], how="outer") if len(sens) else pd.DataFrame(
            columns=["lr_sensitivity_v", "lr_sensitivity", "best_loss"])
        scale = m.best_loss.to_numpy(float)
        rows.append(_cite(C.paired_difference(
            f"{label} lowers LR sensitivity (paired by seed, relative to the baseline's best final loss)", wortsman,
            m.lr_sensitivity_v.to_numpy(float) / scale, m.lr_sensitivity.to_numpy(float) / scale, direction="less",
            alpha=alpha, **P[key].rule), P[key]))
    r = seed_correlations(sweep, "baseline", "lr", "attn_logit_max").to_numpy(float)
    rows.append(_cite(C.paired_difference(
        "attention logits grow with the learning rate without qk-layernorm (Spearman rho over the learning rates, "
        "one per seed)", wortsman, r, np.zeros(r.shape), direction="greater", alpha=alpha, **P["logit growth"].rule),
        P["logit growth"]))
    b = sweep[sweep.variant == "baseline"] if len(sweep) else sweep
    q = sweep[sweep.variant == "qk_layernorm"] if len(sweep) else sweep
    if len(q) and len(b):
        m = q.set_index(["lr", "seed"]).attn_logit_max.to_frame("q").join(
            b.set_index(["lr", "seed"]).attn_logit_max.to_frame("b"), how="outer")
        with np.errstate(divide="ignore", invalid="ignore"):
            m["log_ratio"] = np.log(m.q.to_numpy(float)) - np.log(m.b.to_numpy(float))
        m = m[np.isfinite(m.log_ratio)]
        lq = m.groupby(level="seed").log_ratio.mean().reindex(sorted(set(q.seed) | set(b.seed))).to_numpy(float)
    else:
        lq = empty
    rows.append(_cite(C.paired_difference(
        "qk-layernorm keeps the maximum attention logit below the baseline's (log ratio, mean over the learning "
        "rates, one per seed)", wortsman, lq, np.zeros(lq.shape), direction="less", alpha=alpha,
        **P["qk logit"].rule), P["qk logit"]))
    r = seed_correlations(sweep, "baseline", "attn_logit_max", "final_loss").to_numpy(float)
    rows.append(_cite(C.paired_difference(
        "attention-logit growth accompanies the high-LR failures (Spearman rho of the maximum attention logit and "
        "the final loss over the learning rates, one per seed)", wortsman, r, np.zeros(r.shape),
        direction="greater", alpha=alpha, **P["logit failure"].rule), P["logit failure"]))
    spiked = relative_damage(effects[effects.event == "lr_spike"]) if len(effects) else effects
    top = float(spiked.noise.max()) if len(spiked) else 0.0
    none, noisy = (spiked[spiked.noise == 0], spiked[spiked.noise == top]) if top > 0 else (spiked, spiked.iloc[:0])
    for name, key, what in (("peak_excess_loss", "noise peak", "peak excess loss"),
                            ("damage", "noise damage", "final damage (relative to the twin's final loss)")):
        x, y = _pair(noisy, none, ["seed"], name)
        rows.append(_cite(C.paired_difference(
            f"controlled stochasticity (gradient noise) buffers an LR spike: lower {what} (the largest noise dose "
            "against none, paired by seed)", "our own", x, y, direction="less", alpha=alpha, **P[key].rule), P[key]))
    sharp = sharpness if sharpness is not None and len(sharpness) else pd.DataFrame(
        columns=["spec_hash", "event", "seed", "in_event", "precond_ratio"])
    cohen = "source paper: Cohen et al. 2022"
    out_ev = np.log(_seed_medians(sharp, 0).to_numpy(float))
    rows.append(_cite(C.paired_difference(
        "outside spikes Adam's preconditioned sharpness stays below its threshold (2+2 beta1)/((1-beta1) lr) "
        "(median log ratio per seed)", cohen, out_ev, np.zeros(out_ev.shape), direction="less", alpha=alpha,
        **P["eos outside"].rule), P["eos outside"]))
    in_ev = np.log(_seed_medians(sharp, 1, "lr_spike").to_numpy(float))
    rows.append(_cite(C.paired_difference(
        "during an LR spike the preconditioned sharpness exceeds Adam's threshold at the spiked lr (median log "
        "ratio per seed, LR-spike runs only)", cohen, in_ev, np.zeros(in_ev.shape), direction="greater",
        alpha=alpha, **P["eos spike"].rule), P["eos spike"]))
    return rows
