"""Perturbation kinds, their stability dimension, and schedules.

A perturbation is a controlled disturbance injected at a known step, for a known
duration, with a known dose, without changing the learning algorithm. Each kind
belongs to one of four *stability dimensions* and makes sense in some domains
only; :func:`check_kind` names the valid choices when a kind is misused.

Timing is in the run's own step unit (see :class:`stabstudy.spec.RunSpec`):
optimizer updates for the ``toy`` and ``lm`` domains, environment steps for ``rl``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from stabstudy.spec import Perturbation

DIMENSIONS = ("optimization", "environment-data", "parametric", "learning-signal")
DOMAINS = ("toy", "rl", "lm")


@dataclass(frozen=True)
class Kind:
    """What a perturbation kind does and where it applies."""

    name: str
    dimension: str
    domains: tuple[str, ...]
    dose: str
    """Meaning of ``Perturbation.dose`` for this kind."""
    instantaneous: bool = False
    """Applied once at ``start`` (duration is then the observation window label only)."""


KINDS: dict[str, Kind] = {
    k.name: k
    for k in (
        Kind("lr_spike", "optimization", DOMAINS, "factor multiplying the learning rate"),
        Kind("beta2_shift", "optimization", ("toy", "lm"), "new Adam beta2 while active"),
        Kind("grad_noise", "optimization", ("toy", "lm"), "Gaussian noise std relative to the gradient RMS"),
        Kind("no_warmup", "optimization", ("lm",), "ignored (1.0): the warmup phase is removed"),
        Kind("weight_noise", "parametric", DOMAINS, "Gaussian noise std relative to each tensor's RMS", instantaneous=True),
        Kind("reinit_layer", "parametric", DOMAINS, "fraction of the layer re-initialised (1.0 = whole layer)", instantaneous=True),
        Kind("outlier_batch", "environment-data", ("toy", "lm"), "fraction of the batch replaced by outliers"),
        Kind("action_noise", "environment-data", ("rl",), "Gaussian std added to actions, relative to the action range"),
        Kind("obs_noise", "environment-data", ("rl",), "Gaussian std added to observations"),
        Kind("reward_scale", "learning-signal", ("rl",), "factor multiplying the reward"),
        Kind("loss_scale", "learning-signal", ("toy", "lm"), "factor multiplying the loss"),
        Kind("precision_switch", "learning-signal", ("lm",), "ignored (1.0): params['dtype'] names the new autocast dtype"),
    )
}


def check_kind(kind: str, domain: str | None = None) -> Kind:
    """Return the :class:`Kind` for ``kind``; raise ``ValueError`` naming valid choices."""
    if kind not in KINDS:
        raise ValueError(f"unknown perturbation kind {kind!r}; valid kinds: {', '.join(sorted(KINDS))}")
    k = KINDS[kind]
    if domain is not None and domain not in k.domains:
        valid = sorted(n for n, v in KINDS.items() if domain in v.domains)
        raise ValueError(
            f"perturbation {kind!r} does not apply to domain {domain!r} "
            f"(it applies to {', '.join(k.domains)}); kinds valid for {domain!r}: {', '.join(valid)}"
        )
    return k


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
        """Product of the doses of every active ``lr_spike`` (1.0 when none)."""
        f = 1.0
        for p in self.active(step):
            if p.kind == "lr_spike":
                f *= p.dose
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
