"""Reading a run directory, live or finished, from any process: ``RunView``.

It is the read-only half of the handle ``dlab.launch`` returns (``dlab.procs.run.Run`` adds the
torchrun process: waiting, stopping, preempting, drawing): the dashboard and the figures take
either, so they follow a run this kernel started, replay a finished one, or follow a run that
torchrun or Slurm started elsewhere on a shared file system.
"""
from __future__ import annotations

from pathlib import Path

from dlab.analysis.diagnose import RunFailed, find_failure
from dlab.analysis.summary import Summary
from dlab.core.rundir import JsonlTail, RunDir


def open_run(path: str | Path) -> RunView:
    """A run directory something else wrote (torchrun on a cluster, an earlier kernel); a
    directory without a readable config.json is refused, naming it."""
    if not (Path(path) / "config.json").exists():
        raise FileNotFoundError(f"{path} is not a dlab run directory (it has no config.json)")
    RunDir(path).config()  # a corrupt config.json is refused here, naming the file
    return RunView(path)


class RunView:
    """A run as its directory tells it. ``proc`` is None: nothing here can stop the run."""

    proc = None

    def __init__(self, path: str | Path):
        self.dir = RunDir(path)
        self.path = self.dir.path
        self._tails: dict[int, JsonlTail] = {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r}, state={self.state!r})"

    # --- what it is ------------------------------------------------------------------------
    @property
    def config(self) -> dict:
        return self.dir.config()

    @property
    def world_size(self) -> int:
        return self.dir.world_size()

    @property
    def state(self) -> str:
        """running, ok, preempted, failed, stopped, interrupted, timeout, or lost (see
        ``RunDir.status``)."""
        return self.dir.status().get("state", "unknown")

    def status(self) -> dict:
        self.state  # noqa: B018 - a live handle finalises a run whose process has just ended
        return self.dir.status()

    # --- reading ---------------------------------------------------------------------------
    def metrics(self, rank: int | None = None) -> list[dict]:
        ranks = [rank] if rank is not None else self.dir.ranks()
        return [m for r in ranks for m in self.dir.metrics(r)]

    def new_metrics(self) -> list[dict]:
        """Records written since the previous call (all ranks)."""
        out = []
        for r in self.dir.ranks():
            out += self._tails.setdefault(r, JsonlTail(self.dir.metrics_file(r))).read()
        return out

    def timeline(self, rank: int | None = None) -> list[dict]:
        ranks = [rank] if rank is not None else self.dir.ranks()
        return [dict(e, rank=r) for r in ranks for e in self.dir.timeline(r)]

    def logs(self, rank: int = 0) -> str:
        return self.dir.log(rank)

    def summary(self) -> Summary:
        return Summary.of(self)

    def failure(self) -> RunFailed | None:
        return find_failure(self.dir, self.proc.poll() if self.proc else None)

    def stop(self, grace: float = 2.0, reason: str = "stopped") -> None:
        """Nothing to stop from here: the run was started elsewhere."""
