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
  forward; their window is the layer's matmuls (Megatron-Core's --tp-comm-overlap pipelines
  them with the GEMMs beside them); plus one on the embedding and two at the head, exposed;
- cp, a ring: (cp-1) passes of the rank's K and V forward, twice that backward (dK and dV come
  back), their window the attention core; an all-gather (Llama 3's): an all-gather of K and V
  forward, another and a reduce-scatter of their gradients backward;
- ep: the dispatch and combine all-to-alls, forward and backward;
- pp: a send of the boundary activation forward and of its gradient backward per micro-batch
  and model chunk, their window the micro-batch's compute;
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
communication). Optimizer: Adam reads and writes its shard's fp32 master weights and two
moments (24 bytes a parameter), reads the gradient twice (the norm clip and the update), zeroes
it, and writes the 16-bit weights.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from dlab.theory.pipeline import bubble, simulated_bubble
from dlab.theory.plan.collectives import bus_bytes, collective_time
from dlab.theory.plan.memory import BYTES, layers_on, rank_params
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
            "layer_recompute": total(recomputed(spec, lay, stack, fwd)) / lay.recompute_every,
            "matmul_forward": total(op for op in fwd if op.kind == "matmul"),
            "matmul_backward": total(op for op in bwd if op.kind == "matmul"),
            "attention_forward": total(op for op in fwd if op.core),
            "attention_backward": total(op for op in bwd if op.core),
            "forward": layers * f + total(ends[0]), "backward": layers * b + total(ends[1])}


def _share(stack, knobs, name: str) -> float:
    return getattr(stack, name) * knobs.overlap


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
        share = _share(stack, knobs, "tp")
        charge("tp", one, comp["matmul_forward"], share, m * layers)
        charge("tp", one, comp["matmul_backward"], share, m * layers)
        again = 1 / lay.recompute_every if lay.recompute == "full" else 0.0
        calls = 2 + again
        charge("tp", one, comp["matmul_forward"], share, m * layers * again)
        ends = int(first) + 2 * int(last)
        end_op = "reduce_scatter" if lay.sequence_parallel else "all_reduce"
        charge("tp", collective_time(cluster, end_op, act, t), 0.0, 0.0, m * ends)
        sent["tp"] = m * (layers * calls * sent_one + ends * bus_bytes(end_op, act, t))
    if cp > 1:
        kv = 2 * e * T * spec.kv_width * t // min(t, spec.n_kv_head) / t
        share = _share(stack, knobs, "cp")
        again = 1 / lay.recompute_every if lay.recompute != "none" else 0.0
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
        calls = 4 + (2 / lay.recompute_every if lay.recompute == "full" else 0.0)
        charge("ep", one, comp["matmul_forward"], _share(stack, knobs, "ep"), m * layers * calls)
        sent["ep"] = m * layers * calls * bus_bytes("all_to_all", buf, lay.ep)
    if lay.pp > 1:
        boundary = act / (t if lay.sequence_parallel else 1)
        hop = collective_time(cluster, "p2p", boundary, 2, t * cp * lay.dp)
        sends = 2 * lay.virtual_stages * m
        window = (comp["forward"] + comp["backward"]) / lay.virtual_stages
        charge("pp", hop, window, _share(stack, knobs, "pp"), sends, micro=False)
        sent["pp"] = sends * boundary
    copies = 0.0
    n = lay.dp * cp
    if n > 1:
        copies = _data(spec, cluster, lay, stack, pp_rank, m, comp, knobs, out, hidden, sent)
    return {"exposed": out, "hidden": hidden, "sent": sent, "per_micro": per_micro,
            "copies": copies}


def _data(spec, cluster, lay, stack, pp_rank, m, comp, knobs, out, hidden, sent) -> float:
    """The data ranks' reductions and gathers (module docstring) into ``out``, ``hidden`` and
    ``sent``; returns the seconds of copying buffers."""
    w, g, _ = BYTES[lay.precision]
    t, n = lay.tp, lay.dp * lay.cp
    shard = lay.zero_group or n
    dense, experts = rank_params(spec, lay, pp_rank)
    layers = max(comp["layers"], 1)
    groups = [(dense, shard, n // shard, t)]
    if experts:  # the experts' owners: n / ep ranks, ep apart
        k = n // lay.ep
        groups.append((experts, min(shard, k), k // min(shard, k), t * lay.ep))
    grads, params = _share(stack, knobs, "grads"), _share(stack, knobs, "params")
    f_micro, b_micro = comp["forward"], comp["backward"] + comp["layer_recompute"] * layers
    f_layer, b_layer = comp["layer_forward"], comp["layer_backward"] + comp["layer_recompute"]
    copies = 0.0

    def add(comm, window, share, count=1):
        shown = exposed(comm, window, share)
        out["data"] += count * shown
        hidden["data"] += count * (comm - shown)

    for psi, k, replicas, stride in groups:
        if k * replicas <= 1:
            continue
        # the collectives' units: buckets of ``stack.bucket`` parameters (Megatron's at least
        # 1M per data rank), or one per layer (FSDP, DeepSpeed): each pays its own latency
        bucket = max(stack.bucket, 1e6 * n) if stack.bucket else psi / layers
        units = max(1, math.ceil(psi / bucket))
        per = psi / units
        reduce_op = "all_reduce" if lay.zero == 0 else "reduce_scatter"
        place = (cluster, k, replicas, stride, w, g, reduce_op)
        rs, ag = _reduce(place, per), _gather(place, per)
        reduce_sent = bus_bytes(reduce_op, g * psi, k) + bus_bytes("all_reduce", g * psi / k, replicas)
        gather_sent = bus_bytes("all_gather", w * psi, k)
        reduces = m if lay.zero == 2 else 1  # ZeRO-2 reduce-scatters every micro-batch's gradients
        if lay.zero in (0, 1, 2):
            add(rs, 0.0, 0.0, reduces)  # the last unit: no backward left to hide it
            add((units - 1) * rs, b_micro, grads, reduces)
            sent["data"] += reduces * reduce_sent
        if lay.zero in (1, 2):
            add(ag, 0.0, 0.0)  # the first unit: no compute before it
            add((units - 1) * ag, f_micro, params)
            sent["data"] += gather_sent
            copies += 2 * w * psi / (cluster.hbm * cluster.kernels.hbm) if stack.copies else 0.0
        if lay.zero == 3:
            units = layers  # a layer's weights gathered ahead of it, its gradient reduced behind
            per = psi / units
            ag, rs = _gather(place, per), _reduce(place, per)
            backward_gathers = (units - 1) if stack.gather_backward else 0
            add(ag, 0.0, 0.0, m)  # the first unit of each forward
            add(ag, f_layer, params, m * (units - 1))
            add(ag, b_layer, params, m * backward_gathers)
            add(rs, b_layer, grads, m * (units - 1))
            add(rs, 0.0, 0.0, m)  # the last unit's reduction: no backward left to hide it
            sent["data"] += m * (reduce_sent + gather_sent * (units + backward_gathers) / units)
            if stack.copies:
                moved = m * 2 * (w * psi * (units + backward_gathers) / units + g * psi)
                copies += moved / (cluster.hbm * cluster.kernels.hbm)
    return copies


def _reduce(place, params: float) -> float:
    """A gradient reduction of ``params`` parameters over a shard group (and its replicas)."""
    cluster, k, replicas, stride, _, g, op = place
    return (collective_time(cluster, op, g * params, k, stride)
            + collective_time(cluster, "all_reduce", g * params / k, replicas, stride * k))


def _gather(place, params: float) -> float:
    """A weight gather of ``params`` parameters over a shard group."""
    cluster, k, _, stride, w, _, _ = place
    return collective_time(cluster, "all_gather", w * params, k, stride)


def optimizer_time(spec, cluster, lay, pp_rank: int) -> float:
    """Adam over the rank's shard (module docstring)."""
    w, g, _ = BYTES[lay.precision]
    dense, experts = rank_params(spec, lay, pp_rank)
    n = lay.dp * lay.cp
    shard = lay.zero_group or n
    psi = dense / (shard if lay.zero else 1) + experts / (max(min(shard, n // lay.ep), 1) if lay.zero else 1)
    return psi * (24 + 3 * g + w) / (cluster.hbm * cluster.kernels.hbm) + 10 * cluster.kernels.launch


def stage(spec, cluster, lay, stack, global_batch: int, seq_len: int, pp_rank: int,
          knobs: Knobs) -> dict:
    """One pipeline rank's step: seconds by part (before the bubble), bytes sent by dimension,
    and its time per micro-batch, which the bubble scales."""
    m = lay.for_batch(global_batch).microbatches
    comp = compute(spec, cluster, lay, stack, seq_len, pp_rank, knobs)
    comm = communication(spec, cluster, lay, stack, global_batch, seq_len, pp_rank, comp, knobs)
    recompute = m * comp["layers"] * comp["layer_recompute"]
    parts = {"compute": m * (comp["forward"] + comp["backward"]) + comm["copies"],
             "recompute": recompute,
             **{f"{k}_comm": v for k, v in comm["exposed"].items()},
             "interference": knobs.interference * sum(comm["hidden"].values()),
             "optimizer": optimizer_time(spec, cluster, lay, pp_rank)}
    per_micro = (comp["forward"] + comp["backward"] + comp["layers"] * comp["layer_recompute"]
                 + sum(v for k, v in comm["per_micro"].items() if k in ("tp", "cp", "ep")))
    return {"parts": parts, "sent": comm["sent"], "pp_rank": pp_rank, "busy": m * per_micro,
            "own": sum(parts.values())}
