"""Shared fixtures: a run directory per test, a check that no test leaves a process behind,
and the single-process reference runs parity tests compare against (one per config, cached)."""
from __future__ import annotations

import json
import time
from collections import defaultdict

import pytest
from helpers import processes_of
from slow_cases import SLOW_BY_HAND

import dlab


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


WORLD_PARAMS = ("world", "world_size", "n")


@pytest.hookimpl(tryfirst=True)  # before -m "not slow" deselects
def pytest_collection_modifyitems(config, items):
    """The parity grids (tests that compare with ``single`` through the ``reference`` or
    ``pipeline_runs`` fixtures) run their cases at 2 and 4 ranks. ``make test`` keeps each
    test's 2-rank cases and marks its 4-rank cases ``slow`` (``make test-slow`` runs them), so
    the default run fits its time on 2 cores while every world size stays tested.

    Beyond this rule a case is marked ``slow`` by hand, with a comment naming what stands for it,
    where a faster case in the default run takes the same code path (the same code at 2 ranks,
    or one of several schedules, routings or layouts sharing one executor); every strategy,
    collective and notebook keeps at least one case in the default run. ``SLOW_BY_HAND`` lists
    the cases moved out of the default run to keep ``make test`` within its time, each with the
    default test that stands for it."""
    _mark_slow_by_hand(items)
    grids = defaultdict(list)
    for item in items:
        spec = getattr(item, "callspec", None)
        if spec is None or not {"reference", "pipeline_runs"} & set(item.fixturenames):
            continue
        world = next((spec.params[k] for k in WORLD_PARAMS if k in spec.params), None)
        if world is not None:
            grids[(str(item.path), item.originalname)].append((world, item))
    for cases in grids.values():
        if any(world == 2 for world, _ in cases):
            for world, item in cases:
                if world == 4:
                    item.add_marker(pytest.mark.slow)


def _mark_slow_by_hand(items) -> None:
    """Mark ``SLOW_BY_HAND``'s cases slow (tests/test_slow_cases.py holds that each exists)."""
    for item in items:
        if item.nodeid in SLOW_BY_HAND:
            item.add_marker(pytest.mark.slow)
