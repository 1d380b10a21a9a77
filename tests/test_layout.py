"""The one ``Layout`` and its rules, checked as pure functions (no process starts): ``nd``,
``pipeline-*`` and the planner ask the same ``problems``, and the same degrees place the same
ranks in every strategy that takes them."""
from __future__ import annotations

import pytest

from dlab import parallel
from dlab.core.config import RunConfig
from dlab.layout import CP_ATTENTION, MESH_ORDER, Layout, ranks, schedules, shape
from dlab.models import model_config
from dlab.parallel.context.core import ATTENTION
from dlab.plan import PlanLayout, models
from dlab.worker.validate import problems

GPT = {"n_layer": 4, "d_model": 32, "n_head": 4, "seq_len": 32}
LLAMA8 = models.preset("llama3-8b")


def gpt_shape(**changes):
    return shape(model_config("gpt", {**GPT, **changes}))


def config(strategy: str, world: int, options: dict, model: str = "gpt", **model_options):
    return RunConfig(strategy, world_size=world, batch_size=8, model=model,
                     model_options={**GPT, **model_options}, options=options)


# --- the rules, one place --------------------------------------------------------------------
@pytest.mark.parametrize("layout,world,says", [
    (Layout(dp=2, pp=2), 8, "takes 4 ranks but world_size=8"),
    (Layout(dp=0, pp=3), 8, "does not divide world_size=8"),
    (Layout(tp=3, dp=1), 3, "tp=3 must divide the model's 4 heads"),
    (Layout(tp=2, dp=1, schedule="zb-h1", pp=1), 2, "zb-h1 splits the backward"),
    (Layout(pp=2, dp=1, schedule="interleaved", microbatches=3, virtual_stages=2), 2,
     "must be a multiple of 2"),
    (Layout(pp=2, dp=1, schedule="1f1b", microbatches=4, virtual_stages=2), 2,
     "needs the interleaved or zbv schedule"),
    (Layout(pp=2, dp=1, schedule="zbv", microbatches=4, virtual_stages=3), 2,
     "exactly 2 stages per rank"),
    (Layout(pp=4, dp=1, schedule="interleaved", microbatches=4, virtual_stages=2), 4,
     "has 8 stages but the model has n_layer=4"),
    (Layout(cp=3, dp=1), 3, "does not cut into 6 equal chunks"),
    (Layout(cp=2, dp=1, cp_attention="ulysses", ulysses=2), 2, None),
    (Layout(cp=4, dp=1, cp_attention="usp", ulysses=3), 4, "ulysses=3 must divide cp=4"),
    (Layout(dp=2, ep=2), 2, "splits the experts of a mixture of experts"),
    (Layout(dp=1, zero=4), 1, "ZeRO has stages 0"),
    (Layout(dp=3), 3, "does not split evenly over 3 data-parallel ranks"),
    (Layout(dp=2, pp=2, microbatches=3), 4, "replicas of microbatches=3"),
    (Layout(dp=1, tp=2, sequence_parallel=True), 2, None),
])
def test_a_layout_says_what_stops_it(layout, world, says):
    found = layout.problems(gpt_shape(), 8, world)
    if says is None:
        assert found == []
    else:
        assert any(says in p for p in found), found


def test_lab_rules_apply_to_the_labs_own_code_only():
    """The lab cuts the MLP and the vocabulary exactly and splits nn.Linear's backward only;
    at scale a real stack pads the vocabulary and splits any layer."""
    odd_vocab = gpt_shape(vocab_size=257)
    lay = Layout(dp=1, tp=2)
    assert any("vocab_size=257" in p for p in lay.problems(odd_vocab, 8, 2, lab=True))
    assert lay.problems(odd_vocab, 8, 2, lab=False) == []
    zb = Layout(dp=1, tp=2, pp=2, schedule="zb-h1", microbatches=4)
    assert any("zb-h1 splits" in p for p in zb.problems(gpt_shape(), 8, 4, lab=True))
    assert zb.problems(gpt_shape(), 8, 4, lab=False) == []


def test_the_schedules_rules_are_the_ones_build_enforces():
    for name in schedules.SCHEDULES:
        for p, m, v in ((2, 4, 1), (2, 3, 2), (3, 2, 2), (2, 2, 3), (2, 1, 1)):
            said = schedules.problems(name, p, m, v)
            try:
                schedules.SCHEDULES[name](p, m, v)
                built = []
            except ValueError as e:
                built = [str(e)]
            assert said == built, (name, p, m, v)


# --- every caller asks the same rules ----------------------------------------------------------
@pytest.mark.parametrize("strategy,options,world,says", [
    ("nd", {"pp": 2, "tp": 3}, 6, "tp=3 must divide the model's 4 heads"),
    ("pipeline-1f1b", {"tp": 3}, 6, "tp=3 must divide the model's 4 heads"),
    ("tp", {"tp": 3}, 3, "tp=3 must divide the model's 4 heads"),
    ("torch-tp", {"tp": 3}, 3, "tp=3 must divide the model's 4 heads"),
    ("nd", {"pp": 2, "schedule": "interleaved", "microbatches": 3}, 2, "multiple of 2"),
    ("pipeline-interleaved", {"microbatches": 3}, 2, "multiple of 2"),
    ("nd", {"cp": 3}, 3, "does not cut into 6 equal chunks"),
    ("cp", {"cp": 3}, 3, "does not cut into 6 equal chunks"),
])
def test_strategies_ask_the_one_layout(strategy, options, world, says):
    found = problems(config(strategy, world, options))
    assert any(says in p for p in found), found


def test_the_planner_asks_the_one_layout():
    assert any("tp=3 must divide the model's 32 heads" in p
               for p in PlanLayout(tp=3).problems(LLAMA8, 8, 8192))
    assert any("exactly 2 stages per rank" in p
               for p in PlanLayout(pp=2, schedule="zbv", virtual_stages=3).problems(LLAMA8, 8, 8192))
    assert any("does not cut into 6 equal chunks" in p
               for p in PlanLayout(cp=3).problems(LLAMA8, 3, 8192 + 2))
    assert any("splits the experts" in p for p in PlanLayout(dp=2, ep=2).problems(LLAMA8, 8, 8192))
    # a real model's vocabulary is padded, so tp need not divide it
    assert PlanLayout(tp=8).problems(models.preset("gpt3-175b"), 8, 2048) == []


def test_the_context_parallel_attentions_are_the_layouts():
    assert tuple(ATTENTION) == CP_ATTENTION


# --- where the ranks go ------------------------------------------------------------------------
def test_coordinates_are_row_major_with_tp_fastest():
    dims = {"pp": 2, "dp": 2, "cp": 1, "tp": 2}
    assert [ranks.coords(dims, r) for r in (0, 1, 2, 4)] == [
        {"pp": 0, "dp": 0, "cp": 0, "tp": 0}, {"pp": 0, "dp": 0, "cp": 0, "tp": 1},
        {"pp": 0, "dp": 1, "cp": 0, "tp": 0}, {"pp": 1, "dp": 0, "cp": 0, "tp": 0}]
    assert all(ranks.rank_at(dims, ranks.coords(dims, r)) == r for r in range(8))


def test_groups_tied_pairs_and_folds():
    dims = {"pp": 2, "dp": 2, "cp": 1, "tp": 2}
    assert ranks.groups(dims, ("tp",)) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert ranks.groups(dims, ("dp", "cp")) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert ranks.groups(dims, ("pp",)) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    four = {"pp": 4, "dp": 1, "cp": 1, "tp": 1}
    assert ranks.groups(four, ("pp",), select={"pp": (0, 3)}) == [[0, 3]]
    runs, across = ranks.folded({"pp": 1, "dp": 2, "cp": 2, "tp": 1}, ("dp", "cp"), 2)
    assert runs == [[0, 1], [2, 3]] and across == [[0, 2], [1, 3]]


@pytest.mark.parametrize("dp,tp", [(2, 2), (4, 1), (1, 4)])
def test_the_same_degrees_give_the_same_ranks_in_every_strategy(dp, tp):
    """pp=2 with dp replicas and tp ranks per stage, named three ways (``nd``, a ``pipeline-*``
    preset, and the planner's layout): the same mesh, so every group holds the same ranks."""
    world = 2 * dp * tp
    nd = parallel.get("nd").layout(config("nd", world, {"pp": 2, "dp": dp, "tp": tp}))
    pipe = parallel.get("pipeline-1f1b").layout(config("pipeline-1f1b", world, {"dp": dp, "tp": tp}))
    plan = PlanLayout(pp=2, dp=dp, tp=tp, micro_batch=1).for_batch(dp * 4)
    for dims in (("tp",), ("dp", "cp"), ("pp",)):
        assert ranks.groups(nd.dims, dims) == ranks.groups(pipe.dims, dims) == \
            ranks.groups(plan.dims, dims)
    assert list(nd.dims) == list(MESH_ORDER)


def test_tp_and_cp_alone_take_the_same_mesh():
    tp = parallel.get("tp").layout(config("tp", 4, {"tp": 2}))
    nd = parallel.get("nd").layout(config("nd", 4, {"tp": 2}))
    assert tp.dims == nd.dims and ranks.groups(tp.dims, ("tp",)) == [[0, 1], [2, 3]]
    cp = parallel.get("cp").layout(config("cp", 4, {"cp": 2}))
    assert cp.dims == parallel.get("nd").layout(config("nd", 4, {"cp": 2})).dims
