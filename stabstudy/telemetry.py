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
primary optimizer whenever it steps every round).

Call :meth:`Monitor.log` *after* ``optimizer.step()`` to attach scalars (loss,
perf, ...) to the step just taken (or pass ``step=mon.step + 1`` to log ahead).

Cost
----
With ``every=N`` only ``grad_norm`` and ``lr`` are computed on every step; the
other channels on steps divisible by N (NaN in between). All vector work is
done on detached flat buffers (``torch.cat(..., out=)``, one Gram matrix for the
dot products, ``torch._foreach_norm``), with one host sync per optimizer step.
Memory: four flat float32 copies of the stepped parameters per optimizer
(gradient, previous gradient, parameters before the update, update; Adam's v
is copied into the third after use). Adam channels read the optimizer state.

References: Molybog et al. 2023 (update/gradient cosine before Adam
instability); Kingma & Ba 2015 (Adam bias correction).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

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

#: Channels computed by the Monitor itself, in dataset order.
OPT_CHANNELS = ("grad_norm", "xgrad", "update_norm", "update_ratio", "update_grad_cos",
                "adam_m_norm", "adam_v_mean", "adam_eps_frac", "lr")

_NAN = float("nan")


def _as_float(x: Any) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def gradient_coherence(grads: Sequence[Sequence[torch.Tensor] | torch.Tensor]) -> float:
    """Microbatch gradient coherence ``||mean_k g_k||^2 / mean_k ||g_k||^2``.

    Args:
        grads: K microbatch gradients, each a flat tensor or a list of tensors
            (one per parameter, same layout for every k).

    Returns:
        A float in [1/K, 1]: 1 when all microbatch gradients agree, 1/K when they
        are orthogonal with equal norms (pure noise).
    """
    flat = [g if isinstance(g, torch.Tensor) else torch.cat([t.detach().reshape(-1) for t in g]) for g in grads]
    if not flat:
        raise ValueError("gradient_coherence needs at least one microbatch gradient")
    G = torch.stack([f.detach().float() for f in flat])  # (K, N)
    num = G.mean(0).pow(2).sum()
    den = G.pow(2).sum(1).mean()
    return float((num / den).item()) if float(den) > 0 else _NAN


class _OptState:
    """Per-optimizer flat buffers and bookkeeping."""

    def __init__(self, index: int, name: str, optimizer: torch.optim.Optimizer):
        self.index = index
        self.name = name
        self.opt = optimizer
        # rows: 0/1 gradient slots (current / previous), 2 w_before (then Adam v), 3 update
        self.buf: torch.Tensor | None = None
        self.key: tuple[tuple[int, int], ...] = ()
        self.views: list[torch.Tensor] = []  # flat views of the stepped parameters (track updates)
        self.sizes: list[int] = []
        self.slot = 0  # gradient slot of the current step
        self.prev_step = -10  # row index whose gradient sits in slot 1 - slot
        self.params: list[torch.Tensor] = []
        self.measuring = False
        self.pre: dict[str, Any] = {}
        self.last_measured = -1  # row whose update sits in buffer row 3
        self.params_at_measure: list[torch.Tensor] = []

    def stepped_params(self) -> list[torch.Tensor]:
        return [p for g in self.opt.param_groups for p in g["params"] if p.grad is not None]

    def prepare(self, params: list[torch.Tensor]) -> None:
        """(Re)build buffers and parameter views when the set of stepped parameters changes."""
        key = tuple((id(p), p.data_ptr()) for p in params)  # storage moves (model.to(...)) rebuild the views
        if key == self.key and self.buf is not None:
            return
        n = sum(p.numel() for p in params)
        self.buf = torch.zeros(4, n, dtype=torch.float32, device=params[0].device)
        self.views = [p.detach().view(-1) if p.is_contiguous() else p.detach() for p in params]
        self.sizes = [p.numel() for p in params]
        self.key = key
        self.prev_step = -10

    def flat_params(self) -> list[torch.Tensor]:
        return [v if v.dim() == 1 else v.reshape(-1) for v in self.views]


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

    def __init__(self, model: Any, optimizer: Any, *, every: int = 1, per_layer: bool = False):
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"every must be an integer >= 1, got {every!r}")
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
        for st in self._opts:
            self._handles.append(st.opt.register_step_pre_hook(self._make_hook(st, pre=True)))
            self._handles.append(st.opt.register_step_post_hook(self._make_hook(st, pre=False)))
        self._step = -1  # index of the current row (-1 before the first update)
        self._stepped: set[int] = set()
        self._rows: dict[int, dict[str, float]] = {}  # logged scalars
        self._suff: dict[int, dict[int, dict[str, float]]] = {}  # row -> optimizer -> statistics
        self._logged: dict[str, None] = {}  # logged channel names, in order of appearance
        self._layer_names: list[str] = []
        self._layer_index: dict[int, int] = {}
        self._layer_rows: dict[int, dict[str, np.ndarray]] = {}
        if per_layer:
            self._init_layers(model)

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
        row = self._rows.setdefault(s, {})
        for k, v in scalars.items():
            row[k] = _NAN if v is None else _as_float(v)
            self._logged.setdefault(k, None)

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
            st.buf = None
            st.views = []
            st.key = ()

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def row(self, step: int | None = None) -> dict[str, float]:
        """All channels of row ``step`` (default: the current one) as a dict, e.g.
        ``mon.row().get("grad_norm")`` right after ``optimizer.step()``."""
        s = self._step if step is None else int(step)
        return {**self._derive_row(s), **self._rows.get(s, {})}

    def channels(self) -> list[str]:
        """Names of the ``step`` variables ``to_dataset`` returns, in order."""
        names = list(OPT_CHANNELS)
        if self._multi:
            names += [f"{ch}_{st.name}" for st in self._opts for ch in OPT_CHANNELS]
        return names + [k for k in self._logged if k not in names]

    def to_dataset(self):
        """All rows as an ``xarray.Dataset`` with dimension ``step`` (float64 channels).

        Optimizer channels are present (NaN) even before any update, so the schema
        does not depend on what happened.
        """
        import xarray as xr

        steps = np.array(sorted(set(self._rows) | set(self._suff)), dtype=np.int64)
        derived = {int(s): self._derive_row(int(s)) for s in steps}
        data_vars = {}
        for ch in self.channels():
            arr = np.array([self._rows.get(int(s), {}).get(ch, derived[int(s)].get(ch, _NAN)) for s in steps],
                           dtype=np.float64)
            data_vars[ch] = ("step", arr, {"long_name": self._long_name(ch)})
        coords: dict[str, Any] = {"step": ("step", steps, {"long_name": "optimizer update index"})}
        if self.per_layer and self._layer_names:
            L = len(self._layer_names)
            for ch in ("layer_grad_norm", "layer_update_ratio"):
                arr = np.full((len(steps), L), np.nan)
                for i, s in enumerate(steps):
                    v = self._layer_rows.get(int(s), {}).get(ch)
                    if v is not None:
                        arr[i] = v
                data_vars[ch] = (("step", "layer"), arr, {"long_name": LONG_NAMES[ch]})
            coords["layer"] = ("layer", np.array(self._layer_names, dtype=str))
        return xr.Dataset(data_vars, coords=coords, attrs={"monitor_every": self.every})

    # -- internals ----------------------------------------------------------------
    def _derive_row(self, s: int) -> dict[str, float]:
        per_opt = self._suff.get(s)
        if not per_opt:
            return {}
        out = _derive(list(per_opt.values()))
        out["lr"] = next(iter(per_opt.values()))["lr_primary"]
        if self._multi:
            for i, suff in per_opt.items():
                name = self._opts[i].name
                for k, v in _derive([suff]).items():
                    out[f"{k}_{name}"] = v
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
        for st in self._opts:
            for gi, g in enumerate(st.opt.param_groups):
                for pi, p in enumerate(g["params"]):
                    if id(p) not in self._layer_index:
                        self._layer_index[id(p)] = len(self._layer_names)
                        self._layer_names.append(names.get(id(p), f"{st.name}.g{gi}.p{pi}"))

    def _make_hook(self, st: _OptState, pre: bool):
        def hook(optimizer, args, kwargs):
            if not self.enabled:
                if pre:  # keep counting updates so that `step` stays the update index
                    self._open_row_if_needed(st)
                return None
            if pre:
                self._pre(st)
            else:
                self._post(st)
            return None
        return hook

    def _open_row_if_needed(self, st: _OptState) -> None:
        if self._step < 0 or st.index in self._stepped:
            self._step += 1
            self._stepped = set()
        self._stepped.add(st.index)

    def _pre(self, st: _OptState) -> None:
        self._open_row_if_needed(st)
        s = self._step
        params = st.stepped_params()
        st.params = params
        st.measuring = False
        st.pre = {"lr": _as_float(st.opt.param_groups[0]["lr"]),
                  "lr_primary": _as_float(self._opts[0].opt.param_groups[0]["lr"])}
        if not params:
            return
        grads = [p.grad.detach().reshape(-1) for p in params]
        measure = s % self.every == 0
        keep_for_next = self.every > 1 and (s + 1) % self.every == 0
        if measure or keep_for_next:
            st.prepare(params)
            buf = st.buf
            torch.cat(grads, out=buf[st.slot])
            if measure:
                torch.cat(st.flat_params(), out=buf[2])
                st.measuring = True
                return
            st.pre["g2"] = buf[st.slot].dot(buf[st.slot])  # keep this gradient for the next xgrad
            st.prev_step = s
            st.slot = 1 - st.slot
            if self.per_layer:
                st.pre["layer_g"] = torch._foreach_norm(grads)
        else:
            norms = torch._foreach_norm(grads)
            st.pre["g2"] = torch.stack(norms).pow(2).sum()
            if self.per_layer:
                st.pre["layer_g"] = norms

    def _post(self, st: _OptState) -> None:
        s = self._step
        params, st.params = st.params, []
        suff: dict[str, float] = {"lr": st.pre["lr"], "lr_primary": st.pre["lr_primary"]}
        self._suff.setdefault(s, {})[st.index] = suff
        if not params:
            return
        if not st.measuring:
            layer_g = st.pre.get("layer_g")
            if layer_g is not None:
                vals = torch.cat([st.pre["g2"].reshape(1), torch.stack(layer_g)]).tolist()
                self._store_layers(s, params, vals[1:], None)
                suff["g2"] = vals[0]
            else:
                suff["g2"] = float(st.pre["g2"].item())
            return
        buf = st.buf
        g_row, gp_row = st.slot, 1 - st.slot
        torch.cat(st.flat_params(), out=buf[3])
        buf[3].sub_(buf[2])  # update u = w_after - w_before
        st.params_at_measure = params
        adam = _adam_info(st, params)
        R = 4
        gram = buf @ buf.T  # every needed dot product of (g slots, w_before, u) in one matmul
        pieces = [gram.reshape(-1)]
        if self.per_layer:  # before the w_before row is reused for v
            norms = [torch.stack(torch._foreach_norm(list(buf[r].split(st.sizes)))) for r in (g_row, 3, 2)]
            pieces.append(torch.cat(norms))
        if adam is not None:
            v = buf[2]
            torch.cat([x.reshape(-1) for x in adam["v"]], out=v)
            if adam["scale2"] is not None:
                v.mul_(adam["scale2"])
            vsum = v.sum()
            # count of v < thr without a bool tensor: sign(v - thr) clamped to {-1, 0}, summed
            below = v.sub_(adam["thr"]).sign_().clamp_(max=0).sum().neg()
            m_norms = torch.stack(torch._foreach_norm(adam["m"])).float()  # per tensor, no flat copy
            if adam["inv_bc1"] is not None:
                m_norms = m_norms * adam["inv_bc1"]
            pieces.append(torch.stack([vsum, below, m_norms.pow(2).sum()]))
        vals = torch.cat(pieces).tolist()  # the one host sync of this step
        suff.update(g2=vals[R * g_row + g_row], gp2=vals[R * gp_row + gp_row], gpg=vals[R * g_row + gp_row],
                    w2=vals[2 * R + 2], u2=vals[3 * R + 3], ug=vals[3 * R + g_row],
                    has_prev=1.0 if st.prev_step == s - 1 else 0.0)
        k = R * R
        if self.per_layer:
            P = len(params)
            g_l, u_l, w_l = vals[k:k + P], vals[k + P:k + 2 * P], vals[k + 2 * P:k + 3 * P]
            ratio = [u / w if w > 0 else _NAN for u, w in zip(u_l, w_l, strict=True)]
            self._store_layers(s, params, g_l, ratio)
            k += 3 * P
        if adam is not None:
            suff.update(m2=vals[k + 2] / adam["bc1"] ** 2, vsum=vals[k] / adam["bc2"],
                        nbelow=vals[k + 1], n=float(buf.shape[1]))
        st.prev_step = s
        st.last_measured = s
        st.slot = 1 - st.slot

    def last_update(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        """The update applied to ``params`` in the current row (copies shaped like
        the parameters), or None when it was not measured in this row (``every``)."""
        where: dict[int, torch.Tensor] = {}
        for st in self._opts:
            if st.buf is None or st.last_measured != self._step:
                continue
            for p, u in zip(st.params_at_measure, st.buf[3].split(st.sizes), strict=True):
                where[id(p)] = u
        out = []
        for p in params:
            u = where.get(id(p))
            if u is None:
                return None
            out.append(u.view(p.shape).to(p.dtype).clone())
        return out

    def _store_layers(self, s: int, params, g_l, ratio) -> None:
        L = len(self._layer_names)
        rec = self._layer_rows.setdefault(s, {})
        g_arr = rec.setdefault("layer_grad_norm", np.full(L, np.nan))
        r_arr = rec.setdefault("layer_update_ratio", np.full(L, np.nan))
        for j, p in enumerate(params):
            i = self._layer_index.get(id(p))
            if i is None:
                continue
            g_arr[i] = g_l[j]
            if ratio is not None:
                r_arr[i] = ratio[j]


def _adam_info(st: _OptState, params: list[torch.Tensor]) -> dict[str, Any] | None:
    """Adam moments of the stepped parameters and their bias corrections, or None.

    When every parameter shares (beta1, beta2, eps, t), the corrections are two
    Python scalars; otherwise per-coordinate scale vectors are built (slow path).
    """
    state = st.opt.state
    ms, vs, per = [], [], []
    for g in st.opt.param_groups:
        betas, eps = g.get("betas"), g.get("eps")
        if betas is None or eps is None:
            return None
        b1, b2, e = _as_float(betas[0]), _as_float(betas[1]), _as_float(eps)
        t_group = None
        for p in g["params"]:
            if p.grad is None:
                continue
            sp = state.get(p)
            if not sp or "exp_avg" not in sp or "exp_avg_sq" not in sp:
                return None
            step_t = sp.get("step", 1)
            if isinstance(step_t, torch.Tensor) and step_t.device.type != "cpu" and t_group is not None:
                t = t_group  # no device sync per parameter: the group's first step count
            else:
                t = t_group = _as_float(step_t)
            ms.append(sp["exp_avg"].detach())
            vs.append(sp["exp_avg_sq"].detach())
            per.append((b1, b2, e, t))
    if not ms or len(ms) != len(params):
        return None
    b1, b2, e, t = per[0]
    if all(x == per[0] for x in per):
        bc1, bc2 = 1.0 - b1**t, 1.0 - b2**t
        # sqrt(v / bc2) < eps  <=>  v < eps^2 * bc2
        return {"m": ms, "v": vs, "bc1": bc1, "bc2": bc2, "thr": e * e * bc2, "inv_bc1": None, "scale2": None}
    dev = st.buf.device
    sizes = torch.tensor(st.sizes, device=dev)
    inv_bc1 = torch.tensor([1.0 / (1.0 - a**t) for a, _, _, t in per], device=dev)
    s2 = torch.repeat_interleave(torch.tensor([1.0 / (1.0 - b**t) for _, b, _, t in per], device=dev), sizes)
    thr = torch.repeat_interleave(torch.tensor([x * x for _, _, x, _ in per], device=dev), sizes)
    return {"m": ms, "v": vs, "bc1": 1.0, "bc2": 1.0, "thr": thr, "inv_bc1": inv_bc1, "scale2": s2}


def _derive(suffs: list[dict[str, float]]) -> dict[str, float]:
    """Channels from the summed statistics of the optimizers stepped in one row."""
    def tot(key: str, among: list[dict[str, float]]) -> float:
        return float(sum(d[key] for d in among))

    out = {ch: _NAN for ch in OPT_CHANNELS}
    with_g = [d for d in suffs if "g2" in d]
    if with_g:
        out["grad_norm"] = math.sqrt(tot("g2", with_g))
    full = [d for d in suffs if "u2" in d]
    if full:
        g2, u2, w2, ug = (tot(k, full) for k in ("g2", "u2", "w2", "ug"))
        out["update_norm"] = math.sqrt(u2)
        out["update_ratio"] = math.sqrt(u2) / math.sqrt(w2) if w2 > 0 else _NAN
        out["update_grad_cos"] = -ug / math.sqrt(u2 * g2) if u2 > 0 and g2 > 0 else _NAN
        prev = [d for d in full if d.get("has_prev")]
        if prev:
            g2p, gp2, gpg = (tot(k, prev) for k in ("g2", "gp2", "gpg"))
            out["xgrad"] = gpg / math.sqrt(g2p * gp2) if g2p > 0 and gp2 > 0 else _NAN
        adam = [d for d in full if "m2" in d]
        if adam:
            n = tot("n", adam)
            out["adam_m_norm"] = math.sqrt(tot("m2", adam))
            out["adam_v_mean"] = tot("vsum", adam) / n
            out["adam_eps_frac"] = tot("nbelow", adam) / n
    if suffs:
        out["lr"] = suffs[0]["lr"]
    return out
