"""Notebooks: stored stripped with one literal parameters cell; every one runs under smoke."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import nbformat
import pytest

from stabstudy import paths
from stabstudy.run import pages, study

NOTEBOOKS = study.notebooks()


def _parameters_cell(nb_path: Path) -> str:
    cells = json.loads(nb_path.read_text())["cells"]
    tagged = [c for c in cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1, f"{nb_path.name}: {len(tagged)} cells tagged 'parameters' (want 1)"
    src = tagged[0]["source"]
    return "".join(src) if isinstance(src, list) else src


def notebook_parameters(nb_path: Path) -> dict:
    """Names and literal values of the parameters cell (raises if a value is not a literal)."""
    out = {}
    for node in ast.parse(_parameters_cell(nb_path)).body:
        assert isinstance(node, ast.Assign) and len(node.targets) == 1, \
            f"{nb_path.name}: parameters cell must hold plain `name = literal` lines"
        out[node.targets[0].id] = ast.literal_eval(node.value)
    return out


def test_there_are_notebooks():
    assert NOTEBOOKS, "no notebooks/NN_*.ipynb found"


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_stored_stripped_with_literal_parameters(nb):
    cells = json.loads(nb.read_text())["cells"]
    assert not [c for c in cells if c.get("outputs")], f"{nb.name} has stored outputs: run `make strip`"
    assert not [c for c in cells if c.get("execution_count")], f"{nb.name} has execution counts"
    params = notebook_parameters(nb)
    assert {"profile", "scheduler"} <= set(params), f"{nb.name}: parameters must include profile and scheduler"


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_key_figure_is_one_the_notebook_saves(nb):
    """FINDINGS.md shows each notebook's key figure (metadata stabstudy.key_figure)."""
    node = json.loads(nb.read_text())
    name = node["metadata"].get("stabstudy", {}).get("key_figure")
    code = "".join("".join(c["source"]) for c in node["cells"] if c["cell_type"] == "code")
    assert name and f'NB, "{name}"' in code, f"{nb.name}: key_figure {name!r} is not a figure it saves"


@pytest.mark.parametrize("profile", study.PROFILES)
def test_profile_keys_match_notebook_parameters(profile):
    prof = study.load_profile(profile)
    stems = {p.stem for p in NOTEBOOKS}
    assert set(prof) <= stems | {k for k in prof if not prof[k]}, f"{profile}.yaml names unknown notebooks"
    for nb in NOTEBOOKS:
        unknown = set(prof.get(nb.stem, {})) - set(notebook_parameters(nb))
        assert not unknown, f"{profile}.yaml sets {sorted(unknown)} that {nb.name} does not declare"


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_papermill_reads_every_parameter(nb):
    """papermill parses the parameters cell line by line with its own pattern: a line it cannot
    parse prints a warning on the terminal and a profile's value for it is 'unknown' to papermill."""
    from papermill.translators import PythonTranslator

    found = {p.name for p in PythonTranslator.inspect(nbformat.v4.new_code_cell(_parameters_cell(nb)))}
    assert found == set(notebook_parameters(nb)), f"papermill cannot read {sorted(set(notebook_parameters(nb)) - found)}"


def test_papermill_check_catches_a_line_it_cannot_parse():
    from papermill.translators import PythonTranslator

    cell = nbformat.v4.new_code_cell("a = 1  # int\nb = 0  # int: a cap, 0 = none\n")
    assert [p.name for p in PythonTranslator.inspect(cell)] == ["a"]  # why notebook 05's line 43 was lost


def test_study_kernels_do_not_print_the_tcp_warning(tmp_path, capfd):
    import papermill as pm


    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "language": "python",
                                                           "display_name": "Python 3"}})
    nb.cells = [nbformat.v4.new_code_cell("a = 1", metadata={"tags": ["parameters"]}),
                nbformat.v4.new_code_cell("print(a * 10)")]
    nbformat.write(nb, tmp_path / "in.ipynb")
    for kernel_manager, warned in ((None, True), (study.kernel_manager_class(), False)):
        kw = {"kernel_manager_class": kernel_manager} if kernel_manager else {}
        pm.execute_notebook(str(tmp_path / "in.ipynb"), str(tmp_path / "out.ipynb"), parameters={"a": 2},
                            kernel_name="python3", progress_bar=False, **kw)
        assert nbformat.read(tmp_path / "out.ipynb", as_version=4).cells[-1].outputs[0]["text"] == "20\n"
        assert ("without encryption" in capfd.readouterr().err) == warned  # the default TCP kernel warns


def test_study_kernel_sockets_live_in_jupyters_runtime_folder(tmp_path, monkeypatch):
    """Not jupyter_client's default for IPC without a connection file, kernel-ipc-N in the working
    folder: a killed kernel left its sockets there, and two studies raced for the names."""
    from jupyter_core.paths import jupyter_runtime_dir

    monkeypatch.chdir(tmp_path)
    managers = [study.kernel_manager_class()() for _ in range(2)]
    assert all(Path(km.ip).parent == Path(jupyter_runtime_dir()) for km in managers)
    assert managers[0].ip != managers[1].ip and not list(tmp_path.iterdir())


@pytest.mark.notebook
@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_under_smoke(nb, tmp_path, monkeypatch, capfd, caplog):
    """The real study code path with tiny sizes, from scratch, on the embedded LocalCluster."""
    monkeypatch.setenv("STABSTUDY_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("STABSTUDY_FIGURES", str(tmp_path / "figures"))
    study.run_study("smoke", only=[nb.stem], out_dir=tmp_path / "build")
    terminal = capfd.readouterr().err + caplog.text  # what `make smoke` shows besides the bars
    for noise in ("Unable to parse", "unknown parameter", "without encryption"):
        assert noise not in terminal, f"{nb.stem}: the terminal shows {noise!r}"
    executed = json.loads((tmp_path / "build" / nb.name).read_text())
    errors = [o for c in executed["cells"] for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    # a warning printed into a stored notebook (a library's, or plots.OverlapWarning) is filtered or fixed at its source
    assert study.warnings_in(nbformat.from_dict(executed)) == []
    figures = list((tmp_path / "figures" / nb.stem).glob("*.png"))
    assert figures, f"{nb.stem} wrote no figure into figures/{nb.stem}/"
    # its page (stabstudy report) shows every figure it made, tables as Markdown, no path of this machine
    page = pages.render(nbformat.read(tmp_path / "build" / nb.name, as_version=4), nb.stem, tmp_path / "page").read_text()
    missing = [p.name for p in figures if f"](figures/{nb.stem}/{p.name})" not in page]
    assert not missing, f"{nb.stem}'s page lacks the figures {missing}"
    for text in ("<style", "<table", "PosixPath", str(tmp_path), str(paths.root()), "ipykernel_"):
        assert text not in page, f"{nb.stem}'s page shows {text!r}"
    runs = {p: p.stat().st_mtime_ns for p in (tmp_path / "data" / "runs").glob("*.nc")}
    assert runs, f"{nb.stem} stored no run"
    assert paths.figures_dir(nb.stem) == tmp_path / "figures" / nb.stem

    # A second study run reuses every stored run and only re-renders the figures.
    before = {p: p.stat().st_mtime_ns for p in figures}
    study.run_study("smoke", only=[nb.stem], out_dir=tmp_path / "build2")
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "data" / "runs").glob("*.nc")} == runs
    assert all(p.stat().st_mtime_ns > before[p] for p in figures), "figures were not re-rendered"
