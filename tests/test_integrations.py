"""The Monitor where users already look: pandas, TensorBoard writers, SB3's logger; the examples of docs/integrations.md."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import xarray as xr
from docblocks import block

from stabstudy.instruments.telemetry import Monitor, to_frame

ROOT = Path(__file__).resolve().parents[1]


def _train(mon_kwargs: dict | None = None, steps: int = 10, log: bool = True) -> Monitor:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(32, 4), torch.randn(32, 1)
    mon = Monitor(model, opt, **(mon_kwargs or {}))
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if log:
            mon.log(loss=loss.detach())
    return mon


def _scalars(logdir: Path) -> dict[str, list]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: acc.Scalars(tag) for tag in acc.Tags()["scalars"]}


# -- pandas -------------------------------------------------------------------------
def test_monitor_to_frame_long_form():
    mon = _train({"per_layer": True}, steps=5)
    mon.close()
    ds = mon.to_dataset()
    df = mon.to_frame()
    assert list(df.columns) == ["step", "channel", "layer", "value"]
    n_layers = ds.sizes["layer"]
    per_step = [v for v in ds.data_vars if ds[v].dims == ("step",)]
    assert len(df) == 5 * (len(per_step) + 2 * n_layers)
    g = df[(df.channel == "grad_norm")].set_index("step")["value"]
    np.testing.assert_array_equal(g.to_numpy(), ds.grad_norm.values)
    assert df[df.channel == "grad_norm"].layer.isna().all()
    lay = df[df.channel == "layer_grad_norm"]
    assert set(lay.layer) == set(ds.layer.values)
    got = lay.set_index(["step", "layer"])["value"]
    want = ds.layer_grad_norm.to_series()
    pd.testing.assert_series_equal(got.sort_index(), want.sort_index(), check_names=False)
    assert not mon.to_frame(dropna=True)["value"].isna().any()


def test_to_frame_reads_stored_runs(tmp_path):
    from stabstudy.run.store import RunStore, load_runs
    from stabstudy.spec import RunSpec

    store = RunStore(tmp_path)
    specs = []
    for seed, n in ((0, 6), (1, 4)):
        mon = _train({"per_layer": True}, steps=n)
        mon.close()
        spec = RunSpec(domain="toy", learner="adam", task="digits", steps=n, seed=seed)
        store.save(mon.to_dataset(), spec, "ok", 0.1)
        specs.append(spec)
    one = store.load(specs[0])
    df1 = to_frame(one)
    assert list(df1.columns) == ["step", "channel", "layer", "value"]
    assert set(df1.channel) >= {"grad_norm", "loss", "layer_grad_norm"}
    both = load_runs(specs, store)
    df = to_frame(both, dropna=True)
    assert list(df.columns) == ["run", "step", "channel", "layer", "value"]
    counts = df[df.channel == "grad_norm"].groupby("run").size()
    assert sorted(counts.tolist()) == [4, 6]  # the shorter run's NaN padding is dropped
    assert to_frame(xr.Dataset()).columns.tolist() == ["step", "channel", "layer", "value"]


# -- plain torch loop + SummaryWriter -------------------------------------------------
def test_writer_streams_in_blocks(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path))
    mon = _train({"writer": writer, "sync_every": 4}, steps=10)
    assert mon._sink.written == 8  # two full blocks of 4 rows went out, the rest waits for its block
    mon.close()
    writer.close()
    tags = _scalars(tmp_path)
    ds = mon.to_dataset()
    gn = tags["stability/grad_norm"]
    assert [e.step for e in gn] == list(range(10))  # one value per step
    np.testing.assert_allclose([e.value for e in gn], ds.grad_norm.values, rtol=1e-6)
    np.testing.assert_allclose([e.value for e in tags["stability/loss"]], ds.loss.values, rtol=1e-6)
    assert "stability/update_ratio" in tags and "stability/layer_grad_norm" not in tags


class _ListWriter:
    def __init__(self):
        self.rows: list[tuple[str, float, int]] = []

    def add_scalar(self, tag, value, global_step):
        self.rows.append((tag, value, global_step))


def test_writer_every_and_several_optimizers():
    torch.manual_seed(0)
    a, c = torch.nn.Linear(3, 2), torch.nn.Linear(3, 1)
    oa, oc = torch.optim.Adam(a.parameters(), 1e-2), torch.optim.SGD(c.parameters(), 1e-2)
    w = _ListWriter()
    mon = Monitor([a, c], {"actor": oa, "critic": oc}, every=2, sync_every=3, writer=w)
    x = torch.randn(8, 3)
    for k in range(7):
        oc.zero_grad()
        c(x).pow(2).mean().backward()
        oc.step()
        if k % 2 == 0:  # a delayed actor: its channels are NaN on the other rows
            oa.zero_grad()
            a(x).pow(2).mean().backward()
            oa.step()
    mon.close()
    steps = {t: [s for tg, _, s in w.rows if tg == t] for t in {tg for tg, _, _ in w.rows}}
    assert steps["stability/grad_norm"] == list(range(7))
    assert steps["stability/grad_norm_actor"] == [0, 2, 4, 6]
    assert not any(v != v for _, v, _ in w.rows)  # NaN is never written
    ds = mon.to_dataset()
    for ch in ("update_ratio", "update_ratio_actor", "xgrad_critic"):  # every=2: only the measured rows
        measured = ds.step.values[ds[ch].notnull().values].tolist()
        assert 0 < len(measured) < 7 and steps.get(f"stability/{ch}", []) == measured, ch
    np.testing.assert_allclose([v for t, v, _ in w.rows if t == "stability/grad_norm"], ds.grad_norm.values)


# -- W&B and MLflow: the row writers ------------------------------------------------------
def test_a_row_writer_gets_each_complete_row_once_from_the_background_thread():
    import threading

    class Rows:
        def __init__(self):
            self.rows, self.threads, self.flushed = [], set(), 0

        def log_row(self, step, values):
            self.rows.append((step, dict(values)))
            self.threads.add(threading.current_thread().name)

        def flush(self):
            self.flushed += 1

    w = Rows()
    mon = _train({"writer": w, "sync_every": 4, "every": 3}, steps=10)
    mon.close()
    ds = mon.to_dataset()
    assert [s for s, _ in w.rows] == list(range(10)) and w.flushed == 1
    assert w.threads == {"stabstudy-writer-sink"}
    for s, values in w.rows:
        assert values["stability/grad_norm"] == pytest.approx(float(ds.grad_norm[s]), rel=1e-12)
        assert ("stability/update_ratio" in values) == (s % 3 == 0)  # NaN (not measured) is not written
    with pytest.raises(TypeError, match="log_row.*WandbWriter.*add_scalar"):
        _train({"writer": object()}, steps=1)


def test_wandb_writer_offline(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    from stabstudy.instruments.telemetry.loggers import WandbWriter

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))  # never the caller's folder
    with pytest.raises(ValueError, match="wandb.init"):
        WandbWriter()
    run = wandb.init(project="stabstudy-test", dir=str(tmp_path))
    logged = []
    real = run.log
    monkeypatch.setattr(run, "log", lambda data, *a, **k: (logged.append(dict(data)), real(data, *a, **k)))
    mon = _train({"writer": WandbWriter(), "sync_every": 4}, steps=6)
    mon.close()
    run.finish()
    wandb.teardown()  # its settings (the run folder) stay in the process otherwise
    ds = mon.to_dataset()
    assert [d["stability/step"] for d in logged] == list(range(6))
    np.testing.assert_allclose([d["stability/grad_norm"] for d in logged], ds.grad_norm.values, rtol=1e-12)
    (file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")  # what `wandb sync` would upload
    assert b"stability/grad_norm" in file.read_bytes()


def test_mlflow_writer_local_file_store(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from stabstudy.instruments.telemetry.loggers import MLflowWriter

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store for those who ask
    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # not mlflow.set_tracking_uri: it would outlive the test
    with pytest.raises(ValueError, match="mlflow.start_run"):
        MLflowWriter()
    with mlflow.start_run() as run:
        mon = _train({"writer": MLflowWriter(), "sync_every": 4}, steps=6)
        mon.close()
    ds = mon.to_dataset()
    hist = MlflowClient(uri).get_metric_history(run.info.run_id, "stability/grad_norm")
    assert sorted(m.step for m in hist) == list(range(6))
    np.testing.assert_allclose([m.value for m in sorted(hist, key=lambda m: m.step)], ds.grad_norm.values, rtol=1e-12)
    loss = MlflowClient(uri).get_metric_history(run.info.run_id, "stability/loss")
    assert len(loss) == 6


# -- stable-baselines3 ------------------------------------------------------------------
def test_sb3_telemetry_reaches_tensorboard(tmp_path):
    from stable_baselines3 import PPO

    from stabstudy.learners.rl import TelemetryCallback

    model = PPO("MlpPolicy", "Pendulum-v1", n_steps=64, batch_size=32, n_epochs=1, seed=0,
                policy_kwargs={"net_arch": [16]}, tensorboard_log=str(tmp_path), device="cpu")
    model.learn(64 * 4, callback=TelemetryCallback(), tb_log_name="ppo")
    runs = list(tmp_path.iterdir())
    assert len(runs) == 1
    tags = _scalars(runs[0])
    gn = tags["stability/grad_norm"]
    assert len(gn) >= 2 and all(np.isfinite(e.value) for e in gn)
    assert "stability/update_ratio" in tags and "train/loss" in tags  # beside SB3's own


def test_sb3_logger_gets_the_norm_before_clipping_and_a_controllers_decisions(tmp_path):
    """PPO clips at 0.5: SB3's logger gets grad_norm before the clip and grad_norm_applied after it,
    and the channels of a ControllerCallback's controller (it attaches through the Monitor)."""
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import CallbackList

    from stabstudy.interventions.control import build
    from stabstudy.learners.rl import ControllerCallback, Recorder, TelemetryCallback

    model = PPO("MlpPolicy", "Pendulum-v1", n_steps=64, batch_size=32, n_epochs=1, seed=0,
                policy_kwargs={"net_arch": [16]}, tensorboard_log=str(tmp_path), device="cpu")
    rec = Recorder()
    ctrl = build("z_skip", threshold=1e9, window=8)
    model.learn(64 * 4, callback=CallbackList([TelemetryCallback(rec), ControllerCallback(rec, ctrl)]), tb_log_name="ppo")
    tags = _scalars(next(tmp_path.iterdir()))
    before, after = ([e.value for e in tags[f"stability/{c}"]] for c in ("grad_norm", "grad_norm_applied"))
    assert len(before) >= 2 and all(a <= 0.5 + 1e-6 for a in after) and max(before) > 0.5
    assert {"stability/controller_score", "stability/controller_alarm", "stability/controller_action/skip"} <= set(tags)


def test_sb3_off_policy_telemetry_reaches_tensorboard_at_sb3s_dumps(tmp_path):
    """SAC dumps at episode ends (every log_interval episodes): the channels are there beside SB3's."""
    from stable_baselines3 import SAC

    from stabstudy.learners.rl import TelemetryCallback

    model = SAC("MlpPolicy", "Pendulum-v1", learning_starts=50, batch_size=32, seed=0, policy_kwargs={"net_arch": [16]},
                tensorboard_log=str(tmp_path), device="cpu")
    model.learn(200 * 4, callback=TelemetryCallback(), tb_log_name="sac", log_interval=2)  # 200-step episodes
    tags = _scalars(next(tmp_path.iterdir()))
    assert len(tags["stability/grad_norm"]) == len(tags["train/actor_loss"]) == 2
    assert all(np.isfinite(e.value) for e in tags["stability/grad_norm"]) and "stability/update_ratio" in tags


# -- docs/integrations.md examples ------------------------------------------------------------------
def _doc_block(marker: str) -> str:
    return block("docs/integrations.md", marker)


def test_readme_summary_writer_example(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    exec(compile(_doc_block("SummaryWriter("), "docs:writer", "exec"), ns)
    logdirs = [p for p in (tmp_path / "runs").rglob("*") if p.is_dir()] + [tmp_path / "runs"]
    found = {}
    for d in logdirs:
        found.update(_scalars(d))
    assert len(found["stability/grad_norm"]) == 200


def test_readme_sb3_example(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(_doc_block("tensorboard_log"), "docs:sb3", "exec"), {})
    runs = [p for p in (tmp_path / "runs").iterdir() if p.is_dir()]
    assert runs and "stability/grad_norm" in _scalars(runs[0])


def test_readme_to_frame_example(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    exec(compile(_doc_block("to_frame"), "docs:frame", "exec"), ns)
    df = ns["df"]
    assert list(df.columns) == ["step", "channel", "layer", "value"]
    assert "grad_norm" in capsys.readouterr().out


def test_wandb_example_logs_every_row_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from stabstudy.instruments.telemetry import loggers

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))  # never the caller's folder
    rows, real = [], loggers.WandbWriter.log_row
    monkeypatch.setattr(loggers.WandbWriter, "log_row", lambda self, step, values: (rows.append(step),
                                                                                    real(self, step, values)))
    exec(compile(_doc_block("WandbWriter(run)"), "docs:wandb", "exec"), {})
    __import__("wandb").teardown()
    assert rows == list(range(100))  # every row, in order, before run.finish()
    (file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    data = file.read_bytes()
    assert b"stability/grad_norm" in data and b"stability/loss" in data


def test_mlflow_example_logs_every_row_to_a_local_file_store(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    ns: dict = {}
    exec(compile(_doc_block("MLflowWriter()"), "docs:mlflow", "exec"), ns)
    client = MlflowClient((tmp_path / "mlruns").as_uri())
    hist = client.get_metric_history(ns["run"].info.run_id, "stability/grad_norm")
    assert sorted(m.step for m in hist) == list(range(100))
    np.testing.assert_allclose(sorted((m.step, m.value) for m in hist)[-1][1], float(ns["mon"].to_dataset().grad_norm[-1]),
                               rtol=1e-12)


# -- run segments (checkpoint state of the framework callbacks) -----------------------------
def test_run_segments_state_survives_weights_only_load(tmp_path):
    from stabstudy.instruments.integrations.segments import RunSegments

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    x, y = torch.randn(16, 4), torch.randn(16, 1)

    def steps(run: RunSegments, n: int, log: str | None = None) -> None:
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)  # a resume builds a new optimizer
        mon = run.attach(model, opt)
        for _ in range(n):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            if log:
                mon.log(**{log: loss.detach()})

    first = RunSegments(per_layer=True)
    steps(first, 3, log="loss")
    torch.save(first.state_dict(), tmp_path / "state.pt")
    second = RunSegments(per_layer=True)
    second.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert second.rows == 3
    steps(second, 2, log="other")
    ds = second.dataset()
    assert ds.step.values.tolist() == [0, 1, 2, 3, 4]
    assert ds.loss.notnull().values.tolist() == [True, True, True, False, False]
    assert ds.other.notnull().values.tolist() == [False, False, False, True, True]
    assert ds.layer_grad_norm.shape == (5, 4) and ds.layer_grad_norm.notnull().all()
    np.testing.assert_array_equal(ds.grad_norm.values[:3], first.dataset().grad_norm.values)
    assert np.isnan(ds.xgrad.values[3]) and np.isfinite(ds.xgrad.values[4])  # no previous gradient after a resume
    assert ds.grad_norm.dtype == np.float64 and ds.attrs["monitor_every"] == 1
    with pytest.raises(ValueError, match="format"):
        second.load_state_dict({"format": 99})


# -- PyTorch Lightning --------------------------------------------------------------------
def _lightning_module():
    pl = pytest.importorskip("lightning.pytorch")

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    torch.manual_seed(0)
    return pl, Tiny()


def _lightning_loader():
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(24, 4, generator=g), torch.randn(24, 1, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=8)  # three updates an epoch, same order each


def _lightning_fit(tmp_path, name: str, max_epochs: int, ckpt_path=None, log_with="log_dict", cb_kwargs=None,
                   **trainer_kwargs):
    pytest.importorskip("lightning")
    from lightning.pytorch.loggers import CSVLogger

    from stabstudy.instruments.integrations.lightning import LightningTelemetryCallback

    pl, model = _lightning_module()
    cb = LightningTelemetryCallback(log_with=log_with, **(cb_kwargs or {}))
    trainer = pl.Trainer(max_epochs=max_epochs, callbacks=[cb, *trainer_kwargs.pop("callbacks", [])],
                         logger=CSVLogger(str(tmp_path), name=name), accelerator="cpu", enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path), **trainer_kwargs)
    trainer.fit(model, _lightning_loader(), ckpt_path=ckpt_path)
    return cb, trainer


@pytest.mark.parametrize("log_with", ["log_dict", "loggers"])
def test_lightning_callback_logs_channels_at_log_every_n_steps(tmp_path, log_with):
    cb, trainer = _lightning_fit(tmp_path, "logs", max_epochs=2, log_with=log_with, log_every_n_steps=2)
    ds = cb.dataset()
    assert ds.step.values.tolist() == list(range(6))
    assert ds.grad_norm.notnull().all() and ds.loss.notnull().all() and ds.adam_v_mean.notnull().all()
    assert cb.monitor is not None and not cb.monitor._handles  # closed at the end of training: hooks removed
    metrics = pd.read_csv(Path(trainer.logger.log_dir) / "metrics.csv")
    logged = metrics.dropna(subset=["stability/grad_norm"])
    assert logged.step.tolist() == [1, 3, 5]  # every second update, as Lightning writes its logs
    np.testing.assert_allclose(logged["stability/grad_norm"], ds.grad_norm.values[[1, 3, 5]], rtol=1e-6)
    np.testing.assert_allclose(logged["stability/loss"], ds.loss.values[[1, 3, 5]], rtol=1e-6)
    assert "stability/update_ratio" in metrics and "stability/layer_grad_norm" not in metrics
    assert (log_with == "log_dict") == ("stability/grad_norm" in trainer.callback_metrics)  # for ModelCheckpoint


def _watching_controller():
    from stabstudy.interventions.control import Controller, Skip
    from stabstudy.online import RobustZ

    return Controller(RobustZ(side="up", window=8, min_periods=2, threshold=1e9), Skip())  # watches, never acts


def test_lightning_logs_the_norm_before_clipping_and_the_controllers_decisions(tmp_path):
    """gradient_clip_val clips inside Lightning's closure: grad_norm is the norm before it; a controller
    given to the callback attaches through its Monitor, and its channels reach Lightning's loggers."""
    cb, trainer = _lightning_fit(tmp_path, "clip", max_epochs=2, log_every_n_steps=1, gradient_clip_val=1e-3,
                                 cb_kwargs={"controller": _watching_controller()})
    ds = cb.dataset()
    assert (ds.grad_norm.values > 1e-2).all()
    np.testing.assert_allclose(ds.grad_norm_applied.values, 1e-3, rtol=1e-3)
    assert ds.controller_action.values.tolist() == ["none"] * 6 and np.isfinite(ds.controller_score.values[2:]).all()
    metrics = pd.read_csv(Path(trainer.logger.log_dir) / "metrics.csv")
    logged = metrics.dropna(subset=["stability/grad_norm"])
    np.testing.assert_allclose(logged["stability/grad_norm"], ds.grad_norm.values, rtol=1e-6)
    assert {"stability/controller_score", "stability/controller_alarm", "stability/controller_action/skip",
            "stability/grad_norm_applied"} <= set(metrics)
    assert cb.run.controller.optimizer is None  # closed with the Monitor at the end of training


def test_lightning_callback_rejects_unknown_log_with():
    pytest.importorskip("lightning")
    from stabstudy.instruments.integrations.lightning import LightningTelemetryCallback

    with pytest.raises(ValueError, match="log_with"):
        LightningTelemetryCallback(log_with="stdout")


def test_lightning_checkpoint_resume_continues_the_run(tmp_path):
    pytest.importorskip("lightning")
    from lightning.pytorch.callbacks import ModelCheckpoint

    whole, _ = _lightning_fit(tmp_path, "whole", max_epochs=2, log_every_n_steps=1)
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True)
    first, _ = _lightning_fit(tmp_path, "first", max_epochs=1, callbacks=[ckpt], log_every_n_steps=1)
    state = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["callbacks"]
    assert [v["rows"] for k, v in state.items() if "LightningTelemetryCallback" in k] == [3]
    resumed, _ = _lightning_fit(tmp_path, "resumed", max_epochs=2, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"),
                                log_every_n_steps=1)
    a, b = whole.dataset(), resumed.dataset()
    assert b.step.values.tolist() == list(range(6))
    np.testing.assert_array_equal(b.grad_norm.values[:3], first.dataset().grad_norm.values)
    for ch in ("grad_norm", "update_ratio", "adam_m_norm", "loss"):  # the same run as without the interruption
        np.testing.assert_allclose(b[ch].values, a[ch].values, rtol=1e-5, err_msg=ch)
    assert np.isnan(b.xgrad.values[[0, 3]]).all() and np.isfinite(b.xgrad.values[[1, 2, 4, 5]]).all()


# -- Hugging Face transformers --------------------------------------------------------------
def _hf_train(out: Path, max_steps: int, resume: bool = False, cb_kwargs=None, **args_kwargs):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from stabstudy.instruments.integrations.hf import HFTelemetryCallback

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)  # random weights: nothing is downloaded
    ids = torch.randint(0, 32, (24, 8), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": r, "labels": r} for r in ids]
    # constant lr, no clipping: a run cut at step 3 and resumed is the run of 6 steps
    args = TrainingArguments(output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=4,
                             learning_rate=1e-2, lr_scheduler_type="constant", seed=0,
                             report_to=[], use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
                             **{"logging_steps": 2, "save_steps": 100, "max_grad_norm": 100.0, **args_kwargs})
    cb = HFTelemetryCallback(**(cb_kwargs or {}))
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[cb])
    trainer.train(resume_from_checkpoint=True if resume else None)
    return cb, trainer


def test_hf_callback_adds_channels_to_the_trainer_logs(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cb, trainer = _hf_train(tmp_path / "out", 6)
    ds = cb.dataset()
    assert ds.step.values.tolist() == list(range(6))
    assert ds.grad_norm.notnull().all() and ds.adam_eps_frac.notnull().all()
    train_logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in train_logs] == [2, 4, 6]
    for h in train_logs:  # the row of the update that brought global_step to h["step"]
        row = ds.sel(step=h["step"] - 1)
        assert h["stability/grad_norm"] == pytest.approx(float(row.grad_norm), rel=1e-9)
        assert h["stability/grad_norm"] == pytest.approx(h["grad_norm"], rel=1e-5)  # the Trainer's own, unclipped
        assert h["stability/update_ratio"] == pytest.approx(float(row.update_ratio), rel=1e-9)
    summary = trainer.state.log_history[-1]
    assert "train_runtime" in summary and not any(k.startswith("stability/") for k in summary)
    assert cb.monitor is not None and not cb.monitor._handles


def test_hf_logs_the_norm_before_clipping_as_the_trainer_does_and_the_controllers_decisions(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cb, trainer = _hf_train(tmp_path / "out", 4, max_grad_norm=1e-3, cb_kwargs={"controller": _watching_controller()})
    ds = cb.dataset()
    np.testing.assert_allclose(ds.grad_norm_applied.values, 1e-3, rtol=1e-3)
    train_logs = [h for h in trainer.state.log_history if "loss" in h]
    for h in train_logs:
        assert h["stability/grad_norm"] == pytest.approx(h["grad_norm"], rel=1e-5)  # the Trainer's own, before clipping
        assert h["stability/grad_norm"] > 1e-2 and h["stability/controller_action/skip"] == 0.0
        assert h["stability/controller_alarm"] == 0.0
    assert np.isfinite(train_logs[-1]["stability/controller_score"])  # once its window holds values


def test_hf_checkpoint_resume_continues_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    whole, _ = _hf_train(tmp_path / "whole", 6)
    first, _ = _hf_train(tmp_path / "cut", 3, save_steps=3)
    assert (tmp_path / "cut" / "checkpoint-3" / "telemetry_state.pt").is_file()
    resumed, _ = _hf_train(tmp_path / "cut", 6, resume=True, save_steps=3)
    a, b = whole.dataset(), resumed.dataset()
    assert b.step.values.tolist() == list(range(6))
    np.testing.assert_array_equal(b.grad_norm.values[:3], first.dataset().grad_norm.values)
    for ch in ("grad_norm", "update_ratio", "adam_m_norm", "lr"):
        np.testing.assert_allclose(b[ch].values, a[ch].values, rtol=1e-4, err_msg=ch)
    assert np.isnan(b.xgrad.values[[0, 3]]).all() and np.isfinite(b.xgrad.values[[1, 2, 4, 5]]).all()


def test_hf_resume_without_telemetry_state_warns(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _hf_train(tmp_path / "cut", 3, save_steps=3)
    (tmp_path / "cut" / "checkpoint-3" / "telemetry_state.pt").unlink()
    with pytest.warns(UserWarning, match="without"):
        resumed, _ = _hf_train(tmp_path / "cut", 5, resume=True, save_steps=100)
    assert resumed.dataset().step.values.tolist() == [3, 4]  # the steps before are not invented


# -- framework examples in docs/integrations.md -----------------------------------------------------
def test_lightning_example(tmp_path, monkeypatch, capsys):
    pytest.importorskip("lightning")
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    exec(compile(_doc_block("LightningTelemetryCallback"), "docs:lightning", "exec"), ns)
    assert ns["ds"].sizes["step"] == 40
    logs = [p for p in (tmp_path / "lightning_logs").iterdir() if p.is_dir()]
    assert len(logs) == 1
    assert [e.step for e in _scalars(logs[0])["stability/grad_norm"]] == [9, 19, 29, 39]
    assert "[" in capsys.readouterr().out


def test_hf_example(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    exec(compile(_doc_block("HFTelemetryCallback"), "docs:hf", "exec"), ns)
    assert ns["ds"].sizes["step"] == 20
    found: dict = {}
    for d in {p.parent for p in (tmp_path / "out").rglob("events.out.tfevents.*")}:
        found.update(_scalars(d))
    assert [e.step for e in found["train/stability/grad_norm"]] == [5, 10, 15, 20]


def test_summary_writer_gets_one_event_per_row_from_a_background_thread(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    class Prefixed(SummaryWriter):  # changes add_scalar: the sink must keep calling it
        def add_scalar(self, tag, value, global_step=None, **kw):
            super().add_scalar("p/" + tag, value, global_step, **kw)

    plain, prefixed = SummaryWriter(str(tmp_path / "plain")), Prefixed(str(tmp_path / "prefixed"))
    for w in (plain, prefixed):
        mon = _train({"writer": w, "sync_every": 4}, steps=6)
        assert (mon._sink._background is not None) == (w is plain)
        mon.close()
        w.close()
    assert [e.step for e in _scalars(tmp_path / "prefixed")["p/stability/grad_norm"]] == list(range(6))
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    events = [e for f in (tmp_path / "plain").glob("events.*") for e in EventFileLoader(str(f)).Load()
              if e.summary.value]
    assert [e.step for e in events] == list(range(6))  # one event per row, all channels in it
    assert {v.tag for v in events[0].summary.value} >= {"stability/grad_norm", "stability/loss"}

    broken = SummaryWriter(str(tmp_path / "broken"))

    def fail(*args, **kwargs):
        raise OSError("disk full")

    broken._get_file_writer().add_summary = fail
    mon = _train({"writer": broken, "sync_every": 2}, steps=3)
    with pytest.raises(RuntimeError, match="writer failed") as err:
        mon.close()
    assert isinstance(err.value.__cause__, OSError)
    broken.close()
