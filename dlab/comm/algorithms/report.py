"""What an algorithm did on one rank: steps, bytes, and (on request) a trace to draw.

A ``Report`` is returned by every hand-written collective. Its trace lists each message this
rank sent as ``Transfer(step, src, dst, chunk, holds, reduce)``: in schedule step ``step`` rank
``src`` sent chunk ``chunk`` (the algorithm's unit of the vector: a ring's N chunks, a tree's
pipelined pieces, a halving's blocks) to ``dst``, and that chunk then carried the contributions
of the ranks in ``holds``; ``reduce`` says whether the receiver folded it into its own copy
(a reduction) or overwrote its copy (a gather / broadcast). The traces of all ranks together
replay the whole algorithm: ``holdings(reports)`` says which partial sum every rank holds for
every chunk after every step - what the notebook draws.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Transfer:
    step: int
    src: int
    dst: int
    chunk: int
    holds: tuple[int, ...]
    reduce: bool


@dataclass
class Report:
    algorithm: str
    rank: int
    world_size: int
    nbytes: int  # payload: the size of the tensor reduced (or gathered / broadcast)
    chunks: int = 1  # how many chunks the trace's chunk indices range over
    rounds: int = 0  # steps in the whole schedule (the alpha count of the cost model)
    steps: int = 0  # steps in which this rank sent or received
    messages: int = 0  # messages this rank sent
    sent_bytes: int = 0
    recv_bytes: int = 0
    # messages on the transport: a send longer than the exchange's piece goes as several, and
    # each carries the backend's framing (dlab.comm.gloo.gloo_framing on Gloo)
    sent_pieces: int = 0
    recv_pieces: int = 0
    message_bytes: int = 0  # payload sent as messages: sent_bytes, except shm (barrier tokens)
    trace: list[Transfer] | None = field(default=None, repr=False)

    def to_dict(self) -> dict:
        return asdict(self)


def merged_trace(reports: list[Report]) -> list[Transfer]:
    """Every rank's sends, in schedule order."""
    out = [t for r in reports for t in (r.trace or [])]
    return sorted(out, key=lambda t: (t.step, t.src, t.dst, t.chunk))


def holdings(reports: list[Report]) -> list[list[list[frozenset[int]]]]:
    """``h[s][rank][chunk]``: the ranks whose contributions that rank's copy of that chunk holds
    after step ``s - 1`` (``h[0]`` is the start: every rank holds only its own)."""
    if any(r.trace is None for r in reports):
        raise ValueError("holdings() needs reports made with trace=True")
    n, chunks = reports[0].world_size, reports[0].chunks
    rounds = max(r.rounds for r in reports)
    state = [[frozenset([rank]) for _ in range(chunks)] for rank in range(n)]
    out = [[list(row) for row in state]]
    by_step: dict[int, list[Transfer]] = {}
    for t in merged_trace(reports):
        by_step.setdefault(t.step, []).append(t)
    for s in range(rounds):
        for t in by_step.get(s, []):
            old = state[t.dst][t.chunk]
            state[t.dst][t.chunk] = old | frozenset(t.holds) if t.reduce else frozenset(t.holds)
        out.append([list(row) for row in state])
    return out
