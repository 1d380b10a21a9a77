"""The software stack a layout runs on: what it fuses, which attention kernel it calls, what
selective recomputation recomputes, and how much of each communication it hides.

The same layout costs differently under Megatron-Core and under PyTorch's FSDP2, so a
prediction names its stack. What a stack decides:

- ``fused``: its memory-bound operations run as fused kernels (Megatron-LM's fused layer norm,
  bias-GeLU, bias-dropout-add and softmax, Transformer Engine's, or ``torch.compile``'s) or as
  eager PyTorch ops, each a kernel reading and writing memory (``dlab.theory.plan.ops``);
- ``attention``: the fused attention kernel a layout with ``attention="flash"`` gets ("fa2":
  FlashAttention-2 or PyTorch SDPA's flash backend, which is it; "fa3": FlashAttention-3 or
  cuDNN's fused attention through Transformer Engine on an H100; "fa1-triton": MosaicML's
  Triton port of FlashAttention-1, llm-foundry's ``attn_impl: triton``);
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
  (infinite: one flat all-reduce, Megatron-LM 2021's; 0: a unit per layer, FSDP's);
- ``sharding``: how it issues the data ranks' collectives (``sharding.Sharding``): what one weight
  gather and one gradient reduction carry (a parameter tensor, a submodule's tensors, a layer's
  flat buffer, a bucket), the host's work per collective and per rank in the group, whether
  the host waits for the device before each gather, and which tensors stay gathered;
- ``tp_backward``: backward's column-parallel collectives (the input gradient's all-reduce,
  or under sequence parallelism its reduce-scatter and the input's re-gather) run
  asynchronously beside the GEMMs that follow them, the rest of tensor parallelism blocking:
  Megatron-LM from 2022 (``LinearWithGradAccumulationAndAsyncCommunication``: the re-gather
  beside the input-gradient GEMM, the reduce-scatter or all-reduce beside the weight-gradient
  GEMM; ``--no-async-tensor-model-parallel-allreduce`` turns it off);
- ``tp_async``: under sequence parallelism, the all-gathers whose result only GEMMs take as
  their left operand and the reduce-scatters of a GEMM's output run decomposed with those
  GEMMs, one step per rank over symmetric memory (PyTorch's async tensor parallelism:
  torch._inductor's micro_pipeline_tp pass rewrites them as fused_all_gather_matmul and
  fused_matmul_reduce_scatter; Wang et al. 2022, "Overlap Communication with Dependent
  Computation via Decomposition"): forward's four a layer, and in backward the all-gathers of
  the row-parallel outputs' gradients before their input-gradient GEMMs; backward's
  reduce-scatters of the column-parallel layers' input gradient are of a sum of GEMMs (QKV's
  three, the MLP's two), which the pass does not match, and stay blocking;
- ``pp_transfers``: the pipeline transfers a stage waits for per micro-batch and model chunk:
  2 where each send goes out with the receive it waits on (Megatron-LM's
  send_forward_recv_backward, one batch_isend_irecv), 4 where every send and receive is its own
  blocking step (DeepSpeed's pipeline engine: SendActivation, RecvGrad, SendGrad and
  RecvActivation are separate instructions, "blocking and must be paired", schedule.py);
- ``pp_scatter``: without sequence parallelism, each tensor-parallel rank sends only its 1/t
  slice of the boundary activation (or its gradient) to the next stage, and the receiving
  stage all-gathers the slices over its tensor-parallel ranks before using them (Narayanan et
  al. 2021, sec. 4.1, "scatter/gather communication optimization": the t ranks would otherwise
  send t copies of one tensor over the nodes' NICs): Megatron-LM's
  scatter_gather_tensors_in_pipeline (on by default from 2021 until its pipeline code moved
  into Megatron-Core in 2023), and DeepSpeed's pipeline engine, which partitions the activation
  and its gradient over the slice-parallel group whenever the model is tensor-parallel
  (``PartitionedTensor``; ``is_pipe_partitioned`` in pipe/engine.py); under sequence
  parallelism the boundary is already split;
- ``hp_grad_pass``: fp32 gradients of 16-bit weights (precision ``bf16-fp32-grads``) are
  accumulated by a pass of their own after every micro-batch's backward (DeepSpeed's
  BF16_Optimizer, which bf16 with ZeRO stage 0 selects: its update_hp_grads adds each bf16
  gradient, converted, into an fp32 copy, which its engine then all-reduces) rather than
  inside the weight-gradient GEMMs (Megatron-LM's gradient_accumulation_fusion writes fp32
  main_grad directly);
- ``sp_regather``: under sequence parallelism, backward all-gathers each layer's two matmul
  inputs again for their weight gradients (Megatron-LM's ``LinearWithGradAccumulationAnd
  AsyncCommunication``, and dlab's ``nd``) rather than keeping what forward gathered (PyTorch's
  ``SequenceParallel`` leaves the gathered input to autograd, which saves it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from dlab.theory.plan.sharding import FLAT_PARAMETERS, MEGATRON_BUCKETS, PER_PARAMETER, Sharding


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
    #: the share of backward's column-parallel collectives that hides behind the GEMMs beside
    #: them (module docstring), where it exceeds ``tp``
    tp_backward: float = 0.0
    #: the share of each collective async tensor parallelism decomposes that hides behind the
    #: GEMMs it runs in steps with (module docstring)
    tp_async: float = 0.0
    cp: float = 1.0
    ep: float = 0.0
    pp: float = 0.0
    gather_backward: bool = True
    copies: bool = False
    bucket: float = 25e6
    sp_regather: bool = True
    sharding: Sharding = Sharding()
    pp_transfers: int = 2
    pp_scatter: bool = False
    hp_grad_pass: bool = False

    def overlaps(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in ("grads", "params", "tp", "tp_backward", "tp_async", "cp",
                                                   "ep", "pp")}

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
          "tensor-parallel collectives and pipeline sends block, each tensor-parallel rank sending "
          "its 1/t of the boundary (sec. 4.1's scatter/gather)", fused=True, attention="fa2",
          grads=0.0, params=0.0, tp=0.0, cp=0.0, ep=0.0, pp=0.0, bucket=math.inf,
          sharding=MEGATRON_BUCKETS, pp_scatter=True),
    Stack("megatron-lm-2022",
          "Megatron-LM as Korthikanti et al. 2022 ran it (mid-2022): the 2021 stack with "
          "sequence parallelism and selective recomputation, and backward's column-parallel "
          "collectives asynchronous beside their GEMMs (the re-gather beside the input-gradient "
          "GEMM, the reduce-scatter or the all-reduce beside the weight-gradient GEMM: "
          "megatron/mpu/layers.py, async_tensor_model_parallel_allreduce on by default); the "
          "gradients all-reduced after the last backward, pipeline sends blocking (split over the "
          "tensor-parallel ranks without sequence parallelism, as in 2021)",
          fused=True, attention="fa2", grads=0.0, params=0.0, tp=0.0, tp_backward=1.0, cp=0.0,
          ep=0.0, pp=0.0, bucket=math.inf, sharding=MEGATRON_BUCKETS, pp_scatter=True),
    Stack("megatron-lm-2023",
          "Megatron-LM in 2023, before its overlaps (--overlap-grad-reduce came in August 2023, "
          "--tp-comm-overlap in October, --overlap-param-gather in November: its git history): "
          "the fused kernels, FlashAttention-2 (--use-flash-attn, May 2023), sequence "
          "parallelism, the distributed optimizer reduce-scattering every gradient after the "
          "last backward and gathering the weights after the step, tensor-parallel collectives "
          "and pipeline sends blocking but backward's column-parallel collectives (as "
          "megatron-lm-2022)", fused=True, attention="fa2",
          grads=0.0, params=0.0, tp=0.0, tp_backward=1.0, cp=0.0, ep=0.0, pp=0.0,
          bucket=math.inf, sharding=MEGATRON_BUCKETS),
    Stack("megatron-deepspeed",
          "Megatron-DeepSpeed as BigScience (BLOOM) and MT-NLG ran it: Megatron-LM's 2021 model "
          "code and fused kernels, DeepSpeed's pipeline engine (1F1B; each send and receive its own "
          "blocking step), "
          "the activation and its gradient split over the tensor-parallel ranks for each transfer, "
          "tensor-parallel collectives blocking, ZeRO-1 as DeepSpeed's BF16_Optimizer does it: "
          "the engine all-reduces every gradient after the last backward, each rank updates its "
          "shard, the weights are all-gathered after the step; with fp32 gradients "
          "(bf16-fp32-grads: bf16 with ZeRO stage 0, BigScience's) the optimizer adds each "
          "micro-batch's bf16 gradients into them by a pass of its own", fused=True,
          attention="fa2", grads=0.0, params=0.0, tp=0.0, cp=0.0, ep=0.0, pp=0.0,
          bucket=math.inf,
          sharding=Sharding(gather="bucket", reduce="bucket", host_ops=2,
                            zero1_reduce="all_reduce"), pp_transfers=4, pp_scatter=True,
          hp_grad_pass=True),
    Stack("megatron-core-2024",
          "Megatron-Core r0.8 as Megatron-LM's README benchmarks it (July 2024): Transformer "
          "Engine's fused kernels and cuDNN attention, the distributed optimizer with "
          "--overlap-grad-reduce and --overlap-param-gather, --tp-comm-overlap, overlapped "
          "pipeline sends, context parallelism's ring overlapped with attention; gradients "
          "reduced in buckets of max(40M, 1M x dp) parameters", fused=True, attention="fa3",
          grads=1.0, params=1.0, tp=1.0, cp=1.0, ep=0.0, pp=1.0, bucket=40e6,
          sharding=Sharding(gather="bucket", reduce="bucket", host_ops=2, bucket_per_rank=1e6)),
    Stack("torchtitan-fsdp2",
          "torchtitan (end of 2024) without torch.compile: eager PyTorch ops, SDPA's flash "
          "backend (FlashAttention-2), FSDP2 gathering each block's weights ahead of its forward "
          "and again for backward, reduce-scattering behind backward, copying in and out of its "
          "flat buffers; selective recomputation is its op policy; no async tensor parallelism "
          "without compile", fused=False, attention="fa2", selective="half-mm",
          grads=1.0, params=1.0, tp=0.0, cp=1.0, ep=0.0, pp=0.0, copies=True, bucket=0.0,
          sp_regather=False, sharding=PER_PARAMETER),
    Stack("torchtitan-fsdp2-compile",
          "torchtitan with torch.compile per block: as torchtitan-fsdp2, the element-wise ops "
          "fused by Inductor", fused=True, attention="fa2", selective="half-mm",
          grads=1.0, params=1.0, tp=0.0, cp=1.0, ep=0.0, pp=0.0, copies=True, bucket=0.0,
          sp_regather=False, sharding=PER_PARAMETER),
    Stack("torchtitan-asynctp",
          "torchtitan with torch.compile and async tensor parallelism (2025: "
          "enable_async_tensor_parallel): as torchtitan-fsdp2-compile, with Inductor's "
          "micro-pipelining of tensor parallelism's collectives over symmetric memory, each "
          "all-gather before the GEMMs it feeds and each reduce-scatter after the GEMM that "
          "feeds it run in one step per rank beside those GEMMs (forward's four a layer, "
          "backward's two all-gathers); backward's reduce-scatters of summed input gradients "
          "block", fused=True, attention="fa2", selective="half-mm", grads=1.0, params=1.0,
          tp=0.0, tp_async=1.0, cp=1.0, ep=0.0, pp=0.0, copies=True, bucket=0.0,
          sp_regather=False, sharding=PER_PARAMETER),
    Stack("pytorch-fsdp1",
          "PyTorch's FullyShardedDataParallel (FSDP1, flat parameters) as MosaicML's "
          "llm-foundry runs it: eager ops, FlashAttention-2, backward prefetch of the next "
          "unit's gather, FULL_SHARD gathering again for backward (SHARD_GRAD_OP is zero=2)",
          fused=False, attention="fa2", grads=1.0, params=1.0, bucket=0.0, sharding=FLAT_PARAMETERS),
    Stack("pytorch-fsdp1-triton",
          "FSDP1 as llm-foundry ran it with attn_impl: triton (its benchmark script's default in "
          "2023, 'our training setups typically use triton': TUTORIAL.md): as pytorch-fsdp1, "
          "its attention MosaicML's Triton port of FlashAttention-1 (flash_attn_triton.py)",
          fused=False, attention="fa1-triton", grads=1.0, params=1.0, bucket=0.0,
          sharding=FLAT_PARAMETERS),
    Stack("pytorch-fsdp1-compile",
          "FSDP1 with torch.compile over the model, as IBM's fms-fsdp runs it (SDPA's "
          "FlashAttention-2, each block its own unit, limit_all_gathers)", fused=True, attention="fa2",
          grads=1.0, params=1.0, bucket=0.0, sharding=FLAT_PARAMETERS),
    Stack("metaseq",
          "metaseq as OPT-175B was trained (Zhang et al. 2022, sec. 2.4; facebookresearch/"
          "metaseq's opt_baselines.py): fairscale's FSDP (a flat parameter per layer, "
          "--no-reshard-after-forward: zero=2, gradients reduce-scattered behind backward) with "
          "Megatron-LM's tensor parallelism and fused kernels, its collectives blocking",
          fused=True, attention="fa2", grads=1.0, params=1.0, tp=0.0, bucket=0.0,
          sharding=FLAT_PARAMETERS),
    Stack("deepspeed-zero3",
          "DeepSpeed ZeRO stage 3 as of 2024-25 (Rajbhandari et al. 2020; DeepSpeed's config "
          "docs and partitioned_param_coordinator.py): a Hugging Face model's eager ops and "
          "FlashAttention-2; per micro-batch each submodule's weights gathered by one "
          "all_gather_coalesced (tensors under stage3_param_persistence_threshold, 1e5, stay "
          "gathered), prefetched up to stage3_prefetch_bucket_size (5e7) ahead while fewer than "
          "stage3_max_live_parameters (1e9) are gathered, gathered again when full recomputation "
          "runs a layer's forward and for backward unless the next use comes within "
          "stage3_max_reuse_distance (1e9); gradients reduce-scattered in reduce_bucket_size "
          "(5e8) buckets behind backward (overlap_comm, on by default at stage 3); partitioned "
          "parameters copied in and out", fused=False, attention="fa2", grads=1.0, params=1.0, copies=True,
          bucket=5e8,
          sharding=Sharding(gather="module", reduce="bucket", persist=1e5, host_ops=12,
                            tensor_ops=2, staging=2 * 5e8, prefetch=5e7, recompute_gathers=True,
                            reuse=1e9, live=1e9)),
    Stack("deepspeed-zero3-2021",
          "DeepSpeed ZeRO stage 3 as released in 2021 (v0.3.15 to v0.5.5) under Megatron-LM's "
          "GPT (DeepSpeedExamples' fused kernels): each parameter tensor of 1e5 elements or more "
          "gathered alone by torch.distributed.all_gather into a list of one tensor per rank, "
          "after a torch.cuda.synchronize() (partition_parameters.py's _allgather_param; DeepSpeed "
          "PR 1188, October 2021: 'the async version is not async at all, because each "
          "all_gather calls torch.cuda.synchronize()' and 'all_gather will do implicit memcpy'), "
          "the next module's tensor prefetched beside the module the hook then runs "
          "(stage3.py's prefetch_next_sub_modules); gathered again when full recomputation runs "
          "a layer's forward (its hooks fire inside Megatron's checkpointed function) and for "
          "backward unless its next use comes within stage3_max_reuse_distance (1e9 elements); "
          "the tensors kept gathered gathered again after each step, a copy per tensor and "
          "rank (_post_step's _allgather_params); each gradient reduce-scattered alone from a "
          "list of one tensor per rank (_reduce_scatter_gradient; ProcessGroupNCCL copies each "
          "piece into a flat buffer first) behind backward (overlap_comm on at stage "
          "3); partitioned parameters copied in and out", fused=True, attention="fa2",
          grads=1.0, params=1.0, copies=True, bucket=5e8,
          sharding=Sharding(gather="tensor", reduce="tensor", persist=1e5, host_ops=6,
                            rank_ops=2, rank_kernels=1, blocking=True, staging=2 * 5e8,
                            prefetch=5e7, recompute_gathers=True, reuse=1e9, live=1e9,
                            step_rank_ops=4)),
    Stack("llama3-meta",
          "Meta's stack as the Llama 3 paper describes it (Dubey et al. 2024, sec. 3.3.2): "
          "FSDP sharding optimizer state and gradients, weights gathered once and not resharded "
          "after forward (zero=2 here), context parallelism by an all-gather of K and V that is "
          "not overlapped, asynchronous pipeline sends; its kernels are not named: "
          "FlashAttention-2's class assumed (FlashAttention-3 was published with the model); "
          "sequence parallelism as PyTorch's, its gathered input kept for backward",
          fused=True, attention="fa2", grads=1.0, params=1.0, tp=0.0, cp=0.0, pp=1.0,
          gather_backward=False, bucket=0.0, sp_regather=False, sharding=FLAT_PARAMETERS),
)}

DEFAULT = "megatron-core-2024"


def preset(name: str) -> Stack:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown stack {name!r}; choose one of {', '.join(PRESETS)}") from None
