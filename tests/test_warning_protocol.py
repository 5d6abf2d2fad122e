"""The early-warning protocol of notebook 04: a clean null, outcome classes, collapse specificity,
held-out kinds and resample stability, on constructed runs where the answer is known."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import xarray as xr

from stabstudy.analysis import claims as C
from stabstudy.analysis.studies import meta_robustness as R
from stabstudy.analysis.studies import meta_summaries as V
from stabstudy.analysis.warning import evaluation as E
from stabstudy.analysis.warning import outcomes as O
from stabstudy.analysis.warning import specificity as S

N = 300


def _run(seed: int, kind: str = "none", start: float = np.nan, jump_at: int | None = None, creep: float = 0.0,
         bump: tuple[int, int] | None = None, lr: float = 0.003, precursor: int = 0,
         noise: int | None = None, creep_from: float | None = None) -> xr.Dataset:
    """A run-shaped Dataset: a noisy falling loss, optionally a lasting +2 nats blow-up at ``jump_at``,
    a ``creep`` (nats) reached over 100 steps from ``creep_from`` (default ``start``) and kept, or a
    transient ``bump`` ``(a, b)`` of +0.25 nats;
    telemetry noise (drawn from ``noise``, default ``seed``), with ``grad_norm`` rising ``precursor``
    steps before the blow-up."""
    rng = np.random.default_rng(seed if noise is None else noise)
    t = np.arange(N, dtype=float)
    loss = 2.5 + np.exp(-t / 40.0) + 0.02 * rng.standard_normal(N)
    ent = 1.8 + 0.01 * rng.standard_normal(N)
    if jump_at is not None:
        loss[jump_at:] += 2.0
        ent[jump_at:] = 0.01
    if creep:  # a slow climb that the trailing band follows
        loss += creep * np.clip((t - (start if creep_from is None else creep_from)) / 100.0, 0.0, 1.0)
    if bump is not None:
        loss[bump[0]:bump[1]] += 0.25  # below the label's 0.3-nat floor
    g = np.exp(0.1 * rng.standard_normal(N))
    if jump_at is not None and precursor:
        g[jump_at - precursor:] *= 20.0
    data = {"loss": loss, "attn_entropy_min": ent, "grad_norm": g}
    for ch in ("xgrad", "update_grad_cos"):
        data[ch] = np.tanh(0.1 * rng.standard_normal(N))
    ds = xr.Dataset({k: ("step", v) for k, v in data.items()}, coords={"step": np.arange(N)})
    return ds.assign(pert_kind=kind, pert_dose=1.0 if kind != "none" else np.nan, pert_start=start,
                     pert_duration=10.0 if kind != "none" else np.nan, seed=seed, hp_lr=lr)


def _grid(runs: dict[str, xr.Dataset]) -> xr.Dataset:
    return xr.concat(list(runs.values()), dim="run").assign_coords(run=list(runs))


def _labels(ds: xr.Dataset) -> pd.DataFrame:
    from stabstudy.analysis.warning.labels import LabelRule, label_runs

    return label_runs(ds, LabelRule(window=50, k=6.0, min_excess=0.3, persist=20, burn_in=50))


# -- the null ---------------------------------------------------------------------------------------


def test_the_null_is_the_unperturbed_runs_of_the_perturbed_runs_configuration():
    ds = _grid({"u0": _run(0), "p0": _run(0, "lr_spike", 150.0), "s0": _run(0, lr=0.02), "u1": _run(1)})
    info = E.run_info(ds, _labels(ds), calibration_seeds=[0])
    assert info.null.to_dict() == {"u0": True, "p0": False, "s0": False, "u1": True}
    assert list(E.null_runs(info, "calibration").index) == ["u0"]


def test_the_null_read_through_the_store_holds_one_configuration(tmp_store):
    """Runs of two configurations written through the real store and read back with ``load_runs`` (which
    attaches the hyperparameters as coordinates): the unperturbed runs of the other configuration
    (lr 0.02, no warmup; their loss 1.5 nats higher and their channels ten times as noisy) enter
    neither the null, nor the PCA, nor the outcome band."""
    from stabstudy.analysis.studies import meta_state as M
    from stabstudy.analysis.warning.labels import LabelRule
    from stabstudy.online import MetaConfig
    from stabstudy.run.store import load_runs

    small = dict(n_layer=1, n_head=1, n_embd=8, block_size=8, batch_size=2, corpus_bytes=10_000)
    specs = M.grid(N, [0, 1, 2, 3], ramp_start=100, ramps=[], shock_step=150, shocks=[["lr_spike", 100.0, 5]],
                   spontaneous={"lr": 0.02, "warmup": 0}, spontaneous_seeds=[0, 1, 2, 3], null_seeds=[1000, 1001],
                   lr=0.003, warmup=20, **small)
    other = {s for s in specs if dict(s.hparams)["lr"] == 0.02}
    assert len(other) == 4 and len(specs) == 14
    for k, spec in enumerate(specs):
        run = _run(k, jump_at=200 if spec.perturbations else None)
        if spec in other:
            run = run.assign(loss=run.loss + 1.5, grad_norm=run.grad_norm ** 10)
        tmp_store.save(run[["loss", "attn_entropy_min", "grad_norm", "xgrad", "update_grad_cos"]], spec, "ok", 1.0)
    ds = load_runs(specs, tmp_store)
    assert "hp_lr" in ds.coords and "hp_lr" not in ds.data_vars  # where load_runs puts them
    rule = LabelRule(window=50, k=6.0, min_excess=0.3, persist=20, burn_in=50)
    config = MetaConfig(window=32, min_periods=8, corr_window=16)
    res = M.analyse(ds, specs, calibration_seeds=[0, 1, 1000], rule=rule, config=config, n_components=2,
                    meta_features=("grad_norm", "xgrad", "update_grad_cos", "attn_entropy_min"), budget=2.0,
                    horizon=60, late=10, n_boot=20)
    info = res.info
    hashes = {s.spec_hash: s for s in specs}
    null = {h for h, s in hashes.items() if not s.perturbations and s not in other}
    assert set(info.index[info.null]) == null
    cal_null = sorted(h for h in null if hashes[h].seed in (0, 1, 1000))
    assert len(cal_null) == 3
    # the PCA: the in-control steps of those three runs, none of the other configuration's
    assert res.pca.n_fit == 3 * (N - rule.burn_in)
    # the outcome band: theirs alone
    from stabstudy.analysis.warning import outcomes as O

    _, band = O.reference_band(ds, cal_null, "loss", O.OutcomeRule(burn_in=rule.burn_in))
    assert res.outcomes.band.iloc[0] == pytest.approx(band) and band < 0.5


def test_thresholds_are_calibrated_on_unperturbed_runs_only():
    """A perturbed calibration run that never collapses but moves the score must not set the threshold."""
    n, rng = 200, np.random.default_rng(0)
    s = rng.standard_normal((4, n))
    s[1, 120:] += 50.0  # the perturbed, surviving run
    scores = xr.DataArray(s[None], dims=("detector", "run", "step"),
                          coords={"detector": ["d"], "run": ["u0", "p0", "u1", "p1"], "step": np.arange(n)})
    info = pd.DataFrame({"seed": [0, 0, 1, 1], "kind": ["none", "lr_spike"] * 2, "dose": np.nan,
                         "start": [np.nan, 100.0] * 2, "duration": np.nan, "family": ["spontaneous", "shock"] * 2,
                         "event": False, "onset": -1, "end": n, "split": ["calibration"] * 2 + ["evaluation"] * 2,
                         "null": [True, False] * 2}, index=scores["run"].values)
    ev = E.evaluate(scores, info, [E.DetectorSpec("d", "x", "single", lambda: None)], budget=5.0, horizon=20,
                    late=5, burn_in=10, n_boot=50)
    assert ev.thresholds["d"] < 10.0  # with p0 in the null it would sit near 50
    row = ev.table.iloc[0]
    assert row.n_null == 1  # false alarms count on the unperturbed evaluation run alone
    assert list(ev.fa_runs.index) == ["u1"]


def test_false_alarms_and_time_in_alarm_count_on_every_null_runs_quiet_steps():
    """A run where nothing was done but an event came (a spontaneous spike) counts its steps before
    the warning window in the per-run false alarms, as in the table's rate; an alarm that stays on
    counts once as an up-crossing and for its length in the time in alarm."""
    n = 300
    s = np.zeros((3, n))
    s[1, 100:] = 5.0  # an alarm from step 100 that stays on (a quiet run)
    s[2, 60] = 5.0  # one false alarm before the event run's warning window
    scores = xr.DataArray(s[None], dims=("detector", "run", "step"),
                          coords={"detector": ["d"], "run": ["u0", "u1", "e1"], "step": np.arange(n)})
    info = pd.DataFrame({"seed": [0, 1, 2], "kind": "none", "dose": np.nan, "start": np.nan, "duration": np.nan,
                         "family": "spontaneous", "event": [False, False, True], "onset": [-1, -1, 250], "end": n,
                         "split": ["calibration", "evaluation", "evaluation"], "null": True}, index=scores["run"].values)
    ev = E.evaluate(scores, info, [E.DetectorSpec("d", "x", "single", lambda: None)], budget=1.0, horizon=100,
                    late=5, burn_in=50, n_boot=20, thresholds=pd.Series({"d": 1.0}))
    assert list(ev.fa_runs.index) == ["u1", "e1"] and ev.table.iloc[0].n_null == 2
    assert ev.fa_runs.loc["e1", "d"] == pytest.approx(1000.0 / 100)  # steps 50-150 before the window at 150
    assert ev.fa_runs.loc["u1", "d"] == pytest.approx(1000.0 / 250)
    assert ev.in_alarm_runs.loc["u1", "d"] == pytest.approx(200 / 250) and ev.in_alarm_runs.loc["e1", "d"] == pytest.approx(0.01)
    total = ev.table.iloc[0]
    assert total.fa_per_1k == pytest.approx(1000.0 * 2 / 350)


# -- outcome classes ------------------------------------------------------------------------------------


def _outcome_grid():
    runs = {f"u{s}": _run(s) for s in range(6)}
    runs |= {"boom": _run(10, "lr_spike", 150.0, jump_at=160), "creep": _run(11, "lr_ramp", 150.0, creep=0.4),
             "back": _run(12, "lr_spike", 150.0, bump=(155, 200)), "calm": _run(13, "lr_spike", 150.0)}
    ds = _grid(runs)
    info = E.run_info(ds, _labels(ds), calibration_seeds=range(4))
    return ds, info


def test_outcome_classes_see_silent_failures():
    ds, info = _outcome_grid()
    ref = [f"u{s}" for s in range(4)]
    out = O.classify(ds, info, ref)
    assert out.outcome[["boom", "creep", "back", "calm"]].tolist() == list(O.OUTCOMES)
    assert set(out.outcome[ref]) == {"unaffected"}  # the band is as wide as the reference runs' spread
    assert bool(out.entropy_collapse["boom"]) and not out.entropy_collapse[["creep", "calm"]].any()
    assert out.final_excess["creep"] == pytest.approx(0.4, abs=0.05)


def test_outcome_classes_need_a_reference_and_go_nan_without_entropy():
    ds, info = _outcome_grid()
    with pytest.raises(ValueError, match="at least 2"):
        O.classify(ds, info, ["u0"])
    out = O.classify(ds.drop_vars("attn_entropy_min"), info, ["u0", "u1"])
    assert out.entropy_collapse.isna().all()
    with pytest.raises(ValueError, match="invalid outcome rule"):
        O.OutcomeRule(margin=0.0)


# -- collapse specificity -------------------------------------------------------------------------------


def _specificity_case(separates: bool, n_seeds: int = 6, after_onset_only: bool = False):
    """Per seed, two perturbed runs starting at 100: one collapses at 140, one survives. The
    score rises in [100, 140) on the collapsing run when ``separates``; with ``after_onset_only``
    it rises only from the onset on."""
    rng = np.random.default_rng(1)
    runs, rows, vals = [], [], []
    for s in range(n_seeds):
        for collapse in (True, False):
            v = rng.standard_normal(N)
            if collapse and separates:
                v[120:140] += 5.0
            if collapse and after_onset_only:
                v[140:] += 50.0
            name = f"s{s}{'c' if collapse else 'n'}"
            runs.append(name)
            vals.append(v)
            rows.append({"seed": s, "kind": "lr_spike", "start": 100.0, "duration": 10.0, "family": "shock",
                         "event": collapse, "onset": 140 if collapse else -1, "end": N,
                         "split": "evaluation"})
    scores = xr.DataArray(np.stack(vals)[None], dims=("detector", "run", "step"),
                          coords={"detector": ["d"], "run": runs, "step": np.arange(N)})
    info = pd.DataFrame(rows, index=runs)
    return scores, info, info.event.copy()


def test_specificity_separates_when_the_score_rises_before_the_collapse():
    scores, info, y = _specificity_case(separates=True)
    sep = S.separation(S.window_scores(scores, info, 50), info, y, pd.Series({"d": 4.5}), ["d"], n_boot=200)
    r = sep.loc["d"]
    assert r.auc == 1.0 and r.auc_lo == pytest.approx(1.0) and r.n_seeds == 6 and r.precision == 1.0 and r.recall == 1.0
    c = C.interval_above("sep", "our own", r.auc, (r.auc_lo, r.auc_hi), int(r.n_seeds), above=0.5, test="AUC")
    assert c.verdict == "supported"


def test_specificity_ignores_what_comes_after_the_label():
    scores, info, y = _specificity_case(separates=False, after_onset_only=True)
    sep = S.separation(S.window_scores(scores, info, 50), info, y, pd.Series({"d": 3.0}), ["d"], n_boot=200)
    assert sep.loc["d"].auc < 0.9  # the jump after the onset is not seen


def test_specificity_interval_resamples_seeds_not_runs():
    """Eight copies of the runs of one seed are one unit: no interval can be drawn from them."""
    scores, info, y = _specificity_case(separates=True, n_seeds=1)
    info = pd.concat([info.assign(seed=0)] * 8)
    info.index = [f"{r}{i}" for i in range(8) for r in scores["run"].values]
    scores = xr.concat([scores] * 8, dim="run").assign_coords(run=info.index.values)
    sep = S.separation(S.window_scores(scores, info, 50), info, y.reindex(info.index.str[:3]).set_axis(info.index),
                       pd.Series({"d": 3.0}), ["d"], n_boot=200)
    r = sep.loc["d"]
    assert r.n_seeds == 1 and np.isnan(r.auc_lo)
    c = C.interval_above("sep", "our own", r.auc, (r.auc_lo, r.auc_hi), int(r.n_seeds), above=0.5, test="AUC")
    assert c.verdict == "inconclusive"


def test_specificity_auc_is_scikit_learns():
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(0)
    for n in (5, 40):
        score = np.round(rng.standard_normal(n), 1)  # ties
        score[:2] = [np.inf, np.nan]
        y = rng.random(n) < 0.4
        y[:3] = [True, True, False]
        ok = ~np.isnan(score)
        want = roc_auc_score(y[ok], np.clip(score[ok], -np.finfo(float).max, np.finfo(float).max))
        assert S._auc(score, y) == pytest.approx(want, abs=1e-12)
    assert np.isnan(S._auc(np.ones(4), np.ones(4, bool)))


def test_a_seed_resamples_auc_is_the_auc_of_its_runs():
    """The Mann-Whitney sums per pair of seeds give, for any resample of seeds, the AUC of the runs of
    the drawn seeds, each taken as often as its seed was drawn."""
    rng = np.random.default_rng(3)
    seeds = np.repeat(np.arange(6), 4)
    score = np.round(rng.standard_normal(seeds.size), 1)  # ties
    score[0] = np.inf
    y = rng.random(seeds.size) < 0.5
    idx, w = S._seed_counts(seeds, 50, seed=0)
    got = S._resampled_auc(S._pairs_by_seed(score, y, idx, 6), w)
    for b in range(50):
        runs = np.concatenate([np.flatnonzero(seeds == u) for u in range(6) for _ in range(int(w[b, u]))])
        assert got[b] == pytest.approx(S._auc(score[runs], y[runs]), abs=1e-12, nan_ok=True)
    assert S._resampled_auc(S._pairs_by_seed(score, y, idx, 6), np.eye(6)[None].sum(axis=1)) == pytest.approx(
        S._auc(score, y))


def test_interval_above_passes_fails_and_goes_untested():
    ok = C.interval_above("c", "our own", 0.9, (0.8, 1.0), 6, above=0.5, test="AUC")
    bad = C.interval_above("c", "our own", 0.3, (0.2, 0.45), 6, above=0.5, test="AUC")
    straddle = C.interval_above("c", "our own", 0.6, (0.4, 0.8), 6, above=0.5, test="AUC")
    undefined = C.interval_above("c", "our own", 0.6, (np.nan, np.nan), 6, above=0.5, test="AUC")
    missing = C.interval_above("c", "our own", np.nan, (np.nan, np.nan), 0, above=0.5, test="AUC")
    assert [x.verdict for x in (ok, bad, straddle, undefined, missing)] == [
        "supported", "not supported", "inconclusive", "inconclusive", "not tested"]


# -- the whole analysis on constructed runs -------------------------------------------------------------


def _fixture_runs() -> dict[str, xr.Dataset]:
    """Main seeds 0-5 (calibration 0-2): an unperturbed run, a spike that collapses at 200 with a
    grad_norm precursor 30 steps ahead, one that survives; null seeds 100-111 (calibration 100-105);
    on evaluation seeds 3-5 a run of a kind no one knows, started no one knows when: seed 3's loss creeps
    up from step 130 and blows up at 230, seed 4's jumps at 230 (a grad_norm precursor 30 steps ahead
    of both), seed 5's survives."""
    runs = {}
    for s in range(6):
        runs[f"u{s}"] = _run(s)
        runs[f"c{s}"] = _run(s, "lr_spike", 150.0, jump_at=200, precursor=30, noise=s + 50)
        runs[f"n{s}"] = _run(s, "outlier_batch", 150.0, noise=s + 70)
    for s in range(100, 112):
        runs[f"u{s}"] = _run(s)
    runs["h3"] = _run(3, "mystery", jump_at=230, creep=0.6, creep_from=130, precursor=30, noise=90)
    runs["h4"] = _run(4, "mystery", jump_at=230, precursor=30, noise=91)
    runs["h5"] = _run(5, "mystery", noise=92)
    return runs


def _analyse(ds: xr.Dataset, **kw):
    from stabstudy.analysis.studies import meta_state as M
    from stabstudy.analysis.warning.labels import LabelRule
    from stabstudy.online import MetaConfig

    specs = [type("S", (), {"perturbations": ()})()]
    rule = LabelRule(window=50, k=6.0, min_excess=0.3, persist=20, burn_in=50)
    feats = ("grad_norm", "xgrad", "update_grad_cos", "attn_entropy_min")
    return M.analyse(ds, specs, calibration_seeds=[0, 1, 2, *range(100, 106)], rule=rule, meta_features=feats,
                     config=MetaConfig(window=32, min_periods=8, corr_window=16), n_components=2, budget=2.0,
                     horizon=60, late=10, n_boot=100, **kw)


@pytest.fixture(scope="module")
def study():
    return _analyse(_grid(_fixture_runs()), held_out=("mystery",))


def test_analysis_counts_the_independent_nulls_and_bounds_the_clip(study):
    assert study.params["n_null_calibration"] == 9 and study.params["n_null_evaluation"] == 9
    assert (study.evaluation.table.n_null == 9).all()
    assert study.params["t2_bound"] > study.evaluation.thresholds["meta-state t2"]
    # the bound holds for a row of z at the clip
    from stabstudy.online.metastate import t2_q

    z = np.full(len(study.pca.features), 10.0)
    assert t2_q(z, study.pca)[0] <= study.params["t2_bound"]


def test_analysis_outcomes_specificity_and_claims(study):
    from stabstudy.analysis.studies import meta_state as M

    assert set(study.outcomes.outcome[[f"c{s}" for s in range(6)]]) == {"explodes"}
    tab = study.specificity["explodes"]
    m, single = study.specificity_choice["explodes"]
    assert tab.loc[single].auc == 1.0  # grad_norm rises before every collapse and never on survivors
    assert tab.loc[single].n_seeds == 3 and tab.loc[single].n_pos == 3 and tab.loc[single].n_neg == 3
    verdicts = C.table(M.claims(study)).set_index("claim").verdict
    assert len(verdicts) == len(M.claims(study))
    assert {v for c, v in verdicts.items() if "slow-onset events" in c} == {"not tested"}  # every spike jumps
    assert any("earlier than the loss" in c for c in verdicts.index)
    assert len([c for c in verdicts.index if c.startswith("held-out kind mystery")]) == 3
    units = V.design(study).set_index(["events", "vs"])
    assert units.loc[("shock", "the loss"), ["n events", "seeds", "design effect"]].tolist() == [3, 3, 1.0]
    assert units.loc[("slow-onset", "the loss"), "n events"] == 0  # the held-out kind's slow onset is not counted
    check = V.manipulation_check(study.info)
    assert check.loc[("lr_spike", 1.0, 10.0), "shock"] == 6 and check.loc[("lr_spike", 1.0, 10.0), "designed"] == "shock"
    assert check.loc[("mystery", 1.0, 10.0), "designed"] == ""  # no design to check it against


def test_a_run_of_an_unknown_kind_started_at_an_unknown_step_is_scored_from_the_data(study):
    """The held-out runs: kind ``mystery`` (in no table of the protocol), no start. The family comes from the
    loss (seed 3 crept up before its blow-up), the warning window from the onset, and nothing of those
    runs enters a threshold, the PCA or a choice."""
    info = study.info
    assert info.loc["h3", "family"] == "slow-onset" and info.loc["h4", "family"] == "shock"
    assert not info.loc["h5", "event"] and np.isnan(info.loc["h3", "start"])
    assert set(study.held_out_leads.index) == {"h3", "h4"}
    assert study.held_out_leads.loc["h4", "OLMo z grad_norm"] == 30  # credited 30 steps ahead, no start needed
    without = _analyse(_grid({k: v for k, v in _fixture_runs().items() if not k.startswith("h")}))
    pd.testing.assert_series_equal(without.evaluation.thresholds, study.evaluation.thresholds)
    assert without.best_meta == study.best_meta and without.best_single == study.best_single
    np.testing.assert_array_equal(without.pca.components, study.pca.components)


def test_the_protocol_reads_neither_the_kind_nor_the_start():
    """Every perturbed run relabelled to an unknown kind with an unknown start: the same families,
    thresholds, PCA, choices, outcome classes and alarms; a lead can only grow (the window, no longer
    bounded by the start, opens at onset - horizon)."""
    runs = {k: v for k, v in _fixture_runs().items() if not k.startswith("h")}
    known = _analyse(_grid(runs))
    blind = _analyse(_grid({k: v.assign(pert_kind="unknown", pert_start=np.nan) if str(v.pert_kind.values) != "none"
                            else v for k, v in runs.items()}))
    pd.testing.assert_series_equal(known.info.family, blind.info.family)
    pd.testing.assert_series_equal(known.evaluation.thresholds, blind.evaluation.thresholds)
    np.testing.assert_array_equal(known.pca.components, blind.pca.components)
    assert known.best_meta == blind.best_meta and known.best_single == blind.best_single
    pd.testing.assert_frame_equal(known.outcomes, blind.outcomes)
    pd.testing.assert_frame_equal(known.alarms, blind.alarms)
    k, b = known.evaluation.leads, blind.evaluation.leads
    assert ((b >= k) | k.isna()).all(axis=None)


def test_verdict_stability_reports_a_share_per_sensitivity_claim(study):
    from stabstudy.analysis.studies import meta_state as M

    st = R.verdict_stability(study, n_resamples=8, seed=0)
    base = C.table(M.sensitivity_claims(study))
    assert st.claim.tolist() == base.claim.tolist()
    assert ((st.same >= 0) & (st.same <= 1)).all() and (st.n_resamples == 8).all()
    # an untested claim stays untested in every resample
    assert (st[st.verdict == "not tested"].same == 1.0).all()


# -- the spontaneous family -------------------------------------------------------------------------------


def _spont_info(onsets_cal, onsets_ev):
    rows = [{"seed": i, "kind": "none", "start": np.nan, "event": True, "onset": o, "split": "calibration"}
            for i, o in enumerate(onsets_cal)]
    rows += [{"seed": 100 + i, "kind": "none", "start": np.nan, "event": True, "onset": o, "split": "evaluation"}
             for i, o in enumerate(onsets_ev)]
    return pd.DataFrame(rows, index=[f"r{i}" for i in range(len(rows))])


def test_a_step_count_warns_when_every_seed_breaks_at_the_same_step_and_misses_when_onsets_spread():
    from stabstudy.analysis.studies import meta_state as M

    t, ld = M.step_count_baseline(_spont_info([700, 705, 698], [702, 699, 704]), late=10, horizon=50, burn_in=100)
    assert ld.notna().all() and (ld > 0).all() and 650 <= t <= 710
    t, ld = M.step_count_baseline(_spont_info([700, 1200, 1700], [900, 1450, 1900]), late=10, horizon=50, burn_in=100)
    assert ld.isna().all()  # one fixed step cannot be inside every warning window
    t, ld = M.step_count_baseline(_spont_info([], [900]), late=10, horizon=50, burn_in=100)
    assert np.isnan(t) and ld.isna().all()


def test_toy_spontaneous_grid_spreads_the_learning_rate_over_both_halves_and_pairs_a_null():
    from stabstudy.analysis.studies import meta_state as M

    specs = M.toy_spontaneous_grid(100, range(8), lr_range=(0.005, 0.02), beta2=0.95, n_train=512)
    assert len(specs) == 16
    lr = {s.seed: dict(s.hparams)["lr"] for s in specs}
    assert {dict(s.hparams)["beta2"] for s in specs} == {0.95, 0.999}
    for half in (range(4), range(4, 8)):  # each half covers the range
        v = [lr[s] for s in half]
        assert min(v) < 0.008 and max(v) > 0.012
    assert all(0.005 <= v <= 0.02 for v in lr.values())
    ds = xr.Dataset({"hp_beta2": ("run", [0.95, 0.999, 0.999])}, coords={"run": ["a", "b", "c"]})
    assert M.runs_with(ds, beta2=0.999) == ["b", "c"]


# -- cross-domain direction -------------------------------------------------------------------------------


def _directions(direction, n_events=8, seed=0, noise=0.3):
    rng = np.random.default_rng(seed)
    feats = ["a", "b", "c", "d", "e"]
    x = np.asarray(direction, float) + noise * rng.standard_normal((n_events, len(feats)))
    return pd.DataFrame(x, columns=feats, index=[f"r{seed}_{i}" for i in range(n_events)]).assign(
        seed=np.arange(n_events)), feats


def test_cross_domain_directions_agree_differ_and_go_untested():
    from stabstudy.analysis.warning import crossdomain as X

    a, feats = _directions([3, -2, 1, 0, 0.5], seed=0)
    same, _ = _directions([3, -2, 1, 0, 0.5], seed=1)
    other, _ = _directions([-1, 0, 3, -2, 0], seed=2)
    r = X.similarity(a, same, feats, n_boot=200)
    assert r["cos"] > 0.9 and r["p_greater"] < 0.05 and r["ci_low"] > 0.5 and r["n"] == 8
    c = C.from_p("same", "our own", r["cos"], (r["ci_low"], r["ci_high"]), r["n"], p_for=r["p_greater"],
                 p_against=r["p_less"], test="permutation")
    assert c.verdict == "supported"
    r = X.similarity(a, other, feats, n_boot=200)
    c = C.from_p("same", "our own", r["cos"], (r["ci_low"], r["ci_high"]), r["n"], p_for=r["p_greater"],
                 p_against=r["p_less"], test="permutation")
    assert r["p_greater"] > 0.05 and c.verdict != "supported"
    empty = X.similarity(a.iloc[:0], same, feats)
    c = C.from_p("same", "our own", empty["cos"], (empty["ci_low"], empty["ci_high"]), empty["n"],
                 p_for=empty["p_greater"], p_against=empty["p_less"], test="permutation")
    assert c.verdict == "not tested"


def test_pre_onset_directions_average_the_window_before_each_onset():
    from stabstudy.analysis.warning import crossdomain as X

    z = np.zeros((2, 50, 2))
    z[0, 30:40] = [1.0, -2.0]
    z[0, 40:] = 99.0  # after the onset: never read
    meta = xr.Dataset({"z": (("run", "step", "feature"), z)}, coords={"run": ["e", "n"], "feature": ["x", "y"]})
    info = pd.DataFrame({"event": [True, False], "onset": [40, -1], "seed": [3, 4]}, index=["e", "n"])
    d = X.pre_onset_directions(meta, info, ["x", "y"], window=10)
    assert d.index.tolist() == ["e"] and d.loc["e", ["x", "y"]].tolist() == [1.0, -2.0] and d.seed["e"] == 3


def test_cross_domain_claim_of_a_domain_with_itself(study):

    dirs, claim = V.cross_domain(study, study, ("a", "b"), window=20, n_boot=50)
    assert dirs.index.tolist() == ["a", "b"] and (dirs.events == 8).all()  # the held-out kind's 2 events too
    assert claim.effect == pytest.approx(1.0) and claim.n == 6


# -- seeds as the units, robustness, nuisance alarms ---------------------------------------------------------


def test_design_effect_sees_events_that_cluster_by_seed():
    from stabstudy.analysis.warning import units as U

    rng = np.random.default_rng(0)
    seeds = pd.Series(np.repeat(np.arange(20), 5), index=[f"r{i}" for i in range(100)])
    clustered = pd.Series(np.repeat(rng.normal(0, 10, 20), 5) + rng.normal(0, 1, 100), index=seeds.index)
    independent = pd.Series(rng.normal(0, 10, 100), index=seeds.index)
    de = U.design_effect(clustered, seeds)
    assert de["k"] == 20 and de["m"] == 5 and de["icc"] > 0.9 and de["deff"] > 4.5 and de["n_eff"] < 25
    assert U.design_effect(independent, seeds)["deff"] < 1.5
    one = U.design_effect(independent.iloc[::5], seeds.iloc[::5])
    assert one["deff"] == 1.0 and one["n_eff"] == 20
    ps = U.per_seed(clustered, seeds)
    assert len(ps) == 20 and ps.iloc[0] == pytest.approx(clustered.iloc[:5].mean())


def test_a_verdict_is_robust_only_when_every_variation_gives_it():

    base = pd.DataFrame({"claim": ["a", "b", "c"], "verdict": ["supported", "not supported", "not tested"]})
    same = base.copy()
    moved = base.assign(verdict=["supported", "inconclusive", "supported"])
    rob = R.robust_verdicts(base, {"budget 2/1k": same, "horizon 50": moved}).set_index("claim")
    assert rob.robust.tolist() == ["supported", "inconclusive", "not tested"]
    assert rob.loc["b", "why"] == "not robust: horizon 50: inconclusive" and rob.loc["a", "why"] == ""
    assert rob.loc["b", "budget 2/1k"] == "not supported"


def test_the_protocol_varies_one_declared_setting_at_a_time(study):
    from stabstudy.analysis.studies import meta_state as M
    from stabstudy.analysis.warning.labels import LabelRule

    ds = _grid(_fixture_runs())
    specs = [type("S", (), {"perturbations": ()})()]
    rule = LabelRule(window=50, k=6.0, min_excess=0.3, persist=20, burn_in=50)
    kw = dict(calibration_seeds=[0, 1, 2, *range(100, 106)], rule=rule)
    budget = R.vary(study, ds, specs, {"budget": 0.5}, **kw)
    assert budget.scores is study.scores and budget.params["budget"] == 0.5  # nothing re-scored
    assert (budget.evaluation.thresholds >= study.evaluation.thresholds).all()
    window = R.vary(study, ds, specs, {"window": 16}, **kw)
    assert window.params["config"].window == 16 and window.params["config"].min_periods == 4
    same = [s.name for s in study.specs if not s.windowed]
    xr.testing.assert_equal(window.scores.sel(detector=same), study.scores.sel(detector=same))
    assert not np.array_equal(window.scores.sel(detector="EWMA z grad_norm").values,
                              study.scores.sel(detector="EWMA z grad_norm").values, equal_nan=True)
    fast = R.vary(study, ds, specs, {"slow": 100.0}, **kw)  # no creep is that steep: every onset a shock
    assert set(fast.info[fast.info.event].family) == {"shock"} and study.info.loc["h3", "family"] == "slow-onset"
    with pytest.raises(ValueError, match="valid: budget"):
        R.vary(study, ds, specs, {"budjet": 2.0}, **kw)
    table, rob = R.robustness(study, ds, specs, variations={"budget 0.5/1k": {"budget": 0.5}}, **kw)
    assert list(rob.columns) == ["claim", "base", "budget 0.5/1k", "robust", "why"]
    assert table.verdict.tolist() == rob.robust.tolist() and len(table) == len(M.claims(study))


def test_alarms_count_whole_runs_false_nuisance_and_harmful(study):
    """Any up-crossing from the burn-in on (an event run: up to onset + late) counts; on a perturbed run
    that ends unaffected it is a nuisance alarm."""

    n = 100
    s = np.zeros((3, n))
    s[0, 30] = 5.0  # before the burn-in: nothing
    s[1, 80] = 5.0  # an unperturbed run's false alarm
    s[2, 95] = 5.0  # after the event's window (onset 60 + late 10): nothing
    scores = xr.DataArray(s[None], dims=("detector", "run", "step"),
                          coords={"detector": ["d"], "run": ["a", "b", "c"], "step": np.arange(n)})
    info = pd.DataFrame({"event": [False, False, True], "onset": [-1, -1, 60], "end": n}, index=["a", "b", "c"])
    got = E.alarmed(scores, info, pd.Series({"d": 1.0}), late=10, burn_in=50)
    assert got.d.tolist() == [False, True, False]
    tab = V.alarm_table(study)
    assert {"FA/1k", "false", "nuisance", "harmful", "held-out nuisance", "held-out harmful"} <= set(tab.columns)
    m = study.best_meta["all"]
    ev = study.info[(study.info.split == "evaluation") & (study.info.kind == "outlier_batch")]
    calm = ev[study.outcomes.outcome.reindex(ev.index) == "unaffected"].index
    assert tab.loc[m, "nuisance k/n"] == f"{int(study.alarms.loc[calm, m].sum())}/{len(calm)}"
    assert tab.loc[m, "held-out harmful k/n"].endswith("/2")


def test_the_controller_detector_is_chosen_with_both_rates(study):

    rec = V.recommend(study, max_nuisance=1.0)
    assert rec.chosen.sum() == 1 and set(rec.index) <= set(V.CONTROLLER)
    # every candidate allowed: the largest calibration lead wins
    assert rec[rec.chosen].index[0] == rec["calibration lead"].idxmax()
    strict = V.recommend(study, max_nuisance=-1.0)  # none allowed: the fewest nuisance alarms
    assert strict[strict.chosen]["calibration nuisance"].iloc[0] == strict["calibration nuisance"].min()
    assert "threshold=" in rec.loc["OLMo z grad_norm", "line"]
