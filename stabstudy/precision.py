"""Numerical-precision measurements: non-finite values, lost updates, fp16 headroom, autocast.

Precision is one of the learning-signal sources of instability (see REFERENCES.md):

* float16 (IEEE half): 5 exponent bits, 10 mantissa bits; largest finite value 65504,
  smallest normal ``2**-14`` (~6.1e-5); below it values become subnormal and lose bits,
  below ``2**-24`` they flush to zero. Activations or logits above 65504 overflow to inf.
* bfloat16: float32's 8 exponent bits (same range) but only 7 mantissa bits, so the spacing
  (ulp) around 1.0 is ``2**-7 = 0.0078``: an update smaller than half of that is rounded away
  when parameters are *stored* in bfloat16.
* A single NaN/inf gradient that reaches Adam makes ``exp_avg``/``exp_avg_sq`` non-finite for
  good (they are running averages), so the corruption outlives the step that caused it.
* Pure float16 Adam with the usual ``eps=1e-8`` divides by zero: ``1e-8`` is below float16's
  smallest subnormal (~6e-8) and rounds to 0, so ``m / (sqrt(v) + eps)`` is inf/NaN where ``v``
  underflows.
* Dynamic loss scaling (``torch.amp.GradScaler``; Micikevicius et al. 2018): initial scale
  ``2**16``, multiplied by 2 after 2000 consecutive clean steps, by 0.5 on an inf/NaN gradient,
  in which case the optimizer step is *skipped*.

Every function here is pure measurement (no training logic) and cheap: reductions stay on
the device and one host synchronisation happens per call. The LM learner
(:mod:`stabstudy.lm`) calls them to fill the precision channels ``nonfinite_grads``,
``loss_scale``, ``skipped_step``, ``lost_update_frac``, ``fp16_headroom``,
``adam_state_nonfinite``. The grid builders and per-run summaries used by
``notebooks/03_precision_experiments.ipynb`` live at the bottom of this module.

CPU autocast support (measured on torch 2.13.0+cpu; :func:`autocast_support` re-checks):
``torch.autocast("cpu", dtype=torch.bfloat16)`` and ``dtype=torch.float16`` are both supported,
forward and backward, and ``torch.amp.GradScaler("cpu")`` works. ``linear``, ``matmul``/``bmm``
and ``scaled_dot_product_attention`` run in the low precision; ``cross_entropy`` and ``mse_loss``
are cast to float32; ``layer_norm``, ``softmax``, ``log_softmax``, ``logsumexp`` and ``gelu`` are on
*no* CPU autocast list, so they run in their input's dtype: float32 on float32 inputs, but float16
/ bfloat16 right after a linear layer (unlike CUDA, where softmax and layer_norm are forced to
float32). :func:`autocast` therefore uses real ``torch.autocast`` on CPU; the op-boundary
emulation (:class:`_LowPrecisionEmulation`) is a documented fallback for a torch/device that
rejects the dtype, or on request (``emulate=True``).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

#: Precision names accepted everywhere in the study, and their torch dtypes.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
#: Largest finite float16 value.
FP16_MAX: float = float(torch.finfo(torch.float16).max)  # 65504.0
#: Smallest normal float16 value, 2**-14.
FP16_MIN_NORMAL: float = float(torch.finfo(torch.float16).tiny)  # 6.1035e-05
#: torch.amp.GradScaler defaults (REFERENCES.md).
SCALER_INIT_SCALE: float = 2.0**16
SCALER_GROWTH_INTERVAL: int = 2000

#: Ops that autocast runs in low precision on CUDA/CPU; the emulation casts around them.
_EMULATED_OPS_NAMES = ("linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "conv1d", "conv2d",
                       "scaled_dot_product_attention")


def resolve_dtype(name: str) -> torch.dtype:
    """The torch dtype for a precision name: ``"float32"``, ``"bfloat16"`` or ``"float16"``.

    Raises:
        ValueError: for any other name (the message lists the valid choices).
    """
    if isinstance(name, torch.dtype):  # tolerate an already-resolved dtype
        if name in DTYPES.values():
            return name
        name = str(name)
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown precision {name!r}; valid choices: {', '.join(DTYPES)}") from None


def all_finite(tensors: Iterable[Tensor]) -> bool:
    """True when every element of ``tensors`` is finite, with one synchronisation.

    One ``torch._foreach_norm`` pass in float64: a norm is finite exactly when every element
    is (squares of float32/16 values cannot overflow float64). In isolation it takes 165 us on
    the small GPT's 28 tensors where ``isfinite(t).all()`` per tensor takes 600 us; inside a
    training step, with cold caches, the two were within noise of each other.
    """
    ts = [t.detach() for t in tensors]
    if not ts:
        return True
    return bool(torch.isfinite(torch.stack(torch._foreach_norm(ts, 2, dtype=torch.float64)).sum()))


def count_nonfinite(tensors: Iterable[Tensor | None]) -> int:
    """Number of non-finite (inf, -inf, NaN) elements over ``tensors``; ``None`` entries are skipped.

    Counts are accumulated on the tensors' device and synchronised once. Typical use:
    ``count_nonfinite(p.grad for p in model.parameters())``.
    """
    total: Tensor | None = None
    for t in tensors:
        if t is None:
            continue
        n = (~torch.isfinite(t.detach())).sum()
        total = n if total is None else total + n.to(total.device)
    return 0 if total is None else int(total.item())


def max_abs(tensors: Iterable[Tensor | None]) -> float:
    """Largest finite-or-not absolute value over ``tensors`` (``None`` skipped; 0.0 when empty).

    Useful to feed :func:`fp16_headroom`; one synchronisation.
    """
    best: Tensor | None = None
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        m = t.detach().abs().max().float()
        best = m if best is None else torch.maximum(best, m.to(best.device))
    return 0.0 if best is None else float(best.item())


def fp16_headroom(max_abs: float) -> float:
    """``max_abs / 65504``: how close a value comes to float16 overflow (>= 1 overflows).

    ``max_abs`` is typically the largest attention or output logit of a step
    (``attn_logit_max`` / ``out_logit_max``); NaN passes through.
    """
    return float(max_abs) / FP16_MAX


def logit_fp16_headroom(attn_logit_max: float, out_logit_max: float, head_dim: int) -> float:
    """float16 headroom of a transformer's largest logits: ``max(attn * sqrt(head_dim), out) / 65504``.

    ``attn_logit_max`` is the largest *scaled* attention logit ``|q.k| / sqrt(head_dim)``, but an
    explicit attention (``(q @ k.T) * head_dim**-0.5``, as in :class:`stabstudy.gpt.GPT` with
    diagnostics on) materialises the *unscaled* product ``q @ k.T`` in float16 first, which is
    ``sqrt(head_dim)`` times larger; that product overflows first. ``out_logit_max`` is the largest
    absolute output logit. A value >= 1 means float16 autocast produces inf there.
    """
    return fp16_headroom(max(float(attn_logit_max) * math.sqrt(head_dim), float(out_logit_max)))


def half_ulp(x: Tensor, storage_dtype: torch.dtype, direction: Tensor | None = None) -> Tensor:
    """Half the spacing from ``x`` (rounded to ``storage_dtype``) to its neighbour, in float64.

    The neighbour is the next representable value of ``storage_dtype`` in the direction of
    ``direction`` (its sign; upward where ``direction`` is ``None`` or 0). Computed with
    :func:`torch.nextafter` in the storage dtype itself, so it is exact at powers of two
    (the spacing below ``2**k`` is half the spacing above) and for subnormals.
    """
    w = x.detach().to(storage_dtype)
    inf = torch.full_like(w, math.inf)
    toward = inf if direction is None else torch.copysign(inf, direction.detach().to(storage_dtype))
    nxt = torch.nextafter(w, toward)
    return (nxt.double() - w.double()).abs() * 0.5


def lost_update_frac(before: Sequence[Tensor], after: Sequence[Tensor],
                     grads: Sequence[Tensor | None], storage_dtype: torch.dtype) -> float:
    """Fraction of coordinates whose update is erased by rounding to ``storage_dtype``.

    Definition (per coordinate ``i`` of every parameter whose gradient is not ``None``):

    * ``w_i = round_storage(before_i)`` is the parameter as it would be *stored* in
      ``storage_dtype``; ``u_i = after_i - before_i`` is the update the optimizer applied
      (computed in float64, so it is exact for float32/bfloat16/float16 inputs);
    * ``h_i`` is half the gap from ``w_i`` to the next ``storage_dtype`` value in the direction
      of ``u_i`` (see :func:`half_ulp`);
    * the update is **lost** when ``|u_i| < h_i``: round-to-nearest maps ``w_i + u_i`` back
      to ``w_i``. (An update of exactly half an ulp is a tie, resolved to even; it is counted
      as kept.)

    The fraction is taken over *eligible* coordinates: gradient finite and nonzero, and
    ``before_i``/``after_i`` finite. A coordinate with a zero gradient is not asked to move, so
    it does not count. Returns NaN when no coordinate is eligible.

    The one definition covers both regimes:

    * **mixed precision** (float32 master weights, ``storage_dtype`` = the autocast dtype):
      ``u_i`` is the float32 update, and the answer is the counterfactual "would this update
      survive if the weights were stored in ``storage_dtype``?" (the float32 master keeps it);
    * **pure low precision** (parameters stored in ``storage_dtype``, e.g. bfloat16 weights
      with a bfloat16 Adam): ``after`` is already rounded, so ``u_i`` is either 0 (the optimizer's
      update was rounded away) or at least one ulp; the test reduces to ``after_i == before_i``,
      i.e. "the update that came out 0".

    Pass ``storage_dtype=torch.float32`` with float32 parameters to measure float32's own
    (tiny) loss. ``before`` must be a snapshot taken before ``optimizer.step()`` (see
    :func:`snapshot`).

    Example: a bfloat16 weight 1.0 (ulp above 1.0 is ``2**-7``) with update ``1e-3`` is lost;
    with update ``1e-1`` it is kept.
    """
    if not (len(before) == len(after) == len(grads)):
        raise ValueError(f"before/after/grads lengths differ: {len(before)}, {len(after)}, {len(grads)}")
    keep = [i for i, g in enumerate(grads) if g is not None]
    if not keep:
        return math.nan
    # One flat vector per input: a handful of kernels instead of ~20 per parameter tensor.
    b = torch.cat([before[i].detach().reshape(-1).double() for i in keep])
    a = torch.cat([after[i].detach().reshape(-1).double() for i in keep])
    g = torch.cat([grads[i].detach().reshape(-1).float() for i in keep])  # type: ignore[union-attr]
    u = a - b  # exact in float64 for float32/bfloat16/float16 inputs
    ok = torch.isfinite(g) & (g != 0) & torch.isfinite(u)
    is_lost = ok & (u.abs() < half_ulp(b, storage_dtype, direction=u))
    counts = torch.stack([is_lost.sum(), ok.sum()]).tolist()  # one sync
    return counts[0] / counts[1] if counts[1] > 0 else math.nan


def snapshot(params: Iterable[Tensor]) -> list[Tensor]:
    """Detached copies of ``params`` (same dtype) to pass as ``before`` to :func:`lost_update_frac`."""
    return [p.detach().clone() for p in params]


def adam_state_nonfinite(optimizer: torch.optim.Optimizer) -> int:
    """Number of non-finite entries in the Adam moments (``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``).

    Works for ``Adam``/``AdamW`` (and returns 0 for optimizers without these states, or before
    the first step). A NaN/inf gradient that reaches Adam without a loss scaler leaves its mark
    here, and because the moments are running averages it stays there.
    """
    tensors: list[Tensor] = []
    for state in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            t = state.get(key)
            if isinstance(t, Tensor):
                tensors.append(t)
    return count_nonfinite(tensors)


# -- autocast ------------------------------------------------------------------------------


def autocast_support(device_type: str = "cpu") -> dict[str, bool]:
    """Which low-precision autocast dtypes the installed torch accepts on ``device_type``.

    Probes by entering ``torch.autocast`` and running a tiny linear layer; a dtype counts as
    supported when no warning/error is raised and the output comes out in that dtype.
    On torch 2.13.0+cpu both ``bfloat16`` and ``float16`` are supported on ``"cpu"``.
    """
    out: dict[str, bool] = {"float32": True}
    for name in ("bfloat16", "float16"):
        dt = DTYPES[name]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                with torch.autocast(device_type, dtype=dt):
                    y = torch.nn.functional.linear(torch.ones(2, 2, device=device_type),
                                                   torch.ones(2, 2, device=device_type))
            out[name] = y.dtype == dt
        except (RuntimeError, UserWarning, AssertionError, ValueError):
            out[name] = False
    return out


class _LowPrecisionEmulation(torch.overrides.TorchFunctionMode):
    """Emulate autocast where the device lacks it: round inputs and output of matmul-like ops.

    Inputs of the ops autocast would run in low precision (linear, matmul, bmm, attention, ...)
    are rounded to ``dtype`` and back to float32 (so overflow to inf and mantissa rounding
    happen exactly as they would when the operands are *stored* in ``dtype``), the op is computed
    in float32, and its output is rounded to ``dtype`` and returned in float32. Accumulation
    inside the op is float32 (as on tensor-core hardware). The backward pass sees the same
    rounding on the forward values but computes gradients in float32, so it does not reproduce
    low-precision *gradient* underflow; GradScaler experiments should use real autocast.
    """

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype
        F = torch.nn.functional
        self.ops = {getattr(F, n, None) for n in _EMULATED_OPS_NAMES} | {
            getattr(torch, n, None) for n in _EMULATED_OPS_NAMES} | {Tensor.matmul, Tensor.__matmul__}
        self.ops.discard(None)

    def _round(self, x: Any) -> Any:
        if isinstance(x, Tensor) and x.is_floating_point():
            return x.to(self.dtype).float()
        return x

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.ops:
            args = tuple(self._round(a) for a in args)
            kwargs = {k: self._round(v) for k, v in kwargs.items()}
            return self._round(func(*args, **kwargs))
        return func(*args, **kwargs)


@contextlib.contextmanager
def autocast(device_type: str, dtype_name: str, emulate: bool | None = None) -> Iterator[None]:
    """Context manager running the enclosed forward pass in ``dtype_name`` mixed precision.

    * ``"float32"``: autocast explicitly disabled (so an outer autocast cannot leak in);
    * ``"bfloat16"`` / ``"float16"``: :class:`torch.autocast` when the installed torch
      supports that dtype on ``device_type`` (it does on CPU in torch 2.13 for both);
      otherwise, or when ``emulate=True``, :class:`_LowPrecisionEmulation`, which rounds the
      operands and results of matmul-like ops to the dtype at op boundaries (float32 compute
      in between; see its docstring for what it does not reproduce).

    Parameters stay float32 (master weights) under both paths; for pure low-precision training
    cast the model itself (``model.to(torch.bfloat16)``) instead.
    """
    dtype = resolve_dtype(dtype_name)
    if dtype == torch.float32:
        with torch.autocast(device_type, enabled=False):
            yield
        return
    if emulate is None:
        emulate = not _supported(device_type, dtype_name)
    if emulate:
        with _LowPrecisionEmulation(dtype):
            yield
        return
    with torch.autocast(device_type, dtype=dtype):
        yield


_SUPPORT_CACHE: dict[str, dict[str, bool]] = {}


def _supported(device_type: str, dtype_name: str) -> bool:
    if device_type not in _SUPPORT_CACHE:
        _SUPPORT_CACHE[device_type] = autocast_support(device_type)
    return _SUPPORT_CACHE[device_type].get(dtype_name, False)


# -- loss scaling --------------------------------------------------------------------------


def make_grad_scaler(device_type: str, enabled: bool = True, init_scale: float = SCALER_INIT_SCALE,
                     growth_interval: int = SCALER_GROWTH_INTERVAL) -> torch.amp.GradScaler:
    """A :class:`torch.amp.GradScaler` with the reference defaults (2**16, x2 / 2000 clean steps, x0.5)."""
    return torch.amp.GradScaler(device_type, init_scale=init_scale, growth_factor=2.0,
                                backoff_factor=0.5, growth_interval=growth_interval, enabled=enabled)


def scaler_step(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> tuple[bool, float]:
    """``scaler.step(optimizer); scaler.update()``; return ``(skipped, scale_used)``.

    ``skipped`` is True when the scaler found an inf/NaN gradient and therefore did not call
    ``optimizer.step()``: detected as the scale backing off (``update`` multiplies it by
    ``backoff_factor < 1`` exactly then). ``scale_used`` is the scale the gradients carried this
    step. With a disabled scaler: plain ``optimizer.step()``, ``(False, 1.0)``.
    """
    if not scaler.is_enabled():
        optimizer.step()
        return False, 1.0
    before = float(scaler.get_scale())
    scaler.step(optimizer)
    scaler.update()
    return float(scaler.get_scale()) < before, before


# -- grid builders and analyses for notebooks/03_precision_experiments.ipynb ----------------
# Imported lazily inside the functions where heavy (xarray/pandas/scipy) so that the learner's
# per-step calls above never pay for them.

#: The precision configurations compared in the study: name -> LM hyperparameters.
#: Every configuration sets all three knobs explicitly so that ``load_runs`` has the
#: ``hp_autocast_dtype``, ``hp_param_dtype`` and ``hp_grad_scaler`` coordinates for every run.
PRECISIONS: dict[str, dict[str, Any]] = {
    "float32": {"autocast_dtype": "float32", "param_dtype": "float32", "grad_scaler": False},
    "bf16_autocast": {"autocast_dtype": "bfloat16", "param_dtype": "float32", "grad_scaler": False},
    "fp16_autocast": {"autocast_dtype": "float16", "param_dtype": "float32", "grad_scaler": False},
    "fp16_autocast_scaler": {"autocast_dtype": "float16", "param_dtype": "float32", "grad_scaler": True},
    "bf16_pure": {"autocast_dtype": "float32", "param_dtype": "bfloat16", "grad_scaler": False},
    "fp16_pure": {"autocast_dtype": "float32", "param_dtype": "float16", "grad_scaler": False},
}


def precision_hparams(name: str) -> dict[str, Any]:
    """LM hyperparameters of a precision configuration in :data:`PRECISIONS` (ValueError otherwise)."""
    if name not in PRECISIONS:
        raise ValueError(f"unknown precision configuration {name!r}; valid: {', '.join(PRECISIONS)}")
    return dict(PRECISIONS[name])


def _lm_spec(steps: int, seed: int, precision: str, hp: dict[str, Any], perturbations=(), log_every: int = 1,
             eval_every: int = 0):
    from stabstudy.spec import RunSpec

    hp = {**hp, **precision_hparams(precision)}
    if not hp["grad_scaler"]:
        hp.pop("scaler_growth_interval", None)  # irrelevant without a scaler: keep hashes shared
    return RunSpec(domain="lm", learner="gpt", task=str(hp.pop("task", "stdlib")), steps=steps, seed=seed,
                   hparams=hp, perturbations=tuple(perturbations), log_every=log_every, eval_every=eval_every)


def precision_grid(steps: int, seeds: Sequence[int], precisions: Sequence[str] = (
        "float32", "bf16_autocast", "fp16_autocast", "fp16_autocast_scaler", "bf16_pure"),
        hp: dict[str, Any] | None = None, eval_every: int = 0) -> list:
    """Same model, data and seeds across precision configurations (no perturbation).

    Returns ``len(precisions) * len(seeds)`` LM RunSpecs; ``hp`` (model size, lr, ...,
    ``scaler_growth_interval``) is shared by all of them.
    """
    return [_lm_spec(steps, s, p, dict(hp or {}), eval_every=eval_every) for p in precisions for s in seeds]


def overflow_grid(steps: int, seeds: Sequence[int], doses: Sequence[float], start: int,
                  precisions: Sequence[str] = ("float32", "bf16_autocast", "fp16_autocast", "fp16_autocast_scaler"),
                  hp: dict[str, Any] | None = None, eval_every: int = 0) -> list:
    """A one-step ``loss_scale`` perturbation of each dose at ``start``, per precision and seed.

    Multiplying the loss by a large factor for one step multiplies every gradient by it: in
    float16 the backward pass overflows to inf beyond ~65504, which is exactly the scenario
    "an fp16 overflow reaches Adam" (without a scaler) or "the scaler skips the step" (with
    one). Dose 1.0 is the unperturbed twin (the perturbation is a no-op, its spec differs only
    by the perturbation record).
    """
    from stabstudy.spec import Perturbation

    return [_lm_spec(steps, s, p, dict(hp or {}), (Perturbation("loss_scale", start, 1, float(d)),),
                     eval_every=eval_every)
            for p in precisions for d in doses for s in seeds]


def logit_grid(steps: int, seeds: Sequence[int], init_scales: Sequence[float], block_sizes: Sequence[int],
               precisions: Sequence[str] = ("float32", "fp16_autocast"), hp: dict[str, Any] | None = None) -> list:
    """Large init x long context toward the float16 limit of the attention logits.

    The attention logit grows like ``init_scale**2`` (queries and keys are both linear in the
    weights, after a LayerNorm that removes the embedding scale); a longer context takes the
    maximum over more query-key pairs.
    """
    out = []
    for p in precisions:
        for s in init_scales:
            for t in block_sizes:
                for seed in seeds:
                    out.append(_lm_spec(steps, seed, p, {**(hp or {}), "init_scale": float(s), "block_size": int(t)}))
    return out


def precision_labels(runs) -> Any:
    """Name from :data:`PRECISIONS` of each run of ``load_runs`` output (DataArray over ``run``)."""
    import numpy as np
    import xarray as xr

    def one(ac, pd_, gs) -> str:
        for name, hp in PRECISIONS.items():
            if (hp["autocast_dtype"], hp["param_dtype"], bool(hp["grad_scaler"])) == (str(ac), str(pd_), bool(gs)):
                return name
        return f"{ac}/{pd_}/scaler={gs}"

    ac = runs["hp_autocast_dtype"].values
    pdt = runs["hp_param_dtype"].values
    gs = runs["hp_grad_scaler"].values
    labels = [one(a, b, bool(c) if not (isinstance(c, float) and np.isnan(c)) else False) for a, b, c in zip(ac, pdt, gs, strict=True)]
    return xr.DataArray(labels, dims="run", coords={"run": runs.run})


def by_precision(runs, var: str) -> Any:
    """``runs[var]`` reshaped to dims ``(precision, seed, step)`` (one run per precision and seed).

    Raises ``ValueError`` when two runs share a (precision, seed) pair (e.g. a grid mixing doses):
    select first. Pairs that were not run are NaN.
    """
    import pandas as pd
    import xarray as xr

    da = runs[var].assign_coords(precision=precision_labels(runs), seed_=("run", runs.seed.values.astype(int)))
    idx = pd.MultiIndex.from_arrays([da.precision.values, da.seed_.values], names=["precision", "seed"])
    if idx.duplicated().any():
        raise ValueError("by_precision: several runs share a (precision, seed) pair; select one grid cell first")
    da = da.drop_vars([c for c in da.coords if c not in ("run", "step")])
    da = da.assign_coords(xr.Coordinates.from_pandas_multiindex(idx, "run")).unstack("run")
    order = [p for p in (*PRECISIONS, *sorted(set(da.precision.values) - set(PRECISIONS))) if p in da.precision]
    return da.sel(precision=order).transpose("precision", "seed", "step")


def _channel(run, name: str):
    import numpy as np

    return run[name].values if name in run else np.full(run.sizes["step"], np.nan)


def run_summary(runs, tail: float = 0.1) -> Any:
    """One row per run of ``load_runs`` output: outcome and precision counts.

    Columns: ``precision``, ``seed``, ``status``, ``steps_done`` (steps with a finite loss),
    ``final_loss`` (mean loss over the last ``tail`` fraction of the *planned* steps, NaN when the
    run did not get there), ``final_val_loss`` (last validation loss), ``nonfinite_steps``
    (steps with >= 1 non-finite gradient element), ``nonfinite_grads`` (total elements),
    ``skipped_steps``, ``loss_scale_min`` / ``loss_scale_max`` / ``loss_scale_final``,
    ``scale_growths`` / ``scale_backoffs`` (number of x2 / x0.5 changes), ``lost_update_mean``,
    ``lost_update_first_half`` / ``lost_update_second_half``, ``adam_state_nonfinite_max``,
    ``adam_state_nonfinite_final``, ``first_nonfinite_step``, ``pert_dose``, ``pert_start``,
    plus ``init_scale`` / ``block_size`` where set.
    """
    import numpy as np
    import pandas as pd

    labels = precision_labels(runs)
    n_planned = runs.sizes["step"]
    rows = []
    for i in range(runs.sizes["run"]):
        r = runs.isel(run=i)
        loss = _channel(r, "loss")
        finite = np.isfinite(loss)
        done = int(finite.sum())
        k = max(int(round(tail * n_planned)), 1)
        last = loss[n_planned - k:]
        final = float(np.mean(last)) if np.isfinite(last).all() else np.nan
        val = _channel(r, "val_loss")
        val = val[np.isfinite(val)]
        nf = _channel(r, "nonfinite_grads")
        sc = _channel(r, "loss_scale")
        scf = sc[np.isfinite(sc)]
        ratio = scf[1:] / scf[:-1] if scf.size > 1 else np.array([])
        lu = _channel(r, "lost_update_frac")
        half = n_planned // 2
        ad = _channel(r, "adam_state_nonfinite")
        adf = ad[np.isfinite(ad)]
        nf_steps = np.flatnonzero(nf > 0)
        row = {
            "precision": str(labels.values[i]), "seed": int(r.seed), "status": str(r.status.values),
            "steps_done": done, "final_loss": final, "final_val_loss": float(val[-1]) if val.size else np.nan,
            "nonfinite_steps": int(np.nansum(nf > 0)), "nonfinite_grads": float(np.nansum(nf)),
            "skipped_steps": int(np.nansum(_channel(r, "skipped_step"))),
            "loss_scale_min": float(scf.min()) if scf.size else np.nan,
            "loss_scale_max": float(scf.max()) if scf.size else np.nan,
            "loss_scale_final": float(scf[-1]) if scf.size else np.nan,
            "scale_growths": int((ratio > 1).sum()), "scale_backoffs": int((ratio < 1).sum()),
            "lost_update_mean": float(np.nanmean(lu)) if np.isfinite(lu).any() else np.nan,
            "lost_update_first_half": float(np.nanmean(lu[:half])) if np.isfinite(lu[:half]).any() else np.nan,
            "lost_update_second_half": float(np.nanmean(lu[half:])) if np.isfinite(lu[half:]).any() else np.nan,
            "adam_state_nonfinite_max": float(adf.max()) if adf.size else np.nan,
            "adam_state_nonfinite_final": float(adf[-1]) if adf.size else np.nan,
            "first_nonfinite_step": float(nf_steps[0]) if nf_steps.size else np.nan,
            "pert_dose": float(r.pert_dose), "pert_start": float(r.pert_start),
        }
        for name in ("init_scale", "block_size", "n_embd", "n_head"):
            if f"hp_{name}" in r.coords:
                row[name] = float(r[f"hp_{name}"])
        rows.append(row)
    return pd.DataFrame(rows)


def loss_gap_vs_reference(summary, reference: str = "float32", column: str = "final_loss") -> Any:
    """Per precision: paired (same seed) difference of ``column`` to the ``reference`` precision.

    Returns a DataFrame indexed by precision with ``n`` (seeds paired, both finite),
    ``mean_diff``, ``ci_low``, ``ci_high`` (95% t-interval of the paired mean; NaN for n < 2),
    ``ref_seed_std`` (seed-to-seed std of the reference, the noise scale), ``diverged``
    (runs not ``ok``).
    """
    import numpy as np
    import pandas as pd
    from scipy import stats as sps

    ref = summary[summary.precision == reference].set_index("seed")[column]
    rows = {}
    for name, g in summary.groupby("precision", sort=False):
        other = g.set_index("seed")[column]
        d = (other - ref).dropna()
        n = int(d.size)
        if n >= 2:
            lo, hi = sps.t.interval(0.95, n - 1, loc=d.mean(), scale=sps.sem(d)) if d.std() > 0 else (d.mean(), d.mean())
        else:
            lo = hi = np.nan
        rows[name] = {"n": n, "mean_diff": float(d.mean()) if n else np.nan, "ci_low": float(lo), "ci_high": float(hi),
                      "ref_seed_std": float(ref.std()) if ref.size > 1 else np.nan,
                      "diverged": int((g.status != "ok").sum())}
    return pd.DataFrame.from_dict(rows, orient="index")


def lost_update_vs_lr(runs) -> Any:
    """Per run: Spearman correlation between the learning rate and ``lost_update_frac`` over steps.

    A negative rho says smaller steps (warmup start, cosine tail) get rounded away more often.
    Returns a DataFrame with ``precision``, ``seed``, ``rho``, ``p``, ``n``.
    """
    import numpy as np
    import pandas as pd
    from scipy import stats as sps

    labels = precision_labels(runs)
    rows = []
    for i in range(runs.sizes["run"]):
        r = runs.isel(run=i)
        lr, lu = _channel(r, "lr"), _channel(r, "lost_update_frac")
        ok = np.isfinite(lr) & np.isfinite(lu)
        if ok.sum() < 3 or np.ptp(lu[ok]) == 0 or np.ptp(lr[ok]) == 0:
            rho, p = np.nan, np.nan
        else:
            res = sps.spearmanr(lr[ok], lu[ok])
            rho, p = float(res.statistic), float(res.pvalue)
        rows.append({"precision": str(labels.values[i]), "seed": int(r.seed), "rho": rho, "p": p, "n": int(ok.sum())})
    return pd.DataFrame(rows)


def overflow_table(summary) -> Any:
    """Per (precision, dose), over seeds: what a one-step loss-scale overflow did.

    Columns: ``runs``, ``diverged`` (count), ``nonfinite_steps``, ``skipped_steps``,
    ``adam_state_nonfinite_max`` (max over seeds), ``final_loss`` (mean over runs that
    finished), ``excess_final_loss`` (mean over seeds of final loss minus the same precision's
    dose-1 twin of the same seed; NaN when either did not finish).
    """
    import numpy as np
    import pandas as pd

    base = summary[summary.pert_dose == 1.0].set_index(["precision", "seed"])["final_loss"]
    s = summary.copy()
    s["excess_final_loss"] = [
        row.final_loss - base.get((row.precision, row.seed), np.nan) for row in s.itertuples()]
    g = s.groupby(["precision", "pert_dose"], sort=False)
    out = pd.DataFrame({
        "runs": g.size(), "diverged": g.status.apply(lambda x: int((x != "ok").sum())),
        "nonfinite_steps": g.nonfinite_steps.sum(), "skipped_steps": g.skipped_steps.sum(),
        "adam_state_nonfinite_max": g.adam_state_nonfinite_max.max(),
        "final_loss": g.final_loss.mean(), "excess_final_loss": g.excess_final_loss.mean(),
    })
    return out


def logit_table(runs) -> Any:
    """Per run of the logit grid: the step-0 attention/output logits and their float16 headroom.

    Columns: ``precision``, ``init_scale``, ``block_size``, ``seed``, ``status``, ``steps_done``,
    ``attn_logit_max0`` / ``out_logit_max0`` (step 0), ``attn_logit_peak`` (max over finite steps),
    ``headroom0`` = :func:`logit_fp16_headroom` at step 0 and ``headroom_peak`` its maximum over the
    measured steps (head_dim from ``n_embd / n_head``,
    learner defaults 64 / 2 when not set), ``headroom_naive0`` = :func:`fp16_headroom` of the
    scaled logits alone.
    """
    import numpy as np
    import pandas as pd

    labels = precision_labels(runs)
    rows = []
    for i in range(runs.sizes["run"]):
        r = runs.isel(run=i)
        n_embd = float(r["hp_n_embd"]) if "hp_n_embd" in r.coords else 64.0
        n_head = float(r["hp_n_head"]) if "hp_n_head" in r.coords else 2.0
        hd = int(n_embd // n_head) if np.isfinite(n_embd) and np.isfinite(n_head) else 32
        a, o = _channel(r, "attn_logit_max"), _channel(r, "out_logit_max")
        fin = a[np.isfinite(a)]
        rows.append({
            "precision": str(labels.values[i]), "init_scale": float(r.hp_init_scale),
            "block_size": int(r.hp_block_size), "seed": int(r.seed), "status": str(r.status.values),
            "steps_done": int(np.isfinite(_channel(r, "loss")).sum()),
            "attn_logit_max0": float(a[0]), "out_logit_max0": float(o[0]),
            "attn_logit_peak": float(fin.max()) if fin.size else np.inf,
            "headroom0": logit_fp16_headroom(a[0], o[0], hd),
            "headroom_peak": max((logit_fp16_headroom(x, y, hd) for x, y in zip(a, o, strict=True)
                                  if not (np.isnan(x) or np.isnan(y))), default=np.nan),
            "headroom_naive0": fp16_headroom(max(a[0], o[0])),
        })
    return pd.DataFrame(rows)


def overflow_prediction(logit_tab) -> Any:
    """Does the float32 twin's fp16 headroom predict which fp16-autocast runs overflow?

    ``logit_tab``: :func:`logit_table`. Returns one row per (init_scale, block_size,
    seed) with an fp16 run: the float32 twin's ``headroom0_fp32``,
    ``headroom_peak_fp32``, ``headroom_naive0_fp32``, the fp16 run's ``fp16_status``
    and ``fp16_steps_done``, ``predicted_overflow`` (peak headroom >= 1) and
    ``fp16_diverged``.
    """
    import pandas as pd

    key = ["init_scale", "block_size", "seed"]
    twin = logit_tab[logit_tab.precision == "float32"].set_index(key)
    fp16 = logit_tab[logit_tab.precision == "fp16_autocast"].set_index(key)
    pred = pd.DataFrame({"headroom0_fp32": twin.headroom0, "headroom_peak_fp32": twin.headroom_peak,
                         "headroom_naive0_fp32": twin.headroom_naive0, "fp16_status": fp16.status,
                         "fp16_steps_done": fp16.steps_done}).dropna(subset=["fp16_status"])
    pred["predicted_overflow"] = pred.headroom_peak_fp32 >= 1
    pred["fp16_diverged"] = pred.fp16_status != "ok"
    return pred


def claims_table(sum_a, sum_b, overflow, rho, pred, logit_tab, gap=None, gap_scaler=None, gap_mixed=None) -> Any:
    """Notebook 03's closing table: claim, our measurement, supported? (yes / no / n/a).

    Args:
        sum_a: :func:`run_summary` of the precision comparison (A).
        sum_b: :func:`run_summary` of the overflow experiment (B); ``overflow``
            its :func:`overflow_table`.
        rho: :func:`lost_update_vs_lr` rows with a finite ``rho``.
        pred: :func:`overflow_prediction`; ``logit_tab``: :func:`logit_table` (C).
        gap, gap_scaler, gap_mixed: :func:`loss_gap_vs_reference` against float32,
            fp16 + scaler and bf16 autocast (None when that reference was not run).

    "n/a" means the data needed for a verdict is missing (e.g. one seed: no interval).
    """
    import numpy as np
    import pandas as pd

    def row(claim, measured, ok):
        return {"claim": claim, "our measurement": measured,
                "supported?": "n/a" if ok is None else ("yes" if ok else "no")}

    def ci_text(g, name):
        if g is None or name not in g.index:
            return "not run", None
        r = g.loc[name]
        txt = f"{r.mean_diff:+.4f} nats [{r.ci_low:+.4f}, {r.ci_high:+.4f}], n={int(r.n)}, diverged={int(r.diverged)}"
        return txt, (None if not np.isfinite(r.ci_low) else r)

    claims = []
    txt, r = ci_text(gap, "bf16_autocast")
    claims.append(row("bf16 autocast reaches float32's final loss (paired CI contains 0)", txt,
                      None if r is None else bool(r.ci_low <= 0 <= r.ci_high)))
    txt, r = ci_text(gap_scaler, "fp16_autocast")
    claims.append(row("fp16 autocast without loss scaling ends worse than with it (underflow)",
                      "fp16 - fp16+scaler: " + txt, None if r is None else bool(r.ci_low > 0)))
    s = sum_a[sum_a.precision == "fp16_autocast_scaler"]
    if len(s):
        ok = bool((s.skipped_steps == s.nonfinite_steps).all() and (s.scale_backoffs == s.skipped_steps).all())
        claims.append(row("GradScaler skips every step with inf/NaN gradients and halves the scale",
                          f"skipped {int(s.skipped_steps.sum())} steps, {int(s.nonfinite_steps.sum())} with inf/NaN "
                          f"grads, {int(s.scale_backoffs.sum())} halvings, {int(s.scale_growths.sum())} doublings; "
                          f"scale range [{s.loss_scale_min.min():g}, {s.loss_scale_max.max():g}]", ok))
    o = sum_b[(sum_b.precision == "fp16_autocast") & (sum_b.nonfinite_steps > 0)]
    claims.append(row("an fp16 overflow reaching Adam (no scaler) corrupts its state; the run does not recover",
                      f"{len(o)} runs overflowed; Adam state non-finite in {int((o.adam_state_nonfinite_max > 0).sum())}, "
                      f"diverged {int((o.status != 'ok').sum())}" + (f" (doses {sorted(set(o.pert_dose))})" if len(o) else ""),
                      None if len(o) == 0 else bool((o.adam_state_nonfinite_max > 0).all() and (o.status != "ok").all())))
    doses_over = sorted(set(o.pert_dose))
    sb = sum_b[(sum_b.precision == "fp16_autocast_scaler") & sum_b.pert_dose.isin(doses_over)]
    have = [("fp16_autocast_scaler", d) for d in doses_over if ("fp16_autocast_scaler", d) in overflow.index]
    exc = overflow.loc[have, "excess_final_loss"] if len(sb) else []
    claims.append(row("with GradScaler the same overflow is skipped and training continues",
                      f"{len(sb)} runs: skipped {int(sb.skipped_steps.sum())} steps, ok {int((sb.status == 'ok').sum())}, "
                      f"max Adam non-finite {sb.adam_state_nonfinite_max.max() if len(sb) else float('nan'):g}, "
                      f"excess final loss vs dose-1 twin {np.round(np.asarray(exc, float), 4).tolist()}",
                      None if len(sb) == 0 else bool((sb.status == "ok").all() and (sb.skipped_steps > 0).all()
                                                      and (sb.adam_state_nonfinite_max == 0).all())))
    bb = sum_b[sum_b.precision == "bf16_autocast"]
    claims.append(row("bfloat16 keeps float32's range: the same doses do not overflow",
                      f"max dose {bb.pert_dose.max():g}: non-finite gradient steps {int(bb.nonfinite_steps.sum())}, "
                      f"diverged {int((bb.status != 'ok').sum())}", None if len(bb) == 0 else bool(bb.nonfinite_steps.sum() == 0)))
    pb = sum_a[sum_a.precision == "bf16_pure"]
    rb = rho[rho.precision == "bf16_pure"]
    claims.append(row("pure bf16 storage erases a sizeable fraction of updates, more when the lr is small (rho(lr, lost) < 0)",
                      f"mean lost fraction {pb.lost_update_mean.mean():.3f}; median Spearman rho {rb.rho.median():+.3f} "
                      f"over {len(rb)} runs (max p {rb.p.max():.2g})" if len(pb) else "not run",
                      None if len(rb) == 0 else bool(rb.rho.median() < 0 and (rb.p < 0.05).all())))
    txt, r = ci_text(gap_mixed, "bf16_pure")
    claims.append(row("pure bf16 ends worse than bf16 autocast with float32 master weights",
                      "bf16_pure - bf16_autocast: " + txt, None if r is None else bool(r.ci_low > 0)))
    pf = sum_a[sum_a.precision == "fp16_pure"]
    claims.append(row("pure fp16 Adam (eps=1e-8 rounds to 0 in float16) diverges at once",
                      f"status {pf.status.tolist()}, steps done {pf.steps_done.tolist()}" if len(pf) else "not run",
                      None if len(pf) == 0 else bool((pf.status != "ok").all())))
    agree = pred.predicted_overflow == pred.fp16_diverged
    claims.append(row("the float32 twin's fp16 headroom (>= 1) predicts which fp16 runs overflow",
                      f"{int(agree.sum())}/{len(pred)} configurations agree; fp16 diverged in {int(pred.fp16_diverged.sum())}; "
                      f"naive headroom (no sqrt(d)) >= 1 in {int((pred.headroom_naive0_fp32 >= 1).sum())}",
                      None if len(pred) == 0 else bool(agree.all())))
    f32 = logit_tab[logit_tab.precision == "float32"].pivot_table(index="init_scale", columns="block_size",
                                                                  values="headroom0")
    if f32.shape[1] >= 2:
        ratio = f32[f32.columns.max()] / f32[f32.columns.min()]
        claims.append(row(f"a longer context ({f32.columns.max()} vs {f32.columns.min()}) moves the logits closer to "
                          "the fp16 limit", f"step-0 headroom ratio per init scale: {np.round(ratio.values, 3).tolist()}",
                          bool((ratio > 1).all())))
    else:
        claims.append(row("a longer context moves the logits closer to the fp16 limit", "one block size only", None))
    skip_doses = sorted(set(sum_b[(sum_b.precision == "fp16_autocast_scaler") & (sum_b.skipped_steps > 0)
                                  & (sum_b.pert_dose != 1.0)].pert_dose))
    pairs = [(d, overflow.loc[("fp16_autocast_scaler", d), "excess_final_loss"],
              overflow.loc[("float32", d), "excess_final_loss"]) for d in skip_doses if ("float32", d) in overflow.index]
    claims.append(row("skipping the overflowing step spares the loss damage the same step does in float32",
                      "; ".join(f"dose {d:g}: scaler {a:+.3f} vs float32 {b:+.3f} nats" for d, a, b in pairs)
                      or "no skipped perturbed step", None if not pairs else bool(all(a < b for _, a, b in pairs))))
    return pd.DataFrame(claims)
