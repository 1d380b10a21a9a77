"""What the three ZeRO stages share: flat units, fp32 master shards, the sharded optimizer step,
the memory accounting by category, and the gathering of full parameters for a checkpoint.

ZeRO (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", SC 2020) removes the redundancy of data parallelism in three steps. With Psi
parameters, N ranks and K bytes of optimizer state per parameter, a rank holds (section 5):

    DDP      2 Psi + 2 Psi + K Psi          (bf16 weights, bf16 grads, K = 12 for Adam:
    stage 1  2 Psi + 2 Psi + K Psi / N       fp32 master 4 + momentum 4 + variance 4)
    stage 2  2 Psi + 2 Psi / N + K Psi / N
    stage 3  (2 + 2 + K) Psi / N

Here every unit's optimizer runs on rank r's chunk only: one fp32 ``nn.Parameter`` per owned
chunk (the *master*), so ``torch.optim.Adam`` keeps exactly 8 bytes per owned element plus one
step counter per unit. In fp32 the master *is* the owned chunk of the parameters (a view, or the
shard itself in stage 3) and K = 8; with ``mixed_precision`` the model computes in bf16 and the
master is a separate fp32 copy counted with the optimizer state, K = 12.

``options``: ``mixed_precision`` (bool, default False), ``offload_optimizer`` (bool, default
False: masters and Adam state live in host memory and the step runs there; on a CPU-only
machine the move is a no-op and the bytes are reported as ``offloaded`` instead of
``optimizer``), ``reduce_scatter`` (``"backend"``, default, or ``"ring"``: dlab's own ring
reduce-scatter of the gradients, (N-1)/N of them per rank where Gloo's reduce-scatter, a whole
all-reduce, writes twice that; it runs synchronously, so it does not overlap backward), and
stage-specific ones (``prefetch`` for stage 3).

Memory, counted from the tensors held when ``memory()`` is called (after the step):
``parameters`` what a rank keeps between steps (full replica in stages 1-2, shards in stage 3),
``gradients`` likewise, ``optimizer`` masters (mixed precision) and Adam state, ``activations``
the peak of saved tensors, ``comm_buffers`` the peak during the step of transient buffers,
read from their storages (``Transient``; ``gathered_peak`` and ``reduce_peak``, extra keys, are
its two main parts on their own):
gathered units (stage 3), flattened gradients being reduced, send copies for all-gathers, and
the fp32 gradient copies handed to the optimizer. ``padding`` (extra key) is the padded
elements' bytes included in the model-state categories.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dlab.comm.host import host_copies_done, pinned, to_host
from dlab.comm.instrumented import reduce_scatter_option
from dlab.core.metrics import ActivationMeter, Transient, optimizer_tensors, storage_bytes
from dlab.models.data import shard
from dlab.parallel.base import REDUCE_SCATTER, Option, Strategy, data_parallel_problems
from dlab.parallel.zero.flat import FlatUnit, build_units
from dlab.runtime import checkpoint
from dlab.theory import memory

BOOL_OPTIONS = {
    "mixed_precision": Option("bool", "compute in bf16 with fp32 master weights", default=False),
    "offload_optimizer": Option("bool", "keep the optimizer state in CPU memory", default=False),
}


class Pending:
    """An async ``Comm`` op; ``wait()`` puts its span (launch to completion seen) on the
    timeline. Gloo's reduce-scatter and all-gather have no completion future, so the end is
    when the step waited for it: the span shows the overlap window, an upper bound on the
    transfer itself."""

    def __init__(self, timeline, kind: str, work, fields: dict):
        self.timeline, self.kind, self.work, self.fields = timeline, kind, work, fields
        self.start = timeline.now()

    def wait(self) -> None:
        self.work.wait()
        self.timeline.add(self.kind, self.start, self.timeline.now(), **self.fields)


class UnitActivationMeter(ActivationMeter):
    """The activation meter with parameters told apart by what they are, not by where their
    storage was at construction: in stage 3 a unit's storage is freed and re-allocated every
    step, so a saved weight (or a view of it, as ``weight.t()`` in a linear layer) is
    recognised as an ``nn.Parameter`` or as living in a currently gathered unit's buffer."""

    def __init__(self, units: list[FlatUnit]):
        super().__init__()
        self.units = units

    def skip(self, t: torch.Tensor) -> bool:
        if super().skip(t) or isinstance(t, nn.Parameter):
            return True
        ptr = t.untyped_storage().data_ptr()
        return bool(ptr) and any(u.gathered and u.storage_ptr() == ptr for u in self.units)


class ZeroStrategy(Strategy):
    """Base of ``zero1`` / ``zero2`` / ``zero3``; a subclass supplies the gradient and
    parameter handling around the shared step."""

    @classmethod
    def replica_zero(cls) -> int:
        return cls.stage

    stage = 0
    OPTIONS = {**BOOL_OPTIONS, **REDUCE_SCATTER}

    @classmethod
    def problems(cls, config):
        return super().problems(config) + data_parallel_problems(config, config.world_size)

    @classmethod
    def predicted_state(cls, config, rank):
        """dlab's exact ZeRO accounting (``dlab.theory.memory.zero_memory``: padding and Adam's
        step counters included) of the units this rank owns."""
        state = memory.zero_memory(memory.model_units(config.model, config.model_options),
                                   config.world_size, cls.stage,
                                   config.options.get("mixed_precision", False), config.optimizer,
                                   rank)
        return {k: state[k] for k in ("parameters", "gradients", "optimizer")}

    # --- setup ------------------------------------------------------------------------------
    def setup(self) -> None:
        ctx, opts = self.ctx, self.ctx.config.options
        self.mixed = opts.get("mixed_precision", False)
        ctx.comm.reduce_scatter_algorithm = reduce_scatter_option(ctx.config)
        self.offload = opts.get("offload_optimizer", False)
        self.dtype = torch.bfloat16 if self.mixed else torch.float32
        self.opt_device = torch.device("cpu") if self.offload else ctx.device
        self.n = ctx.world_size
        self.model = self.build_model()
        self.units = build_units(self.model, self.n, ctx.rank, self.dtype, ctx.device)
        self.shard_storage = self.stage == 3
        self.separate_master = self.mixed or self.opt_device != ctx.device
        for u in self.units:
            # The compute-precision shard: a view of the full buffer (stages 1-2, which keep
            # the replica), or a tensor of its own (stage 3, which frees the replica).
            u.shard = u.flat[u.owned].clone() if self.shard_storage else u.flat[u.owned]
            u.master = nn.Parameter(self._master_copy(u.initial_shard) if self.separate_master
                                    else u.shard)
            del u.initial_shard
            u.grad_shard = None
        self.optimizer = self.build_optimizer([u.master for u in self.units])
        self.transient = Transient()
        self.meter = UnitActivationMeter(self.units)
        self.unit_of = {id(p): u for u in self.units for p in u.params}

    # --- the step -----------------------------------------------------------------------------
    def step(self, batch):
        x, y = (t.to(self.ctx.device) for t in shard(batch, self.ctx.rank, self.n))
        tl = self.ctx.timeline
        self.transient.reset_peak()
        self.meter.reset_peak()
        self.before_forward()
        with tl.span("forward"), self.meter.track():
            logits = self.model(x)
            loss = self.model.criterion(logits.float() if self.mixed else logits, y)
        with tl.span("backward"):
            loss.backward()
        with tl.span("comm_wait"):
            self.after_backward()
        with tl.span("optimizer"):
            self.optimizer_step()
        self.after_step()
        return self.mean_loss(loss)

    def before_forward(self) -> None:
        pass

    def after_backward(self) -> None:
        """Leave every unit's reduced, averaged gradient shard in ``u.grad_shard``."""
        raise NotImplementedError

    def after_step(self) -> None:
        pass

    def _master_copy(self, initial: torch.Tensor) -> torch.Tensor:
        """The fp32 master of a chunk: on the GPU beside the model, or, offloaded from a GPU,
        in pinned host memory so the copy back after each step does not block the host."""
        if self.offload:
            return pinned(initial.float(), self.ctx.device)
        return initial.to(self.opt_device, torch.float32, copy=True)

    def optimizer_step(self) -> None:
        """Adam on the owned chunks only. The master's gradient is the reduced shard itself
        where dtypes and devices agree (fp32, no offload); otherwise an fp32 copy on the
        optimizer's device that lives for the step (counted as a transient buffer). Offloaded
        from a GPU, every unit's copy is enqueued into pinned memory first and waited for once
        (``dlab.comm.host``), and the updated chunks go back without a wait: the next forward
        runs on the same stream, after them."""
        for u in self.units:
            if not self.separate_master:
                u.master.grad = u.grad_shard
            elif self.offload:
                u.master.grad = self.transient.held("master_grad", to_host(u.grad_shard, torch.float32))
            else:
                u.master.grad = self.transient.held(
                    "master_grad", u.grad_shard.to(self.opt_device, torch.float32, copy=True))
        if self.offload:
            host_copies_done(self.ctx.device)
        self.optimizer.step()
        for u in self.units:
            if self.separate_master:  # cast to bf16 / move back to the device
                u.shard.copy_(u.master.detach(), non_blocking=self.offload)
            u.master.grad = None

    # --- collectives with timeline events -----------------------------------------------------
    def launch(self, kind: str, work, **fields) -> Pending:
        return Pending(self.ctx.timeline, kind, work, fields)

    def reduce_scatter_async(self, u: FlatUnit, flat_grad: torch.Tensor):
        """Average ``flat_grad`` over ranks into ``u.grad_shard``: each rank's gradient is
        divided by N first, then summed (as DDP averages)."""
        flat_grad.div_(self.n)
        work = self.ctx.comm.reduce_scatter_tensor(u.grad_shard, flat_grad, async_op=True)
        return self.launch("reduce_scatter", work, unit=u.name)

    def gather_async(self, u: FlatUnit, source: torch.Tensor):
        work = self.ctx.comm.all_gather_into_tensor(u.flat, source, async_op=True)
        return self.launch("all_gather", work, unit=u.name)

    # --- reports --------------------------------------------------------------------------------
    def memory(self):
        params = list(self.model.parameters())
        shards = [u.shard for u in self.units]
        opt = optimizer_tensors(self.optimizer)
        if self.separate_master:
            opt += [u.master for u in self.units]
        mem = {
            "parameters": storage_bytes(params + shards),
            "gradients": storage_bytes([p.grad for p in params if p.grad is not None]
                                       + [u.grad_shard for u in self.units if u.grad_shard is not None]),
            "optimizer": storage_bytes(opt),
            "activations": self.meter.peak,
            "comm_buffers": self.transient.peak,
        }
        if self.offload:
            mem["offloaded"], mem["optimizer"] = mem["optimizer"], 0
        mem["padding"] = self.padding_bytes()
        # The parts of comm_buffers the tests hold to their bounds: gathered units at once
        # (stage 3: root + 1 block, + 1 with prefetch) and flattened gradients in flight.
        mem["gathered_peak"] = self.transient.kind_peak.get("unit", 0)
        mem["reduce_peak"] = self.transient.kind_peak.get("reduce", 0)
        return mem

    def padding_bytes(self) -> int:
        """Bytes of padding inside the parameters, gradients and optimizer state this rank
        holds, read from the storages themselves: a storage the size of a whole unit (the full
        flat buffer, stage 1's flat gradient) holds the unit's padding, one the size of a chunk
        (a shard, a gradient shard, a master, its optimizer state) holds this rank's part of
        it; anything else (a step counter) holds none. Each storage is counted once."""
        total, seen = 0, set()
        for u in self.units:
            own = max(0, u.owned.stop - max(u.owned.start, u.numel))
            held = [u.flat, u.shard, u.grad_shard, getattr(u, "flat_grad", None), u.master,
                    *(p.grad for p in u.params), *self.optimizer.state.get(u.master, {}).values()]
            for t in held:
                if not isinstance(t, torch.Tensor) or t.untyped_storage().nbytes() == 0:
                    continue
                storage = t.untyped_storage()
                if (t.device, storage.data_ptr()) in seen:
                    continue
                seen.add((t.device, storage.data_ptr()))
                elements = storage.nbytes() // t.element_size()
                pad = u.padding if elements == u.padded else own if elements == u.shard_numel else 0
                total += pad * t.element_size()
        return total

    # --- checkpoints ----------------------------------------------------------------------------
    def checkpoint_state(self):
        """This rank's cut of every parameter and of its Adam moments, as pieces at their flat
        offsets in the single model's tensors (fp32 masters: the exact values), so the
        checkpoint loads at any world size or layout. Padding is not saved: it is zero."""
        params, optim = {}, {}
        for u in self.units:
            state = self.optimizer.state.get(u.master, {})
            master = u.master.detach()
            for s, start, at, n in u.owned_cuts():
                params[s.name] = checkpoint.piece(master[at:at + n], start, s.shape)
                optim[s.name] = {k: checkpoint.piece(v[at:at + n], start, s.shape) if v.dim()
                                 else v.detach().clone() for k, v in state.items()}
        hparams = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        return {"params": params, "optim": optim, "hparams": hparams}

    def load_checkpoint_state(self, reader) -> None:
        with torch.no_grad():
            for u in self.units:
                master = u.master.detach()
                keys = set().union(*(reader.keys(s.name) for s in u.slots))
                state = {k: torch.zeros_like(master) for k in keys if k != "step"}
                for s, start, at, n in u.owned_cuts():
                    master[at:at + n].copy_(reader.range("params", s.name, start, n))
                    for k in state:
                        state[k][at:at + n].copy_(reader.range("optim", s.name, start, n, k))
                if "step" in keys:  # one counter per unit; every parameter's is the same
                    state["step"] = reader.tensor("optim", u.slots[0].name, "step").clone()
                if state:
                    self.optimizer.state[u.master] = state
                if self.separate_master:
                    u.shard.copy_(master)
                if not self.shard_storage:  # stages 1-2 keep the full replica between steps
                    for s in u.slots:
                        u.flat[s.offset:s.offset + s.numel].copy_(reader.tensor("params", s.name).reshape(-1))
        for group, hparams in zip(self.optimizer.param_groups, reader.hparams()):
            group.update(hparams)

    def full_state_dict(self):
        """Every parameter at full size in fp32, gathered from the masters (the optimizer's
        copy, the exact one in mixed precision), under the single model's names."""
        out = {}
        for u in self.units:
            full = torch.empty(u.padded, dtype=torch.float32, device=self.ctx.device)
            dist.all_gather_into_tensor(full, u.master.detach().to(self.ctx.device, torch.float32))
            out.update({k: v.cpu().clone() for k, v in u.unflatten(full).items()})
        return out
