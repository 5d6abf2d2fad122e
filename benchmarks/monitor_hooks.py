"""CPU time the Monitor adds to one optimizer step, for the tensor sets of the study's small models.

The end-to-end ratios of ``telemetry_overhead.py`` and ``rl_overhead.py`` move by several percent
between runs on a shared machine; this measures the Monitor alone, steadily: an Adam step on
fixed gradients, with and without a Monitor attached (``every=1`` and ``every=10``), timed by
``time.thread_time`` (the CPU time of this thread: time the scheduler gives other processes is
not counted) in interleaved blocks, the minimum over blocks. The difference is the Monitor's cost
per step (its hooks, and the cache misses they cause the Adam step), without the forward and
backward passes, whose cache traffic it leaves out.

Second table: the read of the gradient at the end of each backward pass that gives ``grad_norm``
before clipping (``Monitor(before_clip=True)``, the default): a backward pass over a graph that
leaves fixed gradients, with the Monitor attached with and without that read (``before_clip``),
in interleaved blocks as above; beside it, one read of the gradient by itself (per-tensor norms
by one ``torch._foreach_norm``, their squared sum by one dot product: the least any gradient norm
costs). The issue's bound (46, item 8): the read costs at most one extra read of the gradient.

Tensor sets (float32): SAC's three optimizers on HalfCheetah with 64-wide nets (``ent_coef``:
one scalar; ``actor``: 8 tensors, 6k parameters; ``critic``: two Q-nets, 12 tensors, 11.5k),
their sum per SAC update, the toy MLP of ``telemetry_overhead.py`` (6 tensors, 85k) and the small
GPT's (``n_layer=2, n_embd=64``: 28 tensors, 121k).

    OMP_NUM_THREADS=1 python benchmarks/monitor_hooks.py [--blocks 15] [--steps 200]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from stabstudy.hparams import GPTHParams, defaults
from stabstudy.instruments.telemetry import TELEMETRY_VERSION, Monitor
from stabstudy.learners import lm, toy
from stabstudy.learners.gpt import GPT


def sac_shapes(obs: int = 17, act: int = 6, hidden: int = 64) -> dict[str, list[tuple[int, ...]]]:
    """SB3 SAC's parameter shapes per optimizer (MlpPolicy, net_arch [hidden, hidden])."""
    mlp = [(hidden, obs), (hidden,), (hidden, hidden), (hidden,)]
    q = [(hidden, obs + act), (hidden,), (hidden, hidden), (hidden,), (1, hidden), (1,)]
    return {"ent_coef": [(1,)], "actor": mlp + [(act, hidden), (act,)] * 2, "critic": q * 2}


def model_shapes() -> dict[str, list[tuple[int, ...]]]:
    """The toy MLP's and the small GPT's parameter shapes, as ``telemetry_overhead.py`` builds them."""
    mlp = toy.MLP(64, 10, 256, 2)
    gpt = GPT(lm.model_config({**defaults(GPTHParams), "n_layer": 2, "n_embd": 64, "n_head": 2, "block_size": 64}))
    return {name: [tuple(p.shape) for p in m.parameters() if p.requires_grad] for name, m in (("mlp", mlp), ("gpt", gpt))}


def cost_per_step(shapes: list[tuple[int, ...]], every: int, blocks: int, steps: int) -> tuple[float, float]:
    """(us the Monitor adds per Adam step, us per Adam step without it), minima over blocks."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*s, generator=gen)) for s in shapes]
    grads = [torch.randn(*s, generator=gen) for s in shapes]
    opt = torch.optim.Adam(params, lr=1e-4)

    def run(n: int) -> float:
        t0 = time.thread_time()
        for _ in range(n):
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            opt.step()
        return (time.thread_time() - t0) / n

    run(5)
    n = max(steps // every, 1) * every
    on, off = float("inf"), float("inf")
    for b in range(blocks):
        for monitored in ((True, False) if b % 2 == 0 else (False, True)):
            if monitored:
                mon = Monitor(None, opt, every=every)
                run(70 + every)  # its buffers, one full device block
                on = min(on, run(n))
                mon.close()
            else:
                off = min(off, run(n))
    return (on - off) * 1e6, off * 1e6


def backward_read_cost(shapes: list[tuple[int, ...]], blocks: int, steps: int) -> tuple[float, float, float]:
    """(us the backward read adds per backward pass, us of one read of the gradient alone, us per
    backward pass without it), minima over interleaved blocks."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*s, generator=gen)) for s in shapes]
    grads = [torch.randn(*s, generator=gen) for s in shapes]
    opt = torch.optim.Adam(params, lr=1e-4)

    def backward(n: int) -> float:
        t0 = time.thread_time()
        for _ in range(n):
            for p in params:
                p.grad = None
            torch.stack([(p * g).sum() for p, g in zip(params, grads, strict=True)]).sum().backward()
        return (time.thread_time() - t0) / n

    out = torch.zeros(())

    def one_read(n: int) -> float:
        t0 = time.thread_time()
        for _ in range(n):
            norms = torch.stack(torch._foreach_norm(grads))
            torch.dot(norms, norms, out=out)
        return (time.thread_time() - t0) / n

    best = {True: float("inf"), False: float("inf")}
    read = float("inf")
    for b in range(blocks):
        for before in ((True, False) if b % 2 == 0 else (False, True)):
            mon = Monitor(None, opt, before_clip=before)
            backward(5)
            best[before] = min(best[before], backward(steps))
            mon.close()
        read = min(read, one_read(steps))
    return (best[True] - best[False]) * 1e6, read * 1e6, best[False] * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=15, help="interleaved blocks per variant (minimum taken)")
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps per block")
    args = ap.parse_args()
    torch.set_num_threads(1)
    sets = {**sac_shapes(), **model_shapes()}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); telemetry {TELEMETRY_VERSION}; "
          f"{args.blocks} interleaved blocks of {args.steps} Adam steps, CPU time (thread_time), minimum")
    print(f"{'tensor set':<12}{'tensors':>8}{'params':>9}{'Adam step us':>14}{'every=1 us':>12}{'every=10 us':>13}")
    sac = [0.0, 0.0, 0.0]
    for name, shapes in sets.items():
        e1, off = cost_per_step(shapes, 1, args.blocks, args.steps)
        e10, _ = cost_per_step(shapes, 10, args.blocks, args.steps)
        n = sum(torch.Size(s).numel() for s in shapes)
        print(f"{name:<12}{len(shapes):>8}{n:>9}{off:>14.1f}{e1:>12.1f}{e10:>13.1f}")
        if name in ("ent_coef", "actor", "critic"):
            sac = [a + b for a, b in zip(sac, (off, e1, e10), strict=True)]
            if name == "critic":
                print(f"{'SAC update':<12}{'':>8}{'':>9}{sac[0]:>14.1f}{sac[1]:>12.1f}{sac[2]:>13.1f}")
    print(f"\nthe read at the end of each backward pass (grad_norm before clipping), {args.blocks} interleaved "
          f"blocks of {args.steps} backward passes, CPU time, minimum")
    print(f"{'tensor set':<12}{'tensors':>8}{'params':>9}{'backward us':>13}{'the read us':>13}{'one read us':>13}")
    for name, shapes in sets.items():
        added, one, bw = backward_read_cost(shapes, args.blocks, args.steps)
        n = sum(torch.Size(s).numel() for s in shapes)
        print(f"{name:<12}{len(shapes):>8}{n:>9}{bw:>13.1f}{added:>13.1f}{one:>13.1f}")
    print(f"load average at the end (1, 5, 15 min): {', '.join(f'{v:.1f}' for v in os.getloadavg())} "
          f"on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
