"""The Monitor where users already look: pandas, TensorBoard writers, SB3's logger; README examples."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import xarray as xr

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


def test_writer_rejects_objects_without_add_scalar():
    with pytest.raises(TypeError, match="add_scalar"):
        _train({"writer": object()}, steps=1)


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


# -- README examples ------------------------------------------------------------------
def _readme_block(marker: str) -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("### Where you already look", 1)[1].split("\n## ", 1)[0]
    blocks = [b for b in re.findall(r"```python\n(.*?)```", section, flags=re.S) if marker in b]
    assert len(blocks) == 1, f"one README example with {marker!r} expected"
    return blocks[0]


def test_readme_summary_writer_example(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    exec(compile(_readme_block("SummaryWriter"), "README:writer", "exec"), ns)
    logdirs = [p for p in (tmp_path / "runs").rglob("*") if p.is_dir()] + [tmp_path / "runs"]
    found = {}
    for d in logdirs:
        found.update(_scalars(d))
    assert len(found["stability/grad_norm"]) == 200


def test_readme_sb3_example(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(_readme_block("tensorboard_log"), "README:sb3", "exec"), {})
    runs = [p for p in (tmp_path / "runs").iterdir() if p.is_dir()]
    assert runs and "stability/grad_norm" in _scalars(runs[0])


def test_readme_to_frame_example(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    exec(compile(_readme_block("to_frame"), "README:frame", "exec"), ns)
    df = ns["df"]
    assert list(df.columns) == ["step", "channel", "layer", "value"]
    assert "grad_norm" in capsys.readouterr().out
