"""Readers of the run directory survive what crashes leave: a torn metrics line is skipped with
a warning naming the file and line; a corrupt config.json is refused, naming the file."""
from __future__ import annotations

import json

import pytest

import dlab
from dlab.core.rundir import CorruptRunFile, JsonlTail, RunDir


def _record(step: int) -> str:
    """A metrics line with the fields the summary reads."""
    return json.dumps({"step": step, "rank": 0, "loss": 1.0 / (step + 1), "step_time": 0.1,
                       "tokens_per_s": 100.0, "mfu": 0.1, "memory": {"parameters": 10},
                       "comm": {"sent_bytes": 0, "seconds": 0.0}}) + "\n"


def _run_dir(tmp_path, world_size: int = 1) -> RunDir:
    run = RunDir(tmp_path / "run")
    (run.path / "metrics").mkdir(parents=True)
    (run.path / "config.json").write_text(json.dumps({"strategy": "single", "world_size": world_size,
                                                      "steps": 4}))
    return run


def test_a_torn_line_mid_file_is_skipped_with_a_warning(tmp_path):
    run = _run_dir(tmp_path)
    torn = _record(2)[:15]  # a rank killed mid-write, then a restart appending after it
    run.metrics_file(0).write_text(_record(0) + _record(1) + torn + _record(2) + _record(3))
    with pytest.warns(UserWarning, match=r"rank0\.jsonl, line 3: not a JSON record"):
        steps = [m["step"] for m in run.metrics(0)]
    assert steps == [0, 1, 2, 3]
    with pytest.warns(UserWarning, match="line 3"):
        assert [row["steps"] for row in dlab.attach(run.path).summary().rows] == [4]


def test_a_live_files_incomplete_last_line_waits_for_its_end(tmp_path, recwarn):
    path = tmp_path / "m.jsonl"
    path.write_text(_record(0) + _record(1)[:10])
    tail = JsonlTail(path)
    assert [m["step"] for m in tail.read()] == [0]
    with open(path, "a") as f:
        f.write(_record(1)[10:])
    assert [m["step"] for m in tail.read()] == [1]
    assert not recwarn.list, "a line still being written is not torn"


def test_line_numbers_count_across_reads(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(_record(0) + _record(1))
    tail = JsonlTail(path)
    tail.read()
    with open(path, "a") as f:
        f.write("{torn\n" + _record(2))
    with pytest.warns(UserWarning, match=r"m\.jsonl, line 3"):
        assert [m["step"] for m in tail.read()] == [2]


@pytest.mark.parametrize("text", ['{"strategy": "single", "world_si', "[]", '{"strategy": "x"}'])
def test_a_corrupt_config_is_refused_naming_the_file(tmp_path, text):
    run = _run_dir(tmp_path)
    (run.path / "config.json").write_text(text)
    with pytest.raises(CorruptRunFile, match=r"run/config\.json"):
        dlab.attach(run.path)
    with pytest.raises(CorruptRunFile, match=r"run/config\.json"):
        dlab.Run(run.path).summary()
