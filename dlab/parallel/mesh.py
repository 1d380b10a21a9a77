"""A mesh of process groups for hybrid layouts (PP x DP, TP x DP, ...), passed to strategies.

Ranks are laid out row-major over the named dimensions, the last varying fastest: with
``Mesh({"dp": 2, "tp": 2})`` ranks 0,1 form a tensor-parallel group and 0,2 a data-parallel
one, so the chattiest dimension (put last) is the one whose ranks sit on the same node -
Megatron-LM's ordering. Built on ``torch.distributed.device_mesh`` (which creates one group per
slice); dlab adds a counting ``Comm`` per dimension. No global singleton: two meshes can live
side by side.
"""
from __future__ import annotations

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
