"""What the Monitor keeps per attached optimizer between its hooks.

:class:`OptState` holds one optimizer's bookkeeping, grouped by what changes together: the
flat buffer of its stepped parameters (:class:`FlatBuffer`, rebuilt when that set changes),
the link to the previous compared gradient (:class:`Previous`, for ``xgrad``), the step in
progress between the pre- and the post-hook (:class:`Current`), and the layer columns of
``per_layer`` (:class:`LayerColumns`). The statistics (:mod:`.stats`, :mod:`.adam`) read and
write these; this module imports neither.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import torch

from stabstudy.instruments.telemetry.table import Block

#: Buffer rows are padded to a multiple of 64 bytes: BLAS's dot product ran 7x slower on two rows
#: whose addresses differed by 40 bytes.
ALIGN_BYTES = 64


class Row(IntEnum):
    """Rows of a :class:`FlatBuffer`."""

    G0 = 0  #: gradient slot 0
    G1 = 1  #: gradient slot 1 (the slots alternate: one holds this step's gradient, the other the previous one)
    W = 2  #: the parameters before the step, turned into -u = w_before - w_after after it


def stat_dtype(params: list[torch.Tensor]) -> torch.dtype:
    """The dtype the Monitor copies and sums ``params`` in: float64 where one of them is float64,
    else float32 (float16 and bfloat16 parameters too: their squared norms would overflow or
    round away in their own dtype)."""
    return torch.float64 if any(p.dtype is torch.float64 for p in params) else torch.float32


def as_float(x: Any) -> float:
    """A Python number or a one-element tensor as a float (a device tensor: a host sync)."""
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


@dataclass(slots=True, eq=False)
class FlatBuffer:
    """The stepped parameters' gradient slots and parameters as rows of one (3, S) tensor on their
    device, in :func:`stat_dtype`, with the views the statistics use (built once per parameter set)."""

    buf: torch.Tensor  #: (3, S), rows :class:`Row`
    flat: list[torch.Tensor]  #: each row's first N elements
    rows: list[list[torch.Tensor]]  #: each row as views shaped like the parameters
    slots: torch.Tensor  #: rows G0, G1 as one (2, N) matrix
    slot_w: list[torch.Tensor]  #: per slot: that slot's row and row W as one (2, N) matrix
    sizes: list[int]  #: element count per tensor
    dtypes: list[torch.dtype]  #: dtype per tensor (the buffer's dtype follows them)
    sizes_dev: torch.Tensor  #: the same, on the device
    key: tuple[int, ...]  #: ids of the parameters it was built for
    N: int  #: elements of the stepped parameters (of their local shards where sharded)
    n_total: int = -1  #: elements over every shard (set by the Monitor; -1 until then)
    #: 1-D views of the parameters' data (None: one is not contiguous), valid while their data
    #: pointers are ``ptrs`` (``p.data`` may be replaced by a tensor of the same size)
    pviews: list[torch.Tensor] | None = None
    ptrs: list[int] = field(default_factory=list)

    @classmethod
    def build(cls, params: list[torch.Tensor], key: tuple[int, ...]) -> FlatBuffer:
        dev, dtype = params[0].device, stat_dtype(params)
        sizes = [p.numel() for p in params]
        N = sum(sizes)
        align = ALIGN_BYTES // dtype.itemsize
        S = -(-N // align) * align
        buf = torch.zeros(3, S, dtype=dtype, device=dev)
        flat = [buf[r, :N] for r in Row]
        rows = [[v.view(p.shape) for v, p in zip(f.split(sizes), params, strict=True)] for f in flat]
        sizes_dev = torch.tensor(sizes)
        if dev.type != "cpu":
            sizes_dev = sizes_dev.to(dev, non_blocking=True)
        return cls(buf=buf, flat=flat, rows=rows, slots=buf[Row.G0:Row.G1 + 1, :N],
                   slot_w=[buf[Row.G0::2, :N], buf[Row.G1:, :N]], sizes=sizes, dtypes=[p.dtype for p in params],
                   sizes_dev=sizes_dev, key=key, N=N)

    def param_views(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The parameters as 1-D tensors for one ``torch.cat(..., out=)`` (a foreach copy
        dispatches once per tensor: ``docs/benchmarks.md``); reshaped copies where one is not
        contiguous."""
        ptrs = [p.data_ptr() for p in params]
        if ptrs != self.ptrs:
            self.ptrs = ptrs
            self.pviews = [p.detach().view(-1) for p in params] if all(p.is_contiguous() for p in params) else None
        return self.pviews if self.pviews is not None else [p.detach().reshape(-1) for p in params]

    def fits(self, params: list[torch.Tensor], key: tuple[int, ...]) -> bool:
        """Whether it still serves ``params`` (same set, same device, same sizes and dtypes:
        ``p.data`` may be replaced by a tensor of another shape or dtype)."""
        p0, buf = params[0], self.buf
        return key == self.key and (buf.is_cpu if p0.is_cpu else buf.device == p0.device) and \
            [p.numel() for p in params] == self.sizes and [p.dtype for p in params] == self.dtypes


@dataclass(slots=True, eq=False)
class Previous:
    """The gradient slot of the current step and what the other slot holds (``xgrad``)."""

    slot: int = 0  #: gradient slot of the current step
    step: int = -10  #: own step (``OptState.n``) whose gradient sits in slot 1 - slot
    row: int = -1  #: the row of that step
    inv: float | torch.Tensor | None = None  #: 1 / loss scale of that gradient, or None for 1

    def keep(self, step: int, row: int, inv: float | torch.Tensor | None) -> None:
        """The current slot's gradient (own step ``step``, row ``row``) becomes the previous one."""
        self.step, self.row, self.inv = step, row, inv
        self.slot = 1 - self.slot


@dataclass(slots=True, eq=False)
class Current:
    """The step in progress, from the pre-hook to the post-hook."""

    params: list[torch.Tensor] = field(default_factory=list)  #: the stepped parameters (local shards where sharded)
    stepped: list[torch.Tensor] = field(default_factory=list)  #: the stepped parameters as the optimizer holds them
    g2: torch.Tensor | None = None  #: this step's ||g||^2 (a block view) for pre-step hooks
    #: ||g||^2 as backward() left it (a block view), where something changed the gradient before the
    #: step; None where nothing did (g2 is that norm then)
    raw: torch.Tensor | None = None
    lr_late: bool = False  #: the learning rates are read in the post-hook (a later pre-hook may change them)
    measuring: bool = False  #: a measured step: the post-hook completes the row
    #: 1 / loss scale of this step's gradient, or None for 1 (GradScaler with an optimizer that
    #: unscales inside its step, e.g. fused Adam: the hooks see scaled gradients)
    inv: float | torch.Tensor | None = None
    pending: list[bool] | None = None  #: opt.step(closure): [whether the gradient pass ran]


@dataclass(slots=True, eq=False)
class LayerColumns:
    """Where the stepped tensors' per-layer values go (``per_layer``)."""

    key: tuple[int, ...] = ()  #: the parameter set ``cols`` was built for
    cols: tuple[int, int] | torch.Tensor = (0, 0)  #: their layer columns: a range, or indices
    end: int = 0  #: 1 + their largest layer column
    w_before: torch.Tensor | None = None  #: per-tensor norms of w_before of the current step


class OptState:
    """One attached optimizer: its flat buffer, device block and step bookkeeping."""

    def __init__(self, index: int, name: str, optimizer: torch.optim.Optimizer):
        self.index = index
        self.name = name
        self.opt = optimizer
        self.n = -1  #: this optimizer's own step count (rows count rounds; it may skip some)
        self.flat: FlatBuffer | None = None
        self.block: Block | None = None  #: device fields of the recent rows
        self.prev = Previous()
        self.cur = Current()
        self.layers = LayerColumns()
        self.special_key: tuple[int, ...] = ()  #: the parameter set ``special`` was checked for
        self.special = False  #: sparse or complex gradients: grad_norm only
        self.group: Any = None  #: process group of sharded parameters (:func:`.sharded.shard_group`), else None
        self.last_measured = -1  #: row whose update (negated) sits in buffer row W
        self.params_at_measure: list[torch.Tensor] = []  #: the parameters of that row
        self.adam: Any = None  #: :class:`.adam.AdamCache` of the stepped parameters (built there)
        self.sk: Any = None  #: :class:`.sketch.SketchState` (``memory="sketch"``), built by the Monitor
        self.bw: Any = None  #: :class:`.backward.BackwardRead` of the latest backward pass since the last step
        self.raw_g2: torch.Tensor | None = None  #: 0-d: where the backward reads put ||g||^2 (reused)
        self.pre_id = -1  #: the id of the Monitor's step pre-hook on this optimizer

    def stepped_params(self) -> list[torch.Tensor]:
        return [p for g in self.opt.param_groups for p in g["params"] if p.grad is not None]

    def prepare(self, params: list[torch.Tensor], key: tuple[int, ...]) -> FlatBuffer:
        """The flat buffer of ``params`` (``key``: their ids), rebuilt when the set, their device,
        or a parameter's size changed; a new one links to no previous gradient."""
        fb = self.flat
        if fb is not None and fb.fits(params, key):
            return fb
        fb = self.flat = FlatBuffer.build(params, key)
        self.prev.step = -10
        self.adam = None
        return fb

    def free_row(self) -> torch.Tensor:
        """The gradient slot not holding this step's gradient: scratch once the pre-hook of a
        measured step compared the previous gradient with it."""
        return self.flat.flat[1 - self.prev.slot]

    def free(self) -> None:
        """Drop every buffer and view of one (what ``Monitor.close`` leaves)."""
        self.flat, self.block, self.adam, self.cur.g2, self.layers.w_before = None, None, None, None, None
        self.cur.raw, self.bw, self.raw_g2 = None, None, None
        self.sk = None
        self.params_at_measure = []
