"""The Python code blocks of README.md and docs/*.md, for the tests that run them."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A block whose first line starts with this is an illustration (it needs a cluster, a service...):
# tests/test_packaging.py only checks that it names its extra.
NOT_RUN = "# not run"
# Every block names, in one of its first two lines, the extra it needs: "# pip install stabstudy" (the
# core alone) or "# pip install 'stabstudy[rl]'" (several: 'stabstudy[rl,tensorboard]'), words after
# it allowed; tests/test_packaging.py runs each block with only those packages importable.
INSTALL = re.compile(r"^# pip install (?:stabstudy|'stabstudy\[([a-z0-9_,-]+)\]')(?: |$)")
# Blocks that a test of their own runs and checks what they give (the text each contains, as block()
# takes it); tests/test_docs.py checks each names one block (tests/test_packaging.py runs every block,
# these too, for their extras).
DEDICATED = {
    "docs/control.md": ["Skip()", "PPO("],  # tests/test_control.py
    "docs/extending.md": ["class LinearHParams", "class LabelNoise"],  # tests/test_extending.py, in a repo copy
    "docs/online.md": ["alarms = [", "Controller(dets", "MetaState(["],  # tests/test_online.py
    "docs/integrations.md": ["CallbackList(",  # tests/test_rl.py
                             "SummaryWriter(", "tensorboard_log", "to_frame", "LightningTelemetryCallback",
                             "HFTelemetryCallback", "WandbWriter(run)", "MLflowWriter()"],  # tests/test_integrations.py
}


def python_blocks(doc: str | Path) -> list[str]:
    """Every ```python block of ``doc`` (a path relative to the repository root), in order."""
    return re.findall(r"```python\n(.*?)```", (ROOT / doc).read_text(encoding="utf-8"), flags=re.S)


# A block that goes on from the one before it (it uses its names) says so in one of its first two lines.
CONTINUES = "continues the example above"


def chain(doc: str, i: int) -> list[int]:
    """Block ``i`` of ``doc`` and the blocks it continues (:data:`CONTINUES`), in reading order."""
    blocks = python_blocks(doc)
    out = [i]
    while out[0] > 0 and CONTINUES in "\n".join(blocks[out[0]].splitlines()[:2]):
        out.insert(0, out[0] - 1)
    return out


def extras_of(code: str) -> list[str] | None:
    """The extras a block names (:data:`INSTALL`; ``[]``: the core), or None where it names none."""
    for line in code.splitlines()[:2]:
        m = INSTALL.match(line)
        if m:
            return [e for e in (m.group(1) or "").split(",") if e]
    return None


def block(doc: str, marker: str) -> str:
    """The one ```python block of ``doc`` that contains ``marker``."""
    found = [b for b in python_blocks(doc) if marker in b]
    assert len(found) == 1, f"one example with {marker!r} expected in {doc}, found {len(found)}"
    return found[0]


def documents() -> list[str]:
    """README.md and every docs/*.md, relative to the repository root."""
    return ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))
