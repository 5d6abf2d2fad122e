"""Cost of the telemetry Monitor and of one lambda_max measurement, side by side;
then our lambda_max against PyHessian's power iteration.

Two training loops -- a small GPT (``stabstudy.learners.gpt.GPT``, AdamW, as in ``stabstudy.learners.lm``)
and the toy tanh MLP (``stabstudy.learners.toy.MLP``, Adam, MSE) -- each run with the Monitor
off, on with ``every=1`` and on with ``every=10``, on with ``every=1`` but without the read of the
gradient at the end of each backward pass that gives ``grad_norm`` before clipping
(``before_clip=False``: what the Monitor cost before it read that), and a floor: a pre-hook that
only reads every gradient once (``torch._foreach_norm``), the least a per-step ``grad_norm`` costs
(``GradReadOnly``). The variants share one model and
optimizer per workload (separate instances differ by a few percent in speed by themselves)
and are timed in interleaved repeats whose order rotates, so that load from other processes
hits them alike; the table shows the median time per training step and the median, with
quartiles, of the per-repeat ratios to "off". ``--paper-gpt`` adds the paper-profile model
(6x384, 32x256 tokens per step; ``--paper-steps`` / ``--paper-repeats``, no lambda_max row).
The time spent inside the Monitor's hooks is shown too: a low-noise lower bound of its cost
(it misses the cache misses it causes the rest of the step, and the warm caches it leaves
the optimizer). A storage table gives the Monitor's memory per row (tracemalloc) and the
time of ``to_dataset``, for one and three optimizers. Then one ``lambda_max`` measurement (the default Lanczos, ``tol=0`` so it spends its whole
budget of 20 Hessian-vector products, on one batch) is timed and expressed in
training-step equivalents.

Second table (curvature): on each workload's freshly initialized model (seed 0) and first
batch, the top Hessian eigenvalue by our ``curvature.lambda_max`` with ``method="lanczos"``
(ARPACK, largest algebraic eigenvalue) and ``method="power"`` (power iteration, plus a
shifted pass when the dominant eigenvalue is negative; ``--curv-iters`` HVPs per pass),
both with ``tol=--curv-tol``, and by PyHessian's ``hessian(...).eigenvalues(maxIter, tol)``
(Yao et al. 2020; a dev dependency, ``pip install -e '.[dev]'``). PyHessian runs plain
power iteration, so it returns the eigenvalue of largest *magnitude*, which may be a
negative one. It does not report its iteration count: the HVPs are counted by wrapping its
``hessian_vector_product`` (one ``torch.autograd.grad`` each). Wall times include building
the gradient graph; the GPT goes to PyHessian through a thin module that returns its logits,
with a criterion computing the loss as ``GPT.forward`` does. Two reference rows (our Lanczos
to ``tol=1e-8``: the top eigenvalue, and the bottom one from ``-loss``) show which value
is right. If PyHessian is missing or fails, its row says why and the rest still prints.

    OMP_NUM_THREADS=1 python benchmarks/telemetry_overhead.py [--steps 20] [--repeats 7] [--paper-gpt]
    OMP_NUM_THREADS=1 python benchmarks/telemetry_overhead.py --only-overhead --repeats 21
    OMP_NUM_THREADS=1 python benchmarks/telemetry_overhead.py --only-curvature
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from stabstudy.hparams import GPTHParams, defaults
from stabstudy.instruments import curvature
from stabstudy.instruments.telemetry import TELEMETRY_VERSION, Monitor
from stabstudy.learners import lm, toy
from stabstudy.learners.gpt import GPT

# (label, every, Monitor arguments): the Monitor with every=1 and every=10, every=1 without the
# read of the gradient at the end of each backward pass (grad_norm before clipping), and the floor
# (GradReadOnly)
VARIANTS = (("off", 0, {}), ("every=1", 1, {}), ("every=10", 10, {}),
            ("every=1, no bwd read", 1, {"before_clip": False}), ("floor: read grads", -1, {}))


#: targets (the scale issue's): median ratio of the step time with the Monitor to the step time without it
TARGETS = {("gpt", "every=1"): 1.03, ("gpt", "every=10"): 1.015, ("mlp", "every=1"): 1.15, ("mlp", "every=10"): 1.08}


class GradReadOnly:
    """The least any per-step gradient channel costs: a pre-hook that reads every gradient once
    (per-tensor norms by ``torch._foreach_norm``, their squared sum into a 0-d tensor, no host
    read). A floor for the Monitor's per-step cost, not a monitor; it has the attributes
    ``bench`` uses (``cost().hook_s`` timed like the Monitor's, ``log``, ``close``)."""

    def __init__(self, opt: torch.optim.Optimizer):
        self.params = [p for g in opt.param_groups for p in g["params"]]
        self.g2 = torch.zeros(())
        self.hook_s = 0.0
        self.handle = opt.register_step_pre_hook(self._hook)

    def _hook(self, opt, args, kwargs) -> None:
        t0 = time.perf_counter()
        norms = torch.stack(torch._foreach_norm([p.grad for p in self.params]))
        torch.dot(norms, norms, out=self.g2)
        self.hook_s += time.perf_counter() - t0

    def cost(self) -> SimpleNamespace:
        return SimpleNamespace(hook_s=self.hook_s)

    def log(self, **scalars) -> None:
        pass

    def close(self) -> None:
        self.handle.remove()


def gpt_workload(args):
    n_head = getattr(args, "n_head", None) or max(args.n_embd // 32, 1)
    hp = {**defaults(GPTHParams), "n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": n_head, "block_size": args.block}
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 256, (args.batch, args.block), generator=g),
                torch.randint(0, 256, (args.batch, args.block), generator=g)) for _ in range(args.steps)]

    def make():
        torch.manual_seed(0)
        model = GPT(lm.model_config(hp))
        return model, lm.make_optimizer(model, hp)

    def loss_of(model, x, y):
        return model(x, y).loss

    def for_pyhessian(model):
        return GPTLogits(model), gpt_criterion(model.cfg.z_loss)

    return make, loss_of, batches, for_pyhessian


class GPTLogits(nn.Module):
    """The GPT as PyHessian wants it: ``forward(inputs)`` returns the logits only."""

    def __init__(self, gpt: GPT):
        super().__init__()
        self.gpt = gpt

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.gpt(idx).logits


def gpt_criterion(z_loss: float):
    """``criterion(logits, targets)``: the loss exactly as ``GPT.forward`` computes it."""

    def criterion(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        flat = logits.float().view(-1, logits.size(-1))
        ce = F.cross_entropy(flat, targets.reshape(-1))
        return ce + z_loss * torch.logsumexp(flat, dim=-1).pow(2).mean() if z_loss else ce

    return criterion


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

    def criterion(out, y):
        return 0.5 * (out - y).pow(2).sum(1).mean()

    def loss_of(model, x, y):
        return criterion(model(x), y)

    def for_pyhessian(model):
        return model, criterion

    return make, loss_of, batches, for_pyhessian


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


def optimizer_share(model, opt, loss_of, batches) -> float:
    """Median fraction of a training step spent in ``opt.step()`` (no Monitor): the part of the
    step that, like a measured Monitor update, streams over parameters, gradients and state."""
    shares = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss_of(model, x, y).backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        shares.append((t2 - t1) / (t2 - t0))
    return statistics.median(shares)


def bench(name, workload, args, *, with_lambda: bool = True) -> list[dict]:
    """Per-step time of each variant on ONE model and optimizer (separate instances differ by a
    few percent in speed on their own, from memory placement), in interleaved repeats whose
    order rotates; each Monitor is attached for its repeat only (one untimed warm-up step
    allocates its buffers) and closed after it. Ratios are paired within a repeat. The time
    spent inside the Monitor's hooks is also accumulated: a low-noise lower bound of its cost
    (it misses the cache misses the Monitor causes the rest of the step)."""
    make, loss_of, batches, _ = workload(args)
    model, opt = make()
    time_steps(model, opt, None, loss_of, batches[:3])  # warm-up: Adam state, allocator
    times: dict[str, list[float]] = {label: [] for label, _, _ in VARIANTS}
    hooks: dict[str, list[float]] = {label: [] for label, _, _ in VARIANTS}
    for rep in range(args.repeats):
        k = rep % len(VARIANTS)
        for label, every, kw in VARIANTS[k:] + VARIANTS[:k]:
            mon = (GradReadOnly(opt) if every < 0 else Monitor(model, opt, every=every, **kw) if every else None)
            hook0 = 0.0
            if mon is not None:
                time_steps(model, opt, mon, loss_of, batches[:1])
                hook0 = mon.cost().hook_s
            times[label].append(time_steps(model, opt, mon, loss_of, batches))
            hooks[label].append((mon.cost().hook_s - hook0) / len(batches) if mon is not None else 0.0)
            if mon is not None:
                mon.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    opt_share = optimizer_share(model, opt, loss_of, batches)
    params = [p for p in model.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)
    rows = []
    for label, _, _ in VARIANTS:
        paired = [t / t0 for t, t0 in zip(times[label], times["off"], strict=True)]
        q1, q2, q3 = statistics.quantiles(paired, n=4) if len(paired) > 1 else (paired[0],) * 3
        hook_ms = statistics.median(hooks[label]) * 1e3
        rows.append({"workload": name, "variant": label, "params": n_params, "ms_per_step": med[label] * 1e3,
                     "ratio": q2, "ratio_iqr": (q1, q3), "hook_ms": hook_ms,
                     "hook_frac": hook_ms / (med["off"] * 1e3), "opt_share": opt_share})
    if with_lambda:  # one lambda_max measurement (fixed 20 HVPs: tol=0) on the first batch
        x, y = batches[0]
        lam_t = statistics.median(
            curvature.lambda_max(lambda: loss_of(model, x, y), params, iters=20, tol=0.0, seed=0).wall_s
            for _ in range(max(args.repeats // 2, 1)))
        rows.append({"workload": name, "variant": "lambda_max (20 HVP)", "params": n_params,
                     "ms_per_step": lam_t * 1e3, "ratio": lam_t / med["off"]})
    return rows


def storage_cost(rows: int = 20000) -> list[dict]:
    """Python/numpy memory the Monitor keeps per row (tracemalloc; torch's own buffers are
    not counted and do not grow) and the time of ``to_dataset``, for one optimizer and for
    three (as SAC), with ``every=1`` and ``every=10``. Steps are driven with tiny
    parameters so that only the storage differs from a real run."""
    import tracemalloc

    out = []
    for n_opt in (1, 3):
        for every in (1, 10):
            params = [torch.nn.Parameter(torch.zeros(4)) for _ in range(n_opt)]
            opts = {f"o{i}": torch.optim.Adam([p], lr=1e-3) for i, p in enumerate(params)}
            mon = Monitor(None, opts, every=every)
            tracemalloc.start()
            base = tracemalloc.get_traced_memory()[0]
            for _ in range(rows):
                for p, o in zip(params, opts.values(), strict=True):
                    p.grad = torch.ones(4)
                    o.step()
                mon.log(loss=1.0)
            held = tracemalloc.get_traced_memory()[0] - base
            tracemalloc.stop()
            t0 = time.perf_counter()
            ds = mon.to_dataset()
            t_ds = time.perf_counter() - t0
            assert ds.sizes["step"] == rows
            mon.close()
            out.append({"optimizers": n_opt, "every": every, "bytes_per_row": held / rows, "to_dataset_s": t_ds})
    return out


def pyhessian_top(model, criterion, x, y, *, max_iter: int, tol: float, seed: int = 0) -> tuple[float, int, float]:
    """PyHessian's top eigenvalue (largest magnitude), HVPs it used, wall time (s, graph build included)."""
    import pyhessian

    mod = sys.modules["pyhessian.hessian"]  # the module (the package rebinds ``hessian`` to the class)
    orig = mod.hessian_vector_product
    calls = 0

    def counting(*a, **kw):
        nonlocal calls
        calls += 1
        return orig(*a, **kw)

    was_training = model.training
    for p in model.parameters():  # it backpropagates into .grad: start from none
        p.grad = None
    torch.manual_seed(seed)  # its starting vector comes from the global generator
    mod.hessian_vector_product = counting
    try:
        t0 = time.perf_counter()
        with sdpa_kernel([SDPBackend.MATH]), warnings.catch_warnings():  # math kernel as in our gradient_graph
            # (fused attention has no double backward); its backward(create_graph=True) warns of a
            # reference cycle, which the finally clause below breaks
            warnings.filterwarnings("ignore", message="Using backward.. with create_graph=True")
            h = pyhessian.hessian(model, criterion, data=(x, y), cuda=False)
        vals, _ = h.eigenvalues(maxIter=max_iter, tol=tol, top_n=1)
        wall = time.perf_counter() - t0
    finally:
        mod.hessian_vector_product = orig
        for p in model.parameters():  # drop the create_graph gradients (a reference cycle)
            p.grad = None
        model.train(was_training)
    return float(vals[0]), calls, wall


def compare_curvature(name, workload, args) -> list[dict]:
    """Our lambda_max (lanczos, power) and PyHessian's, on one fresh model and its first batch."""
    make, loss_of, batches, for_pyhessian = workload(args)
    model, _ = make()
    x, y = batches[0]
    params = [p for p in model.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)
    rows = []
    for method in ("lanczos", "power"):
        runs = [curvature.lambda_max(lambda: loss_of(model, x, y), params, iters=args.curv_iters,
                                     tol=args.curv_tol, seed=0, method=method)
                for _ in range(args.curv_repeats)]
        r = runs[0]
        rows.append({"workload": name, "method": f"ours {method}", "params": n_params, "value": r.value,
                     "hvps": r.iters, "converged": "yes" if r.converged else "no",
                     "wall_ms": statistics.median(q.wall_s for q in runs) * 1e3})
    row = {"workload": name, "method": "pyhessian power", "params": n_params}
    try:
        ph_model, criterion = for_pyhessian(model)
        with torch.no_grad():
            a, b = float(criterion(ph_model(x), y)), float(loss_of(model, x, y))
        if abs(a - b) > 1e-6 * max(abs(b), 1.0):
            raise RuntimeError(f"criterion(model(x), y) = {a} differs from our loss {b}")
        runs = [pyhessian_top(ph_model, criterion, x, y, max_iter=args.curv_iters, tol=args.curv_tol)
                for _ in range(args.curv_repeats)]
        value, calls, _ = runs[0]
        row.update(value=value, hvps=calls,
                   converged="yes" if calls < args.curv_iters else "no (budget spent)",
                   wall_ms=statistics.median(q[2] for q in runs) * 1e3)
    except Exception as e:  # import or run-time failure: report it, keep the table
        row.update(value=float("nan"), hvps=0, converged="-", wall_ms=float("nan"),
                   error=f"{type(e).__name__}: {e}")
    rows.append(row)
    # references: Lanczos run to tol 1e-8 for the top eigenvalue, and for the bottom one (of -loss)
    for label, sign in (("ref lambda_max", 1.0), ("ref lambda_min", -1.0)):
        r = curvature.lambda_max(lambda s=sign: s * loss_of(model, x, y), params, iters=args.ref_iters, tol=1e-8,
                                 seed=1)
        rows.append({"workload": name, "method": label, "params": n_params, "value": sign * r.value,
                     "hvps": r.iters, "converged": "yes" if r.converged else "no", "wall_ms": r.wall_s * 1e3})
    lanczos, ref = rows[0]["value"], rows[3]["value"]
    for r in rows:
        r["rel_lanczos"] = (r["value"] - lanczos) / abs(lanczos) if lanczos else float("nan")
        r["rel_ref"] = (r["value"] - ref) / abs(ref) if ref else float("nan")
    return rows


def print_curvature(rows, args) -> None:
    print(f"\ntop Hessian eigenvalue on the first batch, fresh model (seed 0): tol={args.curv_tol:g}, "
          f"at most {args.curv_iters} HVPs (ours power: per pass); wall: median of {args.curv_repeats}")
    print(f"ref: our Lanczos to tol 1e-8 (at most {args.ref_iters} HVPs), top eigenvalue and, from -loss, "
          f"the bottom one; timed once")
    print(f"{'workload':<9}{'method':<17}{'params':>9}{'value':>11}{'HVPs':>6}{'wall ms':>10}"
          f"{'rel diff to':>13}{'rel diff to':>13}  converged")
    print(f"{'':<63}{'lanczos':>13}{'ref max':>13}")
    for r in rows:
        print(f"{r['workload']:<9}{r['method']:<17}{r['params']:>9}{r['value']:>11.5g}{r['hvps']:>6}"
              f"{r['wall_ms']:>10.1f}{r['rel_lanczos']:>+13.2e}{r['rel_ref']:>+13.2e}  {r['converged']}")
        if "error" in r:
            print(f"{'':<9}  PyHessian failed, not compared: {r['error']}")


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
    ap.add_argument("--paper-gpt", action="store_true",
                    help="also time the paper-profile GPT (6x384, 6 heads, 32x256 tokens; ~6 s per step on one core)")
    ap.add_argument("--paper-steps", type=int, default=2, help="steps per timed repeat of --paper-gpt")
    ap.add_argument("--paper-repeats", type=int, default=3, help="repeats of --paper-gpt")
    ap.add_argument("--storage-rows", type=int, default=20000, help="rows of the storage measurement")
    ap.add_argument("--only-curvature", action="store_true", help="skip the overhead table")
    ap.add_argument("--only-overhead", action="store_true", help="skip the lambda_max rows and the curvature table")
    ap.add_argument("--curv-iters", type=int, default=100, help="HVP budget of each eigensolver")
    ap.add_argument("--curv-tol", type=float, default=1e-3, help="tolerance of each eigensolver")
    ap.add_argument("--curv-repeats", type=int, default=3, help="timed repeats of each eigensolver")
    ap.add_argument("--ref-iters", type=int, default=300, help="HVP budget of the tol=1e-8 reference runs")
    args = ap.parse_args()
    if not args.only_curvature:
        lam = not args.only_overhead
        rows = bench("gpt", gpt_workload, args, with_lambda=lam) + bench("mlp", mlp_workload, args, with_lambda=lam)
        if args.paper_gpt:
            paper = argparse.Namespace(**{**vars(args), "n_layer": 6, "n_embd": 384, "n_head": 6, "block": 256,
                                          "batch": 32, "steps": args.paper_steps, "repeats": args.paper_repeats})
            rows += bench("gpt-paper", gpt_workload, paper, with_lambda=False)
        print_overhead(rows, args)
        print(f"\nMonitor storage ({args.storage_rows} rows; tracemalloc, torch buffers not counted)")
        print(f"{'optimizers':>10}{'every':>7}{'bytes/row':>11}{'to_dataset s':>14}")
        for r in storage_cost(args.storage_rows):
            print(f"{r['optimizers']:>10}{r['every']:>7}{r['bytes_per_row']:>11.0f}{r['to_dataset_s']:>14.3f}")
    if args.only_overhead:
        return
    print_curvature(compare_curvature("gpt", gpt_workload, args) + compare_curvature("mlp", mlp_workload, args),
                    args)


def print_overhead(rows, args) -> None:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); {args.repeats} interleaved repeats of "
          f"{args.steps} steps on one model per workload; ms/step: median; ratio: median of the per-repeat ratios "
          f"to off [quartiles] (timings include other processes' load)")
    print("in hooks: median time inside the Monitor's hooks per step, and as a fraction of the 'off' step")
    print(f"telemetry implementation: {TELEMETRY_VERSION}")
    print(f"{'workload':<11}{'variant':<21}{'params':>9}{'ms/step':>10}{'ratio to off':>14}{'quartiles':>18}"
          f"{'in hooks ms':>13}{'fraction':>10}")
    for r in rows:
        if r["variant"].startswith("lambda"):
            tail = "x (step equivalents)"
        else:
            lo, hi = r["ratio_iqr"]
            tail = f"x  [{lo:.3f}, {hi:.3f}]{r['hook_ms']:>13.3f}{100 * r['hook_frac']:>9.1f}%"
        print(f"{r['workload']:<11}{r['variant']:<21}{r['params']:>9}{r['ms_per_step']:>10.1f}{r['ratio']:>13.3f}"
              f"{tail}")
    shares = {r["workload"]: r["opt_share"] for r in rows if "opt_share" in r}
    print("opt.step() share of a training step without the Monitor (median): "
          + ", ".join(f"{w} {100 * v:.0f}%" for w, v in shares.items()))
    print(f"load average at the end (1, 5, 15 min): {', '.join(f'{v:.1f}' for v in os.getloadavg())} "
          f"on {os.cpu_count()} cores")
    print("targets (median ratio): " + ", ".join(f"{w} {v} <= x{t:.3f}" for (w, v), t in TARGETS.items()))
    for w in shares:
        got = {r["variant"]: r for r in rows if r["workload"] == w}

        def verdict(v: str, w: str = w, got: dict = got) -> str:
            t = TARGETS.get((w, v))
            return "" if t is None else (" met" if got[v]["ratio"] <= t else " MISSED")

        verdicts = [f"{v}{verdict(v)} (x{got[v]['ratio']:.3f}, {100 * got[v]['hook_frac']:.1f}% in hooks)"
                    for v in ("every=1", "every=10")]
        floor = got["floor: read grads"]
        print(f"  {w:<10}" + "; ".join(verdicts) + f"; floor, one read of the gradient: {100 * floor['hook_frac']:.1f}%"
              f" in hooks, x{floor['ratio']:.3f}")


if __name__ == "__main__":
    main()
