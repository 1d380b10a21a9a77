"""The attention core a context-parallel strategy installs in every block: by name
(``ATTENTION``), built over a mesh's cp dimension (``attention_core``). ``cp`` and ``nd`` both
take it from here."""
from __future__ import annotations

import functools

from dlab.core.options import Option
from dlab.layout import CP, Layout, tokens
from dlab.parallel.context import attention as cores

ATTENTION = {"ring": cores.ring_attention, "allgather": cores.allgather_attention,
             "ulysses": cores.ulysses_attention, "usp": cores.usp_attention}

#: the options of context parallelism, in ``cp`` and ``nd`` alike
ULYSSES = Option("int", "Ulysses ranks per group under attention='usp' (the ring runs across "
                 "the groups)", default=Layout().ulysses, minimum=1)


def attention_core(attention: str, mesh, positions: list, timeline=None, ulysses: int = 2):
    """The attention core over ``mesh``'s cp dimension, and the Comms it talks over."""
    if attention == "usp":
        heads, across = mesh.folded((CP,), ulysses)
        ring = cores.Hybrid(heads, across, positions, timeline)
        return functools.partial(cores.usp_attention, ring=ring), [heads, across]
    ring = cores.Ring(mesh.comm(CP), positions, timeline)
    return functools.partial(ATTENTION[attention], ring=ring), [mesh.comm(CP)]


def apply_context_parallel(model, mesh, lay, seq_len: int, device, timeline=None):
    """Cut every sequence over ``mesh``'s cp ranks (``lay.cp_layout``: zigzag gives each rank
    an early and a late chunk, so causal attention costs every rank the same; Brandon et al.
    2023) and make every block's attention core ``lay.cp_attention`` over them. Returns this
    rank's token positions and the Comms the cores talk over."""
    positions = [tokens.positions(lay.cp_layout, seq_len, r, lay.cp).to(device) for r in range(lay.cp)]
    core, comms = attention_core(lay.cp_attention, mesh, positions, timeline, lay.ulysses)
    for block in model.blocks:
        block.attn.core = core
    return positions[mesh.rank(CP)], comms
