"""results/<profile>/ is made from the executed study, byte for byte the same when remade, and knows when it is stale."""

import base64
import io

import matplotlib
import nbformat
import pytest

from stabstudy.analysis import claims as C
from stabstudy.run import costs, report
from stabstudy.run.cli import main

matplotlib.use("Agg")


def _png() -> bytes:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2, 2))
    ax.plot([0, 1], [1, 0])
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


@pytest.fixture()
def study(tmp_path, monkeypatch):
    """A fake project root holding one executed notebook, its claims and a figure."""
    monkeypatch.setenv("STABSTUDY_ROOT", str(tmp_path))
    monkeypatch.delenv("STABSTUDY_FIGURES", raising=False)
    monkeypatch.delenv("STABSTUDY_DATA", raising=False)
    (tmp_path / "stabstudy").mkdir()
    (tmp_path / "stabstudy" / "x.py").write_text("A = 1\n")
    (tmp_path / "notebooks").mkdir()
    nb = nbformat.v4.new_notebook()
    code = nbformat.v4.new_code_cell("plot()")
    bar = [nbformat.v4.new_output("stream", name="stderr", text=f"\rruns: {i:3d}%|  {i}/100") for i in range(101)]
    code.outputs = [*bar, nbformat.v4.new_output("stream", name="stderr", text="\n"),
                    nbformat.v4.new_output("display_data", data={"image/png": base64.b64encode(_png()).decode()})]
    code.metadata["papermill"] = {"start_time": "2026-12-01T03:00:00", "duration": 1.0}
    nb.cells = [nbformat.v4.new_markdown_cell("# Title"), code]
    nb.metadata["papermill"] = {"duration": 12.5, "end_time": "2026-12-01T03:00:12"}
    nbformat.write(nb, tmp_path / "notebooks" / "00_demo.ipynb")
    (tmp_path / "build" / "quick").mkdir(parents=True)
    nbformat.write(nb, tmp_path / "build" / "quick" / "00_demo.ipynb")
    (tmp_path / "figures" / "00_demo").mkdir(parents=True)
    (tmp_path / "figures" / "00_demo" / "main.png").write_bytes(_png())
    rows = [C.within_tolerance("slope = log sigma", "textbook", [1.01], 1.0, rel_tol=0.05, family="demo: slopes"),
            C.not_tested("PPO collapses", "source paper", "no trained prefix", family="demo: RL")]
    C.save(C.table(rows), "00_demo", "quick")
    return tmp_path


def test_publish_writes_claims_pages_images_and_figures(study):
    files = report.publish("quick")
    out = study / "results" / "quick"
    names = {p.relative_to(out).as_posix() for p in files}
    assert {"CLAIMS.md", "00_demo.md", "manifest.json", "figures/00_demo/main.png"} <= names
    assert any(n.startswith("00_demo_files/") and n.endswith(".png") for n in names)
    page = (out / "00_demo.md").read_text()
    assert "base64" not in page and "00_demo_files/" in page
    # a progress bar's 101 redraws are shown as a terminal would: its last state, once
    assert "runs:  50%" not in page and page.count("runs: 100%|  100/100") == 1 and "\r" not in page
    text = (out / "CLAIMS.md").read_text()
    assert "| 00_demo | demo: slopes | slope = log sigma | textbook |" in text and "**supported**" in text
    assert "| 00_demo | demo: RL | PPO collapses | source paper |  |  | 0 |  |" in text  # no 'nan' test name
    assert "**not tested**" in text and "00_demo 12 s" in text and "2026-12-01T03:00:12" in text


def test_publishing_again_gives_the_same_bytes(study):
    first = {p: p.read_bytes() for p in report.publish("quick")}
    second = {p: p.read_bytes() for p in report.publish("quick")}
    assert first == second


def test_check_names_what_changed(study, capsys):
    assert report.check("quick")[0].startswith("no published results")
    report.publish("quick")
    assert report.check("quick") == []
    assert main(["report", "--profile", "quick", "--check"]) == 0
    (study / "stabstudy" / "x.py").write_text("A = 2\n")
    (study / "notebooks" / "01_new.ipynb").write_text("{}")
    assert report.check("quick") == ["changed: stabstudy/x.py", "added: notebooks/01_new.ipynb"]
    assert main(["report", "--profile", "quick", "--check"]) == 1
    assert "changed: stabstudy/x.py" in capsys.readouterr().err


def test_the_readmes_cost_block_is_the_executions_and_check_says_when_it_is_not(study):
    """The README's cost table is written from the executions' own measurements (no time typed by
    hand), names the machine once where every page ran on one, and report --check flags an edit."""
    readme = study / "README.md"
    readme.write_text(f"# demo\n\nintro\n\n{costs.BEGIN}\nold numbers\n{costs.END}\n\nrest\n")
    nb = nbformat.read(study / "build" / "quick" / "00_demo.ipynb", as_version=4)
    nb.metadata["stabstudy"] = {"cpu_s": 30.0, "runs_computed": 7, "runs_stored": 2, "commit": "abc123",
                                "machine": "Demo CPU, 2 cores, no GPU"}
    nbformat.write(nb, study / "build" / "quick" / "00_demo.ipynb")
    report.publish("quick")
    text = readme.read_text()
    assert "old numbers" not in text and text.startswith("# demo\n\nintro\n\n") and text.endswith("\n\nrest\n")
    assert "on Demo CPU, 2 cores, no GPU, commit `abc123`, 2026-12-01" in text
    assert "| 00 | 7 | 2 | 12 s | 30 s |" in text and "| all | 7 | | 12 s | 30 s |" in text
    assert report.check("quick") == []
    readme.write_text(text.replace("| 00 | 7 |", "| 00 | 6 |"))
    assert report.check("quick") == ["changed: README.md's cost block (run `stabstudy report --profile quick`)"]
    plain = "# no markers\n"
    readme.write_text(plain)
    report.publish("quick")
    assert readme.read_text() == plain


def test_no_executed_notebooks_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("STABSTUDY_ROOT", str(tmp_path))
    assert main(["report", "--profile", "smoke"]) == 2
    assert "run `stabstudy study --profile smoke` first" in capsys.readouterr().err


def test_publishing_one_notebook_keeps_the_other_pages_and_drops_removed_notebooks(study):
    report.publish("quick")
    out = study / "results" / "quick"
    nb = nbformat.read(study / "build" / "quick" / "00_demo.ipynb", as_version=4)
    nb.metadata["papermill"] = {"duration": 3.0, "end_time": "2026-12-02T03:00:03"}
    nb.metadata["stabstudy"] = {"cpu_s": 7.0, "commit": "abc123"}  # as stabstudy study leaves it
    for d in ("notebooks", "build/quick"):
        nbformat.write(nb, study / d / "01_other.ipynb")
    (study / "build" / "quick" / "00_demo.ipynb").unlink()  # a study run with --only 01
    (study / "build" / "quick" / "claims" / "00_demo.csv").rename(study / "build" / "quick" / "claims" / "01_other.csv")
    report.publish("quick")
    text = (out / "CLAIMS.md").read_text()
    assert "| 00_demo | demo: slopes | slope = log sigma |" in text and "| 01_other | demo: slopes | slope = log sigma |" in text
    assert "00_demo 12 s, 01_other 3 s" in text and "2026-12-02T03:00:03" in text
    assert "00_demo not measured, 01_other 7 s" in text
    assert "01_other `abc123`" in text  # the commit it was executed at, not the report's
    assert (out / "00_demo.md").exists() and (out / "figures" / "00_demo" / "main.png").exists()
    assert report.check("quick") == []
    (study / "notebooks" / "00_demo.ipynb").unlink()  # a removed notebook leaves no page behind
    report.publish("quick")
    assert not (out / "00_demo.md").exists() and not (out / "figures" / "00_demo").exists()
    assert "00_demo" not in (out / "CLAIMS.md").read_text()


def _unfinish(nb, how):
    """``nb`` as a study that did not finish leaves it: killed, failed in a cell, or interrupted."""
    code = nb.cells[1]
    if how == "killed":  # papermill writes the end time when the kernel is done; a killed study never is
        nb.metadata["papermill"] = {"start_time": "2026-12-02T03:00:00", "end_time": None, "duration": None}
        code.outputs = code.outputs[:1]
    elif how == "failed":
        nb.metadata["papermill"].update(exception=True)
        code.outputs = [nbformat.v4.new_output("error", ename="ValueError", evalue="boom", traceback=[])]
    else:  # as `stabstudy study` marks one stopped by Ctrl-C
        nb.metadata["papermill"].update(exception=True)
        nb.metadata["stabstudy"] = {"interrupted": True}
        code.outputs = [nbformat.v4.new_output("error", ename="KeyboardInterrupt", evalue="", traceback=[])]
    return nb


@pytest.mark.parametrize("how, says", [("killed", "no end time"), ("failed", "cell 2 raised ValueError: boom"),
                                       ("interrupted", "interrupted")])
def test_an_execution_that_did_not_finish_is_refused_and_the_published_page_kept(study, capsys, how, says):
    report.publish("quick")
    out = study / "results" / "quick"
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    executed = study / "build" / "quick" / "00_demo.ipynb"
    nbformat.write(_unfinish(nbformat.read(executed, as_version=4), how), executed)
    assert main(["report", "--profile", "quick"]) == 1
    err = capsys.readouterr().err
    assert f"stabstudy report: error: {executed} did not finish" in err and says in err, err
    assert "nothing was published" in err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


#: A small notebook as the study's notebooks are: a figure saved as the cell's last value, a table with
#: two header rows and an index, a warning from a cell and a library, and this machine's paths printed.
DEMO = [
    'profile = "quick"\nscheduler = ""\nretry_failed = False',
    "import warnings\nimport matplotlib.pyplot as plt\nimport pandas as pd\nfrom stabstudy import paths, plots\n"
    "plots.setup()\nfig, ax = plt.subplots(figsize=(3, 2))\nax.plot([0, 1], [1, 0])\n"
    'plots.savefig(fig, "00_page", "curve")',
    'df = pd.DataFrame({("final", "iqm"): [1.5, 2.0], ("final", "max"): [3.0, 4.0]},\n'
    '                  index=pd.Index(["ppo", "sac"], name="learner"))\ndisplay(df)',
    'warnings.warn("careful")\nprint("stored in", paths.runs_dir(), "from", paths.root() / "stabstudy")\n'
    "import scipy, os\nprint(os.path.dirname(scipy.__file__))",
]


def test_a_page_shows_every_figure_and_table_and_no_path_of_this_machine(tmp_path, monkeypatch):
    """An executed notebook (a real kernel, as `stabstudy study` runs it) rendered by the report."""
    from stabstudy.run import study as S

    monkeypatch.setenv("STABSTUDY_ROOT", str(tmp_path))
    monkeypatch.delenv("STABSTUDY_FIGURES", raising=False)
    monkeypatch.delenv("STABSTUDY_DATA", raising=False)
    (tmp_path / "notebooks").mkdir()
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "language": "python",
                                                           "display_name": "Python 3"}})
    nb.cells = [nbformat.v4.new_code_cell(src) for src in DEMO]
    nb.cells[0].metadata["tags"] = ["parameters"]
    nbformat.write(nb, tmp_path / "notebooks" / "00_page.ipynb")
    S.run_study("quick")
    report.publish("quick")
    out = tmp_path / "results" / "quick"
    page = (out / "00_page.md").read_text()
    assert "![curve](figures/00_page/curve.png)" in page  # the figure, next to the page
    assert (out / "figures" / "00_page" / "curve.png").read_bytes() == \
        (tmp_path / "figures" / "00_page" / "curve.png").read_bytes()
    assert not list(out.glob("00_page_files/*"))  # not a second copy of it
    assert "| learner | final iqm | final max |" in page and "| ppo | 1.5 | 3.0 |" in page
    for html in ("<style", "<table", "<div"):
        assert html not in page, html
    assert "PosixPath" not in page and str(tmp_path) not in page and "ipykernel_" not in page
    assert "stored in data/runs from ./stabstudy" in page
    assert "<cell>:1: UserWarning: careful" in page and "    site-packages/scipy\n" in page


def test_markdown_table_repeats_spanning_cells_and_escapes_bars():
    from stabstudy.run.pages import markdown_table

    html = ("<table><thead><tr><th></th><th colspan='2'>final</th></tr><tr><th>learner</th><th>a|b</th><th>max</th>"
            "</tr></thead><tbody><tr><th rowspan='2'>ppo</th><td>1</td><td>2</td></tr><tr><td>3</td><td>4</td></tr>"
            "</tbody></table>")
    assert markdown_table(html).splitlines() == [
        "| learner | final a\\|b | final max |", "|---|---|---|", "| ppo | 1 | 2 |", "| ppo | 3 | 4 |"]
    assert markdown_table("<p>no table</p>") is None
