"""Shared fixtures: a run directory per test, a check that no test leaves a process behind,
and the single-process reference runs parity tests compare against (one per config, cached)."""
from __future__ import annotations

import json
import time

import psutil
import pytest

import dlab


def processes_of(path) -> list[psutil.Process]:
    """Live processes whose command line names ``path`` (a run directory or its parent): the
    torchrun agent and every rank, orphans included."""
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and str(path) in " ".join(p.info["cmdline"] or []):
                out.append(p)
        except psutil.Error:
            continue
    return out


@pytest.fixture
def runs_dir(tmp_path):
    path = tmp_path / "runs"
    yield path
    deadline = time.monotonic() + 5
    while processes_of(path) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = processes_of(path)
    for p in left:
        p.kill()
    assert not left, f"processes left behind: {[p.info['cmdline'] for p in left]}"


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """``reference(**config)``: the finished ``single`` run of that config (run once per session)."""
    cache: dict[str, dlab.Run] = {}
    root = tmp_path_factory.mktemp("reference")

    def get(**config) -> dlab.Run:
        key = json.dumps(config, sort_keys=True)
        if key not in cache:
            cache[key] = dlab.launch("single", 1, runs_dir=root, wait=True, **{**config, "save_final": True})
        return cache[key]

    return get
