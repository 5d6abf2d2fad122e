"""Notebook 05 (closed-loop monitor): the paired-counterfactual grid, threshold calibration,
per-run outcomes; the paired table and the claims are :mod:`.closed_loop_claims`'s.

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
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import xarray as xr

from stabstudy.analysis.studies import lm_spikes
from stabstudy.analysis.studies.rl import curves, design, runs
from stabstudy.analysis.studies.rl import outcomes as rl_paired
from stabstudy.analysis.warning.evaluation import before_clip
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
