"""Theory beside measurement in the dashboard's figure (``dlab.ui.plots``): the bubble panel's
formula and simulations, the model state beside the measured memory, the bytes panels' model
and wire figures named as such, and a timeline legend in the bars' colours, clear of the bars."""
from __future__ import annotations

import pytest
from helpers import TINY_GPT
from matplotlib.colors import to_hex
from test_dashboard import record_pipeline_run

import dlab
from dlab.theory.memory import model_units, zero_memory
from dlab.ui.figure import KIND_COLORS, MiB
from dlab.ui.gantt import WAIT_COLOR, WAITING, WAITS
from dlab.ui.plots import compare, plot

P, M = 2, 8


@pytest.fixture(scope="module")
def one_f_one_b(tmp_path_factory):
    """A finished 2-rank pipeline-1f1b run with m = 8 micro-batches, and its figure."""
    run = dlab.launch("pipeline-1f1b", P, runs_dir=tmp_path_factory.mktemp("runs"), wait=True,
                      options={"microbatches": M}, **TINY_GPT)
    assert run.state == "ok"
    return run, plot(run)


def axes_titled(fig, start: str):
    return next(ax for ax in fig.axes if ax.get_title().startswith(start))


def bars(ax) -> dict[str, list[float]]:
    """Bar heights by the label each series was drawn with."""
    return {c.get_label(): [p.get_height() for p in c] for c in ax.containers}


def test_bubble_panel_sets_the_formula_and_simulations_beside_the_measured_bars(one_f_one_b):
    run, fig = one_f_one_b
    ax = axes_titled(fig, "bubble")
    assert "1f1b p=2 m=8" in ax.get_title()
    heights = bars(ax)
    assert set(heights) == {"measured", "simulated (model), measured op times",
                            "simulated (model), mean op times"}
    assert all(len(h) == P for h in heights.values())
    (formula,) = [line for line in ax.get_lines() if line.get_label().startswith("formula (model)")]
    assert formula.get_ydata()[0] == pytest.approx(100 * (P - 1) / (M + P - 1))
    # Replayed with free messages, the measured op times cannot idle more than the run did.
    for sim, measured in zip(heights["simulated (model), measured op times"], heights["measured"]):
        assert sim <= measured + 2
    # Each stage is replayed at its own mean op times, so their imbalance shows: the stage that
    # computes longer waits less (equal times would give the closed form on both).
    busy = [sum(e["end"] - e["start"] for e in run.timeline(r)
                if e["kind"] in ("forward", "backward") and e["step"] > 0) for r in range(P)]
    mean_op = heights["simulated (model), mean op times"]
    assert (mean_op[0] < mean_op[1]) == (busy[0] > busy[1])
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(t.startswith("formula (model)") for t in legend) and "measured" in legend


def test_a_hand_recorded_gpipe_step_is_its_own_simulation(tmp_path):
    """The recorded steps have no communication gaps: replaying each op's measured time gives
    the measured bubble exactly, and the formula for p = m = 2 is 1/3."""
    record_pipeline_run(tmp_path / "run")
    heights = bars(axes_titled(plot(tmp_path / "run"), "bubble"))
    assert heights["measured"] == pytest.approx([100 / 3] * 2)
    assert heights["simulated (model), measured op times"] == pytest.approx(heights["measured"])


def test_timeline_legend_has_the_bars_colours_and_keeps_off_them(one_f_one_b):
    run, fig = one_f_one_b
    ax = axes_titled(fig, "timeline of step")
    step = int(ax.get_title().split()[3])
    shown = [e for e in run.timeline() if e["step"] == step and e["kind"] != "step"]
    # a transfer is drawn as the wait it cost (a thin red bar), every other kind as its own bar
    waits = [e for e in shown if e["kind"] in WAITS and e["end"] > e["start"]]
    drawn = {e["kind"] for e in shown if e["kind"] not in WAITS} | ({WAITING} if waits else set())
    bar_colors = [to_hex(p.get_facecolor()) for p in ax.patches]
    legend = ax.get_legend()
    kinds = [t.get_text() for t in legend.get_texts()]
    assert set(kinds) == drawn
    for kind, handle in zip(kinds, legend.legend_handles, strict=True):
        color = to_hex(handle.get_facecolor())
        assert color == (WAIT_COLOR if kind == WAITING else KIND_COLORS[kind])
        count = len(waits) if kind == WAITING else sum(e["kind"] == kind for e in shown)
        assert bar_colors.count(color) == count, kind
    fig.draw_without_rendering()  # lays the figure out, as saving it does
    for panel in (ax, axes_titled(fig, "bubble"), axes_titled(fig, "memory")):
        box = panel.get_legend().get_window_extent()
        assert not box.overlaps(panel.get_window_extent()), panel.get_title()


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_memory_panel_shows_the_model_state_beside_the_measured_bars(strategy, tmp_path):
    run = dlab.launch(strategy, 2, runs_dir=tmp_path / "runs", wait=True, **TINY_GPT)
    ax = axes_titled(plot(run), "memory")
    model = [p for p in ax.patches if p.get_gid() == "model"]
    assert len(model) == 2 * 5  # per rank, one stacked bar of the five categories
    tops = sorted({round(p.get_y() + p.get_height(), 9) for p in model})
    if strategy == "zero2":
        units = model_units("gpt", TINY_GPT["model_options"])
        mem = zero_memory(units, 2, 2, optimizer=TINY_GPT["optimizer"])
        want = sum(v for k, v in mem.items() if k != "padding") / MiB
    else:
        want = sum(run.metrics(0)[-1]["memory"][k] for k in ("parameters", "gradients", "optimizer")) / MiB
    assert tops[-1] == pytest.approx(want)
    # measured to the byte: parameters + gradients + optimizer state of rank 0
    measured = run.metrics(0)[-1]["memory"]
    assert want == pytest.approx(sum(measured[k] for k in ("parameters", "gradients", "optimizer")) / MiB)
    assert "hatched: model state (model)" in [t.get_text() for t in ax.get_legend().get_texts()]
    side_by_side = axes_titled(compare([run]), "memory per rank")
    model = [p for p in side_by_side.patches if p.get_gid() == "model"]
    assert max(p.get_y() + p.get_height() for p in model) == pytest.approx(want)


def test_a_pipeline_run_shows_each_stage_its_own_model_state(one_f_one_b):
    """A ``pipeline-*`` run states its theory as ``nd`` does (``dlab.theory.nd.model_state`` of
    each rank's stage): one hatched bar per rank, at that rank's measured model state."""
    run, fig = one_f_one_b
    ax = axes_titled(fig, "memory")
    model = [p for p in ax.patches if p.get_gid() == "model"]
    assert len(model) == P * 5
    for r in range(P):
        measured = run.metrics(r)[-1]["memory"]
        want = sum(measured[k] for k in ("parameters", "gradients", "optimizer")) / MiB
        tops = [p.get_y() + p.get_height() for p in model[5 * r:5 * r + 5]]
        assert max(tops) == pytest.approx(want), r


def test_an_nd_run_with_a_pipeline_has_the_bubble_panel(tmp_path):
    """``nd`` with pp > 1 pipelines: its figure has the bubble panel with the schedule's formula
    (it states its pipeline as ``pipeline-*`` does; no table of names decides it)."""
    run = dlab.launch("nd", 2, runs_dir=tmp_path / "runs", wait=True,
                      options={"pp": 2, "microbatches": 4}, **TINY_GPT)
    ax = axes_titled(plot(run), "bubble")
    assert "1f1b p=2 m=4" in ax.get_title()
    (formula,) = [line for line in ax.get_lines() if line.get_label().startswith("formula (model)")]
    assert formula.get_ydata()[0] == pytest.approx(100 * 1 / 5)


def test_bytes_panels_name_the_model_and_the_wire(tmp_path):
    record_pipeline_run(tmp_path / "old")
    record_pipeline_run(tmp_path / "wired", wire_bytes=3 * MiB)
    old = axes_titled(plot(tmp_path / "old"), "communication")
    assert [line.get_label() for line in old.get_lines()][0] == "model (ring)"
    assert "wire bytes: not measured" in [t.get_text() for t in old.texts]

    wired = axes_titled(plot(tmp_path / "wired"), "communication")
    lines = {line.get_label(): line for line in wired.get_lines()}
    assert lines["measured (wire)"].get_ydata()[-1] == pytest.approx(3 * 3)  # MiB over 3 steps
    assert lines["model (ring)"].get_ydata()[-1] == pytest.approx(3 * 2)
    assert not wired.texts

    ax = axes_titled(compare([tmp_path / "old", tmp_path / "wired"]), "MiB sent per step")
    heights = bars(ax)
    assert heights["model (ring)"] == pytest.approx([2.0])
    assert heights["measured (wire)"] == pytest.approx([3.0])
