"""The measuring half of ``benchmarks/gpu_check.sh``: the paper-profile GPT with the Monitor, and the table.

On the device the training loop runs on (CUDA when present, else the CPU with a smaller batch
and fewer steps, so that the script keeps working): the step time with the Monitor off, on
with ``every=1`` (exact), and on with ``memory="sketch"``, in interleaved repeats (median of
the per-repeat ratios to "off"); host synchronisations per step counted under
``torch.cuda.set_sync_debug_mode("warn")`` (one warning per synchronising call), with the
Monitor minus without it; the Monitor's device memory (``Monitor.memory_bytes``) and, on CUDA,
the peak allocated memory of a step above the loop without the Monitor, as a share of the
parameter bytes. ``--junit`` adds the counts of the CUDA tests' pytest run. Writes one table
(markdown) to stdout and to ``--out``.

    python benchmarks/gpu_check.py [--junit report.xml] [--out table.md]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
import xml.etree.ElementTree as ET

import torch

from stabstudy.hparams import GPTHParams, defaults
from stabstudy.instruments.telemetry import Monitor
from stabstudy.learners import lm
from stabstudy.learners.gpt import GPT

TARGETS = {"every=1": 1.05}  # median step-time ratio to "off"
MEMORY_TARGET = 0.05  # sketch mode: Monitor memory / parameter bytes


def workload(device: torch.device, batch: int, block: int):
    hp = {**defaults(GPTHParams), "n_layer": 6, "n_embd": 384, "n_head": 6, "block_size": block}
    torch.manual_seed(0)
    model = GPT(lm.model_config(hp)).to(device)
    opt = lm.make_optimizer(model, hp)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (batch, block), generator=g).to(device)
    y = torch.randint(0, 256, (batch, block), generator=g).to(device)
    return model, opt, x, y


def step(model, opt, x, y, mon=None):
    opt.zero_grad(set_to_none=True)
    loss = model(x, y).loss
    loss.backward()
    opt.step()
    if mon is not None:
        mon.log(loss=loss.detach())


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(device: torch.device, batch: int, block: int, steps: int, repeats: int) -> dict:
    model, opt, x, y = workload(device, batch, block)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    variants = {"off": None, "every=1": {}, "sketch": {"memory": "sketch"}}
    for _ in range(2):  # warm-up: kernels, allocator, Adam state
        step(model, opt, x, y)
    times: dict[str, list[float]] = {v: [] for v in variants}
    syncs, mem, peak = {}, {}, {}
    for rep in range(repeats):
        order = list(variants)[rep % 3:] + list(variants)[:rep % 3]
        for v in order:
            kw = variants[v]
            mon = Monitor(model, opt, **kw) if kw is not None else None
            step(model, opt, x, y, mon)  # the Monitor's buffers are built on its first step
            sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            t0 = time.perf_counter()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if device.type == "cuda":
                    torch.cuda.set_sync_debug_mode("warn")
                try:
                    for _ in range(steps):
                        step(model, opt, x, y, mon)
                finally:
                    if device.type == "cuda":
                        torch.cuda.set_sync_debug_mode(0)
            sync(device)
            times[v].append((time.perf_counter() - t0) / steps)
            if rep == 0:
                syncs[v] = sum("synchroniz" in str(w.message) for w in caught) / steps
                if device.type == "cuda":
                    peak[v] = torch.cuda.max_memory_allocated(device) - base
            if mon is not None:
                mem[v] = mon.memory_bytes()
                mon.to_dataset()
                mon.close()
    ratios = {v: statistics.median(t / o for t, o in zip(times[v], times["off"], strict=True)) for v in variants}
    return {"param_bytes": param_bytes, "ms": {v: 1e3 * statistics.median(times[v]) for v in variants},
            "ratio": ratios, "syncs": syncs, "mem": mem, "peak": peak,
            "params": sum(p.numel() for p in model.parameters())}


def junit_counts(path: str) -> dict[str, int]:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    out = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for s in suites:
        for k in out:
            out[k] += int(s.get(k, 0))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--junit", help="pytest --junitxml report of the CUDA tests")
    ap.add_argument("--out", help="also write the table here")
    ap.add_argument("--steps", type=int, default=0, help="steps per repeat (default: 30 on CUDA, 2 on CPU)")
    ap.add_argument("--repeats", type=int, default=0, help="repeats (default: 7 on CUDA, 2 on CPU)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    batch, block = (32, 256) if cuda else (2, 256)
    steps = args.steps or (30 if cuda else 2)
    repeats = args.repeats or (7 if cuda else 2)
    if not cuda:
        torch.set_num_threads(1)
    r = measure(device, batch, block, steps, repeats)
    name = torch.cuda.get_device_name(device) if cuda else "CPU (no CUDA: smaller batch, the CUDA checks skipped)"
    lines = [f"# GPU check: {name}, torch {torch.__version__}",
             "", f"paper-profile GPT, {r['params']} params, batch {batch}x{block}, {steps} steps x {repeats} repeats",
             "", "| check | measured | target | verdict |", "|---|---|---|---|"]
    if args.junit:
        c = junit_counts(args.junit)
        ran = c["tests"] - c["skipped"]
        bad = c["failures"] + c["errors"]
        verdict = "not tested (no CUDA)" if ran == 0 else ("met" if bad == 0 else "MISSED")
        lines.append(f"| CUDA tests (no-host-sync included) | {ran} ran, {bad} failed, {c['skipped']} skipped "
                     f"| all pass | {verdict} |")
    for v in ("every=1", "sketch"):
        tgt = TARGETS.get(v)
        verdict = "" if tgt is None else ("met" if r["ratio"][v] <= tgt else "MISSED")
        lines.append(f"| step time, Monitor {v} / off | x{r['ratio'][v]:.3f} ({r['ms'][v]:.1f} vs "
                     f"{r['ms']['off']:.1f} ms) | {f'<= x{tgt:.2f}' if tgt else '(stated)'} | {verdict} |")
    for v in ("every=1", "sketch"):
        if cuda:
            extra = r["syncs"][v] - r["syncs"]["off"]
            lines.append(f"| host syncs per step, Monitor {v} (minus off) | {extra:g} | 0 | "
                         f"{'met' if extra == 0 else 'MISSED'} |")
        else:
            lines.append(f"| host syncs per step, Monitor {v} | not measured on the CPU | 0 | not tested (no CUDA) |")
    for v in ("every=1", "sketch"):
        frac = r["mem"][v] / r["param_bytes"]
        tgt = MEMORY_TARGET if v == "sketch" else None
        verdict = "" if tgt is None else ("met" if frac <= tgt else "MISSED")
        lines.append(f"| Monitor memory, {v} (memory_bytes / param bytes) | {frac:.1%} | "
                     f"{f'<= {tgt:.0%}' if tgt else '(stated)'} | {verdict} |")
        if cuda:
            pf = (r["peak"][v] - r["peak"]["off"]) / r["param_bytes"]
            lines.append(f"| peak allocated above off, {v} / param bytes | {pf:.1%} | "
                         f"{f'<= {tgt:.0%}' if tgt else '(stated)'} | "
                         f"{'' if tgt is None else ('met' if pf <= tgt else 'MISSED')} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
