"""The Monitor's fused C kernels (stabstudy.instruments.telemetry.kernels): same channels as its torch ops, fallback
where the kernels cannot read the tensors, and the compile / cache / disable paths."""

from __future__ import annotations

import math
import os
import warnings

import numpy as np
import pytest
import torch

from stabstudy.instruments.telemetry import Monitor, kernels

# CI has a C compiler: there a missing kernel is a failure, not a skip
needs_kernels = pytest.mark.skipif(kernels.load() is None and not os.environ.get("CI"),
                                   reason=f"fused kernels unavailable: {kernels.unavailable_reason()}")

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    # two param groups with different betas: per-coordinate bias corrections (torch ops inside a fused step)
    "adam-groups": lambda ps: torch.optim.Adam([{"params": ps[:2]}, {"params": ps[2:], "betas": (0.5, 0.9)}],
                                               lr=0.01),
}


def train(backend, opt_name="adam", every=1, per_layer=False, steps=9, dtype=torch.float32, hook=None):
    """``opt_name``: a key of OPTIMIZERS, or a factory ``params -> optimizer``."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(6, 700), torch.nn.Tanh(), torch.nn.Linear(700, 3)).to(dtype)
    make_opt = OPTIMIZERS[opt_name] if isinstance(opt_name, str) else opt_name
    opt = make_opt(list(model.parameters()))
    mon = Monitor(model, opt, every=every, per_layer=per_layer, backend=backend)
    gen = torch.Generator().manual_seed(4)
    for s in range(steps):
        x, y = torch.randn(32, 6, generator=gen, dtype=dtype), torch.randn(32, 3, generator=gen, dtype=dtype)
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        if hook is not None:
            hook(s, model)
        opt.step()
        mon.log(loss=loss)
    ds = mon.to_dataset()
    mon.close()
    return ds, mon


def assert_same(a, b, rtol=1e-5):
    assert list(a.data_vars) == list(b.data_vars)
    for ch in a.data_vars:
        np.testing.assert_allclose(a[ch].values, b[ch].values, rtol=rtol, atol=1e-9, equal_nan=True, err_msg=ch)


@needs_kernels
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize(("every", "per_layer"), [(1, False), (3, True)])
def test_fused_matches_torch(opt_name, every, per_layer):
    """Every channel, on every path: measured, kept for xgrad, norm only (every=3), per layer."""
    fused, mf = train("fused", opt_name, every, per_layer)
    ref, mt = train("torch", opt_name, every, per_layer)
    assert mf.fused_steps == 9 and mt.fused_steps == 0
    assert np.isfinite(fused.xgrad.values[::every][1:]).all()
    if opt_name != "sgd":
        assert np.isfinite(fused.adam_eps_frac.values[::every]).all()
    assert_same(fused, ref)


@needs_kernels
@pytest.mark.parametrize(("every", "odd_steps"), [(1, (2,)), (3, (1, 2))])  # every=3: norm-only, kept
def test_auto_falls_back_per_step(every, odd_steps):
    """float64 parameters and a non-contiguous gradient go through torch ops, with the same values."""
    ds64, m64 = train("auto", dtype=torch.float64, steps=3, every=every, per_layer=True)
    assert m64.fused_steps == 0 and np.isfinite(ds64.grad_norm.values).all()
    assert np.isfinite(ds64.layer_grad_norm.values).all()

    def transpose_grad(step, model):  # the same values, laid out column-major
        if step in odd_steps:
            w = model[0].weight
            w.grad = w.grad.t().contiguous().t()
            assert not w.grad.is_contiguous()

    auto, ma = train("auto", hook=transpose_grad, steps=5, every=every)
    ref, _ = train("torch", hook=transpose_grad, steps=5, every=every)
    assert ma.fused_steps == 5 - len(odd_steps)
    assert np.isfinite(auto.xgrad.values[3]), "xgrad across the switch of backends"
    assert_same(auto, ref)
    with pytest.raises(RuntimeError, match="contiguous float32 CPU"):
        train("fused", dtype=torch.float64, steps=1)


@needs_kernels
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_fused_nonfinite_gradient_is_recorded(bad):
    def poison(step, model):
        if step == 1:
            model[0].weight.grad[0, 0] = bad

    ds, mon = train("fused", opt_name="sgd", hook=poison, steps=3)
    ref, _ = train("torch", opt_name="sgd", hook=poison, steps=3)
    assert mon.fused_steps == 3
    g = ds.grad_norm.values
    assert np.isfinite(g[0]) and (np.isnan(g[1]) if math.isnan(bad) else np.isposinf(g[1]))
    np.testing.assert_array_equal(np.isnan(ds.update_norm.values), np.isnan(ref.update_norm.values))


def test_backend_choices():
    lin = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="'auto', 'fused', 'torch'"):
        Monitor(lin, torch.optim.SGD(lin.parameters(), lr=0.1), backend="cuda")


@pytest.fixture
def fresh_kernels(monkeypatch, tmp_path):
    """kernels.load() as in a new process, compiling into an empty cache folder."""
    for name, value in (("_tried", False), ("_loaded", None), ("_reason", None)):
        monkeypatch.setattr(kernels, name, value)
    monkeypatch.setenv("STABSTUDY_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("STABSTUDY_FUSED", raising=False)
    return tmp_path / "cache"


def test_disabled_by_environment(fresh_kernels, monkeypatch):
    monkeypatch.setenv("STABSTUDY_FUSED", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an explicit opt-out is not warned about
        assert kernels.load() is None
    assert "STABSTUDY_FUSED" in kernels.unavailable_reason()
    lin = torch.nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="unavailable: disabled by STABSTUDY_FUSED"):
        Monitor(lin, torch.optim.SGD(lin.parameters(), lr=0.1), backend="fused")
    mon = Monitor(lin, torch.optim.SGD(lin.parameters(), lr=0.1))  # auto: the torch path
    assert mon._kernels is None


def test_no_compiler(fresh_kernels, monkeypatch):
    monkeypatch.setenv("CC", "no-such-cc-stabstudy")
    with pytest.warns(RuntimeWarning, match="no C compiler.*uses torch ops"):
        assert kernels.load() is None
    assert "no C compiler" in kernels.unavailable_reason()


def test_compiler_error_is_reported(fresh_kernels, monkeypatch):
    monkeypatch.setenv("CC", "false")  # exists, exits 1
    with pytest.warns(RuntimeWarning, match="false failed"):
        assert kernels.load() is None
    assert "false failed" in kernels.unavailable_reason()
    assert not list(fresh_kernels.glob("*")), "no partial library left behind"


@needs_kernels
def test_compiler_with_arguments(fresh_kernels, monkeypatch):
    """$CC may carry flags or a launcher, as make and setuptools allow."""
    monkeypatch.setenv("CC", f"{os.environ.get('CC') or 'cc'} -g0")
    k = kernels.load()
    assert k is not None, kernels.unavailable_reason()


@needs_kernels
def test_compiles_once_into_the_cache(fresh_kernels, monkeypatch):
    k = kernels.load()
    assert k is not None and k.path.parent == fresh_kernels
    assert [p.name for p in fresh_kernels.iterdir()] == [k.path.name]  # no temporary files left
    umask = os.umask(0)
    os.umask(umask)
    assert k.path.stat().st_mode & 0o777 == 0o777 & ~umask  # a shared cache stays loadable by others
    mtime = k.path.stat().st_mtime_ns
    monkeypatch.setattr(kernels, "_tried", False)
    assert kernels.load().path == k.path and k.path.stat().st_mtime_ns == mtime  # reused, not rebuilt


class OutOfPlaceSGD(torch.optim.Optimizer):
    """Assigns ``p.data`` a new tensor each step, as hand-written optimizers sometimes do."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data = p.data - group["lr"] * p.grad


@needs_kernels
def test_parameters_replaced_by_the_step():
    """The post-hook sees new parameter tensors: the update is formed by torch ops, the sums by
    the kernels, and the next pre-hook checks the new tensors again."""
    def make(ps):
        return OutOfPlaceSGD(ps, lr=0.05)

    fused, mon = train("fused", make, steps=4)
    ref, _ = train("torch", make, steps=4)
    assert mon.fused_steps == 4 and np.isfinite(fused.update_norm.values).all()
    assert_same(fused, ref)


@needs_kernels
def test_damaged_cached_library_is_rebuilt(fresh_kernels):
    # as left by an earlier process (never by this one: the compile writes a temporary file and
    # renames it; rewriting a library this process has loaded would corrupt its mapped code)
    path = fresh_kernels / kernels._library_name(os.environ.get("CC") or "cc")
    fresh_kernels.mkdir()
    path.write_bytes(b"not a shared library")
    k = kernels.load()
    assert k is not None and k.path == path and path.read_bytes()[:4] == b"\x7fELF"
    lin = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    mon = Monitor(lin, opt, backend="fused")
    lin(torch.ones(1, 3)).sum().backward()
    opt.step()
    assert mon.fused_steps == 1 and mon.grad_norm() > 0
