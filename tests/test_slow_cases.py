"""The cases moved to ``make test-slow`` by hand (``slow_cases.SLOW_BY_HAND``) exist: a renamed test
or case would otherwise silently return to the default run, or its entry mark nothing."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from slow_cases import SLOW_BY_HAND

ROOT = Path(__file__).resolve().parents[1]


def test_every_case_moved_to_the_slow_run_exists_and_is_marked_slow():
    files = sorted({nodeid.split("::")[0] for nodeid in SLOW_BY_HAND})
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                             "-m", "slow", *files], cwd=ROOT, capture_output=True, text=True, timeout=300)
    slow = {line.strip() for line in listed.stdout.splitlines() if "::" in line}
    missing = [nodeid for nodeid in SLOW_BY_HAND if nodeid not in slow]
    assert not missing, f"SLOW_BY_HAND names cases that do not exist (or are not marked slow): {missing}"
    assert all(reason.strip() for reason in SLOW_BY_HAND.values()), "each names what stands for it"
