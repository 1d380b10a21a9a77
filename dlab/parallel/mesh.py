"""The process groups of a layout, passed to strategies: the only place ranks become groups.

``Mesh.of(layout)`` (or ``Mesh(dims)`` for the degrees alone) builds one group per dimension
with ``torch.distributed.device_mesh`` and the groups that span several dimensions or part of
one (``subgroup``, ``folded``) from ``dlab.layout.ranks``, whose arithmetic places every rank:
the same degrees give the same ranks in every strategy. Each group comes wrapped in a counting
``Comm``. No global singleton: two meshes can live side by side.
"""
from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from dlab.comm.instrumented import Comm
from dlab.layout import ranks
from dlab.layout.layout import MESH_ORDER, Layout


class Mesh:
    def __init__(self, dims: dict[str, int], device_type: str = "cpu"):
        """``dims``: degrees by dimension name, outermost first (the last varies fastest)."""
        if ranks.world(dims) != dist.get_world_size():
            raise ValueError(f"mesh {dims} needs {ranks.world(dims)} ranks, the world has "
                             f"{dist.get_world_size()}")
        self.dims = dict(dims)
        self.device_mesh = init_device_mesh(device_type, tuple(dims.values()),
                                            mesh_dim_names=tuple(dims))
        self.comms = {name: Comm(self.device_mesh.get_group(name)) for name in dims}

    @classmethod
    def of(cls, layout: Layout, device_type: str = "cpu") -> Mesh:
        """The layout's mesh, pp x dp x cp x tp (``MESH_ORDER``)."""
        return cls({d: layout.dims[d] for d in MESH_ORDER}, device_type)

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
        return ranks.coords(self.dims, dist.get_rank())

    # --- groups across several dimensions -------------------------------------------------
    def _mine(self, all_groups: list[list[int]]) -> Comm | None:
        """Create every group (``new_group`` is collective: every rank creates every group, in
        the same order) and return this rank's, or None where it is in none."""
        me, mine = dist.get_rank(), None
        for members in all_groups:
            group = dist.new_group(members)
            if me in members:
                mine = Comm(group)
        return mine

    def subgroup(self, dims: tuple[str, ...], select: dict[str, tuple[int, ...]] | None = None
                 ) -> Comm | None:
        """A counting ``Comm`` over the ranks that share this rank's coordinates on every
        dimension but ``dims`` (e.g. ``("dp", "cp")``: the data ranks a gradient is reduced
        over). ``select`` keeps only some coordinates of a dimension in ``dims`` (the first and
        the last pipeline stage, which hold the tied matrix)."""
        return self._mine(ranks.groups(self.dims, dims, select))

    def folded(self, dims: tuple[str, ...], inner: int) -> tuple[Comm, Comm]:
        """A dimension of ``inner`` ranks folded onto ``dims`` (Megatron-Core's "parallel
        folding" of expert parallelism onto the data ranks): this rank's folded group and its
        group across the runs (``dlab.layout.ranks.folded``)."""
        runs, across = ranks.folded(self.dims, dims, inner)
        return self._mine(runs), self._mine(across)
