"""The LM learner: every channel stored, determinism, perturbations, precision, divergence."""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr

from stabstudy.analysis.studies import lm_spikes as study
from stabstudy.instruments import curvature
from stabstudy.interventions.perturb import Perturbation
from stabstudy.learners import lm
from stabstudy.run.runner import run_grid
from stabstudy.run.store import SHARED_CHANNELS, load_runs

TINY = dict(n_layer=1, n_head=2, n_embd=32, block_size=32, batch_size=8, corpus_bytes=200_000, warmup=5)
LM_CHANNELS = ("val_loss", "ce_loss", "z_loss", "attn_logit_max", "attn_logit_max_l0", "out_logit_max",
               "attn_entropy_min")


def spec(steps=30, seed=0, perts=(), **hp):
    return study.base_spec(steps, seed=seed, perturbations=tuple(perts), eval_every=10, **{**TINY, **hp})


def test_learner_stores_every_channel(tmp_store):
    s = spec(curvature_every=0)
    (rec,) = run_grid([s], scheduler="serial", store=tmp_store, progress=False)
    assert rec.status == "ok", rec.error
    ds = load_runs([s], store=tmp_store).isel(run=0)
    for ch in (*SHARED_CHANNELS, *LM_CHANNELS):
        assert ch in ds, ch
    for ch in ("loss", "grad_norm", "xgrad", "update_ratio", "adam_v_mean", "lr", "attn_logit_max"):
        assert np.isfinite(ds[ch].values[1:]).all(), ch
    assert np.isfinite(ds.val_loss.values).sum() == 3  # steps 9, 19, 29
    np.testing.assert_allclose(ds.perf.dropna("step"), -ds.val_loss.dropna("step"))
    np.testing.assert_array_equal(ds.tokens.values, (np.arange(30) + 1) * 8 * 32)
    assert ds.loss.values[-5:].mean() < ds.loss.values[:3].mean() - 0.5  # it learns
    raw = tmp_store.load(s)
    assert len(raw.attrs["corpus_sha256"]) == 64 and raw.attrs["status"] == "ok"


def test_same_seed_same_loss_curve():
    a, b, c = lm.run(spec(seed=3)), lm.run(spec(seed=3)), lm.run(spec(seed=4))
    np.testing.assert_array_equal(a.loss.values, b.loss.values)
    np.testing.assert_array_equal(a.grad_norm.values, b.grad_norm.values)
    assert not np.array_equal(a.loss.values, c.loss.values)


def test_perturbations_act_at_their_step_only():
    base = lm.run(spec())
    spike = lm.run(spec(perts=[Perturbation("lr_spike", 15, 2, dose=20.0)]))
    out = lm.run(spec(perts=[Perturbation("outlier_batch", 15, 1, dose=1.0)]))
    np.testing.assert_array_equal(base.loss.values[:15], spike.loss.values[:15])
    np.testing.assert_allclose(spike.lr.values[15:17], 20 * base.lr.values[15:17])
    assert spike.perturbed.values[15:17].tolist() == [1.0, 1.0] and spike.perturbed.values[17] == 0
    assert not np.allclose(base.loss.values[16:], spike.loss.values[16:])
    np.testing.assert_array_equal(base.loss.values[:15], out.loss.values[:15])
    assert out.loss.values[15] != base.loss.values[15]
    for kind, dose in (("grad_noise", 1.0), ("weight_noise", 0.5), ("beta2_shift", 0.5), ("loss_scale", 100.0)):
        r = lm.run(spec(perts=[Perturbation(kind, 15, 3, dose=dose)]))
        assert r.attrs["status"] == "ok", kind
        np.testing.assert_array_equal(base.loss.values[:15], r.loss.values[:15])
        assert not np.allclose(base.loss.values[17:], r.loss.values[17:]), kind
    nw = lm.run(spec(perts=[Perturbation("no_warmup", 0, 1)]))
    assert nw.lr.values[0] == pytest.approx(1e-3) and base.lr.values[0] == pytest.approx(1e-3 / 5)


def test_precision_channels_and_switch():
    r = lm.run(spec(steps=20, autocast_dtype="float16", grad_scaler=True))
    assert r.attrs["status"] == "ok"
    for ch in lm.PRECISION_CHANNELS:
        assert ch in r, ch
    assert r.loss_scale.values[0] == 2.0**16
    assert np.isfinite(r.lost_update_frac.values).all()
    sw = lm.run(spec(steps=20, perts=[Perturbation("precision_switch", 10, 10, params={"dtype": "bfloat16"})]))
    base = lm.run(spec(steps=20))
    np.testing.assert_array_equal(base.loss.values[:10], sw.loss.values[:10])
    assert not np.array_equal(base.loss.values[10:], sw.loss.values[10:])
    assert np.isfinite(sw.lost_update_frac.values).all()


def test_nan_config_is_stored_as_diverged(tmp_store):
    # pure float16 Adam: eps=1e-8 rounds to 0, so coordinates with zero gradient get 0/0 = NaN
    s = spec(param_dtype="float16")
    (rec,) = run_grid([s], scheduler="serial", store=tmp_store, progress=False)
    assert rec.status == "diverged"
    ds = tmp_store.load(s)
    assert ds.attrs["status"] == "diverged"
    assert 1 <= ds.sizes["step"] < 30 and np.isfinite(ds.loss.values[0])


def test_unknown_hparam_and_task_are_clear_errors():
    with pytest.raises(ValueError, match="unknown hyperparameter"):
        lm.run(spec(learning_rate=1e-3))
    with pytest.raises(ValueError, match="unknown lm task 'no-such-corpus': use 'stdlib' or the path of a text file"):
        spec().replace(task="no-such-corpus")  # when the spec is built
    with pytest.raises(ValueError, match="unknown LM task 'no/such.txt'"):
        lm.run(spec().replace(task="no/such.txt"))  # reads as a path: the file is looked for where the run executes


def test_curvature_channels_at_their_cadence():
    r = lm.run(spec(steps=21, curvature_every=10, curvature_iters=5))
    measured = np.flatnonzero(np.isfinite(r.lambda_max.values)).tolist()
    assert measured == [0, 10, 20]
    assert (r.lambda_max.values[measured] > 0).all()
    assert np.isfinite(r.precond_sharpness.values[measured]).all()
    assert np.isfinite(r.sharpness_update.values[measured]).all()
    assert np.isfinite(r.lambda_max_resid.values[measured]).all() and r.attrs["curvature_tol"] == curvature.TOL
    s = spec(steps=21, curvature_every=10, curvature_iters=5)
    assert lm.stale(s, r.attrs) is None and "old default tolerance" in lm.stale(s, {})


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_curvature_under_half_precision_autocast(dtype):
    """The probe measures under the run's autocast (it crashed in Lanczos before)."""
    r = lm.run(spec(steps=11, curvature_every=10, curvature_iters=4, autocast_dtype=dtype,
                    grad_scaler=dtype == "float16"))
    assert r.attrs["status"] == "ok"
    measured = np.flatnonzero(np.isfinite(r.lambda_max.values)).tolist()
    assert measured == [0, 10] and (r.lambda_max.values[measured] > 0).all()


def test_grid_builders_and_analyses():
    specs = study.spike_grid(40, 20, seeds=(0,), events={"lr_spike": (30.0, 2), "outlier_batch": (1.0, 1)},
                          beta2s=(0.95, 0.99), **TINY)
    assert len(specs) == 2 * 3 and len({s.spec_hash for s in specs}) == 6
    meta = study.run_table(specs)
    assert (meta.event == "none").sum() == 2
    assert (meta[meta.event != "none"].twin != "").all()
    sweep = study.lr_sweep_grid((1e-3, 1e-2), 30, variants=("baseline", "qk_layernorm"), **TINY)
    assert [s.hp["lr"] for s in sweep] == [1e-3, 1e-2, 1e-3, 1e-2]
    assert study.run_table(sweep).variant.tolist() == ["baseline"] * 2 + ["qk_layernorm"] * 2
    with pytest.raises(ValueError, match="unknown variant"):
        study.lr_sweep_grid((1e-3,), 30, variants=("layernorm",))


def test_spike_effects_and_adam_memory_on_real_runs(tmp_store):
    specs = study.spike_grid(60, 20, seeds=(0,), events={"outlier_batch": (1.0, 1)}, beta2s=(0.9,), **TINY)
    run_grid(specs, scheduler="serial", store=tmp_store, progress=False)
    ds = load_runs(specs, store=tmp_store)
    eff = study.spike_effects(ds, specs)
    assert len(eff) == 1
    row = eff.iloc[0]
    assert row.peak_excess_loss > 0.1 and row.grad_norm_ratio > 2 and row.adam_v_ratio > 2
    mem = study.adam_memory(ds, specs)
    # the outlier's gradient leaves v with weight beta2^k: e-folding ~ 1/(1-beta2) = 10 steps
    assert 5 <= mem.iloc[0].t_efold <= 20 and mem.iloc[0].tau_theory == pytest.approx(10.0)


def test_lr_sensitivity_definition():
    # loss0 = 5; losses over 4 lrs, one diverged (NaN -> loss0) and one above loss0 (capped)
    assert study.lr_sensitivity(np.array([3.0, 2.0, np.nan, 6.0]), 5.0) == pytest.approx((3 + 2 + 5 + 5) / 4 - 2)
    assert study.lr_sensitivity(np.array([2.0, 2.0]), 5.0) == 0.0
    t, tau, k0 = study.efold_time(np.exp(-np.arange(50) / 7.0))
    assert k0 == 0 and t == 7.0 and tau == pytest.approx(7.0)


def test_grad_scaler_with_float16_parameters_is_a_clear_error():
    with pytest.raises(ValueError, match="GradScaler"):
        lm.run(spec(steps=5, param_dtype="float16", grad_scaler=True))


def test_spike_effects_recovery_baseline_is_not_smeared_by_the_event():
    """A centred smoothing window must not carry the spike into the pre-event baseline:
    synthetic twin pair, +3 nats at the outlier step, then an excess 0.6 * 0.8^k."""
    steps, s0 = 60, 20
    twin = study.base_spec(steps, 0)
    pert = study.base_spec(steps, 0, perturbations=(Perturbation("outlier_batch", s0, 1, dose=1.0),))
    base = 3.0 - np.linspace(0, 1, steps)
    lp = base.copy()
    lp[s0] += 3.0
    lp[s0 + 1:] += 0.6 * 0.8 ** np.arange(steps - s0 - 1)
    data = {"loss": (("run", "step"), np.vstack([lp, base]))}
    for ch in ("val_loss", "grad_norm", "update_ratio", "adam_v_mean", "xgrad", "attn_logit_max"):
        data[ch] = (("run", "step"), np.ones((2, steps)))
    ds = xr.Dataset(data, coords={"run": [pert.spec_hash, twin.spec_hash], "step": np.arange(steps)})
    row = study.spike_effects(ds, [twin, pert], smooth=5, abs_tol=0.05).iloc[0]
    # excess <= 0.05 from k = 12 (0.6 * 0.8^12 = 0.041), i.e. step s0 + 13; smoothing shifts it by
    # at most half a window
    assert 11 <= row.recovery_steps <= 16
    assert row.peak_excess_loss > 0.6


def test_run_on_an_edited_corpus_file_is_recomputed(tmp_store, tmp_path, monkeypatch, capsys):
    from stabstudy.learners import corpus
    from stabstudy.run import runner

    monkeypatch.setattr(corpus, "_MEMO", {})
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    spec = study.base_spec(3, 0, task=str(text), **TINY)
    run_grid([spec], scheduler="serial", store=tmp_store, progress=False)
    assert runner.pending([spec], tmp_store) == []
    text.write_text("a different text, with other bytes in it! " * 200)
    assert runner.pending([spec], tmp_store) == [spec]
    assert "another version of the corpus file" in capsys.readouterr().out
    run_grid([spec], scheduler="serial", store=tmp_store, progress=False)
    assert runner.pending([spec], tmp_store) == []


def test_sharpness_claims_use_adams_preconditioned_threshold():
    """Adam is judged against (2 + 2 beta1) / ((1 - beta1) lr) on lambda_max(P^-1 H), not raw
    lambda_max against 2/lr (which Adam trains past); one median per seed (a seed's twin and spiked run
    share every step before the event), three seeds needed, and the in-event set is the LR-spike runs'."""
    import pandas as pd

    twins = [study.base_spec(8, s, **TINY) for s in range(3)]
    spikes = [study.base_spec(8, s, perturbations=(Perturbation("lr_spike", 4, 2, dose=10.0),), **TINY)
              for s in range(3)]
    lr = np.full((6, 8), 1e-2)
    lr[3:, 4:6] = 0.1
    thr = (2 + 2 * 0.9) / (0.1 * lr)  # 38 / lr
    pre = 0.5 * thr * np.array([[1.0], [1.1], [1.2], [1.0], [1.1], [1.2]])  # about half the threshold ...
    pre[3:, 4:6] = 2.0 * thr[3:, 4:6] * np.array([[1.0], [1.1], [1.2]])  # ... except twice it during the spikes
    lam = 10.0 * 2.0 / lr  # raw sharpness 10x past 2/lr everywhere
    ds = xr.Dataset({"lambda_max": (("run", "step"), lam), "lr": (("run", "step"), lr),
                     "precond_sharpness": (("run", "step"), pre)},
                    coords={"run": [s.spec_hash for s in twins + spikes], "step": np.arange(8)})
    sharp = study.sharpness_table(ds, twins + spikes)
    assert np.allclose(sharp.adam_threshold, 38 / sharp.lr) and np.allclose(sharp.ratio, 10.0)
    assert np.allclose(sharp[sharp.in_event == 1].precond_ratio / [2.0, 2.0, 2.2, 2.2, 2.4, 2.4], 1.0)
    empty = pd.DataFrame()

    def verdict(table, start):
        return next(c.verdict for c in table if c.claim.startswith(start))

    table = study.claims(empty, empty, empty, sharp)
    assert verdict(table, "outside spikes") == "supported"
    assert verdict(table, "during an LR spike") == "supported"
    two = sharp[sharp.seed < 2]
    assert verdict(study.claims(empty, empty, empty, two), "during an LR spike") == "inconclusive"  # two seeds
    past = sharp.copy()
    past.loc[past.in_event == 0, "precond_ratio"] *= 3.0  # past Adam's threshold outside spikes
    assert verdict(study.claims(empty, empty, empty, past), "outside spikes") == "not supported"
    one_seed = sharp[sharp.seed == 0]  # a twin and its spiked run: one unit, no verdict
    assert verdict(study.claims(empty, empty, empty, one_seed), "outside spikes") == "inconclusive"
    assert verdict(study.claims(empty, empty, empty, None), "outside spikes") == "not tested"


def test_twin_has_the_same_logging_cadence():
    event = study.base_spec(40, 0, perturbations=(Perturbation("lr_spike", 10, 2, dose=10.0),), **TINY)
    same = study.base_spec(40, 0, **TINY)
    sparse = study.base_spec(40, 0, log_every=5, **TINY)
    for order in ([sparse, same, event], [same, sparse, event]):
        assert study.run_table(order).loc[event.spec_hash, "twin"] == same.spec_hash
    assert study.run_table([sparse, event]).loc[event.spec_hash, "twin"] == ""


@pytest.mark.parametrize("case", ["ok", "loss_nan", "params_nan"])
def test_block_copies_leave_the_recorded_trajectory_unchanged(monkeypatch, case):
    """Losses and divergence checks stay on the device and reach the host every SYNC_EVERY
    steps: a run must record exactly what it records with a copy after every step, also when it
    diverges inside a block (a non-finite loss: the run stops before that step's update; non-finite
    parameters after an update: the step is kept)."""
    import torch

    perts = {"ok": [], "loss_nan": [Perturbation("weight_noise", 13, 1, dose=1e39)],
             "params_nan": [Perturbation("grad_noise", 12, 1, dose=1e39)]}[case]  # 12: a checked step
    s = spec(steps=24, perts=perts, log_every=2, **({"grad_scaler": True} if case == "ok" else {}))
    s = s.replace(eval_every=8)
    runs = {}
    for n in (1, 5, 64):
        monkeypatch.setattr(lm, "SYNC_EVERY", n)
        runs[n] = lm.run(s)
    for n in (5, 64):
        a, b = runs[1], runs[n]
        assert a.attrs["status"] == b.attrs["status"] == ("ok" if case == "ok" else "diverged")
        assert list(a.data_vars) == list(b.data_vars) and a.sizes == b.sizes
        for k in a.data_vars:
            torch.testing.assert_close(b[k].values, a[k].values, rtol=0, atol=0, equal_nan=True, msg=k)
    if case != "ok":
        ds, last = runs[64], 13 if case == "loss_nan" else 12
        assert ds.sizes["step"] == last + 1 and np.isfinite(ds.lr.values[last])
        # the diverged step's loss is recorded; its update only when it was applied
        assert np.isnan(ds.loss.values[last]) == np.isnan(ds.grad_norm.values[last]) == (case == "loss_nan")


def test_training_loop_does_not_synchronise_with_the_host(monkeypatch):
    """On CUDA, the steps of a float32 run (after the first, which takes diagnostics) make no
    synchronising call: losses, divergence checks and the Monitor's channels stay on the device."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    real_lr_at, real_evaluate = lm.lr_at, lm.evaluate

    def lr_at(step, *a, **kw):  # called first in every step
        torch.cuda.set_sync_debug_mode("error" if step >= 1 else 0)
        return real_lr_at(step, *a, **kw)

    def evaluate(*a, **kw):  # evaluation reads the loss back: allowed
        torch.cuda.set_sync_debug_mode(0)
        return real_evaluate(*a, **kw)

    monkeypatch.setattr(lm, "lr_at", lr_at)
    monkeypatch.setattr(lm, "evaluate", evaluate)
    try:
        ds = lm.run(spec(steps=12, diag_every=1000, device="cuda").replace(eval_every=100))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert ds.attrs["status"] == "ok" and np.isfinite(ds.loss.values).all()
    assert np.isfinite(ds.grad_norm.values).all() and np.isfinite(ds.xgrad.values[1:]).all()


def test_scaler_skips_a_nonfinite_loss_only_when_asked():
    # a large init overflows float16 logits but not float32: three float16 steps give a non-finite loss
    switch = [Perturbation("precision_switch", 8, 3, params={"dtype": "float16"})]
    stop = lm.run(spec(steps=20, perts=switch, init_scale=1000.0, grad_scaler=True))
    assert stop.attrs["status"] == "diverged" and stop.sizes["step"] == 9 and np.isnan(stop.loss.values[8])
    go = lm.run(spec(steps=20, perts=switch, init_scale=1000.0, grad_scaler=True, skip_nonfinite_loss=True))
    assert go.attrs["status"] == "ok" and go.sizes["step"] == 20
    np.testing.assert_array_equal(go.loss.values[:8], stop.loss.values[:8])
    assert not np.isfinite(go.loss.values[8:11]).any() and np.isfinite(go.loss.values[11:]).all()
    assert go.skipped_step.values.tolist() == [0.0] * 8 + [1.0] * 3 + [0.0] * 9
    assert (go.nonfinite_grads.values[8:11] > 0).all() and (go.nonfinite_grads.values[11:] == 0).all()
    assert go.loss_scale.values[[8, 9, 10, 11]].tolist() == [2.0**16, 2.0**15, 2.0**14, 2.0**13]
    assert go.adam_state_nonfinite.values.max() == 0  # the skipped steps never reached AdamW
    with pytest.raises(ValueError, match="skip_nonfinite_loss needs grad_scaler"):
        lm.run(spec(steps=5, autocast_dtype="float16", skip_nonfinite_loss=True))
