"""A run, live or finished: the handle ``launch`` returns and ``attach`` opens.

Everything it knows it reads from the run directory (``dlab.core.rundir``), except whether its
own torchrun process is still alive; it can wait for the run (a progress bar, the failing rank's
error raised in the cell), stop it whole, preempt it as a scheduler would, summarise it and draw
it. An interpreter that exits stops the runs it started.
"""
from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
import weakref
from pathlib import Path

from dlab.analysis.diagnose import find_failure
from dlab.analysis.reader import RunView, open_run
from dlab.core.disk import aside, write_json
from dlab.core.rundir import preempted_or_ok
from dlab.procs.process import kill_tree
from dlab.runtime.checkpoint import discard_partial
from dlab.ui.plots import plot

_LIVE: weakref.WeakSet[Run] = weakref.WeakSet()
#: seconds a checkpointing run gets to stop after a SIGTERM reached its launcher: torchrun's
#: agent gives its ranks 30 s after passing the signal on, then kills them; a little over that
PREEMPT_GRACE_S = 35.0
#: seconds the launcher waits for the run directory to take the record of a run's end
RECORD_WITHIN_S = 10.0
#: the reason a run is stopped for when a scheduler's notice (SIGTERM) reached its launcher and
#: was passed on to its ranks: only then, or when the run ended on its own, do ranks that
#: stopped as preempted make the run read "preempted" (a run this process stopped for any other
#: reason, a closed output pipe, Ctrl-C or a deadline, reads as what stopped it)
NOTICE = "notice"


def track(run: Run) -> Run:
    """Stop ``run`` if this interpreter exits while it goes on."""
    _LIVE.add(run)
    return run


def attach(path: str | Path) -> Run:
    """Open a run something else started (torchrun on a cluster, an earlier kernel)."""
    return Run(open_run(path).path)


class Run(RunView):
    """A run, live or finished. Everything it knows it reads from the run directory
    (``RunView``), except whether its own torchrun process is still alive."""

    def __init__(self, path: str | Path, proc: subprocess.Popen | None = None):
        super().__init__(path)
        self.proc = proc
        self._ended_as: str | None = None
        #: whether no rank had failed when a Stop (reason "stopped") began the teardown: the
        #: errors ranks report after it are the teardown's casualties (``wait``)
        self._stopped_healthy: bool | None = None
        #: held while the end is recorded: a Stop from the dashboard's thread and ``wait`` on
        #: the cell's may both finish the run, and the second must read the first's record
        self._finishing = threading.Lock()

    @property
    def state(self) -> str:
        """running, ok, preempted, failed, stopped, interrupted, timeout, or lost (see
        ``RunDir.status``)."""
        if self.proc is not None and self.proc.poll() is None:
            return "running"
        if self.proc is not None:
            self._finish()  # once; or wait for the record another thread is making
        return self.dir.status().get("state", "unknown")

    def plot(self):
        """The dashboard's final figure of this run: loss, throughput, memory, bytes moved and,
        for a pipeline, the per-rank timeline."""
        return plot(self)

    # --- waiting and stopping --------------------------------------------------------------
    def stream(self, poll: float = 0.2, timeout: float | None = None):
        """Yield metric records as the ranks write them, until the run ends."""
        for records in self._polls(poll, timeout):
            yield from records

    def _polls(self, poll: float, timeout: float | None):
        """Every ``poll`` seconds until the run ends, the records written since the last poll
        (often none); past ``timeout`` the run is stopped and ``TimeoutError`` raised."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            running = self.state == "running"
            yield list(self.new_metrics())
            if not running:
                return
            if deadline and time.monotonic() > deadline:
                self.stop(reason="timeout")
                raise TimeoutError(f"run {self.path} did not finish within {timeout} s; stopped it")
            self._pause(poll)

    def _pause(self, seconds: float) -> None:
        """Sleep until the next poll, or until torchrun exits if that comes first (a sleep
        would leave a finished run waiting for the rest of its poll, 0.1 s on average)."""
        if self.proc is None:
            time.sleep(seconds)
            return
        try:
            self.proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            pass

    def wait(self, timeout: float | None = None, progress: bool = False, poll: float = 0.2,
             on_poll=None, stop_requested=None) -> Run:
        """Block until the run ends; raise ``RunFailed`` naming the failing rank. An interrupt
        (KeyboardInterrupt, a notebook's stop button) stops the whole run before it returns.

        The one supervision loop of a run: the dashboard watches through it too, with
        ``on_poll(records)`` called every ``poll`` seconds with the records that arrived (it
        redraws) and ``stop_requested()`` asked as often (its Stop button: the run is stopped,
        reading "stopped", and ``wait`` returns). A failed rank ends the run here unless
        torchrun may restart it (``max_restarts``), whoever watches. A rank that reports an
        error only in the teardown a Stop caused (a peer gone from under its collective) is the
        Stop's casualty, not a failure; one that failed before the Stop is still named."""
        bar = _Progress(self) if progress else None
        try:
            for records in self._polls(poll, timeout):
                for record in records if bar else ():
                    bar.update(record)
                if on_poll is not None:
                    on_poll(records)
                if stop_requested is not None and stop_requested():
                    self.stop(reason="stopped")
                    break
                if self._a_rank_failed() and not self.config.get("max_restarts"):
                    self._give_torchrun(2.0)
        except BaseException as e:
            grace = self._grace_for(e)
            self.stop(grace=grace, reason=NOTICE if grace == PREEMPT_GRACE_S else "interrupted")
            raise
        finally:
            if bar:
                bar.close()
        failure = self.failure()
        if failure and not self._stopped_healthy:
            raise failure
        if self.state == "lost":
            raise RuntimeError(f"run {self.path} is lost: its launcher and processes are gone "
                               f"without a final status (killed with kill -9, or its kernel "
                               f"died); what it wrote so far is still readable")
        return self

    def _grace_for(self, interruption: BaseException) -> float:
        """Seconds the run's processes get to end on their own once this wait is interrupted: a
        SIGTERM that reached the launcher (``getattr(e, "signum")``: the CLI's, as Slurm or
        ``timeout`` send it) is a scheduler's notice, and a run that checkpoints then gets the
        time torchrun gives its ranks to write their last checkpoint; anything else, 2 s."""
        if getattr(interruption, "signum", None) == signal.SIGTERM and self.config.get(
                "checkpoint_every"):
            return PREEMPT_GRACE_S
        return 2.0

    def _a_rank_failed(self) -> bool:
        return any((rep := self.dir.report(r)) and not rep.get("ok") for r in self.dir.ranks())

    def _give_torchrun(self, seconds: float) -> None:
        """torchrun tears the others down when it sees a rank fail; if that has not happened
        within ``seconds`` (a rank stuck in C++ that ignores SIGTERM), do it ourselves."""
        end = time.monotonic() + seconds
        while self.proc is not None and self.proc.poll() is None and time.monotonic() < end:
            time.sleep(0.05)
        if self.proc is not None and self.proc.poll() is None:
            self.stop(reason="failed")

    def preempt(self, timeout: float | None = None) -> Run:
        """Do what a scheduler does to a job it takes back: SIGTERM to the launcher (torchrun's
        agent passes it to every rank and waits up to 30 s for them), then wait. The ranks stop
        after a step they agree on, checkpoint it and exit as preempted (``dlab.runtime.preemption``);
        ``launch(..., resume=str(run.path))`` goes on from there. The run must checkpoint
        (``checkpoint_every`` > 0), or a SIGTERM just ends it."""
        if self.proc is None:
            raise RuntimeError(f"run {self.path} was not started by this process; send SIGTERM "
                               f"to its torchrun (or scancel --signal=TERM its Slurm job)")
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
        return self.wait(timeout=timeout)

    def stop(self, grace: float = 2.0, reason: str = "stopped") -> None:
        """End every process of the run: SIGTERM (torchrun forwards it to its ranks), then
        SIGKILL whatever is left after ``grace`` seconds."""
        if self.proc is None or self.proc.poll() is not None:
            if self.proc is not None:
                self._finish()
            return
        if reason == "stopped" and self._stopped_healthy is None:
            self._stopped_healthy = not self._a_rank_failed()
        kill_tree(self.proc, grace)
        self._finish(reason)

    def _finish(self, reason: str | None = None) -> None:
        """Record how the run ended in ``status.json``, once. The record is made by a process
        of its own (``aside``) given ``RECORD_WITHIN_S``: a hung file system must not hold the
        caller past its deadline, nor its exit after (a thread stuck in a write to a frozen
        file system would); that process writes the record, and removes what the run's
        unfinished writes left, when the directory answers again (until then the run reads
        "running": its ranks, stuck in the same writes, die of their SIGKILL only then). A
        full disk is said in a warning, not raised over the run's own outcome."""
        with self._finishing:
            if self._ended_as is not None or self.proc is None:
                return
            self._ended_as = reason or "ended"  # never finished twice, whatever the record does
            _LIVE.discard(self)
            try:
                # torchrun's exit status is read here, by its parent (the recording process is
                # not); once the end is recorded, what writes left half done (a rank's, stuck
                # on a hung disk when it was killed) goes
                if aside(RECORD_WITHIN_S, self._record, reason, self.proc.poll(),
                         then=self.dir.discard_temporaries):
                    return
                why = (f"its directory did not answer within {RECORD_WITHIN_S:g} s (a hung "
                       f"file system?); it will be once the directory answers")
            except (OSError, RuntimeError) as e:
                why = str(e)
            warnings.warn(f"the end of run {self.path} ({self._ended_as}) is not recorded in "
                          f"status.json: {why}", stacklevel=3)

    def _record(self, reason: str | None, torchrun_exit: int | None) -> None:
        failure = find_failure(self.dir, torchrun_exit)
        reports = {r: self.dir.report(r) for r in self.dir.ranks()}
        ended_well = bool(reports) and all(rep and rep.get("ok") for rep in reports.values())
        if ended_well and reason in (None, NOTICE) and preempted_or_ok(reports) == "preempted":
            state = "preempted"  # a SIGTERM the ranks took as a notice and checkpointed
        elif reason in (None, "failed"):
            state = "failed" if failure or not ended_well else "ok"
        elif reason in (NOTICE, "interrupted"):
            state = "interrupted" if failure else "stopped"
        else:
            state = reason
        exit_codes = failure.exit_codes if failure else {r: 0 for r in self.dir.ranks()}
        self._ended_as = state
        write_json(self.dir / "status.json", {
            "state": state, "torchrun_exit": torchrun_exit, "exit_codes": exit_codes,
            "failed_rank": failure.rank if failure else None, "ended": time.time(),
            "ranks": reports})
        # every process of the run is gone: a checkpoint still partial never will be whole
        discard_partial(self.dir / "checkpoints")


class _Progress:
    """One line per run: a bar when the output is a terminal, a line every tenth otherwise."""

    def __init__(self, run: Run):
        self.run, self.steps = run, run.config.get("steps", 1)
        self.tty = sys.stdout.isatty()
        self.shown = -1

    def update(self, record: dict) -> None:
        if record.get("rank") != 0:
            return
        step = record["step"] + 1
        frac = step / self.steps
        line = (f"{self.run.path.name}  [{'#' * int(30 * frac):<30}] step {step}/{self.steps}  "
                f"loss {record['loss']:.4f}  {record['tokens_per_s']:,.0f} tok/s")
        if self.tty:
            print("\r" + line, end="", flush=True)
        elif int(10 * frac) > self.shown:
            self.shown = int(10 * frac)
            print(line, flush=True)

    def close(self) -> None:
        if self.tty:
            print()


@atexit.register
def _stop_all() -> None:
    for run in list(_LIVE):
        run.stop(grace=1.0, reason="stopped")


