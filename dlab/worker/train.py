"""The one training loop every strategy runs under.

Per step: inject a configured fault if this is its step, take the global batch, let the
strategy do one optimizer step, then write one metrics record and the step's timeline events.

The record's ``comm`` holds the step's communication: ``sent_bytes`` / ``recv_bytes`` the
model (ring model for the backend's collectives, the algorithm's own count for dlab's
hand-written ones), ``gloo_bytes`` the model of Gloo's real algorithms, and ``wire_bytes`` the
bytes this rank measurably wrote to the transport during the step (``dlab.comm.wire``; None
where not measurable: NCCL, not Linux). ``comm_by_op`` splits them per operation; the step's
measured bytes that no ``Comm`` operation took (a collective called on ``torch.distributed``
directly, such as the logged loss's mean) appear there as ``outside_comm``; overlapping ops of
different kinds share one ``overlapped:<ops>`` entry (``dlab.comm.wire``). A strategy of
several dimensions names its ``Comm``s (``Strategy.comms_by_dim``): ``comm_by_dim`` then splits
the same figures by dimension. Everything the rank writes itself (this record, timeline, logs)
is written after the step's window closes.

Utilization against the device's peak: ``mfu`` counts the FLOPs the model needs
(``flops_per_token``), ``hfu`` the FLOPs the hardware ran, the forwards that activation
recomputation repeats included (``hardware_flops_per_token``); without recomputation they are
equal (Chowdhery et al. 2022, app. B).

A strategy that scales its loss (fp16, ``Strategy.scaler``) adds ``skipped`` (the step found an
inf or NaN gradient on some rank and no rank applied it) and ``loss_scale`` (the scale the
step's loss was multiplied by). A run that took its steps and learned nothing ends failed, not
ok (``learned_nothing`` states the rule).
"""
from __future__ import annotations

import math
import time

import torch

from dlab.comm.instrumented import OpStats
from dlab.comm.wire import meter
from dlab.core.events import BUSY_KINDS, busy_seconds, comm_times, spans
from dlab.core.machine import device_peak_flops
from dlab.core.rundir import RankWriter
from dlab.models.data import make_data
from dlab.models.flops import utilization
from dlab.parallel.base import Context, Strategy
from dlab.runtime import faults
from dlab.runtime.checkpoint import Checkpointer
from dlab.runtime.preemption import Preemption


def _comm_totals(strategy: Strategy) -> tuple[OpStats, dict[str, OpStats]]:
    total, by_op = OpStats(), {}
    for comm in strategy.comms():
        for op, s in comm.stats.items():
            by_op.setdefault(op, OpStats()).add(s)
            total.add(s)
    return total, by_op


def _dim_totals(strategy: Strategy) -> dict[str, OpStats]:
    out = {}
    for dim, comms in strategy.comms_by_dim().items():
        out[dim] = OpStats()
        for comm in comms if isinstance(comms, list) else [comms]:
            for s in comm.stats.values():
                out[dim].add(s)
    return out


OUTSIDE_COMM = "outside_comm"


def _minus(a, b):
    return None if a is None else a - (b or 0)


def _delta(after: OpStats, before: OpStats | None) -> dict:
    before = before or OpStats()
    return {"calls": after.calls - before.calls,
            "payload_bytes": after.payload_bytes - before.payload_bytes,
            "sent_bytes": after.sent_bytes - before.sent_bytes,
            "recv_bytes": after.recv_bytes - before.recv_bytes,
            "seconds": after.seconds - before.seconds,
            "wire_bytes": _minus(after.wire_bytes, before.wire_bytes),
            "gloo_bytes": _minus(after.gloo_bytes, before.gloo_bytes)}


def _comm_record(strategy: Strategy, before: tuple, after: tuple, wire: int | None,
                 times: tuple[float, float]) -> tuple[dict, dict]:
    """The step's totals and per-op figures; ``wire`` is the step's measured total, ``times``
    its (exposed, busy) communication seconds (``dlab.core.events.comm_times``)."""
    (before_total, before_ops), (after_total, after_ops) = before, after
    total = _delta(after_total, before_total)
    total["exposed_seconds"], total["busy_seconds"] = times
    by_op = {op: _delta(s, before_ops.get(op)) for op, s in after_ops.items()}
    measurable = wire is not None and all(c.measurable for c in strategy.comms())
    total["wire_bytes"] = wire if measurable else None
    if measurable:
        outside = wire - sum(d["wire_bytes"] or 0 for d in by_op.values())
        by_op[OUTSIDE_COMM] = {**_delta(OpStats(), None), "wire_bytes": outside}
    return total, by_op


def _step_comm_times(strategy: Strategy, events: list[dict], t0: float,
                     window: tuple[float, float]) -> tuple[float, float]:
    """(exposed, busy) seconds of the step's communication: the spans every ``Comm`` of the
    strategy collected (``perf_counter`` times, moved onto the timeline's clock by ``t0``)
    against the step's own work."""
    collected = [(s - t0, e - t0, b) for c in strategy.comms() for s, e, b in c.spans or ()]
    work = spans(events, BUSY_KINDS)
    return comm_times([(s, e) for s, e, _ in collected], [(s, e) for s, e, b in collected if b],
                      work, window)


class TrainingDiverged(RuntimeError):
    """The run took every step and learned nothing (``learned_nothing``); every rank raises it,
    so the run ends failed."""


def learned_nothing(last_loss: float, taken: int, skipped: int) -> str | None:
    """Why a run that took ``taken`` steps, ``skipped`` of them skipped by the loss scaler, the
    last with the loss ``last_loss``, learned nothing; None where it trained. The rule: its last
    loss is not finite (NaN or inf: the weights, or the activations they give, are gone, and
    fp16's skipping cannot bring them back), or the scaler skipped every step it took (every
    step overflowed somewhere: not one update was applied). Some skipped steps in a run that
    ends on a finite loss are dynamic loss scaling working as designed (Micikevicius et al.
    2018, sec. 3.2: the scale is lowered until the gradients fit), and so is a loss that was
    not finite on the way but finite at the end. A run with no step to take (restarted after
    its last checkpoint) has nothing to judge."""
    if not taken:
        return None
    if not math.isfinite(last_loss):
        return (f"its last loss is {last_loss} ({skipped} of its {taken} steps skipped by the "
                f"loss scaler)")
    if skipped == taken:
        return f"the loss scaler skipped every one of its {taken} steps (every step overflowed)"
    return None


def train(ctx: Context, strategy: Strategy, writer: RankWriter, state: dict,
          checkpointer: Checkpointer | None = None, attempt: int = 0,
          preemption: Preemption | None = None) -> None:
    """Runs steps ``state['step']`` .. ``config.steps - 1``; ``state['step']`` always holds the
    step in progress (the worker reports it if the step fails). With a ``checkpointer``, saves
    after every ``checkpoint_every`` steps; ``checkpoint_s`` in the metrics is the time the step
    was blocked by it. With a ``preemption``, stops after the step the ranks agree on once a
    SIGTERM came, with a checkpoint of it (``dlab.runtime.preemption``); ``state["preempted"]`` is then
    the step to resume from.

    ``busy_s`` in the metrics is the step's time in the rank's own work (``BUSY_KINDS``) and
    ``idle_s`` the rest of ``step_time``: waiting for peers or for bytes. One slow rank shows as
    the one whose busy time is high and idle time low while every other rank idles.

    A run that ends having learned nothing (``learned_nothing``) raises ``TrainingDiverged``
    after its last step and checkpoint, on every rank alike (their losses are the same global
    mean and their scalers take one decision), so it ends failed with a message saying why."""
    cfg = ctx.config
    scaler = strategy.scaler
    first, skipped, loss = state.get("step", 0), 0, float("nan")
    data = make_data(cfg)
    tokens = data.tokens_per_batch()
    model = cfg.model_config()
    flops_per_token, hardware_flops_per_token = model.flops_per_token(), model.hardware_flops_per_token()
    peak, peak_source = device_peak_flops(ctx.device, cfg.threads_per_rank)
    state["peak_flops"], state["peak_source"] = peak, peak_source
    for step in range(state.get("step", 0), cfg.steps):
        state["step"] = ctx.timeline.step = step
        faults.maybe_inject(cfg.fault, ctx.rank, step, attempt)
        delay = faults.straggle_s(cfg.fault, ctx.rank, step)
        batch = data.global_batch(step)
        wire_start = meter.cut()  # an op still in flight from the last step is charged there
        before, before_dims = _comm_totals(strategy), _dim_totals(strategy)
        for c in strategy.comms():
            c.spans = []
        scaled = (scaler.scale, scaler.skipped) if scaler is not None else None
        start, wall, cpu = time.perf_counter(), ctx.timeline.now(), time.process_time()
        if delay:
            with ctx.timeline.span("straggle", delay_s=delay):
                time.sleep(delay)
        loss = strategy.step(batch)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        wire_end = meter.cut()  # ... and one still in flight now, here, for what it wrote so far
        ctx.timeline.add("step", wall, ctx.timeline.now())
        busy = busy_seconds(ctx.timeline.events)
        times = _step_comm_times(strategy, ctx.timeline.events, ctx.timeline.t0,
                                 (wall, ctx.timeline.now()))
        comm, comm_by_op = _comm_record(strategy, before, _comm_totals(strategy),
                                        None if wire_start is None else wire_end - wire_start, times)
        record = {
            "step": step, "rank": ctx.rank, "world_size": ctx.world_size, "attempt": attempt,
            "time": ctx.timeline.now(),
            "loss": loss, "step_time": seconds,
            "busy_s": busy, "idle_s": max(0.0, seconds - busy), "cpu_s": cpu,
            "tokens": tokens, "tokens_per_s": tokens / seconds,
            "mfu": utilization(flops_per_token, tokens, seconds, peak, ctx.world_size),
            "hfu": utilization(hardware_flops_per_token, tokens, seconds, peak, ctx.world_size),
            "memory": strategy.memory(),
            "comm": comm, "comm_by_op": comm_by_op,
            **strategy.step_extras(),
        }
        if scaled is not None:
            record["loss_scale"], record["skipped"] = scaled[0], scaler.skipped > scaled[1]
            skipped += record["skipped"]
        if before_dims:
            record["comm_by_dim"] = {dim: _delta(s, before_dims[dim])
                                     for dim, s in _dim_totals(strategy).items()}
        if checkpointer and (step + 1) % cfg.checkpoint_every == 0:
            with ctx.timeline.span("checkpoint"):
                record["checkpoint_s"] = checkpointer.save(strategy, step + 1)
        if ctx.device.type == "cuda":
            record["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(ctx.device)
        writer.metric(record)
        writer.events(ctx.timeline.drain())
        if preemption and step + 1 < cfg.steps and preemption.stop_after(step):
            begin = time.perf_counter()
            if "checkpoint_s" not in record:
                checkpointer.save(strategy, step + 1)
            checkpointer.wait()
            state["notice_checkpoint_s"] = time.perf_counter() - begin
            state["step"] = state["preempted"] = step + 1
            return
    if checkpointer:
        checkpointer.wait()
    why = learned_nothing(loss, cfg.steps - first, skipped)
    if why is not None:
        raise TrainingDiverged(
            f"the run learned nothing: {why}. Lower lr (it is {cfg.lr:g}); under fp16 a loss "
            f"that overflows needs a lower lr, or bf16 (fp32's range, no loss scaling); each "
            f"step's 'loss' and 'skipped' are in the metrics")
    state["step"] = cfg.steps
