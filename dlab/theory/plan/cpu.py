"""Step time on the lab's CPU ("this machine", ``Cluster.cores``): measured rates, measured
collectives, nothing overlapped.

Compute, per micro-batch on a rank's layers (b sequences, s / cp of its tokens): the matmuls,
2 FLOPs per parameter a token multiplies by (forward; backward twice that), at the rate one
thread measured for the lab's GPT (``dlab.tools.calibrate.compute``) plus its fixed cost per
layer; attention's scores and values, 4 h s per token over the keys it sees, half of them under
the causal mask, or ring attention by its tiles (zigzag gives every rank 2 cp + 1 a layer, each
at the measured fixed cost and cost per element); the layer's element-wise work as bytes at the
machine's memory bandwidth. Full recomputation runs each layer's forward again in backward,
selective the attention core's.

Communication: nothing hides (the cores that would compute are the ones that move the bytes),
and a collective costs what ``calibrate.collective_probe`` measured for its op and group
(``Cluster.calls``; the fitted link's ring time for a group it did not measure), counted call by
call (``collective_calls``, the counts of ``nd``'s code): Gloo's hand-offs between processes,
not the bytes, dominate, about a millisecond a call.

With more ranks than cores (``Cluster.oversubscribed``) a rank's time is not its own: the cores
run whichever ranks are ready, so what is conserved is CPU time. Each rank's CPU seconds per
step are its compute at one thread's measured rate, its optimizer, and its collectives at the
CPU seconds the probe measured a call to burn with ranks outnumbering the cores. The step is
the ranks' CPU seconds shared out over the cores, at the share of their time the ranks fill
(``Cluster.utilization``, measured by the same probe): sum / (cores x utilization). A
pipeline's bubble is filled by the other stages' ranks, so it costs nothing there unless one
rank's own chain (its work and the schedule's bubble on it) is longer still: a rank runs on
one core at most.

Optimizer: ``dlab.theory.plan.time.optimizer_time``, the GPU's, at this machine's measured
bandwidth.
"""
from __future__ import annotations

from dlab.theory.comm import ring_allreduce_time, ring_gather_time
from dlab.theory.plan.memory import BYTES, layers_on, rank_params


def stage_compute(spec, cluster, lay, seq_len: int, pp_rank: int) -> dict[str, float]:
    """Seconds of forward, backward and recomputation of one micro-batch on ``pp_rank``, on a
    core of its own (a GPU, or a CPU rank's one thread)."""
    b, s, h, f = lay.micro_batch, seq_len // lay.cp, spec.d_model, spec.d_ff
    t, r = lay.tp, (lay.tp if lay.sequence_parallel else 1)
    e = 4 if lay.precision == "fp32" else 2
    layers = layers_on(spec, lay, pp_rank)
    peak = cluster.peak
    mm_flops = layers * 2 * b * s * spec.active_layer_params() / t
    if pp_rank == lay.pp - 1:
        mm_flops += 2 * b * s * spec.embedding_params() / t  # the head
    attn_flops = layers * 4 * b * s * seq_len * h / t / 2  # causal: half the keys on average
    elementwise = 8 * s * b * h / r + 12 * s * b * h / r  # two norms, two residual adds
    experts = spec.top_k if spec.n_expert > 1 else 1
    elementwise += (6 if spec.mlp == "swiglu" else 4) * s * b * f / t * experts
    if spec.dropout:
        elementwise += 3 * 5 * s * b * h / r
    core = 0.0  # the attention core's own element-wise work: a math core's softmax and dropout
    if lay.attention == "math":
        core = (4 + (5 if spec.dropout else 0)) * spec.n_head * s * seq_len * b / t
    to_seconds = layers * e / 2 / cluster.hbm  # counted in 16-bit elements above
    ew, core_ew = (elementwise + core) * to_seconds, core * to_seconds
    mm = mm_flops / (peak * cluster.matmul_efficiency)
    attn = attn_flops / (peak * cluster.attention_efficiency)
    if lay.cp > 1 and cluster.ring_tile:
        # the CPU lab's ring attention: zigzag gives every rank 2 cp + 1 visible tiles a layer
        # (its 2 chunks against the 2 cp chunks at or before them), each b x heads x k rows of
        # the head width, k = s / 2 cp; a tile's forward is a third of its cost, as for FLOPs
        fixed, per_element = cluster.ring_tile
        k = seq_len // (2 * lay.cp)
        tile = fixed + per_element * b * spec.n_head / t * k * (h // spec.n_head)
        attn = layers * (2 * lay.cp + 1) * tile / 3
    overhead = layers * cluster.layer_overhead
    forward = mm + attn + ew + overhead / 3
    backward = 2 * (mm + attn + ew) + 2 * overhead / 3
    # selective recomputation runs the attention core's forward again: its matmuls and, for a
    # math core, the softmax and dropout over the s x s scores (Korthikanti et al. 2022, sec. 5)
    recompute = {"full": forward, "selective": attn + core_ew}.get(lay.recompute, 0.0)
    return {"forward": forward, "backward": backward, "recompute": recompute,
            "attention_forward": attn / layers if layers else 0.0, "layers": layers}


def comm_times(spec, cluster, lay, global_batch: int, seq_len: int, pp_rank: int,
               comp: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """(exposed seconds, bytes sent) per step of each dimension's communication on
    ``pp_rank``; bytes under the ring model (an all-reduce sends 2 (n-1)/n of its buffer)."""
    m = lay.for_batch(global_batch).microbatches
    b, s, h = lay.micro_batch, seq_len // lay.cp, spec.d_model
    e = 4 if lay.precision == "fp32" else 2
    layers, t = comp["layers"], lay.tp
    out = dict.fromkeys(("tp", "cp", "ep", "pp", "data"), 0.0)
    sent = dict(out)
    act = e * b * s * h
    boundary = act / (t if lay.sequence_parallel else 1)  # what a pipeline stage hands its neighbour
    kv = 2 * e * b * s * spec.kv_width / min(t, spec.n_kv_head)
    if t > 1:
        calls = m * layers * (4 + (2 if lay.recompute == "full" else 0))
        sent["tp"] = calls * 2 * (t - 1) / t * act
        out["tp"] = calls * ring_allreduce_time(act, t, cluster.link(lay.span("tp")))
    if lay.cp > 1:
        link = cluster.link(lay.span("cp"))
        passes = (lay.cp - 1) * (1 + 2 + (1 if lay.recompute != "none" else 0))
        sent["cp"] = m * layers * passes * kv
        out["cp"] = m * layers * passes * (kv / link.bandwidth + link.alpha)
    if spec.n_expert > 1 and lay.ep > 1:
        link = cluster.link(lay.span("ep"))
        calls = m * layers * (4 + (2 if lay.recompute == "full" else 0))
        per = act * spec.top_k * (lay.ep - 1) / lay.ep
        sent["ep"] = calls * per
        out["ep"] = calls * (per / link.bandwidth + (lay.ep - 1) * link.alpha)
    if lay.pp > 1:
        link = cluster.link(lay.span("pp"))
        sent["pp"] = 2 * lay.virtual_stages * m * boundary
        out["pp"] = 2 * lay.virtual_stages * m * (boundary / link.bandwidth + link.alpha)
    n = lay.dp * lay.cp
    if n > 1:
        out["data"], sent["data"] = _data_exposed(spec, cluster, lay, pp_rank, m, n)
    if cluster.calls:  # the CPU machine: what its collectives cost, measured
        g = BYTES[lay.precision][1]
        grads = g * sum(rank_params(spec, lay, pp_rank))
        tied = g * spec.embedding_params() / t if spec.tied else 0.0
        calls = collective_calls(lay, m, layers, pp_rank, act, kv, grads, boundary, tied)
        calls["pp"] = calls.get("pp", []) + calls.pop("tied", [])  # one matrix on two stages
        for dim, ops in calls.items():
            each = [cluster.call_cost(op, group, payload) for op, group, _, payload in ops]
            if None not in each:  # else the link's time: the probe did not measure that group
                out[dim] = sum(count * sec for (_, _, count, _), sec in zip(ops, each))
    return out, sent


def collective_calls(lay, m: int, layers: int, pp_rank: int, act: float, kv: float,
                     grads: float, boundary: float = 0.0, tied: float = 0.0) -> dict[str, list[tuple]]:
    """The blocking collectives of a step on a rank, per dimension: (op, group size, calls,
    payload bytes of each: a micro-batch's activation ``act`` for tensor parallelism, its K and
    V ``kv`` for a ring pass, the rank's gradients ``grads`` cut into units for ZeRO). The
    counts are those of ``nd``'s code: tensor parallelism's two all-reduces per layer each way
    (an all-gather and a reduce-scatter apiece under sequence parallelism, and the forward's
    again under full recomputation), with the vocabulary-parallel embedding on the first stage
    and the head and loss on the last (1 and 3 calls per micro-batch; 6 and 9 under sequence
    parallelism, which gathers and scatters around them, and one all-reduce a step of the
weights it leaves whole: norms, biases); ring attention's 3 (c-1) + 1 passes
    per layer (c - 1 more when the core is recomputed); ZeRO's reduce-scatter and all-gather
    per unit (a stage's layers and its embedding or head), ZeRO-3's gathers for every
    micro-batch, or one flat all-reduce without ZeRO; a pipeline's transfers of ``boundary``
    bytes, a forward activation and a backward gradient each way per micro-batch and stage
    boundary (counted as send-and-receive pairs, charged as a ring pass over 2), and with
    ``tied`` bytes of a tied embedding, its gradient's all-reduce between the first and last
    stage ("tied", once a step)."""
    first, last = pp_rank == 0, pp_rank == lay.pp - 1
    out = {}
    t, c, n = lay.tp, lay.cp, lay.dp * lay.cp
    if t > 1:
        per_layer = 4 + (2 if lay.recompute == "full" else 0)
        edges = (6 * first + 9 * last) if lay.sequence_parallel else (first + 3 * last)
        count = m * (layers * per_layer * (2 if lay.sequence_parallel else 1) + edges)
        out["tp"] = ([("all_gather", t, count / 2, act), ("reduce_scatter", t, count / 2, act),
                      ("all_reduce", t, 1, act)]
                     if lay.sequence_parallel else [("all_reduce", t, count, act)])
    if c > 1:
        passes = m * layers * (3 * (c - 1) + 1 + ((c - 1) if lay.recompute != "none" else 0))
        out["cp"] = [("ring", c, passes, kv)]
    if lay.pp > 1:
        stages = [k * lay.pp + pp_rank for k in range(lay.virtual_stages)]
        ends = sum((s > 0) + (s < lay.pp * lay.virtual_stages - 1) for s in stages)  # neighbours, over chunks
        out["pp"] = [("ring", 2, m * ends, boundary)]
        if tied and (first or last):
            out["tied"] = [("all_reduce", 2, 1, tied)]
    if n > 1:
        units = layers + int(first) + int(last and lay.pp > 1)
        if lay.zero == 0:
            out["data"] = [("all_reduce", n, 1, grads)]
        else:
            gathers = units * (2 * m if lay.zero == 3 else 1)
            reduces = units * (m if lay.zero >= 2 else 1)
            out["data"] = [("all_gather", n, gathers, grads / units),
                           ("reduce_scatter", n, reduces, grads / units)]
    return out


def _data_exposed(spec, cluster, lay, pp_rank, m, n) -> tuple[float, float]:
    """(seconds, bytes sent) of the gradient reduction over the data ranks, all exposed."""
    w, g, _ = BYTES[lay.precision]
    link = cluster.link(lay.span("data"))
    dense, experts = rank_params(spec, lay, pp_rank)
    groups = [(dense, n)] + ([(experts, n // lay.ep)] if experts and n // lay.ep > 1 else [])
    exposed = sent = 0.0
    for psi, k in groups:
        ring = (k - 1) / k
        if lay.zero == 0:
            exposed += ring_allreduce_time(g * psi, k, link)
            sent += 2 * ring * g * psi
        else:
            gathers, reduces = (2 * m if lay.zero == 3 else 1), (m if lay.zero >= 2 else 1)
            # the link's time where the probe has no figure: one reduction, every gather
            exposed += ring_gather_time(g * psi, k, link) + ring_gather_time(w * psi, k, link) * gathers
            sent += ring * psi * (g * reduces + w * gathers)
    return exposed, sent
