"""The data ranks' collectives as each software stack issues them: the gradient reduction of
ZeRO 0-2 (one all-reduce or reduce-scatter behind the last backward, per bucket), ZeRO-1/2's
weight gather after the step, and ZeRO-3's weight gathers and gradient reductions per
micro-batch (``sharded``), each collective at its group's size and placement
(``dlab.theory.plan.collectives``), with the host's work to issue it (``Stack.sharding``: its
granularity, operations per tensor and per rank, whether the host waits for the device first)
and the compute window it may hide behind. ``dlab.theory.plan.time`` charges what each window
leaves exposed; its module docstring states the model.
"""
from __future__ import annotations

import math

from dlab.theory.plan.collectives import bus_bytes, collective_time
from dlab.theory.plan.memory import BYTES, rank_params


def data(spec, cluster, lay, stack, pp_rank, m, comp, shares, add, sent) -> float:
    """The data ranks' reductions and gathers (module docstring) of ``m`` micro-batches on
    ``pp_rank``: each charged through ``add(seconds, window, share, count)``, which books what
    the window leaves exposed and what it hides (``dlab.theory.plan.time.communication``), their
    bytes into ``sent``; ``shares`` the overlap shares of the gradient reductions and the weight
    gathers. Returns the seconds of copying buffers."""
    w, g, _ = BYTES[lay.precision]
    t, n = lay.tp, lay.dp * lay.cp
    shard = lay.zero_group or n
    dense, experts = rank_params(spec, lay, pp_rank)
    layers = max(comp["layers"], 1)
    groups = [(dense, shard, n // shard, t, True)]
    if experts:  # the experts' owners: n / ep ranks, ep apart
        k = n // lay.ep
        groups.append((experts, min(shard, k), k // min(shard, k), t * lay.ep, False))
    grads, params = shares
    f_micro, b_micro = comp["forward"], comp["backward"] + comp["layer_recompute"] * layers
    copies = 0.0

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
            moved = sharded(spec, cluster, lay, stack, m, comp, place, psi, layers, dense_group,
                             (grads, params), add, sent)
            copies += moved / (cluster.hbm * cluster.kernels.hbm) if stack.copies else 0.0
    return copies


def sharded(spec, cluster, lay, stack, m, comp, place, psi, layers, dense_group, shares, add,
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
    on_device = sh.rank_kernels * k * cluster.kernels.launch  # each rank's piece copied, in or out

    def gather_time(msgs, early=None):
        """Device seconds of ``msgs`` (those ``early`` marks True, where given)."""
        keep = [True] * len(msgs) if early is None else early
        return sum(_gather(place, p) + on_device for (p, _), y in zip(msgs, keep) if y)

    def host_time(msgs):
        return sum(_host(cluster, sh, c, k) for _, c in msgs)

    again = (spec.recomputed_share(lay.recompute, lay.recompute_every)
             if sh.recompute_gathers and lay.recompute == "full" else 0.0)
    # a gather no prefetch starts early (``Sharding.live``) waits whole, forward and backward
    ahead = prefetched(gathers, sh.live)
    ahead_back = prefetched(gathers[::-1], sh.live)[::-1]
    ag, ag_host = gather_time(gathers, ahead), host_time(gathers)
    ag_late = gather_time(gathers, [not y for y in ahead])
    # backward's gathers: (device seconds prefetched, not prefetched, host seconds, layers)
    backward = _backward_gathers(stack, gathers, layers, again)
    back = []
    for idx, count in backward:
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
        # a reduce-scatter from a list copies each rank's piece into its flat buffer first
        rs = sum(_reduce(place, p) + on_device for p, _ in reductions)
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
                + sum(sum(gathers[i][0] for i in idx) * count for idx, count in backward))
    sent["data"] += m * (bus_bytes(reduce_op, g * psi, k) + bus_bytes("all_reduce", g * psi / k, replicas)
                         + bus_bytes("all_gather", w * gathered, k))
    return m * 2 * (w * gathered + g * psi)


def prefetched(gathers, live: float) -> list[bool]:
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
