"""Which forks notebook 01 runs, round by round: :class:`ForkPlan`.

The study is adaptive: which forks run next depends on what the last ones showed. A plan is a frozen
table of :class:`Fork` rows (spec, arm, prefix, role, what it is judged over) and two pure steps,
:meth:`ForkPlan.first_round` and :meth:`ForkPlan.next_round` (the outcomes of every fork so far in, the
plan with the next round's forks out); :meth:`ForkPlan.judge` computes those outcomes from the runs.
The notebook's loop::

    plan = ForkPlan.of(design, hparams, prefixes).first_round()
    while plan.new:
        run_grid(plan.new)
        plan = plan.next_round(plan.judge(load_runs(plan.specs), prefix_ds))

The rounds: the first forks of every matched prefix (:meth:`.design.ForkDesign.first_forks`: its control
to H; the claim's dose, lr ramps, env-side kinds and the noise grid short); then, for each step of
``dose_steps``, the short forks that dropped below their control within their window run on to H
(:func:`.design.to_horizon`, kinds of ``extend_kinds``), then each prefix's next lr-spike dose from its
outcome at the last one (:meth:`.design.ForkDesign.next_dose`: down after a collapse, up after none, so
no prefix is forked above a dose it collapsed at); a last round runs the last doses' drops on to H. A
prefix without a verdict at a dose gets no further dose. A round without forks is skipped.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pandas as pd
import xarray as xr

from stabstudy.analysis.studies.rl.curves import eval_curves, return_reference
from stabstudy.analysis.studies.rl.design import ForkDesign, arms_of, to_horizon, with_arms
from stabstudy.analysis.studies.rl.outcomes import horizon_outcomes
from stabstudy.analysis.studies.rl.runs import run_table
from stabstudy.spec import RunSpec

#: What a fork is for: the unperturbed fork of its prefix, run to H (``control``); a perturbed fork that
#: runs its short window first (``short``); a short fork run on to H after it dropped (``extension``).
ROLES = ("control", "short", "extension")
#: The groups of a plan's forks.
GROUPS = ("control", "lr_spike", "lr_ramp", "action_noise", "reward_scale", "noise")


@dataclass(frozen=True)
class Fork:
    """One row of a :class:`ForkPlan`."""

    spec: RunSpec
    """what runs"""
    arm: str
    """its arm (a learner, or a variant such as ``ppo-tuned``)"""
    prefix: str
    """spec hash of the matching prefix it continues: the independent unit"""
    role: str
    """one of :data:`ROLES`"""
    group: str
    """one of :data:`GROUPS`"""
    round: int
    """the round it was planned in (1: the first forks)"""
    step: int = -1
    """an lr-spike fork of the main grid: its place in its prefix's dose sequence (0: the claim's dose); else -1"""
    replaces: str = ""
    """an extension: the spec hash of the short fork it runs on to H"""

    @property
    def judged_over(self) -> str:
        """``"H"`` or ``"short window"``: what its outcome is read over."""
        return "short window" if self.role == "short" else "H"


@dataclass(frozen=True)
class ForkPlan:
    """Notebook 01's forks so far and the rule for the next round (module docstring)."""

    design: ForkDesign
    """the design, fixed before the runs"""
    hparams: Mapping[str, Mapping[str, Any]]
    """per arm, the hyperparameters its specs are built with"""
    prefixes: tuple[tuple[str, str, int, int], ...]
    """one ``(spec_hash, arm, seed, steps)`` per matching prefix with forks (``steps``: where it stopped)"""
    rows: tuple[Fork, ...] = ()
    """every fork planned so far, in the order planned"""
    stage: str = "start"
    """the last round planned: ``"start"``, ``"first"``, ``"extensions"``, ``"dose"`` or ``"done"``"""
    dose_step: int = 0
    """the last dose step planned (0: the claim's dose)"""

    @classmethod
    def of(cls, design: ForkDesign, hparams: Mapping[str, Mapping[str, Any]], prefixes: pd.DataFrame) -> ForkPlan:
        """A plan with no forks yet. ``prefixes``: the matching prefixes to fork (columns ``spec_hash``,
        ``arm``, ``seed``, ``steps``: where each stopped); leave out those not to fork (diverged)."""
        missing = sorted({"spec_hash", "arm", "seed", "steps"} - set(prefixes))
        if missing:
            raise ValueError(f"prefixes needs the columns {', '.join(missing)}")
        rows = tuple((str(r.spec_hash), str(r.arm), int(r.seed), int(r.steps)) for r in prefixes.itertuples())
        return cls(design, {a: dict(h) for a, h in hparams.items()}, rows)

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
        return {**{h: a for h, a, _, _ in self.prefixes}, **{f.spec.spec_hash: f.arm for f in self.rows}}

    @property
    def prefix_of(self) -> dict[str, str]:
        """Fork spec hash -> its prefix's (the matching prefix's) spec hash."""
        return {f.spec.spec_hash: f.prefix for f in self.rows}

    @property
    def long(self) -> set[str]:
        """Spec hashes of the forks that ran to their event + H (a short fork whose window reaches H among them)."""
        return {f.spec.spec_hash for f in self.rows if f.judged_over == "H" or self._reaches_h(f)}

    def _reaches_h(self, f: Fork) -> bool:
        return bool(f.spec.perturbations) and to_horizon(f.spec, self.design.h(f.arm, self.hparams[f.arm])) == f.spec

    def prefix_steps(self) -> dict[str, dict[int, int]]:
        """Arm -> seed -> the env step its prefix stopped at (where its forks start)."""
        out: dict[str, dict[int, int]] = {}
        for _, arm, seed, steps in self.prefixes:
            out.setdefault(arm, {})[seed] = steps
        return out

    def window(self) -> dict[str, int]:
        """Per arm, the env steps a short fork runs from its event."""
        return {a: self.design.window(a, self.hparams[a]) for a in self.design.algos}

    def horizon(self) -> dict[str, int]:
        """Per arm, H (:meth:`.design.ForkDesign.h`)."""
        return {a: self.design.h(a, self.hparams[a]) for a in self.design.algos}

    def lag(self) -> dict[str, float]:
        """Per arm, the env steps a fork may trail its control by."""
        return {a: self.design.lag(a, self.hparams[a]) for a in self.design.algos}

    def final(self) -> dict[str, list[RunSpec]]:
        """Per group (:data:`GROUPS`), the forks every table reads: each short fork that ran on to H
        replaced by its run to H."""
        ext = {f.replaces: f.spec for f in self.rows if f.role == "extension"}
        out: dict[str, list[RunSpec]] = {g: [] for g in GROUPS}
        for f in self.rows:
            if f.role != "extension":
                spec = ext.get(f.spec.spec_hash, f.spec)
                if spec not in out[f.group]:
                    out[f.group].append(spec)
        return out

    def table(self) -> pd.DataFrame:
        """The rows as a table: ``spec_hash``, ``arm``, ``prefix``, ``seed``, ``role``, ``judged_over``,
        ``group``, ``round``, ``step``, ``replaces``, the perturbation's ``kind`` and ``dose``."""
        cols = ["spec_hash", "arm", "prefix", "seed", "role", "judged_over", "group", "round", "step", "replaces",
                "kind", "dose"]
        return pd.DataFrame([{"spec_hash": f.spec.spec_hash, "arm": f.arm, "prefix": f.prefix, "seed": f.spec.seed,
                              "role": f.role, "judged_over": f.judged_over, "group": f.group, "round": f.round,
                              "step": f.step, "replaces": f.replaces,
                              "kind": f.spec.perturbations[0].kind if f.spec.perturbations else "none",
                              "dose": f.spec.perturbations[0].dose if f.spec.perturbations else 1.0}
                             for f in self.rows], columns=cols)

    # -- the rounds --------------------------------------------------------------------------

    def first_round(self) -> ForkPlan:
        """The plan with the first forks of every prefix (:meth:`.design.ForkDesign.first_forks`)."""
        if self.stage != "start":
            raise ValueError(f"the first round is planned already (stage {self.stage!r})")
        prefix = {(arm, seed): h for h, arm, seed, _ in self.prefixes}
        rows = []
        for group, specs in self.design.first_forks(self.hparams, self.prefix_steps()).items():
            arms = arms_of(specs, self.hparams)
            for s in specs:
                arm = arms[s.spec_hash]
                step = 0 if group == "lr_spike" else -1
                rows.append(Fork(s, arm, prefix[(arm, s.seed)], "control" if not s.perturbations else "short",
                                 group, 1, step))
        return replace(self, rows=tuple(rows), stage="first")

    def next_round(self, outcomes: pd.DataFrame) -> ForkPlan:
        """The plan with the next round that has forks (or ``stage`` "done"), from ``outcomes``: the
        paired outcomes of every fork so far (:meth:`judge`; columns ``spec_hash``, ``dropped`` and
        ``collapsed``). Pure: the same plan and outcomes give the same next round."""
        if self.stage == "start":
            raise ValueError("plan the first round first (first_round)")
        plan = self
        while plan.stage != "done":
            if plan.stage in ("first", "dose"):
                plan = replace(plan, rows=plan.rows + tuple(plan._extensions(outcomes)), stage="extensions")
            elif plan.dose_step < len(plan.design.dose_steps):
                plan = replace(plan, rows=plan.rows + tuple(plan._doses(outcomes)), stage="dose",
                               dose_step=plan.dose_step + 1)
            else:
                plan = replace(plan, stage="done")
            if plan.round > self.round:
                break
        return plan

    def _extensions(self, outcomes: pd.DataFrame) -> list[Fork]:
        """The short forks of the last round that dropped within their window, run on to H."""
        dropped = set(outcomes.spec_hash[outcomes["dropped"].astype(bool)]) if len(outcomes) else set()
        rows = []
        for f in self.rows:
            if f.round == self.round and f.role == "short" and f.spec.spec_hash in dropped and \
                    f.spec.perturbations[0].kind in self.design.extend_kinds:
                ext = to_horizon(f.spec, self.design.h(f.arm, self.hparams[f.arm]))
                if ext != f.spec:  # a short window as long as H is its run to H already
                    rows.append(replace(f, spec=ext, role="extension", round=self.round + 1, replaces=f.spec.spec_hash))
        return rows

    def _doses(self, outcomes: pd.DataFrame) -> list[Fork]:
        """Each prefix's next lr-spike dose, from its verdict at its last one (over what that fork ran)."""
        verdict = dict(zip(outcomes.spec_hash, outcomes.collapsed.to_numpy(float), strict=True)) if len(outcomes) else {}
        ext = {f.replaces: f.spec.spec_hash for f in self.rows if f.role == "extension"}
        steps = self.prefix_steps()
        rows = []
        for f in self.rows:
            if f.step != self.dose_step or f.role == "extension":
                continue
            c = verdict.get(ext.get(f.spec.spec_hash, f.spec.spec_hash), np.nan)
            dose = self.design.next_dose(f.spec.perturbations[0].dose, self.dose_step, bool(c)) if np.isfinite(c) else None
            if dose is None:
                continue
            (spec,) = self.design.forks(self.hparams, steps, f.arm, [f.spec.seed], [("lr_spike", dose)], to_h=False)
            rows.append(Fork(spec, f.arm, f.prefix, "short", "lr_spike", self.round + 1, self.dose_step + 1))
        return rows

    # -- judging a round ---------------------------------------------------------------------

    def judge(self, ds: xr.Dataset, prefix_ds: xr.Dataset) -> pd.DataFrame:
        """The paired outcomes of every fork of the plan (:func:`.outcomes.horizon_outcomes` over H, or
        the short window, with the design's lag, ``collapse_frac`` and least gain): ``ds`` holds the
        forks' runs (``stabstudy.run.store.load_runs``), ``prefix_ds`` the matching prefixes' (their
        first evaluations, the untrained policies, are the floors)."""
        ds = with_arms(ds, self.arms)
        prefix_of = self.prefix_of
        floors, _ = return_reference(prefix_ds, eval_curves(ds), prefix_of)
        out = horizon_outcomes(ds, run_table(ds), horizon=self.horizon(), window=self.window(), long=self.long,
                               floors=floors, prefix_of=prefix_of, lag=self.lag(), frac=self.design.collapse_frac,
                               min_gain=self.design.no_gain)
        return out if len(out) else pd.DataFrame(columns=["spec_hash", "dropped", "collapsed"])
