"""Elastic membership rehearsed on one machine: two torchrun agents, one lost and brought back.

On a cluster each node runs one torchrun agent, all meeting at one rendezvous with
``--nnodes MIN:MAX``. When a node dies its peers' collectives fail; their agents then meet
again without it and restart every worker at the smaller world size. When a node comes back
its agent waits at the rendezvous; the running agents see it waiting and restart every worker
at the larger size (torchrun's ``num_nodes_waiting``; such a restart does not use up
``--max-restarts``). torchrun restarts workers, nothing more: what lets training go on is a
checkpoint any world size can read. dlab's store every tensor as pieces of its full shape,
so each restart resumes from the newest one, resharded on load (``worker._resume``).

``rehearse`` plays this with ``agents`` agents of ``nproc`` ranks each on this machine: it
SIGKILLs one agent and its ranks (a node lost without notice) when rank 0 has finished step
``lose_at``, lets the others train ``back_after`` steps at the smaller size, starts the agent
again, and lets the run finish at the full size. It measures the time each membership change
costs, from the kill (or the return) to the end of the first step at the new size, and the
steps trained twice (those since the last checkpoint).

Batch semantics: the **global batch stays fixed** (the config's ``batch_size``); each rank's
share grows when ranks leave, so every step applies the same batch as an uninterrupted run
and the parameters match one to float summation order (1e-5 in fp32), not bitwise.

Settings, and why:

- ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (``launch.worker_env``): with the store shared
  (torch's default) an agent caches the workers' store address from its first rendezvous, so
  after a membership change the agent that was rank 0 never publishes it in the new round and
  a returning agent waits for it until the join timeout (seen with torch 2.13).
- ``--rdzv-conf``: heartbeats every second, a node dead after 5 missed (torch's default is 5 s
  x 3), and 2 s of last call for late joiners, so a change costs seconds, not the default
  30 s; a real cluster keeps longer timeouts for slow file systems and busy hosts.
"""
from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from dlab.core.config import ConfigError, RunConfig
from dlab.core.rundir import JsonlTail
from dlab.procs.launch import TORCHRUN, agent_log_dir, check_runs_dir, new_run_dir
from dlab.procs.process import (
    binds_its_port,
    free_port,
    kill_tree,
    process_tree,
    signal_each,
    spawn_tied_to_this_process,
    worker_env,
)
from dlab.procs.run import Run
from dlab.worker.validate import validate

RDZV_CONF = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=5"
#: restarts an agent may make after failures (the loss of a peer is one)
MAX_RESTARTS = 3


@dataclass
class Elastic:
    """What a rehearsal measured: ``lost_s`` from the kill to the end of the first step at the
    smaller size, ``back_s`` from the agent's return to the end of the first step at the full
    size, ``redone_steps`` trained twice (after a checkpoint, before a change), ``phases`` the
    (world size, step records) in order, and the agents' exit statuses (those that finished)."""

    run: Run
    lost_s: float
    back_s: float
    redone_steps: int
    phases: list[tuple[int, int]] = field(default_factory=list)
    exit_codes: list[int] = field(default_factory=list)


def rehearse(strategy: str = "ddp", agents: int = 2, nproc: int = 2, *, lose_at: int = 4,
             back_after: int = 3, runs_dir: str | Path = "runs", timeout: float = 300.0,
             **config) -> Elastic:
    """Run ``strategy`` on ``agents`` torchrun agents of ``nproc`` ranks, lose the last agent
    after step ``lose_at``, bring it back after ``back_after`` steps at the smaller size.

    ``config`` takes ``RunConfig`` fields; ``checkpoint_every`` must be set (the restarts
    resume from checkpoints) and ``batch_size`` must split at both world sizes. Bad input
    raises ``ConfigError`` before any process starts."""
    full, small = agents * nproc, (agents - 1) * nproc
    cfg = _checked(strategy, full, small, lose_at, back_after, config)
    check_runs_dir(runs_dir, full)
    with new_run_dir(runs_dir, cfg.name or f"{strategy}-elastic-{full}-{small}") as run_dir:
        cfg.save(run_dir / "config.json")
    port = free_port()
    cmd = [*TORCHRUN, f"--nnodes=1:{agents}",
           f"--nproc-per-node={nproc}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
           f"--rdzv-id={run_dir.path.name}", f"--rdzv-conf={RDZV_CONF}",
           f"--max-restarts={MAX_RESTARTS}", "--monitor-interval=0.1",
           f"--log-dir={agent_log_dir(run_dir)}", "-m", "dlab.worker",
           "--run-dir", str(run_dir.path.resolve()), "--config", str(run_dir / "config.json"),
           "--elastic"]
    env = worker_env(cfg.threads_per_rank, restarts=True)
    agents_up: list[subprocess.Popen] = []

    def start(i: int) -> subprocess.Popen:
        with open(run_dir / f"agent{i}.log", "ab") as log:
            proc = spawn_tied_to_this_process(cmd, log, env)
        agents_up.append(proc)
        return proc

    tail, seen = JsonlTail(run_dir.metrics_file(0)), []
    deadline = time.monotonic() + timeout

    def next_row(want) -> tuple[dict, float]:
        """The next rank-0 step record that ``want`` accepts, and when it was seen."""
        while True:
            for m in tail.read():
                if isinstance(m, dict) and "step" in m:
                    seen.append(m)
                    if want(m):
                        return m, time.time()
            codes = [p.poll() for p in agents_up]
            if any(c not in (None, 0) for c in codes) or all(c == 0 for c in codes):
                why = (f"an agent exited with status {next(c for c in codes if c)}" if any(codes)
                       else "the run ended first: give it more steps, or pace it with a 'slow' fault")
            elif time.monotonic() > deadline:
                why = f"not within timeout={timeout:g} s"
            else:
                time.sleep(0.02)
                continue
            raise RuntimeError(f"the elastic rehearsal did not reach its next step ({why}); see "
                               f"{run_dir.path}/agent*.log and {run_dir.path}/logs/")

    try:
        if not binds_its_port(start(0), port):
            raise RuntimeError(f"another process took rendezvous port {port}; run again")
        for i in range(1, agents):
            start(i)
        next_row(lambda m: m["step"] >= lose_at and m["world_size"] == full)
        t_lost = time.time()
        _lose(agents_up.pop())
        first_small, t_small = next_row(lambda m: m["world_size"] == small)
        next_row(lambda m: m["world_size"] == small and m["step"] >= first_small["step"] + back_after)
        t_back = time.time()
        start(agents - 1)
        _, t_full = next_row(lambda m: m["world_size"] == full)
        codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in agents_up]
        seen += [m for m in tail.read() if isinstance(m, dict) and "step" in m]
    finally:
        for p in agents_up:
            if p.poll() is None:
                kill_tree(p, grace=1.0)
    return Elastic(Run(run_dir.path), lost_s=t_small - t_lost, back_s=t_full - t_back,
                   redone_steps=len(seen) - len({m["step"] for m in seen}), phases=_phases(seen),
                   exit_codes=codes)


def _lose(agent: subprocess.Popen) -> None:
    """SIGKILL an agent and its ranks together: a node lost, not one told to stop (a SIGTERM
    would let the ranks checkpoint and leave in order, dlab.runtime.preemption)."""
    procs = process_tree(agent)
    signal_each(procs, "kill")
    psutil.wait_procs(procs, timeout=5)
    agent.wait(timeout=5)


def _phases(rows: list[dict]) -> list[tuple[int, int]]:
    phases: list[tuple[int, int]] = []
    for m in rows:
        if phases and phases[-1][0] == m["world_size"]:
            phases[-1] = (m["world_size"], phases[-1][1] + 1)
        else:
            phases.append((m["world_size"], 1))
    return phases


def _checked(strategy: str, full: int, small: int, lose_at: int, back_after: int,
             config: dict) -> RunConfig:
    if small < 1:
        raise ConfigError("an elastic rehearsal needs at least 2 agents (one is lost); use agents=2")
    cfg = validate(RunConfig.from_dict({"strategy": strategy, "world_size": full, **config}))
    validate(RunConfig.from_dict({"strategy": strategy, "world_size": small, **config}))
    if not cfg.checkpoint_every:
        raise ConfigError("every restart of an elastic run resumes from the newest checkpoint; "
                          "set checkpoint_every (e.g. 2)")
    if cfg.resume or cfg.fault and cfg.fault.get("kind") != "slow":
        raise ConfigError("an elastic rehearsal makes its own fault (the lost agent) and resumes "
                          "by itself; drop resume and fault (a 'slow' fault to pace it is fine)")
    if lose_at < 0 or back_after < 1 or lose_at + back_after + 3 > cfg.steps:
        raise ConfigError(f"steps={cfg.steps} leaves no room to lose an agent after step {lose_at}, "
                          f"train {back_after} steps without it and finish with it; use steps >= "
                          f"{lose_at + back_after + 3}, lose_at >= 0 and back_after >= 1")
    return cfg
