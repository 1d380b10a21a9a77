"""3D parallelism (data x pipeline x tensor) on paper: what one rank holds and sends per step.

A rank is one tensor-parallel shard (degree t) of one pipeline stage (of p) of one replica (of
d). With b = B/d sequences per replica, A = b s h fp32 activation bytes of the replica's batch
at one layer boundary, and ar = 2(t-1)/t the ring all-reduce factor, the rank of a stage
holding L blocks sends per step (GPipe or 1F1B, one stage per rank):

    tensor parallel   L * 8 (t-1)/t A                (``estimate.tensor.layer_bytes``)
                      + ar A on the first stage       (the embedding's sum over vocab shards)
                      + ar A + 3 ar b s * 4 on the last (the head's input gradient, the loss)
    pipeline          A to the next stage (activations) and A to the previous one (their
                      gradients), summed over the m micro-batches; none past either end
    tied embedding    ar' V/t h * 4, ar' = 1 for the pair of first and last stage
    data parallel     2 (d-1)/d * (this rank's parameters) * 4

Micro-batching does not change the totals: every term is linear in the batch. Parameters per
rank: L blocks' shards, plus the embedding's on the first stage and the head's (with its own
copy of a tied matrix) on the last, as ``estimate.tensor`` counts them.
"""
from __future__ import annotations

from dlab.models.gpt import GPTConfig
from dlab.theory import tensor
from dlab.theory.tensor import FP32, _config


def stage_params(model_options: dict | GPTConfig, tp: int, blocks: int, first: bool,
                 last: bool, p: int) -> int:
    """Parameters held by one tensor-parallel rank of a stage of ``blocks`` blocks."""
    cfg = _config(model_options)
    n = blocks * tensor.block_params(cfg, tp)
    if first:
        n += tensor.embedding_params(cfg, tp)
    if last:
        n += tensor.head_params(cfg, tp, tied_in_embedding=p == 1)
    return n


def step_bytes(model_options: dict | GPTConfig, global_batch: int, dp: int, tp: int, p: int,
               blocks: int, first: bool, last: bool) -> dict[str, float]:
    """Bytes one rank of a stage sends in a step, by where they go, and their ``total``."""
    cfg = _config(model_options)
    b = global_batch // dp
    a = b * cfg.seq_len * cfg.d_model * FP32
    ar = 2 * (tp - 1) / tp
    tied = cfg.tied and p > 1 and (first or last)
    out = {"tensor": blocks * tensor.layer_bytes(cfg, b, tp, False)
           + (ar * a if first else 0.0)
           + (ar * a + 3 * ar * b * cfg.seq_len * FP32 if last else 0.0),
           "pipeline": (a if not last else 0.0) + (a if not first else 0.0),
           "tied": cfg.vocab_size // tp * cfg.d_model * FP32 if tied else 0.0,
           "data_parallel": 2 * (dp - 1) / dp * FP32
           * stage_params(cfg, tp, blocks, first, last, p)}
    out["total"] = sum(out.values())
    return out
