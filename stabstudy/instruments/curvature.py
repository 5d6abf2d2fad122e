"""Loss curvature from Hessian-vector products: sharpness, directional and
Adam-preconditioned sharpness.

* :func:`lambda_max`: top (largest *algebraic*) Hessian eigenvalue from
  Hessian-vector products (Pearlmutter 1994: Hv = grad(grad(L) . v)). The default
  ``method="lanczos"`` runs Lanczos with full reorthogonalisation and thick restarts
  (Wu & Simon 2000) on the parameters' device, in their dtype (float32 at least): only the
  small projected matrix goes to the host for its eigenvalues. It is
  indifferent to a dominant *negative* eigenvalue (seen in the small GPT of
  :mod:`stabstudy.learners.lm`), which stalls power iteration. ``method="power"`` keeps power iteration
  for comparison, the method of PyHessian (Yao et al. 2020, "PyHessian: Neural networks
  through the lens of the Hessian"), plus a shifted second pass that PyHessian lacks: plain
  power iteration returns the eigenvalue of largest *magnitude* (measured in
  ``benchmarks/telemetry_overhead.py``: PyHessian gives -6.48 on the small GPT whose top
  eigenvalue is +5.15 and bottom one -6.54). Gradient
  descent with step ``lr`` is stable on a quadratic only
  while ``lambda_max < 2 / lr``; full-batch GD trains at this *edge of stability*
  (Cohen et al. 2021, "Gradient descent on neural networks typically occurs at
  the edge of stability").
* :func:`directional_sharpness`: u^T H u / ||u||^2 along a direction (the
  gradient, the applied update).
* :func:`precond_sharpness`: top eigenvalue of P^{-1} H with Adam's
  preconditioner P = diag(sqrt(v_hat) + eps); Adam settles where it is about
  (2 + 2 beta1) / ((1 - beta1) lr) = 38 / lr for beta1 = 0.9 (Cohen et al. 2022,
  "Adaptive gradient methods at the edge of stability"). The eigensolver runs on
  the symmetric P^{-1/2} H P^{-1/2}, which has the same eigenvalues.
* :class:`CurvatureProbe`: measures all of the above every N steps into a
  :class:`stabstudy.instruments.telemetry.Monitor` (``lambda_max`` etc., NaN in between).

Every function takes ``loss_fn``, a closure that computes the scalar loss on a
*fixed* probe batch, and ``params``, the list of tensors to differentiate.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from stabstudy import registry

LossFn = Callable[[], torch.Tensor]


@dataclass(frozen=True)
class EigResult:
    """Result of an eigenvalue estimate (:func:`lambda_max`, :func:`precond_sharpness`)."""

    value: float
    """The eigenvalue estimate (lanczos: the top Ritz value, converged or not: a lower bound
    that does not decrease with the budget; power: Rayleigh quotient at the last iterate)."""
    iters: int
    """Hessian-vector products actually used (all of them, shift pass included)."""
    wall_s: float
    """Wall time of the whole measurement (seconds)."""
    converged: bool
    """lanczos: the residual test ||Hx - theta x|| <= tol |theta| passed within the budget (or the
    Krylov space is invariant: the value is exact on it);
    power: the relative change fell below ``tol`` before ``iters`` ran out."""
    resid: float = math.nan
    """How converged ``value`` is. lanczos: the relative residual ||Hx - theta x|| / |theta| of the
    returned Ritz pair (some eigenvalue lies within ``resid * |theta|`` of it, and the top one within
    ``resid**2 * |theta| / gap`` when the rest of the spectrum lies ``gap`` below: Kato-Temple);
    power: the relative change of the estimate in the last iteration. NaN when not measured."""

    def __float__(self) -> float:
        return float(self.value)


def _params(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    ps = [p for p in params if p.requires_grad]
    if not ps:
        raise ValueError("no parameter requires grad")
    return ps


def _dot(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> torch.Tensor:
    return sum((x * y).sum() for x, y in zip(a, b, strict=True))


def gradient_graph(loss_fn: LossFn, params: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Loss and gradient with ``create_graph=True`` (reusable for many HVPs).

    ``loss_fn`` runs with scaled-dot-product attention restricted to the math
    kernel: the fused (flash / memory-efficient) kernels have no double backward.
    """
    params = _params(params)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        loss = loss_fn()
    grads = torch.autograd.grad(loss, params, create_graph=True)
    return loss, list(grads)


def hvp(grads: Sequence[torch.Tensor], params: Sequence[torch.Tensor], v: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Hessian-vector product H v from a gradient graph (Pearlmutter trick)."""
    out = torch.autograd.grad(grads, params, grad_outputs=list(v), retain_graph=True, allow_unused=True)
    return [torch.zeros_like(p) if h is None else h.detach() for h, p in zip(out, params, strict=True)]


def _work_dtype(params: Sequence[torch.Tensor]) -> torch.dtype:
    """The eigensolvers' vector dtype: the parameters' (promoted if mixed), float32 at least.

    Half-precision Lanczos vectors (eps 1e-3 / 8e-3) would lose orthogonality at the level of
    the answer; the HVP itself still runs in each parameter's own dtype.
    """
    return functools.reduce(torch.promote_types, [p.dtype for p in params], torch.float32)


def _flat(ts: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """One flat vector (on the tensors' device) of ``dtype``."""
    return torch.cat([t.detach().reshape(-1) for t in ts]).to(dtype)


class _Operator:
    """x -> S H S x on flat vectors on the parameters' device, in :func:`_work_dtype`
    (S = diag(P^-1/2) for a preconditioner P, identity when None): one HVP per call."""

    def __init__(self, grads: Sequence[torch.Tensor], params: Sequence[torch.Tensor],
                 precond: Sequence[torch.Tensor] | None = None):
        self.grads, self.params = list(grads), list(params)
        devices = {p.device for p in self.params}
        if len(devices) != 1:
            raise ValueError(f"the parameters must share one device, got {sorted(map(str, devices))}")
        self.device = devices.pop()
        self.dtype = _work_dtype(self.params)
        self.sizes = [p.numel() for p in self.params]
        self.n = sum(self.sizes)
        self.scale = None
        if precond is not None:
            scale = _flat(precond, self.dtype)
            self.scale = (scale if scale.device == self.device else scale.to(self.device)).rsqrt_()
        self.calls = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = x if self.scale is None else x * self.scale
        v = [t.view(p.shape).to(p.dtype) for t, p in zip(w.split(self.sizes), self.params, strict=True)]
        y = _flat(hvp(self.grads, self.params, v), self.dtype)
        self.calls += 1
        return y if self.scale is None else y.mul_(self.scale)


def _start_vector(op: _Operator, generator: torch.Generator) -> torch.Tensor:
    """A standard normal vector drawn on the operator's device.

    A generator on another device (the CPU one a caller or :class:`CurvatureProbe` holds)
    seeds a generator on the parameters' device, so that nothing parameter-sized crosses.
    """
    g = generator
    if generator.device != op.device:
        g = torch.Generator(device=op.device)
        g.manual_seed(int(torch.randint(0, 2**62, (1,), generator=generator)))
    return torch.randn(op.n, generator=g, device=op.device, dtype=op.dtype)


def _power(op: _Operator, v0: torch.Tensor, *, iters: int, tol: float,
           shift: float = 0.0) -> tuple[float, int, bool, float]:
    """Power iteration on (op + shift I) from ``v0``: (value, HVPs, converged, relative change)."""
    v = v0 / torch.linalg.vector_norm(v0)
    lam_prev = None
    lam, change = float("nan"), float("nan")
    for k in range(1, iters + 1):
        hv = op(v)
        if shift:
            hv.add_(v, alpha=shift)
        lam_t, nrm_t = torch.dot(v, hv), torch.linalg.vector_norm(hv)
        lam_s, nrm = torch.stack([lam_t, nrm_t]).tolist()  # one device sync per HVP
        lam = lam_s - shift
        if not math.isfinite(lam) or nrm == 0.0:
            return lam, k, False, float("nan")
        v = hv.div_(nrm_t)
        if lam_prev is not None:
            change = abs(lam - lam_prev) / max(abs(lam), 1e-12)
            if change <= tol:
                return lam, k, True, change
        lam_prev = lam
    return lam, iters, False, change


def _generator(seed: int | None, generator: torch.Generator | None) -> torch.Generator:
    if generator is not None:
        return generator
    return torch.Generator().manual_seed(0 if seed is None else int(seed))


#: Eigensolvers of :func:`lambda_max` and :func:`precond_sharpness`.
METHODS = ("lanczos", "power")
#: Lanczos basis size: a larger ``iters`` budget thick-restarts from the top Ritz vectors.
MAX_NCV = 20
#: Below ``BREAKDOWN * eps * ||T||`` a Lanczos residual means an invariant subspace (exact).
BREAKDOWN = 100.0
#: Default relative tolerance of the eigensolvers (``tol``). The residual test alone only puts *some*
#: eigenvalue within ``tol * |theta|``: at 1e-3, with the top two eigenvalues 0.15% apart (the edge of
#: stability pins several at 2/lr), Lanczos stopped on a mixture of the two, 1.4e-3 below the dense
#: value. The top eigenvalue is within ``tol**2 / gap`` (Kato-Temple): at 1e-5 that is 7e-8 for a
#: 0.15% gap, and a 1e-4 error needs a gap below 1e-6 (tests/test_curvature.py).
TOL = 1e-5


def _check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}: use 'lanczos' or 'power'")


def _lanczos(op: _Operator, v0: torch.Tensor, *, iters: int, tol: float) -> tuple[float, int, bool, float]:
    """Largest algebraic eigenvalue of ``op`` by thick-restart Lanczos within ``iters`` HVPs.

    The basis V ((m + 1) x n, m = min(n, iters, :data:`MAX_NCV`)) stays on the device in
    ``op.dtype``; each new vector is orthogonalised against all of V, twice (classical
    Gram-Schmidt, "twice is enough"), so that the Ritz values do not fall apart into copies
    in finite precision. Only the coefficients (k + 1 numbers) come to the host, where the
    projected matrix T = V^T A V (tridiagonal; arrowhead after a restart; k x k, k <= m)
    gives its eigenvalues. Converged when the Ritz residual ``||A y - theta y|| =
    beta |s_k|`` is at most ``tol |theta|`` (ARPACK's test), or when the Krylov space is
    invariant. A full basis with budget left restarts from its top ``m // 2`` Ritz vectors
    (Wu & Simon 2000), which keeps the Ritz value non-decreasing. Unconverged: the top Ritz
    value with ``converged=False``. The last element is the relative residual of the returned pair.
    """
    budget = max(int(iters), 1)
    m = min(op.n, MAX_NCV, budget)
    eps = torch.finfo(op.dtype).eps
    V = torch.empty(m + 1, op.n, dtype=op.dtype, device=op.device)
    torch.div(v0, torch.linalg.vector_norm(v0), out=V[0])
    T = np.zeros((m + 1, m + 1))
    j = 0  # V[:j + 1] orthonormal, V[j] next to multiply
    while True:
        w = op(V[j])
        Vj = V[: j + 1]
        # float32 dot products suffice (no float64 accumulation): on float32 MLPs of 1.2k-9k
        # parameters the value is within 2e-8 (relative) of the float64 dense top eigenvalue
        # after 20 HVPs and within 1e-6 at tol=1e-3 (tests/test_curvature.py checks 1e-6, 1e-4)
        h = Vj @ w
        w.addmv_(Vj.T, h, alpha=-1.0)
        h2 = Vj @ w
        w.addmv_(Vj.T, h2, alpha=-1.0)
        beta_t = torch.linalg.vector_norm(w)
        coeffs = torch.cat([h + h2, beta_t[None]]).to("cpu", torch.float64).numpy()  # j + 2 numbers
        if not np.isfinite(coeffs).all():
            return float("nan"), op.calls, False, float("nan")
        k, beta = j + 1, float(coeffs[-1])
        T[:k, j] = T[j, :k] = coeffs[:-1]
        theta, S = np.linalg.eigh(T[:k, :k])
        top = float(theta[-1])
        invariant = k >= op.n or beta <= BREAKDOWN * eps * float(np.abs(theta).max())
        resid = beta * abs(S[-1, -1])
        rel = resid / abs(top) if top else math.inf
        if invariant or resid <= tol * abs(top):
            return top, op.calls, True, rel
        if op.calls >= budget:
            return top, op.calls, False, rel
        if k < m:
            torch.div(w, beta_t, out=V[k])
            j = k
            continue
        r = max(m // 2, 1)
        keep = torch.from_numpy(np.ascontiguousarray(S[:, -r:].T)).to(V)  # r x k, small
        V[:r] = keep @ V[:k]
        torch.div(w, beta_t, out=V[r])
        T[:] = 0.0
        T[:r, :r] = np.diag(theta[-r:])
        T[r, :r] = T[:r, r] = beta * S[-1, -r:]
        j = r


def _top_eig(grads, params, *, method: str, iters: int, tol: float, generator: torch.Generator,
             precond: Sequence[torch.Tensor] | None = None) -> tuple[float, int, bool, float]:
    _check_method(method)
    op = _Operator(grads, params, precond)
    # a caller's autocast (an LM probe under bfloat16 / float16) would run the basis products in
    # half precision, against the float32 vectors they update; the HVPs' double backward keeps
    # the dtypes its forward pass recorded either way
    with torch.autocast(op.device.type, enabled=False):
        return _solve(op, method, iters=iters, tol=tol, generator=generator)


def _solve(op: _Operator, method: str, *, iters: int, tol: float,
           generator: torch.Generator) -> tuple[float, int, bool, float]:
    if method == "lanczos":
        return _lanczos(op, _start_vector(op, generator), iters=iters, tol=tol)
    lam, k, ok, change = _power(op, _start_vector(op, generator), iters=iters, tol=tol)
    if math.isfinite(lam) and lam < 0:
        lam2, k2, ok, change = _power(op, _start_vector(op, generator), iters=iters, tol=tol, shift=abs(lam))
        lam, k = lam2, k + k2
    return lam, k, ok, change


def lambda_max(loss_fn: LossFn, params: Sequence[torch.Tensor], *, iters: int = 20, tol: float = TOL,
               seed: int | None = 0, generator: torch.Generator | None = None,
               grads: Sequence[torch.Tensor] | None = None, method: str = "lanczos") -> EigResult:
    """Top (largest algebraic) Hessian eigenvalue of ``loss_fn`` at ``params`` from HVPs.

    ``method="lanczos"`` (default): thick-restart Lanczos with full reorthogonalisation,
    one HVP on the reused gradient graph per step; at most ``iters`` HVPs; converged
    when the residual test ``||Hx - theta x|| <= tol |theta|`` passes (ARPACK's; checked
    after every HVP), else the top Ritz value of the Krylov space spent (``converged=False``).
    A dominant negative eigenvalue does not slow it. It runs on the parameters' device;
    memory: ``min(iters, MAX_NCV) + 1`` parameter-sized vectors in the parameters' dtype
    (float32 for half-precision parameters), and per step a few numbers to the host.

    ``method="power"``: power iteration; it finds the eigenvalue of largest magnitude,
    and when that is negative a second pass on H + |lambda| I (slow when the negative
    eigenvalue dominates) recovers the most positive one; ``tol`` bounds the relative
    change of the estimate, ``iters`` each pass.

    Args:
        loss_fn: closure computing the scalar loss on a fixed probe batch.
        params: tensors to differentiate (those not requiring grad are skipped).
        iters: maximum number of Hessian-vector products (the cost knob).
        tol: convergence tolerance (see above; :data:`TOL` by default).
        seed / generator: randomness of the starting vector.
        grads: a gradient graph from :func:`gradient_graph` to reuse.
        method: ``"lanczos"`` or ``"power"``.

    Returns:
        :class:`EigResult` (value, HVPs used, wall time, converged, relative residual).
    """
    _check_method(method)
    t0 = time.perf_counter()
    params = _params(params)
    if grads is None:
        _, grads = gradient_graph(loss_fn, params)
    gen = _generator(seed, generator)
    lam, k, ok, resid = _top_eig(grads, params, method=method, iters=iters, tol=tol, generator=gen)
    return EigResult(lam, k, time.perf_counter() - t0, ok, resid)


def directional_sharpness(loss_fn: LossFn | None, params: Sequence[torch.Tensor],
                          direction: Sequence[torch.Tensor], *,
                          grads: Sequence[torch.Tensor] | None = None) -> float:
    """u^T H u / ||u||^2 along ``direction`` (one HVP); NaN for a zero direction."""
    params = _params(params)
    if grads is None:
        _, grads = gradient_graph(loss_fn, params)
    u = [d.detach().to(p) for d, p in zip(direction, params, strict=True)]
    uu = float(_dot(u, u))
    if not uu > 0:
        return float("nan")
    return float(_dot(u, hvp(grads, params, u))) / uu


def adam_preconditioner(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
    """Adam's diagonal preconditioner P = sqrt(v_hat) + eps per parameter (bias-corrected v).

    Returns None when some parameter has no Adam state yet (or the optimizer is not Adam-like).
    """
    where = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    out = []
    for p in params:
        g = where.get(id(p))
        st = optimizer.state.get(p, {})
        if g is None or "exp_avg_sq" not in st or "betas" not in g:
            return None
        t = float(st.get("step", 1))
        b2 = float(g["betas"][1])
        v_hat = st["exp_avg_sq"].detach() / (1.0 - b2**t)
        out.append(v_hat.sqrt() + float(g["eps"]))
    return out


def precond_sharpness(loss_fn: LossFn | None, params: Sequence[torch.Tensor],
                      preconditioner: Sequence[torch.Tensor], *, iters: int = 20, tol: float = TOL,
                      seed: int | None = 0, generator: torch.Generator | None = None,
                      grads: Sequence[torch.Tensor] | None = None, method: str = "lanczos") -> EigResult:
    """Top eigenvalue of P^{-1} H, P = diag(``preconditioner``) (e.g. :func:`adam_preconditioner`).

    Runs the eigensolver (``method``, ``iters`` and ``tol`` as in :func:`lambda_max`) on the
    symmetric P^{-1/2} H P^{-1/2} (same eigenvalues).
    """
    _check_method(method)
    t0 = time.perf_counter()
    params = _params(params)
    if grads is None:
        _, grads = gradient_graph(loss_fn, params)
    precond = [d.detach().reshape(p.shape) for d, p in zip(preconditioner, params, strict=True)]
    gen = _generator(seed, generator)
    lam, k, ok, resid = _top_eig(grads, params, method=method, iters=iters, tol=tol, generator=gen,
                                 precond=precond)
    return EigResult(lam, k, time.perf_counter() - t0, ok, resid)


def dense_hessian(loss_fn: LossFn, params: Sequence[torch.Tensor]) -> np.ndarray:
    """The full Hessian (N x N, float64 numpy) from N HVPs: for checks on small models only."""
    params = _params(params)
    _, grads = gradient_graph(loss_fn, params)
    n = sum(p.numel() for p in params)
    if n > 20000:
        raise ValueError(f"dense_hessian is for small models; got {n} parameters")
    H = np.zeros((n, n))
    for i in range(n):
        e = torch.zeros(n)
        e[i] = 1.0
        parts = list(e.split([p.numel() for p in params]))
        hv = hvp(grads, params, [x.view_as(p).to(p) for x, p in zip(parts, params, strict=True)])
        H[:, i] = torch.cat([h.reshape(-1) for h in hv]).double().numpy()
    return 0.5 * (H + H.T)


def dense_top_eigenvalue(loss_fn: LossFn, params: Sequence[torch.Tensor],
                         preconditioner: Sequence[torch.Tensor] | None = None) -> float:
    """Exact top eigenvalue of H (or of P^{-1} H) from the dense Hessian."""
    H = dense_hessian(loss_fn, params)
    if preconditioner is not None:
        s = torch.cat([d.detach().reshape(-1) for d in preconditioner]).double().numpy() ** -0.5
        H = s[:, None] * H * s[None, :]
    return float(np.linalg.eigvalsh(H)[-1])


def check(name: str, measured: float, target: float, rel_tol: float) -> dict:
    """A calibration check: measured vs target within a relative tolerance.

    Returns ``{"check", "measured", "target", "rel_error", "tolerance", "passed"}``.
    """
    rel = abs(measured - target) / abs(target) if target else float("inf")
    ok = bool(math.isfinite(measured) and rel <= rel_tol)
    return {"check": name, "measured": float(measured), "target": float(target),
            "rel_error": float(rel), "tolerance": float(rel_tol), "passed": ok}


#: Channels a :class:`CurvatureProbe` writes.
CURVATURE_CHANNELS = registry.channel_names(source="curvature")


def probe_stale(curvature_every: int, attrs: Mapping[str, Any], tol: float) -> str | None:
    """Why a stored run's curvature channels no longer describe its probe, or None: they were measured
    at another tolerance, or before ``lambda_max_resid`` (runs without the ``curvature_tol`` attribute,
    at the old default 1e-3). For the learners' ``stale(spec, attrs)``: only runs that measured
    curvature are recomputed, not every run a ``RESULTS_VERSION`` bump would."""
    if not curvature_every:
        return None
    if "curvature_tol" not in attrs:
        return f"measured lambda_max at the old default tolerance 1e-3, without lambda_max_resid (now tol {tol:g})"
    if float(attrs["curvature_tol"]) != float(tol):
        return f"measured lambda_max at tolerance {float(attrs['curvature_tol']):g} (now {tol:g})"
    return None


class CurvatureProbe:
    """Measure curvature every ``every`` steps into a :class:`~stabstudy.instruments.telemetry.Monitor`.

    Call it right after ``optimizer.step()`` (after the Monitor recorded the step).
    It evaluates, at the parameters after the update, on the fixed probe batch of
    ``loss_fn``: ``lambda_max`` (``method``: Lanczos or power iteration), ``sharpness_grad`` (along the
    probe-batch gradient), ``sharpness_update`` (along the update just applied,
    when the Monitor measured it), ``precond_sharpness`` (Adam's P^{-1} H, when
    ``optimizer`` has Adam state), ``lambda_max_cost_s``, ``lambda_max_iters`` and
    ``lambda_max_resid`` (:attr:`EigResult.resid`: how converged ``lambda_max`` is).
    Rows in between read NaN.
    """

    def __init__(self, monitor, loss_fn: LossFn, params: Sequence[torch.Tensor], *, every: int,
                 optimizer: torch.optim.Optimizer | None = None, iters: int = 20, tol: float = TOL,
                 seed: int = 0, method: str = "lanczos"):
        _check_method(method)
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.monitor = monitor
        self.loss_fn = loss_fn
        self.params = _params(params)
        self.every = every
        self.optimizer = optimizer
        self.iters = iters
        self.tol = tol
        self.method = method
        self.generator = torch.Generator().manual_seed(seed)

    def measure(self, update: Sequence[torch.Tensor] | None = None) -> dict[str, float]:
        """All curvature channels at the current parameters (no logging)."""
        out = dict.fromkeys(CURVATURE_CHANNELS, float("nan"))
        t0 = time.perf_counter()
        loss, grads = gradient_graph(self.loss_fn, self.params)
        if not torch.isfinite(loss):
            return out
        eig = lambda_max(None, self.params, iters=self.iters, tol=self.tol, generator=self.generator, grads=grads,
                         method=self.method)
        out["lambda_max"] = eig.value
        out["lambda_max_iters"] = float(eig.iters)
        out["lambda_max_resid"] = eig.resid
        out["lambda_max_cost_s"] = time.perf_counter() - t0
        out["sharpness_grad"] = directional_sharpness(None, self.params, [g.detach() for g in grads], grads=grads)
        if update is not None:
            out["sharpness_update"] = directional_sharpness(None, self.params, update, grads=grads)
        if self.optimizer is not None:
            P = adam_preconditioner(self.optimizer, self.params)
            if P is not None:
                out["precond_sharpness"] = precond_sharpness(
                    None, self.params, P, iters=self.iters, tol=self.tol, generator=self.generator, grads=grads,
                    method=self.method).value
        return out

    def __call__(self) -> dict[str, float] | None:
        """Measure and log if the Monitor's current step is due; return the values or None."""
        s = self.monitor.step
        if s < 0 or s % self.every != 0 or not self.monitor.enabled:
            return None
        update = self.monitor.last_update(self.params)
        vals = self.measure(update)
        self.monitor.log(**vals)
        return vals
