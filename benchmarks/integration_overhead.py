"""What streaming the Monitor's channels to TensorBoard costs: ``Monitor(..., writer=SummaryWriter)``
against the bare Monitor, side by side, on the small GPT and tiny MLP steps of
``benchmarks/telemetry_overhead.py`` (its workload builders, the same defaults).

Both variants share one model and optimizer per workload and run in interleaved repeats whose
order alternates, each Monitor attached for its repeat (one untimed warm-up step) and closed
after it; the ratio is the median of the per-repeat ratios writer / bare (target: at most
x1.01). ``--sync-every`` sets the block size; the writer's ``add_scalar`` calls happen once
per block, so a timed repeat of ``--steps`` steps contains ``steps / sync_every`` flushes.

    OMP_NUM_THREADS=1 python benchmarks/integration_overhead.py [--steps 64] [--repeats 11]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from telemetry_overhead import gpt_workload, mlp_workload, time_steps  # noqa: E402

from stabstudy.instruments.telemetry import Monitor  # noqa: E402

TARGET = 1.01


def bench(name: str, workload, args: argparse.Namespace, logdir: str) -> dict:
    """Median ms/step of the bare Monitor and of the Monitor with a SummaryWriter, and the ratio."""
    from torch.utils.tensorboard import SummaryWriter

    make, loss_of, batches, _ = workload(args)
    model, opt = make()
    time_steps(model, opt, None, loss_of, batches[:3])  # warm-up: Adam state, allocator
    writer = SummaryWriter(f"{logdir}/{name}")
    times: dict[str, list[float]] = {"bare": [], "writer": []}
    for rep in range(args.repeats):
        for label in (("bare", "writer") if rep % 2 == 0 else ("writer", "bare")):
            mon = Monitor(model, opt, sync_every=args.sync_every, writer=writer if label == "writer" else None)
            time_steps(model, opt, mon, loss_of, batches[:1])
            times[label].append(time_steps(model, opt, mon, loss_of, batches))
            mon.close()
    writer.close()
    ratios = [w / b for w, b in zip(times["writer"], times["bare"], strict=True)]
    q1, q2, q3 = statistics.quantiles(ratios, n=4)
    return {"workload": name, "bare_ms": statistics.median(times["bare"]) * 1e3,
            "writer_ms": statistics.median(times["writer"]) * 1e3, "ratio": q2, "iqr": (q1, q3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=64, help="training steps per timed repeat")
    ap.add_argument("--repeats", type=int, default=11, help="interleaved repeats per variant")
    ap.add_argument("--sync-every", type=int, default=64, help="the Monitor's block size")
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--mlp-width", type=int, default=256)
    ap.add_argument("--mlp-batch", type=int, default=128)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as logdir:
        rows = [bench("gpt", gpt_workload, args, logdir), bench("mlp", mlp_workload, args, logdir)]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); {args.repeats} interleaved repeats of "
          f"{args.steps} steps, sync_every={args.sync_every}; ms/step: median; ratio: median of per-repeat "
          f"writer / bare [quartiles]; target <= x{TARGET}")
    print(f"{'workload':<10}{'bare ms':>9}{'writer ms':>11}{'ratio':>8}{'quartiles':>20}")
    for r in rows:
        lo, hi = r["iqr"]
        verdict = "met" if r["ratio"] <= TARGET else "MISSED"
        print(f"{r['workload']:<10}{r['bare_ms']:>9.2f}{r['writer_ms']:>11.2f}{r['ratio']:>8.3f}"
              f"   [{lo:.3f}, {hi:.3f}]  {verdict}")


if __name__ == "__main__":
    main()
