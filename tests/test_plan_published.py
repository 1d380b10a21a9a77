"""The planner against what it can be checked against: published runs at scale (each row's own
metric and FLOPs convention) and a run on this machine (memory and bytes to the byte)."""
from __future__ import annotations

import pytest

import dlab
from dlab.bench.nd import BATCH, MODEL
from dlab.bench.plan import plan_layout, predict
from dlab.plan import clusters, published


def test_published_rows_come_from_three_sources_and_are_predicted_within_15_percent():
    results = published.check()
    assert len(results) >= 10
    assert len({r["source"] for r in results}) >= 3
    assert all("table" in r["source"] for r in results)
    assert published.mean_abs_error(results) <= 0.15
    assert max(abs(r["throughput_error"]) for r in results) < 0.5


def test_each_row_predicts_the_papers_own_metric():
    row = next(r for r in published.ROWS if r.metric == "tflops_per_gpu" and r.convention == "megatron")
    m, b, s = row.model, row.global_batch, row.seq_len
    # Narayanan et al. eq. 3, written out: 96 B s l h^2 (1 + s/6h + V/16lh) FLOPs per iteration
    h, layers = m.d_model, m.n_layer
    flops = 96 * b * s * layers * h * h * (1 + s / (6 * h) + m.vocab / (16 * layers * h))
    assert row.predicted(10.0) == pytest.approx(flops / 10.0 / row.gpus / 1e12)
    timed = next(r for r in published.ROWS if r.metric == "iteration_s")
    assert timed.predicted(12.5) == 12.5


def test_korthikanti_iteration_times_agree_with_the_mfu_they_report():
    """A typo guard from an independent figure: the paper's (and Megatron-LM's README's) MFU of
    each present-work run, from its model FLOPs 72 B s l h^2 (1 + s/6h + V/12lh), its time and
    N x 312 TFLOP/s."""
    rows = [r for r in published.ROWS if "mfu" in r.extra]
    assert len(rows) == 4
    for r in rows:
        m, b, s = r.model, r.global_batch, r.seq_len
        h, layers = m.d_model, m.n_layer
        flops = 72 * b * s * layers * h * h * (1 + s / (6 * h) + m.vocab / (12 * layers * h))
        assert flops / (r.value * r.gpus * 312e12) == pytest.approx(r.extra["mfu"], abs=0.002), m.name


def test_a_run_here_holds_what_the_plan_says_to_the_byte(tmp_path):
    options = {"dp": 2, "zero": 1, "pp": 2}
    run = dlab.launch("nd", 4, runs_dir=tmp_path, wait=True, model_options=MODEL, options=options,
                      batch_size=BATCH, steps=2)
    machine = clusters.this_machine(peak=1e10, ranks=4)
    pred = predict(options, machine)
    state = max(sum(m["memory"][k] for k in ("parameters", "gradients", "optimizer"))
                for m in (run.metrics(r)[-1] for r in range(4)))
    sent = max(run.metrics(r)[-1]["comm"]["sent_bytes"] for r in range(4))
    act = max(run.metrics(r)[-1]["memory"]["activations"] for r in range(4))
    assert pred["state_plan_MB"] * 1e6 == pytest.approx(state, abs=1)
    assert pred["sent_plan_MB"] * 1e6 == pytest.approx(sent, abs=1)
    assert pred["act_plan_MB"] * 1e6 == pytest.approx(act, rel=0.02)


SLOW = pytest.mark.slow
LAYOUTS = [pytest.param({"cp": 2, "tp": 2, "sequence_parallel": True, "zero": 1}, id="cp2-tp2-sp-zero1"),
           pytest.param({"pp": 2, "tp": 2, "sequence_parallel": True}, id="pp2-tp2-sp", marks=SLOW),
           pytest.param({"tp": 4}, id="tp4", marks=SLOW),
           pytest.param({"pp": 2, "dp": 2, "zero": 1}, id="pp2-dp2-zero1")]


@pytest.mark.parametrize("options", LAYOUTS)
def test_the_plan_counts_the_collectives_a_run_makes(options, tmp_path):
    """On the CPU with more ranks than cores every blocking collective is charged its measured
    cost, so the count per dimension must be the run's: each rank's calls per step, as its comm
    meter booked them, against ``collective_calls`` for its pipeline stage."""
    from dlab.models.gpt import GPTConfig
    from dlab.theory.plan import cpu as tm
    from dlab.theory.plan.spec import from_gpt
    lay = plan_layout(options)
    run = dlab.launch("nd", 4, runs_dir=tmp_path, wait=True, model_options=MODEL, options=options,
                      batch_size=BATCH, steps=2)
    spec = from_gpt(GPTConfig(**MODEL))
    names = {"tp": "tensor", "cp": "context", "data": "data", "pp": "pipeline", "tied": "tied"}
    for rank in range(4):
        pp_rank = rank // (4 // lay.pp)
        layers = tm.layers_on(spec, lay, pp_rank)
        want = tm.collective_calls(lay, lay.for_batch(BATCH).microbatches, layers, pp_rank, 1.0, 1.0, 1.0,
                                   boundary=1.0, tied=1.0)
        booked = run.metrics(rank)[-1]["comm_by_dim"]
        for dim, calls in want.items():
            per_call = 2 if dim in ("cp", "pp") else 1  # a pass or pair: a send and a receive
            assert sum(c[2] for c in calls) * per_call == booked[names[dim]]["calls"], (rank, dim)


@pytest.mark.skipif((__import__("os").cpu_count() or 1) >= 4, reason="needs 4 ranks to outnumber the cores")
def test_with_ranks_outnumbering_cores_a_collective_costs_far_more_than_its_wire_time(tmp_path):
    """The probe behind "this machine" at 4 ranks: every op the planner charges, for every group
    size; an all-reduce over 4 ranks burns each rank's CPU for over 5x what the fitted link
    says it takes on the wire (the hand-offs between processes sharing cores, not the bytes, are
    the cost); the ranks fill part of the cores' time, not more than all of it."""
    from dlab.tools import calibrate
    probe = calibrate.collective_probe(4, repeats=5, trials=1, runs_dir=tmp_path)
    assert {(op, g) for op, g, _, _ in probe.calls} == {(op, g) for op in calibrate.OPS for g in (2, 4)}
    assert 0.3 < probe.utilization <= 1.0
    machine = clusters.this_machine(peak=1e10, ranks=4, calls=probe.calls)
    link = machine.intra
    wire = 2 * 3 / 4 * calibrate.PROBE_SIZES[0] / link.bandwidth + 2 * 3 * link.alpha
    assert machine.call_cost("all_reduce", 4, calibrate.PROBE_SIZES[0]) > 5 * wire
    assert machine.call_cost("all_reduce", 8, 1.0) is None  # not measured: the planner uses the link
    # two ranks, a core each: a call's wall time, as far above the wire's
    probe = calibrate.collective_probe(2, repeats=5, trials=1, runs_dir=tmp_path)
    pair = clusters.this_machine(peak=1e10, ranks=2, calls=probe.calls)
    wire = 2 * 1 / 2 * calibrate.PROBE_SIZES[0] / pair.intra.bandwidth + 2 * pair.intra.alpha
    assert pair.call_cost("all_reduce", 2, calibrate.PROBE_SIZES[0]) > 5 * wire
