"""The gang drill: a job of N ranks of which only some start, as when a scheduler places a job's
pods one at a time and runs out of GPUs part-way.

A statically sized job cannot run on fewer ranks than it was launched with: every collective
involves every rank, so ``init_process_group`` for a world of N waits until all N have given
their addresses to the rendezvous store, and gives up when one has not come within its
``timeout``. Until then the ranks that did start hold their GPUs and do nothing.

``drill(world_size, started, timeout_s)`` plays that on this machine. It hosts the rendezvous
store itself (as torchrun's agent hosts its workers' store), starts ranks ``0 .. started-1`` of
``world_size`` (``python -m dlab.runtime.gang_rank``, each tied to this process), lets them
wait, and returns what each saw: when it entered, how long it waited, how many ranks the store
counted, and torch's error. Every rank is reaped before it returns; one still running after
``timeout_s`` plus ``START_S`` is killed and the drill raises, naming its log.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import psutil
import torch.distributed as dist

from dlab.core.config import ConfigError
from dlab.core.disk import write_json
from dlab.core.rundir import RunDir, read_json
from dlab.procs.launch import check_runs_dir, check_seconds, new_run_dir
from dlab.procs.process import exit_text, kill_tree, spawn_tied_to_this_process, worker_env

#: seconds a rank may take to start (import torch, reach the store) on top of its timeout: 2
#: shared cores starting several Pythons at once take a few; a busy machine many more
START_S = 60.0


@dataclass
class GangRank:
    """What one started rank saw: ``entered_s`` after the drill started the ranks, ``waited_s``
    from entering the rendezvous to its end (the group formed, or torch gave up), how many
    ranks the store counted then (``arrived``), its error ("" if the group formed) and its exit
    status."""

    rank: int
    entered_s: float
    waited_s: float
    formed: bool
    arrived: int
    error: str
    exit_code: int


@dataclass
class Gang:
    world_size: int
    timeout_s: float
    ranks: list[GangRank]  # the ranks that started, in rank order
    run_dir: Path

    @property
    def missing(self) -> list[int]:
        """The ranks that never started."""
        return list(range(len(self.ranks), self.world_size))

    def alive(self) -> list[int]:
        """The pids of live processes whose command line names this drill's run directory (its
        ranks, and anything they started): none, once the drill has returned. Read from the
        system's process table, not from the drill's own bookkeeping."""
        out = []
        for p in psutil.process_iter(["cmdline", "status"]):
            try:
                if (p.info["status"] != psutil.STATUS_ZOMBIE
                        and str(self.run_dir) in " ".join(p.info["cmdline"] or [])):
                    out.append(p.pid)
            except psutil.Error:  # gone while we looked
                continue
        return out

    def lines(self) -> list[str]:
        out = [f"rank {r.rank}: entered the rendezvous {r.entered_s:.1f} s after the launch; "
               + (f"the process group formed {r.waited_s:.1f} s later" if r.formed else
                  f"gave up {r.waited_s:.1f} s later and {exit_text(r.exit_code)}: {r.error}")
               for r in self.ranks]
        return out + [f"rank {r}: never started (no GPU was free for it)" for r in self.missing]


def drill(world_size: int = 4, started: int = 3, timeout_s: float = 6.0,
          runs_dir: str | Path = "runs") -> Gang:
    """Start ranks ``0 .. started-1`` of a job of ``world_size`` ranks, each waiting up to
    ``timeout_s`` for the process group, and return what each saw once all have ended."""
    _check(world_size, started, timeout_s)
    check_runs_dir(runs_dir, started)
    with new_run_dir(runs_dir, f"gang-{started}of{world_size}") as run_dir:
        write_json(run_dir / "config.json", {"world_size": world_size, "started": started,
                                             "timeout_s": timeout_s})
        (run_dir / "logs").mkdir()
    # the store outlives every rank: a rank that gave up still reads the count from it
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s + START_S))
    env = worker_env(threads=1, restarts=False)
    procs, launched = [], time.time()
    try:
        for r in range(started):
            cmd = [sys.executable, "-m", "dlab.runtime.gang_rank", "--run-dir", str(run_dir.path.resolve()),
                   "--port", str(store.port), "--rank", str(r), "--world", str(world_size),
                   "--timeout", str(timeout_s)]
            with open(run_dir.log_file(r), "ab") as log:
                procs.append(spawn_tied_to_this_process(cmd, log, env))
        deadline = time.monotonic() + timeout_s + START_S
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        late = [r for r, p in enumerate(procs) if p.poll() is None]
        if late:
            raise RuntimeError(f"ranks {late} were still running {timeout_s + START_S:g} s after the "
                               f"launch (timeout_s={timeout_s:g} plus {START_S:g} s to start) and "
                               f"were killed; see {run_dir.path / 'logs'}")
    finally:
        for p in procs:
            if p.poll() is None:  # an interrupted drill, or a rank past its deadline
                kill_tree(p, grace=1.0)
    return Gang(world_size, timeout_s, [_seen(run_dir, r, p.returncode, launched)
                                        for r, p in enumerate(procs)], run_dir.path.resolve())


def _seen(run_dir: RunDir, rank: int, code: int, launched: float) -> GangRank:
    report = read_json(run_dir / f"gang/rank{rank}.json")
    if report is None:
        log = run_dir.log_file(rank)
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        raise RuntimeError(f"rank {rank} {exit_text(code)} without saying what it saw; its log "
                           f"{log}:\n{tail}")
    return GangRank(rank, report["entered"] - launched, report["ended"] - report["entered"],
                    report["formed"], report["arrived"], report["error"], code)


def _check(world_size, started, timeout_s) -> None:
    """Refuse a drill that cannot show the lesson, before any process starts."""
    for name, value in (("world_size", world_size), ("started", started)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name} must be a whole number of ranks (got {value!r})")
    if world_size < 2:
        raise ConfigError(f"world_size={world_size}: a gang needs at least 2 ranks")
    if not 1 <= started <= world_size:
        raise ConfigError(f"started={started}: start between 1 and world_size={world_size} ranks "
                          f"(fewer than world_size to see the group wait; all of them to see it form)")
    check_seconds(timeout_s, "timeout_s (how long each rank waits for the process group)")
