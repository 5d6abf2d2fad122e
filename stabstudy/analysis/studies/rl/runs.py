"""One row per RL run of a Dataset: its keys (learner or arm, perturbation, seed, prefix, noise knob) and
its final return, what :func:`.outcomes.paired_table` pairs forks with their controls by."""

from __future__ import annotations

import numpy as np
import pandas as pd
import xarray as xr

from stabstudy.analysis.studies.rl.curves import finite_pairs
from stabstudy.registry import NOISE_KNOB

#: The columns of :func:`run_table` every run has (then each noise knob the runs set, and ``noise``).
KEYS = ("spec_hash", "learner", "seed", "pert_kind", "pert_dose", "pert_start", "status")


def run_table(ds: xr.Dataset, final_points: int = 3) -> pd.DataFrame:
    """One row per run of ``ds`` (:func:`stabstudy.run.store.load_runs`): its keys (:data:`KEYS` where
    the Dataset has them), ``prefix_steps`` (0: from scratch), ``noise_after_fork`` ("same" where the
    fork kept its prefix's knob), each learner's noise knob the runs set, ``noise`` (the learner's own
    knob in effect during the event: a fork's ``noise_after_fork``, else its knob) and
    ``final_return`` (the mean of its last ``final_points`` evaluations; NaN without any)."""
    if "run" not in ds.dims:
        ds = ds.expand_dims(run=[0])
    n = ds.sizes["run"]

    def coord(name, default):
        return ds[name].values if name in ds.coords and ds[name].dims == ("run",) else np.full(n, default, dtype=object)

    names = {k: ds[k].values for k in KEYS if k in ds.coords and ds[k].dims == ("run",)}
    if "spec_hash" not in names:
        names = {"spec_hash": ds["run"].values, **names}  # load_runs: the run coordinate is the spec hash
    prefix = pd.to_numeric(pd.Series(coord("hp_prefix_steps", 0)), errors="coerce").fillna(0).to_numpy()
    after = coord("hp_noise_after_fork", "same")
    env = ds["env_step"].transpose("run", "step").values if "run" in ds["env_step"].dims else \
        np.broadcast_to(ds["env_step"].values, (n, ds.sizes["step"]))
    perf = ds["perf"].transpose("run", "step").values
    rows = []
    for i in range(n):
        row = {k: names[k][i] for k in KEYS if k in names}
        row["prefix_steps"] = int(prefix[i])
        row["noise_after_fork"] = "same" if not isinstance(after[i], int | float) or np.isnan(after[i]) else after[i]
        for knob in dict.fromkeys(NOISE_KNOB.values()):
            if f"hp_{knob}" in ds.coords:
                row[knob] = ds[f"hp_{knob}"].values[i]
        own = row.get(NOISE_KNOB.get(str(row.get("learner")), ""), np.nan)
        row["noise"] = pd.to_numeric(pd.Series([row["noise_after_fork"] if row["noise_after_fork"] != "same"
                                                else own]), errors="coerce").iloc[0]
        _, v = finite_pairs((env[i], perf[i]))
        row["final_return"] = float(np.mean(v[-final_points:])) if v.size else np.nan
        rows.append(row)
    return pd.DataFrame(rows)
