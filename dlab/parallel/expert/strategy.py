"""The ``ep`` strategy: expert parallelism combined with data parallelism, on the ``moe`` model.

Every rank takes its slice of the global batch, as in data parallelism, and holds every
non-expert parameter (attention, norms, embeddings, routers) plus E/n of each layer's experts.
Tokens travel to their experts' ranks and back (``dispatch``). Gradients:

- non-expert parameters saw only this rank's tokens: all-reduced, as in data parallelism;
- an expert's parameters saw every rank's tokens routed to it, through the all-to-all's
  backward: their gradient is already the sum over the global batch, and needs no collective.

Each rank's loss is the mean over its shard and is scaled by 1/n before backward, so both
kinds of gradient come out as the gradient of the global mean loss, which is what makes the
run equal to ``single`` on the same model. Memory per rank: the dense part whole, 1/n of the
experts; that is how expert counts grow past what one device holds (Switch Transformer,
Fedus et al. 2021, sec. 5).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from dlab.core.metrics import ActivationMeter, model_state_memory
from dlab.layout import Layout
from dlab.models.data import shard
from dlab.parallel import register
from dlab.parallel.base import Strategy
from dlab.parallel.expert.dispatch import global_expert_name, keep_local_experts
from dlab.parallel.grads import reduce_gradients


@register("ep")
class ExpertParallel(Strategy):
    """Expert parallelism x data parallelism: experts split over ranks, tokens sent to them
    by all-to-all."""

    trains_moe_options = True

    @classmethod
    def model_problems(cls, config):
        if config.model != "moe":
            return [f"expert parallelism splits a mixture of experts; use model='moe' "
                    f"(got {config.model!r})"]
        return []

    @classmethod
    def layout(cls, config) -> Layout:
        """Every rank a data rank, and the experts split over all of them."""
        return Layout(dp=config.world_size, ep=config.world_size)

    def setup(self) -> None:
        ctx = self.ctx
        self.model = self.build_model()
        self.combines = keep_local_experts(self.model, ctx.comm, ctx.config.model_config().n_expert,
                                           ctx.timeline)
        for block in self.model.blocks:
            block.mlp.sum_counts = self._sum_counts
        expert_ids = {id(p) for block in self.model.blocks for p in block.mlp.experts.parameters()}
        self.params = list(self.model.parameters())
        self.dense = [p for p in self.params if id(p) not in expert_ids]
        self.optimizer = self.build_optimizer(self.params)
        self.meter = ActivationMeter(self.params)

    def _sum_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """The balancing loss's per-expert counts over the whole batch (E numbers per layer)."""
        self.ctx.comm.all_reduce(counts)
        return counts

    def step(self, batch):
        tl, comm = self.ctx.timeline, self.ctx.comm
        x, y = (t.to(self.ctx.device) for t in shard(batch, self.ctx.rank, self.ctx.world_size))
        self.optimizer.zero_grad(set_to_none=True)
        self.meter.reset_peak()
        with tl.span("forward"), self.meter.track():
            loss = self.model.criterion(self.model(x), y)
        with tl.span("backward"):
            (loss / comm.size).backward()
        with tl.span("all_reduce"):  # the 1/n is in the loss already: the dense gradients' sum
            reduce_gradients(self.dense, comm, divide_by=1)
        with tl.span("optimizer"):
            self.optimizer.step()
        return self.mean_loss(loss)

    def memory(self):
        mem = model_state_memory(self.params, self.optimizer)
        mem["activations"], mem["comm_buffers"] = self.meter.peak, 0
        return mem

    def full_state_dict(self):
        """Every rank's experts gathered (as objects, outside the counted traffic) under the
        names they have in the single model."""
        mine = {}
        for name, t in self.model.state_dict().items():
            if ".experts." in name:
                name = global_expert_name(name, self.model.blocks[int(name.split(".")[1])].mlp.first_expert)
            mine[name] = t.detach().cpu().clone()
        everyone = [None] * self.ctx.world_size
        dist.all_gather_object(everyone, mine)
        return {k: v for part in everyone for k, v in part.items()}
