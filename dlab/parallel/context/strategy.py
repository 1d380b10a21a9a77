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

``options``: ``attention`` = ``"ring"`` (default) or ``"allgather"``; ``layout`` =
``"zigzag"`` (default) or ``"contiguous"``.
"""
from __future__ import annotations

import functools

from dlab import checkpoint
from dlab.metrics import ActivationMeter
from dlab.parallel import register
from dlab.parallel.base import Strategy
from dlab.parallel.context import layout
from dlab.parallel.context.attention import Ring, allgather_attention, ring_attention
from dlab.parallel.data_parallel.replica import unknown_options

ATTENTION = {"ring": ring_attention, "allgather": allgather_attention}


def cp_options(config) -> tuple[str, str]:
    return (str(config.options.get("attention", "ring")),
            str(config.options.get("layout", "zigzag")))


@register("cp")
class ContextParallel(Strategy):
    """Context parallelism: each rank holds a share of every sequence; attention by ring or
    all-gather."""

    replicated = True

    @classmethod
    def problems(cls, config):
        p = super().problems(config) + unknown_options(config, ("attention", "layout"))
        if p:
            return p
        if config.model != "gpt":
            return [f"context parallelism splits a sequence; use model='gpt' (got {config.model!r})"]
        attention, lay = cp_options(config)
        if attention not in ATTENTION:
            p.append(f"option attention={attention!r} is not one of {sorted(ATTENTION)}")
        if lay not in layout.LAYOUTS:
            p.append(f"option layout={lay!r} is not one of {list(layout.LAYOUTS)}")
        pieces = layout.chunks(lay, config.world_size)
        seq_len = config.model_config().seq_len
        if lay in layout.LAYOUTS and seq_len % pieces:
            p.append(f"model option seq_len={seq_len} does not cut into {pieces} equal chunks "
                     f"({lay} layout at world_size {config.world_size}); use a multiple of {pieces}")
        return p

    def setup(self) -> None:
        ctx = self.ctx
        attention, lay = cp_options(ctx.config)
        seq_len = ctx.config.model_config().seq_len
        positions = [layout.positions(lay, seq_len, r, ctx.world_size).to(ctx.device)
                     for r in range(ctx.world_size)]
        self.positions = positions[ctx.rank]
        self.model = self.build_model()
        core = functools.partial(ATTENTION[attention], ring=Ring(ctx.comm, positions))
        for block in self.model.blocks:
            block.attn.core = core
        self.params = list(self.model.parameters())
        self.optimizer = self.build_optimizer(self.params)
        self.meter = ActivationMeter(self.params)

    def step(self, batch):
        tl, comm = self.ctx.timeline, self.ctx.comm
        x, y = (t[:, self.positions.cpu()].to(self.ctx.device) for t in batch)
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

    def memory(self):
        return self.replica_memory(self.model, self.optimizer)

    def full_state_dict(self):
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    def checkpoint_state(self):
        return checkpoint.replica_state(self.model, self.optimizer)

    def load_checkpoint_state(self, reader):
        checkpoint.load_replica(self.model, self.optimizer, reader)
