"""``dlab.launch``: one call, a real multi-process run under torchrun, and a handle on it.

What dlab adds to torchrun for a notebook: the config is checked before any process starts; a
free port (retried when a stranger takes it first) and a fresh run directory per run (so runs
started together never collide); torchrun runs in its own process session and every rank dies
with it, and torchrun dies with the process that launched it however that process dies (a
parent-death signal), so an interrupted cell, a killed kernel or a cancelled job leaves nothing
behind; a run-wide deadline; and the failing rank's traceback brought back into the cell.
"""
from __future__ import annotations

import errno
import math
import os
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dlab.core.config import ConfigError, RunConfig
from dlab.core.disk import RESERVED_BYTES, DiskError, disk_error, write_json
from dlab.core.rundir import RunDir
from dlab.procs.process import binds_its_port, free_port, kill_tree, spawn_tied_to_this_process, worker_env
from dlab.procs.run import Run, track
from dlab.worker.validate import validate


def launch(strategy: str, world_size: int = 2, *, wait: bool = False, progress: bool = False,
           dashboard: bool = False, runs_dir: str | Path = "runs", timeout: float | None = None,
           **config) -> Run:
    """Start ``strategy`` on ``world_size`` ranks; return a ``Run``.

    ``config`` takes any ``RunConfig`` field (steps, model, model_options, batch_size, lr,
    options, fault, ...). A config that cannot work raises ``ConfigError`` here, before any
    process starts. ``wait=True`` blocks until the run ends (``progress`` prints a bar);
    ``dashboard=True`` blocks with live charts. ``timeout`` bounds the whole run's wall time
    (seconds, a positive finite number, or None for no bound beyond ``timeout_s`` per step).
    """
    if timeout is not None:
        check_seconds(timeout, "timeout (the run's wall deadline, --deadline on the command line)",
                      "or None")
    cfg = validate(RunConfig.from_dict({"strategy": strategy, "world_size": world_size, **config}))
    check_runs_dir(runs_dir, cfg.world_size)
    with new_run_dir(runs_dir, cfg.name or f"{strategy}-w{world_size}") as run_dir:
        cfg.save(run_dir / "config.json")
        run = start_torchrun(run_dir, cfg.world_size, ["--config", str(run_dir.path / "config.json")],
                             threads=cfg.threads_per_rank, max_restarts=cfg.max_restarts,
                             forked=forks(cuda=cfg.resolved_device() == "cuda"))
    if dashboard:
        from dlab.ui.dashboard import watch  # ipywidgets, a lab extra: loaded for a dashboard only

        watch(run, timeout=timeout)
    elif wait:
        run.wait(timeout=timeout, progress=progress)
    return run


def check_runs_dir(runs_dir: str | Path, ranks: int = 1) -> None:
    """Refuse a runs directory that cannot hold run directories, before anything starts: one
    that is a file, cannot be made or written, or whose file system has less room than a run
    of ``ranks`` sets aside to record how it ended (``RESERVED_BYTES`` for its status and for
    each rank's report): such a run could not even say why it failed."""
    path = Path(runs_dir)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"runs_dir {path} is a file, not a directory; choose another runs_dir")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"runs_dir {path} cannot be created ({e.strerror}); choose a "
                          f"writable directory") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"runs_dir {path} is not writable; choose a writable directory")
    free = shutil.disk_usage(path).free
    if free < RESERVED_BYTES * (ranks + 1):
        raise DiskError(f"{path} ({free // 1024} KiB free)", errno.ENOSPC)


@contextmanager
def new_run_dir(runs_dir: str | Path, label: str) -> Iterator[RunDir]:
    """A fresh run directory for a run being set up. A write that fails before the run starts
    (a full disk, most likely) removes it again, so no half-written directory is left to read
    as a lost run, and a disk that refuses it is said as ``DiskError`` ("no space left on
    <path>", "disk quota exceeded on <path>", ...)."""
    run_dir = RunDir.create(runs_dir, label)
    try:
        yield run_dir
    except OSError as e:
        shutil.rmtree(run_dir.path, ignore_errors=True)
        raise disk_error(e, run_dir.path) from None


def check_seconds(value, what: str, alternative: str = "") -> None:
    """Refuse a deadline that is not a positive, finite number of seconds (nan, inf, 0, -1, a
    string), naming ``what`` it is for, before anything starts."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value > 0):
        raise ConfigError(f"{what} must be a positive number of seconds"
                          f"{' ' + alternative if alternative else ''} (got {value!r})")


RDZV_TRIES = 3

#: torchrun itself (``torch.distributed.run``'s ``main``, what ``python -m torch.distributed.run``
#: runs), ending without the interpreter's teardown once ``main`` returned: tearing down the
#: torch it imported took 0.4-0.6 s of every launch on the 2-core machine, after its ranks had
#: finished and it had recorded their end. A failure raises out of ``main`` as under torchrun
#: (its traceback, exit status 1); the streams are flushed before the exit.
TORCHRUN = [sys.executable, "-c", "import os, sys\n"
            "from torch.distributed.run import main\n"
            "main()\n"
            "sys.stdout.flush(); sys.stderr.flush(); os._exit(0)"]

#: torchrun's agent forking its ranks from one import of torch and the worker (on CPUs: see
#: ``dlab.procs.agent``)
FORKING_AGENT = [sys.executable, "-m", "dlab.procs.agent"]


def forks(cuda: bool) -> bool:
    """Whether a run's ranks are forked from torchrun's agent (``dlab.procs.agent``): on Linux
    for ranks on the CPU. A process that touched CUDA cannot be forked into ranks that use it,
    and macOS forks no process that has loaded its system frameworks (Python starts its own
    processes there by spawning for that reason); those ranks start as torchrun's commands."""
    return sys.platform.startswith("linux") and not cuda


def agent_log_dir(run_dir: RunDir) -> Path:
    """Where torchrun's agent keeps its per-attempt folders: in the run directory. Without
    ``--log-dir`` it makes a fresh ``torchelastic_*`` directory in the temp dir for every run
    and never removes it (hundreds after a day of lessons)."""
    return run_dir.path.resolve() / "torchelastic"


def start_torchrun(run_dir: RunDir, nproc: int, args: list[str], threads: int = 1,
                   max_restarts: int = 0, program: str = "dlab.worker", forked: bool = False) -> Run:
    """Start torchrun on a free port, its ranks running ``python -m program --run-dir run_dir
    *args`` (``forked``: forked from its agent, ``dlab.procs.agent``), and return once it holds
    that port (the rendezvous store).

    ``free_port`` only says the port was free a moment ago: a stranger may bind it before
    torchrun does, and torchrun then waits on the stranger in silence for its 10-minute
    rendezvous timeout. So this waits (typically 1-3 s: torchrun importing torch) until
    torchrun's own process listens on the port; if another process listens there instead, it
    stops this torchrun and starts again on another port (``RDZV_TRIES`` times in all)."""
    env = worker_env(threads, max_restarts > 0)
    for attempt in range(1, RDZV_TRIES + 1):
        port = free_port()
        cmd = [*(FORKING_AGENT if forked else TORCHRUN), "--nnodes=1",
               f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_dir.path.name}",
               f"--max-restarts={max_restarts}", "--monitor-interval=0.1",
               f"--log-dir={agent_log_dir(run_dir)}",
               "-m", program, "--run-dir", str(run_dir.path.resolve()), *args]
        with open(run_dir / "torchrun.log", "ab") as log:
            proc = spawn_tied_to_this_process(cmd, log, env)
        try:
            write_json(run_dir / "launch.json", {"command": cmd, "port": port, "pid": proc.pid,
                                                 "host": socket.gethostname(),
                                                 "started": time.time(), "attempt": attempt})
        except OSError:
            kill_tree(proc, grace=1.0)  # a run whose launch cannot be recorded does not go on
            raise
        if binds_its_port(proc, port):
            break
        kill_tree(proc, grace=1.0)
        with open(run_dir / "torchrun.log", "a") as log:
            print(f"[dlab] another process took rendezvous port {port} before torchrun bound "
                  f"it; stopped this torchrun and started again on a new port", file=log)
    else:
        raise RuntimeError(f"torchrun could not bind a rendezvous port in {RDZV_TRIES} tries: "
                           f"other processes took each free port first; see {run_dir / 'torchrun.log'}")
    return track(Run(run_dir.path, proc))


