"""The README's and the Monitor page's first examples give what they say, the blocks that other tests
run are found, and the README links every page of docs/. That every example runs as written, with only
the extra it names, is tests/test_packaging.py's."""

from __future__ import annotations

import re

import pytest
from docblocks import DEDICATED, ROOT, block, documents, python_blocks


@pytest.mark.parametrize("doc", ["README.md", "docs/monitor.md"])
def test_monitor_example_runs_as_written(doc, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the README's writes telemetry.png
    code = [b for b in python_blocks(doc) if "Monitor(" in b][0]
    ns: dict = {}
    exec(compile(code, f"{doc}:monitor-example", "exec"), ns)
    ds = ns["ds"]
    assert ds.sizes["step"] == 100
    for ch in ("loss", "grad_norm", "update_ratio", "update_grad_cos", "adam_eps_frac"):
        assert ds[ch].notnull().all(), ch
    assert ds.xgrad[0].isnull() and ds.xgrad[1:].notnull().all()  # no previous gradient at the first step
    out = capsys.readouterr().out
    assert "grad_norm" in out
    if doc == "README.md":  # the outlier batch at 70: seen before the clip, acted on, the cut rate recorded
        assert ds.grad_norm[70] > 3 * float(ds.grad_norm[69]) and float(ds.grad_norm_applied[70]) <= 1.0 + 1e-6
        acted = ds.step.values[ds.controller_action.values != "none"].tolist()
        assert acted == [70] and ds.controller_action[70] == "lr_backoff" and ds.lr[70] == pytest.approx(1e-3)
        assert "actions at steps: 70 (lr_backoff)" in out and (tmp_path / "telemetry.png").stat().st_size > 0


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
