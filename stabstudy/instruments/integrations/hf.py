"""The Monitor in a Hugging Face ``transformers.Trainer``: :class:`HFTelemetryCallback`.

Needs ``transformers`` and ``accelerate`` (``pip install 'stabstudy[hf]'``). At ``on_train_begin``
the callback attaches a :class:`~stabstudy.instruments.telemetry.Monitor` to the optimizer the
Trainer built (unwrapped from accelerate's ``AcceleratedOptimizer``): the Monitor's own step hooks
record every update, so no per-step callback work is needed (``on_optimizer_step`` stays unused).
``grad_norm`` is the norm backward() produced, before ``max_grad_norm`` clipping (accelerate's fp16
scaler's scale divided out), as the Trainer's own ``grad_norm`` log; ``grad_norm_applied`` the norm
of the gradient the optimizer applies. A ``controller`` attaches through the Monitor when training
starts: its score, alarm and action go to the logs with the rest.

Logging: at each ``on_log`` of training (``logging_steps``), the latest update's channels are
added to the Trainer's ``logs`` as ``stability/<channel>`` (and to the entry just appended to
``state.log_history``); only then is the row read from the Monitor (one host sync per logged step
on a GPU). Callbacks run in list order and the Trainer lists its ``report_to`` integrations
(TensorBoard, W&B, ...) before the user's callbacks: :meth:`HFTelemetryCallback.add_to` puts the
callback first so that they receive the channels too.

Checkpoints: at each ``on_save`` the rows recorded so far go to ``telemetry_state.pt`` inside the
checkpoint folder the Trainer just wrote (:mod:`.segments`); ``trainer.train(resume_from_checkpoint=...)``
restores them at ``on_train_begin`` from ``<output_dir>/checkpoint-<global_step>`` (or from
``resume_from``), so :meth:`HFTelemetryCallback.dataset` covers the whole run across resumes.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

try:
    from transformers import TrainerCallback
except ImportError as e:  # the framework is an optional extra
    raise ImportError("HFTelemetryCallback needs transformers: pip install 'stabstudy[hf]'") from e

from stabstudy.instruments.integrations.segments import RunSegments

if TYPE_CHECKING:
    import xarray as xr
    from transformers import Trainer, TrainerControl, TrainerState, TrainingArguments

    from stabstudy.instruments.telemetry import Monitor

#: File the callback writes into each checkpoint folder.
STATE_FILE = "telemetry_state.pt"


class HFTelemetryCallback(TrainerCallback):
    """Record optimizer telemetry during ``Trainer.train`` and add it to the Trainer's logs.

    Args:
        every: the Monitor's ``every`` (costly channels every this many updates, NaN between);
            choose ``logging_steps`` a multiple of it to see them in the logs.
        per_layer: the Monitor's ``per_layer`` (in :meth:`dataset` only; not logged).
        sync_every: the Monitor's ``sync_every`` (rows per device block).
        prefix: name prefix of the logged channels.
        resume_from: checkpoint folder to restore the telemetry from when training resumes
            (default: ``<output_dir>/checkpoint-<global_step>``, where the Trainer writes them).
        controller: an unattached :class:`~stabstudy.interventions.control.Controller` (or ``OlmoSkip``)
            for the Trainer's optimizer, attached through the Monitor when training starts.
        **monitor_kwargs: further :class:`~stabstudy.instruments.telemetry.Monitor` arguments (``writer``).

    Example::

        cb = HFTelemetryCallback()
        trainer = Trainer(model, args, train_dataset=data, callbacks=[cb])
        trainer.train()                      # logs: stability/grad_norm, stability/update_ratio, ...
        ds = cb.dataset()                    # the Monitor's Dataset
    """

    def __init__(self, every: int = 1, per_layer: bool = False, sync_every: int = 64, prefix: str = "stability/",
                 resume_from: str | Path | None = None, controller: Any = None, **monitor_kwargs: Any):
        self.prefix = prefix
        self.controller = controller
        self.resume_from = resume_from
        self.run = RunSegments(every=every, per_layer=per_layer, sync_every=sync_every, **monitor_kwargs)

    @property
    def monitor(self) -> Monitor | None:
        """The Monitor attached to the Trainer's optimizer (None before training starts)."""
        return self.run.monitor

    def dataset(self) -> xr.Dataset:
        """The run's telemetry (``Monitor.to_dataset`` form), restored rows included; ``step`` is
        the optimizer update index (``state.global_step - 1`` after the update)."""
        return self.run.dataset()

    def add_to(self, trainer: Trainer) -> HFTelemetryCallback:
        """Put this callback first in ``trainer``'s callbacks, so that the ``report_to`` integrations,
        which the Trainer lists before the user's callbacks, log the channels it adds; returns self."""
        cbs = trainer.callback_handler.callbacks
        if self in cbs:
            cbs.remove(self)
        cbs.insert(0, self)
        return self

    # -- Trainer events -------------------------------------------------------------------
    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       model: Any = None, optimizer: Any = None, **kwargs: Any) -> None:
        self.run.reset()
        if state.global_step > 0:  # resuming: the Trainer restored its state from a checkpoint
            self._restore(args, state)
        opt = _unwrap(optimizer)
        if opt is None:
            warnings.warn("HFTelemetryCallback: the Trainer passed no torch optimizer; nothing is recorded",
                          stacklevel=2)
            return
        # the Trainer's fp16 GradScaler: accelerate's optimizer wrapper holds it (None otherwise)
        self.run.attach(model, opt, scaler=getattr(optimizer, "scaler", None), controller=self.controller)

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        # training logs only (not the end-of-training summary nor evaluation metrics), and a row not
        # logged yet
        if logs is None or "train_runtime" in logs or any(k.startswith(("eval_", "test_")) for k in logs):
            return
        if not self.run.new_row():
            return
        values = {self.prefix + k: v for k, v in self.run.latest().items()}
        logs.update(values)
        hist = state.log_history
        if hist and hist[-1].get("step") == state.global_step and all(k in hist[-1] for k in logs if k not in values):
            hist[-1].update(values)  # the entry the Trainer appended for these logs, before calling us

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if state.is_world_process_zero and folder.is_dir() and self.run.monitor is not None:
            torch.save(self.run.state_dict(), folder / STATE_FILE)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self.run.close()

    def _restore(self, args: TrainingArguments, state: TrainerState) -> None:
        folder = Path(self.resume_from) if self.resume_from is not None else \
            Path(args.output_dir) / f"checkpoint-{state.global_step}"
        path = folder / STATE_FILE
        if not path.is_file():
            warnings.warn(f"HFTelemetryCallback: resuming at step {state.global_step} without {path}: the "
                          "telemetry starts there, with the earlier steps missing", stacklevel=3)
            self.run.offset = state.global_step
            return
        self.run.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        if self.run.offset != state.global_step:
            warnings.warn(f"HFTelemetryCallback: {path} holds {self.run.offset} updates but training resumes "
                          f"at step {state.global_step}", stacklevel=3)


def _unwrap(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer inside accelerate's wrapper (whose ``step`` calls the inner one's, where
    the Monitor's hooks are)."""
    while optimizer is not None and not type(optimizer).__module__.startswith("torch.") \
            and isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
