"""The communication buffers of an ``nd`` rank: the most bytes its transient buffers hold at
once in a step (``comm_buffers``), and each kind's own peak.

Written from the order in which ``nd`` allocates and frees them (``parallel.nd.sharding``,
``parallel.pipeline.executor``), for a GPT. A rank at pipeline rank p holds units u (a root
of the embedding and/or head where it has the first or last stage, one per block;
``nd.units``), each padded to a multiple of the n = dp x cp data ranks, pad(u); e bytes per
compute element, g per gradient element (``dlab.core.precision``):

    A  = B/(dp m) x T/cp (/tp under sequence parallelism) x d x e    one boundary tensor
    F  = g sum pad(u)                  ZeRO 2-3: the flat gradient of every unit
    R  = e pad(root)                   ZeRO 3: the root, gathered for the whole step
    U  = e pad(block)                  ZeRO 3: one block gathered
    S  = g x the replicated parameters sequence parallelism sums over tp
    D  = g sum u                       ZeRO 0: the flat all-reduce message
    M  = 4 sum pad(u)/n (ZeRO >= 1), 4 sum u (ZeRO 0), where g = 2: fp32 gradient copies

1. Before the schedule the flat gradients F are allocated (ZeRO 2-3: gradients accumulate
   over all m micro-batches, so they live for the whole schedule) and the root R gathered.
2. The schedule: the executor posts k = ``recv_ahead`` receives, and at each receive posts up
   to k after the one it waits on, so r = posted - consumed buffers of A bytes are held; a
   received buffer stops counting once it is handed to its stage. Under ZeRO 3 a forward
   gathers one block at a time (gathered before it, freed after it); a backward holds two
   blocks at once where its stage has two or more. Why: the tensor between blocks i-1 and i
   carries two gradient hooks, block i-1's "gather me for my backward" (registered when
   block i-1's forward ended) and block i's "free me, my backward is done" (registered when
   block i's forward began); hooks run in registration order, so block i-1 is gathered
   before block i is freed. Measured: ``gathered_peak`` = R + 2U exactly, and R + U where
   every stage has one block (interleaved, 4 blocks on 4 stages; tests/test_nd_buffers.py).
3. After it: the sequence-parallel all-reduce's flat message S, with F and R still held.
4. The data reduction: ZeRO 0 all-reduces one flat message D (freed once copied back);
   ZeRO 2-3 free each unit's flat gradient, and ZeRO 3 the root, after its reduce-scatter.
5. The optimizer's fp32 gradient copies M, all alive during its step (only where the
   gradients are 2-byte: bf16, fp16; fp32 gradients are handed over as they are).

    comm_buffers = max( F + R + max over the schedule of (r A + blocks gathered x U),
                        F + R + S,  D,  M )

and its parts, each kind's own peak: ``recv_peak`` min(k + 1, receives) A (as
``theory.pipeline.recv_buffer_bytes``), ``gathered_peak`` R + 2U (R + U), ``reduce_peak``
max(F + S, D), ``master_grad_peak`` M.

Stage 1's flat gradients stay allocated between steps, so they are ``gradients``, not a
transient buffer; stages 1-2 all-gather the updated replica from the owned chunk in place, with
no send copy. Left out: what the collectives hold inside them (Gloo's copies, the
staging buffers of dlab's ring reduce-scatter), the tensor- and context-parallel layers'
own buffers (all-gathered activations, K/V blocks in flight) and a MoE's all-to-all rows and
expert units (``comm_buffers`` refuses a MoE); sent activations, which are the stages'
outputs themselves held by the pending send, not copies. Recomputation changes nothing here:
the recomputed forward fires no module hooks (``dlab.models.recompute``).
"""
from __future__ import annotations

from dlab.core.precision import PRECISIONS
from dlab.layout import schedules
from dlab.layout.layout import Layout
from dlab.theory import nd
from dlab.theory.memory import padded

FP32 = 4


def boundary_bytes(cfg, lay: Layout, global_batch: int, element_bytes: int) -> int:
    """Bytes of one activation (or its gradient) crossing a stage boundary: the rank's share
    of a micro-batch, its tokens only (the sequence-parallel slice under sp)."""
    tokens = cfg.seq_len // lay.cp // (lay.tp if lay.sequence_parallel else 1)
    return global_batch // (lay.dp * lay.microbatches) * tokens * cfg.d_model * element_bytes


def _schedule(lay: Layout, pp_rank: int, recv_ahead: int, boundary: int, block: int,
              blocks: dict[int, int]) -> tuple[int, int]:
    """(the most bytes of receive buffers held at once, the most of receive buffers and
    gathered blocks at once) over the rank's action list, walked as the executor posts,
    waits and computes; ``blocks`` is each of its stages' block count."""
    actions = schedules.build(lay.schedule, lay.pp, lay.microbatches,
                              lay.virtual_stages).actions[pp_rank]
    total = sum(1 for a in actions if a.kind == "recv")
    posted, done = min(recv_ahead, total), 0
    recv = both = posted * boundary
    for a in actions:
        if a.kind == "recv":  # post up to k past this one, wait for it, hand it over
            posted = max(posted, min(done + 1 + recv_ahead, total))
            recv = max(recv, (posted - done) * boundary)
            done += 1
        elif a.kind in ("forward", "backward"):
            at_once = 1 if a.kind == "forward" else min(2, blocks[a.stage])
            both = max(both, (posted - done) * boundary + at_once * block)
    return recv, max(recv, both)


def comm_buffers(cfg, lay: Layout, pp_rank: int, global_batch: int, precision: str = "fp32",
                 recv_ahead: int | None = None) -> dict[str, int]:
    """``comm_buffers`` of a rank at ``pp_rank`` (the formula above) and its parts as ``nd``
    reports them: ``recv_peak``, ``gathered_peak``, ``reduce_peak`` (F + S, or D, or S: the
    flat gradients and flat messages), ``master_grad_peak`` (M). ``recv_ahead`` defaults to
    Gloo's 2v (``ND.recv_ahead``)."""
    if hasattr(cfg, "n_expert"):
        raise ValueError("a MoE's expert units and all-to-all buffers are not modelled: read the "
                         "measured memory.comm_buffers for a MoE")
    prec = PRECISIONS[precision]
    e, g = prec.weight_bytes, prec.grad_bytes
    k = 2 * lay.virtual_stages if recv_ahead is None else recv_ahead
    n, zero = lay.dp * lay.cp, lay.zero
    ranges, mine, n_stages = nd._stages(cfg, lay, pp_rank)
    first, last = 0 in mine, n_stages - 1 in mine
    dense, _ = nd.units(cfg, lay, pp_rank)
    sizes = [padded(u, n) for u in dense]
    root = sizes[0] if first or last else 0
    flats = g * sum(sizes) if zero >= 2 else 0
    gathered_root = e * root if zero == 3 else 0
    block = e * sizes[-1] if zero == 3 else 0  # every block's unit is the same size
    blocks = {s: len(ranges[s]) for s in mine}
    recv, schedule = _schedule(lay, pp_rank, k, boundary_bytes(cfg, lay, global_batch, e), block,
                               blocks)
    sp = (g * nd._replicated(cfg, sum(blocks.values()), first, last)
          if lay.tp > 1 and lay.sequence_parallel else 0)
    all_reduce = g * sum(dense) if zero == 0 else 0
    masters = FP32 * (sum(sizes) // n if zero else sum(dense)) if g != FP32 else 0
    at_once = 2 if max(blocks.values()) >= 2 else 1
    return {"comm_buffers": max(flats + gathered_root + schedule, flats + gathered_root + sp,
                                all_reduce, masters),
            "recv_peak": recv,
            "gathered_peak": gathered_root + at_once * block,
            "reduce_peak": max(flats + sp, all_reduce),
            "master_grad_peak": masters}
