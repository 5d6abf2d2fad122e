"""The meta-state as a Controller detector: streamed in a training loop it equals the replay of the
stored run, calibrated on unperturbed runs it stays quiet on a null run and acts after an lr spike."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stabstudy.analysis.warning.evaluation import calibrate_detector
from stabstudy.analysis.warning.metastate import replay
from stabstudy.instruments.telemetry import Monitor
from stabstudy.interventions.control import Controller, Skip
from stabstudy.online import MetaConfig, MetaDetector, features

FEATS = ("grad_norm", "xgrad", "update_norm/lr", "update_grad_cos", "adam_m_norm", "adam_v_mean")
SPIKE = 200  # the lr spike's first step (five steps at x30)


def _train(seed: int, detector=None, spike: float = 1.0, steps: int = 260):
    """Full-batch AdamW on a random regression; returns the Monitor's Dataset and the controller."""
    torch.manual_seed(seed)
    x, y = torch.randn(64, 6), torch.randn(64, 1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = Monitor(model, opt)
    ctrl = Controller(detector, Skip(), signal="meta").attach(opt, mon) if detector is not None else None
    for t in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.param_groups[0]["lr"] = 1e-2 * (spike if SPIKE <= t < SPIKE + 5 else 1.0)
        opt.step()
    mon.close()
    if ctrl is not None:
        ctrl.close()
    return mon.to_dataset(), ctrl


@pytest.fixture(scope="module")
def nulls():
    return [_train(seed)[0] for seed in range(4)]


def test_streamed_scores_equal_the_replay_of_the_stored_run_one_step_behind(nulls):
    det = calibrate_detector(nulls, FEATS)
    watch = MetaDetector(det.state.pca, "t2", np.inf, det.state.config, burn_in=det.burn_in)
    ds, ctrl = _train(10, watch)
    offline = replay(features.matrix(ds, FEATS), det.state.pca, det.state.config)["t2"]
    # before step t lands the Controller has the complete row t - 1
    expected = {t + 1: v for t, v in enumerate(offline[:-1]) if t >= det.burn_in and np.isfinite(v)}
    assert expected and ctrl.scores.keys() == expected.keys()
    np.testing.assert_allclose([ctrl.scores[t] for t in expected], list(expected.values()), rtol=1e-9)
    assert ctrl.n_actions == 0


@pytest.mark.parametrize("seed", [10, 11, 12])
def test_calibrated_on_unperturbed_runs_it_is_quiet_on_a_null_run_and_acts_after_an_lr_spike(nulls, seed):
    _, quiet = _train(seed, calibrate_detector(nulls, FEATS))
    assert quiet.n_actions == 0
    _, spiked = _train(seed, calibrate_detector(nulls, FEATS), spike=30.0)
    acted = np.flatnonzero(spiked.records()["intervened"])
    assert acted.size and SPIKE < acted[0] <= SPIKE + 30


def test_bad_input_is_refused_with_the_valid_choices(nulls):
    with pytest.raises(ValueError, match="valid: t2, q"):
        calibrate_detector(nulls, FEATS, statistic="T2")
    with pytest.raises(ValueError, match=r"lacks channel\(s\) \['attn_logit_max'\]"):
        calibrate_detector(nulls, (*FEATS, "attn_logit_max"))
    det = calibrate_detector(nulls, FEATS, statistic="q", config=MetaConfig(ewma=1.0))
    assert det.name == "meta_q" and np.isfinite(det.threshold)
    with pytest.raises(ValueError, match="valid: t2, q"):
        MetaDetector(det.state.pca, "coordination")
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match="attach\\(optimizer, monitor\\)"):
        Controller(det, Skip(), signal="meta").attach(torch.optim.Adam(model.parameters()))
