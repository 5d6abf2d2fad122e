"""One place that seeds the global random number generators of a run."""

from __future__ import annotations

import random

import numpy as np


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators from ``seed``.

    Learners call this first; they also draw their data, perturbations and
    evaluation from private ``torch.Generator`` objects seeded from the same
    seed, so what one part consumes does not shift another.
    """
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
