"""Notebook 11's planner figure and explorer controls as a learner sees them: the learner's bar
labelled and on top, no two bars on one row, every legend below its panel (a legend inside the
axes covered the learner's bar and the memory limit's line), no layout warning however few the
bars, and twelve controls in rows that fit a laptop's window."""
from __future__ import annotations

import warnings

import pytest

from dlab.plan import PlanLayout, clusters, models, plan
from dlab.ui.figure import png

pytest.importorskip("matplotlib")
pytest.importorskip("ipywidgets")

from dlab.ui.plan import bar_labels, control_rows, layout_bars  # noqa: E402


@pytest.fixture(scope="module")
def preds():
    llama, h100 = models.preset("llama3-70b"), clusters.preset("h100-sxm")
    layouts = [PlanLayout(dp=32, tp=8, pp=4, zero=1, sequence_parallel=True, micro_batch=1),
               PlanLayout(dp=32, tp=8, pp=4, zero=1, sequence_parallel=True, micro_batch=1),
               PlanLayout(dp=64, tp=8, pp=2, zero=1, sequence_parallel=True, micro_batch=1)]
    return [plan(llama, h100, lay, 1024, 8192, "megatron-core-2024") for lay in layouts]


def _drawn(fig):
    """``fig`` drawn as a notebook shows it; its renderer, to measure where things landed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Tight layout not applied" and its kin fail the test
        png(fig)
        canvas = FigureCanvasAgg(fig)
        canvas.draw()
    return canvas.get_renderer()


@pytest.mark.parametrize("count", [1, 3])
def test_the_bars_draw_without_a_layout_warning_and_legends_below_their_panels(preds, count):
    fig = layout_bars(preds[:count], "title", first="yours" if count > 1 else None)
    renderer = _drawn(fig)
    legends = [leg for sub in fig.subfigs for leg in sub.legends]
    assert len(legends) == 2, "one legend per panel"
    axes = [ax for sub in fig.subfigs for ax in sub.axes]
    for ax in axes:
        box = ax.get_window_extent(renderer)
        for leg in legends:
            other = leg.get_window_extent(renderer)
            assert not box.overlaps(other), "a legend must not sit on the bars or the limit's line"
            assert other.y1 <= box.y0 + 1, "each legend goes below the panels"
    mem_labels = legends[0].get_texts()
    assert any("memory" in t.get_text() for t in mem_labels), "the dashed limit is named"


def test_the_learners_bar_is_labelled_and_on_top_and_equal_layouts_get_two_rows(preds):
    fig = layout_bars(preds, "title", first="yours")
    _drawn(fig)
    ax = fig.subfigs[0].axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == bar_labels(preds, "yours")
    assert labels[0].startswith("yours: ") and labels[1].startswith("1. ")
    assert len(set(labels)) == len(labels), "two equal layouts would share a row"
    low, high = ax.get_ylim()
    assert low > high, "the y axis runs downwards: the first bar, the learner's, on top"
    assert ax.get_yticks()[0] == 0


def test_a_lone_bar_is_its_layouts_name(preds):
    assert bar_labels(preds[:1]) == [preds[0].layout.describe()]


def test_twelve_controls_make_three_rows_of_four_that_fit_a_laptop_window():
    import ipywidgets as W

    controls = [W.Dropdown(options=[1, 2], description=f"c{i}") for i in range(11)]
    controls.append(W.IntSlider(value=1, min=0, max=3, description="ZeRO"))
    box = control_rows(controls)
    assert [len(row.children) for row in box.children] == [4, 4, 4]
    widths = [int(c.layout.width.removesuffix("px")) for c in controls]
    assert sum(widths[:4]) <= 1000, "a row must fit beside JupyterLab's side bar at 1,400 pixels"
    slider = controls[-1]
    assert slider.layout.width == controls[0].layout.width
    assert int(slider.style.description_width.removesuffix("px")) <= 50, "the slider keeps room for its track"
