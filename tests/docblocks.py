"""The Python code blocks of README.md and docs/*.md, for the tests that run them."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A block whose first line starts with this is an illustration (it needs a cluster, a service...):
# the docs test leaves it out and says so.
NOT_RUN = "# not run"
# Blocks that a test of their own runs and checks (the text each contains, as block() takes it):
# the docs test does not run them a second time.
DEDICATED = {
    "docs/control.md": ["Skip()", "PPO("],  # tests/test_control.py
    "docs/extending.md": ["class LinearHParams", "class LabelNoise"],  # tests/test_extending.py, in a repo copy
    "docs/online.md": ["alarms = [", "Controller(dets", "MetaState(["],  # tests/test_online.py
    "docs/integrations.md": ["CallbackList(",  # tests/test_rl.py
                             "SummaryWriter(", "tensorboard_log", "to_frame", "LightningTelemetryCallback",
                             "HFTelemetryCallback"],  # tests/test_integrations.py
}


def python_blocks(doc: str | Path) -> list[str]:
    """Every ```python block of ``doc`` (a path relative to the repository root), in order."""
    return re.findall(r"```python\n(.*?)```", (ROOT / doc).read_text(encoding="utf-8"), flags=re.S)


def block(doc: str, marker: str) -> str:
    """The one ```python block of ``doc`` that contains ``marker``."""
    found = [b for b in python_blocks(doc) if marker in b]
    assert len(found) == 1, f"one example with {marker!r} expected in {doc}, found {len(found)}"
    return found[0]


def documents() -> list[str]:
    """README.md and every docs/*.md, relative to the repository root."""
    return ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))
