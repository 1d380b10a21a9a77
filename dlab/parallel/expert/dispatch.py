"""Sending tokens to the ranks that hold their experts, and the answers back (GShard, Lepikhin
et al. 2020): two all-to-alls per MoE layer forward, two more backward.

With E experts on n ranks, rank r holds experts [r E/n, (r+1) E/n). Each rank routes its own
tokens, then:

1. sorts its (token, expert) assignments by expert, so the rows for each rank are contiguous;
2. tells every rank how many rows it will send it (an all-to-all of n counts), which fixes the
   receive splits; the sizes vary from step to step with the routing;
3. all-to-all: the rows go to their experts' ranks (with the expert of each row);
4. runs each local expert on the rows it received;
5. all-to-all back, in the reverse splits: every row returns to where it came from, in order,
   and is weighted and summed into its token's output.

The all-to-all is its own adjoint: the gradient of the rows received is sent back along the
same splits reversed, so autograd needs one small Function. Per layer and step a rank sends
the rows it routes off-rank twice (forward, and the gradient of their answers) and the rows it
received twice (their answers, and the gradient of the rows), d x 4 bytes each, plus the counts
and each sent row's expert index (``dlab.theory.expert``).
"""
from __future__ import annotations

import contextlib

import torch

from dlab.comm.instrumented import Comm


def owner(expert: int, n_expert: int, ranks: int) -> int:
    """The rank of an expert-parallel group of ``ranks`` that holds ``expert``: rank r holds
    experts [r E/n, (r+1) E/n)."""
    return expert // (n_expert // ranks)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm: Comm, out_splits: list[int], in_splits: list[int]):
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        comm.all_to_all_single(out, x.contiguous(), out_splits, in_splits)
        ctx.comm, ctx.splits = comm, (out_splits, in_splits)
        return out

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        grad = g.new_empty(sum(in_splits), *g.shape[1:])
        ctx.comm.all_to_all_single(grad, g.contiguous(), in_splits, out_splits)
        return grad, None, None, None


def all_to_all(x, comm: Comm, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
    return _AllToAll.apply(x, comm, out_splits, in_splits)


class ExpertParallelCombine:
    """Replaces ``MoE.combine`` on one rank: ``local`` are this rank's experts, by global
    index. The rows it sends to and receives from other ranks are counted for the byte
    formula (they depend on the routing, so the formula takes them as inputs). Given a
    ``timeline``, the local experts' forward is put on it as an ``experts`` span: the rank's
    own expert work, which the router's balance sets and the next all-to-all waits for."""

    def __init__(self, comm: Comm, local: dict[int, torch.nn.Module], n_expert: int,
                 timeline=None):
        self.comm, self.local, self.timeline = comm, local, timeline
        self.per_rank = n_expert // comm.size
        self.rows_sent = self.rows_received = 0
        #: per call (a forward of its layer): (assignments this rank routed, rows its experts
        #: received), what the layer's saved tensors depend on (``estimate.nd.activations``)
        self.calls: list[tuple[int, int]] = []

    def __call__(self, flat, weights, experts) -> torch.Tensor:
        comm, n = self.comm, self.comm.size
        token = torch.arange(flat.shape[0], device=flat.device).repeat_interleave(experts.shape[1])
        expert, weight = experts.reshape(-1), weights.reshape(-1)
        kept = expert >= 0  # -1: dropped over an expert's capacity (``moe.drop_over_capacity``)
        token, expert, weight = token[kept], expert[kept], weight[kept]
        order = torch.argsort(expert, stable=True)
        token, expert, weight = token[order], expert[order], weight[order]
        send = torch.bincount(expert // self.per_rank, minlength=n)
        recv = torch.empty_like(send)
        comm.all_to_all_single(recv, send)  # n counts each way: the splits of what follows
        in_splits, out_splits = send.tolist(), recv.tolist()
        self.rows_sent += sum(in_splits) - in_splits[comm.rank]
        self.rows_received += sum(out_splits) - out_splits[comm.rank]
        self.calls.append((sum(in_splits), sum(out_splits)))

        rows = all_to_all(flat[token], comm, out_splits, in_splits)
        row_expert = torch.empty(sum(out_splits), dtype=expert.dtype, device=expert.device)
        comm.all_to_all_single(row_expert, expert, out_splits, in_splits)
        # rows * 0, not zeros: autograd must run both exchanges' backward on every rank, even
        # one whose experts got no rows this step, or the ranks' all-to-alls would not pair up
        done = rows * 0
        with self.timeline.span("experts") if self.timeline else contextlib.nullcontext():
            for e, mlp in self.local.items():
                mine = (row_expert == e).nonzero(as_tuple=True)[0]
                if len(mine):
                    done = done.index_add(0, mine, mlp(rows[mine]))
        back = all_to_all(done, comm, in_splits, out_splits)
        out = torch.zeros_like(flat)
        return out.index_add(0, token, back * weight[:, None])


def keep_local_experts(model, comm: Comm, n_expert: int, timeline=None) -> list[ExpertParallelCombine]:
    """In every MoE layer of ``model`` keep only the experts this rank of ``comm`` holds
    (``owner``) and route tokens to the others' over ``comm``; returns each layer's combine.
    The dropped experts free their memory: that is how expert counts outgrow one device
    (Switch Transformer, Fedus et al. 2021, sec. 5)."""
    combines = []
    for moe in (block.mlp for block in model.blocks):
        local = {e: moe.experts[e] for e in range(n_expert) if owner(e, n_expert, comm.size) == comm.rank}
        moe.experts = torch.nn.ModuleList(local.values())
        moe.first_expert = min(local)  # the local index i is global expert first_expert + i
        moe.combine = ExpertParallelCombine(comm, local, n_expert, timeline)
        combines.append(moe.combine)
    return combines


def global_expert_name(name: str, first: int) -> str:
    """A local parameter name under the single model's expert numbering:
    ``blocks.1.mlp.experts.0.fc.weight`` on a rank whose first expert is 2 ->
    ``blocks.1.mlp.experts.2.fc.weight``."""
    parts = name.split(".")
    i = parts.index("experts")
    parts[i + 1] = str(first + int(parts[i + 1]))
    return ".".join(parts)
