"""Step time on a GPU cluster: every operation priced, every collective at the bandwidth it
achieves, each overlap hiding a stated share, the bubble, the optimizer.

Compute, per micro-batch on a pipeline rank: its layers' operations forward and backward and
what recomputation runs again (``dlab.theory.plan.ops``), plus the embedding on the first stage
and the head and loss on the last, each operation at the device's roofline.

Communication, per collective (``dlab.theory.plan.collectives``), and what hides it. A
collective beside compute of ``window`` seconds, under a stack whose share for it is ``share``
(``dlab.theory.plan.stacks``), is exposed for ``comm - share x min(comm, window)``: all of it
at share 0, what the window cannot cover at share 1 (``exposed``). Per micro-batch and layer:

- tp: forward two all-reduces of the layer's b (s/cp) h activation (sequence parallelism: two
  all-gathers and two reduce-scatters), backward as many, again in a fully recomputed
  forward; under sequence parallelism backward gathers the two matmuls' inputs again for
  their weight gradients (Megatron-LM's, and dlab's nd: 10 (t-1)/t of the activation a layer
  where all-reduces would move 8) unless the stack keeps them (``Stack.sp_regather``); a stack
  may hide only backward's column-parallel collectives (``Stack.tp_backward``: the input
  gradient's all-reduce, or its reduce-scatter and the re-gather, behind the QKV and MLP-in
  GEMMs beside them, Megatron-LM's asynchronous ones); their window is the layer's matmuls
  (Megatron-Core's --tp-comm-overlap pipelines them with the GEMMs beside them); a stack with
  async tensor parallelism (``Stack.tp_async``) hides each collective that PyTorch's
  micro-pipelining decomposes behind the GEMMs it feeds or is fed by, and no more
  (``decomposed``), its other collectives blocking; plus one on the embedding and two at the
  head, exposed;
- cp, a ring: (cp-1) passes of the rank's K and V forward, twice that backward (dK and dV come
  back), their window the attention core; an all-gather (Llama 3's): an all-gather of K and V
  forward, another and a reduce-scatter of their gradients backward;
- ep: the dispatch and combine all-to-alls, forward and backward;
- pp: a send of the boundary activation forward and of its gradient backward per micro-batch
  and model chunk, their window the micro-batch's compute; a stage waits for two transfers a
  micro-batch where each send is paired with the receive it waits on, four where sends and
  receives are separate blocking steps (``Stack.pp_transfers``); a stack that splits the
  boundary over the tp ranks sends 1/t of it and all-gathers what it receives over them
  (``Stack.pp_scatter``);
- data (the dp x cp ranks; ``zero_group`` of them sharing a shard under hybrid sharding, the
  shards all-reduced over the replicas): ZeRO-0 one all-reduce of the gradients behind the
  last micro-batch's backward, ZeRO-1 a reduce-scatter there and one all-gather of the weights
  behind the first forward, ZeRO-2 the reduce-scatter after every micro-batch's backward,
  ZeRO-3 per micro-batch a gather of each layer ahead of its forward (the first unit exposed)
  and again for backward (``Stack.gather_backward``), a reduce-scatter of each behind the next
  layer's backward (the last one exposed). Each runs in units, buckets of ``Stack.bucket``
  parameters (Megatron's: at least a million per data rank) or one per layer (FSDP,
  DeepSpeed), each paying its latency; the last unit reduced and the first gathered are
  exposed. Gathered weights and reduced gradients copied in and out of the collective's buffer
  (``Stack.copies``) are memory-bound passes added to the compute.

A hidden collective is not free: NCCL's kernels occupy streaming multiprocessors and memory
bandwidth beside the compute they hide behind, which loses ``interference`` of the hidden
seconds (``dlab.theory.plan.ranges``: 0.1, from 0 to 0.2).

Bubble: the schedule's idle fraction (``dlab.theory.pipeline``'s closed forms, the simulation
where none applies) of the stage's time per micro-batch (compute and its exposed tp, cp and ep
communication). Optimizer: Adam over the rank's shard (``optimizer_time``, which the CPU model
uses too).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from dlab.core.precision import PRECISIONS
from dlab.theory.pipeline import bubble, simulated_bubble
from dlab.theory.plan import data_comm
from dlab.theory.plan.collectives import bus_bytes, collective_time
from dlab.theory.plan.memory import BYTES, layers_on, optimizer_shard, rank_params
from dlab.theory.plan.ops import end_ops, layer_ops, recomputed


@dataclass(frozen=True)
class Knobs:
    """The planner-wide constants a range varies (``dlab.theory.plan.ranges``)."""
    sustained: float = 1.0
    interference: float = 0.1
    #: the share of each stack overlap that holds (1: the stack's own)
    overlap: float = 1.0


def exposed(comm: float, window: float, share: float) -> float:
    """Seconds of ``comm`` that ``window`` seconds of compute do not hide at ``share``."""
    return comm - share * min(comm, window)


def bubble_fraction(lay, m: int) -> float:
    """Idle share of a pipelined step: forward, input gradient and weight gradient alike."""
    if lay.pp == 1:
        return 0.0
    third = 1.0 / 3
    closed = bubble(lay.schedule, lay.pp, m, lay.virtual_stages, third, third, third)
    if closed is not None:
        return closed
    return simulated_bubble(lay.schedule, lay.pp, m, lay.virtual_stages, third, third, third)


#: the column-parallel matmuls (their input gradient's collective is the f operator's)
COLUMN = ("qkv", "mlp in", "mlp gate", "mlp up")


def _seconds(ops, cluster, stack, knobs, elt) -> float:
    return sum(op.seconds(cluster, stack, knobs.sustained, elt) for op in ops)


def compute(spec, cluster, lay, stack, seq_len: int, pp_rank: int, knobs: Knobs) -> dict:
    """Seconds of one micro-batch's compute on ``pp_rank`` (forward, backward, recompute) and
    the per-layer windows the overlaps use. Layouts that differ only in what does not change a
    micro-batch's compute (dp, ZeRO, the schedule, the micro-batches) share one pricing."""
    return _compute(spec, cluster, _pricing_key(lay), stack, seq_len, pp_rank, knobs)


@functools.lru_cache(maxsize=65536)
def _pricing_key(lay):
    return dataclasses.replace(lay, dp=1, zero=0, zero_group=0, microbatches=1, schedule="1f1b")


@functools.lru_cache(maxsize=4096)
def _compute(spec, cluster, lay, stack, seq_len: int, pp_rank: int, knobs: Knobs) -> dict:
    elt = 4 if lay.precision == "fp32" else 2
    fwd, bwd = layer_ops(spec, lay, stack, seq_len)
    layers = layers_on(spec, lay, pp_rank)
    ends = end_ops(spec, lay, stack, seq_len, pp_rank == 0, pp_rank == lay.pp - 1)

    def total(ops):
        return _seconds(ops, cluster, stack, knobs, elt)

    f, b = total(fwd), total(bwd)
    return {"layers": layers, "layer_forward": f, "layer_backward": b,
            "gemms": {op.name: total([op]) for op in (*fwd, *bwd) if op.kind == "matmul"},
            "layer_recompute": total(recomputed(spec, lay, stack, fwd))
            * spec.recomputed_share(lay.recompute, lay.recompute_every),
            "matmul_forward": total(op for op in fwd if op.kind == "matmul"),
            "matmul_backward": total(op for op in bwd if op.kind == "matmul"),
            "column_backward": total(op for op in bwd if op.kind == "matmul" and op.name.startswith(COLUMN)),
            "attention_forward": total(op for op in fwd if op.core),
            "attention_backward": total(op for op in bwd if op.core),
            "forward": layers * f + total(ends[0]), "backward": layers * b + total(ends[1])}


def _share(stack, knobs, name: str) -> float:
    return getattr(stack, name) * knobs.overlap


def decomposed(cluster, act: float, t: int, gemms: dict) -> tuple[list, list]:
    """Async tensor parallelism's (``Stack.tp_async``) collectives of one layer under sequence
    parallelism, each as (its seconds, the GEMMs it runs in steps with): forward, the
    all-gather of the attention's input with the QKV GEMMs that take it, of the MLP's input with
    its first GEMMs, and the reduce-scatters of the output projection's and the MLP's last
    GEMM's outputs; backward, the all-gathers of those two outputs' gradients with the
    input-gradient GEMMs that take them. Decomposed into one step per rank (a shard's GEMM
    while the next shard arrives; Wang et al. 2022), a collective is exposed only where it is
    longer than its GEMMs."""
    ag = collective_time(cluster, "all_gather", act, t)
    rs = collective_time(cluster, "reduce_scatter", act, t)

    def gemm(*names):
        return sum(s for name, s in gemms.items() if name in names)

    forward = [(ag, gemm("qkv")), (ag, gemm("mlp in", "mlp gate", "mlp up")),
               (rs, gemm("projection")), (rs, gemm("mlp out"))]
    backward = [(ag, gemm("projection input grad")), (ag, gemm("mlp out input grad"))]
    return forward, backward


def communication(spec, cluster, lay, stack, global_batch: int, seq_len: int, pp_rank: int,
                  comp: dict, knobs: Knobs) -> dict:
    """Exposed and hidden seconds, and bytes sent, per dimension for one step on ``pp_rank``;
    ``copies``: memory-bound seconds of copying gathered and reduced buffers."""
    m = lay.for_batch(global_batch).microbatches
    e = 4 if lay.precision == "fp32" else 2
    T = lay.micro_batch * seq_len // lay.cp
    h, t, cp = spec.d_model, lay.tp, lay.cp
    layers = comp["layers"]
    first, last = pp_rank == 0, pp_rank == lay.pp - 1
    out = {k: 0.0 for k in ("tp", "cp", "ep", "pp", "data")}
    sent, hidden = dict(out), dict(out)
    per_micro = dict(out)  # exposed seconds on each micro-batch's critical path

    def charge(dim, comm, window, share, count=1.0, micro=True):
        shown = exposed(comm, window, share)
        out[dim] += count * shown
        hidden[dim] += count * (comm - shown)
        if micro:
            per_micro[dim] += count * shown / m

    act = e * T * h
    if t > 1:
        ops = (("all_gather", 2), ("reduce_scatter", 2)) if lay.sequence_parallel else (("all_reduce", 2),)
        one = sum(k * collective_time(cluster, op, act, t) for op, k in ops)
        sent_one = sum(k * bus_bytes(op, act, t) for op, k in ops)
        # sequence parallelism's backward gathers the two matmul inputs again for the weight
        # gradients unless the stack kept them from forward (Stack.sp_regather)
        regather = 2 if lay.sequence_parallel and stack.sp_regather else 0
        back = one + regather * collective_time(cluster, "all_gather", act, t)
        share, column = _share(stack, knobs, "tp"), _share(stack, knobs, "tp_backward")
        again = spec.recomputed_share(lay.recompute, lay.recompute_every) if lay.recompute == "full" else 0.0
        calls = 2 + again
        if stack.tp_async and lay.sequence_parallel:
            forward, backward = decomposed(cluster, act, t, comp["gemms"])
            hide = _share(stack, knobs, "tp_async")
            for comm, window in forward:
                charge("tp", comm, window, hide, m * layers * (1 + again))
            for comm, window in backward:
                charge("tp", comm, window, hide, m * layers)
            blocking = back - sum(comm for comm, _ in backward)  # the two reduce-scatters, regathers
            charge("tp", blocking, comp["matmul_backward"], share, m * layers)
        else:
            charge("tp", one, comp["matmul_forward"], share, m * layers * (1 + again))
            if column > share:  # the column-parallel layers' collectives behind their own GEMMs
                row = 2 * collective_time(cluster, "all_gather", act, t) if lay.sequence_parallel else 0.0
                charge("tp", row, comp["matmul_backward"], share, m * layers)
                charge("tp", back - row, comp["column_backward"], column, m * layers)
            else:
                charge("tp", back, comp["matmul_backward"], share, m * layers)
        ends = int(first) + 2 * int(last)
        end_op = "reduce_scatter" if lay.sequence_parallel else "all_reduce"
        charge("tp", collective_time(cluster, end_op, act, t), 0.0, 0.0, m * ends)
        sent["tp"] = m * (layers * (calls * sent_one + regather * bus_bytes("all_gather", act, t))
                          + ends * bus_bytes(end_op, act, t))
    if cp > 1:
        kv = 2 * e * T * spec.kv_width * t // min(t, spec.n_kv_head) / t
        share = _share(stack, knobs, "cp")
        again = spec.recomputed_share(lay.recompute, lay.recompute_every)
        if lay.cp_attention == "allgather":
            gather = collective_time(cluster, "all_gather", kv * cp, cp, t)
            scatter = collective_time(cluster, "reduce_scatter", kv * cp, cp, t)
            charge("cp", gather, comp["attention_forward"], share, m * layers * (1 + again))
            charge("cp", gather + scatter, comp["attention_backward"], share, m * layers)
            sent["cp"] = m * layers * (2 + again) * bus_bytes("all_gather", kv * cp, cp) \
                + m * layers * bus_bytes("reduce_scatter", kv * cp, cp)
        else:
            hop = collective_time(cluster, "p2p", kv, 2, t)
            charge("cp", (cp - 1) * hop, comp["attention_forward"], share, m * layers * (1 + again))
            charge("cp", 2 * (cp - 1) * hop, comp["attention_backward"], share, m * layers)
            sent["cp"] = m * layers * (3 + again) * (cp - 1) * kv
    if spec.n_expert > 1 and lay.ep > 1:
        buf = act * spec.top_k
        one = collective_time(cluster, "all_to_all", buf, lay.ep, t)
        calls = 4 + (2 * spec.recomputed_share(lay.recompute, lay.recompute_every)
                     if lay.recompute == "full" else 0.0)
        charge("ep", one, comp["matmul_forward"], _share(stack, knobs, "ep"), m * layers * calls)
        sent["ep"] = m * layers * calls * bus_bytes("all_to_all", buf, lay.ep)
    if lay.pp > 1:
        scatter = stack.pp_scatter and not lay.sequence_parallel and t > 1
        boundary = act / (t if lay.sequence_parallel or scatter else 1)
        hop = collective_time(cluster, "p2p", boundary, 2, t * cp * lay.dp)
        sends = 2 * lay.virtual_stages * m
        window = (comp["forward"] + comp["backward"]) / lay.virtual_stages
        waits = sends * stack.pp_transfers / 2  # transfers the stage waits for (Stack.pp_transfers)
        share = _share(stack, knobs, "pp")
        charge("pp", hop, window, share, waits, micro=False)
        sent["pp"] = sends * boundary
        if scatter:  # each received slice all-gathered over the tp ranks (Stack.pp_scatter)
            charge("pp", collective_time(cluster, "all_gather", act, t), window, share, sends,
                   micro=False)
            sent["pp"] += sends * bus_bytes("all_gather", act, t)
    copies = 0.0
    n = lay.dp * cp
    if n > 1:
        def add(comm, window, share, count=1.0):
            charge("data", comm, window, share, count, micro=False)
        shares = (_share(stack, knobs, "grads"), _share(stack, knobs, "params"))
        copies = data_comm.data(spec, cluster, lay, stack, pp_rank, m, comp, shares, add, sent)
    return {"exposed": out, "hidden": hidden, "sent": sent, "per_micro": per_micro,
            "copies": copies}


def optimizer_time(spec, cluster, lay, pp_rank: int) -> float:
    """Adam over the rank's shard (``memory.optimizer_shard``), memory-bound: its state read and
    written (2 K bytes a parameter: the fp32 master and two moments in mixed precision, the
    moments alone in fp32, whose weights it then reads and writes too, 2 x 4), the gradient read
    twice (the norm clip and the update) and zeroed (3 g), the 16-bit weights written (w);
    ten launches on a GPU. One function for the GPU and the CPU machine (``cpu``), whose
    streaming kernels are its measured bandwidth itself."""
    w, g, k = BYTES[lay.precision]
    per_param = 2 * k + 3 * g + (w if PRECISIONS[lay.precision].mixed else 2 * w)
    kernels = cluster.kernels
    share = kernels.hbm if kernels else 1.0
    launches = 10 * kernels.launch if kernels else 0.0
    return optimizer_shard(spec, lay, pp_rank) * per_param / (cluster.hbm * share) + launches


#: bytes a parameter DeepSpeed's BF16_Optimizer moves after each micro-batch's backward
#: (update_hp_grads: ``hp_grad.add_(lp.grad.to(fp32))``): the bf16 gradient read and written
#: out as a temporary fp32 tensor (2 + 4), which the add reads beside the fp32 gradient before
#: writing that back (4 + 4 + 4)
HP_GRAD_PASS = 18


def accumulation_time(spec, cluster, lay, stack, pp_rank: int) -> float:
    """Seconds a micro-batch spends adding its 16-bit gradients into fp32 ones, where the stack
    does that by a pass of its own (``Stack.hp_grad_pass``), memory-bound."""
    w, g, _ = BYTES[lay.precision]
    if not stack.hp_grad_pass or g <= w:
        return 0.0
    return HP_GRAD_PASS * sum(rank_params(spec, lay, pp_rank)) / (cluster.hbm * cluster.kernels.hbm)


def stage(spec, cluster, lay, stack, global_batch: int, seq_len: int, pp_rank: int,
          knobs: Knobs) -> dict:
    """One pipeline rank's step: seconds by part (before the bubble), bytes sent by dimension,
    and its time per micro-batch, which the bubble scales."""
    m = lay.for_batch(global_batch).microbatches
    comp = compute(spec, cluster, lay, stack, seq_len, pp_rank, knobs)
    comm = communication(spec, cluster, lay, stack, global_batch, seq_len, pp_rank, comp, knobs)
    recompute = m * comp["layers"] * comp["layer_recompute"]
    accumulate = accumulation_time(spec, cluster, lay, stack, pp_rank)
    parts = {"compute": m * (comp["forward"] + comp["backward"] + accumulate) + comm["copies"],
             "recompute": recompute,
             **{f"{k}_comm": v for k, v in comm["exposed"].items()},
             "interference": knobs.interference * sum(comm["hidden"].values()),
             "optimizer": optimizer_time(spec, cluster, lay, pp_rank)}
    per_micro = (comp["forward"] + comp["backward"] + accumulate + comp["layers"] * comp["layer_recompute"]
                 + sum(v for k, v in comm["per_micro"].items() if k in ("tp", "cp", "ep")))
    return {"parts": parts, "sent": comm["sent"], "pp_rank": pp_rank, "busy": m * per_micro,
            "own": sum(parts.values())}
