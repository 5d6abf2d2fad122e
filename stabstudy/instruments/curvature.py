"""Loss curvature from Hessian-vector products: sharpness, directional and
Adam-preconditioned sharpness.

* :func:`lambda_max`: top (largest *algebraic*) Hessian eigenvalue from
  Hessian-vector products (Pearlmutter 1994: Hv = grad(grad(L) . v)). The default
  ``method="lanczos"`` runs ARPACK's implicitly restarted Lanczos
  (``scipy.sparse.linalg.eigsh``, ``which="LA"``; Lehoucq, Sorensen & Yang 1998)
  on a :class:`scipy.sparse.linalg.LinearOperator` whose matvec is one HVP; it is
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

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from scipy.sparse.linalg import ArpackError, ArpackNoConvergence, LinearOperator, eigsh

LossFn = Callable[[], torch.Tensor]


@dataclass(frozen=True)
class EigResult:
    """Result of an eigenvalue estimate (:func:`lambda_max`, :func:`precond_sharpness`)."""

    value: float
    """The eigenvalue estimate (lanczos: ARPACK's Ritz value, or when it did not converge the
    best Ritz value over every vector it multiplied; power: Rayleigh quotient at the last iterate)."""
    iters: int
    """Hessian-vector products actually used (all of them, shift pass included)."""
    wall_s: float
    """Wall time of the whole measurement (seconds)."""
    converged: bool
    """lanczos: ARPACK's residual test ||Hx - theta x|| <= tol |theta| passed within the budget;
    power: the relative change fell below ``tol`` before ``iters`` ran out."""

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


def _power(grads, params, *, iters: int, tol: float, generator: torch.Generator,
           scale: Sequence[torch.Tensor] | None = None, shift: float = 0.0) -> tuple[float, int, bool]:
    """Power iteration on (S H S + shift I), S = diag(scale) (identity when None)."""
    v = [torch.randn(p.shape, generator=generator, dtype=torch.float32).to(p) for p in params]
    nrm = torch.sqrt(_dot(v, v))
    v = [x / nrm for x in v]
    lam_prev = None
    lam = float("nan")
    for k in range(1, iters + 1):
        w = v if scale is None else [x * s for x, s in zip(v, scale, strict=True)]
        hv = hvp(grads, params, w)
        if scale is not None:
            hv = [x * s for x, s in zip(hv, scale, strict=True)]
        if shift:
            hv = [h + shift * x for h, x in zip(hv, v, strict=True)]
        lam_t = _dot(v, hv)
        nrm = torch.sqrt(_dot(hv, hv))
        lam = float(lam_t) - shift
        if not math.isfinite(lam) or float(nrm) == 0.0:
            return lam, k, False
        v = [x / nrm for x in hv]
        if lam_prev is not None and abs(lam - lam_prev) <= tol * max(abs(lam), 1e-12):
            return lam, k, True
        lam_prev = lam
    return lam, iters, False


def _generator(seed: int | None, generator: torch.Generator | None) -> torch.Generator:
    if generator is not None:
        return generator
    return torch.Generator().manual_seed(0 if seed is None else int(seed))


#: Eigensolvers of :func:`lambda_max` and :func:`precond_sharpness`.
METHODS = ("lanczos", "power")
#: Largest Lanczos basis (ARPACK's ``ncv``); a larger ``iters`` budget restarts.
MAX_NCV = 20


def _check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}: use 'lanczos' or 'power'")


class _Stop(Exception):
    """Raised by the matvec to end ARPACK's reverse communication (budget spent, non-finite HVP)."""


class _HessianOperator(LinearOperator):
    """S H S on flat float64 vectors (S = diag(scale), identity when None): one HVP per matvec.

    Counts its matvecs, refuses more than ``budget`` (raises :class:`_Stop`), and keeps
    every vector x it multiplied (normalized) with its product, so that :meth:`ritz_max`
    can give the best Ritz value over their span (the Krylov space of all HVPs spent).
    """

    def __init__(self, grads: Sequence[torch.Tensor], params: Sequence[torch.Tensor],
                 scale: Sequence[torch.Tensor] | None, budget: int):
        self.grads, self.params = list(grads), list(params)
        self.sizes = [p.numel() for p in self.params]
        n = sum(self.sizes)
        super().__init__(dtype=np.float64, shape=(n, n))
        self.scale = None if scale is None else _flat(scale)
        self.budget = budget
        self.calls = 0
        self.xs: list[np.ndarray] = []
        self.ys: list[np.ndarray] = []
        self.finite = True

    def _matvec(self, x: np.ndarray) -> np.ndarray:
        if self.calls >= self.budget:
            raise _Stop("budget")
        x = np.asarray(x, dtype=np.float64).reshape(-1)
        w = x if self.scale is None else x * self.scale
        parts = torch.from_numpy(w).split(self.sizes)
        y = _flat(hvp(self.grads, self.params, [t.view(p.shape).to(p) for t, p in zip(parts, self.params, strict=True)]))
        if self.scale is not None:
            y *= self.scale
        self.calls += 1
        if not np.isfinite(y).all():
            self.finite = False
            raise _Stop("non-finite Hessian-vector product")
        nrm = float(np.linalg.norm(x))
        if nrm > 0:
            self.xs.append(x / nrm)
            self.ys.append(y / nrm)
        return y

    def ritz_max(self) -> float:
        """Largest Ritz value of the operator on the span of every vector multiplied so far.

        Rayleigh-Ritz: with X (rows: the vectors) and Y = A X, the projection onto the span
        is T = W^T sym(X Y^T) W, W = V diag(sigma)^-1 from X X^T = V diag(sigma^2) V^T; directions
        with sigma below eps(HVP dtype)^(1/3) are dropped (their products are noise).
        """
        if not self.xs:
            return float("nan")
        X, Y = np.stack(self.xs), np.stack(self.ys)
        s, V = np.linalg.eigh(X @ X.T)
        eps = torch.finfo(self.params[0].dtype).eps if self.params[0].is_floating_point() else 1e-16
        keep = s > (eps ** (1 / 3)) ** 2 * s[-1]
        W = V[:, keep] / np.sqrt(s[keep])
        G = X @ Y.T
        T = W.T @ (0.5 * (G + G.T)) @ W
        return float(np.linalg.eigvalsh(T)[-1])


def _flat(ts: Sequence[torch.Tensor]) -> np.ndarray:
    return torch.cat([t.detach().reshape(-1) for t in ts]).to("cpu", torch.float64).numpy()


def _lanczos(grads, params, *, iters: int, tol: float, generator: torch.Generator,
             scale: Sequence[torch.Tensor] | None = None) -> tuple[float, int, bool]:
    """Largest algebraic eigenvalue of S H S by ARPACK (``eigsh``, ``which="LA"``) within ``iters`` HVPs.

    ``ncv = min(n, iters - 1, MAX_NCV)`` (ARPACK's first Lanczos pass costs ncv + 1 HVPs, so
    the default budget is one unrestarted pass); ``maxiter`` is large enough that the HVP
    budget, enforced in the matvec, is what ends an unconverged run. Then (budget spent, or
    ``ArpackNoConvergence`` without a converged value) the value is the best Ritz value over
    all vectors multiplied, with ``converged=False``.
    """
    op = _HessianOperator(grads, params, scale, max(int(iters), 1))
    n = op.shape[0]
    v0 = torch.randn(n, generator=generator, dtype=torch.float64).numpy()
    if n < 2:  # ARPACK needs k < n: one HVP is the whole (1 x 1) Hessian
        try:
            return float(op.matvec(np.ones(1))[0]), op.calls, True
        except _Stop:
            return float("nan"), op.calls, False
    ncv = min(n, max(2, int(iters) - 1), MAX_NCV)
    try:
        w = eigsh(op, k=1, which="LA", ncv=ncv, maxiter=max(int(iters), 1), tol=float(tol), v0=v0,
                  return_eigenvectors=False)
        return float(w[-1]), op.calls, True
    except ArpackNoConvergence as e:
        if len(e.eigenvalues):
            return float(np.max(e.eigenvalues)), op.calls, False
    except _Stop:
        pass
    except ArpackError:  # pragma: no cover - e.g. a breakdown ARPACK cannot recover from
        pass
    return (op.ritz_max() if op.finite else float("nan")), op.calls, False


def _top_eig(grads, params, *, method: str, iters: int, tol: float, generator: torch.Generator,
             scale: Sequence[torch.Tensor] | None = None) -> tuple[float, int, bool]:
    _check_method(method)
    if method == "lanczos":
        return _lanczos(grads, params, iters=iters, tol=tol, generator=generator, scale=scale)
    lam, k, ok = _power(grads, params, iters=iters, tol=tol, generator=generator, scale=scale)
    if math.isfinite(lam) and lam < 0:
        lam2, k2, ok = _power(grads, params, iters=iters, tol=tol, generator=generator, scale=scale, shift=abs(lam))
        lam, k = lam2, k + k2
    return lam, k, ok


def lambda_max(loss_fn: LossFn, params: Sequence[torch.Tensor], *, iters: int = 20, tol: float = 1e-3,
               seed: int | None = 0, generator: torch.Generator | None = None,
               grads: Sequence[torch.Tensor] | None = None, method: str = "lanczos") -> EigResult:
    """Top (largest algebraic) Hessian eigenvalue of ``loss_fn`` at ``params`` from HVPs.

    ``method="lanczos"`` (default): ARPACK's implicitly restarted Lanczos
    (``scipy.sparse.linalg.eigsh(which="LA", k=1)``) on a ``LinearOperator`` whose
    matvec is one HVP on the reused gradient graph; at most ``iters`` HVPs; converged
    when ARPACK's residual test ``||Hx - theta x|| <= tol |theta|`` passes, else the best
    Ritz value over the Krylov space spent (``converged=False``). A dominant negative
    eigenvalue does not slow it. Memory: about ``2 * iters`` float64 copies of the parameters.

    ``method="power"``: power iteration; it finds the eigenvalue of largest magnitude,
    and when that is negative a second pass on H + |lambda| I (slow when the negative
    eigenvalue dominates) recovers the most positive one; ``tol`` bounds the relative
    change of the estimate, ``iters`` each pass.

    Args:
        loss_fn: closure computing the scalar loss on a fixed probe batch.
        params: tensors to differentiate (those not requiring grad are skipped).
        iters: maximum number of Hessian-vector products (the cost knob).
        tol: convergence tolerance (see above).
        seed / generator: randomness of the starting vector.
        grads: a gradient graph from :func:`gradient_graph` to reuse.
        method: ``"lanczos"`` or ``"power"``.

    Returns:
        :class:`EigResult` (value, HVPs used, wall time, converged).
    """
    _check_method(method)
    t0 = time.perf_counter()
    params = _params(params)
    if grads is None:
        _, grads = gradient_graph(loss_fn, params)
    gen = _generator(seed, generator)
    lam, k, ok = _top_eig(grads, params, method=method, iters=iters, tol=tol, generator=gen)
    return EigResult(lam, k, time.perf_counter() - t0, ok)


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
                      preconditioner: Sequence[torch.Tensor], *, iters: int = 20, tol: float = 1e-3,
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
    scale = [d.detach().to(p).rsqrt() for d, p in zip(preconditioner, params, strict=True)]
    gen = _generator(seed, generator)
    lam, k, ok = _top_eig(grads, params, method=method, iters=iters, tol=tol, generator=gen, scale=scale)
    return EigResult(lam, k, time.perf_counter() - t0, ok)


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
CURVATURE_CHANNELS = ("lambda_max", "sharpness_grad", "sharpness_update", "precond_sharpness",
                      "lambda_max_cost_s", "lambda_max_iters")


class CurvatureProbe:
    """Measure curvature every ``every`` steps into a :class:`~stabstudy.instruments.telemetry.Monitor`.

    Call it right after ``optimizer.step()`` (after the Monitor recorded the step).
    It evaluates, at the parameters after the update, on the fixed probe batch of
    ``loss_fn``: ``lambda_max`` (``method``: Lanczos or power iteration), ``sharpness_grad`` (along the
    probe-batch gradient), ``sharpness_update`` (along the update just applied,
    when the Monitor measured it), ``precond_sharpness`` (Adam's P^{-1} H, when
    ``optimizer`` has Adam state), ``lambda_max_cost_s`` and ``lambda_max_iters``.
    Rows in between read NaN.
    """

    def __init__(self, monitor, loss_fn: LossFn, params: Sequence[torch.Tensor], *, every: int,
                 optimizer: torch.optim.Optimizer | None = None, iters: int = 20, tol: float = 1e-3,
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
