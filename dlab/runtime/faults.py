"""Faults injected on purpose, from the launch config, so reliability can be tested and taught.

``fault={"rank": 1, "step": 3, "kind": K}`` acts on that rank at the start of that step:

- ``raise``: raises RuntimeError (a bug in user code);
- ``kill``: SIGKILL to itself (an out-of-memory kill, a lost node) - it cannot leave a traceback;
- ``exit``: exits with code 3 without a word (a library calling exit);
- ``hang``: stops taking part, outside any collective (as a rank stuck in its own code would);
  its step watchdog (``dlab.runtime.watchdog``) ends it at the deadline (``timeout_s``), naming where it
  is stuck, and the others, waiting for it in their next collective, are reported as symptoms;
- ``slow``: a straggler (a throttled GPU, a noisy neighbour, a slow link's host): the rank
  sleeps ``delay_s`` seconds at the start of each step from ``step`` on, for ``steps`` steps
  (default: to the end), inside the step's timed window, as a ``straggle`` span on its timeline.
  Its own work is not slower; it starts it late, so every rank that meets it in a collective
  waits. A delay, not a factor on compute: it is exact and the same on every machine, and
  synchronous training turns either into the same wait;
- ``preempt``: the scheduler's notice: SIGTERM to the rank's launcher (torchrun's agent, as
  Slurm signals the job step), which passes it to every rank; each finishes a step the ranks
  agree on, writes a checkpoint and exits as preempted (``dlab.runtime.preemption``).
"""
from __future__ import annotations

import os
import signal
import sys
import time

#: the keys a fault of each kind takes beyond rank, step and kind
EXTRA_KEYS = {"slow": {"delay_s", "steps"}}
KINDS = ("raise", "kill", "hang", "exit", "slow", "preempt")


class InjectedFault(RuntimeError):
    pass


def straggle_s(fault: dict | None, rank: int, step: int) -> float:
    """Seconds a ``slow`` fault delays ``rank`` at the start of ``step`` (0 outside its span).
    Every attempt: slowness belongs to the machine, not to one try of the run."""
    if not fault or fault.get("kind") != "slow" or fault.get("rank", 0) != rank:
        return 0.0
    first = fault.get("step", 0)
    last = first + fault["steps"] if fault.get("steps") is not None else float("inf")
    return float(fault["delay_s"]) if first <= step < last else 0.0


def maybe_inject(fault: dict | None, rank: int, step: int, attempt: int = 0) -> None:
    """Only on the first attempt: after a torchrun restart the run must be able to go on."""
    if not fault or attempt or fault.get("rank", 0) != rank or fault.get("step", 0) != step:
        return
    kind = fault["kind"]
    sys.stdout.flush()
    if kind == "raise":
        raise InjectedFault(f"injected fault: rank {rank} raised at step {step}")
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "exit":
        os._exit(3)
    if kind == "preempt":
        print(f"injected fault: rank {rank} sends SIGTERM to its launcher at step {step}", flush=True)
        # the launcher: torchrun's agent, the parent of a rank it started as a command, the
        # grandparent of one it forked (dlab.procs.agent names itself)
        os.kill(int(os.environ.get("DLAB_AGENT_PID") or os.getppid()), signal.SIGTERM)
    if kind == "hang":
        print(f"injected fault: rank {rank} stops taking part at step {step}", flush=True)
        while True:
            time.sleep(3600)
