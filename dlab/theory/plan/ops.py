"""A training step's operations on one GPU, one by one: every matmul, the attention core, every
memory-bound operation, each with its shape, FLOPs, bytes and kernels, priced by the device's
roofline (``dlab.theory.plan.kernels``).

One layer, one micro-batch of b sequences, T = b s / cp tokens on the rank (s / cp of each
sequence under context parallelism), width h, a heads (g of them for K and V, h_kv = h g / a
wide), MLP width f (k of E experts under a MoE), tensor parallelism t, r = t for the
operations sequence parallelism splits and 1 without, 16-bit elements (e bytes):

    matmul       forward (m x k) @ (k x n)                  backward: two of the same FLOPs
    qkv          T x h @ h x (h + 2 h_kv) / t               input gradient  m x n @ n x k
    projection   T x h/t @ h/t x h                          weight gradient k x m @ m x n
    mlp in       T x h @ h x f/t   (twice for SwiGLU: gate and up)
    mlp out      T x f/t @ f/t x h
    head         T x h @ h x V/t   (the last pipeline stage)

The attention core: a fused kernel (``attention="flash"``) does 4 b (a/t) (s/cp) (s/2) d FLOPs
forward (the causal half of the keys; FlashAttention skips masked blocks) and 2.5 times that
backward (FlashAttention-2's backward recomputes the scores: five matmuls to the forward's
two, Dao 2023, sec. 3.1.2), over ``s / cp`` keys a call for a ring (one call per ring step)
and s for an all-gather; the 2022 "math" core is two batched matmuls (Q K^T and P V, over
all s keys: no block is skipped) with the softmax and its dropout between them in memory.

Memory-bound operations, in elements per token and passes over them (a read or a write of
the tensor: forward / backward), fused (Megatron's kernels, Transformer Engine,
``torch.compile``) or eager (one PyTorch op, one kernel, one read and write each):

    operation                 elements       fused       eager
    norm (x2)                 h/r            2 / 4       LayerNorm 2 / 4 (one kernel);
                                                         RMSNorm 18 / 32 (in fp32: the cast,
                                                         pow, mean, rsqrt, two multiplies, the
                                                         cast back: torchtitan's and the Llama
                                                         reference's RMSNorm)
    residual add (x2)         h/r            3 / 3       3 / 3
    dropout (x2, GPT-era)     h/r            +0.5 / +0.5 (1-byte mask, fused into the add)
                                                         3.5 / 2.5 (its own kernel)
    activation                f/t (x k)      GeLU 2 / 3, SwiGLU 3 / 5; eager SwiGLU 5 / 9
    rotary embedding          (h + h_kv)/t   2 / 2       10 / 10 (an fp32 complex multiply)
    attention output copy     h/t            none        2 / 2 (the transpose back, contiguous)
    GQA repeat of K and V     (2h + 2h_kv)/t none        1 / 1 (read g heads, write a heads)

and once a micro-batch: the loss over T x V/t fp32 logits (fused: 10 bytes an element forward,
6 backward; eager 20 and 18: the logits cast to fp32 first, as the Llama reference does), the
embedding's gather (2 passes of T x h) and its gradient (a dense V/t x h gradient zeroed and
T x h rows added).

Each operation's seconds: ``kernels.matmul_time`` / ``attention_time`` / ``memory_time``.
"""
from __future__ import annotations

from dataclasses import dataclass

from dlab.theory.plan import kernels as kn


@dataclass(frozen=True)
class Op:
    name: str
    kind: str  # "matmul", "attention" or "memory"
    flops: float = 0.0
    nbytes: float = 0.0
    kernels: float = 1.0
    #: (m, n, k, batch) of a matmul; (keys,) of an attention kernel
    shape: tuple = ()
    backward: bool = False
    #: part of the attention core (what selective recomputation repeats, cp's window)
    core: bool = False

    def seconds(self, cluster, stack, sustained: float = 1.0, elt: int = 2) -> float:
        if self.kind == "matmul":
            m, n, k, batch = self.shape
            return kn.matmul_time(cluster, m, n, k, elt, sustained, batch)
        if self.kind == "attention":
            return kn.attention_time(cluster, stack.attention, self.flops, self.shape[0],
                                     self.backward, sustained, int(self.kernels))
        return kn.memory_time(cluster, self.nbytes, self.kernels)


def _matmul(name: str, m: float, n: float, k: float, batch: float = 1,
            core: bool = False) -> tuple[Op, Op, Op]:
    """A forward GEMM and its backward pair (input and weight gradients)."""
    m, n, k = int(max(m, 1)), int(max(n, 1)), int(max(k, 1))
    flops = 2.0 * m * n * k * batch
    return (Op(name, "matmul", flops, shape=(m, n, k, batch), core=core),
            Op(f"{name} input grad", "matmul", flops, shape=(m, k, n, batch), backward=True,
               core=core),
            Op(f"{name} weight grad", "matmul", flops, shape=(k, n, m, batch), backward=True,
               core=core))


#: (forward passes, backward passes, forward kernels, backward kernels) of each memory-bound
#: operation per element (module docstring)
FUSED = {"norm": (2, 4, 1, 2), "residual": (3, 3, 1, 1), "gelu": (2, 3, 1, 1),
         "swiglu": (3, 5, 1, 1), "rope": (2, 2, 1, 1), "loss": (10, 6, 3, 1)}
EAGER = {"layernorm": (2, 4, 1, 2), "rmsnorm": (18, 32, 7, 12), "residual": (3, 3, 1, 1),
         "dropout": (3.5, 2.5, 2, 1), "gelu": (2, 3, 1, 1), "swiglu": (5, 9, 2, 3),
         "rope": (10, 10, 3, 3), "copy": (2, 2, 1, 1), "repeat": (1, 1, 2, 2), "loss": (20, 18, 6, 4)}


def _memory(name: str, elements: float, passes: tuple, elt: int, count: int = 1,
            core: bool = False) -> tuple[Op, Op]:
    fwd, bwd, kf, kb = passes
    return (Op(name, "memory", nbytes=count * elements * fwd * elt, kernels=count * kf, core=core),
            Op(f"{name} backward", "memory", nbytes=count * elements * bwd * elt,
               kernels=count * kb, backward=True, core=core))


def layer_ops(spec, lay, stack, seq_len: int) -> tuple[list[Op], list[Op]]:
    """(forward ops, backward ops) of one layer for one micro-batch on one rank."""
    b, cp, t = lay.micro_batch, lay.cp, lay.tp
    s = seq_len // cp
    T = b * s
    h, f, a = spec.d_model, spec.d_ff, spec.n_head
    r = t if lay.sequence_parallel else 1
    e = 4 if lay.precision == "fp32" else 2
    kv = spec.kv_width * t // min(t, spec.n_kv_head)  # K and V width over t ranks (replicated past g)
    heads = a // t
    d = h // a
    fwd, bwd = [], []

    def add(pair):
        fwd.append(pair[0])
        bwd.extend(pair[1:])

    add(_matmul("qkv", T, (h + 2 * kv) / t, h))
    add(_matmul("projection", T, h, h / t))
    experts = spec.top_k if spec.n_expert > 1 else 1
    width = f / t
    tokens = T * experts
    if spec.n_expert > 1:  # the E / ep local experts each take T k ep / E of the tokens
        local = spec.n_expert // lay.ep
        tokens, batch = T * experts * lay.ep / spec.n_expert, local
    else:
        batch = 1
    for name in ("mlp gate", "mlp up") if spec.mlp == "swiglu" else ("mlp in",):
        add(_matmul(name, tokens, width, h, batch))
    add(_matmul("mlp out", tokens, h, width, batch))

    if lay.attention == "flash":
        ring = lay.cp_attention in ("ring", "usp") and cp > 1
        keys = seq_len / cp if ring else seq_len
        calls = cp if ring else 1
        flops = 4.0 * b * heads * s * (seq_len / 2) * d
        fwd.append(Op("attention core", "attention", flops, kernels=calls, shape=(keys,), core=True))
        bwd.append(Op("attention core backward", "attention", 2.5 * flops, kernels=calls,
                      shape=(keys,), backward=True, core=True))
    else:  # the 2022 math core: Q K^T, softmax, dropout, P V over all s keys
        scores = b * heads * s * seq_len
        add(_matmul("scores", s, seq_len, d, b * heads, core=True))
        add(_memory("softmax", scores, (2, 3, 1, 1), e, core=True))
        if spec.dropout:
            add(_memory("attention dropout", scores, (2.5, 2.5, 1, 1), e, core=True))
        add(_matmul("values", s, d, seq_len, b * heads, core=True))

    table = FUSED if stack.fused else EAGER
    norm = table["norm"] if stack.fused else table[spec.norm]
    add(_memory("norms", T * h / r, norm, e, 2))
    residual = table["residual"]
    if spec.dropout:  # bias-dropout-add: a 1-byte mask on top when fused, a kernel of its own eager
        residual = ((3.5, 3.5, 1, 1) if stack.fused else
                    tuple(x + y for x, y in zip(residual, EAGER["dropout"])))
    add(_memory("residual adds", T * h / r, residual, e, 2))
    add(_memory("activation", tokens * batch * width, table[spec.mlp], e))
    if spec.rope:
        add(_memory("rotary embedding", T * (h + kv) / t, table["rope"], e))
    if lay.attention == "flash" and not stack.fused:  # eager layout changes around the kernel
        add(_memory("attention output copy", T * h / t, table["copy"], e))
        if spec.n_kv_head < a:  # grouped-query attention: K and V repeated to every head
            add(_memory("GQA repeat", T * (2 * h + 2 * kv) / t, table["repeat"], e))
    return fwd, bwd


def end_ops(spec, lay, stack, seq_len: int, first: bool, last: bool) -> tuple[list[Op], list[Op]]:
    """(forward ops, backward ops) of a micro-batch outside the layers: the embedding on the
    first stage, the final norm, head and loss on the last."""
    b, t = lay.micro_batch, lay.tp
    T = b * seq_len // lay.cp
    h, v = spec.d_model, spec.vocab
    r = t if lay.sequence_parallel else 1
    e = 4 if lay.precision == "fp32" else 2
    fwd, bwd = [], []
    if first:
        fwd.append(Op("embedding", "memory", nbytes=2 * e * T * h / r))
        bwd.append(Op("embedding backward", "memory", nbytes=e * v * h / t + 3 * e * T * h / r,
                      kernels=2, backward=True))
    if last:
        table = FUSED if stack.fused else EAGER
        norm = table["norm"] if stack.fused else table[spec.norm]
        head = _matmul("head", T, v / t, h)
        fwd.append(head[0])
        bwd.extend(head[1:])
        nf, nb = _memory("final norm", T * h / r, norm, e)
        fwd.append(nf)
        bwd.append(nb)
        per_f, per_b, kf, kb = table["loss"]  # bytes an fp32 logit, kernels
        logits = T * v / t
        fwd.append(Op("loss", "memory", nbytes=per_f * logits, kernels=kf))
        bwd.append(Op("loss backward", "memory", nbytes=per_b * logits, kernels=kb, backward=True))
    return fwd, bwd


def recomputed(spec, lay, stack, fwd: list[Op]) -> list[Op]:
    """The forward ops a layer's backward runs again under the layout's recomputation: all of
    them (full), the attention core (selective, Megatron's), or half the matmuls and every
    memory-bound op (selective, torchtitan's op policy)."""
    if lay.recompute == "full":
        return list(fwd)
    if lay.recompute != "selective":
        return []
    if stack.selective == "half-mm":
        mms = [op for op in fwd if op.kind == "matmul"]
        return mms[1::2] + [op for op in fwd if op.kind == "memory"]
    return [op for op in fwd if op.core]
