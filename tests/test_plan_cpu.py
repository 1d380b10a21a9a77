"""The planner on this machine's CPU, where ranks outnumber the cores: what it assumes about the
lab's code is checked against that code, and the step is the ranks' CPU seconds shared out over
the cores. (How close its step times come to runs is ``python -m dlab bench plan``'s business:
timings belong in a benchmark, not a unit test.)"""
from __future__ import annotations

import dataclasses

import pytest

import dlab
from dlab.bench.nd import BATCH, MODEL
from dlab.bench.plan import plan_layout
from dlab.layout import tokens as cp_layout
from dlab.models.gpt import GPTConfig
from dlab.parallel.context.attention import visible_tiles
from dlab.plan import clusters, plan
from dlab.theory.comm import AlphaBeta
from dlab.theory.plan.spec import from_gpt

LAB = from_gpt(GPTConfig(**MODEL))
# a CPU with measured-looking constants: every op the lab uses costs 1 ms of CPU a call plus
# 1 ns a byte, whatever the group; the ranks fill 80 % of the cores' time
CALLS = tuple((op, g, 1e-3, 1e-9) for op in ("all_reduce", "all_gather", "reduce_scatter", "ring")
              for g in (2, 4, 8))
CPU = clusters.Cluster("test CPU", 5e10, 24e9, 10e9, 1 << 20, AlphaBeta.link(1e9, 1e-5),
                       AlphaBeta.link(1e9, 1e-5), 1.0, 1.0, reserved=0.0, cores=2,
                       layer_overhead=5e-4, ring_tile=(1.5e-4, 2e-8), calls=CALLS, utilization=0.8)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_zigzag_gives_every_rank_2n_plus_1_tiles_a_layer(n):
    """``cpu.stage_compute`` charges ring attention by the tile: 2 cp + 1 per rank and layer
    under the zigzag layout (its two chunks against every chunk at or before them). Counted here
    from the attention code's own tiling."""
    positions = [cp_layout.positions("zigzag", MODEL["seq_len"], r, n) for r in range(n)]
    for rank in range(n):
        assert sum(len(per_src) for per_src in visible_tiles(positions, rank)) == 2 * n + 1


@pytest.mark.parametrize("options", [{"dp": 8, "zero": 1}, {"pp": 4, "tp": 2, "sequence_parallel": True},
                                     {"pp": 2, "cp": 4, "zero": 1}])
def test_on_shared_cores_the_step_is_cpu_seconds_over_the_cores(options):
    """8 ranks on 2 cores, then on 4: the ranks' CPU seconds are the same, so the step halves
    (the cores fill the pipeline's bubble with other ranks' work: no bubble is charged); the
    core-seconds the ranks do not fill are a fifth of the step at 80 % utilization."""
    lay = plan_layout(options)
    two = plan(LAB, CPU, lay, BATCH, MODEL["seq_len"])
    four = plan(LAB, dataclasses.replace(CPU, cores=4), lay, BATCH, MODEL["seq_len"])
    assert four.step_s == pytest.approx(two.step_s / 2)
    assert two.time["bubble"] == 0.0
    assert two.time["idle_cores"] == pytest.approx(0.2 * two.step_s)


def test_one_ranks_chain_bounds_the_step_when_cores_are_almost_enough():
    """7 cores for 8 ranks: shared out, the CPU seconds would take less than one pipeline rank's
    own work and bubble, and a rank runs on one core at most: the step is that rank's, as it is
    with a core for every rank."""
    lay = plan_layout({"pp": 4, "dp": 2, "zero": 1})
    p = plan(LAB, dataclasses.replace(CPU, cores=7, utilization=1.0), lay, BATCH, MODEL["seq_len"])
    own = plan(LAB, dataclasses.replace(CPU, cores=8), lay, BATCH, MODEL["seq_len"])
    assert p.time["bubble"] > 0 and "idle_cores" not in own.time
    assert p.step_s == pytest.approx(own.step_s)


def test_a_middle_pipeline_stage_pays_for_both_its_neighbours():
    """A rank per core, pipeline transfers at a measured 10 ms a pair: a middle stage of pp 4
    sends and receives towards both neighbours (2 m pairs, m = 4) and is the slowest."""
    calls = tuple(c for c in CALLS if c[:2] != ("ring", 2)) + (("ring", 2, 1e-2, 0.0),)
    p = plan(LAB, dataclasses.replace(CPU, cores=8, calls=calls), plan_layout({"pp": 4, "dp": 2, "zero": 1}),
             BATCH, MODEL["seq_len"])
    assert p.time["pp_comm"] == pytest.approx(2 * 4 * 1e-2)


def test_a_group_the_probe_did_not_measure_costs_the_links_time():
    """The probe measures the group sizes that divide its world: 3 ranks, pipelined, make pairs
    it has no figure for, which then cost what the link says (as with no probe), refused never."""
    lay = plan_layout({"pp": 3})
    no_pairs = tuple(c for c in CALLS if c[1] != 2)
    probed = plan(LAB, dataclasses.replace(CPU, calls=no_pairs), lay, BATCH, MODEL["seq_len"])
    bare = plan(LAB, dataclasses.replace(CPU, calls=()), lay, BATCH, MODEL["seq_len"])
    assert bare.time["pp_comm"] > 0
    assert probed.time["pp_comm"] == pytest.approx(bare.time["pp_comm"])


def test_a_step_records_the_cpu_its_rank_burned(tmp_path):
    """``cpu_s`` in a step record is the rank's CPU time, not its wall time: a straggler that
    sleeps 0.6 s inside its step (its step takes at least that: the sleep's floor is the OS's
    promise, not a race) burns no more CPU in it than in its other steps, give or take half the
    sleep (with a core busy the steps' CPU differed by 0.02 s at most: 15x inside that)."""
    delay = 0.6
    run = dlab.launch("ddp", 2, runs_dir=tmp_path, wait=True, model_options=MODEL, batch_size=BATCH,
                      steps=3, fault={"kind": "slow", "rank": 1, "step": 1, "delay_s": delay, "steps": 1})
    steps = run.metrics(1)
    slow, others = steps[1], [steps[0], steps[2]]
    assert slow["step_time"] >= delay
    assert 0 < slow["cpu_s"] < min(m["cpu_s"] for m in others) + delay / 2
