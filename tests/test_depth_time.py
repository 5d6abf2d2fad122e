"""Notebook 06's pieces: the Monitor against a closed form, the seq learner, slopes, claims, post-LN."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import xarray as xr

from stabstudy.analysis.studies import depth_time as S
from stabstudy.hparams import SeqHParams
from stabstudy.learners import depth, seq
from stabstudy.run.runner import run_grid
from stabstudy.spec import RunSpec


@pytest.mark.parametrize("dtype, rel_tol", [(torch.float64, 1e-5), (torch.float32, 1e-4)])
@pytest.mark.parametrize("sigma", [0.9, 1.1])
def test_monitor_per_layer_grad_norms_match_the_closed_form(dtype, rel_tol, sigma):
    """Deep linear net, weights sigma * orthogonal, biases 0: the bias gradient of layer l is the
    backpropagated signal, sigma^(L-l) times the last layer's; every weight gradient has the same norm
    (sigma^(L-1) ||r|| ||sum_b x_b||). The Monitor keeps float32 buffers, hence ~1e-7 even in float64."""
    L, width = 32, 48
    net = depth.DeepNet(L, width, sigma, seed=3, dtype=dtype)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn((16, width), generator=gen, dtype=torch.float64).to(dtype)
    r = torch.randn(width, generator=gen, dtype=torch.float64).to(dtype)
    per = depth.monitor_layer_grad_norms(net, x, r)
    bias = np.array([float(per.sel(layer=f"layers.{i}.bias")) for i in range(L)])
    weight = np.array([float(per.sel(layer=f"layers.{i}.weight")) for i in range(L)])
    expected = sigma ** (L - 1 - np.arange(L))
    np.testing.assert_allclose(bias / bias[-1], expected, rtol=rel_tol)
    np.testing.assert_allclose(weight / weight[-1], np.ones(L), rtol=rel_tol)
    exact = sigma ** (L - 1) * float(r.double().norm()) * float(x.double().sum(0).norm())
    np.testing.assert_allclose(weight[-1], exact, rtol=rel_tol)


def test_depth_and_time_profiles_of_linear_networks_are_powers_of_sigma():
    for sigma in (0.8, 1.25):
        d = depth.depth_profile(24, 32, sigma, batch=8, seed=1)
        np.testing.assert_allclose(d / d[0], sigma ** np.arange(25), rtol=1e-10)
        assert d[0] == pytest.approx(math.sqrt(8))  # dL/dh_L = r (unit vector) for each of 8 inputs
        t = seq.time_profile("rnn_linear", sigma, 40, hidden=16, batch=4, seed=2)
        np.testing.assert_allclose(t.values / t.values[0], sigma ** t.lag.values, rtol=1e-10)
    # the other networks run and bend the profile (no closed form asserted here)
    for kind in ("rnn_tanh", "lstm"):
        assert np.isfinite(seq.time_profile(kind, 1.0, 10, hidden=8, batch=2).values).all()
    assert np.isfinite(depth.depth_profile(8, 16, 1.0, activation="tanh", variant="preln_residual", batch=4)).all()


def _spec(**hp):
    return RunSpec("seq", hp.pop("learner", "rnn_tanh"), "adding", hp.pop("steps", 30), hp.pop("seed", 0),
                   perturbations=hp.pop("perturbations", ()),
                   hparams={"hidden": 8, "T": 10, "batch_size": 8, "eval_size": 16, **hp})


@pytest.mark.parametrize("learner", ["rnn_tanh", "rnn_linear", "lstm"])
def test_seq_runs_are_deterministic(learner):
    a, b = seq.run(_spec(learner=learner)), seq.run(_spec(learner=learner))
    assert a.attrs["status"] == "ok" and a.sizes["step"] == 30
    np.testing.assert_array_equal(a.loss.values, b.loss.values)
    np.testing.assert_array_equal(a.grad_norm.values, b.grad_norm.values)
    assert np.isfinite(a.grad_norm.values).all() and np.isfinite(a.test_loss.values).any()
    c = seq.run(_spec(learner=learner, seed=1))
    assert not np.array_equal(a.loss.values, c.loss.values)


def test_clipping_caps_what_the_optimizer_sees():
    ds = seq.run(_spec(grad_clip=0.1, lr=0.01))
    raw, seen = ds.grad_norm_raw.values, ds.grad_norm.values
    assert (ds.clipped.values == (raw > 0.1)).all() and ds.clipped.values.any()
    np.testing.assert_allclose(seen[raw > 0.1], 0.1, rtol=1e-4)
    np.testing.assert_allclose(seen[raw <= 0.1], raw[raw <= 0.1], rtol=1e-5)


def test_a_diverging_run_is_stored_as_diverged(tmp_store):
    spec = _spec(lr=50.0, steps=200, diverge_loss=100.0)
    ds = seq.run(spec)  # never raises
    assert ds.attrs["status"] == "diverged" and ds.sizes["step"] < 200
    last = ds.loss.values[-1]
    assert not np.isfinite(last) or last > 100.0
    (rec,) = run_grid([spec], scheduler="serial", store=tmp_store, progress=False)
    assert rec.status == "diverged"
    stored = tmp_store.load(spec)
    assert stored.attrs["status"] == "diverged" and stored.sizes["step"] == ds.sizes["step"]


def test_seq_hyperparameters_are_validated_when_the_spec_is_built():
    with pytest.raises(ValueError, match=r"unknown hyperparameter\(s\) \['hiden'\] for seq learner 'lstm'; "
                                         r"valid: .*\bhidden\b.*\bsigma\b"):
        RunSpec("seq", "lstm", "adding", 10, 0, hparams={"hiden": 8})
    with pytest.raises(ValueError, match=r"'optimizer' of seq learner 'lstm' must be one of 'sgd', 'adam'"):
        RunSpec("seq", "lstm", "adding", 10, 0, hparams={"optimizer": "rmsprop"})
    with pytest.raises(ValueError, match=r"'T' of seq learner 'rnn_tanh' must be int"):
        RunSpec("seq", "rnn_tanh", "adding", 10, 0, hparams={"T": 10.0})
    with pytest.raises(ValueError, match=r"unknown learner 'gru' for domain 'seq'; valid learners: rnn_tanh"):
        RunSpec("seq", "gru", "adding", 10, 0)
    with pytest.raises(ValueError, match=r"unknown seq task 'copy'; valid tasks: adding"):
        RunSpec("seq", "lstm", "copy", 10, 0)
    assert SeqHParams().grad_clip == 0.0


def test_log_slope_on_synthetic_profiles():
    k = np.arange(65)
    sig = np.array([0.8, 1.0, 1.25])
    rng = np.random.default_rng(0)
    clean = 3.0 * sig[:, None] ** k
    da = xr.DataArray(clean, dims=("sigma", "from_output"), coords={"sigma": sig, "from_output": k})
    np.testing.assert_allclose(S.log_slope(da, "from_output").values, np.log(sig), atol=1e-12)
    noisy = da * np.exp(rng.normal(0, 0.05, da.shape))
    np.testing.assert_allclose(S.log_slope(noisy, "from_output").values, np.log(sig), atol=5e-3)
    holes = da.copy()
    holes[:, ::3] = np.nan
    holes[:, 1] = 0.0  # non-positive: no logarithm, left out
    np.testing.assert_allclose(S.log_slope(holes, "from_output").values, np.log(sig), atol=1e-12)
    assert np.isnan(S.log_slope(da.isel(from_output=[0]), "from_output").values).all()


def test_mean_field_profile():
    # below sigma = 1 the activations die out with depth, tanh' -> 1, and the factor of the last
    # layers (index 0 = the output) tends to sigma; the first layers, on order-1 inputs, shrink more
    p = S.tanh_mean_field_log_profile(0.8, 200)
    assert p[0] == 0.0 and p.shape == (201,)
    assert p[1] - p[0] == pytest.approx(math.log(0.8), rel=1e-6)
    assert p[-1] - p[-2] < math.log(0.8) - 0.1
    # tanh' <= 1: never above the linear profile
    assert (S.tanh_mean_field_log_profile(1.25, 64) <= 64 * math.log(1.25) + 1e-12).all()
    assert float(S.mean_field_slopes([0.8], 64).sel(sigma=0.8)) < math.log(0.8)


def test_closed_form_claims_can_pass_and_fail():
    sig = np.array([0.9, 1.0, 1.1])
    exact = xr.DataArray(np.repeat(np.log(sig)[:, None], 3, 1), dims=("sigma", "seed"),
                         coords={"sigma": sig, "seed": [0, 1, 2]})
    rows = S.closed_form_claims(exact + 1e-9, "linear", "textbook")
    assert [r.verdict for r in rows] == ["supported"] * 3
    assert "sigma = 1" in rows[1].claim and rows[1].test.startswith("TOST")
    off = S.closed_form_claims(exact * 1.1 + 0.02, "linear", "textbook")
    assert [r.verdict for r in off] == ["not supported"] * 3
    table = S.slope_table(exact)
    assert np.isnan(table.rel_error[1]) and np.allclose(table.rel_error[[0, 2]], 0)


def test_run_tables_and_rate_claims():
    per_run = [{"learner": "lstm", "grad_clip": c, "seed": s, "diverged": c == 0 and s < 4,
                "final_test_loss": np.nan if c == 0 and s < 4 else 0.1} for c in (0.0, 1.0) for s in range(6)]
    import pandas as pd

    df = pd.DataFrame(per_run)
    rates = S.rate_table(df, ["grad_clip"], "final_test_loss")
    assert list(rates.diverged) == [4, 0] and list(rates.runs) == [6, 6]
    claim = S.rate_claim(df, "clipping prevents divergence", "textbook", {"grad_clip": 0.0}, {"grad_clip": 1.0})
    assert claim.verdict == "supported" and claim.n == 12
    assert S.spike_count(np.r_[np.ones(30), 50.0, np.ones(10)], factor=10, window=20) == 1


def test_post_ln_is_a_gpt_option_whose_default_changes_nothing():
    from stabstudy.hparams import GPTHParams, merged
    from stabstudy.learners.gpt import GPT
    from stabstudy.learners.lm import model_config

    spec = RunSpec("lm", "gpt", "stdlib", 10, 0, hparams={"n_layer": 2})
    assert "post_ln" not in spec.hp  # stored hparams (and so every existing hash) are unchanged
    hp = dict(n_layer=2, n_embd=16, n_head=2, block_size=8)
    pre_cfg, post_cfg = (model_config(merged(GPTHParams, {**hp, "post_ln": p}, "t")) for p in (False, True))
    assert not pre_cfg.post_ln and post_cfg.post_ln
    idx = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    pre = GPT(pre_cfg)
    torch.manual_seed(0)
    post = GPT(post_cfg)
    assert not torch.allclose(pre(idx).logits, post(idx).logits)
    with torch.no_grad():  # post-LN: the stream leaving each block is normalised
        x = post.wte(idx) + post.wpe(torch.arange(8))
        out = post.blocks[0](x)
    np.testing.assert_allclose(out.std(-1, unbiased=False).numpy(), 1.0, rtol=1e-3)


def test_seq_applies_the_perturbation_kinds_the_registry_allows_it():
    from stabstudy.interventions.perturb import Perturbation
    from stabstudy.registry import KINDS

    allowed = {k for k, v in KINDS.items() if "seq" in v.domains}
    assert {"lr_spike", "weight_noise", "reinit_layer"} <= allowed
    base = seq.run(_spec(learner="lstm", lr=0.01))
    for p in (Perturbation("lr_spike", start=10, duration=5, dose=10.0), Perturbation("weight_noise", start=10, dose=0.5),
              Perturbation("reinit_layer", start=10, dose=1.0)):
        ds = seq.run(_spec(learner="lstm", lr=0.01, perturbations=(p,)))
        np.testing.assert_array_equal(ds.loss.values[:10], base.loss.values[:10])  # same stream until the event
        assert not np.array_equal(ds.loss.values[11:], base.loss.values[11:]), p.kind
        assert ds.perturbed.values[10] == 1.0
    spiked = seq.run(_spec(learner="lstm", lr=0.01, perturbations=(Perturbation("lr_spike", start=10, duration=5, dose=10.0),)))
    np.testing.assert_allclose(spiked.lr.values[10:15], 0.1)
