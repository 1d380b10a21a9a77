"""The gang drill of notebook 13 (``dlab.procs.gang``): a job of 4 ranks of which 3 start. The
three wait for the fourth at the rendezvous until their timeout, each fails saying how many
ranks arrived and how many are missing, and none is left running; with every rank started the
same program forms its group. Times are bounded below (a rank cannot give up before its
timeout) and, above, only by the drill's own deadline, which a busy machine stays within."""
from __future__ import annotations

import math

import pytest
from helpers import processes_of

from dlab.core.config import ConfigError
from dlab.procs import gang

TIMEOUT_S = 3.0


def test_the_started_ranks_wait_for_the_missing_one_until_their_timeout_then_fail(runs_dir):
    drilled = gang.drill(world_size=4, started=3, timeout_s=TIMEOUT_S, runs_dir=runs_dir)
    assert [r.rank for r in drilled.ranks] == [0, 1, 2] and drilled.missing == [3]
    for r in drilled.ranks:
        assert not r.formed and r.exit_code == 1, r
        assert r.entered_s >= 0, r  # it entered after the drill started it
        assert TIMEOUT_S - 0.05 <= r.waited_s < TIMEOUT_S + gang.START_S, r
        assert 1 <= r.arrived <= 3, r
        assert f"{r.arrived} of 4 ranks arrived, {4 - r.arrived} missing" in r.error, r
        assert "torch said: " in r.error, r
    # the rank that gave up last read the count after every started rank had counted itself in
    last = max(drilled.ranks, key=lambda r: r.entered_s + r.waited_s)
    assert last.arrived == 3, drilled.ranks
    assert drilled.alive() == [] and processes_of(runs_dir) == []
    lines = drilled.lines()
    assert len(lines) == 4 and lines[3] == "rank 3: never started (no GPU was free for it)"
    assert all(f"gave up {r.waited_s:.1f} s later and exited with code 1: {r.error}" in line
               for r, line in zip(drilled.ranks, lines)), lines


def test_with_every_rank_started_the_same_program_forms_its_group(runs_dir):
    """The control: the failure above is the missing rank's, not the program's."""
    drilled = gang.drill(world_size=2, started=2, timeout_s=60.0, runs_dir=runs_dir)
    assert drilled.missing == []
    for r in drilled.ranks:
        assert r.formed and r.exit_code == 0 and r.arrived == 2 and r.error == "", r
        assert r.waited_s < 60.0, r  # formed, so it did not wait out its timeout
    assert "the process group formed" in drilled.lines()[0]


def test_ranks_still_running_at_the_deadline_are_killed_and_reaped(runs_dir, monkeypatch):
    """No time to start (START_S = 0): the deadline is the timeout itself, which a rank that
    must first start and then wait that long always passes."""
    monkeypatch.setattr(gang, "START_S", 0.0)
    with pytest.raises(RuntimeError, match=r"ranks \[0, 1\] were still running 1 s after the launch"):
        gang.drill(world_size=3, started=2, timeout_s=1.0, runs_dir=runs_dir)
    assert processes_of(runs_dir) == []  # at once: killed, not left to end by themselves


@pytest.mark.parametrize("kwargs,says", [
    ({"world_size": 1, "started": 1}, "a gang needs at least 2 ranks"),
    ({"world_size": 4, "started": 0}, "start between 1 and world_size=4 ranks"),
    ({"world_size": 4, "started": 5}, "start between 1 and world_size=4 ranks"),
    ({"world_size": 4.0, "started": 3}, "world_size must be a whole number of ranks"),
    ({"world_size": 4, "started": True}, "started must be a whole number of ranks"),
    ({"timeout_s": 0}, "timeout_s (how long each rank waits for the process group) must be a positive"),
    ({"timeout_s": math.nan}, "must be a positive number of seconds"),
])
def test_a_drill_that_cannot_show_the_lesson_is_refused_before_anything_starts(kwargs, says, runs_dir):
    with pytest.raises(ConfigError) as refused:
        gang.drill(runs_dir=runs_dir, **kwargs)
    assert says in str(refused.value)
    assert not runs_dir.exists()  # no run directory, so no rank
