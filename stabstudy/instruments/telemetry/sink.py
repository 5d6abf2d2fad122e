"""Streaming the Monitor's channels to a writer: TensorBoard's ``SummaryWriter``, W&B, MLflow, or
anything with ``add_scalar``.

Writers take one of two shapes. A *row writer* (:class:`RowWriter`: ``log_row(step, values)``, the
shape of :mod:`.loggers`' ``WandbWriter`` and ``MLflowWriter``) gets each complete row's channels
in one call, from a background thread; a *scalar writer* (:class:`ScalarWriter`:
``add_scalar(tag, value, global_step)``) gets one call per value in the training thread.
TensorBoard's ``SummaryWriter`` is a scalar writer that the sink drives as a row writer (below).

The Monitor never reads a device value per step; a :class:`WriterSink` therefore writes a
row only once the row is *complete on the host*: closed (a later row opened, or the
Monitor closed) and, for every optimizer that stepped in it, copied from its device block.
That happens a block of ``sync_every`` rows at a time, so the writer sees the channels in
blocks, with no extra host synchronisation (on CUDA the copies are not waited for: a row
is written once its copy has arrived).

TensorBoard's ``SummaryWriter`` gets one event per row holding every channel of the row, where
its ``add_scalar`` writes one event per value (readers see the same scalars), and gets them from a
background thread: the writer's event queue is short (``max_queue=10``), so a block's events would
otherwise wait in the training loop for its file thread to take them. Both cut the time the
training thread spends in the sink, measured by ``benchmarks/integration_overhead.py`` (tiny
MLP: 12.6% -> 3.3% of the step for one event per row, -> 0.9% with the thread). Other writers
get ``add_scalar`` calls in the training thread.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np


class ScalarWriter(Protocol):
    """A writer :class:`WriterSink` calls once per value: ``torch.utils.tensorboard.SummaryWriter`` qualifies."""

    def add_scalar(self, tag: str, scalar_value: float, global_step: int) -> Any: ...


class RowWriter(Protocol):
    """A writer :class:`WriterSink` calls once per row, from a background thread (:mod:`.loggers`);
    ``flush()``, if it has one, is called when the Monitor closes."""

    def log_row(self, step: int, values: dict[str, float]) -> Any: ...


class WriterSink:
    """Writes each complete row's channels as ``<prefix><channel>`` at ``global_step`` = the row.

    NaN values (channels not measured on that row, e.g. between ``every`` measurements) are
    not written; per-layer channels are not written (see ``to_dataset``). A value logged
    to a row after the row was written does not reach the writer.

    Args:
        writer: a :class:`RowWriter` (``log_row(step, values)``) or a :class:`ScalarWriter`
            (``add_scalar(tag, value, global_step)``).
        prefix: tag prefix.
    """

    def __init__(self, writer: ScalarWriter | RowWriter, prefix: str = "stability/"):
        if not callable(getattr(writer, "log_row", None)) and not callable(getattr(writer, "add_scalar", None)):
            raise TypeError("writer must have log_row(step, values) (stabstudy.instruments.telemetry.loggers: "
                            "WandbWriter, MLflowWriter) or add_scalar(tag, value, global_step) (TensorBoard's "
                            f"SummaryWriter); got {type(writer).__name__}")
        self.writer = writer
        self.prefix = prefix
        self.written = 0  # rows before this one were written
        self._tags: dict[str, str] = {}
        self._row_events = _rows_of(writer) if callable(getattr(writer, "log_row", None)) else \
            _row_event_writer(writer)
        self._background = _Background() if self._row_events is not None else None

    def flush(self, mon: Any, end: int) -> None:
        """Write the rows from :attr:`written` up to ``end`` (exclusive) that are complete on the
        host of Monitor ``mon`` (:meth:`~stabstudy.instruments.telemetry.Monitor.rows_on_host`)."""
        if end <= self.written:
            return
        stop, channels = mon.rows_on_host(self.written, end)
        if stop > self.written:
            self._write(channels, self.written)
            self.written = stop

    def _write(self, channels: dict[str, np.ndarray], first: int) -> None:
        tags = self._tags
        if self._row_events is not None and self._background is not None:
            names = list(channels)
            for name in names:
                if name not in tags:
                    tags[name] = self.prefix + name
            block = np.array([np.asarray(channels[n], dtype=np.float64) for n in names])  # a copy: ours
            self._background.submit(self._row_events, [tags[n] for n in names], block, first)
            return
        add = self.writer.add_scalar
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
        if self._background is not None:
            self._background.wait()  # every row handed to the writer before it flushes
        flush = getattr(self.writer, "flush", None)
        if callable(flush):
            flush()


class _Background:
    """Runs the submitted calls in order on one daemon thread, started at the first call (and again
    in a forked child, whose copy of the thread does not run); an error there is raised at the next
    :meth:`submit` or :meth:`wait`."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        self._raise()
        if self._thread is None or not self._thread.is_alive():
            self._queue = queue.SimpleQueue()  # a forked child's copy holds the parent's pending calls
            self._thread = threading.Thread(target=self._run, args=(self._queue,), name="stabstudy-writer-sink",
                                            daemon=True)
            self._thread.start()
        self._queue.put((fn, args))

    def wait(self) -> None:
        """Return once every submitted call ran (the thread ends; a later :meth:`submit` starts another)."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self._thread = None
        self._raise()

    def _run(self, q: queue.SimpleQueue) -> None:
        while (item := q.get()) is not None:
            if self._error is None:  # after an error the rest is dropped: the writer is broken
                fn, args = item
                try:
                    fn(*args)
                except BaseException as e:  # handed to the training thread
                    self._error = e

    def _raise(self) -> None:
        if self._error is not None:
            e, self._error = self._error, None
            raise RuntimeError("the writer failed while writing telemetry rows") from e


def _rows_of(writer: RowWriter) -> Callable[[list[str], np.ndarray, int], None]:
    """A function handing each row of a block to ``writer.log_row``, its non-NaN values only."""
    log_row = writer.log_row

    def write(tags: list[str], block: np.ndarray, first: int) -> None:
        for j, row in enumerate(block.T.tolist()):
            values = {t: v for t, v in zip(tags, row, strict=True) if v == v}
            if values:  # NaN: nothing measured there
                log_row(first + j, values)

    return write


def _row_event_writer(writer: Any) -> Callable[[list[str], np.ndarray, int], None] | None:
    """For TensorBoard's ``SummaryWriter``: a function writing each row as one event of all its
    non-NaN values (``simple_value``, as ``add_scalar`` writes them) through the writer's event file
    writer; None for other writers, for a subclass that changes ``add_scalar`` (its own way is kept)
    and without tensorboard."""
    cls = type(writer)
    base = next((c for c in cls.__mro__ if c.__name__ == "SummaryWriter"
                 and c.__module__.startswith("torch.utils.tensorboard")), None)
    if base is None or cls.add_scalar is not base.add_scalar or cls._get_file_writer is not base._get_file_writer:
        return None
    get = writer._get_file_writer
    try:
        from tensorboard.compat.proto.summary_pb2 import Summary
    except ImportError:  # torch's SummaryWriter without tensorboard cannot be built anyway
        return None
    Value = Summary.Value

    def write(tags: list[str], block: np.ndarray, first: int) -> None:
        file_writer, now = get(), time.time()
        for j, row in enumerate(block.T.tolist()):
            values = [Value(tag=t, simple_value=v) for t, v in zip(tags, row, strict=True) if v == v]
            if values:  # NaN: nothing measured there
                file_writer.add_summary(Summary(value=values), first + j, now)

    return write
