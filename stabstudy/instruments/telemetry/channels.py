"""What the Monitor records: channel names, the per-row statistics, and the channels derived from them.

A row holds, per optimizer, two groups of fields. The *host fields* (``H_*``) are known
in Python when the optimizer steps (what kind of step it was, learning rates, Adam's bias
corrections, ...) and are written straight into a numpy table. The *device fields*
(``D_*``) are sums over the gradient, parameters, update and Adam state; they are
computed by torch ops on the parameters' device into a block of rows there, and copied to
the host a block at a time (:mod:`stabstudy.instruments.telemetry.table`). The channels
are derived from both with numpy (:func:`derive`) when they are read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

#: Version of the Monitor's implementation: stored with every run (``code_identity``), so that
#: runs whose telemetry was computed by another implementation can be told apart.
TELEMETRY_VERSION = "torch-foreach-1"

#: Long names of the channels the Monitor records (attrs of ``to_dataset``).
LONG_NAMES: dict[str, str] = {
    "grad_norm": "global L2 norm of the gradient",
    "xgrad": "gradient-direction coherence cos(g_t, g_{t-1})",
    "update_norm": "L2 norm of the applied parameter update",
    "update_ratio": "update norm / parameter norm (before the update)",
    "update_grad_cos": "cosine(applied update, -gradient)",
    "adam_m_norm": "L2 norm of Adam's bias-corrected first moment m_hat",
    "adam_v_mean": "mean of Adam's bias-corrected second moment v_hat",
    "adam_eps_frac": "fraction of coordinates with sqrt(v_hat) < eps (bias-corrected)",
    "lr": "learning rate applied (param_groups[0]['lr'] of the primary optimizer)",
    "grad_coherence": "microbatch gradient coherence ||mean_k g_k||^2 / mean_k ||g_k||^2",
    "loss": "training objective at that update",
    "perf": "performance measure (higher is better)",
    "perturbed": "1 while a perturbation is active",
    "intervened": "1 where a controller acted",
    "lambda_max": "top Hessian eigenvalue (Lanczos on Hessian-vector products; NaN between measurements)",
    "layer_grad_norm": "L2 norm of the gradient per parameter tensor",
    "layer_update_ratio": "update norm / parameter norm per parameter tensor",
}

#: Channels computed by the Monitor itself, in dataset order.
OPT_CHANNELS = ("grad_norm", "xgrad", "update_norm", "update_ratio", "update_grad_cos",
                "adam_m_norm", "adam_v_mean", "adam_eps_frac", "lr")

NAN = float("nan")

# host fields, float64 per optimizer per row (NaN where not written)
# H_KIND: what was computed when the optimizer stepped (NaN: it did not step in that row);
# H_ORDER: how many optimizers stepped before it in the row; H_LR / H_LRP: its own lr and the
# primary optimizer's, read at that step; H_PREV: the row of its previous own step when that
# step's gradient is compared with this one (xgrad), else NaN; H_BC1 / H_BC2: Adam's bias
# corrections still to apply to D_M2 (divided by bc1^2) and D_VSUM (by bc2); H_N: coordinates
# of the Adam state read; H_SLOT: the gradient slot of a measured step (see below)
H_KIND, H_ORDER, H_LR, H_LRP, H_PREV, H_BC1, H_BC2, H_N, H_SLOT = range(9)
NH = 9
K_NOPARAMS, K_GRAD, K_FULL, K_ADAM = 0.0, 1.0, 2.0, 3.0

# device fields, float32 per optimizer per row: ||g||^2 (of the true gradient: a loss scale is
# divided out on the device), g.g_prev, ||w_before||^2, -u.g, ||u||^2, ||m||^2, sum(v),
# #(v < eps^2 bc2); NaN where not computed. A measured step takes g.G0 and g.G1 (the two
# gradient slots, one holding g) by one matrix-vector product into the first two fields, and
# -u.g, u.u by another into D_NUG, D_U2; the first two are put in order (||g||^2, g.g_prev)
# on the host by :func:`canonical`, from H_SLOT.
D_G2, D_GPG, D_W2, D_NUG, D_U2, D_M2, D_VSUM, D_NBELOW = range(8)
ND = 8

#: Per-layer quantities kept in the device blocks (after the ND fields), one column per layer each.
LAYER_PARTS = ("g", "u", "w")


def gradient_coherence(grads: Sequence[Sequence[torch.Tensor] | torch.Tensor]) -> float:
    """Microbatch gradient coherence ``||mean_k g_k||^2 / mean_k ||g_k||^2``.

    Args:
        grads: K microbatch gradients, each a flat tensor or a list of tensors
            (one per parameter, same layout for every k).

    Returns:
        A float in [0, 1]: 1 when all microbatch gradients agree, 1/K when they
        are orthogonal with equal norms (pure noise), 0 when they cancel.
    """
    flat = [g if isinstance(g, torch.Tensor) else torch.cat([t.detach().reshape(-1) for t in g]) for g in grads]
    if not flat:
        raise ValueError("gradient_coherence needs at least one microbatch gradient")
    G = torch.stack([f.detach().float() for f in flat])  # (K, N)
    num = G.mean(0).pow(2).sum()
    den = G.pow(2).sum(1).mean()
    return float((num / den).item()) if float(den) > 0 else NAN


class MonitorCost(NamedTuple):
    """What :meth:`Monitor.cost` returns."""

    hook_s: float  #: seconds spent inside the Monitor's hooks
    span_s: float  #: seconds from the first hook's entry to the last hook's exit
    fraction: float  #: hook_s / span_s: the share of the training loop's wall time (NaN before a step)
    updates: int  #: rows recorded (updates of the primary optimizer)
    hook_calls: int  #: hook invocations (two per optimizer step)


def canonical(D: np.ndarray, H: np.ndarray) -> None:
    """Put the first two device fields of rows ``D`` (rows x ND, one optimizer, as copied from its
    block) in order (||g||^2, g.g_prev), in place, where the step's gradient sat in slot 1
    (``H``: the same rows' host fields)."""
    swap = H[:, H_SLOT] == 1.0
    if swap.any():
        D[swap, D_G2], D[swap, D_GPG] = D[swap, D_GPG], D[swap, D_G2].copy()


@dataclass(frozen=True)
class PreStepStats:
    """What a pre-step hook (:meth:`Monitor.add_pre_step_hook`) sees of the step about to land."""

    name: str  #: the optimizer's name in the Monitor
    step: int  #: the row this update is recorded in
    grad_norm: torch.Tensor  #: 0-d float32 tensor on the gradient's device: the global gradient norm

    def grad_norm_float(self) -> float:
        """``grad_norm`` as a Python float (a host sync on a GPU)."""
        return float(self.grad_norm.item())


def previous_g2(H: np.ndarray, D: np.ndarray) -> np.ndarray:
    """||g||^2 of each optimizer's previous compared gradient for the rows ``H`` (any
    selection; rows x optimizers): ``D_G2`` of the row that ``H_PREV`` names in ``D``, which
    holds every row up to the latest; NaN where there is none."""
    out = np.full(H.shape[:2], np.nan)
    prev = H[..., H_PREV]
    for i in range(H.shape[1]):
        at = np.flatnonzero(~np.isnan(prev[:, i]))
        out[at, i] = D[prev[at, i].astype(np.int64), i, D_G2]
    return out


def derive(H: np.ndarray, D: np.ndarray, gp2: np.ndarray, lr_field: int = H_LR) -> dict[str, np.ndarray]:
    """Channels from the host fields ``H`` (rows x optimizers x NH), the device fields ``D``
    (rows x optimizers x ND) and :func:`previous_g2` ``gp2``, summed over the optimizers that
    stepped in each row; ``lr`` is host field ``lr_field`` (own lr, or the primary's lr as read
    at that step) of the first optimizer that stepped in the row."""
    kind = H[..., H_KIND]
    with np.errstate(invalid="ignore", divide="ignore"):
        def tot(x: np.ndarray, among: np.ndarray) -> np.ndarray:
            return np.where(among, x, 0.0).sum(1)

        nan = np.full(len(H), np.nan)
        out = {ch: nan for ch in OPT_CHANNELS}
        with_g = kind >= K_GRAD
        out["grad_norm"] = np.where(with_g.any(1), np.sqrt(tot(D[..., D_G2], with_g)), nan)
        full = kind >= K_FULL
        g2, u2, w2 = (tot(D[..., f], full) for f in (D_G2, D_U2, D_W2))
        ug = -tot(D[..., D_NUG], full)
        has = full.any(1)
        out["update_norm"] = np.where(has, np.sqrt(u2), nan)
        out["update_ratio"] = np.where(has & (w2 > 0), np.sqrt(u2) / np.sqrt(w2), nan)
        out["update_grad_cos"] = np.where(has & (u2 > 0) & (g2 > 0), -ug / np.sqrt(u2 * g2), nan)
        prev = full & ~np.isnan(H[..., H_PREV])
        g2p, gp2s, gpg = tot(D[..., D_G2], prev), tot(gp2, prev), tot(D[..., D_GPG], prev)
        out["xgrad"] = np.where(prev.any(1) & (g2p > 0) & (gp2s > 0), gpg / np.sqrt(g2p * gp2s), nan)
        adam = kind == K_ADAM
        n = tot(H[..., H_N], adam)
        has = adam.any(1)
        out["adam_m_norm"] = np.where(has, np.sqrt(tot(D[..., D_M2] / H[..., H_BC1] ** 2, adam)), nan)
        out["adam_v_mean"] = np.where(has, tot(D[..., D_VSUM] / H[..., H_BC2], adam) / n, nan)
        out["adam_eps_frac"] = np.where(has, tot(D[..., D_NBELOW], adam) / n, nan)
        stepped = ~np.isnan(kind)
        order = np.where(stepped, H[..., H_ORDER], np.inf)
        first = stepped & (order == order.min(1, keepdims=True))
        out["lr"] = np.where(stepped.any(1), tot(H[..., lr_field], first), nan)
    return out
