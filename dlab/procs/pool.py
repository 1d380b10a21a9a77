"""A warm pool of ranks for notebook cells: start N ranks once, then run cell after cell on them.

``%%distributed`` in its fresh mode starts N processes and a rendezvous for every cell (2.6-4.4 s
on the 2-core machine, most of it Python and torch importing); a workshop runs dozens of such
cells. The pool pays that once (``%dist_start -n 4``, or ``RankPool(4)``) and keeps, on each
rank, the process group and the cell's variables between cells (ipyparallel's ``%px`` and
nbdistributed's ``%%distributed`` work this way). A cell then costs a message to each rank and
the collectives it runs.

What happens when a cell goes wrong:

- it raises on some ranks and the others finish: the cell fails with the failing rank's
  exception and traceback (a rank's own error before a peer's "connection closed"); the pool
  and every rank's variables live on;
- it raises on one rank while the others wait for it in a collective, or it hangs, or the
  kernel is interrupted: the ranks that answered are shown, the others cannot be woken safely
  (a collective half done leaves the process group out of step), so the pool is restarted: new
  ranks, the variables lost, said in the error. Waiting stops at the cell's ``timeout_s`` or at
  the kernel's interrupt, whichever comes first;
- a rank's process dies (killed, out of memory, ``os._exit``) during a cell or between cells:
  the error names it and how it ended, and the pool is restarted at once, its variables lost
  (the survivors' process group lost a member). A death between cells is found when the next
  cell comes: that cell is not run (it would fail on a lost variable), the error says why;
- the kernel dies: every rank watches its parent and ends its process group, itself and what
  its cells started (``pool_rank.watch_parent``); closing or restarting the pool ends the
  same groups (``_kill``), so no process a cell started outlives the pool (one that leaves the
  group, with ``setsid`` or ``start_new_session``, is its own);
- a cell ends its rank's process (``os._exit``, a crash): the error gives the last line the
  rank wrote to its log, not only its exit status.

Every cell's message carries a sequence number that its answers carry back, and an answer to
any other cell is dropped: a cell's results are always its own (``pool_rank`` says why this was
not so when a tensor ``result`` broke the channel). Results come back in rank order whatever
order the ranks answer in.

Each rank's own stdout and stderr (outside cells) go to ``runs/pool/rank{r}.log``; a restart
keeps the previous ranks' as ``rank{r}.previous.log`` (a dead rank's last words).
"""
from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection, wait
from pathlib import Path

from dlab.analysis.diagnose import own_error
from dlab.core.config import ConfigError
from dlab.procs.cells import RankError, RankOutputs, cell_traceback
from dlab.procs.launch import check_runs_dir, check_seconds
from dlab.procs.process import exit_text, free_port
from dlab.runtime.pool_rank import pack, unpack

#: seconds the ranks that are still busy get, once one rank failed, to answer too
GRACE_S = 2.0


class PoolRestarted(RuntimeError):
    """The pool could not get every rank back and started new ones: state is gone. ``rank``
    names the rank whose process died, when one did."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


def check_pool(nprocs, start_timeout_s, log_dir) -> None:
    """Refuse what cannot make a pool, before any rank starts (and before ``%dist_start``
    stops the running one): ``ConfigError`` says what to change."""
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ConfigError(f"a pool needs at least 1 rank (got {nprocs!r}); use -n 2, for example")
    check_seconds(start_timeout_s, "the pool's start-up deadline (%dist_start --timeout)")
    check_runs_dir(log_dir)


class RankPool:
    """N ranks with the default process group initialised, serving cells until ``close``."""

    def __init__(self, nprocs: int = 2, start_timeout_s: float = 60.0, log_dir: str | Path = "runs/pool",
                 backend: str = "gloo"):
        check_pool(nprocs, start_timeout_s, log_dir)
        self.nprocs, self.start_timeout_s, self.backend = nprocs, start_timeout_s, backend
        self.log_dir = Path(log_dir)
        self.procs: list[subprocess.Popen] = []
        self.conns: list = []
        self.restarts = 0
        self.seq = 0  # the number of the cell in progress (or the last one)
        self._start()
        atexit.register(self._kill)  # a kernel that exits cleanly takes its ranks along

    # --- life cycle -----------------------------------------------------------------------
    def _start(self) -> None:
        """Start the ranks, each with one end of a socket pair to talk to the pool over, and
        wait until every one has joined the process group."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
               "WORLD_SIZE": str(self.nprocs), "DLAB_POOL_PARENT": str(os.getpid()),
               "DLAB_POOL_BACKEND": self.backend}
        for r in range(self.nprocs):
            mine, theirs = socket.socketpair()
            log_file = self.log_file(r)
            if log_file.exists():
                log_file.replace(self.log_dir / f"rank{r}.previous.log")
            with open(log_file, "w") as log:
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "dlab.runtime.pool_rank"],
                    env={**env, "RANK": str(r), "DLAB_POOL_FD": str(theirs.fileno())},
                    pass_fds=(theirs.fileno(),), stdout=log, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True))  # the kernel's interrupt (SIGINT) is not theirs
            theirs.close()
            self.conns.append(Connection(mine.detach()))
        deadline = time.monotonic() + self.start_timeout_s
        try:
            for r, c in enumerate(self.conns):
                while not c.poll(0.1):
                    if self.procs[r].poll() is not None:
                        raise RuntimeError(f"pool rank {r} exited while starting; see "
                                           f"{self.log_file(r)}")
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"pool rank {r} did not join the process group within "
                                           f"{self.start_timeout_s:g} s; see {self.log_dir}")
                c.recv_bytes()
        except BaseException:
            self._kill()
            raise

    def log_file(self, rank: int) -> Path:
        return self.log_dir / f"rank{rank}.log"

    def _kill(self) -> None:
        """End every rank and every process its cells started (each rank leads a process group
        that they share), whether the rank is still there or not: a rank that exited or died
        leaves its cells' processes behind in its group. A group's id is not handed out again
        while a member is left, so the signal reaches no stranger."""
        for c in self.conns:
            c.close()
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in self.procs:
            p.wait()
        self.procs, self.conns = [], []

    def restart(self) -> None:
        """New ranks in place of the old ones (every variable is lost)."""
        self._kill()
        self.restarts += 1
        self._start()

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send_bytes(pack(None))
            except OSError:
                pass
        deadline = time.monotonic() + 2.0
        for p in self.procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self._kill()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def alive(self) -> bool:
        return bool(self.procs) and all(p.poll() is None for p in self.procs)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- cells ----------------------------------------------------------------------------
    def run(self, cell: str, timeout_s: float = 60.0) -> tuple[RankOutputs, list | None, Exception | None]:
        """Run ``cell`` on every rank. Returns (outputs, results in rank order or None, error or
        None), as ``magic.run_cell`` does; a hang, a rank stuck behind a failed one, a rank
        that died, or an interrupt (KeyboardInterrupt while waiting) restarts the pool and
        returns a ``PoolRestarted`` error. A bad ``timeout_s`` is refused before anything is
        sent (``ConfigError``)."""
        check_seconds(timeout_s, "a cell's timeout (%%distributed --timeout)")
        if not isinstance(cell, str):
            raise TypeError(f"a cell is a str of Python code (got {type(cell).__name__})")
        dead = {r: exit_text(p.poll()) for r, p in enumerate(self.procs) if p.poll() is not None}
        if dead or not self.procs:
            return self._restarted_between_cells(dead)
        self.seq += 1
        start = time.monotonic()
        replies: dict[int, dict] = {}
        pending = dict(enumerate(self.conns))
        for r, c in list(pending.items()):
            try:
                c.send_bytes(pack({"seq": self.seq, "cell": cell}))
            except OSError:  # its end is closed: the process is gone
                replies[r] = self._died(r)
                del pending[r]
        why = None
        try:
            while pending:
                left = start + timeout_s - time.monotonic()
                if left <= 0:
                    why = f"the cell ran past its timeout ({timeout_s:g} s)"
                    break
                self._collect(pending, replies, left)
                if any(not rep["ok"] for rep in replies.values()) and pending:
                    # the others may be waiting for the failed rank in a collective: a short grace
                    end = time.monotonic() + GRACE_S
                    while pending and (left := end - time.monotonic()) > 0:
                        self._collect(pending, replies, left)
                    if pending:
                        why = "a rank failed while the others waited for it"
                        break
        except KeyboardInterrupt:
            why = "interrupted"
        elapsed = time.monotonic() - start
        return self._outcome(cell, replies, why, elapsed)

    def _receive(self, r: int) -> dict | None:
        """Rank ``r``'s answer to the cell in progress, with its result loaded; None for an
        answer to an earlier cell (dropped: never taken for this cell's)."""
        try:
            answer = unpack(self.conns[r].recv_bytes())
        except (EOFError, OSError):
            return self._died(r)
        if answer.get("seq") != self.seq:
            return None
        if answer["ok"]:
            try:
                answer["result"] = unpack(answer["result"])
            except Exception as e:  # noqa: BLE001 - a class or module the kernel does not have
                answer.update(ok=False, exception=type(e).__name__, traceback="",
                              message=f"rank {r}'s `result` pickled there but cannot be loaded "
                                      f"in the kernel ({e}); send plain values (numbers, "
                                      f"lists, tensors)")
        return answer

    def _collect(self, pending: dict, replies: dict, left: float) -> None:
        """Wait up to ``left`` seconds (in short waits, so that an interrupt is seen however it
        arrives) for answers, and move those that came from ``pending`` to ``replies``."""
        ready = wait(list(pending.values()), timeout=min(left, 0.2))
        for r, c in list(pending.items()):
            if c in ready and (reply := self._receive(r)) is not None:
                replies[r] = reply
                del pending[r]

    def _died(self, r: int) -> dict:
        try:
            code = self.procs[r].wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            code = None
        return {"ok": False, "died": True, "exception": "RankDied", "output": "", "traceback": "",
                "message": f"rank {r}'s process ended during the cell ({exit_text(code)})"
                           + self._last_words(r)}

    def _last_words(self, r: int) -> str:
        """The last line rank ``r``'s process wrote to its log (a Python error ends with what
        it was), where there is one: an exit code alone does not say what the cell did."""
        try:
            lines = self.log_file(r).read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return f"; its last output: {lines[-1].strip()!r} (in {self.log_file(r)})" if lines else ""

    def _restarted_between_cells(self, dead: dict[int, str]):
        n = self.nprocs
        who = "; ".join(f"rank {r} {how}" for r, how in dead.items()) or "the pool was stopped"
        self.restart()
        last = ", ".join(str(self.log_dir / f"rank{r}.previous.log") for r in dead)
        message = (f"the warm pool lost a rank since the last cell ({who}"
                   + (f"; its last output: {last}" if last else "")
                   + f"), so it was restarted: {n} new ranks, every variable lost. This cell was "
                     f"NOT run: run the cells it needs again")
        outputs = RankOutputs(["[not run]"] * n, None, None, "FAILED: " + message)
        return outputs, None, PoolRestarted(message, rank=next(iter(dead), None))

    def _outcome(self, cell: str, replies: dict, why: str | None, elapsed: float):
        n = self.nprocs
        failed = [r for r in range(n) if r in replies and not replies[r]["ok"]]
        logs = [_shown(replies.get(r)) for r in range(n)]
        died = [r for r in failed if replies[r].get("died")]
        # the cause: a rank that died, else a rank's own error, before a peer's symptom of it
        cause = next(iter(died or [r for r in failed if own_error(replies[r])] or failed), None)
        if died:
            why = "; ".join(replies[r]["message"] for r in died)
        if why is not None:
            stuck = [r for r in range(n) if r not in replies]
            self.restart()
            summary = (f"FAILED: {why}"
                       + (f"; rank(s) {stuck} did not answer" if stuck else "")
                       + f"; the pool was restarted: {n} new ranks, every variable lost")
            error = PoolRestarted(summary, rank=died[0] if died else None)
            if cause is not None and not died:
                rep = replies[cause]
                error = RankError(cause, rep["exception"], rep["message"] + f" ({summary})",
                                  cell_traceback(rep["traceback"], cell), self.log_dir,
                                  logs=f"{self.log_dir}/rank{{r}}.log")
            return RankOutputs(logs, None, cause, summary), None, error
        summary = f"{n} ranks of the warm pool, {elapsed * 1e3:.0f} ms"
        if cause is None:
            results = [replies[r]["result"] for r in range(n)]
            return RankOutputs(logs, results, None, summary), results, None
        rep = replies[cause]
        error = RankError(cause, rep["exception"], rep["message"],
                          cell_traceback(rep["traceback"], cell), self.log_dir,
                          logs=f"{self.log_dir}/rank{{r}}.log")
        return RankOutputs(logs, None, cause, "FAILED: " + summary + "; the pool lives on"), None, error


def _shown(reply: dict | None) -> str:
    """What a rank printed, and how its part of the cell ended when it did not end well."""
    if reply is None:
        return "[no answer]"
    if reply["ok"]:
        return reply["output"]
    why = (reply.get("message") or "").strip().splitlines()[:1]
    return reply["output"] + f"[{reply['exception']}: {why[0] if why else ''}]"
