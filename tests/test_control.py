"""Closed-loop control: stationary when no alarm fires, each action does what it says, the OLMo rule
decides on the device like the streaming WindowZ, and the examples of docs/control.md run."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch
from docblocks import block

from stabstudy.analysis.studies import closed_loop_claims as loop_claims
from stabstudy.instruments.telemetry import Monitor
from stabstudy.interventions import control
from stabstudy.interventions.control import (
    ACTION_CODES,
    AdamSecondMoment,
    Controller,
    LrBackoff,
    NonFinite,
    OlmoSkip,
    Rollback,
    Skip,
)
from stabstudy.interventions.perturb import Perturbation
from stabstudy.online import WindowZ
from stabstudy.spec import RunSpec

NAMES = [n for n in control.CONTROLLERS if n != "none"]
COMPARE = {"toy": ["loss", "grad_norm", "update_ratio", "perf", "adam_v_mean"],
           "lm": ["loss", "grad_norm", "update_ratio", "val_loss", "adam_v_mean", "attn_logit_max"]}


def _toy(controller: str = "none", threshold: float = 0.0, perts=(), steps: int = 80) -> RunSpec:
    hp = {"lr": 0.01, "width": 16, "batch_size": 32, "n_train": 128, "n_test": 64}
    if controller != "none":
        hp.update(controller=controller, controller_threshold=threshold)
    return RunSpec("toy", "adam", "digits", steps, 3, hp, perts)


def _lm(controller: str = "none", threshold: float = 0.0, perts=(), steps: int = 50) -> RunSpec:
    hp = dict(n_layer=1, n_embd=32, n_head=2, block_size=16, batch_size=4, corpus_bytes=100_000, warmup=5,
              device="cpu")
    if controller != "none":
        hp.update(controller=controller, controller_threshold=threshold)
    return RunSpec("lm", "gpt", "stdlib", steps, 3, hp, perts)


def _run(domain: str, spec: RunSpec):
    from stabstudy.learners import lm, toy

    return (toy if domain == "toy" else lm).run(spec)


@pytest.mark.parametrize("domain", ["toy", "lm"])
def test_stationary_when_no_alarm_fires(domain):
    """Every controller and comparator, with a threshold no step reaches: bit-identical trajectories."""
    make = _toy if domain == "toy" else _lm
    base = _run(domain, make())
    assert "intervened" not in base and "action" not in base  # the default stores what it stored before
    for name in NAMES:
        ds = _run(domain, make(name, 1e9))
        assert ds.sizes["step"] == base.sizes["step"]
        assert ds.intervened.sum() == 0 and ds.action.sum() == 0, name
        for ch in COMPARE[domain]:
            np.testing.assert_array_equal(ds[ch].values, base[ch].values, err_msg=f"{name}: {ch}")


def test_default_specs_keep_their_hash():
    """A controller is a hyperparameter stored only when given: default specs hash as before."""
    assert _toy().spec_hash == RunSpec("toy", "adam", "digits", 80, 3, {"lr": 0.01, "width": 16, "batch_size": 32,
                                                                          "n_train": 128, "n_test": 64}).spec_hash
    assert "controller" not in _toy().hp and _toy("z_skip").hp["controller"] == "z_skip"
    with pytest.raises(ValueError, match="controller"):
        _toy("no_such_controller")


@pytest.mark.parametrize("name", ["z_skip", "z_lr", "z_adam", "z_rollback", "z_clip", "olmo", "zclip"])
def test_an_outlier_batch_is_acted_on_before_it_lands(name):
    # step 75: past the warm-up of every detector (the OLMo rule's is 63 values)
    ds = _run("toy", _toy(name, perts=(Perturbation("outlier_batch", 75, 1, dose=1.0),), steps=90))
    acted = np.flatnonzero(ds.intervened.values)
    assert 75 in acted, (name, acted)
    assert set(np.unique(ds.action.values)) <= {0.0, float(ds.action.values[75])}
    assert ds.attrs["controller_policy"]


def _model_opt(seed: int = 0, lr: float = 1e-2):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def _step(model, opt, x, y):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss


class _Always:
    """A detector that alarms on the steps named."""

    name, threshold = "always", 0.5

    def __init__(self, at):
        self.at, self.n = set(at), -1

    def update(self, value):
        self.n += 1
        return 1.0 if self.n in self.at else 0.0

    def alarm(self, score):
        return score > self.threshold


def _state(model, opt):
    return ([p.detach().clone() for p in model.parameters()],
            [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()])


def test_skip_leaves_parameters_and_adam_state_untouched():
    model, opt = _model_opt()
    ctrl = Controller(_Always({3}), Skip()).attach(opt)
    x, y = torch.randn(32, 6), torch.randn(32, 1)
    for step in range(5):
        _step(model, opt, x, y)
        before = _state(model, opt)
        opt.step()
        if step == 3:
            after = _state(model, opt)
            for a, b in zip(before[0], after[0], strict=True):
                assert torch.equal(a, b)
            for a, b in zip(before[1], after[1], strict=True):
                assert all(torch.equal(a[k], b[k]) for k in a)
    rec = ctrl.records()
    assert rec["action"].tolist() == [0, 0, 0, ACTION_CODES["skip"], 0]


def test_lr_backoff_recovers_on_its_stated_schedule_and_restores_the_lr():
    model, opt = _model_opt(lr=0.1)
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: None)
    back = LrBackoff(factor=0.2, recovery=4)
    Controller(_Always({1}), back).attach(opt)
    opt.register_step_pre_hook(lambda o, a, k: seen.append(o.param_groups[0]["lr"]))  # after the controller's
    x, y = torch.randn(8, 6), torch.randn(8, 1)
    for _ in range(8):
        _step(model, opt, x, y)
        opt.step()
        assert opt.param_groups[0]["lr"] == 0.1  # the learner's lr is back after every step
    np.testing.assert_allclose(seen, [0.1, 0.02, 0.04, 0.06, 0.08, 0.1, 0.1, 0.1])


def test_adam_second_moment_bounds_the_spiking_step():
    x, y = torch.randn(32, 6), torch.randn(32, 1)
    moved = {}
    for act in (None, AdamSecondMoment()):
        model, opt = _model_opt()
        if act is not None:
            Controller(_Always({20}), act).attach(opt)
        for step in range(21):
            _step(model, opt, x, y)
            if step == 20:
                for p in model.parameters():
                    p.grad.mul_(1e3)  # a spike
            before = [p.detach().clone() for p in model.parameters()]
            opt.step()
        moved[act is None] = max(float((p.detach() - b).abs().max()) for p, b in zip(model.parameters(), before, strict=True))
    assert moved[False] < 0.5 * moved[True]  # v_hat >= g^2: at most about lr * |m_hat| / |g| per coordinate


def test_rollback_restores_a_snapshot_and_measures_its_cost():
    model, opt = _model_opt()
    rb = Rollback(every=5, size=2)
    ctrl = Controller(_Always({17}), rb).attach(opt)
    x, y = torch.randn(32, 6), torch.randn(32, 1)
    kept = {}
    for step in range(18):
        _step(model, opt, x, y)
        opt.step()
        if step in (4, 9, 14):
            kept[step] = [p.detach().clone() for p in model.parameters()]
    # snapshots after steps 9 and 14 are in the ring (size 2); the rollback restores the older one
    for a, b in zip(model.parameters(), kept[9], strict=True):
        assert torch.equal(a, b)
    assert rb.restored == 1 and rb.cost_s > 0 and rb.bytes > 0
    assert ctrl.attrs()["rollback_restored"] == 1


def test_nonfinite_gradients_are_skipped():
    model, opt = _model_opt()
    ctrl = Controller(NonFinite(), Skip()).attach(opt)
    x, y = torch.randn(8, 6), torch.randn(8, 1)
    _step(model, opt, x, y)
    opt.step()
    _step(model, opt, x, y)
    next(model.parameters()).grad[0, 0] = math.nan
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))
    assert ctrl.records()["intervened"].tolist() == [0, 1]


def test_olmo_rule_on_the_device_matches_the_streaming_window_z():
    """OlmoSkip decides as WindowZ (z > 6 over 128) of the loss or the gradient norm, and undoes the step exactly."""
    model, opt = _model_opt()
    olmo = OlmoSkip(window=16, min_periods=8).attach(opt)
    zl, zg = WindowZ(window=16, min_periods=8), WindowZ(window=16, min_periods=8)
    gen = torch.Generator().manual_seed(0)
    expect, undone = [], []
    for step in range(40):
        x, y = torch.randn(16, 6, generator=gen), torch.randn(16, 1, generator=gen)
        if step in (20, 31):
            x = x * 50
        loss = _step(model, opt, x, y)
        g = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])))
        expect.append(zl.alarm(zl.update(float(loss.detach()))) or zg.alarm(zg.update(g)))
        olmo.observe(loss, step=step)
        before = _state(model, opt)
        opt.step()
        if expect[-1]:
            undone.append(all(torch.equal(a, b) for a, b in zip(before[0], _state(model, opt)[0], strict=True)))
    got = olmo.records()["intervened"].astype(bool).tolist()
    assert got == expect and any(expect) and all(undone)


def test_controller_through_the_monitor_pre_step_view():
    model, opt = _model_opt()
    mon = Monitor(model, opt)
    ctrl = Controller(_Always({2}), Skip()).attach(opt, mon)
    x, y = torch.randn(8, 6), torch.randn(8, 1)
    for _ in range(4):
        _step(model, opt, x, y)
        opt.step()
    mon.close()
    ctrl.close()
    assert ctrl.records()["intervened"].tolist() == [0, 0, 1, 0]
    assert mon.to_dataset().update_norm.values[2] == 0  # the Monitor saw the skipped update as none


def _doc_block(marker: str) -> str:
    return block("docs/control.md", marker)


def test_readme_plain_torch_loop():
    ns: dict = {}
    exec(compile(_doc_block("Skip()"), "docs:controller-torch", "exec"), ns)
    assert 150 in ns["rec"]["intervened"].nonzero()[0]  # the outlier batch's step


def test_readme_sb3_learn():
    pytest.importorskip("stable_baselines3")
    ns: dict = {}
    exec(compile(_doc_block("PPO("), "docs:controller-sb3", "exec"), ns)
    assert len(ns["ctrl"].records()["action"]) == 4 * 2 * (256 // 64)  # 4 rollouts x 2 epochs x 4 minibatches


def test_raise_noise_multiplies_the_knob_for_a_while_then_restores_it():
    from stabstudy.interventions.control import RaiseNoise

    knob = {"ent_coef": 0.01}
    model, opt = _model_opt()
    act = RaiseNoise(lambda: knob["ent_coef"], lambda v: knob.update(ent_coef=v), factor=5.0, duration=3)
    Controller(_Always({1}), act).attach(opt)
    x, y = torch.randn(8, 6), torch.randn(8, 1)
    seen = []
    for _ in range(6):
        _step(model, opt, x, y)
        opt.step()
        seen.append(knob["ent_coef"])
    np.testing.assert_allclose(seen, [0.01, 0.05, 0.05, 0.01, 0.01, 0.01])


# -- the study's analysis (notebook 05) on synthetic runs ----------------------------------------
def _synthetic_study():
    import xarray as xr

    from stabstudy.analysis.studies import closed_loop as study

    events = [["lr_spike", 100.0, 5]]
    hp = {"lr": 0.003, "width": 16}
    specs = study.uncontrolled_grid("toy", 100, [0, 1, 2, 3], 50, events, **hp)
    specs += study.controlled_grid("toy", 100, [0, 1, 2, 3], 50, events, ["z_skip", "clip1"], {"z": 7.0}, **hp)
    table = study.run_table(specs)
    rng = np.random.default_rng(0)
    steps = np.arange(100)
    loss, inter = [], []
    for _, r in table.iterrows():
        base = 2.0 * np.exp(-steps / 40) + 0.3 + 0.01 * rng.standard_normal(100)
        iv = np.zeros(100)
        if r.event != "none":
            hurt = 1.0 if r.controller == "none" else (0.02 if r.controller == "z_skip" else 0.5)
            base[50:] += hurt
            if r.controller != "none":
                iv[51] = 1
        elif r.controller == "clip1":
            iv[::10] = 1  # clipping acts all along
        loss.append(base)
        inter.append(iv)
    ds = xr.Dataset({"loss": (("run", "step"), np.array(loss)), "intervened": (("run", "step"), np.array(inter)),
                     "grad_norm": (("run", "step"), np.exp(-np.array(loss)))},
                    coords={"run": table.index.values, "step": steps, "status": ("run", ["ok"] * len(table))})
    return study, ds, table


def test_closed_loop_outcomes_table_and_claims():
    study, ds, table = _synthetic_study()
    out = study.outcomes(ds, table, collapse_excess={"toy": 0.3}, recover_excess={"toy": 0.05}, final_window=10,
                         smooth=3)
    pert = out[out.event != "none"]
    assert pert[pert.controller == "none"].collapse.all()
    assert not pert[pert.controller == "z_skip"].collapse.any()
    assert (pert[pert.controller != "none"].first_action == 1).all()
    assert (out[(out.controller == "clip1") & (out.event == "none")].per_1k == 100).all()
    assert table[table.controller == "z_skip"].threshold.eq(7.0).all() and table[table.controller == "clip1"].threshold.isna().all()
    paired = loop_claims.paired_table(out, [1, 2, 3])
    row = paired.set_index("controller").loc["z_skip"]
    assert row.collapse_without == 4 and row.collapse_with == 0 and row.false_per_1k == 0
    assert loop_claims.choose_primary(out, [0], ["z_skip"]) == "z_skip"
    rows = loop_claims.claims(out[out.seed.isin([1, 2, 3])], primary="z_skip", evaluation_seeds=[1, 2, 3],
                              plan=loop_claims.Plan(collapse_excess={"toy": 0.3}, margin=0.05), comparators=["clip1", "olmo"])
    cl = {c.claim.split(": ", 1)[1].split(":")[0].split(" (")[0]: c for c in rows}
    assert all(c.claim.startswith("toy: ") for c in rows)  # one domain, its rows named by it
    assert cl["z_skip prevents collapse"].verdict == "inconclusive"  # 3 pairs
    assert cl["z_skip beats clip1"].verdict == "supported"
    assert cl["z_skip beats olmo"].verdict == "not tested"  # no olmo runs
    assert cl["z_skip is selective"].verdict in ("supported", "inconclusive")
    assert cl["z_skip reduces damage"].verdict == "supported"


def test_action_timing_counts_first_actions_after_the_event_ended():

    paired = pd.DataFrame({"domain": ["lm", "lm", "lm", "ppo", "ppo"],
                           "event": ["lr_spike x100/5", "lr_spike x300/5", "lr_spike x100/5", "lr_spike x10/2048",
                                     "lr_spike x10/2048"],
                           "controller": ["z_skip", "z_skip", "olmo", "z_skip", "z_rollback"],
                           "first_action": [1.0, np.nan, 9.0, 320.0, 12.0]})
    t = loop_claims.action_timing(paired, {"ppo": 320})
    assert t.loc["lm"].tolist() == [1.0, 5, 0, 1]  # olmo is not ours; the NaN row never acted
    assert t.loc["ppo"].tolist() == [166.0, 320, 1, 2]


def test_published_variants_of_the_calibrated_comparators():
    from stabstudy.analysis.studies import closed_loop as study

    thr = {"z": 7.0, "olmo": 8.0, "zclip": 2.5}  # the calibration moved olmo only
    pub = study.published_grid("toy", 100, [0], 50, [["lr_spike", 100.0, 5]], ["z_skip", "olmo", "zclip", "clip1"],
                               thr, lr=0.003)
    assert {s.hp["controller"] for s in pub} == {"olmo"} and {s.hp["controller_threshold"] for s in pub} == {6.0}
    cal = study.controlled_grid("toy", 100, [0], 50, [["lr_spike", 100.0, 5]], ["olmo"], thr, lr=0.003)
    table = study.run_table(cal, pub)
    assert sorted(table.controller.value_counts().items()) == [("olmo", 2), ("olmo@published", 2)]


def test_calibration_replays_what_the_controllers_compute_and_keeps_published_floors():
    from stabstudy.analysis.studies import closed_loop as study

    _, ds, table = _synthetic_study()
    null = table[(table.event == "none") & (table.controller == "none")].index
    thr = study.calibrate(ds, list(null), budget=2.0, window=16)
    assert (thr.threshold >= pd.Series(study.PUBLISHED)).all()
    # the score that set each calibrated value is named: with 0 alarms allowed, the largest one
    for k, r in thr.iterrows():
        run_sc = study.replay_scores(ds.grad_norm.sel(run=r.set_by_run).values, ds.loss.sel(run=r.set_by_run).values,
                                     window=16)[k]
        assert r.calibrated == pytest.approx(run_sc[r.set_by_step] * 1.0001, rel=1e-3)
        assert r.alarms_allowed == 0 and run_sc[r.set_by_step] == max(np.nanmax(study.replay_scores(
            ds.grad_norm.sel(run=n).values, ds.loss.sel(run=n).values, window=16)[k]) for n in null)
    # the replayed robust z is the controller's own score: its alarms at the calibrated threshold
    run = null[0]
    g, loss = ds.grad_norm.sel(run=run).values, ds.loss.sel(run=run).values
    sc = study.replay_scores(g, loss, window=16)["z"]
    ctrl = control.build("z_skip", threshold=1e9, window=16)
    model, opt = _model_opt()
    ctrl.attach(opt)
    for t in range(len(g)):
        ctrl.observe(loss[t])
        ctrl._pre(opt, torch.tensor(g[t], dtype=torch.float64))
        ctrl._post(opt)
    got = np.array([ctrl.scores.get(t, np.nan) for t in range(len(g))])
    np.testing.assert_allclose(got, sc, rtol=1e-12, equal_nan=True)


def _clipped_run(ctrl, clip: float = 0.05, outlier: int = 30, steps: int = 40):
    """A loop that clips every step's gradient between backward() and step() (as SB3's PPO does),
    with an outlier batch at ``outlier``; returns the pre-clip norms."""
    model, opt = _model_opt()
    ctrl.attach(opt, before_clip=True) if ctrl is not None else None
    gen = torch.Generator().manual_seed(1)
    raw = []
    for step in range(steps):
        x, y = torch.randn(16, 6, generator=gen), torch.randn(16, 1, generator=gen)
        _step(model, opt, x, y * 100 if step == outlier else y)
        raw.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        if ctrl is not None:
            ctrl.observe(step=step)
        opt.step()
    return raw


def test_before_clip_judges_the_gradient_as_backward_left_it():
    """Clipped at 0.05, every step's norm reaches the optimizer as 0.05: only the pre-clip norm shows the outlier."""
    from stabstudy.online import RobustZ

    ctrl = Controller(RobustZ(window=16, min_periods=8, side="up", threshold=6.0), Skip(), log=True)
    raw = _clipped_run(ctrl)
    assert min(raw) > 0.05  # the clip acted on every step
    assert ctrl.records()["intervened"].nonzero()[0].tolist() == [30]
    # without before_clip the same detector sees a constant norm and never alarms
    model, opt = _model_opt()
    blind = Controller(RobustZ(window=16, min_periods=8, side="up", threshold=6.0), Skip(), log=True).attach(opt)
    gen = torch.Generator().manual_seed(1)
    for step in range(40):
        x, y = torch.randn(16, 6, generator=gen), torch.randn(16, 1, generator=gen)
        _step(model, opt, x, y * 100 if step == 30 else y)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
    assert blind.n_actions == 0


def test_olmo_without_a_loss_judges_the_norm_alone():
    """SB3 gives the hooks no loss: OlmoSkip then skips on the (pre-clip) gradient norm only."""
    olmo = OlmoSkip(window=16, min_periods=8)
    raw = _clipped_run(olmo)
    z = WindowZ(window=16, min_periods=8)
    expect = [z.alarm(z.update(g)) for g in raw]
    assert olmo.records()["intervened"].astype(bool).tolist() == expect and expect[30]


def test_rl_domain_grid_calibration_and_outcomes(tmp_store):
    """PPO forks of a tiny Pendulum prefix: the uncontrolled grid is notebook 01's fork grid, the watch
    run calibrates the robust z from the scores it filed, and the outcomes pair every run with the
    unperturbed uncontrolled fork of its seed."""
    from stabstudy.analysis.studies import closed_loop as study
    from stabstudy.analysis.studies.rl import curves, design
    from stabstudy.learners.rl import forks
    from stabstudy.run.runner import run_grid
    from stabstudy.run.store import load_runs

    hp = {"hidden": 16, "n_steps": 64, "batch_size": 32, "n_epochs": 2, "eval_episodes": 1, "eval_max_steps": 50}
    kw = dict(hp=hp, prefix_steps=256, task="Pendulum-v1", lead={"ppo": 128}, post={"ppo": 192},
              eval_every={"ppo": 64})
    events = [["lr_spike", 300.0]]
    free = study.rl_grid("ppo", [0, 1], events, [], None, **kw)
    assert free == design.fork_grid(["ppo"], [("none", 1.0), ("lr_spike", 300.0)], [0, 1], {"ppo": 256},
                                           task="Pendulum-v1", hparams={"ppo": hp}, lead={"ppo": 128},
                                           post={"ppo": 192}, eval_every={"ppo": 64}, env_duration=64)
    watch = study.watch_grid(free, [0], window=8)
    assert [w.hp["controller_threshold"] for w in watch] == [study.WATCH] and not watch[0].perturbations
    prefixes = forks.prefix_specs(free)
    run_grid(prefixes, scheduler="serial", progress=False)
    run_grid(free + watch, scheduler="serial", progress=False)
    wds = load_runs(watch)
    with pytest.raises(ValueError, match="no run"):
        study.calibrate_watch(wds, [], budget=2.0)
    thr = study.calibrate_watch(wds, [w.spec_hash for w in watch], budget=2.0, floor={"z": 0.0, "olmo": 6.0,
                                                                                      "zclip": 2.5})
    scores = np.nan_to_num(wds.controller_score.values, nan=-np.inf)
    assert (scores > thr.threshold["z"]).sum() == 0 and np.isnan(thr.calibrated["olmo"])  # 40 updates: 0 allowed
    specs = study.rl_grid("ppo", [0, 1], events, ["z_skip"], {"z": 0.5}, controller_hp={"controller_window": 8}, **kw)
    assert {s.hp.get("controller_window") for s in specs if "controller" not in s.hp} == {None}
    run_grid(specs, scheduler="serial", progress=False)
    ds = load_runs(specs)
    prefix_of = {s.spec_hash: forks.prefix_key(s).spec_hash for s in specs}
    table = study.run_table(specs, prefix_of=prefix_of)
    assert set(table.domain) == {"ppo"} and set(table.event) == {"none", "lr_spike x300/64"}
    pre = load_runs(prefixes)
    floors, scale = curves.return_reference(pre, curves.eval_curves(ds), prefix_of)
    first = {p.spec_hash: float(pre.perf.sel(run=p.spec_hash).dropna("step").values[0]) for p in prefixes}
    assert floors == {s.spec_hash: first[forks.prefix_key(s).spec_hash] for s in specs}
    best = max(np.nanmax(pre.perf.values), np.nanmax(ds.perf.values))
    assert scale == pytest.approx(best - np.median(list(first.values())))
    out = study.rl_outcomes(ds, table, scale=100.0, floors=floors, min_after=1)
    assert len(out) == len(specs) and out.n_steps.eq(int(np.isfinite(ds.lr.values[0]).sum())).all()
    ref = out[(out.controller == "none") & (out.event == "none")]
    assert (ref.damage == 0).all() and not ref.collapse.any()
    ctrl = out[out.controller == "z_skip"]
    assert (ctrl.interventions == [int(np.nansum(ds.intervened.sel(run=r).values)) for r in ctrl.index]).all()
    assert ctrl.interventions.sum() > 0  # a low threshold acts
    assert out[out.event == "none"].first_action.isna().all()
    pert = out[out.event != "none"]  # each against the unperturbed uncontrolled fork of its prefix, same env steps
    # to the closing evaluation at the run's end (of the policy after the last update)
    assert (pert.window == 640 - 384).all()
    # a verdict, or none because the reference gained nothing over its floor in 256 env steps (a few PPO rollouts)
    judged = pert.state != "no_verdict"
    assert set(pert.state[judged]) <= {"collapsed", "recovered", "no_drop"}
    assert pert.reason[~judged].str.contains("no gain to lose").all()
    perf = ds.perf.where(np.isfinite(ds.perf))
    for run, r in pert[~pert.diverged].iterrows():
        t, c = (perf.sel(run=h).dropna("step") for h in (run, ref.index[ref.seed == r.seed][0]))
        assert (t.env_step.values == c.env_step.values).all()
        assert r.damage == pytest.approx(-(t.values[-3:] - c.values[-3:]).mean() / 100.0)
