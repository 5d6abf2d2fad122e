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
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

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


def log_ticks_at(ax: plt.Axes, values, axis: str = "x") -> None:
    """Tick a log-scaled ``axis`` of ``ax`` at ``values`` only, labelled as plain numbers (``%g``).

    Over less than a decade matplotlib labels the minor ticks of a log axis too
    (``3x10^-1 4x10^-1 ...``), and they collide; the tested doses are the ticks a reader needs.
    """
    if axis not in ("x", "y"):
        raise ValueError(f"axis must be 'x' or 'y', not {axis!r}")
    values = sorted({float(v) for v in values if v > 0})
    target = ax.xaxis if axis == "x" else ax.yaxis
    target.set_major_locator(FixedLocator(values))
    target.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    target.set_minor_locator(NullLocator())


def _ticks(axis, minor: bool) -> list:
    """The ticks ``axis`` draws now (its tick list keeps spare ticks with stale positions)."""
    if minor:
        return axis.get_minor_ticks(len(axis.get_minorticklocs()))
    return axis.get_major_ticks(len(axis.get_majorticklocs()))


def _texts(ax: plt.Axes) -> list[tuple[str, object]]:
    """The visible text artists of one panel: ticks (major and minor), labels, title."""
    items = [("title", ax.title), ("xlabel", ax.xaxis.label), ("ylabel", ax.yaxis.label)]
    for name, axis in (("xtick", ax.xaxis), ("ytick", ax.yaxis)):
        lo, hi = sorted(axis.get_view_interval())
        pad = 1e-9 * max(abs(lo), abs(hi), 1.0)
        for minor in (False, True):
            kind = f"minor {name}" if minor else name
            # ticks outside the view limits keep a label object that is never drawn
            items += [(kind, lab) for tick in _ticks(axis, minor) if lo - pad <= tick.get_loc() <= hi + pad
                      for lab in (tick.label1, tick.label2) if lab.get_visible()]
    return [(k, t) for k, t in items if t.get_visible() and t.get_text()]


def overlaps(fig: plt.Figure) -> list[str]:
    """Text elements whose bounding boxes intersect (empty when clean): any two of *different*
    panels, and two tick labels of the same axis of one panel (major or minor: a log axis over
    less than a decade labels its minor ticks, which then crowd each other)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [(i, kind, t.get_text(), t.get_window_extent(renderer))
             for i, ax in enumerate(fig.axes) if ax.get_visible() for kind, t in _texts(ax)]
    found = []
    for a in range(len(boxes)):
        for b in range(a + 1, len(boxes)):
            (i, ka, ta, ba), (j, kb, tb, bb) = boxes[a], boxes[b]
            same_axis_ticks = i == j and "tick" in ka and ka.split()[-1] == kb.split()[-1]
            if (i != j or same_axis_ticks) and ba.overlaps(bb) and ba.width > 0 and bb.width > 0:
                found.append(f"panel {i} {ka} {ta!r} overlaps panel {j} {kb} {tb!r}")
    return found
