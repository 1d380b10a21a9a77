"""A cluster profile (``python -m dlab plan calibrate`` writes it, ``--cluster FILE`` reads it):
every figure it holds feeds the prediction it is for, so altering any one of them in the file
moves that prediction, and a table it lacks is either refused or said, never silently replaced.

The profile here is written by ``clusters.dump`` from measured-looking figures (no calibration
is run), then edited as JSON, one field at a time, as a user would edit it."""
from __future__ import annotations

import json

import pytest

from dlab.plan import PlanLayout, clusters, plan, step_range
from dlab.theory.comm import AlphaBeta
from dlab.theory.plan.collectives import OPS
from dlab.theory.plan.kernels import Kernels, nearest, table_rate
from dlab.theory.plan.spec import Transformer

KERNELS = Kernels(matmul=0.8, sms=6, tile=(64, 32, 16), best=(512, 512, 512), fill=2.0,
                  attention=(("fa2", 0.5, 0.4), ("fa3", 0.6, 0.5)), attention_half=256, hbm=0.9,
                  launch=2e-5,
                  matmul_table=((64, 64, 64, 2e10), (256, 256, 256, 5e10), (1024, 1024, 1024, 8e10)),
                  attention_table=((128, 1e10, 8e9), (512, 2e10, 1.6e10)))
#: two ranks a node; every op measured inside a node at 5 GB/s, none across (1 GB/s links)
MEASURED = clusters.Cluster("measured-looking profile", 1e11, 16e9, 2e10, 2,
                            AlphaBeta.link(4e9, 3e-5), AlphaBeta.link(1e9, 1e-4), 0.8, 1.0,
                            reserved=1e9, kernels=KERNELS,
                            ops=tuple((op, "intra", 2e-5, 5e9) for op in OPS),
                            spread=(("matmul", 0.9, 1.1), ("hbm", 0.9, 1.1)), source="a test")
DENSE = Transformer("dense", 4, 512, 8, 2048, 8000)
MOE = Transformer("moe", 4, 512, 8, 1024, 8000, n_expert=4, top_k=2)


def _write(tmp_path, doc, name="profile.json"):
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.fixture
def doc(tmp_path):
    return clusters.dump(MEASURED, tmp_path / "written.json")


def _set(doc, field: str, change):
    """``doc`` with ``field`` (dotted; ``ops.NAME`` is that op's row) changed by ``change``."""
    out = json.loads(json.dumps(doc))
    *parents, last = field.split(".")
    if parents == ["ops"]:
        row = next(r for r in out["ops"] if r[0] == last)
        row[2:] = change(row[2:])
        return out
    node = out
    for key in parents:
        node = node[key]
    node[last] = change(node[last])
    return out


def _scale(factor):
    def change(value):
        if isinstance(value, list):
            return [change(v) for v in value]
        return value * factor if isinstance(value, float) else value
    return change


def _time(part):
    return lambda p: p.time[part]


def _rows(scale_col):
    """Multiply column ``scale_col`` onwards of every row of a table."""
    return lambda rows: [[*r[:scale_col], *(x * 0.5 for x in r[scale_col:])] for r in rows]


#: a stack that hides no communication, so every collective's time shows in the step
WAITS = "megatron-lm-2021"
TWO = PlanLayout(dp=2)
ZERO1 = PlanLayout(dp=2, zero=1)
#: (field, what the edit does, its base edit (a table dropped, so a fallback is what the field
#: feeds), model, layout, what it moves, +1 if it grows, -1 if it shrinks, 0 if it only moves)
CASES = [
    ("kernels.matmul_table", _rows(3), None, DENSE, TWO, _time("compute"), 1),
    ("kernels.attention_table", _rows(1), None, DENSE, TWO, _time("compute"), 1),
    ("memory_bandwidth", _scale(0.5), None, DENSE, TWO, _time("optimizer"), 1),
    ("kernels.hbm", _scale(0.5), None, DENSE, TWO, _time("optimizer"), 1),
    ("kernels.launch", _scale(10.0), None, DENSE, TWO, _time("compute"), 1),
    ("ops.all_reduce", _scale(0.1), None, DENSE, TWO, _time("data_comm"), 1),
    ("ops.reduce_scatter", _scale(0.1), None, DENSE, ZERO1, _time("data_comm"), 1),
    ("ops.all_gather", _scale(0.1), None, DENSE, ZERO1, _time("data_comm"), 1),
    ("ops.all_to_all", _scale(0.1), None, MOE, PlanLayout(dp=2, ep=2), _time("ep_comm"), 1),
    ("ops.p2p", _scale(0.1), None, DENSE, PlanLayout(pp=2), _time("pp_comm"), 1),
    ("links.intra.busbw", _scale(0.1), "no-all-reduce", DENSE, TWO, _time("data_comm"), 1),
    ("links.intra.latency", _scale(100.0), "no-all-reduce", DENSE, TWO, _time("data_comm"), 1),
    ("links.inter.busbw", _scale(0.1), None, DENSE, PlanLayout(dp=4), _time("data_comm"), 1),
    ("links.inter.latency", _scale(100.0), None, DENSE, PlanLayout(dp=4), _time("data_comm"), 1),
    ("gpus_per_node", lambda v: 4, None, DENSE, PlanLayout(dp=4), _time("data_comm"), -1),
    ("peak_flops", _scale(0.5), None, DENSE, TWO, lambda p: p.mfu, 1),
    ("memory_bytes", _scale(2.0), None, DENSE, TWO, lambda p: p.capacity, 1),
    ("reserved_bytes", _scale(2.0), None, DENSE, TWO, lambda p: p.capacity, -1),
    ("generation", lambda v: "H100", None, DENSE, TWO, lambda p: p.step_s, 1),
    ("spread", lambda rows: [[n, lo * 0.5, hi * 2] for n, lo, hi in rows], None, DENSE, TWO,
     lambda p: (lambda lo, hi: hi - lo)(*step_range(p)), 1),
    # the curves a missing table falls back to
    ("kernels.matmul", _scale(0.5), "no-matmul-table", DENSE, TWO, _time("compute"), 1),
    ("kernels.sms", lambda v: 5, "no-matmul-table", DENSE, TWO, _time("compute"), 0),
    ("kernels.tile", lambda v: [96, 32, 16], "no-matmul-table", DENSE, TWO, _time("compute"), 0),
    ("kernels.best", lambda v: [640, 512, 512], "no-matmul-table", DENSE, TWO, _time("compute"), 0),
    ("kernels.fill", _scale(4.0), "no-matmul-table", DENSE, TWO, _time("compute"), 0),
    ("kernels.attention", lambda rows: [[n, f / 2, b / 2] for n, f, b in rows],
     "no-attention-table", DENSE, TWO, _time("compute"), 1),
    ("kernels.attention_half", lambda v: 4 * v, "no-attention-table", DENSE, TWO, _time("compute"), 1),
]
BASES = {None: lambda d: d,
         "no-all-reduce": lambda d: {**d, "ops": [r for r in d["ops"] if r[0] != "all_reduce"]},
         "no-matmul-table": lambda d: _set(d, "kernels.matmul_table", lambda v: []),
         "no-attention-table": lambda d: _set(d, "kernels.attention_table", lambda v: [])}
#: what names a profile and says nothing the planner prices
DESCRIPTIVE = {"format", "name", "source", "measured", "flags"}


def _leaves(doc, prefix=""):
    for key, value in doc.items():
        if isinstance(value, dict) and key != "measured":
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


def test_every_field_a_profile_holds_has_a_case_below(doc):
    """A field added to the profile without a case here fails this (``ops`` counts by op)."""
    fields = {c[0] for c in CASES}
    want = set(_leaves(doc)) - DESCRIPTIVE - {"ops"} | {f"ops.{op}" for op in OPS}
    assert fields == want


@pytest.mark.parametrize("field,change,base,spec,lay,observe,sign", CASES, ids=[c[0] for c in CASES])
def test_each_field_of_a_profile_moves_the_prediction_it_feeds(field, change, base, spec, lay,
                                                                observe, sign, doc, tmp_path):
    before_doc = BASES[base](doc)
    before = clusters.preset(_write(tmp_path, before_doc, "before.json"))
    after = clusters.preset(_write(tmp_path, _set(before_doc, field, change), "after.json"))
    was, now = (observe(plan(spec, c, lay, 8, 512, WAITS)) for c in (before, after))
    assert now != pytest.approx(was, rel=1e-6), f"{field} fed nothing: {was} both times"
    if sign:
        assert (now - was) * sign > 0, (field, was, now)


@pytest.mark.parametrize("table,says", [
    ("kernels.matmul_table", "no matmul table"), ("kernels.attention_table", "no attention table"),
    ("ops", "measured no all_reduce, all_gather, reduce_scatter, all_to_all, p2p inside")])
def test_a_profile_without_a_table_says_what_replaces_it(table, says, doc, tmp_path):
    """An empty table is a fallback the prediction names (its ``assumptions``, which the CLI
    prints); a table left out of the file is refused, naming it."""
    cluster = clusters.preset(_write(tmp_path, _set(doc, table, lambda v: [])))
    p = plan(DENSE, cluster, TWO, 8, 512)
    assert any(says in a for a in p.assumptions), p.assumptions
    whole = plan(DENSE, clusters.preset(_write(tmp_path, doc, "whole.json")), TWO, 8, 512)
    assert not any(says in a for a in whole.assumptions)
    parent, _, key = table.rpartition(".")
    cut = json.loads(json.dumps(doc))
    del (cut[parent] if parent else cut)[key]
    with pytest.raises(ValueError, match=f"{table} is missing"):
        clusters.preset(_write(tmp_path, cut, "cut.json"))


def test_a_profile_measured_across_nodes_uses_that_measurement(doc, tmp_path):
    """An op measured across nodes replaces the inter link for it, and the note that it is
    priced on the links goes."""
    inter = {**doc, "ops": [*doc["ops"], ["all_reduce", "inter", 2e-5, 0.5e9]]}
    cluster = clusters.preset(_write(tmp_path, inter))
    p = plan(DENSE, cluster, PlanLayout(dp=4), 8, 512, WAITS)
    base = plan(DENSE, clusters.preset(_write(tmp_path, doc, "base.json")), PlanLayout(dp=4), 8, 512,
                WAITS)
    assert p.time["data_comm"] > base.time["data_comm"]  # 0.5 GB/s measured, not the link's 1
    assert any("measured no all_gather, reduce_scatter, all_to_all, p2p across" in a
               for a in p.assumptions)


def test_what_a_calibration_flagged_is_said_by_every_prediction(doc, tmp_path):
    flagged = {**doc, "flags": ["all_reduce: its times do not grow with its bytes"]}
    cluster = clusters.preset(_write(tmp_path, flagged))
    assert "all_reduce: its times do not grow with its bytes" in plan(DENSE, cluster, TWO, 8, 512).assumptions


def test_a_measured_grid_is_read_between_its_shapes_and_never_beyond_them():
    """Log-linear interpolation recovers a power law exactly: rates made from
    r = c m^0.3 n^0.2 k^0.4 on a 2 x 3 x 2 grid are read back at shapes between the measured
    ones, the measured rows themselves, and the edge's rate past the grid. A table that is not
    a full grid (``--quick``'s four shapes) is read at its nearest row."""
    def law(m, n, k):
        return 1e9 * m ** 0.3 * n ** 0.2 * k ** 0.4

    grid = tuple((m, n, k, law(m, n, k)) for m in (256, 4096) for n in (512, 2048, 8192) for k in (512, 8192))
    for shape in ((256, 512, 512), (1000, 700, 3000), (4096, 8192, 2048), (300, 5000, 600)):
        assert table_rate(grid, shape, 3) == pytest.approx(law(*shape), rel=1e-12), shape
    assert table_rate(grid, (65536, 8192, 8192), 3) == pytest.approx(law(4096, 8192, 8192))
    assert table_rate(grid, (16, 512, 512), 3) == pytest.approx(law(256, 512, 512))
    sparse = grid[:5]
    assert table_rate(sparse, (1000, 700, 3000), 3) == nearest(sparse, (1000, 700, 3000))[3]
    keys = ((512, 4e13, 3e13), (2048, 2.9e14, 2.3e14), (8192, 5.7e14, 5e14))
    assert table_rate(keys, (1024,), 1) == pytest.approx((4e13 * 2.9e14) ** 0.5)  # half-way in log
