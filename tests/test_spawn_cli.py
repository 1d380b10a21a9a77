"""dlab.spawn (a function or code on N ranks) and the command line."""
from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

import dlab
from dlab.procs import spawn as spawn_module


def rank_and_sum(scale):
    import torch
    import torch.distributed as dist
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), scale * t.item()


def test_spawn_returns_every_rank_result(runs_dir):
    assert dlab.spawn(rank_and_sum, 3, 10, runs_dir=runs_dir) == [(0, 60.0), (1, 60.0), (2, 60.0)]


def test_spawn_forks_its_ranks_only_on_a_machine_without_cuda(monkeypatch, runs_dir):
    """A function may put tensors on the one GPU under Gloo (two ranks on one GPU), and a rank
    forked from the agent cannot initialise CUDA (an H200's session, torch 2.11): on a machine
    with any GPU, spawn's ranks start as torchrun's commands."""
    asked = []

    def start(*args, forked, **kwargs):
        asked.append(forked)
        raise RuntimeError("started")

    monkeypatch.setattr(spawn_module, "start_torchrun", start)
    for gpus in (0, 1):
        monkeypatch.setattr(spawn_module, "gpu_count", lambda gpus=gpus: gpus)
        with pytest.raises(RuntimeError, match="started"):
            dlab.spawn(rank_and_sum, 2, 1, runs_dir=runs_dir)
    assert asked == [True, False]


def test_spawn_code_names_the_raising_rank(runs_dir):
    code = "if rank == 1:\n    raise ValueError('bad shard')\nresult = rank"
    with pytest.raises(dlab.RunFailed, match="rank 1 of 2 failed: ValueError: bad shard") as info:
        dlab.spawn(code, 2, runs_dir=runs_dir, timeout_s=10)
    assert info.value.rank == 1


def test_cli_run_prints_a_summary_and_refuses_bad_input(runs_dir, tmp_path):
    out = tmp_path / "summary.json"
    # the README's first command line, as written there (default model, 4 ranks, 20 steps)
    cmd = [sys.executable, "-m", "dlab", "run", "torch-ddp", "--world-size", "4", "--steps", "20",
           "--runs-dir", str(runs_dir), "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert "step ms" in done.stdout and "ok" in done.stdout
    assert [r["steps"] for r in json.loads(out.read_text())["rows"]] == [20] * 4
    bad = subprocess.run(cmd[:5] + ["-n", "3", "--batch-size", "8"], capture_output=True, text=True)
    assert bad.returncode == 2 and "does not split evenly over 3" in bad.stderr


def test_cli_env_reports_backends():
    done = subprocess.run([sys.executable, "-m", "dlab", "env", "--json", "--no-measure"],
                          capture_output=True, text=True, timeout=60)
    info = json.loads(done.stdout)
    assert info["backends"]["gloo"] is True and info["auto_backend"]


def test_env_says_what_sharing_cores_does_to_timings():
    from dlab.cli.env import sharing
    assert sharing((2, 4), 4) is None  # a core per rank: nothing to say
    note = sharing((2, 4, 8), 2)
    assert "share the 2 cores" in note and "4 ranks up to 2.0x, 8 ranks up to 4.0x" in note
    done = subprocess.run([sys.executable, "-m", "dlab", "env", "--no-measure", "--ranks", "64"],
                          capture_output=True, text=True, timeout=60)
    assert "64 ranks up to" in done.stdout and "usable here" in done.stdout


def _no_work(*args, **kwargs):
    raise AssertionError("the command started its work before refusing its arguments")


@pytest.mark.parametrize("argv, words", [
    (["run", "single", "--steps", "1", "--json", "{missing}/s.json"], "does not exist"),
    (["bench", "launch", "--json", "{missing}/rows.json"], "does not exist"),
    (["check", "--quick", "--json", "{missing}/rows.json"], "does not exist"),
    (["plan", "--json", "{missing}/rows.json"], "does not exist"),
    (["plan", "--json", "{tmp}"], "is a directory"),
    (["check", "--strategies", ","], "names no strategy"),
    (["check", "--strategies", ""], "names no strategy"),
    (["check", "--strategies", "ddp,zero3,ddp"], "names ddp more than once"),
    # a path whose directory exists but takes no new file, whatever the permission bits say
    (["bench", "cells", "--json", "/proc/rows.json"], "/proc/rows.json cannot be written"),
    (["run", "single", "--steps", "1", "--json", "/proc/s.json"], "/proc/s.json cannot be written"),
    (["check", "--quick", "--json", "/proc/rows.json"], "/proc/rows.json cannot be written"),
])
def test_every_cli_refuses_nonsense_before_it_works(argv, words, tmp_path, monkeypatch, capsys):
    """A --json path that cannot be written, or an empty list of strategies, is found before
    the command runs anything (not after a check or a bench of minutes)."""
    from dlab.cli import main as cli
    from dlab.cli import plan as plan_cli
    from dlab.tools import check
    for module, name in ((cli, "launch"), (cli, "run_bench"), (check, "run_check"),
                         (plan_cli, "run")):
        monkeypatch.setattr(module, name, _no_work)
    argv = [a.format(missing=tmp_path / "missing", tmp=tmp_path) for a in argv]
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse's own refusal
        code = e.code
    assert code == 2
    assert words in capsys.readouterr().err


def test_check_on_its_own_refuses_an_unwritable_json_before_it_works(monkeypatch, capsys):
    """``python -m dlab.tools.check`` (not through ``python -m dlab``) checks its --json too."""
    from dlab.tools import check
    monkeypatch.setattr(check, "run_check", _no_work)
    with pytest.raises(SystemExit) as info:
        check.main(["--strategies", "ddp", "--json", "/proc/rows.json"])
    assert info.value.code == 2 and "/proc/rows.json cannot be written" in capsys.readouterr().err


def test_a_full_disk_at_the_json_path_is_named(monkeypatch, capsys):
    """/dev/full takes the open and refuses the write: the message names it, in one line."""
    from dlab.bench import cells
    from dlab.cli import main as cli
    monkeypatch.setattr(cells, "run", lambda quick: [{"name": "cell", "dlab": 1.0}])
    assert cli.main(["bench", "cells", "--json", "/dev/full"]) == 1
    err = capsys.readouterr().err
    assert err == ("error: no space left on /dev/full: free some space there, or give --json "
                   "another path\n"), err


TINY_FLAGS = ["--model-opt", "n_layer=1", "--model-opt", "d_model=32", "--model-opt", "n_head=2",
              "--model-opt", "seq_len=32", "--batch-size", "8"]


def test_a_closed_output_pipe_ends_the_command_quietly_and_the_run_reads_stopped(runs_dir):
    """``python -m dlab run ... | head -1``: the reader of the output goes away (here before the
    first line, so that the order is certain). The command ends as Unix tools do when SIGPIPE
    ends them (status 141, nothing said, no traceback), and the run it stopped on the way out
    reads "stopped"."""
    cli = subprocess.Popen([sys.executable, "-m", "dlab", "run", "single", "-n", "1", "--steps",
                            "1000000", "--runs-dir", str(runs_dir), *TINY_FLAGS],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    cli.stdout.close()
    try:
        _, err = cli.communicate(timeout=120)
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
    assert cli.returncode == 128 + signal.SIGPIPE and err == "", err
    (run_dir,) = runs_dir.iterdir()
    assert dlab.attach(run_dir).state == "stopped"
