"""Cost of one online update of each early-warning detector, relative to one small-GPT training step.

A controller would call ``detector.update`` once per optimizer step, so the number that matters is
the update's time over the step's. The step is notebook 04's quick-profile GPT (2 layers, width 64,
16 x 64 tokens) with the telemetry Monitor attached, on one thread as on a study worker; the
detectors are notebook 04's suite plus the meta-state (one :class:`MetaState` update feeds T^2, Q
and coordination), each fed a warm-up stream first so that every window is full. Target: a
meta-state update costs at most 1% of a step.

    OMP_NUM_THREADS=1 python benchmarks/detector_cost.py [--steps 30] [--updates 2000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from stabstudy.analysis.warning import evaluation as E
from stabstudy.analysis.warning.metastate import fit_pca, replay
from stabstudy.hparams import GPTHParams, defaults
from stabstudy.instruments.telemetry import Monitor
from stabstudy.learners import lm
from stabstudy.learners.corpus import get_batch, load_corpus
from stabstudy.learners.gpt import GPT
from stabstudy.online import MetaConfig, MetaState
from stabstudy.online import features as F

KINDS = ("lr_ramp", "lr_spike", "outlier_batch")


def gpt_step_seconds(steps: int) -> float:
    """Median seconds of one training step (forward, backward, AdamW, Monitor hooks)."""
    hp = {**defaults(GPTHParams), "n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64, "batch_size": 16}
    torch.manual_seed(0)
    model = GPT(lm.model_config(hp))
    opt = lm.make_optimizer(model, hp)
    mon = Monitor(model, opt, every=1)
    corpus = load_corpus("stdlib", int(hp["corpus_bytes"]))
    g = torch.Generator().manual_seed(0)
    times = []
    for i in range(steps + 3):
        x, y = get_batch(corpus.train, 16, 64, g)
        t0 = time.perf_counter()
        out = model(x, y, diagnostics=True)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()
        mon.log(loss=float(out.loss.detach()))
        if i >= 3:  # the first steps allocate
            times.append(time.perf_counter() - t0)
    mon.close()
    return statistics.median(times)


def stream(n: int, n_features: int, seed: int = 0) -> np.ndarray:
    """Telemetry-like rows (shape (n, feature)): slow random walks plus noise."""
    rng = np.random.default_rng(seed)
    return np.cumsum(0.02 * rng.standard_normal((n, n_features)), axis=0) + 0.1 * rng.standard_normal((n, n_features))


def per_update_seconds(update, values: np.ndarray, warm: int) -> float:
    """Median seconds of one ``update(v)`` over ``values[warm:]`` (timed in blocks of 50)."""
    for v in values[:warm]:
        update(v)
    blocks = []
    rest = values[warm:]
    for k in range(0, len(rest) - 49, 50):
        t0 = time.perf_counter()
        for v in rest[k:k + 50]:
            update(v)
        blocks.append((time.perf_counter() - t0) / 50)
    return statistics.median(blocks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="timed GPT steps")
    ap.add_argument("--updates", type=int, default=2000, help="timed updates per detector")
    args = ap.parse_args()
    torch.set_num_threads(1)
    step = gpt_step_seconds(args.steps)
    warm = 300
    feats = F.LM_CHANNELS
    x = stream(warm + args.updates, len(feats))
    config = MetaConfig()
    pca = fit_pca(replay(x[:warm], None, config)["zs"][config.window:], feats)
    rows = []
    ms = MetaState(feats, pca, config, KINDS)
    rows.append(("meta-state (T^2, Q, coordination)", per_update_seconds(ms.update, x, warm)))
    for spec in E.suite(KINDS, feats):
        if spec.feature.startswith("meta:"):
            continue
        det = spec.make()
        rows.append((spec.name, per_update_seconds(det.update, np.abs(x[:, 0]) + 0.5, warm)))
    print(f"one small-GPT training step (2 layers, width 64, 16x64 tokens, Monitor on, 1 thread): {step * 1e3:.1f} ms")
    print(f"{'detector':<40} {'us / update':>12} {'% of a step':>12}")
    for name, sec in rows:
        print(f"{name:<40} {sec * 1e6:>12.1f} {100 * sec / step:>11.3f}%")
    meta = rows[0][1] / step
    print(f"meta-state update = {100 * meta:.3f}% of a step: target <= 1% {'met' if meta <= 0.01 else 'NOT met'}")


if __name__ == "__main__":
    main()
