"""Notebook 06's pieces: the Monitor against a closed form, the seq learner, slopes, claims, post-LN."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch
import xarray as xr

from stabstudy.analysis import claims as C
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


SIGMAS = np.array([0.8, 1.0, 1.25])


def _slopes(lin: np.ndarray, tanh: np.ndarray, preln: np.ndarray, seeds: int) -> xr.DataArray:
    """(activation, variant, sigma, seed) slopes: ``lin`` / ``tanh`` per sigma for the plain variant,
    ``preln`` for the linear pre-LN residual one, a little spread over seeds."""
    rng = np.random.default_rng(0)
    data = np.full((2, 2, SIGMAS.size, seeds), np.nan)
    jitter = 1e-4 * rng.standard_normal((SIGMAS.size, seeds))
    data[0, 0], data[1, 0] = lin[:, None] + 0 * jitter, tanh[:, None] + jitter
    data[0, 1], data[1, 1] = preln[:, None] + jitter, preln[:, None] + jitter
    return xr.DataArray(data, dims=("activation", "variant", "sigma", "seed"),
                        coords={"activation": ["linear", "tanh"], "variant": ["plain", "preln_residual"],
                                "sigma": SIGMAS, "seed": np.arange(seeds)})


def _seq(diverged_unclipped: int, diverged_clipped: int, n: int, learners=("rnn_tanh", "lstm")) -> pd.DataFrame:
    return pd.DataFrame([{"learner": lr_name, "grad_clip": clip, "seed": s, "lr": 0.1,
                          "diverged": s < (diverged_unclipped if clip == 0 else diverged_clipped),
                          "final_test_loss": 0.17} for lr_name in learners for clip in (0.0, 1.0) for s in range(n)])


def _adam(solved_clipped: int, solved_unclipped: int, n: int) -> pd.DataFrame:
    return pd.DataFrame([{"learner": "lstm", "grad_clip": clip, "seed": s, "lr": 0.03, "diverged": False,
                          "final_test_loss": 0.003 if s < (solved_clipped if clip else solved_unclipped) else 0.17}
                         for clip in (0.0, 1.0) for s in range(n)])


def _gpt(fail: dict[tuple[bool, int], int], loss: dict[tuple[bool, int], float], n: int) -> pd.DataFrame:
    """Runs at 24 blocks of each (post_ln, warmup) arm: the first ``fail[arm]`` seeds end above the
    failure line (3.0), the others at ``loss[arm]``, with a little seed noise."""
    rng = np.random.default_rng(1)
    return pd.DataFrame([{"n_layer": 24, "post_ln": pl, "warmup": w, "seed": s, "diverged": False,
                          "final_loss": (3.2 if s < fail[(pl, w)] else loss[(pl, w)]) + 0.005 * rng.standard_normal()}
                         for (pl, w) in fail for s in range(n)])


def _grads(grow: bool, n: int, blocks: int = 12) -> dict[str, xr.DataArray]:
    rng = np.random.default_rng(2)
    trend = np.arange(blocks) if grow else np.zeros(blocks)
    data = np.exp(0.3 * trend + rng.standard_normal((2, 1, n, blocks)))
    g = xr.DataArray(data, dims=("post_ln", "n_layer", "seed", "block"),
                     coords={"post_ln": [False, True], "n_layer": [blocks], "seed": np.arange(n), "block": np.arange(blocks)})
    return {"gpt2": g, "xavier": g}


def _table(slopes, seq_runs, adam_runs, gpt_runs, grads, mean_field=None):
    plan = S.Plan()
    mf = xr.DataArray(np.log(SIGMAS) if mean_field is None else mean_field, dims=("sigma",), coords={"sigma": SIGMAS})
    time = slopes.sel(activation="linear", variant="plain").expand_dims(kind=["rnn_linear"])
    rows = S.claims_table(plan, slopes=slopes, time_slopes=time, mean_field=mf, sgd_runs=seq_runs, adam_runs=adam_runs,
                          gpt_runs=gpt_runs, grad_norms=grads, seq_clip=1.0, claim_depth=24, gpt_warmup=20,
                          fail_below=3.0)
    assert all(r.family for r in rows) and all(r.confirmatory for r in rows)
    t = C.table(rows, alpha=plan.alpha)
    assert t.claim.is_unique
    return dict(zip(t.claim, t.verdict, strict=True))


ARMS = ((True, 0), (True, 20), (False, 0))


def test_every_claim_of_notebook_06_can_be_supported():
    log = np.log(SIGMAS)
    v = _table(_slopes(log, log, np.full(3, 0.02), 4), _seq(16, 0, 16), _adam(16, 0, 16),
               _gpt({(True, 0): 16, (True, 20): 0, (False, 0): 0}, {(True, 0): 3.2, (True, 20): 2.8, (False, 0): 2.8}, 16),
               _grads(True, 12))
    assert len(v) == 14 and set(v.values()) == {"supported"}, v


def test_every_claim_of_notebook_06_can_be_not_supported_when_the_effect_is_absent():
    """Closed forms off by 10% (one named case suffices); equal rates and losses, flat profiles and
    no growth, with as many units as the notebook's quick profile: every row decides 'not supported'."""
    log = np.log(SIGMAS)
    off = log * 1.1 + 0.01
    v = _table(_slopes(off, off, np.abs(off), 4), _seq(0, 0, 16), _adam(2, 2, 16),
               _gpt({arm: 16 for arm in ARMS}, {arm: 3.2 for arm in ARMS}, 16), _grads(False, 30), mean_field=log)
    assert len(v) == 14 and set(v.values()) == {"not supported"}, v


def test_closed_forms_name_the_failing_case_and_floor_a_zero_target():
    log = np.log(SIGMAS)
    near = log.copy()
    near[1] = 0.003  # sigma = 1: the target is 0, a relative tolerance would fail any measurement
    claim = S.closed_form_claim(_slopes(near, near, near, 3).sel(activation="linear", variant="plain"), "lin",
                                "textbook", S.Plan(), "f")
    assert claim.verdict == "supported" and claim.n == 9
    near[2] *= 1.2
    claim = S.closed_form_claim(_slopes(near, near, near, 3).sel(activation="linear", variant="plain"), "lin",
                                "textbook", S.Plan(), "f")
    assert claim.verdict == "not supported" and "sigma=1.25 seed 0" in claim.reason


def test_notebook_06_without_data_decides_nothing():
    """Every row is there, and none decides: NaN slopes, runs without a verdict or a final loss."""
    nan = np.full(3, np.nan)
    v = _table(_slopes(nan, nan, nan, 3), _seq(8, 0, 8).assign(diverged=np.nan),
               _adam(8, 0, 8).assign(final_test_loss=np.nan),
               _gpt({arm: 0 for arm in ARMS}, {arm: np.nan for arm in ARMS}, 8),
               {k: g * np.nan for k, g in _grads(True, 3).items()})
    assert len(v) == 14 and set(v.values()) <= {"not tested", "inconclusive"}, v
    few = _table(_slopes(nan, nan, nan, 2), _seq(2, 0, 2), _adam(2, 0, 2),
                 _gpt({(True, 0): 2, (True, 20): 0, (False, 0): 0}, {arm: 2.8 for arm in ARMS}, 2), _grads(True, 2))
    assert set(few.values()) <= {"not tested", "inconclusive"}, few  # two units: too few for any rule


def test_run_tables_and_rate_claims():
    df = _seq(4, 0, 6, learners=("lstm",))
    rates = S.rate_table(df, ["grad_clip"], "final_test_loss")
    assert list(rates.diverged) == [4, 0] and list(rates.runs) == [6, 6]
    claim = S.rate_claim(df, "clipping prevents divergence", "textbook", {"grad_clip": 0.0}, {"grad_clip": 1.0},
                         sesoi=0.5, family="f")
    assert claim.n == 12 and claim.family == "f" and claim.sesoi == 0.5
    runs = pd.DataFrame({"diverged": [True, False, False, False], "final_loss": [np.nan, 2.0, 3.5, np.nan]})
    assert S.mark_failed(runs, "final_loss", 3.0).failed.tolist()[:3] == [1.0, 0.0, 1.0]
    assert S.mark_solved(runs, "final_loss", 3.0).solved.tolist()[:3] == [0.0, 1.0, 0.0]
    assert np.isnan(S.mark_failed(runs, "final_loss", 3.0).failed.iloc[3])  # no loss, no verdict
    assert S.unigram_entropy(np.array([1, 1, 2, 2])) == pytest.approx(math.log(2))
    assert S.spike_count(np.r_[np.ones(30), 50.0, np.ones(10)], factor=10, window=20) == 1


def test_growth_is_summarised_per_network():
    g = _grads(True, 5)["gpt2"]
    rho = S.growth_rho(g, True)
    assert rho.sizes == {"seed": 5} and (rho > 0.5).all()
    claim = S.growth_claim(g, True, "grows", "source paper (x)", S.Plan())
    assert claim.n == 5  # networks, not network x block pairs


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
