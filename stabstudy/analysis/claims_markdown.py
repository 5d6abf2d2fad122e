"""Claims tables as people read them: Markdown for the notebooks' pages and for ``CLAIMS.md``.

The confirmatory table (verdicts after Holm within each family, with the power of each rule:
P(supported) at the planning effect / P(not supported) at no effect) comes first, the exploratory
one (raw p-values and intervals, no verdict) after it. Input: a DataFrame of
:func:`stabstudy.analysis.claims.table`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd


def _fmt(v: float) -> str:
    return "" if not np.isfinite(v) else f"{v:.3g}"


def _cells(*values) -> str:
    text = ("" if isinstance(v, float) and not np.isfinite(v) else str(v) for v in values)  # an empty CSV cell
    return "| " + " | ".join(t.replace("|", "\\|").replace("\n", " ") for t in text) + " |"


def _interval(r) -> str:
    return f"{_fmt(r.effect)}" + (f" [{_fmt(r.ci_low)}, {_fmt(r.ci_high)}]" if np.isfinite(r.ci_low) else "")


def _pair(a: float, b: float) -> str:
    return f"{_fmt(a) or '-'} / {_fmt(b) or '-'}" if np.isfinite(a) or np.isfinite(b) else ""


CONFIRMATORY_HEAD = ("family", "claim", "source", "smallest effect", "effect [CI]", "n", "test",
                     "p for / against (Holm)", "power S / NS", "verdict", "reason")
EXPLORATORY_HEAD = ("claim", "source", "effect [CI]", "n", "test", "p for / against", "reason")


def confirmatory_lines(df: pd.DataFrame) -> list[str]:
    """The confirmatory rows of a :func:`table` as Markdown table rows (no header)."""
    return [_cells(r.family, r.claim, r.source, _fmt(r.sesoi), _interval(r), r.n, r.test,
                   _pair(r.p_for_holm, r.p_against_holm), _pair(r.power_supported, r.power_not_supported),
                   f"**{r.verdict}**", r.reason)
            for r in df[df.role == "confirmatory"].itertuples(index=False)]


def exploratory_lines(df: pd.DataFrame) -> list[str]:
    """The exploratory rows of a :func:`table` as Markdown table rows (no header)."""
    return [_cells(r.claim, r.source, _interval(r), r.n, r.test, _pair(r.p_for, r.p_against), r.reason)
            for r in df[df.role == "exploratory"].itertuples(index=False)]


def header(columns: Sequence[str]) -> list[str]:
    return [_cells(*columns), "|" + "---|" * len(columns)]


def to_markdown(df: pd.DataFrame) -> str:
    """A claims table as Markdown: the confirmatory table (verdicts after Holm within each family,
    with the power of each rule: P(supported) at the planning effect / P(not supported) at none),
    then the exploratory one (raw p-values, no verdict)."""
    out = ["**Confirmatory claims** (Holm within each family; power at the family's alpha)", "",
           *header(CONFIRMATORY_HEAD), *confirmatory_lines(df)]
    if (df.role == "exploratory").any():
        out += ["", "**Exploratory rows** (descriptions: raw p-values and intervals, no verdict)", "",
                *header(EXPLORATORY_HEAD), *exploratory_lines(df)]
    return "\n".join(out) + "\n"
