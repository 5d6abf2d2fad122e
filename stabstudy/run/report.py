"""Publish a study's results so they can be read without running anything, and tell when they are stale.

``publish(profile)`` turns what ``stabstudy study`` left in ``build/<profile>/`` (the
executed notebooks and each notebook's claims table) and ``figures/`` into
``results/<profile>/``:

* ``CLAIMS.md``: every claim of every notebook in one table, headed by the profile,
  the code version, the machine, the package versions, the date of the study and each
  notebook's wall time (all read from the executed notebooks, so regenerating the
  report from the same study gives the same bytes);
* ``<notebook>.md`` with its images as separate PNG files in ``<notebook>_files/`` (stream
  outputs as a terminal shows them: a progress bar is its last state, not each redraw);
* ``figures/<notebook>/*.png``;
* ``manifest.json``: a content hash of every source file that made them.

``check(profile)`` compares that manifest with the files now in ``stabstudy/`` and
``notebooks/`` (the profiles included) and names what changed.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import platform
import shutil
from pathlib import Path

from stabstudy import paths

#: Folders whose contents decide the published numbers.
SOURCES = ("stabstudy", "notebooks")
#: Packages whose versions head CLAIMS.md.
PACKAGES = ("torch", "numpy", "scipy", "xarray", "pandas", "stable-baselines3", "gymnasium", "mujoco",
            "statsmodels", "scikit-learn", "papermill")


def source_hashes() -> dict[str, str]:
    """sha256 of every source file under :data:`SOURCES`, keyed by its repo-relative path."""
    root = paths.root()
    out = {}
    for folder in SOURCES:
        for f in sorted((root / folder).rglob("*")):
            if f.is_file() and "__pycache__" not in f.parts and ".ipynb_checkpoints" not in f.parts:
                out[f.relative_to(root).as_posix()] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "not installed"
    return out


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import os

    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{cpu}, {os.cpu_count()} cores, {gpu}"


def _executed(profile: str) -> list[Path]:
    src = paths.build_dir() / profile
    nbs = sorted(src.glob("[0-9][0-9]_*.ipynb"))
    if not nbs:
        raise FileNotFoundError(f"no executed notebooks in {src}; run `stabstudy study --profile {profile}` first")
    return nbs


def _render(nb: Path, out: Path) -> tuple[float, str]:
    """``nb`` as ``out/<stem>.md`` with images in ``out/<stem>_files/``; returns (wall seconds, end time)."""
    import nbformat
    from nbconvert import MarkdownExporter

    from stabstudy.run.study import collapse_streams

    # as a reader of the notebook would see it: a progress bar's redraws are one line, not dozens
    # (`stabstudy study` stores them so already; notebooks executed otherwise may not be)
    node = collapse_streams(nbformat.read(nb, as_version=4))
    pm = node.metadata.get("papermill", {})
    for cell in node.cells:  # papermill's per-cell timings would make every report differ
        cell.metadata.pop("papermill", None)
        cell.metadata.pop("execution", None)
    files = f"{nb.stem}_files"
    body, resources = MarkdownExporter().from_notebook_node(
        node, resources={"output_files_dir": files, "unique_key": nb.stem})
    (out / f"{nb.stem}.md").write_text(body)
    for name, data in sorted(resources.get("outputs", {}).items()):
        target = out / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return float(pm.get("duration") or float("nan")), str(pm.get("end_time") or "")


def _claims_rows(profile: str, stems: list[str]) -> list[str]:
    import pandas as pd

    from stabstudy.analysis import claims

    rows: list[str] = []
    for stem in stems:
        f = paths.claims_dir(profile) / f"{stem}.csv"
        if not f.exists():
            rows.append(f"| {stem} | (no claims table saved) | | | | | | | | |")
            continue
        df = pd.read_csv(f, keep_default_na=False, na_values=[""])
        for line in claims.to_markdown(df).splitlines()[2:]:
            rows.append(f"| {stem} {line}")
    return rows


def publish(profile: str = "quick") -> list[Path]:
    """Write ``results/<profile>/`` from ``build/<profile>/`` and ``figures/``; return the files written."""
    from stabstudy.run.store import git_commit

    executed = _executed(profile)
    commit = git_commit()  # before the old results go: removing tracked files would read as +dirty
    out = paths.results_dir(profile)
    if out.exists():
        shutil.rmtree(out)  # a notebook removed since must not leave its old page behind
    out.mkdir(parents=True)
    timings, ends = {}, []
    for nb in executed:
        timings[nb.stem], end = _render(nb, out)
        ends.append(end)
        for png in sorted(paths.figures_dir(nb.stem).glob("*.png")):
            target = out / "figures" / nb.stem / png.name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(png, target)
    stems = [nb.stem for nb in executed]
    versions = _versions()
    head = [
        f"# Claims of the `{profile}` study",
        "",
        "Generated by `stabstudy report --profile " + profile + "` from the executed notebooks; "
        "every verdict is computed by the rules in `stabstudy/analysis/claims.py` "
        "(supported / not supported / inconclusive / not tested; p-values Holm-adjusted within each notebook).",
        "",
        f"- profile: `{profile}`; code: commit `{commit}`",
        f"- machine: {_machine()}",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()),
        f"- study finished: {max(ends) if any(ends) else 'unknown'}",
        "- wall time per notebook: " + ", ".join(f"{s} {t:.0f} s" for s, t in timings.items()),
        "",
        "| notebook | claim | source | effect [CI] | n | test | p (Holm) | verdict | reason |",
        "|---|---|---|---|---|---|---|---|---|",
        *_claims_rows(profile, stems),
        "",
        "Notebooks: " + ", ".join(f"[{s}]({s}.md)" for s in stems),
        "",
    ]
    (out / "CLAIMS.md").write_text("\n".join(head))
    manifest = {"profile": profile, "commit": commit, "sources": source_hashes()}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return sorted(p for p in out.rglob("*") if p.is_file())


def check(profile: str = "quick") -> list[str]:
    """What changed in the sources since ``results/<profile>/`` was made (empty when current)."""
    f = paths.results_dir(profile) / "manifest.json"
    if not f.exists():
        return [f"no published results in {f.parent}: run `stabstudy study --profile {profile}` "
                f"then `stabstudy report --profile {profile}`"]
    then = json.loads(f.read_text())["sources"]
    now = source_hashes()
    changed = [f"changed: {p}" for p in sorted(set(then) & set(now)) if then[p] != now[p]]
    changed += [f"added: {p}" for p in sorted(set(now) - set(then))]
    changed += [f"removed: {p}" for p in sorted(set(then) - set(now))]
    return changed
