"""Notebook 03 (precision experiments): its grids and the summaries computed from its runs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from stabstudy.instruments.precision import fp16_headroom, logit_fp16_headroom

if TYPE_CHECKING:
    from stabstudy.analysis.claims import Claim
    from stabstudy.analysis.plan import Planned


FAMILIES = {
    "bf16": "bf16 autocast against float32 (GPT)",
    "underflow": "fp16 underflow without loss scaling (GPT)",
    "overflow": "an fp16 overflow without and with GradScaler (GPT)",
    "range": "bfloat16's range against float16's (GPT)",
    "pure": "pure low-precision storage (GPT)",
    "headroom": "fp16 headroom of the attention logits (GPT)",
}
"""Notebook 03's questions, one domain each: Holm adjusts within a family only."""


def plan(*, equivalence_margin: float = 0.01, loss_frac: float = 0.01, rate_difference: float = 0.5,
         correlation: float = 0.3, context_fold: float = 1.1) -> dict[str, Planned]:
    """Notebook 03's analysis plan, from its parameters: each confirmatory claim's family and smallest
    effect of interest, fixed before the runs.

    The unit of every claim is the seed: the precisions of (A) share a seed's initialisation and
    batches; the overflow rows of (B) are read at the largest dose, one run per precision and seed
    (the doses of one seed share every step before the overflow, like forks of one run); the
    configurations of (C) give one summary per seed (the init scales of a seed are one network,
    scaled).

    Args:
        equivalence_margin: "reaches float32" within this fraction of float32's final loss (TOST).
        loss_frac: the project's margin, a fraction of the final loss (about the seed-to-seed spread).
        rate_difference: the smallest rate difference credited to "X but not Y": a majority of runs
            against a minority.
        correlation: the project's margin for correlations.
        context_fold: the smallest rise of the step-0 fp16 headroom credited to a longer context.
    """
    # here, not at the top: analysis.plan imports pandas, which this module's import keeps out (see below)
    from stabstudy.analysis.plan import Planned

    F = FAMILIES
    loss_why = f"the project's margin: {loss_frac:.0%} of the final loss, about the seed-to-seed spread"
    rate_why = f"the claim's own contrast: a majority of runs against a minority (a rate difference of {rate_difference:g})"
    rate = Planned(F["overflow"], rate_difference, "rate difference over seeds", rate_why)
    return {
        "bf16 equivalence": Planned(F["bf16"], equivalence_margin, "fraction of float32's final loss (TOST margin)",
                                    f"the project's margin: {equivalence_margin:.0%} of the final loss, about the "
                                    "seed-to-seed spread"),
        "underflow": Planned(F["underflow"], loss_frac, "fraction of the GradScaler run's final loss", loss_why),
        "adam corrupted": rate,
        "no recovery": rate,
        "finishes": rate,
        "skip spares damage": Planned(F["overflow"], loss_frac, "fraction of float32's dose-1 final loss", loss_why),
        "bf16 range": Planned(F["range"], rate_difference, "rate difference over seeds", rate_why),
        "lost updates": Planned(F["pure"], correlation, "Spearman rho per run (one per seed)",
                                f"the project's margin for correlations: rho {correlation:g}"),
        "pure bf16": Planned(F["pure"], loss_frac, "fraction of bf16 autocast's final loss", loss_why),
        "pure fp16": Planned(F["pure"], rate_difference, "rate difference over seeds", rate_why),
        "headroom predicts": Planned(F["headroom"], rate_difference, "divergence-rate difference per seed", rate_why),
        "context": Planned(F["headroom"], math.log(context_fold), "log ratio per seed",
                           f"the measurement's precision: the largest logit of one batch moves by about "
                           f"{context_fold - 1:.0%} from batch to batch"),
    }


# -- grid builders and analyses for notebooks/03_precision_experiments.ipynb ----------------
# Imported lazily inside the functions where heavy (xarray/pandas/scipy) so that the learner's
# per-step calls above never pay for them.

#: The precision configurations compared in the study: name -> LM hyperparameters.
#: Every configuration sets all three knobs explicitly so that ``load_runs`` has the
#: ``hp_autocast_dtype``, ``hp_param_dtype`` and ``hp_grad_scaler`` coordinates for every run.
PRECISIONS: dict[str, dict[str, Any]] = {
    "float32": {"autocast_dtype": "float32", "param_dtype": "float32", "grad_scaler": False},
    "bf16_autocast": {"autocast_dtype": "bfloat16", "param_dtype": "float32", "grad_scaler": False},
    "fp16_autocast": {"autocast_dtype": "float16", "param_dtype": "float32", "grad_scaler": False},
    # a GradScaler training loop skips a step whose loss is non-finite too: so does this configuration
    "fp16_autocast_scaler": {"autocast_dtype": "float16", "param_dtype": "float32", "grad_scaler": True,
                             "skip_nonfinite_loss": True},
    "bf16_pure": {"autocast_dtype": "float32", "param_dtype": "bfloat16", "grad_scaler": False},
    "fp16_pure": {"autocast_dtype": "float32", "param_dtype": "float16", "grad_scaler": False},
}


def precision_hparams(name: str) -> dict[str, Any]:
    """LM hyperparameters of a precision configuration in :data:`PRECISIONS` (ValueError otherwise)."""
    if name not in PRECISIONS:
        raise ValueError(f"unknown precision configuration {name!r}; valid: {', '.join(PRECISIONS)}")
    return dict(PRECISIONS[name])


def _lm_spec(steps: int, seed: int, precision: str, hp: dict[str, Any], perturbations=(), log_every: int = 1,
             eval_every: int = 0):
    from stabstudy.spec import RunSpec

    hp = {**hp, **precision_hparams(precision)}
    if not hp["grad_scaler"]:
        hp.pop("scaler_growth_interval", None)  # irrelevant without a scaler: keep hashes shared
        hp.pop("skip_nonfinite_loss", None)
    return RunSpec(domain="lm", learner="gpt", task=str(hp.pop("task", "stdlib")), steps=steps, seed=seed,
                   hparams=hp, perturbations=tuple(perturbations), log_every=log_every, eval_every=eval_every)


def precision_grid(steps: int, seeds: Sequence[int], precisions: Sequence[str] = (
        "float32", "bf16_autocast", "fp16_autocast", "fp16_autocast_scaler", "bf16_pure"),
        hp: dict[str, Any] | None = None, eval_every: int = 0) -> list:
    """Same model, data and seeds across precision configurations (no perturbation).

    Returns ``len(precisions) * len(seeds)`` LM RunSpecs; ``hp`` (model size, lr, ...,
    ``scaler_growth_interval``) is shared by all of them.
    """
    return [_lm_spec(steps, s, p, dict(hp or {}), eval_every=eval_every) for p in precisions for s in seeds]


def overflow_grid(steps: int, seeds: Sequence[int], doses: Sequence[float], start: int,
                  precisions: Sequence[str] = ("float32", "bf16_autocast", "fp16_autocast", "fp16_autocast_scaler"),
                  hp: dict[str, Any] | None = None, eval_every: int = 0,
                  twins: Sequence[str] | None = None) -> list:
    """A one-step ``loss_scale`` perturbation of each dose at ``start``, per precision and seed.

    Multiplying the loss by a large factor for one step multiplies every gradient by it: in
    float16 the backward pass overflows to inf beyond ~65504, which is exactly the scenario
    "an fp16 overflow reaches Adam" (without a scaler) or "the scaler skips the step" (with
    one). Dose 1.0 is the unperturbed twin (the perturbation is a no-op, its spec differs only
    by the perturbation record); ``twins`` (default: every precision) names the precisions whose
    dose-1 twin is run: only :func:`excess_final_loss` reads a twin, and a precision that diverges at
    every perturbed dose has no excess to measure.
    """
    from stabstudy.spec import Perturbation

    twins = precisions if twins is None else twins
    return [_lm_spec(steps, s, p, dict(hp or {}), (Perturbation("loss_scale", start, 1, float(d)),),
                     eval_every=eval_every)
            for p in precisions for d in doses for s in seeds if d != 1.0 or p in twins]


def logit_grid(steps: int, seeds: Sequence[int], init_scales: Sequence[float], block_sizes: Sequence[int],
               precisions: Sequence[str] = ("float32", "fp16_autocast"), hp: dict[str, Any] | None = None) -> list:
    """Large init x long context toward the float16 limit of the attention logits.

    The attention logit grows like ``init_scale**2`` (queries and keys are both linear in the
    weights, after a LayerNorm that removes the embedding scale); a longer context takes the
    maximum over more query-key pairs.
    """
    out = []
    for p in precisions:
        for s in init_scales:
            for t in block_sizes:
                for seed in seeds:
                    out.append(_lm_spec(steps, seed, p, {**(hp or {}), "init_scale": float(s), "block_size": int(t)}))
    return out


def precision_labels(runs) -> Any:
    """Name from :data:`PRECISIONS` of each run of ``load_runs`` output (DataArray over ``run``)."""
    import numpy as np
    import xarray as xr

    def one(ac, pd_, gs) -> str:
        for name, hp in PRECISIONS.items():
            if (hp["autocast_dtype"], hp["param_dtype"], bool(hp["grad_scaler"])) == (str(ac), str(pd_), bool(gs)):
                return name
        return f"{ac}/{pd_}/scaler={gs}"

    ac = runs["hp_autocast_dtype"].values
    pdt = runs["hp_param_dtype"].values
    gs = runs["hp_grad_scaler"].values
    labels = [one(a, b, bool(c) if not (isinstance(c, float) and np.isnan(c)) else False) for a, b, c in zip(ac, pdt, gs, strict=True)]
    return xr.DataArray(labels, dims="run", coords={"run": runs.run})


def by_precision(runs, var: str) -> Any:
    """``runs[var]`` reshaped to dims ``(precision, seed, step)`` (one run per precision and seed).

    Raises ``ValueError`` when two runs share a (precision, seed) pair (e.g. a grid mixing doses):
    select first. Pairs that were not run are NaN.
    """
    import pandas as pd
    import xarray as xr

    da = runs[var].assign_coords(precision=precision_labels(runs), seed_=("run", runs.seed.values.astype(int)))
    idx = pd.MultiIndex.from_arrays([da.precision.values, da.seed_.values], names=["precision", "seed"])
    if idx.duplicated().any():
        raise ValueError("by_precision: several runs share a (precision, seed) pair; select one grid cell first")
    da = da.drop_vars([c for c in da.coords if c not in ("run", "step")])
    da = da.assign_coords(xr.Coordinates.from_pandas_multiindex(idx, "run")).unstack("run")
    order = [p for p in (*PRECISIONS, *sorted(set(da.precision.values) - set(PRECISIONS))) if p in da.precision]
    return da.sel(precision=order).transpose("precision", "seed", "step")


def _channel(run, name: str):
    import numpy as np

    return run[name].values if name in run else np.full(run.sizes["step"], np.nan)


#: Outcomes of :func:`overflow_recovery` and what they count as (1 recovered, 0 not, NaN no verdict).
RECOVERY_OUTCOMES: dict[str, float] = {"never_left": 1.0, "recovered": 1.0, "not_recovered": 0.0, "diverged": 0.0,
                                       "unobserved": float("nan"), "undefined": float("nan"),
                                       "no_overflow": float("nan")}


def overflow_recovery(run, window: int, tol: float = 0.1, baseline_points: int = 10) -> dict[str, Any]:
    """Did one run's training loss come back after its first overflow? (one run of ``load_runs``)

    The event is the first recorded step with a non-finite gradient element or a non-finite
    loss (recorded steps are those with a learning rate: ``load_runs`` pads shorter runs with
    NaN). The band is the pre-overflow baseline (mean loss of the last ``baseline_points`` steps
    before it) plus ``tol`` times its size, as in :func:`stabstudy.analysis.events.recovery_state`,
    applied to the steps up to ``window`` after the event; a recorded non-finite loss (a step the
    scaler skipped because its forward overflowed) counts as outside the band.

    ``state`` (:data:`RECOVERY_OUTCOMES` maps it to ``recovered`` 1 / 0 / NaN):
    ``never_left`` / ``recovered`` (in the band at the end of the overflow, or back within the
    window), ``not_recovered`` (out of it for the rest of a fully observed window), ``diverged``
    (the learner stopped as diverged within the window: at non-finite parameters, which stay
    non-finite under AdamW, and every parameter of the tied-embedding GPT enters every forward
    pass, so no later loss would be finite; or at a non-finite loss, whose gradient reaches AdamW
    where nothing skips the step: no scaler, or a scaler without ``skip_nonfinite_loss``, which
    :data:`PRECISIONS` sets), ``unobserved`` (the run ends before the window does and was not
    back), ``undefined`` (no pre-overflow baseline), ``no_overflow``.

    Returns ``overflow_step`` (NaN without one), ``recovery_state``, ``recovered``,
    ``recovery_time`` (steps from the event back into the band; 0 when it never left, inf when not
    back, NaN without a verdict) and ``recovery_window``.
    """
    import math

    import numpy as np

    from stabstudy.analysis import events

    loss, lr = _channel(run, "loss"), _channel(run, "lr")
    recorded = np.isfinite(lr)
    last = int(np.flatnonzero(recorded)[-1]) if recorded.any() else -1
    bad = recorded & ((_channel(run, "nonfinite_grads") > 0) | ~np.isfinite(loss))
    out: dict[str, Any] = {"overflow_step": math.nan, "recovery_state": "no_overflow", "recovered": math.nan,
                           "recovery_time": math.nan, "recovery_window": int(window)}
    if not bad.any():
        return out
    ev = int(np.flatnonzero(bad)[0])
    out["overflow_step"] = float(ev)
    end = ev + int(window)
    if str(run.status.values) == "diverged" and last <= end:
        state, time = "diverged", math.inf
    else:
        # the worst representable loss: outside any band, yet kept by events.as_series (which drops non-finite)
        curve = np.where(recorded & ~np.isfinite(loss), np.finfo(float).max, loss)[:min(end, last) + 1]
        state, time = events.recovery_state(curve, ev, tol=tol, baseline_points=baseline_points,
                                            higher_is_better=False)
        if state == "never_left":
            time = 0.0
        if state in ("never_left", "not_recovered") and last < end:
            state, time = "unobserved", math.nan
    out.update(recovery_state=state, recovered=RECOVERY_OUTCOMES[state], recovery_time=time)
    return out


def run_summary(runs, tail: float = 0.1, recovery_window: int | None = None, recovery_tol: float = 0.1) -> Any:
    """One row per run of ``load_runs`` output: outcome and precision counts.

    Columns: ``precision``, ``seed``, ``status``, ``steps_done`` (steps with a finite loss),
    ``final_loss`` (mean loss over the last ``tail`` fraction of the *planned* steps, NaN when the
    run did not get there), ``final_val_loss`` (last validation loss), ``nonfinite_steps``
    (steps with >= 1 non-finite gradient element), ``nonfinite_grads`` (total elements),
    ``skipped_steps``, ``loss_scale_min`` / ``loss_scale_max`` / ``loss_scale_final``,
    ``scale_growths`` / ``scale_backoffs`` (number of x2 / x0.5 changes), ``lost_update_mean``,
    ``lost_update_first_half`` / ``lost_update_second_half``, ``adam_state_nonfinite_max``,
    ``adam_state_nonfinite_final``, ``first_nonfinite_step``, ``pert_dose``, ``pert_start``,
    plus ``init_scale`` / ``block_size`` where set. With ``recovery_window`` (steps) also the
    columns of :func:`overflow_recovery` (``overflow_step``, ``recovery_state``, ``recovered``,
    ``recovery_time``, ``recovery_window``), its band ``recovery_tol``.
    """
    import numpy as np
    import pandas as pd

    labels = precision_labels(runs)
    n_planned = runs.sizes["step"]
    rows = []
    for i in range(runs.sizes["run"]):
        r = runs.isel(run=i)
        loss = _channel(r, "loss")
        finite = np.isfinite(loss)
        done = int(finite.sum())
        k = max(int(round(tail * n_planned)), 1)
        last = loss[n_planned - k:]
        final = float(np.mean(last)) if np.isfinite(last).all() else np.nan
        val = _channel(r, "val_loss")
        val = val[np.isfinite(val)]
        nf = _channel(r, "nonfinite_grads")
        sc = _channel(r, "loss_scale")
        scf = sc[np.isfinite(sc)]
        ratio = scf[1:] / scf[:-1] if scf.size > 1 else np.array([])
        lu = _channel(r, "lost_update_frac")
        half = n_planned // 2
        ad = _channel(r, "adam_state_nonfinite")
        adf = ad[np.isfinite(ad)]
        nf_steps = np.flatnonzero(nf > 0)
        row = {
            "precision": str(labels.values[i]), "seed": int(r.seed), "status": str(r.status.values),
            "steps_done": done, "final_loss": final, "final_val_loss": float(val[-1]) if val.size else np.nan,
            "nonfinite_steps": int(np.nansum(nf > 0)), "nonfinite_grads": float(np.nansum(nf)),
            "skipped_steps": int(np.nansum(_channel(r, "skipped_step"))),
            "loss_scale_min": float(scf.min()) if scf.size else np.nan,
            "loss_scale_max": float(scf.max()) if scf.size else np.nan,
            "loss_scale_final": float(scf[-1]) if scf.size else np.nan,
            "scale_growths": int((ratio > 1).sum()), "scale_backoffs": int((ratio < 1).sum()),
            "lost_update_mean": float(np.nanmean(lu)) if np.isfinite(lu).any() else np.nan,
            "lost_update_first_half": float(np.nanmean(lu[:half])) if np.isfinite(lu[:half]).any() else np.nan,
            "lost_update_second_half": float(np.nanmean(lu[half:])) if np.isfinite(lu[half:]).any() else np.nan,
            "adam_state_nonfinite_max": float(adf.max()) if adf.size else np.nan,
            "adam_state_nonfinite_final": float(adf[-1]) if adf.size else np.nan,
            "first_nonfinite_step": float(nf_steps[0]) if nf_steps.size else np.nan,
            "pert_dose": float(r.pert_dose), "pert_start": float(r.pert_start),
        }
        for name in ("init_scale", "block_size", "n_embd", "n_head"):
            if f"hp_{name}" in r.coords:
                row[name] = float(r[f"hp_{name}"])
        if recovery_window is not None:
            row.update(overflow_recovery(r, recovery_window, tol=recovery_tol))
        rows.append(row)
    return pd.DataFrame(rows)


def loss_gap_vs_reference(summary, reference: str = "float32", column: str = "final_loss") -> Any:
    """Per precision: paired (same seed) difference of ``column`` to the ``reference`` precision.

    Returns a DataFrame indexed by precision with ``n`` (seeds paired, both finite),
    ``mean_diff``, ``ci_low``, ``ci_high`` (95% t-interval of the paired mean; NaN for n < 2),
    ``ref_seed_std`` (seed-to-seed std of the reference, the noise scale), ``diverged``
    (runs not ``ok``).
    """
    import numpy as np
    import pandas as pd
    from scipy import stats as sps

    ref = summary[summary.precision == reference].set_index("seed")[column]
    rows = {}
    for name, g in summary.groupby("precision", sort=False):
        other = g.set_index("seed")[column]
        d = (other - ref).dropna()
        n = int(d.size)
        if n >= 2:
            lo, hi = sps.t.interval(0.95, n - 1, loc=d.mean(), scale=sps.sem(d)) if d.std() > 0 else (d.mean(), d.mean())
        else:
            lo = hi = np.nan
        rows[name] = {"n": n, "mean_diff": float(d.mean()) if n else np.nan, "ci_low": float(lo), "ci_high": float(hi),
                      "ref_seed_std": float(ref.std()) if ref.size > 1 else np.nan,
                      "diverged": int((g.status != "ok").sum())}
    return pd.DataFrame.from_dict(rows, orient="index")


def lost_update_vs_lr(runs) -> Any:
    """Per run: Spearman correlation between the learning rate and ``lost_update_frac`` over steps.

    A negative rho says smaller steps (warmup start, cosine tail) get rounded away more often.
    Returns a DataFrame with ``precision``, ``seed``, ``rho``, ``p``, ``n``.
    """
    import numpy as np
    import pandas as pd
    from scipy import stats as sps

    labels = precision_labels(runs)
    rows = []
    for i in range(runs.sizes["run"]):
        r = runs.isel(run=i)
        lr, lu = _channel(r, "lr"), _channel(r, "lost_update_frac")
        ok = np.isfinite(lr) & np.isfinite(lu)
        if ok.sum() < 3 or np.ptp(lu[ok]) == 0 or np.ptp(lr[ok]) == 0:
            rho, p = np.nan, np.nan
        else:
            res = sps.spearmanr(lr[ok], lu[ok])
            rho, p = float(res.statistic), float(res.pvalue)
        rows.append({"precision": str(labels.values[i]), "seed": int(r.seed), "rho": rho, "p": p, "n": int(ok.sum())})
    return pd.DataFrame(rows)


def overflow_table(summary) -> Any:
    """Per (precision, dose), over seeds: what a one-step loss-scale overflow did.

    Columns: ``runs``, ``diverged`` (count), ``nonfinite_steps``, ``skipped_steps``,
    ``adam_state_nonfinite_max`` (max over seeds), ``final_loss`` (mean over runs that
    finished), ``excess_final_loss`` (mean over seeds of final loss minus the same precision's
    dose-1 twin of the same seed; NaN when either did not finish).
    """
    import numpy as np
    import pandas as pd

    base = summary[summary.pert_dose == 1.0].set_index(["precision", "seed"])["final_loss"]
    s = summary.copy()
    s["excess_final_loss"] = [
        row.final_loss - base.get((row.precision, row.seed), np.nan) for row in s.itertuples()]
    g = s.groupby(["precision", "pert_dose"], sort=False)
    out = pd.DataFrame({
        "runs": g.size(), "diverged": g.status.apply(lambda x: int((x != "ok").sum())),
        "nonfinite_steps": g.nonfinite_steps.sum(), "skipped_steps": g.skipped_steps.sum(),
        "adam_state_nonfinite_max": g.adam_state_nonfinite_max.max(),
        "final_loss": g.final_loss.mean(), "excess_final_loss": g.excess_final_loss.mean(),
    })
    return out


def logit_table(runs) -> Any:
    """Per run of the logit grid: the step-0 attention/output logits and their float16 headroom.

    Columns: ``precision``, ``init_scale``, ``block_size``, ``seed``, ``status``, ``steps_done``,
    ``attn_logit_max0`` / ``out_logit_max0`` (step 0), ``attn_logit_peak`` (max over finite steps),
    ``headroom0`` = :func:`logit_fp16_headroom` at step 0 and ``headroom_peak`` its maximum over the
    measured steps (head_dim from ``n_embd / n_head``,
    learner defaults 64 / 2 when not set), ``headroom_naive0`` = :func:`fp16_headroom` of the
    scaled logits alone.
    """
    import numpy as np
    import pandas as pd

    labels = precision_labels(runs)
    rows = []
    for i in range(runs.sizes["run"]):
        r = runs.isel(run=i)
        n_embd = float(r["hp_n_embd"]) if "hp_n_embd" in r.coords else 64.0
        n_head = float(r["hp_n_head"]) if "hp_n_head" in r.coords else 2.0
        hd = int(n_embd // n_head) if np.isfinite(n_embd) and np.isfinite(n_head) else 32
        a, o = _channel(r, "attn_logit_max"), _channel(r, "out_logit_max")
        fin = a[np.isfinite(a)]
        rows.append({
            "precision": str(labels.values[i]), "init_scale": float(r.hp_init_scale),
            "block_size": int(r.hp_block_size), "seed": int(r.seed), "status": str(r.status.values),
            "steps_done": int(np.isfinite(_channel(r, "loss")).sum()),
            "attn_logit_max0": float(a[0]), "out_logit_max0": float(o[0]),
            "attn_logit_peak": float(fin.max()) if fin.size else np.inf,
            "headroom0": logit_fp16_headroom(a[0], o[0], hd),
            "headroom_peak": max((logit_fp16_headroom(x, y, hd) for x, y in zip(a, o, strict=True)
                                  if not (np.isnan(x) or np.isnan(y))), default=np.nan),
            "headroom_naive0": fp16_headroom(max(a[0], o[0])),
        })
    return pd.DataFrame(rows)


def overflow_prediction(logit_tab) -> Any:
    """Does the float32 twin's fp16 headroom predict which fp16-autocast runs overflow?

    ``logit_tab``: :func:`logit_table`. Returns one row per (init_scale, block_size,
    seed) with an fp16 run: the float32 twin's ``headroom0_fp32``,
    ``headroom_peak_fp32``, ``headroom_naive0_fp32``, the fp16 run's ``fp16_status``
    and ``fp16_steps_done``, ``predicted_overflow`` (peak headroom >= 1) and
    ``fp16_diverged``.
    """
    import pandas as pd

    key = ["init_scale", "block_size", "seed"]
    twin = logit_tab[logit_tab.precision == "float32"].set_index(key)
    fp16 = logit_tab[logit_tab.precision == "fp16_autocast"].set_index(key)
    pred = pd.DataFrame({"headroom0_fp32": twin.headroom0, "headroom_peak_fp32": twin.headroom_peak,
                         "headroom_naive0_fp32": twin.headroom_naive0, "fp16_status": fp16.status,
                         "fp16_steps_done": fp16.steps_done}).dropna(subset=["fp16_status"])
    pred["predicted_overflow"] = pred.headroom_peak_fp32 >= 1
    pred["fp16_diverged"] = pred.fp16_status != "ok"
    return pred


def _by_seed(summary, a: str, b: str, column: str = "final_loss"):
    """``column`` of precisions ``a`` and ``b`` aligned by seed (a seed missing in one is NaN there)."""
    import numpy as np

    if len(summary) == 0:
        return np.array([]), np.array([])
    x = summary[summary.precision == a].groupby("seed")[column].mean()
    y = summary[summary.precision == b].groupby("seed")[column].mean()
    m = x.to_frame("a").join(y.to_frame("b"), how="outer")
    return m["a"].to_numpy(float), m["b"].to_numpy(float)


def excess_final_loss(sum_b) -> Any:
    """Per perturbed run of the overflow experiment: ``final_loss`` minus the same precision's
    and seed's dose-1 twin (NaN when either did not finish), with ``precision, seed, pert_dose``."""
    import numpy as np

    if len(sum_b) == 0:
        return sum_b.assign(excess=np.array([], dtype=float))
    base = sum_b[sum_b.pert_dose == 1.0].set_index(["precision", "seed"])["final_loss"]
    pert = sum_b[sum_b.pert_dose != 1.0]
    return pert.assign(excess=[row.final_loss - base.get((row.precision, row.seed), np.nan)
                               for row in pert.itertuples()])


def _k_n(values, hit) -> tuple[int, int]:
    """``(k, n)``: ``n`` non-missing values, ``k`` of them where ``hit(values)`` holds (missing is no outcome)."""
    v = values.dropna()
    return (int(hit(v).astype(bool).sum()), int(v.size)) if v.size else (0, 0)


def _cite(c: Claim, planned: Planned) -> Claim:
    """The row with where its smallest effect of interest comes from after its own source."""
    return replace(c, source=f"{c.source}; smallest effect: {planned.why}")


def headroom_by_seed(logit_tab) -> Any:
    """Per seed of the logit experiment (:func:`logit_table`): ``predicted_rate`` and
    ``cleared_rate``, the divergence rates of the fp16 runs whose float32 twin's peak headroom is
    at least 1 and below it (NaN where a seed has none of them), and ``context_log_ratio``, the mean
    over init scales of the log ratio of the float32 step-0 headroom at the longest block size to the
    shortest (NaN with one block size)."""
    import numpy as np
    import pandas as pd

    cols = ["predicted_rate", "cleared_rate", "context_log_ratio"]
    if len(logit_tab) == 0:
        return pd.DataFrame(columns=cols, dtype=float)
    pred = overflow_prediction(logit_tab).reset_index()
    pred = pred[pred.headroom_peak_fp32.notna()]  # a NaN headroom predicts nothing
    div = pred.fp16_diverged.astype(float)
    out = pd.DataFrame({"predicted_rate": div[pred.predicted_overflow.astype(bool)].groupby(pred.seed).mean(),
                        "cleared_rate": div[~pred.predicted_overflow.astype(bool)].groupby(pred.seed).mean()})
    f32 = logit_tab[logit_tab.precision == "float32"]
    sizes = sorted(set(f32.block_size))
    if len(sizes) >= 2:
        key = ["init_scale", "seed"]
        m = f32[f32.block_size == sizes[-1]].set_index(key).headroom0.to_frame("long").join(
            f32[f32.block_size == sizes[0]].set_index(key).headroom0.to_frame("short"), how="outer")
        # headrooms span orders of magnitude over the init scales: their ratio, not their difference
        with np.errstate(divide="ignore", invalid="ignore"):
            m["r"] = np.log(m["long"].to_numpy(float)) - np.log(m["short"].to_numpy(float))
        m = m[np.isfinite(m.r)]
        out = out.join(m.groupby(level="seed").r.mean().rename("context_log_ratio"), how="outer")
    return out.reindex(columns=cols)


def claims_table(sum_a, sum_b, rho, logit_tab, *, equivalence_margin: float = 0.01,
                 alpha: float = 0.05) -> list[Claim]:
    """Notebook 03's claims as :class:`stabstudy.analysis.claims.Claim` rows, decided at the families
    and smallest effects of :func:`plan` (``equivalence_margin``: its parameter).

    Args:
        sum_a: :func:`run_summary` of the precision comparison (A).
        sum_b: :func:`run_summary` of the overflow experiment (B).
        rho: :func:`lost_update_vs_lr` rows (per run; NaN rho is dropped).
        logit_tab: :func:`logit_table` of the logit experiment (C).

    Every test is over seeds. (A): ``equivalence`` (TOST, relative) and ``paired_difference`` by
    seed of the relative final-loss gap, ``rate_comparison`` of divergence over seeds. (B), at the
    largest dose, one run per precision and seed: ``rate_comparison`` of fp16 autocast *with*
    GradScaler against *without* a scaler (the alternative in the grid) over the seeds whose
    scaler-free run overflowed, of fp16 against bf16 autocast overflows, and ``paired_difference``
    of the excess final loss (float32 against the scaler, relative to float32's dose-1 final loss,
    seeds where the scaler skipped). The recovery row needs the ``recovered`` column of
    ``run_summary(..., recovery_window=...)`` in ``sum_b`` (else ``not tested``); a run without a
    recovery verdict (``unobserved``, ``undefined``) is left out of its group. (C):
    :func:`headroom_by_seed`, ``paired_difference`` by seed.
    """
    import numpy as np
    import pandas as pd

    from stabstudy.analysis import claims as C

    P = plan(equivalence_margin=equivalence_margin)
    mp = "source paper: Micikevicius et al. 2018"
    ieee = "textbook: IEEE 754 half (max 65504) and bfloat16 (float32's exponent range)"
    rows = []

    def gap(a: str, b: str):
        """``a``'s final loss relative to ``b``'s, minus 1, by seed."""
        x, y = _by_seed(sum_a, a, b)
        with np.errstate(divide="ignore", invalid="ignore"):
            return x / y - 1.0

    x, y = _by_seed(sum_a, "bf16_autocast", "float32")
    rows.append(_cite(C.equivalence(
        f"bf16 autocast reaches float32's final loss (within {equivalence_margin:g} relative, paired by seed)", mp,
        x, y, margin=P["bf16 equivalence"].sesoi, relative=True, paired=True, family=P["bf16 equivalence"].family,
        alpha=alpha), P["bf16 equivalence"]))
    g = gap("fp16_autocast", "fp16_autocast_scaler")
    rows.append(_cite(C.paired_difference(
        "fp16 autocast without loss scaling ends worse than with GradScaler (underflow; final loss relative to the "
        "scaler's, paired by seed)", mp, g, np.zeros(g.shape), direction="greater", alpha=alpha,
        **P["underflow"].rule), P["underflow"]))
    top = float(sum_b.pert_dose.max()) if len(sum_b) else float("nan")
    b = sum_b[(sum_b.pert_dose == top) & (sum_b.pert_dose != 1.0)] if len(sum_b) else sum_b
    no_sc = b[b.precision == "fp16_autocast"].set_index("seed") if len(b) else pd.DataFrame()
    sc = b[b.precision == "fp16_autocast_scaler"].set_index("seed") if len(b) else pd.DataFrame()
    over = no_sc.index[no_sc.nonfinite_steps > 0].intersection(sc.index) if len(no_sc) and len(sc) else pd.Index([])

    def at(df, column: str):
        return df.loc[over, column] if len(over) else pd.Series(dtype=float)

    where = "fp16 autocast without vs with a scaler at the largest dose, over seeds"
    rows.append(_cite(C.rate_comparison(
        f"an fp16 overflow corrupts Adam's state without a scaler but not with GradScaler ({where})", mp,
        *_k_n(at(no_sc, "adam_state_nonfinite_max"), lambda v: v > 0),
        *_k_n(at(sc, "adam_state_nonfinite_max"), lambda v: v > 0), direction="greater", alpha=alpha,
        **P["adam corrupted"].rule), P["adam corrupted"]))
    rec_claim = "after an fp16 overflow reaches Adam (no scaler) the run does not recover"
    if "recovered" not in b:
        rows.append(C.not_tested(rec_claim, mp, "no recovery measurement (run_summary without recovery_window)",
                                 n=len(over), family=P["no recovery"].family, sesoi=P["no recovery"].sesoi))
    else:
        w = sorted({int(v) for v in b.recovery_window.dropna()}) if "recovery_window" in b else []
        within = f"within {w[0]} steps" if len(w) == 1 else "within the window"
        rows.append(_cite(C.rate_comparison(
            f"{rec_claim}, while the same overflow skipped by GradScaler does (loss back in its pre-overflow band "
            f"{within}; not-recovered rate, {where})", mp, *_k_n(at(no_sc, "recovered"), lambda v: v == 0),
            *_k_n(at(sc, "recovered"), lambda v: v == 0), direction="greater", alpha=alpha,
            **P["no recovery"].rule), P["no recovery"]))
    rows.append(_cite(C.rate_comparison(
        f"with GradScaler the same overflow is skipped and training finishes more often than without a scaler "
        f"({where})", mp, *_k_n(at(sc, "status"), lambda v: v == "ok"),
        *_k_n(at(no_sc, "status"), lambda v: v == "ok"), direction="greater", alpha=alpha, **P["finishes"].rule),
        P["finishes"]))
    ex = excess_final_loss(sum_b) if len(sum_b) else pd.DataFrame(columns=["precision", "pert_dose", "seed", "excess"])
    ex = ex[ex.pert_dose == top] if len(ex) else ex
    skipped = (b[(b.precision == "fp16_autocast_scaler") & (b.skipped_steps > 0)].seed if len(b) else pd.Series())
    e32 = ex[ex.precision == "float32"].set_index("seed")["excess"] if len(ex) else pd.Series(dtype=float)
    esc = ex[ex.precision == "fp16_autocast_scaler"].set_index("seed")["excess"] if len(ex) else pd.Series(dtype=float)
    twin32 = (sum_b[(sum_b.precision == "float32") & (sum_b.pert_dose == 1.0)].groupby("seed").final_loss.mean()
              if len(sum_b) else pd.Series(dtype=float))
    scale = twin32.reindex(skipped).to_numpy(float)
    rows.append(_cite(C.paired_difference(
        "skipping the overflowing step (GradScaler) spares the loss damage the same step does in float32 (excess "
        "final loss over the dose-1 twin at the largest dose, relative to float32's, paired by seed)", mp,
        e32.reindex(skipped).to_numpy(float) / scale, esc.reindex(skipped).to_numpy(float) / scale,
        direction="greater", alpha=alpha, **P["skip spares damage"].rule), P["skip spares damage"]))
    bf = b[b.precision == "bf16_autocast"] if len(b) else pd.DataFrame({"nonfinite_steps": []})
    fp = b[b.precision == "fp16_autocast"] if len(b) else pd.DataFrame({"nonfinite_steps": []})
    rows.append(_cite(C.rate_comparison(
        "bfloat16 keeps float32's range: the dose that overflows fp16 autocast overflows bf16 autocast less often "
        "(largest dose, over seeds)", ieee, *_k_n(fp.nonfinite_steps, lambda v: v > 0),
        *_k_n(bf.nonfinite_steps, lambda v: v > 0), direction="greater", alpha=alpha, **P["bf16 range"].rule),
        P["bf16 range"]))
    rb = rho[(rho.precision == "bf16_pure") & np.isfinite(rho.rho.to_numpy(float))] if len(rho) else rho
    r = rb.rho.to_numpy(float) if len(rb) else np.array([])
    rows.append(_cite(C.paired_difference(
        "pure bf16 storage erases more updates when the lr is small (per-run Spearman rho(lr, lost-update "
        "fraction) below 0, one run per seed)", "our own", r, np.zeros(r.shape), direction="less", alpha=alpha,
        **P["lost updates"].rule), P["lost updates"]))
    g = gap("bf16_pure", "bf16_autocast")
    rows.append(_cite(C.paired_difference(
        "pure bf16 ends worse than bf16 autocast with float32 master weights (final loss relative to bf16 "
        "autocast's, paired by seed)", mp, g, np.zeros(g.shape), direction="greater", alpha=alpha,
        **P["pure bf16"].rule), P["pure bf16"]))
    status = sum_a.set_index("precision").status if len(sum_a) else pd.Series(dtype=object)
    rows.append(_cite(C.rate_comparison(
        "pure fp16 Adam (eps=1e-8 rounds to 0 in float16) diverges where float32 does not (over seeds)", ieee,
        *_k_n(status[status.index == "fp16_pure"], lambda v: v != "ok"),
        *_k_n(status[status.index == "float32"], lambda v: v != "ok"), direction="greater", alpha=alpha,
        **P["pure fp16"].rule), P["pure fp16"]))
    hs = headroom_by_seed(logit_tab)
    rows.append(_cite(C.paired_difference(
        "the float32 twin's fp16 headroom (>= 1) predicts which fp16 runs overflow (divergence rate of the runs it "
        "flags minus the runs it clears, per seed)", ieee, hs.predicted_rate.to_numpy(float),
        hs.cleared_rate.to_numpy(float), direction="greater", alpha=alpha, **P["headroom predicts"].rule),
        P["headroom predicts"]))
    f32c = logit_tab[logit_tab.precision == "float32"] if len(logit_tab) else logit_tab
    sizes = sorted(set(f32c.block_size)) if len(f32c) else []
    context = "a longer context moves the logits closer to the fp16 limit"
    if len(sizes) < 2:
        rows.append(C.not_tested(context, "our own", f"{len(sizes)} block size(s) in the grid; the claim needs two",
                                 family=P["context"].family, sesoi=P["context"].sesoi))
    else:
        lr_ = hs.context_log_ratio.to_numpy(float)
        rows.append(_cite(C.paired_difference(
            f"{context} ({sizes[-1]} vs {sizes[0]}; step-0 headroom, log ratio, mean over the init scales, one per "
            "seed)", "our own", lr_, np.zeros(lr_.shape), direction="greater", alpha=alpha, **P["context"].rule),
            P["context"]))
    return rows
