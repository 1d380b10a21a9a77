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
reduce-scatter by dlab's own ring, half the bytes of Gloo's). With fewer, the ranks form
``Mesh({"dp": world/cp, "cp": cp})``: each group of cp adjacent ranks shares a slice of the
batch and splits its sequences (CP x DP). The gradient all-reduce then runs over every rank,
since each one's gradient covers different tokens.
"""
from __future__ import annotations

import functools

from dlab.comm.instrumented import reduce_scatter_option
from dlab.models.data import shard
from dlab.core.metrics import ActivationMeter
from dlab.parallel import register
from dlab.parallel.base import REDUCE_SCATTER, Option, WholeModel, data_parallel_problems
from dlab.layout import tokens as layout
from dlab.parallel.context.attention import (
    Hybrid,
    Ring,
    allgather_attention,
    ring_attention,
    ulysses_attention,
    usp_attention,
)
from dlab.parallel.mesh import Mesh

ATTENTION = {"ring": ring_attention, "allgather": allgather_attention, "ulysses": ulysses_attention,
             "usp": usp_attention}
ULYSSES = Option("int", "Ulysses ranks per group under attention='usp' (the ring runs across "
                 "the groups)", default=2, minimum=1)


def head_split(attention: str, cp: int, ulysses: int) -> int:
    """Over how many ranks the attention splits the heads: cp for Ulysses, the Ulysses group
    for USP, none for the ring and the all-gather."""
    return {"ulysses": cp, "usp": ulysses}.get(attention, 1)


def attention_problems(attention: str, n_head: int, cp: int, ulysses: int, tp: int = 1) -> list[str]:
    """What makes ``attention`` impossible for ``n_head`` heads (cut over ``tp`` tensor-parallel
    ranks first) on ``cp`` ranks, said with what to change."""
    if attention == "usp" and cp % ulysses:
        return [f"option ulysses={ulysses} must divide cp={cp} (USP cuts the cp ranks into "
                f"groups of that many; the ring runs across the groups)"]
    split, heads = head_split(attention, cp, ulysses), n_head // tp
    if heads % split:
        who = f"cp={cp}" if attention == "ulysses" else f"ulysses={ulysses}"
        per_rank = f"n_head={n_head}" + (f" / tp={tp} = {heads}" if tp > 1 else "")
        return [f"attention={attention!r} splits the heads over {split} ranks: {per_rank} is not "
                f"a multiple of {who}; make it one (or use attention='ring')"]
    return []


def attention_core(attention: str, mesh: Mesh, positions: list, timeline=None, ulysses: int = 2):
    """The attention core over ``mesh``'s cp dimension, and the Comms it talks over."""
    if attention == "usp":
        heads, across = mesh.folded(("cp",), ulysses)
        return functools.partial(usp_attention, ring=Hybrid(heads, across, positions, timeline)), [
            heads, across]
    return (functools.partial(ATTENTION[attention], ring=Ring(mesh.comm("cp"), positions, timeline)),
            [mesh.comm("cp")])


def cp_options(config) -> tuple[str, str, int]:
    return (str(config.options.get("attention", "ring")),
            str(config.options.get("layout", "zigzag")),
            int(config.options.get("cp", config.world_size)))


def ulysses_option(config) -> int:
    return int(config.options.get("ulysses", 2))


@register("cp")
class ContextParallel(WholeModel):
    """Context parallelism: each rank holds a share of every sequence; attention by ring,
    all-gather, Ulysses or USP."""

    OPTIONS = {
        "attention": Option("choice", "how attention sees the other ranks' keys and values",
                            default="ring", choices=tuple(ATTENTION)),
        "layout": Option("choice", "how a sequence is cut over the ranks", default="zigzag",
                         choices=layout.LAYOUTS),
        "cp": Option("int", "the context-parallel degree (default: every rank)", minimum=1),
        "ulysses": ULYSSES,
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
        p += attention_problems(cp_options(config)[0], mc.n_head, cp, ulysses_option(config))
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
        core, self.attention_comms = attention_core(attention, self.mesh, positions, ctx.timeline,
                                                    ulysses_option(ctx.config))
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
        return [self.ctx.comm, *self.attention_comms]
