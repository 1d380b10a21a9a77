"""``nd``'s composition, one step per dimension: each takes the mesh (and the layout) and the
model as the step before left it, and returns what it made. ``ND.setup`` calls them in this
module's order, which is Megatron-Core's and torchtitan's: the layers are cut before anything
else (tensor parallelism changes what a layer's parameters are), experts and attention are
swapped inside the cut layers, the blocks are dealt out to stages, and only then are the
stages' parameters sharded over the data ranks (ZeRO/FSDP shards what is left on a rank).
"""
from __future__ import annotations

from dlab.layout import CP, DP, PP, TP, Layout
from dlab.parallel.context.core import apply_context_parallel
from dlab.parallel.expert.dispatch import global_expert_name, keep_local_experts
from dlab.parallel.mesh import Mesh
from dlab.parallel.nd.sharding import DataSharding, stage_groups
from dlab.parallel.pipeline.split import StageModule
from dlab.parallel.tensor.model import TensorParallelGPT

#: the ranks that see different tokens of the same parameters: their gradients are reduced
#: together and ZeRO shards over them (Megatron-Core shards its optimizer over dp x cp)
DATA = (DP, CP)


def tensor_parallel(model, mesh: Mesh, lay: Layout, device):
    """Each block's matmuls cut over tp, column- then row-parallel (Shoeybi et al. 2019), with
    sequence parallelism outside them if asked (Korthikanti et al. 2022)."""
    if lay.tp == 1:
        return model
    return TensorParallelGPT(model, mesh.comm(TP), lay.sequence_parallel).to(device)


def expert_parallel(model, mesh: Mesh, lay: Layout, n_expert: int | None):
    """A MoE's experts split over an ep group folded onto the data ranks (Megatron-Core's
    parallel folding: experts take no ranks of their own). Returns each layer's combine, the ep
    group, and the group across ep groups that reduces an expert's gradient."""
    if n_expert is None:
        return [], None, None
    ep_comm, across = mesh.folded(DATA, lay.ep)
    return keep_local_experts(model, ep_comm, n_expert), ep_comm, across


def context_parallel(model, mesh: Mesh, lay: Layout, seq_len: int, device):
    """Each sequence cut over cp, every attention core made cross-rank. Returns this rank's
    token positions (None without cp) and the Comms attention talks over. No tile spans on the
    timeline (``timeline=None``): nd's timeline is its schedule's."""
    if lay.cp == 1:
        return None, []
    return apply_context_parallel(model, mesh, lay, seq_len, device)


def stages(model, sched, ranges: list[range], pp_rank: int, positions) -> dict:
    """This pipeline rank's stages of the cut model, each a ``StageModule`` over its blocks
    (the first holds the embedding, the last the head)."""
    n = sched.n_stages
    out = {s: StageModule(model, ranges[s], s == 0, s == n - 1) for s in sched.stages_of(pp_rank)}
    for st in out.values():
        st.positions = positions
    return out


def data_sharding(stages_: dict, lay: Layout, data_comm, expert_data_comm, device, timeline,
                  transient, precision) -> list[DataSharding]:
    """The stages' parameters sharded by ZeRO stage ``lay.zero`` over the data ranks; a MoE's
    experts in units of their own over the ranks that hold the same experts, under the single
    model's expert names (their gradients already sum every data rank's tokens routed to them,
    hence ``divide_by`` the whole data group)."""
    groups = stage_groups(stages_.values())
    experts = _expert_units(groups, stages_) if expert_data_comm is not None else []  # out of groups
    out = [DataSharding(lay.zero, groups, data_comm, device, timeline, transient, precision=precision)]
    if experts:
        out.append(DataSharding(lay.zero, experts, expert_data_comm, device, timeline, transient,
                                divide_by=data_comm.size, precision=precision))
    return out


def _expert_units(groups: list, stages_: dict) -> list:
    """Take the experts out of ``groups`` (in place) and return them, one unit per layer."""
    out = []
    for gi, (name, mod, params) in enumerate(groups):
        experts = [(n, p) for n, p in params if ".experts." in n]
        if not experts:
            continue
        groups[gi] = (name, mod, [(n, p) for n, p in params if ".experts." not in n])
        layer = int(experts[0][0].split(".")[1])
        first = _block(stages_, layer).mlp.first_expert
        out.append((f"experts{layer}", None, [(global_expert_name(n, first), p) for n, p in experts]))
    return out


def _block(stages_: dict, layer: int):
    for st in stages_.values():
        if layer in st.block_range:
            return st.blocks[st.block_range.index(layer)]
    raise KeyError(layer)


def tied_pair(model, mesh: Mesh, sched):
    """The first and the last stage's ranks of this pipeline, each holding (its tp shard of)
    the tied embedding/head matrix: their gradients are summed after the schedule (Megatron-LM's
    embedding group). None when one rank holds both (one stage, or a V-schedule)."""
    first, last = sched.stage_rank[0], sched.stage_rank[-1]
    if not model.cfg.tied or first == last:
        return None
    return mesh.subgroup((PP,), select={PP: (first, last)})
