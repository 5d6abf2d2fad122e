"""What a perturbation did to a run, judged against the unperturbed ensemble: one outcome class per run.

The label of :mod:`stabstudy.analysis.warning.labels` sees a loss that *leaves its own trailing band*:
a blow-up. A run whose loss creeps up and stays up, or whose attention collapses while the loss
barely moves, never leaves that band. So every run also gets an outcome class from a *fixed
reference*, the per-step band of the unperturbed calibration runs:

* the reference is the per-step median ``m(t)`` of the smoothed loss (trailing mean over ``smooth``
  steps) of the unperturbed calibration runs, with half-width ``h = margin * max |L_i(t) - m(t)|``
  over those runs and the steps after ``burn_in``: with ``margin >= 1`` no unperturbed calibration
  run is ever outside it (the band is as wide as their own spread), and the unperturbed
  *evaluation* runs say how often an untouched run would be labelled;
* ``explodes``: the blow-up label fired (or the loss went non-finite);
* ``silently degrades``: no blow-up, but the loss ends above the band (mean of the last ``final``
  steps above ``m + h`` there);
* ``recovers``: no blow-up, at least ``persist`` steps above the band after ``burn_in``, and back
  inside it at the end;
* ``unaffected``: none of these.

Like the label, a class reads the loss alone, never what was done to the run or when (before a
perturbation a run is its unperturbed twin, whose steps the band covers).

Attention-entropy collapse is its own outcome (``entropy_collapse``), from the same construction on
``attn_entropy_min`` with the band's lower edge: the run ends below ``m_E - h_E``. It is NaN when
the runs do not record the channel.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import xarray as xr

#: Outcome classes, worst first.
OUTCOMES = ("explodes", "silently degrades", "recovers", "unaffected")


@dataclass(frozen=True)
class OutcomeRule:
    """Parameters of the outcome classes (module docstring)."""

    channel: str = "loss"
    """performance channel compared with the reference band (a loss: higher is worse)"""
    smooth: int = 10
    """trailing mean over this many steps before comparing with the band"""
    final: int = 20
    """last steps whose mean decides where a run ends"""
    persist: int = 10
    """steps above the band, after ``burn_in``, that count as a departure"""
    margin: float = 1.0
    """band half-width as a multiple of the largest excursion of an unperturbed calibration run"""
    burn_in: int = 50
    """steps before this one set no band and count for nothing"""
    entropy_channel: str = "attn_entropy_min"
    """channel of the attention-entropy outcome (lower is worse)"""

    def __post_init__(self) -> None:
        if self.smooth < 1 or self.final < 1 or self.persist < 1 or self.margin <= 0 or self.burn_in < 0:
            raise ValueError(f"invalid outcome rule {self}: smooth, final, persist >= 1; margin > 0; burn_in >= 0")


def _smoothed(ds: xr.Dataset, channel: str, runs, width: int) -> np.ndarray:
    x = ds[channel].sel(run=list(runs)).transpose("run", "step").to_numpy().astype(float)
    x = np.where(np.isfinite(x), x, np.inf)  # a broken run is worse than any value
    return pd.DataFrame(x.T).rolling(width, min_periods=1).mean().to_numpy().T


def reference_band(ds: xr.Dataset, reference_runs, channel: str, rule: OutcomeRule) -> tuple[np.ndarray, float]:
    """Per-step median (shape (step,)) and half-width of the reference runs' smoothed ``channel``."""
    ref = _smoothed(ds, channel, reference_runs, rule.smooth)
    ok = np.isfinite(ref).all(axis=0)
    med = np.median(ref, axis=0)
    dev = np.abs(ref - med)[:, rule.burn_in:][:, ok[rule.burn_in:]]
    return med, rule.margin * float(dev.max()) if dev.size else np.nan


def classify(ds: xr.Dataset, info: pd.DataFrame, reference_runs, rule: OutcomeRule | None = None) -> pd.DataFrame:
    """The outcome of every run of ``info`` (rows of :func:`stabstudy.analysis.warning.evaluation.run_info`).

    Args:
        ds: the runs (dims run, step).
        info: needs ``event`` (the blow-up label).
        reference_runs: the unperturbed calibration runs that set the band (at least 2).
    Returns:
        index run; ``outcome`` (one of :data:`OUTCOMES`), ``final_excess`` (mean of the last
        ``final`` smoothed losses minus the reference's, in the channel's units), ``above_steps``
        (steps above the band after ``burn_in``), ``band`` (the half-width), ``entropy_collapse``
        (bool, NaN without the channel).
    """
    rule = rule or OutcomeRule()
    reference_runs = list(reference_runs)
    if len(reference_runs) < 2:
        raise ValueError(f"the outcome band needs at least 2 unperturbed reference runs; got {len(reference_runs)}")
    med, h = reference_band(ds, reference_runs, rule.channel, rule)
    x = _smoothed(ds, rule.channel, info.index, rule.smooth)
    n = x.shape[1]
    ent = None
    if rule.entropy_channel in ds and np.isfinite(ds[rule.entropy_channel].values).any():
        e_med, e_h = reference_band(ds, reference_runs, rule.entropy_channel, rule)
        e = _smoothed(ds, rule.entropy_channel, info.index, rule.smooth)
        e = np.where(np.isinf(e), -np.inf, e)  # a broken run's entropy counts as collapsed
        ent = (e[:, n - rule.final:].mean(axis=1) < e_med[n - rule.final:].mean() - e_h) & np.isfinite(e_h)
    rows = []
    a = rule.burn_in
    for i, (run, r) in enumerate(info.iterrows()):
        above = int(np.count_nonzero(x[i, a:] > med[a:] + h))
        with np.errstate(invalid="ignore"):
            final = float(x[i, n - rule.final:].mean() - med[n - rule.final:].mean())
        if bool(r.event) or not np.isfinite(final):
            outcome = "explodes"
        elif final > h:
            outcome = "silently degrades"
        elif above >= rule.persist:
            outcome = "recovers"
        else:
            outcome = "unaffected"
        rows.append({"run": run, "outcome": outcome, "final_excess": final, "above_steps": above, "band": h,
                     "entropy_collapse": bool(ent[i]) if ent is not None else np.nan})
    return pd.DataFrame(rows).set_index("run")
