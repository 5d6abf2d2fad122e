"""Replay-buffer surgery: take the latest transitions out of an SB3 replay buffer.

An env-side perturbation window (``action_noise``, ``obs_noise``, ``reward_scale``) writes its
transitions into an off-policy learner's replay buffer; when the window ends they are the most
recent ones, and :func:`drop_latest` removes them, so no later minibatch can contain them (PPO
discards its rollout after one update: with this, the two kinds of learner see a perturbation for
as long as it lasts, not SAC/TD3 for the rest of training).

Removal is exact, never an overwrite of the rows' contents: SB3 samples indices uniformly from
``[0, pos)`` (not full) or ``[0, buffer_size)`` (full), so

* a buffer that has not wrapped gets its write position moved back by ``n``: the removed rows lie
  beyond ``pos``, outside every later sample, until new transitions overwrite them;
* a full (wrapped) buffer is first rotated so that its oldest transition is row 0 and its newest
  the last row, then it is the same case (``pos = buffer_size - n``, ``full = False``). The
  transitions the window overwrote while wrapping are gone; the buffer holds ``n`` fewer until new
  ones refill it.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _arrays(rb: Any) -> list[tuple[Any, str]]:
    """(owner, attribute) of every per-transition array of ``rb`` (leading dim ``buffer_size``):
    a ``ReplayBuffer``'s arrays, each observation key of a ``DictReplayBuffer``."""
    out: list[tuple[Any, str]] = []
    for name, v in vars(rb).items():
        if isinstance(v, np.ndarray) and v.ndim >= 1 and v.shape[0] == rb.buffer_size:
            out.append((rb, name))
        elif isinstance(v, dict):
            out += [(v, k) for k, a in v.items() if isinstance(a, np.ndarray) and a.shape[:1] == (rb.buffer_size,)]
    return out


def stored(rb: Any) -> int:
    """Transitions ``rb`` can sample from (per env)."""
    return int(rb.buffer_size if rb.full else rb.pos)


def drop_latest(rb: Any, n: int) -> int:
    """Remove the ``n`` most recently written transitions of the SB3 replay buffer ``rb`` from
    every later sample (module docstring). Returns how many were removed: ``n``, or 0 when that
    would leave the buffer empty (``n >= `` what it holds: SB3 cannot sample from an empty buffer;
    the caller keeps them and says so). Raises for SB3's ``optimize_memory_usage`` layout, where a
    transition's next observation is the next row's observation."""
    n = int(n)
    if n < 0:
        raise ValueError(f"n must be at least 0, got {n}")
    if getattr(rb, "optimize_memory_usage", False):
        raise ValueError("drop_latest cannot remove transitions from a buffer with optimize_memory_usage=True "
                         "(each row's next observation is the next row); build the learner without it")
    if n == 0 or n >= stored(rb):
        return 0
    if rb.full:
        # oldest first: row pos is the oldest once the buffer has wrapped
        for owner, name in _arrays(rb):
            a = getattr(owner, name) if owner is rb else owner[name]
            rolled = np.roll(a, -int(rb.pos), axis=0)
            if owner is rb:
                setattr(rb, name, rolled)
            else:
                owner[name] = rolled
        rb.pos, rb.full = rb.buffer_size, False
    rb.pos -= n
    return n


def touched_windows(windows: list[tuple[str, int, int]]) -> list[tuple[int, int]]:
    """The env-step intervals ``[a, b)`` whose transitions env-side perturbation windows touched,
    overlapping ones merged: ``windows`` holds ``(kind, start, end)``; a window touches the
    transitions of its env steps ``[start, end)``, and ``obs_noise`` one more (the transition of env
    step ``end`` starts from the observation its last step returned, which was noisy)."""
    spans = sorted((int(s), int(e) + (k == "obs_noise")) for k, s, e in windows if int(e) > int(s))
    merged: list[tuple[int, int]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged
