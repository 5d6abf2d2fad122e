"""Notebook prose states no measured number: numbers come from code cells.

A Markdown cell may name parameters and formulas inside code spans (`lr = 0.001`) or
math ($2/\\eta$); outside them a decimal number, a percentage or a thousands-separated
number reads as a result typed in by hand, which goes stale the moment the runs change.
"""

from __future__ import annotations

import json
import re

import pytest

from stabstudy.run import study

NOTEBOOKS = study.notebooks()

#: Code spans, math and reference identifiers (arXiv 2601.13160), removed before looking for numbers.
_QUOTED = [re.compile(p, re.S) for p in (r"```.*?```", r"``.*?``", r"`[^`]*`", r"\$\$.*?\$\$", r"\$[^$]*\$",
                                         r"arXiv:? ?\d{4}\.\d{4,5}")]
#: What a typed-in result looks like: 0.93, x0.5, 40%, 40 %, 5,000 (but not a unit: "per 1,000 steps").
_NUMBER = re.compile(r"(?<![\d.])\d+(?:\.\d+)? ?%|(?<![\d.])\d+\.\d+|(?<![\d,])(?<!per )\d{1,3}(?:,\d{3})+(?!\d)")
#: Per notebook stem, exact phrases allowed outside code spans (documentation, not results).
ALLOWED: dict[str, tuple[str, ...]] = {}


def typed_numbers(markdown: str, allowed: tuple[str, ...] = ()) -> list[str]:
    """Numbers in ``markdown`` outside code spans, math and the ``allowed`` phrases."""
    text = markdown
    for pattern in _QUOTED:
        text = pattern.sub(" ", text)
    for phrase in allowed:
        text = text.replace(phrase, " ")
    return _NUMBER.findall(text)


def test_the_check_flags_typed_numbers_and_spares_code_and_math():
    assert typed_numbers("PPO collapsed in 40% of runs, rho 0.12, over 5,000 steps") == ["40%", "0.12", "5,000"]
    assert typed_numbers("a 3 % drop, scale x0.5, 12.5% of runs") == ["3 %", "0.5", "12.5%"]
    assert typed_numbers("the margin `equivalence_margin = 0.02` and $\\beta_2 = 0.999$; Adam 2015") == []
    assert typed_numbers("```\nx = 0.5\n```\nsee above") == []
    assert typed_numbers("tolerance 0.2 here", allowed=("tolerance 0.2",)) == []
    assert typed_numbers("source paper arXiv 2601.13160; false alarms per 1,000 steps") == []


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_markdown_cells_state_no_measured_number(nb):
    cells = json.loads(nb.read_text())["cells"]
    bad = []
    for i, cell in enumerate(cells):
        if cell["cell_type"] != "markdown":
            continue
        src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        found = typed_numbers(src, ALLOWED.get(nb.stem, ()))
        if found:
            bad.append(f"cell {i}: {found}")
    assert not bad, f"{nb.name}: numbers typed into Markdown (put them in code spans or compute them): {bad}"
