"""The Monitor's low-memory mode (``memory="sketch"``) against the exact mode: memory and channel error.

One training run per workload (a GPT as the ``lm`` learner builds it, AdamW, the stdlib corpus)
carries an exact Monitor and sketch Monitors of each ``--k`` on the same optimizer, so every
Monitor sees the same steps. Per workload and k the table gives the Monitor's own device memory
(``Monitor.memory_bytes``: flat rows or sketches, and the device block) as a share of the
parameter bytes, and the error against the exact mode over the measured steps: median and
maximum |error| of the cosines (``xgrad``, ``update_grad_cos``), median and maximum relative
error of ``update_norm``, and the largest relative error of the channels meant to stay exact
(``grad_norm``, ``update_ratio``'s denominator, Adam's three). Targets: memory <= 5% of the
parameter bytes at every=1, |cos error| <= 0.02 at k = 4096 (the median; the maximum is stated
beside it). ``--paper`` adds the paper-profile GPT (6 x 384, block 256).

    OMP_NUM_THREADS=1 python benchmarks/sketch_accuracy.py [--steps 30] [--k 4096 16384] [--paper]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from stabstudy.hparams import GPTHParams, defaults
from stabstudy.instruments.telemetry import Monitor
from stabstudy.learners import lm
from stabstudy.learners.corpus import get_batch, load_corpus
from stabstudy.learners.gpt import GPT

MEMORY_TARGET = 0.05
COS_TARGET = 0.02  # at k = 4096


def run(name: str, n_layer: int, n_embd: int, block: int, batch: int, steps: int, ks: list[int]) -> list[dict]:
    hp = {**defaults(GPTHParams), "n_layer": n_layer, "n_embd": n_embd, "n_head": max(n_embd // 64, 1),
          "block_size": block, "batch_size": batch}
    corpus = load_corpus("stdlib", 2_000_000, 0.1)
    torch.manual_seed(0)
    model = GPT(lm.model_config(hp))
    opt = lm.make_optimizer(model, hp)
    mons = {"exact": Monitor(model, opt)}
    for k in ks:
        mons[k] = Monitor(model, opt, memory="sketch", sketch_dim=k)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x, y = get_batch(corpus.train, batch, block, g)
        opt.zero_grad(set_to_none=True)
        model(x, y).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    dss = {key: m.to_dataset() for key, m in mons.items()}
    mem = {key: m.memory_bytes() for key, m in mons.items()}
    for m in mons.values():
        m.close()
    ex = dss["exact"]
    rows = []
    for key in ["exact", *ks]:
        ds = dss[key]
        row = {"workload": name, "params": sum(p.numel() for p in model.parameters()), "k": key,
               "mem_frac": mem[key] / param_bytes}
        for ch in ("xgrad", "update_grad_cos"):
            err = np.abs(ds[ch].values - ex[ch].values)
            row[ch] = (np.nanmedian(err), np.nanmax(err))
        rel = np.abs(ds.update_norm.values / ex.update_norm.values - 1)
        row["update_norm"] = (np.nanmedian(rel), np.nanmax(rel))
        exact_chs = ("grad_norm", "adam_m_norm", "adam_v_mean", "adam_eps_frac")
        den = ds.update_norm / ds.update_ratio, ex.update_norm / ex.update_ratio
        rels = [np.nanmax(np.abs(ds[c].values / ex[c].values - 1)) for c in exact_chs if np.any(ex[c].values)]
        rels.append(np.nanmax(np.abs(den[0].values / den[1].values - 1)))
        row["exact_rel"] = max(rels)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30, help="training steps per workload (all measured)")
    ap.add_argument("--k", type=int, nargs="+", default=[4096, 16384], help="sketch dimensions")
    ap.add_argument("--paper", action="store_true", help="add the paper-profile GPT (6 x 384, block 256)")
    ap.add_argument("--paper-steps", type=int, default=8)
    ap.add_argument("--paper-batch", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = run("gpt-small", 2, 64, 64, 16, args.steps, args.k)
    if args.paper:
        rows += run("gpt-paper", 6, 384, 256, args.paper_batch, args.paper_steps, args.k)
    print(f"torch {torch.__version__}; {args.steps} steps (paper: {args.paper_steps}); every=1; errors against the "
          "exact mode over the measured steps (median / max)")
    print(f"{'workload':<10}{'params':>10}{'k':>7}{'memory/params':>15}{'|xgrad err|':>18}{'|cos(u,-g) err|':>18}"
          f"{'update_norm rel':>18}{'exact chs rel':>15}")
    for r in rows:
        def pair(v, exact=r["k"] == "exact"):
            return "" if exact else f"{v[0]:.4f} / {v[1]:.4f}"
        print(f"{r['workload']:<10}{r['params']:>10}{r['k']!s:>7}{r['mem_frac']:>14.1%} {pair(r['xgrad']):>18}"
              f"{pair(r['update_grad_cos']):>18}{pair(r['update_norm']):>18}{r['exact_rel']:>15.1e}")
    print(f"targets: sketch memory <= {MEMORY_TARGET:.0%} of the parameter bytes; |cos error| <= {COS_TARGET} "
          "(median) at k = 4096")
    for r in rows:
        if r["k"] == "exact":
            continue
        mem_ok = "met" if r["mem_frac"] <= MEMORY_TARGET else "MISSED"
        line = f"  {r['workload']:<10} k={r['k']:<6} memory {r['mem_frac']:.1%} {mem_ok}"
        if r["k"] == 4096:
            worst = max(r["xgrad"][0], r["update_grad_cos"][0])
            line += f"; cos median {worst:.4f} {'met' if worst <= COS_TARGET else 'MISSED'}"
            line += f" (max {max(r['xgrad'][1], r['update_grad_cos'][1]):.4f})"
        print(line)


if __name__ == "__main__":
    main()
