"""The ``cp`` strategy: context parallelism. Every rank holds the whole model and the whole
global batch's rows, but only its share of each sequence's tokens (``layout``).

Everything outside attention is per token, so it runs on the local tokens unchanged: the
embedding (at the tokens' true positions), layer norms, MLPs, the head and the loss. Attention
is the one place tokens meet, and it is replaced by a cross-rank version (``attention``). Each
rank's loss is the mean over its tokens; the ranks hold equally many, so the global mean is
the mean of the local ones, and the parameter gradients are all-reduced (summed, each local
loss scaled by 1/n) exactly as in data parallelism, since every rank's gradient covers
different tokens of the same model.

What it buys: activation memory per rank falls as 1/n with the ring (long sequences fit), at
the price of K/V traffic per layer, which grows with the sequence, not with the model.

``options``: ``attention`` = ``"ring"`` (default), ``"allgather"``, ``"ulysses"`` (all-to-all
to a head split: cp must divide n_head) or ``"usp"`` (Ulysses inside groups of ``ulysses``
consecutive cp ranks, default 2, the ring across the groups); ``layout`` = ``"zigzag"``
(default) or ``"contiguous"``; ``cp`` = the context-parallel degree (default: every rank);
``reduce_scatter`` = ``"backend"`` (default) or ``"ring"`` (the all-gather attention's backward
reduce-scatter by dlab's own ring, half the bytes of Gloo's). With fewer, the layout is dp =
world / cp x cp (``dlab.layout``): each group of cp adjacent ranks shares a slice of the batch
and splits its sequences (CP x DP). The gradient reduction (``dlab.parallel.grads``) then runs
over every rank, since each one's gradient covers different tokens.
"""
from __future__ import annotations

from dlab.comm.instrumented import reduce_scatter_option
from dlab.core.metrics import ActivationMeter
from dlab.layout import CP, DP, Layout, tokens
from dlab.models.data import shard
from dlab.parallel import register
from dlab.parallel.base import REDUCE_SCATTER, Option, WholeModel
from dlab.parallel.context.core import ATTENTION, ULYSSES, apply_context_parallel
from dlab.parallel.grads import reduce_gradients
from dlab.parallel.mesh import Mesh


@register("cp")
class ContextParallel(WholeModel):
    """Context parallelism: each rank holds a share of every sequence; attention by ring,
    all-gather, Ulysses or USP."""

    OPTIONS = {
        "attention": Option("choice", "how attention sees the other ranks' keys and values",
                            default=Layout().cp_attention, choices=tuple(ATTENTION)),
        "layout": Option("choice", "how a sequence is cut over the ranks", default=Layout().cp_layout,
                         choices=tokens.LAYOUTS),
        "cp": Option("int", "the context-parallel degree (default: every rank)", minimum=1),
        "ulysses": ULYSSES,
        **REDUCE_SCATTER,
    }

    @classmethod
    def model_problems(cls, config):
        if config.model != "gpt":
            return [f"context parallelism splits a sequence; use model='gpt' (got {config.model!r})"]
        return []

    @classmethod
    def layout(cls, config) -> Layout:
        return Layout.from_options({CP: config.world_size, **config.options}, config.world_size)

    def setup(self) -> None:
        ctx = self.ctx
        lay = self.layout(ctx.config)
        self.dp = lay.dp
        self.mesh = Mesh.of(lay, device_type=ctx.device.type)
        self.model = self.build_model()
        self.mesh.comm(CP).reduce_scatter_algorithm = reduce_scatter_option(ctx.config)
        self.positions, self.attention_comms = apply_context_parallel(
            self.model, self.mesh, lay, ctx.config.model_config().seq_len, ctx.device, ctx.timeline)
        self.params = list(self.model.parameters())
        self.optimizer = self.build_optimizer(self.params)
        self.meter = ActivationMeter(self.params)

    def step(self, batch):
        tl, comm = self.ctx.timeline, self.ctx.comm
        mine = shard(batch, self.mesh.rank(DP), self.dp)
        x, y = (t[:, self.positions.cpu()].to(self.ctx.device) for t in mine)
        self.optimizer.zero_grad(set_to_none=True)
        self.meter.reset_peak()
        with tl.span("forward"), self.meter.track():
            loss = self.model.criterion(self.model(x, self.positions), y)
        with tl.span("backward"):
            loss.backward()
        with tl.span("all_reduce"):  # every rank's gradient covers other tokens: the mean of all
            reduce_gradients(self.params, comm)
        with tl.span("optimizer"):
            self.optimizer.step()
        return self.mean_loss(loss)

    def comms(self):
        return [self.ctx.comm, *self.attention_comms]
