"""The ``tp`` strategy: Megatron-style tensor parallelism, optionally with sequence parallelism,
combined with data parallelism when there are more ranks than the tensor-parallel degree.

``options``: ``tp`` (the tensor-parallel degree t, default: every rank), ``sequence_parallel``
(default False) and ``reduce_scatter`` (``"backend"``, default, or ``"ring"``: sequence
parallelism's reduce-scatters by dlab's own ring, (N-1)/N of the input per rank where Gloo's, a
whole all-reduce, writes twice that). Ranks form a ``Mesh({"dp": world/t, "tp": t})``: the t
ranks of one tensor-parallel group are adjacent (on one node, where the bandwidth is) and take
the same data-parallel slice of the global batch; the data-parallel replicas all-reduce their
gradients after backward, like plain DDP.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from dlab.comm.instrumented import reduce_scatter_option
from dlab.models.data import shard
from dlab.core.metrics import ActivationMeter, model_state_memory
from dlab.parallel import register
from dlab.parallel.base import REDUCE_SCATTER, Option, Strategy, data_parallel_problems
from dlab.parallel.mesh import Mesh
from dlab.parallel.tensor.model import TensorParallelGPT

OPTIONS = {
    "tp": Option("int", "the tensor-parallel degree (default: every rank)", minimum=1),
    "sequence_parallel": Option("bool", "split the sequence in the norms and dropout regions "
                                "(Korthikanti et al.)", default=False),
    **REDUCE_SCATTER,
}


def tp_options(config) -> tuple[int, bool]:
    return int(config.options.get("tp", config.world_size)), bool(
        config.options.get("sequence_parallel", False))


def tensor_parallel_problems(config) -> list[str]:
    """The checks ``tp`` and ``torch-tp`` share: what must divide by the tensor-parallel degree."""
    if config.model != "gpt":
        return [f"tensor parallelism here splits the GPT's heads, MLP and vocabulary; use "
                f"model='gpt' (got {config.model!r})"]
    tp, sp = tp_options(config)
    p = []
    if config.world_size % tp:
        p.append(f"world_size={config.world_size} is not a multiple of tp={tp}; use a "
                 f"world_size that tp divides (tp x dp ranks), or a tp that divides it")
    mc = config.model_config()
    p += model_split_problems(mc, tp)
    if sp and mc.seq_len % tp:
        p.append(f"model option seq_len={mc.seq_len} is not divisible by tp={tp} (sequence "
                 f"parallelism splits the sequence); use a multiple of {tp} or "
                 f"sequence_parallel=False")
    if not p:
        p += data_parallel_problems(config, config.world_size // tp)
    return p


def model_split_problems(mc, tp: int) -> list[str]:
    """What of the GPT's shape a tensor-parallel degree ``tp`` must divide."""
    p = []
    for field, why in (("n_head", "attention is split by heads"),
                       ("d_ff", "the MLP's hidden layer is split by columns"),
                       ("vocab_size", "the embedding and output layer are split by vocabulary")):
        value = getattr(mc, field)
        if value % tp:
            p.append(f"model option {field}={value} is not divisible by tp={tp} ({why}); "
                     f"use a multiple of {tp} or another tp")
    return p


def all_reduce_grads(params: list[torch.Tensor], comm, average: bool) -> None:
    """Sum (or average) the gradients of ``params`` over ``comm``'s group in one flat message."""
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat.div_(comm.size) if average else flat)
    for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(part.view_as(g))


@register("tp")
class TensorParallel(Strategy):
    """Megatron-LM tensor parallelism (Shoeybi et al. 2019) with optional sequence parallelism
    (Korthikanti et al. 2022), written on dlab's own f / g operators; TP x DP through a mesh."""

    OPTIONS = OPTIONS

    @classmethod
    def problems(cls, config):
        return super().problems(config) + tensor_parallel_problems(config)

    def setup(self) -> None:
        cfg = self.ctx.config
        self.tp, self.sp = tp_options(cfg)
        self.dp = self.ctx.world_size // self.tp
        self.mesh = Mesh({"dp": self.dp, "tp": self.tp}, device_type=self.ctx.device.type)
        self.tp_comm, self.dp_comm = self.mesh.comm("tp"), self.mesh.comm("dp")
        self.tp_comm.reduce_scatter_algorithm = reduce_scatter_option(cfg)
        full = self.build_model()  # same weights on every rank; each keeps its shard
        self.model = TensorParallelGPT(full, self.tp_comm, self.sp).to(self.ctx.device)
        del full
        self.params = list(self.model.parameters())
        self.sp_params = self.model.sequence_parallel_params()
        self.optimizer = self.build_optimizer(self.params)
        self.meter = ActivationMeter(self.params)

    def step(self, batch):
        x, y = (t.to(self.ctx.device) for t in shard(batch, self.mesh.rank("dp"), self.dp))
        tl = self.ctx.timeline
        self.optimizer.zero_grad()
        self.meter.reset_peak()
        loss = self.forward_backward(x, y)
        if self.sp_params and self.tp > 1:
            # Under sequence parallelism each rank's layer norms, biases and positions saw only
            # its tokens: sum the partial gradients (one flat all-reduce per step).
            with tl.span("all_reduce", what="sequence_parallel"):
                all_reduce_grads(self.sp_params, self.tp_comm, average=False)
        if self.dp > 1:
            with tl.span("all_reduce"):  # data parallelism: average over the replicas
                all_reduce_grads(self.params, self.dp_comm, average=True)
        with tl.span("optimizer"):
            self.optimizer.step()
        return self.mean_loss(loss, self.mesh.group("dp"))

    def memory(self):
        mem = model_state_memory(self.params, self.optimizer)
        mem["activations"] = self.meter.peak
        mem["comm_buffers"] = 0
        return mem

    def comms(self):
        return [self.tp_comm, self.dp_comm]

    def full_state_dict(self):
        return gather_full_state(self.model, self.mesh.group("tp"))


def gather_full_state(model: TensorParallelGPT, group) -> dict[str, torch.Tensor]:
    """Every parameter at full size under ``GPT``'s names, on every rank. Uses the raw backend,
    not ``Comm``: this is checkpoint traffic, not the training step's."""
    return {name: gather_shards(p, model.shard_dim(name), group).cpu().clone()
            for name, p in model.state_dict().items()}


def gather_shards(t: torch.Tensor, dim: int | None, group) -> torch.Tensor:
    """The full tensor whose shards along ``dim`` the ranks of ``group`` hold (``t`` itself if
    ``dim`` is None: a parameter whole on every rank). Raw backend, like the caller."""
    t = t.detach()
    size = dist.get_world_size(group)
    if dim is None or size == 1:
        return t
    local = t.movedim(dim, 0).contiguous()
    full = local.new_empty((size * local.shape[0], *local.shape[1:]))
    dist.all_gather_into_tensor(full, local, group=group)
    return full.movedim(0, dim)
