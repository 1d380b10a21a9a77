"""``dlab check --quick`` as a session step: every family of strategies against ``single`` on this
machine's devices (on one GPU: NCCL at one rank, and the multi-rank strategies on Gloo with CUDA
tensors; ``dlab.tools.check`` says what runs where). In CPU mode one strategy (``ddp``) stands
for the rest: the suite checks them all on the CPU elsewhere, and the session's CPU mode is for
its own code path."""
from __future__ import annotations

from dlab.tools import check

CPU_STRATEGIES = ["ddp"]


def run(ctx):
    strategies = None if ctx.cuda else CPU_STRATEGIES
    where, rows, bus = check.run_check(True, f"{ctx.runs_dir}/check", strategies)
    counts = {k: sum(r["result"] == v for r in rows) for k, v in
              (("passed", "ok"), ("failed", "FAIL"), ("skipped", "skipped"))}
    doc = {"machine": where, "strategies_asked": strategies or list(check.QUICK), "rows": rows,
           "allreduce": bus, **counts}
    return doc, f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped", []
