"""The attention core a context-parallel strategy installs in every block: by name
(``ATTENTION``), built over a mesh's cp dimension (``attention_core``). ``cp`` and ``nd`` both
take it from here."""
from __future__ import annotations

import functools

from dlab.core.options import Option
from dlab.parallel.context.attention import (
    Hybrid,
    Ring,
    allgather_attention,
    ring_attention,
    ulysses_attention,
    usp_attention,
)

ATTENTION = {"ring": ring_attention, "allgather": allgather_attention, "ulysses": ulysses_attention,
             "usp": usp_attention}

#: the options of context parallelism, in ``cp`` and ``nd`` alike
ULYSSES = Option("int", "Ulysses ranks per group under attention='usp' (the ring runs across "
                 "the groups)", default=2, minimum=1)


def attention_core(attention: str, mesh, positions: list, timeline=None, ulysses: int = 2):
    """The attention core over ``mesh``'s cp dimension, and the Comms it talks over."""
    if attention == "usp":
        heads, across = mesh.folded(("cp",), ulysses)
        return functools.partial(usp_attention, ring=Hybrid(heads, across, positions, timeline)), [
            heads, across]
    return (functools.partial(ATTENTION[attention], ring=Ring(mesh.comm("cp"), positions, timeline)),
            [mesh.comm("cp")])
