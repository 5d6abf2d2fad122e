"""What the Monitor records: channel names, the per-row statistics, and the channels derived from them.

A row holds, per optimizer, two groups of fields. The *host fields* (:class:`HostField`) are known
in Python when the optimizer steps (what kind of step it was, learning rates, Adam's bias
corrections, ...) and are written straight into a numpy table. The *device fields*
(:class:`DevField`) are sums over the gradient, parameters, update and Adam state; they are
computed by torch ops on the parameters' device into a block of rows there, and copied to
the host a block at a time (:mod:`stabstudy.instruments.telemetry.table`). The channels
are derived from both with numpy (:func:`derive`) when they are read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

import numpy as np
import torch

from stabstudy import registry

#: Version of the Monitor's implementation: stored with every run (``code_identity``), so that
#: runs whose telemetry was computed by another implementation can be told apart.
TELEMETRY_VERSION = "torch-foreach-1"

#: Long names of the channels (attrs of ``to_dataset``): the registry's meanings.
LONG_NAMES: dict[str, str] = registry.LONG_NAMES

#: Channels computed by the Monitor itself, in dataset order (the registry's ``optimizer`` channels).
OPT_CHANNELS = registry.channel_names(source="optimizer")

NAN = float("nan")

class HostField(IntEnum):
    """Host fields of a row, float64 per optimizer (NaN where not written)."""

    KIND = 0  #: what was computed when the optimizer stepped (a :class:`Kind`; NaN: it did not step in that row)
    ORDER = 1  #: how many optimizers stepped before it in the row
    LR = 2  #: its own lr, read at that step
    LRP = 3  #: the primary optimizer's lr, read at that step
    PREV = 4  #: the row of its previous own step when that step's gradient is compared with this one (xgrad), else NaN
    BC1 = 5  #: Adam's bias correction 1 - beta1^t still to apply to DevField.M2 (divided by BC1^2)
    BC2 = 6  #: Adam's bias correction 1 - beta2^t still to apply to DevField.VSUM (divided by BC2)
    N = 7  #: coordinates of the Adam state read
    SLOT = 8  #: the gradient slot of a measured step (see DevField)
    RAW = 9  #: 1 where DevField.RAW holds the norm the gradient had before the step's changes (clipping, ...)


class Kind(IntEnum):
    """What a row recorded for one optimizer (``HostField.KIND``); each kind includes the ones before it."""

    NOPARAMS = 0  #: it stepped no parameter with a gradient
    GRAD = 1  #: the gradient only (``grad_norm``; steps between ``every`` measurements)
    FULL = 2  #: gradient, parameters and update
    ADAM = 3  #: FULL and Adam's moments


class DevField(IntEnum):
    """Device fields of a row, per optimizer, in the dtype of its flat buffer (float64 for a float64
    model, else float32; NaN where not computed).

    A measured step takes g.G0 and g.G1 (the two gradient slots, one holding g) by one
    matrix-vector product into the first two fields, and -u.g, u.u by another into NUG, U2;
    the first two are put in order (G2, GPG) on the host by :func:`canonical`, from
    ``HostField.SLOT``.
    """

    G2 = 0  #: ||g||^2 of the true gradient the optimizer receives (a loss scale is divided out on the device)
    GPG = 1  #: g . g_prev
    W2 = 2  #: ||w_before||^2
    #: ||g||^2 as the last backward pass left it, unscaled, where something changed the gradient
    #: before the step (:mod:`.backward`; HostField.RAW says where it is written)
    RAW = 3
    NUG = 4  #: -u . g
    U2 = 5  #: ||u||^2
    M2 = 6  #: ||m||^2 (Adam, before bias correction unless HostField.BC1 is 1)
    VSUM = 7  #: sum(v)
    NBELOW = 8  #: #(v < eps^2 bc2)


NH = len(HostField)
ND = len(DevField)

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
    swap = H[:, HostField.SLOT] == 1.0
    if swap.any():
        D[swap, DevField.G2], D[swap, DevField.GPG] = D[swap, DevField.GPG], D[swap, DevField.G2].copy()


@dataclass(frozen=True)
class PreStepStats:
    """What a pre-step hook (:meth:`Monitor.add_pre_step_hook`) sees of the step about to land."""

    name: str  #: the optimizer's name in the Monitor
    step: int  #: the row this update is recorded in
    #: 0-d tensor on the gradient's device (float64 for a float64 model, else float32): the global norm
    #: of the gradient as ``backward()`` produced it, before clipping (the row's ``grad_norm``)
    grad_norm: torch.Tensor
    #: the same for the gradient the optimizer is about to receive, after any clipping (the row's
    #: ``grad_norm_applied``; what an action that rescales the gradient starts from)
    grad_norm_applied: torch.Tensor

    def grad_norm_float(self) -> float:
        """``grad_norm`` as a Python float (a host sync on a GPU)."""
        return float(self.grad_norm.item())


def previous_g2(H: np.ndarray, D: np.ndarray) -> np.ndarray:
    """||g||^2 of each optimizer's previous compared gradient for the rows ``H`` (any
    selection; rows x optimizers): ``DevField.G2`` of the row that ``HostField.PREV`` names in ``D``, which
    holds every row up to the latest; NaN where there is none."""
    out = np.full(H.shape[:2], np.nan)
    prev = H[..., HostField.PREV]
    for i in range(H.shape[1]):
        at = np.flatnonzero(~np.isnan(prev[:, i]))
        out[at, i] = D[prev[at, i].astype(np.int64), i, DevField.G2]
    return out


def derive(H: np.ndarray, D: np.ndarray, gp2: np.ndarray, lr_field: int = HostField.LR) -> dict[str, np.ndarray]:
    """Channels from the host fields ``H`` (rows x optimizers x NH), the device fields ``D``
    (rows x optimizers x ND) and :func:`previous_g2` ``gp2``, summed over the optimizers that
    stepped in each row; ``lr`` is host field ``lr_field`` (own lr, or the primary's lr as read
    at that step) of the first optimizer that stepped in the row."""
    kind = H[..., HostField.KIND]
    with np.errstate(invalid="ignore", divide="ignore"):
        def tot(x: np.ndarray, among: np.ndarray) -> np.ndarray:
            return np.where(among, x, 0.0).sum(1)

        nan = np.full(len(H), np.nan)
        out = {ch: nan for ch in OPT_CHANNELS}
        with_g = kind >= Kind.GRAD
        some = with_g.any(1)
        raw = np.where(H[..., HostField.RAW] == 1.0, D[..., DevField.RAW], D[..., DevField.G2])
        out["grad_norm"] = np.where(some, np.sqrt(tot(raw, with_g)), nan)
        out["grad_norm_applied"] = np.where(some, np.sqrt(tot(D[..., DevField.G2], with_g)), nan)
        full = kind >= Kind.FULL
        g2, u2, w2 = (tot(D[..., f], full) for f in (DevField.G2, DevField.U2, DevField.W2))
        ug = -tot(D[..., DevField.NUG], full)
        has = full.any(1)
        out["update_norm"] = np.where(has, np.sqrt(u2), nan)
        out["update_ratio"] = np.where(has & (w2 > 0), np.sqrt(u2) / np.sqrt(w2), nan)
        out["update_grad_cos"] = np.where(has & (u2 > 0) & (g2 > 0), -ug / np.sqrt(u2 * g2), nan)
        prev = full & ~np.isnan(H[..., HostField.PREV])
        g2p, gp2s, gpg = tot(D[..., DevField.G2], prev), tot(gp2, prev), tot(D[..., DevField.GPG], prev)
        out["xgrad"] = np.where(prev.any(1) & (g2p > 0) & (gp2s > 0), gpg / np.sqrt(g2p * gp2s), nan)
        adam = kind == Kind.ADAM
        n = tot(H[..., HostField.N], adam)
        has = adam.any(1)
        out["adam_m_norm"] = np.where(has, np.sqrt(tot(D[..., DevField.M2] / H[..., HostField.BC1] ** 2, adam)), nan)
        out["adam_v_mean"] = np.where(has, tot(D[..., DevField.VSUM] / H[..., HostField.BC2], adam) / n, nan)
        out["adam_eps_frac"] = np.where(has, tot(D[..., DevField.NBELOW], adam) / n, nan)
        stepped = ~np.isnan(kind)
        order = np.where(stepped, H[..., HostField.ORDER], np.inf)
        first = stepped & (order == order.min(1, keepdims=True))
        out["lr"] = np.where(stepped.any(1), tot(H[..., lr_field], first), nan)
    return out
