"""Gradients through depth at initialisation: deep MLPs with scaled orthogonal weights, and the GPT.

Notebook 06's closed-form side. A deep *linear* network whose weight matrices are random
orthogonal matrices times ``sigma`` multiplies the backpropagated gradient by
``W^T = sigma Q^T`` at every layer, so ``||dL/dh_l|| = sigma^(L-l) ||dL/dh_L||`` exactly;
tanh networks, residual connections and LayerNorm bend that profile, and
:func:`depth_profiles` measures them all with autograd. :func:`gpt_block_grad_norms`
reads the per-layer gradient norms of the small GPT at initialisation through the
telemetry Monitor (pre-LN vs post-LN, Xiong et al. 2020).

Nothing here trains; the analysis of these arrays lives in
:mod:`stabstudy.analysis.studies.depth_time`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import xarray as xr

from stabstudy.hparams import GPTHParams, merged
from stabstudy.instruments.telemetry import Monitor
from stabstudy.learners.corpus import get_batch, load_corpus
from stabstudy.learners.gpt import GPT
from stabstudy.learners.lm import model_config
from stabstudy.learners.seq import single_threaded

#: Block forms of :class:`DeepNet` (``phi`` = identity or tanh, ``W`` = sigma * orthogonal, ``L`` = depth).
VARIANTS: dict[str, str] = {
    "plain": "h = phi(W h)",
    "residual": "h = h + phi(W h)",
    "residual_scaled": "h = h + phi(W h) / sqrt(L)",
    "layernorm": "h = LN(phi(W h))",
    "preln_residual": "h = h + phi(W LN(h))",
}
ACTIVATIONS = ("linear", "tanh")


def scaled_orthogonal(n: int, sigma: float, generator: torch.Generator, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``sigma`` times a Haar-random orthogonal (n, n) matrix (QR of a Gaussian matrix, signs fixed)."""
    a = torch.randn((n, n), generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    q = q * torch.sign(torch.diagonal(r))  # makes the distribution Haar, not just orthogonal
    return (sigma * q).to(dtype)


class DeepNet(torch.nn.Module):
    """``depth`` square layers ``layers.0 .. layers.{depth-1}`` (Linear, bias zero), each block as
    :data:`VARIANTS` says; ``forward(x, keep=True)`` keeps every hidden state ``h_0 = x .. h_L``
    (each (batch, width)) with its gradient retained, in ``self.states``."""

    def __init__(self, depth: int, width: int, sigma: float, *, activation: str = "linear",
                 variant: str = "plain", seed: int = 0, dtype: torch.dtype = torch.float64):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width, dtype=dtype) for _ in range(depth))
        with torch.no_grad():
            for layer in self.layers:
                layer.weight.copy_(scaled_orthogonal(width, sigma, gen, dtype))
                layer.bias.zero_()
        # LayerNorm without affine parameters: at init the affine part is the identity anyway
        self.norm = torch.nn.LayerNorm(width, elementwise_affine=False, dtype=dtype)
        self.states: list[torch.Tensor] = []
        self.configure(activation, variant)

    def configure(self, activation: str, variant: str) -> DeepNet:
        """Switch the block form, keeping the weights (a grid of forms then shares one draw)."""
        if variant not in VARIANTS:
            raise ValueError(f"unknown variant {variant!r}; valid: {', '.join(VARIANTS)}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; valid: {', '.join(ACTIVATIONS)}")
        self.variant, self.activation = variant, activation
        self.branch_scale = 1.0 / math.sqrt(len(self.layers)) if variant == "residual_scaled" else 1.0
        return self

    def _phi(self, a: torch.Tensor) -> torch.Tensor:
        return torch.tanh(a) if self.activation == "tanh" else a

    def forward(self, x: torch.Tensor, keep: bool = False) -> torch.Tensor:
        """``x`` (batch, width) -> ``h_L`` (batch, width)."""
        self.states = [x] if keep else []
        h = x
        for layer in self.layers:
            if self.variant == "plain":
                h = self._phi(layer(h))
            elif self.variant in ("residual", "residual_scaled"):
                h = h + self.branch_scale * self._phi(layer(h))
            elif self.variant == "layernorm":
                h = self.norm(self._phi(layer(h)))
            else:
                h = h + self._phi(layer(self.norm(h)))
            if keep:
                h.retain_grad()
                self.states.append(h)
        return h


def depth_profile(depth: int, width: int, sigma: float, *, activation: str = "linear", variant: str = "plain",
                  batch: int = 32, seed: int = 0, dtype: torch.dtype = torch.float64) -> np.ndarray:
    """Gradient norms ``||dL/dh_l||_F`` (over batch and units) for ``l = L, L-1, ..., 0``: shape (depth + 1,),
    index = layers from the output.

    Inputs are standard Gaussian (batch, width); the loss is ``sum_b r . h_L`` for a fixed random
    unit vector ``r``, so ``dL/dh_L`` does not depend on the forward pass and equals ``sqrt(batch)``
    in norm.
    """
    return _profile(DeepNet(depth, width, sigma, activation=activation, variant=variant, seed=seed, dtype=dtype),
                    batch, seed, dtype)


def _profile(net: DeepNet, batch: int, seed: int, dtype: torch.dtype) -> np.ndarray:
    width = net.layers[0].in_features
    gen = torch.Generator().manual_seed(seed + 1_000_003)
    x = torch.randn((batch, width), generator=gen, dtype=torch.float64).to(dtype).requires_grad_(True)
    r = torch.randn(width, generator=gen, dtype=torch.float64)
    r = (r / r.norm()).to(dtype)
    (net(x, keep=True) @ r).sum().backward()
    norms = np.array([float(h.grad.double().norm()) for h in net.states])
    return norms[::-1].copy()


@single_threaded
def depth_profiles(sigmas: Sequence[float], depth: int, width: int, seeds: Sequence[int], *,
                   activations: Sequence[str] = ACTIVATIONS, variants: Sequence[str] = ("plain",),
                   batch: int = 32) -> xr.DataArray:
    """:func:`depth_profile` over a grid: dims (``activation``, ``variant``, ``sigma``, ``seed``,
    ``from_output``), ``from_output`` = L - l (0 .. depth)."""
    data = np.full((len(activations), len(variants), len(sigmas), len(seeds), depth + 1), np.nan)
    for k, s in enumerate(sigmas):
        for m, sd in enumerate(seeds):
            net = DeepNet(depth, width, float(s), seed=int(sd))  # one draw of the weights for every form
            for i, a in enumerate(activations):
                for j, v in enumerate(variants):
                    data[i, j, k, m] = _profile(net.configure(a, v), batch, int(sd), torch.float64)
    return xr.DataArray(data, dims=("activation", "variant", "sigma", "seed", "from_output"),
                        coords={"activation": list(activations), "variant": list(variants),
                                "sigma": [float(s) for s in sigmas], "seed": [int(s) for s in seeds],
                                "from_output": np.arange(depth + 1)},
                        name="state_grad_norm", attrs={"long_name": "||dL/dh_l|| at init (Frobenius over batch)",
                                                 "depth": depth, "width": width, "input_q0": 1.0})


def monitor_layer_grad_norms(net: torch.nn.Module, x: torch.Tensor, r: torch.Tensor) -> xr.DataArray:
    """One SGD step (learning rate 0) on ``sum_b r . net(x)`` seen by a ``Monitor(per_layer=True)``:
    its ``layer_grad_norm`` at that step, a DataArray over the ``layer`` dimension (parameter names)."""
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    mon = Monitor(net, opt, per_layer=True)
    try:
        opt.zero_grad()
        (net(x) @ r).sum().backward()
        opt.step()
        ds = mon.to_dataset()
    finally:
        mon.close()
    return ds["layer_grad_norm"].isel(step=0)


@single_threaded
def gpt_block_grad_norms(n_layers: Sequence[int], seeds: Sequence[int], *, post_ln: Sequence[bool] = (False, True),
                         corpus_bytes: int = 200_000, **hp: Any) -> xr.DataArray:
    """Per-block gradient norms of the GPT at initialisation, read by the Monitor.

    For each depth, LayerNorm placement and seed: a GPT built exactly as the ``lm`` learner
    builds it (``hp`` as :class:`~stabstudy.hparams.GPTHParams`), one training batch of the
    stdlib corpus, the cross-entropy's gradient, and the Monitor's ``layer_grad_norm`` summed
    in quadrature over each block's tensors. Returns a DataArray with dims (``post_ln``,
    ``n_layer``, ``seed``, ``block``), NaN beyond a model's depth.
    """
    hp = {**hp, "corpus_bytes": corpus_bytes}
    corpus = None
    max_l = max(n_layers)
    out = np.full((len(post_ln), len(n_layers), len(seeds), max_l), np.nan)
    for i, pl in enumerate(post_ln):
        for j, n in enumerate(n_layers):
            full = merged(GPTHParams, {**hp, "n_layer": int(n), "post_ln": bool(pl)}, "gpt_block_grad_norms")
            if corpus is None:
                corpus = load_corpus("stdlib", int(full["corpus_bytes"]), float(full["val_frac"]))
            for k, seed in enumerate(seeds):
                torch.manual_seed(int(seed))
                model = GPT(model_config(full))
                x, y = get_batch(corpus.train, int(full["batch_size"]), int(full["block_size"]),
                                 torch.Generator().manual_seed(int(seed)))
                opt = torch.optim.SGD(model.parameters(), lr=0.0)
                mon = Monitor(model, opt, per_layer=True)
                try:
                    opt.zero_grad()
                    model(x, y).loss.backward()
                    opt.step()
                    per = mon.to_dataset()["layer_grad_norm"].isel(step=0)
                finally:
                    mon.close()
                names = [str(s) for s in per.layer.values]
                sq = per.values.astype(np.float64) ** 2
                for b in range(int(n)):
                    sel = [m for m, name in enumerate(names) if name.startswith(f"blocks.{b}.")]
                    out[i, j, k, b] = math.sqrt(float(sq[sel].sum()))
    return xr.DataArray(out, dims=("post_ln", "n_layer", "seed", "block"),
                        coords={"post_ln": [bool(p) for p in post_ln], "n_layer": [int(n) for n in n_layers],
                                "seed": [int(s) for s in seeds], "block": np.arange(max_l)},
                        name="block_grad_norm",
                        attrs={"long_name": "gradient norm of one transformer block's parameters at init"})
