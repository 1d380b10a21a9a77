"""Writing a run's files so that a disk that fails says so: a write the file system refuses
(full, over quota, read-only, failing) named in one sentence with its remedy (``DiskError``),
whole files written by rename, space set aside for the record of how a run ended (``reserve``),
and calls that a hung file system could block bounded in time (``within``, ``aside``). The run
directory (``dlab.core.rundir``) and every other file dlab writes go through these.
"""
from __future__ import annotations

import contextlib
import errno
import gc
import json
import os
import select
import threading
from collections.abc import Callable
from pathlib import Path

#: what a write's errno says about the file system it went to, and what to do about it: each
#: its own sentence, since each needs another remedy (freeing space on a disk does not lift a
#: user's quota; a read-only or failing file system takes no write however much is freed)
DISK_ERRORS = {
    errno.ENOSPC: ("no space left on {path}", "free some space there, or {instead}"),
    errno.EDQUOT: ("disk quota exceeded on {path}", "your quota on that file system is used up "
                                                    "(`quota -s` shows it): remove some of your "
                                                    "files there, or {instead}"),
    errno.EROFS: ("{path} is on a read-only file system", "{instead}, or remount it read-write"),
    errno.EIO: ("an input/output error writing {path}", "the disk or the network file system "
                                                        "under it failed (dmesg says more): check "
                                                        "it, or {instead}"),
}
#: the way out that every remedy offers, for a run's own files
ELSEWHERE = "write runs elsewhere (runs_dir, --runs-dir)"
#: the errors after which a file set aside by ``reserve`` can still be written: overwriting it
#: in place needs no new block
FULL = (errno.ENOSPC, errno.EDQUOT)
#: bytes set aside, when a run (``status.json``) or a rank (its report) starts, for the file
#: that records how it ended: on a full disk it is overwritten in place, which needs no new
#: block, so the end of a run is recorded even when nothing else can be written
RESERVED_BYTES = 64 * 1024


class DiskError(OSError):
    """A write the file system refused (``DISK_ERRORS``: full, over quota, read-only, failing),
    said in one sentence that names ``path`` and what to do (``instead``: where else to write)."""

    def __init__(self, path, code: int = errno.ENOSPC, instead: str = ELSEWHERE):
        what, remedy = DISK_ERRORS[code]
        super().__init__(code, f"{what.format(path=path)}: {remedy.format(instead=instead)}")
        self.path = path

    def __str__(self) -> str:
        return self.strerror


def disk_error(error: OSError, path, instead: str = ELSEWHERE) -> OSError:
    """``error`` as ``DiskError`` naming ``path`` when its errno is one of ``DISK_ERRORS``,
    else itself."""
    if error.errno in DISK_ERRORS and not isinstance(error, DiskError):
        return DiskError(path, error.errno, instead)
    return error


def _write_new(path: Path, text: str) -> None:
    """Write a new file (the one write of the run directory's whole files: tests make it fail
    or hang, as a full or hung file system would)."""
    with open(path, "w") as f:
        f.write(text)


def write_json(path: Path, obj) -> None:
    """Whole-file write by rename: a reader sees the old file or the new one, never half. On a
    full disk the temporary file is removed, and a file ``reserve`` set aside is overwritten in
    place instead (it needs no new block); otherwise ``DiskError`` names the path."""
    path = Path(path)
    text = json.dumps(obj, indent=1, default=str)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        _write_new(tmp, text)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if e.errno in FULL and _overwrite_reserved(path, text):
            return
        raise disk_error(e, path) from None


def reserve(path: Path) -> None:
    """Set ``RESERVED_BYTES`` aside at ``path`` (blanks, which readers take for "not written
    yet") for a record that must be written even on a full disk (``write_json``). Best effort:
    a disk already full when the run starts leaves nothing to reserve."""
    with contextlib.suppress(OSError):
        _write_new(path, " " * RESERVED_BYTES)


def _overwrite_reserved(path: Path, text: str) -> bool:
    data = text.encode()
    try:
        if not path.is_file() or path.stat().st_size < len(data):
            return False
        with open(path, "r+b") as f:
            f.write(data)
            f.truncate()
        return True
    except OSError:
        return False


def within(seconds: float, fn, *args) -> bool:
    """Call ``fn(*args)`` in a thread and wait at most ``seconds``: True when it returned (its
    exception raised here), False when it is still blocked (a hung file system: the thread is
    left to it, and whoever called goes on to its deadline)."""
    outcome: list = []

    def call():
        try:
            fn(*args)
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            outcome.append(e)

    thread = threading.Thread(target=call, name=f"dlab-within-{getattr(fn, '__name__', 'call')}",
                              daemon=True)
    thread.start()
    thread.join(seconds)
    if not outcome:
        return False
    if outcome[0] is not None:
        raise outcome[0]
    return True


def aside(seconds: float, fn, *args, then: Callable[[], None] | None = None) -> bool:
    """Call ``fn(*args)`` in a process of its own and wait at most ``seconds``: True when it
    returned (an error it raised raised here, as ``OSError`` when it was one), False when it
    is still blocked; it then finishes on its own, however late, and ends. ``then()`` runs in
    that process after ``fn`` returned well, once the caller has been told.

    A process, not a thread (``within``): a write to a frozen file system (``fsfreeze``, a
    disk or network file system that stopped answering) can sleep where no signal reaches it,
    and a thread asleep there holds its whole process's exit until the disk answers; the
    process that writes here holds nothing of its caller's. It is forked twice (so that no
    zombie is left to whoever called), leaves the caller's session and files (a pipe its
    caller writes to closes when the caller exits), and ends with ``os._exit``."""
    if not hasattr(os, "fork"):
        return within(seconds, fn, *args)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the fork
        _aside_child(read, write, fn, args, then)
    os.close(write)
    os.waitpid(child, 0)  # it forks the worker and ends at once
    try:
        ready, _, _ = select.select([read], [], [], seconds)
        outcome = os.read(read, 4096) if ready else None
    finally:
        os.close(read)
    if outcome is None:
        return False
    if not outcome:
        raise RuntimeError("the process that did it ended without saying how it went")
    kind, _, message = outcome.decode(errors="replace").partition(":")
    if kind == "ok":
        return True
    code, _, text = message.partition(":")
    if kind == "OSError":
        raise OSError(int(code), text)
    raise RuntimeError(f"{kind}: {text}")


def _aside_child(read: int, write: int, fn, args, then) -> None:  # pragma: no cover - a fork
    """The middle process of ``aside``: fork the worker and end; the worker calls ``fn``, says
    how it went on ``write``, then calls ``then``."""
    try:
        gc.disable()  # a finalizer of the caller's objects would close a descriptor reused here
        os.close(read)
        if os.fork():
            os._exit(0)
        os.setsid()  # a Ctrl-C to the caller's terminal, or a signal to its group, is not for it
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.closerange(3, write)
        os.closerange(write + 1, os.sysconf("SC_OPEN_MAX"))
        try:
            fn(*args)
            said = "ok:"
        except OSError as e:
            said = f"OSError:{e.errno or 0}:{e}"
        except BaseException as e:  # noqa: BLE001 - said to the caller
            said = f"{type(e).__name__}:0:{e}"
        with contextlib.suppress(OSError):
            os.write(write, said.encode()[:4000])  # under PIPE_BUF: one write, read whole
            os.close(write)
        if then is not None and said == "ok:":
            then()
    finally:
        os._exit(0)
