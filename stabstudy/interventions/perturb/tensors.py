"""Torch-level disturbances shared by every domain: weight noise, layer re-initialisation, gradient noise.

Torch is imported inside the functions, so that importing the perturbation package (spec
validation, the CLI) never pays for it. Every random draw comes from the ``generator`` given,
a seeded ``torch.Generator``, so a disturbance is reproducible.
"""

from __future__ import annotations


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
