"""Optimizer telemetry for any PyTorch training loop.

:class:`Monitor` attaches to one or several ``torch.optim.Optimizer`` objects
through ``register_step_pre_hook`` / ``register_step_post_hook``, so a training
loop needs no extra calls to record, per update:

=================== ==========================================================
``grad_norm``       global L2 norm of the gradient (every step)
``xgrad``           gradient-direction coherence cos(g_t, g_{t-1})
``update_norm``     L2 norm of the applied update u = w_after - w_before
``update_ratio``    ||u|| / ||w_before||
``update_grad_cos`` cos(u, -g) (Molybog et al. 2023: -> 0 before Adam divergence)
``adam_m_norm``     ||m_hat||, bias-corrected Adam first moment
``adam_v_mean``     mean of v_hat, bias-corrected Adam second moment
``adam_eps_frac``   fraction of coordinates with sqrt(v_hat) < eps (bias-corrected)
``lr``              param_groups[0]['lr'] of the primary optimizer at the step
=================== ==========================================================

Rows and the ``step`` coordinate
--------------------------------
A *row* is one round of updates in which each attached optimizer steps at most
once; a row opens when an optimizer steps that already stepped in the current
row. With one optimizer a row is one ``optimizer.step()``. With several (SAC:
actor, critic, entropy coefficient) the shared channels are global over all
parameters stepped in that row, and every channel is also recorded per optimizer
as ``<channel>_<name>`` (names: the dict's keys, else ``opt0``, ``opt1``, ...).
An optimizer that skips rounds (TD3's delayed actor) simply leaves its own
channels NaN there; the row still exists. ``step`` counts rows (= updates of the
primary optimizer whenever it steps every round). Each optimizer's ``xgrad`` is
the cosine with *its own* previous gradient, and ``every`` counts each
optimizer's own steps, so a delayed actor is measured every N of its updates.

Call :meth:`Monitor.log` *after* ``optimizer.step()`` to attach scalars (loss,
perf, ...) to the step just taken (or pass ``step=mon.step + 1`` to log ahead).

Cost
----
With ``every=N`` only ``grad_norm`` and ``lr`` are computed on every step; the
other channels on steps divisible by N (each optimizer's own steps; NaN in between). A measured step needs the
gradient and the parameters before and after the update, Adam's m and v, and the
previous step's gradient. On contiguous float32 CPU tensors (``backend="auto"``, the
default) it takes three passes of the fused C kernels in :mod:`stabstudy.instruments.telemetry.kernels`: one
over gradient and parameters in the pre-hook (copying both into a flat float32 buffer,
summing g.g, g.g_prev, w.w), one forming the update in place after the step (u.u, u.g),
one over Adam's state (m.m, sum v, #(v < thr)), each element read once. Elsewhere (GPU,
half precision, no C compiler, ``backend="torch"``) the same statistics come from torch
ops: foreach copies of gradient and parameters into the buffer, the update formed in place
by ``torch._foreach_sub_``, Adam's m and v copied into a scratch row by ``torch.cat`` of
cached views, separate dot products (memory-bound on CPU, cheaper there than a Gram
matmul of the rows) into a small result tensor read back with one host sync. Adam's state
tensors and step counts are looked up once and reused while the optimizer's state and the
set of stepped parameters stay the same. Memory: four flat float32 rows the size of the
stepped parameters per optimizer (gradient, previous gradient, parameters before the
update then the negated update, scratch). ``benchmarks/telemetry_overhead.py`` measures
the cost per step of both backends; :meth:`Monitor.cost` reports the time spent in the
hooks of a live Monitor, i.e. its share of the user's own loop.

References: Molybog et al. 2023 (update/gradient cosine before Adam
instability); Kingma & Ba 2015 (Adam bias correction).
"""

from __future__ import annotations

import math
import time
import warnings
from array import array
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from stabstudy.instruments.telemetry import kernels

#: Long names of the channels the Monitor records (attrs of ``to_dataset``).
LONG_NAMES: dict[str, str] = {
    "grad_norm": "global L2 norm of the gradient",
    "xgrad": "gradient-direction coherence cos(g_t, g_{t-1})",
    "update_norm": "L2 norm of the applied parameter update",
    "update_ratio": "update norm / parameter norm (before the update)",
    "update_grad_cos": "cosine(applied update, -gradient)",
    "adam_m_norm": "L2 norm of Adam's bias-corrected first moment m_hat",
    "adam_v_mean": "mean of Adam's bias-corrected second moment v_hat",
    "adam_eps_frac": "fraction of coordinates with sqrt(v_hat) < eps (bias-corrected)",
    "lr": "learning rate applied (param_groups[0]['lr'] of the primary optimizer)",
    "grad_coherence": "microbatch gradient coherence ||mean_k g_k||^2 / mean_k ||g_k||^2",
    "loss": "training objective at that update",
    "perf": "performance measure (higher is better)",
    "perturbed": "1 while a perturbation is active",
    "intervened": "1 where a controller acted",
    "lambda_max": "top Hessian eigenvalue (Lanczos on Hessian-vector products; NaN between measurements)",
    "layer_grad_norm": "L2 norm of the gradient per parameter tensor",
    "layer_update_ratio": "update norm / parameter norm per parameter tensor",
}

#: Values of ``Monitor(backend=...)``: "fused" (one-pass C kernels, float32 CPU tensors), "torch"
#: (torch ops, any device and dtype), "auto" (fused where the tensors allow, else torch).
BACKENDS = ("auto", "fused", "torch")

#: Channels computed by the Monitor itself, in dataset order.
OPT_CHANNELS = ("grad_norm", "xgrad", "update_norm", "update_ratio", "update_grad_cos",
                "adam_m_norm", "adam_v_mean", "adam_eps_frac", "lr")

_NAN = float("nan")
# per-optimizer statistics stored for each row (one float64 each; NaN where not computed)
(_F_KIND, _F_ORDER, _F_LR, _F_LRP, _F_G2, _F_GP2, _F_GPG, _F_W2, _F_U2, _F_UG, _F_PREV, _F_M2, _F_VSUM, _F_NBELOW,
 _F_N) = range(15)
_NF = 15
# _F_KIND: what was computed when the optimizer stepped (NaN: it did not step in that row)
_K_NOPARAMS, _K_GRAD, _K_FULL, _K_ADAM = 0.0, 1.0, 2.0, 3.0
# slots of _OptState.res: the scalars one measured step reads back in one transfer
_G2, _GPG, _W2, _U2, _NUG, _M2, _VSUM, _NBELOW = range(8)
_NRES = 8


def _as_float(x: Any) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def gradient_coherence(grads: Sequence[Sequence[torch.Tensor] | torch.Tensor]) -> float:
    """Microbatch gradient coherence ``||mean_k g_k||^2 / mean_k ||g_k||^2``.

    Args:
        grads: K microbatch gradients, each a flat tensor or a list of tensors
            (one per parameter, same layout for every k).

    Returns:
        A float in [0, 1]: 1 when all microbatch gradients agree, 1/K when they
        are orthogonal with equal norms (pure noise), 0 when they cancel.
    """
    flat = [g if isinstance(g, torch.Tensor) else torch.cat([t.detach().reshape(-1) for t in g]) for g in grads]
    if not flat:
        raise ValueError("gradient_coherence needs at least one microbatch gradient")
    G = torch.stack([f.detach().float() for f in flat])  # (K, N)
    num = G.mean(0).pow(2).sum()
    den = G.pow(2).sum(1).mean()
    return float((num / den).item()) if float(den) > 0 else _NAN


class MonitorCost(NamedTuple):
    """What :meth:`Monitor.cost` returns."""

    hook_s: float  #: seconds spent inside the Monitor's hooks
    span_s: float  #: seconds from the first hook's entry to the last hook's exit
    fraction: float  #: hook_s / span_s: the share of the training loop's wall time (NaN before a step)
    updates: int  #: rows recorded (updates of the primary optimizer)
    hook_calls: int  #: hook invocations (two per optimizer step)


class _Table:
    """Float64 array indexed by row that grows by doubling; NaN where nothing was written.
    Columnar storage keeps a long run's telemetry small (120 bytes per optimizer per row) and
    lets ``to_dataset`` derive channels with numpy. ``masked`` tables also keep a mask of the
    cells written (logged scalars, where a logged NaN differs from nothing logged)."""

    def __init__(self, tail: tuple[int, ...] = (), masked: bool = False):
        self.tail = tail
        self.a = np.full((0, *tail), np.nan)
        self.m = np.zeros((0, *tail), dtype=bool) if masked else None
        self.n = 0  # rows in use: 1 + the largest row written
        self.mv: memoryview | None = None  # flat view of ``a`` (see flat)

    def put(self, row: int, value: float) -> None:
        """Write one value (masked tables without a tail)."""
        self._grow(row)
        self.a[row] = value
        self.m[row] = True

    def row(self, row: int) -> np.ndarray:
        """View of one row (tables with a tail), allocating up to it."""
        self._grow(row)
        return self.a[row]

    def flat(self, row: int) -> memoryview:
        """The whole table as a flat float64 memoryview, allocated up to ``row``: element
        ``(row, *idx)`` is at ``row * prod(tail) + ...``. Writing single cells through it
        costs far less than numpy indexing in the cold-cache optimizer hooks."""
        if row >= len(self.a) or self.mv is None:
            self._grow(row)
            self.mv = memoryview(self.a).cast("B").cast("d")
        elif row >= self.n:
            self.n = row + 1
        return self.mv

    def _grow(self, row: int) -> None:
        if row >= len(self.a):
            self.mv = None
            self.a = self._padded(self.a, max(64, 2 * len(self.a), row + 1), np.nan)
            if self.m is not None:
                self.m = self._padded(self.m, len(self.a), False)
        if row >= self.n:
            self.n = row + 1

    def widen(self, width: int) -> None:
        """Grow a 1-D tail to ``width`` columns (NaN in the new ones)."""
        if width <= self.tail[0]:
            return
        out = np.full((len(self.a), width), np.nan)
        out[:, : self.tail[0]] = self.a
        self.a, self.tail, self.mv = out, (width,), None

    def _padded(self, x: np.ndarray, n: int, fill: Any) -> np.ndarray:
        out = np.full((n, *self.tail), fill, dtype=x.dtype)
        out[: len(x)] = x
        return out

    def rows(self, n: int) -> tuple[np.ndarray, np.ndarray | None]:
        """The first ``n`` rows (padded with NaN / False beyond what was written), and the mask."""
        if n <= len(self.a):
            return self.a[:n], None if self.m is None else self.m[:n]
        return self._padded(self.a, n, np.nan), None if self.m is None else self._padded(self.m, n, False)


class _OptState:
    """Per-optimizer flat buffers, cached parameter / Adam-state lists and bookkeeping."""

    def __init__(self, index: int, name: str, optimizer: torch.optim.Optimizer):
        self.index = index
        self.name = name
        self.opt = optimizer
        # buffer rows: 0/1 gradient slots (current / previous), 2 w_before then -u, 3 scratch (Adam m, v)
        self.buf: torch.Tensor | None = None
        self.rows: list[list[torch.Tensor]] = []  # per row: views of that row shaped like the parameters
        self.res: torch.Tensor | None = None  # scalar results of one step, read back with one tolist()
        self.out: list[torch.Tensor] = []  # its elements, as out= targets
        self.key: tuple[int, ...] = ()
        self.sizes: list[int] = []
        self.slot = 0  # gradient slot of the current step
        self.n = -1  # this optimizer's own step count (rows count rounds; it may skip some)
        self.prev_step = -10  # own step (``n``) whose gradient sits in slot 1 - slot
        self.prev_g2 = _NAN  # its squared norm
        # loss scale of this step's / that gradient (GradScaler with an optimizer that unscales
        # inside its step, e.g. fused Adam: the hooks see scaled gradients)
        self.gscale = self.prev_gscale = 1.0
        self.special_key: tuple[int, ...] = ()  # the parameter set ``special`` was checked for
        self.special = False  # sparse or complex gradients: grad_norm only (_special_g2)
        self.pending: list[bool] | None = None  # opt.step(closure): [whether the gradient pass ran]
        self.params: list[torch.Tensor] = []
        self.measuring = False
        self.kept = False  # this step's gradient is kept for the next step's xgrad (every > 1)
        self.order = 0  # how many optimizers stepped before this one in the current row
        self.lr = self.lr_primary = _NAN  # read when this optimizer steps
        self.layer_w: list[torch.Tensor] = []  # per-tensor norms of w_before (torch path, per_layer)
        self.last_measured = -1  # row whose update (negated) sits in buffer row 2
        self.params_at_measure: list[torch.Tensor] = []
        self.adam: _AdamCache | None = None
        # fused path (stabstudy.instruments.telemetry.kernels). Plain ``array.array``s, not numpy: in a training loop
        # the hooks run with cold caches, where numpy's heavier code paths cost tens of us per
        # call. out_g[3t:3t+3] = (g.g, g.g_prev, w.w) of tensor t, then the sums over tensors;
        # out_u[2t:2t+2] = (u.u, -u.g), then the sums; out_a = (m.m, sum v, #(v < thr)).
        self.fused = False  # this step's statistics come from the fused kernels
        self.lens = array("q")  # element count per tensor
        self.out_g = self.out_u = self.out_a = array("d")
        self.gptr = self.wptr = array("Q")  # data pointers of this step's gradients / parameters
        self.addr: dict[str, int] = {}  # addresses of lens, out_g, out_u, out_a
        self.row_addr: list[int] = []  # addresses of the buffer rows
        self.w_list: list[int] = []  # the parameters' data pointers the pre-hook checked

    def stepped_params(self) -> list[torch.Tensor]:
        return [p for g in self.opt.param_groups for p in g["params"] if p.grad is not None]

    def prepare(self, params: list[torch.Tensor], key: tuple[int, ...], sizes: bool = False) -> None:
        """(Re)build the buffers when the set of stepped parameters (``key``: their ids) or
        their device changes, or with ``sizes`` when a parameter's size changed (``p.data``
        replaced by a tensor of another shape; the fused path checks sizes itself)."""
        p0, buf = params[0], self.buf
        if key == self.key and buf is not None and (buf.is_cpu if p0.is_cpu else buf.device == p0.device) and \
                (not sizes or [p.numel() for p in params] == self.sizes):
            return
        dev = params[0].device
        self.sizes = [p.numel() for p in params]
        self.buf = torch.zeros(4, sum(self.sizes), dtype=torch.float32, device=dev)
        self.rows = [[v.view(p.shape) for v, p in zip(self.buf[r].split(self.sizes), params, strict=True)]
                     for r in range(4)]
        self.res = torch.zeros(_NRES, dtype=torch.float32, device=dev)
        self.out = list(self.res.unbind())
        P = len(params)
        self.lens = array("q", self.sizes)
        self.out_g, self.out_u, self.out_a = (array("d", bytes(8 * k)) for k in (3 * (P + 1), 2 * (P + 1), 3))
        self.addr = {k: getattr(self, k).buffer_info()[0] for k in ("lens", "out_g", "out_u", "out_a")}
        self.row_addr = [self.buf[r].data_ptr() for r in range(4)]
        self.key = key
        self.prev_step = -10
        self.adam = None


_F32 = torch.float32


def _special_g2(grads: list[torch.Tensor]) -> float:
    """||g||^2 of gradients that may be sparse (stored values, coalesced) or complex (|z|^2)."""
    tot = 0.0
    for g in grads:
        v = g.coalesce().values() if g.is_sparse else g
        tot += float(v.abs().double().pow(2).sum())
    return tot


def _grad_scale(opt: torch.optim.Optimizer) -> float:
    """The factor the gradients the optimizer is about to see are scaled by: ``torch.amp.GradScaler``
    leaves them scaled for optimizers that unscale inside ``step`` (``_step_supports_amp_scaling``,
    e.g. ``fused=True`` Adam) and sets ``opt.grad_scale`` (None once ``unscale_`` ran) for that step."""
    s = getattr(opt, "grad_scale", None)
    return 1.0 if s is None else _as_float(s)


def _grad_norms(grads: list[torch.Tensor]) -> torch.Tensor:
    """Per-tensor L2 norms, computed in at least float32: a half-precision gradient's norm
    overflows float16 long before its entries do (float64 stays float64: torch will not narrow)."""
    dt = torch.float64 if any(g.dtype is torch.float64 for g in grads) else _F32
    return torch.stack(torch._foreach_norm(grads, 2, dtype=dt))


def _point(st: _OptState, params: list[torch.Tensor], grads: list[torch.Tensor], weights: bool) -> bool:
    """Load the data pointers of ``grads`` (and with ``weights`` of ``params``) into ``st``'s
    pointer arrays; False when the fused kernels cannot read them: not contiguous float32 CPU
    tensors of the sizes the buffers were built for (``p.data`` may have been replaced since).
    A gradient has its parameter's dtype, device and shape (torch enforces it), not
    necessarily its layout; without ``weights`` (a step that reads only gradients) the
    gradients are checked themselves."""
    if not weights:
        for g, n in zip(grads, st.sizes, strict=True):
            if not (g.is_cpu and g.dtype is _F32 and g.is_contiguous() and g.numel() == n):
                return False
        st.gptr = array("Q", [g.data_ptr() for g in grads])
        return True
    w = []
    for p, n in zip(params, st.sizes, strict=True):
        if not (p.is_cpu and p.dtype is _F32 and p.is_contiguous() and p.numel() == n):
            return False
        w.append(p.data_ptr())
    for g in grads:
        if not g.is_contiguous():
            return False
    st.w_list = w
    st.wptr = array("Q", w)
    st.gptr = array("Q", [g.data_ptr() for g in grads])
    return True


def _flat_views(ts: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
    """1-D views of ``ts`` for ``torch.cat(..., out=)`` (one kernel, where a foreach copy
    dispatches once per tensor), or None when one is not contiguous (reshape copies then)."""
    return [t.detach().view(-1) for t in ts] if all(t.is_contiguous() for t in ts) else None


class Monitor:
    """Record optimizer telemetry per update through optimizer step hooks.

    Args:
        model: the ``nn.Module`` (or a list / dict of modules) whose parameters
            the optimizers update; only used to name parameters for
            ``per_layer`` (may be ``None``).
        optimizer: one optimizer, a list of them, or a dict ``name -> optimizer``.
            The first is the *primary*: its ``lr`` is the ``lr`` channel.
        every: compute the costly channels every this many steps (NaN between);
            ``grad_norm`` and ``lr`` are recorded on every step.
        per_layer: also record ``layer_grad_norm`` and ``layer_update_ratio``
            on a ``layer`` dimension (one entry per parameter tensor).
        backend: one of :data:`BACKENDS`. "auto" computes a step's statistics with the fused
            C kernels of :mod:`stabstudy.instruments.telemetry.kernels` when its parameters, gradients and Adam
            state are contiguous float32 CPU tensors and the kernels compiled, else with
            torch ops; "fused" raises instead of falling back; "torch" never uses them.

    Adam channels are read from ``optimizer.state[p]["exp_avg"|"exp_avg_sq"|"step"]``
    (Adam, AdamW, and any optimizer storing the same keys) and are bias-corrected:
    m_hat = m / (1 - beta1^t), v_hat = v / (1 - beta2^t); ``adam_eps_frac`` counts
    coordinates with sqrt(v_hat) < eps. Other optimizers (SGD, ...) give NaN there.

    Example::

        mon = Monitor(model, opt)
        for x, y in loader:
            opt.zero_grad(); loss = f(model(x), y); loss.backward(); opt.step()
            mon.log(loss=loss.item())
        ds = mon.to_dataset(); mon.close()
    """

    def __init__(self, model: Any, optimizer: Any, *, every: int = 1, per_layer: bool = False,
                 backend: str = "auto"):
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"every must be an integer >= 1, got {every!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
        self.backend = backend
        self._kernels = kernels.load() if backend != "torch" else None
        if backend == "fused" and self._kernels is None:
            raise RuntimeError(f"backend='fused' but the fused kernels are unavailable: {kernels.unavailable_reason()}")
        #: optimizer steps whose gradient pass ran on the fused kernels (measured or not; the rest: torch ops)
        self.fused_steps = 0
        if isinstance(optimizer, Mapping):
            named = list(optimizer.items())
        elif isinstance(optimizer, torch.optim.Optimizer):
            named = [("opt0", optimizer)]
        elif isinstance(optimizer, Iterable):
            named = [(f"opt{i}", o) for i, o in enumerate(optimizer)]
        else:
            raise TypeError(f"optimizer must be an Optimizer, a list or a dict of them, got {type(optimizer).__name__}")
        if not named:
            raise ValueError("Monitor needs at least one optimizer")
        for name, o in named:
            if not isinstance(o, torch.optim.Optimizer):
                raise TypeError(f"optimizer {name!r} is a {type(o).__name__}, not a torch.optim.Optimizer")
        self.every = every
        self.per_layer = per_layer
        self.enabled = True
        self._opts = [_OptState(i, str(n), o) for i, (n, o) in enumerate(named)]
        self._multi = len(self._opts) > 1
        self._handles: list[Any] = []
        self._cost = [0.0, -1.0, -1.0, 0]  # see cost(); a list: the hooks update it in place
        for st in self._opts:
            self._handles.append(st.opt.register_step_pre_hook(self._make_hook(st, pre=True)))
            self._handles.append(st.opt.register_step_post_hook(self._make_hook(st, pre=False)))
        self._step = -1  # index of the current row (-1 before the first update)
        self._stepped: set[int] = set()
        self._stats = _Table((len(self._opts), _NF))  # row -> optimizer -> statistics (_F_*)
        self._logged: dict[str, _Table] = {}  # logged scalars by name, in order of appearance
        self._layer_names: list[str] = []
        self._param_names: dict[int, str] = {}  # id(parameter) -> name in the model (per_layer)
        self._layer_index: dict[int, int] = {}
        self._layers: dict[str, _Table] = {}
        if per_layer:
            self._init_layers(model)
            L = len(self._layer_names)
            self._layers = {"layer_grad_norm": _Table((L,)), "layer_update_ratio": _Table((L,))}

    # -- public API ---------------------------------------------------------------
    @property
    def step(self) -> int:
        """Index of the current row (the update just taken); -1 before the first."""
        return self._step

    @property
    def optimizer_names(self) -> list[str]:
        return [st.name for st in self._opts]

    def log(self, step: int | None = None, **scalars: Any) -> None:
        """Attach scalars to the current row (or to row ``step``).

        New channel names may appear at any time: earlier rows read NaN.
        Tensors are converted with ``.item()``; call after ``optimizer.step()``.
        Nothing is recorded while ``enabled`` is False (updates are still counted,
        so ``step`` stays the update index).
        """
        if not self.enabled:
            return
        s = max(self._step, 0) if step is None else int(step)
        if s < 0:
            raise ValueError(f"step must be >= 0, got {step!r}")
        for k, v in scalars.items():
            col = self._logged.get(k)
            if col is None:
                col = self._logged[k] = _Table(masked=True)
            col.put(s, _NAN if v is None else _as_float(v))

    def microbatch_coherence(self, grads: Sequence[Sequence[torch.Tensor] | torch.Tensor],
                             step: int | None = None) -> float:
        """Compute :func:`gradient_coherence` of K microbatch gradients, log it as
        ``grad_coherence`` (current row, or row ``step``) and return it."""
        c = gradient_coherence(grads)
        self.log(step=step, grad_coherence=c)
        return c

    def close(self) -> None:
        """Remove the hooks and free the buffers (recorded data stays available)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for st in self._opts:
            st.buf, st.res, st.rows, st.out, st.adam = None, None, [], [], None
            st.key, st.row_addr, st.addr = (), [], {}

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def row(self, step: int | None = None) -> dict[str, float]:
        """All channels of row ``step`` (default: the current one) as a dict, e.g.
        ``mon.row().get("grad_norm")`` right after ``optimizer.step()``."""
        s = self._step if step is None else int(step)
        if s < 0:
            return {}
        out: dict[str, float] = {}
        if s < self._stats.n:
            S = self._stats.a[s:s + 1]
            if not np.isnan(S[0, :, _F_KIND]).all():  # some optimizer stepped in this row
                out = {k: float(v[0]) for k, v in self._derive(S).items()}
        for k, col in self._logged.items():
            if s < col.n and col.m[s]:
                out[k] = float(col.a[s])
        return out

    def grad_norm(self, step: int | None = None) -> float:
        """Global gradient norm of row ``step`` (default: the current one), cheaply (no other
        channel is derived); NaN where no optimizer recorded a gradient in that row."""
        s = self._step if step is None else int(step)
        if not 0 <= s < self._stats.n:
            return _NAN
        g2, seen = 0.0, False
        for kind, v in self._stats.a[s, :, [_F_KIND, _F_G2]].T.tolist():  # plain floats: no numpy per call
            if kind >= _K_GRAD:
                g2, seen = g2 + v, True
        return math.sqrt(g2) if seen else _NAN

    def channels(self) -> list[str]:
        """Names of the ``step`` variables ``to_dataset`` returns, in order."""
        names = list(OPT_CHANNELS)
        if self._multi:
            names += [f"{ch}_{st.name}" for st in self._opts for ch in OPT_CHANNELS]
        return names + [k for k in self._logged if k not in names]

    def to_dataset(self):
        """All rows as an ``xarray.Dataset`` with dimension ``step`` (float64 channels).

        Optimizer channels are present (NaN) even before any update, so the schema
        does not depend on what happened. A logged scalar named like a channel
        replaces the computed value where it was logged.
        """
        import xarray as xr

        n = max([self._stats.n, *(c.n for c in self._logged.values())], default=0)
        st_a = self._stats.rows(n)[0]
        logged = {k: c.rows(n) for k, c in self._logged.items()}
        present = ~np.isnan(st_a[..., _F_KIND]).all(axis=1)  # some optimizer stepped
        for _, m in logged.values():
            present |= m
        steps = np.flatnonzero(present).astype(np.int64)
        derived = self._derive(st_a[steps])
        data_vars = {}
        for ch in self.channels():
            arr = derived.get(ch, np.full(len(steps), np.nan))
            if ch in logged:
                a, m = logged[ch]
                arr = np.where(m[steps], a[steps], arr)
            data_vars[ch] = ("step", np.asarray(arr, dtype=np.float64), {"long_name": self._long_name(ch)})
        coords: dict[str, Any] = {"step": ("step", steps, {"long_name": "optimizer update index"})}
        if self.per_layer and self._layer_names:
            for ch, tab in self._layers.items():
                data_vars[ch] = (("step", "layer"), tab.rows(n)[0][steps], {"long_name": LONG_NAMES[ch]})
            coords["layer"] = ("layer", np.array(self._layer_names, dtype=str))
        return xr.Dataset(data_vars, coords=coords, attrs={"monitor_every": self.every})

    # -- internals ----------------------------------------------------------------
    def _derive(self, S: np.ndarray) -> dict[str, np.ndarray]:
        """Channels of rows ``S`` (rows x optimizers x fields): global ones, with the
        primary's lr read by the first optimizer that stepped in the row, and per optimizer."""
        out = _derive(S, lr_field=_F_LRP)
        if self._multi:
            for i, st in enumerate(self._opts):
                for k, v in _derive(S[:, i:i + 1]).items():
                    out[f"{k}_{st.name}"] = v
        return out

    def _long_name(self, ch: str) -> str:
        if ch in LONG_NAMES:
            return LONG_NAMES[ch]
        for st in self._opts:
            suffix = "_" + st.name
            if ch.endswith(suffix) and ch[: -len(suffix)] in LONG_NAMES:
                return f"{LONG_NAMES[ch[: -len(suffix)]]} ({st.name})"
        return ch

    def _init_layers(self, model: Any) -> None:
        names: dict[int, str] = {}
        if isinstance(model, torch.nn.Module):
            mods = [("", model)]
        elif isinstance(model, Mapping):
            mods = [(f"{k}.", m) for k, m in model.items()]
        elif isinstance(model, Iterable):
            mods = [(f"m{i}.", m) for i, m in enumerate(model)]
        else:
            mods = []
        for prefix, m in mods:
            for n, p in m.named_parameters():
                names.setdefault(id(p), prefix + n)
        self._param_names = names  # also for parameters an optimizer gains later (add_param_group)
        for st in self._opts:
            for gi, g in enumerate(st.opt.param_groups):
                for pi, p in enumerate(g["params"]):
                    if id(p) not in self._layer_index:
                        self._layer_index[id(p)] = len(self._layer_names)
                        self._layer_names.append(names.get(id(p), f"{st.name}.g{gi}.p{pi}"))

    def _make_hook(self, st: _OptState, pre: bool):
        clock = time.perf_counter
        cost = self._cost  # [seconds in hooks, first hook entry, last hook exit, hook calls]

        def hook(optimizer, args, kwargs):
            t0 = clock()
            out = None
            if not self.enabled:
                if pre:  # keep counting updates so that `step` stays the update index
                    self._skip(st)
            elif pre:
                # args is (optimizer, *step args): torch passes the bound call's full arguments
                closure = args[1] if len(args) > 1 else kwargs.get("closure")
                if callable(closure):  # the gradient exists only once the closure ran: read it then
                    out = self._after_closure(st, closure, args, kwargs)
                else:
                    self._pre(st)
            else:
                if st.pending is not None and not st.pending[0]:  # the step never called its closure
                    self._skip(st)
                st.pending = None
                self._post(st)
            t1 = clock()
            cost[0] += t1 - t0
            if cost[1] < 0.0:
                cost[1] = t0
            cost[2] = t1
            cost[3] += 1
            return out
        return hook

    def _skip(self, st: _OptState) -> None:
        """An update the Monitor does not see: counted (``step`` stays the update index), nothing read."""
        self._open_row_if_needed(st)
        st.n += 1  # the next step's previous gradient is unknown
        st.params, st.measuring = [], False
        if st.adam is not None:  # unseen steps may skip parameters: recheck step counts
            st.adam.verified = False

    def _after_closure(self, st: _OptState, closure: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``opt.step(closure)``: the pre-hook runs before the closure computes the gradient, so the
        closure is wrapped to run the gradient pass right after its first call (before the step
        changes the parameters; LBFGS calls it again later, those calls pass through)."""
        fired = st.pending = [False]
        cost, clock = self._cost, time.perf_counter

        def wrapped():
            loss = closure()
            if not fired[0]:
                fired[0] = True
                t0 = clock()
                self._pre(st)
                cost[0] += clock() - t0
            return loss

        if len(args) > 1:
            return (args[0], wrapped, *args[2:]), kwargs
        return args, {**kwargs, "closure": wrapped}

    def cost(self) -> MonitorCost:
        """Wall time this Monitor spent inside its hooks so far, against the wall time since
        its first hook ran: what it costs *this* training loop. A lower bound: the cache
        misses it causes the rest of the step are not counted (the end-to-end ratio, Monitor
        on vs off, is measured by ``benchmarks/telemetry_overhead.py``)."""
        hook_s, first, last, calls = self._cost
        span = last - first if first >= 0.0 else 0.0
        return MonitorCost(hook_s=hook_s, span_s=span, fraction=hook_s / span if span > 0 else _NAN,
                           updates=self._step + 1, hook_calls=int(calls))

    def _open_row_if_needed(self, st: _OptState) -> None:
        if self._step < 0 or st.index in self._stepped:
            self._step += 1
            self._stepped = set()
        self._stepped.add(st.index)

    def _pre(self, st: _OptState) -> None:
        self._open_row_if_needed(st)
        st.order = len(self._stepped) - 1  # 0 for the first optimizer stepping in this row
        s = self._step
        st.n += 1
        k = st.n  # this optimizer's own step count: `every` and xgrad follow it, not the row
        # (TD3's delayed actor steps on every other row: by rows it would never be measured at
        # an even `every`, and its previous gradient would never be one row back)
        params = st.stepped_params()
        st.params = params
        st.measuring = st.kept = st.fused = False
        st.lr = _as_float(st.opt.param_groups[0]["lr"])
        st.lr_primary = st.lr if st.index == 0 else _as_float(self._opts[0].opt.param_groups[0]["lr"])
        if not params:
            rec, b = self._row_fields(st, s)
            rec[b + _F_KIND] = _K_NOPARAMS
            return
        ids = tuple(map(id, params))
        if st.adam is not None and st.adam.verified and ids != st.adam.ids:
            st.adam.verified = False  # some parameter's step count now lags: read them all again
        grads = [p.grad for p in params]
        if ids != st.special_key:  # sparse / complex: fixed per parameter, checked when the set changes
            st.special_key = ids
            st.special = any(p.is_complex() for p in params) or any(g.is_sparse for g in grads)
            if st.special:
                warnings.warn(f"Monitor: optimizer {st.name!r} steps sparse or complex gradients; only grad_norm "
                              "and lr are recorded for it", RuntimeWarning, stacklevel=4)
        st.gscale = _grad_scale(st.opt)
        if st.special:
            rec, b = self._row_fields(st, s)
            rec[b + _F_KIND], rec[b + _F_G2] = _K_GRAD, _special_g2(grads) / st.gscale**2
            return
        measure = k % self.every == 0
        keep = not measure and self.every > 1 and (k + 1) % self.every == 0  # for the next step's xgrad
        if self._fused_ok(st, params, grads, ids, measure):
            st.fused = True
            self.fused_steps += 1
            got = self._pre_fused(st, k, measure, keep)
        else:
            got = self._pre_torch(st, k, params, grads, ids, measure, keep)
        if got is not None:  # a step that reads only the gradient: its row is complete already
            g2, layer_g = got
            if st.gscale != 1.0:
                g2 /= st.gscale**2
                layer_g = [x / st.gscale for x in layer_g] if layer_g is not None else None
            rec, b = self._row_fields(st, s)
            rec[b + _F_KIND], rec[b + _F_G2] = _K_GRAD, g2
            if self.per_layer:
                self._store_layers(st, s, params, layer_g, None)
            if st.kept:
                st.prev_g2, st.prev_gscale = g2, st.gscale

    def _row_fields(self, st: _OptState, s: int) -> tuple[memoryview, int]:
        """The stats table (flat) and where ``st``'s fields of row ``s`` start, with the fields
        every step records (order in the row, lr, primary lr) written."""
        rec = self._stats.flat(s)
        b = (s * len(self._opts) + st.index) * _NF
        rec[b + _F_ORDER], rec[b + _F_LR], rec[b + _F_LRP] = st.order, st.lr, st.lr_primary
        return rec, b

    def _fused_ok(self, st: _OptState, params: list[torch.Tensor], grads: list[torch.Tensor],
                  ids: tuple[int, ...], measure: bool) -> bool:
        """Whether this step runs on the fused kernels (then their pointers are loaded into ``st``);
        ``measure``: the step reads the parameters too."""
        if self._kernels is None:
            return False
        st.prepare(params, ids)
        if _point(st, params, grads, weights=measure):
            return True
        if self.backend == "fused":
            raise RuntimeError(f"Monitor(backend='fused'): optimizer {st.name!r} steps parameters or gradients "
                               "that are not contiguous float32 CPU tensors; use backend='auto' or 'torch'")
        return False

    def _pre_fused(self, st: _OptState, k: int, measure: bool,
                   keep: bool) -> tuple[float, list[float] | None] | None:
        """The gradient pass of this optimizer's step ``k``; returns (||g||^2, per-tensor norms | None)
        where the step reads nothing else, None for a measured step (finished by the post-hook)."""
        K, a, n = self._kernels, st.addr, len(st.sizes)
        g_at = st.gptr.buffer_info()[0]
        if measure:
            gprev = st.row_addr[1 - st.slot] if st.prev_step == k - 1 else None
            K.grad(n, g_at, a["lens"], st.row_addr[st.slot], gprev, st.wptr.buffer_info()[0], st.row_addr[2],
                   a["out_g"])
            st.measuring = True
            return None
        K.grad(n, g_at, a["lens"], st.row_addr[st.slot] if keep else None, None, None, None, a["out_g"])
        layer_g = [math.sqrt(x) for x in st.out_g[0:3 * n:3]] if self.per_layer else None
        if keep:
            st.kept = True
            st.prev_step = k
            st.slot = 1 - st.slot
        return st.out_g[3 * n], layer_g

    def _pre_torch(self, st: _OptState, k: int, params: list[torch.Tensor], grads: list[torch.Tensor],
                   ids: tuple[int, ...], measure: bool, keep: bool) -> tuple[float, list[float] | None] | None:
        """As :meth:`_pre_fused`, by torch ops."""
        if not measure and not keep:
            norms = _grad_norms(grads).tolist()  # one transfer; summed in Python
            return math.fsum(x * x for x in norms), norms
        with torch.no_grad():  # hooks run in the caller's grad mode; copying a parameter must not be recorded
            st.prepare(params, ids, sizes=True)
            # copies by foreach (grads are new tensors each step: no cached flat views); the
            # dot products of a row right after writing it, while it is in cache
            torch._foreach_copy_(st.rows[st.slot], grads)
            if measure:
                g, out = st.buf[st.slot], st.out
                torch.dot(g, g, out=out[_G2])
                if st.prev_step == k - 1:
                    torch.dot(g, st.buf[1 - st.slot], out=out[_GPG])
                torch._foreach_copy_(st.rows[2], params)  # w_before
                w = st.buf[2]
                torch.dot(w, w, out=out[_W2])
                if self.per_layer:
                    st.layer_w = torch._foreach_norm(st.rows[2])
                st.measuring = True
                return None
            g = st.buf[st.slot]
            g2 = float(g.dot(g).item())
            st.kept = True
            st.prev_step = k
            st.slot = 1 - st.slot
            return g2, (_grad_norms(grads).tolist() if self.per_layer else None)

    def _post(self, st: _OptState) -> None:
        params, st.params = st.params, []
        if not st.measuring:  # the pre-hook recorded the row
            return
        s = self._step
        rec, b = self._row_fields(st, s)
        measured = self._measured_fused if st.fused else self._measured_torch
        g2, gpg, w2, u2, nug, adam, layer = measured(st, params)
        if st.gscale != 1.0 or st.prev_gscale != 1.0:  # statistics of the true gradient
            g2, gpg, nug = g2 / st.gscale**2, gpg / (st.gscale * st.prev_gscale), nug / st.gscale
            if layer is not None:
                layer = ([x / st.gscale for x in layer[0]], *layer[1:])
        rec[b + _F_KIND] = _K_FULL
        rec[b + _F_G2], rec[b + _F_GP2], rec[b + _F_GPG], rec[b + _F_W2] = g2, st.prev_g2, gpg, w2
        rec[b + _F_U2], rec[b + _F_UG], rec[b + _F_PREV] = u2, -nug, 1.0 if st.prev_step == st.n - 1 else 0.0
        if layer is not None:
            g_l, u_l, w_l = layer
            ratio = [u / w if w > 0 else _NAN for u, w in zip(u_l, w_l, strict=True)]
            self._store_layers(st, s, params, g_l, ratio)
        if adam is not None:
            bc1, bc2, m2, vsum, nbelow = adam
            rec[b + _F_KIND] = _K_ADAM
            rec[b + _F_M2], rec[b + _F_VSUM], rec[b + _F_NBELOW] = m2 / bc1**2, vsum / bc2, nbelow
            rec[b + _F_N] = float(st.buf.shape[1])
        st.prev_step = st.n
        st.prev_g2, st.prev_gscale = g2, st.gscale
        st.last_measured = s
        st.params_at_measure = params
        st.slot = 1 - st.slot

    def _measured_torch(self, st: _OptState, params: list[torch.Tensor]) -> tuple:
        """(g2, g.g_prev, w2, u2, -u.g, (bc1, bc2, m2, vsum, nbelow) | None, per-tensor norms | None)."""
        buf, res, out = st.buf, st.res, st.out
        neg_u = buf[2]
        with torch.no_grad():
            torch._foreach_sub_(st.rows[2], params)  # row 2: w_before - w_after = -u
            # separate dots: on CPU one memory-bound dot per pair is cheaper than a Gram matmul
            torch.dot(neg_u, neg_u, out=out[_U2])
            torch.dot(neg_u, buf[st.slot], out=out[_NUG])
            adam = _adam_stats(st, params, None)
            if self.per_layer:
                layer = [torch.stack(torch._foreach_norm(st.rows[st.slot])),
                         torch.stack(torch._foreach_norm(st.rows[2])), torch.stack(st.layer_w)]
                vals = torch.cat([res, *layer]).tolist()
            else:
                vals = res.tolist()  # the one host sync of this step
        norms = None
        if self.per_layer:
            P = len(params)
            norms = vals[_NRES:_NRES + P], vals[_NRES + P:_NRES + 2 * P], vals[_NRES + 2 * P:_NRES + 3 * P]
        if adam is not None:
            adam = (adam[0], adam[1], vals[_M2], vals[_VSUM], vals[_NBELOW])
        return vals[_G2], vals[_GPG], vals[_W2], vals[_U2], vals[_NUG], adam, norms

    def _measured_fused(self, st: _OptState, params: list[torch.Tensor]) -> tuple:
        """As :meth:`_measured_torch`, from the fused kernels (the gradient pass ran in the pre-hook)."""
        K, a, n = self._kernels, st.addr, len(st.sizes)
        if [p.data_ptr() for p in params] == st.w_list:  # the step updated the weights in place
            K.update(n, st.wptr.buffer_info()[0], a["lens"], st.row_addr[2], st.row_addr[st.slot], a["out_u"])
        else:
            with torch.no_grad():
                torch._foreach_sub_(st.rows[2], params)
            K.update(n, None, a["lens"], st.row_addr[2], st.row_addr[st.slot], a["out_u"])
        adam = _adam_stats(st, params, K)
        if adam is not None:
            bc1, bc2, mvb = adam
            if mvb is None:  # computed by torch ops (per-coordinate bias corrections, or state not fusable)
                vals = st.res.tolist()
                mvb = [vals[_M2], vals[_VSUM], vals[_NBELOW]]
            adam = (bc1, bc2, *mvb)
        g2, gpg, w2 = st.out_g[3 * n:3 * n + 3]
        u2, nug = st.out_u[2 * n:2 * n + 2]
        norms = None
        if self.per_layer:
            norms = tuple([math.sqrt(x) for x in out[k:k + m * n:m]]
                          for out, k, m in ((st.out_g, 0, 3), (st.out_u, 0, 2), (st.out_g, 2, 3)))
        return g2, gpg, w2, u2, nug, adam, norms

    def last_update(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        """The update applied to ``params`` in the current row (copies shaped like
        the parameters), or None when it was not measured in this row (``every``)."""
        where: dict[int, torch.Tensor] = {}
        for st in self._opts:
            if st.buf is None or st.last_measured != self._step:
                continue
            for p, neg_u in zip(st.params_at_measure, st.rows[2], strict=True):
                where[id(p)] = neg_u
        out = []
        for p, neg_u in ((p, where.get(id(p))) for p in params):
            if neg_u is None:
                return None
            out.append(neg_u.neg().to(p.dtype))
        return out

    def _store_layers(self, st: _OptState, s: int, params, g_l, ratio) -> None:
        if any(id(p) not in self._layer_index for p in params):
            self._add_layers(st, params)
        g_arr = self._layers["layer_grad_norm"].row(s)
        r_arr = self._layers["layer_update_ratio"].row(s)
        for j, p in enumerate(params):
            i = self._layer_index[id(p)]
            g_arr[i] = g_l[j]
            if ratio is not None:
                r_arr[i] = ratio[j]

    def _add_layers(self, st: _OptState, params) -> None:
        """Layer entries for parameters the optimizer gained after the Monitor attached
        (``add_param_group``, e.g. a layer unfrozen during fine-tuning); NaN in earlier rows."""
        for p in params:
            if id(p) not in self._layer_index:
                self._layer_index[id(p)] = len(self._layer_names)
                self._layer_names.append(self._param_names.get(id(p), f"{st.name}.added{len(self._layer_names)}"))
        for t in self._layers.values():
            t.widen(len(self._layer_names))


class _AdamCache:
    """Adam state tensors of the stepped parameters, looked up once.

    Adam (and AdamW, ...) update ``exp_avg`` / ``exp_avg_sq`` / ``step`` in place, so the
    tensor objects stay valid until the state is replaced (``load_state_dict``,
    ``state.clear()``), which :meth:`valid` detects cheaply. Betas and eps are read
    from the param groups on every step (perturbations such as ``beta2_shift`` change them).
    """

    def __init__(self, opt: torch.optim.Optimizer, params: list[torch.Tensor]):
        self.state_obj = opt.state
        self.n_state = len(opt.state)
        self.ok = False
        self.ms: list[torch.Tensor] = []
        self.vs: list[torch.Tensor] = []
        self.steps: list[Any] = []  # step tensors (updated in place), or None: read from the state dict
        self.groups: list[tuple[dict[str, Any], int, int]] = []  # (param group, first, end) in `params`
        self.ids: tuple[int, ...] = ()
        self.verified = False  # see common_count
        stepped = {id(p) for p in params}
        i = 0
        for g in opt.param_groups:
            if g.get("betas") is None or g.get("eps") is None:
                return
            start = i
            for p in g["params"]:
                if id(p) not in stepped:
                    continue
                sp = opt.state.get(p)
                if not sp or "exp_avg" not in sp or "exp_avg_sq" not in sp:
                    return
                self.ms.append(sp["exp_avg"])
                self.vs.append(sp["exp_avg_sq"])
                t = sp.get("step")
                self.steps.append(t if isinstance(t, torch.Tensor) else None)
                i += 1
            if i > start:
                self.groups.append((g, start, i))
        if i != len(params):
            return
        self.params = params
        self.ids = tuple(map(id, params))
        self.m_flat, self.v_flat = _flat_views(self.ms), _flat_views(self.vs)
        # for the fused kernels: pointer arrays (kept alive here) and their addresses, when every
        # m and v is a contiguous float32 CPU tensor of its parameter's size (the kernel reads that many)
        self.fused_addr: tuple[int, int] | None = None
        if all(t.is_cpu and t.dtype is _F32 and t.is_contiguous() and t.numel() == p.numel()
               for ts in (self.ms, self.vs) for t, p in zip(ts, params, strict=True)):
            self.mptr = array("Q", [m.data_ptr() for m in self.ms])
            self.vptr = array("Q", [v.data_ptr() for v in self.vs])
            self.fused_addr = (self.mptr.buffer_info()[0], self.vptr.buffer_info()[0])
        self.ok = True

    def flat_m(self) -> list[torch.Tensor]:
        return self.m_flat if self.m_flat is not None else [m.reshape(-1) for m in self.ms]

    def flat_v(self) -> list[torch.Tensor]:
        return self.v_flat if self.v_flat is not None else [v.reshape(-1) for v in self.vs]

    def valid(self, opt: torch.optim.Optimizer) -> bool:
        if opt.state is not self.state_obj or len(opt.state) != self.n_state:
            return False
        if not self.ok:
            return True
        # every entry, not only the first: resetting one parameter's moments (``del opt.state[p]``,
        # re-initialised layers) keeps the dict's size once the next step re-creates them
        state = opt.state
        for p, m, v, t in zip(self.params, self.ms, self.vs, self.steps, strict=True):
            sp = state.get(p)
            if sp is None or sp.get("exp_avg") is not m or sp.get("exp_avg_sq") is not v:
                return False
            if t is not None and sp.get("step") is not t:
                return False
        return True

    def _count(self, opt: torch.optim.Optimizer, j: int) -> float:
        t = self.steps[j]
        return _as_float(t) if t is not None else _as_float(opt.state[self.params[j]].get("step", 1))

    def step_counts(self, opt: torch.optim.Optimizer) -> list[float]:
        """Step count per stepped parameter (device tensors: the group's first count, no sync each)."""
        out = []
        for _, a, b in self.groups:
            first = self.steps[a]
            if first is not None and first.device.type != "cpu":
                out += [_as_float(first)] * (b - a)
            else:
                out += [self._count(opt, j) for j in range(a, b)]
        return out

    def common_count(self, opt: torch.optim.Optimizer) -> float | None:
        """The step count shared by every stepped parameter, or None when they differ.

        The counts are all read once; after they were found equal, and as long as every
        optimizer step since stepped exactly this set of parameters (``verified``, cleared by
        the Monitor when the set changes), they are still equal and one is read.
        """
        if self.verified:
            return self._count(opt, 0)
        ts = self.step_counts(opt)
        self.verified = all(t == ts[0] for t in ts)
        return ts[0] if self.verified else None


def _adam_stats(st: _OptState, params: list[torch.Tensor],
                K: kernels.Kernels | None) -> tuple[float, float, list[float] | None] | None:
    """||m||^2, sum(v) and #(v < eps^2 (1 - beta2^t)) of the stepped parameters, and the bias
    corrections (bc1, bc2) to apply to them; None when there is no Adam state.

    Returns ``(bc1, bc2, [m2, vsum, nbelow])`` from the fused kernels ``K`` where they can read
    the state, else ``(bc1, bc2, None)`` with the sums written into ``st.res`` by torch ops.
    sqrt(v_hat) < eps  <=>  v < eps^2 * bc2. When the parameters differ in (beta1, beta2,
    eps, t) the corrections are applied per coordinate instead (torch ops) and (1, 1) returned.
    """
    if st.adam is None or not st.adam.valid(st.opt):
        st.adam = _AdamCache(st.opt, params)
    ad = st.adam
    if not ad.ok:
        return None
    hps = [(_as_float(g["betas"][0]), _as_float(g["betas"][1]), _as_float(g["eps"])) for g, _, _ in ad.groups]
    t = ad.common_count(st.opt) if all(h == hps[0] for h in hps) else None
    per: list[tuple[float, float, float, float]] = []
    if t is None:
        ts = ad.step_counts(st.opt)
        per = [(*h, t_) for h, (_, a, b) in zip(hps, ad.groups, strict=True) for t_ in ts[a:b]]
    if not per and K is not None and ad.fused_addr is not None:
        b1, b2, e = hps[0]
        bc1, bc2 = 1.0 - b1**t, 1.0 - b2**t
        K.adam(len(params), *ad.fused_addr, st.addr["lens"], e * e * bc2, st.addr["out_a"])
        return bc1, bc2, st.out_a.tolist()
    out, x = st.out, st.buf[3]
    torch.cat(ad.flat_m(), out=x)  # state tensors persist: cached flat views, one kernel
    if per:
        x.mul_(_per_coord([1.0 / (1.0 - b1**t_) for b1, _, _, t_ in per], st.sizes, x.device))
    torch.dot(x, x, out=out[_M2])
    torch.cat(ad.flat_v(), out=x)
    if not per:
        b1, b2, e = hps[0]
        bc1, bc2 = 1.0 - b1**t, 1.0 - b2**t
        thr: float | torch.Tensor = e * e * bc2
    else:
        x.mul_(_per_coord([1.0 / (1.0 - b2**t_) for _, b2, _, t_ in per], st.sizes, x.device))
        bc1 = bc2 = 1.0
        thr = _per_coord([e * e for _, _, e, _ in per], st.sizes, x.device)
    torch.sum(x, 0, out=out[_VSUM])
    torch.lt(x, thr, out=x)  # 1.0 where below: counted by a float sum (a bool reduction is slower)
    torch.sum(x, 0, out=out[_NBELOW])
    return bc1, bc2, None


def _per_coord(values: list[float], sizes: list[int], device: torch.device) -> torch.Tensor:
    return torch.repeat_interleave(torch.tensor(values, dtype=torch.float32, device=device),
                                   torch.tensor(sizes, device=device))


def _derive(S: np.ndarray, lr_field: int = _F_LR) -> dict[str, np.ndarray]:
    """Channels from the statistics ``S`` (rows x optimizers x fields) summed over the
    optimizers that stepped in each row; ``lr`` is field ``lr_field`` (own lr, or the primary's
    lr as read at that step) of the first optimizer that stepped in the row."""
    kind = S[..., _F_KIND]
    with np.errstate(invalid="ignore", divide="ignore"):
        def tot(field: int, among: np.ndarray) -> np.ndarray:
            return np.where(among, S[..., field], 0.0).sum(1)

        def any_(among: np.ndarray) -> np.ndarray:
            return among.any(1)

        nan = np.full(len(S), np.nan)
        out = {ch: nan for ch in OPT_CHANNELS}
        with_g = kind >= _K_GRAD
        out["grad_norm"] = np.where(any_(with_g), np.sqrt(tot(_F_G2, with_g)), nan)
        full = kind >= _K_FULL
        g2, u2, w2, ug = (tot(f, full) for f in (_F_G2, _F_U2, _F_W2, _F_UG))
        has = any_(full)
        out["update_norm"] = np.where(has, np.sqrt(u2), nan)
        out["update_ratio"] = np.where(has & (w2 > 0), np.sqrt(u2) / np.sqrt(w2), nan)
        out["update_grad_cos"] = np.where(has & (u2 > 0) & (g2 > 0), -ug / np.sqrt(u2 * g2), nan)
        prev = full & (S[..., _F_PREV] == 1.0)
        g2p, gp2, gpg = (tot(f, prev) for f in (_F_G2, _F_GP2, _F_GPG))
        out["xgrad"] = np.where(any_(prev) & (g2p > 0) & (gp2 > 0), gpg / np.sqrt(g2p * gp2), nan)
        adam = kind == _K_ADAM
        n = tot(_F_N, adam)
        has = any_(adam)
        out["adam_m_norm"] = np.where(has, np.sqrt(tot(_F_M2, adam)), nan)
        out["adam_v_mean"] = np.where(has, tot(_F_VSUM, adam) / n, nan)
        out["adam_eps_frac"] = np.where(has, tot(_F_NBELOW, adam) / n, nan)
        stepped = ~np.isnan(kind)
        order = np.where(stepped, S[..., _F_ORDER], np.inf)
        first = stepped & (order == order.min(1, keepdims=True))
        out["lr"] = np.where(any_(stepped), tot(lr_field, first), nan)
    return out
