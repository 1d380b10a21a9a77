"""A rank's life, the same for every program a run's ranks run (``python -m dlab.worker`` for
training, ``python -m dlab.runtime.call`` for ``dlab.spawn``): where it is in the world, its
output into the run directory, death with its launcher, the process group with the run's
deadline, the step watchdog, and - whatever happens - a report (``ranks/rank{r}.json``): ok,
or its exception and traceback, a timeout reported as the deadline it is.

Under torchrun a rank reads RANK, WORLD_SIZE, LOCAL_RANK (and MASTER_ADDR/PORT); under ``srun``
without torchrun, SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from dlab.core.disk import within
from dlab.core.rundir import RankWriter, RunDir
from dlab.runtime.watchdog import LAST_WORDS_S, StepWatchdog

#: seconds a rank whose collective timed out waits before exiting, so that the peer it waited
#: for, if stuck outside a collective, reports itself (its watchdog's deadline started earlier)
SYMPTOM_GRACE_S = 1.0


@dataclass
class Place:
    """Where this process is in the run: its rank, the world's size, its rank on the node."""
    rank: int
    world: int
    local_rank: int


def place() -> Place:
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:
        os.environ["RANK"] = os.environ["SLURM_PROCID"]
        os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
        os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    return Place(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                 int(os.environ.get("LOCAL_RANK", 0)))


def default_run_dir() -> Path:
    job = os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or "local"
    return Path("runs") / f"job-{job}"


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this rank when its parent (torchrun's agent, or the keeper of a rank
    the agent forked: ``dlab.procs.agent``) dies, so a killed agent can never leave ranks
    behind. Ranks run in their own sessions under torchrun, so a signal to the agent's process
    group would not reach them."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() == 1:  # the parent died before prctl took effect
            os._exit(1)


def redirect_output(path: Path) -> None:
    """Send this process's stdout and stderr (also from C++) to its log file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)


def timeout_hint(exc: BaseException, timeout_s: float) -> str:
    text = f"{type(exc).__name__} {exc}".lower()
    if "timed out" in text or "timeout" in text:
        return (f"a collective did not complete within the deadline (timeout_s={timeout_s:g} s): "
                f"another rank never joined it (stuck, hung, or in a different collective). "
                f"Raise timeout_s if the work is just slow.")
    return ""


def open_run(run: RunDir, me: Place) -> RankWriter:
    """The rank's side of the run directory: its log (when launched by dlab, which asks for
    it with DLAB_REDIRECT), its pid file, its metrics and timeline files; and its death tied
    to its launcher's."""
    run.path.mkdir(parents=True, exist_ok=True)
    if os.environ.get("DLAB_REDIRECT") == "1":
        (run.path / "logs").mkdir(exist_ok=True)
        redirect_output(run.log_file(me.rank))
    die_with_parent()
    return RankWriter(run, me.rank)


def serve(writer: RankWriter, timeout_s: float, body: Callable[[dict], dict | None],
          exit_code: Callable[[dict], int | None] = lambda result: None,
          fast_exit: bool = True) -> None:
    """Run ``body(state)`` under the step watchdog (``state["step"]`` is the step in progress,
    None outside steps), then report: ok with what ``body`` returned, or the exception, its
    traceback and, for a timeout, what it means. A rank that failed exits at once (destroying a
    process group whose peers are gone can block); ``exit_code(result)`` may ask for a status
    other than 0 after a success (a preempted rank's).

    A rank that succeeded ends with ``os._exit`` too, once its report, its files and its output
    are written and flushed: the interpreter's own teardown of torch's modules takes 0.4-0.6 s
    per rank on the 2-core machine, about a tenth of a short run's launch, and does nothing a
    run needs (its process group is destroyed, its threads are daemons that hold nothing
    unwritten: ``Checkpointer.wait`` returned before the report). ``fast_exit=False`` keeps the
    interpreter's exit for a body that runs someone else's code (``dlab.spawn``'s), whose open
    files and threads only that exit would flush and join."""
    state = {"step": None}
    watchdog = StepWatchdog(state, timeout_s, writer, writer.rank).start()
    try:
        result = body(state) or {}
        watchdog.stop()
        writer.report(ok=True, step=state["step"], **result)
        writer.close()
        code = exit_code(result)
        if code is not None or fast_exit:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0 if code is None else code)
    except BaseException as exc:  # noqa: BLE001 - every failure must leave a report
        watchdog.stop()
        tb, error, message = traceback.format_exc(), type(exc).__name__, str(exc)
        hint = timeout_hint(exc, timeout_s)

        def last_words() -> None:
            # the report first (on a full disk it takes the space set aside for it), the log
            try:
                writer.report(ok=False, step=state["step"], exception=error, message=message,
                              traceback=tb, hint=hint)
            finally:
                print(tb, file=sys.stderr, flush=True)

        # a full or hung disk must not keep a failed rank alive: what cannot be written in
        # LAST_WORDS_S is given up
        with contextlib.suppress(BaseException):
            within(LAST_WORDS_S, last_words)
        if hint:
            time.sleep(SYMPTOM_GRACE_S)
        os._exit(1)


def process_group(backend: str, timeout_s: float, threads: int, device: torch.device):
    """Initialise the default process group with the run's deadline (its rendezvous and every
    collective), on ``device``; a context manager that destroys it after a body that returns.
    After one that raises it is left for the process's exit (``serve``'s ``os._exit``, once the
    report is written): destroying it closes the connections, its peers fail at once with
    "connection closed" and exit, and torchrun then ends this rank while it is still writing
    the report of the error that started it all (under load, the run named a peer as the rank
    that raised and showed no traceback of this one)."""
    torch.set_num_threads(threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return _Destroy()


class _Destroy:
    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            dist.destroy_process_group()
