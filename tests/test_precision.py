"""Precision measurements (hand-made tensors), overflow, loss scaling, and the LM learner's precision runs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from stabstudy.analysis.studies import precision as study
from stabstudy.instruments import precision as P
from stabstudy.interventions.perturb import Perturbation
from stabstudy.learners import lm
from stabstudy.run.runner import run_grid
from stabstudy.run.store import load_runs

TINY = dict(n_layer=1, n_head=2, n_embd=32, block_size=32, batch_size=8, corpus_bytes=200_000, warmup=5)
BF16 = torch.bfloat16


# -- dtype names, counting ------------------------------------------------------------------


def test_resolve_dtype_and_unknown_name():
    assert P.resolve_dtype("float32") is torch.float32
    assert P.resolve_dtype("bfloat16") is torch.bfloat16
    assert P.resolve_dtype("float16") is torch.float16
    with pytest.raises(ValueError, match="valid choices: float32, bfloat16, float16"):
        P.resolve_dtype("fp8")


def test_count_nonfinite_skips_none():
    a = torch.tensor([1.0, math.inf, -math.inf, math.nan, 0.0])
    b = torch.tensor([[math.nan, 2.0]], dtype=torch.float16)
    assert P.count_nonfinite([a, None, b]) == 4
    assert P.count_nonfinite([None, torch.zeros(3)]) == 0
    assert P.count_nonfinite([]) == 0


def test_fp16_headroom_and_logit_headroom():
    assert P.fp16_headroom(65504.0) == 1.0
    assert P.fp16_headroom(6550.4) == pytest.approx(0.1)
    assert math.isnan(P.fp16_headroom(math.nan))
    # the unscaled q.k product is sqrt(head_dim) larger than the logit
    assert P.logit_fp16_headroom(1000.0, 10.0, head_dim=64) == pytest.approx(8000 / 65504)
    assert P.logit_fp16_headroom(1.0, 6550.4, head_dim=64) == pytest.approx(0.1)


# -- ulp and lost updates -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_half_ulp_matches_finfo(dtype):
    eps = torch.finfo(dtype).eps  # spacing above 1.0
    one = torch.ones(2)
    assert P.half_ulp(one, dtype).tolist() == [eps / 2, eps / 2]
    # below a power of two the spacing halves
    assert P.half_ulp(one, dtype, direction=-one).tolist() == [eps / 4, eps / 4]
    # at zero: half the smallest subnormal
    tiny_sub = float(torch.nextafter(torch.zeros((), dtype=dtype), torch.ones((), dtype=dtype)))
    assert float(P.half_ulp(torch.zeros(1), dtype)) == tiny_sub / 2


def test_lost_update_bf16_hand_made():
    w = torch.ones(4, dtype=BF16)
    g = torch.ones(4)
    # pure bf16 storage: the update is applied in bf16, 1e-3 < half ulp (2**-8) is rounded away
    after_small = (w.float() + 1e-3).to(BF16)
    after_big = (w.float() + 1e-1).to(BF16)
    assert after_small.tolist() == w.tolist()
    assert P.lost_update_frac([w], [after_small], [g], BF16) == 1.0
    assert P.lost_update_frac([w], [after_big], [g], BF16) == 0.0
    # mixed precision: float32 master keeps the update; would it survive bf16 storage? No.
    m = torch.ones(4)
    assert P.lost_update_frac([m], [m + 1e-3], [g], BF16) == 1.0
    assert P.lost_update_frac([m], [m + 1e-3], [g], torch.float32) == 0.0
    assert P.lost_update_frac([m], [m + 1e-1], [g], BF16) == 0.0
    # direction matters at a power of two: gap below 1.0 is 2**-8, above 2**-7
    assert P.lost_update_frac([m], [m - 0.003], [g], BF16) == 0.0
    assert P.lost_update_frac([m], [m + 0.003], [g], BF16) == 1.0


def test_lost_update_eligibility():
    m = torch.ones(4)
    after = m + torch.tensor([1e-3, 1e-1, 1e-3, 1e-1])
    # coordinates with zero or non-finite gradient are not asked to move: excluded
    g = torch.tensor([1.0, 1.0, 0.0, math.nan])
    assert P.lost_update_frac([m], [after], [g], BF16) == 0.5
    # parameters without a gradient are skipped; none eligible -> NaN
    assert P.lost_update_frac([m, m], [after, after], [None, g], BF16) == 0.5
    assert math.isnan(P.lost_update_frac([m], [after], [None], BF16))
    assert math.isnan(P.lost_update_frac([m], [after], [torch.zeros(4)], BF16))
    with pytest.raises(ValueError, match="lengths differ"):
        P.lost_update_frac([m], [after, after], [g], BF16)


def test_lost_update_pure_bf16_equals_unchanged_fraction():
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 16).to(BF16)
    opt = torch.optim.SGD(lin.parameters(), lr=3e-3)
    x = torch.randn(32, 16, dtype=BF16)
    lin(x).float().pow(2).mean().backward()
    params = list(lin.parameters())
    before = P.snapshot(params)
    opt.step()
    frac = P.lost_update_frac(before, params, [p.grad for p in params], BF16)
    nz = torch.cat([(p.grad != 0).flatten() for p in params])
    same = torch.cat([(p == b).flatten() for p, b in zip(params, before, strict=True)])
    expected = float((same & nz).sum() / nz.sum())
    assert frac == pytest.approx(expected)
    assert 0.0 < frac < 1.0  # small SGD steps: some survive, some are rounded away


# -- overflow, autocast, Adam state, GradScaler ---------------------------------------------


def test_autocast_support_on_cpu():
    sup = P.autocast_support("cpu")
    assert sup["float32"] is True
    assert set(sup) == {"float32", "bfloat16", "float16"}


@pytest.mark.parametrize("emulate", [False, True])
def test_forced_fp16_overflow_is_counted(emulate):
    lin = torch.nn.Linear(8, 4, bias=False)
    torch.nn.init.constant_(lin.weight, 100.0)
    x = torch.full((2, 8), 100.0)  # each output = 8 * 100 * 100 = 80000 > 65504
    with P.autocast("cpu", "float16", emulate=emulate):
        y16 = lin(x)
    with P.autocast("cpu", "bfloat16", emulate=emulate):
        y_bf = lin(x)
    with P.autocast("cpu", "float32"):
        y32 = lin(x)
    assert P.count_nonfinite([y16]) == 8
    assert P.count_nonfinite([y_bf, y32]) == 0  # bfloat16 keeps float32's range
    assert float(y32.detach().max()) == 80000.0


def test_emulation_rounds_at_op_boundaries():
    lin = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.constant_(lin.weight, 1.0)
    x = torch.tensor([[1.0 + 2.0**-12]])  # below half an fp16 ulp above 1.0 (2**-11)
    with P.autocast("cpu", "float16", emulate=True):
        y = lin(x)
        z = x @ torch.ones(1, 1)
    assert y.dtype == torch.float32 and float(y.detach()) == 1.0 and float(z) == 1.0
    assert float(lin(x).detach()) == 1.0 + 2.0**-12


def test_overflow_into_adam_corrupts_state_for_good():
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(lin.parameters(), lr=1e-3)
    x = torch.randn(8, 4)
    for step in range(6):
        opt.zero_grad()
        lin(x).pow(2).mean().backward()
        if step == 2:
            lin.weight.grad[0, 0] = math.inf  # one overflowed gradient element
        opt.step()
        if step < 2:
            assert P.adam_state_nonfinite(opt) == 0
        else:  # running averages keep the inf/NaN forever and the parameter turns NaN
            assert P.adam_state_nonfinite(opt) >= 2
            assert P.count_nonfinite(lin.parameters()) >= 1
    assert P.adam_state_nonfinite(torch.optim.SGD(lin.parameters(), lr=0.1)) == 0


def test_grad_scaler_skips_overflowing_step():
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    opt = torch.optim.Adam(lin.parameters(), lr=1e-3)
    scaler = P.make_grad_scaler("cpu")
    assert scaler.get_scale() == 2.0**16
    x = torch.randn(16, 8)
    results = []
    for factor in (1.0, 1e6, 1.0):
        opt.zero_grad()
        with P.autocast("cpu", "float16"):
            loss = lin(x).float().pow(2).mean() * factor
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        n_bad = P.count_nonfinite(p.grad for p in lin.parameters())
        before = P.snapshot(lin.parameters())
        skipped, scale = P.scaler_step(scaler, opt)
        moved = any(not torch.equal(b, p) for b, p in zip(before, lin.parameters(), strict=True))
        results.append((n_bad, skipped, scale, moved))
    assert results[0] == (0, False, 2.0**16, True)
    assert results[1][0] > 0 and results[1][1:] == (True, 2.0**16, False)  # skipped, params untouched
    assert results[2] == (0, False, 2.0**15, True)  # halved, then clean again
    assert P.adam_state_nonfinite(opt) == 0
    disabled = P.make_grad_scaler("cpu", enabled=False)
    assert P.scaler_step(disabled, opt) == (False, 1.0)


# -- the LM learner's precision runs ---------------------------------------------------------


def _spec(precision, steps=30, seed=0, perts=(), **hp):
    return study._lm_spec(steps, seed, precision, {**TINY, **hp}, perts, eval_every=10)


def test_lm_fp16_overflow_without_scaler_diverges_and_is_stored(tmp_store):
    pert = (Perturbation("loss_scale", 12, 1, dose=1e8),)
    specs = [_spec("fp16_autocast", perts=pert), _spec("fp16_autocast_scaler", perts=pert),
             _spec("bf16_autocast", perts=pert)]
    recs = run_grid(specs, scheduler="serial", store=tmp_store, progress=False)
    assert [r.status for r in recs] == ["diverged", "ok", "ok"], [r.error for r in recs]
    runs = load_runs(specs, store=tmp_store)
    s = study.run_summary(runs).set_index("precision")
    # no scaler: the overflow reaches Adam, its state turns non-finite and the run stops there
    nf = runs.nonfinite_grads.isel(run=0).values
    assert nf[12] > 0 and (nf[:12] == 0).all()
    assert s.loc["fp16_autocast", "adam_state_nonfinite_max"] > 0
    assert s.loc["fp16_autocast", "steps_done"] == 13 and s.loc["fp16_autocast", "first_nonfinite_step"] == 12
    assert np.isnan(s.loc["fp16_autocast", "final_loss"])
    # scaler: the same step is skipped, the scale halves, the state stays finite
    sc = runs.isel(run=1)
    assert sc.skipped_step.values[12] == 1 and np.nansum(sc.skipped_step.values) == 1
    assert sc.loss_scale.values[12] == 2.0**16 and sc.loss_scale.values[13] == 2.0**15
    assert s.loc["fp16_autocast_scaler", "scale_backoffs"] == 1
    assert s.loc["fp16_autocast_scaler", "adam_state_nonfinite_max"] == 0
    # bfloat16 has float32's range: no overflow at all
    assert s.loc["bf16_autocast", "nonfinite_steps"] == 0
    # recovery: the diverged run cannot come back, the skipped step never took the loss out of its band
    r = study.run_summary(runs, recovery_window=10).set_index("precision")
    assert r.loc["fp16_autocast", "recovery_state"] == "diverged" and r.loc["fp16_autocast", "recovered"] == 0
    assert r.loc["fp16_autocast_scaler", "overflow_step"] == 12
    assert r.loc["fp16_autocast_scaler", "recovery_state"] == "never_left"
    assert r.loc["fp16_autocast_scaler", "recovered"] == 1
    assert r.loc["bf16_autocast", "recovery_state"] == "no_overflow" and np.isnan(r.loc["bf16_autocast", "recovered"])


def test_lm_scaler_grows_and_same_seed_same_trajectory():
    a = lm.run(_spec("fp16_autocast_scaler", steps=25, scaler_growth_interval=10))
    b = lm.run(_spec("fp16_autocast_scaler", steps=25, scaler_growth_interval=10))
    np.testing.assert_array_equal(a.loss.values, b.loss.values)
    np.testing.assert_array_equal(a.loss_scale.values, b.loss_scale.values)
    sc, skipped = a.loss_scale.values, a.skipped_step.values
    assert sc.max() == 2.0**17  # x2 after 10 clean steps (this model then overflows at 2**17)
    run = 0  # clean steps since the last change: the GradScaler rule, step by step
    for t in range(1, len(sc)):
        run = 0 if skipped[t - 1] else run + 1
        if skipped[t - 1]:
            assert sc[t] == sc[t - 1] / 2
        elif run == 10:
            assert sc[t] == sc[t - 1] * 2
            run = 0
        else:
            assert sc[t] == sc[t - 1]
    assert skipped.sum() >= 1


def test_lm_large_init_overflows_fp16_attention_logits(tmp_store):
    specs = study.logit_grid(3, [0], init_scales=[1.0, 1000.0], block_sizes=[32], hp=TINY)
    recs = run_grid(specs, scheduler="serial", store=tmp_store, progress=False)
    assert all(r.status in ("ok", "diverged") for r in recs)
    t = study.logit_table(load_runs(specs, store=tmp_store)).set_index(["precision", "init_scale"])
    assert t.loc[("float32", 1.0), "headroom0"] < 1e-2
    assert t.loc[("float32", 1000.0), "headroom0"] > 1.0  # the float32 twin predicts the overflow
    assert t.loc[("float32", 1000.0), "status"] == "ok"
    assert t.loc[("fp16_autocast", 1000.0), "status"] == "diverged"
    assert t.loc[("fp16_autocast", 1.0), "status"] == "ok"


def _recovery_run(loss, nonfinite_at=(20,), status="ok", recorded=60):
    """One load_runs-shaped run of 60 steps: ``loss`` (NaN at a step = a non-finite loss), padded after ``recorded``."""
    import xarray as xr

    loss = np.asarray(loss, dtype=float)
    lr = np.where(np.arange(60) < recorded, 1e-3, np.nan)
    nf = np.zeros(60)
    nf[list(nonfinite_at)] = 5.0
    nf[recorded:] = np.nan
    return xr.Dataset({"loss": ("step", np.where(np.arange(60) < recorded, loss, np.nan)), "lr": ("step", lr),
                       "nonfinite_grads": ("step", nf)}, coords={"step": np.arange(60), "status": status})


@pytest.mark.parametrize(("case", "state", "recovered", "time"), [
    ("flat", "never_left", 1.0, 0.0),
    ("spike", "recovered", 1.0, 5.0),
    ("stuck", "not_recovered", 0.0, math.inf),
    ("skipped_forward", "recovered", 1.0, 3.0),
    ("diverged", "diverged", 0.0, math.inf),
    ("diverged_after_window", "never_left", 1.0, 0.0),
    ("short", "unobserved", math.nan, math.nan),
    ("clean", "no_overflow", math.nan, math.nan),
])
def test_overflow_recovery_states(case, state, recovered, time):
    loss = np.full(60, 2.0)
    kw = {}
    if case == "spike":
        loss[20:25] = 5.0
    elif case in ("stuck", "short"):
        loss[20:] = 5.0
        kw = {"recorded": 35} if case == "short" else {}
    elif case == "skipped_forward":  # the scaler skipped three steps whose loss was non-finite
        loss[20:23] = np.nan
        kw = {"nonfinite_at": ()}
    elif case == "diverged":
        kw = {"status": "diverged", "recorded": 21}
    elif case == "diverged_after_window":
        kw = {"status": "diverged", "recorded": 50}
    elif case == "clean":
        kw = {"nonfinite_at": ()}
    out = study.overflow_recovery(_recovery_run(loss, **kw), window=20)
    assert out["recovery_state"] == state
    np.testing.assert_equal((out["recovered"], out["recovery_time"]), (recovered, time))
    np.testing.assert_equal(out["overflow_step"], math.nan if case == "clean" else 20.0)
    assert out["recovery_window"] == 20


def test_grid_builders_and_labels():
    specs = study.precision_grid(10, [0, 1], hp=dict(TINY, scaler_growth_interval=5))
    assert len(specs) == 10 and len({s.spec_hash for s in specs}) == 10
    assert {s.get("scaler_growth_interval") for s in specs} == {None, 5}
    ov = study.overflow_grid(10, [0], [1.0, 1e8], start=5, hp=TINY)
    assert len(ov) == 8 and all(s.perturbations[0].kind == "loss_scale" for s in ov)
    # a precision without a twin runs at the perturbed doses only
    some = study.overflow_grid(10, [0], [1.0, 1e8], start=5, hp=TINY, twins=("float32",))
    assert len(some) == 5 and [s.perturbations[0].dose for s in some].count(1.0) == 1
    with pytest.raises(ValueError, match="valid: float32"):
        study.precision_hparams("fp8")


def _fake_runs():
    """A load_runs-shaped Dataset: 2 precisions x 2 seeds x 2 doses, 10 steps, known numbers."""
    import xarray as xr

    rows = [(p, s, d) for p in ("float32", "fp16_autocast_scaler") for s in (0, 1) for d in (1.0, 1e8)]
    n, steps = len(rows), np.arange(10)
    loss = np.ones((n, 10))
    lr = np.tile(np.linspace(1.0, 0.1, 10), (n, 1))
    lost = np.full((n, 10), np.nan)
    scale = np.full((n, 10), np.nan)
    skipped = np.zeros((n, 10))
    for i, (p, s, d) in enumerate(rows):
        loss[i] += 0.1 * s + (0.5 if (d > 1 and p == "float32") else 0.0) + (0.02 if p != "float32" else 0.0)
        if p != "float32":
            lost[i] = 1.0 - lr[i]  # perfectly anti-correlated with lr
            scale[i] = [2.0**16] * 5 + [2.0**15] * 5
            skipped[i, 4] = 1.0
    hp = {k: [study.PRECISIONS[p][k] for p, _, _ in rows] for k in ("autocast_dtype", "param_dtype", "grad_scaler")}
    return xr.Dataset(
        {"loss": (("run", "step"), loss), "lr": (("run", "step"), lr), "lost_update_frac": (("run", "step"), lost),
         "loss_scale": (("run", "step"), scale), "skipped_step": (("run", "step"), skipped),
         "nonfinite_grads": (("run", "step"), skipped * 7)},
        coords={"run": [f"r{i}" for i in range(n)], "step": steps, "seed": ("run", [s for _, s, _ in rows]),
                "status": ("run", ["ok"] * n), "pert_dose": ("run", [d for *_, d in rows]),
                "pert_start": ("run", [4.0] * n), **{f"hp_{k}": ("run", v) for k, v in hp.items()}})


def test_analyses_on_known_numbers():
    runs = _fake_runs()
    assert study.precision_labels(runs).values.tolist()[:4] == ["float32"] * 4
    s = study.run_summary(runs, tail=0.2)
    sc = s[s.precision == "fp16_autocast_scaler"].iloc[0]
    assert (sc.skipped_steps, sc.nonfinite_steps, sc.scale_backoffs, sc.scale_growths) == (1, 1, 1, 0)
    assert (sc.loss_scale_max, sc.loss_scale_final) == (2.0**16, 2.0**15)
    gap = study.loss_gap_vs_reference(s[s.pert_dose == 1.0], "float32")
    assert gap.loc["fp16_autocast_scaler", "mean_diff"] == pytest.approx(0.02)
    assert gap.loc["fp16_autocast_scaler", "n"] == 2
    ov = study.overflow_table(s)
    assert ov.loc[("float32", 1e8), "excess_final_loss"] == pytest.approx(0.5)
    assert ov.loc[("fp16_autocast_scaler", 1e8), "excess_final_loss"] == pytest.approx(0.0)
    rho = study.lost_update_vs_lr(runs).dropna()
    assert (rho.precision == "fp16_autocast_scaler").all() and np.allclose(rho.rho, -1.0)
    with pytest.raises(ValueError, match="share a"):
        study.by_precision(runs, "loss")
    a = study.by_precision(runs.where(runs.pert_dose == 1.0, drop=True), "loss")
    assert a.dims == ("precision", "seed", "step") and a.precision.values.tolist() == ["float32", "fp16_autocast_scaler"]
    np.testing.assert_allclose((a - a.sel(precision="float32")).sel(precision="fp16_autocast_scaler"), 0.02)


def _claims_inputs(scaler_keeps_adam_finite: bool = True, fp16_overflows_at_300: bool = True, seeds=(0, 1, 2)):
    import pandas as pd

    sum_a = pd.DataFrame([
        dict(precision=p, seed=s, final_loss=2.0 + 0.001 * s, status="diverged" if p == "fp16_pure" else "ok")
        for p in ("float32", "fp16_autocast_scaler", "fp16_pure") for s in seeds])
    sum_b = pd.DataFrame([
        dict(precision=p, pert_dose=d, seed=s, final_loss=2.0 + (0.5 if p == "float32" and d > 1 else 0.0) + 0.01 * s,
             nonfinite_steps=int(d > 1 and p.startswith("fp16")),
             adam_state_nonfinite_max=10 if d > 1 and (p == "fp16_autocast" or not scaler_keeps_adam_finite) else 0,
             status="diverged" if d > 1 and p == "fp16_autocast" else "ok",
             skipped_steps=int(d > 1 and p == "fp16_autocast_scaler"))
        for p in ("float32", "fp16_autocast", "fp16_autocast_scaler", "bf16_autocast")
        for d in (1.0, 1e6, 1e8) for s in seeds])
    rho = pd.DataFrame({"precision": [], "rho": [], "p": []})
    logit = pd.DataFrame([
        dict(precision=prec, init_scale=init, block_size=64, seed=s, headroom0=h, headroom_peak=h, headroom_naive0=h / 8,
             status="diverged" if (prec == "fp16_autocast" and init >= 300 and fp16_overflows_at_300) else "ok",
             steps_done=5)
        for prec in ("float32", "fp16_autocast") for init, h in ((1.0, 0.01), (3.0, 0.03), (300.0, 1.3), (900.0, 3.0))
        for s in seeds
    ])
    return sum_a, sum_b, rho, logit


def test_precision_claims_table_verdicts_follow_the_data():
    from stabstudy.analysis import claims as C

    pred = study.overflow_prediction(_claims_inputs()[3])
    assert int(pred.predicted_overflow.sum()) == 6 and int(pred.fp16_diverged.sum()) == 6  # 2 inits x 3 seeds
    t = C.table(study.claims_table(*_claims_inputs())).set_index("claim").verdict
    v = {k.split(" (")[0]: x for k, x in t.items()}
    assert v["an fp16 overflow corrupts Adam's state without a scaler but not with GradScaler"] == "supported"
    assert v["after an fp16 overflow reaches Adam"] == "not tested"  # no recovery_window: no recovery measured
    assert v["with GradScaler the same overflow is skipped and training finishes more often than without a scaler"] \
        == "supported"
    assert v["skipping the overflowing step"] == "supported"
    assert v["pure fp16 Adam"] == "supported"
    assert v["the float32 twin's fp16 headroom"] == "supported"
    assert v["bf16 autocast reaches float32's final loss"] == "not tested"  # no bf16 run in (A)
    assert v["a longer context moves the logits closer to the fp16 limit"] == "not tested"  # one block size

    t = C.table(study.claims_table(*_claims_inputs(scaler_keeps_adam_finite=False, fp16_overflows_at_300=False)))
    v = {k.split(" (")[0]: x for k, x in t.set_index("claim").verdict.items()}
    assert v["an fp16 overflow corrupts Adam's state without a scaler but not with GradScaler"] == "inconclusive"
    assert v["the float32 twin's fp16 headroom"] == "not supported"  # nothing diverges: it separates nothing
    # one seed: no verdict from single runs
    t = C.table(study.claims_table(*_claims_inputs(seeds=(0,))))
    assert set(t.verdict) <= {"not tested", "inconclusive"}


def test_all_finite_exact_for_huge_finite_values():
    """all_finite is True for finite values whose float32 norm would overflow, False for inf / NaN."""
    big = torch.full((4,), 3e38)  # finite float32; the float32 norm of this overflows
    assert P.all_finite([big, torch.zeros(2, dtype=torch.float16)])
    assert P.all_finite([])
    for bad in (float("inf"), float("nan")):
        t = torch.zeros(3)
        t[1] = bad
        assert not P.all_finite([big, t])
