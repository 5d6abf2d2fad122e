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


def _sampled(model, after):
    """Every minibatch the learner draws once ``num_timesteps > after``, as (rewards, observations, next observations)."""
    rb, batches = model.replay_buffer, []
    sample = rb.sample

    def watched(*a, **k):
        b = sample(*a, **k)
        if model.num_timesteps > after:
            batches.append((b.rewards.numpy().ravel(), b.observations.numpy(), b.next_observations.numpy()))
        return b

    rb.sample = watched
    return batches


def _train_watching(spec, after):
    """:func:`_train` with the minibatches drawn after env step ``after``."""
    model = rl.build_model(spec)
    rec, cb = rl.callbacks_for(spec, monitor=False, evaluation=False)
    batches = _sampled(model, after)
    model.learn(spec.steps, callback=cb)
    return model, next(c for c in cb.callbacks if isinstance(c, PerturbationCallback)), batches


@pytest.mark.parametrize("purge", [True, False])
def test_transitions_of_an_env_window_leave_the_replay_buffer_when_it_ends(purge):
    spec = RunSpec("rl", "sac", "Pendulum-v1", 300, 0, hparams={**TINY, "purge_replay": purge},
                   perturbations=(Perturbation("reward_scale", 100, 50, 1000.0),))
    model, pc, batches = _train_watching(spec, after=151)
    rb = model.replay_buffer
    n = rb.buffer_size if rb.full else rb.pos
    worst = np.abs(rb.rewards[:n]).max()  # Pendulum's reward lies in [-16.3, 0]
    sampled = max(np.abs(r).max() for r, _, _ in batches)
    if purge:  # exactly the window's 50 transitions are gone: no later minibatch holds one
        assert n == 250 and pc.replay_purged == 50 and worst < 17 and sampled < 17
    else:
        assert n == 300 and pc.replay_purged == 0 and worst > 1000 and sampled > 1000


def test_a_wrapped_replay_buffer_drops_the_window_too():
    # capacity 120: the window's transitions 100..149 wrap over rows 100..119 and 0..29
    spec = RunSpec("rl", "td3", "Pendulum-v1", 200, 0, hparams={**TINY, "buffer_size": 120},
                   perturbations=(Perturbation("reward_scale", 100, 50, 1000.0),))
    model, pc, batches = _train_watching(spec, after=151)
    assert pc.replay_purged == 50 and pc.replay_kept == 0
    assert batches and max(np.abs(r).max() for r, _, _ in batches) < 17
    rb = model.replay_buffer  # rotated oldest first (transitions 30..99), then 150..199 written behind them
    assert rb.full and rb.pos == 0 and np.abs(rb.rewards).max() < 17


def test_obs_noise_also_drops_the_transition_that_starts_from_its_last_noisy_observation():
    # Pendulum observes cos, sin and an angular velocity in [-8, 8]; noise of std 1000 is unmistakable
    spec = RunSpec("rl", "sac", "Pendulum-v1", 260, 0, hparams=TINY,
                   perturbations=(Perturbation("obs_noise", 100, 50, 1000.0),))
    model, pc, batches = _train_watching(spec, after=152)
    assert pc.replay_purged == 51
    assert max(max(np.abs(o).max(), np.abs(o2).max()) for _, o, o2 in batches) <= 8.0 + 1e-6
    assert np.abs(model.replay_buffer.observations[:model.replay_buffer.pos]).max() <= 8.0 + 1e-6


def test_a_window_that_alone_fills_the_buffer_is_kept_and_said_so():
    spec = RunSpec("rl", "td3", "Pendulum-v1", 200, 0, hparams={**TINY, "buffer_size": 60},
                   perturbations=(Perturbation("action_noise", 100, 80, 0.5),))
    with pytest.warns(RuntimeWarning, match="kept the 80 transitions"):
        _, pc, _ = _train(spec)
    assert pc.replay_purged == 0 and pc.replay_kept == 80


def test_purging_changes_nothing_without_an_env_side_window():
    # purge_replay is on by default: a run without an env-side perturbation is the same bit for bit
    spike = (Perturbation("lr_spike", 100, 30, 10.0),)
    on, off = (rl.run(RunSpec("rl", "sac", "Pendulum-v1", 160, 0, hparams={**TINY, "purge_replay": p},
                              perturbations=spike, eval_every=80)) for p in (True, False))
    assert on.attrs["replay_purged"] == off.attrs["replay_purged"] == 0
    for v in on.data_vars:
        np.testing.assert_array_equal(on[v].values, off[v].values, err_msg=v)


@pytest.mark.parametrize("episodes", [1, 3])
def test_evaluations_record_the_spread_of_their_episodes(episodes):
    ds = rl.run(RunSpec("rl", "sac", "Pendulum-v1", 120, 0, hparams={**TINY, "eval_episodes": episodes},
                        eval_every=60))
    ev = np.isfinite(ds.perf.values)
    assert ev.sum() >= 2
    spread = ds.perf_std.values[ev]
    assert np.isnan(spread).all() if episodes == 1 else (np.isfinite(spread).all() and (spread > 0).any())
    assert ds.attrs["dose_rules"] == rl.DOSE_RULES


def test_stored_runs_of_the_old_replay_rule_are_stale_only_where_it_acts():
    spec = lambda algo, kind: RunSpec("rl", algo, "Pendulum-v1", 200, 0,  # noqa: E731
                                      perturbations=(Perturbation(kind, 100, 30, 1.0),))
    old = {"status": "ok", "monitor_own_steps": 1, "perturbation_rows": 1, "dose_rules": rl.DOSE_RULES}
    assert "replay_rule" in rl.stale(spec("sac", "obs_noise"), old)
    assert "replay_rule" in rl.stale(spec("td3", "action_noise"), {**old, "replay_kept": 30})
    assert rl.stale(spec("td3", "action_noise"), {**old, "replay_kept": 0}) is None  # purged alike by both rules
    assert rl.stale(spec("ppo", "obs_noise"), old) is None  # no replay buffer
    assert rl.stale(spec("sac", "obs_noise"), {**old, "replay_rule": rl.REPLAY_RULE}) is None


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


@pytest.mark.parametrize(("algo", "expected"), [
    ("td3", {"updates": 30, "critic_updates": 30, "actor_updates": 15}),  # policy_delay 2: half the actor's
    ("sac", {"updates": 30, "critic_updates": 30, "actor_updates": 30, "ent_coef_updates": 0}),
])
def test_the_spiked_updates_of_each_optimizer_are_counted_whatever_the_monitors_cadence(algo, expected):
    from stabstudy.analysis.studies.rl.checks import spiked_updates

    ds = rl.run(RunSpec("rl", algo, "Pendulum-v1", 160, 0, hparams={**TINY, "monitor_every": 5},
                        perturbations=(Perturbation("lr_spike", 100, 30, 10.0),)))
    assert spiked_updates(ds, 100, 30) == expected
    assert np.isfinite(ds.update_norm.values[(ds.env_step.values >= 100) & (ds.env_step.values < 130)]).sum() < 30
