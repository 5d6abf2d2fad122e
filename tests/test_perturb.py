"""The perturbation skeleton: one Perturber with hooks, each kind's effect registered once."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stabstudy import registry
from stabstudy.interventions import perturb
from stabstudy.interventions.perturb import EFFECTS, Effect, Perturber, Schedule
from stabstudy.learners import toy
from stabstudy.registry import KINDS, Kind
from stabstudy.spec import Perturbation, RunSpec

SMALL = {"width": 16, "depth": 1, "n_train": 128, "n_test": 64, "lr": 0.1}


@pytest.fixture
def weight_scale():
    """A new kind, added in one place: its table row and what it does, in one register call."""
    @perturb.register(Kind("weight_scale", "parametric", ("toy",), "factor multiplying every parameter",
                           instantaneous=True))
    class WeightScale(Effect):
        def on_params(self, p, model, ctx):
            with torch.no_grad():
                for w in model.parameters():
                    w.mul_(p.dose)

    yield "weight_scale"
    perturb.unregister("weight_scale")


def test_a_kind_added_in_one_place_runs_through_the_toy_learner(weight_scale):
    base = RunSpec("toy", "gd", "digits", 10, 0, hparams=SMALL)
    hit = base.replace(perturbations=(Perturbation(weight_scale, start=5, dose=0.0),))
    a, b = toy.run(base), toy.run(hit)
    np.testing.assert_array_equal(a.loss.values[:5], b.loss.values[:5])  # nothing before its start
    assert b.loss.values[5] == 0.5  # every weight zero: the net outputs 0, MSE to one-hot targets is 1/2
    assert a.loss.values[5] != 0.5 and list(b.perturbed.values) == [0] * 5 + [1] + [0] * 4
    assert "weight_scale" in {k.name for k in registry.KINDS.values()}
    with pytest.raises(ValueError, match=r"does not apply to domain 'lm' \(it applies to toy\)"):
        RunSpec("lm", "gpt", "stdlib", 10, 0, perturbations=(Perturbation(weight_scale, 1),))


def test_a_kind_is_gone_after_unregister_and_builtins_stay(weight_scale):
    perturb.unregister(weight_scale)
    with pytest.raises(ValueError, match="unknown perturbation kind 'weight_scale'; valid kinds: .*lr_spike"):
        Perturbation(weight_scale, 1)
    with pytest.raises(ValueError, match="'lr_spike' is built in; only kinds register added can be removed"):
        perturb.unregister("lr_spike")
    assert "lr_spike" in KINDS and "lr_spike" in EFFECTS


@pytest.mark.parametrize("kind, match", [
    ("nonesuch", r"unknown perturbation kind 'nonesuch'; valid kinds"),
    ("lr_spike", r"'lr_spike' already has an effect \(LRSpike\)"),
    (Kind("x2", "vibes", ("toy",), "d"), r"unknown dimension 'vibes'; valid: optimization, "),
    (Kind("x3", "parametric", ("chess",), "d"), r"domains must be a non-empty tuple of toy, rl, lm, seq"),
    (Kind("action_noise", "parametric", ("toy",), "d"), r"'action_noise' is taken or not an identifier"),
])
def test_register_names_what_is_wrong(kind, match):
    with pytest.raises(ValueError, match=match):
        perturb.register(kind)(type("E", (Effect,), {}))
    assert set(EFFECTS) <= set(KINDS) and not {"x2", "x3"} & set(KINDS)


def test_every_kind_of_a_perturber_domain_has_an_effect_and_no_effect_lacks_a_kind():
    perturber_domains = {"toy", "lm", "seq"}
    want = [k for k, v in KINDS.items() if perturber_domains & set(v.domains)]
    assert list(EFFECTS) == want  # registration order is the registry's order
    with pytest.raises(ValueError, match=r"'action_noise' has no effect .* kinds with effects: lr_spike, "):
        Perturber([Perturbation("action_noise", 0)], torch.Generator())


def _sgd_adam():
    w = torch.nn.Parameter(torch.ones(3))
    return w, torch.optim.Adam([w], lr=1.0, betas=(0.9, 0.99))


def test_hooks_act_in_their_window_only_and_the_optimizer_is_restored_after():
    w, opt = _sgd_adam()
    pert = Perturber([Perturbation("beta2_shift", 2, 2, dose=0.5), Perturbation("beta2_shift", 3, 2, dose=0.7),
                      Perturbation("lr_spike", 1, 2, dose=10.0), Perturbation("lr_ramp", 2, 2, dose=4.0),
                      Perturbation("loss_scale", 4, 1, dose=3.0)], torch.Generator())
    seen = []
    for step in range(6):
        lr = pert.on_step_start(step, opt, 0.1)
        seen.append((lr, opt.param_groups[0]["lr"], opt.param_groups[0]["betas"], float(pert.on_loss(step, torch.tensor(1.0)))))
    # lr: spike x10 on [1, 3); the ramp climbs 4**0.5, 4 on [2, 4) and stays at 4
    assert [s[0] for s in seen] == [0.1, 0.1 * 10.0, 0.1 * (10.0 * 2.0), 0.1 * 4.0, 0.1 * 4.0, 0.1 * 4.0]
    assert all(s[0] == s[1] for s in seen)
    # betas: the first listed window acts where two overlap (step 3), the optimizer's own after
    assert [s[2] for s in seen] == [(0.9, 0.99), (0.9, 0.99), (0.9, 0.5), (0.9, 0.5), (0.9, 0.7), (0.9, 0.99)]
    assert [s[3] for s in seen] == [1.0, 1.0, 1.0, 1.0, 3.0, 1.0]


def test_instantaneous_kinds_act_once_and_draw_from_the_generator():
    def noised(seed, start=2):
        net = torch.nn.Linear(3, 2)
        torch.nn.init.ones_(net.weight)
        pert = Perturber(Schedule((Perturbation("weight_noise", start, 3, dose=0.1),)), torch.Generator().manual_seed(seed))
        trace = []
        for step in range(6):
            pert.on_params(step, net)
            trace.append(net.weight.detach().clone())
        return trace

    t = noised(0)
    assert torch.equal(t[0], t[1]) and not torch.equal(t[1], t[2]) and all(torch.equal(t[2], x) for x in t[3:])
    assert torch.equal(noised(0)[5], t[5]) and not torch.equal(noised(1)[5], t[5])


def test_batch_hooks_need_the_learners_outliers_and_settings_fall_back_to_the_default():
    ob = Perturber([Perturbation("outlier_batch", 0, dose=0.5)], torch.Generator())
    with pytest.raises(ValueError, match="outlier_batch: this learner gave its Perturber no outliers function"):
        ob.on_batch(0, (torch.zeros(2),))
    sw = Perturber([Perturbation("precision_switch", 1, 1, params={"dtype": "float16"}),
                    Perturbation("no_warmup", 0)], torch.Generator())
    assert sw.overrides("autocast_dtype") and not ob.overrides("autocast_dtype")
    assert [sw.setting(s, "autocast_dtype", "float32") for s in range(3)] == ["float32", "float16", "float32"]
    assert sw.hparams({"warmup": 10, "lr": 1.0}) == {"warmup": 0, "lr": 1.0}
