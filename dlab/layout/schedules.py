"""Pipeline schedules as data: for every rank, the ordered list of actions it performs.

An ``Action`` is one of

    forward(stage, mb)       run micro-batch ``mb`` through ``stage``
    backward(stage, mb)      its backward; in a zero-bubble schedule the input gradient only
    weight_grad(stage, mb)   the deferred weight gradient of that backward (zero-bubble only)
    send(stage, mb, peer)    ship ``stage``'s output (peer = stage + 1) or input gradient
                             (peer = stage - 1) for ``mb`` to the rank that holds ``peer``
    recv(stage, mb, peer)    receive it there (``stage`` is the receiving stage)

A schedule is a function ``(p, m, v) -> Schedule`` that writes these lists; it decides nothing at
run time. The same lists are simulated with unit times (``dlab.theory.simulate``), drawn,
checked for deadlocks (``simulate.validate``) and executed on real ranks
(``dlab.parallel.pipeline.executor``): what you see is what runs.

Stages are *virtual* stages: ``n_stages`` pieces of the model, placed on ``p`` ranks by
``stage_rank``. Plain schedules put stage s on rank s; interleaved 1F1B puts v stages on each rank
round-robin (stage s on rank s mod p; Narayanan et al. 2021); the V-shape (ZB-V, DualPipeV) puts
stages r and 2p-1-r on rank r (Qi et al. 2024), so the first and the last stage share rank 0.

Compute orders are written per rank; ``_with_comms`` then adds a recv right before each
computation whose input lives on another rank and a send right after each computation whose
output is needed on another rank. The executor posts sends without waiting and blocks on recvs,
and ``simulate`` models exactly that.
"""
from __future__ import annotations

from dataclasses import dataclass

COMPUTE = ("forward", "backward", "weight_grad")
SHORT = {"forward": "F", "backward": "B", "weight_grad": "W", "send": "S", "recv": "R"}


@dataclass(frozen=True)
class Action:
    kind: str
    stage: int
    mb: int
    peer: int | None = None  # send/recv: the stage at the other end

    def __str__(self) -> str:
        s = f"{SHORT[self.kind]}{self.mb}@{self.stage}"
        return s if self.peer is None else f"{s}{'>' if self.kind == 'send' else '<'}{self.peer}"

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE


def F(stage: int, mb: int) -> Action:
    return Action("forward", stage, mb)


def B(stage: int, mb: int) -> Action:
    return Action("backward", stage, mb)


def W(stage: int, mb: int) -> Action:
    return Action("weight_grad", stage, mb)


@dataclass
class Schedule:
    name: str
    p: int  # ranks in one pipeline
    m: int  # micro-batches per step
    n_stages: int
    stage_rank: tuple[int, ...]  # virtual stage -> rank
    actions: list[list[Action]]  # per rank, in order
    split_backward: bool = False  # backward is input-grad only and weight_grad follows

    def stages_of(self, rank: int) -> list[int]:
        return [s for s, r in enumerate(self.stage_rank) if r == rank]

    @property
    def v(self) -> int:
        return self.n_stages // self.p

    def compute(self, rank: int) -> list[Action]:
        return [a for a in self.actions[rank] if a.is_compute]

    def __str__(self) -> str:
        return "\n".join(f"rank {r}: " + " ".join(str(a) for a in acts)
                         for r, acts in enumerate(self.actions))


# --- placing sends and receives -----------------------------------------------------------------

def _with_comms(orders: list[list[Action]], stage_rank: tuple[int, ...]) -> list[list[Action]]:
    last = len(stage_rank) - 1
    out = []
    for rank, order in enumerate(orders):
        acts: list[Action] = []
        for a in order:
            s = a.stage
            if a.kind == "forward" and s > 0 and stage_rank[s - 1] != rank:
                acts.append(Action("recv", s, a.mb, s - 1))
            if a.kind == "backward" and s < last and stage_rank[s + 1] != rank:
                acts.append(Action("recv", s, a.mb, s + 1))
            acts.append(a)
            if a.kind == "forward" and s < last and stage_rank[s + 1] != rank:
                acts.append(Action("send", s, a.mb, s + 1))
            if a.kind == "backward" and s > 0 and stage_rank[s - 1] != rank:
                acts.append(Action("send", s, a.mb, s - 1))
        out.append(acts)
    return out


def _plain(p: int) -> tuple[int, ...]:
    return tuple(range(p))


def problems(name: str, p: int, m: int, v: int = 1) -> list[str]:
    """What stops schedule ``name`` on ``p`` pipeline ranks with ``m`` micro-batches and ``v``
    stages per rank, each saying what to change: the one statement of the schedules' rules
    (``build`` refuses what it lists; ``dlab.layout.Layout`` asks it without building)."""
    if name not in SCHEDULES:
        return [f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}"]
    if p < 1 or m < 1:
        return [f"a pipeline needs p >= 1 stages and m >= 1 micro-batches (got p={p}, m={m})"]
    if v < 1:
        return [f"virtual_stages must be >= 1 (got {v})"]
    if name == "naive" and m != 1:
        return [f"the naive pipeline runs the whole batch at once (m=1), not m={m}; use gpipe or "
                f"1f1b for micro-batches"]
    if v > 1 and name not in ("interleaved", *V_SHAPED):
        return [f"virtual_stages={v} needs the interleaved or zbv schedule; {name} places one "
                f"stage per rank"]
    if name == "interleaved" and m % p:
        return [f"interleaved 1F1B sends micro-batches in groups of p={p}: microbatches={m} must "
                f"be a multiple of {p}"]
    if name in V_SHAPED and v != 2:
        return [f"the V schedule places exactly 2 stages per rank (virtual_stages=2), not {v}"]
    if name == "dualpipev" and m < 2 * p:
        return [f"DualPipeV fills both legs of the V before its steady phase: microbatches={m} "
                f"must be at least 2p = {2 * p}"]
    return []


def n_stages(name: str, p: int, v: int = 1) -> int:
    """How many pieces the schedule cuts the model into: p, or v per rank (interleaved, V)."""
    return p * v if name in ("interleaved", *V_SHAPED) else p


def _check(name: str, p: int, m: int, v: int) -> None:
    found = problems(name, p, m, v)
    if found:
        raise ValueError(found[0])


# --- the schedules ------------------------------------------------------------------------------

def gpipe(p: int, m: int, v: int = 1) -> Schedule:
    """GPipe (Huang et al. 2019): every forward, then every backward. Each rank holds the
    activations of all m micro-batches at the turn; bubble (p-1)/(m+p-1)."""
    _check("gpipe", p, m, v)
    orders = [[F(r, i) for i in range(m)] + [B(r, i) for i in range(m)] for r in range(p)]
    return Schedule("gpipe", p, m, p, _plain(p), _with_comms(orders, _plain(p)))


def naive(p: int, m: int = 1, v: int = 1) -> Schedule:
    """Model parallelism without micro-batches: one batch goes down the stages and back, so at
    any moment one rank works and p-1 wait; bubble (p-1)/p."""
    _check("naive", p, m, v)
    s = gpipe(p, 1)
    s.name = "naive"
    return s


def one_f_one_b(p: int, m: int, v: int = 1) -> Schedule:
    """1F1B, PipeDream-Flush (Narayanan et al. 2021): rank r runs p-r-1 warm-up forwards, then
    alternates one forward and one backward, then drains the backwards. Same bubble as GPipe,
    but rank r holds at most min(p-r, m) micro-batches of activations instead of m."""
    _check("1f1b", p, m, v)
    orders = []
    for r in range(p):
        warm = min(p - r - 1, m)
        order = [F(r, i) for i in range(warm)]
        for i in range(m - warm):
            order += [F(r, warm + i), B(r, i)]
        order += [B(r, i) for i in range(m - warm, m)]
        orders.append(order)
    return Schedule("1f1b", p, m, p, _plain(p), _with_comms(orders, _plain(p)))


def interleaved(p: int, m: int, v: int = 2) -> Schedule:
    """Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021, sec. 2.2): each rank holds v
    model chunks (stage s on rank s mod p). Micro-batches go through a rank's chunks in groups
    of p, so a stage's work is 1/v as long and the bubble shrinks by v: (p-1)/(v m + p - 1).
    Needs m a multiple of p."""
    _check("interleaved", p, m, v)
    n = p * v
    placement = tuple(s % p for s in range(n))
    total = m * v

    def nth(r: int, k: int, backward: bool) -> Action:
        """Rank r's k-th forward (or backward): chunks in groups of p micro-batches."""
        group, within = divmod(k, p)
        chunk = group % v
        mb = (k // (p * v)) * p + within
        if backward:
            chunk = v - 1 - chunk
        return (B if backward else F)(chunk * p + r, mb)

    orders = []
    for r in range(p):
        # Megatron's warm-up: 2 (p-r-1) forwards to fill the pipe for this rank's first backward
        # plus (v-1) p for the chunks after the first.
        warm = min(2 * (p - r - 1) + (v - 1) * p, total)
        order = [nth(r, k, False) for k in range(warm)]
        for k in range(total - warm):
            order += [nth(r, warm + k, False), nth(r, k, True)]
        order += [nth(r, k, True) for k in range(total - warm, total)]
        orders.append(order)
    return Schedule("interleaved-1f1b", p, m, n, placement, _with_comms(orders, placement))


# --- zero-bubble schedules: found by list scheduling at unit times -------------------------------

def _list_schedule(p: int, m: int, placement: tuple[int, ...], max_unbackwarded: list[int],
                   max_held: list[int]) -> list[list[Action]]:
    """Greedy list scheduling at unit times (t_F = t_B = t_W = 1), the way the ZB paper (Qi et
    al. 2023, sec. 3) builds its hand-crafted schedules: whenever a rank is free it runs, in
    order of preference,

    1. a backward (input gradient) whose gradient has arrived - B is on the critical path;
    2. a forward whose input has arrived, if the rank then holds at most
       ``max_unbackwarded[r]`` micro-batches not yet through B (their full activations) and
       ``max_held[r]`` not yet through W (what a pending W keeps: the inputs of the weight
       matmuls and their output gradients);
    3. the oldest pending weight gradient - nobody waits for W, so it fills what would be bubble.

    Later stages go first on a rank holding several (the V's second leg finishes micro-batches)."""
    n = len(placement)
    stages = [sorted((s for s in range(n) if placement[s] == r), reverse=True) for r in range(p)]
    f_done: dict[tuple[int, int], int] = {}
    b_done: dict[tuple[int, int], int] = {}
    next_f, next_b = [0] * n, [0] * n
    pending_w: list[list[Action]] = [[] for _ in range(p)]
    unbackwarded, held = [0] * p, [0] * p
    busy_until = [0] * p
    orders: list[list[Action]] = [[] for _ in range(p)]
    todo, t = 3 * m * n, 0

    def done_by(table: dict, key: tuple) -> bool:
        return table.get(key, t + 1) <= t

    while todo:
        for r in range(p):
            if busy_until[r] > t:
                continue
            choice = next((B(s, next_b[s]) for s in stages[r] if next_b[s] < m
                           and done_by(f_done, (s, next_b[s]))
                           and (s == n - 1 or done_by(b_done, (s + 1, next_b[s])))), None)
            if choice is None and unbackwarded[r] < max_unbackwarded[r] and held[r] < max_held[r]:
                choice = next((F(s, next_f[s]) for s in stages[r] if next_f[s] < m
                               and (s == 0 or done_by(f_done, (s - 1, next_f[s])))), None)
            if choice is None and pending_w[r]:
                choice = pending_w[r].pop(0)
            if choice is None:
                continue
            orders[r].append(choice)
            busy_until[r] = t + 1
            todo -= 1
            key = (choice.stage, choice.mb)
            if choice.kind == "forward":
                f_done[key] = t + 1
                next_f[choice.stage] += 1
                unbackwarded[r] += 1
                held[r] += 1
            elif choice.kind == "backward":
                b_done[key] = t + 1
                next_b[choice.stage] += 1
                unbackwarded[r] -= 1
                pending_w[r].append(W(*key))
            else:
                held[r] -= 1
        t += 1
    return orders


def zb_h1(p: int, m: int, v: int = 1) -> Schedule:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): backward split into the input
    gradient B (what the previous stage waits for) and the weight gradient W (which nobody waits
    for). Full activations stay bounded as in 1F1B (rank r: p-r micro-batches before their B);
    up to p-1 more micro-batches may wait for their W, and moving W's into the drain cuts the
    bubble from (p-1)(t_F+t_B+t_W) to (p-1)(t_F+t_B-t_W)."""
    _check("zb-h1", p, m, v)
    placement = _plain(p)
    orders = _list_schedule(p, m, placement, [p - r for r in range(p)],
                            [2 * p - r - 1 for r in range(p)])
    return Schedule("zb-h1", p, m, p, placement, _with_comms(orders, placement),
                    split_backward=True)


def zbv(p: int, m: int, v: int = 2) -> Schedule:
    """ZB-V (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory"): 2p stages in a V,
    stages r and 2p-1-r on rank r, so the last stage sits on rank 0 beside the first and the
    turn of the V costs no communication. Full activations bounded by 1F1B's peak (2p
    half-size chunks = p micro-batches per rank), up to p more chunks may wait for their W.
    Once m >= 2p the only idle time left is the pipeline's fill: (p-1) half-stage forwards."""
    _check("zbv", p, m, v)
    placement = _v_placement(p)
    orders = _list_schedule(p, m, placement, [2 * p] * p, [3 * p] * p)
    return Schedule("zbv", p, m, 2 * p, placement, _with_comms(orders, placement),
                    split_backward=True)


def _v_placement(p: int) -> tuple[int, ...]:
    """Stages r and 2p-1-r on rank r: the model folded in a V."""
    return tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p))


def _dualpipev_rank(p: int, m: int, r: int) -> list[Action]:
    """Rank r's compute order in DualPipeV's eight phases (``dualpipev``'s docstring)."""
    chunk = (r, 2 * p - 1 - r)  # chunk 0 on the way down, chunk 1 on the way back
    nxt = {("F", 0): 0, ("F", 1): 0, ("B", 0): 0, ("B", 1): 0}
    deferred: list[Action] = []
    order: list[Action] = []

    def fwd(c: int) -> None:
        order.append(F(chunk[c], nxt[("F", c)]))
        nxt[("F", c)] += 1

    def bwd(c: int, defer: bool = False) -> None:
        act = B(chunk[c], nxt[("B", c)])
        nxt[("B", c)] += 1
        order.append(act)
        (deferred if defer else order).append(W(act.stage, act.mb))

    for _ in range(2 * (p - r - 1)):
        fwd(0)
    for _ in range(r + 1):
        fwd(0)
        fwd(1)
    for _ in range(p - r - 1):
        bwd(1)
        fwd(1)
    for _ in range(m - 2 * p + r + 1):
        fwd(0)
        bwd(1)
        fwd(1)
        bwd(0)
    for _ in range(p - r - 1):
        bwd(1)
        fwd(1)
        bwd(0)
    # DeepSeek's phase 6: W is deferred from the middle pair on (for B1 on odd ranks, from B0
    # on even ones), so r+1 W's wait for the drain
    half = (r + 1) // 2
    for i in range(r + 1):
        bwd(1, defer=i > half or (i == half and r % 2 == 1))
        bwd(0, defer=i >= half)
    for _ in range(p - r - 1):
        order.append(deferred.pop(0))
        bwd(0, defer=True)
    return order + deferred


def dualpipev(p: int, m: int, v: int = 2) -> Schedule:
    """DualPipeV: DualPipe (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", sec. 3.2.1) cut in
    half into a V, as DeepSeek's open ``dualpipev.py`` and ``torch``'s ``ScheduleDualPipeV`` do.

    DualPipe feeds micro-batches into both ends of the pipeline at once, so every rank holds a
    forward of one micro-batch and a backward of another at the same time and runs them as one
    overlapped "F&B" chunk (the all-to-all of one hides behind the compute of the other). Folding
    its two directions into a V gives each rank stages r and 2p-1-r (chunk 0 goes down the ranks,
    chunk 1 comes back up). Rank r runs eight phases (``m >= 2p``):

    1. 2(p-r-1) forwards of chunk 0 (filling the first leg);
    2. r+1 pairs F0, F1 (the turn: the last rank starts chunk 1 at once);
    3. p-r-1 times B1, W1, F1 (a full backward of chunk 1, then one more forward);
    4. m-2p+r+1 times F0&B1, F1&B0: the steady phase, a forward and a backward per slot;
    5. p-r-1 times B1, F1&B0 (chunk 0's input runs out);
    6. r+1 pairs B1, B0; from the middle pair on the weight gradient W is deferred;
    7. p-r-1 times W, B0 (deferred W's fill the drain, as in zero-bubble schedules);
    8. r+1 W's.

    Outside phases 6-7 each B is followed at once by its W (a whole backward). "F&B" runs here
    as F then B: on one CPU process nothing overlaps, so the overlap DualPipe is built for shows
    as the pair's two ops back to back (``dlab.theory.pipeline.bubble`` models it so)."""
    _check("dualpipev", p, m, v)
    placement = _v_placement(p)
    orders = [_dualpipev_rank(p, m, r) for r in range(p)]
    return Schedule("dualpipev", p, m, 2 * p, placement, _with_comms(orders, placement),
                    split_backward=True)


SCHEDULES = {"naive": naive, "gpipe": gpipe, "1f1b": one_f_one_b,
             "interleaved": interleaved, "zb-h1": zb_h1, "zbv": zbv, "dualpipev": dualpipev}
#: the schedules that fold the model in a V, two stages per rank
V_SHAPED = ("zbv", "dualpipev")
#: the schedules whose backward is the input gradient only, with weight_grad actions after it
SPLIT_BACKWARD = ("zb-h1", "zbv", "dualpipev")


def build(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The action lists of schedule ``name`` (``v=1`` for a V schedule means its 2)."""
    if name in V_SHAPED and v == 1:
        v = 2
    _check(name, p, m, v)
    return SCHEDULES[name](p, m, v)
