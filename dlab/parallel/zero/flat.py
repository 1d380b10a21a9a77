"""Flat parameter units and their shards: the data layout every ZeRO stage here shares.

A *unit* is a group of parameters that is communicated as one tensor: one per transformer block
(``model.blocks``, or ``model.layers`` for the MLP) plus a *root* unit holding whatever is left
(token and position embeddings, the final norm, the head; the tied embedding/head weight lives
here, once). Each unit is flattened into one buffer whose length is padded up to a multiple of
the world size N, so it splits into N equal chunks: rank r owns chunk r of every unit. The
padding is zeros, never read by the model, and stays zero under Adam (a zero gradient gives a
zero update); it is reported in the accounting (``padding``) because it is memory a rank holds.

The model's parameters become views into their unit's flat buffer (``p.data = flat[o:o+n]``),
so one collective on the flat buffer (a reduce-scatter of gradients, an all-gather of
parameters) serves every parameter of the unit, and freeing the buffer's storage
(``untyped_storage().resize_(0)``) frees them all while the ``nn.Parameter`` objects - and any
autograd node that saved them - stay valid: re-allocating the storage and gathering into it
brings the same views back to life. Writes go to ``flat`` (a plain tensor), never to the
parameters, so the parameters' autograd version counters do not move and backward does not
complain that a saved weight was modified in place. This is how PyTorch's FSDP (v1) manages its
``FlatParameter`` (Zhao et al., "PyTorch FSDP", VLDB 2023, section 3.2).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Slot:
    name: str
    param: nn.Parameter
    offset: int
    numel: int
    shape: torch.Size


def padded_size(numel: int, world_size: int) -> int:
    """``numel`` rounded up to a multiple of ``world_size`` (the flat buffer's length)."""
    return -(-numel // world_size) * world_size


def unit_modules(model: nn.Module) -> list[nn.Module]:
    """The modules that become units of their own: the GPT's blocks, the MLP's layers."""
    for attr in ("blocks", "layers"):
        mods = getattr(model, attr, None)
        if isinstance(mods, nn.ModuleList):
            return list(mods)
    return []


def unit_param_groups(model: nn.Module) -> list[tuple[str, nn.Module | None, list[tuple[str, nn.Parameter]]]]:
    """``[(unit name, module or None for the root, [(parameter name, parameter)])]``, the root
    first (it is used first in forward and last in backward), names as in
    ``model.named_parameters()`` (a tied weight appears once, under its first name)."""
    named = list(model.named_parameters())
    by_id = {id(p): n for n, p in named}
    groups, claimed = [], set()
    for i, mod in enumerate(unit_modules(model)):
        params = [(by_id[id(p)], p) for p in mod.parameters() if id(p) not in claimed]
        claimed |= {id(p) for _, p in params}
        groups.append((f"unit{i + 1}", mod, params))
    root = [(n, p) for n, p in named if id(p) not in claimed]
    return ([("root", None, root)] if root else []) + [g for g in groups if g[2]]


class FlatUnit:
    """One unit: its parameters flattened into ``flat`` (``padded`` elements of ``dtype``),
    rank ``rank``'s chunk ``owned`` (``shard_numel`` elements), and the fp32 values of that
    chunk at construction (``initial_shard``, taken before any cast to bf16 so fp32 master
    weights start from the exact initial values)."""

    def __init__(self, name: str, module: nn.Module | None, params: list[tuple[str, nn.Parameter]],
                 world_size: int, rank: int, dtype: torch.dtype, device: torch.device):
        self.name, self.module, self.dtype = name, module, dtype
        self.slots: list[Slot] = []
        offset = 0
        for pname, p in params:
            self.slots.append(Slot(pname, p, offset, p.numel(), p.shape))
            offset += p.numel()
        self.numel = offset
        self.padded = padded_size(offset, world_size)
        self.padding = self.padded - offset
        self.shard_numel = self.padded // world_size
        self.owned = slice(rank * self.shard_numel, (rank + 1) * self.shard_numel)
        full32 = torch.zeros(self.padded, dtype=torch.float32, device=device)
        for s in self.slots:
            full32[s.offset:s.offset + s.numel].copy_(s.param.detach().reshape(-1))
        self.initial_shard = full32[self.owned].clone()
        self.flat = full32.to(dtype) if dtype != torch.float32 else full32
        for s in self.slots:
            s.param.data = self.flat[s.offset:s.offset + s.numel].view(s.shape)

    @property
    def params(self) -> list[nn.Parameter]:
        return [s.param for s in self.slots]

    @property
    def nbytes(self) -> int:
        return self.padded * self.flat.element_size()

    # --- the full buffer's storage ---------------------------------------------------------
    @property
    def gathered(self) -> bool:
        return self.flat.untyped_storage().nbytes() > 0

    def free(self) -> None:
        """Release the full buffer; every parameter view of it becomes empty storage."""
        self.flat.untyped_storage().resize_(0)

    def allocate(self) -> None:
        """Give the full buffer its storage back (contents undefined until gathered into)."""
        self.flat.untyped_storage().resize_(self.nbytes)

    def storage_ptr(self) -> int:
        return self.flat.untyped_storage().data_ptr()

    # --- gradients ---------------------------------------------------------------------------
    def flat_grad_views(self, flat_grad: torch.Tensor) -> None:
        """Make every parameter's ``.grad`` a view of ``flat_grad`` (autograd then accumulates
        into it in place, as DDP's ``gradient_as_bucket_view``)."""
        for s in self.slots:
            s.param.grad = flat_grad[s.offset:s.offset + s.numel].view(s.shape)

    def flatten_grads(self) -> torch.Tensor:
        """A new padded flat buffer holding the parameters' gradients (zeros where a parameter
        got none, and in the padding)."""
        out = torch.zeros(self.padded, dtype=self.dtype, device=self.flat.device)
        for s in self.slots:
            if s.param.grad is not None:
                out[s.offset:s.offset + s.numel].copy_(s.param.grad.reshape(-1))
        return out

    def owned_cuts(self):
        """``(slot, start in the parameter, start in the shard, count)`` for every parameter that
        this rank's chunk cuts: the chunk boundaries fall anywhere, mid-parameter included
        (what a checkpoint saves and loads of a sharded unit)."""
        lo, hi = self.owned.start, self.owned.stop
        for s in self.slots:
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            if a < b:
                yield s, a - s.offset, a - lo, b - a

    def unflatten(self, full: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{parameter name: its piece of the full flat tensor}`` (views)."""
        return {s.name: full[s.offset:s.offset + s.numel].view(s.shape) for s in self.slots}


def build_units(model: nn.Module, world_size: int, rank: int, dtype: torch.dtype,
                device: torch.device) -> list[FlatUnit]:
    return [FlatUnit(name, mod, params, world_size, rank, dtype, device)
            for name, mod, params in unit_param_groups(model)]
