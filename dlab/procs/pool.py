"""A warm pool of ranks for notebook cells: start N ranks once, then run cell after cell on them.

``%%distributed`` in its fresh mode starts N processes and a rendezvous for every cell (2.6-4.4 s
on the 2-core machine, most of it Python and torch importing); a workshop runs dozens of such
cells. The pool pays that once (``%dist_start -n 4``, or ``RankPool(4)``) and keeps, on each
rank, the process group and the cell's variables between cells (ipyparallel's ``%px`` and
nbdistributed's ``%%distributed`` work this way). A cell then costs a message to each rank and
the collectives it runs.

What happens when a cell goes wrong:

- it raises on some ranks and the others finish: the cell fails with the first failing rank's
  exception and traceback; the pool and every rank's variables live on;
- it raises on one rank while the others wait for it in a collective, or it hangs, or the
  kernel is interrupted: the ranks that answered are shown, the others cannot be woken safely
  (a collective half done leaves the process group out of step), so the pool is restarted: new
  ranks, the variables lost, said in the error. Waiting stops at the cell's ``timeout_s`` or at
  the kernel's interrupt, whichever comes first;
- the kernel dies: every rank watches its parent and exits (``pool_rank.watch_parent``).

Each rank's own stdout and stderr (outside cells) go to ``runs/pool/rank{r}.log``.
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

from dlab.procs.cells import RankError, RankOutputs, cell_traceback
from dlab.procs.process import free_port


class PoolRestarted(RuntimeError):
    """The pool could not get every rank back and started new ones: state is gone."""


class RankPool:
    """N ranks with the default process group initialised, serving cells until ``close``."""

    def __init__(self, nprocs: int = 2, start_timeout_s: float = 60.0, log_dir: str | Path = "runs/pool",
                 backend: str = "gloo"):
        if nprocs < 1:
            raise ValueError(f"a pool needs at least 1 rank (got nprocs={nprocs})")
        self.nprocs, self.start_timeout_s, self.backend = nprocs, start_timeout_s, backend
        self.log_dir = Path(log_dir)
        self.procs: list[subprocess.Popen] = []
        self.conns: list = []
        self.restarts = 0
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
            with open(self.log_dir / f"rank{r}.log", "w") as log:
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
                                           f"{self.log_dir / f'rank{r}.log'}")
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"pool rank {r} did not join the process group within "
                                           f"{self.start_timeout_s:g} s; see {self.log_dir}")
                c.recv()
        except BaseException:
            self._kill()
            raise

    def _kill(self) -> None:
        for c in self.conns:
            c.close()
        for p in self.procs:
            if p.poll() is None:
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
                c.send(None)
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
        """Run ``cell`` on every rank. Returns (outputs, results or None, error or None), as
        ``magic.run_cell`` does; a hang, a rank stuck behind a failed one, or an interrupt
        (KeyboardInterrupt while waiting) restarts the pool and returns a ``PoolRestarted``
        error."""
        if not self.alive():
            self.restart()
        start = time.monotonic()
        for c in self.conns:
            c.send(cell)
        replies: dict[int, dict] = {}
        pending = dict(enumerate(self.conns))
        why = None
        try:
            while pending:
                left = start + timeout_s - time.monotonic()
                if left <= 0:
                    why = f"the cell ran past its timeout ({timeout_s:g} s)"
                    break
                # short waits, so that an interrupt is seen however it arrives
                ready = wait(list(pending.values()), timeout=min(left, 0.2))
                for r, c in list(pending.items()):
                    if c in ready:
                        try:
                            replies[r] = c.recv()
                        except EOFError:
                            replies[r] = {"ok": False, "exception": "RankDied", "output": "",
                                          "message": "the rank's process ended", "traceback": ""}
                        del pending[r]
                if any(not rep["ok"] for rep in replies.values()) and pending:
                    # the others may be waiting for the failed rank in a collective: a short grace
                    grace = wait(list(pending.values()), timeout=2.0)
                    if not grace:
                        why = "a rank raised while the others waited for it"
                        break
        except KeyboardInterrupt:
            why = "interrupted"
        elapsed = time.monotonic() - start
        return self._outcome(cell, replies, why, elapsed)

    def _outcome(self, cell: str, replies: dict, why: str | None, elapsed: float):
        n = self.nprocs
        logs = [replies[r]["output"] if r in replies else "[no answer]" for r in range(n)]
        failed = next((r for r in range(n) if r in replies and not replies[r]["ok"]), None)
        if why is not None:
            stuck = [r for r in range(n) if r not in replies]
            self.restart()
            summary = (f"FAILED: {why}; rank(s) {stuck} did not answer, so the pool was restarted: "
                       f"{n} new ranks, every variable lost")
            error = PoolRestarted(summary)
            if failed is not None:
                rep = replies[failed]
                error = RankError(failed, rep["exception"], rep["message"] + f" ({summary})",
                                  cell_traceback(rep["traceback"], cell), self.log_dir,
                                  logs=f"{self.log_dir}/rank{{r}}.log")
            return RankOutputs(logs, None, failed, summary), None, error
        summary = f"{n} ranks of the warm pool, {elapsed * 1e3:.0f} ms"
        if failed is None:
            results = [replies[r]["result"] for r in range(n)]
            return RankOutputs(logs, results, None, summary), results, None
        rep = replies[failed]
        error = RankError(failed, rep["exception"], rep["message"],
                          cell_traceback(rep["traceback"], cell), self.log_dir,
                                  logs=f"{self.log_dir}/rank{{r}}.log")
        return RankOutputs(logs, None, failed, "FAILED: " + summary + "; the pool lives on"), None, error
