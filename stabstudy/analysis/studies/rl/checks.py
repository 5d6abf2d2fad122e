"""Manipulation checks of notebook 01: did a perturbation change what it was meant to change?

A perturbation that changed nothing tests nothing, whatever the outcome (:func:`checked` makes its
claim ``not tested``, with the reason):

* the lr spike: :func:`spiked_updates` (the updates whose applied learning rate it changed, per
  optimizer), :func:`spike_policy_change` and :func:`policy_change_table` (how far the policy moved
  in the spike's window);
* the noise knob of claim (c): :func:`knob_changed` (one fork against its default-knob twin before
  the spike, on :data:`KNOB_CHANNELS`), :func:`knob_check_table` (every knob fork of a grid).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import numpy as np
import pandas as pd
import xarray as xr

from stabstudy.analysis.claims import Claim
from stabstudy.analysis.studies.rl.outcomes import CONTROL_DOSE

#: Per-update count names of :func:`spiked_updates`: ``updates`` is the primary optimizer's (off-policy the
#: critic, PPO/A2C the policy), then one per optimizer of a multi-optimizer Monitor.
SPIKED_COUNTS = {"": "updates", "critic": "critic_updates", "actor": "actor_updates", "ent_coef": "ent_coef_updates"}


def _window(run: xr.Dataset, start: float, duration: float) -> np.ndarray:
    """Rows of ``run`` with ``env_step`` in ``[start, start + duration)``, past its first row (a fork's
    first row is its prefix's last update, made before the window)."""
    env = np.asarray(run["env_step"].values, dtype=float)
    inside = (env >= start) & (env < start + duration)
    inside[:1] = False
    return inside


def _measured(run: xr.Dataset, channel: str) -> bool:
    """Whether ``run`` holds a finite value of ``channel``."""
    return channel in run and bool(np.isfinite(np.asarray(run[channel].values, dtype=float)).any())


def spiked_updates(run: xr.Dataset, start: float, duration: float, *, rtol: float = 1e-6) -> dict[str, int]:
    """Gradient updates of one run (dim ``step``) that its lr spike reached, per optimizer: rows with
    ``env_step`` in ``[start, start + duration)`` (past the run's first row) where the learning rate the
    optimizer actually applied (``lr``, ``lr_<optimizer>``: recorded on every update it made, whatever
    the Monitor's ``every``) differs by more than ``rtol`` from its median outside the window.

    Keys (:data:`SPIKED_COUNTS`, those the run measured): ``updates`` (the primary optimizer: the
    critic off-policy, the policy for PPO/A2C), ``critic_updates``, ``actor_updates`` (TD3's delayed
    actor steps every ``policy_delay`` updates: about half the critic's), ``ent_coef_updates`` (SAC's
    entropy coefficient: 0 unless ``spike_ent_coef``). A run without the ``lr`` channel (no Monitor):
    ``updates`` = every row in the window. Rows a run thinned (``log_every`` > 1) are not counted."""
    inside = _window(run, start, duration)
    if "lr" not in run:
        return {"updates": int(inside.sum())}
    out = {}
    for opt, name in SPIKED_COUNTS.items():
        ch = f"lr_{opt}" if opt else "lr"
        if ch not in run:
            continue
        lr = np.asarray(run[ch].values, dtype=float)
        base = lr[~inside & np.isfinite(lr)]
        if not base.size:  # nothing outside the window to compare with: every update in it counts as reached
            out[name] = int((inside & np.isfinite(lr)).sum())
            continue
        ref = float(np.median(base))
        out[name] = int((inside & np.isfinite(lr) & (np.abs(lr - ref) > rtol * abs(ref))).sum())
    return out


def spike_policy_change(run: xr.Dataset, start: float, duration: float) -> dict[str, float]:
    """How much one run's policy moved in ``[start, start + duration)`` (env steps; past its first
    row), the spike's window, or the same window of a control fork:

    * ``policy_updates``: updates of the policy's optimizer in the window (rows where it applied a
      learning rate: ``lr_actor`` off-policy, ``lr`` for PPO/A2C);
    * ``update_norm``: the mean L2 norm of those updates (``update_norm_actor`` / ``update_norm``,
      over the rows the Monitor measured them: every ``monitor_every``-th);
    * ``update_path``: ``update_norm x policy_updates``, the length of the path the policy's
      parameters travelled (an estimate when the Monitor skipped rows);
    * ``relative_path``: the same with ``update_ratio`` (update / parameter norm): comparable
      across network sizes;
    * ``kl``: PPO's mean ``approx_kl`` of the window's ``train()`` calls (nats; NaN for learners
      without it).

    NaN where the run lacks the channel or has no measured row in the window."""
    inside = _window(run, start, duration)
    # by values, not by name: in a Dataset of PPO, SAC and TD3 runs every run carries the actor's
    # variables, all NaN for PPO (reading them gave PPO no policy change at all)
    sfx = "_actor" if _measured(run, "update_norm_actor") else ""

    def mean(ch):
        if ch not in run:
            return np.nan
        v = np.asarray(run[ch].values, dtype=float)[inside]
        v = v[np.isfinite(v)]
        return float(v.mean()) if v.size else np.nan

    lr_ch = f"lr{sfx}" if f"lr{sfx}" in run else None
    n = int((inside & np.isfinite(np.asarray(run[lr_ch].values, dtype=float))).sum()) if lr_ch else int(inside.sum())
    norm, ratio = mean(f"update_norm{sfx}"), mean(f"update_ratio{sfx}")
    return {"policy_updates": n, "update_norm": norm, "update_path": norm * n, "relative_path": ratio * n,
            "kl": mean("approx_kl")}


def policy_change_table(ds: xr.Dataset, rows, *, duration: Mapping[str, float], prefix_of: Mapping[str, str],
                        control_dose: float = CONTROL_DOSE):
    """:func:`spike_policy_change` of every run of ``rows`` (:func:`.runs.run_table` rows of the runs
    of ``ds``, a ``load_runs`` Dataset: perturbed forks and their controls) over its spike window
    (``pert_start``, ``duration[learner]`` env steps); a control (``pert_kind`` "none") over the window
    of the perturbed forks of its prefix (their median start), at dose ``control_dose``. One row per
    run: ``spec_hash``, ``learner``, ``prefix`` (``prefix_of``), ``pert_kind``, ``pert_dose`` and the
    measured change: what :func:`.outcomes.prefix_critical_doses` reads as ``changes``."""
    rows = rows.assign(prefix=rows.spec_hash.map(lambda h: prefix_of.get(str(h))))
    starts = rows[rows.pert_kind != "none"].groupby(["learner", "prefix"]).pert_start.median().to_dict()
    out = []
    for r in rows.itertuples():
        control = r.pert_kind == "none"
        start = starts.get((r.learner, r.prefix), np.nan) if control else float(r.pert_start)
        if not np.isfinite(start) or r.learner not in duration:
            continue
        out.append({"spec_hash": r.spec_hash, "learner": r.learner, "prefix": r.prefix, "pert_kind": r.pert_kind,
                    "pert_dose": control_dose if control else float(r.pert_dose),
                    **spike_policy_change(ds.sel(run=r.spec_hash), start, float(duration[r.learner]))})
    return pd.DataFrame(out)


def checked(claim: Claim, ok: bool, reason: str) -> Claim:
    """``claim`` when its manipulation check passed (``ok``), else ``not tested`` with ``reason`` (its family and
    smallest effect kept): a perturbation that changed nothing tests nothing, whatever the outcome."""
    if ok:
        return claim
    return replace(claim, verdict="not tested", reason=f"manipulation check failed: {reason}", p_for=np.nan,
                   p_against=np.nan, power=None)


#: The channel that shows each learner's own noise knob acting on its policy.
KNOB_CHANNELS = {"ppo": "policy_std", "a2c": "policy_std", "sac": "ent_coef", "td3": None, "ddpg": None}


def knob_changed(treated: xr.Dataset, control: xr.Dataset, learner: str, at: float, *, lookback: float,
                 rtol: float = 0.05) -> tuple[bool | None, str]:
    """Did a fork's changed noise knob change its policy's noise at the spike (env step ``at``)?
    Compares :data:`KNOB_CHANNELS` (PPO: ``policy_std``; SAC: ``ent_coef``, its alpha) averaged over
    ``[at - lookback, at)`` with the control fork's (same prefix, default knob). ``(True, reason)``
    when they differ by more than ``rtol`` (relative), ``(False, reason)`` when not, ``(None, reason)``
    when nothing measures it (TD3's exploration noise acts on behaviour, not on the policy)."""
    ch = KNOB_CHANNELS.get(learner)
    if ch is None:
        return None, f"{learner.upper()}'s knob acts on behaviour; no policy channel measures it"

    def mean(ds):
        env = np.asarray(ds["env_step"].values, dtype=float)
        v = ds[ch].values[(env >= at - lookback) & (env < at)] if ch in ds else np.array([])
        v = v[np.isfinite(v)]
        return float(v.mean()) if v.size else np.nan

    a, b = mean(treated), mean(control)
    if not (np.isfinite(a) and np.isfinite(b)):
        return False, f"no {ch} measured in the {lookback:.0f} env steps before the spike"
    rel = abs(a - b) / max(abs(b), 1e-12)
    verb = "changed" if rel > rtol else "did not change"
    return rel > rtol, f"the knob {verb} {ch} before the spike ({a:.3g} vs {b:.3g} in the control, {100 * rel:.1f}%)"


def knob_check_table(ds: xr.Dataset, rows, *, lookback: Mapping[str, float], prefix_of: Mapping[str, str],
                     rtol: float = 0.05):
    """:func:`knob_changed` for every fork of ``rows`` (:func:`.runs.run_table` rows of the runs of
    ``ds``) that ran with a changed noise knob (``noise_after_fork`` not "same") and no perturbation,
    against the unperturbed default-knob fork of its prefix (``prefix_of``: run -> prefix), over the
    ``lookback[learner]`` env steps before the spike (the median ``pert_start`` of the prefix's spiked
    forks). One row per learner, prefix and knob level: ``noise``, ``changed`` (True / False / None:
    not measurable), ``reason``; what :func:`.claims.noise_buffer_claim` reads as ``checks``."""
    rows = rows.assign(prefix=rows.spec_hash.map(lambda h: prefix_of.get(str(h))))
    same = rows.noise_after_fork.map(lambda v: v == "same")
    plain = rows.pert_kind == "none"
    starts = rows[~plain].groupby(["learner", "prefix"]).pert_start.median().to_dict()
    default = rows[plain & same].drop_duplicates(["learner", "prefix"]).set_index(["learner", "prefix"]).spec_hash
    out = []
    for r in rows[plain & ~same].itertuples():
        base = {"learner": r.learner, "prefix": r.prefix, "noise": r.noise_after_fork}
        ctrl, at = default.get((r.learner, r.prefix)), starts.get((r.learner, r.prefix), np.nan)
        if ctrl is None or not np.isfinite(at):
            out.append({**base, "changed": False, "reason": "no default-knob fork or no spike of this prefix to "
                                                              "compare with"})
            continue
        ok, why = knob_changed(ds.sel(run=r.spec_hash), ds.sel(run=ctrl), r.learner, float(at),
                               lookback=float(lookback[r.learner]), rtol=rtol)
        out.append({**base, "changed": ok, "reason": why})
    return pd.DataFrame(out, columns=["learner", "prefix", "noise", "changed", "reason"])
