"""Overhead of the learner's stable-baselines3 callbacks on training, side by side.

Same algorithm, env and seed; variants interleaved over repeats, median wall
time per variant, training throughput (gradient updates/s and env steps/s):

* ``plain``        ``model.learn`` without a callback;
* ``callback``     the callbacks of ``stabstudy.learners.rl.learner.callbacks_for`` without the
                   evaluation: ``TelemetryCallback`` (the Monitor on every optimizer,
                   ``every=--monitor-every``), ``PerturbationCallback`` (empty schedule),
                   ``DiagnosticsCallback``, ``DivergenceCallback``, ``EpisodeReturnCallback``;
* ``no-monitor``   the same without ``TelemetryCallback``;
* ``controller``   ``callback`` plus a ``ControllerCallback`` (robust z of the pre-clip gradient
                   norm, ``stabstudy.interventions.control``) whose threshold no step reaches, so it
                   only watches: its cost when no alarm fires.

Evaluation episodes are excluded (they are a measurement, not overhead: the
plain SB3 script would evaluate too). Target: overhead <= 5 %; the controller's over
``callback`` is printed as its own ratio. ``in hooks``: the Monitor's own time per gradient update
(``Monitor.cost``, all optimizers) and its share of plain SB3's wall time, a steadier number than
the ratios on a loaded machine.

Forks (``stabstudy.learners.rl.forks``): the cost of storing and of restoring one checkpoint
with a full replay buffer of ``--checkpoint-buffer`` transitions (default: the quick profile's
SAC/TD3 prefix), in milliseconds and in training steps (one env step with its gradient update,
``callback`` variant): save = snapshot + atomic write with its SHA-256; load = read, verify the
SHA-256, restore model, buffer, env and generators.

    OMP_NUM_THREADS=1 python benchmarks/rl_overhead.py [--algo sac] [--env HalfCheetah-v5] [--steps 1500]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from stabstudy.learners.rl import forks
from stabstudy.learners.rl import learner as rl
from stabstudy.registry import ON_POLICY
from stabstudy.spec import RunSpec

#: targets (the scale issue's): the study's callbacks over plain SB3 with the Monitor on every update,
#: and a watching ControllerCallback over those callbacks
TARGETS = {"callback": 1.05, "controller": 1.02}


def one(spec: RunSpec, variant: str) -> tuple[float, int | None, float]:
    """Wall time of one training run of ``variant``, its gradient updates (None for ``plain``) and the
    seconds spent inside the Monitor's hooks (``Monitor.cost``; 0 without a Monitor)."""
    model = rl.build_model(spec)
    if variant == "controller":  # never alarms: the cost of watching
        spec = spec.replace(hparams={"controller": "z_skip", "controller_threshold": 1e9})
    rec, cb = (rl.callbacks_for(spec, monitor=variant in ("callback", "controller"), evaluation=False)
               if variant != "plain" else (None, None))
    t0 = time.perf_counter()
    model.learn(spec.steps, callback=cb)
    dt = time.perf_counter() - t0
    model.env.close()
    hook_s = rec.monitor.cost().hook_s if rec is not None and rec.monitor is not None else 0.0
    return dt, rec.n_updates if rec is not None else None, hook_s


def checkpoint_cost(spec: RunSpec, buffer: int, repeats: int) -> tuple[float, float, int]:
    """Median seconds to save and to load a checkpoint of ``spec``'s model with a full replay buffer of
    ``buffer`` transitions (filled with random ones after a short training), and its size in bytes."""
    on_policy = spec.learner in ON_POLICY  # a rollout buffer: nothing to fill, no buffer_size to set
    spec = spec.replace(steps=buffer, hparams={"prefix_steps": buffer, **({} if on_policy else {"buffer_size": buffer})})
    model = rl.build_model(spec)
    model.learn(min(spec.steps, 300))
    rb = getattr(model, "replay_buffer", None)
    if rb is not None:  # the rest of a prefix's transitions: only their size matters here
        rng = np.random.default_rng(0)
        for k in forks.BUFFER_ARRAYS:
            arr = getattr(rb, k)
            arr[:] = rng.standard_normal(arr.shape).astype(arr.dtype)
        rb.pos, rb.full = 0, True
    saves, loads, size = [], [], 0
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        extra = {"n_updates": 0, "train_calls": 0, "diag_rng": None}
        for _ in range(repeats):
            t0 = time.perf_counter()
            blob = forks.snapshot(model, extra)
            forks.write_checkpoint(spec.spec_hash, blob, {}, root)
            saves.append(time.perf_counter() - t0)
            size = len(blob)
            t0 = time.perf_counter()
            data, _ = forks.read_checkpoint(spec.spec_hash, root)
            restored = rl.build_model(spec)
            forks.restore(data, restored)
            loads.append(time.perf_counter() - t0)
            restored.env.close()
    model.env.close()
    return statistics.median(saves), statistics.median(loads), size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--algo", default="sac", choices=rl.ALGOS)
    ap.add_argument("--env", default="HalfCheetah-v5")
    ap.add_argument("--steps", type=int, default=1500, help="env steps per training run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=0, help="0: the algorithm's default")
    ap.add_argument("--monitor-every", type=int, default=1)
    ap.add_argument("--checkpoint-buffer", type=int, default=60000,
                    help="replay transitions in the checkpoint (0: skip the checkpoint benchmark)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    hp = {"hidden": args.hidden, "monitor_every": args.monitor_every}
    if args.batch_size:
        hp["batch_size"] = args.batch_size
    if args.algo not in ON_POLICY:
        hp["learning_starts"] = min(100, args.steps // 4)
    spec = RunSpec("rl", args.algo, args.env, args.steps, 0, hparams=hp)
    variants = ["plain", "callback", "no-monitor", "controller"]
    times: dict[str, list[float]] = {v: [] for v in variants}
    hooks: dict[str, list[float]] = {v: [] for v in variants}
    updates = 0
    one(spec, "plain")  # warm-up (imports, MuJoCo compile)
    for r in range(args.repeats):
        order = variants if r % 2 == 0 else variants[::-1]
        for v in order:
            dt, n, hook_s = one(spec, v)
            times[v].append(dt)
            hooks[v].append(hook_s)
            updates = n or updates
    base = statistics.median(times["plain"])
    print(f"{args.algo} on {args.env}: {args.steps} env steps, {updates} gradient updates, hidden {args.hidden}, "
          f"batch {rl.hparams_for(spec)['batch_size'] if 'batch_size' in rl.hparams_for(spec) else '-'}, "
          f"monitor every {args.monitor_every}, {args.repeats} interleaved repeats (median)")
    # in hooks: the Monitor's own time per update (Monitor.cost), steadier than the wall-time ratio
    # on a loaded machine, and as a share of plain SB3's wall time
    print(f"{'variant':<12} {'wall s':>8} {'updates/s':>10} {'env steps/s':>12} {'overhead':>9} "
          f"{'in hooks ms/update':>19} {'of plain':>9}")
    for v in variants:
        m, h = statistics.median(times[v]), statistics.median(hooks[v])
        hook = f"{1e3 * h / updates:19.3f} {100 * h / base:8.1f}%" if h else ""
        print(f"{v:<12} {m:8.2f} {updates / m:10.1f} {args.steps / m:12.1f} {100 * (m / base - 1):8.1f}% {hook}")
    ratio = statistics.median(times["callback"]) / base
    ctrl = statistics.median(times["controller"]) / statistics.median(times["callback"])
    floor = statistics.median(times["no-monitor"]) / base
    print(f"load average at the end (1, 5, 15 min): {', '.join(f'{v:.1f}' for v in os.getloadavg())} "
          f"on {os.cpu_count()} cores")
    for label, got, target in (("callback / plain", ratio, TARGETS["callback"]),
                               ("controller / callback", ctrl, TARGETS["controller"])):
        print(f"{label} = x{got:.3f} (target <= x{target:.2f}: {'met' if got <= target else 'MISSED'})")
    print(f"no-monitor / plain = x{floor:.3f} (the callbacks without the Monitor)")
    if args.checkpoint_buffer:
        step = statistics.median(times["callback"]) / args.steps
        save, load, size = checkpoint_cost(spec, args.checkpoint_buffer, args.repeats)
        what = "no replay buffer (on-policy)" if spec.learner in ON_POLICY else \
            f"{args.checkpoint_buffer} replay transitions"
        print(f"checkpoint with {what} ({size / 2**20:.1f} MiB): "
              f"save {1e3 * save:.0f} ms = {save / step:.0f} training steps, "
              f"load {1e3 * load:.0f} ms = {load / step:.0f} training steps (one step {1e3 * step:.2f} ms)")


if __name__ == "__main__":
    main()
