"""One dose across algorithms: SAC's entropy coefficient outside the lr spike, env-side transitions out of
the replay buffer when their window ends, evaluations with their spread, and the stale rule for stored runs."""

import numpy as np
import pytest
import torch
from stable_baselines3.common.callbacks import BaseCallback

from stabstudy.learners.rl import learner as rl
from stabstudy.learners.rl.callbacks import PerturbationCallback
from stabstudy.spec import Perturbation, RunSpec

torch.set_num_threads(1)
TINY = dict(hidden=16, batch_size=32, learning_starts=50, eval_episodes=1, eval_max_steps=20, diag_every=5)


def _train(spec):
    """(model, PerturbationCallback) after ``spec.steps`` env steps with the study's callbacks."""
    model = rl.build_model(spec)
    rec, cb = rl.callbacks_for(spec, monitor=False, evaluation=False)
    seen = []

    class Watch(BaseCallback):  # after the spike's hook: sees the applied lr of SAC's entropy optimizer
        def _init_callback(self):
            model.ent_coef_optimizer.register_step_pre_hook(
                lambda o, *a: seen.append((model.num_timesteps, o.param_groups[0]["lr"])))

        def _on_step(self):
            return True

    if spec.learner == "sac":
        cb.callbacks.append(Watch())
    model.learn(spec.steps, callback=cb)
    pc = next(c for c in cb.callbacks if isinstance(c, PerturbationCallback))
    return model, pc, seen


@pytest.mark.parametrize("spiked", [False, True])
def test_sacs_entropy_coefficient_is_left_out_of_the_lr_spike_unless_asked(spiked):
    spec = RunSpec("rl", "sac", "Pendulum-v1", 160, 0, hparams={**TINY, "spike_ent_coef": spiked},
                   perturbations=(Perturbation("lr_spike", 100, 30, 10.0),))
    model, _, seen = _train(spec)
    inside = {lr for t, lr in seen if 100 <= t < 130}
    outside = {lr for t, lr in seen if not 100 <= t < 130}
    assert outside == {3e-4} and len(inside) == 1
    assert inside.pop() == (pytest.approx(3e-3) if spiked else 3e-4)
    assert model.critic.optimizer.param_groups[0]["lr"] == 3e-4  # the networks' spike is undone at the end


@pytest.mark.parametrize("purge", [True, False])
def test_transitions_of_an_env_window_leave_the_replay_buffer_when_it_ends(purge):
    spec = RunSpec("rl", "sac", "Pendulum-v1", 300, 0, hparams={**TINY, "purge_replay": purge},
                   perturbations=(Perturbation("reward_scale", 100, 50, 1000.0),))
    model, pc, _ = _train(spec)
    rb = model.replay_buffer
    n = rb.buffer_size if rb.full else rb.pos
    worst = np.abs(rb.rewards[:n]).max()  # Pendulum's reward lies in [-16.3, 0]
    if purge:
        assert n == 250 and pc.replay_purged == 50 and worst < 17
    else:
        assert n == 300 and pc.replay_purged == 0 and worst > 1000


def test_a_full_replay_buffer_keeps_the_window_and_says_so():
    spec = RunSpec("rl", "td3", "Pendulum-v1", 200, 0, hparams={**TINY, "buffer_size": 120},
                   perturbations=(Perturbation("action_noise", 100, 50, 0.5),))
    _, pc, _ = _train(spec)
    assert pc.replay_purged == 0 and pc.replay_kept == 50


@pytest.mark.parametrize("episodes", [1, 3])
def test_evaluations_record_the_spread_of_their_episodes(episodes):
    ds = rl.run(RunSpec("rl", "sac", "Pendulum-v1", 120, 0, hparams={**TINY, "eval_episodes": episodes},
                        eval_every=60))
    ev = np.isfinite(ds.perf.values)
    assert ev.sum() >= 2
    spread = ds.perf_std.values[ev]
    assert np.isnan(spread).all() if episodes == 1 else (np.isfinite(spread).all() and (spread > 0).any())
    assert ds.attrs["dose_rules"] == rl.DOSE_RULES


def test_stored_runs_of_the_old_dose_rules_are_stale_only_where_the_rules_act():
    spike = (Perturbation("lr_spike", 100, 30, 10.0),)
    scale = (Perturbation("reward_scale", 100, 30, 10.0),)
    old = {"status": "ok", "monitor_own_steps": 1, "perturbation_rows": 1}
    new = {**old, "dose_rules": rl.DOSE_RULES}
    spec = lambda algo, perts: RunSpec("rl", algo, "Pendulum-v1", 200, 0, perturbations=perts)  # noqa: E731
    assert "dose rules" in rl.stale(spec("sac", spike), old)
    assert "dose rules" in rl.stale(spec("td3", scale), old)
    assert rl.stale(spec("ppo", spike), old) is None and rl.stale(spec("td3", spike), old) is None
    assert rl.stale(spec("ppo", scale), old) is None  # stale for another reason, not this one
    assert rl.stale(spec("sac", spike), new) is None and rl.stale(spec("td3", scale), new) is None
