"""The Monitor in a PyTorch Lightning ``Trainer``: :class:`LightningTelemetryCallback`.

Needs ``lightning`` (``pip install 'stabstudy[lightning]'``). The callback attaches a
:class:`~stabstudy.instruments.telemetry.Monitor` to the optimizers the Trainer built when
training starts. Lightning calls ``optimizer.step(closure)`` with the closure that runs the
forward and backward passes (and gradient clipping): the Monitor's own step hooks read the
gradient right after that closure, so the callback needs no pre-step hook of its own;
``grad_norm`` is the norm the closure's backward pass produced, before Lightning's gradient
clipping (``gradient_clip_val``) and with a ``16-mixed`` scaler's scale divided out, and
``grad_norm_applied`` the norm of the gradient the optimizer applies. A ``controller`` attaches
through the Monitor when training starts: its score, alarm and action go to the logs with the rest.

Logging: at the steps Lightning writes its logs (``log_every_n_steps``), the channels of the
latest update go as ``stability/<channel>`` to every logger the Trainer has; only then is the row
read from the Monitor (one host sync per logged step on a GPU, none in between). By default they go
through ``pl_module.log_dict``, so Lightning's callbacks see them too (``ModelCheckpoint(monitor=
"stability/grad_norm")``, ``EarlyStopping``); that costs about 0.5-1 ms per channel per logged step
on a CPU, a few percent of a millisecond-scale step at ``log_every_n_steps=50``.
``log_with="loggers"`` hands them to ``trainer.loggers`` directly, at the same steps, for the cost
of the loggers' own writes. With ``every=N``, the costly channels appear at the logged steps that
are measured ones: choose ``log_every_n_steps`` a multiple of N.

Checkpoints: the rows recorded so far are the callback's ``state_dict`` and come back with
``Trainer.fit(ckpt_path=...)`` (:mod:`.segments`), so :meth:`LightningTelemetryCallback.dataset`
covers the whole run across resumes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

try:
    import lightning.pytorch as pl
except ImportError as e:  # the framework is an optional extra
    raise ImportError("LightningTelemetryCallback needs lightning: pip install 'stabstudy[lightning]'") from e

from stabstudy.instruments.integrations.segments import RunSegments

if TYPE_CHECKING:
    import xarray as xr

    from stabstudy.instruments.telemetry import Monitor


class LightningTelemetryCallback(pl.Callback):
    """Record optimizer telemetry during ``Trainer.fit`` and log it with Lightning's loggers.

    Args:
        every: the Monitor's ``every`` (costly channels every this many updates, NaN between).
        per_layer: the Monitor's ``per_layer`` (in :meth:`dataset` only; not logged).
        sync_every: the Monitor's ``sync_every`` (rows per device block).
        prefix: name prefix of the logged channels.
        log_loss: record the training step's ``loss`` (a device tensor: no host sync) as the
            ``loss`` channel of the update it led to (with gradient accumulation: the last micro-batch's).
        log_with: ``"log_dict"`` (through ``pl_module.log_dict``: Lightning's callbacks see the
            channels) or ``"loggers"`` (straight to ``trainer.loggers``: cheaper); ``None``: not logged.
        controller: an unattached :class:`~stabstudy.interventions.control.Controller` (or ``OlmoSkip``)
            for the Trainer's (first) optimizer, attached through the Monitor when training starts.
        **monitor_kwargs: further :class:`~stabstudy.instruments.telemetry.Monitor` arguments (``writer``).

    Example::

        cb = LightningTelemetryCallback()
        L.Trainer(max_epochs=2, callbacks=[cb]).fit(model, loader)   # stability/grad_norm, ...
        ds = cb.dataset()                                             # the Monitor's Dataset
    """

    def __init__(self, every: int = 1, per_layer: bool = False, sync_every: int = 64, prefix: str = "stability/",
                 log_loss: bool = True, log_with: str | None = "log_dict", controller: Any = None,
                 **monitor_kwargs: Any):
        super().__init__()
        self.controller = controller
        if log_with not in ("log_dict", "loggers", None):
            raise ValueError(f"log_with must be 'log_dict', 'loggers' or None, got {log_with!r}")
        self.prefix = prefix
        self.log_loss = log_loss
        self.log_with = log_with
        self.run = RunSegments(every=every, per_layer=per_layer, sync_every=sync_every, **monitor_kwargs)

    @property
    def monitor(self) -> Monitor | None:
        """The Monitor attached to the Trainer's optimizers (None before training starts)."""
        return self.run.monitor

    def dataset(self) -> xr.Dataset:
        """The run's telemetry (``Monitor.to_dataset`` form), restored rows included; ``step``
        counts the optimizer updates of the run (rounds of updates with several optimizers)."""
        return self.run.dataset()

    # -- Lightning hooks ------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":  # a new fit is a new run unless a checkpoint restores one (after setup)
            self.run.reset()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # here: the optimizers exist and a checkpoint's optimizer state has been loaded into them
        opts = list(trainer.optimizers)
        if not opts:
            return
        # the scaler of Lightning's "16-mixed" precision (its plugin holds it), None otherwise
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.run.attach(pl_module, opts[0] if len(opts) == 1 else opts, scaler=scaler, controller=self.controller)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self.run.new_row():  # no update this batch (gradient accumulation, skipped step)
            return
        mon = self.run.monitor
        assert mon is not None  # new_row() is False without one
        if self.log_loss:
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            if isinstance(loss, torch.Tensor):  # Lightning hands it over detached already: no extra call then
                mon.log(loss=loss.detach() if loss.requires_grad else loss)
        if self.log_with is None or not trainer.loggers or not _writes_logs_now(trainer):
            return
        values = {self.prefix + k: v for k, v in self.run.latest().items()}
        if not values:
            return
        if self.log_with == "log_dict":
            pl_module.log_dict(values, on_step=True, on_epoch=False, prog_bar=False, logger=True)
            return
        # the step Lightning gives its own step logs (its count of batches that stepped, before
        # this one is added), so both land on one x-axis
        step = getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", trainer.global_step - 1)
        for logger in trainer.loggers:
            logger.log_metrics(values, step=step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.run.close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.run.close()  # remove the optimizer hooks; the rows recorded stay readable

    # -- checkpoint state -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return self.run.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.run.load_state_dict(state_dict)


def _writes_logs_now(trainer: pl.Trainer) -> bool:
    """Whether Lightning writes this training step's logs (``log_every_n_steps``): asked of its logger
    connector, which decides exactly that, else computed from the same step count."""
    connector = getattr(trainer, "_logger_connector", None)
    decided = getattr(connector, "should_update_logs", None)
    if isinstance(decided, bool):
        return decided
    n = trainer.log_every_n_steps
    return bool(n) and (trainer.global_step % n == 0 or trainer.should_stop)
