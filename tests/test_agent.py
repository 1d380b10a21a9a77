"""A CPU run's ranks are forked from torchrun's agent (``dlab.procs.agent``): each rank under a
keeper under the agent, named by the agent's command line, and a rank's end other than status 0
recorded by its keeper as it happened (the killed rank is named from it: test_faults)."""
from __future__ import annotations

import os

import psutil
import pytest
from helpers import TINY_GPT

import dlab
from dlab.core.rundir import read_json_object
from dlab.procs.agent import PASSED_ON


def test_a_cpu_runs_ranks_are_forked_under_keepers_and_named_by_the_agents_command_line(runs_dir):
    run = dlab.launch("ddp", 2, runs_dir=runs_dir, **{**TINY_GPT, "steps": 10_000})
    for _ in run.stream(timeout=120):
        break  # the ranks are training
    agent = psutil.Process(run.proc.pid)
    assert agent.cmdline()[1:3] == ["-m", "dlab.procs.agent"]
    for r in range(2):
        rank = psutil.Process(read_json_object(run.dir.pid_file(r))["pid"])
        keeper = rank.parent()
        assert keeper.parent().pid == agent.pid, (r, keeper.parent())
        # what finds a run's processes (processes_of, RunDir's liveness) reads the run
        # directory in the command line
        assert rank.cmdline() == keeper.cmdline() == agent.cmdline()
        # a session of its own, as torchrun starts a rank it runs as a command
        assert os.getsid(rank.pid) == keeper.pid != os.getsid(agent.pid)
        # the signals a keeper passes on, blocked across its fork of the rank, reach both again
        for proc in (keeper, rank):
            assert not _blocked(proc.pid) & set(PASSED_ON), (r, proc.pid)
    run.stop()
    # the keepers record the SIGTERM they passed on; a run stopped from outside still reads
    # stopped, not failed
    assert run.state == "stopped" and run.status()["failed_rank"] is None


def test_a_killed_ranks_keeper_records_its_signal(runs_dir):
    run = dlab.launch("ddp", 2, runs_dir=runs_dir, fault={"rank": 1, "step": 2, "kind": "kill"},
                      **{**TINY_GPT, "steps": 6})
    with pytest.raises(dlab.RunFailed) as failed:
        run.wait(timeout=120)
    assert failed.value.rank == 1 and failed.value.exit_code == -9
    killed = read_json_object(run.dir.exit_file(1))
    assert killed["exit_code"] == -9 and killed["torn_down"] is False


def _blocked(pid: int) -> set[int]:
    """The signals ``pid`` blocks (its /proc status's SigBlk mask: bit n - 1 for signal n)."""
    status = open(f"/proc/{pid}/status").read()
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigBlk:")), 16)
    return {n for n in range(1, 65) if mask >> (n - 1) & 1}
