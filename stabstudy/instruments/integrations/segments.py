"""One run's telemetry across checkpoint resumes: earlier rows kept as state, the live Monitor after them.

A framework that resumes from a checkpoint builds a new optimizer, so a new
:class:`~stabstudy.instruments.telemetry.Monitor` attaches to it and counts its rows from 0
again. :class:`RunSegments` keeps the rows recorded before the checkpoint (restored from the
checkpoint's state) and shifts the new Monitor's rows after them, so that :meth:`RunSegments.dataset`
is the whole run with one ``step`` coordinate, as one uninterrupted Monitor would give it.

The state (:meth:`RunSegments.state_dict`) holds only tensors, strings, numbers, lists and dicts,
so it loads with ``torch.load(..., weights_only=True)`` (Lightning's and torch's default).

What a resume cannot carry: the Monitor's previous gradient, so ``xgrad`` is NaN on the first
update after a resume; and its count of updates, so with ``every=N`` the measured updates are
counted from the resume on.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from stabstudy.instruments.telemetry import Monitor

if TYPE_CHECKING:  # imported when used: building a Monitor need not load xarray
    import xarray as xr

#: Version of the layout of :meth:`RunSegments.state_dict`.
STATE_FORMAT = 1


class RunSegments:
    """The rows of one run: those restored from a checkpoint, then the live Monitor's.

    Args:
        **monitor_kwargs: passed to every :class:`Monitor` this run attaches (``every``,
            ``per_layer``, ``sync_every``, ``writer``).
    """

    def __init__(self, **monitor_kwargs: Any):
        self.monitor_kwargs = monitor_kwargs
        self.monitor: Monitor | None = None
        self.controller: Any = None  #: the controller attached through the live Monitor, if any
        self.offset = 0  # rows before the live Monitor's first (restored from a checkpoint)
        self._prior: xr.Dataset | None = None
        self._last_seen = -1  # the live Monitor's last row handed out by new_row()

    def reset(self) -> None:
        """Forget everything: a new run starts (closes the live Monitor)."""
        self.close()
        self.monitor, self.offset, self._prior, self._last_seen = None, 0, None, -1

    def attach(self, model: Any, optimizers: Any, *, scaler: Any = None, controller: Any = None) -> Monitor:
        """Start recording ``optimizers`` (one, a list or a dict, as :class:`Monitor` takes) after
        the rows already held; a Monitor still attached is closed and its rows kept first.
        ``scaler``: the framework's GradScaler (unless the Monitor's arguments name one);
        ``controller``: attached through the new Monitor to the (first) optimizer, so that its
        decisions are channels of the rows (it is closed with the Monitor)."""
        if self.monitor is not None:
            self._prior, self.offset = self._whole(), self.rows
            self.close()
        kwargs = dict(self.monitor_kwargs)
        if scaler is not None:
            kwargs.setdefault("scaler", scaler)
        self.monitor = Monitor(model, optimizers, **kwargs)
        self._last_seen = -1
        self.controller = controller
        if controller is not None:
            opt = optimizers if isinstance(optimizers, torch.optim.Optimizer) else \
                next(iter(optimizers.values() if isinstance(optimizers, Mapping) else optimizers))
            controller.attach(opt, self.monitor)
        return self.monitor

    @property
    def rows(self) -> int:
        """Rows recorded in this run so far (restored ones included)."""
        return self.offset + (self.monitor.step + 1 if self.monitor is not None else 0)

    def new_row(self) -> bool:
        """True once per row of the live Monitor: whether an update was recorded since the last call."""
        mon = self.monitor
        if mon is None or mon.step <= self._last_seen:
            return False
        self._last_seen = mon.step
        return True

    def latest(self) -> dict[str, float]:
        """The channels of the live Monitor's latest row, NaN ones left out (a host sync on a GPU)."""
        if self.monitor is None or self.monitor.step < 0:
            return {}
        return {k: v for k, v in self.monitor.row().items() if not math.isnan(v)}

    def close(self) -> None:
        """Close the live Monitor and its controller (the rows stay readable)."""
        if self.controller is not None:
            self.controller.close()
        if self.monitor is not None:
            self.monitor.close()

    def dataset(self) -> xr.Dataset:
        """The whole run as the Monitor's Dataset: restored rows, then the live Monitor's, on
        ``step`` = the run's update index."""
        ds = self._whole()
        if ds is None:
            raise RuntimeError("no telemetry yet: the callback attaches when training starts")
        return ds

    def _whole(self) -> xr.Dataset | None:
        live = None
        if self.monitor is not None:
            live = self.monitor.to_dataset()
            live = live.assign_coords(step=live.step + self.offset)
        if self._prior is None or live is None:
            return live if live is not None else self._prior
        return concat_steps(self._prior, live)

    # -- checkpoint state ----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Every row recorded so far, in a form ``torch.load(weights_only=True)`` reads back."""
        ds = self._whole()
        return {"format": STATE_FORMAT, "rows": self.rows, "dataset": None if ds is None else dataset_to_state(ds)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the rows of :meth:`state_dict`; the next :meth:`attach` records after them."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"unknown telemetry state format {state.get('format')!r} (expected {STATE_FORMAT})")
        self.close()
        self.monitor, self._last_seen = None, -1
        self.offset = int(state["rows"])
        self._prior = None if state["dataset"] is None else dataset_from_state(state["dataset"])


def dataset_to_state(ds: xr.Dataset) -> dict[str, Any]:
    """A Monitor Dataset as tensors, strings and numbers (what ``weights_only`` loading accepts)."""
    coords: dict[str, Any] = {"step": torch.tensor(np.asarray(ds.step.values, dtype=np.int64))}
    if "layer" in ds.coords:
        coords["layer"] = [str(x) for x in ds.layer.values]
    data = {name: {"dims": list(da.dims), "attrs": _plain(da.attrs),
                   **({"strings": [str(x) for x in da.values.tolist()]} if da.dtype.kind in "US" else
                      {"values": torch.tensor(np.asarray(da.values, dtype=np.float64))})}
            for name, da in ds.data_vars.items()}  # strings: a Controller's action names
    return {"coords": coords, "data_vars": data, "attrs": _plain(ds.attrs)}


def dataset_from_state(state: Mapping[str, Any]) -> xr.Dataset:
    """Inverse of :func:`dataset_to_state`."""
    import xarray as xr

    coords: dict[str, Any] = {"step": ("step", state["coords"]["step"].numpy(), {"long_name": "optimizer update index"})}
    if "layer" in state["coords"]:
        coords["layer"] = ("layer", np.array(state["coords"]["layer"], dtype=str))
    data = {name: (tuple(v["dims"]), np.array(v["strings"], dtype=str) if "strings" in v else v["values"].numpy(),
                   dict(v["attrs"])) for name, v in state["data_vars"].items()}
    return xr.Dataset(data, coords=coords, attrs=dict(state["attrs"]))


def concat_steps(first: xr.Dataset, then: xr.Dataset) -> xr.Dataset:
    """``first`` then ``then`` along ``step``; a channel one of them lacks (a scalar logged only
    after the resume, a new optimizer's) is NaN there, and layers are joined by name."""
    import xarray as xr

    parts = [first, then]
    for a, b in ((0, 1), (1, 0)):
        missing = {k: v for k, v in parts[b].data_vars.items() if k not in parts[a].data_vars}
        if missing:
            fill = {}
            for k, v in missing.items():
                shape = tuple(parts[a].sizes[d] if d in parts[a].dims else v.sizes[d] for d in v.dims)
                fill[k] = (v.dims, np.full(shape, "") if v.dtype.kind in "US" else np.full(shape, np.nan), v.attrs)
            parts[a] = parts[a].assign(fill)
    # float64 NaN fills keep every channel float64; attrs from the first (same Monitor settings)
    return xr.concat(parts, dim="step", join="outer", fill_value=np.nan, combine_attrs="override")


def _plain(attrs: Mapping[str, Any]) -> dict[str, Any]:
    """Attributes as plain Python values (numpy scalars are not loadable with ``weights_only``)."""
    return {str(k): (v.item() if isinstance(v, np.generic) else v) for k, v in attrs.items()}
