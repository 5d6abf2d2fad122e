"""Notebook 02 (nanoGPT spike studies): its grids and the analyses computed from its runs."""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import xarray as xr

from stabstudy.hparams import GPTHParams, defaults
from stabstudy.spec import Perturbation, RunSpec

if TYPE_CHECKING:
    from stabstudy.analysis.claims import Claim


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
        out["final_damage"] = _final(_curve(ds, h, "val_loss")) - _final(_curve(ds, r.twin, "val_loss"))
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
    ``variant, seed, lr_sensitivity, n_lr, n_finite``.

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
            rows.append({"variant": variant, "seed": seed, "lr_sensitivity": sens, "n_lr": len(g),
                         "n_finite": n_finite})
    return pd.DataFrame(rows, columns=["variant", "seed", "lr_sensitivity", "n_lr", "n_finite"])


def _pair(a: pd.DataFrame, b: pd.DataFrame, key: list[str], col: str) -> tuple[np.ndarray, np.ndarray]:
    """``col`` of ``a`` and ``b`` aligned on ``key`` (outer join: a missing partner is NaN)."""
    if len(a) == 0 or len(b) == 0:
        return np.array([]), np.array([])
    m = a.groupby(key)[col].mean().to_frame("a").join(b.groupby(key)[col].mean().to_frame("b"), how="outer")
    return m["a"].to_numpy(float), m["b"].to_numpy(float)


def _run_medians(sharp: pd.DataFrame, in_event: int) -> np.ndarray:
    """Per run, the median ``precond_ratio`` over its measurements with ``in_event``."""
    m = sharp[(sharp.in_event == in_event) & np.isfinite(sharp.precond_ratio.to_numpy(float))]
    return m.groupby("spec_hash").precond_ratio.median().to_numpy(float) if len(m) else np.array([])


def claims(effects: pd.DataFrame, memory: pd.DataFrame, sweep: pd.DataFrame, sharpness: pd.DataFrame | None = None,
           *, band: float = 0.05, min_ratio: float = 2.0, memory_tolerance: float = 0.5,
           alpha: float = 0.05) -> list[Claim]:
    """Notebook 02's claims as :class:`stabstudy.analysis.claims.Claim` rows.

    Args:
        effects: :func:`spike_effects` (all spike-grid runs, any noise level); its
            ``peak_excess_loss`` and ``final_damage`` are already differences to the twin.
        memory: :func:`adam_memory`.
        sweep: :func:`lr_sweep_table`.
        sharpness: :func:`sharpness_table` (None or empty: those rows are not tested).
        band: the recovery band in nats (:func:`spike_effects`' ``abs_tol``): a spike
            must exceed it, a recovered run ends within it (equivalence margin).
        min_ratio: factor by which an outlier batch must inflate the gradient norm and
            Adam's second moment over the twin.
        memory_tolerance: relative tolerance of the e-folding time against 1 / (1 - beta2).

    Rules: ``paired_difference`` (perturbed run minus its twin, same seed and batches;
    log ratios against ``log(min_ratio)``), ``equivalence`` (final validation loss
    within ``band`` of the twin), ``within_tolerance`` (e-folding times of the runs
    that observed at least 1 / (1 - beta2) steps), ``correlation`` (Spearman over
    runs), and, for the variants of the LR sweep, ``paired_difference`` by seed of
    :func:`seed_sensitivity` and by (lr, seed) of the maximum attention logit.
    """
    from stabstudy.analysis import claims as C

    empty = np.array([])
    rows = []

    def col(df: pd.DataFrame, name: str) -> np.ndarray:
        return df[name].to_numpy(float) if len(df) and name in df else empty

    clean = effects[effects.noise == 0] if len(effects) else effects
    for kind, label in (("lr_spike", "an LR spike"), ("outlier_batch", "an outlier batch")):
        e = clean[clean.event == kind] if len(clean) else clean
        peak, dmg = col(e, "peak_excess_loss"), col(e, "final_damage")
        rows.append(C.paired_difference(f"{label} causes a loss spike (peak excess loss over the twin above the "
                                        f"{band:g}-nat band)", "our own", peak, np.full(peak.shape, band),
                                        direction="greater", alpha=alpha))
        rows.append(C.equivalence(f"the spike after {label} is transient (final validation loss within "
                                  f"{band:g} nats of the twin)", "our own", dmg, np.zeros(dmg.shape),
                                  margin=band, relative=False, paired=True, alpha=alpha))
        rows.append(C.paired_difference(f"{label} leaves unrecovered damage (final validation loss above the twin)",
                                        "our own", dmg, np.zeros(dmg.shape), direction="greater", alpha=alpha))
    e = clean[clean.event == "outlier_batch"] if len(clean) else clean
    with np.errstate(divide="ignore", invalid="ignore"):
        for name, what in (("grad_norm_ratio", "the gradient norm"), ("adam_v_ratio", "Adam's second moment")):
            r = np.log(col(e, name))
            rows.append(C.paired_difference(f"an outlier batch inflates {what} at least {min_ratio:g}-fold over the "
                                            "twin (log ratio)", "our own", r, np.full(r.shape, np.log(min_ratio)),
                                            direction="greater", alpha=alpha))
    adam_src = "textbook: Kingma & Ba 2015 (v is an EMA with weight beta2^k)"
    # only runs that saw the whole tolerance band can fail it; one that never e-folded there lies beyond it
    seen = (memory[memory.steps_observed >= (1 + memory_tolerance) * memory.tau_theory] if len(memory)
            else memory)
    t_e = np.where(np.isposinf(col(seen, "t_efold")), col(seen, "steps_observed") + 1, col(seen, "t_efold"))
    rows.append(C.within_tolerance("inflated Adam second moments persist about 1/(1-beta2) steps (e-folding time)",
                                   adam_src, t_e, col(seen, "tau_theory"), rel_tol=memory_tolerance, min_n=3))
    # an excess that never decays has the longest decay time: keep it as the top rank
    tau_fit = np.where(np.isposinf(col(memory, "tau_fit")), np.finfo(float).max, col(memory, "tau_fit"))
    rows.append(C.correlation("their persistence grows with beta2 (fitted decay time vs 1/(1-beta2))", adam_src,
                              col(memory, "tau_theory"), tau_fit, expect="positive", alpha=alpha))
    wortsman = "source paper: Wortsman et al. 2023"
    sens = seed_sensitivity(sweep)
    base_s = sens[sens.variant == "baseline"]
    for v, label in (("qk_layernorm", "qk-layernorm"), ("z_loss", "z-loss")):
        x, y = _pair(sens[sens.variant == v], base_s, ["seed"], "lr_sensitivity")
        rows.append(C.paired_difference(f"{label} lowers LR sensitivity (paired by seed)", wortsman, x, y,
                                        direction="less", alpha=alpha))
    b = sweep[sweep.variant == "baseline"] if len(sweep) else sweep
    q = sweep[sweep.variant == "qk_layernorm"] if len(sweep) else sweep
    rows.append(C.correlation("attention logits grow with the learning rate without qk-layernorm", wortsman,
                              col(b, "lr"), col(b, "attn_logit_max"), expect="positive", alpha=alpha))
    x, y = _pair(q, b, ["lr", "seed"], "attn_logit_max")
    rows.append(C.paired_difference("qk-layernorm keeps the maximum attention logit below the baseline's (paired by "
                                    "lr and seed)", wortsman, x, y, direction="less", alpha=alpha))
    # a diverged run is a failure: its final loss is the loss at initialization
    fail = b.final_loss.fillna(b.loss0).to_numpy(float) if len(b) else empty
    rows.append(C.correlation("attention-logit growth accompanies the high-LR failures (worse final loss)", wortsman,
                              col(b, "attn_logit_max"), fail, expect="positive", alpha=alpha))
    noisy = effects[effects.event == "lr_spike"] if len(effects) else effects
    for name, what in (("peak_excess_loss", "peak excess loss"), ("final_damage", "final damage")):
        rows.append(C.correlation(f"controlled stochasticity (gradient noise) buffers an LR spike: lower {what}",
                                  "our own", col(noisy, "noise"), col(noisy, name), expect="negative", alpha=alpha))
    sharp = sharpness if sharpness is not None and len(sharpness) else pd.DataFrame(
        columns=["spec_hash", "in_event", "precond_ratio"])
    cohen = "source paper: Cohen et al. 2022"
    out_ev = np.log(_run_medians(sharp, 0))
    rows.append(C.paired_difference("outside spikes Adam's preconditioned sharpness stays below its threshold "
                                    "(2+2 beta1)/((1-beta1) lr) (per-run median, log ratio)", cohen, out_ev,
                                    np.zeros(out_ev.shape), direction="less", alpha=alpha))
    in_ev = np.log(_run_medians(sharp, 1))
    rows.append(C.paired_difference("during an LR spike the preconditioned sharpness exceeds Adam's threshold at the "
                                    "spiked lr (per-run median, log ratio)", cohen, in_ev, np.zeros(in_ev.shape),
                                    direction="greater", alpha=alpha))
    return rows
