"""Notebook 01's claims, each a :class:`stabstudy.analysis.claims.Claim` decided by a rule fixed in :func:`plan`
before the runs.

The headline is one family (:data:`HEADLINE`: Holm within it, :func:`stabstudy.analysis.claims.table`, which
prints the power of each rule at the family's level):

* (a) "PPO collapses at x10 where SAC and TD3 do not": :func:`collapse_at_dose_claims`, per comparison the exact
  score tests of the collapse-rate difference over prefixes (:func:`stabstudy.analysis.claims.rate_comparison`):
  supported when it is shown above 0, not supported when every difference of :data:`SESOI_RATE` or more is
  excluded;
* (b) "PPO's critical dose is lower": :func:`critical_dose_claims`, each prefix's bracket of its critical dose as a
  factor of its arm's own learning rate, decided by :func:`.rules.dose_verdict` at the brackets' ends least
  favourable to each verdict, smallest effect of interest a factor of :data:`SESOI_DOSE`.

Each "where SAC and TD3 do not" is decided from its comparisons as Holm adjusted them in the family
(:func:`joint`). Outside the family: the same brackets as an absolute learning rate and as the policy change
(exploratory), the claim as stated (a family of its own, units: seeds), the precondition that the prefixes were
matched (:func:`matched_claims`), decoupling over prefixes (:func:`decoupling_claim`), the env-side kinds and
claim (c) (:func:`noise_buffer_claim`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np
import pandas as pd
from scipy.stats import binomtest

from stabstudy.analysis import claims as C
from stabstudy.analysis.claims import Claim, not_tested
from stabstudy.analysis.plan import Planned
from stabstudy.analysis.studies.rl.checks import checked
from stabstudy.analysis.studies.rl.power import critical_dose_power, sign_test_power
from stabstudy.analysis.studies.rl.rules import dose_verdict

PAPER = "source paper: the report under test"
#: Claim (a)'s smallest effect of interest: the collapse-rate difference (PPO minus the other arm) that matters.
SESOI_RATE = 0.5
#: Claim (b)'s smallest effect of interest: the factor by which PPO's critical dose must be lower.
SESOI_DOSE = 2.0


def families(task: str = "HalfCheetah-v5") -> dict[str, str]:
    """The notebook's families, by the question each answers (one domain: ``task``)."""
    return {"headline": f"PPO collapses where SAC and TD3 do not ({task}, forks of trained prefixes)",
            "stated": f"the claim as stated ({task}, fresh runs)",
            "matched": f"precondition: prefixes matched by return ({task})",
            "decoupling": f"final return decoupled from stability ({task}, prefixes)",
            "env": f"the same pattern under env-side perturbations ({task}, prefixes)",
            "noise": f"the learner's own noise buffers the spike ({task}, prefixes)"}


def plan(*, task: str = "HalfCheetah-v5", target_return: float = 1300.0, comparable_frac: float = 0.1,
         decoupling_margin: float = 0.3) -> dict[str, Planned]:
    """Notebook 01's analysis plan, from its parameters: each confirmatory claim's family and smallest effect."""
    f = families(task)
    rate = ("collapse-rate difference", "the claim: PPO collapses where the others do not; a difference of less "
            "than half the prefixes is not that")
    return {
        "(a) collapse at the claim's dose": Planned(f["headline"], SESOI_RATE, *rate),
        "(b) critical dose": Planned(f["headline"], float(np.log10(SESOI_DOSE)), "log10 critical dose (factor of "
                                     "the arm's own lr)", "a factor of 2: within it, 'lower' would rest on about one "
                                     "step of the dose sequence"),
        "the claim as stated": Planned(f["stated"], SESOI_RATE, *rate),
        "comparable returns": Planned(f["matched"], comparable_frac * abs(target_return), "return",
                                      "the design's margin: a tenth of the target return"),
        "decoupling": Planned(f["decoupling"], decoupling_margin, "Spearman rho", "the project's margin for a "
                              "correlation"),
        "env-side kinds": Planned(f["env"], SESOI_RATE, *rate),
        "claim (c)": Planned(f["noise"], 0.5, "share of resolved prefixes moving up minus one half",
                             "the sign test's: every resolved prefix moving up"),
    }


def adjusted(rows: Sequence[Claim], alpha: float = 0.05) -> list[Claim]:
    """``rows`` (one family's confirmatory rows) with their p-values as Holm adjusts them within the family
    and each verdict decided from those: what :func:`stabstudy.analysis.claims.table` shows for them."""
    out = [*rows]
    for name in ("p_for", "p_against"):
        p = np.array([getattr(r, name) for r in rows], dtype=float)
        ok = np.isfinite(p)
        if ok.any():
            p[ok] = C.holm(p[ok])
        out = [replace(r, **{name: float(v)}) for r, v in zip(out, p, strict=True)]
    return [replace(r, verdict=C.decide(r.p_for, r.p_against, alpha)) if r.verdict != "not tested" and
            (np.isfinite(r.p_for) or np.isfinite(r.p_against)) else r for r in out]


def joint(claim: str, rows: Sequence[Claim], names: Sequence[str], *, test: str, family: str) -> Claim:
    """The claim that every one of ``rows`` holds (one per name of ``names``; their p-values as Holm adjusted
    them in their family, :func:`adjusted`): supported when every one is (the largest ``p_for``), not
    supported when any is not (the smallest ``p_against``), not tested when all are, else inconclusive. It
    is a family of its own (``family``): the adjustment is done."""
    verdicts = [r.verdict for r in rows]
    reason = "; ".join(f"{a.upper()}: {v}" for a, v in zip(names, verdicts, strict=True)) + " (after Holm in the family)"
    n = sum(r.n for r in rows)
    if not rows or all(v == "not tested" for v in verdicts):
        return not_tested(claim, PAPER, reason, n=n, family=family)
    tested = [r for r in rows if r.verdict != "not tested"]
    p_for = max(r.p_for for r in rows) if len(tested) == len(rows) else np.nan
    p_against = min((r.p_against for r in tested if np.isfinite(r.p_against)), default=np.nan)
    verdict = "not supported" if "not supported" in verdicts else "supported" if all(
        v == "supported" for v in verdicts) else "inconclusive"
    return Claim(claim, PAPER, verdict, reason, n=n, test=test, p_for=float(p_for), p_against=float(p_against),
                 family=family)


def _counts(per_prefix: pd.DataFrame, arm: str) -> tuple[int, int]:
    c = per_prefix[per_prefix.learner == arm]["collapsed_prefix"].to_numpy(float) if len(per_prefix) else np.array([])
    c = c[np.isfinite(c)]
    return int(c.sum()), int(c.size)


def collapse_at_dose_claims(per_prefix: pd.DataFrame, dose: float, *, on_policy: str = "ppo",
                            off_policy: Sequence[str] = ("sac", "td3"), kind: str = "lr_spike",
                            spiked: Mapping[str, int] | None = None, planning: tuple[float, float] = (0.9, 0.1),
                            unmatched: Mapping[str, int] | None = None, unit: str = "prefixes", what: str = "",
                            family: str = "") -> list[Claim]:
    """Claim (a)'s comparisons: "``on_policy`` collapses at ``dose`` more often than each ``off_policy`` arm".

    ``per_prefix``: :func:`.outcomes.by_prefix` rows (one per prefix: ``collapsed_prefix``). One row per
    off-policy arm: :func:`stabstudy.analysis.claims.rate_comparison` over prefixes, smallest effect of
    interest :data:`SESOI_RATE` (supported when the on-policy rate is shown above the other's, not supported
    when every difference of :data:`SESOI_RATE` or more is excluded), its power at ``planning`` rates.
    ``spiked``: per arm, the updates the perturbation reached (an arm with none is ``not tested``: the
    manipulation check); ``unmatched``: per arm, prefixes that did not reach the return target (said in the
    reason). The joint row ("where every one does not") is :func:`joint` of these, once adjusted."""
    at = per_prefix[(per_prefix.pert_kind == kind) & (per_prefix.pert_dose == dose)] if len(per_prefix) else per_prefix
    k1, n1 = _counts(at, on_policy)
    rows = []
    for a in off_policy:
        k0, n0 = _counts(at, a)
        text = (f"{on_policy.upper()} collapses at x{dose:g} {what}more often than {a.upper()} (over {unit}, against the "
                "paired control)")
        claim = C.rate_comparison(text, PAPER, k1, n1, k0, n0, direction="greater", sesoi=SESOI_RATE,
                                  planning=tuple(planning), family=family)
        notes = "".join(f"; {x.upper()}: {unmatched[x]} {unit} unmatched" for x in (on_policy, a) if (unmatched or {}).get(x))
        claim = replace(claim, reason=claim.reason + notes)
        missing = [x for x in (on_policy, a) if spiked is not None and int(spiked.get(x, 0)) == 0]
        rows.append(checked(claim, not missing, f"the perturbation reached no update of {', '.join(m.upper() for m in missing)}"))
    return rows


#: Each :func:`.outcomes.prefix_critical_doses` value claim (b) can be read in, with its bracket's columns.
CRITICAL_VALUES = {"dose": ("low", "high"), "lr": ("lr_low", "lr_high"),
                   "change_at_dose": ("change_low", "change_high")}


def _dose_power(n1: int, n2: int, planning: tuple[float, float, float], start: float, steps: Sequence[float],
                sims: int, seed: int):
    """Claim (b)'s :data:`stabstudy.analysis.power.PowerFn`: P(supported) at the ``planning`` medians and spread,
    P(not supported) at equal medians (:func:`.power.critical_dose_power`)."""
    def power(alpha: float, scale: float) -> tuple[float, float]:
        a, b = max(1, round(n1 * scale)), max(1, round(n2 * scale))
        kw = dict(sd=planning[2], start=start, steps=steps, sesoi=SESOI_DOSE, alpha=alpha, sims=sims, seed=seed)
        return (critical_dose_power(a, b, medians=planning[:2], **kw)["supported"],
                critical_dose_power(a, b, medians=(planning[0], planning[0]), **kw)["not supported"])
    return power


def critical_dose_claims(crit: pd.DataFrame, *, on_policy: str = "ppo", off_policy: Sequence[str] = ("sac", "td3"),
                         value: str = "dose", spiked: Mapping[str, int] | None = None, min_n: int = 3,
                         planning: tuple[float, float, float] = (5.0, 50.0, 0.4), start: float = 10.0,
                         steps: Sequence[float] = (0.5, 0.25), sims: int = 400, seed: int = 0,
                         family: str = "") -> list[Claim]:
    """Claim (b)'s comparisons: "``on_policy``'s critical lr-spike dose is lower than each ``off_policy`` arm's",
    over prefixes (``crit``: :func:`.outcomes.prefix_critical_doses`, one bracket per prefix).

    ``value``: ``"dose"`` (a factor of the arm's own learning rate: what a learning-rate spike means; the
    confirmatory row), ``"lr"`` (the absolute learning rate) or ``"change_at_dose"`` (the policy change it
    caused), both exploratory; :data:`CRITICAL_VALUES`. Each row by :func:`.rules.dose_verdict` on the
    brackets' ends, smallest effect of interest a factor of :data:`SESOI_DOSE`; ``effect``: log10 of the
    ratio of the medians of the bracket midpoints (the other arm's over PPO's: positive when PPO's is lower).
    ``spiked``: the manipulation check. The power (``"dose"`` only: the planning is in dose units): the
    design's own sequence of doses simulated (``start``, ``steps``) at the ``planning`` medians and spread."""
    if value not in CRITICAL_VALUES:
        raise ValueError(f"value must be one of {', '.join(CRITICAL_VALUES)}; got {value!r}")
    lo_col, hi_col = CRITICAL_VALUES[value]
    if lo_col not in crit:
        raise ValueError(f"crit has no column {lo_col!r}: pass base_lrs (lr) or changes (change_at_dose) to "
                         "prefix_critical_doses")
    label = {"dose": "critical lr-spike dose (a factor of its own lr)", "lr": "critical learning rate (dose x base lr)",
             "change_at_dose": "policy change at its critical lr-spike dose"}[value]
    test = "Mann-Whitney U over prefixes at the brackets' least favourable ends (one-sided, permutation)"
    sesoi = float(np.log10(SESOI_DOSE))
    on = crit[(crit.learner == on_policy) & crit[lo_col].notna() & crit[hi_col].notna()]
    rows = []
    for a in off_policy:
        off = crit[(crit.learner == a) & crit[lo_col].notna() & crit[hi_col].notna()]
        text = f"{on_policy.upper()}'s {label} is lower than {a.upper()}'s (each prefix's own, over prefixes)"
        n1, n2 = len(on), len(off)
        if min(n1, n2) == 0:
            claim = not_tested(text, PAPER, "no prefix-level critical doses", n=n1 + n2, family=family, sesoi=sesoi)
        elif min(n1, n2) < min_n:
            claim = Claim(text, PAPER, "inconclusive", f"{n1} vs {n2} prefixes, fewer than {min_n}", n=n1 + n2, test=test,
                          family=family, sesoi=sesoi)
        else:
            _, p_for, p_against = dose_verdict(on[lo_col], on[hi_col], off[lo_col], off[hi_col], sesoi=SESOI_DOSE,
                                               seed=seed)
            med = [float(np.median(np.sqrt(x[lo_col].to_numpy(float) * x[hi_col].to_numpy(float)))) for x in (on, off)]
            effect = float(np.log10(med[1] / med[0])) if np.isfinite(med).all() and med[0] > 0 else np.nan
            power = _dose_power(n1, n2, planning, start, steps, sims, seed) if value == "dose" else None
            claim = C.from_p(text, PAPER, effect, (np.nan, np.nan), n1 + n2, p_for=p_for, p_against=p_against, test=test,
                             sesoi=sesoi, power=power, family=family)
            claim = replace(claim, reason=(
                f"median bracket midpoint {med[0]:.3g} ({n1} prefixes) vs {med[1]:.3g} ({n2}); lower at the least "
                f"favourable ends p = {p_for:.3g}; within x{SESOI_DOSE:g} or opposite p = {p_against:.3g}"),
                meaning=("the ranks say lower, at the ends least favourable to it",
                         f"the ranks say within x{SESOI_DOSE:g} or higher, at the ends least favourable to that"))
        missing = [x for x in (on_policy, a) if spiked is not None and int(spiked.get(x, 0)) == 0]
        claim = checked(claim, not missing, f"the perturbation reached no update of {', '.join(m.upper() for m in missing)}")
        rows.append(claim if value == "dose" else C.exploratory(claim))
    return rows


def matched_claims(matches: pd.DataFrame, target: float, *, on_policy: str = "ppo",
                   off_policy: Sequence[str] = ("sac", "td3"), margin_frac: float = 0.1, family: str = "") -> list[Claim]:
    """The precondition "returns before the spike are comparable": per off-policy arm, TOST (Welch) of the
    prefixes' returns where they stopped (``matches``: ``arm``, ``matched`` and ``match_return``, the mean
    of the two evaluations that met the target) against the on-policy arm's, margin ``margin_frac`` of the
    target; an unmatched prefix (it never reached the target) is left out and counted in the reason."""
    rows = []

    def of(arm):
        m = matches[matches.arm == arm]
        return m[m.matched.astype(bool)].match_return.to_numpy(float), int((~m.matched.astype(bool)).sum())

    on, miss_on = of(on_policy)
    for a in off_policy:
        off, miss = of(a)
        c = C.equivalence(f"returns before the spike are comparable: {on_policy.upper()} vs {a.upper()} (prefixes "
                          f"matched by return, within {margin_frac:g} of the target {target:g})", PAPER, on, off,
                          margin=margin_frac * abs(target), relative=False, paired=False, family=family)
        rows.append(replace(c, reason=f"{c.reason}; unmatched prefixes: {on_policy.upper()} {miss_on}, {a.upper()} {miss}"))
    return rows


def decoupling_claim(per_prefix: pd.DataFrame, *, margin: float = 0.3, family: str = "") -> Claim:
    """"High final return is decoupled from training stability", one unit per prefix: Spearman's rho of
    the final return of the prefix's control and its critical dose (log10; above every dose tried ranks
    highest), ``expect="none"`` within ``margin`` (``per_prefix``: ``final_return`` and ``dose``)."""
    d = per_prefix.dropna(subset=["final_return", "dose"])
    dose = d.dose.to_numpy(float)
    dose = np.where(np.isinf(dose), 10 * np.nanmax(np.where(np.isinf(dose), np.nan, dose), initial=1.0), dose)  # ranks last
    return C.correlation("high final return is decoupled from stability (control's final return vs critical lr-spike "
                         "dose, one unit per prefix)", "our own", d.final_return.to_numpy(float), np.log10(dose),
                         expect="none", margin=margin, family=family)


def noise_buffer_claim(changes, learner: str, knob: str, *, dose: float, checks=None, alpha: float = 0.05,
                       planning_up: float = 0.9, claim: str | None = None, family: str = "") -> Claim:
    """Claim (c): "more of ``learner``'s own noise (``knob``) buffers the lr spike", over prefixes.

    ``changes``: :func:`.outcomes.knob_collapse_changes` at ``dose`` (+1: the raised knob stopped a
    collapse), rows of ``learner`` used. A one-sided exact sign test over the prefixes whose change is resolved
    (``binomtest`` of the +1 against the -1, p 0.5): ``supported`` when "up" rejects at ``alpha``,
    ``not supported`` when "down" does, else ``inconclusive`` (also when no prefix resolved a change,
    or so few did that even all moving up could not reach ``alpha``).

    The manipulation check: ``checks`` (:func:`.checks.knob_check_table` rows, ``prefix`` and ``changed``):
    prefixes where the knob changed nothing measurable (``changed`` False) are left out; when that
    leaves none, the claim is ``not tested`` with the reason. ``changed`` None (TD3: the knob acts on
    behaviour, no policy channel measures it) is tested and says so. The reason states the power of
    the sign test at ``planning_up`` (each prefix moving up with that probability) for the number of
    prefixes (:func:`.power.sign_test_power`)."""
    claim = claim or (f"more of {learner.upper()}'s own noise ({knob}) prevents its collapse at x{dose:g} (paired per "
                      "prefix, knob set at the fork)")
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
                                  n=0, family=family)
        if len(unmeasured) and not len(failed):
            note = f"; manipulation check not measurable: {unmeasured.reason.iloc[0]}"
    d = rows["direction"].to_numpy(float) if len(rows) else np.array([])
    d = d[np.isfinite(d)]
    if not d.size:
        return not_tested(claim, source, f"no prefix with the outcome at both knob levels{note}", n=0, family=family)
    up, down, same = int((d > 0).sum()), int((d < 0).sum()), int((d == 0).sum())
    power = (f"; power {sign_test_power(int(d.size), planning_up, alpha):.2f} if each of {d.size} prefixes moves up "
             f"with probability {planning_up:g}")
    counts = f"{up} prefixes up, {down} down, {same} unresolved or unchanged"
    n = int(d.size)
    if up + down == 0:
        return Claim(claim, source, "inconclusive", f"{counts}: no prefix resolved a change{power}{note}", n=n, test=test,
                     family=family)
    if 0.5 ** (up + down) >= alpha:
        return Claim(claim, source, "inconclusive", f"{counts}: with {up + down} resolved the smallest attainable p is "
                     f"{0.5 ** (up + down):.3g}{power}{note}", n=n, test=test, family=family)
    p_for = float(binomtest(up, up + down, 0.5, alternative="greater").pvalue)
    p_against = float(binomtest(up, up + down, 0.5, alternative="less").pvalue)
    verdict = "supported" if p_for < alpha else "not supported" if p_against < alpha else "inconclusive"
    p = p_against if verdict == "not supported" else p_for
    effect = (up - down) / n
    return Claim(claim, source, verdict, f"{counts}; one-sided p = {p:.3g}{power}{note}", effect, n=n, test=test,
                 p_for=p_for, p_against=p_against, family=family)
