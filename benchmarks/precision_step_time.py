"""Training-step time per precision on this machine, side by side.

Variants (same small GPT, same batches): float32; bfloat16 autocast; float16 autocast with a
GradScaler; pure bfloat16 (parameters and Adam state stored in bfloat16); float16 emulated at
op boundaries (:class:`stabstudy.instruments.precision._LowPrecisionEmulation`); and float32 plus the
precision telemetry (snapshot + lost_update_frac + nonfinite counts + Adam-state scan) to show
what the channels cost. Repeats are interleaved (variant order shuffled per round) and the
median step time is reported with its ratio to float32.

    OMP_NUM_THREADS=1 python benchmarks/precision_step_time.py [--rounds 5] [--steps 10]

CPU timings are inflated when other processes share the cores.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch

from stabstudy.instruments import precision as P
from stabstudy.learners.gpt import GPT, GPTConfig


def make_step(variant: str, cfg: GPTConfig, seed: int) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """A closure doing one optimizer step of ``variant`` on a fresh model."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    amp = {"bf16_autocast": "bfloat16", "fp16_autocast_scaler": "float16",
           "fp16_emulated": "float16"}.get(variant, "float32")
    if variant == "bf16_pure":
        model = model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    scaler = P.make_grad_scaler("cpu", enabled=variant == "fp16_autocast_scaler")
    emulate = variant == "fp16_emulated"
    telemetry = variant == "fp32_with_precision_channels"
    params = [p for p in model.parameters()]

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        with P.autocast("cpu", amp, emulate=emulate if amp != "float32" else None):
            loss = model(x, y).loss
        scaler.scale(loss).backward()
        if telemetry:
            before = P.snapshot(params)
            P.count_nonfinite(p.grad for p in params)
        P.scaler_step(scaler, opt)
        if telemetry:
            P.lost_update_frac(before, params, [p.grad for p in params], torch.bfloat16)
            P.adam_state_nonfinite(opt)

    return step


VARIANTS = ("float32", "bf16_autocast", "fp16_autocast_scaler", "bf16_pure", "fp16_emulated",
            "fp32_with_precision_channels")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="interleaved repeats per variant")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per repeat (after 2 warm-up steps)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--n-layer", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = GPTConfig(block_size=args.block, n_embd=args.n_embd, n_layer=args.n_layer, n_head=2)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (args.batch, args.block), generator=g)
    y = torch.randint(0, cfg.vocab_size, (args.batch, args.block), generator=g)
    steps = {v: make_step(v, cfg, seed=0) for v in VARIANTS}
    for fn in steps.values():  # warm-up
        fn(x, y)
        fn(x, y)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    order = list(VARIANTS)
    rng = random.Random(0)
    for _ in range(args.rounds):
        rng.shuffle(order)
        for v in order:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                steps[v](x, y)
            times[v].append((time.perf_counter() - t0) / args.steps)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, autocast support "
          f"{P.autocast_support('cpu')}")
    print(f"GPT n_layer={cfg.n_layer} n_embd={cfg.n_embd} block={cfg.block_size} batch={args.batch}; "
          f"{args.rounds} interleaved rounds x {args.steps} steps")
    base = statistics.median(times["float32"])
    print(f"{'variant':32s} {'median ms/step':>15s} {'min':>8s} {'max':>8s} {'x float32':>10s}")
    for v in VARIANTS:
        med = statistics.median(times[v])
        print(f"{v:32s} {1e3 * med:15.2f} {1e3 * min(times[v]):8.2f} {1e3 * max(times[v]):8.2f} {med / base:10.2f}")


if __name__ == "__main__":
    main()
