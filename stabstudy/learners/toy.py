"""Toy learner for instrument calibration: small tanh MLPs trained with full-batch
GD, minibatch SGD or Adam, where the expected curvature dynamics are known.

* Full-batch GD on an MSE loss: progressive sharpening, then the *edge of
  stability* where lambda_max hovers near 2/lr (Cohen et al. 2021). It is
  strongest with MSE, tanh nets and hard (one-hot) targets, hence the defaults.
* Full-batch Adam: the preconditioned sharpness lambda_max(P^-1 H) settles near
  (2 + 2 beta1) / ((1 - beta1) lr) = 38/lr for beta1 = 0.9 (Cohen et al. 2022).

``run(spec)`` follows the learner contract (:mod:`stabstudy.run.runner`): every
RNG seeded from ``spec.seed``, a Dataset with dimension ``step`` (optimizer
updates), status ``diverged`` on a non-finite or exploding loss. Tasks:

* ``digits``: scikit-learn's bundled 8x8 digits (no download), standardized with
  training statistics; a deterministic subset of ``n_train`` training and
  ``n_test`` test images (``data_seed``); targets one-hot; ``perf`` = test accuracy.
* ``synthetic``: Gaussian inputs, targets from a fixed random tanh teacher;
  ``perf`` = minus the test loss.

Hyperparameters (``spec.hparams``; fields and defaults in :class:`stabstudy.hparams.ToyHParams`): ``lr``,
``warmup`` (linear lr warmup steps), ``width``, ``depth`` (hidden layers), ``n_train``, ``n_test``, ``batch_size``
(0 = full batch; ``gd`` is always full batch), ``beta1``, ``beta2``, ``eps``,
``momentum`` (sgd/gd), ``weight_decay``, ``activation`` (tanh|relu|elu|gelu),
``loss`` (mse|ce), ``curv_iters``, ``probe_size``, ``diverge_loss``,
``data_seed``, ``outlier_scale``.

Channels: the Monitor's (``grad_norm``, ``xgrad``, ``update_*``, ``adam_*``,
``lr``; every ``spec.log_every`` steps), ``loss`` (unscaled), ``out_logit_max`` (largest |output| on the
training batch, from the forward pass of the loss) and ``last_weight_norm`` (Frobenius norm of the output layer's
weight before the update) every step,
``perf``, ``test_loss`` and (digits) ``train_acc`` every ``spec.eval_every``
steps (default: 100 evaluations per run), ``perturbed``, and with
``spec.curvature_every`` the :data:`stabstudy.instruments.curvature.CURVATURE_CHANNELS`
(``lambda_max`` etc., on the first ``probe_size`` training examples, measured
after the update of that step). With a ``controller`` (:mod:`stabstudy.interventions.control`,
attached through the Monitor's pre-step view) also ``intervened`` and ``action``.

Perturbations: every kind :data:`stabstudy.registry.KINDS` lists for ``toy``, through the hooks of
a :class:`~stabstudy.interventions.perturb.Perturber`: ``lr_spike``, ``lr_ramp``, ``beta2_shift``
(Adam only), ``grad_noise``, ``weight_noise``, ``reinit_layer`` (``params['layer']``, default
``layers.0``), ``outlier_batch`` (a ``dose`` fraction of the batch replaced by inputs of std
``outlier_scale`` with random one-hot targets), ``loss_scale``.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import torch
import xarray as xr

from stabstudy import registry
from stabstudy.hparams import ToyHParams, merged
from stabstudy.instruments.curvature import CURVATURE_CHANNELS, TOL, CurvatureProbe, probe_stale
from stabstudy.instruments.telemetry import Monitor
from stabstudy.interventions import control
from stabstudy.interventions.perturb import Perturber
from stabstudy.registry import DOMAINS, check_task
from stabstudy.seeding import seed_everything
from stabstudy.spec import RunSpec

#: Bump when a change to this learner alters the results it stores: the runner then
#: recomputes stored runs of other versions instead of reusing them.
#: 2: lambda_max from the on-device Lanczos (another start vector: values move within its tolerance).
#: 3: out_logit_max and last_weight_norm every step (every other array bit for bit as in 2).
RESULTS_VERSION = 3

TASKS = DOMAINS["toy"].task_names


_ACT = {"tanh": torch.nn.Tanh, "relu": torch.nn.ReLU, "elu": torch.nn.ELU, "gelu": torch.nn.GELU}


def hparams(spec: RunSpec) -> dict[str, Any]:
    """The spec's hyperparameters over the :class:`~stabstudy.hparams.ToyHParams` defaults."""
    return merged(ToyHParams, spec.hp, f"toy learner {spec.learner!r}")


def stale(spec: RunSpec, attrs: dict) -> str | None:
    """Why a stored run of ``spec`` no longer describes it, or None (called by
    :func:`stabstudy.run.runner.pending`): its curvature channels came from another probe tolerance."""
    return probe_stale(spec.curvature_every, attrs, float(hparams(spec)["curv_tol"]))


class MLP(torch.nn.Module):
    """``depth`` hidden layers of ``width`` units; submodules ``layers.0`` ... ``layers.{depth}``."""

    def __init__(self, d_in: int, d_out: int, width: int, depth: int, activation: str = "tanh"):
        super().__init__()
        dims = [d_in] + [width] * depth + [d_out]
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:], strict=True))
        self.act = _ACT[activation]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = self.act(layer(x))
        return self.layers[-1](x)


@functools.cache
def _digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    d = load_digits()
    return d.data.astype(np.float32), d.target.astype(np.int64)


def load_task(task: str, n_train: int, n_test: int, data_seed: int = 0, synthetic_dim: int = 16,
              synthetic_out: int = 4) -> dict[str, torch.Tensor]:
    """Tensors ``x_train, y_train, x_test, y_test`` (float32; ``y`` one-hot or regression
    targets) and ``c_train, c_test`` (class indices; -1 for regression)."""
    check_task("toy", task)  # names the valid tasks
    rng = np.random.default_rng(data_seed)
    if task == "digits":
        X, c = _digits()
        if n_train + n_test > len(X):
            raise ValueError(f"digits has {len(X)} images; n_train + n_test = {n_train + n_test}")
        idx = rng.permutation(len(X))
        tr, te = idx[:n_train], idx[n_train:n_train + n_test]
        mu, sd = X[tr].mean(0), X[tr].std(0) + 1e-6
        Xs = (X - mu) / sd
        Y = np.eye(10, dtype=np.float32)[c]
        out = {"x_train": Xs[tr], "y_train": Y[tr], "x_test": Xs[te], "y_test": Y[te],
               "c_train": c[tr], "c_test": c[te]}
    else:  # synthetic
        n = n_train + n_test
        X = rng.standard_normal((n, synthetic_dim)).astype(np.float32)
        W1 = rng.standard_normal((synthetic_dim, 32)) / math.sqrt(synthetic_dim)
        W2 = rng.standard_normal((32, synthetic_out)) / math.sqrt(32)
        Y = (np.tanh(X @ W1) @ W2).astype(np.float32)
        out = {"x_train": X[:n_train], "y_train": Y[:n_train], "x_test": X[n_train:], "y_test": Y[n_train:],
               "c_train": -np.ones(n_train, np.int64), "c_test": -np.ones(n_test, np.int64)}
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in out.items()}


def objective(out: torch.Tensor, y: torch.Tensor, c: torch.Tensor, kind: str) -> torch.Tensor:
    """``mse``: 0.5 * mean_i ||f(x_i) - y_i||^2 (Cohen et al. 2021); ``ce``: cross-entropy."""
    if kind == "mse":
        return 0.5 * (out - y).pow(2).sum(1).mean()
    return torch.nn.functional.cross_entropy(out, c)


def make_optimizer(learner: str, params, hp: dict[str, Any]) -> torch.optim.Optimizer:
    lr = float(hp["lr"])
    if learner in ("gd", "sgd"):
        return torch.optim.SGD(params, lr=lr, momentum=float(hp["momentum"]), weight_decay=float(hp["weight_decay"]))
    if float(hp["weight_decay"]) > 0:
        return torch.optim.AdamW(params, lr=lr, betas=(float(hp["beta1"]), float(hp["beta2"])),
                                 eps=float(hp["eps"]), weight_decay=float(hp["weight_decay"]))
    return torch.optim.Adam(params, lr=lr, betas=(float(hp["beta1"]), float(hp["beta2"])), eps=float(hp["eps"]))


def _outliers(x, y, c, frac: float, scale: float, gen: torch.Generator, classification: bool):
    n = x.shape[0]
    k = min(n, max(1, int(round(frac * n)))) if frac > 0 else 0
    if k == 0:
        return x, y, c
    x, y, c = x.clone(), y.clone(), c.clone()
    rows = torch.randperm(n, generator=gen)[:k]
    x[rows] = torch.randn((k, x.shape[1]), generator=gen) * scale
    if classification:
        new_c = torch.randint(0, y.shape[1], (k,), generator=gen)
        c[rows] = new_c
        y[rows] = torch.nn.functional.one_hot(new_c, y.shape[1]).to(y.dtype)
    else:
        y[rows] = torch.randn((k, y.shape[1]), generator=gen) * y.std()
    return x, y, c


def run(spec: RunSpec) -> xr.Dataset:
    """Train the toy model as ``spec`` says; return the per-step Dataset."""
    if spec.domain != "toy":
        raise ValueError(f"toy.run got a {spec.domain!r} spec")
    hp = hparams(spec)
    seed = spec.seed
    classification = spec.task == "digits"
    pert = Perturber(spec.perturbations, torch.Generator().manual_seed(seed + 1_000_003), layer="layers.0",
                     outliers=lambda b, p, gen: _outliers(*b, p.dose, float(hp["outlier_scale"]), gen, classification))
    hp = pert.hparams(hp)
    seed_everything(seed)
    data = load_task(spec.task, int(hp["n_train"]), int(hp["n_test"]), int(hp["data_seed"]),
                     int(hp["synthetic_dim"]), int(hp["synthetic_out"]))
    xtr, ytr, ctr = data["x_train"], data["y_train"], data["c_train"]
    model = MLP(xtr.shape[1], ytr.shape[1], int(hp["width"]), int(hp["depth"]), str(hp["activation"]))
    params = list(model.parameters())
    opt = make_optimizer(spec.learner, params, hp)
    loss_kind = str(hp["loss"])
    n = xtr.shape[0]
    bs = int(hp["batch_size"]) or (64 if spec.learner == "sgd" else n)
    full_batch = spec.learner == "gd" or bs >= n
    data_gen = torch.Generator().manual_seed(seed + 17)
    base_lr = float(hp["lr"])
    warmup = int(hp["warmup"])

    mon = Monitor(model, opt, every=spec.log_every)
    ctrl = control.from_hparams(hp)  # None unless hparams name one: then the loop runs as before
    if ctrl is not None:
        ctrl.attach(opt, mon)
    probe = None
    if spec.curvature_every:
        m = int(hp["probe_size"]) or n
        px, py, pc = xtr[:m], ytr[:m], ctr[:m]
        probe = CurvatureProbe(mon, lambda: objective(model(px), py, pc, loss_kind), params,
                               every=spec.curvature_every, optimizer=opt if spec.learner == "adam" else None,
                               iters=int(hp["curv_iters"]), tol=float(hp["curv_tol"]), seed=seed)
    eval_every = spec.eval_every or max(1, spec.steps // 100)
    status, done = "ok", 0
    order = torch.randperm(n, generator=data_gen)
    cursor = 0
    try:
        for step in range(spec.steps):
            # -- schedule ------------------------------------------------------------
            # past the warmup the lr is base_lr itself, not base_lr * 1.0: stored runs recompute bit for bit
            pert.on_step_start(step, opt, base_lr if step >= warmup else base_lr * (step + 1) / warmup)
            pert.on_params(step, model)
            # -- batch ---------------------------------------------------------------
            if full_batch:
                x, y, c = xtr, ytr, ctr
            else:
                if cursor + bs > n:
                    order, cursor = torch.randperm(n, generator=data_gen), 0
                idx = order[cursor:cursor + bs]
                cursor += bs
                x, y, c = xtr[idx], ytr[idx], ctr[idx]
            x, y, c = pert.on_batch(step, (x, y, c))
            # -- update --------------------------------------------------------------
            opt.zero_grad(set_to_none=True)
            out = model(x)
            loss = objective(out, y, c, loss_kind)
            loss_val = float(loss.detach())
            # read off this forward pass and the weights it used (before the update), as tensors: the
            # Monitor copies them without a host sync on a GPU
            row = {"loss": loss_val, "out_logit_max": out.detach().abs().max(),
                   "last_weight_norm": torch.linalg.vector_norm(model.layers[-1].weight.detach())}
            pert.on_loss(step, loss).backward()
            pert.on_grads(step, params)
            if ctrl is not None:
                ctrl.observe(loss_val, step=step)
            opt.step()
            done = step + 1
            if step % eval_every == 0 or step == spec.steps - 1:
                row.update(_evaluate(model, data, loss_kind, classification))
            mon.log(**row)
            if not math.isfinite(loss_val) or loss_val > float(hp["diverge_loss"]):
                status = "diverged"
                break
            if probe is not None:
                probe()
    finally:
        mds = mon.to_dataset(stored=True)
        mon.close()
        if ctrl is not None:
            ctrl.close()
    steps = np.arange(done)
    mds = mds.reindex(step=steps)
    ds = xr.Dataset(coords={"step": ("step", steps, {"long_name": "optimizer update index"})})
    for k in mds.data_vars:
        if "layer" not in mds[k].dims:
            ds[k] = ("step", mds[k].values.astype(np.float64), mds[k].attrs)
    if probe is not None:
        for k in CURVATURE_CHANNELS:
            if k not in ds:
                ds[k] = ("step", np.full(done, np.nan))
    ds["perturbed"] = ("step", pert.mask(steps))
    if ctrl is not None:
        for k, v in ctrl.records(done).items():
            ds[k] = ("step", v)
        ds.attrs.update(ctrl.attrs())
    if probe is not None:
        ds.attrs["curvature_tol"] = float(probe.tol)
    ds.attrs.update(status=status, n_params=sum(p.numel() for p in params), batch_size=int(bs),
                    full_batch=int(full_batch))
    return registry.annotate(ds)


@torch.no_grad()
def _evaluate(model: torch.nn.Module, data: dict[str, torch.Tensor], loss_kind: str,
              classification: bool) -> dict[str, float]:
    out = model(data["x_test"])
    test_loss = float(objective(out, data["y_test"], data["c_test"], loss_kind))
    res = {"test_loss": test_loss}
    if classification:
        res["perf"] = float((out.argmax(1) == data["c_test"]).float().mean())
        tr = model(data["x_train"])
        res["train_acc"] = float((tr.argmax(1) == data["c_train"]).float().mean())
    else:
        res["perf"] = -test_loss
    return res


def lambda_max_check(*, seed: int = 0, steps: int = 100, lr: float = 0.3, width: int = 16, depth: int = 1,
                     n_train: int = 256, iters: int = 20, tol: float = TOL, tolerance: float = 0.02,
                     task: str = "digits") -> dict[str, Any]:
    """Check (a) of notebook 00: Lanczos ``lambda_max`` vs the exact top
    eigenvalue of the dense Hessian, for a small MLP after ``steps`` of full-batch GD.

    Returns :func:`stabstudy.instruments.curvature.check`'s dict plus ``n_params``,
    ``iters_used``, ``power_s`` and ``dense_s`` (wall times).
    """
    import time

    from stabstudy.instruments import curvature as cv

    torch.manual_seed(seed)
    data = load_task(task, n_train, 64, 0)
    x, y, c = data["x_train"], data["y_train"], data["c_train"]
    model = MLP(x.shape[1], y.shape[1], width, depth).double()
    x, y = x.double(), y.double()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=lr)
    loss_fn = lambda: objective(model(x), y, c, "mse")  # noqa: E731
    for _ in range(steps):
        opt.zero_grad()
        loss_fn().backward()
        opt.step()
    res = cv.lambda_max(loss_fn, params, iters=iters, tol=tol, seed=seed)
    t0 = time.perf_counter()
    exact = cv.dense_top_eigenvalue(loss_fn, params)
    dense_s = time.perf_counter() - t0
    out = cv.check("lambda_max vs dense top eigenvalue", res.value, exact, tolerance)
    out.update(n_params=sum(p.numel() for p in params), iters_used=res.iters, power_s=res.wall_s, dense_s=dense_s)
    return out
