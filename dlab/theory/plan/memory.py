"""Memory per GPU at any scale: model state (the ZeRO paper's accounting), activations
(Korthikanti et al.'s, tensor by tensor), and communication buffers.

Model state. A rank holds Psi_r parameters: its pipeline stage's layers cut by tp (experts: E/ep
of them per layer, cut by tp as Megatron-Core's default expert tensor parallelism does), plus the
embedding (first stage) and the head (last stage, unless tied and on the same rank), V h / tp
each. Bytes per parameter (w weights, g gradients, K optimizer state):

    precision          w   g   K
    bf16               2   2   12    ZeRO paper (Rajbhandari et al. 2020, sec. 3.1): fp16/bf16
                                     weights and gradients, fp32 master weights, momentum, variance
    bf16-fp32-grads    2   4   12    Megatron-LM: gradients accumulated and reduced in fp32 (a
                                     stack that adds the bf16 ones into them by a pass of its
                                     own keeps those too: 2 + 4, ``Stack.hp_grad_pass``)
    fp32               4   4   8     Adam's two moments, no master copy

ZeRO stage z over the n = dp x cp data ranks (n / ep for expert parameters): stage >= 1 divides K
by n, stage >= 2 also g, stage 3 also w. With Psi_r the whole model and n = N_d this is the
ZeRO paper's (2 + 2 + K) Psi, (2 + 2) Psi + K Psi / N_d, 2 Psi + (2 + K) Psi / N_d and
(2 + 2 + K) Psi / N_d.

Activations. One layer of a micro-batch of b sequences of s tokens (s / cp on a rank), width h,
a heads, g KV heads, MLP width f, saves (16-bit activations, 1-byte dropout masks), with r = t
under sequence parallelism and 1 without:

    norm inputs            2 x 2 s b h / r
    QKV input              2 s b h / r        (the first norm's output)
    Q, K, V                2 s b h / t + 2 x 2 s b h g / (a t)
    attention core         math: softmax 2 a s^2 b / t (+ its dropout mask a s^2 b / t and output
                           2 a s^2 b / t); flash: the log-sum-exp, 4 a s b / t (fp32)
    projection input       2 s b h / t
    MLP input              2 s b h / r
    MLP                    GeLU: its input and output, 2 x 2 s b f / t; SwiGLU: gate, up and
                           their product, 3 x 2 s b f / t
    dropout masks          2 x s b h / r      (after attention and after the MLP)

Under torchtitan's selective op policy a layer keeps instead its input, the Q and V
projections, the attention output, the MLP's first matmul and its output (``op_policy_kept``).
With a = g, f = 4h, GeLU, dropout and the math core this is Korthikanti et al. 2022 (eq. 1-2):
s b h (34 + 5 a s / h) without parallelism, s b h (10 + 24 / t + 5 a s / (h t)) with tensor
parallelism, s b h / t (34 + 5 a s / h) with sequence parallelism too. Selective recomputation
drops the core's s^2 terms (34 s b h / t), full recomputation keeps only the layer's input,
2 s b h / r (2 s b h / t when the layout distributes it over the tp ranks,
``PlanLayout.distribute_saved``). A pipeline's rank holds ``estimate.pipeline.in_flight`` micro-batches of its
layers at once (1F1B's first stage: p of L / p layers, so L layers' worth: their eq. 5), plus
on the first stage the embedding's dropout mask (s b h / r a micro-batch) and on the last the
final norm's and head's inputs (2 x 2 s b h / r) and fp32 logits (4 s b V / t) of one micro-batch.
During a fully recomputed layer's backward, its activations exist again on top.

Buffers: ZeRO-3 gathers two layers' weights at once (the one running and the one prefetched;
under DeepSpeed's prefetch bucket the largest submodule and the bucket ahead, plus its gradient
staging buckets: ``gathered``, ``sharding.Sharding``), a pipeline rank keeps one send and one
receive buffer, and sequence parallelism's all-gather materialises a layer input of s b h
(16-bit) for the QKV and MLP matmuls.

The lab's own GPT (``Transformer.gpt``) is counted by ``dlab.theory.nd`` instead, exactly
(biases, norms, padding and Adam's step counters included), in the fp32 it trains in; the
activations of the lab's MoE by the formulas above (``nd``'s depend on the step's routing).
"""
from __future__ import annotations

import dataclasses
import math

from dlab.core.precision import PRECISIONS
from dlab.theory import nd as nd_estimate
from dlab.theory.memory import paper_memory
from dlab.theory.pipeline import in_flight

#: (weights, gradients, Adam state) bytes per parameter, by precision (``dlab.core.precision``)
BYTES = {name: p.bytes for name, p in PRECISIONS.items()}


def state_bytes(psi: float, n: int, zero: int, precision: str = "bf16") -> dict[str, float]:
    """Model-state bytes of ``psi`` parameters ZeRO-sharded (stage ``zero``) over ``n`` ranks:
    the ZeRO paper's formula (``dlab.theory.memory.paper_memory``) at the precision's bytes."""
    w, g, k = BYTES[precision]
    return paper_memory(psi, n, zero, k=k, weight_bytes=w, grad_bytes=g)


def layers_on(spec, lay, pp_rank: int) -> int:
    """Layers a pipeline rank holds: L / (pp v) per chunk, the remainder spread over the first
    chunks (Megatron requires an even split; Llama 3 took a layer off the first and last)."""
    stages = lay.pp * lay.virtual_stages
    base, extra = divmod(spec.n_layer, stages)
    return sum(base + (1 if pp_rank + k * lay.pp < extra else 0) for k in range(lay.virtual_stages))


def rank_params(spec, lay, pp_rank: int) -> tuple[float, float]:
    """(dense, expert) parameters of a rank at ``pp_rank``."""
    first, last = pp_rank == 0, pp_rank == lay.pp - 1
    layers = layers_on(spec, lay, pp_rank)
    router = spec.d_model * spec.n_expert if spec.n_expert > 1 else 0
    dense = layers * (spec.attention_params() / lay.tp + router)
    dense += spec.embedding_params() / lay.tp * (int(first) + int(last and not (spec.tied and first)))
    experts = layers * spec.n_expert / lay.ep * spec.expert_params() / lay.tp if spec.n_expert > 1 else 0.0
    if spec.n_expert == 1:
        dense += layers * spec.expert_params() / lay.tp
    return dense, experts


def optimizer_shard(spec, lay, pp_rank: int) -> float:
    """Parameters whose optimizer state a rank updates: its dense parameters over the ZeRO
    group (the dp x cp data ranks, ``zero_group`` under hybrid sharding; all of them without
    ZeRO) and its experts over their owners among that group."""
    dense, experts = rank_params(spec, lay, pp_rank)
    if not lay.zero:
        return dense + experts
    n = lay.dp * lay.cp
    shard = lay.zero_group or n
    return dense / shard + experts / max(min(shard, n // lay.ep), 1)


def model_state(spec, lay, pp_rank: int) -> dict[str, float]:
    """Model-state bytes of a rank: ZeRO over the dp x cp data ranks, or over groups of
    ``zero_group`` of them under hybrid sharding."""
    n = lay.zero_group or lay.dp * lay.cp
    dense, experts = rank_params(spec, lay, pp_rank)
    out = state_bytes(dense, n, lay.zero, lay.precision)
    if experts:
        owners = min(n, lay.dp * lay.cp // lay.ep)
        for key, v in state_bytes(experts, max(owners, 1), lay.zero, lay.precision).items():
            out[key] += v
    return out


def layer_activation_terms(spec, lay, micro_batch: int, seq_len: int) -> dict[str, float]:
    """Bytes one layer saves for one micro-batch on one rank, by tensor (module docstring),
    before recomputation."""
    b, s, h, f, a = micro_batch, seq_len // lay.cp, spec.d_model, spec.d_ff, spec.n_head
    t = lay.tp
    r = t if lay.sequence_parallel else 1
    e = 4 if lay.precision == "fp32" else 2
    kv_shards = min(t, spec.n_kv_head)  # more tp ranks than KV heads replicate them
    terms = {"norm inputs": 2 * e * s * b * h / r, "qkv input": e * s * b * h / r,
             "q": e * s * b * h / t, "k, v": 2 * e * s * b * spec.kv_width / kv_shards,
             "projection input": e * s * b * h / t, "mlp input": e * s * b * h / r}
    if lay.attention == "math":
        terms["softmax"] = e * a * s * s * b / t
        if spec.dropout:
            terms["softmax dropout"] = (1 + e) * a * s * s * b / t
    else:
        terms["log-sum-exp"] = 4 * a * s * b / t
    mlp_tensors = 3 if spec.mlp == "swiglu" else 2
    terms["mlp"] = mlp_tensors * e * s * b * f / t * (spec.top_k if spec.n_expert > 1 else 1)
    if spec.dropout:
        terms["dropout masks"] = 2 * s * b * h / r
    return terms


def op_policy_kept(spec, lay, micro_batch: int, seq_len: int) -> float:
    """Bytes a layer keeps under torchtitan's selective op policy (its activation_checkpoint.py:
    the outputs of every matmul but each second one, of the fused attention, and the block's
    input; every other op recomputed): the input, Q's and V's projections (the first and
    third of Q, K, V), the attention output and its log-sum-exp, the MLP's first matmul
    (w1; w3, the second, is recomputed) and its output (w2)."""
    b, s, h, f = micro_batch, seq_len // lay.cp, spec.d_model, spec.d_ff
    t = lay.tp
    r = t if lay.sequence_parallel else 1
    e = 4 if lay.precision == "fp32" else 2
    kv = spec.kv_width / min(t, spec.n_kv_head)
    experts = spec.top_k if spec.n_expert > 1 else 1
    saved = 2 * h / r + h / t + kv + h / t + experts * f / t
    return e * s * b * saved + 4 * spec.n_head * s * b / t


def layer_bytes(spec, lay, micro_batch: int, seq_len: int, stack=None) -> tuple[float, float]:
    """(what a layer keeps for backward under the layout's recomputation, what its backward
    holds again on top); under selective recomputation ``stack``'s policy decides
    (``Stack.selective``: Megatron's drops the attention core, torchtitan's op policy keeps
    ``op_policy_kept``)."""
    terms = layer_activation_terms(spec, lay, micro_batch, seq_len)
    whole = sum(terms.values())
    if lay.recompute == "selective" and stack is not None and stack.selective == "half-mm":
        kept = op_policy_kept(spec, lay, micro_batch, seq_len)
        return kept, whole - kept
    if lay.recompute == "full":
        kept = terms["norm inputs"] / 2
        if lay.distribute_saved and not lay.sequence_parallel:  # the input cut over the tp ranks
            kept /= lay.tp
        return kept, whole - kept
    if lay.recompute == "selective":
        core = ("softmax", "softmax dropout", "log-sum-exp")
        dropped = sum(v for k, v in terms.items() if k in core)
        return whole - dropped, dropped
    return whole, 0.0


def activations(spec, lay, global_batch: int, seq_len: int, pp_rank: int, stack=None) -> float:
    """Peak activation bytes on a rank at ``pp_rank`` (module docstring)."""
    if spec.gpt is not None and not hasattr(spec.gpt, "n_expert"):  # a MoE's needs its routing
        cfg = dataclasses.replace(spec.gpt, seq_len=seq_len, recompute=lay.recompute)
        return nd_estimate.activations(cfg, lay.for_batch(global_batch), global_batch, pp_rank)["peak"]
    b, m = lay.micro_batch, lay.for_batch(global_batch).microbatches
    s, h, t = seq_len // lay.cp, spec.d_model, lay.tp
    r = t if lay.sequence_parallel else 1
    e = 4 if lay.precision == "fp32" else 2
    kept, transient = layer_bytes(spec, lay, b, seq_len, stack)
    if lay.recompute_every > 1:  # one layer in k recomputed whole, the others keep everything
        share = spec.recomputed_share(lay.recompute, lay.recompute_every)
        kept = share * kept + (1 - share) * (kept + transient)
    held = in_flight(lay.schedule, lay.pp, m, pp_rank, lay.virtual_stages) if lay.pp > 1 else 1
    per_micro = layers_on(spec, lay, pp_rank) * kept
    if pp_rank == 0 and spec.dropout:
        per_micro += s * b * h / r
    out = held * per_micro
    if pp_rank == lay.pp - 1:
        out += 2 * e * s * b * h / r + 4 * s * b * spec.vocab / t
    return out + transient


def gathered(spec, lay, sharding) -> float:
    """Parameters a ZeRO-3 rank holds gathered at once: two layers' (the running one and the
    one prefetched: FSDP's), or under a stack that gathers submodules with a prefetch bucket
    (DeepSpeed's stage3_prefetch_bucket_size) the largest submodule and the bucket ahead of it,
    never more than two layers'."""
    layer = spec.layer_params() / lay.tp
    if not sharding.prefetch:
        return 2 * layer
    modules: dict[str, float] = {}
    for name, n in spec.layer_tensors(lay.tp):
        modules[name] = modules.get(name, 0.0) + n
    return min(2 * layer, max(modules.values()) + sharding.prefetch)


def buffers(spec, lay, seq_len: int, stack=None) -> float:
    """Communication buffers (module docstring), 16-bit; ZeRO-3's gathered weights and its
    gradient staging as ``stack`` holds them (``sharding.Sharding``)."""
    b, s, h, t = lay.micro_batch, seq_len // lay.cp, spec.d_model, lay.tp
    e = 4 if lay.precision == "fp32" else 2
    out = 0.0
    if lay.zero == 3 and lay.dp * lay.cp > 1:
        sharding = stack.sharding if stack is not None else None
        if sharding is None:
            out += 2 * e * spec.layer_params() / t
        else:
            out += e * gathered(spec, lay, sharding) + BYTES[lay.precision][1] * sharding.staging
    if lay.pp > 1:
        out += 2 * e * s * b * h / (t if lay.sequence_parallel else 1)
    if lay.sequence_parallel and t > 1:
        out += e * s * b * h
    return out


def memory(spec, lay, global_batch: int, seq_len: int, stack=None) -> dict[str, float]:
    """Bytes per GPU by category on the fullest pipeline rank (the first or the last: the
    first holds the most micro-batches, the last the head and the logits); ``stack``: the
    software stack, whose sharding decides ZeRO-3's buffers (``buffers``)."""
    best = None
    for pp_rank in sorted({0, lay.pp - 1}):
        if spec.gpt is not None:
            cfg = dataclasses.replace(spec.gpt, seq_len=seq_len, recompute=lay.recompute)
            state = nd_estimate.model_state(cfg, lay.for_batch(global_batch), pp_rank, "adam")
        else:
            state = model_state(spec, lay, pp_rank)
            w, g, _ = BYTES[lay.precision]
            if stack is not None and stack.hp_grad_pass and g > w:
                # the 16-bit gradients autograd writes stay beside the fp32 ones the optimizer
                # adds them into (Stack.hp_grad_pass: DeepSpeed's BF16_Optimizer)
                state["gradients"] += w * sum(rank_params(spec, lay, pp_rank))
        out = {**state, "activations": activations(spec, lay, global_batch, seq_len, pp_rank, stack),
               "buffers": 0.0 if spec.gpt is not None else buffers(spec, lay, seq_len, stack)}
        out["total"] = math.fsum(out.values())
        out["pp_rank"] = pp_rank
        if best is None or out["total"] > best["total"]:
            best = out
    return best
