"""``python -m dlab bench plan``: the planner's prediction beside a measured run, per layout.

First the "this machine" preset is measured for the bench's model (``dlab.tools.calibrate``: one
thread's rate and fixed costs on that model, every rank measuring at once where they outnumber
the cores; the fitted link; what each kind of blocking collective costs a rank at 4 and 8 ranks
and the share of the cores' time the ranks fill), rows "(calibration)" and "(probe)" (one
call's milliseconds at a 256 KiB payload, a layer's activation of the bench's model: CPU
milliseconds where the ranks outnumber the cores, wall milliseconds where not). Then every
layout of ``python -m dlab bench nd`` (the 4- and 8-rank grid; ``--quick``: three 4-rank
layouts) runs under ``nd`` and its figures are set beside
``dlab.plan.plan`` of the same layout: model state and bytes sent of the fullest rank (exact,
so the error is 0), the activation peak, the CPU seconds a rank spends in a step (the mean rank:
``cpu_ms`` measured, ``cpu_plan_ms`` the plan's), and the step time.

The step time is the slowest rank's median over the steps after the first ``WARMUP`` (the first
steps pay for the allocator, Gloo's lazily made connections and the optimizer's state: up to
half again as long), with ``spread`` the interquartile range of those steps over their median.
Each row has ``metric`` step_s with ``dlab`` = the prediction, ``peer`` = the measurement and
``ratio`` their quotient.
"""
from __future__ import annotations

import statistics
import tempfile

from dlab.analysis.steps import steady, step_time
from dlab.bench.nd import BATCH, MODEL, QUICK, label, layouts, measure, runnable
from dlab.models.gpt import GPTConfig
from dlab.procs.launch import launch
from dlab.theory.plan import plan
from dlab.theory.plan.layout import PlanLayout
from dlab.theory.plan.spec import from_gpt
from dlab.tools import calibrate

PAYLOAD = 256 << 10
STEPS, WARMUP = 12, 4


def plan_layout(options: dict, recompute: str = "none") -> PlanLayout:
    """The planner's layout for ``nd`` options as the bench runs them (1F1B, 4 micro-batches
    when pipelined, fp32)."""
    pp, dp = options.get("pp", 1), options.get("dp", 1)
    m = 4 if pp > 1 else 1
    return PlanLayout(dp=dp, tp=options.get("tp", 1), pp=pp, cp=options.get("cp", 1),
                      zero=options.get("zero", 0),
                      sequence_parallel=bool(options.get("sequence_parallel")),
                      micro_batch=BATCH // (dp * m), recompute=recompute, precision="fp32")


def predict(options: dict, machine, recompute: str = "none") -> dict:
    cfg = GPTConfig(**MODEL)
    lay = plan_layout(options, recompute)
    p = plan(from_gpt(cfg), machine, lay, BATCH, cfg.seq_len)
    mem = p.memory
    busy = p.step_s - p.time.get("idle_cores", 0.0) - p.time["bubble"]  # CPU seconds over the cores
    return {"step_model_s": p.step_s, "cpu_plan_ms": 1e3 * busy * machine.cores / lay.world
            if machine.oversubscribed(lay.world) else None,
            "state_plan_MB": (mem["parameters"] + mem["gradients"] + mem["optimizer"]) / 1e6,
            "act_plan_MB": mem["activations"] / 1e6, "sent_plan_MB": p.sent["total"] / 1e6}


def run(quick: bool = False) -> list[dict]:

    cfg = GPTConfig(**MODEL)
    worlds = (4,) if quick else (4, 8)
    rows = []
    with tempfile.TemporaryDirectory() as runs_dir:
        machines = {w: calibrate.this_machine(cfg, w, runs_dir=runs_dir) for w in worlds}
        for w, c in machines.items():
            rows.append({"layout": "(calibration)", "ranks": w, "rate_GFLOPs": c.peak / 1e9,
                         "layer_overhead_ms": c.layer_overhead * 1e3,
                         "tile_ms": c.ring_tile[0] * 1e3, "tile_ns_per_element": c.ring_tile[1] * 1e9,
                         "utilization": c.utilization,
                         "alpha_us": c.intra.alpha * 1e6, "link_GBs": c.intra.bandwidth / 1e9})
            rows += [{"layout": f"(probe) {op} over {g}", "ranks": w,
                      "call_ms": (fixed + per_byte * PAYLOAD) * 1e3}
                     for op, g, fixed, per_byte in c.calls]
        grid = [(4, o) for o in QUICK] if quick else [(w, o) for w in worlds for o in layouts(w)]
        for world, options in grid:
            if not runnable(world, options):
                continue
            run_ = launch("nd", world, runs_dir=runs_dir, wait=True, model_options=MODEL,
                               options=options, batch_size=BATCH, steps=STEPS)
            measured, got = step_time(run_, WARMUP), measure(run_)
            pred = predict(options, machines[world])
            rows.append({"layout": label(options), "ranks": world, "metric": "step_s",
                         "dlab": pred["step_model_s"], "peer": measured,
                         "ratio": pred["step_model_s"] / measured, "spread": spread(run_),
                         "cpu_ms": 1e3 * cpu_seconds(run_), "cpu_plan_ms": pred["cpu_plan_ms"],
                         "state_MB": got["state_MB"], "state_plan_MB": pred["state_plan_MB"],
                         "sent_MB": got["sent_MB"], "sent_plan_MB": pred["sent_plan_MB"],
                         "act_MB": got["act_MB"], "act_plan_MB": pred["act_plan_MB"]})
    return rows


def _steady(run, key: str, rank: int) -> list[float]:
    return [m[key] for m in steady(run.metrics(rank), WARMUP)]


def spread(run) -> float:
    """The slowest rank's steady steps: interquartile range over median."""
    steps = max((_steady(run, "step_time", r) for r in range(run.world_size)), key=statistics.median)
    q1, _, q3 = statistics.quantiles(steps, n=4)
    return (q3 - q1) / statistics.median(steps)


def cpu_seconds(run) -> float:
    """The CPU seconds (every thread of the process) a rank spends in a steady step: the mean
    over the ranks of each one's median."""
    return statistics.fmean(statistics.median(_steady(run, "cpu_s", r)) for r in range(run.world_size))


def error(row: dict) -> float:
    """The step-time prediction's relative error of a row."""
    return row["dlab"] / row["peer"] - 1

