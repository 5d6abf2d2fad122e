"""Long-format pandas view of a telemetry Dataset: one row per (step, channel[, layer]) value.

The xarray Dataset stays the stored form (``Monitor.to_dataset``, ``RunStore.load``,
``load_runs``); :func:`to_frame` gives the tidy table that pandas, seaborn or a
spreadsheet expect, with the same columns whatever produced the Dataset.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # imported when called: importing the Monitor need not load pandas
    import pandas as pd
    import xarray as xr

#: Columns of :func:`to_frame`, after those of any further dimension (e.g. ``run``).
FRAME_COLUMNS = ("step", "channel", "layer", "value")


def to_frame(ds: xr.Dataset, *, dropna: bool = False) -> pd.DataFrame:
    """Every numeric variable along ``step`` of ``ds`` as a long DataFrame.

    Columns: one per further dimension (``run`` for :func:`stabstudy.run.store.load_runs`),
    then ``step``, ``channel`` (the variable's name), ``layer`` (the layer name for per-layer
    channels such as ``layer_grad_norm``, missing elsewhere) and ``value`` (float64).
    Variables without a ``step`` dimension and non-numeric ones are left out.

    Args:
        ds: a Monitor's ``to_dataset()``, a stored run (``RunStore.load``) or several (``load_runs``).
        dropna: leave out rows whose value is NaN (steps a channel was not measured on,
            e.g. between ``every`` measurements or past a shorter run's end).
    """
    import pandas as pd

    parts: list[pd.DataFrame] = []
    extra: list[str] = []  # further dimensions, in order of appearance: their columns lead
    for name, da in ds.data_vars.items():
        if "step" not in da.dims or not np.issubdtype(da.dtype, np.number) or np.issubdtype(da.dtype, np.complexfloating):
            continue
        order = [d for d in da.dims if d not in ("step", "layer")] + ["step"] + (["layer"] if "layer" in da.dims else [])
        extra += [d for d in order[:-1] if d not in extra and d != "step"]
        vals = np.asarray(da.transpose(*order).values, dtype=np.float64)
        # one index per dimension for every cell, C order as ravel() below
        idx = np.indices(vals.shape).reshape(len(order), -1)
        cols: dict[str, object] = {}
        for i, d in enumerate(order):
            labels = ds[d].values if d in ds.coords else np.arange(vals.shape[i])
            cols[d] = labels[idx[i]]
        cols["channel"] = str(name)
        cols["value"] = vals.ravel()
        parts.append(pd.DataFrame(cols))
    columns = extra + list(FRAME_COLUMNS)
    if not parts:
        return pd.DataFrame({c: pd.Series(dtype=np.float64 if c == "value" else object) for c in columns})
    out = pd.concat(parts, ignore_index=True, sort=False)
    if "layer" not in out:
        out["layer"] = None
    out = out[columns]
    if dropna:
        out = out[out["value"].notna()].reset_index(drop=True)
    return out
