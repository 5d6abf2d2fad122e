"""Toy learner for instrument calibration: small tanh MLPs trained with full-batch
GD, minibatch SGD or Adam, where the expected curvature dynamics are known.

* Full-batch GD on an MSE loss: progressive sharpening, then the *edge of
  stability* where lambda_max hovers near 2/lr (Cohen et al. 2021). It is
  strongest with MSE, tanh nets and hard (one-hot) targets, hence the defaults.
* Full-batch Adam: the preconditioned sharpness lambda_max(P^-1 H) settles near
  (2 + 2 beta1) / ((1 - beta1) lr) = 38/lr for beta1 = 0.9 (Cohen et al. 2022).

``run(spec)`` follows the learner contract (:mod:`stabstudy.runner`): every
RNG seeded from ``spec.seed``, a Dataset with dimension ``step`` (optimizer
updates), status ``diverged`` on a non-finite or exploding loss. Tasks:

* ``digits``: scikit-learn's bundled 8x8 digits (no download), standardized with
  training statistics; a deterministic subset of ``n_train`` training and
  ``n_test`` test images (``data_seed``); targets one-hot; ``perf`` = test accuracy.
* ``synthetic``: Gaussian inputs, targets from a fixed random tanh teacher;
  ``perf`` = minus the test loss.

Hyperparameters (``spec.hparams``; defaults in :data:`DEFAULTS`): ``lr``,
``width``, ``depth`` (hidden layers), ``n_train``, ``n_test``, ``batch_size``
(0 = full batch; ``gd`` is always full batch), ``beta1``, ``beta2``, ``eps``,
``momentum`` (sgd/gd), ``weight_decay``, ``activation`` (tanh|relu|elu|gelu),
``loss`` (mse|ce), ``curv_iters``, ``probe_size``, ``diverge_loss``,
``data_seed``, ``outlier_scale``.

Channels: the Monitor's (``grad_norm``, ``xgrad``, ``update_*``, ``adam_*``,
``lr``; every ``spec.log_every`` steps), ``loss`` (unscaled, every step),
``perf``, ``test_loss`` and (digits) ``train_acc`` every ``spec.eval_every``
steps (default: 100 evaluations per run), ``perturbed``, and with
``spec.curvature_every`` the :data:`stabstudy.curvature.CURVATURE_CHANNELS`
(``lambda_max`` etc., on the first ``probe_size`` training examples, measured
after the update of that step).

Perturbations (:mod:`stabstudy.perturb`): ``lr_spike``, ``beta2_shift`` (Adam
only), ``grad_noise``, ``weight_noise``, ``reinit_layer`` (``params['layer']``,
default ``layers.0``), ``outlier_batch`` (a ``dose`` fraction of the batch
replaced by inputs of std ``outlier_scale`` with random one-hot targets),
``loss_scale``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import xarray as xr

from stabstudy import perturb
from stabstudy.curvature import CURVATURE_CHANNELS, CurvatureProbe
from stabstudy.perturb import Schedule
from stabstudy.seeding import seed_everything
from stabstudy.spec import Perturbation, RunSpec
from stabstudy.telemetry import Monitor

#: Bump when a change to this learner alters the results it stores: the runner then
#: recomputes stored runs of other versions instead of reusing them.
RESULTS_VERSION = 1

TASKS = ("digits", "synthetic")

DEFAULTS: dict[str, Any] = {
    "lr": 0.05,            # learning rate
    "width": 64,           # hidden units per layer
    "depth": 2,            # hidden layers
    "n_train": 512,        # training examples (full batch for gd)
    "n_test": 512,         # test examples
    "batch_size": 0,       # 0 = full batch (sgd default: 64)
    "beta1": 0.9,          # Adam beta1
    "beta2": 0.999,        # Adam beta2
    "eps": 1e-8,           # Adam eps
    "momentum": 0.0,       # heavy-ball momentum for gd/sgd
    "weight_decay": 0.0,   # L2 (gd/sgd) or decoupled (adam: AdamW) weight decay
    "activation": "tanh",  # tanh | relu | elu | gelu
    "loss": "mse",         # mse (0.5 * mean squared error summed over outputs) | ce
    "curv_iters": 20,      # Hessian-vector products per lambda_max measurement (Lanczos budget)
    "curv_tol": 1e-3,      # eigensolver relative tolerance
    "probe_size": 0,       # curvature probe batch (0 = the whole training set)
    "diverge_loss": 1e6,   # a training loss above this counts as diverged
    "data_seed": 0,        # which subset of the data (fixed across seeds by default)
    "outlier_scale": 10.0, # std of outlier inputs (outlier_batch)
    "synthetic_dim": 16,   # synthetic task: input dimension
    "synthetic_out": 4,    # synthetic task: output dimension
}

_ACT = {"tanh": torch.nn.Tanh, "relu": torch.nn.ReLU, "elu": torch.nn.ELU, "gelu": torch.nn.GELU}


def hparams(spec: RunSpec) -> dict[str, Any]:
    """The spec's hyperparameters over :data:`DEFAULTS` (unknown names raise)."""
    unknown = set(spec.hp) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown toy hyperparameters {sorted(unknown)}; valid: {', '.join(DEFAULTS)}")
    hp = {**DEFAULTS, **spec.hp}
    if hp["activation"] not in _ACT:
        raise ValueError(f"activation must be one of {', '.join(_ACT)}, got {hp['activation']!r}")
    if hp["loss"] not in ("mse", "ce"):
        raise ValueError(f"loss must be 'mse' or 'ce', got {hp['loss']!r}")
    if spec.task not in TASKS:
        raise ValueError(f"unknown toy task {spec.task!r}; valid tasks: {', '.join(TASKS)}")
    return hp


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
    elif task == "synthetic":
        n = n_train + n_test
        X = rng.standard_normal((n, synthetic_dim)).astype(np.float32)
        W1 = rng.standard_normal((synthetic_dim, 32)) / math.sqrt(synthetic_dim)
        W2 = rng.standard_normal((32, synthetic_out)) / math.sqrt(32)
        Y = (np.tanh(X @ W1) @ W2).astype(np.float32)
        out = {"x_train": X[:n_train], "y_train": Y[:n_train], "x_test": X[n_train:], "y_test": Y[n_train:],
               "c_train": -np.ones(n_train, np.int64), "c_test": -np.ones(n_test, np.int64)}
    else:
        raise ValueError(f"unknown toy task {task!r}; valid tasks: {', '.join(TASKS)}")
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
    seed_everything(seed)
    data = load_task(spec.task, int(hp["n_train"]), int(hp["n_test"]), int(hp["data_seed"]),
                     int(hp["synthetic_dim"]), int(hp["synthetic_out"]))
    xtr, ytr, ctr = data["x_train"], data["y_train"], data["c_train"]
    classification = spec.task == "digits"
    model = MLP(xtr.shape[1], ytr.shape[1], int(hp["width"]), int(hp["depth"]), str(hp["activation"]))
    params = list(model.parameters())
    opt = make_optimizer(spec.learner, params, hp)
    loss_kind = str(hp["loss"])
    n = xtr.shape[0]
    bs = int(hp["batch_size"]) or (64 if spec.learner == "sgd" else n)
    full_batch = spec.learner == "gd" or bs >= n
    data_gen = torch.Generator().manual_seed(seed + 17)
    pert_gen = torch.Generator().manual_seed(seed + 1_000_003)
    sched = Schedule(spec.perturbations)
    base_lr, beta1, beta2 = float(hp["lr"]), float(hp["beta1"]), float(hp["beta2"])

    mon = Monitor(model, opt, every=spec.log_every)
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
            for g in opt.param_groups:
                g["lr"] = base_lr * sched.lr_factor(step)
                if "betas" in g:
                    b2p = sched.of_kind("beta2_shift", step)
                    g["betas"] = (beta1, b2p.dose if b2p is not None else beta2)
            for p in sched.starts_at(step, "weight_noise"):
                perturb.add_weight_noise(model, p.dose, pert_gen)
            for p in sched.starts_at(step, "reinit_layer"):
                perturb.reinit_layer(model, str(p.p.get("layer", "layers.0")), p.dose, pert_gen)
            # -- batch ---------------------------------------------------------------
            if full_batch:
                x, y, c = xtr, ytr, ctr
            else:
                if cursor + bs > n:
                    order, cursor = torch.randperm(n, generator=data_gen), 0
                idx = order[cursor:cursor + bs]
                cursor += bs
                x, y, c = xtr[idx], ytr[idx], ctr[idx]
            ob = sched.of_kind("outlier_batch", step)
            if ob is not None:
                x, y, c = _outliers(x, y, c, ob.dose, float(hp["outlier_scale"]), pert_gen, classification)
            # -- update --------------------------------------------------------------
            opt.zero_grad(set_to_none=True)
            loss = objective(model(x), y, c, loss_kind)
            loss_val = float(loss.detach())
            ls = sched.of_kind("loss_scale", step)
            (loss * ls.dose if ls is not None else loss).backward()
            gn = sched.of_kind("grad_noise", step)
            if gn is not None:
                perturb.add_grad_noise(params, gn.dose, pert_gen)
            opt.step()
            done = step + 1
            row = {"loss": loss_val}
            if step % eval_every == 0 or step == spec.steps - 1:
                row.update(_evaluate(model, data, loss_kind, classification))
            mon.log(**row)
            if not math.isfinite(loss_val) or loss_val > float(hp["diverge_loss"]):
                status = "diverged"
                break
            if probe is not None:
                probe()
    finally:
        mds = mon.to_dataset()
        mon.close()
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
    ds["perturbed"] = ("step", sched.mask(steps))
    ds.attrs.update(status=status, n_params=sum(p.numel() for p in params), batch_size=int(bs),
                    full_batch=int(full_batch))
    return ds


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


# -- grid builders and calibration analyses (notebook 00) ---------------------------------


def base_spec(learner: str, steps: int, seed: int = 0, task: str = "digits", *, log_every: int = 1,
              eval_every: int = 0, curvature_every: int = 0,
              perturbations: Sequence[Perturbation] = (), **hp: Any) -> RunSpec:
    """A toy RunSpec storing only the given hyperparameters (the rest are :data:`DEFAULTS`)."""
    return RunSpec(domain="toy", learner=learner, task=task, steps=steps, seed=seed, hparams=hp,
                   perturbations=tuple(perturbations), log_every=log_every, eval_every=eval_every,
                   curvature_every=curvature_every)


def adam_eos_target(lr: float, beta1: float) -> float:
    """Adaptive edge of stability (Cohen et al. 2022): (2 + 2 beta1) / ((1 - beta1) lr)."""
    return (2.0 + 2.0 * beta1) / ((1.0 - beta1) * lr)


def calibration_grid(gd_lrs: Sequence[float], adam_lrs: Sequence[float], *, gd_steps: int, adam_steps: int,
                     seeds: Sequence[int] = (0,), curvature_every: int = 10, spike_lr: float | None = None,
                     spike_dose: float = 2.0, spike_start: int | None = None, spike_duration: int = 10,
                     spike_steps: int | None = None, spike_curvature_every: int = 2,
                     task: str = "digits", **hp: Any) -> dict[str, list[RunSpec]]:
    """Specs for notebook 00: full-batch GD at each of ``gd_lrs`` (edge of stability),
    full-batch Adam at each of ``adam_lrs`` (adaptive edge of stability), and a
    baseline / ``lr_spike`` pair of GD runs at ``spike_lr`` (default: the first GD
    lr) of ``spike_steps`` (default ``gd_steps``) steps, the spike multiplying the
    lr by ``spike_dose`` on ``[spike_start, spike_start + spike_duration)``
    (default start: 80% of the run), curvature every ``spike_curvature_every``.
    ``hp`` go to every spec.

    Returns ``{"gd": [...], "adam": [...], "spike": [...]}`` (spike: baseline then
    spiked, per seed).
    """
    out: dict[str, list[RunSpec]] = {"gd": [], "adam": [], "spike": []}
    for seed in seeds:
        for lr in gd_lrs:
            out["gd"].append(base_spec("gd", gd_steps, seed, task, curvature_every=curvature_every, lr=float(lr), **hp))
        for lr in adam_lrs:
            out["adam"].append(base_spec("adam", adam_steps, seed, task, curvature_every=curvature_every,
                                         lr=float(lr), **hp))
        s_lr = float(spike_lr if spike_lr is not None else gd_lrs[0])
        s_steps = int(spike_steps or gd_steps)
        start = spike_start if spike_start is not None else (s_steps * 4) // 5
        pert = Perturbation("lr_spike", start=int(start), duration=int(spike_duration), dose=float(spike_dose))
        for perts in ((), (pert,)):
            out["spike"].append(base_spec("gd", s_steps, seed, task, curvature_every=spike_curvature_every,
                                          lr=s_lr, perturbations=perts, **hp))
    return out


def _tail(da: xr.DataArray, frac: float) -> xr.DataArray:
    """The last ``frac`` of the run's steps (NaN-free values of ``da``)."""
    steps = da.step.values
    finite = steps[np.isfinite(da.values)]
    if finite.size == 0:
        return da.isel(step=slice(0, 0))
    cut = finite.max() - frac * (finite.max() + 1)
    return da.where(da.step > cut).dropna("step")


def eos_table(runs: xr.Dataset, *, tail: float = 0.4, tolerance: float = 0.2,
              channel: str = "lambda_max", beta1: float | None = None) -> Any:
    """Edge-of-stability check per run of ``runs`` (dims ``run, step`` from ``load_runs``).

    For each run: the median of ``channel`` over the last ``tail`` fraction of
    training, the target (2/lr for GD; :func:`adam_eos_target` when ``beta1`` is
    given, for ``precond_sharpness``), their ratio and whether it lies within
    ``1 +- tolerance``. Returns a pandas DataFrame.
    """
    import pandas as pd

    rows = []
    for r in range(runs.sizes["run"]):
        one = runs.isel(run=r)
        lr = float(one["hp_lr"])
        target = 2.0 / lr if beta1 is None else adam_eos_target(lr, beta1)
        vals = _tail(one[channel], tail).values
        med = float(np.median(vals)) if vals.size else float("nan")
        ratio = med / target
        rows.append({"learner": str(one.learner.values), "seed": int(one.seed.values), "lr": lr, "target": target,
                     f"median_{channel}": med, "ratio": ratio, "n_measurements": int(vals.size),
                     "status": str(one.status.values),
                     "passed": bool(np.isfinite(ratio) and abs(ratio - 1.0) <= tolerance)})
    return pd.DataFrame(rows)


def spike_response(baseline: xr.Dataset, spiked: xr.Dataset, start: int, duration: int,
                   window: int = 20) -> dict[str, float]:
    """Response of one run to an ``lr_spike`` on ``[start, start + duration)``, vs its baseline.

    Returns: ``loss_jump`` (max loss in the window / baseline loss there),
    ``grad_norm_jump`` (same for grad_norm), ``sharpness_before`` (median
    lambda_max over ``window`` steps before the spike), ``sharpness_after``
    (median over ``window`` steps after the window ends, in the spiked run),
    ``sharpness_drop`` = 1 - after / before, and the same for the baseline run.
    """
    def win(ds, var, a, b):
        da = ds[var].sel(step=slice(a, b - 1))
        return da.values[np.isfinite(da.values)]

    end = start + duration
    a, b = start, end + window
    loss_jump = np.max(win(spiked, "loss", a, b)) / np.max(win(baseline, "loss", a, b))
    gn_jump = np.max(win(spiked, "grad_norm", a, b)) / np.max(win(baseline, "grad_norm", a, b))
    before = np.median(win(spiked, "lambda_max", start - window, start))
    after = np.median(win(spiked, "lambda_max", end + 1, end + 1 + window))
    base_after = np.median(win(baseline, "lambda_max", end + 1, end + 1 + window))
    return {"loss_jump": float(loss_jump), "grad_norm_jump": float(gn_jump),
            "sharpness_before": float(before), "sharpness_after": float(after),
            "sharpness_drop": float(1.0 - after / before),
            "baseline_sharpness_after": float(base_after),
            "baseline_sharpness_drop": float(1.0 - base_after / before)}


def lambda_max_check(*, seed: int = 0, steps: int = 100, lr: float = 0.3, width: int = 16, depth: int = 1,
                     n_train: int = 256, iters: int = 20, tol: float = 1e-3, tolerance: float = 0.02,
                     task: str = "digits") -> dict[str, Any]:
    """Check (a) of notebook 00: Lanczos ``lambda_max`` vs the exact top
    eigenvalue of the dense Hessian, for a small MLP after ``steps`` of full-batch GD.

    Returns :func:`stabstudy.curvature.check`'s dict plus ``n_params``,
    ``iters_used``, ``power_s`` and ``dense_s`` (wall times).
    """
    import time

    from stabstudy import curvature as cv

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


def spike_checks(resp: dict[str, float], *, min_jump: float = 2.0, min_extra_drop: float = 0.2) -> list[dict[str, Any]]:
    """Pass/fail of check (d) from :func:`spike_response`: the loss and the gradient
    norm jump at least ``min_jump``-fold over the baseline, and the sharpness after
    the spike falls by at least ``min_extra_drop`` (fraction of its value before)
    more than the baseline's does over the same steps (the catapult)."""
    extra = resp["sharpness_drop"] - resp["baseline_sharpness_drop"]
    return [
        {"check": "loss jump (x baseline)", "measured": resp["loss_jump"], "threshold": min_jump,
         "passed": bool(resp["loss_jump"] >= min_jump)},
        {"check": "grad-norm jump (x baseline)", "measured": resp["grad_norm_jump"], "threshold": min_jump,
         "passed": bool(resp["grad_norm_jump"] >= min_jump)},
        {"check": "extra sharpness drop after spike", "measured": extra, "threshold": min_extra_drop,
         "passed": bool(np.isfinite(extra) and extra >= min_extra_drop)},
    ]


def claims_table(dense: dict[str, Any], gd: Any, adam: Any, spike: list[dict[str, Any]]) -> Any:
    """The closing "claim | our measurement | supported?" table of notebook 00,
    from check (a) (:func:`lambda_max_check`), (b) and (c) (:func:`eos_table`) and (d)
    (:func:`spike_checks`)."""
    import pandas as pd

    def yes(ok: bool) -> str:
        return "yes" if ok else "no"

    rows = [
        {"claim": "Lanczos lambda_max matches the dense Hessian's top eigenvalue (within "
                  f"{dense['tolerance']:.0%})",
         "our measurement": f"{dense['measured']:.4g} vs {dense['target']:.4g} "
                            f"(rel. error {dense['rel_error']:.2%}, {dense['iters_used']} HVPs)",
         "supported?": yes(dense["passed"])},
        {"claim": "full-batch GD: sharpness rises then hovers at 2/lr (Cohen et al. 2021)",
         "our measurement": "; ".join(f"lr={r.lr:g}: {r.ratio:.2f} x 2/lr" for r in gd.itertuples()),
         # the claim is about >= 3 learning rates (rows are lr x seed)
         "supported?": yes(bool(gd.passed.all())) if gd.lr.nunique() >= 3
         else f"not tested (only {gd.lr.nunique()} learning rate(s))"},
        {"claim": "full-batch Adam: preconditioned sharpness settles near 38/lr (Cohen et al. 2022)",
         "our measurement": "; ".join(f"lr={r.lr:g}: {r.ratio:.2f} x 38/lr" for r in adam.itertuples()),
         "supported?": yes(bool(len(adam) and adam.passed.all()))},
        {"claim": "an lr spike at the edge of stability shows as loss and grad-norm jumps, then lower sharpness",
         "our measurement": "; ".join(f"{c['check']}: {c['measured']:.3g}" for c in spike),
         "supported?": yes(all(c["passed"] for c in spike))},
    ]
    return pd.DataFrame(rows)
