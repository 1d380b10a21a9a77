"""Tensor and sequence parallelism on paper: bytes moved per layer and activation memory.

Bytes (per rank, per step, sent; ring-algorithm wire bytes as ``dlab.comm.instrumented`` counts
them). With ``A = b s h`` activation elements of one layer's hidden state on a rank's
data-parallel slice (b sequences of s tokens, hidden size h) and t the tensor-parallel degree:

    tensor parallel      per layer  4 all-reduces of A   (f and g, forward and backward, for
                                                           attention and for the MLP)
                                    = 4 * 2 (t-1)/t * A
    + sequence parallel  per layer  per sub-layer: all-gather + reduce-scatter forward,
                                    reduce-scatter + all-gather backward, and one more all-gather
                                    backward to rebuild the input for the weight gradient
                                    (Korthikanti et al. 2022, sec. 4.2.2)
                                    = 10 * (t-1)/t * A

An all-reduce costs what a reduce-scatter plus an all-gather cost, so sequence parallelism moves
the same bytes as tensor parallelism for the same work (8 (t-1)/t A) and only the re-gather is
extra. Outside the layers: the embedding's sum over vocabulary shards, the head's input
gradient, the vocabulary-parallel loss (an all-reduce of N and one of 2N numbers, N = b s), the
gradients of whole-on-every-rank parameters under sequence parallelism, and the data-parallel
gradient all-reduce.

Activation memory per layer (Korthikanti et al. 2022, eq. 1-4), in bytes, for their setting
(16-bit activations, dropout after attention and MLP, softmax materialised, a heads):

    no parallelism              s b h (34 + 5 a s / h)
    tensor parallel             s b h (10 + 24/t + 5 a s / (h t))
    tensor + sequence parallel  s b h (34/t + 5 a s / (h t))

dlab's GPT keeps fp32 activations, has no dropout and uses a fused attention kernel that keeps
no s x s matrix, so ``activation_bytes`` counts its saved tensors the same way, term by term;
the tests check it against ``ActivationMeter``.
"""
from __future__ import annotations

from dlab.models.gpt import GPTConfig

FP32 = 4


def _config(model_options: dict | GPTConfig) -> GPTConfig:
    return model_options if isinstance(model_options, GPTConfig) else GPTConfig(**model_options)


def block_params(cfg: GPTConfig, tp: int) -> int:
    """Parameters of one transformer block held by one tensor-parallel rank: two layer norms,
    q/k/v column-parallel, proj row-parallel (bias whole), the MLP's fc and proj likewise."""
    d, f, t = cfg.d_model, cfg.d_ff, tp
    return 2 * 2 * d + 3 * (d * d // t + d // t) + (d * d // t + d) + (f // t * d + f // t) + (
        f // t * d + d)


def embedding_params(cfg: GPTConfig, tp: int) -> int:
    """The token embedding's vocabulary shard and the whole position embedding."""
    return cfg.vocab_size // tp * cfg.d_model + cfg.seq_len * cfg.d_model


def head_params(cfg: GPTConfig, tp: int, tied_in_embedding: bool = True) -> int:
    """The final layer norm and the output projection's vocabulary shard, unless the matrix is
    tied and already counted with the embedding (``tied_in_embedding``; a pipeline's last stage
    holds its own copy)."""
    own = not cfg.tied or not tied_in_embedding
    return 2 * cfg.d_model + (cfg.vocab_size // tp * cfg.d_model if own else 0)


def local_params(cfg: GPTConfig, tp: int) -> int:
    """Parameters held by one tensor-parallel rank."""
    return embedding_params(cfg, tp) + cfg.n_layer * block_params(cfg, tp) + head_params(cfg, tp)


def sequence_parallel_params(cfg: GPTConfig) -> int:
    """Parameters whole on every rank whose gradients are partial under sequence parallelism:
    two layer norms and two row-parallel biases per layer, the final norm, the positions."""
    d = cfg.d_model
    return cfg.n_layer * (4 * d + 2 * d) + 2 * d + cfg.seq_len * d


def layer_bytes(model_options: dict | GPTConfig, batch: int, tp: int,
                sequence_parallel: bool, element_size: int = FP32) -> float:
    """Bytes one rank sends per transformer layer per step (forward + backward); ``batch`` is
    the sequences this tensor-parallel group works on (its data-parallel slice);
    ``element_size`` 2 for bf16 activations."""
    cfg = _config(model_options)
    a = batch * cfg.seq_len * cfg.d_model * element_size
    if sequence_parallel:
        return 10 * (tp - 1) / tp * a
    return 4 * 2 * (tp - 1) / tp * a


def step_bytes(model_options: dict | GPTConfig, global_batch: int, tp: int, dp: int,
               sequence_parallel: bool) -> dict[str, float]:
    """Bytes one rank sends in a step, by where they go, and their ``total``."""
    cfg = _config(model_options)
    b = global_batch // dp
    a = b * cfg.seq_len * cfg.d_model * FP32
    ar, half = 2 * (tp - 1) / tp, (tp - 1) / tp
    tokens = b * cfg.seq_len
    out = {"layers": cfg.n_layer * layer_bytes(cfg, b, tp, sequence_parallel),
           # the embedding: g (all-reduce) forward, or reduce-scatter forward + all-gather back
           "embedding": 2 * half * a if sequence_parallel else ar * a,
           # the head's input: f's all-reduce backward, or all-gather forward + re-gather and
           # reduce-scatter backward
           "head": 3 * half * a if sequence_parallel else ar * a,
           "loss": ar * tokens * FP32 + ar * 2 * tokens * FP32,
           "sequence_parallel_grads": ar * sequence_parallel_params(cfg) * FP32
           if sequence_parallel else 0.0,
           "data_parallel_grads": 2 * (dp - 1) / dp * local_params(cfg, tp) * FP32}
    out["total"] = sum(out.values())
    return out


def korthikanti_layer_bytes(model_options: dict | GPTConfig, batch: int, tp: int,
                            sequence_parallel: bool) -> float:
    """Activation bytes per layer per rank in Korthikanti et al.'s setting (eq. 2-4)."""
    cfg = _config(model_options)
    s, b, h, a, t = cfg.seq_len, batch, cfg.d_model, cfg.n_head, tp
    attention_scores = 5 * a * s / (h * t)
    if sequence_parallel:
        return s * b * h * (34 / t + attention_scores)
    return s * b * h * (10 + 24 / t + attention_scores)


def activation_bytes(model_options: dict | GPTConfig, batch: int, tp: int,
                     sequence_parallel: bool) -> dict[str, float]:
    """Bytes dlab's GPT saves for backward on one tensor-parallel rank, counted the way
    Korthikanti et al. count (each saved tensor once), for fp32, no dropout, fused attention.

    Per layer, in elements (x4 bytes), with r = t under sequence parallelism and 1 without:

    - whole-width tensors: the inputs of both layer norms and of the q/k/v and fc linears
      (their outputs), 4 s b h / r; with sequence parallelism the linears keep the local shard
      and gather again in backward, so these too are 1/t.
    - inside the tensor-parallel regions, always 1/t: q, k, v and the attention output (which is
      also proj's input, the same storage), 4 s b h / t; GeLU's input and output (fc's output,
      proj's input), 8 s b h / t.
    - small: each layer norm's mean and 1/std, 2 s b / r each; attention's log-sum-exp
      (a/t heads x s x b), in place of the paper's s x s softmax (5 a s^2 b in its count).

    Outside the layers: token indices (int64) and their out-of-shard mask (bool) for the
    vocabulary-parallel embedding, the positions (int64); the final norm's input and output and
    its statistics; the loss's local softmax (b s V/t) with the target indices and mask.
    """
    cfg = _config(model_options)
    s, b, h, a, t, v = cfg.seq_len, batch, cfg.d_model, cfg.n_head, tp, cfg.vocab_size
    r = t if sequence_parallel else 1
    layer = FP32 * (4 * s * b * h / r + 12 * s * b * h / t + 2 * 2 * s * b / r + a * s * b / t)
    embedding = 8 * b * s + b * s + 8 * s // r
    head = FP32 * (2 * s * b * h / r + 2 * s * b / r)
    loss = FP32 * b * s * v / t + 8 * b * s + b * s
    out = {"per_layer": layer, "layers": cfg.n_layer * layer, "embedding": embedding,
           "head": head, "loss": loss}
    out["total"] = out["layers"] + embedding + head + loss
    return out
