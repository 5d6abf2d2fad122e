"""Figures: panels whose labels collide are detected; saved files carry no dates."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from stabstudy import plots  # noqa: E402


def test_overlapping_panels_are_found_and_constrained_layout_clears_them():
    fig, axes = plt.subplots(2, 2, figsize=(3, 2))
    for ax in axes.flat:
        ax.plot([1e5, 2e5], [1e5, 2e5])
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
