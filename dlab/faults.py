"""Faults injected on purpose, from the launch config, so reliability can be tested and taught.

``fault={"rank": 1, "step": 3, "kind": K}`` acts on that rank at the start of that step:

- ``raise``: raises RuntimeError (a bug in user code);
- ``kill``: SIGKILL to itself (an out-of-memory kill, a lost node) - it cannot leave a traceback;
- ``exit``: exits with code 3 without a word (a library calling exit);
- ``hang``: stops taking part, outside any collective (as a rank stuck in its own code would);
  its step watchdog (``dlab.watchdog``) ends it at the deadline (``timeout_s``), naming where it
  is stuck, and the others, waiting for it in their next collective, are reported as symptoms.
"""
from __future__ import annotations

import os
import signal
import sys
import time


class InjectedFault(RuntimeError):
    pass


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
    if kind == "hang":
        print(f"injected fault: rank {rank} stops taking part at step {step}", flush=True)
        while True:
            time.sleep(3600)
