"""Published figures the GPU lessons show where no GPU session of this project has measured
them, each with its source. They are read from the sources named, not fitted to anything here.
The planner's own published constants (the maximum achievable matmul, FlashAttention's shares,
nccl-tests' bus bandwidth) stay in ``dlab.theory.plan.cluster``, which cites them; these are the
rest the lessons need."""
from __future__ import annotations

#: NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column; an H200 has the same compute): the
#: dense TF32 and FP8 tensor-core peaks (the datasheet's "with sparsity" 989 and 3,958 halved);
#: its bf16 and fp32 peaks are ``dlab.core.machine.GPU_PEAK_FLOPS``'s, its HBM3 bandwidth the
#: planner's preset's (``dlab.theory.plan.cluster``)
H100_SXM = {"source": "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM (dense: the sparsity figures halved)",
            "peak": {"tf32": 494.5e12, "fp8": 1979e12}}

#: forward TFLOP/s of attention against the sequence length, FP16/BF16: the bar labels of Shah
#: et al. 2024 (FlashAttention-3)'s chart "Attention forward speed, head dim 128 (H100 80GB
#: SXM5)" of the forward pass *with* the causal mask (the paper charts it with and without; the
#: one without reads higher at short sequences: FlashAttention-3 497 at 512, the math path 74),
#: "standard attention" being the math path; None: out of memory there
ATTENTION_H100 = {
    "source": "Shah et al. 2024, FlashAttention-3, the chart 'Attention forward speed, head dim 128 "
              "(H100 80GB SXM5)', forward with the causal mask, FP16/BF16, its bar labels",
    "seqs": (512, 1024, 2048, 4096, 8192, 16384),
    "tflops": {"standard (math)": (26, 31, 34, 35, 35, None),
               "FlashAttention-2": (191, 260, 298, 319, 333, 335),
               "cuDNN": (315, 410, 484, 518, 529, 539),
               "FlashAttention-3": (292, 423, 521, 579, 602, 616)}}

#: where a transformer's training time goes by operator class (Ivanov et al. 2021, "Data
#: Movement Is All You Need", MLSys, table 1: BERT-large encoder layer, PyTorch, one V100)
OPERATOR_CLASSES = {
    "source": "Ivanov et al. 2021, Data Movement Is All You Need (MLSys), table 1: BERT-large, PyTorch, V100",
    "rows": (("tensor contractions (matmuls)", 99.80, 61.0),
             ("statistical normalizations (softmax, layer norm)", 0.17, 25.5),
             ("element-wise (bias, dropout, activation, residual)", 0.03, 13.5))}

#: the CUDA caching allocator's sizes (PyTorch's c10/cuda/CUDACachingAllocator.cpp; in recent
#: releases c10/core/AllocatorConfig.h): every block
#: rounded up to 512 bytes; requests up to 1 MiB served from 2 MiB segments, larger ones from
#: 20 MiB segments (10 MiB and above: rounded to 2 MiB)
ALLOCATOR = {"source": "PyTorch's CUDA caching allocator, its constants kMinBlockSize, kSmallSize, "
                       "kSmallBuffer, kLargeBuffer, kMinLargeAlloc, kRoundLarge",
             "block": 512, "small": 1 << 20, "small_segment": 2 << 20, "large_segment": 20 << 20,
             "min_large": 10 << 20, "round_large": 2 << 20}
