"""One rank of a warm pool (``dlab.procs.pool``): ``python -m dlab.runtime.pool_rank``, started by the pool.

The rank talks to the pool over an inherited socket, joins the process group (Gloo over loopback, or NCCL with
``DLAB_POOL_BACKEND``), then serves cells: it runs each one in a namespace it keeps between
cells (``rank``, ``world_size``, ``dist`` and ``torch`` to start with), captures what the cell
prints, and answers with that output, its ``result`` variable and, if the cell raised, the
exception and traceback. A cell that raises does not end the rank.

The wire (``pack`` / ``unpack``): every message is one plain ``pickle`` of a dict, sent as bytes.
Not ``Connection.send``: it pickles with multiprocessing's pickler, to which torch gives tensors a
reduction that shares their memory through a file descriptor fetched, on loading, from the
sender's resource sharer with multiprocessing's authentication key, which a process the pool
started with ``subprocess`` does not share: loading a tensor ``result`` in the kernel raised
``AuthenticationError``, after the reply had been read. Plain pickle copies the tensor's bytes.
A cell's message carries a sequence number and its answer carries it back (``seq``), so the
pool never takes one cell's answer for another's. The ``result`` travels pickled on its own
inside the answer: an answer whose result the kernel cannot load is still an answer to its cell.

It never outlives its pool, nor does anything a cell started: a thread watches the parent
process (the notebook's kernel) and, the moment the parent is gone, ends the rank's process
group (the rank and every process a cell started that did not leave it), even while the main
thread is stuck in a collective; a closed connection to the pool ends the group too, and so does
the pool when it stops or restarts the rank (``dlab.procs.pool``).

A cell that closes ``sys.stdout`` or ``sys.stderr`` (a habit from scripts) closes nothing but
its own capture, which stays open: the rank goes on, and the cell's output says so.
"""
from __future__ import annotations

import contextlib
import io
import os
import pickle
import signal
import threading
import time
import traceback
from multiprocessing.connection import Connection


def watch_parent(parent: int, every_s: float = 0.2) -> None:
    """End this process, and every process of its group (what its cells started), when
    ``parent`` is no longer its parent (the kernel died: the rank was re-parented), checked
    every ``every_s``."""
    def watch():
        while os.getppid() == parent:
            time.sleep(every_s)
        end_group()
    threading.Thread(target=watch, daemon=True, name="dlab-parent-watch").start()


def end_group() -> None:
    """SIGKILL this rank's process group: the processes its cells started that are still
    there, and the rank itself (it leads the group), which ends here."""
    os.killpg(os.getpgrp(), signal.SIGKILL)


def pack(message) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def unpack(data: bytes):
    return pickle.loads(data)  # noqa: S301 - the pool's own ranks, over a socket pair it made


def pickled_result(value) -> tuple[bytes, bool]:
    """``value`` pickled, and True; or, when it does not pickle (a module, a lock, a class
    defined in the cell), its repr pickled, and False: it is shown, not sent."""
    try:
        return pack(value), True
    except Exception:  # noqa: BLE001 - anything unpicklable is shown, not sent
        return pack(repr(value)), False


class _Capture(io.StringIO):
    """What a cell prints. ``close()`` (``sys.stdout.close()`` in the cell) leaves it open and
    is noted: a closed capture lost the cell's output and, when read, ended the rank."""

    closed_by_cell = False

    def close(self) -> None:
        self.closed_by_cell = True


def run_one(code: str, scope: dict) -> dict:
    out = _Capture()
    reply = {"ok": True, "output": "", "result": None, "sent": True}
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            scope.pop("result", None)
            exec(compile(code, "<cell>", "exec"), scope)  # noqa: S102 - the user's own cell
            reply["result"], reply["sent"] = pickled_result(scope.get("result"))
        except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt too: the rank lives on
            reply.update(ok=False, exception=type(e).__name__, message=str(e),
                         traceback=traceback.format_exc())
    reply["output"] = out.getvalue() + (
        "[the cell closed sys.stdout or sys.stderr: the pool keeps them open for the cells]\n"
        if out.closed_by_cell else "")
    return reply


def main() -> None:
    import torch
    import torch.distributed as dist

    env = os.environ
    watch_parent(int(env["DLAB_POOL_PARENT"]))
    conn = Connection(int(env["DLAB_POOL_FD"]))  # a socket pair's end, from the pool
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    dist.init_process_group(env.get("DLAB_POOL_BACKEND", "gloo"), rank=rank, world_size=world)
    scope = {"rank": rank, "world_size": world, "dist": dist, "torch": torch,
             "__name__": "__dlab_cell__"}
    conn.send_bytes(pack({"ready": True}))
    while True:
        try:
            message = unpack(conn.recv_bytes())
        except (EOFError, OSError):
            break  # the pool is gone
        if message is None:
            break
        conn.send_bytes(pack({**run_one(message["cell"], scope), "seq": message["seq"]}))
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    end_group()  # the pool closed (or the kernel is gone): nothing a cell started stays


if __name__ == "__main__":
    main()
