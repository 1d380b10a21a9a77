"""torchrun's agent with its ranks forked from it: ``python -m dlab.procs.agent <torchrun flags>
-m dlab.worker --run-dir ...`` (or ``-m dlab.runtime.call``), what ``dlab.launch`` (and
``dlab.spawn``) start on CPUs.

Everything torchrun does stays torchrun's: its flags (``torch.distributed.run.parse_args``), its
rendezvous, its monitoring of the ranks, its restarts, its failure summary; the agent is
torch's own (``elastic_launch``). What changes is how a rank starts. torchrun runs a command
line per rank, a fresh interpreter that imports torch, then torch._dynamo when it builds its
first optimizer: 4.5 s of CPU a rank on the 2-core machine, so that a 4-rank run of one step
took 11 s, most of it four imports of the same library on two cores. Given a function, the
agent forks its ranks (``start_method="fork"``) from a process that has imported all of it
once: the same run takes 5 s, the agent's one import (``python -m dlab bench launch``).

Each rank is two processes. The one torch's agent forks, the rank's *keeper*, forks the rank
and waits for it: it passes on the signals it gets (the agent's closing SIGTERM, a stop), and
when the rank ends other than with status 0 it writes how (``ranks/rank{r}.exit.json``: the
exit code, negative for a signal, when, and whether a signal it passed on ended it), then ends
with the same status. torch's agent reports one failed rank of a forked run, the first it
finds, where torchrun's table of commands lists every one; the keepers' records are how
``dlab.analysis.diagnose`` still tells the rank killed first from the peers that failed after.

A rank starts as torchrun's own would: in a session of its own (torchrun starts each with
``start_new_session``), with the default signal handlers (the agent's turn SIGTERM into an
exception in its own loop), with its command line's arguments, and ends as one started as a
command does (``_run_rank``). Its command line (``ps``) is the
agent's, which names the run directory as a rank's did. A rank's launcher, to which the
``preempt`` fault sends its notice, is the agent (``DLAB_AGENT_PID``), not its keeper.

Only for ranks on the CPU, on Linux (``launch.forks``): a process that has touched CUDA cannot be
forked into ranks that use it; elsewhere the ranks start as torchrun's commands
(``launch.TORCHRUN``).
"""
from __future__ import annotations

import contextlib
import importlib
import os
import signal
import sys
import threading
import time
import traceback

from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.launcher.api import elastic_launch
from torch.distributed.run import config_from_args, parse_args

from dlab.core.disk import within, write_json
from dlab.core.rundir import RunDir
from dlab.runtime.rank import die_with_parent

#: the programs a forked rank runs (``python -m NAME``), each a function of its arguments;
#: what the agent imports for one, once, before it forks (``_preload``)
PROGRAMS = {"dlab.worker": "dlab.worker.main", "dlab.runtime.call": "dlab.runtime.call"}
#: what a keeper passes on to its rank
PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)
#: seconds a keeper gives the record of its rank's end (a hung disk must not keep it alive)
RECORD_S = 5.0


def rank_main(program: str, *argv: str) -> None:
    """The process torch's agent forked for a rank (the keeper): fork the rank, wait for it,
    record an end other than status 0, end as it did."""
    agent = os.getppid()
    os.setsid()
    die_with_parent()
    os.environ["DLAB_AGENT_PID"] = str(agent)
    # a signal in the instant between the fork and the handlers going in waits (pending) until
    # each process has its own: the keeper's passes it on, the rank's are the defaults
    signal.pthread_sigmask(signal.SIG_BLOCK, PASSED_ON)
    rank = os.fork()
    if rank == 0:
        _run_rank(program, argv)
    passed: set[int] = set()

    def pass_on(signum, frame) -> None:
        passed.add(signum)
        with contextlib.suppress(ProcessLookupError):
            os.kill(rank, signum)

    for sig in PASSED_ON:
        signal.signal(sig, pass_on)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, PASSED_ON)
    _, status = os.waitpid(rank, 0)
    code = os.waitstatus_to_exitcode(status)
    if code == 0:
        return  # to torch's wrapper, which hands the agent this rank's (empty) result
    record_end(RunDir(argv[argv.index("--run-dir") + 1]), int(os.environ["RANK"]),
               {"exit_code": code, "time": time.time(), "torn_down": code < 0 and -code in passed})
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [-code])
        os.kill(os.getpid(), -code)
    os._exit(code if code > 0 else 128 - code)


def record_end(run: RunDir, rank: int, end: dict) -> None:
    """Write ``ranks/rank{r}.exit.json``, or give up after ``RECORD_S`` (a full or hung disk:
    the diagnosis falls back on torch's agent's table)."""
    def write() -> None:
        run.exit_file(rank).parent.mkdir(parents=True, exist_ok=True)
        write_json(run.exit_file(rank), end)

    with contextlib.suppress(OSError):
        within(RECORD_S, write)


def _run_rank(program: str, argv: tuple[str, ...]) -> None:
    """The rank: ``python -m program *argv``. The worker ends its process itself
    (``os._exit``); a program that returns (``dlab.spawn``'s, running the caller's code) ends
    as the interpreter's exit begins, with the threads that code left running joined. What the
    interpreter would do after (``atexit``, the teardown of modules) is not done: the handlers
    are the agent's, inherited, as much as the rank's."""
    for sig in PASSED_ON:
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, PASSED_ON)
    sys.argv = [program, *argv]
    code = 1
    try:
        sys.modules[PROGRAMS[program]].main(list(argv))
        for thread in threading.enumerate():
            if thread is not threading.current_thread() and not thread.daemon:
                thread.join()
        code = 0
    except SystemExit as e:  # argparse's refusal, as the command would have exited
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
        if code == 1 and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - before its report exists: as the interpreter would
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _preload(program: str) -> None:
    """Import what ``program``'s ranks run, here, once: each forked rank inherits it."""
    importlib.import_module(PROGRAMS[program])
    if program == "dlab.worker":
        # a worker builds an optimizer, whose first construction imports torch._dynamo: 2.2 s
        # of CPU on the 2-core machine, as long as torch's own import
        importlib.import_module("torch._dynamo")


def main() -> None:
    args = parse_args(sys.argv[1:])
    if not args.module or args.training_script not in PROGRAMS:
        raise SystemExit(f"dlab.procs.agent forks {' or '.join(PROGRAMS)} only: run it as "
                         f"'-m PROGRAM ...' (got {args.training_script!r})")
    _preload(args.training_script)
    config, _, _ = config_from_args(args)
    config.start_method = "fork"
    elastic_launch(config=config, entrypoint=rank_main)(args.training_script,
                                                         *args.training_script_args)


if __name__ == "__main__":
    try:
        record(main)()  # as torchrun's own main: a failure's summary, then exit status 1
    finally:
        # as torchrun's main under dlab (launch.TORCHRUN): no teardown of torch once it returned
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(0)
