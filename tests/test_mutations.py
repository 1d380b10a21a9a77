"""The planted bugs of ``tests/mutations.py`` are each caught by the tests named for them (and
those tests pass without the bug). The full check is slow: about a minute per mutation on 2
cores. That each planted edit still applies to today's code, and that each named test still
exists, is checked in the default run, so a refactor that moves the text is caught at once."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from mutations import MUTATIONS, ROOT  # noqa: E402


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m.name)
def test_each_planted_edit_applies_once_and_its_tests_exist(mutation):
    text = (ROOT / mutation.path).read_text()
    for old, new in mutation.edits:
        found = text.count(old)
        assert found == 1, f"{mutation.name}: {mutation.path} holds {found} copies of {old!r}"
        assert old != new
    for node in mutation.tests:
        path, name = node.split("::")
        function = name.split("[")[0]
        assert f"def {function}(" in (ROOT / path).read_text(), f"{mutation.name}: no test {node}"


@pytest.mark.slow
def test_every_planted_bug_is_caught():
    script = Path(__file__).with_name("mutations.py")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
