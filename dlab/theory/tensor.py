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
no s x s matrix, so ``activation_bytes`` counts its saved tensors the same way, term by term
(``dlab.theory.activations``, recomputation included); the tests check it against
``ActivationMeter``.
"""
from __future__ import annotations

from dlab.models.gpt import GPTConfig
from dlab.theory import activations

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
                            sequence_parallel: bool, recompute: str = "none") -> float:
    """Activation bytes per layer per rank in Korthikanti et al.'s setting (eq. 2-4, Table 2):
    selective recomputation drops the 5 a s / (h t) term, full keeps the layer's 2 s b h input
    bytes (1/t of them under sequence parallelism, where the input is the local shard)."""
    cfg = _config(model_options)
    s, b, h, a, t = cfg.seq_len, batch, cfg.d_model, cfg.n_head, tp
    if recompute == "full":
        return 2 * s * b * h / (t if sequence_parallel else 1)
    attention_scores = 0 if recompute == "selective" else 5 * a * s / (h * t)
    if sequence_parallel:
        return s * b * h * (34 / t + attention_scores)
    return s * b * h * (10 + 24 / t + attention_scores)


def activation_bytes(model_options: dict | GPTConfig, batch: int, tp: int,
                     sequence_parallel: bool) -> dict[str, float]:
    """Bytes dlab's tensor-parallel GPT saves for backward on one rank, each saved tensor once,
    under the config's recomputation setting: ``dlab.theory.activations``, which names every
    tensor and maps them onto the paper's count. Per layer, in fp32 elements, with r = t under
    sequence parallelism and 1 without: the inputs of both layer norms and of the q/k/v and fc
    linears, 4 s b h / r; inside the tensor-parallel regions q, k, v, the attention output, and
    GeLU's input and output, 12 s b h / t (f = 4h); each norm's statistics 2 s b / r; the fused
    attention's log-sum-exp a s b / t, where the paper has its s x s softmax."""
    return activations.activation_bytes(model_options, batch, tp=tp, sp=sequence_parallel)
