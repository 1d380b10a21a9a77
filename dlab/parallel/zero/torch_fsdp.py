"""``torch-fsdp2``: PyTorch's ``fully_shard`` (FSDP2), the peer ``zero3`` is benchmarked against.

Each block is wrapped with ``fully_shard``, then the whole model (the root: embeddings, final
norm, head), as PyTorch's FSDP2 tutorial does; parameters become DTensors sharded on dim 0 (each
padded on its own, not per unit as in dlab). ``options``: ``mixed_precision`` (bf16 compute
and bf16 reduction via ``MixedPrecisionPolicy``; the sharded parameters stay fp32 and the
optimizer steps on them), ``offload_optimizer`` (``CPUOffloadPolicy(pin_memory=False)``, the
form that runs on CPU/Gloo). FSDP2 prefetches the next module's all-gather by itself.

The tied head weight: the GPT's head reads the embedding matrix through a plain reference, but
FSDP2 swaps module parameters (sharded DTensor between steps, the gathered tensor during the
step), so the head is pointed at ``model.embed.tok.weight`` as the attribute currently is.

Memory is counted from the local shards (``DTensor.to_local()``); bytes moved are not counted
(FSDP2 calls the backend directly, not through dlab's ``Comm``).
"""
from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from dlab.core.metrics import ActivationMeter, storage_bytes
from dlab.models.data import shard
from dlab.parallel import register
from dlab.parallel.base import Strategy, data_parallel_problems
from dlab.parallel.zero.flat import unit_modules
from dlab.parallel.zero.sharded import BOOL_OPTIONS


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


class ParamMeter(ActivationMeter):
    """Saved parameters are not activations. FSDP2 moves them (the gathered tensors are new
    each step), so they are recognised when saved: a Parameter, or a view (``weight.t()``) of a
    storage that a parameter of the model currently uses."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def skip(self, t: torch.Tensor) -> bool:
        if super().skip(t) or isinstance(t, torch.nn.Parameter):
            return True
        ptr = t.untyped_storage().data_ptr()
        return bool(ptr) and any(_local(p).untyped_storage().data_ptr() == ptr
                                 for p in self.model.parameters())


@register("torch-fsdp2")
class TorchFSDP2(Strategy):
    """PyTorch's FSDP2 (fully_shard per block), the peer for ZeRO-3."""

    @classmethod
    def replica_zero(cls) -> int:
        return 3  # fully_shard: parameters, gradients and optimizer state sharded (ZeRO-3)


    OPTIONS = BOOL_OPTIONS

    @classmethod
    def problems(cls, config):
        return super().problems(config) + data_parallel_problems(config, config.world_size)

    def setup(self) -> None:
        opts = self.ctx.config.options
        self.mixed = opts.get("mixed_precision", False)
        model = self.build_model()
        mesh = init_device_mesh(self.ctx.device.type, (self.ctx.world_size,))
        kwargs = {"mesh": mesh}
        if self.mixed:
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                       reduce_dtype=torch.bfloat16)
        if opts.get("offload_optimizer", False):
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
        self.model = shard_with_fsdp2(model, **kwargs)
        self.optimizer = self.build_optimizer(model.parameters())
        self.meter = ParamMeter(model)

    def step(self, batch):
        x, y = (t.to(self.ctx.device) for t in shard(batch, self.ctx.rank, self.ctx.world_size))
        tl = self.ctx.timeline
        self.optimizer.zero_grad()
        self.meter.reset_peak()
        with tl.span("forward"), self.meter.track():
            logits = self.model(x)
            loss = self.model.criterion(logits.float() if self.mixed else logits, y)
        with tl.span("backward"):
            loss.backward()
        with tl.span("optimizer"):
            self.optimizer.step()
        return self.mean_loss(loss)

    def memory(self):
        params = list(self.model.parameters())
        state = [_local(v) for s in self.optimizer.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor)]
        return {
            "parameters": storage_bytes(_local(p) for p in params),
            "gradients": storage_bytes(_local(p.grad) for p in params if p.grad is not None),
            "optimizer": storage_bytes(state),
            "activations": self.meter.peak,
            "comm_buffers": 0,
        }

    def full_state_dict(self):
        return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().cpu().clone()
                for name, p in self.model.named_parameters()}


def shard_with_fsdp2(model: torch.nn.Module, **kwargs) -> torch.nn.Module:
    """``fully_shard`` each block, then the root (``kwargs``: mesh, mp_policy, offload_policy);
    a tied head then reads the embedding's (now sharded, all-gathered on use) matrix."""
    for block in unit_modules(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    if getattr(model, "head", None) is not None and getattr(model.head, "tied_weight", False):
        model.head.projection = lambda: model.embed.tok.weight
    return model
