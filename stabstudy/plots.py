"""One figure style for the whole study, and saving to ``figures/<notebook>/``; a quick look at
one run's telemetry (:func:`telemetry`).

:func:`setup` makes every new figure use constrained layout (panels, labels and titles
spaced so they do not collide) and compact numbers on long axes; :func:`savefig` shows the
figure in the executed notebook (its page links it) and warns (:class:`OverlapWarning`) when
text of different panels still overlaps or tick labels run together, which an executed
notebook then shows and ``stabstudy study`` repeats on the terminal. :func:`log_ticks_at`,
:func:`turn_labels`, :func:`legend_beside` and :func:`symlog_if_dwarfed` are the usual fixes.
Needs the ``[plot]`` extra (matplotlib, seaborn).
"""

from __future__ import annotations

import base64
import io
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib.pyplot as plt  # headless: matplotlib falls back to Agg without a display
import numpy as np
import seaborn as sns
from matplotlib.legend import Legend
from matplotlib.textpath import TextToPath
from matplotlib.ticker import FixedLocator, Formatter, NullFormatter, NullLocator

from stabstudy import paths

if TYPE_CHECKING:
    import xarray as xr

#: The channels :func:`telemetry` draws by default, in this order, where the Dataset has them.
TELEMETRY_PANELS = ("loss", "grad_norm", "update_ratio", "update_grad_cos", "lr", "controller_score")
#: Channels :func:`telemetry` draws on a log scale where their values span more than a decade.
LOG_PANELS = ("loss", "grad_norm", "grad_norm_applied", "grad_norm_raw", "update_norm", "update_ratio",
              "adam_m_norm", "adam_v_mean", "lambda_max", "val_loss", "test_loss")


def setup() -> None:
    """Apply the study's figure style (call once per notebook)."""
    sns.set_theme(context="notebook", style="whitegrid", palette="colorblind")
    plt.rcParams.update({"figure.dpi": 100, "savefig.dpi": 150, "savefig.bbox": "tight",
                         "axes.titlesize": "medium", "figure.autolayout": False,
                         # constrained layout for every figure: tick labels and titles of neighbouring
                         # panels otherwise collide (a later fig.tight_layout() replaces it, with a warning)
                         "figure.constrained_layout.use": True,
                         # environment steps (260000 280000 ...) as 2.6 2.8 ... x10^5: six-digit labels
                         # run together on a panel's axis
                         "axes.formatter.limits": (-4, 4), "axes.formatter.use_mathtext": True,
                         "svg.hashsalt": "stabstudy"})  # fixed SVG ids: same data, same bytes


class OverlapWarning(UserWarning):
    """Text of different panels of a saved figure overlaps, or tick labels of one axis run together
    (see :func:`overlaps`)."""


#: No creation dates in saved files, so the same data give the same bytes (published results are diffed).
_NO_DATES: dict[str, dict] = {"pdf": {"CreationDate": None, "ModDate": None}, "svg": {"Date": None}}


#: Where a figure :func:`savefig` shows in a notebook says which it is (``<notebook>/<name>.png``), in
#: the output's metadata: ``stabstudy report`` links the published PNG there.
FIGURE_KEY = "stabstudy_figure"


class SavedFigure(list):
    """The paths :func:`savefig` wrote. As a cell's last value it shows nothing: the figure is shown
    (a list of this machine's paths would be printed into the executed notebook and its page)."""

    def _ipython_display_(self) -> None:
        pass


def savefig(fig: plt.Figure, notebook: str, name: str, formats: tuple[str, ...] = ("png", "pdf")) -> SavedFigure:
    """Save ``fig`` as ``figures/<notebook>/<name>.<fmt>`` for each format; return the paths.

    Warns :class:`OverlapWarning` (and saves all the same) when :func:`overlaps` finds text of
    different panels overlapping: the figure is still worth having, but needs a fix. In a
    notebook kernel whose matplotlib backend does not show figures itself (``stabstudy study``
    runs them under Agg) the saved PNG is shown in the cell, marked with :data:`FIGURE_KEY`, so
    that the executed notebook and its published page carry every figure it made.
    """
    clashes = overlaps(fig)
    if clashes:
        more = f" (and {len(clashes) - 3} more)" if len(clashes) > 3 else ""
        warnings.warn(f"figure {notebook}/{name}: " + "; ".join(clashes[:3]) + more, OverlapWarning, stacklevel=2)
    out = paths.figures_dir(notebook)
    out.mkdir(parents=True, exist_ok=True)
    written = SavedFigure()
    for fmt in formats:
        p = out / f"{name}.{fmt}"
        fig.savefig(p, metadata=_NO_DATES.get(fmt))
        written.append(p)
    _show(fig, notebook, name, out / f"{name}.png" if "png" in formats else None)
    return written


def _show(fig: plt.Figure, notebook: str, name: str, png: Path | None) -> None:
    """Display ``fig`` (the saved ``png``, else one made now) in the running kernel, if any, unless
    its inline backend will show the figure itself at the end of the cell."""
    ipython = sys.modules.get("IPython")  # imported by a kernel; a script or a test has none running
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is None or getattr(shell, "kernel", None) is None or "inline" in plt.get_backend():
        return
    if png is None:
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        data = buf.getvalue()
    else:
        data = png.read_bytes()
    # here, not at the top: IPython is there wherever a kernel runs, and figures need none
    from IPython.display import display

    display({"image/png": base64.b64encode(data).decode(), "text/plain": f"figure {notebook}/{name}"},
            raw=True, metadata={FIGURE_KEY: f"{notebook}/{name}.png"})


def mark_window(ax: plt.Axes, start: float, end: float, label: str | None = "perturbation", **kw) -> None:
    """Shade a perturbation window on ``ax``."""
    ax.axvspan(start, end, color=kw.pop("color", "tab:red"), alpha=kw.pop("alpha", 0.15), label=label, lw=0, **kw)


class SpacedLabels(Formatter):
    """Plain-number tick labels (``%g``) that leave out a label which would come closer than
    :data:`TICK_GAP_EM` to the one kept before it on an x axis, or touch it on a y axis (its tick
    keeps its mark). Which fit depends on
    the panel's drawn length, so it is decided at every draw, from the font's own glyph widths
    (the same in PNG and PDF)."""

    def __call__(self, x: float, pos: int | None = None) -> str:
        return f"{x:g}"

    def format_ticks(self, values) -> list[str]:
        labels = [self(v) for v in values]
        if self.axis is None or len(labels) < 2:
            return labels
        ax, horizontal = self.axis.axes, self.axis.axis_name == "x"
        font = self.axis.majorTicks[0].label1.get_fontproperties()
        scale = ax.figure.dpi / 72
        at = ax.transData.transform([(v, 1.0) if horizontal else (1.0, v) for v in values])[:, 0 if horizontal else 1]
        if horizontal:  # side by side: a space between them at least
            size = [_TEXT.get_text_width_height_descent(lab, font, ismath=False)[0] * scale for lab in labels]
            gap = TICK_GAP_EM * font.get_size_in_points() * scale
        else:  # stacked up the axis like lines of text: their height is what may collide
            size, gap = [font.get_size_in_points() * scale] * len(labels), 0.0
        end, shown = -np.inf, list(labels)
        for k in np.argsort(at):
            if at[k] - size[k] / 2 < end + gap:
                shown[k] = ""
            else:
                end = at[k] + size[k] / 2
        return shown


#: Measures text with the font's own metrics, whichever backend draws.
_TEXT = TextToPath()


def legend_beside(ax: plt.Axes, **kw) -> Legend:
    """``ax``'s legend right of the panel, outside its data (constrained layout makes room): inside,
    it covers curves or points wherever matplotlib puts it. ``kw`` go to ``Axes.legend``."""
    return ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, **kw)


def turn_labels(ax: plt.Axes, angle: float = 45.0, axis: str = "x") -> None:
    """Turn ``axis``'s tick labels by ``angle`` degrees, each ending at its tick: centred on their
    ticks, a long label turned beside a short one runs into it."""
    if axis not in ("x", "y"):
        raise ValueError(f"axis must be 'x' or 'y', not {axis!r}")
    labels = ax.get_xticklabels() if axis == "x" else ax.get_yticklabels()
    plt.setp(labels, rotation=angle, ha="right", rotation_mode="anchor")


def symlog_if_dwarfed(ax: plt.Axes, values, axis: str = "y", ratio: float = 10.0) -> bool:
    """Put ``axis`` on a symmetric log scale when the largest of ``values`` is more than ``ratio``
    times their median size (bars of 197 and of 2 on one linear axis: every bar but one is flat);
    linear up to the power of ten at or below the smallest nonzero size, so zeros stay at the base.
    Returns whether it did."""
    if axis not in ("x", "y"):
        raise ValueError(f"axis must be 'x' or 'y', not {axis!r}")
    size = np.abs(np.asarray(values, dtype=float))
    size = size[np.isfinite(size) & (size > 0)]
    if size.size < 2 or size.max() <= ratio * np.median(size):
        return False
    linthresh = float(10.0 ** np.floor(np.log10(size.min())))  # a decade: ticks 0, 0.1, 1, ... keep apart
    (ax.set_yscale if axis == "y" else ax.set_xscale)("symlog", linthresh=linthresh)
    return True


def log_ticks_at(ax: plt.Axes, values, axis: str = "x") -> None:
    """Tick a log-scaled ``axis`` of ``ax`` at ``values`` only, labelled as plain numbers (``%g``),
    each label that would run into its neighbour left out (:class:`SpacedLabels`).

    Over less than a decade matplotlib labels the minor ticks of a log axis too
    (``3x10^-1 4x10^-1 ...``), and they collide; the tested doses are the ticks a reader needs, and
    doses a factor 1.44 apart ("1.44", "2.08", ...) need more room than a narrow panel has.
    """
    if axis not in ("x", "y"):
        raise ValueError(f"axis must be 'x' or 'y', not {axis!r}")
    values = sorted({float(v) for v in values if v > 0})
    target = ax.xaxis if axis == "x" else ax.yaxis
    target.set_major_locator(FixedLocator(values))
    target.set_major_formatter(SpacedLabels())
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


#: Two tick labels of one axis closer than this (in ems of their font, about a space) run together:
#: the dose axis "1.44", "2.08" read "1.442.08" without their boxes touching.
TICK_GAP_EM = 0.3


def _outline(text, renderer) -> np.ndarray:
    """The four corners (pixels) of ``text`` as drawn: its box turned by its rotation. The window
    extent of turned text is the upright box around those corners, and neighbouring turned tick
    labels overlap in that box while far apart on the page."""
    box = text.get_window_extent(renderer)
    angle = text.get_rotation()
    if angle % 90 == 0:
        return np.array([(box.x0, box.y0), (box.x1, box.y0), (box.x1, box.y1), (box.x0, box.y1)])
    text.set_rotation(0)
    try:
        flat = text.get_window_extent(renderer)
    finally:
        text.set_rotation(angle)
    half = np.array([(-1, -1), (1, -1), (1, 1), (-1, 1)]) * (flat.width / 2, flat.height / 2)
    c, s = np.cos(np.radians(angle)), np.sin(np.radians(angle))
    # the upright box around a turned rectangle has the rectangle's centre
    return half @ np.array([[c, s], [-s, c]]) + ((box.x0 + box.x1) / 2, (box.y0 + box.y1) / 2)


def _gap(p: np.ndarray, q: np.ndarray) -> float:
    """How far apart the convex outlines ``p`` and ``q`` are along the edge normal that parts them
    most (separating axes; negative where they overlap)."""
    best = -np.inf
    for poly in (p, q):
        edges = np.roll(poly, -1, axis=0) - poly
        for nx, ny in np.stack([-edges[:, 1], edges[:, 0]], axis=1):
            norm = np.hypot(nx, ny)
            if norm == 0:
                continue
            a, b = p @ (nx / norm, ny / norm), q @ (nx / norm, ny / norm)
            best = max(best, b.min() - a.max(), a.min() - b.max())
    return float(best)


def _on_one_line(p: np.ndarray, q: np.ndarray, a, b) -> bool:
    """Whether upright texts ``a`` and ``b`` (outlines ``p``, ``q``) stand side by side on one line,
    where a gap narrower than a space reads as one word; stacked like lines of text, they read apart."""
    upright = a.get_rotation() % 180 == 0 and b.get_rotation() % 180 == 0
    return upright and min(p[:, 1].max(), q[:, 1].max()) > max(p[:, 1].min(), q[:, 1].min())


def overlaps(fig: plt.Figure) -> list[str]:
    """Text elements that overlap or run together (empty when clean): any two of *different*
    panels that overlap, and two tick labels of the same axis of one panel that overlap (major
    or minor: a log axis over less than a decade labels its minor ticks, which then crowd each
    other) or, side by side on one line, stand less than :data:`TICK_GAP_EM` apart (labels such
    as doses then read as one: "1.442.08"). Turned labels are compared as drawn, not by the
    upright boxes around them."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [(i, kind, t, t.get_window_extent(renderer))
             for i, ax in enumerate(fig.axes) if ax.get_visible() for kind, t in _texts(ax)]
    boxes = [(i, kind, t, _outline(t, renderer)) for i, kind, t, box in boxes if box.width > 0 and box.height > 0]
    found = []
    for a in range(len(boxes)):
        for b in range(a + 1, len(boxes)):
            (i, ka, ta, pa), (j, kb, tb, pb) = boxes[a], boxes[b]
            same_axis_ticks = i == j and "tick" in ka and ka.split()[-1] == kb.split()[-1]
            if i != j or same_axis_ticks:
                gap = _gap(pa, pb)
                least = TICK_GAP_EM * max(ta.get_fontsize(), tb.get_fontsize()) * fig.dpi / 72 \
                    if same_axis_ticks and _on_one_line(pa, pb, ta, tb) else 0.0
                if gap < least:
                    how = "overlaps" if gap < 0 else "runs into"
                    found.append(f"panel {i} {ka} {ta.get_text()!r} {how} panel {j} {kb} {tb.get_text()!r}")
    return found


def _windows(mask: np.ndarray, steps: np.ndarray) -> list[tuple[float, float]]:
    """The runs of consecutive True in ``mask`` as (first step, last step + 1)."""
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    return [(float(steps[a]), float(steps[b - 1]) + 1.0) for a, b in zip(np.flatnonzero(edges == 1),
                                                                          np.flatnonzero(edges == -1), strict=True)]


def _acted(ds: xr.Dataset) -> dict[float, str]:
    """Steps where a controller acted, with the action's name (a Monitor's ``controller_action``)
    or ``"intervened"`` (a stored run's ``intervened``)."""
    steps = ds["step"].values
    if "controller_action" in ds and ds["controller_action"].dtype.kind in "US":
        return {float(s): str(a) for s, a in zip(steps, ds["controller_action"].values, strict=True)
                if a not in ("", "none")}
    if "intervened" in ds:
        return {float(s): "intervened" for s, i in zip(steps, ds["intervened"].values, strict=True) if i == 1.0}
    return {}


def telemetry(ds: xr.Dataset, channels: Sequence[str] | None = None, *, title: str | None = None) -> plt.Figure:
    """One run's telemetry at a glance: a panel per channel against ``step``, with the perturbation
    windows shaded (``perturbed``) and the steps where a controller acted marked (a Monitor's
    ``controller_action``, a stored run's ``intervened``).

    Args:
        ds: a Monitor's ``to_dataset()`` or one stored run (``RunStore().load(spec)``, or
            ``load_runs(...).isel(run=i)``).
        channels: what to draw (default: those of :data:`TELEMETRY_PANELS` the Dataset has);
            ``grad_norm``'s panel also draws ``grad_norm_applied`` (dashed) where the two differ.
        title: the figure's title.

    A channel of :data:`LOG_PANELS` whose values span more than a decade is drawn on a log scale. Returns the
    figure (``plots.savefig`` or ``fig.savefig`` it; in a notebook it shows).
    """
    if "step" not in ds.dims or "run" in ds.dims:
        raise ValueError(f"telemetry draws one run (dimension 'step'), got dims {dict(ds.sizes)}: "
                         "select one run, e.g. ds.isel(run=0)")
    if channels is None:
        channels = [c for c in TELEMETRY_PANELS if c in ds and np.isfinite(ds[c].values.astype(float)).any()]
    missing = [c for c in channels if c not in ds or ds[c].dims != ("step",) or ds[c].dtype.kind not in "fiub"]
    if missing:
        valid = [str(v) for v, da in ds.data_vars.items() if da.dims == ("step",) and da.dtype.kind in "fiub"]
        raise ValueError(f"cannot draw {missing}: not numeric channels along step of this Dataset; "
                         f"valid: {', '.join(valid)}")
    if not channels:
        raise ValueError("nothing to draw: the Dataset has none of " + ", ".join(TELEMETRY_PANELS))
    steps = ds["step"].values.astype(float)
    fig, axes = plt.subplots(len(channels), 1, sharex=True, figsize=(8, 1.6 + 1.4 * len(channels)), squeeze=False,
                             layout="constrained")
    perturbed = ds["perturbed"].values == 1.0 if "perturbed" in ds else np.zeros(len(steps), bool)
    acted = _acted(ds)
    for ax, ch in zip(axes[:, 0], channels, strict=True):
        y = ds[ch].values.astype(float)
        ok = np.isfinite(y)
        line, = ax.plot(steps[ok], y[ok], lw=1.2, label=f"_{ch}", marker="." if ok.sum() < 0.5 * len(y) else None)
        if ch == "grad_norm" and "grad_norm_applied" in ds:
            applied = ds["grad_norm_applied"].values.astype(float)
            if not np.allclose(applied, y, rtol=1e-6, equal_nan=True):
                line.set_label("before clipping")
                ax.plot(steps, applied, lw=1.0, ls="--", label="applied (after clipping)")
                ax.legend(fontsize="small", loc="upper left")
        pos = y[ok & (y > 0)]
        if ch in LOG_PANELS and pos.size and ok.sum() == pos.size and pos.max() > 10 * pos.min():
            ax.set_yscale("log")
            ax.yaxis.set_minor_formatter(NullFormatter())  # labelled minor ticks crowd a short panel
        for i, (a, b) in enumerate(_windows(perturbed, ds["step"].values)):
            mark_window(ax, a, b, label=None if i or ax is not axes[0, 0] else "perturbation")
        for j, (s, name) in enumerate(sorted(acted.items())):
            ax.axvline(s, color="tab:purple", lw=0.8, alpha=0.7,
                       label=f"controller: {name}" if j == 0 and ax is axes[0, 0] else None)
        ax.set_ylabel(ch, fontsize="small")
    if perturbed.any() or acted:
        axes[0, 0].legend(fontsize="small", loc="upper right")
    axes[-1, 0].set_xlabel("step (optimizer update)")
    if title:
        fig.suptitle(title)
    return fig
