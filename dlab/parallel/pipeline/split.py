"""Cutting the GPT into pipeline stages by layers.

Stage 0 owns the embedding (and so the input tokens), the last stage owns the head, the loss
and the targets; the transformer blocks are dealt out in contiguous runs. A run is chosen to
minimise the most loaded stage (the pipeline goes as fast as its slowest stage), with a block's
load either its parameter count or its measured forward+backward time.

With a tied head (``GPTConfig.tied``) the first and the last stage both hold the embedding
matrix: the first to look tokens up, the last to project onto the vocabulary. Each keeps its
own copy; after every backward the two copies' gradients are summed across the two ranks, so
both apply the same update and stay equal - Megatron-LM's treatment of tied embeddings
(Shoeybi et al. 2019; Narayanan et al. 2021). ``StageModule`` keeps the GPT's own parameter
names, so stages gather back into exactly ``GPT.state_dict()``.
"""
from __future__ import annotations

import time

import torch
from torch import nn

from dlab.models.gpt import GPT


def param_costs(model: GPT) -> tuple[list[float], float, float]:
    """Per-block parameter counts, and the embedding's and the head's (the head counts the
    vocabulary projection even when tied: its stage does that matmul)."""
    blocks = [float(sum(p.numel() for p in b.parameters())) for b in model.blocks]
    embed = float(sum(p.numel() for p in model.embed.parameters()))
    head = float(sum(p.numel() for p in model.head.parameters()) + model.head.projection().numel())
    return blocks, embed, head


def time_costs(model: GPT, batch: tuple[torch.Tensor, torch.Tensor], repeats: int = 3
               ) -> tuple[list[float], float, float]:
    """Measured forward+backward seconds of each block, the embedding and the head+loss on
    ``batch`` (the median of ``repeats``). Timings differ between ranks, so measure on one
    rank and broadcast the split (``strategy.py`` does)."""
    x, y = batch

    def timed(fn) -> float:
        runs = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - start)
        return sorted(runs)[len(runs) // 2]

    with torch.no_grad():
        h = model.embed(x)
    hidden = h.detach().requires_grad_()

    def embed():
        model.embed(x).sum().backward()

    def block(b):
        return lambda: b(hidden).sum().backward()

    def head():
        model.criterion(model.head(hidden), y).backward()

    costs = [timed(block(b)) for b in model.blocks]
    out = costs, timed(embed), timed(head)
    model.zero_grad(set_to_none=True)
    return out


class StageModule(nn.Module):
    """One stage of the GPT: the embedding if first, a run of blocks, the head if last.
    It holds references into a full ``GPT`` built from the same seed (so every stage starts
    from the reference's weights); ``named_full_parameters`` gives them under the GPT's names."""

    def __init__(self, model: GPT, blocks: range, first: bool, last: bool):
        super().__init__()
        self.first, self.last, self.block_range = first, last, blocks
        self.embed = model.embed if first else None
        self.blocks = nn.ModuleList(model.blocks[i] for i in blocks)
        self.head = model.head if last else None
        self.criterion = model.criterion
        #: the input tokens' positions (None: 0, 1, ...; context parallelism sets its share's)
        self.positions = None
        self._names = {}
        for name, p in model.named_parameters():
            owner = name.split(".")[0]
            if owner == "embed" and (first or (last and p is model.head.projection())):
                self._names[name] = p
            elif owner == "blocks" and int(name.split(".")[1]) in blocks:
                self._names[name] = p
            elif owner == "head" and last:
                self._names[name] = p

    def named_full_parameters(self) -> dict[str, nn.Parameter]:
        """This stage's parameters under the full GPT's names (the tied matrix, held by the last
        stage for its head, under ``embed.tok.weight``)."""
        return dict(self._names)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x, self.positions)
        for b in self.blocks:
            x = b(x)
        return self.head(x) if self.head is not None else x
