"""Readers of the run directory survive what crashes leave: a torn metrics line is skipped with
a warning naming the file and line; a corrupt config.json is refused, naming the file."""
from __future__ import annotations

import json
import re

import pytest

import dlab
from dlab.core.rundir import CorruptRunFile, JsonlTail, RunDir


def _record(step: int) -> str:
    """A metrics line with the fields the summary reads."""
    return json.dumps({"step": step, "rank": 0, "loss": 1.0 / (step + 1), "step_time": 0.1,
                       "tokens_per_s": 100.0, "mfu": 0.1, "memory": {"parameters": 10},
                       "comm": {"sent_bytes": 0, "seconds": 0.0, "wire_bytes": 0}}) + "\n"


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


def _finished_run(tmp_path) -> RunDir:
    """A finished one-rank run written by hand: four steps, their events, an ok report."""
    run = _run_dir(tmp_path)
    run.metrics_file(0).write_text("".join(_record(s) for s in range(4)))
    run.timeline_file(0).parent.mkdir()
    run.timeline_file(0).write_text("".join(
        json.dumps({"kind": kind, "step": s, "start": s + a, "end": s + b}) + "\n"
        for s in range(4) for kind, a, b in (("forward", 0.0, 0.3), ("backward", 0.3, 0.8),
                                             ("step", 0.0, 1.0))))
    run.report_file(0).parent.mkdir()
    run.report_file(0).write_text(json.dumps({"rank": 0, "ok": True, "time": 1.0}))
    return run


def _replace_line(path, number: int, text: str) -> None:
    lines = path.read_text().splitlines(keepends=True)
    lines[number - 1] = text + "\n"
    path.write_text("".join(lines))


@pytest.mark.parametrize("file, line, text, words", [
    ("metrics", 2, json.dumps({"step": 1, "rank": 0, "step_time": 0.1}), "no 'loss' field"),
    ("metrics", 3, _record(2).replace('"sent_bytes": 0', '"sent": 0').strip(),
     "no 'comm.sent_bytes' field"),
    ("metrics", 2, _record(1).replace('"loss": 0.5', '"loss": "low"').strip(),
     "its 'loss' is 'low', not a number"),
    ("metrics", 4, "[1, 2]", "a JSON list, not an object"),
    ("timeline", 5, json.dumps({"step": 1, "start": 1.0, "end": 1.3}), "no 'kind' field"),
    ("timeline", 1, json.dumps({"kind": "forward", "step": 0, "start": "0", "end": 0.3}),
     "its 'start' is '0', not a number"),
    # wrong kinds inside a record, and values the figures divide by (each crashed summary() or
    # plot() with a TypeError or a ZeroDivisionError before records were checked this deep)
    ("metrics", 2, _record(1).replace('{"parameters": 10}', '{"parameters": "lots"}').strip(),
     "its 'memory.parameters' is 'lots', not a number"),
    ("metrics", 3, _record(2).replace('"wire_bytes": 0', '"wire_bytes": "many"').strip(),
     "its 'comm.wire_bytes' is 'many', not a number"),
    ("metrics", 2, _record(1).replace('"step_time": 0.1', '"step_time": 0').strip(),
     "its 'step_time' is 0, not a positive number of seconds"),
    ("metrics", 4, _record(3).replace('"mfu": 0.1', '"mfu": 0.1, "hfu": true').strip(),
     "its 'hfu' is True, not a number"),
    ("timeline", 2, json.dumps({"kind": "forward", "step": 0, "start": 0, "end": 0.3,
                                "stage": "first"}), "its 'stage' is 'first', not an integer"),
])
def test_a_malformed_record_is_skipped_naming_file_and_line_and_the_rest_is_shown(
        tmp_path, file, line, text, words):
    run = _finished_run(tmp_path)
    path = run.metrics_file(0) if file == "metrics" else run.timeline_file(0)
    _replace_line(path, line, text)
    view = dlab.attach(run.path)
    with pytest.warns(UserWarning, match=rf"{file}/rank0\.jsonl, line {line}: a record with "
                                         rf"{re.escape(words)}; skipped it"):
        summary = view.summary()
        events = view.timeline()
        figure = view.plot()
    assert summary.rows[0]["steps"] == (3 if file == "metrics" else 4)
    assert len(events) == (12 if file == "metrics" else 11)
    assert figure is not None


@pytest.mark.parametrize("text", ["[]", '"ok"', "3", '[{"state": "ok"}]'])
def test_a_status_that_is_json_but_not_an_object_is_named_and_the_rest_shown(tmp_path, text):
    run = _finished_run(tmp_path)
    (run.path / "status.json").write_text(text)
    view = dlab.attach(run.path)
    with pytest.warns(UserWarning, match=r"run/status\.json: holds a JSON \w+, not the object"):
        assert view.state == "ok"  # what the ranks' reports say
        assert [row["steps"] for row in view.summary().rows] == [4]
        view.plot()


def test_a_report_that_is_not_an_object_is_named_and_the_run_is_read_without_it(tmp_path):
    run = _finished_run(tmp_path)
    run.report_file(0).write_text('["ok"]')
    with pytest.warns(UserWarning, match=r"ranks/rank0\.json: holds a JSON list"):
        view = dlab.attach(run.path)
        assert view.failure() is None and view.summary().rows[0]["steps"] == 4
