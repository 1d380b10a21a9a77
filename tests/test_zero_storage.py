"""ZeRO-3 gathers a unit's full parameters only while it computes: the full buffers allocated at
once, read from their storages after every operator of a step (forward and backward), are the
root and one block, two with prefetch. This module imports nothing from the tests' helpers, so
its function can run on the ranks."""
from __future__ import annotations

import pytest
import torch

import dlab
from dlab.core.config import RunConfig
from dlab.models.data import make_data
from dlab.theory.memory import model_units, padded

# As test_zero.UNEVEN: every unit padded at 2 and 4 ranks.
UNEVEN = {"model": "gpt", "batch_size": 8, "steps": 2, "optimizer": "sgd",
          "model_options": {"n_layer": 3, "d_model": 31, "n_head": 1, "seq_len": 32}}


def whole_units_at_once(prefetch: bool) -> list[int]:
    """On each rank: zero3 for two steps; per step, the most bytes of full unit buffers
    allocated at once."""
    import torch.distributed as dist

    from dlab import parallel
    from dlab.comm.instrumented import Comm
    from dlab.core.events import Timeline
    from dlab.core.metrics import StoragePeak
    from dlab.parallel.base import Context

    cfg = RunConfig(strategy="zero3", world_size=dist.get_world_size(),
                    options={"prefetch": prefetch}, **UNEVEN)
    ctx = Context(cfg, dist.get_rank(), cfg.world_size, 0, torch.device("cpu"), Timeline(), Comm())
    strategy = parallel.get("zero3")(ctx)
    strategy.setup()
    data, peaks = make_data(cfg), []
    for step in range(cfg.steps):
        ctx.timeline.step = step
        meter = StoragePeak(lambda: [u.flat for u in strategy.units])
        with meter.track():
            strategy.step(data.global_batch(step))
        peaks.append(meter.peak)
    return peaks


@pytest.mark.parametrize("n,prefetch", [(2, True), pytest.param(4, False, marks=pytest.mark.slow)])
def test_zero3_holds_the_root_and_one_or_two_blocks_whole_at_once(n, prefetch, runs_dir):
    units = model_units("gpt", UNEVEN["model_options"])
    block, root = 4 * padded(units.blocks[0], n), 4 * padded(units.root, n)
    for peaks in dlab.spawn(whole_units_at_once, n, prefetch, runs_dir=runs_dir):
        assert peaks == [root + block * (2 if prefetch else 1)] * 2
