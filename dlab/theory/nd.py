"""An N-D layout on paper: the model state each rank of ``nd`` holds and the bytes it sends.

A rank is (pipeline rank, data rank, cp rank, tp rank). What it holds depends on its pipeline
rank (which blocks, whether it has the embedding or the head) and on the layout's degrees; the
data, cp and tp coordinates only pick *which* equal share. With n = dp x cp data ranks, the
rank's parameters form units (one per block of its stages, a root for the rest; the experts of
a MoE layer a unit of their own over the n / ep ranks holding the same experts), each padded to
a multiple of its group (``memory.padded``). Per element, with w and g the bytes of a weight and
of a gradient and K the optimizer's bytes (``dlab.core.precision``: fp32 w = g = 4, K = 4 for SGD
with momentum, 8 for Adam; bf16 w = g = 2 and bf16-fp32-grads w = 2, g = 4, each with K grown by
the 4-byte fp32 master: 8 for SGD, 12 for Adam; Adam adds one 4-byte step counter per tensor):

    ZeRO   parameters          gradients                      optimizer
    0      w sum u             g sum u                        K sum u
    1      w sum pad(u)        g (sum pad(u) + sum pad(u)/n)  K sum pad(u)/n
    2      w sum pad(u)        g sum pad(u)/n                 K sum pad(u)/n
    3      w sum pad(u)/n      g sum pad(u)/n                 K sum pad(u)/n

Stage 1 keeps its whole flat gradient between steps *and* the reduced shard the optimizer
reads (``nd.sharding``). A block's parameters on a tensor-parallel rank are
``tensor.block_params`` (a MoE block: attention's shard, the two norms, the router and E/ep
whole experts); the embedding's and head's shards are ``tensor.embedding_params`` and
``tensor.head_params`` (the last stage keeps its own copy of a tied matrix unless it also holds
the embedding).

Bytes sent per step, under ``dlab.comm.instrumented``'s ring model, with b = B/dp sequences of
T/cp tokens on the rank and A = b (T/cp) h x 4 bytes: tensor parallelism
``tensor.layer_bytes`` per block on those tokens, plus the embedding's, head's and loss's terms
on the first and last stage and, under sequence parallelism, the replicated parameters'
gradients; context parallelism ``context.sent_per_step``'s K/V terms for the rank's heads
(h/t wide); the pipeline one activation per micro-batch to the next stage and one gradient to
the previous (A / t each under sequence parallelism, which sends only the rank's slice); the
tied matrix's gradient between the first and last stage; the data reduction: an all-reduce
(ZeRO 0) or a reduce-scatter of every unit plus one all-gather (stages 1-2) or 2m all-gathers
of every block and one of the root (stage 3: before each micro-batch's forward and backward).
Every term is linear in the batch, so the micro-batches change only stage 3's gathers.
Recomputation runs a region's forward collectives again in its backward: a block recomputed
whole adds its four tensor-parallel forward collectives, 4 (t-1)/t A (all-reduces, or the
all-gathers and reduce-scatters of sequence parallelism), and every recomputed attention core
(full or selective) its forward K/V exchange, (cp-1) kv. ZeRO-3 gathers nothing again: the
block's parameters are already gathered for its backward when the recomputation runs.

Activations (``activations``): one micro-batch of b = B / (dp m) sequences leaves on a rank
F = its layers' saved bytes (``estimate.activations`` at tp, sp, cp; a block that ``recompute``
recomputes whole keeps only its input) plus the embedding's on the first stage and the head's
and loss's on the last. The schedule holds ``estimate.pipeline.in_flight`` micro-batches at
once, and the backward that runs at that moment may rebuild a recomputed region on top, so the
peak is (k - 1) F + max(F, that micro-batch's backward peak) with k in flight; with more than
one stage on a rank (interleaved) each stage has its own F, and the peak is found by walking
the rank's action list. The zero-bubble schedules' B leaves, until W, what the deferred
weight gradients hold (``activations.split_block_backward``); each attention core's saved
tensors are ``activations.layer_terms``'. A MoE layer's MLP saves what each forward's routing
made it (``activations.moe_mlp_bytes``), so its F differs from micro-batch to micro-batch and
the estimate reads the routing the step recorded, as ``expert_bytes`` does.
"""
from __future__ import annotations

import dataclasses

import torch

from dlab.core.precision import PRECISIONS
from dlab.layout import schedules
from dlab.layout.layout import Layout
from dlab.layout.stages import partition
from dlab.models import MODELS
from dlab.models import recompute as rc
from dlab.theory import activations as act
from dlab.theory import context, expert, tensor
from dlab.theory.memory import padded

FP32 = 4


def _stages(cfg, lay: Layout, pp_rank: int) -> tuple[list[range], list[int], int]:
    """(block ranges of all stages, this pipeline rank's stage indices, number of stages),
    blocks dealt out by parameter count as ``nd`` deals them (``split.partition``, with the
    embedding's and the head's counts loading the first and last stage)."""
    sched = schedules.build(lay.schedule, lay.pp, lay.microbatches, lay.virtual_stages)
    d, v, s = cfg.d_model, cfg.vocab_size, cfg.seq_len
    block = _block_params(cfg, 1)
    ranges = partition([float(block)] * cfg.n_layer, sched.n_stages, float(v * d + s * d),
                       float(2 * d + v * d))
    return ranges, sched.stages_of(pp_rank), sched.n_stages


def _block_params(cfg, tp: int) -> int:
    if not hasattr(cfg, "n_expert"):
        return tensor.block_params(cfg, tp)
    d, t = cfg.d_model, tp
    attention = 2 * 2 * d + 3 * (d * d // t + d // t) + (d * d // t + d)
    return attention + d * cfg.n_expert  # + the router; the experts are a unit of their own


def _expert_params(cfg, ep: int) -> int:
    return cfg.n_expert // ep * cfg.mlp_params()


def units(cfg, lay: Layout, pp_rank: int) -> tuple[list[int], list[int]]:
    """(dense units, expert units) of the ranks at pipeline rank ``pp_rank``: root first."""
    ranges, mine, n = _stages(cfg, lay, pp_rank)
    first, last = 0 in mine, n - 1 in mine
    root = (tensor.embedding_params(cfg, lay.tp) if first else 0) + (
        tensor.head_params(cfg, lay.tp, tied_in_embedding=first) if last else 0)
    blocks = [_block_params(cfg, lay.tp) for s in mine for _ in ranges[s]]
    experts = ([_expert_params(cfg, lay.ep)] * len(blocks) if hasattr(cfg, "n_expert") else [])
    return ([root] if root else []) + blocks, experts


def _state(sizes: list[int], n: int, zero: int, w: int, g: int, k: int, counters: int
           ) -> dict[str, int]:
    full = sum(padded(u, n) for u in sizes) if zero else sum(sizes)
    chunk = full // n if zero else full
    return {"parameters": w * (chunk if zero == 3 else full),
            "gradients": g * ({0: full, 1: full + chunk}.get(zero, chunk)),
            "optimizer": k * chunk + counters}


def model_state(cfg, lay: Layout, pp_rank: int, optimizer: str = "sgd", precision: str = "fp32"
                ) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state a rank at ``pp_rank`` holds after a
    step in ``precision`` (a name of ``dlab.core.precision.PRECISIONS``). Adam keeps a 4-byte
    step counter per tensor it steps: with ZeRO one per flat unit, without it one per
    parameter tensor (``tensor_counts``); mixed precision's fp32 masters are stepped in the
    same units, so the counters do not change."""
    dense, experts = units(cfg, lay, pp_rank)
    prec = PRECISIONS[precision]
    # Adam's K is the precision's; SGD keeps one momentum (4 bytes) where Adam keeps two
    k = prec.adam_bytes if optimizer == "adam" else prec.adam_bytes - 4
    n = lay.dp * lay.cp
    tensors = tensor_counts(cfg, lay, pp_rank) if optimizer == "adam" and not lay.zero else (0, 0)
    out = {}
    for sizes, group, count in ((dense, n, tensors[0]), (experts, n // lay.ep, tensors[1])):
        if not sizes:
            continue
        counters = 4 * (len(sizes) if lay.zero else count) if optimizer == "adam" else 0
        for key, val in _state(sizes, group, lay.zero, prec.weight_bytes, prec.grad_bytes, k,
                               counters).items():
            out[key] = out.get(key, 0) + val
    return out


def tensor_counts(cfg, lay: Layout, pp_rank: int) -> tuple[int, int]:
    """(dense, expert) parameter tensors of a rank at ``pp_rank``, read off the model's
    structure on the meta device (no memory): its stages' blocks, the embedding on the first
    stage, the head on the last (with its own copy of a tied matrix unless it also holds the
    embedding), and E/ep of each MoE layer's experts. Tensor parallelism cuts tensors, it does
    not add or remove any."""
    ranges, mine, n = _stages(cfg, lay, pp_rank)
    first, last = 0 in mine, n - 1 in mine
    model_cls = next(m for c, m in MODELS.values() if type(cfg) is c)
    with torch.device("meta"):
        model = model_cls(cfg)
    blocks = {f"blocks.{i}." for s in mine for i in ranges[s]}
    dense = experts = 0
    for name, _ in model.named_parameters():
        if name.startswith(tuple(blocks)):
            if ".experts." in name:
                experts += 1
            else:
                dense += 1
        elif (first and name.startswith("embed.")) or (last and name.startswith("head.")):
            dense += 1
    if last and not first and cfg.tied:
        dense += 1  # the last stage's copy of the embedding matrix
    return dense, experts // lay.ep


def step_bytes(cfg, lay: Layout, global_batch: int, pp_rank: int,
               attention: str = "ring", ulysses: int = 1) -> dict[str, float]:
    """Bytes a rank at ``pp_rank`` sends in a step (ring model), by dimension, and ``total``
    (a GPT: a MoE's all-to-all depends on the routing, ``estimate.expert``)."""
    ranges, mine, n_stages = _stages(cfg, lay, pp_rank)
    first, last = 0 in mine, n_stages - 1 in mine
    t, c, m, sp = lay.tp, lay.cp, lay.microbatches, lay.sequence_parallel
    b, tokens = global_batch // lay.dp, cfg.seq_len // c
    local = dataclasses.replace(cfg, seq_len=tokens)  # the rank's share of each sequence
    a = b * tokens * cfg.d_model * FP32
    blocks = sum(len(ranges[s]) for s in mine)
    whole = set(rc.recomputed_blocks(cfg.n_layer, cfg.recompute, cfg.recompute_every))
    rebuilt = sum(1 for s in mine for i in ranges[s] if i in whole)
    cores = blocks if cfg.recompute == "selective" else rebuilt
    out = dict.fromkeys(("tensor", "context", "pipeline", "tied", "data"), 0.0)
    if t > 1:
        tp = tensor.step_bytes(local, b, t, 1, sp)
        out["tensor"] = blocks * tensor.layer_bytes(local, b, t, sp) + rebuilt * 4 * (t - 1) / t * a + (
            tp["embedding"] if first else 0.0) + (tp["head"] + tp["loss"] if last else 0.0)
        if sp:
            out["tensor"] += 2 * (t - 1) / t * FP32 * _replicated(cfg, blocks, first, last)
    if c > 1:
        kv = 2 * b * tokens * (cfg.d_model // t) * FP32
        out["context"] = (blocks * context.layer_bytes(attention, c, kv, ulysses)
                          + cores * context.forward_bytes(attention, c, kv, ulysses))
    boundary = a // (t if sp else 1)
    for s in mine:
        if s + 1 < n_stages and s + 1 not in mine:
            out["pipeline"] += boundary
        if s > 0 and s - 1 not in mine:
            out["pipeline"] += boundary
    if cfg.tied and lay.pp > 1 and (first or last) and not (first and last):
        out["tied"] = cfg.vocab_size // t * cfg.d_model * FP32
    n = lay.dp * c
    dense, _ = units(cfg, lay, pp_rank)
    ring = (n - 1) / n
    if lay.zero == 0:
        out["data"] = 2 * ring * FP32 * sum(dense)
    else:
        root = 1 if (first or last) else 0
        for i, u in enumerate(dense):
            gathers = 1 if lay.zero < 3 or i < root else 2 * m
            out["data"] += ring * FP32 * padded(u, n) * (1 + gathers)
    out["total"] = sum(out.values())
    return out


def expert_bytes(cfg, lay: Layout, pp_rank: int, sent: int, received: int, bytes_per: int = FP32
                 ) -> int:
    """Bytes a rank at ``pp_rank`` sends over its expert-parallel group in a step, given the
    rows the step's routing actually sent to and received from other ranks (``sent``,
    ``received``, summed over its MoE layers and micro-batches, as ``nd`` records them in
    ``expert_rows``): ``estimate.expert.all_to_all_bytes`` per call, one call per MoE layer of
    its stages and micro-batch, again for a block recomputed whole (its forward runs twice);
    rows of ``bytes_per``-byte elements (the compute dtype)."""
    ranges, mine, _ = _stages(cfg, lay, pp_rank)
    whole = set(rc.recomputed_blocks(cfg.n_layer, cfg.recompute, cfg.recompute_every))
    calls = lay.microbatches * sum(1 + (i in whole) for s in mine for i in ranges[s])
    # the counts' all-to-all is paid per call, the rows once over all of them
    return (calls - 1) * (lay.ep - 1) * 8 + expert.all_to_all_bytes(
        lay.ep, cfg.d_model, sent, received, bytes_per)


def _replicated(cfg, blocks: int, first: bool, last: bool) -> int:
    """Parameters whole on every tensor-parallel rank of these stages (two norms and two
    row-parallel biases per block, the positions on the first stage, the final norm on the
    last): under sequence parallelism their gradients are summed over tp."""
    d = cfg.d_model
    return blocks * 6 * d + (cfg.seq_len * d if first else 0) + (2 * d if last else 0)


def activations(cfg, lay: Layout, global_batch: int, pp_rank: int, precision: str = "fp32",
                routing: list[list] | None = None) -> dict[str, float]:
    """Bytes of activations a rank at ``pp_rank`` holds: ``micro_batch`` (F above, summed
    over the rank's stages) and ``peak`` (what ``ActivationMeter`` measures over a step),
    walking the schedule's action list with each stage's own F (and, in a zero-bubble
    schedule, each stage's W: what its deferred weight gradients hold from B to W), under cp
    with the layout's attention core, in ``precision``'s compute dtype. A MoE's MLP saves what
    the routing of each forward made (``activations.moe_mlp_bytes``): ``routing`` is the step's
    ``expert_rows["calls"]`` as ``nd`` records them, per block the (assignments, rows) of each
    forward of its layer, in the order the rank ran them."""
    moe = hasattr(cfg, "n_expert")
    sched = schedules.build(lay.schedule, lay.pp, lay.microbatches, lay.virtual_stages)
    if moe:
        _moe_problems(cfg, lay, sched, routing)
    ranges, mine, n_stages = _stages(cfg, lay, pp_rank)
    b = global_batch // (lay.dp * lay.microbatches)
    e = PRECISIONS[precision].compute.itemsize
    one = act.activation_bytes(cfg, b, tp=lay.tp, sp=lay.sequence_parallel, cp=lay.cp,
                               attention=lay.cp_attention, element=e)
    whole = set(rc.recomputed_blocks(cfg.n_layer, cfg.recompute, cfg.recompute_every))
    held, back, deferred = {}, {}, {}  # per stage: a micro-batch's bytes after its forward;
    # its backward's peak; what its W holds (zero-bubble schedules)
    dense_mlp = one["terms"]["gelu.input"] + one["terms"]["proj.input"] if moe else 0.0
    for s in mine:
        kept = [one["recomputed_layer"] if i in whole else one["per_layer"] - dense_mlp
                for i in ranges[s]]
        out = {"embedding": one["embedding"] if s == 0 else 0.0,
               "head": one["head"] if s == n_stages - 1 else 0.0,
               "loss": one["loss"] if s == n_stages - 1 else 0.0}
        held[s] = sum(kept) + sum(out.values())
        if sched.split_backward:
            back[s], deferred[s] = _split_backward(cfg, one, ranges[s], whole, held[s], out)
        else:
            back[s] = act.backward_peak(cfg.recompute, [j for j, i in enumerate(ranges[s]) if i in whole],
                                        kept, one["kept_terms"], one["backward_transient"],
                                        {**out, "total": held[s]})
            deferred[s] = 0.0
    now = peak = 0.0
    added, forwards = {}, dict.fromkeys(mine, 0)
    for a in sched.actions[pp_rank]:
        if a.kind == "forward":
            extra = sum(act.moe_mlp_bytes(cfg, b, lay.tp, lay.sequence_parallel, lay.cp, e,
                                          *routing[i][forwards[a.stage]])
                        for i in ranges[a.stage]) if moe else 0.0
            forwards[a.stage] += 1
            added[a.stage, a.mb] = held[a.stage] + extra
            now += added[a.stage, a.mb]
            peak = max(peak, now)
        elif a.kind == "backward":
            # the backward's peak stands above what it found as its stage's F does (a MoE's
            # routed part only frees)
            peak = max(peak, now + back[a.stage] - held[a.stage])
            now += deferred[a.stage] - added.pop((a.stage, a.mb))
        elif a.kind == "weight_grad":
            now -= deferred[a.stage]
    return {"micro_batch": sum(held.values()), "peak": peak}


def _moe_problems(cfg, lay: Layout, sched, routing) -> None:
    """What the MoE count does not cover, refused with what to change."""
    if routing is None:
        raise ValueError("a mixture of experts' saved tensors depend on the rows each forward "
                         "routed: pass routing= the step's expert_rows['calls']")
    unmodelled = [name for name, on in (
        ("ep=1 (the experts on every rank, MoE.combine)", lay.ep == 1),
        (f"the {lay.schedule} schedule's split expert linears", sched.split_backward),
        (f"recompute={cfg.recompute!r}", cfg.recompute != "none"),
        ("the balancing losses", bool(cfg.aux_loss or cfg.z_loss))) if on]
    if unmodelled:
        raise ValueError(f"a MoE's activations are counted under expert parallelism without "
                         f"recomputation, split backward or balancing losses; not with "
                         f"{', '.join(unmodelled)}: read the measured memory.activations")


def _split_backward(cfg, one: dict, blocks: range, whole: set, held: float, out: dict
                    ) -> tuple[float, float]:
    """A stage's B when its weight gradients wait for W: (its peak, what W then holds). The
    head and the loss free first, then each block from the top (``split_block_backward``),
    then the embedding."""
    level = peak = held - out["head"] - out["loss"]
    for i in reversed(blocks):
        recompute = "full" if i in whole else ("selective" if cfg.recompute == "selective" else "none")
        transient = one["backward_transient"] if recompute != "none" else 0.0
        terms = one["terms"] if recompute == "full" else one["kept_terms"]
        up, change = act.split_block_backward(terms, recompute, transient)
        peak = max(peak, level + up)
        level += change
    return max(peak, held), level - out["embedding"]
