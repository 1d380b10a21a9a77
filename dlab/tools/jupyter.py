"""``python -m dlab lab``: JupyterLab on ``notebooks/``, where it is run - as root in a
container, on a headless server, or on a laptop - and the URL to open, token included.

JupyterLab refuses to start as root without ``--allow-root`` (Docker containers, hosted
notebook services), and on a machine without a display its attempt to open a browser fails or
opens a text browser. So: ``--allow-root`` when the effective user is root, ``--no-browser``
when there is no display (Linux without DISPLAY or WAYLAND_DISPLAY), and the URL printed by us,
with a token we choose, so it is right whatever the server prints. The token goes to the
server in its environment (JUPYTER_TOKEN), not on its command line, where any user of the
machine could read it. The port is checked before start and the server is told not to wander
to another one (the URL would then be wrong). JupyterLab is one of the lab's extras, not a
dependency of the package: without it we say what to install before printing any URL.
"""
from __future__ import annotations

import importlib.util
import os
import secrets
import socket
import sys
from pathlib import Path

INSTALL_LAB = 'pip install -e ".[lab]"'  # from the repository; make lab installs it into .venv


def notebooks_dir() -> Path:
    """``notebooks/`` of the current directory (the repository, as ``make lab`` runs it), else
    the one beside this package."""
    here = Path("notebooks")
    return here.resolve() if here.is_dir() else Path(__file__).resolve().parents[2] / "notebooks"


def has_display() -> bool:
    if sys.platform.startswith("linux"):
        return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))
    return True


def _port_free(ip: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((ip, port))
        except OSError:
            return False
    return True


def command(port: int, ip: str = "127.0.0.1", token: str | None = None,
            extra: list[str] | None = None, root=None) -> tuple[list[str], dict, str]:
    """The JupyterLab command line, its environment and the URL (with the token) it serves;
    ``root``: the directory it serves (default: the notebooks)."""
    token = token or secrets.token_hex(24)
    cmd = [sys.executable, "-m", "jupyterlab", str(root or notebooks_dir()), f"--ServerApp.ip={ip}",
           f"--ServerApp.port={port}", "--ServerApp.port_retries=0"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    if not has_display():
        cmd.append("--no-browser")
    host = "127.0.0.1" if ip in ("0.0.0.0", "") else ip
    env = {**os.environ, "JUPYTER_TOKEN": token}
    return cmd + list(extra or []), env, f"http://{host}:{port}/lab?token={token}"


def main(port: int, ip: str, extra: list[str]) -> int:
    """Start the lab in place of this process (signals then reach JupyterLab directly)."""
    missing = [m for m in ("jupyterlab", "ipywidgets", "matplotlib") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"error: {', '.join(missing)} not installed in this Python ({sys.executable}); the lab "
              f"needs the package's lab extras: {INSTALL_LAB}, or make lab, which installs "
              f"everything into .venv", file=sys.stderr)
        return 2
    if not _port_free(ip, port):
        print(f"error: port {port} on {ip} is in use; pass another, e.g. python -m dlab lab "
              f"--port {port + 1} (make lab LAB_PORT={port + 1})", file=sys.stderr)
        return 2
    cmd, env, url = command(port, ip, extra=[a for a in extra if a != "--"])
    print(f"dlab lab: serving {cmd[3]}\n  open {url}", flush=True)
    os.execve(cmd[0], cmd, env)
    return 0  # not reached: execv replaces this process
