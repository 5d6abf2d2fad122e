"""Each notebook's claims function: only 'not tested' / 'inconclusive' on empty or NaN-only
inputs, and 'supported' / 'not supported' on data constructed for and against its claims."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from stabstudy.analysis import claims as C
from stabstudy.analysis.studies import calibration, closed_loop_claims, lm_spikes, precision
from stabstudy.analysis.studies.rl import curves as rl_curves

MISSING = {"not tested", "inconclusive"}


def verdicts(rows: list[C.Claim]) -> dict[str, str]:
    """Claim text -> verdict after Holm (what the notebook shows)."""
    assert all(isinstance(r, C.Claim) for r in rows)
    df = C.table(rows)
    assert df.claim.is_unique, "claims of one table must be distinguishable"
    return dict(zip(df.claim, df.verdict, strict=True))


def find(v: dict[str, str], start: str) -> str:
    """The verdict of the one claim whose text starts with ``start``."""
    hits = [k for k in v if k.startswith(start)]
    assert len(hits) == 1, (start, list(v))
    return v[hits[0]]


# -- notebook 00 -------------------------------------------------------------------------


def _eos(ratios: dict[float, list[float]]) -> pd.DataFrame:
    return pd.DataFrame([{"lr": lr, "seed": i, "ratio": r} for lr, rs in ratios.items() for i, r in enumerate(rs)])


def _spikes(n: int, jump: float, drop: float) -> pd.DataFrame:
    rng = np.random.default_rng(1)
    return pd.DataFrame({"loss_jump": jump * (1 + 0.05 * rng.random(n)),
                         "grad_norm_jump": jump * (1 + 0.05 * rng.random(n)),
                         "sharpness_drop": drop + 0.01 * rng.random(n), "baseline_sharpness_drop": 0.01 * rng.random(n)})


def test_calibration_missing_data_gives_no_verdict():
    nan_eos = _eos({0.3: [np.nan], 0.45: [np.nan], 0.6: [np.nan]})
    for dense, gd, adam, spikes in [
        (None, pd.DataFrame(), pd.DataFrame(), []),
        ({"measured": np.nan, "target": 1.0, "tolerance": 0.02}, nan_eos, nan_eos,
         pd.DataFrame({k: [np.nan] * 4 for k in _spikes(1, 1, 1)})),
    ]:
        assert set(verdicts(calibration.claims_table(dense, gd, adam, spikes)).values()) <= MISSING


def test_calibration_one_run_or_too_few_lrs_is_no_verdict():
    good = _eos({0.3: [1.0], 0.45: [1.0]})  # two learning rates: the GD claim needs three
    v = verdicts(calibration.claims_table(None, good, _eos({0.003: [1.0]}), _spikes(1, 10.0, 0.8)))
    assert set(v.values()) <= MISSING


def test_calibration_for_and_against():
    dense = {"measured": 1.005, "target": 1.0, "tolerance": 0.02, "iters_used": 12}
    gd = _eos({0.3: [1.05, 0.98], 0.45: [0.95, 1.0], 0.6: [1.1, 1.02]})
    adam = _eos({0.003: [1.1], 0.006: [0.9]})
    v = verdicts(calibration.claims_table(dense, gd, adam, _spikes(6, 10.0, 0.6)))
    assert set(v.values()) == {"supported"}
    bad_dense = {**dense, "measured": 1.5}
    bad = _eos({0.3: [0.5, 0.4], 0.45: [0.5, 0.6], 0.6: [1.6, 1.5]})
    v = verdicts(calibration.claims_table(bad_dense, bad, _eos({0.003: [3.0], 0.006: [0.1]}), _spikes(6, 1.1, 0.0)))
    assert set(v.values()) == {"not supported"}
    # one learning rate outside the band is enough against a claim about every one, and it is named
    one_off = _eos({0.3: [1.05, 0.98], 0.45: [0.95, 1.0], 0.6: [1.6, 1.5]})
    row = C.table(calibration.claims_table(dense, one_off, adam, _spikes(6, 10.0, 0.6))).iloc[1]
    assert row.verdict == "not supported" and "outside: lr 0.6" in row.reason


def test_calibration_claims_declare_their_plan():
    """Every confirmatory row names a family of the plan and none falls back to 'no smallest effect'."""
    dense = {"measured": 1.005, "target": 1.0, "tolerance": 0.02, "iters_used": 12}
    gd = _eos({0.3: [1.05], 0.45: [0.95], 0.6: [1.1]})
    df = C.table(calibration.claims_table(dense, gd, _eos({0.003: [1.1], 0.006: [0.9]}), _spikes(6, 10.0, 0.6)))
    families = {p.family for p in calibration.plan().values()}
    assert set(df.family) <= families and not df.reason.str.contains(C.NO_SESOI).any()
    catapult = df[df.family == "catapult after an lr spike (toy MLP)"]
    assert len(catapult) == 3 and catapult.power_supported.notna().all()


# -- notebook 01: tests/test_rl_outcomes.py (its claims are decided over prefixes) -------------


# -- notebook 02 -------------------------------------------------------------------------

LM_ROWS = ("an LR spike causes a loss spike", "the spike after an LR spike is transient",
           "an LR spike leaves unrecovered damage", "an outlier batch causes a loss spike",
           "the spike after an outlier batch is transient", "an outlier batch leaves unrecovered damage",
           "an outlier batch inflates the gradient norm", "an outlier batch inflates Adam's second moment",
           "inflated Adam second moments persist", "their persistence grows", "qk-layernorm lowers LR sensitivity",
           "z-loss lowers LR sensitivity", "attention logits grow with the learning rate",
           "qk-layernorm keeps the maximum attention logit", "attention-logit growth accompanies",
           "controlled stochasticity (gradient noise) buffers an LR spike: lower peak",
           "controlled stochasticity (gradient noise) buffers an LR spike: lower final damage", "outside spikes",
           "during an LR spike")


def _lm(n: int = 12, claims_hold: bool = True, damage: float = 0.03):
    """Notebook 02's tables with every claim true (``claims_hold``) or every effect absent or reversed;
    ``damage``: the lasting damage (nats) of an event without gradient noise, 0 at the largest dose when the
    claims hold (noise buffers it)."""
    rng = np.random.default_rng(2)
    eff = []
    for kind in ("lr_spike", "outlier_batch"):
        for noise in (0.0, 3.0):
            for i in range(n):
                buffered = claims_hold and noise > 0
                eff.append(dict(event=kind, noise=noise, seed=i, beta2=0.95,
                                peak_excess_loss=(0.25 if buffered else 1.0 if claims_hold else 0.0)
                                + 0.01 * rng.random(),
                                final_damage=(0.0 if buffered else damage) + 0.002 * rng.normal(),
                                twin_final_loss=2.3 + 0.01 * rng.normal(),
                                grad_norm_ratio=(5.0 if claims_hold else 1.0) + 0.1 * rng.random(),
                                adam_v_ratio=(5.0 if claims_hold else 1.0) + 0.1 * rng.random()))
    mem = pd.DataFrame([dict(beta2=b2, seed=i, tau_theory=1 / (1 - b2), steps_observed=500,
                             t_efold=(1 / (1 - b2)) * (1.05 if claims_hold else 3.0),
                             tau_fit=(1 / (1 - b2)) * (1 + 0.01 * i) if claims_hold else 1000 * (1 - b2) + 0.1 * i)
                        for b2 in (0.9, 0.95, 0.99) for i in range(n)])
    sweep = []
    for variant in ("baseline", "qk_layernorm", "z_loss"):
        for j, lr in enumerate((1e-3, 3e-3, 1e-2, 3e-2, 1e-1)):
            for i in range(n):
                fixed = variant != "baseline" and claims_hold  # qk-layernorm and z-loss help only when the claims hold
                qk = variant == "qk_layernorm"
                # the baseline's logits grow with the lr (and with its failures) when the claims hold, fall otherwise;
                # qk-layernorm's are 5-fold lower when they hold, 5-fold higher otherwise
                logit = (10.0 * (j + 1) if claims_hold else 100.0 / (j + 1)) * ((0.2 if claims_hold else 5.0) if qk else 1.0)
                worse = j >= 3 and not fixed
                sweep.append(dict(variant=variant, lr=lr, seed=i, loss0=5.5, status="ok",
                                  final_loss=4.0 + j + 0.01 * rng.random() if worse else 2.0 + 0.01 * rng.random(),
                                  attn_logit_max=logit * (1 + 0.01 * rng.random())))
    sharp = pd.DataFrame([dict(spec_hash=f"{kind}{i}", event=kind, seed=i, in_event=e,
                               precond_ratio=((0.5 if e == 0 else 2.0) if claims_hold else 1.0) * (1 + 0.01 * rng.random()))
                          for i in range(n) for kind in ("none", "lr_spike") for e in (0, 1) if kind != "none" or e == 0])
    return pd.DataFrame(eff), mem, pd.DataFrame(sweep), sharp


def test_lm_missing_data_gives_no_verdict():
    empty = pd.DataFrame()
    assert set(verdicts(lm_spikes.claims(empty, empty, empty, None)).values()) == {"not tested"}
    eff, mem, sweep, sharp = _lm()
    for df, cols in ((eff, ["peak_excess_loss", "final_damage", "grad_norm_ratio", "adam_v_ratio"]),
                     (mem, ["t_efold", "tau_fit"]), (sweep, ["final_loss", "attn_logit_max"]),
                     (sharp, ["precond_ratio"])):
        df[cols] = np.nan
    assert set(verdicts(lm_spikes.claims(eff, mem, sweep, sharp)).values()) <= MISSING


def test_lm_every_confirmatory_row_declares_its_smallest_effect_and_family():
    df = C.table(lm_spikes.claims(*_lm()))
    assert len(df) == len(LM_ROWS) and (df.role == "confirmatory").all()
    assert set(df.family) == {p.family for p in lm_spikes.plan().values()} == set(lm_spikes.FAMILIES.values())
    assert not df.reason.str.contains(C.NO_SESOI).any()
    assert df.source.str.contains("smallest effect: ").all()
    directional = df[~df.test.str.startswith(("TOST", "every case"))]
    assert np.isfinite(directional.sesoi).all() and np.isfinite(directional.power_supported).all()


def test_lm_qk_layernorm_row_needs_qk_data():
    eff, mem, sweep, sharp = _lm(n=3)
    v = verdicts(lm_spikes.claims(eff, mem, sweep[sweep.variant != "qk_layernorm"], sharp))
    assert find(v, "qk-layernorm keeps the maximum attention logit") == "not tested"
    assert find(v, "qk-layernorm lowers LR sensitivity") == "not tested"
    # a variant whose every run diverged has no sensitivity (not the best one, 0)
    dead = sweep.copy()
    dead.loc[dead.variant == "qk_layernorm", "final_loss"] = np.nan
    assert find(verdicts(lm_spikes.claims(eff, mem, dead, sharp)), "qk-layernorm lowers LR sensitivity") == "not tested"
    one_seed = sweep[sweep.seed == 0]
    assert find(verdicts(lm_spikes.claims(eff, mem, one_seed, sharp)), "qk-layernorm lowers LR") == "inconclusive"


def test_lm_claims_for_and_against():
    v = verdicts(lm_spikes.claims(*_lm()))
    for start in LM_ROWS:
        assert find(v, start) == "supported", start
    v = verdicts(lm_spikes.claims(*_lm(claims_hold=False, damage=0.3)))
    for start in LM_ROWS:
        want = "supported" if start.endswith("leaves unrecovered damage") else "not supported"
        assert find(v, start) == want, start


def test_lm_absent_damage_with_enough_seeds_is_not_supported():
    """No lasting damage at all (and so none for gradient noise to buffer): the rows that claim damage say
    'not supported' once enough seeds exclude 1% of the final loss; three seeds cannot."""
    v = verdicts(lm_spikes.claims(*_lm(damage=0.0)))
    for start in ("an LR spike leaves unrecovered damage", "an outlier batch leaves unrecovered damage",
                  "controlled stochasticity (gradient noise) buffers an LR spike: lower final damage"):
        assert find(v, start) == "not supported", start
    assert find(v, "the spike after an LR spike is transient") == "supported"
    v = verdicts(lm_spikes.claims(*_lm(n=2, damage=0.0)))
    assert find(v, "an LR spike leaves unrecovered damage") == "inconclusive"


def test_lm_sharpness_in_event_set_is_the_lr_spike_runs_only():
    """An outlier batch's measurement during its event (at the usual lr, far below the threshold) is not
    pooled into the LR spike's; without LR-spike runs the row is not tested."""
    eff, mem, sweep, sharp = _lm()
    outlier = sharp[sharp.event == "lr_spike"].assign(event="outlier_batch", precond_ratio=0.05,
                                                      spec_hash=lambda d: "o" + d.spec_hash)
    v = verdicts(lm_spikes.claims(eff, mem, sweep, pd.concat([sharp, outlier])))
    assert find(v, "during an LR spike") == "supported"
    v = verdicts(lm_spikes.claims(eff, mem, sweep, pd.concat([sharp[sharp.event == "none"], outlier])))
    assert find(v, "during an LR spike") == "not tested"


def test_lm_seed_is_the_unit_of_the_sweep_and_sharpness_rows():
    eff, mem, sweep, sharp = _lm(n=4)
    df = C.table(lm_spikes.claims(eff, mem, sweep, sharp)).set_index("claim")
    n = {start: int(df.n[[k for k in df.index if k.startswith(start)][0]])
         for start in ("attention logits grow", "qk-layernorm keeps", "attention-logit growth", "outside spikes",
                       "during an LR spike", "qk-layernorm lowers")}
    assert set(n.values()) == {4}, n


# -- notebook 03 -------------------------------------------------------------------------

PREC_ROWS = ("bf16 autocast reaches float32", "fp16 autocast without loss scaling", "an fp16 overflow corrupts",
             "after an fp16 overflow reaches Adam", "with GradScaler the same overflow", "skipping the overflowing step",
             "bfloat16 keeps float32's range", "pure bf16 storage erases", "pure bf16 ends worse", "pure fp16 Adam",
             "the float32 twin's fp16 headroom", "a longer context")


def _prec(for_claims: bool, n: int = 6, underflow: float | None = None):
    """Notebook 03's tables with every claim true or every effect absent or reversed; ``underflow``: the
    final-loss gap of fp16 autocast without a scaler over the one with GradScaler (default 0.2 for, 0 against)."""
    rng = np.random.default_rng(3)
    gap = (0.2 if for_claims else 0.0) if underflow is None else underflow
    a = []
    for p, off in (("float32", 0.0), ("bf16_autocast", 0.001 if for_claims else 0.3), ("fp16_autocast", gap),
                   ("fp16_autocast_scaler", 0.0), ("bf16_pure", 0.3 if for_claims else -0.2), ("fp16_pure", np.nan)):
        for i in range(n):
            a.append(dict(precision=p, seed=i, final_loss=2.0 + off + 0.002 * rng.normal(),
                          status="diverged" if p == "fp16_pure" and for_claims else "ok"))
    b = []
    for p in ("float32", "bf16_autocast", "fp16_autocast", "fp16_autocast_scaler"):
        for d in (1.0, 1e4, 1e8):
            for i in range(n):
                pert = d != 1.0
                over = d == 1e8 and p.startswith("fp16") if for_claims else pert  # against: bf16 overflows too
                no_scaler = p == "fp16_autocast"
                # against: seed 0's scaler-free run breaks as well, since statsmodels' closed-form score
                # statistic is undefined (NaN) at the extreme table 0/n against n/n, which the exact test
                # then ranks least extreme (p = 1)
                broke = over and (no_scaler == for_claims or (no_scaler and i == 0))
                damage = {"float32": 0.5, "fp16_autocast_scaler": 0.0}.get(p, 0.0) if for_claims else \
                    {"float32": 0.0, "fp16_autocast_scaler": 0.5}.get(p, 0.0)
                # for: the scaler-free run diverges (not recovered), the scaler's run does; against: the reverse
                recovered = (0.0 if broke else 1.0) if over else np.nan
                b.append(dict(precision=p, pert_dose=d, seed=i, nonfinite_steps=int(over),
                              adam_state_nonfinite_max=10.0 if broke else 0.0, status="diverged" if broke else "ok",
                              skipped_steps=int(over and p == "fp16_autocast_scaler"),
                              final_loss=2.0 + (damage if pert else 0.0) + 0.01 * rng.random(),
                              recovered=recovered, recovery_window=50))
    rho = pd.DataFrame([dict(precision="bf16_pure", seed=i, rho=(-0.8 if for_claims else 0.8) + 0.05 * i, p=0.01)
                        for i in range(n)])
    logit = []
    for p in ("float32", "fp16_autocast"):
        for init in (1.0, 3.0, 100.0, 300.0, 1000.0, 3000.0, 10000.0):
            for t in (64, 256):
                for i in range(n):
                    h = init * 1e-3 * (t / 64 if for_claims else 64 / t) * (1 + 0.01 * i * t / 64)
                    over = h >= 1
                    div = (over if for_claims else not over) and p == "fp16_autocast"
                    logit.append(dict(precision=p, init_scale=init, block_size=t, seed=i, headroom0=h,
                                      headroom_peak=h, headroom_naive0=h / 8, status="diverged" if div else "ok",
                                      steps_done=5))
    return pd.DataFrame(a), pd.DataFrame(b), rho, pd.DataFrame(logit)


def test_precision_missing_data_gives_no_verdict():
    empty = pd.DataFrame()
    assert set(verdicts(precision.claims_table(empty, empty, empty, empty)).values()) == {"not tested"}
    a, b, rho, logit = _prec(True)
    a[["final_loss", "status"]] = np.nan
    b[["final_loss", "nonfinite_steps", "adam_state_nonfinite_max", "skipped_steps", "status", "recovered"]] = np.nan
    rho["rho"] = np.nan
    logit[["headroom0", "headroom_peak", "headroom_naive0"]] = np.nan
    logit["status"] = None
    assert set(verdicts(precision.claims_table(a, b, rho, logit)).values()) <= MISSING


def test_precision_every_confirmatory_row_declares_its_smallest_effect_and_family():
    df = C.table(precision.claims_table(*_prec(True)))
    assert len(df) == len(PREC_ROWS) and (df.role == "confirmatory").all()
    assert set(df.family) == {p.family for p in precision.plan().values()} == set(precision.FAMILIES.values())
    assert not df.reason.str.contains(C.NO_SESOI).any()
    assert df.source.str.contains("smallest effect: ").all()
    assert np.isfinite(df.sesoi).all() and np.isfinite(df.power_supported).all()


def test_precision_claims_for_and_against():
    v = verdicts(precision.claims_table(*_prec(True)))
    assert set(v.values()) == {"supported"}, v
    assert "within 50 steps" in next(k for k in v if k.startswith("after an fp16 overflow reaches Adam"))
    v = verdicts(precision.claims_table(*_prec(False)))
    for start in PREC_ROWS:
        assert find(v, start) == "not supported", start


def test_precision_absent_underflow_with_enough_seeds_is_not_supported():
    """fp16 without a scaler ending where GradScaler ends: 'not supported' once the seeds exclude 1% of the
    final loss, inconclusive with two seeds."""
    v = verdicts(precision.claims_table(*_prec(True, underflow=0.0)))
    assert find(v, "fp16 autocast without loss scaling") == "not supported"
    v = verdicts(precision.claims_table(*_prec(True, n=2, underflow=0.0)))
    assert find(v, "fp16 autocast without loss scaling") == "inconclusive"


def test_precision_overflow_rows_count_seeds_at_the_largest_dose():
    """The doses of one seed share every step before the overflow: the rates count seeds, at the largest dose."""
    df = C.table(precision.claims_table(*_prec(True, n=5))).set_index("claim")
    for start in ("an fp16 overflow corrupts", "after an fp16 overflow", "with GradScaler the same", "bfloat16 keeps"):
        row = df.loc[[k for k in df.index if k.startswith(start)][0]]
        assert row.n == 10 and row.effect == 1.0, (start, row.n, row.effect)  # 5 seeds an arm, all against none
    assert df.loc[[k for k in df.index if k.startswith("skipping the overflowing")][0]].n == 5


def test_precision_recovery_needs_a_recovery_measurement_and_both_groups():
    a, b, rho, logit = _prec(True)
    v = verdicts(precision.claims_table(a, b.drop(columns=["recovered", "recovery_window"]), rho, logit))
    assert find(v, "after an fp16 overflow reaches Adam") == "not tested"  # run_summary without recovery_window
    b.loc[b.precision == "fp16_autocast_scaler", "recovered"] = np.nan  # no verdict for the scaler's runs
    v = verdicts(precision.claims_table(a, b, rho, logit))
    assert find(v, "after an fp16 overflow reaches Adam") == "not tested"
    b.loc[(b.precision == "fp16_autocast_scaler") & (b.seed < 2), "recovered"] = 1.0  # two seeds: too few
    v = verdicts(precision.claims_table(a, b, rho, logit))
    assert find(v, "after an fp16 overflow reaches Adam") == "inconclusive"


@pytest.mark.parametrize("margin", [0.02, 0.05])
def test_precision_equivalence_is_tost_against_the_stated_margin(margin):
    a, b, rho, logit = _prec(True)
    a.loc[a.precision == "bf16_autocast", "final_loss"] += 0.03 * 2.0  # 3% above float32
    v = verdicts(precision.claims_table(a, b, rho, logit, equivalence_margin=margin))
    assert find(v, "bf16 autocast reaches float32") == ("not supported" if margin == 0.02 else "supported")


def test_precision_headroom_rows_summarise_each_seed():
    """The init scales of a seed are one network, scaled: one number per seed, so three seeds are n = 3."""
    a, b, rho, logit = _prec(True, n=3)
    df = C.table(precision.claims_table(a, b, rho, logit)).set_index("claim")
    for start in ("the float32 twin's fp16 headroom", "a longer context"):
        assert df.loc[[k for k in df.index if k.startswith(start)][0]].n == 3, start
    v = verdicts(precision.claims_table(a, b, rho, logit[logit.block_size == 64]))
    assert find(v, "a longer context") == "not tested"


def test_rl_first_last_returns_skip_rows_without_evaluations():
    import xarray as xr

    perf = np.array([[np.nan, -300.0, np.nan, 2000.0], [np.nan] * 4])
    ds = xr.Dataset({"perf": (("run", "step"), perf)}, coords={"run": ["a", "b"], "step": np.arange(4)})
    ends = rl_curves.first_last_returns(ds)
    assert ends.loc["a"].tolist() == [-300.0, 2000.0]
    assert ends.loc["b"].isna().all()


@pytest.mark.parametrize("module", [lm_spikes, precision], ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_analysis_plan_declares_every_confirmatory_claim_before_the_runs(module):
    """The plan's rows (printed before the runs) are the families and smallest effects the claims use; each
    row's source names where its smallest effect comes from."""
    from stabstudy.analysis import plan

    frame = plan.frame(module.plan())
    assert frame.why.str.len().gt(0).all() and frame["smallest effect"].gt(0).all()
    data = _lm() if module is lm_spikes else _prec(True)
    rows = lm_spikes.claims(*data) if module is lm_spikes else precision.claims_table(*data)
    df = C.table(rows)
    whys = {p.why for p in module.plan().values()}
    assert all(any(src.endswith(f"smallest effect: {w}") for w in whys) for src in df.source)
    # a universal claim has its tolerance, not a smallest effect; a relative TOST margin is printed in nats
    used = df[~df.test.str.contains("relative")].sesoi.abs().dropna().round(9)
    assert set(used) <= {round(p.sesoi, 9) for p in module.plan().values()}


# -- notebook 05 (GPT and toy domains) ---------------------------------------------------------

COMPARATORS = ("clip1", "olmo")


def _loop(effect: bool, n: int = 16, domain: str = "toy", seed0: int = 0) -> pd.DataFrame:
    """One domain's runs, as closed_loop.outcomes gives them: per seed the unperturbed and two
    perturbed runs without a controller, with z_rollback and with each comparator. ``effect``: the
    controller spares every collapse, cuts the damage, stays quiet and leaves the final loss alone,
    and the comparators do far worse; else it changes nothing (same collapses, same damage as the
    comparators), intervenes 5 times per 1,000 steps and ends 5% higher when nothing is wrong."""
    rng = np.random.default_rng(seed0 + (0 if effect else 1))
    rows = []
    for s in range(seed0, seed0 + n):
        base = 0.8 + 0.05 * rng.standard_normal()
        for ctrl in ("none", "z_rollback", *COMPARATORS):
            for event in ("none", "lr_spike x100/5", "outlier_batch x1/5"):
                hit = event != "none"
                cut = ctrl == "z_rollback" and effect
                damage = (0.02 if cut else base + (0.0 if ctrl == "none" or not effect else -0.2)) if hit else 0.0
                damage += 0.01 * rng.standard_normal() if hit else 0.0
                quiet = ctrl != "z_rollback" or effect
                rows.append({"domain": domain, "seed": s, "prefix": "", "event": event, "controller": ctrl,
                             "damage": damage, "collapse": float(hit and not cut),
                             "interventions": int(rng.integers(0, 2)) if quiet else int(rng.integers(4, 7)),
                             "n_steps": 1000, "final": 2.0 if quiet else 2.1 + 0.001 * rng.standard_normal()})
    return pd.DataFrame(rows)


def _loop_verdicts(out: pd.DataFrame) -> dict[str, str]:
    rows = closed_loop_claims.claims(out, primary="z_rollback", evaluation_seeds=sorted(out.seed.unique()),
                              plan=closed_loop_claims.Plan(), comparators=COMPARATORS)
    assert all(r.family and r.confirmatory for r in rows)
    return verdicts(rows)


def test_closed_loop_every_gpt_and_toy_claim_can_be_supported():
    for domain in ("lm", "toy"):
        v = _loop_verdicts(_loop(True, domain=domain))
        assert len(v) == 6 and set(v.values()) == {"supported"}, v


def test_closed_loop_every_claim_is_not_supported_when_the_effect_is_absent():
    """No effect at all, with the quick profile's units: every row decides, the 'beats' rows too."""
    for domain in ("lm", "toy"):
        v = _loop_verdicts(_loop(False, domain=domain))
        assert len(v) == 6 and set(v.values()) == {"not supported"}, v


def test_closed_loop_missing_data_gives_no_verdict():
    out = _loop(True)
    out[["damage", "collapse", "final"]] = np.nan
    out = out[~((out.event == "none") & (out.controller == "z_rollback"))]  # no unperturbed controlled run
    v = _loop_verdicts(out)
    assert set(v.values()) <= MISSING, v
    assert set(_loop_verdicts(_loop(True, n=2)).values()) <= MISSING  # two units are too few for any rule


def test_closed_loop_false_interventions_are_a_rate_per_run():
    out = _loop(True, n=5)
    sel = [r for r in closed_loop_claims.claims(out, primary="z_rollback", evaluation_seeds=list(range(5)),
                                         plan=closed_loop_claims.Plan(), comparators=()) if "selective" in r.claim]
    assert len(sel) == 1 and sel[0].n == 5  # runs, not 5,000 steps


def test_closed_loop_domains_never_pool_and_never_change_each_others_verdicts():
    lm, toy = _loop(True, domain="lm"), _loop(False, domain="toy", seed0=100)
    alone = _loop_verdicts(lm)
    both = _loop_verdicts(pd.concat([lm, toy]))
    assert {k: v for k, v in both.items() if k.startswith("lm:")} == alone
    assert len(both) == 12 and {v for k, v in both.items() if k.startswith("toy:")} == {"not supported"}
