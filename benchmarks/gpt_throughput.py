"""Tokens/s of one GPT training step: with vs without the telemetry Monitor, float32 vs bfloat16 autocast.

Four variants side by side, timed in interleaved repeats (A B C D, B C D A, ...) so that load
from other processes hits them alike; the table reports the median tokens/s per variant and
the ratio to the float32 / no-Monitor reference. The Monitor (``every=1``, torch ops on the
model's device) gets the loss as a tensor, so the timed loop reads nothing back per step on a
GPU: its rows reach the host in blocks of ``--sync-every``.

    OMP_NUM_THREADS=1 python benchmarks/gpt_throughput.py [--steps 20] [--repeats 12] [--n-embd 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from stabstudy.hparams import GPTHParams, defaults
from stabstudy.instruments.precision import autocast
from stabstudy.instruments.telemetry import Monitor
from stabstudy.learners import lm
from stabstudy.learners.corpus import get_batch, load_corpus
from stabstudy.learners.gpt import GPT


def make_variant(hp: dict, monitor: bool, dtype: str, device: torch.device, sync_every: int = 64):
    torch.manual_seed(0)
    model = GPT(lm.model_config(hp)).to(device)
    opt = lm.make_optimizer(model, hp)
    mon = Monitor(model, opt, every=1, sync_every=sync_every) if monitor else None
    return {"model": model, "opt": opt, "mon": mon, "dtype": dtype}


def train_steps(v: dict, batches: list, device: torch.device) -> float:
    """Run the batches as training steps; return seconds."""
    model, opt = v["model"], v["opt"]
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for x, y in batches:
        with autocast(device.type, v["dtype"]):
            loss = model(x, y).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if v["mon"] is not None:
            v["mon"].log(loss=loss.detach())
    float(loss.detach())  # sync
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20, help="training steps per timed repeat")
    ap.add_argument("--repeats", type=int, default=12, help="interleaved repeats per variant")
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--sync-every", type=int, default=64, help="the Monitor's rows per device-to-host copy")
    args = ap.parse_args()
    hp = {**defaults(GPTHParams), "n_embd": args.n_embd, "n_layer": args.n_layer, "batch_size": args.batch_size,
          "block_size": args.block_size}
    device = lm.resolve_device(args.device)
    corpus = load_corpus("stdlib", int(hp["corpus_bytes"]))
    g = torch.Generator().manual_seed(0)
    batches = [tuple(t.to(device) for t in get_batch(corpus.train, args.batch_size, args.block_size, g))
               for _ in range(args.steps)]
    names = [("float32", False), ("float32", True), ("bfloat16", False), ("bfloat16", True)]
    variants = {n: make_variant(hp, mon, dt, device, args.sync_every) for n in names for dt, mon in [n]}
    for v in variants.values():  # warm-up
        train_steps(v, batches[:3], device)
    times: dict = {n: [] for n in names}
    for r in range(args.repeats):  # interleaved, order rotated every repeat
        for n in names[r % 4:] + names[:r % 4]:
            times[n].append(train_steps(variants[n], batches, device))
    tokens = args.steps * args.batch_size * args.block_size
    ref = statistics.median(times[names[0]])
    n_params = variants[names[0]]["model"].num_params()
    print(f"GPT {n_params / 1e6:.3f}M params, batch {args.batch_size} x {args.block_size} tokens, device {device}, "
          f"torch threads {torch.get_num_threads()}, {args.repeats} interleaved repeats of {args.steps} steps")
    print(f"{'autocast':<10} {'monitor':<8} {'tokens/s':>10} {'steps/s':>8} {'time ratio':>10}")
    for n in names:
        med = statistics.median(times[n])
        print(f"{n[0]:<10} {('on' if n[1] else 'off'):<8} {tokens / med:>10.0f} {args.steps / med:>8.1f} {med / ref:>10.2f}")
    for dt in ("float32", "bfloat16"):
        r = statistics.median(times[(dt, True)]) / statistics.median(times[(dt, False)])
        print(f"Monitor overhead ({dt}): x{r:.2f} step time")
    r = statistics.median(times[("bfloat16", False)]) / ref
    print(f"bfloat16 autocast vs float32 (no Monitor): x{r:.2f} step time")


if __name__ == "__main__":
    main()
