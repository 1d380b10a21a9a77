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


def layer_terms(cfg: GPTConfig, micro_batch: int, tp: int = 1, sp: bool = False, cp: int = 1
                ) -> dict[str, float]:
    """Bytes of each tensor one layer saves on one rank without recomputation (table above)."""
    b, h, f, a, t = micro_batch, cfg.d_model, cfg.d_ff, cfg.n_head, tp
    c = cfg.seq_len // cp
    r = t if sp else 1
    whole, split = c * b * h / r, c * b * h / t
    terms = {"ln1.input": whole, "ln1.stats": 2 * c * b / r, "qkv.input": whole,
             "q": split, "k": split, "v": split, "core.out": split}
    if cp == 1 and cfg.attention_core == "math":
        terms["core.softmax"] = a * c * c * b / t
    else:  # the fused kernel, or context parallelism's ring attention
        terms["core.lse"] = a * c * b / t
    terms.update({"ln2.input": whole, "ln2.stats": 2 * c * b / r, "fc.input": whole,
                  "gelu.input": c * b * f / t, "proj.input": c * b * f / t})
    return {k: FP32 * v for k, v in terms.items()}


def selective_drops(cfg: GPTConfig, cp: int = 1) -> tuple[str, ...]:
    """The terms selective recomputation no longer keeps: the core's own, beyond q, k, v and
    the output (which proj keeps)."""
    return ("core.softmax",) if cp == 1 and cfg.attention_core == "math" else ("core.lse",)


def _core_rebuilt(cfg: GPTConfig, micro_batch: int, cp: int = 1) -> tuple[str, ...]:
    """What a recomputed core saves anew in backward: its output and log-sum-exp (it shares
    q, k, v with the kept inputs); for the math core the softmax and, with more than one
    sequence, its batched matmuls' copies of q, k, v (for one sequence, folding (1, a) into
    one batch dimension is a view of the kept tensors, not a copy)."""
    if cp == 1 and cfg.attention_core == "math":
        return ("q", "k", "v", "core.softmax") if micro_batch > 1 else ("core.softmax",)
    return ("core.out", "core.lse")


def activation_bytes(model_options: dict | GPTConfig, micro_batch: int, recompute: str | None = None,
                     tp: int = 1, sp: bool = False, cp: int = 1, every: int | None = None
                     ) -> dict[str, float]:
    """Bytes saved for backward on one rank for one micro-batch of ``micro_batch`` sequences
    (``recompute`` / ``every`` default to the config's). ``per_layer``: a layer that keeps its
    activations (selective already applied); ``recomputed_layer``: one recomputed whole;
    ``layers``: all L of them; ``embedding``, ``head``, ``loss`` and their ``total`` (what is
    held at the end of the forward: ``ActivationMeter.peak`` over a forward);
    ``backward_transient``: what one recomputed region holds again during its backward;
    ``backward_peak``: the most held during backward (``ActivationMeter.peak`` over a backward
    run inside ``track()``); ``terms``: every tensor of a layer without recomputation, by name."""
    cfg = _config(model_options)
    recompute = cfg.recompute if recompute is None else recompute
    every = cfg.recompute_every if every is None else every
    if recompute not in rc.RECOMPUTE:
        raise ValueError(f"recompute={recompute!r} is not one of {rc.RECOMPUTE}")
    terms = layer_terms(cfg, micro_batch, tp, sp, cp)
    dropped = selective_drops(cfg, cp) if recompute == "selective" else ()
    per_layer = sum(v for k, v in terms.items() if k not in dropped)
    recomputed_layer = terms["ln1.input"]  # the block's input
    whole = rc.recomputed_blocks(cfg.n_layer, recompute, every)
    transient = {"none": 0.0, "selective": sum(terms[k] for k in _core_rebuilt(cfg, micro_batch, cp)),
                 "full": sum(terms.values()) - recomputed_layer}[recompute]
    kept = [recomputed_layer if i in whole else per_layer for i in range(cfg.n_layer)]
    out = {"terms": terms, "per_layer": per_layer, "recomputed_layer": recomputed_layer,
           "recomputed": len(whole), "layers": sum(kept), "backward_transient": transient}
    out.update(_outside(cfg, micro_batch, tp, sp, cp))
    out["total"] = out["layers"] + out["embedding"] + out["head"] + out["loss"]
    out["backward_peak"] = backward_peak(recompute, whole, kept, terms, transient, out)
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


def _outside(cfg: GPTConfig, b: int, tp: int, sp: bool, cp: int) -> dict[str, float]:
    """The embedding's, the head's and the loss's saved tensors."""
    c, h, v, t = cfg.seq_len // cp, cfg.d_model, cfg.vocab_size, tp
    if tp == 1:
        return {"embedding": INT64 * (b * c + c),
                "head": FP32 * (2 * c * b * h + 2 * c * b),
                "loss": FP32 * b * c * v + INT64 * b * c + FP32}
    # the tensor-parallel GPT (``dlab.parallel.tensor.model``): token indices and their
    # out-of-shard mask (bool) for the vocabulary-parallel lookup, the positions; the final
    # norm as above, 1/r of the tokens; the loss's local softmax (b s V/t), indices and mask
    r = t if sp else 1
    return {"embedding": INT64 * b * c + b * c + INT64 * c // r,
            "head": FP32 * (2 * c * b * h / r + 2 * c * b / r),
            "loss": FP32 * b * c * v / t + INT64 * b * c + b * c}
