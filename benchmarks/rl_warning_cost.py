"""Wall time of notebook 04's RL analysis (:func:`stabstudy.analysis.studies.rl.warning.analyse`) for one learner.

The forks are constructed, sized like notebook 01's quick grid: per prefix (seed) a control, five lr
spikes and two lr ramps, ``--rows`` Monitor rows each (notebook 04's RL forks of 01's 6-prefix quick
grid had 5,000-7,200 rows, 2026-12-06); half the perturbed forks drop to a tenth of the control's
return after the perturbation. The analysis is notebook 04's: every detector scored, the meta-state
replayed, sensitivity, specificity and the held-out kinds, with the
notebook's bootstrap sizes; then the verdict stability (calibration-seed resamples). One thread, as on a study worker.

``--stream`` also scores the same forks with every detector fed value by value (``update``, what a
training loop does) beside ``replay`` (what the analysis does: the array form where a detector has
one, equal bit for bit), and prints the ratio.

    OMP_NUM_THREADS=1 python benchmarks/rl_warning_cost.py [--seeds 6] [--rows 6000] [--n-boot 1000] [--resamples 200] [--stream]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import xarray as xr

from stabstudy.analysis.studies import meta_robustness as R
from stabstudy.analysis.studies.rl import warning as W
from stabstudy.analysis.warning import evaluation as E
from stabstudy.online import MetaConfig
from stabstudy.online import features as F

EVERY, EVAL = 5, 500  # Monitor cadence (updates) and evaluation cadence (env steps), notebook 01's quick SAC


def forks(seeds: int, rows: int, seed: int = 0) -> tuple[xr.Dataset, xr.Dataset, dict[str, str]]:
    """Constructed forks of one learner (one update per env step), their prefixes and ``prefix_of``."""
    rng = np.random.default_rng(seed)
    p_env, n = 70_000, rows * EVERY
    upd = np.arange(p_env, p_env + n + 1)
    start = p_env + 1000
    runs, pre = [], []
    for s in range(seeds):
        for k, (kind, dose) in enumerate([("none", np.nan)] + [("lr_spike", d) for d in (3, 10, 30, 100, 300)]
                                         + [("lr_ramp", d) for d in (3, 30)]):
            data = {c: 10 ** (0.05 * rng.standard_normal(upd.size)) for c in ("grad_norm", "update_norm",
                                                                               "update_ratio", "adam_m_norm", "adam_v_mean")}
            data |= {c: 0.5 + 0.05 * rng.standard_normal(upd.size) for c in ("xgrad", "update_grad_cos")}
            data["lr"] = np.where((upd >= start) & (kind != "none"), 3e-4 * (dose if kind != "none" else 1), 3e-4)
            for c in ("update_norm", "update_ratio", "xgrad", "update_grad_cos", "adam_m_norm", "adam_v_mean"):
                data[c][(upd - p_env) % EVERY != 0] = np.nan
            perf = np.where((upd - p_env) % EVAL == 0, 3000.0 + 30 * rng.standard_normal(upd.size), np.nan)
            if kind != "none" and k % 2:
                perf[upd >= start + 1500] = 300.0
            data |= {"perf": perf, "loss": np.full(upd.size, np.nan)}
            h = f"{kind}{dose}s{s}"
            ds = xr.Dataset({c: ("step", v) for c, v in data.items()}, coords={"step": upd})
            runs.append(ds.assign_coords(env_step=("step", upd.astype(float))).expand_dims(run=[h]).assign_coords(
                spec_hash=("run", [h]), learner=("run", ["sac"]), seed=("run", [s]), pert_kind=("run", [kind]),
                pert_dose=("run", [dose]), pert_start=("run", [np.nan if kind == "none" else float(start)]),
                pert_duration=("run", [np.nan if kind == "none" else 2048.0]), status=("run", ["ok"]),
                hp_prefix_steps=("run", [float(p_env)])))
        env = np.arange(0, p_env + 1, 5000, dtype=float)
        pre.append(xr.Dataset({"perf": ("step", np.minimum(-300 + env / 10, 3000.0))}, coords={"step": env.astype(int)})
                   .assign_coords(env_step=("step", env)).expand_dims(run=[f"pre{s}"]).assign_coords(
                       spec_hash=("run", [f"pre{s}"]), learner=("run", ["sac"]), seed=("run", [s]),
                       pert_kind=("run", ["none"]), pert_start=("run", [np.nan]), status=("run", ["ok"])))
    fork = xr.concat(runs, dim="run")
    prefix_of = {str(h): f"pre{int(s)}" for h, s in zip(fork.run.values, fork.seed.values, strict=True)}
    return fork, xr.concat(pre, dim="run"), prefix_of


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=6, help="prefixes (notebook 01 quick: 6)")
    ap.add_argument("--rows", type=int, default=6000, help="Monitor rows per fork")
    ap.add_argument("--n-boot", type=int, default=1000, help="bootstrap resamples (notebook 04 quick: 1000)")
    ap.add_argument("--resamples", type=int, default=200, help="calibration resamples (notebook 04 quick: 200)")
    ap.add_argument("--stream", action="store_true", help="also time update value by value against replay")
    args = ap.parse_args()
    fork, pre, prefix_of = forks(args.seeds, args.rows)
    t0 = time.perf_counter()
    horizon = {"sac": float(args.rows * EVERY - 1000 - EVAL)}  # every fork reaches the event + H
    r = W.analyse(fork, pre, prefix_of, calibration_seeds=[0], horizon=horizon, n_boot=args.n_boot,
                  config=MetaConfig(window=64, min_periods=16, corr_window=32))
    dt = time.perf_counter() - t0
    print(f"{fork.sizes['run']} forks x {r.rows} rows: rl.warning.analyse {dt:.1f} s "
          f"({'protocol ran' if r.study is not None else 'not run: ' + r.reason})")
    if r.study is not None:
        t0 = time.perf_counter()
        R.verdict_stability(r.study, n_resamples=args.resamples, seed=0)
        print(f"verdict_stability ({args.resamples} resamples): {time.perf_counter() - t0:.1f} s")
    if args.stream:
        stream_vs_replay(W.on_rows(fork))


def stream_vs_replay(rows: xr.Dataset) -> None:
    """Seconds to score ``rows`` with notebook 04's RL suite, by update and by replay, side by side."""
    specs = [s for s in E.suite(W.KINDS, W.RL_CHANNELS, lambda_max=False) if not s.feature.startswith("meta:")]
    data = {c: rows[c].transpose("run", "step").values for c in F.channels_of([s.feature for s in specs]) if c in rows}
    cols = {s.feature: np.stack([F.column({c: v[i] for c, v in data.items()}, s.feature) for i in range(rows.sizes["run"])])
            for s in specs if F.channels_of([s.feature]) <= set(data)}
    took = {}
    for how in ("update", "replay"):
        t0 = time.perf_counter()
        for sp in specs:
            for x in cols.get(sp.feature, ()):
                d = sp.make()
                _ = [d.update(v) for v in x] if how == "update" else d.replay(x)
        took[how] = time.perf_counter() - t0
    n = rows.sizes["run"] * rows.sizes["step"]
    print(f"{len(specs)} detectors over {rows.sizes['run']} forks x {rows.sizes['step']} rows: update "
          f"{took['update']:.1f} s ({took['update'] / n * 1e6:.0f} us a row), replay {took['replay']:.1f} s "
          f"({took['replay'] / n * 1e6:.0f} us a row); update / replay = {took['update'] / took['replay']:.1f}")


if __name__ == "__main__":
    main()
