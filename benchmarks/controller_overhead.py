"""Cost of a closed-loop controller when no alarm fires, side by side on one small GPT.

The training loop of ``stabstudy.learners.lm`` (small GPT, AdamW, the Monitor on every step) runs
with no controller ("off") and with controllers attached whose threshold no step reaches, so each
only watches: ``z_skip`` (robust z of log grad norm and loss through the Monitor's pre-step view:
one float read of the norm and of the loss per step), ``z_rollback`` (the same, plus a snapshot of
parameters and AdamW state every 25 steps) and ``olmo`` (OLMo-core's rule on the device: a copy of
parameters and state before each step and a ``torch.where`` after it). The variants share one model
and optimizer and run in interleaved repeats whose order rotates, so that load from other processes
hits them alike; the table shows the median ms per step, the median (quartiles) of the per-repeat
ratio to "off", and the time inside the controller's own hooks as a share of the step (a low-noise
lower bound). Target: ``z_skip`` within 1% of "off".

    OMP_NUM_THREADS=1 python benchmarks/controller_overhead.py [--steps 30] [--repeats 11]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from stabstudy.hparams import GPTHParams, defaults
from stabstudy.instruments.telemetry import Monitor
from stabstudy.interventions import control
from stabstudy.learners import lm
from stabstudy.learners.corpus import get_batch, load_corpus
from stabstudy.learners.gpt import GPT

VARIANTS = ("off", "z_skip", "z_rollback", "olmo")
TARGET = 1.01  # median ratio of z_skip to off


class Timed:
    """Wraps a controller's hook methods to add up the seconds spent in them."""

    def __init__(self, ctrl):
        self.ctrl, self.s = ctrl, 0.0
        for name in ("_pre", "_post"):
            fn = getattr(ctrl, name)

            def timed(*a, _fn=fn):
                t0 = time.perf_counter()
                _fn(*a)
                self.s += time.perf_counter() - t0
            setattr(ctrl, name, timed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30, help="training steps per variant and repeat")
    ap.add_argument("--repeats", type=int, default=11, help="interleaved repeats")
    ap.add_argument("--warmup", type=int, default=40, help="untimed steps first (the detectors' windows fill)")
    args = ap.parse_args()
    torch.manual_seed(0)
    hp = defaults(GPTHParams)
    model = GPT(lm.model_config(hp))
    opt = lm.make_optimizer(model, hp)
    mon = Monitor(model, opt, sync_every=lm.SYNC_EVERY)
    corpus = load_corpus("stdlib", int(hp["corpus_bytes"]), float(hp["val_frac"]))
    gen = torch.Generator().manual_seed(0)
    B, T = int(hp["batch_size"]), int(hp["block_size"])

    def steps(n: int, ctrl) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            x, y = get_batch(corpus.train, B, T, gen)
            loss = model(x, y).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if ctrl is not None:
                ctrl.observe(loss)
            opt.step()
            mon.log(loss=loss.detach())
        return (time.perf_counter() - t0) / n

    # one controller per variant, kept across repeats (its detector windows stay warm)
    ctrls = {v: None if v == "off" else control.build(v, threshold=1e9) for v in VARIANTS}
    timers = {v: Timed(c) for v, c in ctrls.items() if c is not None and hasattr(c, "_pre")}
    for c in ctrls.values():
        if c is not None:
            c.attach(opt, mon)
            steps(args.warmup, c)
            c.close()
    t_step: dict[str, list[float]] = {v: [] for v in VARIANTS}
    hook_s = {v: 0.0 for v in VARIANTS}
    for r in range(args.repeats):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
        for v in order:
            c = ctrls[v]
            if c is not None:
                c.attach(opt, mon)
            before = timers[v].s if v in timers else 0.0
            t_step[v].append(steps(args.steps, c))
            if v in timers:
                hook_s[v] += timers[v].s - before
            if c is not None:
                c.close()
                if c.n_actions:
                    raise RuntimeError(f"{v} acted {c.n_actions} times: the benchmark needs no alarm")
    mon.close()
    off = t_step["off"]
    print(f"small GPT ({sum(p.numel() for p in model.parameters()) / 1e3:.0f}k params), {args.repeats} repeats x "
          f"{args.steps} steps, Monitor on every step in every variant")
    print(f"{'variant':<12}{'ms/step':>9}{'ratio to off':>14}{'quartiles':>18}{'in its hooks':>14}")
    for v in VARIANTS:
        ratios = sorted(a / b for a, b in zip(t_step[v], off, strict=True))
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        hooks = hook_s[v] / (sum(t_step[v]) * args.steps) if v in timers else float("nan")
        print(f"{v:<12}{1e3 * statistics.median(t_step[v]):>9.2f}{statistics.median(ratios):>14.4f}"
              f"{f'[{q[0]:.3f}, {q[2]:.3f}]':>18}{hooks:>13.2%} ")
    med = statistics.median(a / b for a, b in zip(t_step["z_skip"], off, strict=True))
    print(f"target: z_skip x{TARGET:g} of off; measured x{med:.4f}: {'met' if med <= TARGET else 'missed'}")


if __name__ == "__main__":
    main()
