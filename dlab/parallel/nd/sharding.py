"""Data parallelism over the data ranks of one stage, with ZeRO stage 0-3, for a run whose step
is a pipeline schedule of micro-batches.

It is built from the parts of ``dlab.parallel.zero``: the same flat units (``FlatUnit``: one
per transformer block, a root for the rest, padded to a multiple of the group), the same fp32
masters (the owned chunk, a view in stages 1-2, a tensor of its own in stage 3), the same
free/allocate of a unit's storage. What differs from the single-dimension ``zero1..3`` is when
gradients are reduced. A step here runs m micro-batches, and a unit's gradient is complete only
after the last one, so every stage accumulates the *whole* gradient of its units into one flat
buffer per unit (``.grad`` are views of it, DDP's ``gradient_as_bucket_view``) and
reduce-scatters it once, after the schedule. That is torchtitan's FSDP under a pipeline
(gradient sync only on the last micro-batch) and why DeepSpeed refuses ZeRO-2 with its
pipeline engine: with micro-batches, stage 2 cannot shard the accumulating gradient, only drop
it after the reduction (so its gradient memory is stage 1's during the step and 1/N after it).

- stage 0: the gradients are all-reduced (one flat message), every rank steps the whole model.
- stage 1: reduce-scatter each unit's flat gradient, step the owned chunk, all-gather the
  parameters; the flat gradients stay allocated between steps (as ZeRO-1's full gradients).
- stage 2: as stage 1, the flat gradients freed after the reduce-scatter.
- stage 3: as stage 2, and between uses a block holds only its shard: it is gathered before
  each micro-batch's forward and again before its backward, and freed after each (Zhao et al.,
  "PyTorch FSDP", sec. 3). The root unit is gathered for the whole step, as FSDP's root.

Mixed precision (``precision``, ``dlab.parallel.mixed``): the model's parameters (the flat
buffers) are in the compute dtype; the optimizer steps fp32 masters, one per owned chunk
(ZeRO >= 1) or per parameter (stage 0), which are its own parameters: a checkpoint of the
optimizer's parameters saves the masters, and ``after_step`` refreshes the compute copies (the
owned chunk, then the all-gather of stages 1-2) from them. Gradients are accumulated and
reduced in the precision's gradient dtype: bf16 (``bf16``, ``fp16``) in the flat buffers the
``.grad`` view, fp32 (``bf16-fp32-grads``) in flat buffers that ``p.main_grad`` views.
Offload stays the single-dimension ``zero*`` strategies' lesson.

Communication buffers: every buffer that lives only for the step is registered with the rank's
``Transient`` (shared with the pipeline executor's receives, so ``comm_buffers`` is one peak of
everything at once; ``dlab.theory.nd_buffers`` derives it): stage 3's gathered units
(``unit``), stages 2-3's flat gradients and stage 0's flat all-reduce message (``reduce``), the
fp32 gradient copies handed to the optimizer where gradients are 2-byte (``master_grad``).
Stage 1's flat gradients are kept between steps: they are ``gradients``, not transient.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dlab.comm.instrumented import Comm
from dlab.core.metrics import Transient, storage_bytes
from dlab.core.precision import PRECISIONS, Precision
from dlab.parallel.grads import reduce_gradients
from dlab.parallel.mixed import MainGrads, fp32_master, grad_dtype, refresh
from dlab.parallel.zero.flat import FlatUnit

Group = tuple[str, nn.Module | None, list[tuple[str, nn.Parameter]]]


def stage_groups(stages) -> list[Group]:
    """``(unit name, block module or None, [(name, parameter)])`` for this rank's stages: one per
    block, then a root of the rest (embedding, head, the tied matrix once), root first. Names
    are the single model's."""
    named: dict[str, nn.Parameter] = {}
    for st in stages:
        named.update(st.named_full_parameters())
    by_id = {id(p): n for n, p in named.items()}
    groups, claimed = [], set()
    for st in stages:
        for i, block in zip(st.block_range, st.blocks, strict=True):
            params = [(by_id[id(p)], p) for p in block.parameters() if id(p) in by_id]
            claimed |= {id(p) for _, p in params}
            groups.append((f"block{i}", block, params))
    root = [(n, p) for n, p in named.items() if id(p) not in claimed]
    return ([("root", None, root)] if root else []) + groups


class DataSharding:
    """ZeRO stage ``stage`` over ``comm`` (the data ranks: dp x cp) for the parameters of
    ``groups``. ``optimizer_params`` are what the optimizer steps; ``begin_step``, then the
    schedule, then ``reduce``, ``hand_grads``, the optimizer's step (one for every
    sharding of the rank) and ``after_step``. Transient buffers are counted in ``transient``."""

    def __init__(self, stage: int, groups: list[Group], comm: Comm, device: torch.device,
                 timeline, transient: Transient, divide_by: int | None = None,
                 precision: Precision = PRECISIONS["fp32"]):
        self.stage, self.comm, self.n, self.tl = stage, comm, comm.size, timeline
        self.transient = transient
        self.prec, self.mixed, self.grad_dtype = precision, precision.mixed, grad_dtype(precision)
        #: fp32 accumulation beside bf16 parameters (``bf16-fp32-grads``)
        self.main = self.mixed and self.grad_dtype != precision.compute
        #: the summed gradient is divided by this: the data ranks whose losses it covers (an
        #: expert's gradient arrives summed over its ep group already, so it is reduced over
        #: dp x cp / ep ranks and divided by dp x cp)
        self.divide_by = divide_by or comm.size
        self.named = [(name, p) for _, _, ps in groups for name, p in ps]
        self.params = [p for _, p in self.named]
        self.units: list[FlatUnit] = []
        self.main_grads = MainGrads(self.params) if self.main else None
        self.masters: list[nn.Parameter] = []
        if stage == 0:
            if self.mixed:  # one master per parameter, taken before the cast
                self.masters = [fp32_master(p) for p in self.params]
                for p in self.params:
                    p.data = p.data.to(precision.compute)
            return
        self.units = [FlatUnit(name, mod, ps, self.n, comm.rank, precision.compute, device)
                      for name, mod, ps in groups]
        for u in self.units:
            u.shard = u.flat[u.owned].clone() if stage == 3 else u.flat[u.owned]
            # fp32: the master is the owned chunk itself; mixed: an fp32 copy of its own
            u.master = fp32_master(u.initial_shard) if self.mixed else nn.Parameter(u.shard)
            del u.initial_shard
            u.grad_shard = torch.zeros(u.shard_numel, dtype=self.grad_dtype, device=device)
            u.flat_grad = None
        self.masters = [u.master for u in self.units] if self.mixed else []
        if stage == 3:
            for u in self.units:
                u.free()
                if u.module is not None:
                    u.module.register_forward_pre_hook(lambda _m, args, u=u: self._before_forward(u, args))
                    u.module.register_forward_hook(lambda _m, _a, out, u=u: self._after_forward(u, out))

    def optimizer_params(self) -> list[nn.Parameter]:
        if self.units:
            return [u.master for u in self.units]
        return self.masters if self.mixed else self.params

    def master_grads(self) -> list[torch.Tensor]:
        """The fp32 gradients the optimizer is about to read (for the loss scaler)."""
        return [m.grad for m in self.optimizer_params() if m.grad is not None]

    # --- stage 3: a block whole only while it computes ---------------------------------------
    def _gather(self, u: FlatUnit) -> None:
        if not u.gathered:
            u.allocate()
            self.transient.held("unit", u.flat)
            with self.tl.span("all_gather", unit=u.name):
                self.comm.all_gather_into_tensor(u.flat, u.shard)

    def _before_forward(self, u: FlatUnit, args) -> None:
        self._gather(u)
        x = args[0]
        if x.requires_grad:  # the input's gradient is complete when the block's backward is
            x.register_hook(lambda g, u=u: (u.free(), g)[1])

    def _after_forward(self, u: FlatUnit, out) -> None:
        u.free()
        if out.requires_grad:  # gather again just before this block's backward
            out.register_hook(lambda g, u=u: (self._gather(u), g)[1])

    # --- the step ----------------------------------------------------------------------------
    def begin_step(self, optimizer) -> None:
        """Zero the gradients: fresh flat buffers the ``.grad`` of each unit view (kept from
        the last step in stage 1, allocated for the step and counted as transient in stages
        2-3); stage 3 gathers its root unit for the whole step."""
        if not self.units:
            optimizer.zero_grad(set_to_none=True)
            for p in self.params:
                p.grad = None
                if self.main:
                    p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            return
        for u in self.units:
            if u.flat_grad is None:
                u.flat_grad = torch.zeros(u.padded, dtype=self.grad_dtype, device=u.grad_shard.device)
                if self.stage >= 2:
                    self.transient.held("reduce", u.flat_grad)
            else:
                u.flat_grad.zero_()
            if self.main:
                for s in u.slots:
                    s.param.main_grad = u.flat_grad[s.offset:s.offset + s.numel].view(s.shape)
            else:
                u.flat_grad_views(u.flat_grad)
            if self.stage == 3 and u.module is None:
                self._gather(u)

    def reduce(self) -> None:
        """Average the gradients over the data ranks: an all-reduce (stage 0) or a
        reduce-scatter of each unit into its owned chunk."""
        self.fold()
        if not self.units:
            with self.tl.span("all_reduce", what="dp"):
                reduce_gradients(self.params, self.comm, self.divide_by, self.transient)
            return
        for u in self.units:
            with self.tl.span("reduce_scatter", unit=u.name):
                self.comm.reduce_scatter_tensor(u.grad_shard, u.flat_grad.div_(self.divide_by))
            if self.stage >= 2:
                for p in u.params:
                    p.grad = None
                    if self.main:
                        p.main_grad = None
                self.transient.free(u.flat_grad)  # not left to Gloo's last reference
                u.flat_grad = None
            if self.stage == 3 and u.module is None:
                u.free()

    def fold(self) -> None:
        """``bf16-fp32-grads``: take any gradient still in ``.grad`` into the fp32 buffer."""
        if self.main_grads is not None:
            self.main_grads.fold()

    def grad(self, p: nn.Parameter) -> torch.Tensor:
        """The tensor ``p``'s gradient accumulates in: ``.grad``, or the fp32 ``main_grad``."""
        return p.main_grad if self.main else p.grad

    def hand_grads(self) -> None:
        """Give each master its reduced gradient (the optimizer steps next): the reduced shard
        itself where it is fp32, else an fp32 copy, a transient buffer until ``after_step``
        drops it."""
        for u in self.units:
            u.master.grad = self._fp32(u.grad_shard)
        if not self.units and self.mixed:
            for p, m in zip(self.params, self.masters, strict=True):
                m.grad = self._fp32(self.grad(p))

    def _fp32(self, grad: torch.Tensor) -> torch.Tensor:
        if grad.dtype == torch.float32:
            return grad
        return self.transient.held("master_grad", grad.float())

    def after_step(self) -> None:
        """Refresh the compute copies from the updated masters, then (stages 1-2) all-gather
        the whole replica."""
        if not self.units and self.mixed:
            for p, m in zip(self.params, self.masters, strict=True):
                refresh(p, m)
                m.grad = None
        for u in self.units:
            u.master.grad = None
            if self.mixed:
                refresh(u.shard, u.master)
            if self.stage in (1, 2):  # every rank needs the whole updated replica
                with self.tl.span("all_gather", unit=u.name):
                    self.comm.all_gather_into_tensor(u.flat, u.shard)

    # --- reports -----------------------------------------------------------------------------
    def memory(self) -> dict[str, int]:
        """Parameters and gradients counted from the storages held after the step (the
        optimizer's state is the rank's, counted once by the strategy)."""
        shards = [u.shard for u in self.units]
        grads = [g for p in self.params for g in (p.grad, getattr(p, "main_grad", None))
                 if g is not None]
        return {"parameters": storage_bytes(self.params + shards),
                "gradients": storage_bytes(grads + [u.grad_shard for u in self.units]),
                "optimizer": storage_bytes(self.masters)}

    def full_params(self) -> dict[str, torch.Tensor]:
        """This rank's parameters (its tensor-parallel shards) whole over the data ranks,
        under the single model's names; stage 3 gathers them from the shards, mixed precision
        from the fp32 masters, the exact values (raw backend: checkpoint traffic, not the
        step's)."""
        if not self.units and self.mixed:
            return {name: m.detach() for (name, _), m in zip(self.named, self.masters, strict=True)}
        if self.stage != 3 and not self.mixed:
            return {name: p.detach() for name, p in self.named}
        out = {}
        for u in self.units:
            full = torch.empty(u.padded, device=u.shard.device)
            source = u.master if self.mixed else u.shard
            dist.all_gather_into_tensor(full, source.detach(), group=self.comm.group)
            out.update(u.unflatten(full))
        return out
