"""``nd``'s mixed-precision step, looked at on its ranks:

- ``bf16-fp32-grads`` sums the micro-batches' bf16 gradients in fp32 (Megatron-LM's
  ``main_grad``): the gradient the optimizer is handed equals a float64 sum of the same
  micro-batches' bf16 gradients, averaged over the data ranks in float64, to fp32's rounding,
  where the same sum taken in bf16 (what autograd's accumulation into a bf16 ``.grad`` does)
  is off by bf16's;
- fp16's overflow decision is the world's: an inf in the gradients of ONE rank makes every
  rank skip the step and halve its scale together, so the parameters stay what they were on
  every rank, and the next clean step is taken by all of them alike.

One spawn of two ranks runs both (each strategy is built on the ranks and stepped by hand).
This module imports nothing from the tests' helpers, so its function can run on the ranks."""
from __future__ import annotations

import pytest
import torch

import dlab
from dlab.core.config import RunConfig

GPT = {"model": "gpt", "batch_size": 8, "optimizer": "sgd", "steps": 2,
       "model_options": {"n_layer": 2, "d_model": 32, "n_head": 2, "seq_len": 32}}
#: micro-batches accumulated (a power of two: the 1/m on each micro-batch's loss is exact)
M = 4
ACCUMULATION = [{"dp": 2, "zero": 0}, {"dp": 2, "zero": 1}]
#: an overflow on rank 1 only: data ranks (a replica each) and pipeline stages (other params)
OVERFLOW = [{"dp": 2, "zero": 1}, {"pp": 2}]


def _build(options: dict):
    import torch.distributed as dist

    from dlab import parallel
    from dlab.comm.instrumented import Comm
    from dlab.core.events import Timeline
    from dlab.parallel.base import Context

    cfg = RunConfig(strategy="nd", world_size=dist.get_world_size(), options=options, **GPT)
    ctx = Context(cfg, dist.get_rank(), cfg.world_size, 0, torch.device("cpu"), Timeline(), Comm())
    nd = parallel.get("nd")(ctx)
    nd.setup()
    return cfg, nd


def _handed(nd) -> dict[str, torch.Tensor]:
    """The fp32 gradients the optimizer was handed, as ``{name: (flat offset, run)}`` pieces of
    the single model's parameters (a ZeRO chunk is a run of each parameter it cuts)."""
    out = {}
    for s in nd.shardings:
        if not s.units:
            out.update({n: (0, m.grad.reshape(-1).clone()) for (n, _), m in zip(s.named, s.masters)})
        for u in s.units:
            for slot, start, at, n in u.owned_cuts():
                out[slot.name] = (start, u.master.grad[at:at + n].clone())
    return out


def accumulation(options: dict) -> dict:
    """One ``bf16-fp32-grads`` step of M micro-batches with the optimizer held back; then, with
    autograd alone on the same bf16 weights, each micro-batch's gradient, summed in float64 and
    in bf16; both sums averaged over the data ranks in float64. Returns each sum's worst error
    against the float64 one, relative to the largest gradient of its tensor."""
    import torch.distributed as dist

    from dlab.models.data import make_data, shard

    cfg, nd = _build({**options, "precision": "bf16-fp32-grads", "microbatches": M})
    handed = {}
    nd.optimizer.step = lambda: handed.update(_handed(nd))  # the gradients, not the update
    batch = make_data(cfg).global_batch(0)
    nd.step(batch)
    named = [(n, p) for s in nd.shardings for n, p in s.named]
    exact = {n: torch.zeros(p.numel(), dtype=torch.float64) for n, p in named}
    in_bf16 = {n: torch.zeros(p.numel(), dtype=torch.bfloat16) for n, p in named}
    stage = nd.stages[0]
    x, y = shard(batch, nd.mesh.rank("dp"), nd.lay.dp)
    for xi, yi in zip(x.chunk(M), y.chunk(M), strict=True):
        for _, p in named:
            p.grad, p.main_grad = None, None  # the fp32 hooks stand aside
        (stage.criterion(stage(xi), yi) / M).backward()
        for n, p in named:
            exact[n] += p.grad.reshape(-1).double()
            in_bf16[n] += p.grad.reshape(-1)
    worst = {"fp32": 0.0, "bf16": 0.0}
    for n, _ in named:
        for sums in (exact, in_bf16):
            sums[n] = sums[n].double()
            dist.all_reduce(sums[n])
            sums[n] /= nd.lay.dp
        if n not in handed:
            continue
        start, got = handed[n]
        ref, bf = (t[start:start + got.numel()] for t in (exact[n], in_bf16[n]))
        scale = ref.abs().max().item() or 1.0
        worst["fp32"] = max(worst["fp32"], (got.double() - ref).abs().max().item() / scale)
        worst["bf16"] = max(worst["bf16"], (bf - ref).abs().max().item() / scale)
    return worst


def overflow_on_one_rank(options: dict) -> dict:
    """Two fp16 steps; in the first, rank 1 alone finds an inf in a gradient it was handed
    (after the data ranks' reduction, before the scaler's decision). Returns, per step, the
    scale, the skipped count and whether this rank's masters and working copy moved, and the
    full parameters after the second step."""
    import torch.distributed as dist

    from dlab.models.data import make_data

    cfg, nd = _build({**options, "precision": "fp16"})
    data = make_data(cfg)
    rank = dist.get_rank()

    def held():
        return [t.detach().clone() for s in nd.shardings
                for t in [*s.optimizer_params(), *(u.shard for u in s.units), *s.params]
                if t.numel()]

    for s in nd.shardings:
        hand = s.hand_grads

        def poisoned(hand=hand, s=s):
            hand()
            if rank == 1 and nd.ctx.timeline.step == 0:
                s.master_grads()[0].view(-1)[0] = float("inf")
        s.hand_grads = poisoned
    steps = []
    for step in range(2):
        nd.ctx.timeline.step = step
        before = held()
        nd.step(data.global_batch(step))
        after = held()
        steps.append({"scale": nd.scaler.scale, "skipped": nd.scaler.skipped,
                      "moved": any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))})
    return {"steps": steps, "full": nd.full_state_dict()}


def mixed_steps() -> dict:
    return {"accumulation": [accumulation(o) for o in ACCUMULATION],
            "overflow": [overflow_on_one_rank(o) for o in OVERFLOW]}


@pytest.fixture(scope="module")
def on_ranks(tmp_path_factory):
    return dlab.spawn(mixed_steps, 2, runs_dir=tmp_path_factory.mktemp("runs"), timeout_s=120)


@pytest.mark.parametrize("case", range(len(ACCUMULATION)),
                         ids=[f"zero{o['zero']}" for o in ACCUMULATION])
def test_bf16_fp32_grads_accumulates_micro_batches_in_fp32(on_ranks, case):
    """fp32 accumulation of M bf16 gradients is exact but for a few fp32 roundings (2^-20 of the
    largest gradient leaves them room); bf16 accumulation rounds each partial sum to 8 bits, so
    the same micro-batches summed in bf16 are off by more than 2^-12 somewhere: the bound tells
    the two apart by 2^8."""
    for rank, result in enumerate(on_ranks):
        worst = result["accumulation"][case]
        assert worst["bf16"] > 2.0 ** -12, ("the micro-batches are too tame to show bf16's "
                                            "rounding: the test tells nothing apart", worst)
        assert worst["fp32"] <= 2.0 ** -20, f"rank {rank}: not accumulated in fp32: {worst}"


@pytest.mark.parametrize("case", range(len(OVERFLOW)), ids=["dp2-zero1", "pp2"])
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(on_ranks, case):
    """Step 0: every rank skipped (its skipped count 1, its scale halved from 2^16, nothing it
    holds moved); step 1: every rank applied it at the same scale. The data ranks' replicas
    then hold the same parameters bit for bit."""
    results = [r["overflow"][case] for r in on_ranks]
    for rank, result in enumerate(results):
        first, second = result["steps"]
        assert (first["skipped"], first["scale"], first["moved"]) == (1, 2.0 ** 15, False), \
            f"rank {rank} did not skip the overflowing step with the others: {first}"
        assert (second["skipped"], second["scale"], second["moved"]) == (1, 2.0 ** 15, True), \
            f"rank {rank}: {second}"
    full = [r["full"] for r in results]
    assert full[0].keys() == full[1].keys()
    assert all(torch.equal(full[0][k], full[1][k]) for k in full[0])
