"""stabstudy.online: the one robust z (stream and batch equal bit for bit), its edge cases, and an
import that needs numpy only."""

from __future__ import annotations

import copy
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from docblocks import block

from stabstudy import online
from stabstudy.analysis.warning.metastate import replay
from stabstudy.online import RobustScaler, RobustZ, rolling_median_mad, rolling_robust_z


def _series(n: int = 800, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = np.log10(np.abs(rng.standard_cauchy(n)) + 0.1)
    x[rng.choice(n, n // 20, replace=False)] = np.nan
    x[100:140] = 0.5  # ties: a constant stretch (MAD 0, the floor)
    x[[200, 201]] = [np.inf, -np.inf]
    return x


def _reference_z(x: np.ndarray, window: int, min_periods: int, clip: float, floor: float,
                 window_of: str) -> np.ndarray:
    """The robust z as the detector computed it before the sorted window: two ``np.median`` calls
    on an explicit list of the past window (the last ``window`` finite values, or steps)."""
    out = np.full(x.size, np.nan)
    past: list[float] = []
    for t, v in enumerate(x):
        p = np.array([u for u in past if math.isfinite(u)])
        if math.isfinite(v) and p.size >= min_periods:
            med = float(np.median(p))
            mad = float(np.median(np.abs(p - med)))
            out[t] = min(max((v - med) / max(1.4826 * mad, floor), -clip), clip)
        if math.isfinite(v) or window_of == "steps":
            past = (past + [v])[-window:]
    return out


CASES = [dict(window=64, min_periods=16, clip=math.inf, floor=1e-3), dict(window=16, min_periods=4, clip=4.0, floor=1e-3),
         dict(window=5, min_periods=5, clip=10.0, floor=0.1), dict(window=1, min_periods=1, clip=math.inf, floor=1e-3)]


@pytest.mark.parametrize("window_of", ["values", "steps"])
@pytest.mark.parametrize("kw", CASES, ids=lambda kw: f"w{kw['window']}")
def test_streaming_robust_z_equals_the_batch_rolling_version_and_the_reference_bit_for_bit(kw, window_of):
    for seed in range(3):
        x = _series(seed=seed)
        det = RobustZ(**kw, window_of=window_of)
        stream = np.array([det.z(v) for v in x])
        np.testing.assert_array_equal(stream, rolling_robust_z(x, **kw, window_of=window_of))
        np.testing.assert_array_equal(stream, _reference_z(x, **kw, window_of=window_of))
        assert np.isfinite(stream).sum() > x.size // 2  # not a comparison of NaNs


def test_the_selected_mad_is_the_median_of_the_sorted_deviations_exactly():
    from stabstudy.online.robust import _mad, _median

    rng = np.random.default_rng(0)
    for trial in range(2000):  # odd and even counts, ties (integers), wide magnitudes
        n = int(rng.integers(1, 70))
        v = rng.integers(0, 6, n).astype(float) if trial % 2 else rng.standard_normal(n) * 10 ** rng.uniform(-5, 5)
        s = sorted(v.tolist())
        med = _median(s)
        assert _mad(s, med) == _median(sorted(abs(u - med) for u in s))


def _replayed() -> list[online.Detector]:
    """Every detector of notebook 04's suite and odd sizes and sides of the ones with an array form."""
    from stabstudy.analysis.warning import evaluation as E

    specs = E.suite(("lr_ramp", "lr_spike", "outlier_batch"), ["grad_norm", "xgrad"], lambda_max=True)
    return [s.make() for s in specs if not s.feature.startswith("meta:")] + [
        online.WindowZ(window=8, min_periods=2, side="both"), online.KendallEWS("v", "variance", 3, 4, 5),
        online.KendallEWS("a", "ac1", 5, 6, 3), online.Level("l", side="down", hold=False), online.NonFinite(),
        RobustZ(window=5, min_periods=5, ewma=0.3, side="down", clip=2.0, window_of="steps")]


@pytest.mark.parametrize("n", [800, 12])
def test_replay_equals_feeding_update_value_by_value_bit_for_bit(n):
    pytest.importorskip("river")
    rng = np.random.default_rng(1)
    series = [_series(seed=1)[:n], np.round(rng.standard_normal(n), 1)]  # gaps, infinities, ties
    for x in series:
        for det in _replayed():
            stream = copy.deepcopy(det)
            np.testing.assert_array_equal(det.replay(x), [stream.update(v) for v in x], err_msg=det.name)
    x = _series(seed=2)
    seen = RobustZ(window=16, min_periods=4)
    for v in x[:50]:
        seen.update(v)
    before, state = copy.deepcopy(seen), list(seen._order)  # it replays from its state and keeps it
    np.testing.assert_array_equal(seen.replay(x[50:]), [before.update(v) for v in x[50:]])
    np.testing.assert_array_equal(list(seen._order), state)


def test_robust_z_scores_nan_for_missing_values_and_until_min_periods_finite_values():
    det = RobustZ(window=8, min_periods=3, side="up")
    scores = [det.update(v) for v in [1.0, np.nan, 2.0, np.inf, 3.0, 4.0, np.nan, 10.0]]
    assert all(math.isnan(s) for s in scores[:5])  # two finite past values at the 5th step (3.0): not enough
    assert scores[5] == pytest.approx((4.0 - 2.0) / (1.4826 * 1.0))
    assert math.isnan(scores[6])  # a missing value scores NaN and enters no window
    assert scores[7] == pytest.approx((10.0 - 2.5) / (1.4826 * 1.0))


def test_window_of_steps_lets_a_gap_age_the_window_and_values_does_not():
    x = np.array([1.0, 2.0, 3.0, np.nan, np.nan, 4.0])
    by_values = RobustZ(window=3, min_periods=3, window_of="values")
    by_steps = RobustZ(window=3, min_periods=3, window_of="steps")
    zv = [by_values.z(v) for v in x]
    zs = [by_steps.z(v) for v in x]
    assert zv[5] == pytest.approx((4.0 - 2.0) / 1.4826)  # the window is still 1, 2, 3
    assert math.isnan(zs[5])  # the window is 3, NaN, NaN: one finite value < min_periods


def test_a_constant_window_uses_the_floor_and_clip_bounds_the_score():
    det = RobustZ(window=10, min_periods=4, floor=0.5, clip=3.0)
    for _ in range(10):
        det.z(2.0)
    assert det.z(3.0) == pytest.approx(2.0)  # (3 - 2) / floor
    assert det.z(100.0) == 3.0


def test_the_ewma_and_the_side_shape_the_score():
    x = _series(seed=4)
    plain, up, down = RobustZ(ewma=0.3), RobustZ(ewma=0.3, side="up"), RobustZ(ewma=0.3, side="down")
    z = rolling_robust_z(x)
    s = np.array([plain.update(v) for v in x])
    u, d = np.array([up.update(v) for v in x]), np.array([down.update(v) for v in x])
    live = np.flatnonzero(np.isfinite(z))
    ew = np.empty(live.size)
    ew[0] = z[live[0]]
    for i in range(1, live.size):
        ew[i] = 0.3 * z[live[i]] + 0.7 * ew[i - 1]
    np.testing.assert_allclose(s[live], np.abs(ew), rtol=1e-12)
    np.testing.assert_allclose(u[live], ew, rtol=1e-12)
    np.testing.assert_allclose(d[live], -ew, rtol=1e-12)


def test_the_scaler_equals_the_batch_replay_of_the_meta_state_bit_for_bit():
    x = np.stack([_series(300, seed=s) for s in range(4)], axis=1)
    x[::5, 1] = np.nan  # a channel measured every 5 steps
    sc = RobustScaler(4, window=20, min_periods=5, clip=10.0)
    stream = np.array([sc.update(r) for r in x])
    np.testing.assert_array_equal(stream, rolling_robust_z(x, 20, 5, 10.0, window_of="steps"))
    cfg = online.MetaConfig(window=20, min_periods=5)
    np.testing.assert_array_equal(stream, replay(x, None, cfg)["z"])


def test_the_meta_state_replays_update_row_for_row_exactly():
    from stabstudy.analysis.warning.metastate import fit_pca

    feats = ("grad_norm", "xgrad", "update_grad_cos")
    x = np.stack([_series(300, seed=s) for s in range(3)], axis=1)
    x[::5, 1] = np.nan  # a channel measured every 5 steps
    x[40:45] = np.nan  # a step with nothing measured
    cfg = online.MetaConfig(window=20, min_periods=5, corr_window=16)
    pca = fit_pca(np.nan_to_num(rolling_robust_z(x[60:], 20, 5, 10.0, window_of="steps")), feats, 2)
    for model in (pca, None):
        ms, stream = online.MetaState(feats, model, cfg), online.MetaState(feats, model, cfg)
        got, want = ms.replay(x), [stream.update(r) for r in x]
        assert len(got) == len(want) and ms._n == 0  # the replayed state did not move
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.r_[g[:4], g.z], np.r_[w[:4], w.z])
        assert np.isfinite([g.coordination for g in got]).sum() > 200
    seen = online.MetaState(feats, pca, cfg)
    seen.update(x[0])  # a state that has seen rows replays from there
    twin = copy.deepcopy(seen)
    np.testing.assert_array_equal([r.q for r in seen.replay(x[1:])], [twin.update(r).q for r in x[1:]])


def test_rolling_median_mad_matches_numpy_on_explicit_windows():
    x = _series(400, seed=7)
    med, mad, n = rolling_median_mad(x, 30)
    for t in (0, 1, 29, 30, 150, 399):
        p = x[max(t - 30, 0):t]
        p = p[np.isfinite(p)]
        assert n[t] == p.size
        if p.size:
            assert med[t] == np.median(p) and mad[t] == np.median(np.abs(p - np.median(p)))
        else:
            assert math.isnan(med[t]) and math.isnan(mad[t])


def test_bad_arguments_name_the_valid_choices():
    with pytest.raises(ValueError, match="valid: values, steps"):
        RobustZ(window_of="rows")
    with pytest.raises(ValueError, match="valid: up, down, both"):
        RobustZ(side="upper")
    with pytest.raises(ValueError, match="window and min_periods must be >= 1"):
        RobustZ(window=0)
    with pytest.raises(ValueError, match="valid: values, steps"):
        rolling_robust_z(np.ones(5), window_of="rows")
    with pytest.raises(ValueError, match="a row of 3 features"):
        RobustScaler(3).update(np.ones(4))


def test_import_needs_numpy_only():
    """river, zclip and ewstools are imported inside the classes that need them; no torch, scipy,
    pandas or xarray either (a training loop pays for numpy alone)."""
    code = ("import sys, stabstudy.online; heavy = {'torch', 'scipy', 'pandas', 'xarray', 'sklearn', 'river', "
            "'zclip', 'ewstools'}; print(sorted({m.split('.')[0] for m in sys.modules} & heavy))")
    root = str(Path(__file__).resolve().parents[1])  # this checkout, not an installed copy
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root, env=env)
    assert out.stdout.strip() == "[]", out.stdout


def _run_doc(marker: str) -> dict:
    ns: dict = {}
    exec(compile(block("docs/online.md", marker), f"docs/online.md:{marker}", "exec"), ns)
    return ns


def test_docs_detector_example_alarms_at_the_spike_only():
    assert _run_doc("alarms = [")["alarms"] == [150]


def test_docs_controller_example_skips_the_outlier_step_only():
    ctrl = _run_doc("Controller(dets")["ctrl"]
    assert ctrl.records()["intervened"].nonzero()[0].tolist() == [100]


def test_docs_meta_state_example_gives_a_coordination_and_an_effective_dimension():
    row = _run_doc("MetaState([")["row"]
    assert 1 / 3 <= row.coordination <= 1 and 1 <= row.eff_dim <= 3
    assert np.isnan(row.t2)  # no PCA given: no T^2
