"""Collapse labels computed from performance alone.

An *event* is the training (or validation) loss leaving a robust band around its own
trailing level and staying out: at step ``t`` the band is ``median(past) + max(k * sigma,
min_excess)``, with ``median`` and ``sigma = 1.4826 * MAD`` over the ``window`` measurements
before ``t`` (causal, the value at ``t`` excluded); the onset is the first ``t`` whose value is
above its band while at least ``frac`` of the ``persist`` measurements from ``t`` on stay above
that same (frozen) band. A non-finite loss counts as out of the band, and so does every step
after the end of a diverged run. A run with no such ``t`` gets the null label.

Each event also gets an *onset speed*, measured on the same channel before the onset and never from
what was done to the run: the ``rise`` of the band's trailing level over the ``window`` measurements
before the onset (its level at the onset minus the lowest level in that stretch), in units of the
label's smallest band half-width ``min_excess`` (the smallest rise it counts as a collapse; the band's
own width is no unit here, since a creeping loss widens it). An onset whose level had already climbed
by ``slow`` of those units is ``slow-onset`` (the loss crept up before the blow-up);
otherwise it is a ``shock`` (the loss jumped from where it was). These are the event families of the
early-warning protocol (:mod:`stabstudy.analysis.warning.evaluation`): a deployed monitor knows no
perturbation kind, so neither may the family.

Only the named performance channel (and the run's ``status``) is read: the label never sees a
telemetry channel, so no detector can be favoured by sharing inputs with its own target.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import xarray as xr

from stabstudy.online.robust import MAD_SCALE, rolling_median_mad

#: Performance channels a label may read -> whether higher values are worse (a loss) or better.
PERFORMANCE: dict[str, bool] = {"loss": True, "ce_loss": True, "val_loss": True, "perf": False}
#: Event families by onset speed (module docstring), slowest first.
FAMILIES: tuple[str, ...] = ("slow-onset", "shock")


@dataclass(frozen=True)
class LabelRule:
    """Parameters of the performance label (module docstring).

    Attributes:
        channel: one of :data:`PERFORMANCE`.
        window: measurements in the trailing band.
        k: band half-width in robust standard deviations (1.4826 MAD).
        min_excess: smallest band half-width, in the channel's units (a loss that barely
            fluctuates must still rise this much to count).
        persist: measurements, from the onset on, over which the value must stay out.
        frac: share of those ``persist`` measurements that must be out (noise may dip back in).
        burn_in: no onset before this step (the loss falls fastest at the start).
        slow: rise of the trailing level over the ``window`` measurements before an onset, in units
            of ``min_excess``, from which the onset is ``slow-onset`` (module docstring).
    """

    channel: str = "loss"
    window: int = 50
    k: float = 6.0
    min_excess: float = 0.3
    persist: int = 20
    frac: float = 0.8
    burn_in: int = 50
    slow: float = 0.25

    def __post_init__(self) -> None:
        if self.channel not in PERFORMANCE:
            raise ValueError(f"a label reads performance only; {self.channel!r} is not one of "
                             f"{', '.join(PERFORMANCE)}")
        if self.window < 3 or self.persist < 1 or not 0 < self.frac <= 1 or self.k <= 0 or self.slow <= 0:
            raise ValueError(f"invalid label rule {self}: window >= 3, persist >= 1, 0 < frac <= 1, k > 0, slow > 0")


def band(values: np.ndarray, window: int, k: float, min_excess: float) -> tuple[np.ndarray, np.ndarray]:
    """Causal robust band of a 1-D series (shape (n,)): ``(level, upper)``, each shape (n,).

    ``level[t]`` is the median of the finite values among ``values[t - window:t]`` and
    ``upper[t] = level[t] + max(k * 1.4826 * MAD, min_excess)``; NaN where fewer than
    ``window // 2`` past values are finite. The median and MAD are
    :func:`stabstudy.online.robust.rolling_median_mad`'s, the meta-state's.
    """
    med, mad, n = rolling_median_mad(np.asarray(values, dtype=float), window, window_of="steps")
    enough = n >= max(window // 2, 2)
    level = np.where(enough, med, np.nan)
    return level, np.where(enough, med + np.maximum(k * MAD_SCALE * mad, min_excess), np.nan)


def onset(values: np.ndarray, rule: LabelRule, diverged: bool = False, steps: np.ndarray | None = None,
          ) -> tuple[int, float, float]:
    """Index of the first collapse in a 1-D series of measurements (shape (n,)), or -1.

    ``values`` are oriented so that higher is worse. ``steps`` (shape (n,)) gives each
    measurement's step for the burn-in (default: its index). Returns ``(index, level,
    excess)``: the band's level at the onset and the largest excess over it within the
    persistence window (inf when the run diverged), NaN for the null label.
    """
    x = np.asarray(values, dtype=float)
    n = x.size
    st = np.arange(n) if steps is None else np.asarray(steps)
    level, upper = band(x, rule.window, rule.k, rule.min_excess)
    bad = ~np.isfinite(x)
    out = bad | (x > upper)
    for t in np.flatnonzero(out & np.isfinite(upper) & (st >= rule.burn_in)):
        seg = x[t:t + rule.persist]
        above = ~np.isfinite(seg) | (seg > upper[t])
        missing = rule.persist - seg.size  # the run ended inside the window
        if missing and not diverged:
            continue  # cannot tell whether it stayed out: no label there
        n_out = int(above.sum()) + missing
        if n_out >= rule.frac * rule.persist:
            excess = np.inf if (diverged and (missing or (~np.isfinite(seg)).any())) else float(np.nanmax(seg) - level[t])
            return int(t), float(level[t]), excess
    return -1, np.nan, np.nan


def onset_rise(values: np.ndarray, index: int, rule: LabelRule) -> float:
    """Rise of the band's trailing level over the ``rule.window`` measurements before measurement
    ``index`` of a 1-D series (higher is worse), in units of ``rule.min_excess`` (module docstring;
    without a floor, of the band's half-width where the level was lowest); NaN when the band is
    undefined there."""
    x = np.asarray(values, dtype=float)
    level, upper = band(x, rule.window, rule.k, rule.min_excess)
    a = max(index - rule.window, 0)
    seg = level[a:index + 1]
    if not np.isfinite(seg).any() or not np.isfinite(level[index]):
        return np.nan
    low = a + int(np.nanargmin(seg))
    unit = rule.min_excess if rule.min_excess > 0 else upper[low] - level[low]
    return float((level[index] - level[low]) / unit) if unit > 0 else np.nan


def family(rise: float, rule: LabelRule) -> str:
    """The event family of an onset whose level rose by ``rise`` half-widths (:func:`onset_rise`):
    ``slow-onset`` from ``rule.slow`` on, else ``shock`` (an undefined rise: the loss had no band to
    climb in, a shock)."""
    return FAMILIES[0] if np.isfinite(rise) and rise >= rule.slow else FAMILIES[1]


def label_run(ds: xr.Dataset, rule: LabelRule) -> dict[str, float | int | bool | str]:
    """Label one run (a Dataset with dimension ``step``): ``event``, ``onset`` (step, -1 for the
    null label), ``level``, ``excess``, ``rise`` (:func:`onset_rise`, NaN for the null label) and
    ``family`` (:func:`family`; empty for the null label). Reads ``rule.channel`` and
    ``attrs``/coordinate ``status`` only."""
    status = str(ds.attrs.get("status", ds.coords["status"].values if "status" in ds.coords else "ok"))
    return _label(np.asarray(ds[rule.channel].values, dtype=float), np.asarray(ds["step"].values), status, rule)


def _label(y: np.ndarray, steps: np.ndarray, status: str, rule: LabelRule) -> dict[str, float | int | bool | str]:
    """:func:`label_run` of the series ``y`` of ``rule.channel`` at ``steps``, of a run whose status is ``status``."""
    if not PERFORMANCE[rule.channel]:
        y = -y
    finite = np.flatnonzero(np.isfinite(y))
    diverged = status == "diverged"
    if finite.size == 0:
        return {"event": diverged, "onset": int(steps[0]) if diverged else -1, "level": np.nan,
                "excess": np.inf if diverged else np.nan, "rise": np.nan, "family": FAMILIES[1] if diverged else ""}
    # a sparse channel (val_loss) is labelled on its measurements; a diverged run keeps its last
    # (non-finite) loss as the break
    last = finite[-1]
    keep = finite
    if diverged:
        after = np.flatnonzero(~np.isfinite(y[last + 1:]))
        if after.size:
            keep = np.append(finite, last + 1 + after[0])
    i, level, excess = onset(y[keep], rule, diverged=diverged, steps=steps[keep])
    if i < 0:
        return {"event": False, "onset": -1, "level": level, "excess": excess, "rise": np.nan, "family": ""}
    rise = onset_rise(y[keep], i, rule)
    return {"event": True, "onset": int(steps[keep][i]), "level": level, "excess": excess, "rise": rise,
            "family": family(rise, rule)}


def label_runs(ds: xr.Dataset, rule: LabelRule | None = None) -> pd.DataFrame:
    """:func:`label_run` for every run of a ``(run, step)`` Dataset (:func:`stabstudy.run.store.load_runs`).

    Returns one row per run (index ``run``): ``event`` (bool), ``onset`` (step, -1 when none),
    ``level``, ``excess``, ``rise`` and ``family`` (the onset's speed). A NaN-padded tail (a run
    shorter than the longest) is not data: it is cut at the run's last finite value before
    labelling, except that a diverged run keeps its first non-finite value as the break.
    """
    rule = rule or LabelRule()
    y = np.asarray(ds[rule.channel].transpose("run", "step").values, dtype=float)
    steps = np.asarray(ds["step"].values)
    status = np.asarray(ds["status"].values) if "status" in ds.coords else np.full(y.shape[0], "ok")
    rows = [{"run": run, **_label(y[i], steps, str(status[i]), rule)} for i, run in enumerate(ds["run"].values)]
    return pd.DataFrame(rows).set_index("run")
