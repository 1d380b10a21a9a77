"""The planted bugs of ``tests/mutations.py`` are each caught by the tests named for them (and
those tests pass without the bug). Slow: about a minute per mutation on 2 cores."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_every_planted_bug_is_caught():
    script = Path(__file__).with_name("mutations.py")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
