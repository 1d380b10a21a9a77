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


def available() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def compared(dlab: float, peer: float, **what) -> dict:
    """A row with a peer: what was measured, both figures and their ratio."""
    return {**what, "dlab": dlab, "peer": peer, "ratio": dlab / peer if peer else float("nan")}


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def format_rows(rows: list[dict]) -> str:
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys]
    table = [keys] + [[_cell(row.get(k, "")) for k in keys] for row in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(keys))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def run_bench(name: str, json_path: str | None = None, quick: bool = False) -> int:
    if name not in available():
        print(f"there is no benchmark {name!r}; available: {', '.join(available())}")
        return 2
    rows = importlib.import_module(f"{__name__}.{name}").run(quick=quick)
    print(format_rows(rows))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)
    return 0
