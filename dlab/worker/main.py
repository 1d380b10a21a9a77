"""The program every rank of a training run runs: ``python -m dlab.worker``, under torchrun (or
Slurm).

From ``dlab.launch`` it gets ``--config <run>/config.json --run-dir <run>``. On a cluster it is
started the usual way, with the config as flags::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $HEAD:29500 \\
        -m dlab.worker --run-dir /shared/runs/exp1 ddp --steps 100 --model-opt n_layer=12

The rank's life (its place in the world, its log, the process group with the config's deadline,
the watchdog, the report it always leaves) is ``dlab.runtime.rank``'s; this module builds the
strategy, resumes from a checkpoint where asked, runs the loop (``dlab.worker.train``) and
writes the final state.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from dlab import parallel
from dlab.comm.instrumented import Comm
from dlab.core.config import ConfigError, RunConfig, add_arguments, from_args
from dlab.core.events import Timeline
from dlab.core.rundir import RunDir
from dlab.parallel.base import Context
from dlab.runtime import checkpoint, checkpoint_load, rank
from dlab.runtime.checkpoint import Checkpointer
from dlab.runtime.preemption import PREEMPTED_EXIT, Preemption
from dlab.worker.train import train
from dlab.worker.validate import validate


def parse(argv: list[str] | None):
    p = argparse.ArgumentParser(prog="python -m dlab.worker", description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", help="run directory (default: runs/<slurm job or torchrun id>)")
    p.add_argument("--config", help="config.json to run (instead of the flags)")
    p.add_argument("--elastic", action="store_true",
                   help="take the world size from torchrun (it changes when agents leave or join, "
                        "torchrun --nnodes MIN:MAX) instead of the config's; see dlab.procs.elastic")
    add_arguments(p, strategy_required=False)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    me = rank.place()
    run = RunDir(args.run_dir or rank.default_run_dir())
    run.path.mkdir(parents=True, exist_ok=True)
    if args.config:
        cfg = RunConfig.load(args.config)
    else:
        cfg = from_args(args)
        cfg.world_size = me.world
        if me.rank == 0 and not (run.path / "config.json").exists():
            cfg.save(run.path / "config.json")
    if args.elastic:
        # The global batch stays the config's; each rank's share follows the world size.
        # Every start resumes from the run's newest checkpoint, from a config file or from
        # flags: a returning agent's ranks are its first attempt, but the run goes on from
        # where the others stopped (``agree_on_step`` refuses ranks that would not).
        cfg.world_size, cfg.resume = me.world, "latest"
    writer = rank.open_run(run, me)

    def body(state: dict) -> dict:
        if cfg.world_size != me.world:
            raise RuntimeError(f"config says world_size={cfg.world_size} but this job has "
                               f"WORLD_SIZE={me.world}")
        validate(cfg)
        # Under Gloo several ranks may share a GPU (memory lessons, `dlab check` on one GPU):
        # rank i of a node takes GPU i modulo the GPUs there. NCCL's check asks for one per rank.
        cuda = cfg.resolved_device() == "cuda"
        device = (torch.device("cuda", me.local_rank % torch.cuda.device_count()) if cuda
                  else torch.device("cpu"))
        with rank.process_group(cfg.resolved_backend(), cfg.timeout_s, cfg.threads_per_rank, device):
            return _train(cfg, writer, me, device, state)

    rank.serve(writer, cfg.timeout_s, body,
               exit_code=lambda result: PREEMPTED_EXIT if result.get("preempted") else None)


def _train(cfg: RunConfig, writer, me: rank.Place, device: torch.device, state: dict) -> dict:
    timeline = Timeline()
    agree_on_config(cfg.to_dict())
    ctx = Context(cfg, me.rank, me.world, me.local_rank, device, timeline, Comm())
    strategy = parallel.get(cfg.strategy)(ctx)
    strategy.setup()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    state["step"] = _resume(cfg, writer.run, strategy, me.rank, attempt)
    checkpointer = None
    if cfg.checkpoint_every:
        checkpointer = Checkpointer(writer.run / "checkpoints", me.rank, me.world,
                                    cfg.checkpoint_kind, cfg.keep_checkpoints,
                                    cfg.checkpoint_async, meta=checkpoint.run_meta(cfg),
                                    device=device)
    # A SIGTERM is turned into a checkpoint only where there are checkpoints to write.
    preemption = Preemption(attempt) if checkpointer else None
    agree_on_step(state["step"])
    dist.barrier()
    t0_wall = timeline.align()
    if attempt or state["step"]:
        timeline.add("restart" if attempt else "resume", 0.0, 0.0, attempt=attempt,
                     from_step=state["step"])
    train(ctx, strategy, writer, state, checkpointer, attempt, preemption)
    common = {"t0_wall": t0_wall, "peak_flops": state["peak_flops"],
              "peak_source": state["peak_source"], "device": str(device)}
    if "preempted" in state:
        dist.barrier()  # no rank exits while another still writes its checkpoint
        return {"preempted": True, "resume_from": state["preempted"],
                "notice_s": time.time() - preemption.noticed if preemption.noticed else None,
                "notice_checkpoint_s": state["notice_checkpoint_s"], **common}
    if cfg.save_final:
        full = strategy.full_state_dict()
        # Every rank writes what it holds, so tests compare replicas bitwise (a rank that
        # skipped a step shows only in its own copy); rank 0's is also the run's final state.
        torch.save(full, writer.run.path / f"final_state_rank{me.rank}.pt")
        if me.rank == 0:
            torch.save(full, writer.run.path / "final_state.pt")
    dist.barrier()
    return common


class RanksDisagree(RuntimeError):
    """The ranks of one run were given different configs, or would start at different steps."""


#: config fields allowed to differ between ranks: the step each rank starts from is compared
#: instead of how it was asked for
MAY_DIFFER = ("resume",)


def agree_on_config(config: dict) -> None:
    """Every rank's config, gathered (``all_gather_object``, before any part of the strategy
    talks) and compared with rank 0's: ranks given other flags (an elastic agent started
    differently, one node's command edited) stop here, all of them, saying which field
    differs on which rank, instead of training together and reporting ok."""
    mine = {k: v for k, v in config.items() if k not in MAY_DIFFER}
    everyone = _gathered(mine)
    problems = [f"rank {r} has {k}={theirs.get(k)!r} where rank 0 has {k}={everyone[0].get(k)!r}"
                for r, theirs in enumerate(everyone[1:], start=1)
                for k in sorted(everyone[0].keys() | theirs.keys())
                if everyone[0].get(k) != theirs.get(k)]
    if problems:
        raise RanksDisagree("the ranks of this run were given different configs, so none of "
                            "them trains; start every rank with the same config or flags:\n  - "
                            + "\n  - ".join(problems[:8]))


def agree_on_step(step: int) -> None:
    """Every rank's first step (0, or the checkpoint it resumed), gathered and compared: ranks
    that did not resume while the others did would train from different states together."""
    starts: dict[int, list[int]] = {}
    for r, s in enumerate(_gathered(step)):
        starts.setdefault(s, []).append(r)
    if len(starts) > 1:
        raise RanksDisagree(
            "the ranks would start at different steps, so none of them trains: "
            + "; ".join(f"ranks {ranks} at step {s}" for s, ranks in sorted(starts.items()))
            + ". Every rank must resume from the same checkpoint: start every agent of an "
              "elastic run with --elastic, or every rank with the same --resume")


def _gathered(obj) -> list:
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, obj)
    return everyone


def _resume(cfg, run: RunDir, strategy, rank_: int, attempt: int) -> int:
    """The step to start from: a restarted attempt takes this run's newest checkpoint; otherwise
    ``resume`` names one ("latest", a checkpoint directory, or another run's directory). The
    strategy takes its state, fp16's loss scaler its own (a checkpoint of a run without one, an
    fp32 or bf16 run, leaves it fresh), every rank its RNG."""
    if attempt or cfg.resume == "latest":
        path = checkpoint.latest(run / "checkpoints")
    elif cfg.resume:
        path = checkpoint_load.find(cfg.resume)
    else:
        return 0
    if path is None:
        return 0
    reader = checkpoint_load.Reader(path)
    # a checkpoint whose manifest predates its optimizer and lr (and "latest", which launch
    # could not look at) is checked here, before its state is taken
    refused = checkpoint_load.settings_problems(cfg, reader.settings(), path)
    if refused:
        raise ConfigError("this run cannot resume:\n  - " + "\n  - ".join(refused))
    strategy.load_checkpoint_state(reader)
    if strategy.scaler is not None and reader.scaler() is not None:
        strategy.scaler.load_state_dict(reader.scaler())
    torch.set_rng_state(reader.rng(rank_))
    cuda_rng = reader.rng(rank_, "cuda_rng")
    if cuda_rng is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda_rng, torch.cuda.current_device())
    return reader.step
