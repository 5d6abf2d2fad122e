"""One figure style for the whole study, and saving to ``figures/<notebook>/``.

:func:`setup` makes every new figure use constrained layout (panels, labels and titles
spaced so they do not collide); :func:`savefig` warns (:class:`OverlapWarning`) when
text of different panels still overlaps, which an executed notebook then shows and
``stabstudy study`` repeats on the terminal.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import matplotlib.pyplot as plt  # headless: matplotlib falls back to Agg without a display
import seaborn as sns

from stabstudy import paths


def setup() -> None:
    """Apply the study's figure style (call once per notebook)."""
    sns.set_theme(context="notebook", style="whitegrid", palette="colorblind")
    plt.rcParams.update({"figure.dpi": 100, "savefig.dpi": 150, "savefig.bbox": "tight",
                         "axes.titlesize": "medium", "figure.autolayout": False,
                         # constrained layout for every figure: tick labels and titles of neighbouring
                         # panels otherwise collide (a later fig.tight_layout() replaces it, with a warning)
                         "figure.constrained_layout.use": True,
                         "svg.hashsalt": "stabstudy"})  # fixed SVG ids: same data, same bytes


class OverlapWarning(UserWarning):
    """Text of different panels of a saved figure overlaps (see :func:`overlaps`)."""


#: No creation dates in saved files, so the same data give the same bytes (published results are diffed).
_NO_DATES: dict[str, dict] = {"pdf": {"CreationDate": None, "ModDate": None}, "svg": {"Date": None}}


def savefig(fig: plt.Figure, notebook: str, name: str, formats: tuple[str, ...] = ("png", "pdf")) -> list[Path]:
    """Save ``fig`` as ``figures/<notebook>/<name>.<fmt>`` for each format; return the paths.

    Warns :class:`OverlapWarning` (and saves all the same) when :func:`overlaps` finds text of
    different panels overlapping: the figure is still worth having, but needs a fix.
    """
    clashes = overlaps(fig)
    if clashes:
        more = f" (and {len(clashes) - 3} more)" if len(clashes) > 3 else ""
        warnings.warn(f"figure {notebook}/{name}: " + "; ".join(clashes[:3]) + more, OverlapWarning, stacklevel=2)
    out = paths.figures_dir(notebook)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for fmt in formats:
        p = out / f"{name}.{fmt}"
        fig.savefig(p, metadata=_NO_DATES.get(fmt))
        written.append(p)
    return written


def mark_window(ax: plt.Axes, start: float, end: float, label: str | None = "perturbation", **kw) -> None:
    """Shade a perturbation window on ``ax``."""
    ax.axvspan(start, end, color=kw.pop("color", "tab:red"), alpha=kw.pop("alpha", 0.15), label=label, lw=0, **kw)


def _texts(ax: plt.Axes) -> list[tuple[str, object]]:
    """The visible text artists of one panel that can collide with another's: ticks, labels, title."""
    items = [("title", ax.title), ("xlabel", ax.xaxis.label), ("ylabel", ax.yaxis.label)]
    for name, axis in (("xtick", ax.xaxis), ("ytick", ax.yaxis)):
        lo, hi = sorted(axis.get_view_interval())
        pad = 1e-9 * max(abs(lo), abs(hi), 1.0)
        # ticks outside the view limits keep a label object that is never drawn
        items += [(name, lab) for tick in axis.get_major_ticks() if lo - pad <= tick.get_loc() <= hi + pad
                  for lab in (tick.label1, tick.label2) if lab.get_visible()]
    return [(k, t) for k, t in items if t.get_visible() and t.get_text()]


def overlaps(fig: plt.Figure) -> list[str]:
    """Pairs of text elements of *different* panels whose bounding boxes intersect (empty when clean)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [(i, kind, t.get_text(), t.get_window_extent(renderer))
             for i, ax in enumerate(fig.axes) if ax.get_visible() for kind, t in _texts(ax)]
    found = []
    for a in range(len(boxes)):
        for b in range(a + 1, len(boxes)):
            (i, ka, ta, ba), (j, kb, tb, bb) = boxes[a], boxes[b]
            if i != j and ba.overlaps(bb) and ba.width > 0 and bb.width > 0:
                found.append(f"panel {i} {ka} {ta!r} overlaps panel {j} {kb} {tb!r}")
    return found
