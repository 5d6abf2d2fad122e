"""The code in README.md and docs/*.md runs as written, and the README links every page of docs/."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from docblocks import DEDICATED, NOT_RUN, ROOT, block, documents, python_blocks

# Runs a document's blocks in order in one namespace (a later block may use an earlier one's
# names, as a reader does), in a fresh interpreter so that what the frameworks set globally
# (seeds, logging, warning filters) stays out of the test process.
RUNNER = """
import sys
from test_docs import runnable
doc = sys.argv[1]
ns = {"__name__": "__main__"}
for i, code in runnable(doc):
    exec(compile(code, f"{doc} (python block {i + 1})", "exec"), ns)
"""


def runnable(doc: str) -> list[tuple[int, str]]:
    """(index, code) of the blocks of ``doc`` this test runs: not illustrations, not run elsewhere."""
    return [(i, b) for i, b in enumerate(python_blocks(doc))
            if not b.startswith(NOT_RUN) and not any(m in b for m in DEDICATED.get(doc, ()))]


@pytest.mark.parametrize("doc", [d for d in documents() if runnable(d)])
def test_every_python_block_runs(doc, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
               HF_HUB_OFFLINE="1", MPLBACKEND="Agg", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", RUNNER, doc], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{doc}: a code block failed\n{proc.stderr[-4000:]}"


@pytest.mark.parametrize("doc", ["README.md", "docs/monitor.md"])
def test_monitor_example_runs_as_written(doc, capsys):
    code = [b for b in python_blocks(doc) if "Monitor(" in b][0]
    ns: dict = {}
    exec(compile(code, f"{doc}:monitor-example", "exec"), ns)
    ds = ns["ds"]
    assert ds.sizes["step"] == 100
    for ch in ("loss", "grad_norm", "update_ratio", "update_grad_cos", "adam_eps_frac"):
        assert ds[ch].notnull().all(), ch
    assert ds.xgrad[0].isnull() and ds.xgrad[1:].notnull().all()  # no previous gradient at the first step
    assert "grad_norm" in capsys.readouterr().out


@pytest.mark.parametrize("doc", sorted(DEDICATED))
def test_each_dedicated_marker_names_one_block(doc):
    for marker in DEDICATED[doc]:
        block(doc, marker)  # a stale marker would leave a block run by no test


def test_block_helper_finds_exactly_one():
    assert "Monitor(" in block("README.md", "mon = Monitor(")
    with pytest.raises(AssertionError, match="one example"):
        block("README.md", "no such text in any block")


def test_readme_links_every_page_of_docs_and_the_changelog():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    pages = [d for d in documents() if d.startswith("docs/")] + ["CHANGELOG.md"]
    missing = [p for p in pages if f"]({p})" not in readme]
    assert not missing, f"README.md's Documentation table lacks a line for {missing}"


@pytest.mark.parametrize("doc", documents() + ["CHANGELOG.md"])
def test_relative_links_point_to_files_that_exist(doc):
    text = (ROOT / doc).read_text(encoding="utf-8")
    here = (ROOT / doc).parent
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a web address or an anchor on the same page
        if not (here / target.split("#", 1)[0]).exists():
            broken.append(target)
    assert not broken, f"{doc} links to missing files: {broken}"


def test_readme_stays_short():
    n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= 250, f"README.md has {n} lines: move the detail to docs/ and link it"
