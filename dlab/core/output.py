"""Files a command writes where its user says (``--json FILE``): checked before the command
works, so minutes of a check or a bench are not lost to a path that cannot take the result,
and written so that a disk that refuses them is named (``/dev/full`` says "no space left on
/dev/full", not "on the disk").
"""
from __future__ import annotations

import os
from pathlib import Path

from dlab.core.config import ConfigError
from dlab.core.disk import disk_error


def check_output_path(path: str | Path, option: str = "--json") -> None:
    """Refuse ``path`` unless a file can be opened for writing there, by opening it (the
    permission bits say nothing to root, and ``/proc`` or ``/sys`` refuse a new file whatever
    they say); a file this check creates is removed again."""
    target = Path(path)
    if target.is_dir():
        raise ConfigError(f"{option} {path} is a directory; give a file name, e.g. "
                          f"{target / 'rows.json'}")
    parent = target.parent
    if not parent.is_dir():
        raise ConfigError(f"{option} {path}: the directory {parent} does not exist; create it or "
                          f"choose another path")
    existed = target.exists()
    try:
        # append: an existing file keeps its bytes; non-blocking: a FIFO without a reader
        # answers at once instead of holding the command
        fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o644)
    except OSError as e:
        raise ConfigError(f"{option} {path} cannot be written ({e.strerror}); choose another "
                          f"path") from None
    os.close(fd)
    if not existed:
        target.unlink(missing_ok=True)


def write_output(path: str | Path, text: str, option: str = "--json") -> None:
    """Write ``text`` to ``path``; a file system that refuses it raises ``DiskError`` naming
    ``path`` (a full disk, a quota, ...)."""
    try:
        Path(path).write_text(text)
    except OSError as e:
        raise disk_error(e, path, instead=f"give {option} another path") from None
