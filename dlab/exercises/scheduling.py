"""Notebook 13's checked exercise on gang scheduling: which waiting jobs start now.

``gang_admit(queue, free, running, backfill)``: ``queue`` the waiting jobs in arrival order as
``(name, gpus, hours)``, ``free`` the GPUs free now, ``running`` the jobs already running as
``(gpus, hours_left)``. Every job needs all of its GPUs at once (gang admission: a job holding
some of its GPUs could not run and would keep them from everyone else). Jobs start first come,
first served; the first job that does not fit holds the line. With ``backfill``, a job behind
it may start if it fits now and does not delay it (EASY backfilling, Lifka 1995; Slurm's
backfill scheduler keeps the same promise for every job ahead): the first waiting job is
promised the earliest time enough GPUs will be free (its reservation, counted from the running
jobs' ends and those of the jobs starting now), and a later job may start only if it ends by
then or uses only GPUs that job will not need then.

The judge checks each rule on its own cases, in that order, and names the rule an answer
breaks and the jobs it breaks it with; what remains is compared with ``admit``, the rules
written out.
"""
from __future__ import annotations

from dlab.exercises.registry import exercise

#: (queue, free, running, backfill): each case is there for a rule
CASES = [
    ([("A", 2, 5), ("B", 2, 5)], 4, [], False),                        # everyone fits
    ([("A", 1, 4), ("B", 4, 4), ("C", 1, 1)], 3, [(4, 2)], False),     # B holds the line
    ([("A", 4, 3), ("B", 1, 1)], 3, [(5, 1)], False),                  # the head itself waits
    ([("A", 1, 4), ("B", 4, 4), ("C", 1, 1)], 3, [(4, 2)], True),      # C ends before B's start
    ([("A", 4, 3), ("B", 2, 5), ("C", 1, 1)], 3, [(2, 2)], True),      # B would delay A; C not
    ([("A", 6, 3), ("B", 1, 9), ("C", 2, 9)], 3, [(4, 2)], True),      # B fits in A's spare GPU
    ([("A", 2, 1), ("B", 4, 2), ("C", 2, 3)], 4, [(2, 5)], True),      # A's end makes B's start
    ([("A", 3, 2), ("B", 1, 1), ("C", 1, 5)], 2, [(2, 1)], True),      # B, done in time, spares C
]


def _gpus(n: int) -> str:
    return f"{n} GPU{'' if n == 1 else 's'}"


def reservation(need: int, free: int, ends: list[tuple[int, float]]) -> tuple[float, int]:
    """When a job of ``need`` GPUs can start at the earliest, given ``free`` GPUs now and the
    (gpus, hours_left) of the jobs that will end, and how many GPUs are spare then."""
    when, have = 0.0, free
    for gpus, left in sorted(ends, key=lambda job: job[1]):
        if have >= need:
            break
        when, have = left, have + gpus
    if have < need:
        raise ValueError(f"a job of {need} GPUs can never start: the cluster has {have}")
    return when, have - need


def admit(queue, free, running, backfill) -> list[str]:
    """The rules, written out: the names of the jobs that start now."""
    started, ends, waiting = [], list(running), list(queue)
    while waiting and waiting[0][1] <= free:
        name, gpus, hours = waiting.pop(0)
        started.append(name)
        free -= gpus
        ends.append((gpus, hours))
    if not (backfill and waiting):
        return started
    shadow, spare = reservation(waiting[0][1], free, ends)
    for name, gpus, hours in waiting[1:]:
        if gpus <= free and (hours <= shadow or gpus <= spare):
            started.append(name)
            free -= gpus
            if hours > shadow:
                spare -= gpus
    return started


def _broken_rule(queue, free, running, backfill, got) -> str | None:
    """The first rule ``got`` breaks on this case, said with its jobs; None if it breaks none
    of those named here."""
    jobs = {name: (gpus, hours) for name, gpus, hours in queue}
    if not isinstance(got, (list, tuple)) or not all(isinstance(n, str) and n in jobs for n in got):
        return f"expected a list of the waiting jobs' names ({sorted(jobs)}), got {got!r}"
    if len(set(got)) != len(got):
        return f"a job is started twice in {list(got)}"
    order = [name for name, _, _ in queue]
    used = 0
    for name in sorted(got, key=order.index):
        gpus = jobs[name][0]
        if used + gpus > free:
            return (f"job {name} needs {_gpus(gpus)} and {free - used} are free once the jobs before "
                    f"it have theirs: a job starts with all of its GPUs at once or waits (holding "
                    f"some, it could not run and would keep them from everyone)")
        used += gpus
    left = free
    for name, gpus, _ in queue:  # the head of the line, first come first served
        if gpus > left:
            head = name
            break
        if name not in got:
            return (f"job {name} is next in line and its {_gpus(gpus)} are free: it starts "
                    f"(first come, first served)")
        left -= gpus
    else:
        return None
    behind = [name for name in order[order.index(head) + 1:] if name in got]
    if behind and not backfill:
        return (f"job {behind[0]} started ahead of job {head}, which waits for "
                f"{_gpus(jobs[head][0])}: without backfill the first job that does not fit holds the "
                f"line (else a stream of small jobs could keep it waiting for ever)")
    if backfill:
        prefix = order[:order.index(head)]
        ends = list(running) + [jobs[n] for n in prefix]
        shadow, spare = reservation(jobs[head][0], left, ends)
        for name in behind:
            gpus, hours = jobs[name]
            if hours > shadow and gpus > spare:
                return (f"job {name} ({_gpus(gpus)} for {hours:g} h) would still hold its GPUs at "
                        f"{shadow:g} h, when job {head} can start, and needs more than the {_gpus(spare)} "
                        f"job {head} leaves spare then: backfill may not delay the first job "
                        f"in line")
            if hours > shadow:
                spare -= gpus
    return None


def run_gang_admit(fn):
    return [(case, fn([tuple(j) for j in case[0]], case[1], [tuple(r) for r in case[2]], case[3]))
            for case in CASES]


@exercise(name="gang_admit", notebook="13_what_breaks_at_scale",
          task="gang_admit(queue, free, running, backfill): the names of the waiting jobs "
               "(name, gpus, hours) that start now, each with all of its GPUs, first come first "
               "served, the first that does not fit holding the line unless backfill lets a later "
               "job start without delaying it (running: the (gpus, hours_left) of running jobs)",
          run=run_gang_admit)
def judge_gang_admit(answer):
    for (queue, free, running, backfill), got in answer:
        case = (f"queue {[f'{n}: {_gpus(g)}, {h:g} h' for n, g, h in queue]}, {_gpus(free)} free, "
                f"running {running}, backfill {'on' if backfill else 'off'}")
        wrong = _broken_rule(queue, free, running, backfill, got)
        want = admit(queue, free, running, backfill)
        order = [name for name, _, _ in queue]
        if wrong is None and sorted(got, key=order.index) != want:
            missed = [name for name in want if name not in got]
            wrong = f"expected {want}, got {list(got)}"
            if backfill and missed:
                wrong += (f": job {missed[0]} fits in the free GPUs and does not delay the first "
                          f"job in line (it ends by then, or uses only GPUs that job leaves spare): "
                          f"backfill starts it")
        if wrong:
            return f"{case}: {wrong}"
    return None
