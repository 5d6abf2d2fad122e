"""Perturbation kinds, their stability dimension, and schedules.

A perturbation is a controlled disturbance injected at a known step, for a known
duration, with a known dose, without changing the learning algorithm. Each kind
belongs to one of four *stability dimensions* and makes sense in some domains
only; :func:`check_kind` names the valid choices when a kind is misused.

Timing is in the run's own step unit (see :class:`stabstudy.spec.RunSpec`):
optimizer updates for the ``toy`` and ``lm`` domains, environment steps for ``rl``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from stabstudy.registry import KINDS, check_kind


def freeze(value: Any, where: str) -> Any:
    """Canonicalise a hyperparameter value: JSON scalars, tuples for sequences."""
    if isinstance(value, bool | int | str) or value is None:
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where}: hyperparameter values must be finite, got {value!r}")
        return value
    if isinstance(value, list | tuple):
        return tuple(freeze(v, where) for v in value)
    if isinstance(value, np.ndarray):  # a sequence, whatever its size (.item() would unwrap [64])
        return freeze(value.tolist(), where)
    if isinstance(value, np.generic):  # numpy scalar
        return freeze(value.item(), where)
    raise TypeError(f"{where}: hyperparameter values must be str/int/float/bool/None or sequences of them, got {type(value).__name__}")


def thaw(value: Any) -> Any:
    return [thaw(v) for v in value] if isinstance(value, tuple) else value


def freeze_map(mapping: Mapping[str, Any] | tuple, where: str) -> tuple[tuple[str, Any], ...]:
    items = mapping.items() if isinstance(mapping, Mapping) else tuple(mapping)
    out = []
    for k, v in items:
        if not isinstance(k, str) or not k.isidentifier():
            raise ValueError(f"{where}: keys must be identifiers, got {k!r}")
        out.append((k, freeze(v, f"{where}[{k!r}]")))
    return tuple(sorted(out))


@dataclass(frozen=True)
class Perturbation:
    """A disturbance of ``kind`` active on steps ``[start, start + duration)``.

    ``dose`` means what :data:`stabstudy.interventions.perturb.KINDS` says for the kind (e.g. the
    learning-rate factor of an ``lr_spike``). ``params`` carries kind-specific
    options (e.g. ``{"layer": "blocks.0.attn"}`` for ``reinit_layer``).
    """

    kind: str
    start: int
    duration: int = 1
    dose: float = 1.0
    params: tuple[tuple[str, Any], ...] | Mapping[str, Any] = ()

    def __post_init__(self) -> None:
        check_kind(self.kind)
        if not isinstance(self.start, int) or isinstance(self.start, bool) or self.start < 0:
            raise ValueError(f"perturbation {self.kind!r}: start must be an integer >= 0, got {self.start!r}")
        if not isinstance(self.duration, int) or isinstance(self.duration, bool) or self.duration < 1:
            raise ValueError(f"perturbation {self.kind!r}: duration must be an integer >= 1, got {self.duration!r}")
        dose = float(self.dose)
        if not math.isfinite(dose) or dose < 0:
            raise ValueError(f"perturbation {self.kind!r}: dose must be a finite number >= 0, got {self.dose!r}")
        object.__setattr__(self, "dose", dose)
        object.__setattr__(self, "params", freeze_map(self.params, f"perturbation {self.kind!r} params"))

    @property
    def dimension(self) -> str:
        """The stability dimension of this kind."""
        return KINDS[self.kind].dimension

    @property
    def end(self) -> int:
        """First step after the window."""
        return self.start + self.duration

    @property
    def p(self) -> dict[str, Any]:
        """``params`` as a plain dict."""
        return {k: thaw(v) for k, v in self.params}

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "start": self.start, "duration": self.duration, "dose": self.dose, "params": self.p}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Perturbation:
        return cls(kind=d["kind"], start=int(d["start"]), duration=int(d.get("duration", 1)),
                   dose=float(d.get("dose", 1.0)), params=d.get("params", {}))



class Schedule:
    """Which perturbations are active at each step.

    ``Schedule(perturbations)`` answers ``active(step)`` (the perturbations whose
    window ``[start, start + duration)`` contains ``step``), ``starts_at(step)``
    (instantaneous kinds fire exactly once) and ``lr_factor(step)``.
    """

    def __init__(self, perturbations: tuple[Perturbation, ...] | list[Perturbation] = ()):
        self.perturbations = tuple(perturbations)

    def active(self, step: int) -> tuple[Perturbation, ...]:
        return tuple(p for p in self.perturbations if p.start <= step < p.start + max(p.duration, 1))

    def is_active(self, step: int) -> bool:
        return bool(self.active(step))

    def of_kind(self, kind: str, step: int) -> Perturbation | None:
        """The active perturbation of ``kind`` at ``step``, if any."""
        for p in self.active(step):
            if p.kind == kind:
                return p
        return None

    def starts_at(self, step: int, kind: str | None = None) -> tuple[Perturbation, ...]:
        return tuple(p for p in self.perturbations if p.start == step and (kind is None or p.kind == kind))

    def lr_factor(self, step: int) -> float:
        """Learning-rate factor at ``step``: the product of every active ``lr_spike``'s dose and every
        started ``lr_ramp``'s ``dose ** (min(step - start + 1, duration) / duration)`` (1.0 when none).

        A ramp keeps its final factor after its window, so ``perturbed`` (the window) marks the climb
        only: a slow-onset disturbance that does not go away, unlike a spike.
        """
        f = 1.0
        for p in self.active(step):
            if p.kind == "lr_spike":
                f *= p.dose
        for p in self.perturbations:
            if p.kind == "lr_ramp" and step >= p.start:
                f *= p.dose ** (min(step - p.start + 1, p.duration) / p.duration)
        return f

    def mask(self, steps: np.ndarray) -> np.ndarray:
        """The ``perturbed`` channel (0/1 floats) over ``steps``."""
        return np.array([1.0 if self.is_active(int(s)) else 0.0 for s in steps])


# -- torch-level appliers shared by every domain --------------------------------
# Imported lazily so that spec validation never pays for importing torch.


def add_weight_noise(module, rel_sigma: float, generator) -> None:
    """Add Gaussian noise of std ``rel_sigma * rms(tensor)`` to every parameter of ``module``.

    ``generator`` is a seeded ``torch.Generator`` so the disturbance is reproducible.
    """
    import torch

    with torch.no_grad():
        for p in module.parameters():
            rms = p.detach().float().pow(2).mean().sqrt()
            noise = torch.randn(p.shape, generator=generator, dtype=torch.float32).to(p.device)
            p.add_((noise * rel_sigma * rms).to(p.dtype))


def reinit_layer(module, name: str, fraction: float, generator) -> None:
    """Re-initialise a ``fraction`` of the entries of every parameter under submodule ``name``.

    Re-initialised entries are drawn from N(0, std(original tensor)^2), so the layer
    keeps its scale but forgets what it learned. Raises ``ValueError`` naming the
    valid submodules when ``name`` is unknown.
    """
    import torch

    subs = dict(module.named_modules())
    if name not in subs:
        valid = [n for n in subs if n]
        raise ValueError(f"reinit_layer: unknown layer {name!r}; valid layers: {', '.join(valid[:40])}")
    with torch.no_grad():
        for p in subs[name].parameters():
            std = p.detach().float().std() if p.numel() > 1 else p.detach().float().abs().mean()
            fresh = torch.randn(p.shape, generator=generator, dtype=torch.float32).to(p.device) * std
            mask = torch.rand(p.shape, generator=generator).to(p.device) < fraction
            p.copy_(torch.where(mask, fresh.to(p.dtype), p))


def add_grad_noise(params, rel_sigma: float, generator) -> None:
    """Add Gaussian noise of std ``rel_sigma * rms(grad)`` to each ``.grad`` (call before ``step``)."""
    import torch

    with torch.no_grad():
        for p in params:
            if p.grad is None:
                continue
            rms = p.grad.detach().float().pow(2).mean().sqrt()
            noise = torch.randn(p.grad.shape, generator=generator, dtype=torch.float32).to(p.grad.device)
            p.grad.add_((noise * rel_sigma * rms).to(p.grad.dtype))
