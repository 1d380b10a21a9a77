"""The program every rank runs: ``python -m dlab.worker``, under torchrun (or Slurm).

From ``dlab.launch`` it gets ``--config <run>/config.json --run-dir <run>``. On a cluster it is
started the usual way, with the config as flags::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $HEAD:29500 \\
        -m dlab.worker --run-dir /shared/runs/exp1 ddp --steps 100 --model-opt n_layer=12

It reads the standard variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT; under
``srun`` without torchrun, SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID), initialises the process
group with the config's deadline, runs the job, and writes everything to the run directory.
Whatever happens, the rank leaves a report (``ranks/rank{r}.json``): ok, or its exception and
traceback; a timeout is reported as the deadline it is.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

from dlab.core.config import RunConfig, add_arguments, from_args
from dlab.runtime.preemption import PREEMPTED_EXIT
from dlab.core.rundir import RankWriter, RunDir
from dlab.runtime.watchdog import StepWatchdog

#: seconds a rank whose collective timed out waits before exiting, so that the peer it waited
#: for, if stuck outside a collective, reports itself (its watchdog's deadline started earlier)
SYMPTOM_GRACE_S = 1.0


def _adopt_slurm_env() -> None:
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:
        os.environ["RANK"] = os.environ["SLURM_PROCID"]
        os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
        os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this rank when its parent (torchrun's agent) dies, so a killed
    agent can never leave ranks behind. Ranks run in their own sessions under torchrun, so a
    signal to the agent's process group would not reach them."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() == 1:  # the parent died before prctl took effect
            os._exit(1)


def _redirect_output(path: Path) -> None:
    """Send this process's stdout and stderr (also from C++) to its log file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)


def _timeout_hint(exc: BaseException, timeout_s: float) -> str:
    text = f"{type(exc).__name__} {exc}".lower()
    if "timed out" in text or "timeout" in text:
        return (f"a collective did not complete within the deadline (timeout_s={timeout_s:g} s): "
                f"another rank never joined it (stuck, hung, or in a different collective). "
                f"Raise timeout_s if the work is just slow.")
    return ""


def parse(argv: list[str] | None):
    p = argparse.ArgumentParser(prog="python -m dlab.worker", description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", help="run directory (default: runs/<slurm job or torchrun id>)")
    p.add_argument("--config", help="config.json to run (instead of the flags)")
    p.add_argument("--call", help="module:function to call on every rank (dlab.spawn)")
    p.add_argument("--elastic", action="store_true",
                   help="take the world size from torchrun (it changes when agents leave or join, "
                        "torchrun --nnodes MIN:MAX) instead of the config's; see dlab.procs.elastic")
    add_arguments(p, strategy_required=False)
    return p.parse_args(argv)


def _default_run_dir() -> Path:
    job = os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or "local"
    return Path("runs") / f"job-{job}"


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    _adopt_slurm_env()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    run = RunDir(args.run_dir or _default_run_dir())
    run.path.mkdir(parents=True, exist_ok=True)
    if args.config:
        cfg = RunConfig.load(args.config)
        if args.elastic:
            # The global batch stays the config's; each rank's share follows the world size.
            # Every start resumes from the run's newest checkpoint: a returning agent's ranks
            # are its first attempt, but the run goes on from where the others stopped.
            cfg.world_size, cfg.resume = world, "latest"
    elif args.call:
        cfg = RunConfig(strategy="call", world_size=world,
                        timeout_s=args.timeout, threads_per_rank=args.threads)
    else:
        cfg = from_args(args)
        cfg.world_size = world
        if rank == 0 and not (run.path / "config.json").exists():
            cfg.save(run.path / "config.json")
    if os.environ.get("DLAB_REDIRECT") == "1":
        (run.path / "logs").mkdir(exist_ok=True)
        _redirect_output(run.log_file(rank))
    _die_with_parent()
    writer = RankWriter(run, rank)
    state = {"step": None}
    watchdog = StepWatchdog(state, cfg.timeout_s, writer, rank).start()
    try:
        if cfg.world_size != world:
            raise RuntimeError(f"config says world_size={cfg.world_size} but this job has "
                               f"WORLD_SIZE={world}")
        if not args.call:
            cfg.validate()
        result = _run(cfg, run, writer, rank, world, local_rank, state, args.call)
        watchdog.stop()
        writer.report(ok=True, step=state["step"], **(result or {}))
        writer.close()
        if result and result.get("preempted"):
            sys.stdout.flush()
            os._exit(PREEMPTED_EXIT)
    except BaseException as exc:  # noqa: BLE001 - every failure must leave a report
        watchdog.stop()
        tb = traceback.format_exc()
        print(tb, file=sys.stderr, flush=True)
        hint = _timeout_hint(exc, cfg.timeout_s)
        writer.report(ok=False, step=state["step"], exception=type(exc).__name__,
                      message=str(exc), traceback=tb, hint=hint)
        if hint:
            time.sleep(SYMPTOM_GRACE_S)
        # Skip interpreter teardown: destroying a process group whose peers are gone can block.
        os._exit(1)


def _run(cfg: RunConfig, run: RunDir, writer: RankWriter, rank: int, world: int,
         local_rank: int, state: dict, call: str | None) -> dict | None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(cfg.threads_per_rank)
    # Under Gloo several ranks may share a GPU (memory lessons, `dlab check` on one GPU): rank
    # i of a node takes GPU i modulo the GPUs there. NCCL's config check asks for one per rank.
    cuda = cfg.resolved_device() == "cuda"
    device = torch.device("cuda", local_rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(cfg.resolved_backend(), timeout=timedelta(seconds=cfg.timeout_s))
    try:
        if call:
            from dlab.procs.spawn import run_call
            run_call(call, run, rank)
            return None
        return _train(cfg, writer, rank, world, local_rank, device, state)
    finally:
        dist.destroy_process_group()


def _train(cfg, writer, rank, world, local_rank, device, state) -> dict:
    import torch.distributed as dist

    from dlab import parallel
    from dlab.runtime.checkpoint import Checkpointer
    from dlab.runtime.checkpoint import run_meta as checkpoint_meta
    from dlab.comm.instrumented import Comm
    from dlab.parallel.base import Context
    from dlab.runtime.preemption import Preemption
    from dlab.core.events import Timeline
    from dlab.runtime.train import train

    timeline = Timeline()
    ctx = Context(cfg, rank, world, local_rank, device, timeline, Comm())
    strategy = parallel.get(cfg.strategy)(ctx)
    strategy.setup()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    state["step"] = _resume(cfg, writer.run, strategy, rank, attempt)
    checkpointer = None
    if cfg.checkpoint_every:
        checkpointer = Checkpointer(writer.run / "checkpoints", rank, world, cfg.checkpoint_kind,
                                    cfg.keep_checkpoints, cfg.checkpoint_async,
                                    meta=checkpoint_meta(cfg), device=device)
    # A SIGTERM is turned into a checkpoint only where there are checkpoints to write.
    preemption = Preemption(attempt) if checkpointer else None
    dist.barrier()
    t0_wall = timeline.align()
    if attempt or state["step"]:
        timeline.add("restart" if attempt else "resume", 0.0, 0.0, attempt=attempt,
                     from_step=state["step"])
    train(ctx, strategy, writer, state, checkpointer, attempt, preemption)
    if "preempted" in state:
        dist.barrier()  # no rank exits while another still writes its checkpoint
        return {"preempted": True, "resume_from": state["preempted"],
                "notice_s": time.time() - preemption.noticed if preemption.noticed else None,
                "notice_checkpoint_s": state["notice_checkpoint_s"],
                "peak_flops": state["peak_flops"], "peak_source": state["peak_source"],
                "t0_wall": t0_wall, "device": str(device)}
    if cfg.save_final:
        import torch
        full = strategy.full_state_dict()
        # Every rank writes what it holds, so tests compare replicas bitwise (a rank that
        # skipped a step shows only in its own copy); rank 0's is also the run's final state.
        torch.save(full, writer.run.path / f"final_state_rank{rank}.pt")
        if rank == 0:
            torch.save(full, writer.run.path / "final_state.pt")
    dist.barrier()
    return {"t0_wall": t0_wall, "peak_flops": state["peak_flops"],
            "peak_source": state["peak_source"], "device": str(device)}


def _resume(cfg, run: RunDir, strategy, rank: int, attempt: int) -> int:
    """The step to start from: a restarted attempt takes this run's newest checkpoint; otherwise
    ``resume`` names one ("latest", a checkpoint directory, or another run's directory)."""
    import torch

    from dlab.runtime import checkpoint
    if attempt or cfg.resume == "latest":
        path = checkpoint.latest(run / "checkpoints")
    elif cfg.resume:
        path = checkpoint.find(cfg.resume)
    else:
        return 0
    if path is None:
        return 0
    reader = checkpoint.Reader(path)
    strategy.load_checkpoint_state(reader)
    torch.set_rng_state(reader.rng(rank))
    cuda_rng = reader.rng(rank, "cuda_rng")
    if cuda_rng is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda_rng, torch.cuda.current_device())
    return reader.step


if __name__ == "__main__":
    main()
