"""The Monitor's low-memory mode: the count-sketch estimator on synthetic vectors (unbiased, its
stated variance), and memory="sketch" against the exact mode (norms and Adam exact, cosines
within their error, a fraction of the memory)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from stabstudy.instruments.telemetry import OPT_CHANNELS, Monitor
from stabstudy.instruments.telemetry.sketch import CountSketch


def pair(n: int, rho: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Two vectors with cosine ~ rho and unequal coordinate scales (as gradients have)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(n, generator=g, dtype=torch.float64))
    a = torch.randn(n, generator=g, dtype=torch.float64) * scale
    b = rho * a + math.sqrt(1 - rho**2) * torch.randn(n, generator=g, dtype=torch.float64) * scale
    return a, b


def sketches(a, b, k, seeds, sizes=None):
    out = []
    for s in seeds:
        cs = CountSketch(sizes or [a.numel()], k, s, a.device, a.dtype)
        sa, sb = torch.zeros(k, dtype=a.dtype), torch.zeros(k, dtype=a.dtype)
        parts = list(a.split(sizes)) if sizes else [a]
        cs.project(parts, sa)
        cs.project(list(b.split(sizes)) if sizes else [b], sb)
        out.append((float(sa @ sb), float(sa @ sa), float(sb @ sb)))
    return np.array(out)


@pytest.mark.parametrize("rho", [0.0, 0.6])
def test_dot_estimate_is_unbiased_with_the_stated_variance(rho):
    a, b = pair(20_000, rho)
    k, seeds = 256, range(300)
    # several tensors with ragged sizes: pieces cross blocks and tensor boundaries
    est = sketches(a, b, k, seeds, sizes=[7, 5000, 3, 12_345, 2645])
    ab, aa, bb = float(a @ b), float(a @ a), float(b @ b)
    sd = math.sqrt((aa * bb + ab**2) / k)  # the stated standard deviation of one estimate
    assert abs(est[:, 0].mean() - ab) < 4 * sd / math.sqrt(len(seeds))
    assert 0.7 < est[:, 0].std() / sd < 1.3
    # ||Sa||^2 estimates ||a||^2 without bias, relative sd ~ sqrt(2/k)
    assert abs(est[:, 1].mean() / aa - 1) < 4 * math.sqrt(2 / k) / math.sqrt(len(seeds))
    assert 0.7 < (est[:, 1] / aa).std() / math.sqrt(2 / k) < 1.3
    # the ratio estimator of the cosine: sd ~ (1 - rho^2) / sqrt(k), every seed within 5 of them
    true = ab / math.sqrt(aa * bb)
    cos = est[:, 0] / np.sqrt(est[:, 1] * est[:, 2])
    sd_cos = (1 - true**2) / math.sqrt(k)
    assert 0.7 < cos.std() / sd_cos < 1.3
    assert np.abs(cos - true).max() < 5 * sd_cos


def test_the_sketch_is_seeded_and_linear():
    a, b = pair(5000, 0.3)
    cs = CountSketch([5000], 64, 3, a.device, a.dtype)
    outs = [torch.zeros(64, dtype=a.dtype) for _ in range(4)]
    for o, v in zip(outs, (a, b, a - b, a), strict=True):
        cs.project([v], o)
    torch.testing.assert_close(outs[0] - outs[1], outs[2])  # S(a - b) = Sa - Sb: no copy of w_before needed
    torch.testing.assert_close(outs[0], outs[3], rtol=0, atol=0)
    other = torch.zeros(64, dtype=a.dtype)
    CountSketch([5000], 64, 4, a.device, a.dtype).project([a], other)
    assert not torch.equal(other, outs[0])
    with pytest.raises(ValueError, match="power of two"):
        CountSketch([10], 100, 0, a.device, a.dtype)


def train(memory, *, opt="adamw", every=1, k=1024, steps=30):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.Tanh(), torch.nn.Linear(128, 64),
                                torch.nn.Tanh(), torch.nn.Linear(64, 4))
    o = (torch.optim.AdamW(model.parameters(), lr=3e-3) if opt == "adamw"
         else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    mon = Monitor(model, o, every=every, memory=memory, sketch_dim=k)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)
        o.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        o.step()
    ds = mon.to_dataset()
    n_bytes = mon.memory_bytes()
    mon.close()
    return ds, n_bytes


@pytest.mark.parametrize(("opt", "every"), [("adamw", 1), ("adamw", 3), ("sgd", 2)])
def test_sketch_mode_against_the_exact_mode(opt, every):
    k = 1024
    exact, exact_bytes = train("exact", opt=opt, every=every, k=k)
    sk, sk_bytes = train("sketch", opt=opt, every=every, k=k)
    for ch in OPT_CHANNELS:  # measured on the same steps
        np.testing.assert_array_equal(np.isnan(sk[ch].values), np.isnan(exact[ch].values), err_msg=ch)
    for ch in ("grad_norm", "adam_m_norm", "adam_v_mean", "adam_eps_frac", "lr"):  # exact
        np.testing.assert_allclose(sk[ch].values, exact[ch].values, rtol=1e-5, equal_nan=True, err_msg=ch)
    for ch in ("xgrad", "update_grad_cos"):  # ratio estimator: sd <= 1/sqrt(k)
        err = np.abs(sk[ch].values - exact[ch].values)
        assert np.nanmax(err) < 5 / math.sqrt(k), (ch, np.nanmax(err))
        assert np.isfinite(err).sum() >= 5
    rel = np.abs(sk.update_norm.values / exact.update_norm.values - 1)
    assert np.nanmax(rel) < 5 * math.sqrt(1 / (2 * k))
    np.testing.assert_allclose(sk.update_ratio.values / sk.update_norm.values,
                               exact.update_ratio.values / exact.update_norm.values, rtol=1e-5)  # exact ||w||
    assert sk_bytes < exact_bytes / 2


def test_sketch_memory_is_a_small_fraction_of_a_large_model():
    model = torch.nn.Sequential(torch.nn.Linear(2048, 1536), torch.nn.Linear(1536, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = Monitor(model, opt, memory="sketch", sketch_dim=4096)
    opt.zero_grad()
    model(torch.randn(4, 2048)).sum().backward()
    opt.step()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert mon.memory_bytes() <= 0.05 * param_bytes
    assert np.isfinite(mon.row()["update_norm"])
    mon.close()


def test_memory_mode_is_validated():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    with pytest.raises(ValueError, match="memory must be one of 'exact', 'sketch'"):
        Monitor(None, opt, memory="low")
    with pytest.raises(ValueError, match="sketch_dim must be a power of two"):
        Monitor(None, opt, memory="sketch", sketch_dim=1000)
    with pytest.raises(ValueError, match="per_layer=True needs memory='exact'"):
        Monitor(None, opt, memory="sketch", per_layer=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sketch_mode_makes_no_host_sync_on_cuda():
    """memory="sketch" on CUDA: no synchronising call in the steps (sync debug mode "error"), and
    the same channels as on the CPU (the sketch's signs are drawn on the host, the same there)."""
    out = {}
    for device in ("cuda", "cpu"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        mon = Monitor(model, opt, every=2, memory="sketch", sketch_dim=256, sync_every=4)
        x, y = torch.randn(16, 32).to(device), torch.randn(16, 4).to(device)
        for i in range(9):
            if device == "cuda" and i >= 1:  # the first step builds the sketch (host -> device copies)
                if i == 1:
                    torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            try:
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        out[device] = mon.to_dataset()
        mon.close()
    for ch in OPT_CHANNELS:
        np.testing.assert_allclose(out["cuda"][ch].values, out["cpu"][ch].values, rtol=1e-3, atol=1e-5,
                                   equal_nan=True, err_msg=ch)
