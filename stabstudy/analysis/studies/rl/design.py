"""Notebook 01's design: which prefixes and forks run, how long, and at which doses.

Every arm (a learner, or a variant such as ``ppo-tuned``: :func:`stabstudy.registry.arm_learner`) trains
one prefix per seed until its evaluation return reaches a target fixed before the runs
(:meth:`ForkDesign.match_specs`), so that the algorithms are compared at the same return, not after the
same number of env steps. Forks of a prefix are read against its control (the unperturbed fork of the
same prefix) over a horizon H fixed before the runs (:meth:`ForkDesign.h`). The control runs to its
event + H; every perturbed fork runs a short window first and is run on to H (:func:`to_horizon`) only
when its return dropped below the control's there: the long run repeats the short one bit for bit (same
checkpoint, seed and spec up to its length), so only the forks that need H pay for it. The lr-spike
doses of each prefix come one at a time (:meth:`ForkDesign.next_dose`); which forks run in which round
is :class:`stabstudy.analysis.studies.rl.plan.ForkPlan`. The claim as stated (:func:`stated_grid`) is a
spike early in a fresh run. :func:`horizons` measures how long the prefixes took to learn (printed beside
the H the design fixed).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

import numpy as np
import pandas as pd
import xarray as xr

from stabstudy.analysis.studies.rl.curves import finite_pairs
from stabstudy.hparams import defaults
from stabstudy.registry import NOISE_KNOB, ON_POLICY, arm_learner, hparams_class
from stabstudy.spec import Perturbation, RunSpec, freeze_map


def _full(arm: str, hp: Mapping[str, Any] | None) -> dict[str, Any]:
    return {**defaults(hparams_class("rl", arm_learner(arm))), **(hp or {})}


def updates_per_rollout(hp: Mapping[str, Any]) -> int:
    """Gradient updates of one PPO ``train()`` call: ``n_epochs`` x minibatches of a rollout
    (``hp`` over the PPO defaults)."""
    hp = _full("ppo", hp)
    return int(hp["n_epochs"]) * -(-int(hp["n_steps"]) // int(hp["batch_size"]))


def fork_unit(arm: str, hp: Mapping[str, Any]) -> int:
    """Env steps between the points where a fork can start or stop without changing what follows:
    a rollout (``n_steps``) on-policy, a train call (``train_freq``) off-policy."""
    full = _full(arm, hp)
    return int(full["n_steps"] if arm_learner(arm) in ON_POLICY else full["train_freq"])


def _round_up(steps: float, unit: int) -> int:
    return int(-(-int(np.ceil(steps)) // unit) * unit)


def spike_env_steps(learner: str, hp: Mapping[str, Any], updates: int = 0) -> int:
    """Env steps of an lr-spike window that spikes ``updates`` gradient updates (0: one PPO
    rollout's worth, :func:`updates_per_rollout` of the PPO defaults over ``hp``). On-policy
    learners update only at rollout ends: their window is one rollout (``n_steps``), whatever
    ``updates``; off-policy learners make ``gradient_steps`` updates every ``train_freq`` env steps.
    ``learner``: a learner or an arm of one."""
    hp = _full(learner, hp)
    if arm_learner(learner) in ON_POLICY:
        return int(hp["n_steps"])
    updates = updates or updates_per_rollout(_full("ppo", {}))
    return -(-int(updates) // int(hp["gradient_steps"])) * int(hp["train_freq"])


def env_step_of_update(learner: str, hp: Mapping[str, Any], update: int) -> int:
    """Env step (``num_timesteps``) of the ``train()`` call in which stable-baselines3's update
    counter (``n_updates``, logged as ``train/n_updates``) reaches ``update``, from scratch.
    SB3 counts PPO's updates by epochs (``n_updates += n_epochs`` per rollout; A2C one per rollout),
    not by minibatch steps; SAC/TD3 count gradient steps (``+= gradient_steps`` per train call, every
    ``train_freq`` env steps once ``num_timesteps > learning_starts``)."""
    hp = _full(learner, hp)
    if arm_learner(learner) in ON_POLICY:
        per = int(hp["n_epochs"]) if arm_learner(learner) == "ppo" else 1
        return (-(-int(update) // per)) * int(hp["n_steps"])
    f, g = int(hp["train_freq"]), int(hp["gradient_steps"])
    first = (int(hp["learning_starts"]) // f + 1) * f
    return first + (-(-int(update) // g) - 1) * f


def fork_grid(algos: Sequence[str], treatments: Sequence[tuple[str, float]], seeds: Iterable[int],
              prefix: Mapping[str, int | Mapping[int, int]], *, task: str = "HalfCheetah-v5",
              hparams: Mapping[str, Mapping[str, Any]] | None = None, lead: Mapping[str, int],
              post: Mapping[str, int] | None = None, horizon: Mapping[str, int] | None = None,
              spike_updates: int = 0, env_duration: int = 2048, eval_every: Mapping[str, int] | None = None,
              log_every: int = 1, noise_after_fork: Mapping[str, float] | None = None,
              keep_knob: bool = False) -> list[RunSpec]:
    """Forks of each arm's stored prefix (``prefix[arm]`` env steps, or ``prefix[arm][seed]`` where each
    seed's prefix has its own length: a prefix matched by return): treatments x seeds.

    ``algos``: arms (learners, or variants such as ``ppo-tuned``, whose ``hparams`` are their own).
    ``treatments``: ``(kind, dose)`` pairs, ``("none", 1.0)`` = the unperturbed fork (the
    control of every perturbed fork of the same seed). Every perturbation starts
    ``lead[arm]`` env steps after the fork (room for the pre-perturbation evaluations);
    an lr spike lasts :func:`spike_env_steps` of ``spike_updates``, an env-side perturbation
    ``env_duration`` env steps, and so does the climb of an ``lr_ramp`` (which then stays at its
    dose to the fork's end). Every fork of an arm then runs ``post[arm]`` env steps beyond the
    longer of the two (the short window), or, with ``horizon``, to the event + ``horizon[arm]``
    (at least the window; :func:`horizon_steps`); the end is rounded up to the fork unit.
    ``noise_after_fork``: the learner's own noise knob from the fork on (left out where it
    equals the prefix's, so those forks are the main grid's, unless ``keep_knob``: a grid with
    another lead keeps its default level apart, with its own controls).
    """
    if (post is None) == (horizon is None):
        raise ValueError("fork_grid needs exactly one of post (the short window) and horizon (to event + H)")
    specs = []
    for a in algos:
        for s in seeds:
            p = int(prefix[a][int(s)] if isinstance(prefix[a], Mapping) else prefix[a])
            hp = {**((hparams or {}).get(a, {})), "prefix_steps": p}
            full = _full(a, hp)
            knob = NOISE_KNOB[arm_learner(a)]
            if noise_after_fork and a in noise_after_fork and (keep_knob or float(noise_after_fork[a]) != full[knob]):
                hp["noise_after_fork"] = float(noise_after_fork[a])
            unit = fork_unit(a, full)
            if p % unit:  # here, not minutes later on a worker
                raise ValueError(f"{a}: prefix_steps {p} must be a multiple of "
                                 f"{'n_steps' if arm_learner(a) in ON_POLICY else 'train_freq'} = {unit} "
                                 "(a fork point ends a train call)")
            start = p + int(lead[a])
            spike = spike_env_steps(a, full, spike_updates)
            window = max(spike, int(env_duration))
            steps = _round_up(start + (window + int(post[a]) if horizon is None else max(window, int(horizon[a]))), unit)
            for kind, dose in treatments:
                pert = () if kind == "none" else (Perturbation(kind, start, spike if kind == "lr_spike"
                                                               else int(env_duration), float(dose)),)
                specs.append(RunSpec("rl", arm_learner(a), task, steps, int(s), hparams=hp, perturbations=pert,
                                     eval_every=int((eval_every or {}).get(a, 0)), log_every=int(log_every)))
    return list(dict.fromkeys(specs))


def to_horizon(spec: RunSpec, horizon: int) -> RunSpec:
    """The perturbed fork ``spec`` run on to its event + ``horizon`` env steps (rounded up to its fork
    unit), the same spec otherwise: up to its old end it is the same computation (same checkpoint,
    seed, perturbation and evaluation cadence), so it repeats it bit for bit. A spec already as long
    comes back unchanged; a control (no event) is refused: build it with ``fork_grid(horizon=...)``."""
    if not spec.perturbations:
        raise ValueError(f"{spec.label}: a control fork has no event to count the horizon from; "
                         "build it with fork_grid(..., horizon=...)")
    start = min(p.start for p in spec.perturbations)
    return spec.replace(steps=max(spec.steps, _round_up(start + int(horizon), fork_unit(spec.learner, spec.hp))))


def arms_of(specs: Iterable[RunSpec], hparams: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """Spec hash -> arm, for prefixes and forks of ``hparams``' arms (arm -> the hyperparameters its
    specs were built with): the arm whose learner is the spec's and whose hyperparameters are the
    spec's without the fork's own (``prefix_steps``, ``noise_after_fork``, ``match_return``). ``ValueError``
    for a spec no arm or more than one arm describes."""
    own = {a: freeze_map(h, a) for a, h in hparams.items()}
    out = {}
    for s in specs:
        hp = {k: v for k, v in s.hp.items() if k not in ("prefix_steps", "noise_after_fork", "match_return")}
        match = [a for a, h in own.items() if arm_learner(a) == s.learner and h == freeze_map(hp, s.label)]
        if len(match) != 1:
            raise ValueError(f"{s.label}: {'no arm' if not match else 'arms ' + ', '.join(match)} of "
                             f"{', '.join(own)} describe(s) its hyperparameters {hp}")
        out[s.spec_hash] = match[0]
    return out


def with_arms(ds: xr.Dataset, arms: Mapping[str, str]) -> xr.Dataset:
    """``ds`` (:func:`stabstudy.run.store.load_runs`) with its ``learner`` coordinate replaced by each
    run's arm (:func:`arms_of`), so tables, pairs and horizons keep ``ppo-tuned`` apart from ``ppo``."""
    learner = [arms.get(str(h), str(a)) for h, a in zip(ds.run.values, ds.learner.values, strict=True)]
    return ds.assign_coords(learner=("run", learner))

@dataclass(frozen=True)
class ForkDesign:
    """Notebook 01's design, fixed before the runs; each field is the notebook parameter of the same name
    (:meth:`from_parameters`).

    Every arm trains one prefix per seed until its return reaches ``target_return`` (:meth:`match_specs`).
    Forks of it (:meth:`forks`): the control runs to its event + H; every perturbed fork runs a short
    window first and on to H only where it dropped (:func:`to_horizon`). The lr-spike doses of each prefix
    come one at a time (:meth:`next_dose`), the other kinds at one dose each."""

    algos: tuple[str, ...]
    """arms (learners or variants, :func:`stabstudy.registry.arm_learner`); on-policy arms are the treated ones"""
    seeds: tuple[int, ...]
    """one prefix per seed and arm: the independent units of claims (a) and (b)"""
    target_return: float
    """a prefix trains until the mean of two consecutive evaluations first reaches this return"""
    prefix_cap: Mapping[str, int]
    """the most env steps an arm's prefix trains; one that has not reached the target by then is unmatched"""
    prefix_eval_every: Mapping[str, int]
    """env steps between a prefix's evaluations, where the target is checked (a multiple of the fork unit)"""
    horizon: Mapping[str, int]
    """H: env steps after the event over which a fork is judged against its control"""
    fork_lead: Mapping[str, int]
    """env steps from the fork to the perturbation"""
    fork_post: Mapping[str, int]
    """env steps a short fork runs after its perturbation window"""
    fork_eval_every: Mapping[str, int]
    """env steps between a fork's evaluations"""
    claim_dose: float = 10.0
    """lr factor (of the arm's own lr) of claim (a) and every prefix's first dose"""
    dose_steps: tuple[float, ...] = (0.5, 0.25)
    """decades from a prefix's last dose to its next: down after a collapse, up after none (claim (b))"""
    lag_frac: float = 0.25
    """a fork that trails its control by up to this fraction of H is not collapsed"""
    collapse_frac: float = 0.5
    """a fork that ends below this fraction of its control's gain over the floor collapsed"""
    no_gain: float = 0.0
    """a control at most this far (a return) above its floor at the end has no gain to lose: no verdict"""
    subset_seeds: tuple[int, ...] = ()
    """the prefixes of subset_arms, of the env-side kinds and of the noise grid"""
    subset_arms: tuple[str, ...] = ()
    """arms that run on the subset seeds only"""
    task: str = "HalfCheetah-v5"
    """gymnasium env id"""
    spike_updates: int = 0
    """gradient updates an lr spike covers (0: one PPO rollout's)"""
    env_pert_duration: int = 2048
    """env steps of an env-side perturbation and of an lr ramp's climb"""
    log_every: int = 1
    """keep every this many telemetry rows"""
    lr_ramp_doses: tuple[float, ...] = ()
    """final factors of lr ramps, short forks of the subset seeds (notebook 04 reads them)"""
    env_doses: Mapping[str, float] = field(default_factory=dict)
    """env-side kind (action_noise, reward_scale) -> its dose, short forks of the subset seeds"""
    extend_kinds: tuple[str, ...] = ("lr_spike",)
    """kinds whose short forks run on to H where they dropped (the others' drops get no verdict)"""
    noise_levels: Mapping[str, Sequence[float]] = field(default_factory=dict)
    """claim (c): each arm's own noise knob after the fork, levels (subset seeds; empty: no noise grid)"""
    noise_lead: Mapping[str, int] = field(default_factory=dict)
    """claim (c): env steps from the fork to the spike in the noise grid (the knob acts that long first)"""
    stated_at: int = 2048
    """the claim as stated: env step of the spike in a fresh run"""
    stated_update: int = 2000
    """the claim as stated: the spike at this update as stable-baselines3 counts them (run where it differs)"""
    stated_steps: Mapping[str, int] = field(default_factory=dict)
    """the claim as stated: each arm's budget in env steps (its fresh runs; empty: not run)"""
    stated_hparams: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """the claim as stated: hyperparameters over the arm's for its fresh runs (e.g. a small learning_starts)"""

    @classmethod
    def from_parameters(cls, params: Mapping[str, Any]) -> ForkDesign:
        """The design of a notebook parameters mapping (extra names are ignored)."""
        required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
        missing = [n for n in required if n not in params]
        if missing:
            raise ValueError(f"ForkDesign needs the parameters {', '.join(missing)}")
        kw = {f.name: params[f.name] for f in fields(cls) if f.name in params}
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in kw.items()})

    def seeds_of(self, arm: str) -> tuple[int, ...]:
        """The prefixes (seeds) of ``arm``."""
        return tuple(self.subset_seeds if arm in self.subset_arms else self.seeds)

    def window(self, arm: str, hp: Mapping[str, Any]) -> int:
        """Env steps a short fork runs from its event: the perturbation window plus ``fork_post``."""
        return max(spike_env_steps(arm, hp, self.spike_updates), int(self.env_pert_duration)) + int(self.fork_post[arm])

    def h(self, arm: str, hp: Mapping[str, Any]) -> int:
        """H of ``arm`` rounded up to its fork unit and never shorter than a short fork's :meth:`window`
        (so a control reaches the end of every short fork of its prefix)."""
        return _round_up(max(int(self.horizon[arm]), self.window(arm, hp)), fork_unit(arm, hp))

    def lag(self, arm: str, hp: Mapping[str, Any]) -> float:
        """Env steps a fork may trail its control by (``lag_frac`` of :meth:`h`)."""
        return float(self.lag_frac) * self.h(arm, hp)

    def match_specs(self, hparams: Mapping[str, Mapping[str, Any]], cap: Mapping[str, int] | None = None) -> list[RunSpec]:
        """One prefix per arm and seed, matched by return (``stabstudy.learners.rl.forks``): from scratch to
        ``target_return``, at most ``prefix_cap`` (or ``cap``) env steps, evaluated every ``prefix_eval_every``."""
        cap = {**self.prefix_cap, **(cap or {})}
        return [RunSpec("rl", arm_learner(a), self.task, int(cap[a]), int(s),
                        hparams={**hparams[a], "match_return": float(self.target_return)},
                        eval_every=int(self.prefix_eval_every[a]), log_every=int(self.log_every))
                for a in self.algos for s in self.seeds_of(a)]

    def next_dose(self, dose: float, step: int, collapsed: bool) -> float | None:
        """A prefix's dose after ``dose`` (its ``step``-th, 0: the claim's): ``dose_steps[step]`` decades down
        after a collapse, up after none, to 3 significant digits; None after the last step."""
        if step >= len(self.dose_steps):
            return None
        return float(f"{dose * 10 ** (-self.dose_steps[step] if collapsed else self.dose_steps[step]):.3g}")

    def forks(self, hparams: Mapping[str, Mapping[str, Any]], prefix: Mapping[str, Mapping[int, int]], arm: str,
              seeds: Iterable[int], treatments: Sequence[tuple[str, float]], *, to_h: bool,
              noise: float | None = None) -> list[RunSpec]:
        """Forks of ``arm``'s prefixes of ``seeds`` (``prefix[arm][seed]``: where each stopped), one per
        treatment, short or (``to_h``) to the event + :meth:`h`; ``noise``: the arm's own knob set at the
        fork, ``noise_lead`` before the perturbation (the noise grid of claim (c), with its own controls)."""
        lead = {arm: int(self.noise_lead[arm] if noise is not None else self.fork_lead[arm])}
        kw = dict(task=self.task, hparams=hparams, lead=lead, spike_updates=self.spike_updates,
                  env_duration=self.env_pert_duration, eval_every=self.fork_eval_every, log_every=self.log_every)
        if noise is not None:
            kw.update(noise_after_fork={arm: float(noise)}, keep_knob=True)
        length = {"horizon": {arm: self.h(arm, hparams[arm])}} if to_h else {"post": self.fork_post}
        return fork_grid([arm], treatments, seeds, prefix, **kw, **length)

    def first_forks(self, hparams: Mapping[str, Mapping[str, Any]],
                    prefix: Mapping[str, Mapping[int, int]]) -> dict[str, list[RunSpec]]:
        """The first round's forks by group: ``"control"`` (to H), ``"lr_spike"`` (the claim's dose, short),
        ``"lr_ramp"`` and each env-side kind of ``env_doses`` (subset seeds), and ``"noise"`` (each knob
        level's control to H and spike at the claim's dose, subset seeds). ``prefix[arm][seed]``: the env
        step each prefix stopped at (prefixes absent there get no forks)."""
        out: dict[str, list[RunSpec]] = {"control": [], "lr_spike": [], "lr_ramp": [], "noise": []}
        out.update({k: [] for k in self.env_doses})
        for a in self.algos:
            seeds = [s for s in self.seeds_of(a) if s in prefix.get(a, {})]
            sub = [s for s in self.subset_seeds if s in seeds]
            out["control"] += self.forks(hparams, prefix, a, seeds, [("none", 1.0)], to_h=True)
            out["lr_spike"] += self.forks(hparams, prefix, a, seeds, [("lr_spike", self.claim_dose)], to_h=False)
            out["lr_ramp"] += self.forks(hparams, prefix, a, sub, [("lr_ramp", d) for d in self.lr_ramp_doses],
                                         to_h=False)
            for kind, dose in self.env_doses.items():
                out[kind] += self.forks(hparams, prefix, a, sub, [(kind, dose)], to_h=False)
            for level in self.noise_levels.get(a, ()):
                out["noise"] += self.forks(hparams, prefix, a, sub, [("none", 1.0)], to_h=True, noise=level)
                out["noise"] += self.forks(hparams, prefix, a, sub, [("lr_spike", self.claim_dose)], to_h=False,
                                           noise=level)
        return out

    def stated(self, hparams: Mapping[str, Mapping[str, Any]]) -> tuple[list[RunSpec], dict[str, str]]:
        """:func:`stated_grid` of the plain learners among the arms, on the arms' seeds, at the claim's dose,
        ``stated_hparams`` over the arms': the spiked fresh runs and the unperturbed runs of their seeds.
        Where an arm's fresh runs train as its prefixes do (no ``stated_hparams``), its control is its
        matching prefix (:meth:`match_specs`: the same training up to the budget, evaluated at the same
        env steps), not a run of its own."""
        arms = [a for a in self.algos if a == arm_learner(a) and a in self.stated_steps]
        hp = {a: {**hparams[a], **self.stated_hparams.get(a, {})} for a in arms}
        specs, dropped = stated_grid(arms, {a: self.seeds_of(a) for a in arms}, self.stated_steps, at=self.stated_at,
                                     update=self.stated_update, dose=self.claim_dose, spike_updates=self.spike_updates,
                                     task=self.task, hparams=hp, eval_every=self.prefix_eval_every,
                                     log_every=self.log_every)
        match = self.match_specs(hparams)
        match_arm = arms_of(match, hparams)
        prefixes = {(match_arm[s.spec_hash], s.seed): s for s in match}
        own = [s.replace(perturbations=()) if self.stated_hparams.get(s.learner) else prefixes[(s.learner, s.seed)]
               for s in specs]
        return list(dict.fromkeys(specs + own)), dropped

    def plan(self, hparams: Mapping[str, Mapping[str, Any]],
             prefix: Mapping[str, Mapping[int, int]] | None = None) -> dict[str, list[RunSpec]]:
        """Every run of the design, for its cost (:func:`stabstudy.analysis.studies.rl.cost.worker_seconds`),
        ``prefix`` (arm -> seed -> env steps) where the prefixes stopped, else at their caps (the most they
        can cost): ``"prefixes"``, the first forks by group, ``"doses"`` (one short fork per prefix and dose
        step; their doses come from the outcomes, stand-ins of the same length), ``"stated"`` and
        ``"extensions (at most)"``: every short lr-spike fork run on to H, the most the drop rule adds."""
        prefix = prefix or {a: dict.fromkeys(self.seeds_of(a), int(self.prefix_cap[a])) for a in self.algos}
        out: dict[str, list[RunSpec]] = {"prefixes": self.match_specs(hparams, {a: max(p.values()) for a, p in prefix.items()})}
        out.update(self.first_forks(hparams, prefix))
        out["doses"] = [s for a in self.algos for i in range(len(self.dose_steps)) for s in self.forks(
            hparams, prefix, a, [s for s in self.seeds_of(a) if s in prefix.get(a, {})],
            [("lr_spike", self.claim_dose * (1 + 1e-3 * (i + 1)))], to_h=False)]
        out["stated"] = [s for s in self.stated(hparams)[0] if s.hp.get("match_return", "none") == "none"]  # not the prefixes
        short = [s for k, v in out.items() if k not in ("prefixes", "control", "stated") for s in v if s.perturbations
                 and s.perturbations[0].kind in self.extend_kinds]
        arms = arms_of(short, hparams)
        longer = [to_horizon(s, self.h(arms[s.spec_hash], hparams[arms[s.spec_hash]])) for s in short]
        out["extensions (at most)"] = [e for e, s in zip(longer, short, strict=True) if e != s]
        return {k: list(dict.fromkeys(v)) for k, v in out.items()}


def default_knob_as_same(table, hparams: Mapping[str, Mapping[str, Any]]):
    """``table`` (``runs.run_table`` rows of a noise grid) with ``noise_after_fork`` "same"
    where a fork's explicit knob equals its arm's own (``hparams[arm]``, e.g. PPO ``ent_coef`` 0):
    the noise grid keeps its default level apart from the main grid (another lead, its own controls,
    :func:`fork_grid` ``keep_knob``), and within the grid that level is the default that
    ``checks.knob_check_table`` and the paired knob changes compare the raised levels with."""
    def own(row):
        v, hp = row["noise_after_fork"], hparams.get(row["learner"], {})
        knob = NOISE_KNOB[arm_learner(row["learner"])]
        same = isinstance(v, int | float) and knob in hp and float(v) == float(hp[knob])
        return "same" if same else v

    return table.assign(noise_after_fork=table.apply(own, axis=1)) if len(table) else table


def stated_grid(algos: Sequence[str], seeds: Mapping[str, Iterable[int]], steps: Mapping[str, int], *, at: int = 2048,
                update: int = 2000, dose: float = 10.0, spike_updates: int = 0, task: str = "HalfCheetah-v5",
                hparams: Mapping[str, Mapping[str, Any]] | None = None, eval_every: Mapping[str, int] | None = None,
                log_every: int = 1) -> tuple[list[RunSpec], dict[str, str]]:
    """The claim as stated: one lr spike at env step ``at`` of a fresh run of ``steps[arm]`` env steps,
    per arm and seed (read against the unperturbed run of the same seed and hyperparameters, evaluated
    at the same env steps, ``eval_every``: :meth:`ForkDesign.stated`). Returns ``(specs, dropped)``,
    ``dropped``: ``{f"{arm}, {reading}": reason}`` for each reading an arm leaves out: "update
    {update}" as stable-baselines3 counts updates (:func:`env_step_of_update`) is not run where it ends
    after the budget, or where it falls within one spike window of env step ``at`` (the same spike); the
    env-step reading where no gradient update falls in its window (before ``learning_starts``)."""
    specs: list[RunSpec] = []
    dropped: dict[str, str] = {}
    for a in algos:
        hp = dict((hparams or {}).get(a, {}))
        full = _full(a, hp)
        spike = spike_env_steps(a, full, spike_updates)
        first_update = env_step_of_update(a, full, 1)
        upd = env_step_of_update(a, full, update)
        if upd + spike >= steps[a]:
            dropped[f"{a}, update {update}"] = (f"update {update} comes at env step {upd}, the spike does not end "
                                                f"before the budget of {steps[a]} env steps")
        elif abs(upd - at) < spike:
            dropped[f"{a}, update {update}"] = (f"update {update} comes at env step {upd}, within one spike window "
                                                f"({spike} env steps) of env step {at}: the same spike, run once")
        else:
            dropped[f"{a}, update {update}"] = (f"update {update} comes at env step {upd}: not run (the design "
                                                f"reads the claim at env step {at})")
        if at + spike >= steps[a]:
            dropped[f"{a}, env step {at}"] = f"the spike does not end before the budget of {steps[a]} env steps"
            continue
        if arm_learner(a) not in ON_POLICY and at + spike <= first_update:
            dropped[f"{a}, env step {at}"] = (f"no gradient update in the spike (env steps [{at}, {at + spike})): the "
                                              f"first comes at env step {first_update} (learning_starts)")
            continue
        for s in seeds[a]:
            specs.append(RunSpec("rl", arm_learner(a), task, int(steps[a]), int(s), hparams=hp,
                                 perturbations=(Perturbation("lr_spike", int(at), spike, float(dose)),),
                                 eval_every=int((eval_every or {}).get(a, 0)), log_every=int(log_every)))
    return list(dict.fromkeys(specs)), dropped


def geometric_points(low: float, high: float, points: int = 1) -> list[float]:
    """The ``points`` doses that split ``[low, high]`` into ``points + 1`` equal steps of log dose,
    rounded to 3 significant digits (so a dose reads as it is stored, and the same bracket always gives
    the same dose): ``points=1`` is the geometric midpoint ``sqrt(low * high)``."""
    if not (0 < low < high < np.inf):
        raise ValueError(f"a bracket needs 0 < low < high < inf, got [{low}, {high}]")
    if points < 1:
        raise ValueError(f"points must be at least 1, got {points}")
    return [float(f"{low * (high / low) ** (i / (points + 1)):.3g}") for i in range(1, int(points) + 1)]


# -- the horizon H: the env steps the prefixes needed to learn -------------------------------


def learning_horizon(curve: Any, frac: float = 0.8, final_points: int = 3) -> float:
    """Env steps a prefix trained from scratch needed to reach ``frac`` of its final return gain:
    the first evaluation at or above ``untrained + frac * (final - untrained)`` (untrained: its first
    evaluation; final: the mean of its last ``final_points``). NaN when it gained nothing or has
    fewer than two evaluations. ``curve``: 1-D over ``env_step`` (``eval_curves`` of one run)."""
    s, v = finite_pairs(curve)
    if s.size < 2:
        return np.nan
    gain = float(np.mean(v[-final_points:])) - v[0]
    if not gain > 0:
        return np.nan
    return float(s[np.argmax(v >= v[0] + frac * gain)])


def horizons(prefix_curves: xr.DataArray, frac: float = 0.8, final_points: int = 3):
    """:func:`learning_horizon` of every prefix of ``prefix_curves`` (``eval_curves`` of the prefix
    runs, with a ``learner`` coordinate) and per learner the median over its prefixes.
    Returns ``(per_prefix DataFrame [learner, spec_hash, horizon], {learner: H})``."""
    rows = [{"learner": str(prefix_curves["learner"].values[i]), "spec_hash": str(prefix_curves["spec_hash"].values[i]),
             "horizon": learning_horizon(prefix_curves.isel(run=i), frac, final_points)}
            for i in range(prefix_curves.sizes["run"])]
    per = pd.DataFrame(rows, columns=["learner", "spec_hash", "horizon"])
    return per, {a: float(np.nanmedian(g.horizon)) if g.horizon.notna().any() else np.nan
                 for a, g in per.groupby("learner")}
