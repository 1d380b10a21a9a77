"""What a GPU session's folder holds, as a schema, and ``validate(folder)``.

The schema is written the way JSON Schema writes one (``type``, ``properties``, ``required``,
``additionalProperties``, ``items``, ``enum``), as Python dicts so that no new dependency is
needed; ``check`` implements the part of JSON Schema they use. Objects are closed: a field the
schema does not name is refused, as is a missing or ill-typed one, each with its path in the
file (``matmul.json: rows[3].tflops: expected a number, got 'fast'``).
"""
from __future__ import annotations

import json
from pathlib import Path

from dlab.theory.plan import cluster

#: the version of this layout; a folder written under another is refused
VERSION = 1

STR, INT, NUM, BOOL = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


def nullable(spec: dict) -> dict:
    return {**spec, "type": [spec["type"], "null"]}


def obj(**properties) -> dict:
    """A closed object: every property required, no other allowed."""
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


def array(items: dict) -> dict:
    return {"type": "array", "items": items}


def mapping(values: dict) -> dict:
    """An object whose keys are free (names), each value of ``values``."""
    return {"type": "object", "additionalProperties": values}


def enum(*values) -> dict:
    return {"enum": list(values)}


STATUS = enum("ok", "skipped", "failed", "timeout")
#: a row that could not be measured says why instead (a backend this GPU lacks, no CUDA)
WHY = nullable(STR)
HEADER = {"step": STR, "device": STR, "cuda": BOOL}

INDEX = obj(
    format=enum("dlab-gpu-session"), version=INT, device=STR, cuda=BOOL, cpu_mode=BOOL,
    quick=BOOL, started=STR, finished=nullable(STR), command=STR, budget_s=NUM,
    versions=mapping(nullable(STR)),
    steps=array(obj(name=STR, status=STATUS, seconds=NUM, budget_s=NUM, files=array(STR),
                    summary=STR, why=WHY)))

ENV = obj(**HEADER, versions=mapping(nullable(STR)), python=STR, platform=STR, cpu_cores=INT,
          gpus=array(obj(index=INT, name=STR, capability=STR, memory_bytes=INT, sms=INT)),
          features=mapping(BOOL), nvidia_smi=nullable(STR))

CHECK = obj(**HEADER, machine=STR, strategies_asked=array(STR),
            rows=array(mapping({"type": ["string", "number", "integer", "boolean", "null"]})),
            allreduce=array(mapping({"type": ["string", "number", "integer", "boolean", "null"]})),
            passed=INT, failed=INT, skipped=INT)

CALIBRATE = obj(**HEADER, profile=STR, describe=STR, quick=BOOL, ranks=INT)

PHASE = obj(name=STR, host_s=NUM, events=INT, busy_s=NUM, compute_s=NUM, memory_s=NUM)
STEP_PROFILE = obj(
    **HEADER, model=mapping(NUM), batch=INT, precision=STR, tokens=INT, flops=NUM, trace=STR,
    dlab_timeline=array(obj(kind=STR, start_s=NUM, end_s=NUM)),
    kind=enum("kernel", "cpu_op"), step_s=NUM, busy_s=NUM, idle_s=NUM, gaps=INT,
    largest_gap_s=NUM, compute_s=NUM, memory_s=NUM, phases=array(PHASE),
    top=array(obj(name=STR, bound=enum("compute", "memory"), count=INT, seconds=NUM)),
    ops=array(obj(name=STR, count=INT, self_s=NUM)))

ATTENTION = obj(**HEADER, dtype=STR, batch=INT, heads=INT, head_dim=INT,
                rows=array(obj(backend=STR, seq=INT, forward_s=nullable(NUM),
                               backward_s=nullable(NUM), tflops=nullable(NUM),
                               saved_bytes=nullable(INT), peak_bytes=nullable(INT), why=WHY)))

MATMUL = obj(**HEADER, bandwidth=NUM, bandwidth_source=STR,
             rows=array(obj(dtype=STR, n=INT, seconds=nullable(NUM), tflops=nullable(NUM),
                            intensity=NUM, peak=nullable(NUM), peak_source=STR,
                            share=nullable(NUM), roofline=nullable(NUM), why=WHY)))

CATEGORY_BYTES = mapping(INT)
ALLOCATOR = obj(
    **HEADER, model=mapping(NUM), batch=INT, precision=STR,
    phases=array(obj(phase=STR, dlab=CATEGORY_BYTES, dlab_total=INT,
                     allocated=nullable(INT), reserved=nullable(INT))),
    dlab_peak=INT, allocator_peak=nullable(INT), reserved_peak=nullable(INT),
    snapshot=nullable(STR), why=WHY)

COLLECTIVES = obj(**HEADER, rows=array(obj(
    backend=STR, tensors=STR, ranks=INT, op=STR, bytes=INT, seconds=nullable(NUM),
    busbw=nullable(NUM), why=WHY)))

#: the JSON files a session writes, by step, with their schemas
FILES = {"index.json": INDEX, "env.json": ENV, "check.json": CHECK, "calibrate.json": CALIBRATE,
         "step_profile.json": STEP_PROFILE, "attention.json": ATTENTION, "matmul.json": MATMUL,
         "allocator.json": ALLOCATOR, "collectives.json": COLLECTIVES}
#: files that are not JSON of this schema: the cluster profile (its own format, read by
#: ``dlab.theory.plan.cluster.load``), the trace, the allocator's snapshot, the README, logs
OTHER = ("profile.json", "trace.json.gz", "memory_snapshot.pickle.gz", "README.md")

_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool,
          "null": type(None), "object": dict, "array": list}


def _is(value, kind: str) -> bool:
    if isinstance(value, bool) and kind in ("integer", "number"):
        return False  # JSON's true is not a number
    return isinstance(value, _TYPES[kind])


def check(value, spec: dict, path: str) -> list[str]:
    """Where ``value`` departs from ``spec``: one message per place, naming its path."""
    if "enum" in spec:
        return [] if value in spec["enum"] else [f"{path}: {value!r} is not one of {spec['enum']}"]
    kinds = spec["type"] if isinstance(spec["type"], list) else [spec["type"]]
    if not any(_is(value, k) for k in kinds):
        return [f"{path}: expected {' or '.join(kinds)}, got {type(value).__name__} {value!r:.60}"]
    out = []
    if isinstance(value, dict):
        props = spec.get("properties", {})
        out += [f"{path}.{k}: missing" for k in spec.get("required", []) if k not in value]
        extra = spec.get("additionalProperties", True)
        for k, v in value.items():
            if k in props:
                out += check(v, props[k], f"{path}.{k}")
            elif extra is False:
                out.append(f"{path}.{k}: not a field of this file")
            elif isinstance(extra, dict):
                out += check(v, extra, f"{path}.{k}")
    elif isinstance(value, list) and "items" in spec:
        for i, item in enumerate(value):
            out += check(item, spec["items"], f"{path}[{i}]")
    return out


def problems(folder) -> list[str]:
    """Every way ``folder`` departs from a session's layout; empty when it is one."""
    folder = Path(folder)
    index_path = folder / "index.json"
    if not index_path.is_file():
        return [f"{folder}: no index.json (not a session folder written by python -m dlab gpu)"]
    out = []
    docs = {}
    for name, spec in FILES.items():
        path = folder / name
        if not path.exists():
            continue
        try:
            docs[name] = json.loads(path.read_text())
        except ValueError as e:
            out.append(f"{name}: not JSON ({e})")
            continue
        out += check(docs[name], spec, name.removesuffix(".json"))
    index = docs.get("index.json")
    if not isinstance(index, dict) or out:
        return out
    if index["version"] != VERSION:
        out.append(f"index.version: {index['version']}, this dlab reads version {VERSION}")
    listed = set()
    for i, row in enumerate(index["steps"]):
        for f in row["files"]:
            listed.add(f)
            if not (folder / f).is_file():
                out.append(f"index.steps[{i}].files: {f} ({row['name']}) is not in the folder")
        if row["status"] == "ok" and not row["files"]:
            out.append(f"index.steps[{i}]: {row['name']} is ok but wrote no file")
        if row["status"] != "ok" and not row["why"]:
            out.append(f"index.steps[{i}].why: {row['name']} is {row['status']} and says not why")
    for path in sorted(folder.iterdir()):
        if path.name in ("index.json", "README.md", "logs"):
            continue
        if path.name not in listed:
            out.append(f"{path.name}: in the folder but no step of index.json wrote it")
    if (folder / "profile.json").exists():
        out += _profile_problems(folder / "profile.json")
    return out


def _profile_problems(path: Path) -> list[str]:
    """The cluster profile is the planner's format: whatever ``--cluster`` cannot load is wrong."""
    try:
        cluster.load(path)
    except ValueError as e:
        return [f"profile.json: {e}"]
    return []


class InvalidSession(ValueError):
    pass


def validate(folder) -> Path:
    """``folder`` if it is a valid session folder; else ``InvalidSession`` listing every problem."""
    found = problems(folder)
    if found:
        raise InvalidSession(f"{folder} is not a valid GPU session folder:\n  - " + "\n  - ".join(found))
    return Path(folder)
