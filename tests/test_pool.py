"""The warm rank pool (``dlab.procs.pool``, ``%dist_start``): variables live on every rank from cell
to cell; a raising cell names its rank and the pool lives on; a hung or interrupted cell
returns control within seconds and the pool works again; a rank that dies is named and the
pool restarts at once, saying its variables are gone; a cell's results are always its own, in
rank order, whatever they hold; bad arguments are refused before anything is sent or stopped;
a killed kernel leaves no rank."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch

from dlab.core.config import ConfigError
from dlab.procs.cells import RankError
from dlab.procs.pool import PoolRestarted, RankPool


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with RankPool(2, log_dir=tmp_path_factory.mktemp("pool")) as p:
        yield p


def test_variables_live_on_every_rank_between_cells(pool):
    _, _, error = pool.run("x = torch.tensor([rank + 1.0])\ndist.all_reduce(x)")
    assert error is None
    outputs, results, error = pool.run("result = (rank, x.item())\nprint('rank', rank, 'sees', x.item())")
    assert error is None and results == [(0, 3.0), (1, 3.0)]
    assert "rank 1 sees 3.0" in outputs.logs[1] and "rank 0 sees 3.0" in outputs.logs[0]


def test_results_are_in_rank_order_when_rank_0_answers_last(pool):
    """Rank 1 answers first and rank 0 a moment later: the list is still [rank 0's, rank 1's]
    (results in the order the answers arrive would give [1, 0])."""
    outputs, results, error = pool.run("import time\nif rank == 0:\n    time.sleep(0.5)\n"
                                       "print('answering', rank)\nresult = rank")
    assert error is None and results == [0, 1]
    assert outputs.logs == ["answering 0\n", "answering 1\n"]


def test_tensor_results_and_what_cannot_travel(pool):
    """A tensor (and a structure holding tensors) comes back as itself; a value that does not
    pickle comes back as its repr; the next cell's results are its own."""
    _, results, error = pool.run("result = {'t': torch.full((2,), float(rank)), 'rank': rank}")
    assert error is None and [r["rank"] for r in results] == [0, 1]
    assert all(torch.equal(r["t"], torch.full((2,), float(i))) for i, r in enumerate(results))
    _, results, error = pool.run("import threading\nresult = threading.Lock()")
    assert error is None and all("lock" in r for r in results), results
    _, results, error = pool.run("result = ('next', rank)")
    assert error is None and results == [("next", 0), ("next", 1)]


def test_a_rank_killed_between_cells_is_named_and_the_next_cell_is_not_run(pool):
    pool.run("kept = rank")
    before = pool.restarts
    os.kill(pool.pids[1], signal.SIGKILL)
    _wait_for_exit(pool, 1)
    outputs, results, error = pool.run("result = kept")
    assert isinstance(error, PoolRestarted) and error.rank == 1 and results is None
    text = str(error)
    assert "rank 1 killed by SIGKILL" in text and "every variable lost" in text
    assert "NOT run" in text and pool.restarts == before + 1
    _, results, error = pool.run("result = 'kept' in dir()")
    assert error is None and results == [False, False]  # new ranks: said, not discovered


def test_a_rank_killed_during_a_cell_is_named_not_a_survivor(pool):
    """The survivor's collective fails with Gloo's "connection closed": a symptom. The error
    names the dead rank and how it ended, and the pool is restarted at once (not at the next
    cell, and never said to live on while a member is dead)."""
    before = pool.restarts
    _, results, error = pool.run("import os, signal\nif rank == 1:\n"
                                 "    os.kill(os.getpid(), signal.SIGKILL)\ndist.barrier()")
    assert isinstance(error, PoolRestarted) and error.rank == 1, error
    assert "rank 1's process ended during the cell (killed by SIGKILL)" in str(error)
    assert "every variable lost" in str(error) and "lives on" not in str(error)
    assert pool.restarts == before + 1 and pool.alive()
    _, results, error = pool.run("result = rank")
    assert error is None and results == [0, 1]


STALE = """
import os
from multiprocessing.connection import Connection
from dlab.runtime.pool_rank import pack
if rank == 1:  # an extra answer, numbered as the previous cell's, ahead of this cell's own
    extra = Connection(os.dup(int(os.environ["DLAB_POOL_FD"])))
    extra.send_bytes(pack({{"seq": {seq}, "ok": True, "output": "", "result": pack("stale")}}))
    extra.close()
result = ("own", rank)
"""


def test_an_answer_to_another_cell_is_never_taken_for_this_ones(pool):
    """What a channel one message behind holds, planted: an answer to the previous cell waits
    ahead of this cell's. It is dropped by its sequence number and the cell's own come back."""
    _, results, error = pool.run(STALE.format(seq=pool.seq))
    assert error is None and results == [("own", 0), ("own", 1)], results
    _, results, error = pool.run("result = ('next', rank)")
    assert error is None and results == [("next", 0), ("next", 1)], results


@pytest.mark.parametrize("timeout", [float("nan"), -1.0, 0.0, float("inf")])
def test_a_bad_timeout_is_refused_before_the_cell_is_sent(pool, timeout):
    seq = pool.seq
    with pytest.raises(ConfigError, match="positive number of seconds"):
        pool.run("ran = True", timeout_s=timeout)
    assert pool.seq == seq
    _, results, error = pool.run("result = ('after', 'ran' in dir())")
    assert error is None and results == [("after", False), ("after", False)]


def test_a_raising_cell_names_its_rank_and_the_pool_lives_on(pool):
    pool.run("kept = rank * 10")
    pids = pool.pids
    outputs, results, error = pool.run("if rank == 1:\n    raise ValueError(f'bad on rank {rank}')\n")
    assert isinstance(error, RankError) and error.rank == 1 and error.exception == "ValueError"
    assert "bad on rank 1" in error.message and 'File "<cell>", line 2' in error.cell_traceback
    assert outputs.failed_rank == 1 and results is None
    _, results, error = pool.run("result = kept")
    assert error is None and results == [0, 10] and pool.pids == pids  # same ranks, same state


def test_a_rank_raising_while_the_others_wait_restarts_the_pool(pool):
    before = pool.restarts
    start = time.monotonic()
    _, _, error = pool.run("if rank == 0:\n    raise KeyError('lost')\ndist.barrier()")
    assert isinstance(error, RankError) and error.rank == 0 and "pool was restarted" in error.message
    assert time.monotonic() - start < 20 and pool.restarts == before + 1
    _, results, error = pool.run("t = torch.ones(1)\ndist.all_reduce(t)\nresult = t.item()")
    assert error is None and results == [2.0, 2.0]


@pytest.fixture
def interruptible():
    """SIGINT raising KeyboardInterrupt, as in a kernel: a test run started in the background
    inherits SIGINT ignored, and Python then leaves it so."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_a_hung_cell_is_interrupted_and_the_pool_recovers(pool, interruptible):
    """The kernel's interrupt is a SIGINT to the thread waiting for the ranks."""
    timer = threading.Timer(1.0, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    start = time.monotonic()
    timer.start()
    _, _, error = pool.run("import time\ntime.sleep(600)", timeout_s=600)
    assert isinstance(error, PoolRestarted) and "interrupted" in str(error)
    assert time.monotonic() - start < 15
    _, results, error = pool.run("result = world_size")
    assert error is None and results == [2, 2]


def test_a_cell_that_closes_stdout_leaves_the_ranks_alive_and_says_so(pool):
    pids = pool.pids
    outputs, results, error = pool.run("import sys\nprint('before', rank)\nsys.stdout.close()\n"
                                       "print('after', rank)\nresult = rank")
    assert error is None and results == [0, 1] and pool.pids == pids
    assert outputs.logs[1].startswith("before 1\nafter 1\n[the cell closed sys.stdout")
    _, results, error = pool.run("print('next')\nresult = rank")
    assert error is None and results == [0, 1]


def test_a_cell_that_ends_its_rank_is_told_by_what_the_rank_last_wrote(pool):
    _, _, error = pool.run("import os, sys\nif rank == 1:\n"
                           "    sys.__stderr__.write('the cell gave up here\\n')\n"
                           "    sys.__stderr__.flush()\n    os._exit(7)")
    assert isinstance(error, PoolRestarted) and error.rank == 1
    assert ("rank 1's process ended during the cell (exited with code 7); its last output: "
            "'the cell gave up here'") in str(error)


def test_a_cell_past_its_timeout_returns_and_the_pool_recovers(pool):
    start = time.monotonic()
    _, _, error = pool.run("t = torch.ones(1)\nif rank == 1:\n    dist.all_reduce(t)\n", timeout_s=2)
    assert isinstance(error, PoolRestarted) and "timeout (2 s)" in str(error) and "[1]" in str(error)
    assert time.monotonic() - start < 15
    _, results, error = pool.run("result = rank")
    assert error is None and results == [0, 1]


def _wait_for_exit(pool, rank: int) -> None:
    deadline = time.monotonic() + 10
    while pool.procs[rank].poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)


#: a cell that starts a process of its own (a server, a helper script) and leaves it running
STARTS_A_CHILD = ("import subprocess, sys\n"
                  "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
                  "result = child.pid")

KERNEL = f"""
import json, sys, time
from dlab.procs.pool import RankPool
pool = RankPool(2, log_dir=sys.argv[1])
_, children, error = pool.run({STARTS_A_CHILD!r})
assert error is None, error
print(json.dumps(pool.pids + children), flush=True)
time.sleep(600)
"""


def test_a_killed_kernel_leaves_no_rank_and_no_process_a_cell_started(tmp_path):
    kernel = subprocess.Popen([sys.executable, "-c", KERNEL, str(tmp_path)], stdout=subprocess.PIPE,
                              text=True)
    pids = json.loads(kernel.stdout.readline())
    assert len(pids) == 4 and all(_running(p) for p in pids)
    os.kill(kernel.pid, signal.SIGKILL)  # no atexit, no close: only the ranks' watch
    kernel.wait()
    _all_gone(pids)


def _all_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_running(p) for p in pids):
        time.sleep(0.1)
    left = [p for p in pids if _running(p)]
    for pid in left:  # a failing test leaves nothing behind either
        os.kill(pid, signal.SIGKILL)
    assert not left, "left running"


def test_a_process_a_cell_started_ends_with_the_pool(tmp_path):
    """Closed, or restarted after a rank died (a dead rank leaves its cells' processes)."""
    with RankPool(2, log_dir=tmp_path / "pool") as pool:
        _, first, error = pool.run(STARTS_A_CHILD)
        assert error is None and all(_running(p) for p in first)
        _, _, error = pool.run("import os\nif rank == 1:\n    os._exit(0)")
        assert isinstance(error, PoolRestarted)
        _all_gone(first)
        _, second, error = pool.run(STARTS_A_CHILD)
        assert error is None and all(_running(p) for p in second)
    _all_gone(second)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_the_magics_run_cells_on_the_pool(tmp_path, capsys):
    from IPython.core.interactiveshell import InteractiveShell
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "dlab")
    try:
        shell.run_line_magic("dist_start", f"-n 2 --runs-dir {tmp_path}")
        assert shell.run_cell("%%distributed\ny = rank + 100").success
        res = shell.run_cell("%%distributed -o ys\nresult = y")
        assert res.success and shell.user_ns["ys"] == [100, 101]
        assert "warm pool" in capsys.readouterr().out
        res = shell.run_cell("%%distributed -n 4\nresult = y")
        assert "use %dist_start -n 4, or --fresh" in str(res.error_in_exec)
        res = shell.run_cell(f"%%distributed --fresh -o fresh --runs-dir {tmp_path}\n"
                             "result = 'y' in dir()")
        assert res.success and shell.user_ns["fresh"] == [False, False]  # new processes
    finally:
        shell.run_line_magic("dist_stop", "")


@pytest.fixture
def shell(tmp_path):
    """An IPython shell with the magics loaded and a warm pool of 2 ranks."""
    from IPython.core.interactiveshell import InteractiveShell
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "dlab")
    ip.run_line_magic("dist_start", f"-n 2 --runs-dir {tmp_path}")
    yield ip
    ip.run_line_magic("dist_stop", "")


def test_after_a_tensor_a_bad_argument_and_a_killed_rank_each_cell_gets_its_own_results(shell):
    """The sequence that left one rank's value a cell behind, silently: a tensor result (the
    channel broke on it), a bad argument (a nan timeout failed after the cell was sent), a rank
    killed mid-cell. After each, a cell's results are checked to be that cell's."""
    def own(tag):
        return [(tag, 0), (tag, 1)]

    res = shell.run_cell("%%distributed -o t\nresult = torch.full((2,), float(rank))")
    assert res.success, res.error_in_exec
    assert [t.tolist() for t in shell.user_ns["t"]] == [[0.0, 0.0], [1.0, 1.0]]
    assert shell.run_cell("%%distributed -o a\nresult = ('a', rank)").success
    assert shell.user_ns["a"] == own("a")
    for bad in ("--timeout nan -o b", "--timeout -1 -o b", "-n 0 -o b", "-o 1x"):
        res = shell.run_cell(f"%%distributed {bad}\nran = True\nresult = ('b', rank)")
        assert isinstance(res.error_in_exec, ConfigError), (bad, res.error_in_exec)
    assert shell.run_cell("%%distributed -o c\nresult = ('c', 'ran' in dir(), rank)").success
    assert shell.user_ns["c"] == [("c", False, 0), ("c", False, 1)]  # no bad cell ran
    res = shell.run_cell("%%distributed -o killed\nimport os, signal\nif rank == 1:\n"
                         "    os.kill(os.getpid(), signal.SIGKILL)\ndist.barrier()\nresult = 1")
    assert isinstance(res.error_in_exec, PoolRestarted) and res.error_in_exec.rank == 1
    assert "killed" not in shell.user_ns
    assert shell.run_cell("%%distributed -o d\nresult = ('d', rank)").success
    assert shell.user_ns["d"] == own("d")


def test_dist_start_refuses_bad_arguments_and_keeps_the_running_pool(shell, tmp_path):
    from dlab.tools.magic import DistributedMagics
    pool = DistributedMagics.pool
    pids = pool.pids
    shell.run_cell("%%distributed\nkept = rank")
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for bad, words in (("-n 0", "at least 1 rank"), ("-n -2", "at least 1 rank"),
                       ("--timeout -1", "positive number of seconds"),
                       ("--timeout nan", "positive number of seconds"),
                       (f"--runs-dir {a_file}", "is a file")):
        with pytest.raises(ConfigError, match=words):
            shell.run_line_magic("dist_start", bad)
        assert DistributedMagics.pool is pool and pool.pids == pids and pool.alive(), bad
    assert shell.run_cell("%%distributed -o k\nresult = kept").success
    assert shell.user_ns["k"] == [0, 1]


def test_fresh_cells_refuse_zero_ranks_before_starting_any(tmp_path):
    from IPython.core.interactiveshell import InteractiveShell
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "dlab")
    res = ip.run_cell(f"%%distributed --fresh -n 0 --runs-dir {tmp_path}\nresult = rank")
    assert isinstance(res.error_in_exec, ConfigError) and "-n 0" in str(res.error_in_exec)
    assert not any(tmp_path.iterdir())
