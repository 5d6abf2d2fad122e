"""Notebook 04's RL family: labels from the paired control, telemetry rows, the protocol on constructed
forks where the answer is known (the meta-state moves before the drop, or never), the paths where it
cannot run, and a tiny real Pendulum fork grid through the whole analysis."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import xarray as xr

from stabstudy.analysis import claims as C
from stabstudy.analysis.studies import meta_robustness as MR
from stabstudy.analysis.studies import meta_state as M
from stabstudy.analysis.studies import meta_summaries as V
from stabstudy.analysis.studies.rl import warning as W
from stabstudy.online import MetaConfig

P_ENV, UPDATES, EVERY = 5000, 800, 2  # prefix env steps; fork updates (one per env step); Monitor cadence
START = P_ENV + 200  # every perturbation's env step (row 99)
EVAL = 50  # env steps between evaluations
H = {"sac": 400.0}  # horizon of "irreversible": [START, START + 400] inside every fork
CONFIG = MetaConfig(window=32, min_periods=8, corr_window=16)
KW = dict(burn_in=30, warn_horizon=100, late=10, config=CONFIG, n_components=3, budget=1.0, n_boot=100)


def _fork(seed: int, kind: str = "none", dose: float = np.nan, drop: int | None = None, noise: int = 0,
          shift: bool = False) -> tuple[dict, dict[str, np.ndarray]]:
    """One fork's coordinates and channels: updates P_ENV+1 .. P_ENV+UPDATES at one per env step, the
    Monitor's costly channels every EVERY updates (grad_norm and lr every update), an evaluation every
    EVAL env steps; the return drops from ~0 to -900 at env step ``drop`` and stays there; with
    ``shift``, four channels move together from the perturbation's start on."""
    rng = np.random.default_rng(1000 * seed + noise)
    upd = np.arange(P_ENV, P_ENV + UPDATES + 1)
    env = upd.astype(float)  # row 0 is the prefix's last update
    n = upd.size
    g = 10 ** (0.05 * rng.standard_normal(n))
    ch = {"grad_norm": g, "update_norm": 1e-3 * 10 ** (0.05 * rng.standard_normal(n)),
          "update_ratio": 1e-4 * 10 ** (0.05 * rng.standard_normal(n)),
          "xgrad": 0.5 + 0.05 * rng.standard_normal(n), "update_grad_cos": 0.5 + 0.05 * rng.standard_normal(n),
          "adam_m_norm": 10 ** (0.05 * rng.standard_normal(n)), "adam_v_mean": 10 ** (0.05 * rng.standard_normal(n)),
          "lr": np.full(n, 3e-4), "loss": np.full(n, np.nan)}
    if kind != "none":  # the knob moves: the update norm and ratio scale with it, lr records it
        on = env >= START
        ch["lr"][on] *= dose
        ch["update_norm"][on] *= dose
        ch["update_ratio"][on] *= dose
    if shift:
        pre = env >= START
        ch["grad_norm"][pre] *= 10 ** 0.3
        ch["adam_v_mean"][pre] *= 10 ** 0.3
        ch["xgrad"][pre] -= 0.3
        ch["update_grad_cos"][pre] -= 0.3
    for c in ("update_norm", "update_ratio", "xgrad", "update_grad_cos", "adam_m_norm", "adam_v_mean"):
        ch[c][(upd - P_ENV) % EVERY != 0] = np.nan
        ch[c][0] = np.nan
    ch["grad_norm"][0] = ch["lr"][0] = np.nan
    perf = np.full(n, np.nan)
    at = (env - P_ENV) % EVAL == 0
    perf[at] = 10.0 * rng.standard_normal(at.sum())
    if drop is not None:
        perf[at & (env >= drop)] = -900.0
    ch["perf"] = perf
    h = f"{kind}{dose:g}s{seed}" if kind != "none" else f"ctrl{seed}"
    coords = {"run": h, "spec_hash": h, "learner": "sac", "seed": seed, "pert_kind": kind, "pert_dose": dose,
              "pert_start": float(START) if kind != "none" else np.nan,
              "pert_duration": 100.0 if kind != "none" else np.nan, "status": "ok", "hp_prefix_steps": float(P_ENV)}
    return coords, {**ch, "env_step": env, "step": upd}


def _stack(parts) -> xr.Dataset:
    runs = []
    for coords, ch in parts:
        step = ch.pop("step")
        env = ch.pop("env_step")
        ds = xr.Dataset({k: ("step", v) for k, v in ch.items()}, coords={"step": step})
        ds = ds.assign_coords(env_step=("step", env)).expand_dims(run=[coords["run"]])
        runs.append(ds.assign_coords({k: ("run", [v]) for k, v in coords.items() if k != "run"}))
    return xr.concat(runs, dim="run", join="outer", fill_value=np.nan)


def _prefixes(seeds) -> xr.Dataset:
    env = np.arange(0, P_ENV + 1, 250, dtype=float)
    parts = []
    for s in seeds:
        coords = {"run": f"pre{s}", "spec_hash": f"pre{s}", "learner": "sac", "seed": s, "pert_kind": "none",
                  "pert_dose": np.nan, "pert_start": np.nan, "pert_duration": np.nan, "status": "ok",
                  "hp_prefix_steps": float(P_ENV)}
        parts.append((coords, {"perf": np.minimum(-1000.0 + env / 2, 0.0), "env_step": env, "step": env.astype(int)}))
    return _stack(parts)


def _grid(seeds, shift: str | None = "collapsing", drops=None):
    """Per seed: the control, and per kind a fork that collapses (drop 50-200 env steps after the
    start, spread over seeds) and one that survives; ``shift``: which of them (``collapsing``,
    ``surviving`` or None) have their channels move from the start."""
    parts = []
    for s in seeds:
        d = START + 50 + (37 * s) % 150 if drops is None else drops
        parts.append(_fork(s))
        for kind, dose in (("lr_spike", 30.0), ("lr_ramp", 10.0)):
            parts.append(_fork(s, kind, dose, drop=d, noise=1 if kind == "lr_spike" else 2, shift=shift == "collapsing"))
            parts.append(_fork(s, kind, dose / 3, noise=3 if kind == "lr_spike" else 4, shift=shift == "surviving"))
    fork = _stack(parts)
    prefix_of = {str(h): f"pre{int(s)}" for h, s in zip(fork.run.values, fork.seed.values, strict=True)}
    return fork, _prefixes(seeds), prefix_of


SEEDS, CAL = list(range(9)), [0, 1, 2]


@pytest.fixture(scope="module")
def warned():
    """The four channels move from the start of every fork that will collapse, and of no other."""
    fork, pre, prefix_of = _grid(SEEDS, shift="collapsing")
    return W.analyse(fork, pre, prefix_of, calibration_seeds=CAL, horizon=H, **KW)


@pytest.fixture(scope="module")
def misled():
    """The return drops with no channel moving; the channels move in the forks that survive."""
    fork, pre, prefix_of = _grid(SEEDS, shift="surviving")
    return W.analyse(fork, pre, prefix_of, calibration_seeds=CAL, horizon=H, **KW)


# -- rows and labels --------------------------------------------------------------------------------


def test_rows_are_the_monitor_rows_and_perturbations_start_at_their_env_step():
    fork, _, _ = _grid([0], shift=None)
    rows = W.on_rows(fork)
    assert rows.sizes["step"] == UPDATES // EVERY and (np.diff(rows.updates.values) == EVERY).all()
    r = rows.sel(run="lr_spike30s0")
    assert int(r.pert_start) == (START - P_ENV) // EVERY - 1  # the first Monitor row at or after env step START
    assert float(r.env_step[int(r.pert_start)]) >= START > float(r.env_step[int(r.pert_start) - 1])
    assert int(r.pert_duration) == 100 // EVERY and np.isnan(float(rows.sel(run="ctrl0").pert_start))
    assert np.isfinite(rows.update_grad_cos.values).all()  # every row measured the costly channels
    with pytest.raises(ValueError, match="one learner"):
        W.on_rows(fork.assign_coords(learner=("run", ["sac", "td3"] * (fork.sizes["run"] // 2) + ["sac"])))


def test_labels_come_from_the_paired_control_and_onsets_from_the_first_evaluation_that_shows_the_drop():
    fork, pre, prefix_of = _grid([0], shift=None, drops=START + 175)
    pair, horizon = W.paired(fork, pre, prefix_of, horizon=H)
    assert horizon == H
    # without a horizon for this learner it comes from the prefixes: the first evaluation at 80% of their gain
    assert W.paired(fork, pre, prefix_of)[1] == W.paired(fork, pre, prefix_of, horizon={})[1] == {"sac": 1750.0}
    assert W.paired(fork, pre, prefix_of, horizon={"td3": 1.0})[1] == {"sac": 1750.0, "td3": 1.0}
    states = pair.set_index("spec_hash").state
    assert states["lr_spike30s0"] == "collapsed" and states["lr_spike10s0"] == "no_drop"
    assert pair.set_index("spec_hash").onset["lr_spike30s0"] == START + 200  # the evaluation after the drop
    rows = W.on_rows(fork)
    labels, left = W.row_labels(rows, pair)
    assert left.empty and labels.loc["ctrl0"].outcome == "control" and not labels.loc["ctrl0"].event
    onset = int(labels.loc["lr_spike30s0"].onset)
    env = rows.sel(run="lr_spike30s0").env_step.values
    assert env[onset] >= START + 200 > env[onset - 1]
    assert labels.loc["lr_ramp3.33333s0"].onset == -1 and not labels.loc["lr_ramp3.33333s0"].event


def test_a_fork_without_a_verdict_is_left_out_and_counted():
    fork, pre, prefix_of = _grid([0, 1], shift=None)
    pair, _ = W.paired(fork, pre, prefix_of, horizon={"sac": 5000.0})  # past every fork's end
    labels, left = W.row_labels(W.on_rows(fork), pair)
    assert len(left) == 8 and set(labels.outcome) == {"control"} and "before event + H" in left.reason.iloc[0]
    r = W.analyse(fork, pre, prefix_of, calibration_seeds=[0], horizon={"sac": 5000.0}, **KW)
    assert r.study is None and "no perturbed fork with a paired verdict (8 without a verdict" in r.reason
    assert {c.verdict for c in W.claims({"sac": r})} == {"not tested"}


# -- the protocol: pass, fail, missing --------------------------------------------------------------


def _claims(res) -> pd.Series:
    return pd.Series({c.claim: c.verdict for c in M.claims(res.study)})


def test_the_meta_state_warns_before_a_drop_it_can_see(warned):
    assert warned.study is not None and not warned.reason
    info = warned.study.info
    assert (info[info.event].onset > info[info.event].start).all()
    assert warned.study.params["n_null_calibration"] == 3 and warned.study.params["n_null_evaluation"] == 6
    v = _claims(warned)
    # an evaluation-based drop has no onset speed the protocol could measure: every RL event is a shock,
    # the lr ramps' as the spikes' (the kind never sets the family)
    assert set(info[info.event].family) == {"shock"} and set(info[info.event].kind) == {"lr_spike", "lr_ramp"}
    for fam, want in (("shock", "supported"), ("slow-onset", "not tested")):
        lead = [c for c in v.index if "deviates before" in c and f"({fam} events" in c]
        assert len(lead) == 1 and v[lead[0]] == want, (fam, v.to_dict())
    spec = [c for c in v.index if "outcome: collapses" in c and "ROC-AUC above 0.5" in c]
    assert v[spec[0]] == "supported"
    assert not [c for c in v.index if "spontaneous" in c]  # the RL family asks about its own event families
    s = W.summary({"sac": warned}).loc["sac"]
    assert s["shock events"] == "18/18" and s["collapsed"] == 18 and s["prefixes cal/eval"] == "3/6"
    assert s["rows/eval"] == EVAL / EVERY  # evaluations fall between telemetry rows
    sens, spec = W.tables({"sac": warned, "td3": W.RLWarning("td3", *(pd.DataFrame(),) * 3, None, "why")})
    assert set(sens.learner) == {"sac"} and set(sens.events) == {"all", "shock"}
    assert (sens[sens.events == "shock"].detected.str.endswith("/12")).all() and (sens.null == 6).all()
    assert set(spec.target) == set(W.TARGETS) and (spec[spec.detector != M.LOSS].prefixes == 6).all()


def test_the_meta_state_neither_warns_nor_tells_collapsing_forks_when_the_channels_move_in_the_others(misled):
    v = _claims(misled)
    for fam in W.FAMILIES:
        lead = [c for c in v.index if "deviates before" in c and f"({fam} events" in c]
        assert v[lead[0]] != "supported", (fam, v[lead[0]])
    spec = [c for c in v.index if "outcome: collapses" in c and "ROC-AUC above 0.5" in c]
    assert v[spec[0]] == "not supported", v[spec[0]]


def test_the_rl_family_is_not_tested_without_notebook_01s_grid(tmp_path, monkeypatch):
    from stabstudy.run.grids import load_grid

    monkeypatch.setenv("STABSTUDY_DATA", str(tmp_path / "data"))
    assert load_grid("01_rl_algorithm_comparison", "quick") is None
    rows = W.not_tested(W.ABSENT)
    assert {c.verdict for c in rows} == {"not tested"} and {c.reason for c in rows} == {W.ABSENT}
    assert {c.claim.split(":")[0] for c in rows} == {"RL PPO", "RL SAC", "RL TD3"}
    assert len(C.table(rows)) == 3 * (2 * len(W.FAMILIES) + len(W.TARGETS))


def test_no_evaluation_prefix_and_other_kinds_are_named():
    fork, pre, prefix_of = _grid([0, 1])
    r = W.analyse(fork, pre, prefix_of, calibration_seeds=[0, 1], horizon=H, **KW)
    assert r.study is None and "no evaluation prefix" in r.reason
    bad = fork.assign_coords(pert_kind=("run", ["action_noise" if k == "lr_ramp" else k for k in fork.pert_kind.values]))
    with pytest.raises(ValueError, match="reads kinds lr_spike, lr_ramp"):
        W.analyse(bad, pre, prefix_of, calibration_seeds=[0], horizon=H, **KW)


def test_verdict_stability_runs_on_an_rl_study(warned):
    st = MR.verdict_stability(warned.study, n_resamples=4, seed=0)
    assert len(st) == len(M.sensitivity_claims(warned.study)) and st.same.between(0, 1).all()


# -- one direction across domains, RL pooled over its algorithms ------------------------------------


def test_cross_domain_pools_the_rl_algorithms_and_goes_untested_without_them(warned, misled):
    dirs, claim = V.cross_domain(warned.study, [warned.study, misled.study], ("A", "RL"), window=20,
                                 features=M.SHARED_CHANNELS, n_boot=50)
    assert list(dirs.columns) == [*M.SHARED_CHANNELS, "events"] and dirs.events.tolist() == [18, 36]
    assert claim.n == 9  # the smaller domain's prefixes; RL's 18 (9 per algorithm) count apart
    assert claim.effect > 0.5
    pooled = V.domain_directions([warned.study, misled.study], M.SHARED_CHANNELS, 20)
    assert pooled.seed.nunique() == 18
    dirs, claim = V.cross_domain(warned.study, [], ("GPT", "RL"), window=20, features=M.SHARED_CHANNELS)
    assert claim.verdict == "not tested" and "no RL study" in claim.reason and dirs.empty


# -- a tiny real fork grid -------------------------------------------------------------------------


def test_a_tiny_real_pendulum_fork_grid_runs_through_the_rl_analysis(tmp_path, monkeypatch):
    """Real SAC forks (two prefixes, a control, an lr spike and an lr ramp each) through the whole path:
    manifest, loading, paired labels, rows, the protocol and the claims."""
    monkeypatch.setenv("STABSTUDY_DATA", str(tmp_path / "data"))
    from stabstudy.analysis.studies.rl import design as R
    from stabstudy.learners.rl import forks
    from stabstudy.run.grids import load_grid, save_grid
    from stabstudy.run.runner import run_grid
    from stabstudy.run.store import load_runs

    hp = {"sac": {"hidden": 16, "batch_size": 32, "learning_starts": 50, "eval_episodes": 1, "eval_max_steps": 50,
                  "monitor_every": 2}}
    kw = dict(task="Pendulum-v1", hparams=hp, lead={"sac": 80}, post={"sac": 120}, spike_updates=20, env_duration=40,
              eval_every={"sac": 20})
    grid = {"lr_spike": R.fork_grid(["sac"], [("none", 1.0), ("lr_spike", 300.0)], [0, 1], {"sac": 200}, **kw),
            "lr_ramp": R.fork_grid(["sac"], [("lr_ramp", 100.0)], [0, 1], {"sac": 200}, **kw)}
    specs = grid["lr_spike"] + grid["lr_ramp"]
    prefixes = forks.prefix_specs(specs)
    run_grid(prefixes, scheduler="serial", progress=False)
    run_grid(specs, scheduler="serial", progress=False)
    save_grid("01_rl_algorithm_comparison", "smoke", {"prefixes": prefixes, **grid}, meta={"collapse_frac": 0.5})
    g = load_grid("01_rl_algorithm_comparison", "smoke")
    fork_specs = g.specs(*W.KINDS)
    prefix_of = {s.spec_hash: forks.prefix_key(s).spec_hash for s in fork_specs}
    r = W.analyse(load_runs(fork_specs, include_failed=False), load_runs(g.specs("prefixes")), prefix_of,
                  calibration_seeds=[0], collapse_frac=g.meta["collapse_frac"], horizon={"sac": 100.0},
                  burn_in=10, warn_horizon=40, late=5, config=MetaConfig(window=16, min_periods=4, corr_window=8),
                  n_components=2, n_boot=20)
    assert r.rows == (80 + 40 + 120) // 2 and len(r.runs) + len(r.left_out) == 6  # a Monitor row every 2 updates
    assert set(r.runs.kind) <= {"none", "lr_spike", "lr_ramp"}
    rows = W.on_rows(load_runs(fork_specs, include_failed=False))
    for h, x in r.runs[r.runs.kind != "none"].iterrows():
        env = rows.env_step.sel(run=h).values
        assert env[int(x.start)] >= 280 > env[int(x.start) - 1]  # the perturbation's env step: 200 + lead 80
    assert r.study is not None, r.reason  # the protocol ran (the seed-0 ramp collapses, CPU runs are deterministic)
    assert set(r.study.info.index) == set(r.runs.index) and r.study.params["families"] == W.FAMILIES
    # one calibration prefix: every resample of it recalibrates to the point estimate
    assert (MR.verdict_stability(r.study, n_resamples=5).same == 1.0).all()
    out = W.claims({"sac": r})
    assert out and all(c.claim.startswith("RL SAC: ") for c in out)
    assert {c.verdict for c in out} <= {"supported", "not supported", "inconclusive", "not tested"}
