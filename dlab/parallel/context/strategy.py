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

``options``: ``attention`` = ``"ring"`` (default), ``"allgather"`` or ``"ulysses"`` (all-to-all
to a head split: cp must divide n_head); ``layout`` = ``"zigzag"``
(default) or ``"contiguous"``; ``cp`` = the context-parallel degree (default: every rank);
``reduce_scatter`` = ``"backend"`` (default) or ``"ring"`` (the all-gather attention's backward
reduce-scatter by dlab's own ring, half the bytes of Gloo's). With fewer, the ranks form
``Mesh({"dp": world/cp, "cp": cp})``: each group of cp adjacent ranks shares a slice of the
batch and splits its sequences (CP x DP). The gradient all-reduce then runs over every rank,
since each one's gradient covers different tokens.
"""
from __future__ import annotations

import functools

from dlab.comm.instrumented import reduce_scatter_option
from dlab.data import shard
from dlab.metrics import ActivationMeter
from dlab.parallel import register
from dlab.parallel.base import REDUCE_SCATTER, Option, WholeModel, data_parallel_problems
from dlab.parallel.context import layout
from dlab.parallel.context.attention import Ring, allgather_attention, ring_attention, ulysses_attention
from dlab.parallel.mesh import Mesh

ATTENTION = {"ring": ring_attention, "allgather": allgather_attention, "ulysses": ulysses_attention}


def cp_options(config) -> tuple[str, str, int]:
    return (str(config.options.get("attention", "ring")),
            str(config.options.get("layout", "zigzag")),
            int(config.options.get("cp", config.world_size)))


@register("cp")
class ContextParallel(WholeModel):
    """Context parallelism: each rank holds a share of every sequence; attention by ring or
    all-gather."""

    OPTIONS = {
        "attention": Option("choice", "how attention sees the other ranks' keys and values",
                            default="ring", choices=tuple(ATTENTION)),
        "layout": Option("choice", "how a sequence is cut over the ranks", default="zigzag",
                         choices=layout.LAYOUTS),
        "cp": Option("int", "the context-parallel degree (default: every rank)", minimum=1),
        **REDUCE_SCATTER,
    }

    @classmethod
    def problems(cls, config):
        p = super().problems(config)
        if p:
            return p
        if config.model != "gpt":
            return [f"context parallelism splits a sequence; use model='gpt' (got {config.model!r})"]
        _, lay, cp = cp_options(config)
        if config.world_size % cp:
            return [f"option cp={cp} must divide world_size={config.world_size} (cp x dp ranks)"]
        p += data_parallel_problems(config, config.world_size // cp)
        pieces = layout.chunks(lay, cp)
        mc = config.model_config()
        seq_len = mc.seq_len
        attention = cp_options(config)[0]
        if attention == "ulysses" and mc.n_head % cp:
            p.append(f"attention='ulysses' gives each of the cp={cp} ranks a share of the heads: "
                     f"n_head={mc.n_head} must be a multiple of cp (or use attention='ring')")
        if seq_len % pieces:
            p.append(f"model option seq_len={seq_len} does not cut into {pieces} equal chunks "
                     f"({lay} layout at cp={cp}); use a multiple of {pieces}")
        return p

    def setup(self) -> None:
        ctx = self.ctx
        attention, lay, cp = cp_options(ctx.config)
        self.dp = ctx.world_size // cp
        self.mesh = Mesh({"dp": self.dp, "cp": cp}, device_type=ctx.device.type)
        seq_len = ctx.config.model_config().seq_len
        positions = [layout.positions(lay, seq_len, r, cp).to(ctx.device) for r in range(cp)]
        self.positions = positions[self.mesh.rank("cp")]
        self.model = self.build_model()
        self.mesh.comm("cp").reduce_scatter_algorithm = reduce_scatter_option(ctx.config)
        core = functools.partial(ATTENTION[attention],
                                 ring=Ring(self.mesh.comm("cp"), positions, ctx.timeline))
        for block in self.model.blocks:
            block.attn.core = core
        self.params = list(self.model.parameters())
        self.optimizer = self.build_optimizer(self.params)
        self.meter = ActivationMeter(self.params)

    def step(self, batch):
        tl, comm = self.ctx.timeline, self.ctx.comm
        mine = shard(batch, self.mesh.rank("dp"), self.dp)
        x, y = (t[:, self.positions.cpu()].to(self.ctx.device) for t in mine)
        self.optimizer.zero_grad(set_to_none=True)
        self.meter.reset_peak()
        with tl.span("forward"), self.meter.track():
            loss = self.model.criterion(self.model(x, self.positions), y)
        with tl.span("backward"):
            (loss / comm.size).backward()
        with tl.span("all_reduce"):
            for p in self.params:
                comm.all_reduce(p.grad)
        with tl.span("optimizer"):
            self.optimizer.step()
        return self.mean_loss(loss)

    def comms(self):
        return [self.ctx.comm, self.mesh.comm("cp")]
