"""How a software stack issues ZeRO's weight gathers and gradient reductions (``Sharding``), and
the ways the stacks of ``dlab.theory.plan.stacks`` share: Megatron's buckets, FSDP1's flat
parameters, FSDP2's per-parameter shards. ``dlab.theory.plan.data_comm`` prices them."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Sharding:
    """How a stack issues ZeRO's weight gathers and gradient reductions
    (``dlab.theory.plan.time``). Each collective pays its ring's latency at the group's size
    and its bytes at the link's bus bandwidth (``collectives``), plus the host's work to issue
    it: ``host_ops`` tensor operations (a hook's bookkeeping, a buffer allocated, the shard
    copied in, the call itself), ``tensor_ops`` more for each parameter tensor it carries
    (views made, streams recorded), each the dispatcher's work (``dispatch``) and a kernel's
    launch (``Kernels.launch``); and where the collective takes a list of one tensor per rank
    (``torch.distributed.all_gather`` and ``reduce_scatter`` before ``_all_gather_base``), for
    each rank of its group ``rank_ops`` trips through the dispatcher that launch nothing (the
    views of each rank's piece, made in Python) and ``rank_kernels`` copies (ProcessGroupNCCL's
    copy of each rank's piece in or out of its flat buffer), each a launch on the host and a
    kernel on the device (a launch's time however small the piece)."""
    #: what one weight gather carries: "tensor" (each parameter tensor alone: DeepSpeed 2021),
    #: "module" (one submodule's tensors: DeepSpeed's all_gather_coalesced), "block" (a layer's
    #: flat buffer: FSDP)
    gather: str = "block"
    #: what one gradient reduction carries: "tensor", "block", or "bucket" (``Stack.bucket``
    #: parameters; a bucket larger than a layer spans several)
    reduce: str = "block"
    #: tensors smaller than this many elements stay gathered between steps and are not gathered
    #: again (DeepSpeed's stage3_param_persistence_threshold, 1e5 since 2021)
    persist: float = 0.0
    host_ops: float = 4.0
    tensor_ops: float = 0.0
    rank_ops: float = 0.0
    rank_kernels: float = 0.0
    #: seconds PyTorch spends on one operation called from Python before any kernel is launched
    #: (argument parsing, the dispatcher, autograd's check): its operator micro-benchmarks time
    #: a small tensor's split at 3.3 us on the CPU, where the launch is nothing
    #: (pytorch/pytorch#32194, 2020)
    dispatch: float = 3.3e-6
    #: the stack's module hooks gather a layer's weights again when full recomputation runs its
    #: forward a second time (DeepSpeed: its pre-forward hooks fire inside the checkpointed
    #: function); FSDP's pre-backward gather serves the recomputation as well
    recompute_gathers: bool = False
    #: a gathered tensor is kept for its next use when fewer than this many elements of other
    #: weights are gathered in between (DeepSpeed's stage3_max_reuse_distance, 1e9 since 2021)
    reuse: float = math.inf
    #: no weights are prefetched while this many elements are gathered (DeepSpeed's
    #: stage3_max_live_parameters, 1e9 since 2021): a module this large prefetches nothing
    live: float = math.inf
    #: trips through the dispatcher per rank, besides a copy's launch, for each tensor kept
    #: gathered (``persist``) once the optimizer step has updated the shards: DeepSpeed 2021
    #: partitions every parameter after backward and its _post_step gathers the kept ones again
    #: with _allgather_params, which copies each tensor's piece out of each rank's (a narrow, a
    #: view, a narrow and the copy: 4)
    step_rank_ops: float = 0.0
    #: the host waits for the device before each weight gather (DeepSpeed 2021's
    #: ``torch.cuda.synchronize()`` in ``_allgather_param``): its host work shows whole, and a
    #: gather overlaps only the compute the host launches after it (the module whose hook
    #: prefetched it), a backward gather sharing that with the reductions in flight
    blocking: bool = False
    #: ZeRO-1/2's gradient reduction: "reduce_scatter" (each rank receives its shard) or
    #: "all_reduce" (DeepSpeed's BF16_Optimizer: the engine all-reduces, each rank then updates
    #: its shard)
    zero1_reduce: str = "reduce_scatter"
    #: a bucket holds at least this many parameters per data rank (Megatron-Core's 1M)
    bucket_per_rank: float = 0.0
    #: elements a gradient reduction's staging buffer holds (DeepSpeed's reduce_bucket_size,
    #: two of them when overlap_comm double-buffers): memory (``memory.buffers``)
    staging: float = 0.0
    #: elements gathered ahead of the running module at most (DeepSpeed's
    #: stage3_prefetch_bucket_size); 0: the next layer's whole buffer (FSDP)
    prefetch: float = 0.0


#: Megatron's buckets: a collective per bucket, a view and the call on the host
MEGATRON_BUCKETS = Sharding(gather="bucket", reduce="bucket", host_ops=2)
#: FSDP1 (and fairscale's FSDP): a layer's FlatParameter gathered by one all_gather_into_tensor
#: into a buffer it allocates, a view made of it per parameter; its gradient reduce-scattered
#: from a padded flat copy, a view per parameter again
FLAT_PARAMETERS = Sharding(gather="block", reduce="block", host_ops=6, tensor_ops=1)
#: FSDP2 (per-parameter DTensors): a block's shards copied into one buffer (a foreach copy),
#: gathered, copied out (split_with_sizes_copy), each parameter's unsharded tensor set up; the
#: gradients concatenated (chunk_cat) and reduce-scattered, each shard's view made
PER_PARAMETER = Sharding(gather="block", reduce="block", host_ops=8, tensor_ops=2)
