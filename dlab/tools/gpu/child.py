"""One step of a GPU session, run in a process of its own (``python child.py TARGET CTX RESULT``).

A lent GPU's minutes must not be lost to one step: a step that hangs is killed at its budget,
one that corrupts the CUDA context or crashes the interpreter takes only its own process down.
So the session (``dlab.tools.gpu.session``) runs each step here, by path: this file imports no
dlab module at its top, so the process costs only what the step itself imports.

``execute`` is also what the session calls in-process (``isolate=False``, the CPU test): the
step's function returns ``(doc, summary, extra files)``, and ``execute`` writes
``<step>.json`` (the doc with its header: step, device, whether CUDA ran it) and says which
files the step wrote.
"""
from __future__ import annotations

import importlib
import json
import math
import os
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace


def clean(value):
    """JSON has no inf or NaN: a figure that is not finite is written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value


def write_json(path: Path, doc) -> None:
    """Write whole or not at all: a session killed mid-write leaves the old file or none."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(clean(doc), indent=1, allow_nan=False))
    os.replace(tmp, path)


def execute(target: str, ctx: dict) -> dict:
    """Run the step ``target`` ("module:function") with ``ctx``; its row's summary and files."""
    module, _, name = target.partition(":")
    step = getattr(importlib.import_module(module), name)
    doc, summary, extra = step(SimpleNamespace(**ctx))
    path = Path(ctx["out"]) / f"{ctx['step']}.json"
    write_json(path, {"step": ctx["step"], "device": ctx["device"], "cuda": ctx["cuda"], **doc})
    return {"summary": summary, "files": [path.name, *extra]}


def main(argv: list[str]) -> int:
    target, ctx_path, result_path = argv
    ctx = json.loads(Path(ctx_path).read_text())
    try:
        result = execute(target, ctx)
    except BaseException as e:  # noqa: BLE001 - whatever ends the step is its row's reason
        traceback.print_exc()
        last = str(e).strip().splitlines()
        result = {"error": f"{type(e).__name__}: {last[-1] if last else ''}".strip()}
    write_json(Path(result_path), result)
    return 1 if "error" in result else 0


if __name__ == "__main__":
    # run by path, this file's folder is first on sys.path; its modules (trace, attention, ...)
    # must not shadow the standard library's for the step
    sys.path.pop(0)
    sys.exit(main(sys.argv[1:]))
