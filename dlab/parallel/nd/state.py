"""``nd``'s checkpoint: each rank's pieces of the *logical* tensors, and a loader that cuts its
own pieces out of the logical tensors whatever layout wrote them.

A rank of ``nd`` holds, of a parameter of the single model, at most one piece, described by
three cuts applied in turn (``dlab.runtime.checkpoint`` stores them):

1. the pipeline cut: the parameter is on this rank only if one of its stages holds the block
   (or the embedding / head); the name is the single model's (``stage_groups``), expert names
   are global (``experts.<e>``), so the stage and expert indices are in the name itself;
2. the tensor-parallel cut: ``TensorParallelGPT.shard_dim(name)`` and this rank's equal share
   along it, ``(dim, tp_rank * size, size)`` - the piece's ``slice``;
3. the ZeRO cut (stage >= 1): the run ``[start, start + n)`` of that slice's flattened elements
   that this rank's chunk of the unit's flat buffer covers (``FlatUnit.owned_cuts``).

What is saved is what the *optimizer* steps and its state (SGD's momentum, Adam's moments and
step): under ZeRO >= 1 the units' masters, otherwise ``DataSharding.optimizer_params()``. In
fp32 those are the model's own tensors; under mixed precision they are the fp32 master weights
and the model's low-precision copies are derived from them, so the checkpoint holds the exact
values either way, and the loader writes the masters first and then the model's copies.

Replicas are written once: a tensor-parallel-replicated parameter by tp rank 0, the last
stage's copy of the tied matrix not at all (the first stage writes it), a ZeRO-0 parameter by
data rank 0; the reader refuses a tensor the written pieces do not wholly cover. Loading at
another layout is then ``Reader.tensor`` (assemble the logical tensor) followed by this rank's
three cuts: the same path the ZeRO strategies and ``single`` load through.
"""
from __future__ import annotations

import torch

from dlab.layout import TP
from dlab.parallel.tensor.model import TensorParallelGPT
from dlab.runtime import checkpoint

TIED = "embed.tok.weight"


def _cut(nd, name: str, local_shape) -> tuple[tuple[int, int, int] | None, list[int]]:
    """This rank's tensor-parallel slice of ``name`` (None: the whole tensor) and the whole
    tensor's shape; shards are equal and in tp-rank order (``gather_shards``)."""
    dim = TensorParallelGPT.shard_dim(name) if nd.lay.tp > 1 else None
    shape = list(local_shape)
    if dim is None:
        return None, shape
    size = shape[dim]
    shape[dim] = size * nd.lay.tp
    return (dim, nd.mesh.rank(TP) * size, size), shape


def _writes(nd, sharding, name: str) -> bool:
    """Whether this rank writes its piece of ``name`` (another rank holds the same otherwise)."""
    if nd.lay.tp > 1 and TensorParallelGPT.shard_dim(name) is None and nd.mesh.rank(TP) != 0:
        return False
    if name == TIED and 0 not in nd.stages:  # the last stage's copy of the tied matrix
        return False
    return bool(sharding.units) or sharding.comm.rank == 0


def _state_pieces(state: dict, at: int, n: int, start: int, shape, cut) -> dict:
    return {k: checkpoint.piece(v.reshape(-1)[at:at + n], start, shape, cut) if v.dim()
            else v.detach().clone() for k, v in state.items()}


def checkpoint_state(nd) -> dict:
    """This rank's pieces of every parameter it writes, and of its optimizer state."""
    params, optim = {}, {}
    opt = nd.optimizer
    for s in nd.shardings:
        if not s.units:  # ZeRO 0: whole (tensor-parallel shards of) parameters
            for (name, _), q in zip(s.named, s.optimizer_params(), strict=True):
                if _writes(nd, s, name):
                    cut, shape = _cut(nd, name, q.shape)
                    params[name] = checkpoint.piece(q, 0, shape, cut)
                    optim[name] = _state_pieces(opt.state.get(q, {}), 0, q.numel(), 0, shape, cut)
            continue
        for u in s.units:
            state = opt.state.get(u.master, {})
            for slot, start, at, n in u.owned_cuts():
                if _writes(nd, s, slot.name):
                    cut, shape = _cut(nd, slot.name, slot.shape)
                    params[slot.name] = checkpoint.piece(u.master.detach()[at:at + n], start, shape, cut)
                    optim[slot.name] = _state_pieces(state, at, n, start, shape, cut)
    hparams = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return {"params": params, "optim": optim, "hparams": hparams}


def _mine(nd, reader, name: str, local_shape, key: str | None = None) -> torch.Tensor:
    """This rank's tensor-parallel slice of the logical tensor, flattened."""
    whole = reader.tensor("optim" if key else "params", name, key)
    cut, shape = _cut(nd, name, local_shape)
    if list(whole.shape) != shape:
        raise checkpoint.CorruptCheckpoint(
            f"{reader.path}: {name} has shape {list(whole.shape)} there and {shape} in this model; "
            f"refusing to load it")
    return (whole if cut is None else whole.narrow(*cut)).reshape(-1)


@torch.no_grad()
def load_checkpoint_state(nd, reader) -> None:
    """Cut this rank's pieces (parameters, then optimizer state) out of the logical tensors of
    a checkpoint written at any layout."""
    opt = nd.optimizer
    for s in nd.shardings:
        if not s.units:
            for (name, p), q in zip(s.named, s.optimizer_params(), strict=True):
                q.copy_(_mine(nd, reader, name, q.shape).view_as(q))
                if p is not q:  # a low-precision model copy of an fp32 master
                    p.copy_(q)
                state = {k: (_mine(nd, reader, name, q.shape, k).view_as(q).clone() if k != "step"
                             else reader.tensor("optim", name, k).clone()) for k in reader.keys(name)}
                if state:
                    opt.state[q] = state
            continue
        for u in s.units:
            master = u.master.detach()
            keys = set().union(*(reader.keys(slot.name) for slot in u.slots))
            state = {k: torch.zeros_like(master) for k in keys if k != "step"}
            for slot, start, at, n in u.owned_cuts():
                master[at:at + n].copy_(_mine(nd, reader, slot.name, slot.shape)[start:start + n])
                for k in state:
                    state[k][at:at + n].copy_(_mine(nd, reader, slot.name, slot.shape, k)[start:start + n])
            if "step" in keys:  # one counter per unit: every parameter's is the same
                state["step"] = reader.tensor("optim", u.slots[0].name, "step").clone()
            if state:
                opt.state[u.master] = state
            if u.shard.data_ptr() != master.data_ptr():  # a low-precision chunk beside its master
                u.shard.copy_(master)
            if u.gathered:  # stages 1-2 hold the whole replica between steps
                for slot in u.slots:
                    whole = _mine(nd, reader, slot.name, slot.shape)
                    u.flat[slot.offset:slot.offset + slot.numel].copy_(whole)
    for group, hparams in zip(opt.param_groups, reader.hparams()):
        group.update(hparams)
