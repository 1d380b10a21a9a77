"""``dlab.launch``: one call, a real multi-process run under torchrun, and a handle on it.

What dlab adds to torchrun for a notebook: the config is checked before any process starts; a
free port (retried when a stranger takes it first) and a fresh run directory per run (so runs
started together never collide); torchrun runs in its own process session and every rank dies
with it, and torchrun dies with the process that launched it however that process dies (a
parent-death signal), so an interrupted cell, a killed kernel or a cancelled job leaves nothing
behind; a run-wide deadline; and the failing rank's traceback brought back into the cell.
"""
from __future__ import annotations

import atexit
import ctypes
import errno
import math
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import psutil

from dlab.core.config import ConfigError, RunConfig
from dlab.analysis.diagnose import RunFailed, find_failure
from dlab.core.metrics import measure_cpu_peak_flops
from dlab.core.rundir import JsonlTail, RunDir, preempted_or_ok, read_json, write_json
from dlab.analysis.summary import Summary

_LIVE: weakref.WeakSet[Run] = weakref.WeakSet()


def free_port() -> int:
    """A port nobody listens on now. The OS hands out ephemeral ports in turn, so two runs
    asking within the same millisecond still get different ones."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    _check_wall_timeout(timeout)
    cfg = RunConfig.from_dict({"strategy": strategy, "world_size": world_size, **config}).validate()
    check_runs_dir(runs_dir)
    run_dir = RunDir.create(runs_dir, cfg.name or f"{strategy}-w{world_size}")
    cfg.save(run_dir / "config.json")
    run = start_torchrun(run_dir, cfg.world_size, ["--config", str(run_dir.path / "config.json")],
                         threads=cfg.threads_per_rank, max_restarts=cfg.max_restarts)
    if dashboard:
        from dlab.ui.dashboard import watch
        watch(run, timeout=timeout)
    elif wait:
        run.wait(timeout=timeout, progress=progress)
    return run


def check_runs_dir(runs_dir: str | Path) -> None:
    """Refuse a runs directory that cannot hold run directories, before anything starts."""
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


def _check_wall_timeout(timeout) -> None:
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (
            math.isfinite(timeout) and timeout > 0):
        raise ConfigError(f"timeout (the run's wall deadline, --deadline on the command line) must "
                          f"be a positive number of seconds or None (got {timeout!r})")


def worker_env(threads: int, restarts: bool) -> dict[str, str]:
    env = dict(os.environ)
    # The worker imports dlab from wherever this process did, installed or not.
    package_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    env.update(OMP_NUM_THREADS=str(threads), DLAB_REDIRECT="1", PYTHONUNBUFFERED="1",
               DLAB_CPU_PEAK_FLOPS=str(measure_cpu_peak_flops(threads)))
    if restarts:
        # Restarted ranks fail to reconnect on Gloo through the agent's shared store
        # (TORCH_ON_CPU.md); with a store of their own they do.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


#: seconds to wait for torchrun to bind its rendezvous port before deciding nothing is wrong
RDZV_BIND_WAIT = 30.0
RDZV_TRIES = 3


def start_torchrun(run_dir: RunDir, nproc: int, worker_args: list[str], threads: int = 1,
                   max_restarts: int = 0) -> Run:
    """Start torchrun on a free port and return once it holds that port (the rendezvous store).

    ``free_port`` only says the port was free a moment ago: a stranger may bind it before
    torchrun does, and torchrun then waits on the stranger in silence for its 10-minute
    rendezvous timeout. So this waits (typically 1-3 s: torchrun importing torch) until
    torchrun's own process listens on the port; if another process listens there instead, it
    stops this torchrun and starts again on another port (``RDZV_TRIES`` times in all)."""
    env = worker_env(threads, max_restarts > 0)
    for attempt in range(1, RDZV_TRIES + 1):
        port = free_port()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
               f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_dir.path.name}",
               f"--max-restarts={max_restarts}", "--monitor-interval=0.1",
               "-m", "dlab.worker", "--run-dir", str(run_dir.path.resolve()), *worker_args]
        with open(run_dir / "torchrun.log", "ab") as log:
            proc = spawn_tied_to_this_process(cmd, log, env)
        write_json(run_dir / "launch.json", {"command": cmd, "port": port, "pid": proc.pid,
                                             "host": socket.gethostname(), "started": time.time(),
                                             "attempt": attempt})
        if binds_its_port(proc, port):
            break
        kill_tree(proc, grace=1.0)
        with open(run_dir / "torchrun.log", "a") as log:
            print(f"[dlab] another process took rendezvous port {port} before torchrun bound "
                  f"it; stopped this torchrun and started again on a new port", file=log)
    else:
        raise RuntimeError(f"torchrun could not bind a rendezvous port in {RDZV_TRIES} tries: "
                           f"other processes took each free port first; see {run_dir / 'torchrun.log'}")
    run = Run(run_dir.path, proc)
    _LIVE.add(run)
    return run


def binds_its_port(proc: subprocess.Popen, port: int) -> bool:
    """True once ``proc`` listens on ``port`` (or has exited: its failure is reported the usual
    way), or when ``RDZV_BIND_WAIT`` passes with the port still free; False as soon as the port
    is in use by a process other than ``proc``."""
    deadline = time.monotonic() + RDZV_BIND_WAIT
    while time.monotonic() < deadline and proc.poll() is None:
        listens = _listens_on(proc.pid, port)
        if listens is None or listens:  # None: this system does not let us look; assume so
            return True
        if _port_in_use(port) and not _listens_on(proc.pid, port):
            return proc.poll() is not None
        time.sleep(0.05)
    return True


def _listens_on(pid: int, port: int) -> bool | None:
    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.AccessDenied:
        return None
    except psutil.Error:
        return False
    return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in conns)


def _port_in_use(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is not "in use"
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


def spawn_tied_to_this_process(cmd: list[str], log, env: dict) -> subprocess.Popen:
    """Popen torchrun in its own session (so a stop can signal its group) and, on Linux, with
    a parent-death signal: the kernel SIGKILLs torchrun when this process dies, however it dies
    (kill -9, a killed kernel, a cancelled job); its ranks follow (``worker._die_with_parent``).

    Linux delivers the parent-death signal when the *thread* that forked exits, not the
    process. A notebook may launch from a short-lived thread, so every torchrun is forked by
    one daemon thread that lives as long as this process."""
    if not sys.platform.startswith("linux"):
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, env=env)
    done: queue.Queue = queue.Queue()
    _spawner().put((cmd, log, env, done))
    ok, value = done.get()
    if not ok:
        raise value
    return value


_SPAWN_QUEUE: queue.Queue | None = None
_SPAWN_LOCK = threading.Lock()


def _spawner() -> queue.Queue:
    global _SPAWN_QUEUE
    with _SPAWN_LOCK:
        if _SPAWN_QUEUE is None:
            _SPAWN_QUEUE = queue.Queue()
            threading.Thread(target=_spawn_loop, args=(_SPAWN_QUEUE,), name="dlab-torchrun-spawner",
                             daemon=True).start()
    return _SPAWN_QUEUE


def _spawn_loop(requests: queue.Queue) -> None:
    # Looked up here, not in the forked child: loading a library after fork can deadlock.
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    while True:
        cmd, log, env, done = requests.get()
        parent = os.getpid()
        try:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, env=env,
                                    preexec_fn=lambda parent=parent: _die_with(prctl, parent))
            done.put((True, proc))
        except BaseException as e:  # noqa: BLE001 - handed to the caller, which raises it
            done.put((False, e))


def _die_with(prctl, parent: int) -> None:
    """In the forked child, before exec: SIGKILL me when my parent's spawning thread ends."""
    PR_SET_PDEATHSIG = 1
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def attach(path: str | Path) -> Run:
    """Open a run something else started (torchrun on a cluster, an earlier kernel)."""
    if not (Path(path) / "config.json").exists():
        raise FileNotFoundError(f"{path} is not a dlab run directory (it has no config.json)")
    RunDir(path).config()  # a corrupt config.json is refused here, naming the file
    return Run(path)


class Run:
    """A run, live or finished. Everything it knows it reads from the run directory, except
    whether its own torchrun process is still alive."""

    def __init__(self, path: str | Path, proc: subprocess.Popen | None = None):
        self.dir = RunDir(path)
        self.path = self.dir.path
        self.proc = proc
        self._tails: dict[int, JsonlTail] = {}
        self._ended_as: str | None = None

    def __repr__(self) -> str:
        return f"Run({str(self.path)!r}, state={self.state!r})"

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
        if self.proc is not None and self.proc.poll() is None:
            return "running"
        if self.proc is not None and self._ended_as is None:
            self._finish()
        return self.dir.status().get("state", "unknown")

    def status(self) -> dict:
        self.state  # noqa: B018 - finalises a run whose process has just ended
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

    def plot(self):
        """The dashboard's final figure of this run: loss, throughput, memory, bytes moved and,
        for a pipeline, the per-rank timeline (matplotlib, imported only when asked for)."""
        from dlab.ui.plots import plot

        return plot(self)

    def failure(self) -> RunFailed | None:
        return find_failure(self.dir, self.proc.poll() if self.proc else None)

    # --- waiting and stopping --------------------------------------------------------------
    def stream(self, poll: float = 0.2, timeout: float | None = None):
        """Yield metric records as the ranks write them, until the run ends."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            running = self.state == "running"
            yield from self.new_metrics()
            if not running:
                return
            if deadline and time.monotonic() > deadline:
                self.stop(reason="timeout")
                raise TimeoutError(f"run {self.path} did not finish within {timeout} s; stopped it")
            time.sleep(poll)

    def wait(self, timeout: float | None = None, progress: bool = False) -> Run:
        """Block until the run ends; raise ``RunFailed`` naming the failing rank. An interrupt
        (KeyboardInterrupt, a notebook's stop button) stops the whole run before it returns."""
        bar = _Progress(self) if progress else None
        try:
            for record in self.stream(timeout=timeout):
                if bar:
                    bar.update(record)
                if self._a_rank_failed() and not self.config.get("max_restarts"):
                    self._give_torchrun(2.0)
        except BaseException:
            self.stop(reason="interrupted")
            raise
        finally:
            if bar:
                bar.close()
        failure = self.failure()
        if failure:
            raise failure
        if self.state == "lost":
            raise RuntimeError(f"run {self.path} is lost: its launcher and processes are gone "
                               f"without a final status (killed with kill -9, or its kernel "
                               f"died); what it wrote so far is still readable")
        return self

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
        kill_tree(self.proc, grace)
        self._finish(reason)

    def _finish(self, reason: str | None = None) -> None:
        if self._ended_as is not None or self.proc is None:
            return
        failure = self.failure()
        reports = {r: self.dir.report(r) for r in self.dir.ranks()}
        ended_well = bool(reports) and all(rep and rep.get("ok") for rep in reports.values())
        state = reason if reason and reason != "failed" else ("failed" if failure else (
            preempted_or_ok(reports) if ended_well else "failed"))
        if state == "interrupted" and failure is None:
            state = "stopped"
        exit_codes = failure.exit_codes if failure else {r: 0 for r in self.dir.ranks()}
        self._ended_as = state
        write_json(self.dir / "status.json", {
            "state": state, "torchrun_exit": self.proc.returncode, "exit_codes": exit_codes,
            "failed_rank": failure.rank if failure else None, "ended": time.time(),
            "ranks": reports})
        _LIVE.discard(self)


def kill_tree(proc: subprocess.Popen, grace: float) -> None:
    procs = process_tree(proc)
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    signal_each(procs[1:], "terminate")  # ranks live in their own sessions, out of the group's reach
    _, alive = psutil.wait_procs(procs, timeout=grace)
    signal_each(alive, "kill")
    psutil.wait_procs(alive, timeout=2)
    try:
        proc.wait(timeout=2)
    except subprocess.TimeoutExpired:
        pass


def process_tree(proc: subprocess.Popen) -> list[psutil.Process]:
    """``proc`` (torchrun) first, then every process under it (its ranks)."""
    try:
        root = psutil.Process(proc.pid)
        return [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def signal_each(procs: list[psutil.Process], how: str) -> None:
    """``terminate`` or ``kill`` each process that is still there."""
    for p in procs:
        try:
            getattr(p, how)()
        except psutil.NoSuchProcess:
            pass


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


__all__ = ["ConfigError", "Run", "RunFailed", "attach", "launch", "read_json"]
