"""Claim (c) of notebook 01: the learner's own noise knob, its manipulation check and the sign test over prefixes."""

import numpy as np
import pandas as pd
import xarray as xr

from stabstudy.analysis.studies.rl import checks
from stabstudy.analysis.studies.rl import claims as rl_claims
from stabstudy.analysis.studies.rl import outcomes as O

GRID = (3.0, 10.0, 30.0, 100.0)


def _run(env_steps, **channels):
    return xr.Dataset({k: ("step", np.asarray(v, float)) for k, v in channels.items()},
                      coords={"step": np.arange(len(env_steps)), "env_step": ("step", np.asarray(env_steps))})


def test_a_knob_that_did_not_change_the_policys_noise_is_caught():
    control = _run([100, 200, 300], ent_coef=[0.1, 0.1, 0.1])
    assert checks.knob_changed(_run([100, 200, 300], ent_coef=[0.3, 0.3, 0.3]), control, "sac", 300, lookback=250)[0] is True
    same, reason = checks.knob_changed(_run([100, 200, 300], ent_coef=[0.1, 0.1, 0.101]), control, "sac", 300, lookback=250)
    assert same is False and "did not change ent_coef" in reason
    assert checks.knob_changed(control, control, "td3", 300, lookback=250)[0] is None
    missing, reason = checks.knob_changed(_run([100], loss=[1.0]), control, "sac", 300, lookback=250)
    assert missing is False and "no ent_coef" in reason


def test_claim_c_on_the_collapse_at_one_dose():
    def rows(collapsed):
        return pd.DataFrame([{"learner": "sac", "pert_kind": "lr_spike", "pert_dose": 30.0, "prefix": f"s{i}",
                              "collapsed_prefix": c} for i, c in enumerate(collapsed)])
    ch = O.knob_collapse_changes(rows([1, 1, 1, 1, 1, 1, 0]), rows([0, 0, 0, 0, 0, 0, 0]), 30.0)
    assert list(ch.direction) == [1, 1, 1, 1, 1, 1, 0]
    claim = rl_claims.noise_buffer_claim(ch, "sac", "target_entropy", dose=30.0)
    assert claim.verdict == "supported" and "collapse at x30" in claim.claim and "6 prefixes up" in claim.reason
    # collapsing at every knob level (the old x30 design): nothing can move, nothing is decided
    flat = rl_claims.noise_buffer_claim(O.knob_collapse_changes(rows([1] * 7), rows([1] * 7), 30.0), "sac",
                                        "target_entropy", dose=30.0)
    assert flat.verdict == "inconclusive" and "no prefix resolved a change" in flat.reason
    few = rl_claims.noise_buffer_claim(O.knob_collapse_changes(rows([1, 1, 1]), rows([0, 0, 0]), 30.0), "sac", "t",
                                       dose=30.0)
    assert few.verdict == "inconclusive" and "smallest attainable p is 0.125" in few.reason
    assert rl_claims.noise_buffer_claim(ch.iloc[:0], "sac", "t", dose=30.0).verdict == "not tested"


def test_claim_c_is_not_tested_when_the_knob_changed_nothing():
    ch = pd.DataFrame({"learner": "ppo", "prefix": [f"p{i}" for i in range(6)], "direction": 1.0})
    none_changed = pd.DataFrame({"learner": "ppo", "prefix": [f"p{i}" for i in range(6)], "changed": False,
                                 "reason": "the knob did not change policy_std before the spike (0.5 vs 0.5)"})
    claim = rl_claims.noise_buffer_claim(ch, "ppo", "ent_coef", dose=10.0, checks=none_changed)
    assert claim.verdict == "not tested" and "manipulation check failed" in claim.reason and "policy_std" in claim.reason
    some = none_changed.assign(changed=[True] * 5 + [False])
    claim = rl_claims.noise_buffer_claim(ch, "ppo", "ent_coef", dose=10.0, checks=some)
    assert claim.verdict == "supported" and claim.n == 5 and "1 prefix(es) left out" in claim.reason
    unmeasurable = none_changed.assign(changed=None, reason="TD3's knob acts on behaviour")
    claim = rl_claims.noise_buffer_claim(ch, "ppo", "ent_coef", dose=10.0, checks=unmeasurable)
    assert claim.verdict == "supported" and "not measurable" in claim.reason


def test_the_knob_check_table_pairs_each_knob_fork_with_its_prefixs_default_fork():
    def run(std):
        return xr.Dataset({"policy_std": (("run", "step"), [[std, std, std]])},
                          coords={"run": [0], "step": np.arange(3), "env_step": ("step", [100, 200, 300])}).isel(run=0)
    ds = xr.concat([run(0.5).expand_dims(run=[h]) for h in ("d0", "s0")]
                   + [run(0.9).expand_dims(run=["k0"]), run(0.5).expand_dims(run=["k1"])], "run")
    rows = pd.DataFrame({"spec_hash": ["d0", "s0", "k0", "k1"], "learner": "ppo",
                         "pert_kind": ["none", "lr_spike", "none", "none"], "pert_start": [np.nan, 350, np.nan, np.nan],
                         "noise_after_fork": ["same", "same", 0.05, 0.01]})
    t = checks.knob_check_table(ds, rows, lookback={"ppo": 300}, prefix_of={h: "P" for h in rows.spec_hash})
    assert list(t.noise) == [0.05, 0.01] and list(t.changed) == [True, False]
    assert "did not change policy_std" in t.reason.iloc[1]
