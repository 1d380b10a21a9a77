"""Pipeline bubble and activation memory: what theory predicts for a schedule.

Bubble fraction = idle / makespan, the same on every rank when stages are balanced. With p
pipeline ranks, m micro-batches and per-stage times t_F, t_B (input gradient) and t_W (weight
gradient) of one micro-batch on one rank's share of the model:

    naive           (p-1) / p                                one batch, m = 1
    GPipe, 1F1B     (p-1) / (m + p - 1)                      Huang et al. 2019; Narayanan et al. 2021
    interleaved     (p-1) / (v m + p - 1)                    Narayanan et al. 2021, eq. 2: the
                                                             fill and drain shrink to 1/v
    ZB-H1           (p-1)(t_F+t_B-t_W) / (m(t_F+t_B+t_W) + (p-1)(t_F+t_B-t_W))
                                                             Qi et al. 2023, sec. 3.1; m >= p
    ZB-V            (p-1) t_F/2 / (m(t_F+t_B+t_W) + (p-1) t_F/2)
                                                             only the fill is left: the last rank
                                                             starts after p-1 half-stage
                                                             forwards; m >= 2p, t_F = t_B = t_W
    DualPipeV       the same as ZB-V                         DeepSeek-AI 2024 (DualPipe), cut in a
                                                             V; m >= 2p, t_F = t_B = t_W, F&B run
                                                             back to back (no overlap on one core)

For GPipe and 1F1B the bubble time is (p-1)(t_F+t_B+t_W), so the fraction does not depend on
the times. The zero-bubble forms hold for dlab's schedules at t_F = t_B = t_W (where they were
built) and m >= p (ZB-H1) or m >= 2p (ZB-V, DualPipeV); elsewhere ``bubble`` returns None and
``simulated_bubble`` gives the answer.

DualPipeV's idle time, derived from its phases (``schedules.dualpipev``) at unit times with a
stage's work split in two half-size chunks (t_F/2 each): rank r starts chunk 1 only once
micro-batch 0 has come down the first leg, and the last rank waits (p-1) half-stage forwards
for it: (p-1) t_F/2. From then on every slot pairs a forward with a backward whose inputs
arrived one slot before, and the drain is filled by the p weight gradients each rank deferred
in phases 6-7, so nothing else idles: makespan m(t_F+t_B+t_W) + (p-1) t_F/2 on every rank, the
ZB-V figure. (DeepSeek's table gives (PP/2-1)(F&B+B-3W) for DualPipe, where F&B is a forward
and a backward *overlapped* on one GPU; here they run in turn, F&B = F + B, and the turn costs
what the fill costs.) With t_B != t_W the drain no longer lines up and the idle time grows
with p faster than linearly (``simulated_bubble`` then).

Activation memory is counted in micro-batches a rank holds between a forward and its backward
(``in_flight``): GPipe holds all m, 1F1B at most p - r on rank r, interleaved 1F1B
2(p-r-1) + (v-1)p + 1 chunks of 1/v micro-batch each; ZB-H1 like 1F1B; ZB-V at most p
(its limit of 2p half-size chunks); DualPipeV p + 1/2: phases 1-2 leave 2p chunks in flight
on every rank, and the steady phase runs a forward before each backward, one chunk more.
Zero-bubble schedules also keep, until W, the inputs of
the weight matmuls and their output gradients of up to p-1 (ZB-H1) or p/2 (ZB-V) more.

Receive buffers (``recv_buffer_bytes``): at a receive a rank holds the buffer it waits on and
the k it keeps posted after it, k + 1 boundary tensors (batch / (d m) x seq x d_model, fp32),
or as many receives as the step has if fewer.
"""
from __future__ import annotations

from dlab.layout import schedules
from dlab.theory.simulate import bubble as _bubble_of
from dlab.theory.simulate import simulate


def bubble(schedule: str, p: int, m: int, v: int = 1, t_f: float = 1.0, t_b: float = 1.0,
           t_w: float = 1.0) -> float | None:
    """The closed form above; None where it does not apply."""
    if schedule == "naive":
        return (p - 1) / p
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved":
        return (p - 1) / (v * m + p - 1)
    work = m * (t_f + t_b + t_w)
    if m < p:
        return None
    if schedule == "zb-h1":
        idle = (p - 1) * max(t_f + t_b - t_w, 0.0)
        return idle / (work + idle)
    if schedule in ("zbv", "dualpipev"):
        if m < 2 * p or not (t_f == t_b == t_w):
            return None
        idle = (p - 1) * t_f / 2
        return idle / (work + idle)
    raise ValueError(f"unknown schedule {schedule!r}")


def simulated_bubble(schedule: str, p: int, m: int, v: int = 1, t_f: float = 1.0,
                     t_b: float = 1.0, t_w: float = 1.0, t_comm: float = 0.0) -> float:
    """The bubble of dlab's action lists run on paper with these times."""
    return _bubble_of(simulate(schedules.build(schedule, p, m, v), t_f, t_b, t_w, t_comm))


def in_flight(schedule: str, p: int, m: int, rank: int, v: int = 1) -> float:
    """Most micro-batches' activations rank ``rank`` holds at once (forward done, backward not),
    in whole micro-batches (a chunk of an interleaved or V schedule counts 1/v). Exact, except
    for ZB-V where it is the schedule's upper bound."""
    if schedule in ("naive", "gpipe"):
        return m
    if schedule in ("1f1b", "zb-h1"):
        return min(p - rank, m)
    if schedule == "interleaved":
        return min(2 * (p - rank - 1) + (v - 1) * p + 1, m * v) / v
    if schedule == "zbv":
        return min(p, m)
    if schedule == "dualpipev":
        return p + 0.5
    raise ValueError(f"unknown schedule {schedule!r}")


def in_flight_of(sched: schedules.Schedule) -> list[float]:
    """The same count read off an action list: the most (forward done, backward not yet) stage
    micro-batches per rank, divided by the stages per rank."""
    out = []
    for acts in sched.actions:
        held = peak = 0
        for a in acts:
            if a.kind == "forward":
                held += 1
                peak = max(peak, held)
            elif a.kind == "backward":
                held -= 1
        out.append(peak / sched.v)
    return out


def recv_buffer_bytes(recv_ahead: int, receives: int, micro_batch: int, seq_len: int, d_model: int,
                      element_bytes: int = 4) -> int:
    """Peak bytes of receive buffers posted and not yet consumed on a rank that makes
    ``receives`` receives a step, with ``recv_ahead`` kept posted ahead of the one it waits on."""
    return min(recv_ahead + 1, receives) * micro_batch * seq_len * d_model * element_bytes
