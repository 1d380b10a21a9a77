"""What a cluster profile (``python -m dlab plan calibrate``, ``cluster.dump``) must hold, field
by field, before the planner reads it, and what a profile leaves the planner to assume.

A profile is a file a user can edit or hand over, and each of its figures divides something: a
bandwidth of zero is a division by zero, a negative one a negative communication time, a NaN
peak a NaN MFU. So ``check`` holds every field to its type (a count is a whole number and a
bool is not one), to being finite, and to its sign (rates, bandwidths, memory and the peak
above zero; a latency, a launch cost or reserved memory zero or more), and names the file,
the field and what to change. ``fallbacks`` says what the planner prices from something other
than a measurement because the profile holds no table for it (``Cluster.notes``, which every
prediction's ``assumptions`` repeats).
"""
from __future__ import annotations

import math

from dlab.theory.plan.collectives import OPS

LEVELS = ("intra", "inter")
#: no count a profile holds (a shape, keys, GPUs a node) is this large; past it the planner's
#: float arithmetic overflows
LARGEST = 10 ** 9
#: the constants a spread may vary (``dlab.theory.plan.ranges.perturbed``), and "step"
SPREAD_NAMES = ("matmul", "attention", "launch", "intra", "inter", "latency", "hbm", "peak", "step")


class _Fields:
    """Collects what is wrong with a profile's fields, each with its dotted name."""

    def __init__(self):
        self.bad: list[str] = []

    def get(self, doc, name: str, key):
        if not isinstance(doc, dict) or key not in doc:
            self.bad.append(f"{name} is missing")
            return None
        return doc[key]

    def number(self, name: str, value, positive: bool = True) -> bool:
        """Whether ``value`` is a finite number above 0 (``positive``) or at least 0."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.bad.append(f"{name}={value!r} is not a number")
        elif abs(value) > 1e300 or not math.isfinite(value):  # 1e300: an int past a float's range
            self.bad.append(f"{name}={value!r} must be finite")
        elif positive and value <= 0:
            self.bad.append(f"{name}={value!r} must be above 0")
        elif value < 0:
            self.bad.append(f"{name}={value!r} must be 0 or more")
        else:
            return True
        return False

    def count(self, name: str, value, least: int = 1) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            self.bad.append(f"{name}={value!r} is not a whole number")
        elif not least <= value <= LARGEST:
            self.bad.append(f"{name}={value} must be from {least} to {LARGEST:.0e}")

    def rows(self, name: str, value, width: int) -> list:
        if not isinstance(value, list) or any(not isinstance(r, list) or len(r) != width for r in value):
            self.bad.append(f"{name} must be a list of rows of {width} entries")
            return []
        return value

    def text(self, name: str, value) -> None:
        if not isinstance(value, str):
            self.bad.append(f"{name}={value!r} must be a string")


def check(doc: dict) -> list[str]:
    """What is wrong with a profile's fields (module docstring); empty when nothing is."""
    f = _Fields()
    for key in ("peak_flops", "memory_bandwidth"):
        f.number(key, f.get(doc, key, key))
    memory = f.number("memory_bytes", f.get(doc, "memory_bytes", "memory_bytes"))
    reserved = f.number("reserved_bytes", f.get(doc, "reserved_bytes", "reserved_bytes"), positive=False)
    f.count("gpus_per_node", f.get(doc, "gpus_per_node", "gpus_per_node"))
    for key in ("name", "source"):
        f.text(key, f.get(doc, key, key))
    f.text("generation", doc.get("generation", ""))
    if memory and reserved and doc["reserved_bytes"] >= doc["memory_bytes"]:
        f.bad.append(f"reserved_bytes={doc['reserved_bytes']!r} must be less than "
                     f"memory_bytes={doc['memory_bytes']!r}")
    k = f.get(doc, "kernels", "kernels")
    if k is not None:
        _kernels(f, k)
    links = f.get(doc, "links", "links")
    for level in LEVELS if links is not None else ():
        link = f.get(links, f"links.{level}", level)
        if link is not None:
            f.number(f"links.{level}.latency", f.get(link, f"links.{level}.latency", "latency"),
                     positive=False)
            f.number(f"links.{level}.busbw", f.get(link, f"links.{level}.busbw", "busbw"))
    for i, (op, level, latency, busbw) in enumerate(f.rows("ops", f.get(doc, "ops", "ops"), 4)):
        if op not in OPS or level not in LEVELS:
            f.bad.append(f"ops[{i}]: {op!r} at {level!r}: an op is one of {', '.join(OPS)} at "
                         f"one of {', '.join(LEVELS)}")
        f.number(f"ops[{i}] ({op}) latency", latency, positive=False)
        f.number(f"ops[{i}] ({op}) busbw", busbw)
    for i, (name, low, high) in enumerate(f.rows("spread", f.get(doc, "spread", "spread"), 3)):
        if name not in SPREAD_NAMES:
            f.bad.append(f"spread[{i}]: {name!r} is no constant; name one of {', '.join(SPREAD_NAMES)}")
        both = f.number(f"spread[{i}] ({name}) low", low) & f.number(f"spread[{i}] ({name}) high", high)
        if both and low > high:
            f.bad.append(f"spread[{i}] ({name}): low {low} is above high {high}")
    flags = doc.get("flags", [])
    if not isinstance(flags, list) or not all(isinstance(x, str) for x in flags):
        f.bad.append("flags must be a list of strings")
    return f.bad


def _kernels(f: _Fields, k) -> None:
    for key in ("matmul", "hbm"):
        f.number(f"kernels.{key}", f.get(k, f"kernels.{key}", key))
    for key in ("launch", "fill"):
        f.number(f"kernels.{key}", f.get(k, f"kernels.{key}", key), positive=False)
    f.count("kernels.sms", f.get(k, "kernels.sms", "sms"), least=0)
    f.count("kernels.attention_half", f.get(k, "kernels.attention_half", "attention_half"))
    for key in ("tile", "best"):
        shape = f.get(k, f"kernels.{key}", key)
        if not isinstance(shape, list) or len(shape) != 3:
            f.bad.append(f"kernels.{key}={shape!r} must be three whole numbers (m, n, k)")
        else:
            for i, x in enumerate(shape):
                f.count(f"kernels.{key}[{i}]", x)
    for i, (name, fwd, bwd) in enumerate(f.rows("kernels.attention",
                                                f.get(k, "kernels.attention", "attention"), 3)):
        f.text(f"kernels.attention[{i}] name", name)
        f.number(f"kernels.attention[{i}] ({name}) forward", fwd)
        f.number(f"kernels.attention[{i}] ({name}) backward", bwd)
    table = f.rows("kernels.matmul_table", f.get(k, "kernels.matmul_table", "matmul_table"), 4)
    for i, (m, n, kk, rate) in enumerate(table):
        for j, x in enumerate((m, n, kk)):
            f.count(f"kernels.matmul_table[{i}][{j}]", x)
        f.number(f"kernels.matmul_table[{i}][3] (FLOP/s)", rate)
    table = f.rows("kernels.attention_table", f.get(k, "kernels.attention_table", "attention_table"), 3)
    for i, (keys, fwd, bwd) in enumerate(table):
        f.count(f"kernels.attention_table[{i}][0] (keys)", keys)
        f.number(f"kernels.attention_table[{i}][1] (forward FLOP/s)", fwd)
        f.number(f"kernels.attention_table[{i}][2] (backward FLOP/s)", bwd)


def fallbacks(doc: dict) -> list[str]:
    """What a (checked) profile leaves the planner to price without a measurement of its own,
    and what the calibration that wrote it flagged."""
    k = doc["kernels"]
    out = list(doc.get("flags", []))
    if not k["matmul_table"]:
        out.append(f"the profile has no matmul table: a matmul runs at its kernels.matmul share "
                   f"({k['matmul']:.3g}) of peak, scaled by the tile and wave curve")
    if not k["attention_table"]:
        out.append("the profile has no attention table: fused attention runs at its "
                   "kernels.attention shares of peak")
    measured = {(op, level) for op, level, *_ in doc["ops"]}
    for level in LEVELS:
        missing = [op for op in OPS if (op, level) not in measured]
        where = "inside" if level == "intra" else "across"
        if missing:
            out.append(f"the profile measured no {', '.join(missing)} {where} nodes: "
                       f"{'that is' if len(missing) == 1 else 'those are'} priced on its "
                       f"links.{level} figures")
    return out
