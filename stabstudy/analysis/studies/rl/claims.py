"""Notebook 01's claims, each a :class:`stabstudy.analysis.claims.Claim` computed by a rule.

* Claim (a), "PPO collapses at a dose where SAC and TD3 do not": :func:`collapse_at_dose_claims`
  (one-sided Boschloo tests over prefixes, with their power).
* Claim (b), "PPO's critical dose is lower": :func:`critical_dose_claims` (one-sided rank tests over
  prefixes of each prefix's own critical dose, :func:`critical_dose_claim`).
* Claim (c), "more of the learner's own noise buffers the spike": :func:`noise_buffer_claim` (a sign
  test over prefixes of the paired change with the knob).
* The per-run rows of the report under test (each run against its own past): :func:`claims_table`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np
from scipy.stats import binomtest

from stabstudy.analysis import claims as C
from stabstudy.analysis.claims import Claim, all_of, not_tested
from stabstudy.analysis.stats import rank_test_p, smallest_p
from stabstudy.analysis.studies.rl.checks import checked
from stabstudy.analysis.studies.rl.power import boschloo_power, critical_dose_power, sign_test_power
from stabstudy.registry import NOISE_KNOB


def intersection(claim: str, rows: Sequence[Claim], names: Sequence[str], n: int, test: str) -> Claim:
    """The claim that every one of ``rows`` (one per name of ``names``) holds (:func:`~stabstudy.analysis.claims.all_of`)."""
    return all_of(claim, "source paper: the report under test", rows, [a.upper() for a in names], n=n, test=test)


# -- the headline claims over prefixes ------------------------------------------------------


def collapse_at_dose_claims(per_prefix, dose: float, *, on_policy: str = "ppo", off_policy: Sequence[str] = ("sac", "td3"),
                            kind: str = "lr_spike", spiked: Mapping[str, int] | None = None, alpha: float = 0.05,
                            planning: tuple[float, float] = (0.9, 0.1)) -> list[Claim]:
    """Claim (a): "``on_policy`` collapses at ``dose`` where every ``off_policy`` learner does not".

    ``per_prefix``: :func:`.outcomes.by_prefix` rows (one per prefix: ``collapsed_prefix``). One row per
    off-policy learner, a one-sided Boschloo test over prefixes (``rate_comparison``: the
    on-policy learner's rate above its rate, each at ``alpha / len(off_policy)``), then the joint
    row: ``supported`` only when every comparison is, ``not supported`` when any is, else
    ``inconclusive``. ``spiked``: per learner, the updates the perturbation reached (median over
    its forks, :func:`.checks.spiked_updates`); a learner with none is ``not tested`` (the manipulation
    check). Every reason states the power of its test at the ``planning`` rates for its numbers of prefixes
    (:func:`.power.boschloo_power`)."""
    level = alpha / max(1, len(off_policy))
    cols = {"learner", "pert_kind", "pert_dose", "collapsed_prefix"}
    at = per_prefix[(per_prefix.pert_kind == kind) & (per_prefix.pert_dose == dose)] if cols <= set(per_prefix) else None

    def counts(a):
        if at is None:
            return 0, 0
        c = at[at.learner == a]["collapsed_prefix"].to_numpy(float)
        c = c[np.isfinite(c)]
        return int(c.sum()), int(c.size)

    k1, n1 = counts(on_policy)
    rows = []
    for a in off_policy:
        k0, n0 = counts(a)
        text = f"{on_policy.upper()} collapses at x{dose:g} more often than {a.upper()} (over prefixes, against the paired control)"
        power = boschloo_power(*planning, max(n1, 1), max(n0, 1), alpha=level) if n1 and n0 else np.nan
        claim = C.rate_comparison(text, "source paper: the report under test", k1, n1, k0, n0, direction="greater",
                                  alpha=level)
        claim = replace(claim, reason=f"{claim.reason}; power {power:.2f} at planning rates {planning[0]:g} vs "
                                      f"{planning[1]:g} with {n1} and {n0} prefixes, alpha {level:.3g}")
        missing = [x for x in (on_policy, a) if spiked is not None and int(spiked.get(x, 0)) == 0]
        rows.append(checked(claim, not missing, f"the perturbation reached no update of {', '.join(m.upper() for m in missing)}"))
    others = " and ".join(x.upper() for x in off_policy)
    return [*rows, intersection(f"{on_policy.upper()} collapses at x{dose:g} where {others} do not (every comparison must hold)",
                                rows, off_policy, sum(r.n for r in rows), "intersection of one-sided Boschloo tests")]


def critical_dose_claim(claim: str, source: str, lower: Sequence[float], higher: Sequence[float], *,
                        alpha: float = 0.05, min_n: int = 3, lower_high: Sequence[float] | None = None,
                        higher_low: Sequence[float] | None = None, power: str = "", seed: int = 0) -> Claim:
    """Claim: the prefixes of ``lower`` have lower critical doses than those of ``higher`` (one value
    per prefix, :func:`.outcomes.prefix_critical_doses`; ``inf`` = above the grid, ranked above every finite
    value): a one-sided Mann-Whitney U test over prefixes (:func:`stabstudy.analysis.stats.rank_test_p`). ``supported`` when
    "lower" rejects at ``alpha``, ``not supported`` when "greater" does, else ``inconclusive``; no
    prefix in an arm: ``not tested``; fewer than ``min_n`` in one, or so few that even complete
    separation cannot reach ``alpha``: ``inconclusive``, saying so.

    The values are the brackets' midpoints; ``lower_high`` / ``higher_low`` (each arm's bracket end
    least favourable to the claim, same order) add the p-value at those ends to the reason: how much
    the verdict leans on where within its bracket each prefix's dose lies. ``power``: a sentence on
    the test's power, appended to the reason. ``effect``: log10 of the ratio of the medians (NaN when
    one is above the grid)."""
    a, b = np.asarray(lower, dtype=float), np.asarray(higher, dtype=float)
    keep_a, keep_b = ~np.isnan(a), ~np.isnan(b)
    a, b = a[keep_a], b[keep_b]
    test = "Mann-Whitney U over prefixes (one-sided, permutation); effect: log10 ratio of median critical doses"
    n = int(a.size + b.size)
    tail = f"; {power}" if power else ""
    if min(a.size, b.size) == 0:
        return not_tested(claim, source, "no prefix-level critical doses", n=n)
    if min(a.size, b.size) < min_n:
        return Claim(claim, source, "inconclusive", f"{a.size} vs {b.size} prefixes, fewer than {min_n}{tail}", n=n,
                     test=test)
    if smallest_p(a.size, b.size) >= alpha:
        return Claim(claim, source, "inconclusive", f"{a.size} vs {b.size} prefixes: the smallest attainable p is "
                     f"{smallest_p(a.size, b.size):.3g}, not below alpha {alpha:.3g}{tail}", n=n, test=test)
    if np.all(np.concatenate([a, b]) == a[0]):
        return Claim(claim, source, "inconclusive", f"every prefix has the same critical dose{tail}", n=n, test=test)
    p_for = rank_test_p(a, b, "less", seed=seed)
    p_against = rank_test_p(a, b, "greater", seed=seed)
    verdict = "supported" if p_for < alpha else "not supported" if p_against < alpha else "inconclusive"
    med_a, med_b = float(np.median(a)), float(np.median(b))
    worst = ""
    if lower_high is not None and higher_low is not None:
        wa = np.asarray(lower_high, dtype=float)[keep_a]
        wb = np.asarray(higher_low, dtype=float)[keep_b]
        worst = f"; at the brackets' ends least favourable to it p = {rank_test_p(wa, wb, 'less', seed=seed):.3g}"

    def fmt(m, x):
        return f"above the grid ({int(np.isinf(x).sum())} of {x.size})" if np.isinf(m) else f"{m:.3g}"

    reason = (f"median critical dose {fmt(med_a, a)} ({a.size} prefixes) vs {fmt(med_b, b)} ({b.size}); one-sided "
              f"p = {p_for:.3g}" + (f", against: p = {p_against:.3g}" if verdict == "not supported" else "")
              + worst + tail)
    effect = float(np.log10(med_a / med_b)) if np.isfinite(med_a) and np.isfinite(med_b) else np.nan
    return Claim(claim, source, verdict, reason, effect, n=n, test=test, p_for=p_for, p_against=p_against)


#: Each :func:`.outcomes.prefix_critical_doses` value claim (b) can test, with its bracket's columns.
CRITICAL_VALUES = {"dose": ("low", "high"), "lr": ("lr_low", "lr_high"),
                   "change_at_dose": ("change_low", "change_high")}


def critical_dose_claims(crit, *, on_policy: str = "ppo", off_policy: Sequence[str] = ("sac", "td3"),
                         value: str = "dose", spiked: Mapping[str, int] | None = None, alpha: float = 0.05,
                         min_n: int = 3, planning: tuple[float, float, float] = (5.0, 50.0, 0.4),
                         bisections: int = 2, sims: int = 400, seed: int = 0) -> list[Claim]:
    """Claim (b): "``on_policy``'s critical lr-spike dose is lower than each ``off_policy`` learner's",
    over prefixes (``crit``: :func:`.outcomes.prefix_critical_doses`, one row per prefix: forks of one prefix
    are one value).

    ``value``: ``"dose"`` (the factor), ``"lr"`` (the absolute learning rate: needs ``base_lrs``) or
    ``"change_at_dose"`` (the policy change it caused: needs ``changes``); :data:`CRITICAL_VALUES`.
    One :func:`critical_dose_claim` per off-policy learner at ``alpha / len(off_policy)``, then the
    joint row: ``supported`` only when every comparison is, ``not supported`` when any is, else
    ``inconclusive``. ``spiked`` (learner -> median spiked updates, :func:`.checks.spiked_updates`): a learner
    the spike reached no update of is ``not tested``. Every reason states its power
    (:func:`.power.critical_dose_power` at the ``planning`` medians of
    the two arms and spread, in decades, with ``bisections`` midpoints, for its numbers of prefixes;
    for ``value="dose"`` only: the planning is in dose units)."""
    if value not in CRITICAL_VALUES:
        raise ValueError(f"value must be one of {', '.join(CRITICAL_VALUES)}; got {value!r}")
    if value not in crit:
        raise ValueError(f"crit has no column {value!r}: pass base_lrs (lr) or changes (change_at_dose) to "
                         "prefix_critical_doses")
    lo_col, hi_col = CRITICAL_VALUES[value]
    level = alpha / max(1, len(off_policy))
    label = {"dose": "critical lr-spike dose", "lr": "critical learning rate (dose x base lr)",
             "change_at_dose": "policy change at its critical lr-spike dose"}[value]

    def arm(a):
        return crit[crit.learner == a]

    on = arm(on_policy)
    rows = []
    for a in off_policy:
        off = arm(a)
        n1, n2 = int(on[value].notna().sum()), int(off[value].notna().sum())
        if value == "dose":
            pw = critical_dose_power(n1, n2, medians=planning[:2], sd=planning[2], bisections=bisections, alpha=level,
                                     sims=sims, seed=seed)
            power = (f"power {pw:.2f} at planning medians x{planning[0]:g} vs x{planning[1]:g}, spread {planning[2]:g} "
                     f"decades, {bisections} bisections, {n1} and {n2} prefixes, alpha {level:.3g} (simulated, {sims} "
                     "draws)")
        else:
            power = "power not computed: the planning is in dose units (see the dose row)"
        claim = critical_dose_claim(f"{on_policy.upper()}'s {label} is lower than {a.upper()}'s (each prefix's own, "
                                    "bracketed by bisection; over prefixes)", "source paper: the report under test",
                                    on[value], off[value], alpha=level, min_n=min_n, lower_high=on[hi_col],
                                    higher_low=off[lo_col], power=power, seed=seed)
        missing = [x for x in (on_policy, a) if spiked is not None and int(spiked.get(x, 0)) == 0]
        rows.append(checked(claim, not missing, f"the perturbation reached no update of {', '.join(m.upper() for m in missing)}"))
    others = " and ".join(x.upper() for x in off_policy)
    return [*rows, intersection(f"{on_policy.upper()}'s {label} is lower than {others}'s (every comparison must hold)",
                                rows, off_policy, int(crit[crit.learner.isin([on_policy, *off_policy])][value].notna().sum()),
                                "intersection of one-sided Mann-Whitney tests")]


def noise_buffer_claim(changes, learner: str, knob: str, *, checks=None, outcome: str = "critical dose",
                       dose: float | None = None, alpha: float = 0.05, planning_up: float = 0.9,
                       claim: str | None = None) -> Claim:
    """Claim (c): "more of ``learner``'s own noise (``knob``) buffers the lr spike", over prefixes.

    ``changes``: :func:`.outcomes.knob_dose_changes` (``outcome="critical dose"``: the critical dose goes up) or
    :func:`.outcomes.knob_collapse_changes` (``outcome="collapse"`` at ``dose``: it stops collapsing), rows of
    ``learner`` used. A one-sided exact sign test over the prefixes whose change is resolved
    (``binomtest`` of the +1 against the -1, p 0.5): ``supported`` when "up" rejects at ``alpha``,
    ``not supported`` when "down" does, else ``inconclusive`` (also when no prefix resolved a change,
    or so few did that even all moving up could not reach ``alpha``).

    The manipulation check: ``checks`` (:func:`.checks.knob_check_table` rows, ``prefix`` and ``changed``):
    prefixes where the knob changed nothing measurable (``changed`` False) are left out; when that
    leaves none, the claim is ``not tested`` with the reason. ``changed`` None (TD3: the knob acts on
    behaviour, no policy channel measures it) is tested and says so. The reason states the power of
    the sign test at ``planning_up`` (each prefix moving up with that probability) for the number of
    prefixes (:func:`.power.sign_test_power`)."""
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


def _rate(runs) -> tuple[int, int]:
    """(collapses, runs with a verdict) of :func:`.runs.summarize` rows."""
    c = runs["collapsed"].to_numpy(float) if len(runs) else np.array([])
    c = c[np.isfinite(c)]
    return int(c.sum()), int(c.size)


#: Label of each perturbation kind in the claims' wording.
KIND_LABELS = {"lr_spike": "a single learning-rate spike", "action_noise": "action noise",
               "reward_scale": "a reward-scale perturbation", "obs_noise": "observation noise",
               "weight_noise": "weight noise"}


#: The regime of the comparison grid in the claims' wording (the claim as meant).
MEANT = "as meant: after training, forked from the stored checkpoint"


def claims_table(comp, scale: float, *, stated=None, dose=None, noise=None, on_policy: str = "ppo",
                 off_policy: Sequence[str] = ("sac", "td3"), comparable_tol: float = 0.25,
                 decoupling_margin: float = 0.3, alpha: float = 0.05) -> list[Claim]:
    """The claims of the report under test and the study's own, as :class:`stabstudy.analysis.claims.Claim` rows.

    Args:
        comp: :func:`.runs.summarize` table of the comparison grid (all perturbation kinds, ``none``
            included): the claim as meant (:data:`MEANT`), the forks of trained prefixes.
        scale: the return scale shared by the stability scores.
        stated: the claim as stated: ``{reading: summarize table}`` of fresh runs with and without
            the spike at "step 2000" under each reading of "step" (None: not run).
        dose: :func:`.runs.summarize` rows of the lr-spike dose sweep (None: the pooled "lower critical dose" rows are left out).
        noise: :func:`.runs.summarize` rows of the controlled-stochasticity grid, with each
            learner's knob in effect as column ``noise`` (None: not run).
        comparable_tol: equivalence margin of the pre-perturbation returns, as a
            fraction of ``scale``; also the non-inferiority margin of "not worse".
        decoupling_margin: equivalence margin of Spearman's rho for "decoupled".

    Rules (:mod:`stabstudy.analysis.claims`; runs already broken before the event,
    ``pre_event_invalid``, are in no claim); the lr-spike rows once per regime:

    * "X collapses irreversibly after K": :func:`~stabstudy.analysis.claims.rate_comparison`
      of X's collapse rate under K against X's unperturbed rate at the same budget;
    * "Y keeps learning after K": :func:`~stabstudy.analysis.claims.paired_difference`
      of each run's final return over its own pre-perturbation return (greater);
    * "comparable returns before the spike": :func:`~stabstudy.analysis.claims.equivalence`
      (Welch TOST) of the pre-spike returns, margin ``comparable_tol * scale``;
    * "X's final return is not worse than Y's" (unperturbed, as meant): non-inferiority,
      :func:`~stabstudy.analysis.claims.difference` of X's final returns plus the margin
      against Y's (greater; the effect includes the margin);
    * decoupling: :func:`~stabstudy.analysis.claims.correlation` of final return and
      stability over perturbed runs, ``expect="none"`` with ``decoupling_margin``;
    * stochasticity buffers: per learner, rho(noise knob, stability) positive;
    * lower critical dose: the on-policy collapse rate over the whole dose sweep
      against each off-policy one over the same doses and seeds.
    """
    paper, own = "source paper: the report under test", "our own"
    rows = []

    def valid(t):  # a run broken before its event says nothing about the event, in any claim
        return t[~t["pre_event_invalid"].fillna(False).astype(bool)] if t is not None and len(t) and \
            "pre_event_invalid" in t else t

    def of(t, **eq):
        return t[np.logical_and.reduce([t[k] == v for k, v in eq.items()])] if t is not None and len(t) else t

    def col(t, c):
        return t[c].to_numpy(float) if t is not None and len(t) and c in t else []

    comp, dose, noise = valid(comp), valid(dose), valid(noise)
    regimes = [(f"as stated: spike at {r}", valid(t), ["lr_spike"]) for r, t in (stated or {}).items()]
    kinds = [k for k in KIND_LABELS if len(comp) and k in set(comp.pert_kind)]
    regimes.append((MEANT, comp, kinds or ["lr_spike"]))
    for regime, table, ks in regimes:
        for kind in ks:
            label = KIND_LABELS[kind]
            on = of(table, pert_kind=kind, learner=on_policy)
            rows.append(C.rate_comparison(
                f"{on_policy.upper()} collapses irreversibly after {label} (collapse rate above its unperturbed "
                f"rate; {regime})", paper, *_rate(on if on is not None else comp.iloc[:0]),
                *_rate(of(table, pert_kind="none", learner=on_policy) if table is not None else comp.iloc[:0]),
                direction="greater", alpha=alpha))
            for a in off_policy:
                r = of(table, pert_kind=kind, learner=a)
                rows.append(C.paired_difference(
                    f"{a.upper()} keeps learning after {label} (final return above its pre-perturbation return; "
                    f"{regime})", paper, col(r, "final_return"), col(r, "pre_return"), direction="greater", alpha=alpha))
                if kind == "lr_spike":
                    rows.append(C.equivalence(
                        f"returns before the spike are comparable: {on_policy.upper()} vs {a.upper()} "
                        f"(within {comparable_tol:g} of the return scale; {regime})", paper, col(on, "pre_return"),
                        col(r, "pre_return"), margin=comparable_tol * scale, relative=False, paired=False, alpha=alpha))
    for a in off_policy:
        margin = comparable_tol * scale
        rows.append(C.difference(
            f"{on_policy.upper()}'s final return is not worse than {a.upper()}'s (unperturbed, non-inferiority margin "
            f"{comparable_tol:g} of the return scale; {MEANT})", paper,
            np.asarray(col(of(comp, pert_kind="none", learner=on_policy), "final_return")) + margin,
            col(of(comp, pert_kind="none", learner=a), "final_return"), direction="greater", alpha=alpha))
    pert = comp[(comp.pert_kind != "none")] if len(comp) else comp
    rows.append(C.correlation("high final return is decoupled from stability (perturbed runs)", own,
                              col(pert, "final_return"), col(pert, "stability"),
                              expect="none", margin=decoupling_margin, alpha=alpha))
    for a in [on_policy, *off_policy]:
        g = of(noise, learner=a)
        rows.append(C.correlation(f"more of {a.upper()}'s own noise ({NOISE_KNOB.get(a, '')}) buffers the spike "
                                  "(higher stability)", own, col(g, "noise"), col(g, "stability") if len(col(g, "noise"))
                                  else [], expect="positive", alpha=alpha))
    for a in off_policy if dose is not None else ():  # pooled over doses and forks: prefer the prefix-level claim (b)
        empty = comp.iloc[:0]
        rows.append(C.rate_comparison(
            f"{on_policy.upper()} has a lower critical lr-spike dose than {a.upper()} "
            "(collapses more often over the same doses and seeds)", own,
            *_rate(of(dose, learner=on_policy) if dose is not None and len(dose) else empty),
            *_rate(of(dose, learner=a) if dose is not None and len(dose) else empty), direction="greater", alpha=alpha))
    return rows
