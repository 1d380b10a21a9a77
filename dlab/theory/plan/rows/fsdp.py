"""Rows of PyTorch FSDP runs: torchtitan's FSDP2 (A100s and H100s), MosaicML's llm-foundry
(FSDP1 on H100s and A100s) and IBM's fms-fsdp (FSDP1, eager and compiled)."""
from __future__ import annotations

from dlab.theory.plan.layout import PlanLayout
from dlab.theory.plan.rows.record import Published, Source
from dlab.theory.plan.spec import PRESETS, Transformer

TITAN = Source("torchtitan", "pytorch/torchtitan: docs/performance.md at 157a12c (2024-04-24), "
               "64 A100s; benchmarks/llama3_h100_202412_torchtitan.md (runs of 2024-12, "
               "committed 2025-06-13), tables 1 and 3", "torchtitan 2024")
TITAN_TP = Source("torchtitan-asynctp", "pytorch/torchtitan: benchmarks/asyncTP_llama3_h100_2025-06_"
                  "torchtitan.md at 8b6770a (runs of 2025-06-14): Llama 3.1 70B on 256 and 8B on 64 "
                  "H100s (Grand Teton, 500 W), FSDP2 x TP 8, torch.compile; its bfloat16 rows, "
                  "vanilla and async tensor parallelism", "torchtitan TP 2025")
FOUNDRY = Source("llm-foundry", "mosaicml/llm-foundry: scripts/train/benchmarking/README.md at "
                 "5e85bd6 (2024-01-06), 'H100 80GB BF16 (Large Scale, >= 128 GPUs)'",
                 "llm-foundry 2024")


FOUNDRY_A100 = Source("llm-foundry-a100", "mosaicml/llm-foundry: scripts/train/benchmarking/"
                      "README.md at 5e85bd6 (2024-01-06), 'A100 80GB with 1600 Gbps node-node "
                      "interconnect (RoCE)' and 'A100 40GB with 1600 Gbps node-node interconnect "
                      "(RoCE)': their rows over more than one node (16 to 128 GPUs)",
                      "llm-foundry A100 2024")
FOUNDRY_H100 = Source("llm-foundry-h100", "mosaicml/llm-foundry: scripts/train/benchmarking/"
                      "README.md at 5e85bd6 (2024-01-06), 'H100 80GB BF16': its rows on 8 to 64 "
                      "GPUs, sequences of 512 to 65,536 tokens", "llm-foundry H100 8-64 GPUs")
FMS = Source("fms-fsdp", "foundation-model-stack/fms-fsdp: README.md, 'Training throughput "
             "benchmarks', at 4ffb9bd (2024-03-21, eager) and at ed74fd5 (2024-05-09, 'updated with "
             "torch.compile'): Llama 2 shapes on 128 A100 80GB (400 Gb/s a node) and 96 H100 "
             "(800 Gb/s a node), PyTorch FSDP1 without model parallelism, its MFU and HFU table "
             "beside", "IBM fms-fsdp 2024")


def _titan(model, gpus, batch, seq, recompute, tps, cluster, stack, every=1, note="") -> Published:
    """torchtitan's FSDP2 (zero=3 over every GPU, gradients reduced in fp32: its
    mixed_precision_reduce default), one micro-batch of the local batch."""
    lay = PlanLayout(dp=gpus, zero=3, micro_batch=batch, recompute=recompute, recompute_every=every,
                     precision="bf16-fp32-grads")
    return Published(TITAN, PRESETS[model], cluster, lay, gpus * batch, seq, "tokens_per_s_per_gpu",
                     tps, stack, assumed=note or "SDPA's flash backend, the selective op policy")


#: MPT shapes (layers, width, heads) of llm-foundry's yamls (scripts/train/yamls/pretrain)
MPT = {"350m": (24, 1024, 16), "760m": (24, 1536, 12), "1b": (24, 2048, 16), "3b": (32, 2560, 20),
       "7b": (32, 4096, 32), "13b": (40, 5120, 40), "30b": (48, 7168, 56), "70b": (80, 8192, 64)}


def _mpt_spec(size) -> Transformer:
    """An MPT of llm-foundry's yamls: GeLU, f = 4h, tied embedding, vocabulary 50368."""
    layers, hidden, heads = MPT[size]
    return Transformer(f"MPT {size}", layers, hidden, heads, 4 * hidden, 50368, tied=True)


#: the MPTs llm-foundry's large-scale sweep ran with ``--attn_impl triton``, the others with
#: ``flash`` (FlashAttention-2): scripts/train/benchmarking/sweep.py at 5e85bd6
TRITON_AT_SCALE = ("13b", "30b")


def _mpt(size, gpus, micro, tps, sharding, ac) -> Published:
    """An MPT of llm-foundry's table: GeLU, f = 4h, tied embedding, vocabulary 50368, sequence
    2048, FlashAttention-2 or MosaicML's Triton FlashAttention as its sweep chose
    (``TRITON_AT_SCALE``), FSDP in the table's "amp_bf16" with Composer's "DEFAULT" mixed
    precision: bf16 weights, gradients reduced in fp32 (Composer v0.17.2, the version the
    README's commit pins: composer/trainer/mosaic_fsdp_utils.py, ``reduce_dtype = float32``)."""
    lay = PlanLayout(dp=gpus, zero=3 if sharding == "FULL_SHARD" else 2, micro_batch=micro,
                     recompute="full" if ac else "none", precision="bf16-fp32-grads")
    stack = "pytorch-fsdp1-triton" if size in TRITON_AT_SCALE else "pytorch-fsdp1"
    return Published(FOUNDRY, _mpt_spec(size), "h100-sxm", lay, gpus * micro, 2048,
                     "tokens_per_s_per_gpu", tps, stack,
                     assumed="DGX H100 nodes (the platform's network is not stated)")


def _mpt_a100(size, memory, gpus, micro, accum, tps, ac) -> Published:
    """A multi-node row of llm-foundry's A100 tables: an MPT (as ``_mpt``) under FSDP1's
    FULL_SHARD in "bf16" with Composer's "PURE" mixed precision (bf16 weights, gradients and
    reductions), ``accum`` micro-batches of ``micro`` sequences a step, MosaicML's Triton
    FlashAttention (its sweep.sh passes no ``--attn_impl``; submit_benchmarks.py's default is
    triton)."""
    lay = PlanLayout(dp=gpus, zero=3, micro_batch=micro, recompute="full" if ac else "none",
                     precision="bf16")
    return Published(FOUNDRY_A100, _mpt_spec(size), f"a100-{memory}gb", lay, gpus * micro * accum, 2048,
                     "tokens_per_s_per_gpu", tps, "pytorch-fsdp1-triton",
                     assumed="its nodes as DGX A100s (8 GPUs, NVSwitch; 1600 Gb/s a node as 8 x 200)")


def _mpt_h100(size, seq, gpus, micro, accum, tps, ac) -> Published:
    """A row of llm-foundry's "H100 80GB BF16" table (8 to 64 GPUs): an MPT (as ``_mpt``) at the
    row's sequence length, FULL_SHARD in "amp_bf16" with Composer's "DEFAULT" mixed precision
    (gradients reduced in fp32, as ``_mpt``), ``accum`` micro-batches of ``micro`` sequences a
    step, MosaicML's Triton FlashAttention (as ``_mpt_a100``: the table came from the same sweep,
    b2a43a1, 2023-10)."""
    lay = PlanLayout(dp=gpus, zero=3, micro_batch=micro, recompute="full" if ac else "none",
                     precision="bf16-fp32-grads")
    return Published(FOUNDRY_H100, _mpt_spec(size), "h100-sxm", lay, gpus * micro * accum, seq,
                     "tokens_per_s_per_gpu", tps, "pytorch-fsdp1-triton",
                     assumed="DGX H100 nodes (the platform's network is not stated)")


def _fms(size, sharding, every, a100_tps, h100_tps, compiled, note) -> list[Published]:
    """A row of IBM's fms-fsdp table on both of its machines: PyTorch FSDP1 over every GPU
    ("FSDP": FULL_SHARD) or sharded inside a node and replicated across ("HSDP": HYBRID_SHARD,
    ``zero_group`` 8), each block its own FSDP unit with ``limit_all_gathers``, bf16 weights and
    reductions (its bfSixteen policy), 2 sequences of 4096 a GPU, one micro-batch a step, SDPA's
    flash backend; ``every``: one block in every this many recomputed (0: none). Eager PyTorch
    in its March 2024 table, torch.compile over the model in its May 2024 one."""
    out = []
    for cluster, gpus, tps in (("a100-80gb-400g", 128, a100_tps), ("h100-sxm-800g", 96, h100_tps)):
        lay = PlanLayout(dp=gpus, zero=3, zero_group=8 if sharding == "HSDP" else 0, micro_batch=2,
                         recompute="full" if every else "none", recompute_every=every or 1,
                         precision="bf16")
        other = tuple({"recompute_every": k} for k in (1, 2, 3) if every and k != every)
        out.append(Published(FMS, PRESETS[f"llama2-{size}"], cluster, lay, 2 * gpus, 4096,
                             "tokens_per_s_per_gpu", tps,
                             "pytorch-fsdp1-compile" if compiled else "pytorch-fsdp1",
                             assumed=note + "; H100 SXM (its 'H100 80G')", alternatives=other))
    return out



TITAN_ROWS = [
    _titan("llama3-8b", 64, 1, 8192, "full", 2904, "a100-80gb", "torchtitan-fsdp2", every=2,
           note="selective layer AC as every second layer recomputed (its default then); DGX A100 nodes"),
    _titan("llama3-8b", 64, 1, 8192, "selective", 2973, "a100-80gb", "torchtitan-fsdp2",
           note="its selective op policy; DGX A100 nodes"),
    _titan("llama3-70b", 64, 1, 8192, "full", 331, "a100-80gb", "torchtitan-fsdp2",
           note="DGX A100 nodes"),
    _titan("llama2-13b", 64, 2, 4096, "none", 2162, "a100-80gb", "torchtitan-fsdp2",
           note="DGX A100 nodes"),
    _titan("llama2-13b", 64, 2, 4096, "full", 1914, "a100-80gb", "torchtitan-fsdp2", every=2,
           note="selective layer AC as every second layer recomputed (its default then); DGX A100 nodes"),
    _titan("llama2-13b", 64, 2, 4096, "selective", 1904, "a100-80gb", "torchtitan-fsdp2",
           note="its selective op policy; DGX A100 nodes"),
    _titan("llama2-70b", 64, 1, 4096, "selective", 355, "a100-80gb", "torchtitan-fsdp2",
           note="its selective op policy; DGX A100 nodes"),
    _titan("llama2-70b", 64, 2, 4096, "full", 353, "a100-80gb", "torchtitan-fsdp2",
           note="DGX A100 nodes"),
    _titan("llama3-8b", 8, 2, 8192, "selective", 5762, "h100-grand-teton", "torchtitan-fsdp2",
           note="sequence 8192 (its llama3_8b.toml); the selective op policy"),
    _titan("llama3-8b", 8, 2, 8192, "selective", 6667, "h100-grand-teton", "torchtitan-fsdp2-compile",
           note="sequence 8192 (its llama3_8b.toml); the selective op policy"),
    _titan("llama3-8b", 128, 2, 8192, "selective", 5605, "h100-grand-teton", "torchtitan-fsdp2",
           note="sequence 8192 (its llama3_8b.toml); the selective op policy"),
    _titan("llama3-8b", 128, 2, 8192, "selective", 6514, "h100-grand-teton", "torchtitan-fsdp2-compile",
           note="sequence 8192 (its llama3_8b.toml); the selective op policy"),
]

def _titan_tp(model, dp, local, recompute, tps, asynchronous) -> Published:
    """torchtitan's FSDP2 over ``dp`` x tensor parallelism over a node's 8 GPUs, sequence
    parallel (its TP plan shards the norms' sequence), ``local`` sequences a data-parallel rank
    in one micro-batch (its local batch size), compiled; the async rows on the stack that
    decomposes tensor parallelism's collectives with their GEMMs (``torchtitan-asynctp``)."""
    lay = PlanLayout(dp=dp, tp=8, zero=3, sequence_parallel=True, micro_batch=local,
                     recompute=recompute, precision="bf16-fp32-grads")
    how = "async TP" if asynchronous else "vanilla TP"
    stack = "torchtitan-asynctp" if asynchronous else "torchtitan-fsdp2-compile"
    return Published(TITAN_TP, PRESETS[model], "h100-grand-teton", lay, dp * local, 8192,
                     "tokens_per_s_per_gpu", tps, stack,
                     assumed=f"{how}; sequence 8192 (its llama3 tomls); TPS per GPU; the local "
                             f"batch per data-parallel rank, one micro-batch")


TITAN_TP_ROWS = [
    _titan_tp("llama3-70b", 32, 16, "full", 597.3, False),
    _titan_tp("llama3-70b", 32, 16, "full", 652.4, True),
    _titan_tp("llama3-8b", 8, 12, "selective", 4378.0, False),
    _titan_tp("llama3-8b", 8, 12, "selective", 4809.4, True),
]

FOUNDRY_ROWS = [
    _mpt("70b", 512, 8, 1007, "FULL_SHARD", True),
    _mpt("70b", 256, 8, 1035, "FULL_SHARD", True),
    _mpt("70b", 128, 8, 1058, "FULL_SHARD", True),
    _mpt("30b", 512, 8, 2115, "FULL_SHARD", True),
    _mpt("30b", 256, 8, 2148, "FULL_SHARD", True),
    _mpt("30b", 128, 8, 2199, "FULL_SHARD", True),
    _mpt("13b", 512, 16, 4952, "FULL_SHARD", True),
    _mpt("13b", 256, 16, 4989, "FULL_SHARD", True),
    _mpt("13b", 128, 16, 5080, "FULL_SHARD", True),
    _mpt("7b", 512, 6, 9670, "FULL_SHARD", False),
    _mpt("7b", 256, 6, 10119, "FULL_SHARD", False),
    _mpt("7b", 128, 6, 10475, "FULL_SHARD", False),
    _mpt("3b", 512, 8, 21664, "SHARD_GRAD_OP", False),
    _mpt("3b", 256, 8, 22772, "SHARD_GRAD_OP", False),
    _mpt("3b", 128, 8, 23422, "SHARD_GRAD_OP", False),
    _mpt("1b", 512, 12, 39837, "SHARD_GRAD_OP", False),
    _mpt("1b", 256, 12, 42555, "SHARD_GRAD_OP", False),
    _mpt("1b", 128, 12, 44123, "SHARD_GRAD_OP", False),
]

FOUNDRY_A100_ROWS = [
    _mpt_a100("70b", 80, 64, 8, 4, 410, True),
    _mpt_a100("70b", 80, 32, 2, 16, 373, True),
    *(_mpt_a100(size, 40, gpus, micro, 1, tps, ac) for size, gpus, micro, tps, ac in (
        ("70b", 128, 4, 376, True), ("70b", 64, 2, 276, True), ("30b", 128, 6, 865, True),
        ("30b", 32, 4, 857, True), ("13b", 128, 16, 1972, True), ("13b", 64, 16, 1976, True),
        ("13b", 32, 14, 1998, True), ("13b", 16, 10, 1993, True), ("7b", 128, 18, 3623, True),
        ("7b", 64, 18, 3665, True), ("7b", 32, 18, 3725, True), ("7b", 16, 16, 3645, True),
        ("3b", 128, 6, 9538, False), ("3b", 64, 6, 9736, False), ("3b", 32, 6, 9914, False),
        ("3b", 16, 5, 9750, False), ("1b", 128, 10, 18647, False), ("1b", 64, 10, 19001, False),
        ("1b", 32, 10, 15555, False), ("1b", 16, 8, 19085, False), ("760m", 128, 12, 28940, False),
        ("760m", 64, 12, 29344, False), ("760m", 32, 12, 29648, False),
        ("760m", 16, 12, 29607, False), ("350m", 128, 18, 51934, False),
        ("350m", 64, 18, 52689, False), ("350m", 32, 18, 53811, False),
        ("350m", 16, 18, 55413, False))),
]

FMS_ROWS = [
    *_fms("7b", "HSDP", 0, 3700, 7500, False, "no recomputation (its table)"),
    *_fms("13b", "FSDP", 2, 1800, 3800, False, "'Selective AC', every second block recomputed: "
          "its selective_checkpointing k recomputes one block in k, and its HFU over MFU on the "
          "A100s, 0.59 / 0.51 = 1.16, is recomputing half the blocks' forward (1 + 1/2 x 1/3)"),
    *_fms("34b", "FSDP", 1, 700, 1550, False, "full recomputation (its table)"),
    *_fms("70b", "FSDP", 1, 370, 800, False, "full recomputation (its table)"),
    *_fms("7b", "HSDP", 0, 4550, 9600, True, "no recomputation (its table)"),
    *_fms("13b", "FSDP", 2, 2150, 4850, True, "'Selective AC' of an unstated share p of the "
          "blocks: its HFU over MFU on the A100s, 0.69 / 0.61 = 1.13, lies between a half (1.17) "
          "and a third (1.11); a half assumed"),
    *_fms("34b", "FSDP", 1, 820, 1830, True, "'Selective AC' of an unstated share: its HFU over "
          "MFU on the A100s, 0.74 / 0.55 = 1.35, is full recomputation's 4/3: every block"),
    *_fms("70b", "FSDP", 1, 410, 890, True, "'Selective AC' of an unstated share: its HFU over "
          "MFU on the A100s, 0.74 / 0.55 = 1.35, is full recomputation's 4/3: every block"),
]

#: the table in its order: size, sequence, GPUs, micro-batch, accumulation, tokens/s a GPU, recomputation
FOUNDRY_H100_ROWS = [
    _mpt_h100("70b", 2048, 64, 8, 4, 1039, True),
    _mpt_h100("70b", 2048, 32, 2, 16, 882, True),
    _mpt_h100("30b", 8192, 8, 1, 21, 1384, True),
    _mpt_h100("30b", 4096, 8, 1, 21, 1802, True),
    _mpt_h100("30b", 2048, 32, 14, 3, 2308, True),
    _mpt_h100("30b", 2048, 16, 10, 3, 2263, True),
    _mpt_h100("30b", 2048, 8, 3, 21, 2002, True),
    _mpt_h100("30b", 1024, 8, 6, 21, 2084, True),
    _mpt_h100("13b", 32768, 8, 1, 3, 1976, True),
    _mpt_h100("13b", 16384, 8, 3, 3, 2985, True),
    _mpt_h100("13b", 4096, 8, 10, 3, 4717, True),
    _mpt_h100("13b", 2048, 64, 2, 1, 4800, False),
    _mpt_h100("13b", 2048, 32, 2, 1, 4811, False),
    _mpt_h100("13b", 2048, 16, 2, 1, 4767, False),
    _mpt_h100("13b", 2048, 8, 2, 1, 4792, False),
    _mpt_h100("13b", 1024, 8, 40, 3, 5502, True),
    _mpt_h100("7b", 65536, 8, 1, 2, 1956, True),
    _mpt_h100("7b", 32768, 8, 2, 2, 3318, True),
    _mpt_h100("7b", 8192, 8, 8, 2, 6935, True),
    _mpt_h100("7b", 4096, 8, 16, 2, 8611, True),
    _mpt_h100("7b", 2048, 8, 6, 1, 10643, False),
    _mpt_h100("7b", 1024, 8, 64, 2, 10203, True),
    _mpt_h100("3b", 65536, 8, 1, 2, 3262, True),
    _mpt_h100("3b", 32768, 8, 3, 6, 5873, True),
    _mpt_h100("3b", 16384, 8, 1, 6, 11152, False),
    _mpt_h100("3b", 8192, 8, 3, 6, 16578, False),
    _mpt_h100("3b", 4096, 8, 5, 6, 20964, False),
    _mpt_h100("3b", 2048, 64, 6, 3, 22525, False),
    _mpt_h100("3b", 2048, 32, 6, 3, 23021, False),
    _mpt_h100("3b", 2048, 16, 10, 3, 24142, False),
    _mpt_h100("3b", 1024, 8, 20, 6, 27046, False),
    _mpt_h100("3b", 512, 8, 40, 6, 27965, False),
    _mpt_h100("1b", 65536, 8, 1, 2, 5506, True),
    _mpt_h100("1b", 32768, 8, 1, 4, 12025, False),
    _mpt_h100("1b", 16384, 8, 2, 4, 19649, False),
    _mpt_h100("1b", 8192, 8, 3, 4, 29157, False),
    _mpt_h100("1b", 4096, 8, 7, 4, 38535, False),
    _mpt_h100("1b", 2048, 64, 20, 1, 44402, False),
    _mpt_h100("1b", 2048, 32, 20, 1, 45130, False),
    _mpt_h100("1b", 2048, 16, 20, 1, 46037, False),
    _mpt_h100("1b", 2048, 8, 14, 1, 45455, False),
    _mpt_h100("1b", 1024, 8, 18, 4, 48910, False),
    _mpt_h100("1b", 512, 8, 56, 4, 52275, False),
    _mpt_h100("760m", 32768, 8, 1, 2, 16291, False),
    _mpt_h100("760m", 16384, 8, 3, 2, 27815, False),
    _mpt_h100("760m", 8192, 8, 6, 2, 41825, False),
    _mpt_h100("760m", 4096, 8, 12, 2, 55459, False),
    _mpt_h100("760m", 2048, 32, 24, 1, 67971, False),
    _mpt_h100("760m", 2048, 16, 24, 1, 68551, False),
    _mpt_h100("760m", 2048, 8, 24, 2, 63147, False),
    _mpt_h100("760m", 1024, 8, 48, 2, 78581, False),
    _mpt_h100("760m", 512, 8, 96, 2, 83749, False),
]
