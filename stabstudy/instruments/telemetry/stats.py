"""The per-step statistics of one optimizer, by torch ops on its parameters' device.

Each function writes sums (see ``D_*`` in :mod:`stabstudy.instruments.telemetry.channels`)
by ``out=`` into 0-d views of the optimizer's device block and never reads a tensor back.

A measured step copies the gradient into one of two gradient slots of a flat float32
buffer (the other holds the previous step's gradient, for ``xgrad``) and the parameters
into a third row, by ``torch._foreach_copy_``; after the step ``torch._foreach_sub_`` turns
that row into -u = w_before - w_after. The sums then run on flat rows, one kernel each (a
foreach reduction launches one per tensor), pairs of dot products sharing a vector as one
matrix-vector product. Rows are padded to 64 bytes: BLAS's dot product ran 7x slower on two
rows whose addresses differed by 40 bytes.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from stabstudy.instruments.telemetry.adam import AdamCache, as_float
from stabstudy.instruments.telemetry.channels import D_G2, D_NUG, D_W2
from stabstudy.instruments.telemetry.table import Block

#: Buffer rows are padded to a multiple of this many float32 (64 bytes).
ALIGN = 16
# buffer rows: two gradient slots, the parameters before the step (then -u)
_G0, _G1, _W = range(3)


class OptState:
    """One attached optimizer: its flat buffers, device block and step bookkeeping."""

    def __init__(self, index: int, name: str, optimizer: torch.optim.Optimizer):
        self.index = index
        self.name = name
        self.opt = optimizer
        self.buf: torch.Tensor | None = None  # (3, S) float32, rows _G0, _G1, _W
        self.flat: list[torch.Tensor] = []  # each buffer row's first N elements
        self.rows: list[list[torch.Tensor]] = []  # the rows as views shaped like the parameters
        self.slots = torch.empty(0)  # rows _G0, _G1 as one (2, N) matrix
        self.slot_w: list[torch.Tensor] = []  # per slot: that slot's row and row _W as one matrix
        self.sizes_dev = torch.empty(0, dtype=torch.long)  # element count per tensor, on the device
        self.key: tuple[int, ...] = ()
        self.sizes: list[int] = []
        self.N = 0  # elements of the stepped parameters
        self.block: Block | None = None  # device fields of the recent rows
        self.slot = 0  # gradient slot of the current step
        self.n = -1  # this optimizer's own step count (rows count rounds; it may skip some)
        self.prev_step = -10  # own step (``n``) whose gradient sits in slot 1 - slot
        self.prev_row = -1  # the row of that step
        # 1 / loss scale of this step's / that gradient, or None for 1 (GradScaler with an optimizer
        # that unscales inside its step, e.g. fused Adam: the hooks see scaled gradients)
        self.inv: float | torch.Tensor | None = None
        self.prev_inv: float | torch.Tensor | None = None
        self.special_key: tuple[int, ...] = ()  # the parameter set ``special`` was checked for
        self.special = False  # sparse or complex gradients: grad_norm only (special_g2)
        self.cols_key: tuple[int, ...] = ()  # the parameter set ``cols`` was built for
        self.cols: tuple[int, int] | torch.Tensor = (0, 0)  # their layer columns: a range, or indices
        self.cols_end = 0  # 1 + their largest layer column
        self.pending: list[bool] | None = None  # opt.step(closure): [whether the gradient pass ran]
        self.params: list[torch.Tensor] = []
        self.g2: torch.Tensor | None = None  # this step's ||g||^2 (a block view) for pre-step hooks
        self.measuring = False
        self.order = 0  # how many optimizers stepped before this one in the current row
        self.lr = self.lr_primary = float("nan")  # read when this optimizer steps
        self.layer_w: torch.Tensor | None = None  # per-tensor norms of w_before (per_layer)
        self.last_measured = -1  # row whose update (negated) sits in buffer row _W
        self.params_at_measure: list[torch.Tensor] = []
        self.adam: AdamCache | None = None

    def stepped_params(self) -> list[torch.Tensor]:
        return [p for g in self.opt.param_groups for p in g["params"] if p.grad is not None]

    def prepare(self, params: list[torch.Tensor], key: tuple[int, ...]) -> None:
        """(Re)build the buffers when the set of stepped parameters (``key``: their ids), their
        device, or a parameter's size changed (``p.data`` replaced by a tensor of another shape)."""
        p0, buf = params[0], self.buf
        if key == self.key and buf is not None and (buf.is_cpu if p0.is_cpu else buf.device == p0.device) and \
                [p.numel() for p in params] == self.sizes:
            return
        dev = p0.device
        self.sizes = [p.numel() for p in params]
        N = self.N = sum(self.sizes)
        S = -(-N // ALIGN) * ALIGN
        self.buf = torch.zeros(3, S, dtype=torch.float32, device=dev)
        self.flat = [self.buf[r, :N] for r in range(3)]
        self.rows = [[v.view(p.shape) for v, p in zip(f.split(self.sizes), params, strict=True)] for f in self.flat]
        self.slots = self.buf[_G0:_G1 + 1, :N]
        self.slot_w = [self.buf[_G0::2, :N], self.buf[_G1:, :N]]
        self.sizes_dev = torch.tensor(self.sizes)
        if dev.type != "cpu":
            self.sizes_dev = self.sizes_dev.to(dev, non_blocking=True)
        self.key = key
        self.prev_step = -10
        self.adam = None

    def free_row(self) -> torch.Tensor:
        """The gradient slot not holding this step's gradient: scratch once the pre-hook of a
        measured step compared the previous gradient with it."""
        return self.flat[1 - self.slot]

    def free(self) -> None:
        """Drop every buffer and view of one (what ``Monitor.close`` leaves)."""
        self.buf, self.block, self.adam, self.g2, self.layer_w = None, None, None, None, None
        self.flat, self.rows, self.slot_w, self.params_at_measure, self.key = [], [], [], [], ()
        self.slots = torch.empty(0)


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


def check_special(st: OptState, params: list[torch.Tensor], grads: list[torch.Tensor], ids: tuple[int, ...]) -> None:
    """Sparse or complex gradients (fixed per parameter, so checked when the set changes):
    only grad_norm is recorded for them, with a warning."""
    if ids == st.special_key:
        return
    st.special_key = ids
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
        dst.index_copy_(0, cols, values.to(torch.float32))


def norms_into(norms: list[torch.Tensor], cols: Any, dst: torch.Tensor | None) -> torch.Tensor:
    """Stack per-tensor ``norms``, writing them into layer columns ``cols`` of ``dst`` when given."""
    if dst is not None and isinstance(cols, tuple) and norms[0].dtype is torch.float32:
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
    torch._foreach_copy_(st.rows[st.slot], grads)
    g = st.flat[st.slot]
    torch.dot(g, g, out=dv[D_G2])
    if layer_g is not None:
        norms_into(torch._foreach_norm(st.rows[st.slot]), st.cols, layer_g)
    _unscale(st, dv, layer_g)


def before_update(st: OptState, params: list[torch.Tensor], grads: list[torch.Tensor],
                  dv: list[torch.Tensor], pair: torch.Tensor, linked: bool, per_layer: bool) -> None:
    """A measured step's pre-hook: copy the gradient into its slot and the parameters into the
    third row (one foreach copy), then g.G0 and g.G1 into ``pair`` by one matrix-vector product
    (||g||^2 and, when ``linked``, g.g_prev: the other slot holds the previous own step's
    gradient; otherwise a value no channel reads), and ||w_before||^2."""
    slot = st.slot
    torch._foreach_copy_(st.rows[slot] + st.rows[_W], grads + params)
    torch.mv(st.slots, st.flat[slot], out=pair)
    w = st.flat[_W]
    torch.dot(w, w, out=dv[D_W2])
    if st.inv is not None:
        dv[slot].mul_(st.inv * st.inv)
    if linked and (st.inv is not None or st.prev_inv is not None):
        dv[1 - slot].mul_((1.0 if st.inv is None else st.inv) * (1.0 if st.prev_inv is None else st.prev_inv))
    st.layer_w = torch.stack(torch._foreach_norm(st.rows[_W])) if per_layer else None


def after_update(st: OptState, params: list[torch.Tensor], dv: list[torch.Tensor], pair: torch.Tensor,
                 layers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> None:
    """The post-hook of a measured step: -u = w_before - w_after in place, then (g.(-u), u.u)
    into ``pair`` by one matrix-vector product over the rows (g slot, -u), and per-tensor norms
    of g, u and w_before into the layer columns ``layers`` (g, u, w)."""
    torch._foreach_sub_(st.rows[_W], params)
    torch.mv(st.slot_w[st.slot], st.flat[_W], out=pair)
    if st.inv is not None:
        dv[D_NUG].mul_(st.inv)
    if layers is not None:
        lg, lu, lw = layers
        norms_into(torch._foreach_norm(st.rows[st.slot]), st.cols, lg)
        if st.inv is not None:
            _scale_cols(lg, st.cols, st.inv)
        norms_into(torch._foreach_norm(st.rows[_W]), st.cols, lu)
        put_cols(lw, st.cols, st.layer_w)


def update_views(st: OptState) -> list[torch.Tensor]:
    """-u of the last measured step, per parameter (views of the buffer)."""
    return st.rows[_W]


def _unscale(st: OptState, dv: list[torch.Tensor], layer_g: torch.Tensor | None) -> None:
    if st.inv is not None:
        dv[D_G2].mul_(st.inv * st.inv)
        if layer_g is not None:
            _scale_cols(layer_g, st.cols, st.inv)


def _scale_cols(dst: torch.Tensor, cols: Any, factor: float | torch.Tensor) -> None:
    if isinstance(cols, tuple):
        dst[cols[0]:cols[1]].mul_(factor)
    else:
        dst.index_copy_(0, cols, dst.index_select(0, cols) * factor)
