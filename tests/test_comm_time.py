"""Communication time that never exceeds the step: the busy time is the union of the
collectives' spans, the exposed time the part of it no computation covers
(``dlab.core.events.comm_times``). The hand-built cases are worked out on paper, apart from the
code; the run has DDP's buckets overlapping backward and each other, where the plain sum of the
spans can pass the step."""
from __future__ import annotations

import pytest
from helpers import TINY_GPT

import dlab
from dlab.analysis.summary import Summary
from dlab.core.events import comm_times


def test_overlapping_collectives_are_counted_once_and_compute_hides_them():
    # in flight 0-4, 1-3, 2-6 (sum 10 s) while the rank computes 0-5: the network is busy
    # 0-6 (6 s), and only 5-6 is not covered by compute (1 s)
    assert comm_times([(0, 4), (1, 3), (2, 6)], [], [(0, 5)], (0, 10)) == pytest.approx((1.0, 6.0))


def test_a_wait_inside_a_compute_span_is_exposed():
    # a tensor-parallel forward 0-3 that blocks 1-2 in its all-reduce: that second is exposed
    assert comm_times([(1, 2)], [(1, 2)], [(0, 3)], (0, 3)) == pytest.approx((1.0, 1.0))
    # a wait() 4-5 on an async op launched at 2 whose compute ended at 4: 4-5 exposed, 2-5 busy
    assert comm_times([(2, 5)], [(4, 5)], [(0, 4)], (0, 6)) == pytest.approx((1.0, 3.0))


def test_spans_are_clipped_to_the_step():
    # an op launched in the last step (-2) ends at 1; an op still running after the step's end
    assert comm_times([(-2, 1), (4, 9)], [], [], (0, 5)) == pytest.approx((2.0, 2.0))


def _by_the_unit(comm, blocked, compute, window) -> tuple[int, int]:
    """The definition read off one-unit cells, apart from ``core.events``: a cell of the window
    is busy when some collective or wait covers it, and exposed when it is busy and no
    computation covers it except where the rank is blocked."""
    def on(spans, t):
        return any(s <= t < e for s, e in spans)
    busy = exposed = 0
    for t in range(*window):
        if on(comm, t) or on(blocked, t):
            busy += 1
            exposed += not on(compute, t) or on(blocked, t)
    return exposed, busy


@pytest.mark.parametrize("seed", range(40))
def test_random_spans_nested_or_overlapping_count_as_the_cells_they_cover(seed):
    """Spans nested in others, repeated, touching or crossing the window's ends: each covered
    second counts once, whatever the order the spans come in."""
    import random

    rng = random.Random(seed)

    def spans(n):
        out = []
        for _ in range(n):
            s = rng.randrange(-3, 22)
            out.append((s, s + rng.randrange(1, 9)))
        if out and rng.random() < 0.5:  # one span nested in another, as a wait inside its op
            s, e = out[0]
            out.append((s + (e - s) // 3, e - (e - s) // 3 or e))
        return out

    comm, blocked, compute = (spans(rng.randrange(0, k)) for k in (6, 3, 4))
    window = (0, 20)
    assert comm_times(comm, blocked, compute, window) == pytest.approx(
        _by_the_unit(comm, blocked, compute, window)), (comm, blocked, compute)


def test_a_span_nested_in_another_counts_once():
    # a collective 2-3 inside one 0-6, and a wait 4-5 inside that one: 6 s busy; compute 0-4
    # covers 0-4 but for nothing blocked, so 4-6 is exposed
    assert comm_times([(0, 6), (2, 3)], [(4, 5)], [(0, 4)], (0, 10)) == pytest.approx((2.0, 6.0))
    assert comm_times([(2, 3), (0, 6)], [], [], (0, 10)) == pytest.approx((6.0, 6.0))


def test_ddp_with_overlapping_buckets_never_reports_more_than_the_step(runs_dir):
    """Eight or so buckets per step on a 4-layer model, all-reduced while backward runs: in each
    record exposed <= busy <= the sum of the ops' spans, and busy <= the step; the summary shows
    both, named, and neither passes the step."""
    model = {"n_layer": 4, "d_model": 32, "n_head": 2, "seq_len": 32}
    run = dlab.launch("ddp", 2, runs_dir=runs_dir, wait=True, options={"bucket_cap_mb": 0.02},
                      **{**TINY_GPT, "model_options": model, "steps": 3})
    assert run.state == "ok", run.error()
    overlapped = False
    for rank in (0, 1):
        for m in run.metrics(rank):
            c = m["comm"]
            assert m["comm_by_op"]["all_reduce"]["calls"] >= 4
            # exposed may be 0: a loaded machine can finish every bucket inside backward
            assert 0 <= c["exposed_seconds"] <= c["busy_seconds"] + 1e-9, (rank, m["step"], c)
            assert c["busy_seconds"] <= c["seconds"] + 1e-6, (rank, m["step"], c)
            assert c["busy_seconds"] <= m["step_time"] + 1e-6, (rank, m["step"], c)
            overlapped |= c["seconds"] > c["busy_seconds"] + 1e-6
        events = [e for e in run.timeline(rank) if e["step"] == 1]
        backward = next(e for e in events if e["kind"] == "backward")
        assert min(e["start"] for e in events if e["kind"] == "all_reduce") < backward["end"]
    assert overlapped, "no step had two all-reduces in flight at once: the test shows nothing"
    summary = run.summary()
    text = str(summary)
    assert "comm exposed ms" in text and "comm busy ms" in text and "comm ms/step" not in text
    for r in summary.rows:
        assert r["comm_exposed_s_per_step"] <= r["comm_busy_s_per_step"] <= r["step_time_s"] + 1e-6


def test_old_records_without_the_figures_show_a_dash():
    memory = {"parameters": 1, "gradients": 1, "optimizer": 1, "activations": 1}
    row = {"rank": 0, "steps": 2, "loss": 1.0, "first_step_s": 1.0, "step_time_s": 1.0,
           "tokens_per_s": 1.0, "mfu": 0.1, "memory": memory, "memory_total": 4,
           "comm_sent_per_step": 0, "comm_wire_per_step": None,
           "comm_exposed_s_per_step": None, "comm_busy_s_per_step": None}
    head, body = Summary("old", "ok", [row]).table()
    assert body[0][head.index("comm exposed ms")] == "-" == body[0][head.index("comm busy ms")]
