"""``torch-tp``: PyTorch's own tensor parallelism on the same GPT, the peer ``tp`` is measured
against.

``torch.distributed.tensor.parallel.parallelize_module`` rewrites each linear's weight into a
DTensor sharded over the mesh's "tp" dimension: ``ColwiseParallel`` for q, k, v and fc,
``RowwiseParallel`` for the two proj layers, and with ``sequence_parallel`` the layer norms
become ``SequenceParallel`` with ``PrepareModuleInput`` doing the all-gather before attention
and the MLP, and the row-parallel outputs reduce-scattered (``output_layouts=Shard(1)``).

The vocabulary is split as ``tp`` splits it, so both sides do the same work: the token
embedding is ``RowwiseParallel`` (each rank holds V/t rows of the matrix, looks up the tokens
in its range and the partial embeddings are all-reduced), the tied head multiplies by that same
shard (the final layer norm's parameters replicated as DTensors, so the projection is a
DTensor matmul) and gives each rank its V/t slice of the logits, and the cross-entropy runs
under ``loss_parallel`` on those slices, so no rank holds the full logits. The position
embedding and the final layer norm are whole on every rank, as in ``tp``. DTensor's
collectives bypass dlab's counting ``Comm``, so only the data-parallel all-reduce is counted
here; the bench compares step time and memory.

With ``fsdp=True`` the data-parallel replicas do not all-reduce their gradients: after
``parallelize_module`` the model is sharded with FSDP2 (``fully_shard``, each block, then the
root) over the "dp" dimension of the same 2-D mesh, PyTorch's own FSDP2 + TP composition in
torchtitan's order. It is the peer of ``nd`` with ``zero=3`` and ``tp``. FSDP2 splits each
rank's TP shard again on dim 0 over dp: a Colwise weight becomes ``(_StridedShard(0),
Shard(0))`` on the (dp, tp) mesh, a Rowwise one ``(Shard(0), Shard(1))``, what TP leaves plain
(the position table, the norms without sequence parallelism) a 1-D DTensor on the dp mesh. It
all-gathers a block's TP shards over dp before its forward and backward and reduce-scatters
(averages) its gradients over dp, so a rank holds 1/(dp*tp) of each TP-split matrix and 1/dp of
what TP replicates, its gradient and optimizer state likewise; its collectives bypass ``Comm``
too. With dp = 1 there is nothing to shard over: ``fsdp`` is refused there (``problems``).

``precision`` (the names of ``dlab.core.precision``) is FSDP2's ``MixedPrecisionPolicy``, so it
needs ``fsdp``: the sharded parameters stay fp32 and are what the optimizer steps (the fp32
masters), each all-gather casts them to ``param_dtype`` = bf16 for the forward and backward,
and the gradients are reduce-scattered in ``reduce_dtype`` (bf16 for ``bf16``, fp32 for
``bf16-fp32-grads``) and kept in the parameters' fp32. So the state per parameter is 4 + 4 + k
bytes, not the ZeRO paper's 2 + 2 + 12 of ``nd``: the bf16 copy exists only while a block is
gathered. ``fp16`` is refused: FSDP2 has no loss scaler of its own.
"""
from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from dlab.core.metrics import ActivationMeter, optimizer_tensors, storage_bytes
from dlab.layout import DP, TP
from dlab.models.data import shard
from dlab.parallel import register
from dlab.parallel.base import Option, Strategy
from dlab.parallel.grads import reduce_gradients
from dlab.parallel.mesh import Mesh
from dlab.parallel.mixed import PRECISION, grad_dtype, precision_of
from dlab.parallel.tensor.strategy import OPTIONS, TensorParallelLayout
from dlab.parallel.zero.torch_fsdp import ParamMeter, shard_with_fsdp2


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class _Holder:
    __slots__ = ("inner", "tensor")

    def __init__(self, inner, tensor):
        self.inner, self.tensor = inner, tensor


class LocalShardMeter(ActivationMeter):
    """``ActivationMeter`` for a model of DTensors: autograd saves DTensors, and what this rank
    holds of one is its local shard, so that is what is counted."""

    def hold(self, t):
        if isinstance(t, DTensor):
            with torch.no_grad():
                return _Holder(super().hold(t.to_local()), t)
        return super().hold(t)

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Holder) else ActivationMeter._unpack(saved)


class FSDPLocalShardMeter(LocalShardMeter, ParamMeter):
    """Under FSDP2 the weights a forward saves are the all-gathered ones, new each step: they
    are recognised by storage (``ParamMeter``) after the DTensor is reduced to its local shard."""


def block_plan(sequence_parallel: bool) -> dict:
    if not sequence_parallel:
        return {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
                "attn.v": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                use_local_output=True)
    return {"ln1": SequenceParallel(use_local_output=True), "attn": gather,
            "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(), "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
            "ln2": SequenceParallel(use_local_output=True), "mlp": gather,
            "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel(output_layouts=Shard(1))}


@register("torch-tp")
class TorchTensorParallel(TensorParallelLayout, Strategy):
    """PyTorch's ``parallelize_module`` (Colwise / Rowwise / SequenceParallel) on the GPT's
    blocks; options as ``tp``: ``tp`` and ``sequence_parallel``. TP x DP through a mesh, the
    DP side all-reducing gradients or, with ``fsdp``, FSDP2 over the mesh's "dp" dimension."""

    # PyTorch's SequenceParallel chooses its own collectives: dlab's reduce_scatter option does not apply
    OPTIONS = {**{k: v for k, v in OPTIONS.items() if k != "reduce_scatter"},
               "fsdp": Option("bool", "shard parameters, gradients and optimizer state over the "
                              "data-parallel ranks with FSDP2 (fully_shard on the 'dp' mesh "
                              "dimension, after TP) instead of all-reducing gradients; the peer "
                              "of nd with zero=3; needs dp = world_size / tp > 1", default=False),
               "precision": PRECISION}

    @classmethod
    def problems(cls, config):
        p = super().problems(config)
        tp = cls.layout(config).tp
        if config.options.get("fsdp", False) and config.world_size == tp:
            p.append(f"fsdp needs dp > 1: world_size={config.world_size} with tp={tp} leaves one "
                     f"data-parallel rank, nothing for FSDP2 to shard over; use a world_size "
                     f"that is a multiple of tp above it, a smaller tp, or fsdp=False")
        prec = precision_of(config)
        if prec.mixed and not config.options.get("fsdp", False):
            p.append(f"precision={prec.name} needs fsdp=True: it is FSDP2's MixedPrecisionPolicy "
                     f"(fp32 parameter shards, bf16 compute); set fsdp=True or precision=fp32")
        if prec.loss_scaled:
            p.append(f"precision={prec.name} needs a loss scaler, which FSDP2 does not have; use "
                     f"precision=bf16 or bf16-fp32-grads")
        return p

    def setup(self) -> None:
        lay = self.layout(self.ctx.config)
        self.tp, self.sp, self.dp = lay.tp, lay.sequence_parallel, lay.dp
        self.fsdp = bool(self.ctx.config.options.get("fsdp", False))
        self.mesh = Mesh.of(lay, device_type=self.ctx.device.type)
        tp_mesh = self.mesh.device_mesh[TP]
        self.model = self.build_model()
        for block in self.model.blocks:
            parallelize_module(block, tp_mesh, block_plan(self.sp))
        if self.sp:
            # The residual stream between blocks is sequence-sharded: cut it (no communication)
            # before the first block; the head gathers it back below.
            parallelize_module(self.model.blocks[0], tp_mesh, PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                use_local_output=True))
        # Vocabulary-parallel embedding and head: the embedding's rows split over the ranks
        # (partial lookups all-reduced), the head's input made a replicated DTensor so it
        # multiplies by the same (tied) shard and leaves the logits split by vocabulary.
        parallelize_module(self.model.embed.tok, tp_mesh, RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Replicate()))
        distribute_module(self.model.head.ln, tp_mesh)
        parallelize_module(self.model.head, tp_mesh, PrepareModuleInput(
            input_layouts=(Shard(1) if self.sp else Replicate(),),
            desired_input_layouts=(Replicate(),), use_local_output=False))
        head = self.model.head
        if head.tied_weight:  # the head reads the embedding's matrix as it is now
            head.projection = lambda: self.model.embed.tok.weight
        else:
            head.weight = torch.nn.Parameter(distribute_tensor(head.weight.detach(), tp_mesh, [Shard(0)]))
        if self.fsdp:
            # after TP, as torchtitan orders it: FSDP2 shards each TP DTensor again over dp (and
            # points the tied head at the embedding's weight as it is at call time, since
            # FSDP2 swaps the sharded and the gathered parameter)
            prec = precision_of(self.ctx.config)
            policy = MixedPrecisionPolicy(param_dtype=prec.compute, reduce_dtype=grad_dtype(prec))
            shard_with_fsdp2(self.model, mesh=self.mesh.device_mesh[DP], mp_policy=policy)
        self.params = list(self.model.parameters())
        self.optimizer = self.build_optimizer(self.params)
        self.meter = (FSDPLocalShardMeter(self.model) if self.fsdp
                      else LocalShardMeter([_local(p) for p in self.params]))

    def step(self, batch):
        x, y = (t.to(self.ctx.device) for t in shard(batch, self.mesh.rank(DP), self.dp))
        tl = self.ctx.timeline
        self.optimizer.zero_grad()
        self.meter.reset_peak()
        # cross-entropy on this rank's vocabulary slice of the logits, in fp32 as ``single``
        # and ``nd`` take it in mixed precision (FSDP2 leaves the root's output in bf16)
        with loss_parallel():
            loss = _local(self.forward_backward(x, y, module=lambda x: self.model(x).float()))
        if self.dp > 1 and not self.fsdp:  # FSDP2 reduce-scatters the gradients in backward
            with tl.span("all_reduce"):
                locals_ = [_LocalGrad(p) for p in self.params]
                reduce_gradients(locals_, self.mesh.comm(DP))
        with tl.span("optimizer"):
            self.optimizer.step()
        return self.mean_loss(loss, self.mesh.group(DP))

    def memory(self):
        mem = {"parameters": storage_bytes(_local(p) for p in self.params),
               "gradients": storage_bytes(_local(p.grad) for p in self.params
                                          if p.grad is not None),
               "optimizer": storage_bytes(_local(v) for v in optimizer_tensors(self.optimizer))}
        mem["activations"] = self.meter.peak
        mem["comm_buffers"] = 0
        return mem

    def comms(self):
        return [self.mesh.comm(DP)]

    def full_state_dict(self):
        return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone()
                for k, v in self.model.state_dict().items()}


class _LocalGrad:
    """A parameter seen through its local shard, for ``reduce_gradients``."""

    def __init__(self, p: torch.Tensor):
        self.grad = _local(p.grad)
