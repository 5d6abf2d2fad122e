"""Early warning: labels, leakage guard, meta-state (streaming == batch), detectors, calibration, lr_ramp."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import xarray as xr

from stabstudy import online as D
from stabstudy.analysis.warning import evaluation as E
from stabstudy.analysis.warning.labels import LabelRule, label_run, label_runs
from stabstudy.analysis.warning.metastate import fit_pca, replay
from stabstudy.interventions.perturb import Perturbation, Schedule
from stabstudy.online import MetaConfig, MetaState
from stabstudy.online import features as F

TELEMETRY = ("grad_norm", "xgrad", "update_norm", "update_ratio", "update_grad_cos", "adam_m_norm", "adam_v_mean",
             "attn_logit_max", "attn_entropy_min", "out_logit_max", "lr")


def fake_run(n: int = 300, seed: int = 0, jump_at: int | None = None, nan_every: int = 0) -> xr.Dataset:
    """A run-shaped Dataset: a falling noisy loss (a lasting +2 nats jump at ``jump_at``) and
    telemetry random walks; ``nan_every`` > 0 blanks some telemetry values."""
    rng = np.random.default_rng(seed)
    t = np.arange(n)
    loss = 2.5 + np.exp(-t / 40.0) + 0.05 * rng.standard_normal(n)
    if jump_at is not None:
        loss[jump_at:] += 2.0
    data = {"loss": loss}
    for i, ch in enumerate(TELEMETRY):
        walk = np.cumsum(0.02 * rng.standard_normal(n)) + 0.1 * rng.standard_normal(n)
        data[ch] = np.exp(walk) * (1 + i) if ch not in ("xgrad", "update_grad_cos") else np.tanh(walk)
        if nan_every:
            data[ch][rng.integers(0, n, n // nan_every)] = np.nan
    return xr.Dataset({k: ("step", v) for k, v in data.items()}, coords={"step": t}, attrs={"status": "ok"})


# -- labels ---------------------------------------------------------------------------------------


def test_label_finds_a_lasting_jump_and_ignores_a_transient_one():
    rule = LabelRule(window=50, k=6.0, min_excess=0.3, persist=20, burn_in=50)
    assert label_run(fake_run(jump_at=200), rule)["onset"] == 200
    ds = fake_run()
    ds["loss"][150:155] += 3.0  # back within 5 steps: no collapse
    nan = pytest.approx(np.nan, nan_ok=True)
    assert label_run(ds, rule) == {"event": False, "onset": -1, "level": nan, "excess": nan, "rise": nan, "family": ""}


def test_a_diverged_run_is_an_event_at_its_break():
    ds = fake_run(n=250)
    ds["loss"][240] = np.nan
    ds = ds.isel(step=slice(0, 241))
    ds.attrs["status"] = "diverged"
    out = label_run(ds, LabelRule())
    assert out["event"] and out["onset"] == 240 and out["excess"] == math.inf


def test_labels_never_read_telemetry():
    runs = [fake_run(seed=s, jump_at=j) for s, j in ((0, 200), (1, None), (2, 120))]
    ds = xr.concat(runs, dim="run").assign_coords(run=["a", "b", "c"], status=("run", ["ok"] * 3))
    before = label_runs(ds)
    rng = np.random.default_rng(9)
    noisy = ds.copy()
    for ch in TELEMETRY:
        noisy[ch] = (("run", "step"), rng.standard_normal(ds[ch].shape) * 1e3)
    pd.testing.assert_frame_equal(label_runs(noisy), before)
    pd.testing.assert_frame_equal(label_runs(ds[["loss"]]), before)  # and without any telemetry at all
    assert before.event.tolist() == [True, False, True]
    with pytest.raises(ValueError, match="performance only"):
        LabelRule(channel="grad_norm")


# -- leakage guard --------------------------------------------------------------------------------


def test_forbidden_channels_raise_naming_them():
    for bad in ("lr", "perturbed", "intervened"):
        with pytest.raises(ValueError, match=bad):
            F.check(["grad_norm", bad])
    with pytest.raises(ValueError, match=r"\['lr', 'perturbed'\]"):
        MetaState(["perturbed", "lr", "xgrad"])
    with pytest.raises(ValueError, match="forbidden"):
        E.suite(["lr_spike"], ["grad_norm", "lr"])


def test_knob_driven_channels_enter_only_divided_by_lr_or_knob_aware():
    with pytest.raises(ValueError, match="update_norm"):
        F.check(["update_norm"], kinds=["lr_ramp"])
    with pytest.raises(ValueError, match="update_ratio"):
        MetaState(["grad_norm", "update_ratio"], kinds=["lr_spike"])
    F.check(["update_norm/lr", "update_ratio/lr"], kinds=["lr_ramp"])
    F.check(["update_norm"], kinds=["lr_ramp"], knob_aware=True)
    F.check(["update_norm"], kinds=["outlier_batch"])  # not driven by that kind's knob
    with pytest.raises(ValueError, match="lambda_max"):
        F.check(["lambda_max*lr/2"])
    F.check(["lambda_max*lr/2"], knob_aware=True)
    assert F.is_knob_aware(["lambda_max*lr/2"]) and not F.is_knob_aware(["update_norm/lr"], ["lr_ramp"])
    families = {s.name: s.family for s in E.suite(["lr_ramp", "lr_spike"], F.LM_CHANNELS, river=False)}
    assert families["lambda_max vs 2/lr"] == "knob-aware"
    x = F.column({"update_norm": np.array([2.0, 4.0]), "lr": np.array([0.1, 0.4])}, "update_norm/lr", log=False)
    np.testing.assert_allclose(x, [20.0, 10.0])


# -- meta-state -----------------------------------------------------------------------------------


@pytest.mark.parametrize("ewma", [1.0, 0.2])
def test_streaming_meta_state_equals_batch_replay_of_a_stored_run(tmp_path, ewma):
    feats = ("grad_norm", "xgrad", "update_norm/lr", "update_grad_cos", "attn_logit_max", "attn_entropy_min")
    path = tmp_path / "run.nc"
    fake_run(n=260, seed=3, nan_every=25).to_netcdf(path)
    with xr.open_dataset(path) as f:
        ds = f.load()
    x = F.matrix(ds, feats)
    config = MetaConfig(window=40, min_periods=10, corr_window=20, ewma=ewma)
    pca = fit_pca(replay(x[:150], None, config)["zs"][20:], feats, n_components=3)
    batch = replay(x, pca, config)
    ms = MetaState(feats, pca, config)
    rows = [ms.update(r) for r in x]
    for k, name in enumerate(("t2", "q", "coordination", "eff_dim")):
        stream = np.array([r[k] for r in rows])
        np.testing.assert_allclose(stream, batch[name], rtol=0, atol=1e-9, equal_nan=True)
        assert np.isfinite(stream[60:]).all(), name
    np.testing.assert_allclose(np.array([r.z for r in rows]), batch["z"], atol=1e-9, equal_nan=True)
    # a mapping of the step's channels gives the same row as the matrix
    one = MetaState(feats, pca, config)
    np.testing.assert_allclose([one.update({c: ds[c].values[t] for c in ds.data_vars}).z for t in range(60)],
                               batch["z"][:60], atol=1e-12, equal_nan=True)


def test_meta_state_statistics_mean_what_they_say():
    rng = np.random.default_rng(0)
    common = rng.standard_normal((400, 1))
    x = np.c_[rng.standard_normal((400, 4)), np.zeros((400, 1))]
    x[300:] = common[300:] + 0.05 * rng.standard_normal((100, 5))  # all channels move together
    out = replay(x, fit_pca(replay(x[:250], None, MetaConfig(ewma=1.0))["zs"][64:], list("abcde")),
                 MetaConfig(ewma=1.0))
    assert np.nanmedian(out["coordination"][350:]) > 0.8 > 0.5 > np.nanmedian(out["coordination"][100:250])
    assert np.nanmedian(out["eff_dim"][350:]) < 1.5 < np.nanmedian(out["eff_dim"][100:250])
    shifted = rng.standard_normal((400, 5))
    shifted[300:] += 3.0  # every channel leaves its level by 3 sigma
    pca = fit_pca(replay(shifted[:250], None, MetaConfig())["zs"][64:], list("abcde"))
    out = replay(shifted, pca, MetaConfig())
    assert np.nanmin(out["t2"][305:320]) > np.nanquantile(out["t2"][100:300], 0.99)


# -- detectors ------------------------------------------------------------------------------------


def _detectors() -> dict[str, tuple[D.Detector, str]]:
    """Detector -> (instance at its default threshold, the change it should see)."""
    return {
        "olmo": (D.WindowZ(), "level"),
        "robust_z": (D.RobustZ(), "level"),
        "robust_z_ewma": (D.RobustZ(ewma=0.2, threshold=3.0), "level"),
        "zclip": (D.ZClipZ(threshold=5.0), "level"),
        "level": (D.Level(threshold=1.3), "level"),
        "ews_var": (D.KendallEWS(indicator="variance", threshold=0.85), "variance"),
        "ews_ac1": (D.KendallEWS(indicator="ac1", threshold=0.8), "ac1"),
        "adwin": (D.ADWINGrid(threshold=2.5), "level"),
        "page_hinkley": (D.PageHinkley(), "level"),
    }


def _stream(change: str, seed: int, n: int = 400, at: int = 300) -> np.ndarray:
    rng = np.random.default_rng(seed)
    e = rng.standard_normal(n)
    if change == "level":
        x = 1.0 + 0.05 * e
        x[at:] += 0.5  # +10 sigma, lasting
    elif change == "variance":
        x = e.copy()
        x[at:] *= np.linspace(1, 6, n - at)
    elif change == "ac1":  # white noise, then an AR(1) whose memory grows
        x = e.copy()
        for t in range(at, n):
            x[t] = (0.99 * (t - at) / (n - at)) * x[t - 1] + e[t]
    else:
        x = 1.0 + 0.05 * e
    return x


@pytest.mark.parametrize("name", list(_detectors()))
def test_each_detector_fires_on_a_change_and_stays_quiet_on_noise(name):
    pytest.importorskip("river")
    det, change = _detectors()[name]
    quiet = [det.update(v) for v in _stream("none", seed=1)]
    assert not any(det.alarm(s) for s in quiet), f"{name} alarmed on stationary noise (max {np.nanmax(quiet):.3g})"
    det, change = _detectors()[name]
    x = _stream(change, seed=2)
    scores = np.array([det.update(v) for v in x])
    assert not any(det.alarm(s) for s in scores[:300]), name
    assert any(det.alarm(s) for s in scores[300:]), f"{name} missed the change (max {np.nanmax(scores[300:]):.3g})"


def test_zclip_z_matches_the_zclip_package():
    zclip = pytest.importorskip("zclip")
    rng = np.random.default_rng(0)
    norms = np.abs(1 + 0.2 * rng.standard_normal(300))
    norms[[100, 180, 181]] *= 8  # spikes: ZClip then feeds its clipped value back into the EMA
    ref = zclip.ZClip()
    ours = D.ZClipZ()
    for g in norms:
        z = ours.update(g)
        if not ref.initialized:  # the package's own warm-up, driven on a stream instead of a model
            ref.buffer.append(g)
            if len(ref.buffer) >= ref.warmup_steps:
                ref._initialize_ema()
            assert math.isnan(z)
            continue
        z_ref, _ = ref._compute_positive_zscore(g)
        clip = ref._compute_clip_val(g)
        ref._update_ema(clip if clip is not None else g)
        assert z == pytest.approx(z_ref, rel=1e-12)
        assert (ours.mean, ours.var) == pytest.approx((ref.mean, ref.var), rel=1e-12)


@pytest.mark.parametrize("indicator", ["variance", "ac1"])
def test_streaming_ews_equals_ewstools(indicator):
    pytest.importorskip("ewstools")
    x = _stream(indicator, seed=4, n=160, at=80)
    x[30] = np.nan  # a missing value empties the windows for a while
    det = D.KendallEWS(indicator=indicator, detrend=10, window=20, span=25)
    stream = np.array([det.update(v) for v in x])
    ref = E.ews_reference(x, indicator, 10, 20, 25)
    np.testing.assert_allclose(stream, ref, atol=1e-9, equal_nan=True)
    assert np.isfinite(stream).sum() > 60


def test_kendall_tau_is_scipys_tau_b():
    from scipy import stats

    y = np.array([3.0, 1.0, 2.0, 2.0, 5.0, 4.0, 4.0, 9.0])
    assert D.kendall_tau(y) == pytest.approx(stats.kendalltau(np.arange(y.size), y).statistic, abs=1e-12)
    assert math.isnan(D.kendall_tau(np.ones(5)))


def test_sliding_tau_equals_kendall_tau_of_its_window_exactly():
    from stabstudy.online.detectors import _TauWindow

    rng = np.random.default_rng(3)
    y = rng.integers(0, 6, 400).astype(float)  # many ties
    y[rng.random(400) < 0.03] = np.nan  # missing values enter and leave the window
    y[[50, 51]] = np.inf
    y[200:260] = 2.0  # a constant stretch: every pair tied
    w, seen = _TauWindow(span=25), 0
    for v in y:
        w.push(v)
        ref = D.kendall_tau(np.fromiter(w.values, dtype=float))
        got = w.tau()
        assert (math.isnan(got) and math.isnan(ref)) or got == ref
        seen += math.isfinite(got)
    assert seen > 100


# -- calibration and evaluation -------------------------------------------------------------------


def _ar1(n_runs: int, n: int, seed: int, phi: float = 0.8) -> np.ndarray:
    rng = np.random.default_rng(seed)
    e = rng.standard_normal((n_runs, n))
    x = np.zeros_like(e)
    for t in range(1, n):
        x[:, t] = phi * x[:, t - 1] + e[:, t]
    return x


def test_calibration_hits_the_false_alarm_budget_on_synthetic_nulls():
    budget = 1.0
    cal, held = _ar1(40, 1000, seed=0), _ar1(40, 1000, seed=1)
    segs = {i: (50, 1000) for i in range(40)}
    thr = E.calibrate(cal, segs, budget)
    fa, n = E.count_alarms(cal, thr, segs)
    assert fa <= budget * n / 1000
    assert E.count_alarms(cal, np.nextafter(thr, -np.inf), segs)[0] > budget * n / 1000  # the lowest such threshold
    fa_held, n_held = E.count_alarms(held, thr, segs)
    assert 0.2 <= 1000 * fa_held / n_held <= 3 * budget  # new nulls: the same budget up to sampling
    assert E.calibrate(np.full((2, 10), np.nan), {0: (0, 10)}) == math.inf


def test_vectorised_auc_is_sklearns():
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(0)
    pos, neg = rng.integers(0, 5, 13).astype(float), rng.integers(0, 5, 17).astype(float)  # ties included
    ref = roc_auc_score(np.r_[np.ones(13), np.zeros(17)], np.r_[pos, neg])
    assert float(E.auc_pairs(pos, neg)) == pytest.approx(ref, abs=1e-12)
    value, lo, hi = E.auc(pos, neg, n_boot=200, seed=0)
    assert value == pytest.approx(ref) and lo <= value <= hi


def test_meta_replay_equals_meta_streams():
    runs = xr.concat([fake_run(n=150, seed=s) for s in range(2)], dim="run").assign_coords(run=["a", "b"])
    feats = ("grad_norm", "xgrad", "attn_entropy_min")
    config = MetaConfig(window=30, min_periods=8, corr_window=16)
    pca = fit_pca(replay(F.matrix({c: runs[c].values[0] for c in runs.data_vars}, feats), None, config)["zs"][40:],
                  feats, n_components=2)
    a, b = E.meta_streams(runs, feats, pca, config), E.meta_replay(runs, feats, pca, config)
    xr.testing.assert_allclose(a, b, atol=1e-9)


def test_evaluate_measures_leads_false_alarms_and_auc():
    n, runs = 300, []
    rng = np.random.default_rng(0)
    for i in range(12):
        s = rng.standard_normal(n)
        if i % 2:  # an event at 200, announced from 180 on
            s[180:] += 8
        runs.append(s)
    scores = xr.DataArray(np.stack(runs)[None], dims=("detector", "run", "step"),
                          coords={"detector": ["d"], "run": [f"r{i}" for i in range(12)], "step": np.arange(n)})
    info = pd.DataFrame({"seed": np.arange(12) // 4, "kind": "none", "dose": np.nan, "start": np.nan,
                         "duration": np.nan, "family": "spontaneous", "event": [bool(i % 2) for i in range(12)],
                         "onset": [200 if i % 2 else -1 for i in range(12)], "end": n,
                         "split": ["calibration"] * 6 + ["evaluation"] * 6}, index=scores["run"].values)
    ev = E.evaluate(scores, info, [E.DetectorSpec("d", "x", "single", lambda: D.Level())], budget=1.0, horizon=50,
                    late=10, burn_in=20, n_boot=200)
    row = ev.table[ev.table.events == "all"].iloc[0]
    assert row.n_events == 3 and row.n_detected == 3 and row.lead_median == 20
    assert row.auc == 1.0 and row.fa_per_1k <= 2.0
    assert ev.leads["d"].tolist() == [20.0, 20.0, 20.0]


def test_a_standing_alarm_is_no_warning_but_a_fresh_one_in_the_window_is():
    s = np.zeros(100)
    s[10:] = 5.0  # above the threshold from step 10 on, long before the window [60, 90]
    assert E.first_alarm(s, 1.0, 60, 90) == -1
    s[70] = 0.0  # it falls and rises again inside the window: that rise is the alarm
    assert E.first_alarm(s, 1.0, 60, 90) == 71
    fresh = np.zeros(100)
    fresh[65:] = 5.0
    assert E.first_alarm(fresh, 1.0, 60, 90) == 65
    assert E.first_alarm(fresh, 1.0, 0, 90) == 65 and E.first_alarm(np.full(10, 5.0), 1.0, 0, 9) == 0
    assert E.first_alarm(np.full(100, np.nan), 1.0, 60, 90) == -1  # a score that is never measured never alarms


# -- lr_ramp --------------------------------------------------------------------------------------


def test_lr_ramp_climbs_geometrically_then_holds():
    from stabstudy.registry import KINDS
    from stabstudy.spec import RunSpec

    sched = Schedule([Perturbation("lr_ramp", 10, 4, dose=16.0)])
    f = [sched.lr_factor(s) for s in range(20)]
    assert f[:10] == [1.0] * 10
    np.testing.assert_allclose(f[10:14], [2.0, 4.0, 8.0, 16.0])  # equal steps in log space
    assert f[14:] == [16.0] * 6  # held after the window, to the end of the run
    assert sched.mask(np.arange(20)).tolist() == [0.0] * 10 + [1.0] * 4 + [0.0] * 6  # `perturbed` marks the climb
    both = Schedule([Perturbation("lr_ramp", 0, 2, dose=4.0), Perturbation("lr_spike", 5, 1, dose=10.0)])
    assert both.lr_factor(5) == pytest.approx(40.0)
    assert set(KINDS["lr_ramp"].domains) == {"toy", "lm", "rl"}
    RunSpec("lm", "gpt", "stdlib", 50, 0, perturbations=(Perturbation("lr_ramp", 10, 20, dose=10.0),))
    RunSpec("rl", "ppo", "Pendulum-v1", 50, 0, perturbations=(Perturbation("lr_ramp", 10, 20, dose=10.0),))
    with pytest.raises(ValueError, match="lr_ramp"):  # not a kind of the sequence learners
        RunSpec("seq", "lstm", "adding", 50, 0, perturbations=(Perturbation("lr_ramp", 10, 20, dose=10.0),))


def test_grid_shares_notebook_02_runs():
    from stabstudy.analysis.studies import lm_spikes, meta_state

    hp = dict(n_layer=2, n_head=2, n_embd=64, block_size=64, batch_size=16, corpus_bytes=1000000, warmup=20,
              device="auto", lr=0.003)
    ours = meta_state.grid(300, [0, 1], ramp_start=100, ramps=[[1000.0, 100]], shock_step=150,
                           shocks=[["lr_spike", 10.0, 3], ["outlier_batch", 1.0, 1]], **hp)
    theirs = lm_spikes.spike_grid(300, 150, seeds=(0, 1), events={"lr_spike": (10.0, 3), "outlier_batch": (1.0, 1)}, **hp)
    assert set(theirs) <= set(ours) and len(ours) == 8
    assert meta_state.kinds_of(ours) == ("lr_ramp", "lr_spike", "outlier_batch")


# -- the claims of notebook 04 ----------------------------------------------------------------------


def _study(meta_lead: float, single_lead: float, fa: float, n_events: int = 10, n_null: int = 8, on: float = 0.01,
           loss_lead: float = 0.0, seeds: list[int] | None = None):
    """A MetaStudy holding only what ``claims`` reads: slow-onset events with the given leads (plus
    noise) of the meta-state, a single channel and the loss, null runs with ``fa`` false alarms per
    1,000 steps and ``on`` of their steps in alarm (plus noise); every run its own seed unless
    ``seeds`` (one per event, then one per null run) says otherwise."""
    from stabstudy.analysis.studies import meta_state

    rng = np.random.default_rng(0)
    ev = [f"e{i}" for i in range(n_events)]
    nulls = [f"n{i}" for i in range(n_null)]
    info = pd.DataFrame({"seed": seeds if seeds is not None else np.arange(n_events + n_null),
                         "kind": ["lr_ramp"] * n_events + ["none"] * n_null,
                         "family": ["slow-onset"] * n_events + [""] * n_null,
                         "event": [True] * n_events + [False] * n_null, "split": "evaluation"}, index=ev + nulls)
    leads = pd.DataFrame({"meta-state t2": meta_lead + rng.normal(0, 2, n_events),
                          "EWMA z x": single_lead + rng.normal(0, 2, n_events),
                          meta_state.LOSS: loss_lead + rng.normal(0, 2, n_events)}, index=ev)
    fa_runs = pd.DataFrame({"meta-state t2": np.clip(fa + rng.normal(0, 0.3, n_null), 0, None)}, index=nulls)
    in_alarm = pd.DataFrame({"meta-state t2": np.clip(on + rng.normal(0, 0.005, n_null), 0, 1)}, index=nulls)
    evaluation = E.Evaluation(pd.Series(dtype=float), pd.DataFrame(), leads, fa_runs, {}, in_alarm)
    best_meta = {"all": "meta-state t2", "slow-onset": "meta-state t2"}
    best_single = {"all": "EWMA z x", "slow-onset": "EWMA z x"}
    return meta_state.MetaStudy(info, None, None, None, [], evaluation, leads, best_single, best_meta,
                                pd.DataFrame(), {"late": 20, "budget": 1.0})


def _verdicts(study) -> dict[str, str]:
    from stabstudy.analysis import claims as C
    from stabstudy.analysis.studies import meta_state

    df = C.table(meta_state.claims(study))
    assert df.claim.is_unique
    return dict(zip(df.claim, df.verdict, strict=True))


def _pick(v: dict[str, str], *parts: str) -> str:
    hits = [k for k in v if all(p in k for p in parts)]
    assert len(hits) == 1, (parts, list(v))
    return v[hits[0]]


def test_meta_state_claims_pass_fail_and_go_untested():
    earlier, before, quiet = "earlier than the best single channel", "deviates before performance", "stays quiet"
    loss = "earlier than the loss"
    good = _verdicts(_study(meta_lead=30, single_lead=5, fa=0.0))
    assert _pick(good, earlier, "slow-onset") == _pick(good, loss, "slow-onset") == "supported"
    assert _pick(good, before, "slow-onset") == "supported"
    assert _pick(good, quiet) == "supported"
    assert _pick(good, earlier, "(shock events)") == _pick(good, loss, "(shock events)") == "not tested"
    bad = _verdicts(_study(meta_lead=-5, single_lead=20, fa=5.0, loss_lead=20))
    assert _pick(bad, earlier, "slow-onset") == _pick(bad, before, "slow-onset") == "not supported"
    assert _pick(bad, loss, "slow-onset") == "not supported"
    assert _pick(bad, quiet) == "not supported"
    # one alarm that comes on and stays on: few up-crossings, most steps in alarm
    stuck = _verdicts(_study(meta_lead=30, single_lead=5, fa=0.0, on=0.6))
    assert _pick(stuck, quiet) == "not supported"
    empty = _verdicts(_study(meta_lead=0, single_lead=0, fa=0.0, n_events=0, n_null=0))
    assert set(empty.values()) <= {"not tested", "inconclusive"}


def test_lead_claims_take_seeds_as_units():
    """Ten events of two seeds are two units: the claim cannot be decided, whatever the events say."""
    from stabstudy.analysis import claims as C
    from stabstudy.analysis.studies import meta_state

    pooled = _study(meta_lead=30, single_lead=5, fa=0.0, seeds=[0] * 5 + [1] * 5 + list(range(10, 18)))
    rows = {c.claim: c for c in meta_state.sensitivity_claims(pooled)}
    row = rows["the meta-state warns earlier than the loss at the same false-alarm budget (slow-onset events)"]
    assert row.n == 2 and row.verdict == "inconclusive" and "over seeds" in row.test
    assert C.table([row]).verdict.iloc[0] == "inconclusive"


def test_the_quiet_claim_counts_seeds_not_runs():
    """Two null runs of one seed (the toy's spiking and beta2-null runs share initialisation and batches)
    are one unit of the quiet claim."""
    from stabstudy.analysis.studies import meta_state

    study = _study(meta_lead=30, single_lead=5, fa=0.0)
    study.info["seed"] = [100 + i for i in range(10)] + [i // 2 for i in range(8)]
    assert meta_state.quiet_claim(study).n == 4
    del study.info["seed"]
    assert meta_state.quiet_claim(study).n == 8


def test_before_clip_reads_the_norm_before_clipping_where_a_run_recorded_it():
    """A clipping learner's stored grad_norm is pinned at the clip (PPO at 0.5): the detectors read
    grad_norm_raw where a run has it, the stored norm in runs made before it was recorded."""
    ds = xr.Dataset({"grad_norm": (("run", "step"), [[0.5, 0.5], [1.0, 2.0]], {"units": "grad"}),
                     "grad_norm_raw": (("run", "step"), [[3.0, np.nan], [np.nan, np.nan]])},
                    coords={"run": ["new", "old"], "step": [0, 1]})
    out = E.before_clip(ds)
    np.testing.assert_array_equal(out.grad_norm.values, [[3.0, np.nan], [1.0, 2.0]])
    assert out.attrs[E.BEFORE_CLIP_ATTR] == "1 of 2" and out.grad_norm.attrs == {"units": "grad"}
    assert E.before_clip(ds.drop_vars("grad_norm_raw")).attrs[E.BEFORE_CLIP_ATTR] == "0 of 2"
