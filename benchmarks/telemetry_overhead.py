"""Cost of the telemetry Monitor and of one lambda_max measurement, side by side.

Two training loops -- a small GPT (``stabstudy.gpt.GPT``, AdamW, as in ``stabstudy.lm``)
and the toy tanh MLP (``stabstudy.toy.MLP``, Adam, MSE) -- each run with the Monitor
off, on with ``every=1`` and on with ``every=10``. Variants are timed in interleaved
repeats (off, every=1, every=10, off, ...) so that load from other processes hits
them alike; the table shows the median time per training step and the ratio to "off".
Then one ``lambda_max`` measurement (power iteration, a fixed 20 Hessian-vector
products on one batch) is timed and expressed in training-step equivalents.

PyHessian is not compared: it is not a dependency and nothing is installed at run time.

    OMP_NUM_THREADS=1 python benchmarks/telemetry_overhead.py [--steps 20] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from stabstudy import curvature, lm, toy
from stabstudy.gpt import GPT
from stabstudy.telemetry import Monitor

VARIANTS = (("off", 0), ("every=1", 1), ("every=10", 10))


def gpt_workload(args):
    hp = {**lm.DEFAULTS, "n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": max(args.n_embd // 32, 1),
          "block_size": args.block}
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 256, (args.batch, args.block), generator=g),
                torch.randint(0, 256, (args.batch, args.block), generator=g)) for _ in range(args.steps)]

    def make():
        torch.manual_seed(0)
        model = GPT(lm.model_config(hp))
        return model, lm.make_optimizer(model, hp)

    def loss_of(model, x, y):
        return model(x, y).loss

    return make, loss_of, batches


def mlp_workload(args):
    data = toy.load_task("digits", 1024, 64)
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(args.steps):
        idx = torch.randint(0, 1024, (args.mlp_batch,), generator=g)
        batches.append((data["x_train"][idx], data["y_train"][idx]))

    def make():
        torch.manual_seed(0)
        model = toy.MLP(64, 10, args.mlp_width, 2)
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)

    def loss_of(model, x, y):
        return 0.5 * (model(x) - y).pow(2).sum(1).mean()

    return make, loss_of, batches


def time_steps(model, opt, mon, loss_of, batches) -> float:
    """Seconds per training step over ``batches``."""
    t0 = time.perf_counter()
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model, x, y)
        loss.backward()
        opt.step()
        if mon is not None:
            mon.log(loss=loss.detach())
    return (time.perf_counter() - t0) / len(batches)


def bench(name, workload, args) -> list[dict]:
    make, loss_of, batches = workload(args)
    setups = {}
    for label, every in VARIANTS:
        model, opt = make()
        mon = Monitor(model, opt, every=every) if every else None
        time_steps(model, opt, mon, loss_of, batches[:3])  # warm-up (allocates buffers, Adam state)
        setups[label] = (model, opt, mon)
    times = {label: [] for label, _ in VARIANTS}
    for _ in range(args.repeats):
        for label, _ in VARIANTS:
            times[label].append(time_steps(*setups[label][:3], loss_of, batches))
    med = {k: statistics.median(v) for k, v in times.items()}
    # one lambda_max measurement (fixed 20 HVPs: tol=0) on the first batch
    model = setups["off"][0]
    x, y = batches[0]
    params = [p for p in model.parameters() if p.requires_grad]
    lam_t = statistics.median(
        curvature.lambda_max(lambda: loss_of(model, x, y), params, iters=20, tol=0.0, seed=0).wall_s
        for _ in range(max(args.repeats // 2, 1)))
    n_params = sum(p.numel() for p in params)
    rows = [{"workload": name, "variant": k, "params": n_params, "ms_per_step": med[k] * 1e3,
             "ratio": med[k] / med["off"]} for k, _ in VARIANTS]
    rows.append({"workload": name, "variant": "lambda_max (20 HVP)", "params": n_params, "ms_per_step": lam_t * 1e3,
                 "ratio": lam_t / med["off"]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="training steps per timed repeat")
    ap.add_argument("--repeats", type=int, default=7, help="interleaved repeats per variant")
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--mlp-width", type=int, default=256)
    ap.add_argument("--mlp-batch", type=int, default=128)
    args = ap.parse_args()
    rows = bench("gpt", gpt_workload, args) + bench("mlp", mlp_workload, args)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); median of {args.repeats} interleaved "
          f"repeats of {args.steps} steps (timings include other processes' load)")
    print(f"{'workload':<9}{'variant':<22}{'params':>9}{'ms/step':>10}{'ratio to off':>14}")
    for r in rows:
        unit = "x (step equivalents)" if r["variant"].startswith("lambda") else "x"
        print(f"{r['workload']:<9}{r['variant']:<22}{r['params']:>9}{r['ms_per_step']:>10.3f}{r['ratio']:>13.3f}{unit}")


if __name__ == "__main__":
    main()
