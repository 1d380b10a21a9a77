"""The software stack a layout runs on: what it fuses, which attention kernel it calls, what
selective recomputation recomputes, and how much of each communication it hides.

The same layout costs differently under Megatron-Core and under PyTorch's FSDP2, so a
prediction names its stack. What a stack decides:

- ``fused``: its memory-bound operations run as fused kernels (Megatron-LM's fused layer norm,
  bias-GeLU, bias-dropout-add and softmax, Transformer Engine's, or ``torch.compile``'s) or as
  eager PyTorch ops, each a kernel reading and writing memory (``dlab.theory.plan.ops``);
- ``attention``: the fused attention kernel a layout with ``attention="flash"`` gets ("fa2":
  FlashAttention-2 or PyTorch SDPA's flash backend, which is it; "fa3": FlashAttention-3 or
  cuDNN's fused attention through Transformer Engine on an H100);
- ``selective``: what ``recompute="selective"`` recomputes: "core", the attention core
  (Korthikanti et al. 2022, Megatron's); "half-mm", torchtitan's op-level policy, which keeps
  every op's output but every second matmul's and recomputes the rest (element-wise ops and
  half the matmuls);
- ``overlap``: for each communication, the share of the compute beside it that it may hide
  behind (0: it waits, exposed; 1: it hides wherever the compute is long enough). What no
  compute can hide is exposed whatever the share: the first unit a ZeRO-3 forward gathers,
  the last gradient bucket, a collective longer than its window (``dlab.theory.plan.time``);
- ``gather_backward``: ZeRO-3 gathers each layer's weights again for backward (FSDP's
  ``reshard_after_forward``, DeepSpeed's stage 3) rather than keeping them from forward;
- ``copies``: gathered weights and reduced gradients are copied between the collective's
  flat buffer and the parameters (FSDP2's per-parameter sharding, DeepSpeed's partitioned
  parameters), a memory-bound pass over each;
- ``bucket``: gradients reduced per bucket of that many parameters, the last one exposed
  (infinite: one flat all-reduce, Megatron-LM 2021's; 0: a unit per layer, FSDP's).
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Stack:
    name: str
    #: what the profile is, and where its choices are documented
    what: str
    fused: bool
    attention: str
    selective: str = "core"
    #: overlap shares (module docstring): the data ranks' gradient reduction, their weight
    #: gathers, tensor, context and expert parallelism's collectives, pipeline transfers
    grads: float = 1.0
    params: float = 1.0
    tp: float = 0.0
    cp: float = 1.0
    ep: float = 0.0
    pp: float = 0.0
    gather_backward: bool = True
    copies: bool = False
    bucket: float = 25e6

    def overlaps(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in ("grads", "params", "tp", "cp", "ep", "pp")}

    def describe(self) -> str:
        hidden = ", ".join(f"{k} {v:.0%}" for k, v in self.overlaps().items())
        return (f"{self.name}: {'fused' if self.fused else 'eager'} element-wise ops, "
                f"{self.attention} attention, selective recomputation of "
                f"{'the attention core' if self.selective == 'core' else 'half the matmuls'}; "
                f"overlap shares {hidden}")


PRESETS = {s.name: s for s in (
    Stack("megatron-lm-2021",
          "Megatron-LM as Narayanan et al. 2021 (sec. 4.2: fused layer norm, bias-GeLU, "
          "bias-dropout-add and scale-mask-softmax kernels) and Korthikanti et al. 2022 ran it: "
          "its default 'local' DDP all-reduces the gradients after the pipeline's last backward, "
          "tensor-parallel collectives and pipeline sends block", fused=True, attention="fa2",
          grads=0.0, params=0.0, tp=0.0, cp=0.0, ep=0.0, pp=0.0, bucket=math.inf),
    Stack("megatron-core-2024",
          "Megatron-Core r0.8 as Megatron-LM's README benchmarks it (July 2024): Transformer "
          "Engine's fused kernels and cuDNN attention, the distributed optimizer with "
          "--overlap-grad-reduce and --overlap-param-gather, --tp-comm-overlap, overlapped "
          "pipeline sends, context parallelism's ring overlapped with attention; gradients "
          "reduced in buckets of max(40M, 1M x dp) parameters", fused=True, attention="fa3",
          grads=1.0, params=1.0, tp=1.0, cp=1.0, ep=0.0, pp=1.0, bucket=40e6),
    Stack("torchtitan-fsdp2",
          "torchtitan (end of 2024) without torch.compile: eager PyTorch ops, SDPA's flash "
          "backend (FlashAttention-2), FSDP2 gathering each block's weights ahead of its forward "
          "and again for backward, reduce-scattering behind backward, copying in and out of its "
          "flat buffers; selective recomputation is its op policy; no async tensor parallelism "
          "without compile", fused=False, attention="fa2", selective="half-mm",
          grads=1.0, params=1.0, tp=0.0, cp=1.0, ep=0.0, pp=0.0, copies=True, bucket=0.0),
    Stack("torchtitan-fsdp2-compile",
          "torchtitan with torch.compile per block: as torchtitan-fsdp2, the element-wise ops "
          "fused by Inductor", fused=True, attention="fa2", selective="half-mm",
          grads=1.0, params=1.0, tp=0.0, cp=1.0, ep=0.0, pp=0.0, copies=True, bucket=0.0),
    Stack("pytorch-fsdp1",
          "PyTorch's FullyShardedDataParallel (FSDP1, flat parameters) as MosaicML's "
          "llm-foundry runs it: eager ops, FlashAttention-2, backward prefetch of the next "
          "unit's gather, FULL_SHARD gathering again for backward (SHARD_GRAD_OP is zero=2)",
          fused=False, attention="fa2", grads=1.0, params=1.0, bucket=0.0),
    Stack("pytorch-fsdp1-compile",
          "FSDP1 with torch.compile, as IBM's fms-fsdp runs it (SDPA FlashAttention-2, "
          "selective recomputation of the attention core)", fused=True, attention="fa2",
          grads=1.0, params=1.0, bucket=0.0),
    Stack("deepspeed-zero3",
          "DeepSpeed ZeRO stage 3 (Rajbhandari et al. 2020; DeepSpeed's config docs: "
          "overlap_comm, stage3_prefetch_bucket_size): a Hugging Face model's eager ops and "
          "FlashAttention-2, weights gathered per micro-batch for forward and again for "
          "backward, gradients reduce-scattered per micro-batch, partitioned parameters copied "
          "in and out", fused=False, attention="fa2", grads=1.0, params=1.0, copies=True,
          bucket=5e8),
    Stack("llama3-meta",
          "Meta's stack as the Llama 3 paper describes it (Dubey et al. 2024, sec. 3.3.2): "
          "FSDP sharding optimizer state and gradients, weights gathered once and not resharded "
          "after forward (zero=2 here), context parallelism by an all-gather of K and V that is "
          "not overlapped, asynchronous pipeline sends; its kernels are not named: "
          "FlashAttention-2's class assumed (FlashAttention-3 was published with the model)",
          fused=True, attention="fa2", grads=1.0, params=1.0, tp=0.0, cp=0.0, pp=1.0,
          gather_backward=False, bucket=0.0),
)}

DEFAULT = "megatron-core-2024"


def preset(name: str) -> Stack:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown stack {name!r}; choose one of {', '.join(PRESETS)}") from None
