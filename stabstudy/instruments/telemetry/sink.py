"""Streaming the Monitor's channels to a scalar writer (TensorBoard's ``SummaryWriter``, ...).

The Monitor never reads a device value per step; a :class:`WriterSink` therefore writes a
row only once the row is *complete on the host*: closed (a later row opened, or the
Monitor closed) and, for every optimizer that stepped in it, copied from its device block.
That happens a block of ``sync_every`` rows at a time, so the writer sees the channels in
blocks, with no extra host synchronisation (on CUDA the copies are not waited for: a row
is written once its copy has arrived).
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import numpy as np

from stabstudy.instruments.telemetry.channels import H_KIND, previous_g2


class ScalarWriter(Protocol):
    """What :class:`WriterSink` writes to: ``torch.utils.tensorboard.SummaryWriter`` qualifies."""

    def add_scalar(self, tag: str, scalar_value: float, global_step: int) -> Any: ...


class WriterSink:
    """Writes each complete row's channels as ``<prefix><channel>`` at ``global_step`` = the row.

    NaN values (channels not measured on that row, e.g. between ``every`` measurements) are
    not written; per-layer channels are not written (see ``to_dataset``). A value logged
    to a row after the row was written does not reach the writer.

    Args:
        writer: anything with ``add_scalar(tag, value, global_step)``.
        prefix: tag prefix.
    """

    def __init__(self, writer: ScalarWriter, prefix: str = "stability/"):
        if not callable(getattr(writer, "add_scalar", None)):
            raise TypeError(f"writer must have add_scalar(tag, value, global_step); got {type(writer).__name__}")
        self.writer = writer
        self.prefix = prefix
        self.written = 0  # rows before this one were written
        self.applied: list[int] = []  # per optimizer: its rows before this one are on the host
        self._tags: dict[str, str] = {}

    def applied_to(self, i: int, end: int) -> None:
        """Optimizer ``i``'s device rows before ``end`` reached the host tables."""
        while len(self.applied) <= i:
            self.applied.append(0)
        self.applied[i] = max(self.applied[i], end)

    def flush(self, mon: Any, end: int) -> None:
        """Write the rows from :attr:`written` up to ``end`` (exclusive) that are complete on the
        host of Monitor ``mon``: it stops at the first row some optimizer stepped in whose
        device fields have not arrived yet."""
        a = self.written
        if end <= a:
            return
        H = mon._host.a
        end = min(end, mon._host.n)
        kind = H[a:end, :, H_KIND]
        applied = np.array([self.applied[i] if i < len(self.applied) else 0 for i in range(kind.shape[1])])
        ok = (np.isnan(kind) | (np.arange(a, end)[:, None] < applied[None, :])).all(axis=1)
        if not ok.all():
            end = a + int(np.argmin(ok))
        if end <= a:
            return
        D = mon._dev.rows(end)[0]
        derived = mon._derive(H[a:end], D[a:end], previous_g2(H[a:end], D))
        for name, col in mon._logged.items():
            vals, m = col.rows(end)
            derived[name] = np.where(m[a:end], vals[a:end], derived.get(name, math.nan))
        self._write(derived, a)
        self.written = end

    def _write(self, channels: dict[str, np.ndarray], first: int) -> None:
        add, tags = self.writer.add_scalar, self._tags
        for name, arr in channels.items():
            tag = tags.get(name)
            if tag is None:
                tag = tags[name] = self.prefix + name
            for j, v in enumerate(np.asarray(arr, dtype=np.float64).tolist()):
                if v == v:  # NaN: nothing measured there
                    add(tag, v, first + j)

    def finish(self, mon: Any) -> None:
        """Monitor ``mon`` closes: write every row left (no further update can join the current
        one) and push what the writer buffered to its files (the writer stays open: it is the caller's)."""
        self.flush(mon, mon.step + 1)
        flush = getattr(self.writer, "flush", None)
        if callable(flush):
            flush()
