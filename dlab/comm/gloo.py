"""What Gloo writes on the wire for each collective: the model the measured ``wire_bytes``
equal to the byte (tests/test_wire_bytes.py).

The ring formulas of ``dlab.theory.comm`` are the textbook ("ring model": nccl-tests' bus-bandwidth
convention), and ``Comm`` counts them as ``sent_bytes``.
Gloo's own algorithms differ in two ways, both measured on the wire (``dlab.comm.wire``, tests
in tests/test_wire_bytes.py) and read from gloo's source (gloo/allreduce.cc, allgather.cc,
broadcast.cc, alltoall.cc, transport/tcp/pair.cc):

- framing: a message goes as an unbound-buffer send. The sender writes a NOTIFY_SEND_READY
  preamble, then a SEND_UNBOUND_BUFFER preamble and the payload; the receiver writes one
  NOTIFY_RECV_READY preamble. A preamble is six size_t fields, 48 bytes on 64-bit Linux. So a
  rank writes ``payload + 96`` per message it sends and ``48`` per message it receives.
- algorithms: all_reduce is a ring cut into ``segments`` (at least 2 per rank, at most 1 MiB
  each, a multiple of N); reduce_scatter_tensor is a whole all-reduce of the input followed by
  a local copy (torch's ProcessGroupGloo), 2 (N-1)/N S instead of (N-1)/N S; all_gather is a
  ring moving each block in two halves; broadcast is a binomial tree (at N = 4 the root sends
  to 2 ranks, one more rank forwards once, two only receive); all_to_all sends N-1 blocks
  directly; send is one message.
"""
from __future__ import annotations

GLOO_PREAMBLE = 48  # bytes: gloo::transport::tcp::Op's preamble, six size_t
GLOO_MAX_SEGMENT = 1 << 20  # gloo::AllreduceOptions::kMaxSegmentSize


def gloo_framing(sends: int, recvs: int) -> int:
    """Bytes a rank writes around its messages' payloads: 2 preambles per send, 1 per receive."""
    return 2 * GLOO_PREAMBLE * sends + GLOO_PREAMBLE * recvs


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def gloo_all_reduce_bytes(nbytes: int, n: int, rank: int, element_size: int = 4,
                          max_segment: int = GLOO_MAX_SEGMENT) -> int:
    """Bytes rank ``rank`` writes for Gloo's ring all-reduce of ``nbytes``: the two phases of
    ``numSegments - numSegments / N`` steps each, a segment sent and one received per step
    (segments past the end of the vector are skipped, so any size is exact)."""
    if n == 1 or nbytes == 0:
        return 0
    seg_max = element_size * max(1, max_segment // element_size)
    segments = _round_up(max(-(-nbytes // seg_max), 2 * n), n)
    per_rank = segments // n
    seg = _round_up(-(-nbytes // segments), element_size)
    span = segments * seg
    written = 0
    for send_first, recv_first in ((rank + 1, rank + 2), (rank, rank + 1)):  # reduce-scatter, all-gather
        for i in range(segments - per_rank):
            send = min(seg, nbytes - (send_first * per_rank + i) * seg % span)
            recv = min(seg, nbytes - (recv_first * per_rank + i) * seg % span)
            written += send + gloo_framing(1, 0) if send > 0 else 0
            written += gloo_framing(0, 1) if recv > 0 else 0
    return written


def gloo_all_gather_bytes(out_nbytes: int, n: int) -> int:
    """Gloo's ring all-gather: 2 (N-1) messages, each half of a rank's block."""
    if n == 1 or out_nbytes == 0:
        return 0
    block = out_nbytes // n
    return (n - 1) * block + gloo_framing(2 * (n - 1), 2 * (n - 1))


def gloo_broadcast_bytes(nbytes: int, n: int, rank: int, root: int = 0) -> int:
    """Gloo's binomial tree over virtual ranks v = rank - root (mod N): in round i (0 ..
    ceil(log2 N) - 1) every v below 2^i sends S to v + 2^i, so v receives once, in the round of
    its highest bit, and then sends in each later round whose partner exists."""
    v = (rank - root) % n
    sends = sum(1 for i in range(v.bit_length(), (n - 1).bit_length()) if v + (1 << i) < n)
    return sends * nbytes + gloo_framing(sends, 1 if v else 0)


def gloo_all_to_all_bytes(sent_payload: int, n: int) -> int:
    """N-1 direct messages each way (empty blocks too), payload what this rank sends to others."""
    return sent_payload + gloo_framing(n - 1, n - 1) if n > 1 else 0


def gloo_reduce_scatter_bytes(in_nbytes: int, n: int, rank: int, element_size: int = 4) -> int:
    """torch's ProcessGroupGloo reduce_scatter_tensor: an all-reduce of the whole input."""
    return gloo_all_reduce_bytes(in_nbytes, n, rank, element_size)


def gloo_send_bytes(nbytes: int) -> int:
    return nbytes + gloo_framing(1, 0)


def gloo_recv_bytes() -> int:
    return gloo_framing(0, 1)


def ring_reduce_scatter_wire(in_nbytes: int, n: int, piece_bytes: int = 1 << 20) -> int:
    """dlab's ring reduce-scatter (``dlab.comm.algorithms.collectives``) on Gloo, N-divisible
    input: N-1 steps, each sending and receiving one S/N chunk cut into 1 MiB pieces."""
    if n == 1:
        return 0
    chunk = in_nbytes // n
    pieces = max(1, -(-chunk // piece_bytes))
    return (n - 1) * chunk + gloo_framing((n - 1) * pieces, (n - 1) * pieces)
