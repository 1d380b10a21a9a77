"""Pipeline schedules as data, checked without starting a process: every list is runnable (each
send has its recv, no deadlock, forward before backward before weight gradient), the simulated
bubble and activation counts agree with the formulas, and the stage split is balanced."""
from __future__ import annotations

import itertools

import pytest

from dlab.layout import schedules
from dlab.layout.schedules import B, F, Schedule, _with_comms
from dlab.layout.stages import partition
from dlab.theory import pipeline as est
from dlab.theory import simulate as simulation
from dlab.theory.simulate import DeadlockError, bubble, simulate

GRID = [(name, p, m, v) for name in schedules.SCHEDULES
        for p, m, v in itertools.product(range(1, 6), range(1, 13), (1, 2, 3))]


def built(name, p, m, v):
    try:
        return schedules.build(name, p, m, v)
    except ValueError:
        return None  # a combination the schedule refuses (tested below)


@pytest.mark.parametrize("name", list(schedules.SCHEDULES))
def test_every_schedule_is_valid_over_a_grid(name):
    count = 0
    for _, p, m, v in (g for g in GRID if g[0] == name):
        s = built(name, p, m, v)
        if s is None:
            continue
        simulation.validate(s)
        count += 1
        # every rank ends with all its work done, and the simulation ran every action once
        events = simulate(s)
        assert len(events) == sum(len(a) for a in s.actions)
        for r in range(p):
            computes = [(a.kind, a.stage, a.mb) for a in s.compute(r)]
            per_mb = 3 if s.split_backward else 2
            assert len(computes) == per_mb * m * len(s.stages_of(r))
    assert count >= 5


def test_refused_combinations_say_what_to_change():
    with pytest.raises(ValueError, match="multiple of 4"):
        schedules.build("interleaved", 4, 6, 2)
    with pytest.raises(ValueError, match="m=1"):
        schedules.build("naive", 2, 4)
    with pytest.raises(ValueError, match="exactly 2 stages"):
        schedules.build("zbv", 2, 4, 3)
    with pytest.raises(ValueError, match="unknown schedule"):
        schedules.build("pipedream", 2, 4)


def test_validate_catches_broken_lists():
    good = schedules.build("1f1b", 2, 2)
    # a recv without its send
    no_send = [list(a) for a in good.actions]
    no_send[0] = [a for a in no_send[0] if not (a.kind == "send" and a.mb == 1)]
    with pytest.raises(ValueError, match="never sends"):
        simulation.validate(Schedule("x", 2, 2, 2, (0, 1), no_send))
    # a backward listed before its forward
    orders = [[F(0, 0), B(0, 0)], [B(1, 0), F(1, 0)]]
    with pytest.raises(ValueError, match="out of order"):
        simulation.validate(Schedule("x", 2, 1, 2, (0, 1), _with_comms(orders, (0, 1))))
    send, recv = schedules.Action("send", 0, 0, 1), schedules.Action("recv", 0, 0, 1)
    rank1 = [schedules.Action("recv", 1, 0, 0), F(1, 0), B(1, 0), schedules.Action("send", 1, 0, 0)]
    fine = [[F(0, 0), send, recv, B(0, 0)], rank1]
    assert bubble(simulate(Schedule("ok", 2, 1, 2, (0, 1), fine))) == pytest.approx(0.5)
    # rank 0 waits for the gradient before sending the activation rank 1 waits for
    stuck = [[F(0, 0), recv, send, B(0, 0)], rank1]
    with pytest.raises(DeadlockError, match="deadlocks"):
        simulate(Schedule("stuck", 2, 1, 2, (0, 1), stuck))


@pytest.mark.parametrize("name", ["naive", "gpipe", "1f1b", "interleaved", "zb-h1", "zbv",
                                  "dualpipev"])
def test_simulated_bubble_matches_the_formula(name):
    checked = 0
    for _, p, m, v in (g for g in GRID if g[0] == name):
        s = built(name, p, m, v)
        if s is None:
            continue
        formula = est.bubble(name, p, m, s.v)
        if formula is None:
            continue
        assert bubble(simulate(s)) == pytest.approx(formula, abs=1e-9), (name, p, m, v)
        checked += 1
    assert checked >= 5


def test_bubble_formulas_at_known_points():
    assert est.bubble("gpipe", 4, 1) == pytest.approx(0.75)  # the naive pipeline's 3 idle of 4
    assert est.bubble("1f1b", 4, 12) == pytest.approx(3 / 15)
    assert est.bubble("interleaved", 4, 8, 2) == pytest.approx(3 / 19)
    assert est.bubble("zb-h1", 4, 8) == pytest.approx(3 / 27)  # a third of 1F1B's idle time
    assert est.bubble("zbv", 4, 8) == pytest.approx(1.5 / 25.5)
    # the last rank waits 3 half-stage forwards for micro-batch 0, then never again: 1.5 of 25.5
    assert est.bubble("dualpipev", 4, 8) == pytest.approx(1.5 / 25.5)
    assert est.bubble("dualpipev", 4, 6) is None  # refused: m < 2p
    # more micro-batches, smaller bubble; zero-bubble below 1F1B below GPipe-without-micro
    assert est.bubble("1f1b", 4, 16) < est.bubble("1f1b", 4, 8) < est.bubble("naive", 4, 1)
    assert est.bubble("zbv", 4, 16) < est.bubble("zb-h1", 4, 16) < est.bubble("1f1b", 4, 16)
    # GPipe's and 1F1B's bubble fraction does not depend on the op times
    assert est.simulated_bubble("1f1b", 4, 8, t_f=1, t_b=3, t_w=0.5) == pytest.approx(3 / 11)
    assert est.simulated_bubble("gpipe", 2, 4, t_f=2, t_b=1, t_w=1) == pytest.approx(1 / 5)


def test_activations_in_flight_match_the_formula():
    for name, p, m, v in GRID:
        s = built(name, p, m, v)
        if s is None:
            continue
        got = est.in_flight_of(s)
        want = [est.in_flight(name, p, m, r, s.v) for r in range(p)]
        if name == "zbv":
            assert all(g <= w for g, w in zip(got, want, strict=True)), (name, p, m, got, want)
        else:
            assert got == want, (name, p, m, v, got, want)
    # the contrast the schedules exist for: GPipe holds m, 1F1B at most p
    assert est.in_flight_of(schedules.build("gpipe", 4, 16)) == [16] * 4
    assert est.in_flight_of(schedules.build("1f1b", 4, 16)) == [4, 3, 2, 1]


def test_dualpipev_pairs_a_forward_with_a_backward():
    """DualPipe's point (DeepSeek-V3 report, sec. 3.2.1): in the steady phase every rank runs a
    forward of one micro-batch next to a backward of another, on its other leg of the V. Counted
    apart from the builder: rank r of p does 2p - r - 1 forwards of its first chunk before any
    backward (the last rank one more: its first backward is of a micro-batch it turned), holds
    2p + 1 chunks at its peak (p + 1/2 micro-batches), and in phase 4 the pairs
    (F on stage r, B on stage 2p-1-r) and (F on 2p-1-r, B on r) follow each other m-2p+r+1 times."""
    p, m = 4, 10
    s = schedules.build("dualpipev", p, m)
    assert s.stage_rank == (0, 1, 2, 3, 3, 2, 1, 0)
    for r in range(p):
        ops = [(a.kind[0].upper(), a.stage) for a in s.compute(r) if a.kind != "weight_grad"]
        first_b = next(i for i, o in enumerate(ops) if o[0] == "B")
        assert sum(o == ("F", r) for o in ops[:first_b]) == 2 * p - r - 1 + (r == p - 1), r
        down, up = r, 2 * p - 1 - r
        pair = [("F", down), ("B", up), ("F", up), ("B", down)]
        text = "".join(f"{k}{st}" for k, st in ops)
        assert "".join(f"{k}{st}" for k, st in pair) * (m - 2 * p + r + 1) in text, (r, text)
    assert est.in_flight_of(s) == [p + 0.5] * p
    with pytest.raises(ValueError, match="at least 2p = 8"):
        schedules.build("dualpipev", 4, 6)


def test_partition_balances_and_covers_every_block():
    assert partition([1] * 8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    # a heavy first stage (embedding) gets fewer blocks
    ranges = partition([1] * 8, 2, first_extra=2)
    assert ranges == [range(0, 3), range(3, 8)]
    # the optimum: the largest stage load is as small as any contiguous split allows
    costs = [5, 1, 1, 1, 1, 5]
    ranges = partition(costs, 3)
    assert max(sum(costs[i] for i in r) for r in ranges) == 5
    with pytest.raises(ValueError, match="n_layer"):
        partition([1, 1], 4)


def test_time_costs_measure_every_piece():
    import torch

    from dlab.models import build
    from dlab.parallel.pipeline.split import param_costs, time_costs

    model = build("gpt", {"n_layer": 3, "d_model": 32, "n_head": 2, "seq_len": 16}, seed=0)
    x = torch.randint(0, 256, (2, 16))
    blocks, embed, head = time_costs(model, (x, x), repeats=1)
    assert len(blocks) == 3 and min(blocks) > 0 and embed > 0 and head > 0
    assert all(p.grad is None for p in model.parameters())  # measuring leaves no gradients
    pblocks, pembed, phead = param_costs(model)
    assert pblocks == [pblocks[0]] * 3 and pembed == (256 + 16) * 32
    assert phead == 2 * 32 + 256 * 32  # final norm + the (tied) projection it multiplies by


@pytest.mark.parametrize("name", ["1f1b", "interleaved", "zbv"])
def test_replay_of_a_timeline_reproduces_it(name):
    """Replaying a timeline at its own mean op times per stage gives it back."""
    from dlab.theory.simulate import replay

    s = schedules.build(name, 4, 8, 2 if name != "1f1b" else 1)
    original = [dict(e, start=e["start"] + 5.0, end=e["end"] + 5.0)
                for e in simulate(s, t_f=1.0, t_b=2.0, t_w=0.5)]
    again = replay(s, original)  # without a split backward, the whole backward was measured
    key = lambda e: (e["rank"], e["kind"], e["stage"], e["mb"])  # noqa: E731
    for a, b in zip(sorted(original, key=key), sorted(again, key=key), strict=True):
        assert (a["start"], a["end"]) == pytest.approx((b["start"], b["end"]))


@pytest.mark.parametrize("name", ["1f1b", "interleaved"])
def test_replay_keeps_a_slow_stage_slow(name):
    """Stage 1 twice as slow as the others: the replay at each stage's own mean times has the
    bubble of that timeline, well above the closed form that equal stages (or one mean pooled
    over every rank) would give."""
    from dlab.theory.simulate import replay

    v = 2 if name == "interleaved" else 1
    s = schedules.build(name, 4, 8, v)
    unit = simulate(s)
    slow = {(e["kind"], e["stage"], e["mb"]): (e["end"] - e["start"]) * (2 if e["stage"] == 1 else 1)
            for e in unit if e["kind"] in ("forward", "backward", "weight_grad")}
    measured = simulate(s, durations=slow)
    assert bubble(measured) > bubble(unit) + 0.1
    assert bubble(replay(s, measured)) == pytest.approx(bubble(measured))


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "zb-h1", "zbv"])
def test_replay_at_each_ops_own_time_reproduces_a_timeline(name):
    from dlab.theory.simulate import replay_ops

    v = 2 if name in ("interleaved", "zbv") else 1
    s = schedules.build(name, 4, 8, v)
    original = [dict(e, start=e["start"] + 5.0, end=e["end"] + 5.0)
                for e in simulate(s, t_f=1.0, t_b=2.0, t_w=0.5)]
    key = lambda e: (e["rank"], e["kind"], e["stage"], e["mb"])  # noqa: E731
    for a, b in zip(sorted(original, key=key), sorted(replay_ops(s, original), key=key), strict=True):
        assert (a["start"], a["end"]) == pytest.approx((b["start"], b["end"]))


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zbv"])
def test_jitter_around_the_same_mean_adds_bubble(name):
    """Every op's time drawn from U(0.5, 1.5) x its unit time (seeded). Each stage's mean then
    drifts a little from the others (8 draws each), and the replay at those stage means shows
    that imbalance above the closed form; on top of it each rank waits for its slower
    neighbour op by op, so the bubble at each op's own time is larger still, in every draw."""
    import random

    from dlab.theory.simulate import bubble_of_ops, replay

    v = 2 if name == "zbv" else 1
    s = schedules.build(name, 4, 8, v)
    unit = simulate(s)
    rng = random.Random(0)
    at_ops, at_means = [], []
    for _ in range(20):
        durations = {(e["kind"], e["stage"], e["mb"]): (e["end"] - e["start"]) * rng.uniform(0.5, 1.5)
                     for e in unit if e["kind"] in ("forward", "backward", "weight_grad")}
        jittered = simulate(s, durations=durations)
        assert bubble_of_ops(s, jittered) == pytest.approx(bubble(jittered))
        at_ops.append(bubble(jittered))
        at_means.append(bubble(replay(s, jittered)))
    formula = bubble(unit)
    assert sum(at_means) / 20 > formula + 0.02, (sum(at_means) / 20, formula)
    assert all(o > m for o, m in zip(at_ops, at_means, strict=True))
    assert sum(at_ops) / 20 > sum(at_means) / 20 + 0.03, (sum(at_ops) / 20, sum(at_means) / 20)
