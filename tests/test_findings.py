"""FINDINGS.md is written from the confirmatory claims: its sentences follow the verdicts."""

from __future__ import annotations

import nbformat
import numpy as np

from stabstudy.analysis import claims as C
from stabstudy.run import findings

FAM = "catapult after an lr spike (toy MLP)"


def _notebook(tmp_path, question: bool = True):
    nb = nbformat.v4.new_notebook()
    text = "# 00 · Demo: does the spike catapult?\n\n" + ("**Question.** Does an lr spike catapult the run?\n\n"
                                                           "**What is measured** ..." if question else "")
    nb.cells = [nbformat.v4.new_markdown_cell(text)]
    nb.metadata["stabstudy"] = {"key_figure": "main"}
    nbs = tmp_path / "notebooks"
    nbs.mkdir(exist_ok=True)
    nbformat.write(nb, nbs / "00_demo.ipynb")
    return nbs


def _rows(up: float):
    d = np.random.default_rng(0).normal(up, 0.1, 8)
    rows = [C.paired_difference("the loss jumps", "source paper: Lewkowycz et al. 2020", d, np.zeros(8),
                                direction="greater", sesoi=0.5, family=FAM),
            C.paired_difference("the sharpness falls", "our own", np.full(8, 1.0) + d * 0.01, np.zeros(8),
                                direction="greater", sesoi=0.5, family=FAM),
            C.exploratory(C.difference("a description", "our own", d, np.zeros(8), direction="greater"))]
    return C.table(rows, power=False).to_dict("records")


def test_the_answer_follows_the_verdicts(tmp_path):
    nbs = _notebook(tmp_path)
    out = tmp_path / "results"
    (out / "figures" / "00_demo").mkdir(parents=True)
    (out / "figures" / "00_demo" / "main.png").write_bytes(b"png")
    text = findings.write(out, {"00_demo": _rows(2.0)}, nbs).read_text()
    assert "**Question.** Does an lr spike catapult the run?" in text
    assert f"**{FAM}**: yes, all 2 claims hold." in text
    assert "Lewkowycz et al. 2020: “the loss jumps”; we measured" in text and "**supported**" in text
    assert "a description" not in text  # exploratory rows answer nothing
    assert "![00_demo: main](figures/00_demo/main.png)" in text
    # the jump is gone: the same question, another answer
    text = findings.write(out, {"00_demo": _rows(0.0)}, nbs).read_text()
    assert f"**{FAM}**: in part (1 of 2 supported). Supported: “the sharpness falls”. Not supported: " \
           "“the loss jumps”." in text


def test_a_page_without_claims_and_a_title_question(tmp_path):
    nbs = _notebook(tmp_path, question=False)
    text = findings.write(tmp_path, {"00_demo": None}, nbs).read_text()
    assert "**Question.** does the spike catapult?" in text and "Not available" in text
    assert "![" not in text  # the key figure is not there: no broken link


def test_family_sentences():
    rows = [{"claim": "a", "verdict": "not supported"}, {"claim": "b", "verdict": "not supported"}]
    assert findings.family_sentence("F", rows) == "**F**: no, none of its 2 claims holds: “a”; “b”."
    assert findings.family_sentence("F", rows[:1]) == "**F**: no, the claim is not supported: “a”."
    assert findings.family_sentence("F", [{"claim": "a", "verdict": "inconclusive"}]) == "**F**: undecided: “a”."
    assert findings.family_sentence("F", [{"claim": "a", "verdict": "not tested"}]) == "**F**: not tested: “a”."
