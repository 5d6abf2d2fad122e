"""The Monitor examples in README.md and docs/monitor.md run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.S)


@pytest.mark.parametrize("doc", ["README.md", "docs/monitor.md"])
def test_monitor_example_runs_as_written(doc, capsys):
    blocks = [b for b in python_blocks(ROOT / doc) if "Monitor(" in b]
    assert blocks, f"no Monitor example in {doc}"
    ns: dict = {}
    exec(compile(blocks[0], f"{doc}:monitor-example", "exec"), ns)
    ds = ns["ds"]
    assert ds.sizes["step"] == 100
    for ch in ("loss", "grad_norm", "update_ratio", "update_grad_cos", "adam_eps_frac"):
        assert ds[ch].notnull().all(), ch
    assert ds.xgrad[0].isnull() and ds.xgrad[1:].notnull().all()  # no previous gradient at the first step
    assert "grad_norm" in capsys.readouterr().out
