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
  (Megatron-Core's --tp-comm-overlap pipelines them with the GEMMs beside them); plus one on
  the embedding and two at the head, exposed;
- cp, a ring: (cp-1) passes of the rank's K and V forward, twice that backward (dK and dV come
  back), their window the attention core; an all-gather (Llama 3's): an all-gather of K and V
  forward, another and a reduce-scatter of their gradients backward;
- ep: the dispatch and combine all-to-alls, forward and backward;
- pp: a send of the boundary activation forward and of its gradient backward per micro-batch
  and model chunk, their window the micro-batch's compute; a stage waits for two transfers a
  micro-batch where each send is paired with the receive it waits on, four where sends and
  receives are separate blocking steps (``Stack.pp_transfers``);
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
import math
from dataclasses import dataclass

from dlab.core.precision import PRECISIONS
from dlab.theory.pipeline import bubble, simulated_bubble
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
        charge("tp", one, comp["matmul_forward"], share, m * layers)
        if column > share:  # the column-parallel layers' collectives behind their own GEMMs
            row = 2 * collective_time(cluster, "all_gather", act, t) if lay.sequence_parallel else 0.0
            charge("tp", row, comp["matmul_backward"], share, m * layers)
            charge("tp", back - row, comp["column_backward"], column, m * layers)
        else:
            charge("tp", back, comp["matmul_backward"], share, m * layers)
        again = spec.recomputed_share(lay.recompute, lay.recompute_every) if lay.recompute == "full" else 0.0
        calls = 2 + again
        charge("tp", one, comp["matmul_forward"], share, m * layers * again)
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
        boundary = act / (t if lay.sequence_parallel else 1)
        hop = collective_time(cluster, "p2p", boundary, 2, t * cp * lay.dp)
        sends = 2 * lay.virtual_stages * m
        window = (comp["forward"] + comp["backward"]) / lay.virtual_stages
        waits = sends * stack.pp_transfers / 2  # transfers the stage waits for (Stack.pp_transfers)
        charge("pp", hop, window, _share(stack, knobs, "pp"), waits, micro=False)
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
    groups = [(dense, shard, n // shard, t, True)]
    if experts:  # the experts' owners: n / ep ranks, ep apart
        k = n // lay.ep
        groups.append((experts, min(shard, k), k // min(shard, k), t * lay.ep, False))
    grads, params = _share(stack, knobs, "grads"), _share(stack, knobs, "params")
    f_micro, b_micro = comp["forward"], comp["backward"] + comp["layer_recompute"] * layers
    copies = 0.0

    def add(comm, window, share, count=1):
        shown = exposed(comm, window, share)
        out["data"] += count * shown
        hidden["data"] += count * (comm - shown)

    sh = stack.sharding
    for psi, k, replicas, stride, dense_group in groups:
        if k * replicas <= 1:
            continue
        # the collectives' units: buckets of ``stack.bucket`` parameters (Megatron's at least
        # 1M per data rank), or one per layer (FSDP, DeepSpeed): each pays its own latency
        bucket = max(stack.bucket, sh.bucket_per_rank * n) if stack.bucket else psi / layers
        units = max(1, math.ceil(psi / bucket))
        per = psi / units
        zero1 = sh.zero1_reduce if lay.zero in (1, 2) else "reduce_scatter"
        reduce_op = "all_reduce" if lay.zero == 0 or zero1 == "all_reduce" else "reduce_scatter"
        place = (cluster, k, replicas, stride, w, g, reduce_op)
        host = _host(cluster, sh, 1, k)
        rs, ag = _reduce(place, per) + host, _gather(place, per) + host
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
            moved = _sharded(spec, cluster, lay, stack, m, comp, place, psi, layers, dense_group,
                             (grads, params), add, sent)
            copies += moved / (cluster.hbm * cluster.kernels.hbm) if stack.copies else 0.0
    return copies


def _sharded(spec, cluster, lay, stack, m, comp, place, psi, layers, dense_group, shares, add,
             sent) -> float:
    """ZeRO-3 (module docstring), as the stack issues it (``Stack.sharding``): per micro-batch
    each layer's weights gathered ahead of its forward, again ahead of a recomputed forward
    where the stack's module hooks fire on recomputation (``Sharding.recompute_gathers``), and
    ahead of its backward (``_backward_gathers``); its gradients reduced behind its backward. The
    collectives are those ``_messages`` lists, each paying its latency at the group's size, the
    device's copies of each rank's piece (``Sharding.rank_kernels``) and the host's work to
    issue it. A layer's gathers hide behind the layer before (its forward or backward: the
    window, shorter as the tokens a rank holds fall) at the stack's share, the first layer's
    gathers and the last reduction behind nothing. A stack that waits for the device before
    each gather (``Sharding.blocking``) shows its host work whole and hides only the gather it
    prefetched behind the compute it launches next, its backward's gathers and reductions
    sharing that window (the wait for the device is a wait for both); elsewhere the host runs
    ahead and shows only where a layer's host work outlasts its compute. Returns the bytes
    copied in and out of the collectives' buffers."""
    cluster, k, replicas, _, w, g, reduce_op = place
    sh = stack.sharding
    grads, params = shares
    f_layer, b_layer = comp["layer_forward"], comp["layer_backward"] + comp["layer_recompute"]
    per_layer = psi / layers
    gathers = _messages(spec, lay, sh, "gather", per_layer) if dense_group else [(per_layer, 1)]
    on_device = sh.rank_kernels * k * cluster.kernels.launch  # each rank's piece copied

    def gather_time(msgs, prefetched=None):
        """Device seconds of ``msgs`` (those ``prefetched`` marks True, where given)."""
        keep = [True] * len(msgs) if prefetched is None else prefetched
        return sum(_gather(place, p) + on_device for (p, _), y in zip(msgs, keep) if y)

    def host_time(msgs):
        return sum(_host(cluster, sh, c, k) for _, c in msgs)

    again = (spec.recomputed_share(lay.recompute, lay.recompute_every)
             if sh.recompute_gathers and lay.recompute == "full" else 0.0)
    # a gather no prefetch starts early (``Sharding.live``) waits whole, forward and backward
    ahead = _prefetched(gathers, sh.live)
    ahead_back = _prefetched(gathers[::-1], sh.live)[::-1]
    ag, ag_host = gather_time(gathers, ahead), host_time(gathers)
    ag_late = gather_time(gathers, [not y for y in ahead])
    # backward's gathers: (device seconds prefetched, not prefetched, host seconds, layers)
    back = []
    for idx, count in _backward_gathers(stack, gathers, layers, again):
        msgs = [gathers[i] for i in idx]
        back.append((gather_time(msgs, [ahead_back[i] for i in idx]),
                     gather_time(msgs, [not ahead_back[i] for i in idx]), host_time(msgs), count))
    if sh.reduce == "bucket" and stack.bucket:  # buckets that span layers, each behind its share
        units = max(1, math.ceil(psi / max(stack.bucket, sh.bucket_per_rank * lay.dp * lay.cp)))
        tensors = len(spec.layer_tensors(lay.tp)) * layers / units
        rs = _reduce(place, psi / units)
        rs_host = units * _host(cluster, sh, tensors, k) / layers
        rs_units, rs_window = units, (comp["backward"] + comp["layer_recompute"] * layers) / units
    else:
        reductions = _messages(spec, lay, sh, "reduce", per_layer) if dense_group else [(per_layer, 1)]
        rs = sum(_reduce(place, p) for p, _ in reductions)
        rs_host = sum(_host(cluster, sh, c, k) for _, c in reductions)
        rs_units, rs_window = layers, b_layer
    add(ag, 0.0, 0.0, m)  # the first layer of each forward
    add(ag, f_layer, params, m * (layers - 1 + layers * again))
    add(ag_late, 0.0, 0.0, m * layers * (1 + again))
    for _, late, _, count in back:
        add(late, 0.0, 0.0, m * count)
    add(rs, 0.0, 0.0, m)  # the last reduction: no backward left to hide it
    if sh.blocking:  # the host's work whole; backward's gathers share their window with reductions
        add(ag_host, 0.0, 0.0, m * layers * (1 + again))
        shared = 0.0
        for dev, _, host, count in back:
            add(host, 0.0, 0.0, m * count)
            both = min(count, rs_units - 1 - shared)
            add(dev + rs, b_layer, params, m * both)
            add(dev, b_layer, params, m * (count - both))
            shared += both
        add(rs, rs_window, grads, m * (rs_units - 1 - shared))
        add(max(0.0, rs_host - b_layer), 0.0, 0.0, m * layers)
    else:
        for dev, _, _, count in back:
            add(dev, b_layer, params, m * count)
        add(rs, rs_window, grads, m * (rs_units - 1))
        host = (ag_host * layers * (1 + again) + sum(h * c for _, _, h, c in back)) / layers + rs_host
        add(max(0.0, host - f_layer - b_layer), 0.0, 0.0, m * layers)
    if sh.step_rank_ops and dense_group:  # after the step: the kept tensors gathered again
        kept = sum(n < sh.persist for _, n in spec.layer_tensors(lay.tp)) * layers
        add(kept * k * (sh.step_rank_ops * sh.dispatch + cluster.kernels.launch), 0.0, 0.0)
    gathered = (sum(p for p, _ in gathers) * layers * (1 + again)
                + sum(sum(gathers[i][0] for i in idx) * count
                      for idx, count in _backward_gathers(stack, gathers, layers, again)))
    sent["data"] += m * (bus_bytes(reduce_op, g * psi, k) + bus_bytes("all_reduce", g * psi / k, replicas)
                         + bus_bytes("all_gather", w * gathered, k))
    return m * 2 * (w * gathered + g * psi)


def _prefetched(gathers, live: float) -> list[bool]:
    """Whether each of a layer's ``gathers`` (in the order they run) is started ahead of its
    use: DeepSpeed prefetches the next module's weights only while fewer than ``live``
    elements are gathered (stage3_max_live_parameters, 1e9 since 2021), and the module running
    holds its own, so a module as large as that prefetches nothing (the one before each gather
    is the previous in the list, the layer's last for its first)."""
    return [gathers[i - 1][0] < live for i in range(len(gathers))]


def _backward_gathers(stack, gathers, layers: int, again: float) -> list[tuple[list, float]]:
    """(the indices in ``gathers`` of the collectives a layer's backward issues, how many
    layers issue them) per
    micro-batch. Without ``Stack.gather_backward`` none; after a forward, every layer but the
    last (whose weights are still there); after a recomputed forward (``again``: the share of
    layers recomputed), each layer's tensors that were released in between: DeepSpeed keeps a
    tensor whose next use comes within ``Sharding.reuse`` elements of other gathered weights
    (stage3_max_reuse_distance), and between a tensor's recomputed forward and its backward
    come the layer's later tensors twice (their recomputed forward, then their backward)."""
    if not stack.gather_backward:
        return []
    every = list(range(len(gathers)))
    out = [(every, (layers - 1) * (1 - again))] if again < 1 else []
    if again:
        later = [sum(p for p, _ in gathers[i + 1:]) for i in every]
        out.append(([i for i in every if 2 * later[i] >= stack.sharding.reuse], layers * again))
    return [(idx, count) for idx, count in out if idx and count]


def _messages(spec, lay, sh, kind: str, per_layer: float) -> list[tuple[float, int]]:
    """(parameters, tensors) of each collective one layer's weight gathers (``kind`` "gather")
    or gradient reductions ("reduce") issue under the sharding ``sh``: one per parameter tensor
    ("tensor"), per submodule ("module") or one for the layer ("block"), the tensors that stay
    gathered (``Sharding.persist``) left out of the gathers; in the layer's ``per_layer``
    parameters on the rank, shared out as its tensors' sizes are."""
    tensors = spec.layer_tensors(lay.tp)
    scale = per_layer / sum(n for _, n in tensors)
    if kind == "gather":
        tensors = [(name, n) for name, n in tensors if n >= sh.persist]
    unit = sh.gather if kind == "gather" else sh.reduce
    if unit == "tensor":
        return [(n * scale, 1) for _, n in tensors]
    if unit == "module":
        modules: dict[str, tuple[float, int]] = {}
        for name, n in tensors:
            size, count = modules.get(name, (0.0, 0))
            modules[name] = (size + n, count + 1)
        return [(size * scale, count) for size, count in modules.values()]
    return [(sum(n for _, n in tensors) * scale, len(tensors))] if tensors else []


def _host(cluster, sh, tensors: float, ranks: int) -> float:
    """Host seconds to issue one collective carrying ``tensors`` over ``ranks`` (``Sharding``):
    an operation the dispatcher's work and a kernel's launch, a view made for each rank the
    dispatcher's work, each rank's copy its launch."""
    launch = cluster.kernels.launch
    return ((sh.dispatch + launch) * (sh.host_ops + sh.tensor_ops * tensors)
            + (sh.dispatch * sh.rank_ops + launch * sh.rank_kernels) * ranks)


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
