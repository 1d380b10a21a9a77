"""A mesh of process groups for hybrid layouts (PP x DP, TP x DP, ...), passed to strategies.

Ranks are laid out row-major over the named dimensions, the last varying fastest: with
``Mesh({"dp": 2, "tp": 2})`` ranks 0,1 form a tensor-parallel group and 0,2 a data-parallel
one, so the chattiest dimension (put last) is the one whose ranks sit on the same node -
Megatron-LM's ordering. Built on ``torch.distributed.device_mesh`` (which creates one group per
slice); dlab adds a counting ``Comm`` per dimension. No global singleton: two meshes can live
side by side.
"""
from __future__ import annotations

import itertools
import math

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from dlab.comm.instrumented import Comm


class Mesh:
    def __init__(self, dims: dict[str, int], device_type: str = "cpu"):
        if math.prod(dims.values()) != dist.get_world_size():
            raise ValueError(f"mesh {dims} needs {math.prod(dims.values())} ranks, the world has "
                             f"{dist.get_world_size()}")
        self.dims = dict(dims)
        self.device_mesh = init_device_mesh(device_type, tuple(dims.values()),
                                            mesh_dim_names=tuple(dims))
        self.comms = {name: Comm(self.device_mesh.get_group(name)) for name in dims}

    def group(self, dim: str) -> dist.ProcessGroup:
        return self.device_mesh.get_group(dim)

    def comm(self, dim: str) -> Comm:
        return self.comms[dim]

    def size(self, dim: str) -> int:
        return self.dims[dim]

    def rank(self, dim: str) -> int:
        """This rank's coordinate along ``dim``."""
        return self.device_mesh.get_local_rank(dim)

    def coords(self) -> dict[str, int]:
        return {d: self.rank(d) for d in self.dims}

    # --- groups across several dimensions -------------------------------------------------
    def global_rank(self, coords: dict[str, int]) -> int:
        """The rank at ``coords`` (row-major over the dimensions, the last fastest)."""
        rank = 0
        for d, n in self.dims.items():
            rank = rank * n + coords[d]
        return rank

    def subgroup(self, dims: tuple[str, ...], select: dict[str, tuple[int, ...]] | None = None
                 ) -> Comm | None:
        """A counting ``Comm`` over the ranks that share this rank's coordinates on every
        dimension but ``dims`` (e.g. ``("dp", "cp")``: the ranks a gradient is reduced over
        when context parallelism shards the data too). ``select`` keeps only some coordinates
        of a dimension in ``dims`` (the first and the last pipeline stage, which hold the tied
        matrix). ``new_group`` is collective, so every rank creates every such group, in the
        same order; returns this rank's, or None where it is in none."""
        others = [d for d in self.dims if d not in dims]
        select = select or {}
        mine, me = None, self.coords()
        for fixed in itertools.product(*(range(self.dims[d]) for d in others)):
            base = dict(zip(others, fixed))
            members = sorted(self.global_rank({**base, **dict(zip(dims, free))})
                             for free in itertools.product(
                                 *(select.get(d, range(self.dims[d])) for d in dims)))
            group = dist.new_group(members)
            if all(base[d] == me[d] for d in others) and all(me[d] in select.get(d, (me[d],))
                                                             for d in dims):
                mine = Comm(group)
        return mine

    def folded(self, dims: tuple[str, ...], inner: int) -> tuple[Comm, Comm]:
        """A dimension of ``inner`` ranks folded onto ``dims`` (Megatron-Core's "parallel
        folding" of expert parallelism onto the data ranks): the ranks sharing this rank's
        other coordinates, in row-major order over ``dims``, are cut into consecutive runs of
        ``inner`` (the folded groups) and into the ranks at the same place of each run (the
        groups across them). Returns this rank's (folded group, group across)."""
        others = [d for d in self.dims if d not in dims]
        me = self.coords()
        run = across = None
        for fixed in itertools.product(*(range(self.dims[d]) for d in others)):
            base = dict(zip(others, fixed))
            ranks = [self.global_rank({**base, **dict(zip(dims, free))})
                     for free in itertools.product(*(range(self.dims[d]) for d in dims))]
            mine = all(base[d] == me[d] for d in others)
            for k in range(len(ranks) // inner):
                g = dist.new_group(ranks[k * inner:(k + 1) * inner])
                if mine and dist.get_rank() in ranks[k * inner:(k + 1) * inner]:
                    run = Comm(g)
            for j in range(inner):
                g = dist.new_group(ranks[j::inner])
                if mine and dist.get_rank() in ranks[j::inner]:
                    across = Comm(g)
        return run, across
