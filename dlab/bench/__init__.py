"""``python -m dlab bench NAME``: measured figures beside their peer, as a ratio from one run.

A benchmark is a module ``dlab.bench.NAME`` with ``run(quick: bool) -> list[dict]``. Each row
names what it measured (``name`` or ``algorithm`` / ``strategy`` / ``schedule``, ``ranks``,
``size`` ...) and, where PyTorch has a peer for the figure, ``metric``, ``dlab``, ``peer`` and
``ratio`` = dlab / peer. The rows are printed as a table and, with ``--json FILE``, written
as a JSON list.
"""
from __future__ import annotations

import importlib
import json
import pkgutil
import statistics

from dlab.analysis.tables import format_rows
from dlab.core.output import write_output


def available() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def compared(dlab: float, peer: float, **what) -> dict:
    """A row with a peer: what was measured, both figures and their ratio."""
    return {**what, "dlab": dlab, "peer": peer, "ratio": dlab / peer if peer else float("nan")}


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def run_bench(name: str, json_path: str | None = None, quick: bool = False) -> int:
    if name not in available():
        print(f"there is no benchmark {name!r}; available: {', '.join(available())}")
        return 2
    rows = importlib.import_module(f"{__name__}.{name}").run(quick=quick)
    print(format_rows(rows))
    if json_path:
        write_output(json_path, json.dumps(rows, indent=1))
    return 0
