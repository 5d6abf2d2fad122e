"""Toy learner: tiny real runs of the real code."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xarray as xr

from stabstudy.analysis.studies import calibration as study
from stabstudy.hparams import ToyHParams
from stabstudy.instruments import curvature as cv
from stabstudy.interventions.perturb import Perturbation
from stabstudy.learners import toy
from stabstudy.run.runner import run_grid
from stabstudy.run.store import load_runs

SMALL = {"width": 16, "depth": 1, "n_train": 128, "n_test": 64}


def spec(learner="gd", steps=30, seed=0, perts=(), curvature_every=0, task="digits", **hp):
    return study.base_spec(learner, steps, seed, task, curvature_every=curvature_every,
                         perturbations=perts, **{**SMALL, **hp})


def test_same_spec_and_seed_give_identical_trajectories():
    s = spec("adam", steps=25, lr=0.01, curvature_every=10,
             perts=(Perturbation("grad_noise", start=5, duration=3, dose=0.5),))
    a, b = toy.run(s), toy.run(s)
    timing = ["lambda_max_cost_s"]  # wall time, the only channel allowed to differ
    xr.testing.assert_identical(a.drop_vars(timing), b.drop_vars(timing))
    c = toy.run(spec("adam", steps=25, seed=1, lr=0.01, curvature_every=10,
                     perts=(Perturbation("grad_noise", start=5, duration=3, dose=0.5),)))
    assert not np.allclose(a.loss.values, c.loss.values)


@pytest.mark.parametrize("learner", ["gd", "sgd", "adam"])
def test_channels_and_schema(learner):
    ds = toy.run(spec(learner, steps=21, lr=0.05 if learner != "adam" else 0.01, curvature_every=10, batch_size=32))
    assert ds.attrs["status"] == "ok" and ds.sizes["step"] == 21
    assert list(ds.step.values) == list(range(21))
    for ch in ("loss", "perf", "grad_norm", "xgrad", "update_norm", "update_ratio", "update_grad_cos",
               "lr", "perturbed", "lambda_max", "sharpness_grad", "sharpness_update", "lambda_max_cost_s",
               "lambda_max_resid"):
        assert ch in ds, ch
        assert ds[ch].dtype == np.float64
    assert np.isfinite(ds.loss).all() and np.isfinite(ds.grad_norm).all()
    assert np.isfinite(ds.lambda_max.values[[0, 10, 20]]).all()
    # how converged each lambda_max is, and at which tolerance (a stored run at another one is stale)
    resid = ds.lambda_max_resid.values
    assert np.isfinite(resid[[0, 10, 20]]).all() and np.isnan(resid[[1, 9, 11]]).all()
    converged = ds.lambda_max_iters.values[[0, 10, 20]] < 20
    assert (resid[[0, 10, 20]][converged] <= ds.attrs["curvature_tol"]).all()
    assert ds.attrs["curvature_tol"] == ToyHParams.curv_tol == cv.TOL
    s = spec(learner, steps=21, curvature_every=10)
    assert toy.stale(s, ds.attrs) is None and "tolerance" in toy.stale(s, {"curvature_tol": 1e-3})
    assert toy.stale(spec(learner, steps=21), {}) is None
    assert np.isnan(ds.lambda_max.values[[1, 9, 11]]).all()
    assert (0 <= ds.perf).all() and (ds.perf <= 1).all()
    adam_ok = np.isfinite(ds.adam_v_mean.values).all()
    assert adam_ok == (learner == "adam")
    assert np.isfinite(ds.precond_sharpness.values[10]) == (learner == "adam")
    if learner == "gd":  # full batch: the loss decreases over a few small steps
        assert ds.loss.values[-1] < ds.loss.values[0]


@pytest.mark.parametrize("learner, hp", [("gd", {"lr": 0.5}),
                                         ("adam", {"lr": 0.01, "beta2": 0.95, "loss": "ce", "activation": "relu"})])
def test_output_layer_channels_are_those_of_a_replay_with_torch_alone(learner, hp):
    """At step t, out_logit_max is max |f(x)| of the forward pass of that step's loss and last_weight_norm the
    Frobenius norm of the output weight that produced it (before the update): replayed here with torch's optimizer."""
    steps, seed = 12, 3
    ds = toy.run(spec(learner, steps=steps, seed=seed, **hp))
    torch.manual_seed(seed)  # the learner's only torch draw before training is the init
    data = toy.load_task("digits", SMALL["n_train"], SMALL["n_test"])
    x, y, c = data["x_train"], data["y_train"], data["c_train"]
    net = toy.MLP(64, 10, SMALL["width"], SMALL["depth"], hp.get("activation", "tanh"))
    opt = (torch.optim.SGD(net.parameters(), lr=hp["lr"]) if learner == "gd"
           else torch.optim.Adam(net.parameters(), lr=hp["lr"], betas=(0.9, hp["beta2"]), eps=1e-8))
    rows = []
    for _ in range(steps):
        out = net(x)
        loss = (0.5 * (out - y).pow(2).sum(1).mean() if learner == "gd"
                else torch.nn.functional.cross_entropy(out, c))
        rows.append((loss.item(), out.detach().abs().max().item(), net.layers[-1].weight.detach().norm().item()))
        opt.zero_grad()
        loss.backward()
        opt.step()
    loss, logit, norm = np.array(rows).T
    np.testing.assert_allclose(ds.loss.values, loss, rtol=1e-6)  # the replay is the run
    assert np.isfinite(ds.out_logit_max).all() and np.isfinite(ds.last_weight_norm).all()
    np.testing.assert_allclose(ds.out_logit_max.values, logit, rtol=1e-6)
    np.testing.assert_allclose(ds.last_weight_norm.values, norm, rtol=1e-6)
    # the norm moves more per step than the tolerance: a norm read after the update would fail above
    assert np.abs(np.diff(norm) / norm[1:]).min() > 1e-5


def test_output_layer_channels_see_a_weight_perturbation_at_its_step():
    base, pert = _delta("weight_noise", dose=0.5)
    np.testing.assert_array_equal(base.last_weight_norm.values[:10], pert.last_weight_norm.values[:10])
    np.testing.assert_array_equal(base.out_logit_max.values[:10], pert.out_logit_max.values[:10])
    assert pert.last_weight_norm.values[10] > 1.05 * base.last_weight_norm.values[10]


def test_synthetic_task_and_sgd_minibatch():
    ds = toy.run(spec("sgd", steps=20, task="synthetic", lr=0.05, batch_size=16))
    assert ds.attrs["status"] == "ok" and ds.attrs["batch_size"] == 16 and ds.attrs["full_batch"] == 0
    np.testing.assert_allclose(ds.perf.values, -ds.test_loss.values)


def test_divergence_stops_and_is_reported():
    ds = toy.run(spec("gd", steps=200, lr=40.0))
    assert ds.attrs["status"] == "diverged"
    assert ds.sizes["step"] < 200


def _delta(kind, learner="gd", dose=2.0, duration=1, start=10, **params):
    p = Perturbation(kind, start=start, duration=duration, dose=dose, params=params)
    base = toy.run(spec(learner, steps=20, lr=0.05 if learner == "gd" else 0.01))
    pert = toy.run(spec(learner, steps=20, lr=0.05 if learner == "gd" else 0.01, perts=(p,)))
    return base, pert


def test_perturbations_act_only_from_their_start():
    for kind, learner, dose, kw in [("lr_spike", "gd", 3.0, {}), ("grad_noise", "gd", 1.0, {}),
                                    ("weight_noise", "gd", 0.5, {}), ("reinit_layer", "gd", 1.0, {"layer": "layers.1"}),
                                    ("outlier_batch", "gd", 0.25, {}), ("loss_scale", "gd", 4.0, {}),
                                    ("beta2_shift", "adam", 0.5, {})]:
        base, pert = _delta(kind, learner, dose, **kw)
        # identical before the start, different after
        np.testing.assert_array_equal(base.loss.values[:10], pert.loss.values[:10], err_msg=kind)
        assert not np.allclose(base.loss.values[11:], pert.loss.values[11:]), kind
        assert pert.perturbed.values[10] == 1 and pert.perturbed.values[:10].sum() == 0, kind


def test_lr_spike_and_loss_scale_exact_effects():
    base, pert = _delta("lr_spike", dose=3.0, duration=2)
    assert pert.lr.values[10] == pytest.approx(0.15) and pert.lr.values[12] == pytest.approx(0.05)
    assert pert.update_norm.values[10] == pytest.approx(3 * base.update_norm.values[10], rel=1e-5)
    base, pert = _delta("loss_scale", dose=4.0)
    assert pert.grad_norm.values[10] == pytest.approx(4 * base.grad_norm.values[10], rel=1e-5)
    assert pert.loss.values[10] == pytest.approx(base.loss.values[10])  # the loss is recorded unscaled


def test_unknown_hparam_and_task_are_rejected():
    with pytest.raises(ValueError, match=r"unknown hyperparameter\(s\) \['lrr'\].*valid: .*\blr\b"):
        spec("gd", steps=2, lrr=0.1)  # when the spec is built, not when it runs
    with pytest.raises(ValueError, match="unknown toy task 'mnist'; valid tasks: digits, synthetic"):
        spec("gd", steps=2, task="mnist")  # when the spec is built, too
    with pytest.raises(ValueError, match="unknown toy task 'mnist'"):
        toy.load_task("mnist", 10, 10)


def test_calibration_grid_through_run_grid_and_tables(tmp_store):
    grid = study.calibration_grid([0.5], [0.01], gd_steps=24, adam_steps=24, curvature_every=4,
                                spike_start=12, spike_duration=3, spike_steps=24, spike_curvature_every=2, **SMALL)
    specs = [s for v in grid.values() for s in v]
    assert len(grid["spike"]) == 2 and grid["spike"][1].perturbations[0].kind == "lr_spike"
    recs = run_grid(specs, scheduler="serial", store=tmp_store, progress=False)
    assert all(r.status == "ok" for r in recs), [r.error for r in recs]
    gd = load_runs(grid["gd"], store=tmp_store)
    tab = study.eos_table(gd, tail=0.5)
    assert tab.loc[0, "target"] == pytest.approx(4.0) and tab.loc[0, "n_measurements"] >= 2
    assert np.isfinite(tab.loc[0, "ratio"])
    adam = study.eos_table(load_runs(grid["adam"], store=tmp_store), channel="precond_sharpness", beta1=0.9)
    assert adam.loc[0, "target"] == pytest.approx(3800.0)
    b, s = (tmp_store.load(x) for x in grid["spike"])
    resp = study.spike_response(b, s, start=12, duration=3, window=4)
    assert resp["loss_jump"] >= 1.0 and np.isfinite(resp["sharpness_drop"])


def test_spike_response_arithmetic():
    steps = np.arange(10)
    base = xr.Dataset({"loss": ("step", np.ones(10)), "grad_norm": ("step", np.ones(10)),
                       "lambda_max": ("step", np.full(10, 4.0))}, coords={"step": steps})
    sp = base.copy(deep=True)
    sp["loss"][5] = 6.0
    sp["grad_norm"][5] = 3.0
    sp["lambda_max"][6:] = 2.0
    r = study.spike_response(base, sp, start=5, duration=1, window=3)
    assert r["loss_jump"] == 6.0 and r["grad_norm_jump"] == 3.0
    assert r["sharpness_before"] == 4.0 and r["sharpness_after"] == 2.0 and r["sharpness_drop"] == 0.5
    assert r["baseline_sharpness_drop"] == 0.0


def test_lambda_max_check_small():
    c = toy.lambda_max_check(steps=10, width=8, n_train=64, iters=60, tol=1e-6)
    assert c["passed"] and c["rel_error"] < 0.02 and c["n_params"] == 64 * 8 + 8 + 8 * 10 + 10


def test_claims_table_needs_three_learning_rates_not_three_runs():
    import pandas as pd

    from stabstudy.analysis import claims as C

    dense = {"tolerance": 0.02, "measured": 1.0, "target": 1.0, "rel_error": 0.0, "iters_used": 10, "passed": True}
    row = lambda lr, seed, ratio=1.0: {"lr": lr, "seed": seed, "ratio": ratio}  # noqa: E731
    adam = pd.DataFrame([row(1e-3, 0)])
    two_lrs = pd.DataFrame([row(lr, s) for lr in (0.01, 0.02) for s in (0, 1)])  # 4 runs, 2 lrs
    gd_claim = study.claims_table(dense, two_lrs, adam, [])[1]
    assert gd_claim.verdict == "inconclusive" and gd_claim.n == 2 and "2 < 3 needed" in gd_claim.reason
    three = pd.DataFrame([row(lr, 0) for lr in (0.01, 0.02, 0.04)])
    assert study.claims_table(dense, three, adam, [])[1].verdict == "supported"
    three.loc[1, "ratio"] = 1.5
    assert study.claims_table(dense, three, adam, [])[1].verdict == "not supported"  # one of 3 outside: not for every lr
    three["ratio"] = 0.5
    assert study.claims_table(dense, three, adam, [])[1].verdict == "not supported"
    # the dense-Hessian check is about one measurement: one suffices
    assert study.claims_table(dense, three, adam, [])[0].verdict == "supported"
    # the spike claims need three seeds: one pair of runs gives no verdict
    one = [{"loss_jump": 10.0, "grad_norm_jump": 10.0, "sharpness_drop": 0.9, "baseline_sharpness_drop": 0.0}]
    assert {c.verdict for c in study.claims_table(dense, three, adam, one)[3:]} == {"inconclusive"}
    assert set(C.table(study.claims_table(None, pd.DataFrame(), pd.DataFrame(), [])).verdict) <= {
        "not tested", "inconclusive"}


def test_warmup_ramps_the_lr_linearly_then_leaves_the_spike_on_top():
    spike = Perturbation("lr_spike", start=6, duration=2, dose=10.0)
    ds = toy.run(spec("adam", steps=10, lr=0.01, warmup=4, perts=(spike,)))
    np.testing.assert_allclose(ds.lr.values, 0.01 * np.array([0.25, 0.5, 0.75, 1, 1, 1, 10, 10, 1, 1]))
    none = toy.run(spec("adam", steps=10, lr=0.01, perts=(spike,)))
    assert not np.allclose(ds.loss.values[1:], none.loss.values[1:])  # the warmup changed the trajectory
    np.testing.assert_array_equal(none.lr.values, toy.run(spec("adam", steps=10, lr=0.01, warmup=0, perts=(spike,))).lr)
