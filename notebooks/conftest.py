"""Under nbval (``make test``): print how long each notebook took, top to bottom."""
from collections import defaultdict

_seconds: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report):
    _seconds[report.nodeid.split("::")[0]] += report.duration  # setup, call and teardown


def pytest_terminal_summary(terminalreporter):
    terminalreporter.section("time per notebook")
    for notebook, seconds in sorted(_seconds.items()):
        terminalreporter.write_line(f"{seconds:7.1f} s  {notebook}")
