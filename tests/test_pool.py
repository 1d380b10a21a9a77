"""The warm rank pool (``dlab.procs.pool``, ``%dist_start``): variables live on every rank from cell
to cell; a raising cell names its rank and the pool lives on; a hung or interrupted cell
returns control within seconds and the pool works again; a killed kernel leaves no rank."""
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


def test_a_cell_past_its_timeout_returns_and_the_pool_recovers(pool):
    start = time.monotonic()
    _, _, error = pool.run("t = torch.ones(1)\nif rank == 1:\n    dist.all_reduce(t)\n", timeout_s=2)
    assert isinstance(error, PoolRestarted) and "timeout (2 s)" in str(error) and "[1]" in str(error)
    assert time.monotonic() - start < 15
    _, results, error = pool.run("result = rank")
    assert error is None and results == [0, 1]


KERNEL = """
import json, sys, time
from dlab.procs.pool import RankPool
pool = RankPool(2, log_dir=sys.argv[1])
print(json.dumps(pool.pids), flush=True)
time.sleep(600)
"""


def test_a_killed_kernel_leaves_no_rank(tmp_path):
    kernel = subprocess.Popen([sys.executable, "-c", KERNEL, str(tmp_path)], stdout=subprocess.PIPE,
                              text=True)
    pids = json.loads(kernel.stdout.readline())
    assert all(psutil.pid_exists(p) for p in pids)
    os.kill(kernel.pid, signal.SIGKILL)  # no atexit, no close: only the ranks' watch
    kernel.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_running(p) for p in pids):
        time.sleep(0.1)
    assert not any(_running(p) for p in pids)


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
