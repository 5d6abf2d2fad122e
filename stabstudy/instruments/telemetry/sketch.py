"""The Monitor's low-memory mode (``Monitor(..., memory="sketch")``): cosines from a seeded count-sketch.

The exact mode keeps three flat rows the size of the parameters (two gradient slots and the
parameters before the step). This mode keeps a k-dimensional sketch of each instead, and
computes the rest without copies:

* exact: ``grad_norm`` and ||w_before|| (``torch._foreach_norm``), Adam's ``adam_m_norm``,
  ``adam_v_mean`` and ``adam_eps_frac`` (per-tensor norms of the state, the count in pieces);
* from the sketch S (k x N, never formed): ``xgrad`` = cos(Sg_t, Sg_{t-1}),
  ``update_grad_cos`` = cos(S(-u), Sg) with S(-u) = S w_before - S w_after (S is linear: the
  parameters are sketched before and after the step, never copied), and ``update_norm`` =
  ||Su|| (``update_ratio`` = ||Su|| / ||w_before||, the denominator exact).

The sketch is a count-sketch with a fixed bucket map: coordinate i (its index in the
concatenated stepped parameters) goes to bucket i mod k with sign
s(i) = c[t] * r[(i mod P + shift[t]) mod P] for its block t = i div P, where r (P signs), c (one
sign per block) and shift (one offset in [0, P) per block) are drawn once from the seed; P is a
power of two >= k, so a block is summed as a (P/k, k) view. For i != j in one bucket,
E[s(i) s(j)] = 0, so (Sa).(Sb) is an unbiased estimate of a.b with variance
(1/k) sum_b [sum_{i != j in b} a_i^2 b_j^2 + a_i b_i a_j b_j] ~ (||a||^2 ||b||^2 + (a.b)^2) / k
(as a Gaussian sketch, when the mass is spread over the buckets). The cosines are the ratio
estimator (Sa).(Sb) / (||Sa|| ||Sb||): bias O(1/k), standard deviation ~ (1 - rho^2) / sqrt(k)
for a true cosine rho (1/sqrt(k) = 0.016 at k = 4096 and rho = 0, shrinking to 0 as |rho| -> 1);
||Sa||^2 estimates ||a||^2 with relative standard deviation ~ sqrt(2/k) (||Sa||: sqrt(1/(2k)),
1.1% at k = 4096). ``tests/test_sketch.py`` checks these on synthetic vectors;
``benchmarks/sketch_accuracy.py`` measures them on GPTs against the exact mode.

Memory per optimizer: 4 rows of k (the sketches), r (twice, 2P) and a scratch block of P + k,
a sign and a shift per block, and per-tensor norms; no transient larger than a block. Each block is one kernel per
operation (multiply by r, sum as a (P/k, k) view, add), so the time grows with N/P.
"""

from __future__ import annotations

import math

import torch

from stabstudy.instruments.telemetry.adam import adam_setup, per_param
from stabstudy.instruments.telemetry.channels import DevField
from stabstudy.instruments.telemetry.state import OptState

#: Choices of ``Monitor(memory=...)``.
MEMORY_MODES = ("exact", "sketch")
#: Largest block of coordinates summed at once (P); smaller for small models.
MAX_BLOCK = 1 << 17


def block_size(n: int, k: int) -> int:
    """P: a power of two >= k, at most n / 128 (r, twice, and the scratch then cost <= 2.4% of n
    values) and MAX_BLOCK."""
    return max(k, min(MAX_BLOCK, 1 << max(int(math.log2(max(n // 128, 1))), 0)))


class CountSketch:
    """The sketch operator of one set of stepped tensors (sizes fixed), on their device."""

    def __init__(self, sizes: list[int], k: int, seed: int, device: torch.device, dtype: torch.dtype):
        if k < 16 or k & (k - 1):
            raise ValueError(f"sketch_dim must be a power of two >= 16, got {k!r}")
        self.k, self.sizes, self.N = k, sizes, sum(sizes)
        self.P = P = block_size(self.N, k)
        gen = torch.Generator().manual_seed(seed)
        n_blocks = -(-self.N // P)
        signs = torch.randint(0, 2, (P + n_blocks,), generator=gen, dtype=torch.int8).to(dtype) * 2 - 1
        self.r = signs[:P].repeat(2).to(device)  # twice: a block reads P signs from its own shift on
        self.c = signs[P:].tolist()  # host floats: alpha= of the block's add
        # each block's shift into r: without it two coordinates at one offset in two blocks (same
        # bucket) would share r's sign, and only c would make them random (structured parameters,
        # e.g. rows of a matrix, then give a biased-looking error for a whole run)
        self.shift = torch.randint(0, P, (n_blocks,), generator=gen).tolist()
        self.scratch = torch.zeros(P + k, dtype=dtype, device=device)
        self.part = torch.empty(k, dtype=dtype, device=device)
        # the pieces: (tensor j, its slice [a, b), block, start of the piece in the block)
        self.pieces: list[tuple[int, int, int, int, int]] = []
        off = 0
        for j, n in enumerate(sizes):
            a = 0
            while a < n:
                blk, x0 = divmod(off + a, P)
                b = min(n, a + P - x0)
                self.pieces.append((j, a, b, blk, x0))
                a = b
            off += n

    def project(self, ts: list[torch.Tensor], out: torch.Tensor) -> None:
        """``out`` (k) = S of the concatenation of ``ts`` (flattened), block by block."""
        out.zero_()
        flat = [t.detach().reshape(-1) for t in ts]
        k, r, sc, part = self.k, self.r, self.scratch, self.part
        for j, a, b, blk, x0 in self.pieces:
            s0 = x0 - x0 % k
            n = b - a
            L = -(-(x0 - s0 + n) // k) * k
            if x0 != s0 or (x0 - s0 + n) != L:
                sc[:L].zero_()
            q = x0 + self.shift[blk]
            torch.mul(flat[j][a:b], r[q:q + n], out=sc[x0 - s0:x0 - s0 + n])
            torch.sum(sc[:L].view(-1, k), 0, out=part)
            out.add_(part, alpha=self.c[blk])

    def count_below(self, ts: list[torch.Tensor], thr: list[float] | torch.Tensor, out: torch.Tensor) -> None:
        """``out`` (0-d) = #coordinates of ``ts`` below their tensor's threshold, block by block
        (no transient larger than a block)."""
        out.zero_()
        flat = [t.detach().reshape(-1) for t in ts]
        sc = self.scratch
        for j, a, b, _, _ in self.pieces:
            n = b - a
            torch.lt(flat[j][a:b], thr[j], out=sc[:n])
            out.add_(sc[:n].sum())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.r, self.scratch, self.part)) + 8 * len(self.c)


class SketchState:
    """One optimizer's sketches: two gradient slots (k each) and the parameters' (then -u's)."""

    def __init__(self, params: list[torch.Tensor], key: tuple[int, ...], k: int, seed: int):
        dtype = torch.float64 if any(p.dtype is torch.float64 for p in params) else torch.float32
        self.key, self.sizes = key, [p.numel() for p in params]
        self.cs = CountSketch(self.sizes, k, seed, params[0].device, dtype)
        self.rows = torch.zeros(4, k, dtype=dtype, device=params[0].device)  # Sg slot 0, slot 1, Sw, S w_after
        self.prev_g2 = torch.zeros((), dtype=dtype, device=params[0].device)  # ||g_prev||^2 (exact)
        self.tmp = torch.zeros(2, dtype=dtype, device=params[0].device)

    def fits(self, params: list[torch.Tensor], key: tuple[int, ...]) -> bool:
        return key == self.key and [p.numel() for p in params] == self.sizes

    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size() + self.cs.nbytes()


def _sq_sum(ts: list[torch.Tensor], out: torch.Tensor) -> None:
    """sum ||t||^2 over ``ts`` (per-tensor norms accumulated in float64: no copy; a float32 dot of
    10M values was off by 2e-3), into 0-d ``out``."""
    n = torch.stack(torch._foreach_norm(ts, 2, dtype=torch.float64))
    out.copy_(torch.dot(n, n))


def pre(st: OptState, sk: SketchState, grads: list[torch.Tensor], params: list[torch.Tensor],
        dv: list[torch.Tensor], measure: bool, keep: bool, linked: bool) -> None:
    """The pre-hook: exact ||g||^2 (unscaled), the gradient's sketch when this step is measured
    or kept for the next one's xgrad, and on a measured step g.g_prev estimated (scaled so that
    ``derive``'s xgrad is the ratio estimator) and ||w_before||^2 exact with w_before's sketch."""
    inv, slot = st.cur.inv, st.prev.slot
    _sq_sum(grads, dv[DevField.G2])
    if inv is not None:
        dv[DevField.G2].mul_(inv * inv)
    if not (measure or keep):
        return
    sg = sk.rows[slot]
    sk.cs.project(grads, sg)
    if not measure:
        return
    if linked:
        sp = sk.rows[1 - slot]
        dot, nn = dv[DevField.GPG], sk.tmp
        torch.dot(sg, sp, out=dot)
        torch.mv(sk.rows[:2], sk.rows[slot], out=nn)  # Sg_slot . Sg0, . Sg1: one of them is ||Sg||^2
        ss = torch.dot(sp, sp)
        dot.mul_(torch.sqrt(dv[DevField.G2] * sk.prev_g2 / (nn[slot] * ss)))
    _sq_sum(params, dv[DevField.W2])
    sk.cs.project(params, sk.rows[2])


def post(st: OptState, sk: SketchState, params: list[torch.Tensor], dv: list[torch.Tensor]) -> None:
    """The post-hook of a measured step: S(-u) = S w_before - S w_after, ||Su||^2 as u.u, and
    -u.g estimated (scaled so that ``derive``'s update_grad_cos is the ratio estimator)."""
    sw, swa, sg = sk.rows[2], sk.rows[3], sk.rows[st.prev.slot]
    sk.cs.project(params, swa)
    sw.sub_(swa)
    torch.dot(sw, sw, out=dv[DevField.U2])
    torch.dot(sg, sw, out=dv[DevField.NUG])
    dv[DevField.NUG].mul_(torch.sqrt(dv[DevField.G2] / torch.dot(sg, sg)))


def keep_g2(sk: SketchState, dv: list[torch.Tensor]) -> None:
    """This step's gradient becomes the previous one: keep its exact squared norm."""
    sk.prev_g2.copy_(dv[DevField.G2])


def adam_stats(st: OptState, sk: SketchState, stepped: list[torch.Tensor],
               dv: list[torch.Tensor]) -> tuple[float, float] | None:
    """Adam's sums as :func:`.adam.adam_stats` writes them, without a flat copy: per-tensor
    norms of m, L1 norms of v (= their sums), the count of v below the threshold in blocks."""
    if (setup := adam_setup(st, stepped)) is None:
        return None
    ad, hps, t = setup
    dtype = dv[DevField.M2].dtype
    m = torch.stack(torch._foreach_norm(ad.ms, 2, dtype=torch.float64))  # accumulated in float64
    v = torch.stack(torch._foreach_norm(ad.vs, 1, dtype=torch.float64))  # v >= 0: the L1 norm is the sum
    if t is not None:
        b1, b2, e = hps[0]
        bc1, bc2 = 1.0 - b1**t, 1.0 - b2**t
        dv[DevField.M2].copy_(torch.dot(m, m))
        dv[DevField.VSUM].copy_(v.sum())
        sk.cs.count_below(ad.vs, [e * e * bc2] * len(ad.vs), dv[DevField.NBELOW])
        return bc1, bc2
    inv1, inv2, thr = per_param(st.opt, ad, hps, m.device)
    m = m * inv1
    dv[DevField.M2].copy_(torch.dot(m, m))
    dv[DevField.VSUM].copy_(torch.dot(v, inv2))
    # v_hat < eps^2  <=>  v < eps^2 / inv2 (per tensor)
    sk.cs.count_below(ad.vs, (thr / inv2).to(dtype).unbind(), dv[DevField.NBELOW])
    return 1.0, 1.0
