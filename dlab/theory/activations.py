"""Activation memory of dlab's GPT, tensor by tensor, with and without recomputation.

"Activations" are the tensors autograd saves for backward (``dlab.core.metrics.ActivationMeter``
measures them from their storages, each once). This module counts them from the model's code,
naming each saved tensor, independently of the meter; the tests hold the two equal to the byte.

Symbols (``notebooks/NOTATION.md``): b sequences of s tokens, width h, a heads, MLP width f
(4h by default), vocabulary V, L layers; t tensor-parallel ranks, r = t with sequence
parallelism and 1 without, n context-parallel ranks, each holding c = s/n tokens. fp32: 4 bytes
an element.

One layer (``Block``) saves, in elements:

    ln1.input       c b h / r    LayerNorm keeps its input ...
    ln1.stats       2 c b / r    ... and each row's mean and 1/std
    qkv.input       c b h / r    q, k and v share one input (ln1's output); under sequence
                                 parallelism they keep the local shard and gather it again
    q, k, v         3 c b h / t  the core's inputs (the linears' outputs, heads a/t per rank)
    core.out        c b h / t    the core's output, which proj keeps as its input: the fused
                                 kernel lays it out so the reshape is a view, one storage
    core.lse        a c b / t    the fused kernel's log-sum-exp per row (its only extra)
    ln2.input, ln2.stats, fc.input   as for ln1
    gelu.input      c b f / t    fc's output
    proj.input      c b f / t    GeLU's output

With ``attention_core="math"`` the core keeps the softmax's output instead of the log-sum-exp,
``core.softmax`` = a c^2 b / t; its q, k, v are then the (b a, s, h/a) copies its batched
matmuls make when b > 1 (the same bytes; the linears' outputs are saved by nobody). Under
context parallelism (n > 1) the core is the ring attention whatever ``attention_core`` says;
it saves what the fused kernel saves, at c tokens: q, k, v, its output (laid out as q, so
proj's input is a view of it) and the log-sum-exp. The whole layer is 4 c b h / r + 4 c b h / t + 2 c b f / t
elements plus the small terms: with f = 4h and no parallelism 16 s b h, 64 s b h bytes.

The paper's count (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", sec. 4.1, eq. 1) is s b h (34 + 5 a s / h) bytes for fp16 activations with
dropout and an unfused attention. Term by term, in their fp16 bytes -> dlab's fp32 elements:
norms' inputs 4 sbh -> ln1.input + ln2.input (2 sbh); QKV input 2 sbh -> qkv.input; QK^T's
inputs 4 sbh -> q, k; softmax output 2 a s^2 b -> core.softmax (math core only); its dropout
mask a s^2 b and output 2 a s^2 b -> absent (no dropout); V 2 sbh -> v; projection input 2 sbh
-> core.out; attention dropout mask sbh -> absent; MLP input 2 sbh -> fc.input; GeLU input
8 sbh -> gelu.input; projection input 8 sbh -> proj.input; MLP dropout mask sbh -> absent. So
their 34 sbh = 2 bytes x 16 sbh + 2 one-byte masks, and dlab's 16 sbh elements are 64 sbh bytes
in fp32; their 5 a s^2 b becomes 4 a s^2 b (math core) or nothing s x s at all (fused:
a s b of log-sum-exp). Layer norm statistics are left out of the paper's count (they are
2 s b per norm, small).

Recomputation (``dlab.models.recompute``):

- selective keeps q, k, v (the checkpoint's inputs) and the output (proj's input) and drops
  what the core keeps beyond them: core.lse (fused, ring), core.softmax (math). The paper's
  selective count is 34 s b h / (t or r): their whole 5 a s^2 b term goes.
- full keeps only each recomputed block's input, c b h / r (the paper's 2 s b h bytes in fp16).
  ``recompute_every=k`` recomputes L // k blocks; the others keep everything.

What ``ActivationMeter.peak`` then shows is the end of the forward: what recomputation keeps.
In backward, each recomputed region's activations exist again while its backward runs
(``backward_transient``: one block's, less the input it already holds; or what one core saves
anew: its output and log-sum-exp, or the math core's softmax and copies of q, k, v), then are
freed before the next region's are made.

Outside the layers, for the plain GPT (``tp`` = 1): the token indices (int64, b c) and
positions (int64, c) the embedding lookups keep; the final norm's input, statistics and output
(the head's input); the loss's log-softmax (b c V), its target indices (int64) and its
total weight (one fp32 scalar). The meter counts an index tensor's whole storage: where a
rank's batch is a slice of the global batch, that is the global batch's. For ``tp`` > 1 these
are the vocabulary-parallel embedding and loss (``dlab.theory.tensor``).
"""
from __future__ import annotations

from dlab.models import recompute as rc
from dlab.models.gpt import GPTConfig

FP32, INT64 = 4, 8


def _config(model_options: dict | GPTConfig) -> GPTConfig:
    return model_options if isinstance(model_options, GPTConfig) else GPTConfig(**model_options)


def layer_terms(cfg: GPTConfig, micro_batch: int, tp: int = 1, sp: bool = False, cp: int = 1,
                attention: str = "ring", element: int = FP32) -> dict[str, float]:
    """Bytes of each tensor one layer saves on one rank without recomputation (table above;
    under cp > 1 the core's are ``attention``'s, ``core_terms``), ``element`` bytes an element
    (the compute dtype's: 2 in bf16 and fp16, norms' statistics included); PyTorch's fused
    kernel keeps its log-sum-exp in fp32 whatever the dtype (dlab's ring keeps it in the
    compute dtype)."""
    b, h, f, t = micro_batch, cfg.d_model, cfg.d_ff, tp
    c = cfg.seq_len // cp
    r = t if sp else 1
    whole = c * b * h / r
    terms = {"ln1.input": whole, "ln1.stats": 2 * c * b / r, "qkv.input": whole}
    terms.update(core_terms(cfg, b, tp, cp, attention))
    terms.update({"ln2.input": whole, "ln2.stats": 2 * c * b / r, "fc.input": whole,
                  "gelu.input": c * b * f / t, "proj.input": c * b * f / t})
    kernel_lse = cp == 1 or attention in ("allgather", "ulysses")  # scaled_dot_product_attention's
    return {k: (FP32 if k == "core.lse" and kernel_lse else element) * v for k, v in terms.items()}


#: under cp > 1, what each attention core saves beyond proj's input (``core.out``), in elements
#: of one rank's q (c b h / t, "q"), its heads' log-sum-exp (a c b / t, "lse"), with n = cp
#: ranks of c = s / n tokens; ``dlab.parallel.context.attention`` for the cores themselves
CP_CORES = {
    # q, k, v as they came; its output is proj's input (laid out so the reshape is a view)
    "ring": {"q": "q", "k": "q", "v": "q", "core.lse": "lse"},
    # the local k and v go into a stack that saves nothing; the kernel keeps every rank's K and
    # V (n q each) and the causal mask of c queries by s keys, made per call and kept as fp32
    "allgather": {"q": "q", "core.keys": "n q", "core.values": "n q", "core.mask": "c s",
                  "core.lse": "lse"},
    # q, k, v as the all-to-all made them (h/n heads of all s tokens: the same bytes), an s x s
    # mask, the kernel's output; proj's input is the all-to-all back, a storage of its own
    "ulysses": {"q": "q", "k": "q", "v": "q", "core.mask": "s s", "core.o": "q", "core.lse": "lse"},
    # the same with the ring over the groups, which makes its masks tile by tile and keeps none
    "usp": {"q": "q", "k": "q", "v": "q", "core.o": "q", "core.lse": "lse"},
}
#: what a selectively recomputed core saves anew in its backward: all it saves but the
#: linears' outputs, which the checkpoint keeps as its inputs, and proj's input where that is a
#: storage of its own
CP_REBUILT = {"ring": ("core.out", "core.lse"),
              "allgather": ("core.keys", "core.values", "core.mask", "core.out", "core.lse"),
              "ulysses": ("q", "k", "v", "core.mask", "core.o", "core.lse"),
              "usp": ("q", "k", "v", "core.o", "core.lse")}


def core_terms(cfg: GPTConfig, micro_batch: int, tp: int = 1, cp: int = 1,
               attention: str = "ring") -> dict[str, float]:
    """What the attention core keeps, in elements on one rank: q, k, v, its output (proj's
    input), and the fused kernel's log-sum-exp or the math core's softmax; under cp > 1
    ``CP_CORES[attention]``."""
    b, h, a, t = micro_batch, cfg.d_model, cfg.n_head, tp
    c = cfg.seq_len // cp
    q = c * b * h / t
    out = {"q": q, "k": q, "v": q, "core.out": q}
    if cp == 1:
        if cfg.attention_core == "math":
            return {**out, "core.softmax": a * c * c * b / t}
        return {**out, "core.lse": a * c * b / t}
    if attention not in CP_CORES:
        raise ValueError(f"attention={attention!r} is not one of {sorted(CP_CORES)}")
    unit = {"q": q, "n q": cp * q, "lse": a * c * b / t, "c s": c * cfg.seq_len,
            "s s": cfg.seq_len ** 2}
    return {"core.out": q, **{k: unit[v] for k, v in CP_CORES[attention].items()}}


def _selective(terms: dict[str, float]) -> dict[str, float]:
    """A layer's terms under selective recomputation: the core keeps its inputs (the three
    linears' outputs, each the size of proj's input) and its output, nothing of its own."""
    out = {k: v for k, v in terms.items() if k not in ("q", "k", "v") and not k.startswith("core.")}
    return {**out, "q": terms["core.out"], "k": terms["core.out"], "v": terms["core.out"],
            "core.out": terms["core.out"]}


def _core_rebuilt(cfg: GPTConfig, micro_batch: int, cp: int = 1, attention: str = "ring"
                  ) -> tuple[str, ...]:
    """What a recomputed core saves anew in backward: its output and log-sum-exp (it shares
    q, k, v with the kept inputs); for the math core the softmax and, with more than one
    sequence, its batched matmuls' copies of q, k, v (for one sequence, folding (1, a) into
    one batch dimension is a view of the kept tensors, not a copy); under cp > 1
    ``CP_REBUILT[attention]``."""
    if cp > 1:
        return CP_REBUILT[attention]
    if cfg.attention_core == "math":
        return ("q", "k", "v", "core.softmax") if micro_batch > 1 else ("core.softmax",)
    return ("core.out", "core.lse")


def activation_bytes(model_options: dict | GPTConfig, micro_batch: int, recompute: str | None = None,
                     tp: int = 1, sp: bool = False, cp: int = 1, every: int | None = None,
                     attention: str = "ring", element: int = FP32) -> dict[str, float]:
    """Bytes saved for backward on one rank for one micro-batch of ``micro_batch`` sequences
    (``recompute`` / ``every`` default to the config's; ``element``: bytes of the compute
    dtype). ``per_layer``: a layer that keeps its
    activations (selective already applied); ``recomputed_layer``: one recomputed whole;
    ``layers``: all L of them; ``embedding``, ``head``, ``loss`` and their ``total`` (what is
    held at the end of the forward: ``ActivationMeter.peak`` over a forward);
    ``backward_transient``: what one recomputed region holds again during its backward;
    ``backward_peak``: the most held during backward (``ActivationMeter.peak`` over a backward
    run inside ``track()``); ``terms``: every tensor of a layer without recomputation, by name;
    ``kept_terms``: those a layer that is not recomputed whole keeps (selective drops some)."""
    cfg = _config(model_options)
    recompute = cfg.recompute if recompute is None else recompute
    every = cfg.recompute_every if every is None else every
    if recompute not in rc.RECOMPUTE:
        raise ValueError(f"recompute={recompute!r} is not one of {rc.RECOMPUTE}")
    terms = layer_terms(cfg, micro_batch, tp, sp, cp, attention, element)
    kept_terms = _selective(terms) if recompute == "selective" else terms
    per_layer = sum(kept_terms.values())
    recomputed_layer = terms["ln1.input"]  # the block's input
    whole = rc.recomputed_blocks(cfg.n_layer, recompute, every)
    transient = {"none": 0.0,
                 "selective": sum(terms[k] for k in _core_rebuilt(cfg, micro_batch, cp, attention)),
                 "full": sum(terms.values()) - recomputed_layer}[recompute]
    kept = [recomputed_layer if i in whole else per_layer for i in range(cfg.n_layer)]
    out = {"terms": terms, "kept_terms": kept_terms, "per_layer": per_layer,
           "recomputed_layer": recomputed_layer, "recomputed": len(whole), "layers": sum(kept),
           "backward_transient": transient}
    out.update(_outside(cfg, micro_batch, tp, sp, cp, element))
    out["total"] = out["layers"] + out["embedding"] + out["head"] + out["loss"]
    out["backward_peak"] = backward_peak(recompute, whole, kept, kept_terms, transient, out)
    return out


def backward_peak(recompute, whole, kept, terms, transient, out) -> float:
    """The most saved bytes held at once during backward, where a recomputed region's
    activations are made again: the highest one is rebuilt first, when the head, the loss and
    the layers above it have been freed and everything below is still held. Without
    recomputation backward only frees, so its peak is the forward's end."""
    if recompute == "full" and whole:
        top = max(whole)
        return out["embedding"] + sum(kept[:top]) + kept[top] + transient
    if recompute == "selective":
        before_core = sum(terms[k] for k in ("ln1.input", "ln1.stats", "qkv.input", "q", "k", "v"))
        return out["embedding"] + sum(kept[:-1]) + before_core + transient
    return out["total"]


def _outside(cfg: GPTConfig, b: int, tp: int, sp: bool, cp: int, e: int = FP32) -> dict[str, float]:
    """The embedding's, the head's and the loss's saved tensors (``e`` bytes an element of
    the compute dtype; indices int64 whatever it is, and the loss fp32: mixed precision takes
    the softmax over the vocabulary from fp32 logits, ``nd``'s and the reference's criterion)."""
    c, h, v, t = cfg.seq_len // cp, cfg.d_model, cfg.vocab_size, tp
    if tp == 1:
        return {"embedding": INT64 * (b * c + c),
                "head": e * (2 * c * b * h + 2 * c * b),
                "loss": FP32 * b * c * v + INT64 * b * c + FP32}
    # the tensor-parallel GPT (``dlab.parallel.tensor.model``): token indices and their
    # out-of-shard mask (bool) for the vocabulary-parallel lookup, the positions; the final
    # norm as above, 1/r of the tokens; the loss's local softmax (b s V/t), indices and mask
    r = t if sp else 1
    return {"embedding": INT64 * b * c + b * c + INT64 * c // r,
            "head": e * (2 * c * b * h / r + 2 * c * b / r),
            "loss": FP32 * b * c * v / t + INT64 * b * c + b * c}


def split_block_backward(terms: dict[str, float], recompute: str, transient: float
                         ) -> tuple[float, float]:
    """One block's backward when its linears defer their weight gradients (the zero-bubble
    schedules, ``dlab.parallel.pipeline.weight_grad``): (the most bytes held above the level at
    its start, the level's change by its end), with ``terms`` what the block keeps at the end
    of its forward, by name. Node by node from the top, each frees what
    autograd saved for it, then the split linear below holds its output's gradient until W
    (it holds its input too, but autograd saved that already: one storage): the block's output
    gradient for proj (c b h), fc's output gradient (c b f), after ln2's backward the gradient
    of x + attn for the attention's proj (c b h), after the core's backward the gradients of
    q, k and v. W then holds the four linears' inputs (qkv.input, core.out, fc.input,
    proj.input) and these five gradients: every term but the norms' inputs and statistics, the
    GeLU's input and what the core keeps, whose places the gradients take. A block recomputed
    whole is rebuilt first (its ``transient``); a selectively recomputed core just before its
    backward."""
    residual = terms["ln1.input"]  # a gradient of the residual stream has its size
    kept_qkv = sum(terms.get(k, 0.0) for k in ("q", "k", "v"))  # the core's, if it keeps them
    grads = 3 * terms["core.out"]  # the q, k and v linears' output gradients
    core_own = sum(v for k, v in terms.items() if k.startswith("core.") and k != "core.out")
    selective = transient if recompute == "selective" else 0.0
    deltas = [transient if recompute == "full" else 0.0,
              residual,                                              # proj holds dy
              -terms["gelu.input"], terms["gelu.input"],             # GeLU frees; fc holds dy
              -terms["ln2.input"] - terms["ln2.stats"], residual,    # ln2 frees; attn.proj holds
              selective, -kept_qkv - (selective or core_own), grads,  # the core frees; q, k, v hold
              -terms["ln1.input"] - terms["ln1.stats"]]
    level = peak = 0.0
    for d in deltas:
        level += d
        peak = max(peak, level)
    return peak, level


def moe_mlp_bytes(cfg, micro_batch: int, tp: int, sp: bool, cp: int, element: int,
                  assigned: int, rows: int) -> float:
    """What a MoE layer's MLP part saves on one rank under expert parallelism
    (``dlab.parallel.expert.dispatch``), for one forward in which the rank routed ``assigned``
    (token, expert) pairs and its experts received ``rows`` rows; in place of the dense
    MLP's GeLU and proj inputs (the router keeps ln2's output as fc did). Counted per storage
    (T tokens on the rank, k, E, width h, MLP width f, e bytes an element): the router's
    softmax T E e, the top-k indices 8 T k and the kept mask T k; the routed pairs' token and
    sort indices 16 A, their weights A e, the answers back A h e and the weighted answers
    A h e; each received row's index 8, its input h e, GeLU's input and output 2 f e and its
    expert's output h e."""
    tokens = cfg.seq_len // cp * micro_batch // (tp if sp else 1)
    h, f, k, e = cfg.d_model, cfg.d_ff, cfg.top_k, element
    return (tokens * cfg.n_expert * e + 9 * tokens * k + 16 * assigned
            + assigned * e * (1 + 2 * h) + rows * (INT64 + e * (2 * h + 2 * f)))
