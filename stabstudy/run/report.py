"""Publish a study's results so they can be read without running anything, and tell when they are stale.

``publish(profile)`` turns what ``stabstudy study`` left in ``build/<profile>/`` (the
executed notebooks and each notebook's claims table) and ``figures/`` into
``results/<profile>/``:

* ``CLAIMS.md``: every claim of every notebook, the confirmatory table then the exploratory
  one, headed by the profile, the code version, the machine, the package versions, the
  date of the study and each notebook's wall time (all read from the executed notebooks, so
  regenerating the report from the same study gives the same bytes);
* ``FINDINGS.md``: per notebook, its question and the answer written from its confirmatory
  verdicts (:mod:`stabstudy.run.findings`);
* ``<notebook>.md`` (:mod:`stabstudy.run.pages`): each figure it made as a relative link to
  ``figures/<notebook>/<name>.png``, other images as PNG files in ``<notebook>_files/``, tables as
  Markdown, no path of the machine it ran on (stream outputs as a terminal shows them: a progress
  bar is its last state, not each redraw);
* ``figures/<notebook>/*.png``;
* ``manifest.json``: a content hash of every source file that made them.

An executed notebook that did not run to its end (killed, a cell that raised, stopped by Ctrl-C:
:func:`unfinished`) is refused: nothing is published and the pages stay as they were.

``check(profile)`` compares that manifest with the files now in ``stabstudy/`` and
``notebooks/`` (the profiles included) and names what changed.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import platform
import shutil
from pathlib import Path

from stabstudy import paths
from stabstudy.analysis import claims_markdown
from stabstudy.run import costs, findings

#: Packages whose versions head CLAIMS.md.
PACKAGES = ("torch", "numpy", "scipy", "xarray", "pandas", "stable-baselines3", "gymnasium", "mujoco",
            "statsmodels", "scikit-learn", "papermill")


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "not installed"
    return out


def _executed(profile: str) -> list[Path]:
    src = paths.build_dir() / profile
    nbs = sorted(src.glob("[0-9][0-9]_*.ipynb"))
    if not nbs:
        raise FileNotFoundError(f"no executed notebooks in {src}; run `stabstudy study --profile {profile}` first")
    return nbs


class UnfinishedExecutionError(RuntimeError):
    """An executed notebook in ``build/<profile>/`` did not run to its end: nothing is published."""


def unfinished(node) -> str | None:
    """Why the executed notebook ``node`` (nbformat) did not run to its end, or None when it did:
    stopped by Ctrl-C (``stabstudy study`` marks it), a cell that raised, or no end time (the study
    was killed, or is still running)."""
    pm = node.metadata.get("papermill", {})
    errors = [(i, o) for i, c in enumerate(node.cells, 1) for o in c.get("outputs", []) if o.get("output_type") == "error"]
    where = f" at cell {errors[0][0]} of {len(node.cells)}" if errors else ""
    if node.metadata.get("stabstudy", {}).get("interrupted"):
        return f"it was interrupted{where}"
    if errors:
        i, o = errors[0]
        return f"cell {i} raised {o.get('ename', 'an error')}: {o.get('evalue', '')}".rstrip(": ")
    if pm.get("exception"):
        return "papermill recorded an exception"
    if not pm.get("end_time"):
        ran = sum(1 for c in node.cells if c.get("cell_type") == "code" and c.get("outputs"))
        code = sum(1 for c in node.cells if c.get("cell_type") == "code")
        return (f"it has no end time (the study was killed, or is still running; {ran} of {code} code cells "
                "have output)")
    return None


def _render(nb: Path, out: Path) -> dict:
    """``nb`` as ``out/<stem>.md`` (:func:`stabstudy.run.pages.render`); returns what its execution
    measured: ``wall_s``, ``end`` (time), and as ``stabstudy study`` measured them (NaN or -1 where it
    did not) ``cpu_s``, ``runs_computed``, ``runs_stored``, ``machine`` (this one where it did not say)
    and ``commit`` (absent where it did not: the report's own commit stands in)."""
    import nbformat

    from stabstudy.run import pages

    node = nbformat.read(nb, as_version=4)
    pm = node.metadata.get("papermill", {})
    pages.render(node, nb.stem, out)
    meta = node.metadata.get("stabstudy", {})
    cpu = meta.get("cpu_s")
    return {"wall_s": float(pm.get("duration") or float("nan")), "end": str(pm.get("end_time") or ""),
            **({"commit": str(meta["commit"])} if meta.get("commit") else {}),
            "machine": str(meta.get("machine") or costs.machine()),
            "cpu_s": float(cpu) if cpu is not None else float("nan"),
            "runs_computed": int(meta.get("runs_computed", -1)), "runs_stored": int(meta.get("runs_stored", -1))}


def from_scratch(page: dict, previous: dict | None) -> dict | None:
    """A page's from-scratch measurement: its own execution's (wall and CPU seconds, runs, commit,
    end) where it computed every run it used, else the one the previous page of that notebook
    carried (None where no execution of it ever computed all its runs)."""
    if page.get("runs_computed", -1) > 0 and page.get("runs_stored", -1) == 0:
        return {k: page[k] for k in ("wall_s", "cpu_s", "commit", "end")} | {"runs": page["runs_computed"]}
    return (previous or {}).get("from_scratch")


def _claims_table(profile: str, stem: str):
    """A notebook's saved claims table (None where it saved none)."""
    import pandas as pd

    f = paths.claims_dir(profile) / f"{stem}.csv"
    return pd.read_csv(f, keep_default_na=False, na_values=[""]) if f.exists() else None


def _claims_rows(df, stem: str) -> dict[str, list[str]]:
    """A notebook's confirmatory and exploratory rows for ``CLAIMS.md``, each led by the notebook."""
    if df is None:
        return {"confirmatory": [f"| {stem} | (no claims table saved) |" + " |" * 10], "exploratory": []}
    return {"confirmatory": [f"| {stem} {line}" for line in claims_markdown.confirmatory_lines(df)],
            "exploratory": [f"| {stem} {line}" for line in claims_markdown.exploratory_lines(df)]}


def _rows(pages: dict[str, dict], role: str) -> list[str]:
    """The rows of one role over every page (a page published before the tables had roles has a
    plain list of rows in the old columns: none of them is shown as confirmatory)."""
    return [row for e in pages.values() if isinstance(e["claims"], dict) for row in e["claims"][role]]


def _cpu(page: dict) -> str:
    cpu = page.get("cpu_s", float("nan"))
    return f"{cpu:.0f} s" if cpu == cpu else "not measured"


def _runs(page: dict) -> str:
    n, stored = page.get("runs_computed", -1), page.get("runs_stored", -1)
    return f"{n} / {stored}" if n >= 0 else "not recorded"


def _kept(out: Path, executed: list[str]) -> dict[str, dict]:
    """The pages of ``out`` (already published) to keep: notebooks that still exist and were not
    executed this time, each with its manifest entry (commit, end time, wall time, sources, claim rows)."""
    f = out / "manifest.json"
    if not f.exists():
        return {}
    old = json.loads(f.read_text())
    alive = {nb.stem for nb in (paths.root() / "notebooks").glob("[0-9][0-9]_*.ipynb")}
    return {stem: e for stem, e in old.get("notebooks", {}).items()
            if stem in alive and stem not in executed and (out / f"{stem}.md").exists()}


def publish(profile: str = "quick") -> list[Path]:
    """Write ``results/<profile>/`` from ``build/<profile>/`` and ``figures/``; return the files written.

    The notebooks executed in ``build/<profile>/`` replace their pages; the pages of the other
    notebooks stay as they were published, with their own commit and date (a study run with
    ``--only`` publishes what it ran and keeps the rest). ``CLAIMS.md`` names each page's commit."""
    import nbformat

    from stabstudy.run.store import git_commit, source_hashes

    executed = _executed(profile)
    refused = [(nb, why) for nb in executed if (why := unfinished(nbformat.read(nb, as_version=4)))]
    if refused:  # before anything is touched: the published pages stay as they are
        raise UnfinishedExecutionError(
            "\n".join(f"{nb} did not finish: {why}" for nb, why in refused) +
            f"\nnothing was published; run them again (`stabstudy study --profile {profile} --only "
            + " ".join(nb.stem[:2] for nb, _ in refused) + "`: stored runs are reused), or delete them from "
            f"{paths.build_dir() / profile} to publish the others")
    commit = git_commit()  # before the old pages go: removing tracked files would read as +dirty
    out = paths.results_dir(profile)
    stems = [nb.stem for nb in executed]
    kept = _kept(out, stems)
    before = json.loads((out / "manifest.json").read_text()).get("notebooks", {}) \
        if (out / "manifest.json").exists() else {}  # read before the old pages go
    if out.exists():  # only the kept pages, their images and figures survive
        for f in sorted(out.iterdir()):
            owner = f.name.removesuffix(".md").removesuffix("_files")
            if f.name != "figures" and owner not in kept:
                shutil.rmtree(f) if f.is_dir() else f.unlink()
        for d in sorted((out / "figures").glob("*")):
            if d.name not in kept:
                shutil.rmtree(d)
    out.mkdir(parents=True, exist_ok=True)
    sources = source_hashes()
    pages = dict(kept)
    for nb in executed:
        for png in sorted(paths.figures_dir(nb.stem).glob("*.png")):
            target = out / "figures" / nb.stem / png.name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(png, target)
        measured = _render(nb, out)  # after the copies: a figure the page shows is its execution's own
        # the execution's own commit (in measured) wins over the report's
        table = _claims_table(profile, nb.stem)
        page = {"commit": commit, **measured, "claims": _claims_rows(table, nb.stem), "sources": sources,
                "table": None if table is None else table.to_dict("records")}
        pages[nb.stem] = page | {"from_scratch": from_scratch(page, before.get(nb.stem))}
    pages = dict(sorted(pages.items()))
    commits = list(dict.fromkeys(e["commit"] for e in pages.values()))
    machines = list(dict.fromkeys(e.get("machine", "not recorded") for e in pages.values()))
    ends = [e["end"] for e in pages.values() if e["end"]]
    versions = _versions()
    code = f"commit `{commits[0]}`" if len(commits) == 1 else \
        "per notebook (below; a page is replaced when its notebook is run again)"
    head = [
        f"# Claims of the `{profile}` study",
        "",
        "Generated by `stabstudy report --profile " + profile + "` from the executed notebooks; "
        "every verdict is computed by the rules in `stabstudy/analysis/claims.py` "
        "(supported / not supported / inconclusive / not tested).",
        "",
        f"- profile: `{profile}`; code: {code}",
        "- machine: " + (machines[0] if len(machines) == 1 else "per notebook (the cost table below)"),
        "- versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()),
        f"- study finished: {max(ends) if ends else 'unknown'}",
        "- wall time per notebook: " + ", ".join(f"{s} {e['wall_s']:.0f} s" for s, e in pages.items()),
        "- CPU time per notebook (`stabstudy study`'s meter: the kernel and its workers): " +
        ", ".join(f"{s} {_cpu(e)}" for s, e in pages.items()),
        "- runs each execution computed / found stored: " + ", ".join(f"{s} {_runs(e)}" for s, e in pages.items()),
        *([] if len(commits) == 1 else
          ["- commit and end per notebook: " + ", ".join(f"{s} `{e['commit'][:12]}` {e['end'] or 'unknown'}"
                                                         for s, e in pages.items())]),
        "",
        *costs.table(pages, profile),
        "",
        "## Confirmatory claims",
        "",
        "Each claim states, before the runs, its smallest effect of interest and its family (one question in "
        "one domain); p-values are Holm-adjusted within the family; power: P(supported) at the planning effect "
        "/ P(not supported) at no effect, at the family's alpha.",
        "",
        *claims_markdown.header(("notebook", *claims_markdown.CONFIRMATORY_HEAD)),
        *_rows(pages, "confirmatory"),
        "",
        "## Exploratory rows",
        "",
        "Descriptions, not tests: raw p-values and intervals, no verdict.",
        "",
        *claims_markdown.header(("notebook", *claims_markdown.EXPLORATORY_HEAD)),
        *_rows(pages, "exploratory"),
        *([] if all(isinstance(e["claims"], dict) for e in pages.values()) else
          ["", "## Pages published before the claims had families", "",
           "| notebook | claim | source | effect [CI] | n | test | p (Holm) | verdict | reason |",
           "|---|---|---|---|---|---|---|---|---|",
           *[row for e in pages.values() if isinstance(e["claims"], list) for row in e["claims"]]]),
        "",
        "Notebooks: " + ", ".join(f"[{s}]({s}.md)" for s in pages),
        "",
    ]
    (out / "CLAIMS.md").write_text("\n".join(head))
    findings.write(out, {s: e.get("table") for s, e in pages.items()}, paths.root() / "notebooks")
    manifest = {"profile": profile, "notebooks": pages}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    if profile == "quick":  # the README's cost block is the quick study's
        costs.update_readme(paths.root() / "README.md", pages, profile)
    return sorted(p for p in out.rglob("*") if p.is_file())


def _notebook_of(path: str) -> str | None:
    """The stem of a notebook's own file (``notebooks/NN_name.ipynb``), None for a shared source."""
    name = Path(path)
    if name.parent.as_posix() == "notebooks" and name.suffix == ".ipynb" and name.stem[:2].isdigit():
        return name.stem
    return None


def check(profile: str = "quick") -> list[str]:
    """What changed in the sources since the pages of ``results/<profile>/`` were made (empty when
    current): each page against the sources it was made from (the library and its own notebook;
    another notebook's file does not make it stale), and every notebook without a page."""
    f = paths.results_dir(profile) / "manifest.json"
    if not f.exists():
        return [f"no published results in {f.parent}: run `stabstudy study --profile {profile}` "
                f"then `stabstudy report --profile {profile}`"]
    from stabstudy.run.store import source_hashes

    pages = json.loads(f.read_text()).get("notebooks", {})
    now, changed = source_hashes(), {}
    for stem, e in pages.items():
        then = e["sources"]
        mine = {p for p in set(then) | set(now) if _notebook_of(p) in (None, stem)}
        for p in sorted(mine):
            kind = "changed" if p in then and p in now and then[p] != now[p] else \
                "added" if p not in then else "removed" if p not in now else None
            if kind:
                changed[f"{kind}: {p}"] = None
    for p in now:
        if _notebook_of(p) and _notebook_of(p) not in pages:
            changed[f"added: {p}"] = None
    stale = costs.readme_stale(paths.root() / "README.md", pages, profile) if profile == "quick" else None
    if stale:
        changed[stale] = None
    order = {"changed": 0, "added": 1, "removed": 2}
    return sorted(changed, key=lambda c: (order[c.split(":")[0]], c))
