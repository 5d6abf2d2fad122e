"""Optimizer telemetry for any PyTorch training loop.

:class:`Monitor` attaches to one or several ``torch.optim.Optimizer`` objects
through ``register_step_pre_hook`` / ``register_step_post_hook``, so a training
loop needs no extra calls to record, per update:

===================== ========================================================
``grad_norm``         global L2 norm of the gradient as ``backward()`` produced it: before
                      clipping, unscaled, the whole accumulated gradient (every step)
``grad_norm_applied`` the same for the gradient the optimizer received (after clipping)
``xgrad``             gradient-direction coherence cos(g_t, g_{t-1})
``update_norm``       L2 norm of the applied update u = w_after - w_before
``update_ratio``      ||u|| / ||w_before||
``update_grad_cos``   cos(u, -g) (Molybog et al. 2023: -> 0 before Adam divergence)
``adam_m_norm``       ||m_hat||, bias-corrected Adam first moment
``adam_v_mean``       mean of v_hat, bias-corrected Adam second moment
``adam_eps_frac``     fraction of coordinates with sqrt(v_hat) < eps (bias-corrected)
``lr``                param_groups[0]['lr'] of the primary optimizer, as the step applied it
===================== ========================================================

The gradient before clipping, the learning rate applied
--------------------------------------------------------
Clipping (``clip_grad_norm_`` between ``backward()`` and ``step()``) would pin a norm read at the
step to the clip value: ``grad_norm`` is read where ``backward()`` left the gradient
(:mod:`.backward`: one read of the gradient per backward pass, no host sync), as the Hugging Face
Trainer logs it and ZClip and OLMo's spike rules judge it; ``grad_norm_applied`` is the norm the
optimizer received. Where nothing changed the gradient in between, both are the step's own norm.
Under a ``torch.amp.GradScaler`` pass ``scaler=``: ``backward()`` left the gradient scaled, and
its scale is divided out on the device (an optimizer that unscales inside its step, fused Adam,
tells its scale itself). ``before_clip=False`` reads the gradient at the step only
(``grad_norm`` is then ``grad_norm_applied``).

``lr`` is read once every pre-step hook has run: the Monitor's own (:meth:`Monitor.add_pre_step_hook`,
a :class:`~stabstudy.interventions.control.Controller` attached through it), then, when another
pre-hook was registered on the optimizer after the Monitor's (a Controller attached to the
optimizer directly), in the Monitor's post-hook, which runs before that hook's post-hook restores
the rate.

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

No host synchronisation per step
--------------------------------
The hooks compute with torch ops on the parameters' device and never read a result
back: the sums go by ``out=`` into a block of ``sync_every`` rows there, copied to the
host a block at a time (on CUDA without waiting, through pinned memory), and logged
device tensors are staged on the device the same way
(:mod:`stabstudy.instruments.telemetry.table`). Reading the data (``to_dataset``,
``row``, ``grad_norm``, ``close``) brings everything over first. Python numbers known
on the host (learning rates, Adam's step counts and betas) are read as such; a
learning rate, beta or eps held in a CUDA tensor is read with a sync.

Cost, precision, distribution
-----------------------------
With ``every=N`` only ``grad_norm`` and ``lr`` are computed on every step; the other channels
on each optimizer's own steps divisible by N (NaN in between). A measured step copies gradient
and parameters into flat rows (:mod:`.stats`, :mod:`.adam`; three rows the size of the stepped
parameters, float64 for a float64 model, else float32), or sketches them (``memory="sketch"``,
:mod:`.sketch`). DDP needs nothing; FSDP2 / DTensor-sharded sums are all-reduced in the hooks
(:mod:`.sharded`); rank 0 alone writes to ``writer``. Nothing is compiled at run time.
``benchmarks/telemetry_overhead.py`` measures the cost per step; :meth:`Monitor.cost` the time
inside the hooks of a live Monitor. Details: ``docs/monitor.md``.

References: Molybog et al. 2023 (update/gradient cosine before Adam
instability); Kingma & Ba 2015 (Adam bias correction).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.hooks import RemovableHandle

from stabstudy.instruments.telemetry import sharded, sketch, stats
from stabstudy.instruments.telemetry.adam import adam_stats
from stabstudy.instruments.telemetry.backward import BackwardRead, BackwardWatch, read_g2
from stabstudy.instruments.telemetry.channels import (
    LAYER_PARTS,
    NAN,
    ND,
    NH,
    DevField,
    HostField,
    Kind,
    MonitorCost,
    PreStepStats,
    canonical,
    gradient_coherence,
)
from stabstudy.instruments.telemetry.layers import LayerIndex
from stabstudy.instruments.telemetry.sink import WriterSink
from stabstudy.instruments.telemetry.state import OptState, as_float, stat_dtype
from stabstudy.instruments.telemetry.table import Block, HostCopies, LogStage, Table
from stabstudy.instruments.telemetry.views import MonitorViews


class Monitor(MonitorViews):
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
        sync_every: rows per device block: the statistics stay on the parameters'
            device and are copied to the host once per this many rows (and when read).
        writer: TensorBoard's ``SummaryWriter``, :mod:`~stabstudy.instruments.telemetry.loggers`'
            ``WandbWriter`` or ``MLflowWriter``, or anything with ``add_scalar(tag, value, global_step)``
            or ``log_row(step, values)``: every channel goes to it as ``stability/<channel>`` at
            step = the row, a block of rows at a time (:mod:`~stabstudy.instruments.telemetry.sink`).
        memory: ``"exact"`` (default: flat copies of the gradient and parameters, three rows the
            size of the parameters) or ``"sketch"``: k-dimensional count-sketches instead, for
            large models; norms and Adam channels stay exact, ``xgrad``, ``update_grad_cos`` and
            ``update_norm`` are estimates (:mod:`~stabstudy.instruments.telemetry.sketch`).
        sketch_dim: k, a power of two (``memory="sketch"``): standard error ~1/sqrt(k) on a cosine.
        sketch_seed: seed of the sketch's random signs (each optimizer adds its index).
        before_clip: record ``grad_norm`` as ``backward()`` left the gradient, before clipping
            (one read of the gradient per backward pass; see the module docstring); False: at the step.
        scaler: the loop's ``torch.amp.GradScaler``, whose scale ``backward()`` left in the gradient
            (divided out of ``grad_norm`` where the gradient was unscaled before the step).

    Adam channels are read from ``optimizer.state[p]["exp_avg"|"exp_avg_sq"|"step"]``
    (Adam, AdamW, and any optimizer storing the same keys) and are bias-corrected:
    m_hat = m / (1 - beta1^t), v_hat = v / (1 - beta2^t); ``adam_eps_frac`` counts
    coordinates with sqrt(v_hat) < eps. Other optimizers (SGD, ...) give NaN there.

    Pre-step view: :meth:`add_pre_step_hook` registers ``fn(optimizer, stats)``, called inside
    the optimizer's step pre-hook once the Monitor has read the gradient and before the
    update lands, with a :class:`PreStepStats` (``stats.grad_norm`` and ``stats.grad_norm_applied``:
    0-d device tensors, what this row records as ``grad_norm`` and ``grad_norm_applied`` for that
    optimizer; ``stats.grad_norm_float()`` syncs only when called). A controller can skip or scale
    the step there, e.g. by scaling the gradients in place; the row records the gradient as it
    was read, and the learning rate as the step applies it (read after these hooks).

    Example::

        mon = Monitor(model, opt)
        for x, y in loader:
            opt.zero_grad(); loss = f(model(x), y); loss.backward(); opt.step()
            mon.log(loss=loss)            # a tensor: no host sync, copied in blocks
        ds = mon.to_dataset(); mon.close()
    """

    def __init__(self, model: Any, optimizer: Any, *, every: int = 1, per_layer: bool = False,
                 sync_every: int = 64, writer: Any = None, memory: str = "exact", sketch_dim: int = 4096,
                 sketch_seed: int = 0, before_clip: bool = True, scaler: Any = None):
        for name, v in (("every", every), ("sync_every", sync_every)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if memory not in sketch.MEMORY_MODES:
            raise ValueError(f"memory must be one of {', '.join(map(repr, sketch.MEMORY_MODES))}, got {memory!r}")
        if memory == "sketch":
            if not isinstance(sketch_dim, int) or isinstance(sketch_dim, bool) or sketch_dim < 16 or \
                    sketch_dim & (sketch_dim - 1):
                raise ValueError(f"sketch_dim must be a power of two >= 16, got {sketch_dim!r}")
            if per_layer:
                raise ValueError("per_layer=True needs memory='exact' (the sketch has no per-tensor rows)")
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
        self.memory, self.sketch_dim, self.sketch_seed = memory, sketch_dim, int(sketch_seed)
        self._sketch = memory == "sketch"
        self.sync_every = sync_every
        self.enabled = True
        self._opts = [OptState(i, str(n), o) for i, (n, o) in enumerate(named)]
        self._multi = len(self._opts) > 1
        self._handles: list[Any] = []
        # an OrderedDict: RemovableHandle keeps a weak reference to it
        self._pre_step_hooks: OrderedDict[int, Callable[[torch.optim.Optimizer, PreStepStats], Any]] = OrderedDict()
        self._cost = [0.0, -1.0, -1.0, 0]  # see cost(); a list: the hooks update it in place
        if scaler is not None and not callable(getattr(scaler, "_get_scale_async", None)):
            raise TypeError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        self.scaler = scaler
        for st in self._opts:
            pre_hook, post_hook = self._make_hooks(st)
            pre = st.opt.register_step_pre_hook(pre_hook)
            st.pre_id = pre.id
            self._handles += [pre, st.opt.register_step_post_hook(post_hook)]
        self.before_clip = bool(before_clip)
        self._watch = BackwardWatch((p for st in self._opts for g in st.opt.param_groups for p in g["params"]),
                                    self._read_backward) if self.before_clip else None
        self._step = -1  # index of the current row (-1 before the first update)
        self._stepped: set[int] = set()
        self._host = Table((len(self._opts), NH))  # row -> optimizer -> host fields (HostField)
        self._dev = Table((len(self._opts), ND))  # row -> optimizer -> device fields (DevField), as copied
        self._logged: dict[str, Table] = {}  # logged scalars by name, in order of appearance
        self._names: dict[str, dict[int, str]] = {}  # logged channels whose codes name something (name_codes)
        self._arrived = [0] * len(self._opts)  # per optimizer: its device rows before this one are on the host
        self._copies = HostCopies()
        self._staged = LogStage(self._copies, self._put_logged, capacity=4 * sync_every)
        self.rank, self.world_size = sharded.rank()
        # every rank records the same rows (DDP: replicated; FSDP2: all-reduced): one writes them
        self._sink = WriterSink(writer) if writer is not None and self.rank == 0 else None
        self._li = LayerIndex(model, self._opts) if per_layer else None

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

        New channel names may appear at any time: earlier rows read NaN. A one-element
        tensor on a GPU is copied on the device (no host sync) and reaches the host with the
        next block; other tensors are read with ``.item()``. Call after ``optimizer.step()``.
        Nothing is recorded while ``enabled`` is False (updates are still counted, so
        ``step`` stays the update index).
        """
        if not self.enabled:
            return
        s = max(self._step, 0) if step is None else int(step)
        if s < 0:
            raise ValueError(f"step must be >= 0, got {step!r}")
        for k, v in scalars.items():
            if isinstance(v, torch.Tensor) and v.device.type != "cpu":
                if k not in self._logged:
                    self._logged[k] = Table(masked=True)
                self._staged.add(s, k, v)
            else:
                self._put_logged(s, k, NAN if v is None else as_float(v))

    def microbatch_coherence(self, grads: Sequence[Sequence[torch.Tensor] | torch.Tensor],
                             step: int | None = None) -> float:
        """Compute :func:`gradient_coherence` of K microbatch gradients, log it as
        ``grad_coherence`` (current row, or row ``step``) and return it."""
        c = gradient_coherence(grads)
        self.log(step=step, grad_coherence=c)
        return c

    def add_pre_step_hook(self, fn: Callable[[torch.optim.Optimizer, PreStepStats], Any]) -> RemovableHandle:
        """Call ``fn(optimizer, stats)`` in each attached optimizer's step pre-hook, after the
        Monitor read the gradient and before the update (steps with gradients, while enabled);
        ``stats`` is a :class:`PreStepStats`. Its time is not counted in :meth:`cost`.
        Returns a handle whose ``remove()`` unregisters ``fn``."""
        handle = RemovableHandle(self._pre_step_hooks)
        self._pre_step_hooks[handle.id] = fn
        return handle

    def close(self) -> None:
        """Remove the hooks and free the buffers (recorded data stays available)."""
        self._sync()
        if self._sink is not None:
            self._sink.finish(self)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._watch is not None:
            self._watch.remove()
        for st in self._opts:
            st.free()

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        # what is known on the host, without reading the device: no sync
        opts = ", ".join(f"{st.name}: {type(st.opt).__name__}" for st in self._opts)
        state = "attached" if self._handles else "closed"
        extra = "".join(f", {k}={v!r}" for k, v in (("per_layer", self.per_layer), ("memory", self.memory))
                        if v != {"per_layer": False, "memory": "exact"}[k])
        return (f"Monitor({opts}; every={self.every}{extra}, before_clip={self.before_clip}; "
                f"{self._step + 1} updates, {len(self.channels())} channels; {state})")

    def last_update(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        """The update applied to ``params`` in the current row (copies shaped like
        the parameters), or None when it was not measured in this row (``every``)."""
        where: dict[int, torch.Tensor] = {}
        for st in self._opts:
            if st.flat is None or st.last_measured != self._step:
                continue
            for p, neg_u in zip(st.params_at_measure, stats.update_views(st), strict=True):
                where[id(p)] = neg_u
        out = []
        for p, neg_u in ((p, where.get(id(p))) for p in params):
            if neg_u is None:
                return None
            out.append(neg_u.neg().to(p.dtype))
        return out

    def memory_bytes(self) -> int:
        """Bytes of the tensors this Monitor holds on the parameters' devices: per optimizer its
        flat rows (``memory="exact"``) or sketches (``"sketch"``) and its device block."""
        total = 0
        for st in self._opts:
            if st.flat is not None:
                total += st.flat.buf.numel() * st.flat.buf.element_size()
            if st.sk is not None:
                total += st.sk.nbytes()
            if st.block is not None:
                total += st.block.t.numel() * st.block.t.element_size()
        return total

    def cost(self) -> MonitorCost:
        """Wall time this Monitor spent inside its hooks so far, against the wall time since
        its first hook ran: what it costs *this* training loop. A lower bound: the cache
        misses it causes the rest of the step are not counted (the end-to-end ratio, Monitor
        on vs off, is measured by ``benchmarks/telemetry_overhead.py``)."""
        hook_s, first, last, calls = self._cost
        span = last - first if first >= 0.0 else 0.0
        return MonitorCost(hook_s=hook_s, span_s=span, fraction=hook_s / span if span > 0 else NAN,
                           updates=self._step + 1, hook_calls=int(calls))

    # -- storage ------------------------------------------------------------------
    def _put_logged(self, row: int, name: str, value: float) -> None:
        col = self._logged.get(name)
        if col is None:
            col = self._logged[name] = Table(masked=True)
        col.put(row, value)

    def _sync(self) -> None:
        """Bring every row and staged value to the host tables (waits for the copies)."""
        for st in self._opts:
            if st.block is not None and st.block.dirty:
                self._send(st.block, st.index)
        self._staged.send_all()
        self._copies.drain(wait=True)
        if self._sink is not None:
            self._sink.flush(self, self._step)

    def _send(self, blk: Block, i: int) -> None:
        """Start the copy of optimizer ``i``'s block rows to the host tables."""
        base, n, L = blk.base, blk.used, blk.layers
        blk.dirty = False

        def apply(a: np.ndarray) -> None:
            self._dev.grow(base + n - 1)
            D = a[:, :ND].astype(np.float64)
            canonical(D, self._host.a[base:base + n, i, :])
            self._dev.a[base:base + n, i, :] = D
            self._arrived[i] = max(self._arrived[i], base + n)
            for j, part in enumerate(LAYER_PARTS if L else ()):
                tab = self._li.tables[part]
                tab.grow(base + n - 1)
                seg = a[:, ND + j * L:ND + (j + 1) * L]  # NaN in other optimizers' layers
                np.copyto(tab.a[base:base + n, :L], seg, where=~np.isnan(seg))

        self._copies.start(blk.t[:n], apply)

    def _block_row(self, st: OptState, s: int, device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
        """The device-field views of row ``s`` in ``st``'s block, starting a new block (and the
        copy of the full one) when the row is past it."""
        blk = st.block
        need = st.layers.end if self.per_layer else 0
        if blk is None or not blk.covers(s, need) or blk.t.device != device or blk.t.dtype != dtype:
            if blk is not None and blk.dirty:
                self._send(blk, st.index)
            if self._sink is not None:
                self._staged.send_all()  # the logged values of the rows the writer gets next
            self._copies.drain(wait=False)
            if self._sink is not None and not self._copies.pending:  # rows before s are closed
                self._sink.flush(self, s)
            if blk is None or blk.layers < need or blk.t.device != device or blk.t.dtype != dtype:
                L = len(self._li.names) if self._li is not None else 0
                blk = st.block = Block(device, self.sync_every, L, dtype)
            else:
                blk.reset(s)
            blk.base = s
        return blk.fields(s)

    # -- internals ----------------------------------------------------------------
    def _make_hooks(self, st: OptState) -> tuple[Callable[..., Any], Callable[..., Any]]:
        """``st``'s optimizer step pre- and post-hook; they time themselves (:meth:`cost`)."""
        clock = time.perf_counter
        cost = self._cost  # [seconds in hooks, first hook entry, last hook exit, hook calls]

        def spent(t0: float) -> None:
            t1 = clock()
            cost[0] += t1 - t0
            if cost[1] < 0.0:
                cost[1] = t0
            cost[2] = t1
            cost[3] += 1

        def pre_hook(optimizer, args, kwargs):
            t0 = clock()
            if not self.enabled:  # keep counting updates so that `step` stays the update index
                self._skip(st)
                return spent(t0)
            # args is (optimizer, *step args): torch passes the bound call's full arguments
            closure = args[1] if len(args) > 1 else kwargs.get("closure")
            if callable(closure):  # the gradient exists only once the closure ran: read it then
                out = self._after_closure(st, closure, args, kwargs)
                spent(t0)
                return out
            stats.without_grad(self._pre, st)
            spent(t0)
            if self._pre_step_hooks:
                self._run_pre_step_hooks(st)
            self._read_lr(st, late=False)

        def post_hook(optimizer, args, kwargs):
            t0 = clock()
            cur = st.cur
            if self.enabled:
                if cur.pending is not None and not cur.pending[0]:  # the step never called its closure
                    self._skip(st)
                cur.pending = None
                if cur.lr_late:
                    self._read_lr(st, late=True)
                if cur.measuring:  # else the pre-hook recorded the row
                    stats.without_grad(self._post, st)
                cur.params, cur.stepped = [], []
            spent(t0)

        return pre_hook, post_hook

    def _run_pre_step_hooks(self, st: OptState) -> None:
        cur = st.cur
        if cur.g2 is None:  # no gradient read (the optimizer steps no parameter)
            return
        applied = cur.g2.sqrt()
        seen = PreStepStats(name=st.name, step=self._step, grad_norm=applied if cur.raw is None else cur.raw.sqrt(),
                            grad_norm_applied=applied)
        for fn in list(self._pre_step_hooks.values()):
            fn(st.opt, seen)

    def _read_lr(self, st: OptState, late: bool) -> None:
        """Record the learning rates of ``st``'s step in the current row: now, once the pre-step
        hooks ran, or (``late=False`` while a pre-hook registered after the Monitor's may still
        change them) in the post-hook, before that hook's own post-hook restores them."""
        cur = st.cur
        if not late:
            hooks = st.opt._optimizer_step_pre_hooks
            if hooks and next(reversed(hooks)) != st.pre_id:
                cur.lr_late = True
                return
        cur.lr_late = False
        rec, b = self._host.flat(self._step), (self._step * len(self._opts) + st.index) * NH
        rec[b + HostField.LR] = lr = as_float(st.opt.param_groups[0]["lr"])
        rec[b + HostField.LRP] = lr if st.index == 0 else as_float(self._opts[0].opt.param_groups[0]["lr"])

    def _read_backward(self) -> None:
        """The end of a backward pass (:class:`~.backward.BackwardWatch`): each optimizer's gradient
        as the pass left it, read once on the device (not for sharded, sparse or complex gradients)."""
        if not self.enabled:
            return
        t0 = time.perf_counter()
        for st in self._opts:
            params = st.stepped_params()
            if not params:
                st.bw = None
                continue
            ids = tuple(map(id, params))
            grads = [p.grad for p in params]
            if ids != st.special_key:
                stats.check_params(st, params, grads, ids, self._li is not None, self._sketch)
                st.raw_g2 = None  # another parameter set: its dtype may differ
            if st.group is not None or st.special:
                st.bw = None
                continue
            if st.raw_g2 is None or st.raw_g2.device != grads[0].device:  # model.to(): same parameters, moved
                st.raw_g2 = torch.zeros((), dtype=stat_dtype(params), device=grads[0].device)
            stats.without_grad(lambda st, grads=grads: read_g2(grads, st.raw_g2), st)  # a create_graph gradient
            st.bw = BackwardRead(st.raw_g2, grads, [g._version for g in grads])
        self._cost[0] += time.perf_counter() - t0

    def _put_raw(self, st: OptState, dv: list[torch.Tensor], raw: torch.Tensor, rec: memoryview, b: int) -> None:
        """Record ``raw`` (||g||^2 as the backward pass left it) in the row, with a loss scale divided out:
        the optimizer's own (it unscales inside its step) or the ``scaler``'s."""
        out = dv[DevField.RAW]
        out.copy_(raw)
        inv = st.cur.inv
        if inv is None and self.scaler is not None and self.scaler.is_enabled():
            scale = self.scaler._get_scale_async()
            inv = None if scale is None else scale.detach().to(out.device, out.dtype).reciprocal()
        if inv is not None:
            out.mul_(inv * inv)
        rec[b + HostField.RAW] = 1.0
        st.cur.raw = out

    def _skip(self, st: OptState) -> None:
        """An update the Monitor does not see: counted (``step`` stays the update index), nothing read."""
        self._open_row_if_needed(st)
        st.n += 1  # the next step's previous gradient is unknown
        st.cur.params, st.cur.measuring = [], False
        if st.adam is not None:  # unseen steps may skip parameters: recheck step counts
            st.adam.verified = False

    def _after_closure(self, st: OptState, closure: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``opt.step(closure)``: the pre-hook runs before the closure computes the gradient, so the
        closure is wrapped to run the gradient pass right after its first call (before the step
        changes the parameters; LBFGS calls it again later, those calls pass through)."""
        fired = st.cur.pending = [False]
        cost, clock = self._cost, time.perf_counter

        def wrapped():
            loss = closure()
            if not fired[0]:
                fired[0] = True
                t0 = clock()
                stats.without_grad(self._pre, st)
                cost[0] += clock() - t0
                if self._pre_step_hooks:
                    self._run_pre_step_hooks(st)
                self._read_lr(st, late=False)
            return loss

        if len(args) > 1:
            return (args[0], wrapped, *args[2:]), kwargs
        return args, {**kwargs, "closure": wrapped}

    def _open_row_if_needed(self, st: OptState) -> None:
        if self._step < 0 or st.index in self._stepped:
            self._step += 1
            self._stepped = set()
        self._stepped.add(st.index)

    def _pre(self, st: OptState) -> None:
        self._open_row_if_needed(st)
        cur, prev = st.cur, st.prev
        s = self._step
        st.n += 1
        k = st.n  # this optimizer's own step count: `every` and xgrad follow it, not the row
        # (TD3's delayed actor steps on every other row: by rows it would never be measured at
        # an even `every`, and its previous gradient would never be one row back)
        params = st.stepped_params()
        cur.params, cur.stepped, cur.measuring, cur.g2, cur.raw = params, params, False, None, None
        bw, st.bw = st.bw, None  # the backward pass's read serves this step only (and holds its gradients)
        # the host fields every step records: its order in the row (0: the first optimizer stepping
        # in it); its learning rates once the pre-step hooks ran (_read_lr)
        rec, b = self._host.flat(s), (s * len(self._opts) + st.index) * NH
        rec[b + HostField.ORDER] = len(self._stepped) - 1
        if not params:
            rec[b + HostField.KIND] = Kind.NOPARAMS
            return
        ids = tuple(map(id, params))
        if st.adam is not None and st.adam.verified and ids != st.adam.ids:
            st.adam.verified = False  # some parameter's step count now lags: read them all again
        grads = [p.grad for p in params]
        raw = bw.g2 if bw is not None and bw.changed(grads) else None  # else the step's own norm is it
        stats.check_params(st, params, grads, ids, self._li is not None, self._sketch)
        if st.group is not None:  # sharded: the sums run over the local shards, then are all-reduced
            params, grads = sharded.local(params), sharded.local(grads)
            cur.params = params
        if self._li is not None:
            self._li.columns(st, params, ids)
        cur.inv = stats.grad_scale(st.opt)
        if self._sketch and not st.special:
            self._pre_sketch(st, s, k, params, grads, ids, rec, b, raw)
            return
        # the flat buffer (and the block, in its dtype) before the first sum; special gradients
        # have none (complex values do not fit a real buffer)
        fb = None if st.special else st.prepare(params, ids)
        if fb is not None and fb.n_total < 0:
            fb.n_total = fb.N if st.group is None else sharded.total(fb.N, st.group, params[0].device)
        dv = self._block_row(st, s, params[0].device, torch.float32 if fb is None else fb.buf.dtype)
        cur.g2 = dv[DevField.G2]
        rec[b + HostField.KIND] = Kind.GRAD
        if raw is not None:
            self._put_raw(st, dv, raw, rec, b)
        lg = st.block.layer(s, 0) if self.per_layer else None
        if st.special:
            stats.special_g2(grads, dv[DevField.G2])
            if cur.inv is not None:
                dv[DevField.G2].mul_(cur.inv * cur.inv)
            if st.group is not None:
                sharded.all_reduce_(st.block.pre_fields(s), st.group)
            return
        measure = k % self.every == 0
        if not measure:
            stats.grad_only(st, grads, dv, lg)
            if st.group is not None:
                sharded.all_reduce_(st.block.pre_fields(s), st.group)
            if (k + 1) % self.every == 0:  # keep it for the next step's xgrad
                prev.keep(k, s, cur.inv)
            return
        linked = prev.step == k - 1
        stats.before_update(st, params, grads, dv, st.block.pairs(s)[0], linked, self.per_layer)
        if st.group is not None:
            sharded.all_reduce_(st.block.pre_fields(s), st.group)
        rec[b + HostField.SLOT] = prev.slot
        cur.g2 = dv[prev.slot]
        if linked:
            rec[b + HostField.PREV] = prev.row
        cur.measuring = True

    def _pre_sketch(self, st: OptState, s: int, k: int, params: list[torch.Tensor], grads: list[torch.Tensor],
                    ids: tuple[int, ...], rec: memoryview, b: int, raw: torch.Tensor | None) -> None:
        """``memory="sketch"``: the pre-hook with sketches instead of flat copies (the fields are
        written in canonical order: slot 0)."""
        cur, prev, sk = st.cur, st.prev, st.sk
        if sk is None or not sk.fits(params, ids):
            sk = st.sk = sketch.SketchState(params, ids, self.sketch_dim, self.sketch_seed + st.index)
            prev.step, st.adam = -10, None
        dv = self._block_row(st, s, params[0].device, sk.rows.dtype)
        cur.g2 = dv[DevField.G2]
        rec[b + HostField.KIND] = Kind.GRAD
        if raw is not None:
            self._put_raw(st, dv, raw, rec, b)
        measure, keep, linked = k % self.every == 0, (k + 1) % self.every == 0, prev.step == k - 1
        sketch.pre(st, sk, grads, params, dv, measure, keep, linked)
        if not measure:
            if keep:
                sketch.keep_g2(sk, dv)
                prev.keep(k, s, cur.inv)
            return
        rec[b + HostField.SLOT] = 0.0
        if linked:
            rec[b + HostField.PREV] = prev.row
        cur.measuring = True

    def _post(self, st: OptState) -> None:
        cur = st.cur
        params, stepped = cur.params, cur.stepped
        s = self._step
        rec, b = self._host.flat(s), (s * len(self._opts) + st.index) * NH
        blk = st.block
        dv = blk.fields(s)
        layers = tuple(blk.layer(s, j) for j in range(len(LAYER_PARTS))) if self.per_layer else None
        if st.sk is not None and self._sketch:
            sketch.post(st, st.sk, params, dv)
            adam = sketch.adam_stats(st, st.sk, stepped, dv)
            sketch.keep_g2(st.sk, dv)
            n_total = st.sk.cs.N
        else:
            stats.after_update(st, params, dv, blk.pairs(s)[1], layers)
            adam = adam_stats(st, stepped, dv)
            n_total = st.flat.n_total
        if st.group is not None:
            sharded.all_reduce_(blk.post_fields(s), st.group)
        rec[b + HostField.KIND] = Kind.FULL
        if adam is not None:
            rec[b + HostField.KIND] = Kind.ADAM
            rec[b + HostField.BC1], rec[b + HostField.BC2], rec[b + HostField.N] = adam[0], adam[1], float(n_total)
        st.prev.keep(st.n, s, cur.inv)
        st.last_measured = s
        st.params_at_measure = params
