"""Run a function, or a piece of code, on N fresh ranks: the tool for collectives lessons and
tests that need a process group but no training loop.

``spawn(fn, world_size, *args)`` starts a run like ``launch`` does (torchrun, its own run
directory, the same failure reporting) whose ranks call ``fn(*args)`` with the default process
group initialised, and returns every rank's return value in rank order. ``fn`` must be a
module-level function (it is imported by name in each rank, or loaded from its file). A string
is run as code with ``rank``, ``world_size``, ``dist`` and ``torch`` in scope; its ``result``
variable, if it sets one, is what comes back (this is what ``%%distributed`` uses).
"""
from __future__ import annotations

import pickle
import sys
from pathlib import Path

from dlab.core.config import FIELDS, ConfigError, RunConfig
from dlab.core.disk import write_json
from dlab.core.machine import gpu_count
from dlab.core.rundir import RunDir
from dlab.procs.launch import check_runs_dir, forks, new_run_dir, start_torchrun


def spawn(fn, world_size: int = 2, *args, timeout_s: float = 60.0, runs_dir: str | Path = "runs",
          name: str = "", timeout: float | None = None, **kwargs) -> list:
    problems = [p for key, value in (("world_size", world_size), ("timeout_s", timeout_s))
                if (p := FIELDS[key].problem(key, value, label="")) is not None]
    problems = problems or RunConfig(strategy="", world_size=world_size).device_problems()
    if problems:
        raise ConfigError("this run cannot start:\n  - " + "\n  - ".join(problems))
    if isinstance(fn, str):
        target = {"code": fn}
    else:
        module = sys.modules[fn.__module__]
        target = {"module": fn.__module__, "file": getattr(module, "__file__", None),
                  "function": fn.__qualname__}
    check_runs_dir(runs_dir, world_size)
    with new_run_dir(runs_dir, name or "spawn") as run_dir:
        # the run directory's contract: its world size; what it runs is call.pkl, not a strategy
        write_json(run_dir / "config.json", {"world_size": world_size, "timeout_s": timeout_s,
                                             "call": target.get("function", "<cell>")})
        with open(run_dir / "call.pkl", "wb") as f:
            pickle.dump({**target, "args": args, "kwargs": kwargs}, f)
        # the ranks' backend is NCCL with a GPU each (dlab.runtime.call's rule), else Gloo; but
        # fn may put tensors on a GPU under Gloo too (two ranks on one GPU), and a rank forked
        # from the agent cannot: "Cannot re-initialize CUDA in forked subprocess" (an H200,
        # torch 2.11). So ranks are forked only on a machine without CUDA.
        run = start_torchrun(run_dir, world_size, ["--timeout", str(timeout_s)],
                             program="dlab.runtime.call", forked=forks(cuda=gpu_count() > 0))
    run.wait(timeout=timeout)
    return results(run_dir)


def results(run_dir: RunDir) -> list:
    out = []
    for r in run_dir.ranks():
        with open(run_dir / f"results/rank{r}.pkl", "rb") as f:
            out.append(pickle.load(f))
    return out
