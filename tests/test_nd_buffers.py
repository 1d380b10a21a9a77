"""``nd``'s communication buffers: on every rank and every step, the measured ``comm_buffers``
(one peak of all the rank's transient buffers at once, read from their storages) and each
part's own peak (``recv_peak``, ``gathered_peak``, ``reduce_peak``, ``master_grad_peak``)
equal ``dlab.theory.nd_buffers.comm_buffers`` to the byte.

The default run's four launches put every term in play: ZeRO 0 with a pipeline (posted
receives, then the flat all-reduce message), ZeRO 3 alone (two blocks gathered at once in
backward, over the root and the flat gradients), ZeRO 3 under an interleaved pipeline
(receives posted while blocks are gathered, over the flat gradients; one block per stage, so a
backward holds one gathered block, not two), and bf16 ZeRO 1 under a pipeline (the
optimizer's fp32 gradient copies). The other stages, schedules, precisions and sequence
parallelism are ``slow``. Training itself is tests/test_nd_parity.py's and
tests/test_nd_precision.py's.
"""
from __future__ import annotations

import pytest
from test_nd_parity import GPT, SP

import dlab
from dlab import parallel
from dlab.core.config import RunConfig
from dlab.layout import Layout
from dlab.theory import nd_buffers

SHORT = {**GPT, "steps": 2}
RECOMPUTED = {**SHORT, "model_options": {**GPT["model_options"], "recompute": "full",
                                         "recompute_every": 2}}

CASES = [
    (2, SHORT, {"pp": 2}),
    (2, SHORT, {"dp": 2, "zero": 3}),
    (4, SHORT, {"pp": 2, "dp": 2, "zero": 3, "schedule": "interleaved"}),
    (4, SHORT, {"pp": 2, "dp": 2, "zero": 1, "precision": "bf16"}),
    # slow: the default cases above run the same allocation order (the same DataSharding and
    # executor code); these add the other stages, schedules, precisions and sp's flat message
    *(pytest.param(*case, marks=pytest.mark.slow) for case in [
        (2, SHORT, {"dp": 2}),
        (2, SHORT, {"dp": 2, "zero": 1}),
        (2, SHORT, {"dp": 2, "zero": 2}),
        (4, SHORT, {"pp": 2, "dp": 2, "zero": 2}),  # stage 3's flats without its gathers
        (4, SHORT, {"pp": 2, "dp": 2}),
        (4, SHORT, {"pp": 2, "dp": 2, "zero": 3}),  # two blocks a stage: two at once
        (4, SHORT, {"pp": 2, "dp": 2, "zero": 3, "recv_ahead": 0}),
        (4, SHORT, {"pp": 2, "dp": 2, "zero": 3, "schedule": "zbv"}),
        # the sequence-parallel flat message; recomputation gathers nothing more
        (4, RECOMPUTED, {"dp": 2, "zero": 3, "tp": 2, **SP}),
        (4, SHORT, {"pp": 2, "tp": 2, **SP}),
        (2, SHORT, {"pp": 2, "precision": "bf16"}),  # stage 0's copies, one per parameter
        (2, SHORT, {"pp": 2, "precision": "bf16-fp32-grads"}),  # fp32 gradients: no copies
        (2, SHORT, {"dp": 2, "zero": 3, "precision": "fp16"}),
    ]),
]


def _id(world, config, options) -> str:
    extra = "-recompute" if config is RECOMPUTED else ""
    return f"{world}-" + "-".join(f"{k}{v}" for k, v in options.items()) + extra


@pytest.mark.parametrize("world,config,options", CASES,
                         ids=[_id(*(c.values if hasattr(c, "values") else c)) for c in CASES])
def test_comm_buffers_are_the_formula_on_every_rank_and_step(world, config, options, runs_dir):
    run = dlab.launch("nd", world, runs_dir=runs_dir, wait=True, options=options, **config)
    cfg = RunConfig.from_dict(run.config)
    lay = Layout.from_options(cfg.options, world)
    k = parallel.get("nd").recv_ahead(cfg)
    for r in range(world):
        want = nd_buffers.comm_buffers(cfg.model_config(), lay, r // (world // lay.pp),
                                       cfg.batch_size, options.get("precision", "fp32"), k)
        steps = run.metrics(r)
        assert len(steps) == config["steps"]
        for m in steps:
            assert {key: m["memory"][key] for key in want} == want, (r, m["step"])
