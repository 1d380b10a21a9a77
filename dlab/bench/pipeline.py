"""``python -m dlab bench pipeline``: every schedule at 2 and 4 stages and 1..16 micro-batches
(those it accepts: interleaved needs m a multiple of p, DualPipeV m >= 2p).

Per configuration: the bubble measured from the timeline (steps after the first) beside the
closed form (``dlab.theory.pipeline.bubble``, unit times), the simulation of the same action
lists at each stage's mean op times measured in that run (``simulated``: adds the imbalance
between stages), and at each op's own measured
time (``sim_ops``: what the op-time jitter alone costs; the rest of the measured excess is
communication and dispatch, see ``simulate.py``); the bubble measured again with every
receive posted only when the schedule reaches it (``bubble_k0``, option ``recv_ahead=0``,
against the strategy's default of 2v posted ahead); every rank's activation peak, and
the busiest rank's beside its in-flight count times one micro-batch's activations (measured by
the naive pipeline, m = 1, on the same stages; for the zero-bubble schedules the excess is what
pending weight gradients keep: the weight matmuls' inputs and output gradients); the median
step time. Where PyTorch has the same schedule (``torch.distributed.pipelining``: GPipe, 1F1B,
Interleaved1F1B, ZBVZeroBubble, DualPipeV) the row also carries ``dlab`` / ``peer`` / ``ratio`` of step
times on the same model and split. ZB-H1 is not compared: PyTorch's zero-bubble schedules
are the interleaved and the V ones.

The model: 8 blocks of d_model 256 over 128 tokens, one sequence per micro-batch (so the
global batch is m sequences per replica). A stage's forward is then ~10 ms per micro-batch on
one core, while a 128 KiB activation crosses loopback Gloo in ~0.2 ms: compute dwarfs p2p and
stage times are balanced (blocks dealt by parameter count; the embedding and head are small
at vocabulary 256), the condition under which the bubble formulas hold. On a machine with
fewer cores than ranks the ranks share cores, which stretches busy ranks and blurs the
bubble: measure with at least as many cores as ranks.
"""
from __future__ import annotations

import statistics
import tempfile

from dlab.analysis.steps import step_time
from dlab.bench import compared
from dlab.layout import schedules
from dlab.parallel.pipeline.torch_pipelining import PEERS, stages_per_rank, torch_run
from dlab.procs.launch import launch
from dlab.procs.spawn import spawn
from dlab.theory import pipeline as est
from dlab.theory.simulate import bubble, bubble_of_ops, replay
from dlab.ui.figure import new_figure
from dlab.ui.gantt import gantt

MODEL = {"n_layer": 8, "d_model": 256, "n_head": 4, "seq_len": 128}
STEPS = 4
SCHEDULES = ["naive", "gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev"]


def configs(quick: bool) -> list[tuple[str, int, int]]:
    if quick:
        return [("naive", 2, 1), ("1f1b", 2, 4), ("gpipe", 2, 4), ("zbv", 2, 4),
                ("dualpipev", 2, 8)]
    out = []
    for p in (2, 4):
        for name in SCHEDULES:
            for m in (1, 2, 4, 8, 16):
                if name == "naive" and m != 1:
                    continue
                if name == "interleaved" and m % p:
                    continue
                if name == "dualpipev" and m < 2 * p:
                    continue
                out.append((name, p, m))
    return out


def _has_peer(name: str, p: int, m: int) -> bool:
    return name in PEERS and not (name == "1f1b" and m < p)


def measure(name: str, p: int, m: int, runs_dir: str, recv_ahead: int | None = None) -> dict:
    """One dlab run: bubble, the timeline (steps after the first), activation peaks per rank,
    median step time. ``recv_ahead`` None: the strategy's default."""

    options = {"microbatches": m} if name != "naive" else {}
    if recv_ahead is not None:
        options["recv_ahead"] = recv_ahead
    run = launch(f"pipeline-{name}", p, runs_dir=runs_dir, wait=True, steps=STEPS,
                      batch_size=m, model="gpt", model_options=MODEL, options=options)
    events = [e for e in run.timeline() if "stage" in e and e["step"] > 0]
    metrics = [run.metrics(r) for r in range(p)]
    return {
        "bubble": bubble(events, ranks=p),
        "events": events,
        "activations": [max(x["memory"]["activations"] for x in ms) for ms in metrics],
        "step_s": step_time(run),
    }


def run(quick: bool = False) -> list[dict]:

    rows, unit = [], {}
    with tempfile.TemporaryDirectory() as runs_dir:
        for name, p, m in configs(quick):
            v = stages_per_rank(name)
            got = measure(name, p, m, runs_dir)
            if name == "naive":
                unit[p] = got["activations"]
            sched = schedules.build(name, p, m, v)
            formula = est.bubble(name, p, m, v)
            peak_rank = max(range(p), key=lambda r: got["activations"][r])
            row = {"schedule": name, "p": p, "m": m, "v": v,
                   "bubble": round(got["bubble"], 3),
                   "formula": round(formula, 3) if formula is not None else "",
                   "simulated": round(bubble(replay(sched, got["events"])), 3),
                   "sim_ops": round(bubble_of_ops(sched, got["events"]), 3),
                   "bubble_k0": round(measure(name, p, m, runs_dir, recv_ahead=0)["bubble"], 3),
                   "act_MiB": round(got["activations"][peak_rank] / 2 ** 20, 2),
                   "act_by_rank_MiB": "/".join(f"{a / 2 ** 20:.1f}" for a in got["activations"])}
            if p in unit:
                predicted = est.in_flight(name, p, m, peak_rank, v) * unit[p][peak_rank]
                row["act_formula_MiB"] = round(predicted / 2 ** 20, 2)
            row["step_s"] = round(got["step_s"], 4)
            if _has_peer(name, p, m) and (not quick or name in ("1f1b", "dualpipev")):
                peer = statistics.median(spawn(torch_run, p, name, p, m, MODEL, STEPS,
                                               runs_dir=runs_dir)[0]["step_s"][1:])
                row = compared(got["step_s"], peer, **row, metric="step_s")
            rows.append(row)
        rows += sweep_recv_ahead(runs_dir, quick)
    return rows


def sweep_recv_ahead(runs_dir: str, quick: bool) -> list[dict]:
    """The bubble at 0, 1, 2 and 4 receives posted ahead, on 2 ranks at m = 16: one posted
    receive in all is not one per stream (``strategy.py``), which the interleaved schedule,
    with 2v = 4 streams per rank, shows and 1F1B (2 streams) hardly does."""
    cases = [("1f1b", 2, 4)] if quick else [("1f1b", 2, 16), ("interleaved", 2, 16)]
    return [{"name": "recv_ahead sweep", "schedule": name, "p": p, "m": m, "recv_ahead": k,
             "bubble": round(measure(name, p, m, runs_dir, recv_ahead=k)["bubble"], 3)}
            for name, p, m in cases for k in (0, 1, 2, 4)]


def save_gantt(path: str = "docs/pipeline_gantt.png", name: str = "1f1b", p: int = 2,
               m: int = 8) -> float:
    """A measured Gantt chart of one step on the bench model, with the simulation of the same
    action list at the measured op times drawn pale under each rank's row (red: time blocked
    in a transfer); returns the measured bubble.
    ``python -c "from dlab.bench.pipeline import save_gantt; save_gantt()"``"""
    with tempfile.TemporaryDirectory() as runs_dir:
        run = launch(f"pipeline-{name}", p, runs_dir=runs_dir, wait=True, steps=3,
                     batch_size=m, model="gpt", model_options=MODEL,
                     options={"microbatches": m})
        events = [e for e in run.timeline() if "stage" in e and e["step"] == 2]
    sim = replay(schedules.build(name, p, m, stages_per_rank(name)), events)
    measured = bubble(events)
    fig = new_figure(figsize=(11, 0.9 + 0.9 * p))
    gantt(events, fig.add_subplot(), comm=True, y_offset=-0.12, height=0.6,
          title=f"{name}, p={p}, m={m}, measured on CPU/Gloo: bubble {measured:.3f} "
                f"(simulated at each stage's mean op times: {bubble(sim):.3f}, pale bars)")
    gantt(sim, fig.axes[0], y_offset=0.3, height=0.22, alpha=0.4, labels=False)
    fig.savefig(path, dpi=120)
    return measured
