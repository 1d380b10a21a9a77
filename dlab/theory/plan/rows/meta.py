"""Rows of Meta's own stacks: Llama 3 405B on H100s (Dubey et al. 2024) and OPT-175B as
metaseq trained it on A100s (Zhang et al. 2022)."""
from __future__ import annotations

from dlab.theory.plan.layout import PlanLayout
from dlab.theory.plan.rows.megatron import _other_v
from dlab.theory.plan.rows.record import Published, Source
from dlab.theory.plan.spec import PRESETS, Transformer

LLAMA3 = Source("llama3", "Dubey et al. 2024, The Llama 3 Herd of Models (arXiv 2407.21783), table 4",
                "Llama 3 (Dubey et al. 2024)")
OPT = Source("opt", "Zhang et al. 2022, OPT: Open Pre-trained Transformer Language Models (arXiv "
             "2205.01068), sec. 2.4 ('up to 147 TFLOP/s per GPU' on 992 A100 80GB); its settings "
             "from facebookresearch/metaseq: metaseq/launcher/opt_job_constants.py and "
             "opt_baselines.py, its FLOPs count from projects/OPT/chronicles/final_update.md "
             "(4.30E+23 FLOPs for 300B tokens)", "OPT-175B (Zhang et al. 2022)")


def _llama3(dp, cp, seq, batch_per_dp, tflops) -> Published:
    """Llama 3 405B on H100s (table 4: tp 8, pp 16, bf16, "TFLOPs/GPU"): interleaved 1F1B
    (sec. 3.3.2) over 16 stages of 8 layers (one fewer on the first and last: its balanced
    pipeline); its FSDP shards optimizer state and gradients and gathers the weights once
    (zero=2 here); context parallelism by all-gathering K and V (sec. 3.3.2). The chunks per
    stage are not stated: v = 4 (a chunk of two layers), the middle of the 2 to 8 a stage of 8
    layers allows, each of which widens the range."""
    lay = PlanLayout(dp=dp, tp=8, pp=16, cp=cp, zero=2, sequence_parallel=True,
                     schedule="interleaved", virtual_stages=4, micro_batch=1, precision="bf16",
                     cp_attention="allgather")
    return Published(LLAMA3, PRESETS["llama3-405b"], "h100-sxm", lay, dp * batch_per_dp, seq,
                     "tflops_per_gpu", tflops, "llama3-meta", "model",
                     "v = 4 and micro-batch 1 (not stated); the paper's FLOPs count is not given: "
                     "6N + 12 L h s assumed", alternatives=_other_v(16, 4)[1:])



def _opt() -> Published:
    """OPT-175B as metaseq ran it: tp 8 over 992 GPUs (dp 124), a batch of 2M tokens split as
    metaseq's launcher does (2,097,152 // 124 // 2048 = 8 sequences a data rank, 992 in all),
    FSDP without resharding after forward (--no-reshard-after-forward: zero=2), full
    recomputation with each layer's saved input cut over the tp ranks
    (--distribute-checkpointed-activations), fp16, tied embeddings, ReLU (two MLP matrices),
    dropout 0.1, separate Q, K and V projections with biases (fairseq's)."""
    spec = Transformer("OPT-175B", 96, 12288, 96, 4 * 12288, 50272, tied=True, dropout=True,
                       split_qkv=True)
    lay = PlanLayout(dp=124, tp=8, zero=2, micro_batch=8, recompute="full", precision="bf16",
                     attention="math", distribute_saved=True)
    return Published(OPT, spec, "a100-80gb", lay, 992, 2048, "tflops_per_gpu", 147, "metaseq",
                     "megatron",
                     "'up to' 147: the best step; Azure's A100 nodes as DGX A100s (8 x 200 Gb/s)")



LLAMA3_ROWS = [
    _llama3(64, 1, 8192, 32, 430),
    _llama3(128, 1, 8192, 16, 400),
    _llama3(8, 16, 131072, 16, 380),  # dp = 16,384 / (8 tp x 16 cp x 16 pp), 16M tokens a batch
]

OPT_ROWS = [
    _opt(),
]
