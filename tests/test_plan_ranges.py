"""A prediction's range (``dlab.theory.plan.ranges.step_range``): low <= step <= high for every
stack, model and layout, and the range of a whole-step spread is what that spread says, counted
by hand."""
from __future__ import annotations

import dataclasses
import math

import pytest

from dlab.plan import PlanLayout, clusters, models, plan, stacks, step_range
from dlab.theory.comm import AlphaBeta

CASES = [("llama3-8b", "h100-sxm", PlanLayout(dp=64, zero=1), 1024, 8192),
         ("llama3-70b", "h100-sxm", PlanLayout(dp=8, tp=8, pp=4, zero=1, sequence_parallel=True,
                                               recompute="selective"), 256, 4096),
         ("mixtral-8x7b", "a100-80gb", PlanLayout(dp=8, ep=8, zero=3, recompute="full"), 64, 4096),
         ("llama3-70b", "h100-grand-teton", PlanLayout(dp=4, cp=4, tp=8, zero=2, pp=2,
                                                       schedule="interleaved", virtual_stages=2,
                                                       sequence_parallel=True), 64, 8192)]


@pytest.mark.parametrize("stack", list(stacks.PRESETS))
@pytest.mark.parametrize("model,cluster,lay,batch,seq", CASES,
                         ids=["8b-dp64", "70b-3d", "mixtral-ep-zero3", "70b-cp-interleaved"])
def test_a_range_holds_its_prediction_and_its_low_is_below_its_high(stack, model, cluster, lay,
                                                                     batch, seq):
    p = plan(models.preset(model), clusters.preset(cluster), lay, batch, seq, stack)
    low, high = step_range(p)
    assert 0 < low < p.step_s < high, (low, p.step_s, high)


CPU = clusters.Cluster("a CPU", 5e10, 24e9, 10e9, 1 << 20, AlphaBeta.link(1e9, 1e-5),
                       AlphaBeta.link(1e9, 1e-5), 1.0, 1.0, reserved=0.0, cores=2,
                       layer_overhead=5e-4, spread=(("step", 0.85, 1.15),))


def test_a_whole_step_spread_gives_the_step_over_its_ends_and_two_add_in_quadrature():
    """A step that may run 0.85 to 1.15 times as fast as measured takes t / 1.15 to t / 0.85;
    two such independent spreads add their deviations as the root of their squares' sum."""
    spec = models.Transformer("tiny", 2, 64, 4, 256, 512)
    p = plan(spec, CPU, PlanLayout(dp=2), 8, 64)
    t = p.step_s
    assert step_range(p) == (pytest.approx(t / 1.15, rel=1e-12), pytest.approx(t / 0.85, rel=1e-12))
    twice = plan(spec, dataclasses.replace(CPU, spread=CPU.spread * 2), PlanLayout(dp=2), 8, 64)
    low, high = step_range(twice)
    assert low == pytest.approx(t * (1 - math.sqrt(2) * (1 - 1 / 1.15)), rel=1e-12)
    assert high == pytest.approx(t * (1 + math.sqrt(2) * (1 / 0.85 - 1)), rel=1e-12)
