"""Notebook 05's paired table and claims (closed-loop monitor): the units they count (a seed, or an RL prefix), the
analysis plan fixed before the runs (:class:`Plan`), the controller under test chosen on the
calibration seeds, and the confirmatory rows, one set per domain (never nats pooled with return
fractions), each question in each domain its own family. The grids and outcomes are
:mod:`.closed_loop`'s.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd
from scipy import stats as sps

from stabstudy.analysis import claims as C
from stabstudy.analysis import power as PW
from stabstudy.analysis import stats
from stabstudy.analysis.plan import Planned
from stabstudy.analysis.studies.closed_loop import OURS, SOURCE
from stabstudy.hparams import field_docs


# -- the paired table ------------------------------------------------------------------------
def paired_table(out: pd.DataFrame, evaluation_seeds: Sequence[int], alpha: float = 0.05,
                 margin: float = 0.01) -> pd.DataFrame:
    """Per domain, event and controller: collapses without / with (paired by seed; in an RL domain
    one fork per prefix and event, so the pairs are prefixes: ``unit``) and the exact
    McNemar p, mean paired damage difference (controlled minus uncontrolled) and its p, median
    recovery with / without, median steps from onset to the first action, false interventions per
    1,000 steps (unperturbed runs of the evaluation seeds) with a Clopper-Pearson interval, and the
    TOST verdict of their final loss against the uncontrolled run (relative ``margin``).
    ``less_damage`` is the verdict of the damage test (one-sided: less with the controller) and
    ``damage_p`` the p-value that verdict rests on (for "not supported", the opposite direction's)."""
    rows = []
    for (domain, ctrl), g in out[out.controller != "none"].groupby(["domain", "controller"], sort=False):
        base = out[(out.domain == domain) & (out.controller == "none")]
        null = g[(g.event == "none") & g.seed.isin(evaluation_seeds)]
        k, n = int(null.interventions.sum()), int(null.n_steps.sum())
        lo, hi = C.rate_ci(k, n)
        ref_null = base[base.event == "none"].set_index("seed").reindex(null.seed)
        tost = _tost("", null.final.to_numpy(), ref_null.final.to_numpy(), margin, alpha)
        for event, ge in g[g.event != "none"].groupby("event", sort=False):
            b = base[base.event == event].set_index("seed").reindex(ge.seed)
            mc = C.paired_outcomes("", "our own", ge.collapse.to_numpy(float), b.collapse.to_numpy(float),
                                   direction="less", alpha=alpha)
            dm = C.paired_difference("", "our own", ge.damage.to_numpy(), b.damage.to_numpy(), direction="less",
                                     alpha=alpha)
            rows.append({"domain": domain, "event": event, "controller": ctrl, "pairs": len(ge),
                         "unit": "prefix" if _has_prefix(ge) else "seed",
                         "collapse_without": int(b.collapse.sum()), "collapse_with": int(ge.collapse.sum()),
                         "mcnemar_p": mc.p, "damage_without": float(b.damage.mean()),
                         "damage_with": float(ge.damage.mean()), "damage_diff": dm.effect, "damage_p": dm.p,
                         "less_damage": dm.verdict,
                         "recovery_without": float(b.recovery.median()), "recovery_with": float(ge.recovery.median()),
                         "first_action": float(ge.first_action.median()),
                         "false_per_1k": 1000 * k / n if n else math.nan, "false_ci_low": 1000 * lo,
                         "false_ci_high": 1000 * hi, "tost": tost.verdict, "tost_diff": tost.effect})
    return pd.DataFrame(rows)


def action_timing(paired: pd.DataFrame, event_steps: dict[str, int] | None = None) -> pd.DataFrame:
    """When our controllers first acted against the event's length, per domain of a
    :func:`paired_table`: the median steps from the onset to the first action, the event's length in
    steps (``event_steps[domain]`` where given, e.g. an RL spike's updates; else the duration in its
    label), and how many (controller, event) rows acted first only after the event ended, i.e. after
    its damage was done (only a rollback to a snapshot from before the event can undo that)."""
    ours = paired[paired.controller.isin(OURS)]
    steps = [(event_steps or {}).get(r.domain, int(r.event.split("/")[1])) for r in ours.itertuples()]
    ours = ours.assign(event_steps=steps, late=lambda x: x.first_action >= x.event_steps)
    return ours.groupby("domain", sort=False).agg(first_action=("first_action", "median"),
                                                  event_steps=("event_steps", "first"), late=("late", "sum"),
                                                  rows=("first_action", "count"))


# -- claims -----------------------------------------------------------------------------------
def _has_prefix(rows: pd.DataFrame) -> bool:
    return "prefix" in rows and bool(len(rows)) and bool((rows["prefix"].fillna("") != "").all())


def _any(x: pd.Series) -> float:
    """1 when any fork collapsed, 0 when every fork has a verdict and none did, else NaN (no verdict)."""
    v = x.to_numpy(float)
    return 1.0 if (v == 1).any() else 0.0 if np.isfinite(v).all() else math.nan


def unit_pairs(treated: pd.DataFrame, control: pd.DataFrame) -> pd.DataFrame:
    """The units the claims count, from perturbed runs with a controller (``treated``) and their
    twins (``control``: uncontrolled, or a comparator), paired on domain, event and seed. The unit is
    what the runs do not share: in a GPT or toy domain the seed (its runs at every event are the same
    run up to the event step: same initialisation, same batches), in an RL domain the independently
    trained prefix (column ``prefix``). A unit's runs (one per event) are summarised into one row,
    ``collapse_*`` 1 when any of them collapsed (NaN when none did and one has no verdict),
    ``damage_*`` the mean over the runs where both twins have one. Columns: domain,
    unit, forks, collapse_with / _without, damage_with / _without, damage_diff (of the unit) and
    ``fork_diffs`` (the forks' paired damage differences, for :func:`stabstudy.analysis.stats.design_effect`)."""
    key = ["domain", "event", "seed"]
    t = treated.set_index(key)
    c = control.set_index(key).reindex(t.index)
    pairs = pd.DataFrame({"collapse_with": t.collapse.to_numpy(float), "collapse_without": c.collapse.to_numpy(float),
                          "damage_with": t.damage.to_numpy(float), "damage_without": c.damage.to_numpy(float)},
                         index=t.index).reset_index()
    rl = t["prefix"].fillna("").ne("").to_numpy() if "prefix" in t else np.zeros(len(t), bool)
    pairs["unit"] = np.where(rl, t["prefix"].to_numpy() if "prefix" in t else "",
                             pairs.domain + " seed " + pairs.seed.astype(str))
    both = pairs.damage_with.notna() & pairs.damage_without.notna()
    pairs["fork_diff"] = (pairs.damage_with - pairs.damage_without).where(both)
    pairs.loc[~both, ["damage_with", "damage_without"]] = np.nan
    g = pairs.groupby(["domain", "unit"], sort=False)
    return pd.DataFrame({"forks": g.size(), "collapse_with": g.collapse_with.agg(_any),
                         "collapse_without": g.collapse_without.agg(_any), "damage_with": g.damage_with.mean(),
                         "damage_without": g.damage_without.mean(), "damage_diff": g.fork_diff.mean(),
                         "fork_diffs": g.fork_diff.agg(list)}).reset_index()


def _with_units(claim: C.Claim, units: pd.DataFrame) -> C.Claim:
    """The claim's reason with its units where some unit summarises several runs (a seed's runs at
    every event, an RL prefix's forks): how many, and their design effect
    (:func:`stabstudy.analysis.stats.design_effect` of the runs' paired damage differences within units: how
    many of them are worth one independent unit)."""
    forks = int(units.forks.sum())
    if forks == len(units):  # every unit is one run: nothing summarised
        return claim
    diffs = [(d, u) for u, ds in zip(units.unit, units.fork_diffs, strict=True) for d in ds if np.isfinite(d)]
    icc, deff = stats.design_effect([d for d, _ in diffs], [u for _, u in diffs])
    return replace(claim, reason=f"{claim.reason}; n = {claim.n} units of {forks} runs (a unit is a seed, or an RL "
                                    f"prefix: its runs at every event summarised); design effect {deff:.2f} (ICC {icc:.2f})")


#: How each domain is named in a family (one question in one domain).
DOMAIN_NAMES = {"lm": "GPT", "toy": "toy MLP", "ppo": "PPO"}


@dataclass(frozen=True)
class Plan:
    """Notebook 05's analysis plan, fixed before the runs: the outcome thresholds, each confirmatory
    claim's smallest effect of interest (in its own units) and its family (one question in one
    domain: Holm adjusts within a family only). Each field's doc says what it is and where its
    number comes from. The PPO domain's smallest effects are its own issue's (notebook 01's rules):
    none is declared here, so its rows say so."""

    collapse_excess: Mapping[str, float] = field(default_factory=lambda: {"lm": 0.3, "toy": 0.1})
    """per domain: a final loss this many nats above the reference run's is a collapse, and a damage difference this large is the smallest of interest ('reduces damage', 'beats'): the project's collapse thresholds, this notebook's since its first design (the GPT's is notebook 04's smallest loss band, label_min_excess; the toy's losses are smaller)"""
    prevents: float = 0.5
    """'prevents collapse': smallest drop of the paired collapse rate over units, the claim's own words (a controller that prevents collapse spares at least half the units that would collapse)"""
    budget: float = 2.0
    """'selective': false interventions per 1,000 unperturbed steps a run may make (mean over runs), the calibration's false-alarm budget, at which every calibrated detector is set"""
    margin: float = 0.01
    """'non-intrusive': TOST margin of the unperturbed final loss, relative to the run without the controller: the project's 1% of the final loss (about the seed-to-seed spread)"""
    alpha: float = 0.05
    """family-wise error of each of a rule's two one-sided tests (Holm within the family)"""

    protect_family: str = "does the controller protect? ({domain})"
    """prevents collapse, reduces damage: paired units near the critical dose, per domain"""
    cost_family: str = "what does it cost when nothing is wrong? ({domain})"
    """selective, non-intrusive: the unperturbed runs of the evaluation seeds, per domain"""
    beats_family: str = "does it beat the other rules? ({domain})"
    """less damage than each comparator on the same perturbed runs, per domain"""

    def families(self, domain: str) -> dict[str, str]:
        """The questions of one domain: ``protect``, ``cost`` and ``beats``."""
        name = DOMAIN_NAMES.get(domain, domain)
        return {k: getattr(self, f"{k}_family").format(domain=name) for k in ("protect", "cost", "beats")}

    def planned(self, domains: Sequence[str]) -> dict[str, Planned]:
        """Each confirmatory question's family and smallest effect of interest per domain (those with a
        collapse threshold: the PPO domain's are its own issue's), with where it comes from (the field
        docs), for :func:`stabstudy.analysis.plan.frame`."""
        why = field_docs(type(self))
        out = {}
        for d in domains:
            if d not in self.collapse_excess:
                continue
            fam, dmg, name = self.families(d), float(self.collapse_excess[d]), DOMAIN_NAMES.get(d, d)
            out |= {f"{name}: prevents collapse": Planned(fam["protect"], self.prevents, "paired rate difference",
                                                         why["prevents"]),
                    f"{name}: reduces damage": Planned(fam["protect"], dmg, "nats", why["collapse_excess"]),
                    f"{name}: selective": Planned(fam["cost"], self.budget, "false interventions per 1,000 steps "
                                                  "(the budget itself)", why["budget"]),
                    f"{name}: non-intrusive": Planned(fam["cost"], self.margin, "relative final loss (TOST margin)",
                                                      why["margin"]),
                    f"{name}: beats each comparator": Planned(fam["beats"], dmg, "nats", why["collapse_excess"])}
        return out


def claims(out: pd.DataFrame, *, primary: str, evaluation_seeds: Sequence[int], plan: Plan,
           comparators: Sequence[str] = ("clip1", "zclip", "olmo")) -> list[C.Claim]:
    """The claims of notebook 05 for the controller ``primary``, one set per domain (never pooled
    across domains: nats and return fractions differ), each question its own family
    (:meth:`Plan.families`), over units (:func:`unit_pairs`: a GPT or toy seed, an RL prefix, its runs
    at every event summarised): collapse prevented (paired binary outcomes), damage reduced (an RL
    domain's: Wilcoxon signed-rank over prefixes), false interventions per run against the budget,
    non-intrusiveness (TOST), and "beats" each comparator (less paired damage on the same perturbed
    runs; calibrated comparators at the same false-alarm budget, ``name@published`` at the published
    threshold). The smallest effects of interest come from ``plan`` (none for a domain it does not
    name)."""
    res: list[C.Claim] = []
    for domain in dict.fromkeys(out.domain):
        o = out[out.domain == domain]
        fam = plan.families(domain)
        dmg = plan.collapse_excess.get(domain)
        ctrl, base = o[o.controller == primary], o[o.controller == "none"]
        pert, bpert = ctrl[ctrl.event != "none"], base[base.event != "none"]
        units = unit_pairs(pert, bpert)
        rl = _has_prefix(pert)
        what = f"paired {'prefixes' if rl else 'seeds'} near the critical dose"
        res.append(_with_units(C.paired_outcomes(f"{domain}: {primary} prevents collapse ({what})", SOURCE,
                                                 units.collapse_with.to_numpy(float),
                                                 units.collapse_without.to_numpy(float), direction="less",
                                                 sesoi=None if rl else plan.prevents, family=fam["protect"],
                                                 alpha=plan.alpha), units))
        res.append(_with_units(C.paired_difference(f"{domain}: {primary} reduces damage ({what})", SOURCE,
                                                   units.damage_with.to_numpy(), units.damage_without.to_numpy(),
                                                   direction="less", sesoi=dmg, family=fam["protect"],
                                                   alpha=plan.alpha, test="wilcoxon" if rl else "ttest"), units))
        null = ctrl[(ctrl.event == "none") & ctrl.seed.isin(evaluation_seeds)]
        res.append(selective(f"{domain}: {primary} is selective: at most {plan.budget:g} false interventions per 1,000 "
                             "unperturbed steps (mean over runs)", 1000 * null.interventions.to_numpy(float)
                             / np.maximum(null.n_steps.to_numpy(float), 1), plan.budget, family=fam["cost"],
                             alpha=plan.alpha))
        ref = base[base.event == "none"].set_index("seed").reindex(null.seed)
        res.append(_tost(f"{domain}: {primary} is non-intrusive: unperturbed final {'return' if rl else 'loss'} within "
                         f"{plan.margin:.0%} of the run without it (TOST)", null.final.to_numpy(), ref.final.to_numpy(),
                         plan.margin, plan.alpha, fam["cost"]))
        for comp in comparators:
            other = o[(o.controller == comp) & (o.event != "none")]
            name = f"{domain}: {primary} beats {comp}: less damage on the same perturbed runs"
            vs = unit_pairs(pert, other) if len(other) else units.iloc[:0]
            if vs.empty or vs.damage_without.isna().all():
                res.append(C.not_tested(name, "our own", f"no {comp} runs", family=fam["beats"],
                                        sesoi=math.nan if dmg is None else -dmg))
                continue
            res.append(_with_units(C.paired_difference(name, "our own", vs.damage_with.to_numpy(),
                                                       vs.damage_without.to_numpy(), direction="less", sesoi=dmg,
                                                       family=fam["beats"], alpha=plan.alpha), vs))
    return res


def _tost(claim: str, final: np.ndarray, ref_final: np.ndarray, margin: float, alpha: float, family: str = "",
          ) -> C.Claim:
    """TOST of the paired ratio final / reference final against 1 +- ``margin`` (relative per pair)."""
    ratio = np.asarray(final, dtype=float) / np.asarray(ref_final, dtype=float)
    return C.equivalence(claim, SOURCE, ratio, np.ones_like(ratio), margin=margin, relative=False, alpha=alpha,
                         family=family)


def choose_primary(out: pd.DataFrame, calibration_seeds: Sequence[int], candidates: Sequence[str] = OURS) -> str:
    """Our controller with the fewest collapses, then the least mean damage, on the perturbed runs of
    the calibration seeds (the claims are then tested on the other seeds)."""
    cal = out[out.seed.isin(calibration_seeds) & (out.event != "none") & out.controller.isin(candidates)]
    if cal.empty:
        return candidates[0]
    score = cal.groupby("controller").agg(collapses=("collapse", "sum"), damage=("damage", "mean"))
    return str(score.sort_values(["collapses", "damage"]).index[0])


def selective(claim: str, rates: Sequence[float], budget: float, *, family: str = "", alpha: float = 0.05,
              min_n: int = 3) -> C.Claim:
    """Claim: the mean of the runs' false-intervention ``rates`` (per 1,000 unperturbed steps, one per
    run: the run is the unit, not the step) is at most ``budget``. One-sided t-tests over runs:
    supported when the mean is shown below the budget, not supported when shown above it. The power
    printed, as :func:`~stabstudy.analysis.claims.rate_below`'s: P(supported) with the runs at half
    the budget, P(not supported) at twice the budget, at the observed spread."""
    r = np.asarray(rates, dtype=float)
    r = r[np.isfinite(r)]
    test = f"one-sided t-tests over runs vs {budget:g} per 1,000 steps"
    if r.size < min_n:
        return C.not_tested(claim, SOURCE, "no unperturbed run" if r.size == 0 else f"{r.size} < {min_n} runs needed",
                            r.size, family=family, sesoi=budget)
    mean, n = float(r.mean()), int(r.size)
    sd = float(r.std(ddof=1))
    if sd == 0:
        p_for, p_against, half = float(mean >= budget), float(mean <= budget), 0.0
    else:
        se = sd / math.sqrt(n)
        p_for = float(sps.t.cdf((mean - budget) / se, n - 1))  # H0: mean >= budget
        p_against = float(sps.t.sf((mean - budget) / se, n - 1))  # H0: mean <= budget
        half = float(sps.t.ppf(1 - alpha, n - 1) * se)
    power = PW.t_test(n, sd, planning=budget / 2, minimum=0.0, sesoi=0.0, null=-budget)
    c = C.from_p(claim, SOURCE, mean, (mean - half, mean + half), n, p_for=p_for, p_against=p_against, test=test,
                 sesoi=budget, power=power, family=family, alpha=alpha, min_n=min_n)
    return replace(c, meaning=(f"the mean rate is shown below {budget:g}", f"the mean rate is shown above {budget:g}"))
