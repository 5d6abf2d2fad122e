"""Where the Monitor keeps its rows: numpy tables on the host, blocks of rows on the device.

The optimizer hooks never read a device tensor back: each optimizer's statistics go by
``out=`` into a :class:`Block` of rows on its parameters' device, and logged device
tensors into a :class:`LogStage` buffer there. A full block (``sync_every`` rows), or
any read of the data (``to_dataset``, ``row``, ``grad_norm``, ``close``), starts one
copy of the rows to the host (:class:`HostCopies`: on CUDA without waiting for it,
through pinned memory and an event), which is applied to the :class:`Table` columns
when it is needed. On the CPU the "copy" is a numpy assignment.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from stabstudy.instruments.telemetry.channels import LAYER_PARTS, ND, DevField

_NAN = float("nan")


class Table:
    """Float64 array indexed by row that grows by doubling; NaN where nothing was written.
    Columnar storage keeps a long run's telemetry small and lets ``to_dataset`` derive
    channels with numpy. ``masked`` tables also keep a mask of the cells written (logged
    scalars, where a logged NaN differs from nothing logged)."""

    def __init__(self, tail: tuple[int, ...] = (), masked: bool = False):
        self.tail = tail
        self.a = np.full((0, *tail), np.nan)
        self.m = np.zeros((0, *tail), dtype=bool) if masked else None
        self.n = 0  # rows in use: 1 + the largest row written
        self.mv: memoryview | None = None  # flat view of ``a`` (see flat)

    def put(self, row: int, value: float) -> None:
        """Write one value (masked tables without a tail)."""
        self.grow(row)
        self.a[row] = value
        self.m[row] = True

    def flat(self, row: int) -> memoryview:
        """The whole table as a flat float64 memoryview, allocated up to ``row``: element
        ``(row, *idx)`` is at ``row * prod(tail) + ...``. Writing single cells through it
        costs far less than numpy indexing in the cold-cache optimizer hooks."""
        if row >= len(self.a) or self.mv is None:
            self.grow(row)
            self.mv = memoryview(self.a).cast("B").cast("d")
        elif row >= self.n:
            self.n = row + 1
        return self.mv

    def grow(self, row: int) -> None:
        """Allocate up to ``row`` and count it as used."""
        if row >= len(self.a):
            self.mv = None
            self.a = self._padded(self.a, max(64, 2 * len(self.a), row + 1), np.nan)
            if self.m is not None:
                self.m = self._padded(self.m, len(self.a), False)
        if row >= self.n:
            self.n = row + 1

    def widen(self, width: int) -> None:
        """Grow a 1-D tail to ``width`` columns (NaN in the new ones)."""
        if width <= self.tail[0]:
            return
        out = np.full((len(self.a), width), np.nan)
        out[:, : self.tail[0]] = self.a
        self.a, self.tail, self.mv = out, (width,), None

    def _padded(self, x: np.ndarray, n: int, fill: Any) -> np.ndarray:
        out = np.full((n, *self.tail), fill, dtype=x.dtype)
        out[: len(x)] = x
        return out

    def rows(self, n: int) -> tuple[np.ndarray, np.ndarray | None]:
        """The first ``n`` rows (padded with NaN / False beyond what was written), and the mask."""
        if n <= len(self.a):
            return self.a[:n], None if self.m is None else self.m[:n]
        return self._padded(self.a, n, np.nan), None if self.m is None else self._padded(self.m, n, False)


class HostCopies:
    """Device -> host copies in flight, applied in the order they were started.

    ``start`` does not wait on CUDA: the rows go to pinned memory by ``non_blocking``
    copy and an event marks their arrival; ``drain`` applies the copies that have arrived
    (all of them with ``wait``, blocking on their events, which the CUDA sync debug mode
    does not count as a stream synchronisation). Elsewhere the copy is applied at once.
    """

    def __init__(self) -> None:
        self.pending: deque[tuple[torch.Tensor, Any, Callable[[np.ndarray], None]]] = deque()

    def start(self, t: torch.Tensor, apply: Callable[[np.ndarray], None]) -> None:
        """Copy ``t`` to the host and call ``apply`` on it (a numpy array, valid during the call)."""
        if t.device.type == "cuda":
            host = t.to("cpu", non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(t.device))
            self.pending.append((host, ev, apply))
        else:
            self.drain(wait=True)  # keep the order of earlier copies
            apply(t.detach().cpu().numpy())

    def drain(self, wait: bool) -> None:
        """Apply the copies that arrived (with ``wait``: all of them, in order)."""
        while self.pending:
            host, ev, apply = self.pending[0]
            if not wait and not ev.query():
                return
            ev.synchronize()
            self.pending.popleft()
            apply(host.numpy())


class Block:
    """``rows`` rows of one optimizer's device fields (``ND``) and, for ``layers`` > 0, its
    per-layer gradient, update and weight norms (``LAYER_PARTS``, ``layers`` columns each),
    on one device in ``dtype`` (that of the optimizer's flat buffer), NaN where not written; rows
    ``base`` .. ``base + rows - 1``."""

    def __init__(self, device: torch.device, rows: int, layers: int, dtype: torch.dtype = torch.float32):
        self.t = torch.full((rows, ND + len(LAYER_PARTS) * layers), _NAN, dtype=dtype, device=device)
        self.rows, self.layers = rows, layers
        self.base = 0
        self.used = 0  # rows written since the last reset: 1 + the latest one - base
        self.dirty = False  # written since its last copy to the host
        self._views: list[list[torch.Tensor] | None] = [None] * rows
        self._pairs: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * rows

    def fields(self, row: int) -> list[torch.Tensor]:
        """0-d views of row ``row``'s ND device fields (out= targets); marks the row written."""
        r = row - self.base
        if r >= self.used:
            self.used = r + 1
        self.dirty = True
        v = self._views[r]
        if v is None:
            v = self._views[r] = list(self.t[r, :ND].unbind())
        return v

    def pairs(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ``row``'s first two fields and (NUG, U2), as out= targets of matrix-vector products."""
        r = row - self.base
        p = self._pairs[r]
        if p is None:
            p = self._pairs[r] = (self.t[r, DevField.G2:DevField.GPG + 1], self.t[r, DevField.NUG:DevField.U2 + 1])
        return p

    def value(self, row: int, field: int) -> float:
        """Field ``field`` of row ``row`` as a float (a host sync on a GPU), through the row's cached
        0-d views where the hooks built them."""
        v = self._views[row - self.base]
        return float((v[field] if v is not None else self.t[row - self.base, field]).item())

    def pre_fields(self, row: int) -> torch.Tensor:
        """Row ``row``'s fields a pre-hook writes (G2, GPG, W2), as one tensor."""
        return self.t[row - self.base, :DevField.NUG]

    def post_fields(self, row: int) -> torch.Tensor:
        """Row ``row``'s fields a post-hook writes (NUG .. NBELOW), as one tensor."""
        return self.t[row - self.base, DevField.NUG:ND]

    def layer(self, row: int, part: int) -> torch.Tensor:
        """Row ``row``'s layer columns of ``LAYER_PARTS[part]`` (written with the fields of that row)."""
        a = ND + part * self.layers
        return self.t[row - self.base, a:a + self.layers]

    def covers(self, row: int, layers: int) -> bool:
        return self.base <= row < self.base + self.rows and layers <= self.layers

    def reset(self, base: int) -> None:
        """Reuse the block from row ``base`` on (after its rows were sent to the host: the
        fill runs after that copy on the device's stream)."""
        self.t.fill_(_NAN)
        self.base, self.used, self.dirty = base, 0, False


class LogStage:
    """Logged device tensors (``Monitor.log(loss=loss)`` with ``loss`` on a GPU): each is copied
    by one device op into a float64 buffer on its device, with no host read; a full buffer, or
    a read of the data, sends the buffer's values to the host in one copy."""

    def __init__(self, copies: HostCopies, put: Callable[[int, str, float], None], capacity: int):
        self.copies, self.put, self.capacity = copies, put, capacity
        self.bufs: dict[torch.device, tuple[torch.Tensor, list[torch.Tensor], list[tuple[int, str]]]] = {}

    def add(self, row: int, name: str, value: torch.Tensor) -> None:
        """Stage ``value`` (one element) for cell (``row``, ``name``); copied now, so that later
        in-place changes to ``value`` do not show."""
        entry = self.bufs.get(value.device)
        if entry is None:
            t = torch.empty(self.capacity, dtype=torch.float64, device=value.device)
            entry = self.bufs[value.device] = (t, list(t.unbind()), [])
        _, views, meta = entry
        views[len(meta)].copy_(value.detach().reshape(()))
        meta.append((row, name))
        if len(meta) == self.capacity:
            self.send(value.device)

    def send(self, device: torch.device) -> None:
        """Start the copy of ``device``'s staged values (the buffer is reused at once: later
        writes to it run after the copy on the device's stream)."""
        t, _, meta = self.bufs[device]
        if not meta:
            return
        cells = list(meta)
        meta.clear()

        def apply(vals: np.ndarray) -> None:
            for (row, name), x in zip(cells, vals.tolist(), strict=True):
                self.put(row, name, x)

        self.copies.start(t[:len(cells)], apply)

    def send_all(self) -> None:
        for device in list(self.bufs):
            self.send(device)
