"""Monitor channels against values computed by hand (numpy) on a tiny linear model."""

from __future__ import annotations

import copy
import math
import time

import numpy as np
import pytest
import torch

from stabstudy.instruments.telemetry import OPT_CHANNELS, Monitor, gradient_coherence

W0 = np.array([[0.5, -0.3, 0.8], [0.1, 0.4, -0.6]])
B0 = np.array([0.2, -0.1])
X = np.array([[1.0, 2.0, -1.0], [0.5, -0.5, 0.3], [-1.2, 0.7, 2.0], [0.0, 1.0, 1.0]])
Y = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-1.0, 0.5]])


# (dtype, rel. tolerance) against the float64 numpy reference (the Monitor sums a float64 model
# in float64, others in float32)
PRECISIONS = [pytest.param(torch.float64, 1e-12, id="float64"), pytest.param(torch.float32, 2e-5, id="float32")]


def make_linear(dtype: torch.dtype = torch.float64) -> torch.nn.Linear:
    lin = torch.nn.Linear(3, 2).to(dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor(W0))
        lin.bias.copy_(torch.tensor(B0))
    return lin


def np_grad(W: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Flat gradient [dW (row-major), db] of mean((XW^T + b - Y)^2)."""
    out = X @ W.T + b
    d = 2.0 * (out - Y) / out.size
    return np.concatenate([(d.T @ X).ravel(), d.sum(0)])


def split(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return w[:6].reshape(2, 3), w[6:]


def torch_steps(lin, opt, n, mon=None, log=True):
    x, y = torch.tensor(X, dtype=lin.weight.dtype), torch.tensor(Y, dtype=lin.weight.dtype)
    for _ in range(n):
        opt.zero_grad()
        loss = ((lin(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        if mon is not None and log:
            mon.log(loss=loss)


def cos(a, b):
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize(("dtype", "rel"), PRECISIONS)
def test_sgd_channels_by_hand(dtype, rel):
    lin = make_linear(dtype)
    lr = 0.1
    opt = torch.optim.SGD(lin.parameters(), lr=lr)
    mon = Monitor(lin, opt)
    torch_steps(lin, opt, 2, mon)
    ds = mon.to_dataset()
    mon.close()
    assert mon.row()["grad_norm"] == ds.grad_norm.values[-1] and mon.row(0)["loss"] == ds.loss.values[0]

    w0 = np.concatenate([W0.ravel(), B0])
    g0 = np_grad(W0, B0)
    w1 = w0 - lr * g0
    g1 = np_grad(*split(w1))
    assert list(ds.step.values) == [0, 1]
    assert ds.grad_norm.values == pytest.approx([np.linalg.norm(g0), np.linalg.norm(g1)], rel=rel)
    assert ds.update_norm.values[0] == pytest.approx(lr * np.linalg.norm(g0), rel=rel)
    assert ds.update_ratio.values[0] == pytest.approx(lr * np.linalg.norm(g0) / np.linalg.norm(w0), rel=rel)
    assert ds.update_ratio.values[1] == pytest.approx(lr * np.linalg.norm(g1) / np.linalg.norm(w1), rel=rel)
    assert ds.update_grad_cos.values == pytest.approx([1.0, 1.0], abs=rel)
    assert math.isnan(ds.xgrad.values[0])
    assert ds.xgrad.values[1] == pytest.approx(cos(g1, g0), abs=rel)
    assert ds.lr.values == pytest.approx([lr, lr])
    for ch in ("adam_m_norm", "adam_v_mean", "adam_eps_frac"):
        assert np.isnan(ds[ch].values).all(), ch
    assert ds.loss.dtype == np.float64 and ds.grad_norm.dtype == np.float64
    assert "long_name" in ds.grad_norm.attrs and "long_name" in ds.loss.attrs


def np_adam(n_steps, lr, b1, b2, eps, wd=0.0, decoupled=False):
    """Hand-written Adam/AdamW; per step returns (g, w_before, w_after, m_hat, v_hat)."""
    w = np.concatenate([W0.ravel(), B0])
    m = np.zeros_like(w)
    v = np.zeros_like(w)
    out = []
    for t in range(1, n_steps + 1):
        g = np_grad(*split(w))
        w_before = w.copy()
        if decoupled:
            w = w * (1 - lr * wd)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g**2
        m_hat = m / (1 - b1**t)
        v_hat = v / (1 - b2**t)
        w = w - lr * m_hat / (np.sqrt(v_hat) + eps)
        out.append((g, w_before, w.copy(), m_hat, v_hat))
    return out


@pytest.mark.parametrize(("dtype", "rel"), PRECISIONS)
@pytest.mark.parametrize("decoupled", [False, True])
def test_adam_and_adamw_channels_by_hand(decoupled, dtype, rel):
    lr, b1, b2, eps, wd = 0.05, 0.8, 0.9, 0.3, 0.1
    lin = make_linear(dtype)
    if decoupled:
        opt = torch.optim.AdamW(lin.parameters(), lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    else:
        opt = torch.optim.Adam(lin.parameters(), lr=lr, betas=(b1, b2), eps=eps)
    mon = Monitor(lin, opt)
    torch_steps(lin, opt, 3, mon)
    ds = mon.to_dataset()
    ref = np_adam(3, lr, b1, b2, eps, wd=wd, decoupled=decoupled)
    for t, (g, wb, wa, m_hat, v_hat) in enumerate(ref):
        u = wa - wb
        assert ds.grad_norm.values[t] == pytest.approx(np.linalg.norm(g), rel=rel)
        assert ds.update_norm.values[t] == pytest.approx(np.linalg.norm(u), rel=rel)
        assert ds.update_ratio.values[t] == pytest.approx(np.linalg.norm(u) / np.linalg.norm(wb), rel=rel)
        assert ds.update_grad_cos.values[t] == pytest.approx(cos(u, -g), abs=rel)
        assert ds.adam_m_norm.values[t] == pytest.approx(np.linalg.norm(m_hat), rel=rel)
        assert ds.adam_v_mean.values[t] == pytest.approx(v_hat.mean(), rel=rel)
        assert ds.adam_eps_frac.values[t] == pytest.approx(np.mean(np.sqrt(v_hat) < eps))
        if t:
            assert ds.xgrad.values[t] == pytest.approx(cos(g, ref[t - 1][0]), abs=rel)
    # eps chosen so that the fraction is strictly between 0 and 1 somewhere
    assert 0 < np.nanmax(ds.adam_eps_frac.values) < 1


@pytest.mark.parametrize("algo", ["adamw", "sgd"])
def test_float64_model_keeps_float64_precision_at_a_tiny_learning_rate(algo):
    """A float64 model at lr 1e-7: every channel equals an independent float64 computation from
    the parameters, gradients and Adam state read around each step, to 1e-10 relative (copies
    of the parameters in float32 lost the update: update_norm was off by about 1e-2)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(), torch.nn.Linear(64, 5)).double()
    params = list(model.parameters())
    if algo == "adamw":
        opt = torch.optim.AdamW(params, lr=1e-7, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    else:
        opt = torch.optim.SGD(params, lr=1e-7, momentum=0.9)
    mon = Monitor(model, opt)
    x, y = torch.randn(32, 20, dtype=torch.float64), torch.randn(32, 5, dtype=torch.float64)

    def flat(ts):
        return torch.cat([t.detach().reshape(-1) for t in ts]).numpy().copy()

    ref = []
    for t in range(1, 5):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        g, wb = flat(p.grad for p in params), flat(params)
        opt.step()
        u = flat(params) - wb
        row = {"grad_norm": np.linalg.norm(g), "update_norm": np.linalg.norm(u),
               "update_ratio": np.linalg.norm(u) / np.linalg.norm(wb), "update_grad_cos": cos(u, -g)}
        if ref:
            row["xgrad"] = cos(g, ref[-1]["g"])
        if algo == "adamw":
            m_hat = flat(opt.state[p]["exp_avg"] for p in params) / (1 - 0.9**t)
            v_hat = flat(opt.state[p]["exp_avg_sq"] for p in params) / (1 - 0.95**t)
            row.update(adam_m_norm=np.linalg.norm(m_hat), adam_v_mean=v_hat.mean(),
                       adam_eps_frac=np.mean(np.sqrt(v_hat) < 1e-8))
        ref.append({**row, "g": g})
    ds = mon.to_dataset()
    mon.close()
    for i, row in enumerate(ref):
        for ch, want in row.items():
            if ch != "g":
                assert ds[ch].values[i] == pytest.approx(want, rel=1e-10, abs=0), (ch, i)
    assert ds.update_norm.values[0] < 1e-5  # the update is tiny against the weights (norm ~ 5)
    if algo == "sgd":
        assert np.isnan(ds.adam_v_mean.values).all()


def two_layer_setup():
    torch.manual_seed(0)
    a = torch.nn.Linear(3, 4)
    b = torch.nn.Linear(4, 2)
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    opt_b = torch.optim.Adam(b.parameters(), lr=0.01)
    x, y = torch.randn(16, 3), torch.randn(16, 2)
    return a, b, opt_a, opt_b, x, y


def test_two_optimizers_shared_and_named_channels_with_delayed_second():
    a, b, opt_a, opt_b, x, y = two_layer_setup()
    mon = Monitor({"a": a, "b": b}, {"critic": opt_a, "actor": opt_b}, per_layer=True)
    expected_gn, expected_a, expected_b = [], [], []
    for i in range(6):
        opt_a.zero_grad()
        opt_b.zero_grad()
        loss = ((b(torch.tanh(a(x))) - y) ** 2).mean()
        loss.backward()
        ga = torch.cat([p.grad.reshape(-1) for p in a.parameters()]).norm().item()
        gb = torch.cat([p.grad.reshape(-1) for p in b.parameters()]).norm().item()
        opt_a.step()
        if i % 2 == 1:  # TD3-style delayed actor update
            opt_b.step()
            expected_gn.append(math.hypot(ga, gb))
            expected_b.append(gb)
        else:
            expected_gn.append(ga)
            expected_b.append(float("nan"))
        expected_a.append(ga)
        mon.log(loss=loss)
    ds = mon.to_dataset()
    mon.close()
    assert ds.sizes["step"] == 6
    np.testing.assert_allclose(ds.grad_norm.values, expected_gn, rtol=1e-5)
    np.testing.assert_allclose(ds.grad_norm_critic.values, expected_a, rtol=1e-5)
    np.testing.assert_allclose(ds.grad_norm_actor.values, expected_b, rtol=1e-5)
    # Adam channels: only the actor (Adam) has them, only on rows where it stepped
    assert np.isnan(ds.adam_m_norm.values[0::2]).all()
    assert np.isfinite(ds.adam_m_norm.values[1::2]).all()
    assert np.isnan(ds.adam_m_norm_critic.values).all()
    assert np.allclose(ds.lr.values, 0.1) and np.allclose(ds.lr_critic.values, 0.1)
    assert np.allclose(ds.lr_actor.values[1::2], 0.01)
    assert ds.layer_grad_norm.dims == ("step", "layer") and ds.sizes["layer"] == 4
    assert list(ds.layer.values) == ["a.weight", "a.bias", "b.weight", "b.bias"]
    # per-layer norms recombine to the global norm
    np.testing.assert_allclose(np.sqrt(np.nansum(ds.layer_grad_norm.values**2, axis=1)), expected_gn, rtol=1e-5)


def test_list_of_optimizers_names_and_global_update():
    a, b, opt_a, opt_b, x, y = two_layer_setup()
    mon = Monitor([a, b], [opt_a, opt_b])
    w_before = torch.cat([p.detach().reshape(-1).clone() for p in [*a.parameters(), *b.parameters()]])
    opt_a.zero_grad()
    opt_b.zero_grad()
    ((b(torch.tanh(a(x))) - y) ** 2).mean().backward()
    opt_a.step()
    opt_b.step()
    w_after = torch.cat([p.detach().reshape(-1) for p in [*a.parameters(), *b.parameters()]])
    ds = mon.to_dataset()
    assert mon.optimizer_names == ["opt0", "opt1"]
    assert ds.sizes["step"] == 1
    assert ds.update_norm.values[0] == pytest.approx((w_after - w_before).norm().item(), rel=1e-5)
    assert ds.update_ratio.values[0] == pytest.approx(((w_after - w_before).norm() / w_before.norm()).item(), rel=1e-5)
    assert "update_norm_opt0" in ds and "update_norm_opt1" in ds


def run_mlp(every, steps=7, per_layer=False):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    mon = Monitor(model, opt, every=every, per_layer=per_layer)
    gen = torch.Generator().manual_seed(2)
    for _ in range(steps):
        x, y = torch.randn(16, 5, generator=gen), torch.randn(16, 3, generator=gen)
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        mon.log(loss=loss)
    return mon.to_dataset()


def test_every_n_matches_every_1_where_measured():
    full = run_mlp(1)
    sparse = run_mlp(3)
    assert list(sparse.step.values) == list(range(7))
    np.testing.assert_allclose(sparse.grad_norm.values, full.grad_norm.values, rtol=1e-6)
    np.testing.assert_allclose(sparse.lr.values, full.lr.values)
    measured = np.array([s % 3 == 0 for s in range(7)])
    for ch in ("xgrad", "update_norm", "update_ratio", "update_grad_cos", "adam_m_norm", "adam_v_mean", "adam_eps_frac"):
        assert np.isnan(sparse[ch].values[~measured]).all(), ch
        ok = measured & np.isfinite(full[ch].values)
        np.testing.assert_allclose(sparse[ch].values[ok], full[ch].values[ok], rtol=1e-5, err_msg=ch)
    # xgrad at step 3 and 6 still uses the gradient of the step just before
    assert np.isfinite(sparse.xgrad.values[[3, 6]]).all()


def test_per_layer_every_n():
    ds = run_mlp(2, per_layer=True)
    assert np.isfinite(ds.layer_grad_norm.values).all()
    assert np.isfinite(ds.layer_update_ratio.values[0::2]).all()
    assert np.isnan(ds.layer_update_ratio.values[1::2]).all()


def test_hooks_leave_the_callers_grad_mode():
    """The hooks switch grad mode off for their copies and restore the caller's, on or off, measured
    step or not (every=2)."""
    lin = make_linear()
    opt = torch.optim.Adam(lin.parameters(), lr=0.1)
    mon = Monitor(lin, opt, every=2)
    x = torch.tensor(X, dtype=lin.weight.dtype)
    for mode in (True, False, True, False):
        opt.zero_grad()
        lin(x).pow(2).mean().backward()
        with torch.set_grad_enabled(mode):
            opt.step()
            assert torch.is_grad_enabled() is mode
    assert np.isfinite(mon.to_dataset().update_norm.values[::2]).all()


def test_log_new_channels_enabled_and_close():
    lin = make_linear()
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    mon = Monitor(lin, opt)
    torch_steps(lin, opt, 2, mon)
    mon.log(perf=3.0)  # appears at step 1 only
    mon.enabled = False
    torch_steps(lin, opt, 2, mon)  # not recorded
    mon.enabled = True
    torch_steps(lin, opt, 1, mon)
    ds = mon.to_dataset()
    assert list(ds.step.values) == [0, 1, 4]  # disabled updates still counted
    assert np.isnan(ds.perf.values[0]) and ds.perf.values[1] == 3.0
    mon.log(step=5, perf=1.0)  # log ahead of the next update
    torch_steps(lin, opt, 1, mon, log=False)
    ds = mon.to_dataset()
    assert ds.perf.values[-1] == 1.0 and np.isfinite(ds.grad_norm.values[-1])
    mon.close()
    torch_steps(lin, opt, 1, None)
    assert mon.to_dataset().sizes["step"] == 4  # hooks removed


def test_microbatch_coherence():
    g = torch.randn(10)
    assert gradient_coherence([g, g, g]) == pytest.approx(1.0)
    e = torch.eye(4)
    assert gradient_coherence([e[i] for i in range(4)]) == pytest.approx(0.25)
    lin = make_linear()
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    mon = Monitor(lin, opt)
    torch_steps(lin, opt, 1, mon)
    c = mon.microbatch_coherence([[e[0], e[1]], [e[1], e[0]]])
    assert c == pytest.approx(0.5)
    assert mon.to_dataset().grad_coherence.values[0] == pytest.approx(0.5)


def test_nonfinite_gradient_does_not_crash():
    lin = make_linear()
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    mon = Monitor(lin, opt)
    opt.zero_grad()
    for p in lin.parameters():
        p.grad = torch.full_like(p, float("nan"))
    opt.step()
    ds = mon.to_dataset()
    assert np.isnan(ds.grad_norm.values[0])


def _adam_expected(opt) -> tuple[float, float, float]:
    """||m_hat||, mean(v_hat), frac(sqrt(v_hat) < eps) from the optimizer state, per-parameter step counts."""
    m_hat, v_hat, below = [], [], []
    for g in opt.param_groups:
        b1, b2 = g["betas"]
        for p in g["params"]:
            st = opt.state[p]
            t = float(st["step"])
            m_hat.append((st["exp_avg"] / (1 - b1**t)).reshape(-1))
            vh = (st["exp_avg_sq"] / (1 - b2**t)).reshape(-1)
            v_hat.append(vh)
            below.append(vh.sqrt() < g["eps"])
    m, v, b = torch.cat(m_hat), torch.cat(v_hat), torch.cat(below)
    return m.norm().item(), v.mean().item(), b.float().mean().item()


def test_adam_eps_count_compares_in_the_buffers_dtype():
    """adam_eps_frac counts v < eps^2 (1 - beta2^t) with the threshold rounded to float32, the
    buffer's dtype, as the float32 state holds v: second moments placed on the float32 neighbours of
    the threshold (some below the float64 threshold but equal to its float32 rounding) count as a
    float32 comparison counts them, not as a float64 one."""
    eps, b2 = 3e-3, 0.999
    thr = eps * eps * (1 - b2)  # the threshold at step 1 (bias correction 1 - b2)
    t32 = torch.tensor(thr, dtype=torch.float32)
    v = torch.stack([torch.nextafter(t32, torch.tensor(d, dtype=torch.float32)) for d in (0.0, 1.0)] + [t32] * 2)
    w = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.Adam([w], lr=0.0, betas=(0.9, b2), eps=eps)
    # registered before the Monitor's post-hook, so it runs first: the state the Monitor reads is v
    opt.register_step_post_hook(lambda o, args, kwargs: o.state[w]["exp_avg_sq"].copy_(v))
    mon = Monitor(None, opt)
    w.grad = torch.ones(4)
    opt.step()
    expected = (v < t32).float().mean().item()  # 0.25: the neighbour below only
    assert expected != (v.double() < thr).float().mean().item()  # 0.75 in float64: the comparisons differ
    assert mon.to_dataset().adam_eps_frac.values[0] == pytest.approx(expected)


def test_adam_param_groups_with_different_hyperparameters():
    """Per-group betas / eps (the slow, per-coordinate bias-correction path) against the state."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    groups = [{"params": model[0].parameters(), "betas": (0.9, 0.99), "eps": 0.05},
              {"params": model[2].parameters(), "betas": (0.5, 0.9), "eps": 0.2}]
    opt = torch.optim.Adam(groups, lr=0.01)
    mon = Monitor(model, opt)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    for _ in range(3):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    ds = mon.to_dataset()
    m_norm, v_mean, frac = _adam_expected(opt)
    assert ds.adam_m_norm.values[-1] == pytest.approx(m_norm, rel=1e-5)
    assert ds.adam_v_mean.values[-1] == pytest.approx(v_mean, rel=1e-5)
    assert ds.adam_eps_frac.values[-1] == pytest.approx(frac)
    assert 0 < ds.adam_eps_frac.values[-1] < 1


def test_parameter_storage_moved_after_attach():
    """model.to(...) after attaching swaps parameter storage: the Monitor must follow it."""
    lin = make_linear().float()
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    mon = Monitor(lin, opt)
    lin.double()
    torch_steps(lin, opt, 1)  # a step in float64 storage
    lin.float()  # and back: new storage again
    w0 = torch.cat([p.detach().reshape(-1).clone() for p in lin.parameters()])
    opt.zero_grad()
    ((lin(torch.tensor(X, dtype=torch.float32)) - torch.tensor(Y, dtype=torch.float32)) ** 2).mean().backward()
    opt.step()
    w1 = torch.cat([p.detach().reshape(-1) for p in lin.parameters()])
    assert mon.to_dataset().update_norm.values[-1] == pytest.approx((w1 - w0).norm().item(), rel=1e-5)


@pytest.mark.parametrize("every", [1, 4])
def test_adam_step_counts_that_drift_apart(every):
    """A layer without gradient on some steps is skipped by Adam, so its step count lags: the
    bias corrections must follow each parameter's own count, also after the set of stepped
    parameters returns to what it was (the Monitor then reads every count again)."""
    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.5, 0.6), eps=0.05)
    mon = Monitor(model, opt, every=every)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    expected = {}
    for step in range(9):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        if step in (1, 2):  # the first layer sits these steps out (with every=4: unmeasured steps)
            for p in model[0].parameters():
                p.grad = None
        opt.step()
        if step % every == 0:
            expected[step] = _adam_expected(opt)
    counts = {float(opt.state[p]["step"]) for p in model.parameters()}
    assert counts == {7.0, 9.0}  # the counts really differ at the end
    ds = mon.to_dataset()
    for step, (m_norm, v_mean, frac) in expected.items():
        if step in (1, 2):  # global channels there cover the stepped parameters only
            continue
        row = ds.sel(step=step)
        assert float(row.adam_m_norm) == pytest.approx(m_norm, rel=1e-5), step
        assert float(row.adam_v_mean) == pytest.approx(v_mean, rel=1e-5), step
        assert float(row.adam_eps_frac) == pytest.approx(frac, abs=1e-6), step


def test_adam_state_replaced_by_load_state_dict():
    """After optimizer.load_state_dict the Monitor reads the new state, not cached tensors."""
    torch.manual_seed(5)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    mon = Monitor(model, opt)
    x, y = torch.randn(6, 3), torch.randn(6, 2)

    def step():
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()

    step()
    saved = copy.deepcopy(opt.state_dict())
    for st in saved["state"].values():  # a different state than the one the Monitor has seen
        st["exp_avg"].mul_(3.0)
        st["exp_avg_sq"].mul_(5.0)
    for _ in range(3):
        step()
    opt.load_state_dict(saved)
    step()
    m_norm, v_mean, _ = _adam_expected(opt)
    ds = mon.to_dataset()
    assert float(ds.adam_m_norm[-1]) == pytest.approx(m_norm, rel=1e-5)
    assert float(ds.adam_v_mean[-1]) == pytest.approx(v_mean, rel=1e-5)


@pytest.mark.parametrize("reset", ["delete", "replace"])
def test_adam_state_of_one_parameter_reset(reset):
    """Resetting one parameter's moments (a re-initialised layer) keeps the state dict's size:
    the Monitor must still read the new tensors and step count."""
    torch.manual_seed(6)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.05, eps=1e-3)
    mon = Monitor(model, opt)
    x, y = torch.randn(16, 3), torch.randn(16, 2)
    for i in range(6):
        if i == 3:
            w = model[2].weight
            if reset == "delete":
                del opt.state[w]
            else:
                opt.state[w]["exp_avg"] = torch.zeros_like(w)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        m_norm, v_mean, frac = _adam_expected(opt)
        row = mon.row()
        assert row["adam_m_norm"] == pytest.approx(m_norm, rel=1e-5), i
        assert row["adam_v_mean"] == pytest.approx(v_mean, rel=1e-5), i
        assert row["adam_eps_frac"] == pytest.approx(frac), i


def test_rows_after_storage_grows_match_live_rows():
    """Storage grows by doubling (64 rows first): values read live with row() right after each
    step equal what to_dataset returns at the end, with two optimizers stepping in turn."""
    torch.manual_seed(6)
    a, b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)
    opts = {"a": torch.optim.Adam(a.parameters(), lr=0.01), "b": torch.optim.SGD(b.parameters(), lr=0.05)}
    mon = Monitor([a, b], opts, every=3)
    x = torch.randn(16, 3)
    live = {}
    for step in range(150):
        for o in opts.values():
            o.zero_grad()
        b(torch.tanh(a(x))).pow(2).mean().backward()
        opts["a"].step()
        if step % 2 == 0:  # b steps every other row only
            opts["b"].step()
        mon.log(loss=float(step))
        live[step] = mon.row()
    ds = mon.to_dataset()
    assert ds.sizes["step"] == 150 and list(ds.step.values) == list(range(150))
    for step in (0, 1, 3, 63, 64, 65, 99, 147, 149):
        for ch, v in live[step].items():
            assert float(ds[ch].sel(step=step)) == pytest.approx(v, nan_ok=True), (step, ch)
    assert np.isnan(ds.grad_norm_b.values[1::2]).all() and np.isfinite(ds.grad_norm_b.values[::2]).all()
    assert np.isfinite(ds.adam_m_norm.values[::3]).all() and np.isnan(ds.adam_m_norm.values[1::3]).all()
    assert ds.loss.values[-1] == 149.0
    # the cheap single-row gradient norm agrees with the dataset
    assert [mon.grad_norm(s) for s in range(150)] == pytest.approx(list(ds.grad_norm.values))
    assert mon.grad_norm() == pytest.approx(float(ds.grad_norm[-1])) and math.isnan(mon.grad_norm(150))
    with pytest.raises(ValueError, match="step must be >= 0"):
        mon.log(step=-1, loss=0.0)


@pytest.mark.parametrize("every", [1, 3])  # every=3: step 1 takes the norm-only path, step 2 keeps the gradient
def test_half_precision_gradient_norm_does_not_overflow(every):
    """A float16 gradient whose entries are representable but whose norm exceeds float16's
    range (65504) still gives a finite, exact grad_norm, on measured and unmeasured steps."""
    w = torch.nn.Parameter(torch.zeros(2000, dtype=torch.float16))
    opt = torch.optim.SGD([w], lr=0.0)
    mon = Monitor(None, opt, every=every)
    for _ in range(3):
        w.grad = torch.full((2000,), 3000.0, dtype=torch.float16)
        opt.step()
    expected = 3000.0 * math.sqrt(2000)  # 134,164: beyond float16
    assert mon.to_dataset().grad_norm.values == pytest.approx([expected] * 3, rel=1e-5)  # float32 sums


def test_adam_step_counts_drifting_while_disabled():
    """Step counts that drift apart while the Monitor is disabled are read again after."""
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.5, 0.6), eps=0.05)
    mon = Monitor(model, opt)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    for step in range(6):
        mon.enabled = step not in (2, 3)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        if step in (2, 3):
            for p in model[0].parameters():
                p.grad = None
        opt.step()
    m_norm, v_mean, _ = _adam_expected(opt)
    assert {float(opt.state[p]["step"]) for p in model.parameters()} == {4.0, 6.0}
    ds = mon.to_dataset()
    assert float(ds.adam_m_norm[-1]) == pytest.approx(m_norm, rel=1e-5)
    assert float(ds.adam_v_mean[-1]) == pytest.approx(v_mean, rel=1e-5)


def test_last_update_is_the_applied_update():
    """last_update returns w_after - w_before shaped like the parameters on measured rows, None otherwise."""
    torch.manual_seed(8)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    mon = Monitor(model, opt, every=2)
    x = torch.randn(5, 3)
    for step in range(3):
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        u = mon.last_update(list(model.parameters()))
        if step % 2:
            assert u is None
        else:
            for ui, p, w in zip(u, model.parameters(), before, strict=True):
                assert ui.shape == p.shape
                torch.testing.assert_close(ui, p.detach() - w)


def test_cost_counts_only_time_inside_the_hooks():
    """cost(): hook calls per optimizer step, updates, and hook time disjoint from the loop's
    own time (the sleeps between steps lie inside the span, outside every hook)."""
    a, b, opt_a, opt_b, x, y = two_layer_setup()
    mon = Monitor({"a": a, "b": b}, {"critic": opt_a, "actor": opt_b})
    c = mon.cost()
    assert (c.hook_s, c.span_s, c.updates, c.hook_calls) == (0.0, 0.0, 0, 0) and math.isnan(c.fraction)
    pause, n = 0.02, 4
    for i in range(n):
        if i:
            time.sleep(pause)
        opt_a.zero_grad()
        opt_b.zero_grad()
        ((b(a(x)) - y) ** 2).mean().backward()
        opt_a.step()
        opt_b.step()
    mon.enabled = False  # disabled steps still run (cheap) hooks: counted
    opt_a.step()
    c = mon.cost()
    assert c.hook_calls == 4 * n + 2 and c.updates == n + 1
    assert c.hook_s > 0.0
    assert c.span_s >= (n - 1) * pause
    assert c.hook_s <= c.span_s - (n - 1) * pause
    assert c.fraction == pytest.approx(c.hook_s / c.span_s)
    mon.close()
    opt_a.step()  # hooks removed: nothing more counted
    assert mon.cost().hook_calls == 4 * n + 2


@pytest.mark.parametrize("every", [1, 2])
def test_delayed_optimizer_is_sampled_and_linked_by_its_own_steps(every):
    """TD3's actor steps on every other round: `every` and xgrad follow its own steps (a Monitor
    attached to the actor alone is the reference), not the row index."""
    a, b, opt_a, opt_b, x, y = two_layer_setup()
    both = Monitor({"a": a, "b": b}, {"critic": opt_a, "actor": opt_b}, every=every)
    alone = Monitor(b, opt_b, every=every)
    for it in range(8):
        opt_a.zero_grad()
        opt_b.zero_grad()
        ((b(a(x)) - y) ** 2).mean().backward()
        opt_a.step()
        if it % 2 == 1:
            opt_b.step()
    ds, ref = both.to_dataset(), alone.to_dataset()
    for ch in ("update_norm", "xgrad", "adam_m_norm", "grad_norm"):
        got = ds[f"{ch}_actor"].values[1::2]  # the actor's rows
        np.testing.assert_allclose(got, ref[ch].values, rtol=1e-5, equal_nan=True, err_msg=ch)
    assert np.isfinite(ds["xgrad_actor"].values[1::2][every::every]).all()  # linked to its own previous step
    assert np.isfinite(ds["update_norm_actor"].values[1::2][::every]).all()


@pytest.mark.parametrize("every", [1, 2])
def test_grad_scaler_with_an_optimizer_that_unscales_inside_step(every):
    """GradScaler leaves the gradients scaled for fused Adam (it unscales inside its step and
    sets opt.grad_scale): the channels must be those of the true gradient, as with plain Adam."""
    rows = {}
    for fused in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=fused)
        mon = Monitor(model, opt, every=every, per_layer=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        x, y = torch.randn(16, 4), torch.randn(16, 1)
        for _ in range(5):
            opt.zero_grad()
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            scaler.step(opt)
            scaler.update()
        rows[fused] = mon.to_dataset()
    for ch in ("grad_norm", "xgrad", "update_norm", "update_grad_cos", "adam_m_norm", "layer_grad_norm"):
        np.testing.assert_allclose(rows[True][ch].values, rows[False][ch].values, rtol=1e-4, equal_nan=True,
                                   err_msg=ch)
    assert np.isfinite(rows[True]["xgrad"].values[every::every]).all()


def test_parameter_replaced_by_one_of_another_shape():
    """p.data = a larger tensor (same parameter object): the buffers are rebuilt, no crash; xgrad
    is NaN across the change (no comparable previous gradient) and finite again after."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 3))
    opt = torch.optim.SGD([w], lr=0.1)
    mon = Monitor(None, opt)
    norms = []
    for i in range(4):
        if i == 2:
            w.data = torch.randn(6, 3)
        opt.zero_grad()
        w.pow(2).sum().backward()
        norms.append(w.grad.norm().item())
        opt.step()
    ds = mon.to_dataset()
    np.testing.assert_allclose(ds.grad_norm.values, norms, rtol=1e-6)
    np.testing.assert_allclose(ds.update_ratio.values, 0.2, rtol=1e-5)  # u = -0.1 * 2w
    assert np.isnan(ds.xgrad.values[[0, 2]]).all() and np.isfinite(ds.xgrad.values[[1, 3]]).all()


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_parameter_data_replaced_by_one_of_the_same_shape(layout):
    """p.data = another tensor of the same shape between steps (new storage; a transposed one is not
    contiguous): the parameters before the step are read from the new data, so the update is the
    applied one (the Monitor keeps views of the parameters' data while their pointers stay put)."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 3))
    opt = torch.optim.SGD([w], lr=0.1)
    mon = Monitor(None, opt)
    ratios = []
    for i in range(4):
        if i == 2:
            w.data = torch.randn(4, 3) * 3.0 if layout == "contiguous" else torch.randn(3, 4).T * 3.0
        opt.zero_grad()
        (w.pow(2).sum() + w.sum()).backward()
        before = w.detach().clone()
        opt.step()
        ratios.append(((w.detach() - before).norm() / before.norm()).item())
    ds = mon.to_dataset()
    np.testing.assert_allclose(ds.update_ratio.values, ratios, rtol=1e-5)


@pytest.mark.parametrize("kind", ["sparse", "complex"])
def test_sparse_or_complex_gradients_record_grad_norm_only(kind):
    torch.manual_seed(0)
    if kind == "sparse":
        emb = torch.nn.Embedding(10, 4, sparse=True)
        opt = torch.optim.SparseAdam(list(emb.parameters()), lr=0.1)
        idx = torch.tensor([1, 2, 2, 3])  # a repeated index: coalescing sums its rows
        loss_of, param = (lambda: emb(idx).pow(2).sum()), emb.weight
    else:
        param = torch.nn.Parameter(torch.randn(4, dtype=torch.complex64))
        opt = torch.optim.Adam([param], lr=1e-2)
        loss_of = lambda: (param.abs() ** 2).sum()  # noqa: E731
    mon = Monitor(None, opt, every=1)
    expected = []
    with pytest.warns(RuntimeWarning, match="sparse or complex gradients"):
        for _ in range(3):
            opt.zero_grad()
            loss_of().backward()
            g = param.grad.to_dense() if param.grad.is_sparse else param.grad
            expected.append(g.abs().pow(2).sum().sqrt().item())
            opt.step()
    ds = mon.to_dataset()
    np.testing.assert_allclose(ds.grad_norm.values, expected, rtol=1e-5)
    assert np.isnan(ds.update_norm.values).all() and np.isfinite(ds.lr.values).all()


@pytest.mark.parametrize("how", ["positional", "keyword"])
def test_step_with_closure_matches_the_plain_loop(how):
    """opt.step(closure): the gradient exists only after the closure ran; the channels must equal
    those of the same training written as zero_grad / backward / step."""
    out = {}
    for mode in ("plain", how):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        mon = Monitor(model, opt)
        x, y = torch.randn(16, 4), torch.randn(16, 1)

        def closure(opt=opt, model=model, x=x, y=y):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        for _ in range(4):
            if mode == "plain":
                closure()
                opt.step()
            elif mode == "positional":
                opt.step(closure)
            else:
                opt.step(closure=closure)
        out[mode] = mon.to_dataset()
    for ch in OPT_CHANNELS:
        np.testing.assert_allclose(out[how][ch].values, out["plain"][ch].values, rtol=1e-6, equal_nan=True, err_msg=ch)
    assert np.isfinite(out[how].grad_norm.values).all() and np.isfinite(out[how].xgrad.values[1:]).all()


def test_lbfgs_reads_the_first_closure_gradient_and_the_whole_update():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(5))
    opt = torch.optim.LBFGS([w], lr=0.5, max_iter=4)
    mon = Monitor(None, opt)
    target = torch.arange(5.0)

    def closure():
        opt.zero_grad()
        loss = ((w - target) ** 2).sum()
        loss.backward()
        return loss

    g0 = 2 * (w.detach() - target)
    w0 = w.detach().clone()
    opt.step(closure)
    row = mon.row()
    assert row["grad_norm"] == pytest.approx(g0.norm().item(), rel=1e-6)
    assert row["update_norm"] == pytest.approx((w.detach() - w0).norm().item(), rel=1e-5)


def test_step_that_never_calls_its_closure_is_counted_not_read():
    class Lazy(torch.optim.Optimizer):  # plain SGD that ignores its closure
        def __init__(self, params, lr):
            super().__init__(params, {"lr": lr})

        @torch.no_grad()
        def step(self, closure=None):
            for g in self.param_groups:
                for p in g["params"]:
                    p.add_(p.grad, alpha=-g["lr"])

    w = torch.nn.Parameter(torch.ones(3))
    opt = Lazy([w], lr=0.1)
    mon = Monitor(None, opt)
    w.grad = torch.ones(3)
    opt.step(lambda: None)
    opt.step()
    ds = mon.to_dataset()  # the unread update is counted (as a disabled one), not a row
    assert mon.step == 1 and ds.step.values.tolist() == [1] and ds.grad_norm.values[0] == pytest.approx(3**0.5)


def test_per_layer_entries_for_parameters_added_after_attaching():
    """Gradual unfreezing: a layer joins the optimizer by add_param_group after the Monitor
    attached; it gets its layer entries (named from the model), NaN before it trained."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    opt = torch.optim.SGD(model[2].parameters(), lr=0.1)
    mon = Monitor(model, opt, per_layer=True)
    x, y = torch.randn(8, 3), torch.randn(8, 2)
    grads = []
    for i in range(4):
        if i == 2:
            opt.add_param_group({"params": list(model[0].parameters())})
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        if i >= 2:
            grads.append(model[0].weight.grad.norm().item())
        else:
            model[0].weight.grad = None
            model[0].bias.grad = None
        opt.step()
    ds = mon.to_dataset()
    names = ds.layer.values.tolist()
    assert names[:2] == ["2.weight", "2.bias"] and set(names[2:]) == {"0.weight", "0.bias"}
    first = ds.layer_grad_norm.sel(layer="0.weight").values
    assert np.isnan(first[:2]).all()
    np.testing.assert_allclose(first[2:], grads, rtol=1e-5)
    assert np.isfinite(ds.layer_update_ratio.sel(layer="0.weight").values[2:]).all()


def test_pre_step_hook_sees_the_recorded_gradient_norm_and_can_scale_the_step():
    """A pre-step hook runs after the Monitor read the gradient and before the update: the norm
    it sees is the row's grad_norm, and halving the gradients there halves the SGD update."""
    seen, rows = [], {}
    for scale in (1.0, 0.5):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        mon = Monitor(model, opt, every=2)

        def hook(optimizer, stats, scale=scale, opt=opt, model=model):
            assert optimizer is opt and stats.name == "opt0" and stats.grad_norm.dim() == 0
            seen.append((scale, stats.step, stats.grad_norm_float()))
            for p in model.parameters():
                p.grad.mul_(scale)

        handle = mon.add_pre_step_hook(hook)
        x, y = torch.randn(16, 4), torch.randn(16, 2)
        for _ in range(4):
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
        handle.remove()
        opt.step()  # removed: not called again
        rows[scale] = mon.to_dataset()
    assert [s for _, s, _ in seen] == [0, 1, 2, 3] * 2
    for scale in (1.0, 0.5):
        ds = rows[scale]
        np.testing.assert_allclose([g for s, _, g in seen if s == scale], ds.grad_norm.values[:4], rtol=1e-6)
        # the row records the gradient as read, and the update the hook left
        lr_g = 0.1 * ds.grad_norm.values[0::2][:2]
        np.testing.assert_allclose(ds.update_norm.values[0::2][:2], scale * lr_g, rtol=1e-5)
    # the first step is the same in both runs: the scaled update is exactly half
    assert rows[0.5].update_norm.values[0] == pytest.approx(0.5 * rows[1.0].update_norm.values[0], rel=1e-6)


def test_pre_step_hook_runs_after_the_closure_computed_the_gradient():
    w = torch.nn.Parameter(torch.tensor([3.0, 4.0]))
    opt = torch.optim.SGD([w], lr=0.1)
    mon = Monitor(None, opt)
    seen = []
    mon.add_pre_step_hook(lambda o, stats: seen.append(stats.grad_norm_float()))

    def closure():
        opt.zero_grad()
        loss = (w**2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    assert seen == [pytest.approx(10.0)] and mon.row()["grad_norm"] == pytest.approx(10.0)


def run_blocks(sync_every: int):
    """Two optimizers (one stepping every other row), per-layer, every=2, a parameter group added
    mid-run, logged tensors and floats: everything that crosses device blocks."""
    torch.manual_seed(9)
    a, b = torch.nn.Linear(3, 4), torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opts = {"a": torch.optim.Adam(a.parameters(), lr=0.01), "b": torch.optim.SGD(b[1].parameters(), lr=0.05)}
    mon = Monitor({"a": a, "b": b}, opts, every=2, per_layer=True, sync_every=sync_every)
    x = torch.randn(8, 3)
    live = []
    for step in range(11):
        if step == 5:
            opts["b"].add_param_group({"params": list(b[0].parameters())})
        for o in opts.values():
            o.zero_grad()
        loss = b(torch.tanh(a(x))).pow(2).mean()
        loss.backward()
        opts["a"].step()
        if step % 2 == 0:
            opts["b"].step()
        mon.log(loss=loss.detach(), perf=float(step))
        if step in (3, 7):
            live.append(mon.row())
    return mon.to_dataset(), live, mon


@pytest.mark.parametrize("sync_every", [1, 3])
def test_rows_do_not_depend_on_the_block_size(sync_every):
    ref, ref_live, _ = run_blocks(64)
    ds, live, _ = run_blocks(sync_every)
    assert list(ds.data_vars) == list(ref.data_vars) and ds.sizes == ref.sizes
    for k in ds.data_vars:
        np.testing.assert_array_equal(ds[k].values, ref[k].values, err_msg=k)
    np.testing.assert_equal(live, ref_live)
    # b's own steps are rows 0, 2, 4, ...; measured every 2 of them: rows 0, 4, 8 (b.0 from row 5 on)
    assert np.isfinite(ds.layer_update_ratio.sel(layer="b.0.weight").values[[8]]).all()


def test_log_stage_copies_at_once_and_sends_in_blocks():
    """Device tensors passed to log() are copied into a device buffer when logged (so that
    later in-place changes do not show) and reach the host when the buffer is full or read."""
    from stabstudy.instruments.telemetry.table import HostCopies, LogStage

    got = []
    stage = LogStage(HostCopies(), lambda row, name, v: got.append((row, name, v)), capacity=2)
    t = torch.tensor(1.5)
    stage.add(0, "loss", t)
    t.fill_(9.0)  # after logging: not seen
    assert got == []
    stage.add(1, "loss", torch.tensor(2.5, dtype=torch.bfloat16))  # full: sent
    stage.add(1, "perf", torch.tensor([7]))
    assert got == [(0, "loss", 1.5), (1, "loss", 2.5)]
    stage.send_all()
    assert got[-1] == (1, "perf", 7.0)
    with pytest.raises(RuntimeError):
        stage.add(2, "bad", torch.zeros(3))


def test_rows_on_host_are_the_rows_whose_block_arrived():
    """What a streaming writer reads: complete rows only (a block of sync_every rows reaches the
    host at a time), equal to to_dataset's rows, nothing copied or waited for by the call."""
    lin = make_linear(torch.float32)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    mon = Monitor(lin, opt, sync_every=4)
    torch_steps(lin, opt, 6, mon)
    mon.log(perf=3.0)
    stop, rows = mon.rows_on_host(0, 6)
    assert stop == 4  # rows 4 and 5 are still in the device block
    assert set(OPT_CHANNELS) <= set(rows) and all(len(v) == 4 for v in rows.values())
    assert mon.rows_on_host(2, 1) == (2, {})
    ds = mon.to_dataset()  # brings the rest over
    for ch in (*OPT_CHANNELS, "loss"):
        np.testing.assert_array_equal(rows[ch], ds[ch].values[:4], err_msg=ch)
    stop, rest = mon.rows_on_host(4, 99)
    assert stop == 6
    np.testing.assert_array_equal(rest["perf"], [np.nan, 3.0])  # logged to row 5 only
    np.testing.assert_array_equal(rest["grad_norm"], ds.grad_norm.values[4:])
    mon.close()


def test_telemetry_modules_import_one_way():
    """No import cycle among the Monitor's modules (type-only imports included)."""
    import ast
    import graphlib
    import pathlib

    import stabstudy.instruments.telemetry as pkg

    root = pathlib.Path(pkg.__file__).parent
    prefix = "stabstudy.instruments.telemetry."
    graph = {}
    for f in root.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module.startswith(prefix):
                    deps.add(node.module[len(prefix):])
                elif node.module == prefix[:-1]:
                    deps.update(a.name for a in node.names if (root / f"{a.name}.py").exists())
        graph[f.stem] = deps - {f.stem}
    assert graph["state"] <= {"table", "channels"}
    order = list(graphlib.TopologicalSorter(graph).static_order())  # raises CycleError on a cycle
    assert order.index("state") < order.index("adam") and order.index("state") < order.index("stats")


@pytest.mark.parametrize("every", [1, 2])
def test_scale_and_step_counts_held_as_tensors(monkeypatch, every):
    """The paths a GPU takes without reading back: a loss scale kept as a tensor (divided out on
    the device) and Adam step counts used on the device (capturable / fused Adam); same
    channels as the host paths."""
    from stabstudy.instruments.telemetry import adam, stats

    def run(device_paths: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
        mon = Monitor(model, opt, every=every, per_layer=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        x, y = torch.randn(16, 4), torch.randn(16, 1)
        for _ in range(5):
            opt.zero_grad()
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            scaler.step(opt)
            scaler.update()
        return mon.to_dataset()

    ref = run(False)
    real_scale, real_init = stats.grad_scale, adam.AdamCache.__init__

    def tensor_scale(opt):
        s = real_scale(opt)
        return torch.tensor(s) if isinstance(s, float) else s

    def device_steps(self, *a):
        real_init(self, *a)
        self.device_steps = self.ok

    monkeypatch.setattr(stats, "grad_scale", tensor_scale)
    monkeypatch.setattr(adam.AdamCache, "__init__", device_steps)
    got = run(True)
    for ch in (*OPT_CHANNELS, "layer_grad_norm", "layer_update_ratio"):
        np.testing.assert_allclose(got[ch].values, ref[ch].values, rtol=1e-5, equal_nan=True, err_msg=ch)
    assert np.isfinite(got.adam_v_mean.values[::every]).all()


def test_sync_every_must_be_positive():
    with pytest.raises(ValueError, match="sync_every"):
        Monitor(None, torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), sync_every=0)


def test_stored_runs_carry_the_telemetry_version(tmp_store):
    from stabstudy.instruments.telemetry import TELEMETRY_VERSION
    from stabstudy.run.runner import run_grid
    from stabstudy.run.store import code_identity
    from stabstudy.spec import RunSpec

    assert code_identity()["telemetry_version"] == TELEMETRY_VERSION
    s = RunSpec("toy", "gd", "digits", steps=3, seed=0, hparams={"lr": 0.05, "width": 8})
    run_grid([s], scheduler="serial", store=tmp_store, progress=False)
    assert tmp_store.load(s).attrs["telemetry_version"] == TELEMETRY_VERSION


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_monitor_steps_make_no_host_sync_on_cuda():
    """Under torch.cuda.set_sync_debug_mode("error") any synchronising call raises: the hooks,
    log() of device tensors and pre-step hooks must make none (Adam with step counts on the
    device, a loss scale on the device with fused Adam, per-layer channels)."""
    dev = torch.device("cuda")
    results = {}
    for device in (dev, torch.device("cpu")):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)).to(device)
        fused = device.type == "cuda"
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=fused)
        scaler = torch.amp.GradScaler(device.type, init_scale=256.0)
        mon = Monitor(model, opt, every=2, per_layer=True, sync_every=4)
        norms = []
        mon.add_pre_step_hook(lambda o, s, norms=norms: norms.append(s.grad_norm))
        x, y = torch.randn(32, 6).to(device), torch.randn(32, 2).to(device)
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()  # warm-up outside the check
        opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(9):  # crosses two blocks of 4 rows
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x), y)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                mon.log(loss=loss.detach())
        finally:
            torch.cuda.set_sync_debug_mode(0)
        results[device.type] = (mon.to_dataset(), torch.stack(norms).cpu())
        mon.close()
    (got, gn), (ref, _) = results["cuda"], results["cpu"]
    for ch in (*OPT_CHANNELS, "loss", "layer_grad_norm", "layer_update_ratio"):
        np.testing.assert_allclose(got[ch].values, ref[ch].values, rtol=1e-3, atol=1e-6, equal_nan=True, err_msg=ch)
    np.testing.assert_allclose(gn.numpy(), got.grad_norm.values, rtol=1e-6)
