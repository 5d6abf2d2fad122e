"""What a design of notebook 01 costs: worker-seconds of its runs, from rates measured on the
development machine and rescaled by the wall times of stored runs."""

from __future__ import annotations

import numpy as np
import pandas as pd

#: Training env steps per second of one worker (``OMP_NUM_THREADS=1``) on HalfCheetah-v5 with the
#: study's callbacks (Monitor every update), evaluations left out: the ``callback`` row of
#: ``benchmarks/rl_overhead.py --algo A --repeats 1 --checkpoint-buffer 0`` on the idle 2-core
#: development machine, 2026-12-04 20:29 UTC (load 0.7): PPO 1132, SAC 187, TD3 356. Under a load of
#: 5-8 (03:00 UTC that day) the same command gave SAC 60 and TD3 70: the rates fall with the
#: load, so :func:`calibration` rescales them from the wall times of stored prefixes where there are some.
TRAIN_RATES = {"ppo": 1100.0, "a2c": 1100.0, "sac": 185.0, "td3": 350.0, "ddpg": 350.0}
#: Env steps per second of a deterministic evaluation (five episodes side by side, one batched forward
#: pass per step, MuJoCo steps) of an untrained 64-unit policy on HalfCheetah-v5, one thread, on the
#: idle development machine, 2026-12-04 20:35 UTC: PPO 9978, SAC 8989, TD3 10182 (one episode at a
#: time: 3888, 3306, 4327).
EVAL_RATES = {"ppo": 9500.0, "a2c": 9500.0, "sac": 8500.0, "td3": 9500.0, "ddpg": 9500.0}


def run_cost(spec, episode_steps: int = 1000) -> dict[str, float]:
    """What one RL run computes: ``train_steps`` (env steps it trains: a fork only its continuation)
    and ``eval_steps`` (env steps of its evaluation episodes: one evaluation at the start, every
    ``eval_every`` env steps, at the end; ``eval_max_steps`` or ``episode_steps`` per episode)."""
    hp = spec.hp
    prefix = int(hp.get("prefix_steps", 0))
    span = spec.steps - (prefix if 0 < prefix < spec.steps else 0)
    every = spec.eval_every or max(1, span // 20)
    episodes = int(hp.get("eval_episodes", 2))
    length = int(hp.get("eval_max_steps", 0)) or int(episode_steps)
    return {"train_steps": float(span), "eval_steps": float((span // every + 2) * episodes * length)}


def calibration(specs, wall_s, rates: dict[str, float] | None = None, eval_rates: dict[str, float] | None = None,
                episode_steps: int = 1000) -> dict[str, float]:
    """Per learner, measured over predicted wall time of stored runs (``specs`` with their
    ``wall_s``, e.g. the prefixes): the factor :func:`worker_seconds` multiplies its estimate by
    (1 where none is stored). It carries what the constants do not: this machine's load, the
    Monitor's cadence, the prefixes' own hyperparameters."""
    pred: dict[str, float] = {}
    meas: dict[str, float] = {}
    for s, w in zip(specs, wall_s, strict=True):
        if w is None or not np.isfinite(w):
            continue
        c = run_cost(s, episode_steps)
        pred[s.learner] = pred.get(s.learner, 0.0) + c["train_steps"] / (rates or TRAIN_RATES)[s.learner] + \
            c["eval_steps"] / (eval_rates or EVAL_RATES)[s.learner]
        meas[s.learner] = meas.get(s.learner, 0.0) + float(w)
    return {a: meas[a] / pred[a] for a in pred if pred[a] > 0}


def worker_seconds(grids, *, rates: dict[str, float] | None = None, eval_rates: dict[str, float] | None = None,
                   factor: dict[str, float] | None = None, episode_steps: int = 1000):
    """Estimated worker-seconds of ``grids`` (``{name: specs}``; a spec in several grids counts
    once, in the first): per grid and learner, ``runs``, ``train_steps``, ``eval_steps`` and
    ``worker_s`` = train steps / :data:`TRAIN_RATES` + eval steps / :data:`EVAL_RATES`, times the
    learner's ``factor`` (:func:`calibration`; default 1). A pandas DataFrame."""
    rates, eval_rates, seen, rows = rates or TRAIN_RATES, eval_rates or EVAL_RATES, set(), []
    for name, specs in grids.items():
        for s in specs:
            if s.spec_hash in seen:
                continue
            seen.add(s.spec_hash)
            if s.learner not in rates:
                raise ValueError(f"no training rate for {s.learner!r}; known: {', '.join(rates)}")
            c = run_cost(s, episode_steps)
            sec = (c["train_steps"] / rates[s.learner] + c["eval_steps"] / eval_rates[s.learner]) * \
                (factor or {}).get(s.learner, 1.0)
            rows.append({"grid": name, "learner": s.learner, "runs": 1, **c, "worker_s": sec})
    cols = ["grid", "learner", "runs", "train_steps", "eval_steps", "worker_s"]
    out = pd.DataFrame(rows, columns=cols)
    return out.groupby(["grid", "learner"], sort=False, as_index=False).sum() if len(out) else out
