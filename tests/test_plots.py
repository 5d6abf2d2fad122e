"""Figures: panels whose labels collide are detected; saved files carry no dates."""

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
        ax.plot([1, 2], [1e5, 2e5])  # wide y tick labels reach into the panel to the left
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
