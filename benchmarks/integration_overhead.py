"""What the Monitor's integrations cost over the bare Monitor, side by side, on the small GPT and
tiny MLP steps of ``benchmarks/telemetry_overhead.py`` (its workload builders, the same defaults).

Three comparisons, each against the bare Monitor (``Monitor(model, opt)``, nothing else):

* ``writer``: ``Monitor(..., writer=SummaryWriter)`` in a plain loop. The writer's work happens
  once per block of ``--sync-every`` rows, so a timed repeat of ``--steps`` steps contains
  ``steps / sync_every`` flushes. ``writer: add_scalar`` is the same SummaryWriter seen only
  through ``add_scalar`` (the sink's path for other writers: one event per value, not per row).
* ``lightning``: ``Trainer.fit`` with :class:`LightningTelemetryCallback` against the same ``fit``
  with a callback that only attaches a bare Monitor at ``on_train_start`` (a CSV logger in both,
  ``log_every_n_steps=--log-every``); ``lightning-loggers``: the same with ``log_with="loggers"``.
  Each ``fit`` is a new Trainer, whose first ``log_dict`` of a name costs far more than later
  ones (Lightning builds its result metric): more ``--steps`` dilute that as a long run does.
* ``hf``: ``transformers.Trainer.train`` with :class:`HFTelemetryCallback` against a callback that
  only attaches a bare Monitor at ``on_train_begin`` (``logging_steps=--log-every``, ``report_to=[]``).

The two variants of a comparison share one model and optimizer per workload and run in interleaved
repeats whose order alternates, each Monitor attached for its repeat and closed after it. In the
frameworks a repeat is one ``fit`` / ``train`` call of ``--steps`` updates, timed from the end of its
first update to the end of its last (the framework's start-up left out). The ratio is the median of
the per-repeat ratios integration / bare (target: at most x1.01).

    OMP_NUM_THREADS=1 python benchmarks/integration_overhead.py [--steps 64] [--repeats 11] [--only writer,lightning,lightning-loggers,hf]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from telemetry_overhead import gpt_workload, mlp_workload, time_steps  # noqa: E402

from stabstudy.instruments.telemetry import Monitor  # noqa: E402

TARGET = 1.01
PARTS = ("writer", "lightning", "lightning-loggers", "hf")


def compare(repeats: int, run: Callable[[str], tuple[float, float]], labels: tuple[str, ...]) -> list[dict]:
    """``run(label)`` -> (seconds per step, seconds per step inside the integration's own hooks), for
    the labels (the bare Monitor first) in interleaved repeats whose order alternates; one result per
    label after the first, against it."""
    times: dict[str, list[float]] = {label: [] for label in labels}
    inside: dict[str, list[float]] = {label: [] for label in labels}
    for rep in range(repeats):
        for label in (labels if rep % 2 == 0 else labels[::-1]):
            t, hooks = run(label)
            times[label].append(t)
            inside[label].append(hooks / t)
    bare = labels[0]
    out = []
    for other in labels[1:]:
        ratios = [o / b for o, b in zip(times[other], times[bare], strict=True)]
        q1, q2, q3 = statistics.quantiles(ratios, n=4)
        out.append({"label": other, "bare_ms": statistics.median(times[bare]) * 1e3,
                    "ms": statistics.median(times[other]) * 1e3, "ratio": q2, "iqr": (q1, q3),
                    "inside": statistics.median(inside[other])})
    return out


class AddScalarOnly:
    """A SummaryWriter seen only through ``add_scalar``: the sink's path for any other writer (one
    call, one event per value), to compare with its one-event-per-row path for a SummaryWriter."""

    def __init__(self, writer: object) -> None:
        self.add_scalar = writer.add_scalar  # type: ignore[attr-defined]


# -- plain loop + SummaryWriter ------------------------------------------------------------
def bench_writer(workload, args: argparse.Namespace, logdir: str, name: str) -> list[dict]:
    from torch.utils.tensorboard import SummaryWriter

    make, loss_of, batches, _ = workload(args)
    model, opt = make()
    time_steps(model, opt, None, loss_of, batches[:3])  # warm-up: Adam state, allocator
    writer = SummaryWriter(f"{logdir}/{name}")

    sinks = {"bare": None, "writer": writer, "writer: add_scalar": AddScalarOnly(writer)}

    def run(label: str) -> tuple[float, float]:
        mon = Monitor(model, opt, sync_every=args.sync_every, writer=sinks[label])
        time_steps(model, opt, mon, loss_of, batches[:1])
        # the sink's flushes (deriving the rows' channels and writing them), timed from here on
        timer = HookTimer(mon._sink, ("flush",)) if mon._sink is not None else None
        t = time_steps(model, opt, mon, loss_of, batches)
        spent = timer.seconds / len(batches) if timer is not None else 0.0
        mon.close()
        return t, spent

    out = compare(args.repeats, run, tuple(sinks))
    writer.close()
    return out


class HookTimer:
    """Wraps hooks of a callback instance (the frameworks look them up by name) to add up the
    seconds spent inside them: a low-noise lower bound of the callback's cost (what it sets off
    later in the framework, e.g. writing the values it logged, is not counted)."""

    def __init__(self, cb: object, hooks: tuple[str, ...]) -> None:
        self.seconds = 0.0
        for name in hooks:
            setattr(cb, name, self._timed(getattr(cb, name)))

    def _timed(self, fn: Callable) -> Callable:
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - t0
        return timed


class StepClock:
    """Seconds per update from the end of the first update to the end of the last."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def tick(self) -> None:
        self.stamps.append(time.perf_counter())

    def per_step(self) -> float:
        return (self.stamps[-1] - self.stamps[0]) / (len(self.stamps) - 1)


# -- PyTorch Lightning ---------------------------------------------------------------------
def bench_lightning(workload, args: argparse.Namespace, logdir: str, name: str,
                    log_with: str = "log_dict") -> list[dict]:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    from stabstudy.instruments.integrations.lightning import LightningTelemetryCallback

    make, loss_of, batches, _ = workload(args)
    model, opt = make()
    time_steps(model, opt, None, loss_of, batches[:3])

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            return loss_of(self.model, *batch)

        def configure_optimizers(self):
            return opt  # the same optimizer in every repeat, as in the plain loop

    class BareMonitor(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            self.mon = Monitor(pl_module, trainer.optimizers[0], sync_every=args.sync_every)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            pass  # timed like the integration's

        def on_train_end(self, trainer, pl_module):
            self.mon.close()

    class Clock(pl.Callback):
        def __init__(self) -> None:
            self.clock = StepClock()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.clock.tick()

    module = Module()
    loader = torch.utils.data.DataLoader(batches, batch_size=None)  # the workload's batches, as made

    def run(label: str) -> tuple[float, float]:
        cb = LightningTelemetryCallback(sync_every=args.sync_every, log_with=log_with) if label == "lightning" \
            else BareMonitor()
        timer = HookTimer(cb, ("on_train_batch_end",))
        clock = Clock()  # last: it ticks after the callback under test did its work
        trainer = pl.Trainer(max_epochs=1, callbacks=[cb, clock], logger=CSVLogger(logdir, name=f"{name}-{label}"),
                             log_every_n_steps=args.log_every, accelerator="cpu", enable_progress_bar=False,
                             enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0)
        trainer.fit(module, loader)
        return clock.clock.per_step(), timer.seconds / len(batches)

    rows = compare(args.repeats, run, ("bare", "lightning"))
    return [{**r, "label": "lightning" if log_with == "log_dict" else f"lightning ({log_with})"} for r in rows]


# -- Hugging Face Trainer --------------------------------------------------------------------
def bench_hf(workload, args: argparse.Namespace, logdir: str, name: str) -> list[dict]:
    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    from stabstudy.instruments.integrations.hf import HFTelemetryCallback, _unwrap

    make, loss_of, batches, _ = workload(args)
    model, opt = make()
    time_steps(model, opt, None, loss_of, batches[:3])

    class Wrapped(torch.nn.Module):
        """The workload's model as the Trainer calls it: ``forward(**batch)`` returns ``{"loss": ...}``."""

        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, x, y):
            return {"loss": loss_of(self.model, x, y)}

    class BareMonitor(TrainerCallback):
        def on_train_begin(self, args_, state, control, model=None, optimizer=None, **kw):
            self.mon = Monitor(model, _unwrap(optimizer), sync_every=args.sync_every)

        def on_log(self, args_, state, control, logs=None, **kw):
            pass  # timed like the integration's

        def on_train_end(self, args_, state, control, **kw):
            self.mon.close()

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.clock = StepClock()

        def on_step_end(self, args_, state, control, **kw):
            self.clock.tick()

    wrapped = Wrapped()
    data = [{"x": x, "y": y} for x, y in batches]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)

    def run(label: str) -> tuple[float, float]:
        cb = HFTelemetryCallback(sync_every=args.sync_every) if label == "hf" else BareMonitor()
        timer = HookTimer(cb, ("on_log",))
        clock = Clock()
        targs = TrainingArguments(output_dir=f"{logdir}/{name}-{label}", max_steps=len(batches),
                                  per_device_train_batch_size=1, logging_steps=args.log_every, save_strategy="no",
                                  report_to=[], use_cpu=True, disable_tqdm=True, dataloader_num_workers=0)
        trainer = Trainer(model=wrapped, args=targs, train_dataset=data, optimizers=(opt, sched),
                          data_collator=lambda items: items[0], callbacks=[cb, clock])
        trainer.remove_callback(PrinterCallback)  # disable_tqdm prints every log otherwise
        trainer.train()
        return clock.clock.per_step(), timer.seconds / len(batches)

    return compare(args.repeats, run, ("bare", "hf"))


def bench_lightning_loggers(workload, args: argparse.Namespace, logdir: str, name: str) -> list[dict]:
    return bench_lightning(workload, args, logdir, name, log_with="loggers")


BENCHES = {"writer": bench_writer, "lightning": bench_lightning, "lightning-loggers": bench_lightning_loggers,
           "hf": bench_hf}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=64, help="training steps per timed repeat")
    ap.add_argument("--repeats", type=int, default=11, help="interleaved repeats per variant")
    ap.add_argument("--sync-every", type=int, default=64, help="the Monitor's block size")
    ap.add_argument("--log-every", type=int, default=50, help="the frameworks' logging interval (steps)")
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma-separated subset of {PARTS}")
    ap.add_argument("--workloads", default="gpt,mlp", help="comma-separated subset of gpt,mlp")
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--mlp-width", type=int, default=256)
    ap.add_argument("--mlp-batch", type=int, default=128)
    args = ap.parse_args()
    parts = [p for p in args.only.split(",") if p]
    unknown = set(parts) - set(PARTS)
    if unknown:
        ap.error(f"unknown --only parts {sorted(unknown)}; choose from {PARTS}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded
    warnings.filterwarnings("ignore")  # the frameworks' start-up advice would drown the table
    workloads = {"gpt": gpt_workload, "mlp": mlp_workload}
    rows = []
    with tempfile.TemporaryDirectory() as logdir:
        for part in parts:
            for w in args.workloads.split(","):
                rows += [(r["label"], w, r) for r in BENCHES[part](workloads[w], args, logdir, f"{part}-{w}")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; {args.repeats} interleaved repeats of {args.steps} "
          f"steps, sync_every={args.sync_every}, log every {args.log_every} steps; ms/step: median; ratio: median "
          f"of per-repeat integration / bare Monitor [quartiles]; target <= x{TARGET}")
    print("in hooks: median share of the step spent inside the integration's own hooks (writer: the sink's "
          "flushes); a lower bound, with less noise than the ratio")
    print(f"{'integration':<19}{'workload':<10}{'bare ms':>9}{'with ms':>9}{'ratio':>8}{'quartiles':>18}"
          f"{'in hooks':>10}")
    for part, w, r in rows:
        lo, hi = r["iqr"]
        verdict = "met" if r["ratio"] <= TARGET else "MISSED"
        inside = f"{100 * r['inside']:.2f}%"
        print(f"{part:<19}{w:<10}{r['bare_ms']:>9.2f}{r['ms']:>9.2f}{r['ratio']:>8.3f}"
              f"   [{lo:.3f}, {hi:.3f}]{inside:>10}  {verdict}")


if __name__ == "__main__":
    main()
