"""The Monitor's rows in Weights & Biases and MLflow: :class:`WandbWriter`, :class:`MLflowWriter`.

Both have the row writer's shape (:class:`~stabstudy.instruments.telemetry.sink.RowWriter`):
``log_row(step, values)`` gets one complete row's channels (``stability/<channel>`` -> value) at
``step`` = the Monitor's row, a block of ``sync_every`` rows at a time, from the sink's background
thread, so the training loop waits for neither service. Pass one as ``Monitor(..., writer=...)``.
TensorBoard needs no adapter: its ``SummaryWriter`` is a writer already.

* ``WandbWriter(run)``: each row is one ``run.log`` with the row's index as ``stability/step``, the
  x-axis W&B draws the ``stability/*`` charts against (``define_metric``): W&B's own step counter
  counts calls to ``log`` and must only grow, while the rows arrive a block late. Log your own
  values with ``run.log`` as usual, without ``step=`` (or give them ``stability/step`` as well).
  Needs ``wandb`` (``pip install 'stabstudy[wandb]'``); offline mode (``WANDB_MODE=offline``) works.
* ``MLflowWriter(run_id)``: each row is one ``MlflowClient.log_batch`` of metrics at ``step`` = the
  row (MLflow keeps steps per metric, in any order). Needs ``mlflow-skinny`` or ``mlflow``
  (``pip install 'stabstudy[mlflow]'``).
"""

from __future__ import annotations

import time
from typing import Any

#: The W&B metric the Monitor's charts are drawn against.
WANDB_STEP = "stability/step"


class WandbWriter:
    """Rows to a W&B run (see the module docstring).

    Args:
        run: a ``wandb`` run (default: ``wandb.run``, the one ``wandb.init()`` started).
        step_metric: the x-axis of the ``stability/*`` charts.
    """

    def __init__(self, run: Any = None, step_metric: str = WANDB_STEP):
        if run is None:
            import wandb  # the [wandb] extra: imported only when this writer is built

            run = wandb.run
        if run is None:
            raise ValueError("WandbWriter needs a W&B run: call wandb.init(...) first, or pass run=")
        self.run, self.step_metric = run, step_metric
        prefix = step_metric.rsplit("/", 1)[0]
        run.define_metric(step_metric)
        run.define_metric(f"{prefix}/*", step_metric=step_metric)

    def log_row(self, step: int, values: dict[str, float]) -> None:
        self.run.log({**values, self.step_metric: step})

    def flush(self) -> None:
        """Nothing to do: W&B sends what ``log`` got on its own thread; ``run.finish()`` ends the run."""


class MLflowWriter:
    """Rows to an MLflow run (see the module docstring).

    Args:
        run_id: the run to log to (default: the active run, ``mlflow.start_run()``'s).
        tracking_uri: the tracking server or store (default: MLflow's, e.g. ``$MLFLOW_TRACKING_URI``).
    """

    def __init__(self, run_id: str | None = None, tracking_uri: str | None = None):
        import mlflow  # the [mlflow] extra: imported only when this writer is built
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        if run_id is None:
            active = mlflow.active_run()
            if active is None:
                raise ValueError("MLflowWriter needs an MLflow run: use it inside mlflow.start_run(), or pass run_id=")
            run_id = active.info.run_id
        self.run_id = run_id
        self.client = MlflowClient(tracking_uri)
        self._metric = Metric

    def log_row(self, step: int, values: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[self._metric(k, float(v), now, int(step)) for k, v in values.items()])

    def flush(self) -> None:
        """Nothing to do: every ``log_row`` was written when it returned."""
