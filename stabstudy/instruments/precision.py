"""Numerical-precision measurements: non-finite values, lost updates, fp16 headroom, autocast.

Precision is one of the learning-signal sources of instability (see docs/references.md):

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
(:mod:`stabstudy.learners.lm`) calls them to fill the precision channels ``nonfinite_grads``,
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
#: torch.amp.GradScaler defaults (docs/references.md).
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
    explicit attention (``(q @ k.T) * head_dim**-0.5``, as in :class:`stabstudy.learners.gpt.GPT` with
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

