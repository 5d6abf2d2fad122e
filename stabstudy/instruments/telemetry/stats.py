"""The per-step statistics of one optimizer, by torch ops on its parameters' device.

Each function writes sums (see :class:`~stabstudy.instruments.telemetry.channels.DevField`)
by ``out=`` into 0-d views of the optimizer's device block and never reads a tensor back.

A measured step copies the gradient into one of two gradient slots of a flat buffer (:class:`~stabstudy.instruments.telemetry.state.FlatBuffer`; the other slot holds the
previous step's gradient, for ``xgrad``) by ``torch._foreach_copy_``, and the parameters into a
third row by one ``torch.cat`` of their 1-D views; after the step ``torch._foreach_sub_`` turns
that row into -u = w_before - w_after. The sums then run on flat rows, one kernel each (a
foreach reduction launches one per tensor), pairs of dot products sharing a vector as one
matrix-vector product.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from stabstudy.instruments.telemetry import sharded
from stabstudy.instruments.telemetry.channels import DevField
from stabstudy.instruments.telemetry.state import OptState, Row, as_float

#: grad mode by torch's C setter: the hooks switch it off on every step, where ``torch.no_grad()``
#: as a context manager costs three times the instructions (``docs/benchmarks.md``)
_grad_enabled, _set_grad_enabled = torch.is_grad_enabled, torch._C._set_grad_enabled


def without_grad(fn: Callable[[OptState], None], st: OptState) -> None:
    """``fn(st)`` with grad mode off: the hooks run in the caller's grad mode, and copying a
    parameter (or a gradient of ``backward(create_graph=True)``) must not be recorded."""
    was = _grad_enabled()
    _set_grad_enabled(False)
    try:
        fn(st)
    finally:
        _set_grad_enabled(was)


def grad_scale(opt: torch.optim.Optimizer) -> float | torch.Tensor | None:
    """1 / the factor the gradients the optimizer is about to see are scaled by, or None for 1:
    ``torch.amp.GradScaler`` leaves them scaled for optimizers that unscale inside ``step``
    (``_step_supports_amp_scaling``, e.g. ``fused=True`` Adam) and sets ``opt.grad_scale`` (None
    once ``unscale_`` ran) for that step. A scale on a GPU stays there (reading it would sync)."""
    s = getattr(opt, "grad_scale", None)
    if s is None:
        return None
    if isinstance(s, torch.Tensor) and s.device.type != "cpu":
        return s.detach().reciprocal()
    s = as_float(s)
    return None if s == 1.0 else 1.0 / s


def check_params(st: OptState, params: list[torch.Tensor], grads: list[torch.Tensor], ids: tuple[int, ...],
                 per_layer: bool, sketched: bool) -> None:
    """What the stepped parameters are (fixed per parameter, so checked when the set changes):
    sharded (``st.group``: their sums are all-reduced, see :mod:`.sharded`); sparse or complex
    gradients (only grad_norm is recorded for them, with a warning)."""
    if ids == st.special_key:
        return
    st.special_key = ids
    st.group = sharded.shard_group(params)
    if st.group is not None and per_layer:
        raise ValueError("Monitor: per_layer=True needs unsharded parameters (per-tensor norms of sharded "
                         "parameters are not reduced across ranks); use per_layer=False with FSDP2 / DTensor")
    if st.group is not None and sketched:
        raise ValueError("Monitor: memory='sketch' needs unsharded parameters; use memory='exact' with FSDP2 / DTensor")
    st.special = any(p.is_complex() for p in params) or any(g.is_sparse for g in grads)
    if st.special:
        warnings.warn(f"Monitor: optimizer {st.name!r} steps sparse or complex gradients; only grad_norm "
                      "and lr are recorded for it", RuntimeWarning, stacklevel=5)


def special_g2(grads: list[torch.Tensor], out: torch.Tensor) -> None:
    """||g||^2 of gradients that may be sparse (stored values, coalesced) or complex (|z|^2)."""
    vals = [(g.coalesce().values() if g.is_sparse else g).abs().double().pow(2).sum() for g in grads]
    out.copy_(torch.stack(vals).sum())


def put_cols(dst: torch.Tensor, cols: tuple[int, int] | torch.Tensor, values: torch.Tensor) -> None:
    """Write one value per stepped tensor into its layer column of ``dst``."""
    if isinstance(cols, tuple):
        dst[cols[0]:cols[1]].copy_(values)
    else:
        dst.index_copy_(0, cols, values.to(dst.dtype))


def norms_into(norms: list[torch.Tensor], cols: Any, dst: torch.Tensor | None) -> torch.Tensor:
    """Stack per-tensor ``norms``, writing them into layer columns ``cols`` of ``dst`` when given."""
    if dst is not None and isinstance(cols, tuple) and norms[0].dtype is dst.dtype:
        return torch.stack(norms, out=dst[cols[0]:cols[1]])
    s = torch.stack(norms)
    if dst is not None:
        put_cols(dst, cols, s)
    return s


def grad_only(st: OptState, grads: list[torch.Tensor], dv: list[torch.Tensor],
              layer_g: torch.Tensor | None) -> None:
    """A step that reads only the gradient (``every`` > 1): copy it into the current slot (kept
    there for the next step's g.g_prev when that step is measured), with ||g||^2 and the
    per-tensor norms from the copy. A foreach copy and one dot cost less than per-tensor norms
    (measured on the small GPT and the MLP of ``benchmarks/telemetry_overhead.py``), and the
    float32 copy sums a half-precision gradient without overflow."""
    fb, slot = st.flat, st.prev.slot
    torch._foreach_copy_(fb.rows[slot], grads)
    g = fb.flat[slot]
    torch.dot(g, g, out=dv[DevField.G2])
    if layer_g is not None:
        norms_into(torch._foreach_norm(fb.rows[slot]), st.layers.cols, layer_g)
    inv = st.cur.inv
    if inv is not None:
        dv[DevField.G2].mul_(inv * inv)
        if layer_g is not None:
            _scale_cols(layer_g, st.layers.cols, inv)


def before_update(st: OptState, params: list[torch.Tensor], grads: list[torch.Tensor],
                  dv: list[torch.Tensor], pair: torch.Tensor, linked: bool, per_layer: bool) -> None:
    """A measured step's pre-hook: copy the gradient into its slot (a foreach copy) and the
    parameters into the third row (one ``torch.cat``), then g.G0 and g.G1 into ``pair`` by one
    matrix-vector product (||g||^2 and, when ``linked``, g.g_prev: the other slot holds the
    previous own step's gradient; otherwise a value no channel reads), and ||w_before||^2."""
    fb, slot, inv, prev_inv = st.flat, st.prev.slot, st.cur.inv, st.prev.inv
    torch._foreach_copy_(fb.rows[slot], grads)
    torch.cat(fb.param_views(params), out=fb.flat[Row.W])
    torch.mv(fb.slots, fb.flat[slot], out=pair)
    w = fb.flat[Row.W]
    torch.dot(w, w, out=dv[DevField.W2])
    if inv is not None:
        dv[slot].mul_(inv * inv)
    if linked and (inv is not None or prev_inv is not None):
        dv[1 - slot].mul_((1.0 if inv is None else inv) * (1.0 if prev_inv is None else prev_inv))
    st.layers.w_before = torch.stack(torch._foreach_norm(fb.rows[Row.W])) if per_layer else None


def after_update(st: OptState, params: list[torch.Tensor], dv: list[torch.Tensor], pair: torch.Tensor,
                 layers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> None:
    """The post-hook of a measured step: -u = w_before - w_after in place, then (g.(-u), u.u)
    into ``pair`` by one matrix-vector product over the rows (g slot, -u), and per-tensor norms
    of g, u and w_before into the layer columns ``layers`` (g, u, w)."""
    fb, slot, inv = st.flat, st.prev.slot, st.cur.inv
    torch._foreach_sub_(fb.rows[Row.W], params)
    torch.mv(fb.slot_w[slot], fb.flat[Row.W], out=pair)
    if inv is not None:
        dv[DevField.NUG].mul_(inv)
    if layers is not None:
        lg, lu, lw = layers
        cols = st.layers.cols
        norms_into(torch._foreach_norm(fb.rows[slot]), cols, lg)
        if inv is not None:
            _scale_cols(lg, cols, inv)
        norms_into(torch._foreach_norm(fb.rows[Row.W]), cols, lu)
        put_cols(lw, cols, st.layers.w_before)


def update_views(st: OptState) -> list[torch.Tensor]:
    """-u of the last measured step, per parameter (views of the buffer)."""
    return st.flat.rows[Row.W]


def _scale_cols(dst: torch.Tensor, cols: Any, factor: float | torch.Tensor) -> None:
    if isinstance(cols, tuple):
        dst[cols[0]:cols[1]].mul_(factor)
    else:
        dst.index_copy_(0, cols, dst.index_select(0, cols) * factor)
