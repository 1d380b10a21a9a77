"""Processes the notebook's side starts and must be able to stop whole: a free port, a child
tied to this process (a parent-death signal, so a killed kernel leaves nothing behind), a check
that the child, not a stranger, holds the port it was given, and a tree killed whole.

``launch`` (torchrun for a run), ``spawn``, the warm pool and the elastic rehearsal all start
their processes through these.
"""
from __future__ import annotations

import ctypes
import errno
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from dlab.core.machine import measure_cpu_peak_flops


def free_port() -> int:
    """A port nobody listens on now. The OS hands out ephemeral ports in turn, so two runs
    asking within the same millisecond still get different ones."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(threads: int, restarts: bool) -> dict[str, str]:
    env = dict(os.environ)
    # The worker imports dlab from wherever this process did, installed or not.
    package_root = str(Path(__file__).resolve().parents[2])  # the directory holding dlab/
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    env.update(OMP_NUM_THREADS=str(threads), DLAB_REDIRECT="1", PYTHONUNBUFFERED="1",
               DLAB_CPU_PEAK_FLOPS=str(measure_cpu_peak_flops(threads)))
    if restarts:
        # Restarted ranks fail to reconnect on Gloo through the agent's shared store
        # (TORCH_ON_CPU.md); with a store of their own they do.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


#: seconds to wait for a child to bind its port before deciding nothing is wrong
RDZV_BIND_WAIT = 30.0


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


def exit_text(code: int | None) -> str:
    """How a process ended, in words: "killed by SIGKILL", "exited with code 3"."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


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


