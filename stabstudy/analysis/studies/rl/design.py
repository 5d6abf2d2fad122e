"""Notebook 01's design: which forks run, how long, at which doses, and the horizon H.

Every arm (a learner, or a variant such as ``ppo-tuned``: :func:`stabstudy.registry.arm_learner`)
trains one prefix per seed; forks of it are read against the paired control (the unperturbed fork of
the same prefix) over a horizon H that the prefixes' own learning curves set (:func:`horizons`). The
control and the forks at the claim's dose run to their event + H (:class:`ForkDesign`); every other
fork runs a short window first and is run on to H (:func:`to_horizon`) only when its return dropped
below the control's there: the long run repeats the short one bit for bit (same checkpoint, seed and
spec up to its length), so only the forks that need H pay for it. Which forks run in which round is
:class:`stabstudy.analysis.studies.rl.plan.ForkPlan`. The claim as stated (:func:`stated_grid`) is a
spike early in a fresh run.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
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


def horizon_steps(horizon: Mapping[str, float], prefix: Mapping[str, int], hparams: Mapping[str, Mapping[str, Any]],
                  at_least: Mapping[str, int] | None = None) -> dict[str, int]:
    """Each arm's horizon H (env steps after the event, :func:`horizons`)
    rounded up to its :func:`fork_unit`, so that a fork running to event + H ends where a fork may end.
    An arm whose prefixes gained nothing has no horizon (NaN): it gets its prefix length, the
    longest an H measured on that prefix could be. ``at_least`` (per arm, e.g. the short window,
    :meth:`ForkDesign.window`): no H is shorter, so a control reaches the end of every short fork
    of its prefix and a fork judged over H has at least the evaluations of a short one."""
    out = {}
    for a, p in prefix.items():
        h = horizon.get(a, np.nan)
        h = max(h if np.isfinite(h) and h > 0 else p, float((at_least or {}).get(a, 0)))
        out[a] = _round_up(h, fork_unit(a, (hparams or {}).get(a, {})))
    return out


def fork_grid(algos: Sequence[str], treatments: Sequence[tuple[str, float]], seeds: Iterable[int],
              prefix: Mapping[str, int], *, task: str = "HalfCheetah-v5",
              hparams: Mapping[str, Mapping[str, Any]] | None = None, lead: Mapping[str, int],
              post: Mapping[str, int] | None = None, horizon: Mapping[str, int] | None = None,
              spike_updates: int = 0, env_duration: int = 2048, eval_every: Mapping[str, int] | None = None,
              log_every: int = 1, noise_after_fork: Mapping[str, float] | None = None,
              keep_knob: bool = False) -> list[RunSpec]:
    """Forks of each arm's stored prefix (``prefix[arm]`` env steps): treatments x seeds.

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
        hp = {**((hparams or {}).get(a, {})), "prefix_steps": int(prefix[a])}
        full = _full(a, hp)
        knob = NOISE_KNOB[arm_learner(a)]
        if noise_after_fork and a in noise_after_fork and (keep_knob or float(noise_after_fork[a]) != full[knob]):
            hp["noise_after_fork"] = float(noise_after_fork[a])
        unit = fork_unit(a, full)
        if int(prefix[a]) % unit:  # here, not minutes later on a worker
            raise ValueError(f"{a}: prefix_steps {prefix[a]} must be a multiple of "
                             f"{'n_steps' if arm_learner(a) in ON_POLICY else 'train_freq'} = {unit} "
                             "(a fork point ends a train call)")
        start = int(prefix[a]) + int(lead[a])
        spike = spike_env_steps(a, full, spike_updates)
        window = max(spike, int(env_duration))
        steps = _round_up(start + (window + int(post[a]) if horizon is None else max(window, int(horizon[a]))), unit)
        for s in seeds:
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
    spec's without the fork's own (``prefix_steps``, ``noise_after_fork``). ``ValueError`` for a spec
    no arm or more than one arm describes."""
    own = {a: freeze_map(h, a) for a, h in hparams.items()}
    out = {}
    for s in specs:
        hp = {k: v for k, v in s.hp.items() if k not in ("prefix_steps", "noise_after_fork")}
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

#: H as a fraction of the prefix length before the prefixes are trained (for a cost estimate only): the
#: prefixes of the quick study of commit efa2e01 (results/quick/01_rl_algorithm_comparison.md, 3 seeds)
#: reached 80% of their return gain after about 150k of 250k (PPO), 45k of 70k (SAC) and 38k of 60k
#: (TD3) env steps (issue 26).
PLANNING_HORIZON_FRAC = 0.6


@dataclass(frozen=True)
class ForkDesign:
    """Notebook 01's fork grids; each field is the notebook parameter of the same name
    (:meth:`from_parameters`).

    :meth:`grids` gives, for one regime (a prefix length per arm): the lr-spike control and
    claim-dose forks, run to H (claims (a) and (b)), the other lr doses and the lr ramps (short window), and
    on the ``subset_seeds`` the action-noise, reward-scale and noise-knob grids (short; their controls to H)."""

    algos: tuple[str, ...]
    """arms of the comparison (learners or variants, :func:`stabstudy.registry.arm_learner`)"""
    seeds: tuple[int, ...]
    """one prefix per seed and arm: the independent units of claims (a) and (b)"""
    prefix_steps: Mapping[str, int]
    """env steps of each arm's prefix"""
    fork_lead: Mapping[str, int]
    """env steps from the fork to the perturbation"""
    fork_post: Mapping[str, int]
    """env steps a short fork runs after its perturbation window"""
    fork_eval_every: Mapping[str, int]
    """env steps between a fork's evaluations"""
    claim_dose: float
    """lr factor of claim (a), fixed before the runs: its forks run to H"""
    lr_doses: tuple[float, ...]
    """lr factors of the dose ladder (claim (b)); the claim dose among them or not"""
    subset_seeds: tuple[int, ...] = ()
    """the prefixes of the other grids (action noise, reward scale, noise knob) and of ``subset_arms``"""
    subset_arms: tuple[str, ...] = ()
    """arms that run on the subset seeds only"""
    task: str = "HalfCheetah-v5"
    """gymnasium env id"""
    lr_ramp_doses: tuple[float, ...] = ()
    """final factors of lr ramps (short forks of every prefix; notebook 04 reads them)"""
    action_noise_doses: tuple[float, ...] = ()
    """action-noise doses (subset seeds)"""
    reward_scale_doses: tuple[float, ...] = ()
    """reward factors (subset seeds)"""
    noise_levels: Mapping[str, Sequence[float]] = field(default_factory=dict)
    """each arm's own noise knob after the fork, levels (subset seeds; empty: no noise grid)"""
    noise_lead: Mapping[str, int] = field(default_factory=dict)
    """env steps from the fork to the spike in the noise grid (the knob acts that long first)"""
    noise_doses: tuple[float, ...] = ()
    """lr-spike doses at each knob level (short forks; empty: the claim's dose only)"""
    spike_updates: int = 0
    """gradient updates an lr spike covers (0: one PPO rollout's)"""
    env_pert_duration: int = 2048
    """env steps of an env-side perturbation"""
    log_every: int = 1
    """keep every this many telemetry rows"""
    bisections: int = 0
    """claim (b)'s bisection forks per prefix inside its bracket (one round; their doses come from the ladder's outcomes)"""
    long_prefix_steps: Mapping[str, int] = field(default_factory=dict)
    """the second regime's prefix lengths (lr grids only; empty: one regime), :func:`regimes`"""
    stated_at: int = 2048
    """the claim as stated: env step of the spike in a fresh run"""
    stated_update: int = 2000
    """the claim as stated: the spike at this update as stable-baselines3 counts them"""
    stated_steps: Mapping[str, int] = field(default_factory=dict)
    """the claim as stated: each arm's budget (env steps of its fresh runs; empty: not run)"""
    stated_hparams: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """the claim as stated: hyperparameters over the arm's (e.g. a small learning_starts)"""
    stated_eval_every: Mapping[str, int] = field(default_factory=dict)
    """the claim as stated: env steps between evaluations"""
    extend_kinds: tuple[str, ...] = ("lr_spike",)
    """perturbation kinds whose short forks run on to H where they dropped (the others' drops get no verdict)"""
    horizon_frac: float = 0.8
    """H is the env steps a prefix needed to reach this fraction of its return gain"""
    collapse_frac: float = 0.5
    """a fork dropped when its return fell below this fraction of its paired control's gain over the floor"""
    recover_frac: float = 0.8
    """a fork that dropped recovered when its last evaluations are back at this fraction by event + H"""

    @classmethod
    def from_parameters(cls, params: Mapping[str, Any]) -> ForkDesign:
        """The design of a notebook parameters mapping (extra names are ignored)."""
        names = [f.name for f in fields(cls)]
        missing = [n for n in names[:8] if n not in params]
        if missing:
            raise ValueError(f"ForkDesign needs the parameters {', '.join(missing)}")
        kw = {n: params[n] for n in names if n in params}
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in kw.items()})

    def seeds_of(self, arm: str) -> tuple[int, ...]:
        """The prefixes (seeds) of ``arm``."""
        return tuple(self.subset_seeds if arm in self.subset_arms else self.seeds)

    def prefix_forks(self, hparams: Mapping[str, Mapping[str, Any]]) -> dict[str, list[RunSpec]]:
        """Per regime, one unperturbed fork of every prefix (arm and seed) at its planning H: what
        ``stabstudy.learners.rl.forks.prefix_specs`` reads the prefixes of, before they exist."""
        out = {}
        for r, pre in self.regimes().items():
            h = horizon_steps({a: PLANNING_HORIZON_FRAC * n for a, n in pre.items()}, pre, hparams)
            out[r] = [s for s in self.grids(hparams, h, prefix=pre, lr_only=True)["lr_spike to H"] if not s.perturbations]
        return out

    def horizon(self, prefix_curves: xr.DataArray, hparams: Mapping[str, Mapping[str, Any]],
                prefix: Mapping[str, int]) -> tuple[pd.DataFrame, dict[str, int]]:
        """H of one regime (``prefix``: its prefix length per arm) from its prefixes' learning curves
        (``eval_curves`` with each run's arm as ``learner``): :func:`horizons` at ``horizon_frac``,
        rounded by :func:`horizon_steps` and never shorter than a short fork's :meth:`window`.
        Returns ``(per-prefix horizons, {arm: H})``."""
        per, h = horizons(prefix_curves, frac=self.horizon_frac)
        return per, horizon_steps(h, prefix, hparams, at_least={a: self.window(a, hparams[a]) for a in self.algos})

    def window(self, arm: str, hp: Mapping[str, Any]) -> int:
        """Env steps a short fork runs from its event: the perturbation window plus ``fork_post``."""
        return max(spike_env_steps(arm, hp, self.spike_updates), int(self.env_pert_duration)) + int(self.fork_post[arm])

    def grids(self, hparams: Mapping[str, Mapping[str, Any]], horizon: Mapping[str, int],
              prefix: Mapping[str, int] | None = None, lr_only: bool = False) -> dict[str, list[RunSpec]]:
        """The fork specs by grid: ``"lr_spike to H"`` (control and claim dose), ``"lr_spike short"``
        (the other doses), ``"lr_ramp"``, ``"action_noise"``, ``"reward_scale"``, ``"noise"`` (each level with its
        own control to H); ``prefix``: another regime's prefix lengths; ``lr_only``: only the first two."""
        prefix = {**self.prefix_steps, **(prefix or {})}
        kw = dict(task=self.task, hparams=hparams, lead=self.fork_lead, spike_updates=self.spike_updates,
                  env_duration=self.env_pert_duration, eval_every=self.fork_eval_every, log_every=self.log_every)
        short = [("lr_spike", d) for d in self.lr_doses if d != self.claim_dose]
        out: dict[str, list[RunSpec]] = {"lr_spike to H": [], "lr_spike short": [], "lr_ramp": [], "action_noise": [],
                                         "reward_scale": [], "noise": []}
        for a in self.algos:
            seeds, sub = self.seeds_of(a), [s for s in self.subset_seeds if s in self.seeds_of(a)]
            out["lr_spike to H"] += fork_grid([a], [("none", 1.0), ("lr_spike", self.claim_dose)], seeds, prefix,
                                              horizon=horizon, **kw)
            out["lr_spike short"] += fork_grid([a], short, seeds, prefix, post=self.fork_post, **kw)
            if lr_only:
                continue
            out["lr_ramp"] += fork_grid([a], [("lr_ramp", d) for d in self.lr_ramp_doses], seeds, prefix,
                                        post=self.fork_post, **kw)
            for kind, doses in (("action_noise", self.action_noise_doses), ("reward_scale", self.reward_scale_doses)):
                out[kind] += fork_grid([a], [(kind, d) for d in doses], sub, prefix, post=self.fork_post, **kw)
            for level in self.noise_levels.get(a, ()):
                nkw = {**kw, "lead": {**self.fork_lead, **self.noise_lead}, "noise_after_fork": {a: level},
                       "keep_knob": True}
                out["noise"] += fork_grid([a], [("none", 1.0)], sub, prefix, horizon=horizon, **nkw)
                out["noise"] += fork_grid([a], [("lr_spike", d) for d in self.noise_doses or (self.claim_dose,)], sub,
                                          prefix, post=self.fork_post, **nkw)
        return {k: list(dict.fromkeys(v)) for k, v in out.items()}

    def regimes(self) -> dict[str, dict[str, int]]:
        """:func:`regimes` of this design."""
        return regimes(self.prefix_steps, self.long_prefix_steps)

    def stated(self, hparams: Mapping[str, Mapping[str, Any]]) -> tuple[dict[str, list[RunSpec]], dict[str, str]]:
        """:func:`stated_grid` of the plain learners among the arms on the subset seeds (the claim's dose;
        ``stated_hparams`` over ``hparams``); nothing without ``stated_steps``."""
        arms = [a for a in self.algos if a == arm_learner(a) and a in self.stated_steps]
        return stated_grid(arms, self.subset_seeds, self.stated_steps, at=self.stated_at, update=self.stated_update,
                           dose=self.claim_dose, spike_updates=self.spike_updates, task=self.task,
                           hparams={a: {**hparams[a], **self.stated_hparams.get(a, {})} for a in arms},
                           eval_every=self.stated_eval_every, log_every=self.log_every)

    def plan(self, hparams: Mapping[str, Mapping[str, Any]],
             horizon: Mapping[str, Mapping[str, int]] | None = None) -> dict[str, list[RunSpec]]:
        """Every run of the design, for its cost (:func:`stabstudy.analysis.studies.rl.cost.worker_seconds`):
        ``"prefixes"`` (one per arm, seed and regime), the grids of every regime (the second regime's lr
        grids only), ``bisections`` stand-in forks per prefix (their doses are known only from the ladder's
        outcomes), ``"stated"``, and ``"extensions (at most)"``: every short fork run on to H, the most
        the drop rule adds. ``horizon``: per regime and arm (measured); default
        :data:`PLANNING_HORIZON_FRAC` of each prefix length (a regime absent from ``horizon`` too)."""
        out: dict[str, list[RunSpec]] = {"prefixes": []}
        for r, pre in self.regimes().items():
            h = (horizon or {}).get(r) or horizon_steps({a: PLANNING_HORIZON_FRAC * n for a, n in pre.items()}, pre, hparams,
                                                        at_least={a: self.window(a, hparams[a]) for a in self.algos})
            g = self.grids(hparams, h, prefix=pre, lr_only=r != "return-matched")
            # the bisection forks' doses come from the ladder's outcomes: stand-ins of the same length for the cost
            stand_in = [("lr_spike", self.claim_dose * (1 + 1e-3 * (i + 1))) for i in range(int(self.bisections))]
            g["lr_spike bisection (stand-ins)"] = [x for a in self.algos for x in fork_grid(
                [a], stand_in, self.seeds_of(a), pre, post=self.fork_post, task=self.task, hparams=hparams,
                lead=self.fork_lead, spike_updates=self.spike_updates, env_duration=self.env_pert_duration,
                eval_every=self.fork_eval_every, log_every=self.log_every)]
            arms = arms_of([x for v in g.values() for x in v], hparams)
            for s in g["lr_spike to H"]:
                if not s.perturbations:
                    out["prefixes"].append(s.replace(steps=pre[arms[s.spec_hash]], eval_every=0))
            for k, v in g.items():
                out.setdefault(k, []).extend(v)
            out.setdefault("extensions (at most)", []).extend(self.upper_bound(g, h, arms))
        out["stated"] = [s for v in self.stated(hparams)[0].values() for s in v]
        return {k: list(dict.fromkeys(v)) for k, v in out.items()}

    def bisection_forks(self, hparams: Mapping[str, Mapping[str, Any]], doses, prefixes: Mapping[str, RunSpec]) -> list[RunSpec]:
        """Short lr-spike forks at the doses of ``doses`` (``outcomes.bisection_doses`` rows:
        ``learner`` the arm, ``prefix`` its prefix's spec hash, ``dose``), each of its own prefix
        (``prefixes``: hash -> prefix spec); then the drop rule, like every short fork."""
        kw = dict(task=self.task, hparams=hparams, lead=self.fork_lead, spike_updates=self.spike_updates,
                  env_duration=self.env_pert_duration, eval_every=self.fork_eval_every, log_every=self.log_every,
                  post=self.fork_post)
        out = []
        for r in doses.itertuples():
            p = prefixes[str(r.prefix)]
            out += fork_grid([r.learner], [("lr_spike", float(r.dose))], [p.seed], {r.learner: p.steps}, **kw)
        return list(dict.fromkeys(out))

    def upper_bound(self, grids: Mapping[str, Sequence[RunSpec]], horizon: Mapping[str, int],
                    arms: Mapping[str, str]) -> list[RunSpec]:
        """Every short fork of ``grids`` run on to H (:func:`to_horizon`; ``arms``: spec hash -> arm,
        :func:`arms_of`): the most the drop rule can add, for a cost estimate."""
        runs = [s for g in grids.values() for s in g if s.perturbations and s.hp.get("prefix_steps")]
        return [e for s in runs if (e := to_horizon(s, horizon[arms[s.spec_hash]])) != s]


def regimes(prefix_steps: Mapping[str, int], long_prefix_steps: Mapping[str, int] | None = None) -> dict[str, dict[str, int]]:
    """The prefix regimes of notebook 01: ``"return-matched"`` (``prefix_steps``: SAC's and TD3's
    prefixes stop where their return is near PPO's) and, when ``long_prefix_steps`` names arms,
    ``"long prefixes"`` (those arms' lengths replaced; the other arms' prefixes are shared)."""
    out = {"return-matched": dict(prefix_steps)}
    if long_prefix_steps:
        unknown = sorted(set(long_prefix_steps) - set(prefix_steps))
        if unknown:
            raise ValueError(f"long_prefix_steps names arms without a prefix: {unknown}; arms: {', '.join(prefix_steps)}")
        out["long prefixes"] = {**prefix_steps, **long_prefix_steps}
    return out


def default_knob_as_same(table, hparams: Mapping[str, Mapping[str, Any]]):
    """``table`` (``runs.summarize`` rows of a noise grid) with ``noise_after_fork`` "same"
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


def stated_grid(algos: Sequence[str], seeds: Iterable[int], steps: Mapping[str, int], *, at: int = 2048,
                update: int = 2000, dose: float = 10.0, spike_updates: int = 0, task: str = "HalfCheetah-v5",
                hparams: Mapping[str, Mapping[str, Any]] | None = None, eval_every: Mapping[str, int] | None = None,
                log_every: int = 1) -> tuple[dict[str, list[RunSpec]], dict[str, str]]:
    """The claim as stated: one lr spike early in a fresh run, against the unperturbed run of the same
    seed at the full budget (``steps[arm]`` env steps). Two readings of the paper's "step":
    ``"env step {at}"`` (PPO: the first rollout end at or after it) and ``"update {update}"`` as
    stable-baselines3 counts updates (:func:`env_step_of_update`). Returns ``(grids, dropped)``:
    ``{reading: specs}`` (the control and the spiked run per arm and seed; where both readings give one
    window the runs are shared) and ``{f"{arm}, {reading}": reason}`` for the readings an arm leaves out
    (the window does not end before its budget, or no gradient update falls in it: SAC/TD3 make none
    before ``learning_starts``)."""
    out: dict[str, list[RunSpec]] = {f"env step {at}": [], f"update {update}": []}
    dropped: dict[str, str] = {}
    seeds = list(seeds)
    for a in algos:
        hp = dict((hparams or {}).get(a, {}))
        full = _full(a, hp)
        spike = spike_env_steps(a, full, spike_updates)
        first_update = env_step_of_update(a, full, 1)
        for reading, start in ((f"env step {at}", int(at)), (f"update {update}", env_step_of_update(a, full, update))):
            if start + spike >= steps[a]:
                dropped[f"{a}, {reading}"] = (f"the spike (env steps [{start}, {start + spike})) does not end before "
                                              f"the budget of {steps[a]} env steps")
                continue
            if arm_learner(a) not in ON_POLICY and start + spike <= first_update:
                dropped[f"{a}, {reading}"] = (f"no gradient update in the spike (env steps [{start}, {start + spike})): "
                                              f"the first comes at env step {first_update} (learning_starts)")
                continue
            for s in seeds:
                for pert in ((), (Perturbation("lr_spike", start, spike, float(dose)),)):
                    out[reading].append(RunSpec("rl", arm_learner(a), task, int(steps[a]), int(s), hparams=hp,
                                                perturbations=pert, eval_every=int((eval_every or {}).get(a, 0)),
                                                log_every=int(log_every)))
    return {k: list(dict.fromkeys(v)) for k, v in out.items()}, dropped


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
