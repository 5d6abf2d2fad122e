"""Notebook 05 (closed-loop monitor): the paired-counterfactual grid, threshold calibration,
per-run outcomes, the paired table and the claims.

Design. Per domain (small GPT ``lm``, toy MLP ``toy``, and an RL learner, ``ppo``, forked from
notebook 01's trained prefixes), seed and event (a perturbation near its
critical dose), twins share the seed and hence the data order: the *uncontrolled* run, one run per
*controller*, and per controller the *unperturbed-but-controlled* run; the unperturbed uncontrolled
run of the seed is the reference of every outcome. A controller is the learner hyperparameter
``controller`` (:mod:`stabstudy.interventions.control`), so its runs are cached like any other.

Thresholds. Our controllers (robust z of log grad norm and loss), the OLMo rule (z of the raw
values over 128 steps) and ZClip (its EMA z of the grad norm) are calibrated to one false-alarm
budget (alarm steps per 1,000 steps) on the unperturbed uncontrolled runs of the calibration seeds,
by replaying the same streaming detectors over the stored channels: with no alarm, a controller
changes nothing, so the replay sees what the controller would have seen. Fixed clipping at 1.0 and
the non-finite skip have no threshold. False interventions and intrusiveness are measured on the
other seeds only. RL runs store the gradient norm after SB3's clipping (pinned at PPO's 0.5), not the
pre-clip norm the controller reads, so an RL domain's robust z is calibrated on *watch* runs
instead: the unperturbed fork with a controller whose threshold no score reaches (bit-identical to
the run without it), which files the score it would have compared (``controller_score``); the
other rules keep their published thresholds there.

Outcomes per run: ``final`` (mean training loss over the last ``final_window`` steps), ``diverged``,
``collapse`` (diverged, or ``final`` more than ``collapse_excess[domain]`` nats above the
reference's), ``damage`` (``final`` minus the reference's; NaN when diverged), ``recovery`` (steps
from the onset until the smoothed loss is back within ``recover_excess[domain]`` nats of the
reference's; NaN if never), ``first_action`` (steps from the onset to the first intervention at or
after it), interventions per 1,000 steps. Losses are cross-entropies in nats in both domains.
An RL domain (``ppo``) continues notebook 01's independently trained prefixes: its uncontrolled
forks are those notebook 01 recorded in its grid manifest (:func:`forks_of`; without one, built from
the parameters as notebook 01 builds them, :func:`rl_grid`), and a controlled fork is the same fork
with a controller (:func:`with_controllers`). Its outcomes pair every run with the unperturbed
uncontrolled fork of its prefix at the same env steps (:func:`.rl.outcomes.paired_outcome`):
``collapse`` its collapse rule over the window after the event (or diverged), ``damage`` the return
lost against that fork as a fraction of the return ``scale`` (so that it reads as the losses' nats,
"larger is worse"), ``recovery`` in env steps; steps are updates. The unit of its claims is the
prefix, not the fork (:func:`unit_pairs`): forks of one prefix at several doses share its training;
in the GPT and toy domains the seed, for the same reason.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pandas as pd
import xarray as xr
from scipy import stats as sps

from stabstudy.analysis import claims as C
from stabstudy.analysis import power as PW
from stabstudy.analysis import stats
from stabstudy.analysis.plan import Planned
from stabstudy.analysis.studies import lm_spikes
from stabstudy.analysis.studies.rl import curves, design, runs
from stabstudy.analysis.studies.rl import outcomes as rl_paired
from stabstudy.analysis.warning.evaluation import before_clip
from stabstudy.hparams import field_docs
from stabstudy.online import RobustZ, WindowZ, ZClipZ
from stabstudy.spec import Perturbation, RunSpec

SOURCE = "source paper (arXiv 2601.13160)"
#: Toy runs evaluate every this many steps (the learner's default, 100 evaluations, would cost 7x the training).
TOY_EVAL_EVERY = 10
#: Our controllers (a robust-z detector, one action each) and the comparators.
OURS = ("z_skip", "z_lr", "z_adam", "z_rollback", "z_clip")
COMPARATORS = ("olmo", "zclip", "clip1", "nonfinite")
#: Which calibrated threshold each controller takes.
CALIBRATED = {**{c: "z" for c in OURS}, "olmo": "olmo", "zclip": "zclip"}


def base_spec(domain: str, steps: int, seed: int, perturbations: tuple[Perturbation, ...] = (),
              **hp: Any) -> RunSpec:
    """A run of the study: ``lm`` as notebooks 02 and 04 build it (so their stored runs are shared),
    ``toy`` an Adam MLP on digits."""
    if domain == "lm":
        return lm_spikes.base_spec(steps, seed, perturbations=perturbations, **hp)
    if domain == "toy":
        return RunSpec(domain="toy", learner="adam", task="digits", steps=steps, seed=seed, hparams=hp,
                       perturbations=perturbations, eval_every=TOY_EVAL_EVERY)
    raise ValueError(f"unknown domain {domain!r}; valid: lm, toy")


def _events(event_step: int, events: Sequence[Sequence[Any]]) -> list[tuple[Perturbation, ...]]:
    return [(Perturbation(str(k), event_step, int(d), dose=float(x)),) for k, x, d in events]


def uncontrolled_grid(domain: str, steps: int, seeds: Sequence[int], event_step: int,
                      events: Sequence[Sequence[Any]], *, unperturbed: bool = True, **hp: Any) -> list[RunSpec]:
    """Per seed: the unperturbed run (unless ``unperturbed`` is False) and one run per ``[kind, dose,
    duration]`` event, no controller."""
    return [base_spec(domain, steps, s, p, **hp) for s in seeds
            for p in [*([()] if unperturbed else []), *_events(event_step, events)]]


def controlled_grid(domain: str, steps: int, seeds: Sequence[int], event_step: int,
                    events: Sequence[Sequence[Any]], controllers: Sequence[str], thresholds: dict[str, float],
                    *, unperturbed: bool = True, **hp: Any) -> list[RunSpec]:
    """Per seed and controller: the unperturbed-but-controlled run (unless ``unperturbed`` is False)
    and one controlled run per event; calibrated controllers carry their threshold
    (``thresholds[CALIBRATED[name]]``)."""
    out = []
    for name in controllers:
        h = {**hp, "controller": name}
        if name in CALIBRATED:
            h["controller_threshold"] = float(thresholds[CALIBRATED[name]])
        out += uncontrolled_grid(domain, steps, seeds, event_step, events, unperturbed=unperturbed, **h)
    return out


def published_grid(domain: str, steps: int, seeds: Sequence[int], event_step: int,
                   events: Sequence[Sequence[Any]], controllers: Sequence[str], thresholds: dict[str, float],
                   *, unperturbed: bool = True, **hp: Any) -> list[RunSpec]:
    """The comparators among ``controllers`` (not ours) whose calibrated threshold differs from the
    published one, again at the published threshold (:data:`PUBLISHED`); pass them to
    :func:`run_table` as ``published`` to label them ``name@published``."""
    names = [c for c in controllers if c in CALIBRATED and c not in OURS
             and float(thresholds[CALIBRATED[c]]) != PUBLISHED[CALIBRATED[c]]]
    return controlled_grid(domain, steps, seeds, event_step, events, names, PUBLISHED, unperturbed=unperturbed,
                           **hp)


def twin_grid(domain: str, steps: int, seeds: Sequence[int], evaluation_seeds: Sequence[int], event_step: int,
              events: Sequence[Sequence[Any]], controllers: Sequence[str], thresholds: dict[str, float], *,
              primary: str | None = None, comparators: Sequence[str] = (), published: bool = True,
              **hp: Any) -> tuple[list[RunSpec], list[RunSpec]]:
    """The controlled twins of a GPT or toy domain, ``(specs, published)``: without ``primary``, every
    controller on the seeds that are not evaluation seeds (they choose the controller under test,
    :func:`choose_primary`); with it, on the ``evaluation_seeds``, the controller under test
    (unperturbed and perturbed) and the comparators among ``controllers`` that a claim names
    (perturbed only: the claims compare damage), ``name@published`` among them (:func:`published_grid`)
    where ``published``. Each run the claims do not read costs a run the units could have had."""
    if primary is None:
        seeds = [s for s in seeds if s not in set(evaluation_seeds)]
        return controlled_grid(domain, steps, seeds, event_step, events, controllers, thresholds, **hp), []
    named = {c.split("@")[0] for c in comparators}
    comps = [c for c in controllers if c in named and c != primary]
    specs = controlled_grid(domain, steps, evaluation_seeds, event_step, events, [primary], thresholds, **hp)
    specs += controlled_grid(domain, steps, evaluation_seeds, event_step, events, comps, thresholds,
                             unperturbed=False, **hp)
    pub = [c.split("@")[0] for c in comparators if c.endswith("@published")]
    extra = published_grid(domain, steps, evaluation_seeds, event_step, events, [c for c in comps if c in pub],
                           thresholds, unperturbed=False, **hp) if published else []
    return specs + extra, extra


#: A controller threshold no score reaches: a *watch* run (bit-identical to the uncontrolled one)
#: that files the scores its controller would have compared.
WATCH = 1e9


#: Hyperparameters that set only what a run records, not how it trains: two forks that differ in them
#: are forks of one arm (notebook 01 may evaluate more episodes than notebook 05's parameters say).
RECORDING = ("eval_episodes", "eval_max_steps", "monitor_every")


def _arm(hp: dict[str, Any]) -> dict[str, Any]:
    """What a fork trains with: its hyperparameters less the recording ones, the fork point and what acts after it."""
    return {k: v for k, v in hp.items() if k not in (*RECORDING, "prefix_steps", "noise_after_fork")
            and not k.startswith("controller")}


def forks_of(specs: Sequence[RunSpec], learner: str, events: Sequence[Sequence[Any]], hp: dict[str, Any],
             ) -> list[RunSpec]:
    """Notebook 01's forks (the specs of its grid manifest, :func:`stabstudy.run.grids.load_grid`) that
    this study pairs: those of ``learner`` that train with ``hp`` (recording cadence aside, so that
    another arm of the same learner, such as a tuned PPO, is left out), with the prefix's own noise
    knob, unperturbed or with one perturbation matching an ``[kind, dose]`` of ``events``. Every
    prefix keeps its unperturbed fork (the control) and a fork per event; ``ValueError`` naming what the
    manifest holds when the arm, an event or a control is missing."""
    arm = [s for s in specs if s.domain == "rl" and s.learner == learner and "noise_after_fork" not in s.hp
           and _arm(s.hp) == _arm(hp)]
    if not arm:
        held = sorted({f"{s.learner} {_arm(s.hp)}" for s in specs if s.domain == "rl"})
        raise ValueError(f"no {learner} fork in notebook 01's grid trains with {_arm(hp)}; it holds: {held}")
    wanted = {(str(k), float(d)) for k, d, *_ in events}
    out = [s for s in arm if not s.perturbations
           or (len(s.perturbations) == 1 and (s.perturbations[0].kind, s.perturbations[0].dose) in wanted)]
    have = {(p.kind, p.dose) for s in out for p in s.perturbations}
    if wanted - have:
        ran = sorted({(p.kind, p.dose) for s in arm for p in s.perturbations})
        raise ValueError(f"notebook 01 ran no {learner} fork at {sorted(wanted - have)}; it ran {ran}")
    no_control = sorted({s.seed for s in out} - {s.seed for s in out if not s.perturbations})
    if no_control:
        raise ValueError(f"{learner} seeds {no_control} have no unperturbed fork in notebook 01's grid")
    return out


def prefixes_of(prefixes: Sequence[RunSpec], forks: Sequence[RunSpec]) -> dict[int, RunSpec]:
    """Seed -> the prefix among ``prefixes`` (notebook 01's matching prefixes, its manifest's group
    ``prefixes``) that the ``forks`` of that seed continue: same learner, hyperparameters (less the
    matching target) and seed. ``ValueError`` naming the seeds without one."""
    out = {}
    for f in forks:
        hit = [p for p in prefixes if p.learner == f.learner and p.seed == f.seed
               and {k: v for k, v in _arm(p.hp).items() if k != "match_return"} == _arm(f.hp)]
        if len(hit) == 1:
            out[f.seed] = hit[0]
    missing = sorted({f.seed for f in forks} - set(out))
    if missing:
        raise ValueError(f"no prefix of seeds {missing} among notebook 01's prefixes for {forks[0].learner}")
    return out


def clipped(specs: Sequence[RunSpec], length: int) -> list[RunSpec]:
    """Each fork of ``specs`` ending ``length`` env steps after its fork point (rounded up to its fork
    unit) where it ran longer: a controlled twin need not run to notebook 01's H when every pair is
    judged over the short window."""
    out = []
    for s in specs:
        unit = design.fork_unit(s.learner, s.hp)
        end = -(-(int(s.hp["prefix_steps"]) + int(length)) // unit) * unit
        out.append(s.replace(steps=min(s.steps, end)))
    return out


def with_controllers(specs: Sequence[RunSpec], controllers: Sequence[str], thresholds: dict[str, float] | None, *,
                     controller_hp: dict[str, Any] | None = None,
                     per_controller: dict[str, dict[str, Any]] | None = None) -> list[RunSpec]:
    """Per controller, the twin of every fork of ``specs``: the same fork (same prefix, same
    continuation) with the controller (``controller_hp`` and its own ``per_controller[name]``); a
    calibrated controller carries ``thresholds[CALIBRATED[name]]`` (None: watch runs, :data:`WATCH`)."""
    out = []
    for name in controllers:
        h = {**(controller_hp or {}), **(per_controller or {}).get(name, {}), "controller": name}
        if name in CALIBRATED:
            h["controller_threshold"] = WATCH if thresholds is None else float(thresholds[CALIBRATED[name]])
        out += [s.replace(hparams={**s.hp, **h}) for s in specs]
    return out


def rl_grid(learner: str, seeds: Sequence[int], events: Sequence[Sequence[Any]], controllers: Sequence[str],
            thresholds: dict[str, float] | None, *, hp: dict[str, Any], prefix_steps: int,
            controller_hp: dict[str, Any] | None = None, per_controller: dict[str, dict[str, Any]] | None = None,
            **fork_kw: Any) -> list[RunSpec]:
    """Without notebook 01's manifest: forks of ``learner``'s prefixes built from the parameters as
    notebook 01 builds them (:func:`.rl.design.fork_grid` with ``hp`` and ``fork_kw``): per seed
    the unperturbed fork and one per ``[kind, dose]`` event, uncontrolled, then their twins per
    controller (:func:`with_controllers`)."""
    treatments = [("none", 1.0), *((str(k), float(d)) for k, d, *_ in events)]
    kw = {"env_duration": 0, **fork_kw}  # an lr spike sets the horizon (notebook 01: one rollout)
    free = design.fork_grid([learner], treatments, seeds, {learner: prefix_steps}, hparams={learner: hp}, **kw)
    return free + with_controllers(free, controllers, thresholds, controller_hp=controller_hp,
                                   per_controller=per_controller)


def watch_grid(specs: Sequence[RunSpec], seeds: Sequence[int], *, window: int = 64) -> list[RunSpec]:
    """The watch twins of the unperturbed uncontrolled forks of ``seeds`` among ``specs``: our robust z
    at an unreachable threshold."""
    null = [s for s in specs if not s.perturbations and "controller" not in s.hp and s.seed in set(seeds)]
    return with_controllers(null, ["z_skip"], None, controller_hp={"controller_window": window})


def domain_of(spec: RunSpec) -> str:
    """The domain name of the study: ``lm``, ``toy``, or the RL learner (``ppo``)."""
    return spec.learner if spec.domain == "rl" else spec.domain


def run_table(specs: Sequence[RunSpec], published: Sequence[RunSpec] = (),
              prefix_of: dict[str, str] | None = None) -> pd.DataFrame:
    """One row per spec (index: spec hash): domain, seed, controller (``name@published`` for the
    specs in ``published``), event (``kind xdose/duration`` or ``none``), onset (RL: env step), the
    threshold given, ``prefix`` (``prefix_of[hash]``: the prefix an RL fork continues, the unit of its
    claims; empty for a run from scratch) and ``fork_at`` (its ``prefix_steps``, 0 from scratch)."""
    rows = []
    pub = {s.spec_hash for s in published}
    for s in dict.fromkeys([*specs, *published]):
        hp = s.hp
        p = s.perturbations[0] if s.perturbations else None
        name = str(hp.get("controller", "none"))
        rows.append({"run": s.spec_hash, "domain": domain_of(s), "seed": s.seed, "steps": s.steps,
                     "controller": f"{name}@published" if s.spec_hash in pub else name,
                     "threshold": float(hp.get("controller_threshold", math.nan)),
                     "event": f"{p.kind} x{p.dose:g}/{p.duration}" if p else "none",
                     "onset": p.start if p else -1, "prefix": (prefix_of or {}).get(s.spec_hash, ""),
                     "fork_at": int(hp.get("prefix_steps", 0))})
    return pd.DataFrame(rows).set_index("run")


# -- calibration ------------------------------------------------------------------------------
def replay_scores(grad_norm: np.ndarray, loss: np.ndarray, window: int = 64) -> dict[str, np.ndarray]:
    """Per-step scores of the calibrated detectors streamed over one run's channels, as the
    controllers compute them: ``z`` (max of the robust z of log10 grad norm and log10 loss),
    ``olmo`` (max of the WindowZ of the raw loss and grad norm, 128 steps), ``zclip`` (ZClip's z)."""
    n = len(grad_norm)
    out = {k: np.full(n, np.nan) for k in ("z", "olmo", "zclip")}
    zg, zl = (RobustZ(window=window, min_periods=max(window // 4, 4), side="up") for _ in range(2))
    og, ol, zc = WindowZ(min_periods=63), WindowZ(min_periods=63), ZClipZ()  # OLMo-core: 64 values with the latest
    with np.errstate(divide="ignore", invalid="ignore"):
        lg, ll = np.log10(grad_norm), np.log10(loss)
    for t in range(n):
        out["z"][t] = np.fmax(zg.update(lg[t]), zl.update(ll[t]))
        out["olmo"][t] = np.fmax(og.update(grad_norm[t]), ol.update(loss[t]))
        out["zclip"][t] = zc.update(grad_norm[t])
    return out


#: The published thresholds (our robust z: the controllers' default), the calibration's floors.
PUBLISHED = {"z": 6.0, "olmo": 6.0, "zclip": 2.5}


def calibrate(ds: xr.Dataset, runs: Sequence[str], budget: float, window: int = 64,
              floor: dict[str, float] | None = None) -> pd.DataFrame:
    """Thresholds giving at most ``budget`` alarm steps per 1,000 steps on ``runs`` (unperturbed,
    uncontrolled): the smallest threshold above all but ``floor(budget * steps / 1000)`` scores,
    never below ``floor`` (default :data:`PUBLISHED`): a short calibration run whose largest score is
    small must not make a rule more trigger-happy than its authors' default. Returns one row per
    detector: threshold, ``calibrated`` (before the floor), steps, alarms allowed, and the run and
    step of the score that set ``calibrated`` (``set_by_run``, ``set_by_step``): with few steps
    one excursion of an unperturbed run can set it. The rules judge the gradient norm before
    clipping, as the live controllers do (:func:`~stabstudy.analysis.warning.evaluation.before_clip`)."""
    floor = floor or PUBLISHED
    ds = before_clip(ds)
    scores: dict[str, list[pd.Series]] = {k: [] for k in ("z", "olmo", "zclip")}
    for r in runs:
        sc = replay_scores(ds.grad_norm.sel(run=r).values, ds.loss.sel(run=r).values, window)
        ok = np.isfinite(ds.loss.sel(run=r).values)
        for k, v in sc.items():
            scores[k].append(_scored(r, ds.step.values[ok], v[ok]))
    return pd.DataFrame([_threshold(k, pd.concat(v) if v else _scored("", [], []), budget, floor[k])
                         for k, v in scores.items()]).set_index("detector")


def _scored(run: str, steps: Any, values: Any) -> pd.Series:
    return pd.Series(np.asarray(values, dtype=float),
                     index=pd.MultiIndex.from_arrays([[run] * len(steps), np.asarray(steps, dtype=int)],
                                                     names=["run", "step"]))


def _threshold(detector: str, s: pd.Series, budget: float, floor: float) -> dict[str, Any]:
    n = int(s.size)
    allowed = int(math.floor(budget * n / 1000))
    fin = s[np.isfinite(s.to_numpy())].sort_values(ascending=False, kind="stable")
    cal, run, step = math.nan, "", -1
    if fin.size > allowed:
        cal = float(f"{float(fin.iloc[allowed]) * 1.0001:.4g}")  # just above: '>' alarms
        run, step = fin.index[allowed]
    thr = max(cal, floor) if math.isfinite(cal) else floor
    return {"detector": detector, "threshold": thr, "calibrated": cal, "steps": n, "alarms_allowed": allowed,
            "set_by_run": str(run), "set_by_step": int(step)}


def calibrate_watch(ds: xr.Dataset, runs: Sequence[str], budget: float, floor: dict[str, float] | None = None,
                    ) -> pd.DataFrame:
    """:func:`calibrate` for an RL domain: our robust z from the ``controller_score`` its watch
    ``runs`` filed per update; ``olmo`` and ``zclip`` at their published thresholds
    (``calibrated`` NaN: not calibrated)."""
    if not len(runs):
        raise ValueError("calibrate_watch: no run given; pass the watch runs of the calibration seeds (watch_grid)")
    floor = floor or PUBLISHED
    parts = []
    for r in runs:
        ok = np.isfinite(ds.lr.sel(run=r).values)  # the rows of updates
        parts.append(_scored(r, ds.step.values[ok], ds.controller_score.sel(run=r).values[ok]))
    rows = [_threshold("z", pd.concat(parts), budget, floor["z"])]
    rows += [{"detector": k, "threshold": floor[k], "calibrated": math.nan, "steps": rows[0]["steps"],
              "alarms_allowed": rows[0]["alarms_allowed"], "set_by_run": "", "set_by_step": -1}
             for k in ("olmo", "zclip")]
    return pd.DataFrame(rows).set_index("detector")


# -- outcomes ---------------------------------------------------------------------------------
def _smooth(x: np.ndarray, w: int) -> np.ndarray:
    return pd.Series(x).rolling(w, min_periods=1).mean().to_numpy()


def outcomes(ds: xr.Dataset, table: pd.DataFrame, *, collapse_excess: dict[str, float],
             recover_excess: dict[str, float], final_window: int = 20, smooth: int = 10) -> pd.DataFrame:
    """Per run of ``table`` (rows of :func:`run_table` loaded in ``ds``): the module docstring's
    outcomes against the unperturbed uncontrolled run of the same domain and seed."""
    ref = table[(table.controller == "none") & (table.event == "none")]
    ref_of = {(r.domain, r.seed): i for i, r in ref.iterrows()}
    rows = []
    for run, r in table.iterrows():
        if run not in ds.run.values or (r.domain, r.seed) not in ref_of:
            continue
        loss = ds.loss.sel(run=run).values[: r.steps]
        rloss = ds.loss.sel(run=ref_of[(r.domain, r.seed)]).values[: r.steps]
        diverged = str(ds.status.sel(run=run).values) == "diverged" or not np.isfinite(loss[-final_window:]).all()
        fin = float(np.mean(loss[-final_window:])) if not diverged else math.nan
        rfin = float(np.nanmean(rloss[-final_window:]))
        iv = ds.intervened.sel(run=run).values[: r.steps] if "intervened" in ds else np.full(r.steps, np.nan)
        iv = np.nan_to_num(iv, nan=0.0)  # an uncontrolled run never intervenes
        n_steps = int(np.isfinite(loss).sum())
        row = {"run": run, **r.to_dict(), "diverged": bool(diverged), "final": fin, "ref_final": rfin,
               "collapse": float(diverged or fin > rfin + collapse_excess[r.domain]), "damage": fin - rfin,
               "interventions": int(iv.sum()), "per_1k": 1000 * float(iv.sum()) / max(n_steps, 1),
               "n_steps": n_steps, "recovery": math.nan, "first_action": math.nan}
        if r.onset >= 0:
            on = int(r.onset)
            after = np.flatnonzero(iv[on:] > 0)
            row["first_action"] = float(after[0]) if after.size else math.nan
            if not diverged:
                s, rs = _smooth(loss, smooth), _smooth(rloss, smooth)
                ok = np.flatnonzero(s[on + 1:] <= rs[on + 1:] + recover_excess[r.domain])
                row["recovery"] = float(ok[0] + 1) if ok.size else math.nan
        rows.append(row)
    return pd.DataFrame(rows).set_index("run")


def rl_outcomes(ds: xr.Dataset, table: pd.DataFrame, *, scale: float, floors: dict[str, float],
                horizon: float = math.inf, frac: float = 0.5, lag_frac: float = 0.0, final_points: int = 3,
                min_after: int = 2, min_gain: float = 1e-8) -> pd.DataFrame:
    """:func:`outcomes` for an RL domain: every run of ``table`` against the unperturbed uncontrolled
    fork of its prefix (the reference), both read at the same env steps
    (:func:`.rl.outcomes.paired_outcome` with ``floors``, ``frac``, ``final_points``, ``min_after``,
    ``min_gain``, and a lag of ``lag_frac`` of the window) from the event (an unperturbed run: from the fork) over ``horizon`` env steps or
    to the end of the pair's evaluations, whichever is shorter (``window``); a run that diverged is
    at its floor after it stopped. ``collapse``: diverged, or collapsed in that window (NaN: no
    verdict, with ``reason``); ``damage``: the return lost against the reference over its last
    ``final_points`` common evaluations, as a fraction of ``scale`` (larger is worse, as the
    losses' nats); ``final``: the mean of the last evaluation returns (NaN when diverged), for the
    intrusiveness test; ``recovery`` in env steps; steps are updates (rows)."""
    summ = runs.run_table(ds, final_points=final_points).set_index("spec_hash")
    index = {str(h): i for i, h in enumerate(ds.run.values)}
    ref = table[(table.controller == "none") & (table.event == "none")]
    ref_of = {(r.domain, r.prefix or r.seed): i for i, r in ref.iterrows()}
    rows = []
    for run, r in table.iterrows():
        key = (r.domain, r.prefix or r.seed)
        if run not in summ.index or key not in ref_of or ref_of[key] not in index:
            continue
        m, h0 = summ.loc[run], ref_of[key]
        upd = np.isfinite(ds.lr.sel(run=run).values)  # the rows of updates this run made
        iv = np.nan_to_num(ds.intervened.sel(run=run).values)[upd]
        pert = np.nan_to_num(ds.perturbed.sel(run=run).values)[upd]
        diverged = m.status == "diverged"
        curve = curves.eval_curves(ds.isel(run=index[run])).isel(run=0)
        rcurve = curves.eval_curves(ds.isel(run=index[h0])).isel(run=0)
        event = float(r.onset if r.onset >= 0 else r.fork_at)
        ends = [curves.finite_pairs(c)[0] for c in ((rcurve,) if diverged else (rcurve, curve))]  # evaluated env steps
        window = min(float(horizon), min(float(e[-1]) if e.size else -math.inf for e in ends) - event)
        stop = curves.stop_env_step(ds, index[run]) if diverged else None
        po = rl_paired.paired_outcome(curve, rcurve, event, window, floor=float(floors.get(run, np.nan)), diverged_at=stop,
                               frac=frac, lag=lag_frac * window, final_points=final_points, min_after=min_after,
                               min_gain=min_gain)
        if run == h0:  # the reference itself: nothing to compare (its level against itself is 1 only above its floor)
            po = {**po, "state": "reference", "collapsed": 0.0, "damage": 0.0, "reason": ""}
        collapse = 1.0 if diverged else po["collapsed"]
        row = {"run": run, **r.to_dict(), "diverged": bool(diverged),
               "final": math.nan if diverged else float(m.final_return), "ref_final": float(summ.loc[h0].final_return),
               "collapse": float(collapse), "damage": -float(po["damage"]) / scale, "state": po["state"],
               "window": window, "reason": po["reason"],
               "interventions": int(iv.sum()), "per_1k": 1000 * float(iv.sum()) / max(int(upd.sum()), 1),
               "n_steps": int(upd.sum()), "recovery": math.nan, "first_action": math.nan}
        if r.onset >= 0 and pert.any():
            on = int(np.flatnonzero(pert)[0])
            after = np.flatnonzero(iv[on:] > 0)
            row["first_action"] = float(after[0]) if after.size else math.nan
            row["recovery"] = {"no_drop": 0.0, "recovered": float(po["recovery_time"])}.get(po["state"], math.nan)
        rows.append(row)
    return pd.DataFrame(rows).set_index("run")


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
