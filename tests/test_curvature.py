"""Curvature estimates against dense Hessians of small MLPs."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from stabstudy.hparams import GPTHParams, defaults
from stabstudy.instruments import curvature as cv
from stabstudy.instruments.telemetry import Monitor

SIZES = [(4, 6), (6, 3)]  # a 4-6-3 tanh MLP: 51 parameters


def mlp_setup(seed=0):
    g = torch.Generator().manual_seed(seed)
    params = []
    for fan_in, fan_out in SIZES:
        params.append((torch.randn(fan_out, fan_in, generator=g, dtype=torch.float64) / fan_in**0.5).requires_grad_())
        params.append((0.1 * torch.randn(fan_out, generator=g, dtype=torch.float64)).requires_grad_())
    x = torch.randn(32, 4, generator=g, dtype=torch.float64)
    y = torch.randn(32, 3, generator=g, dtype=torch.float64)
    return params, x, y


def forward(params, x):
    h = torch.tanh(x @ params[0].T + params[1])
    return h @ params[2].T + params[3]


def flat_loss(flat, x, y):
    """The same loss as a function of one flat vector (for autograd.functional.hessian)."""
    ps, i = [], 0
    for fan_in, fan_out in SIZES:
        ps.append(flat[i:i + fan_in * fan_out].view(fan_out, fan_in))
        i += fan_in * fan_out
        ps.append(flat[i:i + fan_out])
        i += fan_out
    return ((forward(ps, x) - y) ** 2).mean()


def reference_hessian(params, x, y):
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    return torch.autograd.functional.hessian(lambda f: flat_loss(f, x, y), flat).numpy()


@pytest.mark.parametrize("method", cv.METHODS)
def test_lambda_max_matches_dense_hessian_within_2_percent(method):
    params, x, y = mlp_setup()
    loss_fn = lambda: ((forward(params, x) - y) ** 2).mean()  # noqa: E731
    H = reference_hessian(params, x, y)
    top = np.linalg.eigvalsh(H)[-1]
    res = cv.lambda_max(loss_fn, params, iters=100, tol=1e-6, seed=0, method=method)
    assert res.value == pytest.approx(top, rel=0.02)
    assert 1 <= res.iters <= 100 and res.wall_s > 0
    # the library's own dense Hessian agrees with torch.autograd.functional.hessian
    np.testing.assert_allclose(cv.dense_hessian(loss_fn, params), H, rtol=1e-8, atol=1e-10)
    # deterministic for a fixed seed
    again = cv.lambda_max(loss_fn, params, iters=100, tol=1e-6, seed=0, method=method)
    assert again.value == res.value and again.iters == res.iters


@pytest.mark.parametrize("method", cv.METHODS)
@pytest.mark.filterwarnings("ignore:Using backward.. with create_graph=True")  # PyHessian's; cycle broken below
def test_lambda_max_agrees_with_pyhessian(method):
    """Our lambda_max vs PyHessian's power iteration (a dev dependency: imported, never skipped)."""
    import pyhessian

    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).double()
    g = torch.Generator().manual_seed(101)
    x = torch.randn(32, 4, generator=g, dtype=torch.float64)
    y = torch.randn(32, 2, generator=g, dtype=torch.float64)
    criterion = torch.nn.MSELoss()
    params = list(model.parameters())
    loss_fn = lambda: criterion(model(x), y)  # noqa: E731
    # PyHessian's power iteration finds the eigenvalue of largest magnitude: make sure it is the top one,
    # with a gap (lambda_2 / lambda_1 < 0.9) so that it converges
    ev = np.linalg.eigvalsh(cv.dense_hessian(loss_fn, params))
    assert ev[-1] > abs(ev[0]) and ev[-2] < 0.9 * ev[-1]
    ours = cv.lambda_max(loss_fn, params, iters=100, tol=1e-6, seed=0, method=method)
    torch.manual_seed(0)  # PyHessian draws its starting vector from the global generator
    try:
        theirs, _ = pyhessian.hessian(model, criterion, data=(x, y), cuda=False).eigenvalues(maxIter=1000, tol=1e-6)
    finally:
        for p in params:  # drop its create_graph gradients
            p.grad = None
    assert ours.converged
    assert ours.value == pytest.approx(theirs[0], rel=0.01)
    assert ours.value == pytest.approx(ev[-1], rel=1e-3)


def test_lanczos_default_budget_on_the_mlp():
    """With the default budget (20 HVPs, tol 1e-3) Lanczos is converged and close to exact."""
    params, x, y = mlp_setup(4)
    loss_fn = lambda: ((forward(params, x) - y) ** 2).mean()  # noqa: E731
    top = np.linalg.eigvalsh(reference_hessian(params, x, y))[-1]
    res = cv.lambda_max(loss_fn, params, seed=0)
    assert res.converged and res.iters <= 20
    assert res.value == pytest.approx(top, rel=1e-3)


def rotated_quadratic(n=60, dtype=torch.float64, seed=0):
    """0.5 x^T A x, A = Q diag(-10, 1, 0.5, distinct values in [-0.9, 0.4]) Q^T (top 1.0, |-10| dominant)."""
    g = torch.Generator().manual_seed(seed)
    ev = torch.cat([torch.tensor([-10.0, 1.0, 0.5]), torch.linspace(-0.9, 0.4, n - 3)]).double()
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    A = (Q * ev) @ Q.T
    x = torch.randn(n, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    Ad = A.to(dtype)
    return (lambda: 0.5 * x @ Ad @ x), [x], A.numpy()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_lanczos_finds_top_algebraic_eigenvalue_when_negative_one_dominates(dtype):
    loss_fn, params, A = rotated_quadratic(dtype=dtype)
    assert np.linalg.eigvalsh(A)[[0, -1]] == pytest.approx([-10.0, 1.0])
    res = cv.lambda_max(loss_fn, params, seed=0)  # the default budget: 20 HVPs, tol 1e-3
    assert res.value == pytest.approx(1.0, rel=0.01)
    assert res.converged and res.iters <= 20
    # the preconditioned solver with P = I is the same operator
    ones = [torch.ones_like(p) for p in params]
    assert cv.precond_sharpness(loss_fn, params, ones, seed=0).value == pytest.approx(1.0, rel=0.01)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("method", ["lanczos", "power"])
def test_eigensolvers_under_a_half_precision_autocast(method, dtype):
    """An LM probe runs under the run's autocast: the float32 basis must not meet half-precision
    products (it raised "addmv input tensors must have the same dtype"); the value is the one
    without autocast, since the HVPs keep their forward pass's dtypes either way."""
    (m32, loss32), _ = float32_mlp()
    params = list(m32.parameters())
    with torch.autocast("cpu", dtype=dtype):
        _, grads = cv.gradient_graph(loss32, params)
        got = cv.lambda_max(None, params, grads=grads, seed=0, method=method)
        ones = [torch.ones_like(p) for p in params]
        pre = cv.precond_sharpness(None, params, ones, grads=grads, seed=0, method=method)
        along = cv.directional_sharpness(None, params, [g.detach() for g in grads], grads=grads)
    ref = cv.lambda_max(None, params, grads=grads, seed=0, method=method)
    assert math.isfinite(got.value) and got.value == ref.value and pre.value == ref.value
    assert math.isfinite(along)


def test_lanczos_budget_is_a_hard_cap_and_unconverged_returns_best_ritz_value():
    loss_fn, params, A = rotated_quadratic(n=200, seed=1)
    top = np.linalg.eigvalsh(A)[-1]
    prev = -np.inf
    for iters in (1, 2, 5, 8, 12):
        res = cv.lambda_max(loss_fn, params, iters=iters, tol=1e-12, seed=0)
        assert res.iters <= iters and not res.converged
        # a Ritz value: a lower bound on the top eigenvalue, non-decreasing in the budget
        assert np.isfinite(res.value) and res.value <= top + 1e-9 and res.value >= prev - 1e-9
        prev = res.value
    # a thick-restarted run (budget above the basis size MAX_NCV) still uses at most the budget
    res = cv.lambda_max(loss_fn, params, iters=3 * cv.MAX_NCV + 5, tol=1e-12, seed=0)
    assert res.iters <= 3 * cv.MAX_NCV + 5 and res.value <= top + 1e-9
    assert res.value == pytest.approx(top, rel=1e-3)


def test_lanczos_tiny_problems_and_nonfinite():
    w = torch.tensor([0.7], dtype=torch.float64, requires_grad=True)
    res = cv.lambda_max(lambda: 3.0 * w[0] ** 2, [w])  # n = 1: one HVP is the whole Hessian
    assert res.value == pytest.approx(6.0) and res.iters == 1 and res.converged
    w2 = torch.tensor([0.3, -0.2], dtype=torch.float64, requires_grad=True)
    res = cv.lambda_max(lambda: w2[0] ** 2 - 3 * w2[1] ** 2, [w2], iters=2)
    assert res.value == pytest.approx(2.0, rel=1e-6) and res.iters <= 2
    bad = cv.lambda_max(lambda: w2[0] ** 2 * float("nan"), [w2])
    assert math.isnan(bad.value) and not bad.converged


def test_unknown_method_is_rejected():
    params, x, y = mlp_setup()
    loss_fn = lambda: ((forward(params, x) - y) ** 2).mean()  # noqa: E731
    for call in (lambda: cv.lambda_max(loss_fn, params, method="arnoldi"),
                 lambda: cv.precond_sharpness(loss_fn, params, [torch.ones_like(p) for p in params], method="x"),
                 lambda: cv.CurvatureProbe(None, loss_fn, params, every=1, method="dense")):
        with pytest.raises(ValueError, match="lanczos.*power"):
            call()


@pytest.mark.parametrize("method", cv.METHODS)
def test_negative_dominant_eigenvalue_is_shifted_to_the_top_one(method):
    # f(a, b) = a^2 - 3 b^2: eigenvalues 2 and -6; power iteration alone finds -6
    w = torch.tensor([0.3, -0.2], dtype=torch.float64, requires_grad=True)
    loss_fn = lambda: w[0] ** 2 - 3 * w[1] ** 2  # noqa: E731
    res = cv.lambda_max(loss_fn, [w], iters=200, tol=1e-10, seed=1, method=method)
    assert res.value == pytest.approx(2.0, rel=1e-4)


def test_directional_sharpness_matches_dense():
    params, x, y = mlp_setup(1)
    loss_fn = lambda: ((forward(params, x) - y) ** 2).mean()  # noqa: E731
    H = reference_hessian(params, x, y)
    g = torch.Generator().manual_seed(3)
    u = [torch.randn(p.shape, generator=g, dtype=torch.float64) for p in params]
    uf = torch.cat([t.reshape(-1) for t in u]).numpy()
    assert cv.directional_sharpness(loss_fn, params, u) == pytest.approx(uf @ H @ uf / (uf @ uf), rel=1e-8)
    assert math.isnan(cv.directional_sharpness(loss_fn, params, [torch.zeros_like(p) for p in params]))


@pytest.mark.parametrize("method", cv.METHODS)
def test_preconditioned_sharpness_matches_dense_P_inverse_H(method):
    params, x, y = mlp_setup(2)
    loss_fn = lambda: ((forward(params, x) - y) ** 2).mean()  # noqa: E731
    opt = torch.optim.Adam(params, lr=1e-3, betas=(0.9, 0.99), eps=1e-3)
    for _ in range(5):
        opt.zero_grad()
        loss_fn().backward()
        opt.step()
    P = cv.adam_preconditioner(opt, params)
    assert P is not None
    # manual P from the state
    st = opt.state[params[0]]
    v_hat = st["exp_avg_sq"] / (1 - 0.99 ** float(st["step"]))
    torch.testing.assert_close(P[0], v_hat.sqrt() + 1e-3)
    H = reference_hessian(params, x, y)
    d = torch.cat([p.reshape(-1) for p in P]).numpy()
    dense = np.max(np.linalg.eigvals(H / d[:, None]).real)  # P^-1 H (non-symmetric)
    res = cv.precond_sharpness(loss_fn, params, P, iters=200, tol=1e-7, seed=0, method=method)
    assert res.value == pytest.approx(dense, rel=0.02)
    assert 1 <= res.iters <= (200 if method == "lanczos" else 400)
    assert cv.dense_top_eigenvalue(loss_fn, params, P) == pytest.approx(dense, rel=1e-6)
    assert cv.adam_preconditioner(torch.optim.SGD(params, lr=0.1), params) is None


def test_check_helper():
    c = cv.check("x", 1.01, 1.0, 0.02)
    assert c["passed"] and c["rel_error"] == pytest.approx(0.01)
    assert not cv.check("x", 1.05, 1.0, 0.02)["passed"]
    assert not cv.check("x", float("nan"), 1.0, 0.02)["passed"]


@pytest.mark.parametrize("method", cv.METHODS)
def test_curvature_probe_logs_every_n_steps(method):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    x, y = torch.randn(16, 4), torch.randn(16, 2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    mon = Monitor(model, opt)
    loss_fn = lambda: ((model(x) - y) ** 2).mean()  # noqa: E731
    probe = cv.CurvatureProbe(mon, loss_fn, list(model.parameters()), every=3, optimizer=opt, iters=30, seed=0,
                              method=method)
    for _ in range(7):
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        opt.step()
        mon.log(loss=loss)
        probe()
    ds = mon.to_dataset()
    lm = ds.lambda_max.values
    assert np.isfinite(lm[[0, 3, 6]]).all() and np.isnan(lm[[1, 2, 4, 5]]).all()
    for ch in cv.CURVATURE_CHANNELS:
        assert np.isfinite(ds[ch].values[3]), ch
    # sharpness along any direction is bounded by lambda_max (top eigenvalue, when positive)
    assert ds.sharpness_grad.values[3] <= ds.lambda_max.values[3] * 1.02
    assert ds.sharpness_update.values[3] <= ds.lambda_max.values[3] * 1.02
    assert probe.method == method
    if method == "lanczos":
        assert (ds.lambda_max_iters.values[[0, 3, 6]] <= 30).all()


def test_lambda_max_through_fused_attention():
    """Fused scaled-dot-product attention has no double backward: gradient_graph uses the math kernel."""
    gpt = pytest.importorskip("stabstudy.learners.gpt")
    lm = pytest.importorskip("stabstudy.learners.lm")
    torch.manual_seed(0)
    hp = {**defaults(GPTHParams), "n_layer": 1, "n_embd": 16, "n_head": 2, "block_size": 8}
    model = gpt.GPT(lm.model_config(hp))
    x = torch.randint(0, 256, (2, 8))
    res = cv.lambda_max(lambda: model(x, x).loss, list(model.parameters()), iters=5, seed=0)
    assert math.isfinite(res.value) and res.value > 0


# -- device-resident eigensolvers: no host copies, the model's dtype, determinism ------------------

class HostTransferGuard(torch.overrides.TorchFunctionMode):
    """Records every move of a large tensor to host memory or numpy, and every large float64 result.

    On CPU ``.cpu()`` is a no-op, so conversions are caught at the call instead: ``numpy``,
    ``tolist``, ``item``, ``__array__``, ``cpu``, ``to``/``double`` towards the CPU or float64.
    "Large" is more than ``limit`` elements: the Lanczos coefficients (MAX_NCV + 2 numbers)
    may travel, a parameter-sized vector may not.
    """

    HOST = {"numpy", "tolist", "item", "__array__", "cpu", "__float__"}

    def __init__(self, limit):
        super().__init__()
        self.limit = limit
        self.host, self.float64 = [], []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        t = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if t is not None and t.numel() > self.limit:
            to_cpu = name == "to" and any(a == "cpu" or a == torch.device("cpu") for a in (*args[1:], kwargs.get("device")))
            to_f64 = name == "double" or (name == "to" and torch.float64 in (*args[1:], kwargs.get("dtype")))
            if name in self.HOST or to_cpu or to_f64:
                self.host.append((name, tuple(t.shape)))
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.dtype == torch.float64 and out.numel() > self.limit:
            self.float64.append((name, tuple(out.shape)))
        return out


def float32_mlp(seed=0):
    """An 8-32-32-4 tanh MLP (1476 parameters) in float32, its float64 twin and their losses."""
    torch.manual_seed(seed)
    m64 = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                              torch.nn.Linear(32, 4)).double()
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(64, 8, generator=g, dtype=torch.float64)
    y = torch.randn(64, 4, generator=g, dtype=torch.float64)
    m32 = copy.deepcopy(m64).float()
    x32, y32 = x.float(), y.float()
    return (m32, lambda: ((m32(x32) - y32) ** 2).mean()), (m64, lambda: ((m64(x) - y) ** 2).mean())


@pytest.mark.parametrize("method", cv.METHODS)
def test_no_parameter_sized_host_copy_or_float64_during_lambda_max(method):
    (model, loss_fn), _ = float32_mlp()
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    limit = 2 * cv.MAX_NCV + 2
    assert limit < 200 < n
    guard = HostTransferGuard(limit)
    with guard:
        res = cv.lambda_max(loss_fn, params, iters=30, tol=1e-6, seed=0, method=method)
        P = [torch.rand_like(p) + 0.5 for p in params]
        pre = cv.precond_sharpness(loss_fn, params, P, iters=30, tol=1e-6, seed=0, method=method)
    assert math.isfinite(res.value) and math.isfinite(pre.value) and res.iters > 1
    assert guard.host == [], f"parameter-sized data went to the host: {guard.host[:5]}"
    assert guard.float64 == [], f"parameter-sized float64 arithmetic: {guard.float64[:5]}"


def test_float32_lanczos_matches_the_float64_dense_top_eigenvalue():
    """Float32 vectors and coefficients suffice: measured 1e-6 relative error at the default
    budget (it stops on the residual test) and 2e-8 run out, against the float64 dense value."""
    (m32, loss32), (m64, loss64) = float32_mlp()
    top = np.linalg.eigvalsh(cv.dense_hessian(loss64, list(m64.parameters())))[-1]
    res = cv.lambda_max(loss32, list(m32.parameters()), seed=0)  # the default budget: 20 HVPs, tol 1e-3
    assert res.converged and res.iters <= 20
    assert res.value == pytest.approx(top, rel=1e-4)
    tight = cv.lambda_max(loss32, list(m32.parameters()), iters=100, tol=1e-6, seed=0)
    assert tight.converged and tight.value == pytest.approx(top, rel=1e-6)
    # half-precision parameters: the HVP runs in bfloat16, the Lanczos vectors in float32
    mbf = copy.deepcopy(m32).to(torch.bfloat16)
    xb = [p for p in mbf.parameters()]
    g = torch.Generator().manual_seed(1)  # float32_mlp's data
    x = torch.randn(64, 8, generator=g, dtype=torch.float64).to(torch.bfloat16)
    y = torch.randn(64, 4, generator=g, dtype=torch.float64).to(torch.bfloat16)
    bf = cv.lambda_max(lambda: ((mbf(x) - y) ** 2).mean(), xb, seed=0)
    assert bf.value == pytest.approx(top, rel=0.01)


@pytest.mark.parametrize("method", cv.METHODS)
def test_lambda_max_is_deterministic_for_a_seed(method):
    (model, loss_fn), _ = float32_mlp(3)
    params = list(model.parameters())
    runs = [cv.lambda_max(loss_fn, params, iters=15, tol=0.0, seed=s, method=method) for s in (7, 7, 8)]
    assert (runs[0].value, runs[0].iters) == (runs[1].value, runs[1].iters)
    assert runs[2].value != runs[0].value  # another starting vector
    assert runs[2].value == pytest.approx(runs[0].value, rel=1e-3 if method == "lanczos" else 0.1)
    # a caller's generator advances: a second measurement starts elsewhere, a reseeded one repeats
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    a = [cv.lambda_max(loss_fn, params, iters=15, tol=0.0, generator=g1, method=method).value for _ in range(2)]
    b = [cv.lambda_max(loss_fn, params, iters=15, tol=0.0, generator=g2, method=method).value for _ in range(2)]
    assert a == b and a[0] != a[1]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_thick_restart_converges_on_a_small_gap(dtype):
    """Top eigenvalues 1, 0.99, 0.98 over [-1, 0.97]: one basis of MAX_NCV vectors is not enough."""
    n = 300
    g = torch.Generator().manual_seed(2)
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    ev = torch.cat([torch.tensor([1.0, 0.99, 0.98]), torch.linspace(-1, 0.97, n - 3)]).double()
    A = ((Q * ev) @ Q.T).to(dtype)
    x = torch.randn(n, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    loss_fn = lambda: 0.5 * x @ A @ x  # noqa: E731
    short = cv.lambda_max(loss_fn, [x], iters=cv.MAX_NCV, tol=1e-8, seed=0)
    assert not short.converged and short.value < 1.0 - 1e-3
    res = cv.lambda_max(loss_fn, [x], iters=300, tol=1e-8, seed=0)
    assert res.converged and cv.MAX_NCV < res.iters < 300
    assert res.value == pytest.approx(1.0, abs=1e-6 if dtype == torch.float32 else 1e-12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method", cv.METHODS)
def test_lambda_max_on_cuda_stays_on_the_device(method):
    (model, _), (m64, loss64) = float32_mlp()
    model = model.cuda()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g, dtype=torch.float64).float().cuda()
    y = torch.randn(64, 4, generator=g, dtype=torch.float64).float().cuda()
    top = np.linalg.eigvalsh(cv.dense_hessian(loss64, list(m64.parameters())))[-1]
    guard = HostTransferGuard(2 * cv.MAX_NCV + 2)
    with guard:
        res = cv.lambda_max(lambda: ((model(x) - y) ** 2).mean(), list(model.parameters()), iters=100, tol=1e-6,
                            seed=0, method=method)
    assert guard.host == [] and guard.float64 == []
    assert res.value == pytest.approx(top, rel=1e-3)


# -- how converged: the residual in the result, and a default tolerance the edge of stability needs --------

def edge_of_stability_quadratic(seed, dtype, lr=0.3, gap=0.0015, n=500):
    """0.5 x^T A x with the spectrum full-batch GD leaves at the edge of stability: the top two eigenvalues
    pinned at 2/lr, ``gap`` (relative) apart, a few outliers below and a bulk near zero."""
    top = 2 / lr
    ev = np.r_[top, top * (1 - gap), top * np.array([0.6, 0.45, 0.3, 0.2, 0.15, 0.1, 0.08]),
               top * np.linspace(-0.05, 0.05, n - 9)]
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    A = ((Q * torch.from_numpy(ev)) @ Q.T).to(dtype)
    x = torch.randn(n, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    return (lambda: 0.5 * x @ A @ x), [x]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_default_tolerance_resolves_two_top_eigenvalues_0_15_percent_apart(dtype):
    """At tol 1e-3 Lanczos stopped on a mixture of the two top eigenvectors, 1.4e-3 below the dense
    value; the default (cv.TOL) stays within 1e-4 of it within the default budget of 20 HVPs."""
    worst_loose, worst = 0.0, 0.0
    for seed in range(3):
        loss_fn, params = edge_of_stability_quadratic(seed, dtype)
        ev = np.linalg.eigvalsh(cv.dense_hessian(loss_fn, params))
        assert (ev[-1] - ev[-2]) / ev[-1] == pytest.approx(0.0015, rel=1e-3 if dtype == torch.float64 else 0.05)
        loose = cv.lambda_max(loss_fn, params, tol=1e-3, seed=0)
        res = cv.lambda_max(loss_fn, params, seed=0)  # the default budget and tolerance
        assert res.converged and res.iters <= 20 and res.resid <= cv.TOL
        worst_loose = max(worst_loose, abs(loose.value - ev[-1]) / ev[-1])
        worst = max(worst, abs(res.value - ev[-1]) / ev[-1])
        # the probe the learners use reports the same value and how converged it is
        probe = cv.CurvatureProbe(None, loss_fn, params, every=1, seed=0)
        probe.generator.manual_seed(0)
        out = probe.measure()
        assert out["lambda_max"] == res.value and out["lambda_max_resid"] == res.resid
    assert worst_loose > 1e-3  # the case is hard: the old default misses it
    assert worst < 1e-4


@pytest.mark.parametrize("method", cv.METHODS)
def test_the_residual_says_how_far_the_value_may_be(method):
    """lanczos: some dense eigenvalue lies within resid * |value| (the residual bound), converged or not;
    resid <= tol exactly when converged by the residual test. power: resid is the last relative change."""
    params, x, y = mlp_setup(4)
    loss_fn = lambda: ((forward(params, x) - y) ** 2).mean()  # noqa: E731
    ev = np.linalg.eigvalsh(reference_hessian(params, x, y))
    for iters, tol in ((3, 1e-12), (6, 1e-12), (100, 1e-6)):
        res = cv.lambda_max(loss_fn, params, iters=iters, tol=tol, seed=0, method=method)
        assert np.isfinite(res.resid) and res.resid >= 0
        assert res.converged == (res.resid <= tol)
        if method == "lanczos":
            assert np.min(np.abs(ev - res.value)) <= res.resid * abs(res.value) * (1 + 1e-9) + 1e-12
    short = cv.lambda_max(loss_fn, params, iters=3, tol=1e-12, seed=0, method=method)
    assert short.resid > 1e-6  # three HVPs do not converge: the result says so
    P = [torch.ones_like(p) for p in params]
    assert np.isfinite(cv.precond_sharpness(loss_fn, params, P, seed=0, method=method).resid)
    w = torch.tensor([0.3], dtype=torch.float64, requires_grad=True)
    assert math.isnan(cv.lambda_max(lambda: w[0] ** 2 * float("nan"), [w], method=method).resid)


def test_stored_curvature_from_another_tolerance_is_stale():
    assert cv.probe_stale(0, {}, cv.TOL) is None  # no curvature measured: nothing to redo
    assert "old default tolerance 1e-3" in cv.probe_stale(10, {}, cv.TOL)
    assert "tolerance 0.001 (now 1e-05)" in cv.probe_stale(10, {"curvature_tol": 1e-3}, 1e-5)
    assert cv.probe_stale(10, {"curvature_tol": cv.TOL}, cv.TOL) is None
