"""RL learners: real tiny stable-baselines3 runs on Pendulum-v1 (seeded)."""


import gymnasium as gym
import numpy as np
import pytest
import torch
import xarray as xr
from docblocks import block
from stable_baselines3.common.callbacks import CallbackList

from stabstudy.analysis.studies.rl import curves, design, runs
from stabstudy.interventions import control
from stabstudy.interventions.perturb import Perturbation, Schedule
from stabstudy.learners import rl as rlpkg
from stabstudy.learners.rl import envs
from stabstudy.learners.rl import learner as rl
from stabstudy.spec import RunSpec

torch.set_num_threads(1)

TINY = {
    "ppo": dict(hidden=16, n_steps=64, batch_size=32, n_epochs=2, eval_episodes=1, eval_max_steps=50),
    "a2c": dict(hidden=16, n_steps=8, eval_episodes=1, eval_max_steps=50),
    "sac": dict(hidden=16, batch_size=32, learning_starts=50, eval_episodes=1, eval_max_steps=50, diag_every=5),
    "td3": dict(hidden=16, batch_size=32, learning_starts=50, eval_episodes=1, eval_max_steps=50, diag_every=5),
}
RL_SHARED = ("loss", "perf", "grad_norm", "xgrad", "update_norm", "update_ratio", "update_grad_cos", "adam_m_norm",
             "adam_v_mean", "adam_eps_frac", "lr", "perturbed", "intervened", "episode_return", "entropy",
             "approx_kl", "clip_fraction", "value_loss", "q_mean", "action_saturation")
#: channels that must hold finite numbers for each learner
MEASURED = {
    "ppo": ("entropy", "approx_kl", "clip_fraction", "value_loss", "action_saturation"),
    "a2c": ("entropy", "value_loss", "action_saturation"),
    "sac": ("entropy", "value_loss", "q_mean", "action_saturation"),
    "td3": ("value_loss", "q_mean", "action_saturation"),
}


def spec(algo, steps=256, seed=0, perts=(), **hp):
    return RunSpec("rl", algo, "Pendulum-v1", steps, seed, hparams={**TINY[algo], **hp}, perturbations=perts,
                   eval_every=128)


@pytest.mark.parametrize("algo", ["ppo", "sac", "td3", "a2c"])
def test_callback_records_every_channel(algo):
    ds = rl.run(spec(algo, steps=256 if algo != "a2c" else 64))
    assert ds.attrs["status"] == "ok"
    for ch in RL_SHARED:
        assert ch in ds, ch
    adam = ("adam_v_mean", "adam_m_norm") if algo != "a2c" else ()  # A2C uses RMSprop
    for ch in ("grad_norm", "xgrad", "update_norm", "update_grad_cos", "lr", "loss") + adam + MEASURED[algo]:
        assert np.isfinite(ds[ch].values).any(), (algo, ch)
    # perf at the untrained policy (step 0), at every eval and at the end
    perf = ds.perf.dropna("step")
    assert perf.step.values[0] == 0 and perf.sizes["step"] >= 2
    assert ds.perf_env_step.dropna("step").values[-1] == (256 if algo != "a2c" else 64)
    # env_step is a non-decreasing coordinate along step; step counts updates
    assert "env_step" in ds.coords and np.all(np.diff(ds.env_step.values) >= 0)
    assert ds.step.values[-1] == ds.attrs["n_updates"]
    assert (ds.perturbed.values == 0).all()


@pytest.mark.parametrize("algo", ["sac", "ppo"])
def test_lr_spike_applies_only_inside_window(algo):
    start, dur, dose = (128, 64, 10.0)
    s = spec(algo, perts=(Perturbation("lr_spike", start, dur, dose),), lr=1e-3)
    ds = rl.run(s)
    env, upd = ds.env_step.values, ds.step.values > 0
    inside = upd & (env >= start) & (env < start + dur)
    outside = upd & ~inside
    assert inside.any() and outside.any()
    lr_channels = [c for c in ds.data_vars if c == "lr" or c.startswith("lr_")]
    # SAC's entropy-coefficient optimizer is left out of the spike (spike_ent_coef=False): one dose for every algorithm
    if algo == "sac":
        np.testing.assert_array_equal(ds.lr_ent_coef.values[np.isfinite(ds.lr_ent_coef.values)], 1e-3)
    for c in [c for c in lr_channels if c != "lr_ent_coef"]:
        v = ds[c].values
        np.testing.assert_allclose(v[inside & np.isfinite(v)], 1e-3 * dose, err_msg=c)
        np.testing.assert_allclose(v[outside & np.isfinite(v)], 1e-3, err_msg=c)
    np.testing.assert_array_equal(ds.perturbed.values[1:], ((env >= start) & (env < start + dur))[1:].astype(float))


@pytest.mark.parametrize("algo", ["sac", "ppo"])
def test_lr_ramp_climbs_over_its_window_and_stays(algo):
    """The applied lr of every update is the base times the ramp's factor at that update's env step:
    1 before the window, climbing geometrically inside it, the dose after it (to the run's end)."""
    start, dur, dose = (64, 128, 10.0)
    ds = rl.run(spec(algo, perts=(Perturbation("lr_ramp", start, dur, dose),), lr=1e-3))
    env, upd = ds.env_step.values, ds.step.values > 0
    want = np.where(env >= start, dose ** (np.minimum(env - start + 1, dur) / dur), 1.0)
    for c in ("lr", "lr_actor", "lr_critic"):
        if c in ds:
            v = ds[c].values
            ok = upd & np.isfinite(v)
            np.testing.assert_allclose(v[ok], 1e-3 * want[ok], rtol=1e-12, err_msg=c)
    lr = ds.lr.values
    assert (lr[upd & (env < start) & np.isfinite(lr)] == 1e-3).all()
    inside = upd & (env >= start) & (env < start + dur) & np.isfinite(lr)
    assert len(np.unique(lr[inside])) >= 2  # it climbs, not one step (PPO: the window holds two rollout ends)
    np.testing.assert_allclose(lr[upd & (env >= start + dur) & np.isfinite(lr)], 1e-3 * dose)
    if algo == "sac":  # the entropy coefficient's optimizer is left out, as under a spike
        np.testing.assert_array_equal(ds.lr_ent_coef.values[np.isfinite(ds.lr_ent_coef.values)], 1e-3)
    np.testing.assert_array_equal(ds.perturbed.values[1:], ((env >= start) & (env < start + dur))[1:].astype(float))


def test_lr_spike_changes_the_trajectory_only_after_the_window_starts():
    base = rl.run(spec("sac", steps=200))
    spiked = rl.run(spec("sac", steps=200, perts=(Perturbation("lr_spike", 150, 20, 100.0),)))
    before = base.env_step.values < 150
    np.testing.assert_array_equal(base.grad_norm.values[before], spiked.grad_norm.values[before])
    after = base.env_step.values > 151
    assert not np.allclose(base.grad_norm.values[after], spiked.grad_norm.values[after])


class _Recorder(gym.Env):
    """Env with a 2-d box action, obs = zeros, reward = 1; records the last action."""

    observation_space = gym.spaces.Box(-10, 10, (3,), np.float32)
    action_space = gym.spaces.Box(np.array([-1.0, -2.0], np.float32), np.array([1.0, 2.0], np.float32))

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(3, np.float32), {}

    def step(self, action):
        self.last = np.asarray(action)
        return np.zeros(3, np.float32), 1.0, False, False, {}


def test_wrappers_scale_reward_and_add_noise_inside_windows():
    W = envs.PerturbationWrapper
    sched = Schedule((Perturbation("reward_scale", 5, 5, 3.0), Perturbation("action_noise", 20, 400, 0.5),
                      Perturbation("obs_noise", 500, 500, 2.0)))
    env = W(_Recorder(), sched, seed=0)
    env.reset(seed=0)
    rewards, acts, obs = [], [], []
    for _ in range(1000):
        o, r, *_ = env.step(np.zeros(2, np.float32))
        rewards.append(r)
        acts.append(env.env.last.copy())
        obs.append(o)
    rewards, acts, obs = np.array(rewards), np.array(acts), np.array(obs)
    np.testing.assert_array_equal(rewards[5:10], 3.0)
    assert (rewards[:5] == 1).all() and (rewards[10:] == 1).all()
    assert (acts[:20] == 0).all() and (acts[420:] == 0).all()
    noisy = acts[20:420]
    # std 0.5 * half-range: 0.5 for dim 0 (range [-1,1]), 1.0 for dim 1 (range [-2,2])
    np.testing.assert_allclose(noisy.std(0), [0.5, 1.0], rtol=0.15)
    assert (np.abs(noisy) <= [1.0, 2.0]).all()
    assert (obs[:500] == 0).all()
    np.testing.assert_allclose(obs[500:].std(), 2.0, rtol=0.1)


def test_make_env_keeps_true_episode_return_under_reward_scale():
    env = rl.make_env("Pendulum-v1", (Perturbation("reward_scale", 0, 400, 10.0),), seed=0)
    env.seed(0)
    env.reset()
    total, ep = 0.0, None
    for _ in range(200):
        _, r, done, info = env.step(np.zeros((1, 1), np.float32))
        total += float(r[0])
        if done[0]:
            ep = info[0]["episode"]["r"]
    assert ep is not None and total == pytest.approx(10 * ep, rel=1e-4)
    assert envs.env_wrapper(env).env_step == 200


def test_same_seed_same_trajectory_and_different_seed_differs():
    for algo in ("sac", "ppo"):
        perts = (Perturbation("action_noise", 100, 50, 0.3),)
        a, b = rl.run(spec(algo, perts=perts)), rl.run(spec(algo, perts=perts))
        for ch in ("perf", "grad_norm", "loss", "episode_return", "lr"):
            np.testing.assert_array_equal(a[ch].values, b[ch].values, err_msg=f"{algo} {ch}")
        c = rl.run(spec(algo, seed=1, perts=perts))
        assert not np.array_equal(a.grad_norm.values[: c.sizes["step"]], c.grad_norm.values[: a.sizes["step"]])


def test_weight_noise_and_divergence_status():
    ds = rl.run(spec("td3", steps=150, perts=(Perturbation("weight_noise", 100, 1, 0.5),)))
    assert ds.attrs["status"] == "ok"
    # an absurd threshold makes every value 'exploding': the run stops, keeps its data, says diverged
    bad = rl.run(spec("sac", steps=256, diverge_threshold=1e-6))
    assert bad.attrs["status"] == "diverged" and bad.attrs["env_steps"] < 256
    assert bad.sizes["step"] >= 1 and "diverge_reason" in bad.attrs


def test_parametric_perturbation_is_not_evaluated_into_the_pre_event_row():
    """An evaluation at the step of a weight_noise comes before the noise (its row is the policy
    after that many updates); rows before the event read as in the unperturbed twin."""
    base = RunSpec("rl", "sac", "Pendulum-v1", 300, 0, hparams=TINY["sac"], eval_every=100)
    pert = base.replace(perturbations=(Perturbation("weight_noise", 200, 1, 3.0),))
    a, b = rl.run(base), rl.run(pert)
    before = lambda ds: ds.perf.values[(ds.env_step.values < 200) & np.isfinite(ds.perf.values)]  # noqa: E731
    assert before(a).size >= 2
    np.testing.assert_array_equal(before(a), before(b))
    assert b.attrs["perturbation_rows"] == rl.PERTURBATION_ROWS
    # runs stored before this rule are recomputed, runs without such an event are not
    assert rl.stale(pert, {**b.attrs, "perturbation_rows": 0}) is not None
    assert rl.stale(pert, b.attrs) is None and rl.stale(base, {}) is None
    td3 = base.replace(learner="td3")
    assert rl.stale(td3, {}) is not None and rl.stale(td3, {"monitor_own_steps": rl.MONITOR_OWN_STEPS}) is None


def test_on_policy_rows_are_flagged_when_their_rollout_overlapped_the_window():
    """PPO trains at rollout ends (every 64 env steps here): action noise on [70, 100), inside one
    rollout, perturbs the data of the update round at env step 128, and only that one."""
    ds = rl.run(spec("ppo", steps=256, perts=(Perturbation("action_noise", 70, 30, 0.5),)))
    flagged = sorted(set(ds.env_step.values[ds.perturbed.values == 1].tolist()))
    assert flagged == [128]
    sac = RunSpec("rl", "sac", "Pendulum-v1", 256, 0, hparams=TINY["sac"],
                  perturbations=(Perturbation("action_noise", 70, 30, 0.5),))
    # off-policy env-side rows were flagged by env step all along (its dose_rules: tests/test_rl_doses.py)
    assert rl.stale(sac, {"dose_rules": rl.DOSE_RULES}) is None
    assert rl.stale(spec("ppo", perts=(Perturbation("action_noise", 70, 30, 0.5),)), {}) is not None


def test_unknown_env_and_hparam_raise_clear_errors():
    with pytest.raises(ValueError, match="unknown gymnasium environment 'NoSuchEnv-v0'"):
        RunSpec("rl", "sac", "NoSuchEnv-v0", 100, 0)  # when the spec is built
    with pytest.raises(ValueError, match="unknown gymnasium environment 'Pendulm-v1'.*did you mean 'Pendulum-v1'"):
        envs.make_env("Pendulm-v1")  # the same check where an env is made
    with pytest.raises(ValueError, match=r"unknown hyperparameter\(s\) \['hiden'\].*valid: .*\bhidden\b"):
        RunSpec("rl", "sac", "Pendulum-v1", 100, 0, hparams={"hiden": 3})


def test_fork_and_stated_grids_and_the_run_table(tmp_path, monkeypatch):
    from stabstudy.learners.rl import forks
    from stabstudy.run.runner import run_grid
    from stabstudy.run.store import RunStore, load_runs

    monkeypatch.setenv("STABSTUDY_DATA", str(tmp_path / "data"))
    hp = {"ppo": TINY["ppo"], "sac": {**TINY["sac"], "target_entropy": -1.0}}  # knob explicit, as algo_hparams makes it
    kw = dict(task="Pendulum-v1", hparams=hp, lead={"ppo": 128, "sac": 40}, post={"ppo": 128, "sac": 60},
              spike_updates=20, env_duration=64, eval_every={"ppo": 64, "sac": 20})
    specs = design.fork_grid(["ppo", "sac"], [("none", 1.0), ("lr_spike", 30.0)], [0, 1], {"ppo": 256, "sac": 200}, **kw)
    assert len(specs) == 8 and {forks.role(s) for s in specs} == {"fork"}
    ppo = [s for s in specs if s.learner == "ppo" and s.perturbations][0].perturbations[0]
    sac = [s for s in specs if s.learner == "sac" and s.perturbations][0].perturbations[0]
    assert (ppo.start, ppo.duration, sac.start, sac.duration) == (384, 64, 240, 20)  # one rollout; 20 updates
    with pytest.raises(ValueError, match="multiple of n_steps"):
        design.fork_grid(["ppo"], [("none", 1.0)], [0], {"ppo": 250}, **kw)
    # a prefix matched by return has its own length per seed
    own = design.fork_grid(["sac"], [("none", 1.0)], [0, 1], {"sac": {0: 200, 1: 260}}, **kw)
    assert [(s.seed, s.hp["prefix_steps"], s.steps) for s in own] == [(0, 200, 364), (1, 260, 424)]
    # the noise knob after the fork: left out where it equals the prefix's, so those forks are shared
    noisy = design.fork_grid(["sac"], [("none", 1.0)], [0], {"sac": 200}, noise_after_fork={"sac": -1.0}, **kw)
    assert noisy[0] in specs
    assert design.fork_grid(["sac"], [("none", 1.0)], [0], {"sac": 200}, noise_after_fork={"sac": 0.5},
                           **kw)[0].get("noise_after_fork") == 0.5
    stated, dropped = design.stated_grid(["ppo", "sac"], {"ppo": [0], "sac": [0]}, {"ppo": 640, "sac": 200}, at=64,
                                         update=20, dose=30.0, spike_updates=20, task="Pendulum-v1", hparams=hp)
    # ppo: a spike at env step 64 (the first rollout end); SB3 counts n_epochs = 2 updates per rollout, so update 20
    # ends rollout 10, at the budget; sac: update 20 comes at env step 70 (learning_starts 50), within one spike
    # window (20 env steps) of env step 64: the same spike, run once
    assert sorted((s.learner, s.perturbations[0].start) for s in stated) == [("ppo", 64), ("sac", 64)]
    assert "does not end before the budget" in dropped["ppo, update 20"]
    assert "the same spike" in dropped["sac, update 20"]
    store = RunStore(tmp_path / "runs")
    prefixes = forks.prefix_specs(specs)
    assert len(prefixes) == 4
    assert all(r.status == "ok" for r in run_grid(prefixes, scheduler="serial", store=store, progress=False))
    assert all(r.status == "ok" for r in run_grid(specs, scheduler="serial", store=store, progress=False))
    ds = load_runs(specs, store=store)
    assert curves.eval_curves(ds).dims == ("run", "env_step")
    table = runs.run_table(ds)
    assert len(table) == 8 and set(table.prefix_steps) == {256, 200} and (table.noise_after_fork == "same").all()
    assert table.final_return.notna().all() and set(table.pert_kind) == {"none", "lr_spike"}


def test_a_runs_final_return_does_not_depend_on_the_other_runs():
    """PPO evaluates at rollout ends, SAC / TD3 at t-1: on the union grid a run's 'last points'
    would include copies of its values at the other runs' env steps."""
    def ds_of(rs):
        n = max(len(r[1]) for r in rs)
        perf, env = np.full((len(rs), n), np.nan), np.full((len(rs), n), np.nan)
        for i, (_, e, p) in enumerate(rs):
            env[i, :len(e)], perf[i, :len(p)] = e, p
        k = len(rs)
        return xr.Dataset({"perf": (("run", "step"), perf)},
                          coords={"run": [r[0] for r in rs], "env_step": (("run", "step"), env),
                                  "learner": ("run", ["sac", "ppo"][:k]), "seed": ("run", [0] * k),
                                  "pert_kind": ("run", ["lr_spike"] * k), "pert_start": ("run", [2500.0] * k),
                                  "status": ("run", ["ok"] * k)})

    a = ("A", [0, 999, 1999, 2999, 3999, 4999], [0.0, 100.0, 200.0, 50.0, 60.0, 70.0])
    b = ("B", [0, 1024, 2048, 3072, 4096, 5120], [0.0, 10.0, 20.0, 30.0, 40.0, 50.0])
    alone = runs.run_table(ds_of([a])).iloc[0]
    mixed = runs.run_table(ds_of([a, b])).set_index("spec_hash").loc["A"]
    assert alone.final_return == mixed.final_return == 60.0 and alone.spec_hash == "A"


def test_reliability_table_groups_runs_and_measures_their_risk():
    """Chan et al. 2020 metrics per (learner, kind): a saw-toothed group is riskier than a steady one."""
    steps = np.arange(0, 1000, 100)
    steady = np.linspace(0, 900, 10)
    saw = steady + np.where(np.arange(10) % 2, -300.0, 0.0)
    c = xr.DataArray(np.array([steady, steady + 10, saw, saw + 10]), dims=("run", "env_step"),
                     coords={"env_step": steps, "learner": ("run", ["sac", "sac", "ppo", "ppo"]),
                             "pert_kind": ("run", ["none"] * 4)})
    t = curves.reliability_table(c).set_index("learner")
    assert (t.n == 2).all()
    assert t.loc["ppo", "dispersion_time"] > t.loc["sac", "dispersion_time"] == 0.0
    assert t.loc["ppo", "short_term_risk"] < t.loc["sac", "short_term_risk"]
    assert t.loc["ppo", "long_term_risk"] > t.loc["sac", "long_term_risk"]


def test_log_every_thins_update_rows_but_keeps_records():
    full = rl.run(spec("sac", steps=150))
    thin = rl.run(spec("sac", steps=150).replace(log_every=10))
    assert thin.sizes["step"] < full.sizes["step"] / 3
    kept = thin.step.values[np.isnan(thin.perf.values) & np.isnan(thin.value_loss.values)
                            & np.isnan(thin.episode_return.values)]
    assert (kept % 10 == 0).all()
    np.testing.assert_array_equal(full.perf.dropna("step").values, thin.perf.dropna("step").values)
    np.testing.assert_array_equal(full.env_step.sel(step=thin.step).values, thin.env_step.values)


def test_callbacks_in_a_plain_sb3_script():
    from stable_baselines3 import TD3

    sched = Schedule((Perturbation("lr_spike", 80, 20, 5.0), Perturbation("reward_scale", 80, 20, 2.0)))
    env = rl.make_env("Pendulum-v1", sched, seed=3)
    model = TD3("MlpPolicy", env, learning_starts=50, batch_size=16, policy_kwargs={"net_arch": [8]}, seed=3)
    rec = rlpkg.Recorder()
    cbs = [rlpkg.TelemetryCallback(rec), rlpkg.PerturbationCallback(rec, sched),
           rlpkg.EvaluationCallback(rec, rl.make_eval_env("Pendulum-v1", 30), every=50, episodes=1),
           rlpkg.DiagnosticsCallback(rec), rlpkg.DivergenceCallback(rec), rlpkg.EpisodeReturnCallback(rec)]
    model.learn(120, callback=CallbackList(cbs))
    ds = cbs[0].to_dataset()
    assert {"perf", "grad_norm_actor", "grad_norm_critic", "q_mean", "lr", "episode_return"} <= set(ds.data_vars)
    assert ds.perf.notnull().sum() >= 3 and ds.perturbed.max() == 1.0
    inside = (ds.env_step >= 80) & (ds.env_step < 100) & (ds.step > 0)
    np.testing.assert_allclose(ds.lr_critic.where(inside, drop=True).values, 5e-3)
    # the callbacks closed themselves at the end of learn(): hooks gone, the lr back to SB3's value
    for opt in (model.critic.optimizer, model.actor.optimizer):
        assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
        assert all(g["lr"] == pytest.approx(1e-3) for g in opt.param_groups)
    with pytest.raises(RuntimeError, match="already recorded a learn"):
        model.learn(10, callback=CallbackList(cbs))


def test_evaluation_episodes_side_by_side_equal_one_at_a_time():
    """One eval env per episode steps the episodes together (one batched predict per step); the
    returns equal each episode played alone on its seeded start, also when episodes end at
    different steps; a wrong number of envs is refused."""
    from stable_baselines3 import TD3

    model = TD3("MlpPolicy", rl.make_env("Pendulum-v1", Schedule(()), seed=1), policy_kwargs={"net_arch": [8]}, seed=1)
    lengths = (30, 12, 30)
    alone = []
    for i, n in enumerate(lengths):
        env, ret, done = rl.make_eval_env("Pendulum-v1", n), 0.0, False
        obs, _ = env.reset(seed=7 + i)
        while not done:
            obs, r, term, trunc, _ = env.step(model.predict(obs, deterministic=True)[0])
            ret, done = ret + float(r), term or trunc
        alone.append(ret)
    cb = rlpkg.EvaluationCallback(None, [rl.make_eval_env("Pendulum-v1", n) for n in lengths], episodes=3, seed=7)
    cb.model = model
    np.testing.assert_allclose(cb._episodes([0, 1, 2]), alone, rtol=1e-6)
    one = rlpkg.EvaluationCallback(None, rl.make_eval_env("Pendulum-v1", 30), episodes=3, seed=7)
    one.model = model
    assert [one._episodes([i])[0] for i in (0, 2)] == pytest.approx([alone[0], alone[2]], rel=1e-6)
    with pytest.raises(ValueError, match="one per episode"):
        rlpkg.EvaluationCallback(None, [rl.make_eval_env("Pendulum-v1")] * 2, episodes=3)


def test_callbacks_compose_in_any_order(monkeypatch):
    """The same spec gives the same data whatever the order of its callbacks: the lr-spike hooks
    run before the Monitor's, an evaluation due at a weight_noise step sees the policy before it,
    diagnostics come before the divergence checks, and training stops at the env step of the
    divergence."""
    perts = (Perturbation("lr_spike", 100, 60, 10.0), Perturbation("weight_noise", 128, 1, 0.5))
    specs = [spec("sac", steps=200, perts=perts), spec("td3", steps=300, diverge_threshold=1e3,
                                                       perts=(Perturbation("lr_spike", 100, 150, 3e3),))]
    ordered = [rl.run(s) for s in specs]
    assert ordered[1].attrs["status"] == "diverged" and ordered[1].attrs["env_steps"] < 300
    compose = rl.callbacks_for

    def reversed_callbacks(s, **kw):
        rec, cb = compose(s, **kw)
        cb.callbacks.reverse()
        return rec, cb

    monkeypatch.setattr(rl, "callbacks_for", reversed_callbacks)
    for a, s in zip(ordered, specs, strict=True):
        b = rl.run(s)
        xr.testing.assert_identical(a.drop_attrs(deep=False), b.drop_attrs(deep=False))
        for k in ("status", "diverge_reason", "env_steps", "n_updates"):
            assert a.attrs[k] == b.attrs[k], k


def test_readme_sb3_example_runs_as_written(capsys):
    ns: dict = {}
    exec(compile(block("docs/integrations.md", "CallbackList("), "docs/integrations.md:sb3-example", "exec"), ns)
    ds = ns["ds"]
    upd = ds.step.values > 0
    inside = upd & (ds.env_step.values >= 200) & (ds.env_step.values < 250)
    assert inside.any() and (upd & ~inside).any()
    np.testing.assert_allclose(ds.lr.values[inside], 3e-3)
    np.testing.assert_allclose(ds.lr.values[upd & ~inside], 3e-4)
    np.testing.assert_array_equal(ds.perturbed.values[upd], inside[upd].astype(float))
    assert np.isfinite(ds.grad_norm_critic.values[upd]).all()
    assert "grad_norm_critic" in capsys.readouterr().out


def test_mujoco_warnings_go_through_python_warnings(tmp_path, monkeypatch):
    """MuJoCo's warnings become Python warnings instead of prints and a MUJOCO_LOG.TXT file; the one
    about gymnasium's own HalfCheetah-v5 XML is silenced where the env is built (quiet notebooks)."""
    import warnings

    import mujoco

    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        envs.make_base("HalfCheetah-v5").close()
    assert not (tmp_path / "MUJOCO_LOG.TXT").exists()
    with pytest.warns(RuntimeWarning, match="MuJoCo: something else"):
        mujoco.get_mju_user_warning()("something else")


@pytest.mark.parametrize("algo", ["ppo", "sac"])
def test_a_controller_that_never_alarms_changes_nothing_and_records_its_scores(algo):
    """Stationary in stable states, in SB3 too: bit-identical to the run without a controller;
    its detector's scores (of the pre-clip norm) are filed per update for calibration."""
    free = rl.run(spec(algo))
    watch = rl.run(spec(algo, controller="z_skip", controller_threshold=1e9, controller_window=16))
    for ch in ("perf", "loss", "grad_norm", "update_norm", "adam_v_mean", "value_loss"):
        np.testing.assert_array_equal(free[ch].values, watch[ch].values, err_msg=ch)
    assert watch.intervened.sum() == 0 and np.isfinite(watch.controller_score.values).sum() > 10
    assert "controller_policy" in watch.attrs


def test_ppo_controller_acts_on_the_pre_clip_norm_and_files_its_actions():
    """PPO clips at 0.5, so the norm its optimizer sees is pinned there; the controller reads the norm
    before the clip, acts on an lr spike's aftermath and files what it did on the update rows."""
    lr = (Perturbation("lr_spike", 128, 64, 300.0),)
    ds = rl.run(spec("ppo", perts=lr, controller="z_skip", controller_threshold=2.0, controller_window=16))
    acted = ds.intervened.values > 0
    assert acted.any() and set(ds.action.values[acted]) == {control.ACTION_CODES["skip"]}
    assert np.nanmax(ds.grad_norm.values) <= 0.5 + 1e-6  # what the optimizer saw: no spike to see there
    assert ds.attrs["controller_detectors"].startswith("RobustZ")


@pytest.mark.parametrize("algo", ["ppo", "a2c", "sac"])
def test_the_norm_before_sb3s_clipping_is_recorded_beside_the_stored_one(algo, monkeypatch):
    """PPO/A2C clip at max_grad_norm inside train(): grad_norm keeps the norm the optimizer got, as
    every stored run has it, and grad_norm_raw is the norm clip_grad_norm_ returned (backward()'s);
    SAC does not clip, so both are equal. SB3's logger gets the Monitor's names."""
    returned = []
    clip = torch.nn.utils.clip_grad_norm_

    def spy(*args, **kwargs):
        n = clip(*args, **kwargs)
        returned.append(float(n))
        return n

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy)  # SB3 calls th.nn.utils.clip_grad_norm_
    ds = rl.run(spec(algo, steps=256 if algo != "a2c" else 64))
    rows = ds.sel(step=ds.step.values[1:])  # row 0: the untrained policy, no update
    raw, applied = rows.grad_norm_raw.values, rows.grad_norm.values
    assert np.isfinite(raw).all() and "grad_norm_applied" not in ds
    if algo == "sac":
        assert not returned
        np.testing.assert_allclose(raw, applied, rtol=1e-6)
        return
    np.testing.assert_allclose(raw, returned, rtol=1e-5)
    np.testing.assert_allclose(applied, np.minimum(raw, 0.5), rtol=1e-4)
    assert (raw > 0.5).any() and np.nanmax(applied) <= 0.5 + 1e-6


def test_a_controller_keeps_the_rows_log_every_keeps():
    """Filing its records must not keep every update's row of a thinned (log_every) run."""
    sp = spec("ppo").replace(log_every=4)
    free = rl.run(sp)
    watch = rl.run(sp.replace(hparams={"controller": "z_skip", "controller_threshold": 1e9, "controller_window": 16}))
    np.testing.assert_array_equal(free.step.values, watch.step.values)
    assert np.isfinite(watch.controller_score.values).sum() > 2 and (watch.action.values[1:] == 0).all()
