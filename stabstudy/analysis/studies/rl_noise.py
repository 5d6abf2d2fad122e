"""Claim (c) of notebook 01, "more of the learner's own noise buffers the lr spike", over prefixes.

The knob (:data:`stabstudy.registry.NOISE_KNOB`: PPO ``ent_coef``, SAC ``target_entropy``, TD3
``action_noise_std``) is set at the fork (``noise_after_fork``), early enough to act before the spike
(the fork's ``lead``). The unit is the prefix, each with a default-knob and a raised-knob arm:

* the manipulation check: :func:`knob_changed` (one fork against its default-knob twin before the
  spike, on :data:`KNOB_CHANNELS`), :func:`knob_check_table` (every knob fork of a grid);
* the outcome, two rules (the notebook chooses by budget): :func:`knob_dose_changes` (the paired
  change of each prefix's critical dose, each bisected at its own knob:
  :func:`stabstudy.analysis.studies.rl_outcomes.prefix_critical_doses`) or
  :func:`knob_collapse_changes` (of its collapse at one dose);
* the rule: :func:`noise_buffer_claim`, an exact sign test over prefixes, with its power.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import xarray as xr

from stabstudy.analysis.claims import Claim, not_tested

#: The channel that shows each learner's own noise knob acting on its policy.
KNOB_CHANNELS = {"ppo": "policy_std", "a2c": "policy_std", "sac": "ent_coef", "td3": None, "ddpg": None}


def knob_changed(treated: xr.Dataset, control: xr.Dataset, learner: str, at: float, *, lookback: float,
                 rtol: float = 0.05) -> tuple[bool | None, str]:
    """Did a fork's changed noise knob change its policy's noise at the spike (env step ``at``)?
    Compares :data:`KNOB_CHANNELS` (PPO: ``policy_std``; SAC: ``ent_coef``, its alpha) averaged over
    ``[at - lookback, at)`` with the control fork's (same prefix, default knob). ``(True, reason)``
    when they differ by more than ``rtol`` (relative), ``(False, reason)`` when not, ``(None, reason)``
    when nothing measures it (TD3's exploration noise acts on behaviour, not on the policy)."""
    ch = KNOB_CHANNELS.get(learner)
    if ch is None:
        return None, f"{learner.upper()}'s knob acts on behaviour; no policy channel measures it"

    def mean(ds):
        env = np.asarray(ds["env_step"].values, dtype=float)
        v = ds[ch].values[(env >= at - lookback) & (env < at)] if ch in ds else np.array([])
        v = v[np.isfinite(v)]
        return float(v.mean()) if v.size else np.nan

    a, b = mean(treated), mean(control)
    if not (np.isfinite(a) and np.isfinite(b)):
        return False, f"no {ch} measured in the {lookback:.0f} env steps before the spike"
    rel = abs(a - b) / max(abs(b), 1e-12)
    verb = "changed" if rel > rtol else "did not change"
    return rel > rtol, f"the knob {verb} {ch} before the spike ({a:.3g} vs {b:.3g} in the control, {100 * rel:.1f}%)"


def knob_check_table(ds: xr.Dataset, rows, *, lookback: Mapping[str, float], prefix_of: Mapping[str, str],
                     rtol: float = 0.05):
    """:func:`knob_changed` for every fork of ``rows`` (``rl_comparison.summarize`` rows of the runs of
    ``ds``) that ran with a changed noise knob (``noise_after_fork`` not "same") and no perturbation,
    against the unperturbed default-knob fork of its prefix (``prefix_of``: run -> prefix), over the
    ``lookback[learner]`` env steps before the spike (the median ``pert_start`` of the prefix's spiked
    forks). One row per learner, prefix and knob level: ``noise``, ``changed`` (True / False / None:
    not measurable), ``reason``; what :func:`noise_buffer_claim` reads as ``checks``."""
    import pandas as pd

    rows = rows.assign(prefix=rows.spec_hash.map(lambda h: prefix_of.get(str(h))))
    same = rows.noise_after_fork.map(lambda v: v == "same")
    plain = rows.pert_kind == "none"
    starts = rows[~plain].groupby(["learner", "prefix"]).pert_start.median().to_dict()
    default = rows[plain & same].drop_duplicates(["learner", "prefix"]).set_index(["learner", "prefix"]).spec_hash
    out = []
    for r in rows[plain & ~same].itertuples():
        base = {"learner": r.learner, "prefix": r.prefix, "noise": r.noise_after_fork}
        ctrl, at = default.get((r.learner, r.prefix)), starts.get((r.learner, r.prefix), np.nan)
        if ctrl is None or not np.isfinite(at):
            out.append({**base, "changed": False, "reason": "no default-knob fork or no spike of this prefix to "
                                                              "compare with"})
            continue
        ok, why = knob_changed(ds.sel(run=r.spec_hash), ds.sel(run=ctrl), r.learner, float(at),
                               lookback=float(lookback[r.learner]), rtol=rtol)
        out.append({**base, "changed": ok, "reason": why})
    return pd.DataFrame(out, columns=["learner", "prefix", "noise", "changed", "reason"])


def knob_dose_changes(default, raised):
    """Claim (c)'s outcome, rule 1: the paired change of each prefix's critical dose when its noise
    knob is raised (``default`` and ``raised``: :func:`~stabstudy.analysis.studies.rl_outcomes.prefix_critical_doses` of the same prefixes at
    the default knob and at the raised one; each bisected at its own knob). One row per learner and
    prefix in both: ``low0``/``high0``/``dose0`` and ``low1``/``high1``/``dose1``, ``log10_change``
    (log10 of dose1 / dose0; NaN when both are above the grid) and ``direction``: +1 when the raised
    knob's bracket lies wholly above the default's (``low1 >= high0``), -1 wholly below (``high1 <=
    low0``), 0 when the brackets overlap (unresolved: the design cannot tell; both above the grid
    too), NaN when either has no data."""
    key = ["learner", "prefix"]
    cols = ["low", "high", "dose", "where"]
    m = default[key + cols].merge(raised[key + cols], on=key, suffixes=("0", "1"))
    lo0, hi0, lo1, hi1 = (m[c].to_numpy(float) for c in ("low0", "high0", "low1", "high1"))
    missing = (m.where0 == "no data") | (m.where1 == "no data")
    direction = np.where(lo1 >= hi0, 1.0, np.where(hi1 <= lo0, -1.0, 0.0))
    m["direction"] = np.where(missing, np.nan, direction)
    with np.errstate(invalid="ignore", divide="ignore"):
        m["log10_change"] = np.log10(m.dose1.to_numpy(float) / m.dose0.to_numpy(float))
    return m.drop(columns=["where0", "where1"])


def knob_collapse_changes(default, raised, dose: float, *, kind: str = "lr_spike", dose_col: str = "pert_dose"):
    """Claim (c)'s outcome, rule 2 (one dose instead of a bisection per knob level): the paired change
    of each prefix's collapse at ``dose`` (``default`` and ``raised``: :func:`~stabstudy.analysis.studies.rl_outcomes.by_prefix`
    rows at the two knob levels). One row per learner and prefix in both: ``collapsed0``, ``collapsed1`` and
    ``direction`` +1 (collapsed at the default knob, not at the raised: buffered), -1 (the reverse), 0
    (the same), NaN without a verdict at either."""
    key = ["learner", "prefix"]

    def at(rows):
        r = rows[(rows[dose_col] == dose) & ((rows.pert_kind == kind) if "pert_kind" in rows else True)]
        return r[key + ["collapsed_prefix"]]

    m = at(default).merge(at(raised), on=key, suffixes=("0", "1")).rename(
        columns={"collapsed_prefix0": "collapsed0", "collapsed_prefix1": "collapsed1"})
    m["direction"] = m.collapsed0 - m.collapsed1
    return m


def noise_buffer_claim(changes, learner: str, knob: str, *, checks=None, outcome: str = "critical dose",
                       dose: float | None = None, alpha: float = 0.05, planning_up: float = 0.9,
                       claim: str | None = None) -> Claim:
    """Claim (c): "more of ``learner``'s own noise (``knob``) buffers the lr spike", over prefixes.

    ``changes``: :func:`knob_dose_changes` (``outcome="critical dose"``: the critical dose goes up) or
    :func:`knob_collapse_changes` (``outcome="collapse"`` at ``dose``: it stops collapsing), rows of
    ``learner`` used. A one-sided exact sign test over the prefixes whose change is resolved
    (``binomtest`` of the +1 against the -1, p 0.5): ``supported`` when "up" rejects at ``alpha``,
    ``not supported`` when "down" does, else ``inconclusive`` (also when no prefix resolved a change,
    or so few did that even all moving up could not reach ``alpha``).

    The manipulation check: ``checks`` (:func:`knob_check_table` rows, ``prefix`` and ``changed``):
    prefixes where the knob changed nothing measurable (``changed`` False) are left out; when that
    leaves none, the claim is ``not tested`` with the reason. ``changed`` None (TD3: the knob acts on
    behaviour, no policy channel measures it) is tested and says so. The reason states the power of
    the sign test at ``planning_up`` (each prefix moving up with that probability) for the number of
    prefixes (:func:`~stabstudy.analysis.studies.rl_design.sign_test_power`)."""
    from scipy.stats import binomtest

    from stabstudy.analysis.studies.rl_design import sign_test_power

    if outcome not in ("critical dose", "collapse"):
        raise ValueError(f"outcome must be one of critical dose, collapse; got {outcome!r}")
    if outcome == "collapse" and dose is None:
        raise ValueError("outcome='collapse' needs the dose it was read at")
    what = "raises its critical lr-spike dose" if outcome == "critical dose" else f"prevents its collapse at x{dose:g}"
    claim = claim or f"more of {learner.upper()}'s own noise ({knob}) {what} (paired per prefix, knob set at the fork)"
    source, test = "our own", "one-sided exact sign test over prefixes"
    rows = changes[changes.learner == learner] if len(changes) else changes
    note = ""
    if checks is not None and len(checks):
        ch = checks[checks.learner == learner] if "learner" in checks else checks
        failed = ch[ch.changed.map(lambda v: v is not None and not bool(v))]
        unmeasured = ch[ch.changed.map(lambda v: v is None)]
        if len(failed):
            rows = rows[~rows.prefix.isin(set(failed.prefix))]
            note = f"; {len(failed)} prefix(es) left out, the knob changed nothing there ({failed.reason.iloc[0]})"
            if not len(rows):
                return not_tested(claim, source, f"manipulation check failed in every prefix: {failed.reason.iloc[0]}",
                                  n=0)
        if len(unmeasured) and not len(failed):
            note = f"; manipulation check not measurable: {unmeasured.reason.iloc[0]}"
    d = rows["direction"].to_numpy(float) if len(rows) else np.array([])
    d = d[np.isfinite(d)]
    if not d.size:
        return not_tested(claim, source, f"no prefix with the outcome at both knob levels{note}", n=0)
    up, down, same = int((d > 0).sum()), int((d < 0).sum()), int((d == 0).sum())
    power = (f"; power {sign_test_power(int(d.size), planning_up, alpha):.2f} if each of {d.size} prefixes moves up "
             f"with probability {planning_up:g}")
    counts = f"{up} prefixes up, {down} down, {same} unresolved or unchanged"
    n = int(d.size)
    if up + down == 0:
        return Claim(claim, source, "inconclusive", f"{counts}: no prefix resolved a change{power}{note}", n=n, test=test)
    if 0.5 ** (up + down) >= alpha:
        return Claim(claim, source, "inconclusive", f"{counts}: with {up + down} resolved the smallest attainable p is "
                     f"{0.5 ** (up + down):.3g}{power}{note}", n=n, test=test)
    p_for = float(binomtest(up, up + down, 0.5, alternative="greater").pvalue)
    p_against = float(binomtest(up, up + down, 0.5, alternative="less").pvalue)
    verdict = "supported" if p_for < alpha else "not supported" if p_against < alpha else "inconclusive"
    p = p_against if verdict == "not supported" else p_for
    effect = float(np.nanmedian(rows.log10_change.to_numpy(float))) if "log10_change" in rows else (up - down) / n
    return Claim(claim, source, verdict, f"{counts}; one-sided p = {p:.3g}{power}{note}", effect, n=n, test=test,
                 p_for=p_for, p_against=p_against)
