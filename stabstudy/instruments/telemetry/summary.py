"""A quick look at a telemetry Dataset: per channel its median, largest and last value, the steps
where a value was not finite, and the steps where a controller alarmed or acted.

NaN is ambiguous in telemetry: a channel measured every N steps (``every=N``, evaluations) is NaN
in between, and one not measurable yet (``xgrad`` on the first step) before its first value. So NaN
counts as non-finite only after a channel's first value and only in a channel recorded on (nearly)
every row: at most one row in ten NaN between its first and last finite values (a run that diverged
is NaN from there to the end, which counts); an infinite value always counts.

:func:`summarize` reads any Dataset with a ``step`` dimension (a Monitor's ``to_dataset()``, a
stored run); :meth:`Monitor.summary <stabstudy.instruments.telemetry.Monitor.summary>` calls it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # imported when called: importing the Monitor need not load pandas or xarray
    import pandas as pd
    import xarray as xr

#: Columns of :attr:`Summary.channels`.
COLUMNS = ("median", "max", "last", "non_finite", "first_non_finite")


def _steps(values: np.ndarray, limit: int = 8) -> str:
    """``values`` (steps) as short text: the first ``limit``, then how many more."""
    vals = [str(int(v)) for v in values[:limit]]
    return ", ".join(vals) + (f" (+{len(values) - limit} more)" if len(values) > limit else "") if vals else "none"


@dataclass
class Summary:
    """What :func:`summarize` returns; ``print`` it for a text table, or display it in a notebook."""

    #: one row per numeric channel along ``step`` (per-layer ones left out): :data:`COLUMNS`
    channels: pd.DataFrame
    steps: int  #: rows of the Dataset
    first: int  #: its first and last ``step`` (-1 when empty)
    last: int
    alarms: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  #: steps where a detector alarmed
    #: steps where a controller acted, with the action's name
    actions: dict[int, str] = field(default_factory=dict)

    def __str__(self) -> str:
        head = f"{self.steps} rows (step {self.first} .. {self.last})" if self.steps else "no rows"
        table = self.channels.to_string(float_format=lambda v: f"{v:.4g}", na_rep="-") if len(self.channels) else ""
        acted = _steps(np.array(sorted(self.actions)))
        names = sorted(set(self.actions.values()))
        lines = [head, table, f"alarms at steps: {_steps(self.alarms)}",
                 f"actions at steps: {acted}" + (f" ({', '.join(names)})" if names else "")]
        bad = self.channels[self.channels.non_finite > 0] if len(self.channels) else self.channels
        lines.append("non-finite values: " + ("none" if not len(bad) else "; ".join(
            f"{ch} at {int(r.non_finite)} steps from {int(r.first_non_finite)}" for ch, r in bad.iterrows())))
        return "\n".join(s for s in lines if s)

    def _repr_html_(self) -> str:
        return "<pre>" + str(self).replace("&", "&amp;").replace("<", "&lt;") + "</pre>"


def summarize(ds: xr.Dataset) -> Summary:
    """The quick look at ``ds`` (one run: dimension ``step``; see the module docstring). Alarms are
    the steps where ``controller_alarm`` is 1; actions those where ``controller_action`` names one
    (a Monitor's Dataset) or, in a stored run, where ``intervened`` is 1 (``action``'s code)."""
    import pandas as pd

    if "step" not in ds.dims:
        raise ValueError(f"summarize needs a Dataset with a 'step' dimension, got dims {dict(ds.sizes)}")
    steps = np.asarray(ds["step"].values) if "step" in ds.coords else np.arange(ds.sizes["step"])
    rows = {}
    for name, da in ds.data_vars.items():
        if da.dims != ("step",) or da.dtype.kind not in "fiub":
            continue
        x = np.asarray(da.values, dtype=np.float64)
        nan = np.isnan(x)
        seen = x[~nan]
        finite = seen[np.isfinite(seen)]
        at = np.flatnonzero(np.isfinite(x))
        dense = at.size > 0 and nan[at[0]:at[-1] + 1].sum() <= 0.1 * (at[-1] + 1 - at[0])
        if dense:
            nan[:at[0]] = False  # before its first value a channel may not be measurable yet (xgrad's first step)
        bad = np.flatnonzero(np.isinf(x) | (nan if dense else False))
        last = seen[-1] if seen.size else np.nan
        rows[str(name)] = (np.median(finite) if finite.size else np.nan, finite.max() if finite.size else np.nan,
                           last, len(bad), steps[bad[0]] if len(bad) else np.nan)
    table = pd.DataFrame.from_dict(rows, orient="index", columns=list(COLUMNS))
    table.index.name = "channel"
    alarms = np.zeros(0, np.int64)
    if "controller_alarm" in ds:
        alarms = steps[np.asarray(ds["controller_alarm"].values, dtype=np.float64) == 1.0]
    actions: dict[int, str] = {}
    if "controller_action" in ds and ds["controller_action"].dtype.kind in "US":
        actions = {int(s): str(a) for s, a in zip(steps, ds["controller_action"].values, strict=True)
                   if a not in ("", "none")}
    elif "intervened" in ds:
        codes = ds["action"].values if "action" in ds else np.ones(ds.sizes["step"])
        actions = {int(s): f"code {int(c)}" for s, i, c in zip(steps, ds["intervened"].values, codes, strict=True)
                   if i == 1.0}
    return Summary(table, len(steps), int(steps[0]) if len(steps) else -1, int(steps[-1]) if len(steps) else -1,
                   alarms, actions)
