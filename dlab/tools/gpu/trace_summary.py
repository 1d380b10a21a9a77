"""A profiler trace of one step, summed: where the time went, by dlab's phases and by kernel.

``torch.profiler`` writes a Chrome trace: complete events (``"ph": "X"``) with a start ``ts``
and a duration ``dur`` in microseconds. On a GPU the device's work is its ``kernel`` (and
``gpu_memcpy`` / ``gpu_memset``) events, each tied by ``args.correlation`` to the host-side
``cuda_runtime`` call that launched it; on the CPU it is the operators (``cpu_op``) that are
not inside another one on the same thread. An event belongs to the dlab phase (a
``dlab:<kind>`` annotation, ``gpt_step.MarkedTimeline``) in which it was *launched*: on a GPU
the kernels run later than the host issues them, which is the point of reading both.

What it reports:

- ``busy_s``: the seconds covered by at least one kernel (``dlab.core.events.covered``) in
  the step's window; ``idle_s`` the rest: the device waiting for the host (launch gaps, the
  Python between operators, a synchronisation); ``gaps`` and the largest of them;
- ``compute_s`` / ``memory_s``: the kernels' seconds split by kind *by name*: matmuls and
  attention (``gemm``, ``mm``, ``linear``, ``flash``, ``fmha``, ...) are the FLOP-heavy,
  tensor-core ones; the rest (element-wise, norms, softmax, reductions, copies, the optimizer)
  move bytes and are memory-bound on a GPU (Ivanov et al. 2021, "Data Movement Is All You
  Need", table 1: in BERT-large's training on a V100, 99.8 % of the FLOPs are tensor
  contractions, which take 61 % of the time);
- ``top``: kernels by total seconds, with their count and kind.
"""
from __future__ import annotations

import re
from collections import defaultdict

from dlab.core.events import covered, union

US = 1e-6
COMPUTE = re.compile(r"gemm|matmul|addmm|bmm|::mm\b|mmbackward|linear|attention|flash|fmha|xmma|"
                     r"cutlass|nvjet|cublas", re.I)
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


def bound(name: str) -> str:
    return "compute" if COMPUTE.search(name) else "memory"


def _top_level(ops: list[dict]) -> list[dict]:
    """The operators no other operator of their thread contains (their children are in them)."""
    out, open_until = [], {}
    for e in sorted(ops, key=lambda e: (e["ts"], -e["dur"])):
        if e["ts"] >= open_until.get(e.get("tid"), float("-inf")):
            out.append(e)
            open_until[e.get("tid")] = e["ts"] + e["dur"]
    return out


def marks(events: list[dict]) -> list[tuple[str, float, float]]:
    """(kind, start, end) of dlab's spans in the trace, in microseconds."""
    return [(e["name"][5:], e["ts"], e["ts"] + e["dur"]) for e in events
            if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e["name"].startswith("dlab:")]


def summarize(events: list[dict], kind: str) -> dict:
    """The step's summary (module docstring); ``kind``: "kernel" on a GPU, "cpu_op" on the CPU."""
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    spans = marks(complete)
    steps = [m for m in spans if m[0] == "step"]
    if not steps:
        raise ValueError("the trace has no dlab:step annotation: profile the step inside "
                         "record_function('dlab:step')")
    _, step_start, step_end = steps[-1]
    if kind == "kernel":
        launched = {e["args"]["correlation"]: e["ts"] for e in complete
                    if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})}
        work = [(launched.get(e.get("args", {}).get("correlation"), e["ts"]), e) for e in complete
                if e.get("cat") in DEVICE_CATS]
    else:
        work = [(e["ts"], e) for e in _top_level([e for e in complete if e.get("cat") == "cpu_op"])]
    work = [(t, e) for t, e in work if step_start <= t <= step_end]
    if not work:
        raise ValueError(f"no {kind} event was launched inside the dlab:step annotation")
    start = min(step_start, *(e["ts"] for _, e in work))
    end = max(step_end, *(e["ts"] + e["dur"] for _, e in work))
    busy = union((e["ts"], e["ts"] + e["dur"]) for _, e in work)
    gaps = [b[0] - a[1] for a, b in zip(busy, busy[1:])]
    by_name = defaultdict(lambda: [0, 0.0])
    for _, e in work:
        by_name[e["name"]][0] += 1
        by_name[e["name"]][1] += e["dur"]
    seconds = {b: sum(e["dur"] for _, e in work if bound(e["name"]) == b) * US for b in ("compute", "memory")}
    phases = []
    for name, s, t in spans:
        if name == "step":
            continue
        mine = [e for launch, e in work if s <= launch <= t]
        phases.append({"name": name, "host_s": (t - s) * US, "events": len(mine),
                       "busy_s": covered((e["ts"], e["ts"] + e["dur"]) for e in mine) * US,
                       "compute_s": sum(e["dur"] for e in mine if bound(e["name"]) == "compute") * US,
                       "memory_s": sum(e["dur"] for e in mine if bound(e["name"]) == "memory") * US})
    busy_s = sum(b - a for a, b in busy) * US
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:15]
    return {"kind": kind, "step_s": (end - start) * US, "busy_s": busy_s,
            "idle_s": (end - start) * US - busy_s, "gaps": len(gaps),
            "largest_gap_s": max(gaps, default=0.0) * US, "compute_s": seconds["compute"],
            "memory_s": seconds["memory"], "phases": phases,
            "top": [{"name": n[:120], "bound": bound(n), "count": c, "seconds": d * US}
                    for n, (c, d) in top]}
