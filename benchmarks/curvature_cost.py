"""Cost of one ``lambda_max`` measurement against one training step: time and peak memory.

Two workloads, as in ``benchmarks/telemetry_overhead.py``: a small GPT
(``stabstudy.learners.gpt.GPT``, AdamW, default 2x64, 16x64 tokens) and the toy tanh MLP
(``stabstudy.learners.toy.MLP``, 64-256-256-10, Adam, MSE on a digits batch of 128). For each,
one training step (forward, backward, optimizer step) and one ``lambda_max`` (default Lanczos,
``iters=20`` and ``tol=0`` so that it spends all 20 Hessian-vector products, on the same
batch, gradient graph included) are timed in interleaved repeats after a warm-up; the table
gives medians and their ratio. ``--tol A B ...`` times one ``lambda_max`` per tolerance instead,
interleaved in the same run (one row each, with the Hessian-vector products it used): the cost
of a tighter default tolerance, e.g. ``--tol 1e-3 1e-5`` (the old and the new default).

Memory: each operation runs once in a fresh child process (this script with ``--child``),
after building the model and batch there, so that no allocator cache from an earlier call
hides its allocations. The child reports the peak resident set size during the call above
the resident size just before it (``/proc/self/statm`` polled every 0.2 ms by a thread;
without ``/proc``, the rise of ``resource.getrusage``'s ``ru_maxrss``, which misses whatever
stays below the process's earlier peak), the peak of Python-heap allocations
(``tracemalloc``: numpy arrays, not torch's CPU tensors), and on CUDA the peak of
``torch.cuda.max_memory_allocated`` above the allocation before the call.

``--impl PATH`` times another implementation of ``stabstudy.instruments.curvature`` loaded from a file,
e.g. the one of an earlier commit, for a before/after comparison::

    git show <commit>:stabstudy/instruments/curvature.py > /tmp/curv_old.py
    OMP_NUM_THREADS=1 python benchmarks/curvature_cost.py --impl /tmp/curv_old.py
    OMP_NUM_THREADS=1 python benchmarks/curvature_cost.py [--repeats 7] [--device cuda]

CPU timings are inflated when other processes share the cores.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable
from types import ModuleType

import torch

from stabstudy.hparams import GPTHParams, defaults
from stabstudy.learners import lm, toy
from stabstudy.learners.gpt import GPT

Workload = tuple[torch.nn.Module, torch.optim.Optimizer, Callable[[], torch.Tensor]]


def load_impl(path: str | None) -> ModuleType:
    """The curvature module: the package's, or one loaded from ``path``."""
    if not path:
        from stabstudy.instruments import curvature

        return curvature
    spec = importlib.util.spec_from_file_location("curvature_impl", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def gpt_workload(args: argparse.Namespace, device: torch.device) -> Workload:
    """Small GPT, AdamW as in ``stabstudy.learners.lm``, one fixed batch."""
    hp = {**defaults(GPTHParams), "n_layer": args.n_layer, "n_embd": args.n_embd,
          "n_head": max(args.n_embd // 32, 1), "block_size": args.block}
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (args.batch, args.block), generator=g).to(device)
    y = torch.randint(0, 256, (args.batch, args.block), generator=g).to(device)
    torch.manual_seed(0)
    model = GPT(lm.model_config(hp)).to(device)
    return model, lm.make_optimizer(model, hp), lambda: model(x, y).loss


def mlp_workload(args: argparse.Namespace, device: torch.device) -> Workload:
    """Toy tanh MLP (two hidden layers), Adam, MSE on one digits batch."""
    data = toy.load_task("digits", 1024, 64)
    idx = torch.randint(0, 1024, (args.mlp_batch,), generator=torch.Generator().manual_seed(0))
    x, y = data["x_train"][idx].to(device), data["y_train"][idx].to(device)
    torch.manual_seed(0)
    model = toy.MLP(64, 10, args.mlp_width, 2).to(device)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3), lambda: 0.5 * (model(x) - y).pow(2).sum(1).mean()


WORKLOADS = {"gpt": gpt_workload, "mlp": mlp_workload}


def operations(work: Workload, impl: ModuleType, iters: int,
               tols: tuple[float, ...] = (0.0,)) -> dict[str, Callable[[], object]]:
    """The measured operations on one workload: a training step and one ``lambda_max`` per tolerance
    (``lambda_max`` alone for ``tol=0``, ``lambda_max@<tol>`` otherwise)."""
    model, opt, loss_fn = work
    params = [p for p in model.parameters() if p.requires_grad]

    def train_step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn().backward()
        opt.step()

    def lam(tol: float) -> Callable[[], object]:
        return lambda: impl.lambda_max(loss_fn, params, iters=iters, tol=tol, seed=0)

    return {"train_step": train_step, **{lam_name(t): lam(t) for t in tols}}


def lam_name(tol: float) -> str:
    return "lambda_max" if tol == 0 else f"lambda_max@{tol:g}"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rss_now() -> int | None:
    """Current resident set size in bytes (Linux), None elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def max_rss() -> int:
    """Peak resident set size so far in bytes (``ru_maxrss`` is KiB on Linux, bytes on macOS)."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


class PeakRSS:
    """Peak resident set size above the one at entry, while inside the ``with`` block."""

    def __init__(self, period_s: float = 2e-4):
        self.period_s = period_s
        self.delta = 0
        self._stop = threading.Event()

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_now() or 0)
            time.sleep(self.period_s)

    def __enter__(self) -> PeakRSS:
        self.start = rss_now()
        self.max0 = max_rss()
        self.peak = self.start or 0
        if self.start is not None:
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.start is None:
            self.delta = max_rss() - self.max0
            return
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_now() or 0)
        self.delta = self.peak - self.start


def child(args: argparse.Namespace) -> None:
    """Run one operation once on a fresh workload; print its memory as one JSON line."""
    device = torch.device(args.device)
    impl = load_impl(args.impl)
    workload, op_name = args.child
    op = operations(WORKLOADS[workload](args, device), impl, args.iters, tuple(args.tol))[op_name]
    sync(device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        dev0 = torch.cuda.memory_allocated(device)
    tracemalloc.start()
    with PeakRSS() as rss:
        op()
        sync(device)
    py_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    out = {"rss_peak_delta": rss.delta, "py_peak": py_peak,
           "device_peak_delta": torch.cuda.max_memory_allocated(device) - dev0 if cuda else None}
    print(json.dumps(out))


def memory(args: argparse.Namespace, workload: str, op: str) -> dict:
    """Memory of one operation, measured in a fresh child process."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", workload, op, *child_args(args)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def child_args(args: argparse.Namespace) -> list[str]:
    out = ["--device", args.device, "--iters", str(args.iters), "--tol", *map(repr, args.tol),
           "--n-layer", str(args.n_layer),
           "--n-embd", str(args.n_embd), "--block", str(args.block), "--batch", str(args.batch),
           "--mlp-width", str(args.mlp_width), "--mlp-batch", str(args.mlp_batch)]
    return out + (["--impl", args.impl] if args.impl else [])


def timing(args: argparse.Namespace, workload: str, impl: ModuleType) -> dict[str, float]:
    """Median seconds of each operation over interleaved repeats, after one warm-up each."""
    device = torch.device(args.device)
    work = WORKLOADS[workload](args, device)
    ops = operations(work, impl, args.iters, tuple(args.tol))
    times: dict[str, list[float]] = {k: [] for k in ops}
    hvps: dict[str, int] = {}
    for name, fn in ops.items():
        res = fn()
        if name != "train_step":  # the same seed every time: the same number of HVPs
            hvps[name] = int(res.iters)
    for _ in range(args.repeats):
        for name, fn in ops.items():
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - t0)
    n_params = sum(p.numel() for p in work[0].parameters() if p.requires_grad)
    return {"params": n_params, "hvps": hvps, **{k: statistics.median(v) for k, v in times.items()}}


def mib(b: float | None) -> str:
    return "-" if b is None else f"{b / 2**20:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impl", default="", help="curvature module file to measure instead of the package's")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--iters", type=int, default=20, help="Hessian-vector products per lambda_max")
    ap.add_argument("--tol", type=float, nargs="+", default=[0.0],
                    help="tolerances, one lambda_max row each (0: spend all --iters)")
    ap.add_argument("--repeats", type=int, default=7, help="interleaved timed repeats")
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--mlp-width", type=int, default=256)
    ap.add_argument("--mlp-batch", type=int, default=128)
    ap.add_argument("--only", choices=sorted(WORKLOADS), help="one workload only")
    ap.add_argument("--child", nargs=2, metavar=("WORKLOAD", "OP"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    impl = load_impl(args.impl)
    print(f"implementation: {args.impl or impl.__name__}; device {args.device}; torch threads "
          f"{torch.get_num_threads()}; lambda_max: at most {args.iters} HVPs, tol "
          f"{', '.join(f'{t:g}' for t in args.tol)}; median of {args.repeats}")
    print(f"{'workload':<9}{'params':>9}{'tol':>8}{'HVPs':>6}{'step ms':>10}{'lambda_max ms':>15}{'x step':>8}"
          f"{'x first tol':>12}{'step RSS MiB':>14}{'lambda RSS MiB':>16}{'lambda py MiB':>15}{'lambda dev MiB':>16}")
    for name in [args.only] if args.only else list(WORKLOADS):
        t = timing(args, name, impl)
        m_step = memory(args, name, "train_step")
        first = t[lam_name(args.tol[0])]
        for tol in args.tol:
            op = lam_name(tol)
            m_lam = memory(args, name, op)
            print(f"{name:<9}{t['params']:>9}{tol:>8g}{t['hvps'][op]:>6}{t['train_step'] * 1e3:>10.2f}"
                  f"{t[op] * 1e3:>15.1f}{t[op] / t['train_step']:>8.1f}{t[op] / first:>12.2f}"
                  f"{mib(m_step['rss_peak_delta']):>14}{mib(m_lam['rss_peak_delta']):>16}{mib(m_lam['py_peak']):>15}"
                  f"{mib(m_lam['device_peak_delta']):>16}")


if __name__ == "__main__":
    main()
