"""Gradient buckets: the flat buffers DDP all-reduces, one message per bucket.

Why buckets (Li et al., "PyTorch Distributed", VLDB 2020, sec. 3.2): one all-reduce per
parameter pays the per-message latency ``alpha`` once per tensor (a GPT has a dozen tensors a
layer), one all-reduce of everything at the end cannot start before backward has finished.
A bucket of ``cap`` bytes is the compromise: few messages, and each can start as soon as the
gradients in it are final, while backward still computes the earlier layers.

Parameters are assigned in *reverse* registration order, because backward produces gradients
roughly from the last layer to the first: bucket 0 fills first and is sent first. Each
parameter's ``.grad`` is a view into its bucket (PyTorch's ``gradient_as_bucket_view``), so
autograd accumulates straight into the buffer that is sent and there is no copy in or out.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Bucket:
    index: int
    params: list[torch.nn.Parameter]
    flat: torch.Tensor  # the gradients of ``params``, back to back
    pending: set[int] = field(default_factory=set)  # ids of params whose gradient is not final

    def reset(self) -> None:
        self.pending = {id(p) for p in self.params}

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()


def assign(sizes_bytes: list[int], cap_bytes: int) -> list[list[int]]:
    """Greedy assignment of tensors (given in the order they become ready) to buckets of at most
    ``cap_bytes``; a tensor larger than the cap gets a bucket of its own. Returns index lists.
    Pure arithmetic, so ``dlab.theory.data_parallel`` predicts the bucket count with it."""
    if cap_bytes <= 0:
        raise ValueError(f"the bucket cap must be positive (got {cap_bytes} bytes)")
    out: list[list[int]] = []
    filled = 0
    for i, size in enumerate(sizes_bytes):
        if not out or filled + size > cap_bytes:
            out.append([])
            filled = 0
        out[-1].append(i)
        filled += size
    return out


def build_buckets(params: list[torch.nn.Parameter], cap_bytes: int) -> list[Bucket]:
    """Buckets over ``params`` (registration order), filled in reverse; every ``p.grad`` becomes
    a zeroed view into its bucket's flat buffer."""
    ready_order = list(reversed(params))
    sizes = [p.numel() * p.element_size() for p in ready_order]
    buckets = []
    for b, members in enumerate(assign(sizes, cap_bytes)):
        ps = [ready_order[i] for i in members]
        flat = torch.zeros(sum(p.numel() for p in ps), dtype=ps[0].dtype, device=ps[0].device)
        offset = 0
        for p in ps:
            p.grad = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        bucket = Bucket(b, ps, flat)
        bucket.reset()
        buckets.append(bucket)
    return buckets
