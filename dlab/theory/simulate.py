"""Run a schedule on paper: the timeline its action lists produce with given op times.

``simulate`` executes every rank's list the way ``executor.py`` does - computations in order,
sends posted without waiting, a recv blocking until its matching send has been posted (plus
``t_comm``) - and returns events of the same shape the real timeline records (``kind``,
``stage``, ``mb``, ``rank``, ``start``, ``end``), so one drawing function (``dlab.ui.gantt``) and
one bubble function serve both. A list that can block forever raises ``DeadlockError`` naming what each
rank waits for.

Default times are units: a forward 1, an input-gradient backward 1, a weight gradient 1 (so
a whole backward is 2, the usual 2:1 ratio). A rank with v virtual stages does 1/v of the work
per stage, so stage times scale by p / n_stages. ``durations`` instead gives every op its own
time, keyed ``(kind, stage, mb)``: how ``replay_ops`` re-runs a measured step.

Three bubbles, each adding one thing the one before leaves out: the closed form (equal unit
times, free communication: ``dlab.theory.pipeline.bubble``), ``replay`` at each stage's
mean measured op times (the same when stages are balanced; adds their imbalance),
``replay_ops`` at each op's own measured time
(adds the jitter: in a pipeline a rank waits for the slower of its neighbours, so op times that
scatter around one mean make idle time that no mean shows), and the measured timeline (adds
what communication and the dispatch between actions cost).
"""
from __future__ import annotations

from dlab.layout.schedules import COMPUTE, SHORT, Schedule


class DeadlockError(RuntimeError):
    pass


def op_time(schedule: Schedule, kind: str, t_f: float, t_b: float, t_w: float) -> float:
    scale = schedule.p / schedule.n_stages
    if kind == "forward":
        return t_f * scale
    if kind == "backward":
        return (t_b if schedule.split_backward else t_b + t_w) * scale
    return t_w * scale


def simulate(schedule: Schedule, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0,
             t_comm: float = 0.0, durations: dict[tuple, float] | None = None) -> list[dict]:
    sr = schedule.stage_rank
    p = schedule.p
    pc = [0] * p
    clock = [0.0] * p
    posted: dict[tuple, float] = {}  # (from stage, mb, to stage) -> time the data is there
    local: dict[tuple, float] = {}  # same-rank hand-offs (the V's turn): (stage, mb, kind)
    received: dict[tuple, float] = {}  # (stage, mb, "act"|"grad") -> time it is here
    f_end: dict[tuple, float] = {}
    events: list[dict] = []
    last = schedule.n_stages - 1
    remaining = sum(len(a) for a in schedule.actions)
    while remaining:
        progressed = False
        for r in range(p):
            while pc[r] < len(schedule.actions[r]):
                a = schedule.actions[r][pc[r]]
                ready = _ready(a, sr, r, last, posted, received, local, f_end, t_comm)
                if ready is None:
                    break
                start = max(clock[r], ready) if a.kind != "recv" else clock[r]
                if a.kind in COMPUTE:
                    end = start + (durations[(a.kind, a.stage, a.mb)] if durations is not None
                                   else op_time(schedule, a.kind, t_f, t_b, t_w))
                    if a.kind == "forward":
                        f_end[(a.stage, a.mb)] = end
                        if a.stage < last and sr[a.stage + 1] == r:
                            local[(a.stage + 1, a.mb, "act")] = end
                    elif a.kind == "backward" and a.stage > 0 and sr[a.stage - 1] == r:
                        local[(a.stage - 1, a.mb, "grad")] = end
                elif a.kind == "send":
                    end = start
                    posted[(a.stage, a.mb, a.peer)] = end + t_comm
                else:  # recv: wait for the data
                    end = max(start, ready)
                    received[(a.stage, a.mb, "act" if a.peer < a.stage else "grad")] = end
                events.append({"kind": a.kind, "stage": a.stage, "mb": a.mb, "rank": r,
                               "start": start, "end": end})
                clock[r] = end
                pc[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: str(schedule.actions[r][pc[r]]) for r in range(p)
                     if pc[r] < len(schedule.actions[r])}
            raise DeadlockError(f"{schedule.name} (p={p}, m={schedule.m}) deadlocks: each rank "
                                f"waits on {stuck}")
    return events


def _ready(a, sr, r, last, posted, received, local, f_end, t_comm) -> float | None:
    """When ``a``'s inputs are on rank ``r`` (None: not yet produced)."""
    if a.kind == "recv":
        return posted.get((a.peer, a.mb, a.stage))
    if a.kind == "send":
        return 0.0
    if a.kind == "forward":
        if a.stage == 0:
            return 0.0
        return received.get((a.stage, a.mb, "act"), local.get((a.stage, a.mb, "act")))
    if a.kind == "backward":
        if (a.stage, a.mb) not in f_end:
            return None
        if a.stage == last:
            return f_end[(a.stage, a.mb)]
        got = received.get((a.stage, a.mb, "grad"), local.get((a.stage, a.mb, "grad")))
        return None if got is None else max(got, f_end[(a.stage, a.mb)])
    return 0.0  # weight_grad: its backward ran earlier on this rank


def validate(schedule: Schedule) -> None:
    """Raises ValueError unless ``schedule`` is runnable: every stage runs every micro-batch's
    forward and backward (and weight gradient, if split) once, on its own rank, forward before
    backward before weight gradient; every send has exactly one matching recv on the peer's rank
    and vice versa; and it completes without deadlock (checked by simulating it)."""
    sr, m, n = schedule.stage_rank, schedule.m, schedule.n_stages
    kinds = ("forward", "backward") + (("weight_grad",) if schedule.split_backward else ())
    position: dict[tuple, int] = {}
    sends, recvs = set(), set()
    for rank, acts in enumerate(schedule.actions):
        for k, a in enumerate(acts):
            if sr[a.stage] != rank:
                raise ValueError(f"rank {rank} runs {a} but stage {a.stage} lives on rank {sr[a.stage]}")
            key = (a.kind, a.stage, a.mb, a.peer)
            if key in position:
                raise ValueError(f"rank {rank} runs {a} twice")
            position[key] = k
            if a.kind == "send":
                sends.add((a.stage, a.mb, a.peer))
            elif a.kind == "recv":
                recvs.add((a.peer, a.mb, a.stage))
            elif a.kind == "weight_grad" and not schedule.split_backward:
                raise ValueError(f"{a}: weight_grad in a schedule whose backward is not split")
    for s in range(n):
        for i in range(m):
            pos = []
            for kind in kinds:
                if (kind, s, i, None) not in position:
                    raise ValueError(f"{SHORT[kind]}{i}@{s} is missing from rank {sr[s]}'s list")
                pos.append(position[(kind, s, i, None)])
            if pos != sorted(pos):
                raise ValueError(f"micro-batch {i} on stage {s}: {'/'.join(kinds)} out of order")
            for peer in (s - 1, s + 1):
                crosses = 0 <= peer < n and sr[peer] != sr[s]
                if not crosses:
                    continue
                wanted = (s, i, peer)
                if wanted not in sends:
                    raise ValueError(f"stage {s} never sends micro-batch {i} to stage {peer}")
    if sends != recvs:
        raise ValueError(f"unmatched sends {sorted(sends - recvs)} / recvs {sorted(recvs - sends)}")
    simulate(schedule)  # raises DeadlockError if the lists can block each other forever


# --- what a timeline says ------------------------------------------------------------------------

def bubble(events: list[dict], ranks: int | None = None) -> float:
    """Idle fraction of one step: 1 - (compute time summed over ranks) / (ranks x makespan),
    the makespan running from the first computation on any rank to the last. Events from
    several steps: the mean over steps. ``ranks`` defaults to the ranks seen."""
    compute = [e for e in events if e["kind"] in COMPUTE]
    if not compute:
        return float("nan")
    steps = sorted({e.get("step", 0) for e in compute})
    out = []
    for step in steps:
        evs = [e for e in compute if e.get("step", 0) == step]
        n = ranks or len({e["rank"] for e in evs})
        span = max(e["end"] for e in evs) - min(e["start"] for e in evs)
        busy = sum(e["end"] - e["start"] for e in evs)
        out.append(1 - busy / (n * span) if span > 0 else 0.0)
    return sum(out) / len(out)


def mean_times(events: list[dict]) -> dict[str, float]:
    """Mean duration of each compute kind over every rank and stage: one figure per kind, to
    print. ``replay`` uses each stage's own means (``stage_mean_times``) instead."""
    out = {}
    for kind in COMPUTE:
        d = [e["end"] - e["start"] for e in events if e["kind"] == kind]
        if d:
            out[kind] = sum(d) / len(d)
    return out


def stage_mean_times(events: list[dict]) -> dict[tuple[str, int], float]:
    """``{(kind, stage): mean duration}``: each stage's own mean, so a slow stage (more layers,
    the head's matmul, a busier core) stays slow in the replay."""
    sums: dict[tuple[str, int], list[float]] = {}
    for e in events:
        if e["kind"] in COMPUTE:
            sums.setdefault((e["kind"], e["stage"]), []).append(e["end"] - e["start"])
    return {k: sum(d) / len(d) for k, d in sums.items()}


def replay(schedule: Schedule, events: list[dict], t_comm: float = 0.0) -> list[dict]:
    """The simulation of ``schedule`` with every op taking its stage's mean measured time in
    ``events`` (a real timeline of the same schedule), shifted to start when the measured step
    starts: theory to overlay on a measurement. Means per stage, not pooled over the ranks: a
    pooled mean makes every stage equal and gives back the closed form whatever was measured,
    hiding the imbalance between stages that a pipeline waits on."""
    means = stage_mean_times(events)
    durations = {(a.kind, a.stage, a.mb): means[(a.kind, a.stage)]
                 for actions in schedule.actions for a in actions if a.kind in COMPUTE}
    return _starting_with(events, simulate(schedule, t_comm=t_comm, durations=durations))


def replay_ops(schedule: Schedule, events: list[dict]) -> list[dict]:
    """The simulation of ``schedule`` with every computation taking exactly the time it took in
    ``events`` (one step of one pipeline) and communication free, shifted to start when the
    measured step starts."""
    durations = {(e["kind"], e["stage"], e["mb"]): e["end"] - e["start"]
                 for e in events if e["kind"] in COMPUTE}
    return _starting_with(events, simulate(schedule, durations=durations))


def _starting_with(events: list[dict], sim: list[dict]) -> list[dict]:
    """``sim`` shifted to start when the measured step in ``events`` starts computing."""
    t0 = min(e["start"] for e in events if e["kind"] in COMPUTE)
    return [dict(e, start=e["start"] + t0, end=e["end"] + t0) for e in sim]


def bubble_of_ops(schedule: Schedule, events: list[dict]) -> float:
    """Mean over the steps in ``events`` of the bubble of ``replay_ops``: the bubble this
    schedule would have had with these very op times and free communication."""
    steps = sorted({e.get("step", 0) for e in events if e["kind"] in COMPUTE})
    return sum(bubble(replay_ops(schedule, [e for e in events if e.get("step", 0) == s]))
               for s in steps) / len(steps)
