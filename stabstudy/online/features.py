"""Detector inputs, guarded against leakage of the perturbation into the warning.

A detector that reads the learning rate "predicts" an LR ramp because it sees the ramp, not
because training is becoming unstable. So:

* :data:`FORBIDDEN` channels (``lr``, ``perturbed``, ``intervened``) and each perturbation
  kind's own knob (:data:`KNOBS`) can never be a feature;
* channels that are a direct function of the knob (:data:`KNOB_DRIVEN`: the update norm and
  ratio under an LR perturbation, which scale with the learning rate) enter only divided by the
  applied learning rate (``update_norm/lr`` = the norm of Adam's normalised direction), or as a
  *knob-aware* feature that the caller must ask for explicitly (``knob_aware=True``), reported
  in a separate column;
* :data:`KNOB_AWARE` derived features (sharpness against 2/lr) are knob-aware by construction.

:func:`check` raises ``ValueError`` naming the offending channels; every detector and meta-state
built by :mod:`stabstudy.analysis.warning.evaluation` passes through it; so does the streaming
:class:`~stabstudy.online.metastate.MetaState`. numpy only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

#: Never a feature: they record the intervention itself.
FORBIDDEN: tuple[str, ...] = ("lr", "perturbed", "intervened")
#: Perturbation kind -> channels that record its knob (forbidden while the kind is in play).
KNOBS: dict[str, tuple[str, ...]] = {"lr_spike": ("lr",), "lr_ramp": ("lr",), "beta2_shift": (),
                                     "loss_scale": (), "outlier_batch": (), "grad_noise": ()}
#: Perturbation kind -> channels that are a direct function of its knob (raw use is knob-aware).
KNOB_DRIVEN: dict[str, tuple[str, ...]] = {"lr_spike": ("update_norm", "update_ratio"),
                                           "lr_ramp": ("update_norm", "update_ratio")}
#: Derived features: name -> (numerator channel, learning-rate channel, power of lr).
#: ``x / lr`` removes the knob; ``x * lr / 2`` (sharpness against 2/lr) multiplies it in.
DERIVED: dict[str, tuple[str, str, float]] = {
    "update_norm/lr": ("update_norm", "lr", -1.0),
    "update_ratio/lr": ("update_ratio", "lr", -1.0),
    "lambda_max*lr/2": ("lambda_max", "lr", 1.0),
}
#: Derived features that contain the knob: allowed only with ``knob_aware=True``.
KNOB_AWARE: tuple[str, ...] = ("lambda_max*lr/2",)
#: Channels whose scale spans decades: used as log10 (a multiplicative change is one size everywhere).
LOG_SCALE: tuple[str, ...] = ("grad_norm", "update_norm", "update_ratio", "update_norm/lr", "update_ratio/lr",
                              "adam_m_norm", "adam_v_mean", "attn_logit_max", "out_logit_max", "last_weight_norm")
#: The language-model telemetry of the meta-state (knob-free; adam_eps_frac is constant in float32 runs).
LM_CHANNELS: tuple[str, ...] = ("grad_norm", "xgrad", "update_norm/lr", "update_ratio/lr", "update_grad_cos",
                                "adam_m_norm", "adam_v_mean", "attn_logit_max", "attn_entropy_min",
                                "out_logit_max")


def forbidden_for(kinds: Iterable[str] = ()) -> set[str]:
    """Channels that may never be a feature when perturbations of ``kinds`` are in play."""
    out = set(FORBIDDEN)
    for k in kinds:
        out.update(KNOBS.get(k, ()))
    return out


def check(features: Sequence[str], kinds: Iterable[str] = (), knob_aware: bool = False) -> None:
    """Raise ``ValueError`` naming every feature that would leak the perturbation (module docstring).

    Args:
        features: channel names or :data:`DERIVED` names.
        kinds: perturbation kinds present in the runs the features will be read from.
        knob_aware: allow knob-driven channels raw and :data:`KNOB_AWARE` features.
    """
    kinds = tuple(kinds)
    bad = sorted(f for f in features if f in forbidden_for(kinds))
    if bad:
        raise ValueError(f"forbidden channel(s) {bad} as detector input: they record the perturbation "
                         f"itself (forbidden: {', '.join(sorted(forbidden_for(kinds)))})")
    if knob_aware:
        return
    driven = {c for k in kinds for c in KNOB_DRIVEN.get(k, ())}
    bad = sorted(f for f in features if f in driven or f in KNOB_AWARE)
    if bad:
        raise ValueError(f"channel(s) {bad} are a direct function of the perturbation's knob under "
                         f"{', '.join(sorted(set(kinds)))}: use them divided by the applied learning rate "
                         f"({', '.join(n for n in DERIVED if n not in KNOB_AWARE)}) or ask for a knob-aware "
                         "detector (knob_aware=True)")


def is_knob_aware(features: Sequence[str], kinds: Iterable[str] = ()) -> bool:
    """Whether ``features`` need ``knob_aware=True`` under ``kinds``."""
    driven = {c for k in kinds for c in KNOB_DRIVEN.get(k, ())}
    return any(f in KNOB_AWARE or f in driven for f in features)


def column(data: Mapping[str, np.ndarray], feature: str, log: bool = True) -> np.ndarray:
    """One feature as floats (shape of the channel arrays), log10 for :data:`LOG_SCALE` when ``log``.

    ``data`` maps channel names to arrays (a Dataset or a dict of arrays); non-positive values
    of a log-scale feature become NaN.
    """
    if feature in DERIVED:
        num, lr, power = DERIVED[feature]
        with np.errstate(divide="ignore", invalid="ignore"):
            x = np.asarray(data[num], dtype=float) * np.asarray(data[lr], dtype=float) ** power
        if feature == "lambda_max*lr/2":
            x = x / 2.0
    else:
        x = np.asarray(data[feature], dtype=float)
    if log and feature in LOG_SCALE:
        with np.errstate(divide="ignore", invalid="ignore"):
            x = np.where(x > 0, np.log10(np.where(x > 0, x, 1.0)), np.nan)
    return x


def matrix(data: Mapping[str, np.ndarray], features: Sequence[str], kinds: Iterable[str] = (),
           knob_aware: bool = False, log: bool = True) -> np.ndarray:
    """Checked features of one run stacked as columns: shape (step, feature), in ``features`` order."""
    check(features, kinds, knob_aware)
    return np.stack([column(data, f, log) for f in features], axis=-1)


def channels_of(features: Iterable[str]) -> set[str]:
    """The channels ``features`` are computed from (a :data:`DERIVED` feature reads two)."""
    return {c for f in features for c in (DERIVED[f][:2] if f in DERIVED else (f,))}


def row(values: Mapping[str, float], features: Sequence[str], log: bool = True) -> np.ndarray:
    """One step's features (shape (feature,)) from a mapping of that step's channel values.

    The streaming counterpart of :func:`matrix` (same transforms); the guard runs once, when the
    detector or meta-state is built, not on every step.
    """
    data = {c: np.asarray(values[c], dtype=float) for c in channels_of(features)}
    return np.array([float(column(data, f, log)) for f in features])
