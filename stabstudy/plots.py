"""One figure style for the whole study, and saving to ``figures/<notebook>/``."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt  # headless: matplotlib falls back to Agg without a display
import seaborn as sns

from stabstudy import paths


def setup() -> None:
    """Apply the study's figure style (call once per notebook)."""
    sns.set_theme(context="notebook", style="whitegrid", palette="colorblind")
    plt.rcParams.update({"figure.dpi": 100, "savefig.dpi": 150, "savefig.bbox": "tight",
                         "axes.titlesize": "medium", "figure.autolayout": False,
                         "svg.hashsalt": "stabstudy"})  # fixed SVG ids: same data, same bytes


#: No creation dates in saved files, so the same data give the same bytes (published results are diffed).
_NO_DATES: dict[str, dict] = {"pdf": {"CreationDate": None, "ModDate": None}, "svg": {"Date": None}}


def savefig(fig: plt.Figure, notebook: str, name: str, formats: tuple[str, ...] = ("png", "pdf")) -> list[Path]:
    """Save ``fig`` as ``figures/<notebook>/<name>.<fmt>`` for each format; return the paths."""
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
