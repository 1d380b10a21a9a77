"""One training step of the lab GPT under ``torch.profiler``: the trace kept
(``trace.json.gz``), and its device work summed by the phases of dlab's own timeline of the
same step (``trace_summary``), beside that timeline.

Two steps run first, unprofiled (the first allocates, picks kernels and creates Adam's state);
the third is profiled whole, inside ``record_function("dlab:step")``. On a GPU the host spans
of dlab's timeline are when the host *issued* the work; the kernels run later, and the step
ends when ``loss.item()`` waits for them: reading the two side by side shows how far the host
runs ahead and where the device waited for it (the launch gaps).
"""
from __future__ import annotations

import gzip
import json
import shutil
import tempfile
from pathlib import Path

from torch.profiler import ProfilerActivity, profile, record_function

from dlab.tools.gpu import gpt_step, trace_summary

WARMUP = 2


def _ops(prof, cuda: bool, top: int = 12) -> list[dict]:
    """The operators with the most self time (device time on a GPU), from the profiler's table."""
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    rows = sorted(prof.key_averages(), key=lambda r: -getattr(r, key))[:top]
    return [{"name": r.key[:120], "count": r.count, "self_s": getattr(r, key) * 1e-6} for r in rows]


def run(ctx):
    cfg = gpt_step.config(ctx.cuda)
    timeline = gpt_step.MarkedTimeline()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
    with gpt_step.one_rank(ctx.cuda):
        strategy, data = gpt_step.build(cfg, timeline)
        for step in range(WARMUP):
            strategy.step(data.global_batch(step))
        gpt_step.sync(ctx.cuda)
        timeline.drain()
        with profile(activities=activities) as prof:
            start = timeline.now()
            with record_function("dlab:step"):
                strategy.step(data.global_batch(WARMUP))
            gpt_step.sync(ctx.cuda)
        events = timeline.drain()
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        trace = json.loads(raw.read_text())
        with open(raw, "rb") as f, gzip.open(Path(ctx.out) / "trace.json.gz", "wb") as g:
            shutil.copyfileobj(f, g)
    summary = trace_summary.summarize(trace["traceEvents"], "kernel" if ctx.cuda else "cpu_op")
    model = cfg.model_config()
    tokens = cfg.batch_size * model.seq_len
    doc = {"model": cfg.model_options, "batch": cfg.batch_size,
           "precision": cfg.options["precision"], "tokens": tokens,
           "flops": model.flops_per_token() * tokens, "trace": "trace.json.gz",
           "dlab_timeline": [{"kind": e["kind"], "start_s": e["start"] - start, "end_s": e["end"] - start}
                             for e in events],
           **summary, "ops": _ops(prof, ctx.cuda)}
    what = "kernels" if ctx.cuda else "top-level CPU operators"
    line = (f"step {summary['step_s'] * 1e3:.1f} ms: {what} busy {summary['busy_s'] / summary['step_s']:.0%} "
            f"(matmul/attention {summary['compute_s'] * 1e3:.1f} ms, the rest "
            f"{summary['memory_s'] * 1e3:.1f} ms), "
            f"{summary['gaps']} gaps, the largest {summary['largest_gap_s'] * 1e6:.0f} us")
    return doc, line, ["trace.json.gz"]
