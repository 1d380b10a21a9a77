"""``python -m dlab bench scale``: what breaks at scale, caused on purpose and measured.

Rows, all at the same model and global batch on Gloo:

- ``straggler``: one rank delayed ``DELAY`` s per step, under synchronous DP (dlab's ``ddp``
  beside PyTorch's DDP with the same straggler: ``ratio``), the synchronous parameter server,
  backup workers (``ps-backup``, b = 1) and the asynchronous one. ``step_s`` is rank 0's median
  step with the straggler, ``clean_s`` without it; the model beside them is the rule of each
  design: synchronous steps take ``clean_s + DELAY`` (everyone waits), and so do dlab's
  asynchronous server's, which averages whole rounds (its workers run ahead on stale weights,
  but a round still ends with the straggler's push); backup workers take ``clean_s`` (nobody
  waits for the late rank; its gradient is dropped), and so does the Downpour server
  (``ps-downpour``), which applies each gradient as it lands (its straggler's gradients arrive
  stale; the fast ranks wait for it only at the run's end, which the median leaves out).
  The rule assumes a core per rank: with 4 ranks on 2 cores, the ranks that do not sleep get
  the sleeper's core meanwhile, so the synchronous steps come in under ``clean_s + DELAY``; the
  2-rank rows are the rule's fair test.
- ``preemption``: a SIGTERM during a run: ``notice_to_exit_s`` from the signal to the ranks'
  exit with their checkpoint written, ``restart_s`` from the resumed launch to its first step,
  and the steps lost (none: the checkpoint is of the agreed step, not the last periodic one).
- ``elastic``: the same run preempted at 4 ranks and resumed at 2 from its checkpoint
  (resharded on load), then at 4 again: time lost per membership change, planned.
- ``elastic-agents``: two torchrun agents of 2 ranks (``dlab.procs.elastic.rehearse``), one
  SIGKILLed mid-run and started again: ``lost_s`` from the kill to the first step at 2 ranks
  (failure noticed, rendezvous without it, restart, resume), ``back_s`` from its return to
  the first step at 4, and the steps trained twice.
- compression and local SGD rows: ``dlab.bench._compression`` and ``dlab.bench._local_sgd``.
"""
from __future__ import annotations

import statistics
import tempfile
import time

from dlab.bench import _compression, _local_sgd, compared
from dlab.procs.elastic import rehearse
from dlab.procs.launch import launch

MODEL = {"n_layer": 4, "d_model": 128, "n_head": 4, "seq_len": 64}
BATCH = 16
DELAY = 0.1


def _launch(strategy, n, runs_dir, steps, **kw):
    return launch(strategy, n, runs_dir=runs_dir, wait=True, steps=steps, batch_size=BATCH,
                       model="gpt", model_options=MODEL, optimizer="sgd", **kw)


def _rank0_step_s(run) -> float:
    """Rank 0's median step, the first and last left out: what the healthy side sees. Not the
    run's ``step_time`` (the slowest rank's): under a parameter server the straggler is the
    slowest rank by construction, and the question is whether the others wait for it; the
    last step is left out because the servers drain their stragglers' gradients there."""
    return statistics.median(m["step_time"] for m in run.metrics(0)[1:-1])


DESIGNS = [("ddp", {}, "sync: clean + delay"), ("ps-sync", {}, "sync: clean + delay"),
           ("ps-backup", {"backup": 1}, "first N-1: clean"), ("ps-async", {}, "sync rounds: clean + delay"),
           ("ps-downpour", {}, "no wait: clean")]


def straggler_rows(n: int, steps: int, runs_dir: str, designs=DESIGNS) -> list[dict]:
    slow = {"rank": n - 1, "step": 0, "kind": "slow", "delay_s": DELAY}
    rows = []
    for strategy, options, rule in designs:
        clean = _rank0_step_s(_launch(strategy, n, runs_dir, steps, options=options))
        hit = _launch(strategy, n, runs_dir, steps, options=options, fault=slow)
        model = clean + DELAY if rule.startswith("sync") else clean
        row = {"name": "straggler", "strategy": strategy, "ranks": n, "delay_s": DELAY,
               "clean_s": clean, "model_s": model, "rule": rule}
        if strategy == "ddp":
            peer = _launch("torch-ddp", n, runs_dir, steps, options={"comm_hook": "builtin"},
                           fault=slow)
            row = compared(_rank0_step_s(hit), _rank0_step_s(peer), metric="step_s", **row)
        else:
            row["step_s"] = _rank0_step_s(hit)
        if strategy == "ps-backup":
            used = [len(m["backup"]["used"]) for m in hit.metrics(0)]
            row["gradients_used"] = statistics.mean(used)
        if strategy == "ps-async":
            stale = [e["staleness"] for e in hit.timeline() if e["kind"] == "forward"]
            row["max_staleness"] = max(stale)
        if strategy == "ps-downpour":  # the server's log: rank, step, version, staleness
            row["max_staleness"] = max(a[3] for m in hit.metrics(0) for a in m["downpour"]["applied"])
        rows.append(row)
    return rows


def _first_step_after(run, t_launch: float) -> float:
    """Seconds from the launch call to the end of the run's first step (rank 0)."""
    first = run.metrics(0)[0]
    t0_wall = run.status()["ranks"]["0"]["t0_wall"]
    return t0_wall + first["time"] - t_launch


def preemption_rows(n: int, steps: int, runs_dir: str) -> list[dict]:
    every = steps  # periodic checkpoints too rare to help: the notice's own checkpoint does
    cut = _launch("ddp", n, runs_dir, steps, checkpoint_every=every,
                  fault={"rank": 0, "step": steps // 4, "kind": "preempt"})
    reports = cut.status()["ranks"].values()
    stop = min(r["resume_from"] for r in reports)
    t = time.time()
    resumed = _launch("ddp", n, runs_dir, steps, resume=str(cut.path))
    rows = [{"name": "preemption", "strategy": "ddp", "ranks": n, "resume_from": stop,
             "notice_to_exit_s": max(r["notice_s"] for r in reports),
             "restart_s": _first_step_after(resumed, t), "steps_lost": 0,
             "steps_lost_without_notice": stop}]
    # elastic: the same checkpoint taken up at half the ranks, then that run's at n again
    t = time.time()
    half = _launch("ddp", n // 2, runs_dir, steps, resume=str(cut.path), checkpoint_every=every,
                   fault={"rank": 0, "step": stop, "kind": "preempt"})
    shrink = _first_step_after(half, t)
    t = time.time()
    back = _launch("ddp", n, runs_dir, steps, resume=str(half.path))
    rows.append({"name": "elastic", "strategy": "ddp", "ranks": f"{n}->{n // 2}->{n}",
                 "shrink_s": shrink, "grow_s": _first_step_after(back, t),
                 "final_loss": back.metrics(0)[-1]["loss"],
                 "uninterrupted_loss": resumed.metrics(0)[-1]["loss"]})
    return rows


def elastic_agent_rows(runs_dir: str) -> list[dict]:
    pace = {"kind": "slow", "rank": 0, "step": 0, "steps": 1000, "delay_s": DELAY}
    e = rehearse("ddp", lose_at=4, back_after=3, runs_dir=runs_dir, steps=60, batch_size=BATCH,
                 model="gpt", model_options=MODEL, optimizer="sgd", checkpoint_every=2, fault=pace)
    return [{"name": "elastic-agents", "strategy": "ddp",
             "ranks": "->".join(str(w) for w, _ in e.phases), "lost_s": e.lost_s,
             "back_s": e.back_s, "redone_steps": e.redone_steps,
             "final_loss": e.run.metrics(0)[-1]["loss"]}]


def run(quick: bool = False) -> list[dict]:
    n, steps = (2, 6) if quick else (4, 12)
    with tempfile.TemporaryDirectory(prefix="dlab-bench-scale-") as runs_dir:
        # a core per rank first, where the rule's clean + delay holds; then 4 ranks on 2 cores
        rows = straggler_rows(2, steps, runs_dir, DESIGNS[:2])
        if not quick:
            rows += straggler_rows(n, steps, runs_dir)
        rows += preemption_rows(n, steps, runs_dir)
        if not quick:
            rows += elastic_agent_rows(runs_dir)
    return rows + _compression.rows(quick) + _local_sgd.rows(quick)
