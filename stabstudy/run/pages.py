"""An executed notebook as a Markdown page a person can read on a web page or in an editor.

:func:`render` writes ``<out>/<stem>.md``:

* every figure :func:`stabstudy.plots.savefig` showed becomes a relative image link,
  ``figures/<notebook>/<name>.png``, with that PNG (the execution's own) written there;
  other images go to ``<stem>_files/``;
* a table (a pandas DataFrame's HTML) becomes a Markdown table, and no other raw HTML is kept
  where a text form exists;
* paths of the machine it ran on (the project's folder, the home folder, site-packages, the
  kernel's temporary cell files) are shortened to what they mean there;
* streams are shown as a terminal shows them (:func:`stabstudy.run.study.collapse_streams`).
"""

from __future__ import annotations

import base64
import os
import re
from pathlib import Path
from typing import Any

from stabstudy import paths
from stabstudy.plots import FIGURE_KEY
from stabstudy.run.study import collapse_streams

#: A file of a Python environment's packages: ``.../site-packages/scipy/x.py`` -> ``site-packages/scipy/x.py``.
_SITE_PACKAGES = re.compile(r"(?:[^\s'\"():]*/)?site-packages/")
#: The file IPython compiles a cell into: ``/tmp/ipykernel_14859/259835745.py`` -> ``<cell>``.
_CELL_FILE = re.compile(r"(?:[^\s'\"():]*/)?ipykernel_\d+/\d+\.py")


def local_paths(text: str) -> str:
    """``text`` without the paths of the machine it was printed on: the project root, the data and
    figure folders, the home folder, site-packages and IPython's cell files become ``.``-relative
    paths, ``$STABSTUDY_DATA``, ``$STABSTUDY_FIGURES``, ``~``, ``site-packages/`` and ``<cell>``."""
    text = _CELL_FILE.sub("<cell>", text)
    text = _SITE_PACKAGES.sub("site-packages/", text)
    root = str(paths.root())
    figures, data = paths.figures_dir(), paths.data_dir()
    named = [(str(figures), "figures" if figures == paths.root() / "figures" else "$STABSTUDY_FIGURES"),
             (str(data), "data" if data == paths.root() / "data" else "$STABSTUDY_DATA"),
             (root, "."), (os.path.expanduser("~"), "~")]
    for folder, name in sorted(named, key=lambda p: -len(p[0])):  # the longest first: a folder inside another
        if folder not in ("", "/", "~"):
            text = re.sub(re.escape(folder) + r"(?=/|\b|$)", name, text)
    return text


def markdown_table(html: str) -> str | None:
    """The first ``<table>`` of ``html`` (a pandas DataFrame's, with its spanning headers and index
    levels) as a Markdown table; None where there is none. A cell spanning columns or rows is
    repeated in each, and the header rows of a column are joined, so every row reads alone."""
    from bs4 import BeautifulSoup  # nbconvert's own dependency

    table = BeautifulSoup(html, "html.parser").find("table")
    if table is None:
        return None
    head = table.find("thead")
    head_rows = len(head.find_all("tr")) if head is not None else 0
    rows: list[list[str]] = []
    below: dict[int, tuple[str, int]] = {}  # column -> (text, rows still to fill) of a cell spanning rows
    for tr in table.find_all("tr"):
        row: list[str] = []
        cells = iter(tr.find_all(["th", "td"], recursive=False))
        while True:
            col = len(row)
            if col in below:
                text, left = below.pop(col)
                row.append(text)
                if left > 1:
                    below[col] = (text, left - 1)
                continue
            cell = next(cells, None)
            if cell is None:
                break
            text = " ".join(cell.get_text(" ", strip=True).split()).replace("|", "\\|")
            for k in range(int(cell.get("colspan", 1) or 1)):
                if int(cell.get("rowspan", 1) or 1) > 1:
                    below[col + k] = (text, int(cell.get("rowspan")) - 1)
                row.append(text)
        rows.append(row)
    if not rows:
        return None
    width = max(len(r) for r in rows)
    rows = [r + [""] * (width - len(r)) for r in rows]
    head_rows = head_rows or 1
    header = [" ".join(dict.fromkeys(r[c] for r in rows[:head_rows] if r[c])) for c in range(width)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * width]
    lines += ["| " + " | ".join(r) + " |" for r in rows[head_rows:]]
    return "\n".join(lines)


def _readable(out: Any, page_dir: Path) -> Any:
    """One output of a cell as its page shows it (see the module's docstring)."""
    import nbformat

    kind = out.get("output_type")
    if kind == "stream":
        out.text = local_paths(out.text)
        return out
    if kind not in ("display_data", "execute_result"):
        return out
    data = out.get("data", {})
    figure = out.get("metadata", {}).get(FIGURE_KEY)
    if figure and "image/png" in data:
        target = page_dir / "figures" / figure
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(base64.b64decode(data["image/png"]))
        name = Path(figure).stem
        return nbformat.v4.new_output("display_data", data={"text/markdown": f"![{name}](figures/{figure})"})
    if "text/html" in data:
        table = markdown_table(data["text/html"])
        if table is not None:
            data = {"text/markdown": table}
        elif "text/plain" in data or "text/markdown" in data:
            data = {k: v for k, v in data.items() if k != "text/html"}
    out.data = {k: local_paths(v) if k.startswith("text/") and isinstance(v, str) else v for k, v in data.items()}
    return out


def render(nb: Any, stem: str, page_dir: Path) -> Path:
    """Write ``nb`` (an executed notebook as ``nbformat.read`` gives it) as ``page_dir/<stem>.md``, its figures under
    ``page_dir/figures/`` and its other images under ``page_dir/<stem>_files/``; return the page."""
    from nbconvert import MarkdownExporter

    node = collapse_streams(nb)
    for cell in node.cells:
        cell.metadata.pop("papermill", None)  # per-cell timings would make every page differ
        cell.metadata.pop("execution", None)
        if cell.get("cell_type") == "code":
            cell.outputs = [_readable(o, page_dir) for o in cell.get("outputs", [])]
    files = f"{stem}_files"
    body, resources = MarkdownExporter().from_notebook_node(node, resources={"output_files_dir": files,
                                                                             "unique_key": stem})
    page = page_dir / f"{stem}.md"
    page.write_text(body)
    for name, data in sorted(resources.get("outputs", {}).items()):
        target = page_dir / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return page
