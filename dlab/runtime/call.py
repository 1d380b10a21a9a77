"""The rank side of ``dlab.spawn``: ``python -m dlab.runtime.call --run-dir R --timeout T``.

It runs what ``spawn`` pickled into ``R/call.pkl`` - a function by module and name, or a cell's
code with ``rank``, ``world_size``, ``dist`` and ``torch`` in scope - with the default process
group initialised, and saves its return value (a cell: its ``result`` variable) to
``R/results/rank{r}.pkl``. Its life is every rank's (``dlab.runtime.rank``): the same log, the
same report, the same deadline.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import pickle

import torch
import torch.distributed as dist

from dlab.core.machine import gpu_count
from dlab.core.rundir import RunDir
from dlab.runtime import rank


def function(target: dict):
    """The function ``target`` names: imported by module name, or loaded from its file (a
    function defined in a script run as ``__main__``)."""
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


def run_call(run: RunDir, rank_: int) -> None:
    """In a rank: run the target and save its result (pickle: these files are the run's own)."""
    with open(run / "call.pkl", "rb") as f:
        call = pickle.load(f)
    if "code" in call:
        scope = {"rank": rank_, "world_size": dist.get_world_size(), "dist": dist, "torch": torch,
                 "__name__": "__dlab_cell__"}
        exec(compile(call["code"], "<cell>", "exec"), scope)  # noqa: S102 - the user's own cell
        result = scope.get("result")
    else:
        result = function(call)(*call["args"], **call["kwargs"])
    (run / "results").mkdir(exist_ok=True)
    with open(run / f"results/rank{rank_}.pkl", "wb") as f:
        pickle.dump(result, f)
    dist.barrier()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m dlab.runtime.call", description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--timeout", type=float, default=60.0, help="deadline of every collective")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    me = rank.place()
    run = RunDir(args.run_dir)
    writer = rank.open_run(run, me)

    # backend "auto", as a run's: NCCL with a GPU per rank (``check``'s bus bandwidth then
    # measures the GPUs), else Gloo on the CPU
    nccl = gpu_count() >= me.world
    device = torch.device("cuda", me.local_rank) if nccl else torch.device("cpu")

    def body(_state: dict) -> None:
        with rank.process_group("nccl" if nccl else "gloo", args.timeout, args.threads, device):
            run_call(run, me.rank)

    # the body runs the caller's code: the interpreter's own exit closes its files and threads
    rank.serve(writer, args.timeout, body, fast_exit=False)


if __name__ == "__main__":
    main()
