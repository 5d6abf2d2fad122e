"""Adam's moments for the Monitor: the state tensors, looked up once, and the sums read from them.

``adam_m_norm``, ``adam_v_mean`` and ``adam_eps_frac`` need ||m||^2, sum(v) and the number of
coordinates with sqrt(v_hat) < eps of the stepped parameters, bias-corrected with each
parameter's own step count t: m_hat = m / (1 - beta1^t), v_hat = v / (1 - beta2^t), and
sqrt(v_hat) < eps  <=>  v < eps^2 (1 - beta2^t). When every stepped parameter shares
(beta1, beta2, eps, t), the sums are taken raw on the device and the corrections applied on
the host; otherwise (param groups with other betas, step counts that drifted apart, step
counts held on a GPU as by ``capturable`` or ``fused`` Adam) they are applied per
coordinate on the device.
"""

from __future__ import annotations

from typing import Any

import torch

from stabstudy.instruments.telemetry import sharded
from stabstudy.instruments.telemetry.channels import DevField
from stabstudy.instruments.telemetry.state import OptState, as_float


def flat_views(ts: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """1-D views of ``ts`` for ``torch.cat(..., out=)`` (one kernel, where a foreach copy
    dispatches once per tensor), or None when one is not contiguous (reshape copies then)."""
    return [t.detach().view(-1) for t in ts] if all(t.is_contiguous() for t in ts) else None


class AdamCache:
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
        self.m_src: list[torch.Tensor] = []  # the state's tensors (DTensors where sharded)
        self.v_src: list[torch.Tensor] = []
        self.ms: list[torch.Tensor] = []  # their local shards, what the sums read
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
                self.m_src.append(sp["exp_avg"])
                self.v_src.append(sp["exp_avg_sq"])
                t = sp.get("step")
                self.steps.append(t if isinstance(t, torch.Tensor) else None)
                i += 1
            if i > start:
                self.groups.append((g, start, i))
        if i != len(params):
            return
        self.params = params
        self.ids = tuple(map(id, params))
        self.ms, self.vs = sharded.local(self.m_src), sharded.local(self.v_src)
        # step counts on a GPU (capturable / fused Adam) are used there: reading them would sync
        self.device_steps = any(t is not None and t.device.type != "cpu" for t in self.steps)
        self.m_flat, self.v_flat = flat_views(self.ms), flat_views(self.vs)
        # eps^2 (1 - beta2^t) as a 0-d host tensor, set through its numpy view: a Python float
        # argument costs torch a wrapped tensor per call, twice the comparison's dispatch. A 0-d
        # tensor does not promote the float32 buffer (as the float did not), and a device kernel
        # reads a host scalar when it is launched
        self.thr = torch.zeros((), dtype=torch.float64)
        self.thr_np = self.thr.numpy()
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
        for p, m, v, t in zip(self.params, self.m_src, self.v_src, self.steps, strict=True):
            sp = state.get(p)
            if sp is None or sp.get("exp_avg") is not m or sp.get("exp_avg_sq") is not v:
                return False
            if t is not None and sp.get("step") is not t:
                return False
        return True

    def _count(self, opt: torch.optim.Optimizer, j: int) -> float:
        t = self.steps[j]
        return as_float(t) if t is not None else as_float(opt.state[self.params[j]].get("step", 1))

    def step_counts(self, opt: torch.optim.Optimizer) -> list[float]:
        """Step count per stepped parameter (host-side counts only)."""
        return [self._count(opt, j) for j in range(len(self.params))]

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


def adam_setup(st: OptState, params: list[torch.Tensor]
               ) -> tuple[AdamCache, list[tuple[float, float, float]], int | None] | None:
    """The optimizer's :class:`AdamCache` (rebuilt when its groups changed), each group's
    ``(beta1, beta2, eps)`` and the step count all groups share (None where they differ or count
    on the device); None when the optimizer keeps no Adam state for ``params``."""
    if st.adam is None or not st.adam.valid(st.opt):
        st.adam = AdamCache(st.opt, params)
    ad = st.adam
    if not ad.ok:
        return None
    hps = [(as_float(g["betas"][0]), as_float(g["betas"][1]), as_float(g["eps"])) for g, _, _ in ad.groups]
    same = all(h == hps[0] for h in hps)
    return ad, hps, ad.common_count(st.opt) if same and not ad.device_steps else None


def adam_stats(st: OptState, params: list[torch.Tensor], dv: list[torch.Tensor]) -> tuple[float, float] | None:
    """Write ||m||^2, sum(v) and #(v < eps^2 bc2) of the stepped parameters into the device
    fields ``dv`` (row views of the optimizer's block) and return the bias corrections
    (bc1, bc2) still to divide them by on the host (1, 1 where they were applied per
    coordinate); None when the optimizer keeps no Adam state for them.

    m, then v, is gathered by one ``torch.cat`` into the buffer's free gradient slot (the
    previous gradient, no longer needed once the pre-hook compared it), where each sum is one
    kernel (per-tensor reductions launch one per tensor). The count overwrites v there with
    1.0 / 0.0 and sums it (faster than a bool reduction).
    """
    if (setup := adam_setup(st, params)) is None:
        return None
    ad, hps, t = setup
    y = st.free_row()
    torch.cat(ad.flat_m(), out=y)
    if t is not None:
        b1, b2, e = hps[0]
        bc1, bc2 = 1.0 - b1**t, 1.0 - b2**t
        torch.dot(y, y, out=dv[DevField.M2])
        torch.cat(ad.flat_v(), out=y)
        torch.sum(y, 0, out=dv[DevField.VSUM])
        ad.thr_np[()] = e * e * bc2
        torch.lt(y, ad.thr, out=y)
        torch.sum(y, 0, out=dv[DevField.NBELOW])
        return bc1, bc2
    inv1, inv2, thr = per_param(st.opt, ad, hps, st.flat.buf.device)
    y.mul_(_per_coord(st, inv1))
    torch.dot(y, y, out=dv[DevField.M2])
    torch.cat(ad.flat_v(), out=y)
    y.mul_(_per_coord(st, inv2))
    torch.sum(y, 0, out=dv[DevField.VSUM])
    torch.lt(y, _per_coord(st, thr), out=y)
    torch.sum(y, 0, out=dv[DevField.NBELOW])
    return 1.0, 1.0


def per_param(opt: torch.optim.Optimizer, ad: AdamCache, hps: list[tuple[float, float, float]],
              dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """1 / (1 - beta1^t), 1 / (1 - beta2^t) and eps^2 per stepped parameter, float64 on ``dev``."""
    per_hp = [h for h, (_, a, b) in zip(hps, ad.groups, strict=True) for _ in range(a, b)]
    if not ad.device_steps:
        ts = ad.step_counts(opt)
        vals = [[1.0 / (1.0 - b1**t) for (b1, _, _), t in zip(per_hp, ts, strict=True)],
                [1.0 / (1.0 - b2**t) for (_, b2, _), t in zip(per_hp, ts, strict=True)],
                [e * e for _, _, e in per_hp]]
        out = _to_device(torch.tensor(vals, dtype=torch.float64), dev)
        return out[0], out[1], out[2]
    # counts on the device: the powers are taken there (float64, as the host path does)
    hp = _to_device(torch.tensor(per_hp, dtype=torch.float64).T.contiguous(), dev)
    ts = torch.stack([t.detach().reshape(()).to(torch.float64) for t in ad.steps])
    return 1.0 / (1.0 - hp[0] ** ts), 1.0 / (1.0 - hp[1] ** ts), hp[2] * hp[2]


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    # non_blocking from pageable memory: staged by the driver, no stream synchronisation
    return t if device.type == "cpu" else t.to(device, non_blocking=True)


def _per_coord(st: OptState, per_param: torch.Tensor) -> torch.Tensor:
    """A per-parameter value repeated over that parameter's coordinates (in the buffer's dtype; the output
    size is given, so that the device needs no synchronisation to size it)."""
    return torch.repeat_interleave(per_param.to(st.flat.buf.dtype), st.flat.sizes_dev, output_size=st.flat.N)
