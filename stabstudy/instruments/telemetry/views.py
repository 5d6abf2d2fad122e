"""Reading what a :class:`~stabstudy.instruments.telemetry.Monitor` recorded: its rows as channels
(:meth:`MonitorViews.row`, :meth:`~MonitorViews.rows_on_host`, :meth:`~MonitorViews.grad_norm`), the
Dataset (:meth:`~MonitorViews.to_dataset`, also in the learners' stored schema), the long pandas form
and the quick look. The Monitor's hooks write the host tables and device blocks these read
(:mod:`.monitor`); this module only reads them, and derives the channels with numpy
(:func:`~.channels.derive`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from stabstudy import registry
from stabstudy.instruments.telemetry.channels import (
    LAYER_PARTS,
    NAN,
    OPT_CHANNELS,
    DevField,
    HostField,
    Kind,
    derive,
    previous_g2,
)

if TYPE_CHECKING:
    from stabstudy.instruments.telemetry.layers import LayerIndex
    from stabstudy.instruments.telemetry.state import OptState
    from stabstudy.instruments.telemetry.table import HostCopies, Table


class MonitorViews:
    """The reading half of :class:`~stabstudy.instruments.telemetry.Monitor` (its base class)."""

    _opts: list[OptState]
    _multi: bool
    _step: int
    _host: Table
    _dev: Table
    _logged: dict[str, Table]
    _names: dict[str, dict[int, str]]
    _arrived: list[int]
    _copies: HostCopies
    _li: LayerIndex | None
    every: int
    rank: int
    world_size: int

    def _sync(self) -> None:  # pragma: no cover - the Monitor's
        raise NotImplementedError

    def name_codes(self, channel: str, names: Mapping[int, str]) -> None:
        """Say what the integer codes logged as ``channel`` name (a Controller's actions): ``to_dataset``
        gives that channel as strings ("" where nothing was logged), and the writers and :meth:`row`
        one 0/1 series ``<channel>/<name>`` per name but that of code 0 (0: what nothing happening is called)."""
        self._names[channel] = {int(k): str(v) for k, v in names.items()}

    def _named(self, out: dict[str, Any]) -> dict[str, Any]:
        """``out`` (channel -> values of some rows) with each named channel as its 0/1 series per name."""
        for ch, names in self._names.items():
            if ch not in out:
                continue
            codes = np.asarray(out.pop(ch), dtype=np.float64)
            for code, name in names.items():
                if code:
                    series = np.where(np.isnan(codes), np.nan, (codes == code).astype(np.float64))
                    out[f"{ch}/{name}"] = series if series.ndim else float(series)
        return out

    def row(self, step: int | None = None) -> dict[str, float]:
        """All channels of row ``step`` (default: the current one) as a dict, e.g.
        ``mon.row().get("grad_norm")`` right after ``optimizer.step()`` (a host sync on a GPU)."""
        s = self._step if step is None else int(step)
        if s < 0:
            return {}
        self._sync()
        out: dict[str, float] = {}
        if s < self._host.n:
            H = self._host.a[s:s + 1]
            if not np.isnan(H[0, :, HostField.KIND]).all():  # some optimizer stepped in this row
                D = self._dev.rows(self._host.n)[0]
                out = {k: float(v[0]) for k, v in self._derive(H, D[s:s + 1], previous_g2(H, D)).items()}
        for k, col in self._logged.items():
            if s < col.n and col.m[s]:
                out[k] = float(col.a[s])
        return self._named(out)

    def grad_norm(self, step: int | None = None, *, applied: bool = False) -> float:
        """``grad_norm`` of row ``step`` (default: the current one; ``applied``: ``grad_norm_applied``),
        cheaply: read from the device block where the row still is (no other channel is derived,
        nothing else is copied; a host sync on a GPU); NaN where no optimizer recorded a gradient."""
        s = self._step if step is None else int(step)
        if not 0 <= s < self._host.n:
            return NAN
        g2, seen = 0.0, False
        H = self._host.a[s]  # learners check it after every update: no fancy indexing, no tensor indexing
        for st, kind, slot, raw in zip(self._opts, H[:, HostField.KIND].tolist(), H[:, HostField.SLOT].tolist(),
                                       H[:, HostField.RAW].tolist(), strict=True):
            if not kind >= Kind.GRAD:  # also NaN: the optimizer did not step in this row
                continue
            seen, blk = True, st.block
            field = DevField.RAW if raw == 1.0 and not applied else DevField.GPG if slot == 1.0 else DevField.G2
            if blk is not None and blk.base <= s < blk.base + blk.used:
                g2 += blk.value(s, field)
            else:
                self._copies.drain(wait=True)
                g2 += float(self._dev.rows(s + 1)[0][s, st.index, DevField.RAW if field == DevField.RAW
                                                     else DevField.G2])
        return math.sqrt(g2) if seen else NAN

    def channels(self) -> list[str]:
        """Names of the ``step`` variables ``to_dataset`` returns, in order."""
        names = list(OPT_CHANNELS)
        if self._multi:
            names += [f"{ch}_{st.name}" for st in self._opts for ch in OPT_CHANNELS]
        return names + [k for k in self._logged if k not in names]

    def rows_on_host(self, start: int, end: int) -> tuple[int, dict[str, np.ndarray]]:
        """The channels (computed and logged) of rows ``start`` up to ``end`` (exclusive) that are
        complete on the host, without copying anything or waiting: it stops before the first row
        in which some optimizer stepped whose device fields have not arrived yet (they arrive a
        block of ``sync_every`` rows at a time). Returns (the row it stopped at, channel -> array
        over rows ``start`` .. that row); what a streaming writer
        (:class:`~stabstudy.instruments.telemetry.sink.WriterSink`) reads."""
        end = min(end, self._host.n)
        if end <= start:
            return start, {}
        kind = self._host.a[start:end, :, HostField.KIND]
        ok = (np.isnan(kind) | (np.arange(start, end)[:, None] < np.array(self._arrived)[None, :])).all(axis=1)
        if not ok.all():
            end = start + int(np.argmin(ok))
        if end <= start:
            return start, {}
        H, D = self._host.a[start:end], self._dev.rows(end)[0]
        out = self._derive(H, D[start:end], previous_g2(H, D))
        for name, col in self._logged.items():
            vals, m = col.rows(end)
            out[name] = np.where(m[start:end], vals[start:end], out.get(name, NAN))
        return end, self._named(out)

    def to_dataset(self, *, stored: bool = False):
        """All rows as an ``xarray.Dataset`` with dimension ``step`` (float64 channels; those of
        :meth:`name_codes`, such as a Controller's ``controller_action``, as strings).

        Optimizer channels are present (NaN) even before any update, so the schema
        does not depend on what happened. A logged scalar named like a channel
        replaces the computed value where it was logged.

        ``stored``: the schema of the learners' stored runs, whose channels keep their meaning
        across versions: ``grad_norm`` (and ``grad_norm_<optimizer>``) is the norm the optimizer
        received, as it always was there (``grad_norm_applied``'s values), the norm before clipping
        is ``grad_norm_raw``, and the channels a Controller logs are left out (a learner stores
        its records itself).
        """
        import xarray as xr

        self._sync()
        n = max([self._host.n, *(c.n for c in self._logged.values())], default=0)
        H, D = self._host.rows(n)[0], self._dev.rows(n)[0]
        logged = {k: c.rows(n) for k, c in self._logged.items()}
        present = ~np.isnan(H[..., HostField.KIND]).all(axis=1)  # some optimizer stepped
        for _, m in logged.values():
            present |= m
        steps = np.flatnonzero(present).astype(np.int64)
        derived = self._derive(H[steps], D[steps], previous_g2(H[steps], D))
        data_vars = {}
        for ch in self.channels():
            arr = derived.get(ch, np.full(len(steps), np.nan))
            if ch in logged:
                a, m = logged[ch]
                arr = np.where(m[steps], a[steps], arr)
            arr = np.asarray(arr, dtype=np.float64)
            if ch in self._names:
                names = self._names[ch]
                arr = np.array([names.get(int(c), str(int(c))) if c == c else "" for c in arr.tolist()], dtype=str)
            data_vars[ch] = ("step", arr, self._attrs(ch))
        coords: dict[str, Any] = {"step": ("step", steps, {"long_name": "optimizer update index"})}
        if self._li is not None and self._li.names:
            g, u, w = (self._li.tables[p].rows(n)[0][steps] for p in LAYER_PARTS)
            with np.errstate(invalid="ignore", divide="ignore"):
                ratio = np.where(w > 0, u / w, np.nan)
            for ch, arr in (("layer_grad_norm", g), ("layer_update_ratio", ratio)):
                data_vars[ch] = (("step", "layer"), arr, self._attrs(ch))
            coords["layer"] = ("layer", np.array(self._li.names, dtype=str))
        if stored:
            data_vars = self._stored(data_vars)
        attrs: dict[str, Any] = {"monitor_every": self.every}
        if self.world_size > 1:
            attrs.update(monitor_rank=self.rank, monitor_world_size=self.world_size)
        return xr.Dataset(data_vars, coords=coords, attrs=attrs)

    def _stored(self, data_vars: dict[str, tuple]) -> dict[str, tuple]:
        """``data_vars`` of :meth:`to_dataset` in the learners' stored schema (its ``stored``)."""
        control = set(registry.channel_names(source="control"))
        out = {}
        for name, var in data_vars.items():
            if name in control or name.startswith("grad_norm_applied"):
                continue
            if name == "grad_norm":
                out["grad_norm_raw"] = (var[0], var[1], self._attrs("grad_norm_raw"))
            if name == "grad_norm" or (name.startswith("grad_norm_") and f"grad_norm_applied{name[9:]}" in data_vars):
                applied = data_vars[f"grad_norm_applied{name[9:]}"]
                var = (var[0], applied[1], var[2])
            out[name] = var
        return out

    def summary(self):
        """A quick look at every row so far: per channel its median, largest and last value and
        the steps where it was not finite, and the steps where a Controller attached through this
        Monitor alarmed or acted (:func:`.summary.summarize`; ``print`` it). Reads everything (a
        host sync on a GPU)."""
        from stabstudy.instruments.telemetry.summary import summarize  # pandas: only when asked

        return summarize(self.to_dataset())

    def to_frame(self, *, dropna: bool = False):
        """:meth:`to_dataset` as a long pandas DataFrame (step, channel, layer, value): see :func:`.frame.to_frame`."""
        from stabstudy.instruments.telemetry.frame import to_frame

        return to_frame(self.to_dataset(), dropna=dropna)

    def _derive(self, H: np.ndarray, D: np.ndarray, gp2: np.ndarray) -> dict[str, np.ndarray]:
        """Channels of rows (H, D, gp2: rows x optimizers x ...): global ones, with the
        primary's lr read by the first optimizer that stepped in the row, and per optimizer."""
        out = derive(H, D, gp2, lr_field=HostField.LRP)
        if self._multi:
            for i, st in enumerate(self._opts):
                for k, v in derive(H[:, i:i + 1], D[:, i:i + 1], gp2[:, i:i + 1]).items():
                    out[f"{k}_{st.name}"] = v
        return out

    def _attrs(self, ch: str) -> dict[str, str]:
        """``long_name`` and (for a registered channel) ``units`` of channel ``ch``, from the registry."""
        names = tuple(st.name for st in self._opts)
        found = registry.channel(ch, names)
        return {"long_name": registry.long_name(ch, names), **({"units": found[0].unit} if found else {})}
