"""The one training loop every strategy runs under.

Per step: inject a configured fault if this is its step, take the global batch, let the
strategy do one optimizer step, then write one metrics record and the step's timeline events.
"""
from __future__ import annotations

import time

import torch

from dlab import faults
from dlab.checkpoint import Checkpointer
from dlab.comm.instrumented import OpStats
from dlab.data import make_data
from dlab.metrics import device_peak_flops
from dlab.parallel.base import Context, Strategy
from dlab.runs import RankWriter


def _comm_totals(strategy: Strategy) -> tuple[OpStats, dict[str, OpStats]]:
    total, by_op = OpStats(), {}
    for comm in strategy.comms():
        for op, s in comm.stats.items():
            by_op.setdefault(op, OpStats()).add(s)
            total.add(s)
    return total, by_op


def _delta(after: OpStats, before: OpStats | None) -> dict:
    before = before or OpStats()
    return {"calls": after.calls - before.calls,
            "sent_bytes": after.sent_bytes - before.sent_bytes,
            "recv_bytes": after.recv_bytes - before.recv_bytes,
            "seconds": after.seconds - before.seconds}


def train(ctx: Context, strategy: Strategy, writer: RankWriter, state: dict,
          checkpointer: Checkpointer | None = None, attempt: int = 0) -> None:
    """Runs steps ``state['step']`` .. ``config.steps - 1``; ``state['step']`` always holds the
    step in progress (the worker reports it if the step fails). With a ``checkpointer``, saves
    after every ``checkpoint_every`` steps; ``checkpoint_s`` in the metrics is the time the step
    was blocked by it."""
    cfg = ctx.config
    data = make_data(cfg)
    tokens = data.tokens_per_batch()
    flops_per_token = cfg.model_config().flops_per_token()
    peak, peak_source = device_peak_flops(ctx.device, cfg.threads_per_rank)
    for step in range(state.get("step", 0), cfg.steps):
        state["step"] = ctx.timeline.step = step
        faults.maybe_inject(cfg.fault, ctx.rank, step, attempt)
        batch = data.global_batch(step)
        before_total, before_ops = _comm_totals(strategy)
        start, wall = time.perf_counter(), ctx.timeline.now()
        loss = strategy.step(batch)
        seconds = time.perf_counter() - start
        ctx.timeline.add("step", wall, ctx.timeline.now())
        after_total, after_ops = _comm_totals(strategy)
        record = {
            "step": step, "rank": ctx.rank, "attempt": attempt, "time": ctx.timeline.now(),
            "loss": loss, "step_time": seconds,
            "tokens": tokens, "tokens_per_s": tokens / seconds,
            "mfu": flops_per_token * tokens / seconds / (peak * ctx.world_size),
            "memory": strategy.memory(),
            "comm": _delta(after_total, before_total),
            "comm_by_op": {op: _delta(s, before_ops.get(op)) for op, s in after_ops.items()},
        }
        if checkpointer and (step + 1) % cfg.checkpoint_every == 0:
            with ctx.timeline.span("checkpoint"):
                record["checkpoint_s"] = checkpointer.save(strategy, step + 1)
        if ctx.device.type == "cuda":
            record["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(ctx.device)
        writer.metric(record)
        writer.events(ctx.timeline.drain())
    if checkpointer:
        checkpointer.wait()
    state["step"] = cfg.steps
    state["peak_flops"], state["peak_source"] = peak, peak_source
