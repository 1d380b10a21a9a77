"""``make lab`` serves the lab as root and headless: the Makefile's own command line starts
JupyterLab, prints the URL with its token, and the page answers over loopback with that token."""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from dlab.procs.process import free_port

REPO = Path(__file__).resolve().parent.parent


def makefile_lab_command(port: int) -> list[str]:
    """The recipe of the Makefile's ``lab`` target, its variables filled in for this venv."""
    lines = (REPO / "Makefile").read_text().splitlines()
    recipe = lines[lines.index("lab: install") + 1].strip()
    recipe = recipe.replace("$(BIN)", str(Path(sys.executable).parent)).replace("$(LAB_PORT)", str(port))
    assert "$(" not in recipe, recipe
    return shlex.split(recipe)


def test_make_lab_serves_the_lab_headless_with_its_token():
    port = free_port()
    cmd = makefile_lab_command(port)
    cmd[0] = sys.executable  # the Makefile's .venv/bin/python is this interpreter's venv
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY")}
    lab = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, start_new_session=True)
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(lab.stdout), daemon=True)
    reader.start()
    try:
        end = time.monotonic() + 90
        url = None
        while url is None and time.monotonic() < end and lab.poll() is None:
            found = re.search(r"open (http://\S+/lab\?token=\w+)", "".join(output))
            url = found and found.group(1)
            time.sleep(0.1)
        assert url, f"no URL with a token printed: {''.join(output)[-2000:]}"
        page = None
        while page is None and time.monotonic() < end:
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    page = (response.status, response.read().decode(errors="replace"))
            except OSError:
                assert lab.poll() is None, "".join(output)[-2000:]
                time.sleep(0.3)
        assert page and page[0] == 200 and "JupyterLab" in page[1], "".join(output)[-2000:]
        base = url.split("/lab?")[0]
        try:
            urllib.request.urlopen(base + "/api/contents", timeout=5)
            raise AssertionError("the server answered without the token")
        except urllib.error.HTTPError as e:
            assert e.code == 403
        token = url.split("token=")[1]
        assert token not in " ".join(psutil.Process(lab.pid).cmdline()), "token on the command line"
        if os.geteuid() == 0:
            assert "--allow-root" in psutil.Process(lab.pid).cmdline()
    finally:
        os.killpg(lab.pid, signal.SIGTERM)
        try:
            lab.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(lab.pid, signal.SIGKILL)
            lab.wait()
    assert not psutil.pid_exists(lab.pid) or psutil.Process(lab.pid).status() == psutil.STATUS_ZOMBIE


def test_without_jupyterlab_the_lab_says_what_to_install_before_any_url(monkeypatch, capsys):
    """A Python with dlab's dependencies but not its lab extras: ``python -m dlab lab`` exits 2
    naming what is missing and the command that installs it, and prints no URL or token (the
    venv built from the dependencies alone, in tests/test_install.py, runs the real command)."""
    import importlib.util

    from dlab.tools import jupyter

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "jupyterlab" else real(name, *a))
    monkeypatch.setattr(jupyter.os, "execve", lambda *a: pytest.fail("the lab was started"))
    assert jupyter.main(free_port(), "127.0.0.1", []) == 2
    out, err = capsys.readouterr()
    assert "token" not in out + err and "http" not in out + err
    assert "jupyterlab not installed" in err and 'pip install -e ".[lab]"' in err, err
