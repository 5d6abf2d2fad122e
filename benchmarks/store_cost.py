"""Cost of checksumming stored runs: write and load time of one run file, three ways side by side.

* ``plain``: ``to_netcdf`` and a full load, no checksum (the store before checksums);
* ``fletcher32``: the same with HDF5's Fletcher-32 filter on every non-scalar variable (checked
  by HDF5 on read; covers chunked arrays only, not attributes, scalars or the string heap);
* ``sha256``: what :class:`stabstudy.run.store.RunStore` does: write, read back, stamp the
  SHA-256 of the content (attributes and every variable) in the file; on load, read and
  compare. Covers attributes and every variable.

Runs are synthetic Datasets of the store's shape (float64 channels along ``step`` plus the
provenance attributes of a real run): a toy-sized run, an LM/RL-sized run and a long one.
Each cell is the median of ``--repeats`` timings in a temporary folder (page cache warm: the
cost measured is CPU, not disk).

    OMP_NUM_THREADS=1 python benchmarks/store_cost.py [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import xarray as xr

from stabstudy.run.store import CHECKSUM_ATTR, ENGINE, RunStore, _read
from stabstudy.spec import RunSpec

#: (label, channels, steps)
SIZES = (("toy run", 15, 500), ("LM / RL run", 40, 5_000), ("long run", 60, 50_000))


def dataset(channels: int, steps: int) -> xr.Dataset:
    rng = np.random.default_rng(0)
    data = {f"ch{i}": ("step", rng.standard_normal(steps)) for i in range(channels)}
    data["loss"] = ("step", rng.standard_normal(steps))
    return xr.Dataset(data, coords={"step": np.arange(steps)})


def median_s(fn, repeats: int) -> float:
    fn()  # first call: imports, file creation
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(store: RunStore, tmp: Path, channels: int, steps: int, repeats: int) -> tuple[float, dict, dict]:
    """File size (MB) and median write / load seconds of one run, keyed plain, fletcher32, sha256."""
    spec = RunSpec("toy", "gd", "digits", steps=steps, seed=0, hparams={"lr": 0.1})
    ds = dataset(channels, steps)
    stored = store.save(ds, spec, "ok", 1.0)
    # the same variables (shared channels added) and provenance attributes in all three files
    full = _read(stored)
    full.attrs.pop(CHECKSUM_ATTR)
    for var in full.variables.values():
        var.encoding = {}
    plain, f32 = tmp / "plain.nc", tmp / "f32.nc"
    enc = {v: {"fletcher32": True} for v in full.variables if full[v].ndim}
    write = {"plain": median_s(lambda: full.to_netcdf(plain, engine=ENGINE), repeats),
             "fletcher32": median_s(lambda: full.to_netcdf(f32, engine=ENGINE, encoding=enc), repeats),
             "sha256": median_s(lambda: store.save(ds, spec, "ok", 1.0), repeats)}
    load = {"plain": median_s(lambda: _read(plain), repeats),
            "fletcher32": median_s(lambda: _read(f32), repeats),
            "sha256": median_s(lambda: store.load(spec), repeats)}
    return stored.stat().st_size / 1e6, write, load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15, help="timings per cell (median reported)")
    args = ap.parse_args()
    print(f"{'run':<14} {'MB':>6} | {'write ms: plain':>15} {'fletcher32':>10} {'sha256':>8} {'ratio':>6}"
          f" | {'load ms: plain':>14} {'fletcher32':>10} {'sha256':>8} {'ratio':>6}")
    with tempfile.TemporaryDirectory() as tmp:
        store = RunStore(Path(tmp) / "runs")
        for label, channels, steps in SIZES:
            mb, w, r = measure(store, Path(tmp), channels, steps, args.repeats)
            print(f"{label:<14} {mb:>6.2f} | {w['plain'] * 1e3:>15.1f} {w['fletcher32'] * 1e3:>10.1f} "
                  f"{w['sha256'] * 1e3:>8.1f} {w['sha256'] / w['plain']:>6.2f}"
                  f" | {r['plain'] * 1e3:>14.1f} {r['fletcher32'] * 1e3:>10.1f} {r['sha256'] * 1e3:>8.1f}"
                  f" {r['sha256'] / r['plain']:>6.2f}")
    print("ratio: sha256 over plain. The sha256 write includes what RunStore.save adds besides the "
          "checksum (schema, provenance, lock, rename).")


if __name__ == "__main__":
    main()
