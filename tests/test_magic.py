"""``%%distributed``: a cell's code runs on N fresh ranks, each rank's output comes back grouped
by rank, ``result`` values come back with ``-o``, and a rank that raises is named by number
with the cell line it raised on."""
from __future__ import annotations

import pytest

from dlab.procs.cells import RankError, cell_traceback, run_cell


@pytest.fixture(scope="module")
def shell():
    from IPython.core.interactiveshell import InteractiveShell
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "dlab")
    return ip


def test_cell_runs_on_every_rank_and_output_is_grouped(shell, runs_dir, capsys):
    cell = ("t = torch.tensor([rank + 1.0])\n"
            "dist.all_reduce(t)\n"
            "print(f'rank {rank} of {world_size}: sum {t.item():g}')\n"
            "result = t.item()\n")
    res = shell.run_cell(f"%%distributed -n 2 -o sums --runs-dir {runs_dir}\n{cell}")
    assert res.success, res.error_in_exec
    assert shell.user_ns["sums"] == [3.0, 3.0]  # 1 + 2 on both ranks
    out = capsys.readouterr().out
    assert out.index("--- rank 0 ---\nrank 0 of 2: sum 3") < out.index("--- rank 1 ---\nrank 1 of 2: sum 3")
    assert "result = 3.0" in out and "2 ranks" in out


def test_a_raising_rank_is_reported_by_number(shell, runs_dir, capsys):
    cell = ("x = torch.ones(2)\n"
            "if rank == 2:\n"
            "    raise ValueError(f'bad shape on rank {rank}')\n"
            "dist.all_reduce(x)\n")
    res = shell.run_cell(f"%%distributed -n 4 --runs-dir {runs_dir}\n{cell}")
    err = res.error_in_exec
    assert isinstance(err, RankError), err
    assert err.rank == 2 and err.exception == "ValueError" and "bad shape on rank 2" in err.message
    # the traceback is the cell's, with the line that raised quoted back
    assert "line 3" in err.cell_traceback and "raise ValueError" in err.cell_traceback
    assert "worker.py" not in err.cell_traceback and "spawn.py" not in err.cell_traceback
    assert err.cell_traceback.splitlines()[1].strip() == 'File "<cell>", line 3, in <module>'
    shown = capsys.readouterr()
    assert "--- rank 2  <- raised ---" in shown.out and "FAILED: rank 2 raised" in shown.out
    # the ranks' own worker tracebacks stay in their logs, not in the cell
    grouped = shown.out.split("FAILED:")[0]
    assert "Traceback" not in grouped and "[ended by ValueError: bad shape on rank 2]" in grouped
    assert "%%distributed: rank 2 raised ValueError" in "\n".join(err._render_traceback_())


def test_a_rank_slow_to_report_its_error_is_still_the_one_named(runs_dir):
    """The raising rank's report comes before its peers hear it is gone: here saying what went
    wrong takes rank 1 three seconds (as a loaded machine can), while its peers wait in the
    all-reduce. Had it closed its process group first, they would fail at once with "connection
    closed", and torchrun would end rank 1 before its report: the run would name a peer."""
    cell = ("class Slow(ValueError):\n"
            "    def __str__(self):\n"
            "        import time\n"
            "        time.sleep(3)\n"
            "        return 'slow to say on rank 1'\n"
            "x = torch.ones(2)\n"
            "if rank == 1:\n"
            "    raise Slow()\n"
            "dist.all_reduce(x)\n")
    _, results, err = run_cell(cell, 2, runs_dir=runs_dir)
    assert results is None and isinstance(err, RankError), err
    assert (err.rank, err.exception) == (1, "Slow") and "slow to say on rank 1" in err.message, err


def test_cell_traceback_keeps_only_the_cells_frames():
    tb = ('Traceback (most recent call last):\n  File "/x/dlab/worker.py", line 9, in main\n'
          '    run()\n  File "/x/dlab/spawn.py", line 79, in run_call\n'
          '    exec(compile(call["code"], "<cell>", "exec"), scope)\n'
          '  File "<cell>", line 2, in <module>\nZeroDivisionError: division by zero')
    text = cell_traceback(tb, "a = 1\nb = a / 0\n")
    assert text.splitlines()[1:] == ['  File "<cell>", line 2, in <module>', "    b = a / 0",
                                     "ZeroDivisionError: division by zero"]
