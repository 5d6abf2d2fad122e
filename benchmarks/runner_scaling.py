"""Runner scaling and overhead, side by side in one run.

1. A grid of identical CPU-bound toy runs (different seeds): serial in-process
   vs an embedded 2-worker Dask LocalCluster (cluster start-up excluded, reported
   separately). Prints the speedup ratio.
2. Per-run overhead of runner + store (execute, conform, atomic netCDF write)
   against calling the learner directly.

    OMP_NUM_THREADS=1 python benchmarks/runner_scaling.py [--runs 8] [--steps 2000]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from stabstudy.run import runner
from stabstudy.run.runner import run_grid
from stabstudy.run.store import RunStore
from stabstudy.spec import RunSpec


def grid(n: int, steps: int, offset: int) -> list[RunSpec]:
    return [RunSpec("toy", "gd", "digits", steps=steps, seed=offset + i, hparams={"lr": 0.05, "width": 32})
            for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5, help="repeats of the overhead measurement")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="stabstudy-bench-"))
    learner = runner.learner_for("toy")

    # warm imports and caches so neither variant pays them
    learner(grid(1, 20, 10_000)[0])

    t0 = time.perf_counter()
    run_grid(grid(args.runs, args.steps, 0), scheduler="serial", store=RunStore(tmp / "serial"), progress=False)
    serial = time.perf_counter() - t0

    t0 = time.perf_counter()
    client = runner.get_client(None, n_workers=2)
    client.wait_for_workers(2)
    warm = grid(1, 20, 10_000)[0]
    client.run(lambda: runner.execute(warm, threads=1))  # imports and data loading on workers, outside the timing
    startup = time.perf_counter() - t0
    t0 = time.perf_counter()
    run_grid(grid(args.runs, args.steps, 0), store=RunStore(tmp / "dask"), progress=False, n_workers=2)
    dask2 = time.perf_counter() - t0
    runner.close_clients()

    direct, managed = [], []
    for r in range(args.repeats):  # interleaved so drift hits both equally
        s = grid(1, args.steps, 1000 + r)[0]
        t0 = time.perf_counter()
        learner(s)
        direct.append(time.perf_counter() - t0)
        s = grid(1, args.steps, 2000 + r)[0]
        t0 = time.perf_counter()
        run_grid([s], scheduler="serial", store=RunStore(tmp / "overhead"), progress=False)
        managed.append(time.perf_counter() - t0)
    d, m = statistics.median(direct), statistics.median(managed)

    print(f"grid: {args.runs} toy runs x {args.steps} full-batch GD steps")
    print(f"{'variant':<28}{'wall s':>10}{'runs/s':>10}")
    print(f"{'serial (in-process)':<28}{serial:>10.2f}{args.runs / serial:>10.2f}")
    print(f"{'Dask LocalCluster, 2 workers':<28}{dask2:>10.2f}{args.runs / dask2:>10.2f}")
    print(f"speedup 2 workers / serial: {serial / dask2:.2f}x   (cluster start-up, not included: {startup:.1f} s)")
    print(f"per-run: learner direct {d:.3f} s, runner+store {m:.3f} s, overhead {m - d:+.3f} s "
          f"({(m / d - 1) * 100:+.1f}%), median of {args.repeats}")


if __name__ == "__main__":
    main()
