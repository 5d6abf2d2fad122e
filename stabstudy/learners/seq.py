"""Sequence learner: recurrent networks on the adding problem, and gradients through time.

Domain ``"seq"``, learners ``rnn_tanh`` (``torch.nn.RNN``), ``rnn_linear`` (the same
recurrence without the nonlinearity) and ``lstm`` (``torch.nn.LSTM``). The recurrent
matrix starts as a random orthogonal matrix times ``sigma`` (per gate for the LSTM), so
that the backward pass multiplies by ``sigma * Q^T`` at every step of a linear RNN and
the gradient reaching ``k`` steps back is exactly ``sigma^k`` times the one at the end.

Task ``adding`` (Hochreiter & Schmidhuber 1997; Le et al. 2015), generated from the seed,
nothing downloaded: sequences of ``T`` steps with two channels, a value drawn from
U(0, 1) and a marker that is 1 at exactly two steps (one in each half); the target is
the sum of the two marked values. Predicting the constant 1 scores an MSE of 1/6, the
level a model that has not learned the long-range dependency stays at.

``run(spec)`` follows the learner contract (:mod:`stabstudy.run.runner`): every random
number generator seeded from ``spec.seed`` (weights through the global generator, the
training stream and the perturbations through private ones; the held-out set is one
fixed set for every seed), a Dataset with dimension ``step`` (optimizer updates) and
channels ``loss``, the Monitor's (``grad_norm`` is the norm the optimizer receives, i.e.
after clipping), ``grad_norm_raw`` (before clipping), ``clipped``, ``test_loss`` and
``perf`` (minus ``test_loss``, every ``spec.eval_every`` steps; default 50 evaluations
per run). A non-finite training loss, or one above ``diverge_loss``, ends the run with
``attrs["status"] = "diverged"``: the data up to that step is returned, nothing raises.

Perturbations: every kind :data:`stabstudy.registry.KINDS` lists for ``seq``, through the hooks of
a :class:`~stabstudy.interventions.perturb.Perturber`: ``lr_spike``, ``weight_noise``,
``reinit_layer`` (``params['layer']``, default ``rnn``).

:func:`time_profile` measures the gradient of a loss read at the last step with
respect to every hidden state of the same networks, for the closed-form check of
notebook 06.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch
import xarray as xr

from stabstudy import registry
from stabstudy.hparams import SeqHParams, merged
from stabstudy.instruments.telemetry import Monitor
from stabstudy.interventions.perturb import Perturber
from stabstudy.registry import DOMAINS
from stabstudy.seeding import seed_everything
from stabstudy.spec import RunSpec

#: Bump when a change to this learner alters the results it stores: the runner then
#: recomputes stored runs of other versions instead of reusing them.
RESULTS_VERSION = 1

TASKS = DOMAINS["seq"].task_names
KINDS = ("rnn_tanh", "rnn_linear", "lstm")
#: Seed of the held-out set: one fixed set, so test losses of different seeds compare.
_EVAL_SEED = 7_919


_F = TypeVar("_F", bound=Callable[..., Any])


def single_threaded(fn: _F) -> _F:
    """Run ``fn`` with one torch thread, restoring the count after. On matrices this small the
    threads' synchronisation costs more than they save, and many times more on a loaded machine."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(before)
    return wrapper  # type: ignore[return-value]


def hparams(spec: RunSpec) -> dict[str, Any]:
    """The spec's hyperparameters over the :class:`~stabstudy.hparams.SeqHParams` defaults."""
    return merged(SeqHParams, spec.hp, f"seq learner {spec.learner!r}")


def adding_batch(n: int, T: int, generator: torch.Generator,
                 dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` sequences of the adding problem: inputs (n, T, 2) [value, marker], targets (n,)."""
    if T < 2:
        raise ValueError(f"the adding problem needs T >= 2, got {T}")
    values = torch.rand((n, T), generator=generator, dtype=torch.float64)
    first = torch.randint(0, T // 2, (n,), generator=generator)
    second = torch.randint(T // 2, T, (n,), generator=generator)
    rows = torch.arange(n)
    marks = torch.zeros((n, T), dtype=torch.float64)
    marks[rows, first] = 1.0
    marks[rows, second] = 1.0
    y = values[rows, first] + values[rows, second]
    return torch.stack([values, marks], dim=-1).to(dtype), y.to(dtype)


class LinearRNN(torch.nn.Module):
    """``h_t = W_ih x_t + b_ih + W_hh h_{t-1} + b_hh`` with ``torch.nn.RNN``'s parameter names and call."""

    def __init__(self, n_in: int, hidden: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.hidden_size = hidden
        self.weight_ih_l0 = torch.nn.Parameter(torch.empty(hidden, n_in, dtype=dtype))
        self.weight_hh_l0 = torch.nn.Parameter(torch.empty(hidden, hidden, dtype=dtype))
        self.bias_ih_l0 = torch.nn.Parameter(torch.zeros(hidden, dtype=dtype))
        self.bias_hh_l0 = torch.nn.Parameter(torch.zeros(hidden, dtype=dtype))
        bound = 1.0 / math.sqrt(hidden)
        torch.nn.init.uniform_(self.weight_ih_l0, -bound, bound)

    def forward(self, x: torch.Tensor, h0: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` (batch, T, n_in), ``h0`` (1, batch, hidden) -> outputs (batch, T, hidden), ``h_T`` (1, batch, hidden)."""
        B, T, _ = x.shape
        drive = x @ self.weight_ih_l0.T + self.bias_ih_l0 + self.bias_hh_l0  # (B, T, hidden): one matmul for all t
        h = h0[0] if h0 is not None else x.new_zeros(B, self.hidden_size)
        outs = []
        for t in range(T):
            h = drive[:, t] + h @ self.weight_hh_l0.T
            outs.append(h)
        return torch.stack(outs, dim=1), h.unsqueeze(0)


class SeqNet(torch.nn.Module):
    """A one-layer recurrent network (submodule ``rnn``) and a linear readout of its last hidden state (``head``).

    ``forward(x)``: inputs (batch, T, n_in) -> predictions (batch,).
    """

    def __init__(self, kind: str, hidden: int, sigma: float, n_in: int = 2, forget_bias: float = 1.0,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"unknown recurrent network {kind!r}; valid: {', '.join(KINDS)}")
        self.kind = kind
        if kind == "lstm":
            self.rnn: torch.nn.Module = torch.nn.LSTM(n_in, hidden, batch_first=True, dtype=dtype)
        elif kind == "rnn_tanh":
            self.rnn = torch.nn.RNN(n_in, hidden, nonlinearity="tanh", batch_first=True, dtype=dtype)
        else:
            self.rnn = LinearRNN(n_in, hidden, dtype)
        self.head = torch.nn.Linear(hidden, 1, dtype=dtype)
        gates = 4 if kind == "lstm" else 1
        with torch.no_grad():
            for g in range(gates):
                block = torch.empty(hidden, hidden, dtype=dtype)
                torch.nn.init.orthogonal_(block)
                self.rnn.weight_hh_l0[g * hidden:(g + 1) * hidden] = sigma * block
            self.rnn.bias_ih_l0.zero_()
            self.rnn.bias_hh_l0.zero_()
            if kind == "lstm":  # torch's gate order is input, forget, cell, output
                self.rnn.bias_ih_l0[hidden:2 * hidden] = forget_bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out[:, -1]).squeeze(-1)

    def step(self, x_t: torch.Tensor, state: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """One time step: ``x_t`` (batch, 1, n_in), ``state`` ``(h,)`` or ``(h, c)`` each (1, batch, hidden)."""
        if self.kind == "lstm":
            _, (h, c) = self.rnn(x_t, state)
            return h, c
        _, h = self.rnn(x_t, state[0])
        return (h,)


def make_optimizer(params: list[torch.nn.Parameter], hp: dict[str, Any]) -> torch.optim.Optimizer:
    """SGD (heavy-ball ``momentum``) or Adam, as ``hp["optimizer"]`` says."""
    if hp["optimizer"] == "adam":
        return torch.optim.Adam(params, lr=float(hp["lr"]), betas=(float(hp["beta1"]), float(hp["beta2"])))
    return torch.optim.SGD(params, lr=float(hp["lr"]), momentum=float(hp["momentum"]))


def run(spec: RunSpec) -> xr.Dataset:
    """Train ``spec.learner`` on the adding problem as ``spec`` says; return the per-step Dataset."""
    if spec.domain != "seq":
        raise ValueError(f"seq.run got a {spec.domain!r} spec")
    hp = hparams(spec)
    seed, steps = spec.seed, spec.steps
    pert = Perturber(spec.perturbations, torch.Generator().manual_seed(seed + 1_000_003), layer="rnn")
    hp = pert.hparams(hp)
    seed_everything(seed)
    T, B = int(hp["T"]), int(hp["batch_size"])
    model = SeqNet(spec.learner, int(hp["hidden"]), float(hp["sigma"]), forget_bias=float(hp["forget_bias"]))
    params = list(model.parameters())
    opt = make_optimizer(params, hp)
    clip, diverge_loss, base_lr = float(hp["grad_clip"]), float(hp["diverge_loss"]), float(hp["lr"])
    data_gen = torch.Generator().manual_seed(seed)
    x_test, y_test = adding_batch(int(hp["eval_size"]), T, torch.Generator().manual_seed(_EVAL_SEED))
    eval_every = spec.eval_every or max(1, steps // 50)
    names = ("loss", "grad_norm_raw", "clipped", "test_loss", "perf")
    rec = {k: np.full(steps, np.nan) for k in names}
    mon = Monitor(model, opt, every=spec.log_every)
    status, done = "ok", 0
    try:
        for step in range(steps):
            pert.on_step_start(step, opt, base_lr)
            pert.on_params(step, model)
            x, y = pert.on_batch(step, adding_batch(B, T, data_gen))
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss_val = float(loss.detach())
            rec["loss"][step] = loss_val
            done = step + 1
            if not math.isfinite(loss_val) or loss_val > diverge_loss:
                status = "diverged"
                break
            opt.zero_grad(set_to_none=True)
            pert.on_loss(step, loss).backward()
            pert.on_grads(step, params)
            # max_norm=inf leaves the gradient as it is and still returns its norm
            raw = float(torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else math.inf))
            rec["grad_norm_raw"][step] = raw
            rec["clipped"][step] = float(clip > 0 and raw > clip)
            opt.step()
            if step % eval_every == 0 or step == steps - 1:
                with torch.no_grad():
                    tl = float(torch.nn.functional.mse_loss(model(x_test), y_test))
                rec["test_loss"][step], rec["perf"][step] = tl, -tl
    finally:
        mds = mon.to_dataset(stored=True)
        mon.close()
    steps_done = np.arange(done)
    ds = xr.Dataset({k: ("step", v[:done]) for k, v in rec.items()},
                    coords={"step": ("step", steps_done, {"long_name": "optimizer update index"})})
    if "step" in mds.dims and mds.sizes["step"]:
        mds = mds.reindex(step=steps_done)
        for k in mds.data_vars:
            if k not in ds and "layer" not in mds[k].dims:
                ds[k] = ("step", mds[k].values.astype(np.float64), mds[k].attrs)
    ds["perturbed"] = ("step", pert.mask(steps_done))
    ds.attrs.update(status=status, n_params=sum(p.numel() for p in params), task=spec.task, T=T,
                    constant_predictor_mse=1.0 / 6.0)
    return registry.annotate(ds)


def time_profile(kind: str, sigma: float, T: int, *, hidden: int = 64, batch: int = 16, seed: int = 0,
                 forget_bias: float = 1.0, dtype: torch.dtype = torch.float64) -> xr.DataArray:
    """Gradient norms through time of a freshly initialised :class:`SeqNet`.

    The network reads ``T`` adding-problem inputs step by step; the loss is the sum over
    the batch of its readout at the last step, so ``dL/dh_T`` is the readout vector for
    every sequence and does not depend on the forward pass. Returns the Frobenius norm
    (over batch and units) of ``dL/d state_t`` for ``t = T, T-1, ..., 0`` (state: ``h``;
    for the LSTM ``(h, c)`` together), as a DataArray with dimension ``lag`` = ``T - t``
    (0 .. T). For ``rnn_linear`` it equals ``sigma**lag`` times its value at lag 0.
    """
    torch.manual_seed(seed)
    model = SeqNet(kind, hidden, sigma, forget_bias=forget_bias, dtype=dtype)
    x, _ = adding_batch(batch, T, torch.Generator().manual_seed(seed), dtype=dtype)
    zeros = torch.zeros(1, batch, hidden, dtype=dtype, requires_grad=True)
    state: tuple[torch.Tensor, ...] = (zeros, torch.zeros_like(zeros, requires_grad=True)) if kind == "lstm" else (zeros,)
    states = [state]
    for t in range(T):
        state = model.step(x[:, t:t + 1], state)
        for s in state:
            s.retain_grad()
        states.append(state)
    model.head(state[0][0]).sum().backward()
    norms = np.array([math.sqrt(sum(float(s.grad.pow(2).sum()) for s in st if s.grad is not None)) for st in states])
    return xr.DataArray(norms[::-1].copy(), dims=("lag",), coords={"lag": np.arange(T + 1)},
                        name="state_grad_norm",
                        attrs={"long_name": "||dL/d state|| at lag steps before the loss", "kind": kind,
                               "sigma": sigma, "T": T})


@single_threaded
def time_profiles(kinds: list[str] | tuple[str, ...], sigmas: list[float] | tuple[float, ...], T: int,
                  seeds: list[int] | tuple[int, ...], *, hidden: int = 64, batch: int = 16,
                  forget_bias: float = 1.0) -> xr.DataArray:
    """:func:`time_profile` over a grid: DataArray with dims (``kind``, ``sigma``, ``seed``, ``lag``)."""
    data = np.stack([np.stack([np.stack([
        time_profile(k, float(s), T, hidden=hidden, batch=batch, seed=int(sd), forget_bias=forget_bias).values
        for sd in seeds]) for s in sigmas]) for k in kinds])
    return xr.DataArray(data, dims=("kind", "sigma", "seed", "lag"),
                        coords={"kind": list(kinds), "sigma": [float(s) for s in sigmas], "seed": list(seeds),
                                "lag": np.arange(T + 1)},
                        name="state_grad_norm", attrs={"long_name": "||dL/d state|| at lag steps before the loss"})
