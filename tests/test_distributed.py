"""The Monitor under torch.distributed: DDP and FSDP2 (gloo, 2 processes on the CPU, started here)
record every channel the single-process run records on the same global batch.

The ranks rendezvous through a file store of their own on the loopback device, with a timeout;
they stop before tearing their group down until both are done, and end without the interpreter's
teardown of torch's threads (a run on a loaded machine once aborted all four tests with
"terminate called without an active exception"). Where gloo cannot start, the tests skip and say
why; a rank that fails or outlives the deadline fails them, naming it."""

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


#: Seconds the ranks may take together (imports, gloo's rendezvous, both trainings) before the
#: test stops them and fails: on the loaded 2-core machine they take 40-150 s.
DEADLINE_S = 420
#: Seconds gloo's rendezvous and each collective may wait for the other rank.
GLOO_TIMEOUT_S = 180


def worker(rank: int, d: str) -> None:
    """One rank: its results go to ``rank<r>.pkl`` once its process group is torn down (written
    atomically); a rendezvous that fails goes to ``rank<r>.nogloo`` (the test then skips, naming it),
    any other error to ``rank<r>.error``. The process then ends at once (``os._exit``), not through
    the interpreter's teardown of torch's threads."""
    import os
    import socket
    import traceback
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    if "lo" in {name for _, name in socket.if_nameindex()}:
        # the loopback device: the host name may resolve to an address this sandbox cannot reach
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    code = 1
    try:
        try:
            dist.init_process_group("gloo", init_method=f"file://{d}/store", rank=rank, world_size=WORLD,
                                    timeout=timedelta(seconds=GLOO_TIMEOUT_S))
        except Exception as e:  # gloo cannot start here: the test skips, saying why
            _write(f"{d}/rank{rank}.nogloo", f"{type(e).__name__}: {e}".encode())
            code = 0
            return
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
        dist.barrier()  # neither rank tears its group down while the other still talks to it
        dist.destroy_process_group()
        _write(f"{d}/rank{rank}.pkl", pickle.dumps(res))
        code = 0
    except BaseException:
        _write(f"{d}/rank{rank}.error", traceback.format_exc().encode())
    finally:
        os._exit(code)


def _write(path: str, data: bytes) -> None:
    import os

    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Both ranks' results; a skip naming the reason where gloo cannot start here; a failure naming
    the rank and its error (or the deadline) otherwise."""
    import multiprocessing as mp
    import time

    d = tmp_path_factory.mktemp("dist")  # a fresh file store for this run
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, str(d)), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    end = time.monotonic() + DEADLINE_S
    for p in procs:
        p.join(max(end - time.monotonic(), 0.0))
    late = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    nogloo = sorted(d.glob("rank*.nogloo"))
    if nogloo:
        pytest.skip(f"gloo cannot start a process group here: {nogloo[0].read_text()}")
    errors = {f.name: f.read_text() for f in sorted(d.glob("rank*.error"))}
    assert not errors, f"a rank failed: {errors}"
    assert not late, f"ranks {late} still ran after {DEADLINE_S} s (gloo's own timeout is {GLOO_TIMEOUT_S} s)"
    missing = {r: p.exitcode for r, p in enumerate(procs) if not (d / f"rank{r}.pkl").exists()}
    assert not missing, f"ranks ended without results (rank: exit code) {missing}"
    return [pickle.loads((d / f"rank{r}.pkl").read_bytes()) for r in range(WORLD)]


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
