"""Which forks notebook 01 runs, round by round: :class:`ForkPlan`.

The study is adaptive: which forks run next depends on what the last ones showed. A plan is a frozen
table of :class:`Fork` rows (spec, arm, prefix, role, what it is judged over) and two pure steps,
:meth:`ForkPlan.first_round` and :meth:`ForkPlan.next_round` (the outcomes of every fork so far in,
the plan with the next round's forks out); :meth:`ForkPlan.judge` computes those outcomes from the
runs. The notebook's loop::

    plan = ForkPlan.of(design, hparams, horizon, prefixes).first_round()
    while plan.new:
        run_grid(plan.new)
        plan = plan.next_round(plan.judge(load_runs(plan.specs), prefix_ds))

The rounds: the grids of every regime (:meth:`.design.ForkDesign.grids`: controls and the claim's
dose to H, every other fork short); the short forks that dropped below their control within their
window, run on to H (:func:`.design.to_horizon`; kinds of ``extend_kinds``); claim (b)'s bisection
forks inside each prefix's bracket (:func:`.outcomes.bisection_doses`); those of them that dropped,
run on to H. A round without forks is skipped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import pandas as pd
import xarray as xr

from stabstudy.analysis.studies.rl.curves import eval_curves, return_reference
from stabstudy.analysis.studies.rl.design import ForkDesign, arms_of, to_horizon, with_arms
from stabstudy.analysis.studies.rl.outcomes import bisection_doses, by_prefix, horizon_outcomes
from stabstudy.analysis.studies.rl.runs import run_table
from stabstudy.spec import RunSpec

#: What a fork is for: the unperturbed fork of its prefix (``control``), a fork run to H from the start
#: (``to H``), one that runs its short window first (``short``), a short fork run on to H after it dropped
#: (``extension``).
ROLES = ("control", "to H", "short", "extension")
#: The rounds, in order; a plan's ``stage`` is the last one it holds.
STAGES = ("grids", "extensions", "bisection", "bisection extensions", "done")
#: The groups whose forks claim (b)'s brackets read.
LR_GROUPS = ("lr_spike to H", "lr_spike short")
#: Every group of a regime's forks: :meth:`.design.ForkDesign.grids`' and the bisection's.
GROUPS = (*LR_GROUPS, "lr_ramp", "action_noise", "reward_scale", "noise", "lr_spike bisection")


@dataclass(frozen=True)
class Fork:
    """One row of a :class:`ForkPlan`: a fork in one regime's grid."""

    spec: RunSpec
    """what runs"""
    arm: str
    """its arm (a learner, or a variant such as ``ppo-tuned``)"""
    prefix: str
    """spec hash of the prefix it continues: the independent unit"""
    role: str
    """one of :data:`ROLES`"""
    judged_over: str
    """``"H"`` or ``"short window"``: what its outcome is read over"""
    regime: str
    """the prefix regime (:func:`.design.regimes`) whose grid holds it"""
    group: str
    """the grid it belongs to (``"lr_spike to H"``, ``"lr_spike short"``, ``"lr_spike bisection"``, ``"lr_ramp"``, ...)"""
    round: int
    """the round it was planned in (1: the grids)"""
    replaces: str = ""
    """an extension: the spec hash of the short fork it runs on to H"""


@dataclass(frozen=True)
class ForkPlan:
    """Notebook 01's forks so far and the rule for the next round (module docstring)."""

    design: ForkDesign
    """the grids, doses and rules"""
    hparams: Mapping[str, Mapping[str, Any]]
    """per arm, the hyperparameters its specs are built with"""
    horizon: Mapping[str, Mapping[str, int]]
    """per regime and arm, H in env steps after the event (:meth:`.design.ForkDesign.horizon`)"""
    prefixes: Mapping[str, RunSpec]
    """spec hash -> prefix spec (every arm, seed and regime)"""
    rows: tuple[Fork, ...] = ()
    """every fork planned so far, in the order planned"""
    stage: str = "start"
    """the last round planned: ``"start"`` or one of :data:`STAGES`"""
    prefix_arms: Mapping[str, str] = field(default_factory=dict)
    """prefix spec hash -> arm"""

    @classmethod
    def of(cls, design: ForkDesign, hparams: Mapping[str, Mapping[str, Any]], horizon: Mapping[str, Mapping[str, int]],
           prefixes: Sequence[RunSpec]) -> ForkPlan:
        """A plan with no forks yet. ``prefixes``: the prefix specs of every regime (stored or not)."""
        unknown = sorted(set(design.regimes()) - set(horizon))
        if unknown:
            raise ValueError(f"no horizon for regime(s) {unknown}; regimes: {', '.join(design.regimes())}")
        return cls(design, dict(hparams), {r: dict(h) for r, h in horizon.items()}, {p.spec_hash: p for p in prefixes},
                   prefix_arms=arms_of(prefixes, hparams))

    # -- views -------------------------------------------------------------------------------

    @property
    def round(self) -> int:
        """The number of the last round planned (0 before the first)."""
        return max((f.round for f in self.rows), default=0)

    @property
    def new(self) -> list[RunSpec]:
        """The distinct specs of the last round: what runs next (empty when the plan is done)."""
        return list(dict.fromkeys(f.spec for f in self.rows if f.round == self.round)) if self.stage != "done" else []

    @property
    def specs(self) -> list[RunSpec]:
        """Every distinct spec planned so far."""
        return list(dict.fromkeys(f.spec for f in self.rows))

    @property
    def arms(self) -> dict[str, str]:
        """Spec hash -> arm, of the prefixes and every fork."""
        return {**self.prefix_arms, **{f.spec.spec_hash: f.arm for f in self.rows}}

    @property
    def prefix_of(self) -> dict[str, str]:
        """Fork spec hash -> its prefix's spec hash."""
        return {f.spec.spec_hash: f.prefix for f in self.rows}

    @property
    def long(self) -> set[str]:
        """Spec hashes of the forks that ran to their event + H."""
        return {f.spec.spec_hash for f in self.rows if f.judged_over == "H"}

    def table(self) -> pd.DataFrame:
        """The rows as a table: ``spec_hash``, ``arm``, ``prefix``, ``role``, ``judged_over``, ``regime``,
        ``group``, ``round``, ``replaces``, the perturbation's ``kind`` and ``dose`` (``none`` and 1 for a control)."""
        cols = ["spec_hash", "arm", "prefix", "role", "judged_over", "regime", "group", "round", "replaces", "kind", "dose"]
        return pd.DataFrame([{"spec_hash": f.spec.spec_hash, "arm": f.arm, "prefix": f.prefix, "role": f.role,
                              "judged_over": f.judged_over, "regime": f.regime, "group": f.group, "round": f.round,
                              "replaces": f.replaces,
                              "kind": f.spec.perturbations[0].kind if f.spec.perturbations else "none",
                              "dose": f.spec.perturbations[0].dose if f.spec.perturbations else 1.0}
                             for f in self.rows], columns=cols)

    def window(self) -> dict[str, int]:
        """Per arm, the env steps a short fork runs from its event (:meth:`.design.ForkDesign.window`)."""
        return {a: self.design.window(a, self.hparams[a]) for a in self.design.algos}

    def final(self) -> dict[str, dict[str, list[RunSpec]]]:
        """Per regime and group, the forks every table reads: each short fork that ran on to H replaced
        by its run to H (every group of :data:`GROUPS`, empty or not)."""
        ext = {(f.regime, f.replaces): f.spec for f in self.rows if f.role == "extension"}
        out = {r: {g: [] for g in GROUPS} for r in dict.fromkeys(f.regime for f in self.rows)}
        for f in self.rows:
            if f.role == "extension":
                continue
            group = out[f.regime][f.group]
            spec = ext.get((f.regime, f.spec.spec_hash), f.spec)
            if spec not in group:
                group.append(spec)
        return out

    # -- the rounds --------------------------------------------------------------------------

    def first_round(self) -> ForkPlan:
        """The plan with the grids of every regime (:meth:`.design.ForkDesign.grids`, the second
        regime's lr grids only)."""
        if self.stage != "start":
            raise ValueError(f"the first round is planned already (stage {self.stage!r})")
        rows = []
        for r, pre in self.design.regimes().items():
            grids = self.design.grids(self.hparams, self.horizon[r], prefix=pre, lr_only=r != "return-matched")
            arms = arms_of([s for v in grids.values() for s in v], self.hparams)
            for group, specs in grids.items():
                for s in specs:
                    role = "control" if not s.perturbations else "to H" if group == "lr_spike to H" else "short"
                    rows.append(self._fork(s, arms[s.spec_hash], role, r, group, 1))
        return replace(self, rows=tuple(rows), stage="grids")

    def next_round(self, outcomes: pd.DataFrame) -> ForkPlan:
        """The plan with the next round that has forks (or ``stage`` "done"), from ``outcomes``: the
        paired outcomes of every fork so far (:meth:`judge`; columns ``regime``, ``spec_hash``,
        ``dropped``, and for the bisection ``learner`` (the arm), ``prefix``, ``pert_kind``, ``pert_dose``,
        ``collapsed``). Pure: the same plan and outcomes give the same next round."""
        if self.stage == "start":
            raise ValueError("plan the first round first (first_round)")
        plan = self
        while plan.stage != "done":
            stage = STAGES[STAGES.index(plan.stage) + 1]
            rows = {"extensions": plan._extensions, "bisection extensions": plan._extensions,
                    "bisection": plan._bisection, "done": lambda _: []}[stage](outcomes)
            plan = replace(plan, rows=plan.rows + tuple(rows), stage=stage)
            if rows:
                break
        return plan

    def _fork(self, spec: RunSpec, arm: str, role: str, regime: str, group: str, rnd: int, replaces: str = "") -> Fork:
        key = (arm, spec.seed, int(spec.hp["prefix_steps"]))
        prefix = [h for h, p in self.prefixes.items() if (self.prefix_arms[h], p.seed, p.steps) == key]
        if len(prefix) != 1:
            raise ValueError(f"{spec.label}: {len(prefix)} prefixes of arm {arm}, seed {spec.seed} and "
                             f"{key[2]} env steps among the plan's prefixes (want 1)")
        return Fork(spec, arm, prefix[0], role, "H" if role in ("control", "to H", "extension") else "short window",
                    regime, group, rnd, replaces)

    def _extensions(self, outcomes: pd.DataFrame) -> list[Fork]:
        """The short forks of the last round that dropped within their window, run on to H."""
        dropped = set(outcomes.spec_hash[outcomes["dropped"].astype(bool)]) if len(outcomes) else set()
        rows = []
        for f in self.rows:
            if f.round != self.round or f.role != "short" or f.spec.spec_hash not in dropped:
                continue
            if f.spec.perturbations[0].kind not in self.design.extend_kinds:
                continue
            ext = to_horizon(f.spec, self.horizon[f.regime][f.arm])
            rows.append(replace(f, spec=ext, role="extension", judged_over="H", round=self.round + 1,
                                replaces=f.spec.spec_hash))
        return rows

    def _bisection(self, outcomes: pd.DataFrame) -> list[Fork]:
        """Claim (b)'s bisection forks: ``bisections`` doses inside each prefix's bracket, per regime."""
        if not self.design.bisections or not len(outcomes):
            return []
        rows = []
        for r, groups in self.final().items():
            lr = {s.spec_hash for g in LR_GROUPS for s in groups.get(g, [])}
            out = outcomes[(outcomes.regime == r) & outcomes.spec_hash.isin(lr)]
            doses = bisection_doses(by_prefix(out), points=self.design.bisections)
            specs = self.design.bisection_forks(self.hparams, doses, self.prefixes)
            arms = arms_of(specs, self.hparams)
            rows += [self._fork(s, arms[s.spec_hash], "short", r, "lr_spike bisection", self.round + 1) for s in specs]
        return rows

    # -- judging a round ---------------------------------------------------------------------

    def judge(self, ds: xr.Dataset, prefix_ds: xr.Dataset) -> pd.DataFrame:
        """The paired outcomes of every fork of the plan (:func:`.outcomes.horizon_outcomes`, per
        regime over its H, a column ``regime``): ``ds`` holds the forks' runs
        (``stabstudy.run.store.load_runs``), ``prefix_ds`` the prefixes' (their untrained returns
        are the floors)."""
        ds = with_arms(ds, self.arms)
        prefix_of = self.prefix_of
        floors, _ = return_reference(prefix_ds, eval_curves(ds), prefix_of)
        table = run_table(ds)
        parts = []
        for r, groups in self.judged_groups().items():
            rows = table[table.spec_hash.isin(groups)]
            out = horizon_outcomes(ds, rows, horizon=self.horizon[r], window=self.window(), long=self.long,
                                   floors=floors, prefix_of=prefix_of, frac=self.design.collapse_frac,
                                   recover_frac=self.design.recover_frac)
            if len(out):
                parts.append(out.assign(regime=r))
        return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=["regime", "spec_hash", "dropped"])

    def judged_groups(self) -> dict[str, set[str]]:
        """Per regime, the spec hashes of its forks (a noise-grid fork pairs with the control of its own
        knob level, :data:`.outcomes.PAIR_KEY`, never with the main grid's)."""
        out: dict[str, set[str]] = {}
        for f in self.rows:
            out.setdefault(f.regime, set()).add(f.spec.spec_hash)
        return out
