"""Figures: panels whose labels collide are detected; saved files carry no dates."""

import itertools

import matplotlib
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from stabstudy import plots  # noqa: E402


def test_overlapping_panels_are_found_and_constrained_layout_clears_them():
    fig, axes = plt.subplots(2, 2, figsize=(3, 2))
    for ax in axes.flat:
        ax.plot([1, 2], [1e5, 2e5])
        ax.set_title("a long panel title here")
        ax.set_xlabel("optimizer update")
    assert plots.overlaps(fig)
    plt.close(fig)
    fig, axes = plt.subplots(2, 2, figsize=(8, 6), layout="constrained")
    for ax in axes.flat:
        ax.plot([1, 2], [1, 2])
        ax.set_title("title")
    assert plots.overlaps(fig) == []
    plt.close(fig)


def test_saved_pdf_and_svg_have_no_dates(tmp_path, monkeypatch):
    monkeypatch.setenv("STABSTUDY_FIGURES", str(tmp_path))
    plots.setup()
    fig, ax = plt.subplots()
    ax.plot([0, 1])
    first = [p.read_bytes() for p in plots.savefig(fig, "nb", "f", formats=("png", "pdf", "svg"))]
    second = [p.read_bytes() for p in plots.savefig(fig, "nb", "f", formats=("png", "pdf", "svg"))]
    plt.close(fig)
    assert first == second
    assert b"CreationDate" not in first[1] and b"<dc:date>" not in first[2]


def _crowded(**kw) -> plt.Figure:
    fig, axes = plt.subplots(2, 2, **kw)
    for ax in axes.flat:
        ax.plot([1, 2], [1e5, 2e5])
        ax.set_yticks([1e5, 2e5], ["100000", "200000"])  # wide y tick labels reach into the panel to the left
        ax.set_title("a long panel title here")
        ax.set_xlabel("optimizer update")
    return fig


def test_setup_gives_constrained_layout_which_clears_a_crowded_grid():
    with plt.rc_context():  # setup() changes global rcParams; keep them to this test
        plots.setup()
        fig = _crowded(figsize=(7, 5))
        assert fig.get_layout_engine().__class__.__name__ == "ConstrainedLayoutEngine"
        assert plots.overlaps(fig) == []
        plt.close(fig)
        fig = _crowded(figsize=(7, 5), layout="none")  # the same figure without it collides
        assert plots.overlaps(fig)
        plt.close(fig)


def test_savefig_warns_about_overlapping_panels_and_saves_anyway(tmp_path, monkeypatch):
    import warnings

    monkeypatch.setenv("STABSTUDY_FIGURES", str(tmp_path))
    fig = _crowded(figsize=(3, 2), layout="none")
    with pytest.warns(plots.OverlapWarning, match=r"figure nb/crowded: panel \d .* overlaps panel \d"):
        written = plots.savefig(fig, "nb", "crowded", formats=("png",))
    assert [p.name for p in written] == ["crowded.png"] and written[0].stat().st_size > 0
    plt.close(fig)
    fig = _crowded(figsize=(8, 6), layout="constrained")
    with warnings.catch_warnings():
        warnings.simplefilter("error", plots.OverlapWarning)
        plots.savefig(fig, "nb", "clean", formats=("png",))
    plt.close(fig)


def _noise_axis():
    """notebook 01's action-noise panel: a log axis over less than a decade (doses 0.3, 1, 3)."""
    fig, ax = plt.subplots(figsize=(4.3, 3), layout="constrained")
    ax.plot([0.3, 1.0, 2.9], [0.0, -400.0, -30.0], "o-")
    ax.set(xscale="log", xlabel="dose")
    return fig, ax


def test_minor_tick_labels_that_crowd_one_axis_are_found():
    fig, ax = _noise_axis()
    clashes = plots.overlaps(fig)
    assert clashes and all("minor xtick" in c and "panel 0" in c for c in clashes), clashes
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(4.3, 3), layout="constrained")
    ax.plot([1, 1000], [0, 1])
    ax.set(xscale="log")  # three decades: minor ticks unlabelled, major labels apart
    assert plots.overlaps(fig) == []
    plt.close(fig)


def test_log_ticks_at_the_doses_clear_the_crowded_axis():
    fig, ax = _noise_axis()
    plots.log_ticks_at(ax, [0.0, 0.3, 1.0, 3.0, 1.0])  # zero (the unperturbed dose) has no place on a log axis
    assert plots.overlaps(fig) == []
    fig.canvas.draw()
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0.3", "1", "3"]
    assert len(ax.xaxis.get_minorticklocs()) == 0
    with pytest.raises(ValueError, match="'x' or 'y'"):
        plots.log_ticks_at(ax, [1.0], axis="z")
    plt.close(fig)


DOSES = [1.44, 2.08, 3.0, 4.48]


def _dose_axis(width: float, spaced: bool) -> tuple[plt.Figure, plt.Axes]:
    """notebook 01's lr-spike dose axis: doses a factor ~1.44 apart, every one labelled, on a log axis."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    fig, ax = plt.subplots(figsize=(width, 2), layout="constrained")
    ax.plot(DOSES, [0.0, 0.2, 0.5, 0.9], "o-")
    ax.set(xscale="log", xlabel="dose")
    if spaced:
        plots.log_ticks_at(ax, DOSES)
    else:  # what log_ticks_at did before: a label at every dose
        ax.xaxis.set_major_locator(FixedLocator(DOSES))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
        ax.xaxis.set_minor_locator(NullLocator())
    return fig, ax


def _label_gaps(fig, ax) -> list[float]:
    fig.canvas.draw()
    boxes = [t.get_window_extent(fig.canvas.get_renderer()) for t in ax.get_xticklabels() if t.get_text()]
    return [b.x0 - a.x1 for a, b in itertools.pairwise(boxes)]


def test_tick_labels_that_run_together_are_found_though_their_boxes_do_not_touch():
    with plt.rc_context():
        plots.setup()
        fig, ax = _dose_axis(1.93, spaced=False)
        gaps = _label_gaps(fig, ax)
        assert 0 < gaps[0] < 0.3 * 11 * fig.dpi / 72  # "1.442.08": apart, by less than a space
        assert plots.overlaps(fig) == ["panel 0 xtick '1.44' runs into panel 0 xtick '2.08'"]
        plt.close(fig)
        fig, ax = _dose_axis(3.0, spaced=False)  # room enough: a space and more between labels
        assert plots.overlaps(fig) == []
        plt.close(fig)


def test_log_ticks_at_leaves_out_the_labels_that_would_run_together():
    with plt.rc_context():
        plots.setup()
        fig, ax = _dose_axis(1.93, spaced=True)
        assert plots.overlaps(fig) == []
        assert [t.get_text() for t in ax.get_xticklabels()] == ["1.44", "", "3", "4.48"]
        assert list(ax.get_xticks()) == DOSES  # every dose keeps its tick
        plt.close(fig)
        fig, ax = _dose_axis(3.0, spaced=True)
        fig.canvas.draw()
        assert [t.get_text() for t in ax.get_xticklabels()] == ["1.44", "2.08", "3", "4.48"]
        plt.close(fig)


NAMES = ["none", "z_lr", "z_rollback", "olmo", "clip1", "olmo@published", "zclip"]


def _categories(width: float) -> plt.Figure:
    """notebook 05's controllers: categorical labels turned by 45 degrees, ending at their ticks."""
    fig, ax = plt.subplots(figsize=(width, 3), layout="constrained")
    ax.plot(range(len(NAMES)), range(len(NAMES)), "o")
    ax.set_xticks(range(len(NAMES)), NAMES, rotation=45, ha="right", rotation_mode="anchor")
    return fig


def test_turned_labels_are_compared_as_drawn_not_by_their_upright_boxes():
    with plt.rc_context():
        plots.setup()
        fig = _categories(4.0)
        fig.canvas.draw()
        boxes = [t.get_window_extent(fig.canvas.get_renderer()) for t in fig.axes[0].get_xticklabels()]
        assert any(a.overlaps(b) for a, b in itertools.pairwise(boxes))  # the upright boxes do
        assert plots.overlaps(fig) == []  # the turned labels do not
        plt.close(fig)
        fig = _categories(1.5)  # too narrow: they do overlap
        assert "panel 0 xtick 'z_lr' overlaps panel 0 xtick 'z_rollback'" in plots.overlaps(fig)
        plt.close(fig)


def _damage_figure(helpers: bool) -> plt.Figure:
    """notebook 05's damage_and_false_interventions on made-up numbers: controllers as categories,
    one controller's false interventions (197 per 1,000 steps) far above the others'."""
    import numpy as np
    import pandas as pd
    import seaborn as sns

    rng = np.random.default_rng(0)
    ctrl = ["none", "z_skip", "z_lr", "z_rollback", "olmo", "zclip", "clip1", "olmo@published", "zclip@published",
            "z_adam", "z_clip", "nonfinite"]  # the quick profile's
    pert = pd.DataFrame([{"controller": c, "damage": d, "label": f"{dom}: lr_spike x{x}/8"}
                         for c in ctrl for dom in ("toy", "lm", "ppo") for x in (10, 30)
                         for d in rng.normal(0.3, 0.2, 3)])
    fa = pd.DataFrame([{"controller": c, "domain": dom, "false_per_1k": 197.0 if c == "clip1" else v}
                       for c in ctrl for dom, v in (("toy", 2.0), ("lm", 0.5), ("ppo", 0.0))])
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    sns.pointplot(data=pert, x="controller", y="damage", hue="label", dodge=0.4, linestyle="none", errorbar=None,
                  order=ctrl, ax=axes[0])
    sns.barplot(data=fa, x="controller", y="false_per_1k", hue="domain", ax=axes[1])
    axes[1].axhline(1.0, color="k", ls=":", lw=1, label="calibration budget")
    for ax in axes:
        if helpers:
            plots.turn_labels(ax)
            plots.legend_beside(ax, fontsize=7)
        else:  # as the notebook drew it
            ax.tick_params(axis="x", rotation=45)
            ax.legend(fontsize=7)
    if helpers:
        assert plots.symlog_if_dwarfed(axes[1], fa.false_per_1k)
    return fig


def test_the_damage_figure_is_clean_with_turned_labels_legends_beside_and_a_log_axis():
    with plt.rc_context():
        plots.setup()
        for helpers in (False, True):
            fig = _damage_figure(helpers)
            assert plots.overlaps(fig) == []
            renderer = fig.canvas.get_renderer()
            for ax in fig.axes:  # with the helpers each legend stands right of its panel, off the data
                beside = ax.get_legend().get_window_extent(renderer).x0 >= ax.get_window_extent(renderer).x1
                assert beside == helpers
            assert fig.axes[1].get_yscale() == ("symlog" if helpers else "linear")
            plt.close(fig)


def test_symlog_only_where_one_value_dwarfs_the_rest():
    fig, ax = plt.subplots()
    assert not plots.symlog_if_dwarfed(ax, [3.0, 2.0, 4.0, 0.0])
    assert ax.get_yscale() == "linear"
    assert plots.symlog_if_dwarfed(ax, [197.0, 2.0, 0.5, 0.0, float("nan")])
    assert ax.get_yscale() == "symlog" and ax.yaxis.get_transform().linthresh == 0.1  # the decade below 0.5
    with pytest.raises(ValueError, match="'x' or 'y'"):
        plots.symlog_if_dwarfed(ax, [1.0], axis="z")
    plt.close(fig)
