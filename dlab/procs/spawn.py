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

import importlib
import importlib.util
import pickle
import sys
from pathlib import Path

from dlab.core.config import RunConfig
from dlab.core.rundir import RunDir


def spawn(fn, world_size: int = 2, *args, timeout_s: float = 60.0, runs_dir: str | Path = "runs",
          name: str = "", timeout: float | None = None, **kwargs) -> list:
    cfg = RunConfig(strategy="call", world_size=world_size, timeout_s=timeout_s)
    problems = cfg.field_problems(("world_size", "timeout_s")) or cfg._device_problems()
    if problems:
        from dlab.core.config import ConfigError
        raise ConfigError("this run cannot start:\n  - " + "\n  - ".join(problems))
    if isinstance(fn, str):
        target = {"code": fn}
    else:
        module = sys.modules[fn.__module__]
        target = {"module": fn.__module__, "file": getattr(module, "__file__", None),
                  "function": fn.__qualname__}
    from dlab.procs.launch import check_runs_dir, start_torchrun
    check_runs_dir(runs_dir)
    run_dir = RunDir.create(runs_dir, name or "spawn")
    cfg.save(run_dir / "config.json")
    with open(run_dir / "call.pkl", "wb") as f:
        pickle.dump({**target, "args": args, "kwargs": kwargs}, f)
    run = start_torchrun(run_dir, world_size, ["--call", "call.pkl", "--timeout", str(timeout_s)])
    run.wait(timeout=timeout)
    return results(run_dir)


def results(run_dir: RunDir) -> list:
    out = []
    for r in run_dir.ranks():
        with open(run_dir / f"results/rank{r}.pkl", "rb") as f:
            out.append(pickle.load(f))
    return out


def _function(target: dict):
    try:
        module = importlib.import_module(target["module"])
    except ImportError:
        spec = importlib.util.spec_from_file_location(target["module"], target["file"])
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    obj = module
    for part in target["function"].split("."):
        obj = getattr(obj, part)
    return obj


def run_call(_: str, run: RunDir, rank: int) -> None:
    """In a rank: run the target and save its result (pickle: these files are the run's own)."""
    import torch
    import torch.distributed as dist

    with open(run / "call.pkl", "rb") as f:
        call = pickle.load(f)
    if "code" in call:
        scope = {"rank": rank, "world_size": dist.get_world_size(), "dist": dist, "torch": torch,
                 "__name__": "__dlab_cell__"}
        exec(compile(call["code"], "<cell>", "exec"), scope)  # noqa: S102 - the user's own cell
        result = scope.get("result")
    else:
        result = _function(call)(*call["args"], **call["kwargs"])
    (run / "results").mkdir(exist_ok=True)
    with open(run / f"results/rank{rank}.pkl", "wb") as f:
        pickle.dump(result, f)
    dist.barrier()
