"""``stabstudy new NN_name``: a new notebook experiment from the templates in ``run/templates/``.

One call writes everything a study notebook needs, so that it runs under the smoke profile as
generated (a real toy grid, a claim that can fail) and ``stabstudy study`` / ``stabstudy report``
pick it up by its name:

* ``notebooks/NN_name.ipynb``: question, one ``parameters`` cell of literals, setup, grid, a figure
  through :func:`stabstudy.plots.savefig`, a claims cell (outputs stripped; each code cell tagged
  by its role, so a guide can name the cell to replace);
* ``stabstudy/analysis/studies/name.py``: the grid builder, the outcome table, the claims table;
* an entry per profile in ``stabstudy/run/profiles/{smoke,quick,paper}.yaml``;
* ``tests/test_study_name.py``: the claim where it passes, where it fails, with missing data.

Nothing is written when any of it would clash with what exists (the number, the name, the module,
the test, a profile entry), when the name is malformed, or when this process imports the package of
another checkout (the study would not read the profiles written): :class:`ValueError` says which. Every file is
written atomically; should a write fail, the files written before it are restored.
"""

from __future__ import annotations

import keyword
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from string import Template

from stabstudy import paths
from stabstudy.run import study

#: ``NN_name``: two digits, an underscore, then a Python module name in lower case.
NAME = re.compile(r"(?P<number>\d{2})_(?P<name>[a-z][a-z0-9_]*)")
#: A code or markdown cell of the notebook template: ``# %% code TAG`` or ``# %% markdown [TAG]``.
_CELL = re.compile(r"^# %% (?P<kind>code|markdown)(?: (?P<tag>[a-z_]+))?$", re.MULTILINE)


@dataclass(frozen=True)
class Plan:
    """What ``stabstudy new`` writes: path -> new text (profiles: the whole file with the entry added)."""

    notebook: str
    files: dict[Path, str]


def _template(name: str) -> Template:
    return Template(resources.files("stabstudy.run").joinpath("templates", name).read_text(encoding="utf-8"))


def parse_name(stem: str) -> tuple[str, str]:
    """``"07_warmup_dose"`` -> ``("07", "warmup_dose")``; ``ValueError`` saying the form otherwise."""
    m = NAME.fullmatch(stem)
    if m is None or keyword.iskeyword(m["name"]) or m["name"].endswith("_") or "__" in m["name"]:
        raise ValueError(f"notebook name must look like NN_name: two digits, an underscore, then a lower-case "
                         f"Python module name (letters, digits, single underscores), e.g. 07_warmup_dose; "
                         f"got {stem!r}")
    return m["number"], m["name"]


#: The first figure a template saves: the scaffolded notebook's key figure.
_FIGURE = re.compile(r'plots\.savefig\([^,]+,\s*NB,\s*"(?P<name>[^"]+)"')


def notebook_json(text: str) -> str:
    """The notebook template's text (cells split at ``# %% code|markdown [tag]`` lines), as stripped ``.ipynb``."""
    import nbformat

    marks = list(_CELL.finditer(text))
    if not marks or text[:marks[0].start()].strip():
        raise ValueError("notebook template must start with a '# %% code|markdown [tag]' line")
    nb = nbformat.v4.new_notebook()
    nb.metadata = {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                   "language_info": {"name": "python"}}
    figure = _FIGURE.search(text)
    if figure:  # FINDINGS.md shows it beside the notebook's answer
        nb.metadata["stabstudy"] = {"key_figure": figure["name"]}
    for i, (m, nxt) in enumerate(zip(marks, [*marks[1:], None], strict=True)):
        source = text[m.end():nxt.start() if nxt else len(text)].strip("\n")
        make = nbformat.v4.new_code_cell if m["kind"] == "code" else nbformat.v4.new_markdown_cell
        cell = make(source, metadata={"tags": [m["tag"]]} if m["tag"] else {})
        cell.id = f"cell-{i:02d}"  # fixed ids (nbformat's are random): the same name scaffolds the same bytes
        nb.cells.append(cell)
    nbformat.validate(nb)
    return nbformat.writes(nb) + "\n"


def plan(stem: str, root: Path | None = None) -> Plan:
    """Everything ``stabstudy new stem`` would write under ``root`` (default: the checkout), checked first."""
    number, name = parse_name(stem)
    here = root is None
    root = root or paths.root()
    pkg = root / "stabstudy"
    if not (root / "notebooks").is_dir() or not (pkg / "analysis" / "studies").is_dir():
        raise ValueError(f"stabstudy new writes into a source checkout (notebooks/, stabstudy/analysis/studies/); "
                         f"{root} is none: run it from a clone, or set STABSTUDY_ROOT")
    if here and paths.profiles_dir().resolve() != (pkg / "run" / "profiles").resolve():
        # the study would read the profiles of the package it imports, not the ones written here
        raise ValueError(f"stabstudy is imported from {paths.profiles_dir().parents[1]}, not from the checkout "
                         f"{root}: install the checkout (pip install -e .) or put it first on PYTHONPATH")
    taken = sorted(p.stem for p in (root / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    clash = [s for s in taken if s.split("_", 1)[0] == number or s.split("_", 1)[1] == name]
    if clash:
        raise ValueError(f"notebook {stem!r} clashes with {', '.join(clash)} (numbers and names are unique); "
                         f"taken: {', '.join(taken)}")
    module = pkg / "analysis" / "studies" / f"{name}.py"
    test = root / "tests" / f"test_study_{name}.py"
    for p in (module, test):
        if p.exists():
            raise ValueError(f"{p.relative_to(root)} exists already: choose another name than {name!r}")
    words = dict(notebook=stem, number=number, name=name, module=name, title=name.replace("_", " ").capitalize())
    files = {root / "notebooks" / f"{stem}.ipynb": notebook_json(_template("notebook.py.tmpl").substitute(words)),
             module: _template("study.py.tmpl").substitute(words),
             test: _template("test.py.tmpl").substitute(words)}
    for profile in study.PROFILES:
        f = pkg / "run" / "profiles" / f"{profile}.yaml"
        old = f.read_text(encoding="utf-8")
        if re.search(rf"^{re.escape(stem)}:", old, re.MULTILINE) or re.search(rf"^\d\d_{name}:", old, re.MULTILINE):
            raise ValueError(f"{f.relative_to(root)} has an entry for {stem!r} (or its name) already: remove it "
                             f"or choose another name")
        entry = _template(f"profile_{profile}.yaml.tmpl").substitute(words)
        files[f] = old + ("" if not old or old.endswith("\n") else "\n") + entry
    return Plan(stem, files)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def create(stem: str, root: Path | None = None) -> list[Path]:
    """Write what :func:`plan` says; return the paths written (the profiles last)."""
    todo = plan(stem, root)
    before: dict[Path, str | None] = {}
    try:
        for path, text in todo.files.items():
            before[path] = path.read_text(encoding="utf-8") if path.exists() else None
            path.parent.mkdir(parents=True, exist_ok=True)
            _write_atomic(path, text)
    except BaseException:
        for path, old in before.items():  # put back what was there: nothing half-written
            if old is None:
                path.unlink(missing_ok=True)
            else:
                _write_atomic(path, old)
        raise
    return list(todo.files)
