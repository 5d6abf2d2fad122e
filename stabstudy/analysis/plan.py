"""A notebook's analysis plan: each confirmatory claim's family and smallest effect of interest.

Fixed in the study module before any run, printed in the notebook's analysis-plan cell before the
runs start, and handed to the rules of :mod:`stabstudy.analysis.claims` as keywords
(``C.paired_difference(..., **PLAN["loss jump"].rule)``), so the numbers a verdict rests on are the
ones declared, never chosen after seeing the data.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pandas as pd


@dataclass(frozen=True)
class Planned:
    """One confirmatory claim's decision parameters."""

    family: str
    """The question and its domain (e.g. "catapult (toy MLP)"): Holm adjusts within it only."""
    sesoi: float
    """Smallest effect of interest, a magnitude in the claim's direction, in ``units``."""
    units: str
    """What the effect is measured in (e.g. "log ratio", "nats", "collapse rate")."""
    why: str
    """Where the smallest effect comes from: the claim's words, a convention, the measurement's precision,
    or the project's margins."""
    minimum: float = 0.0
    """The threshold of an "at least X" claim (then equal to ``sesoi``); 0 otherwise."""

    def __post_init__(self) -> None:
        if not self.family:
            raise ValueError("a planned claim needs a family (one question in one domain)")
        if not (self.sesoi >= self.minimum >= 0):
            raise ValueError(f"need sesoi >= minimum >= 0; got sesoi {self.sesoi}, minimum {self.minimum}")

    @property
    def rule(self) -> dict[str, Any]:
        """The keywords a directional rule takes: ``family``, ``sesoi``, ``minimum``."""
        return {"family": self.family, "sesoi": self.sesoi, "minimum": self.minimum}


def frame(plan: Mapping[str, Planned]) -> pd.DataFrame:
    """The plan as a table, one row per claim, grouped by family (for the analysis-plan cell)."""
    rows = [{"claim": k, "family": p.family, "smallest effect": p.sesoi, "units": p.units,
             "at least": p.minimum or "", "why": p.why} for k, p in plan.items()]
    return pd.DataFrame(rows).sort_values("family", kind="stable").reset_index(drop=True)
