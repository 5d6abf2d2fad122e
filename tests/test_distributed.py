"""The Monitor under torch.distributed: DDP and FSDP2 (gloo, 2 processes on the CPU, started here)
record every channel the single-process run records on the same global batch."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from stabstudy.instruments.telemetry import OPT_CHANNELS, Monitor

WORLD = 2
STEPS = 6
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("needs torch.distributed with gloo", allow_module_level=True)


class ListWriter:
    def __init__(self):
        self.calls = []

    def add_scalar(self, tag, value, global_step):
        self.calls.append((tag, value, global_step))


def make():
    """The model (float64: the comparison is at 1e-10), its optimizer and the global batch."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).double()
    x = torch.randn(16, 8, dtype=torch.float64)
    y = torch.randn(16, 3, dtype=torch.float64)
    return model, x, y


def train(model, opt, mon, x, y):
    norms = []
    mon.add_pre_step_hook(lambda o, s: norms.append(float(s.grad_norm)))
    for _ in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()  # mean over this rank's rows
        opt.step()
    ds = mon.to_dataset()
    mon.close()
    return ds, norms


def single(kind: str):
    model, x, y = make()
    if kind == "ddp":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        mon = Monitor(model, opt, every=2, per_layer=True)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        mon = Monitor(model, opt)
    return train(model, opt, mon, x, y)


def worker(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        res = {}
        # DDP: the gradients are averaged before the step; the parameters stay replicated
        model, x, y = make()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        writer = ListWriter()
        mon = Monitor(ddp, opt, every=2, per_layer=True, writer=writer)
        ds, norms = train(ddp, opt, mon, x[rank::WORLD], y[rank::WORLD])
        res["ddp"] = (ds, norms, len(writer.calls))
        # FSDP2: every parameter sharded over the ranks (the last layer unevenly: 3 rows)
        model, x, y = make()
        fully_shard(model, mesh=init_device_mesh("cpu", (WORLD,)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        ds, norms = train(model, opt, Monitor(model, opt), x[rank::WORLD], y[rank::WORLD])
        res["fsdp"] = (ds, norms, 0)
        try:
            Monitor(model, opt, per_layer=True)
            model(x).sum().backward()
            opt.step()
            res["per_layer_error"] = ""
        except ValueError as e:
            res["per_layer_error"] = str(e)
        with open(f"{out}/rank{rank}.pkl", "wb") as f:
            pickle.dump(res, f)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    import torch.multiprocessing as mp

    d = tmp_path_factory.mktemp("dist")
    mp.spawn(worker, args=(str(d / "store"), str(d)), nprocs=WORLD, join=True)
    out = []
    for r in range(WORLD):
        with open(d / f"rank{r}.pkl", "rb") as f:
            out.append(pickle.load(f))
    return out


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_every_channel_equals_the_single_process_run(ranks, kind):
    ref, ref_norms = single(kind)
    chans = list(OPT_CHANNELS) + (["layer_grad_norm", "layer_update_ratio"] if kind == "ddp" else [])
    for r, res in enumerate(ranks):
        ds, norms, _ = res[kind]
        assert ds.sizes["step"] == STEPS
        for ch in chans:
            np.testing.assert_allclose(ds[ch].values, ref[ch].values, rtol=1e-10, atol=0, equal_nan=True,
                                       err_msg=f"{kind} rank {r} {ch}")
        assert np.isfinite(ds.update_grad_cos.values[::2]).all() and np.isfinite(ds.xgrad.values[1:]).sum() >= 2
        np.testing.assert_allclose(norms, ref_norms, rtol=1e-10)  # a pre-step hook sees the global norm
        assert ds.attrs["monitor_rank"] == r and ds.attrs["monitor_world_size"] == WORLD
    if kind == "fsdp":
        assert np.isfinite(ranks[0]["fsdp"][0].adam_v_mean.values).all()
    assert "monitor_rank" not in ref.attrs


def test_rank_zero_alone_writes_the_rows(ranks):
    assert ranks[0]["ddp"][2] > 0 and ranks[1]["ddp"][2] == 0


def test_per_layer_with_sharded_parameters_is_refused(ranks):
    assert "per_layer=True needs unsharded parameters" in ranks[0]["per_layer_error"]
