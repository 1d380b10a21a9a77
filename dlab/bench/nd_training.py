"""``python -m dlab bench nd_training``: a real run of ``nd`` that loses its cluster and goes on
in another layout.

The lab GPT (the smallest config that still cuts into 2 stages of 2 blocks) trains on the
repository's corpus (``data/corpus.txt``, ``dlab.models.corpus``) with Adam:

1. under pp2 x tp2 x dp2 with ZeRO-3 on 8 ranks, checkpointing every 50 steps, until rank 5
   is SIGKILLed at the start of step 175 (``_plan``; no restart: the job is gone; the steps
   since the last checkpoint are lost);
2. resumed from that job's newest checkpoint under dp2 x tp2 with ZeRO-1 on 4 ranks (a smaller
   cluster: another pipeline depth, ZeRO stage and data degree; each rank cuts its pieces of
   the parameters and of Adam's moments out of the logical tensors, ``dlab.parallel.nd.state``);
3. ``single``, uninterrupted, for the same steps: the reference.

Rows: each phase's steps, last loss and median step time, and the largest difference of its
losses from ``single``'s at the same steps (measured; fp32 - the layouts sum the same numbers
in other orders, and Adam divides each gradient by its own running RMS, so a rounding
difference in a coordinate whose gradient is near zero becomes an update of lr's size: the
difference stays at rounding level for some dozens of steps, then grows to the size of the
loss's step-to-step noise, before any checkpoint - the figure's lower panel. This row is the
size of that drift, not a test; the 1e-5 parity of a resharded resume is
tests/test_nd_checkpoint.py's, with SGD). What the resume itself changes is the
``checkpoint`` row's ``loss_diff_at_resume``: the resumed run's first loss against the killed
run's loss at the same step (the same parameters under another layout). Not quick, it also
draws the loss curves and their difference from ``single``'s into ``docs/nd_training.png``.
fp32 throughout: mixed precision in ``nd`` is another branch's (issue #40); the checkpoint
saves the optimizer's fp32 masters, so it does not change with it.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from dlab.analysis.diagnose import RunFailed
from dlab.analysis.steps import step_time
from dlab.procs.launch import launch
from dlab.procs.run import Run
from dlab.runtime import checkpoint, checkpoint_load
from dlab.ui.figure import new_figure, style

MODEL = {"n_layer": 4, "d_model": 32, "n_head": 2, "seq_len": 32}
EIGHT = {"pp": 2, "tp": 2, "dp": 2, "zero": 3}
FOUR = {"dp": 2, "tp": 2, "zero": 1}
FIGURE = Path("docs/nd_training.png")


def _plan(quick: bool) -> tuple[int, int, int]:
    """(steps, checkpoint interval, the step rank 5 is killed at)."""
    return (40, 10, 25) if quick else (300, 50, 175)


def _name(options: dict) -> str:
    return " x ".join(f"{k}{v}" for k, v in options.items() if k != "zero") + f" zero{options['zero']}"


def run(quick: bool = False) -> list[dict]:
    steps, every, kill_at = _plan(quick)
    common = {"model": "gpt", "model_options": MODEL, "batch_size": 16, "optimizer": "adam",
              "steps": steps}
    with tempfile.TemporaryDirectory() as root:
        ref = launch("single", 1, runs_dir=root, wait=True, **common)
        try:
            lost = launch("nd", 8, runs_dir=root, wait=True, options=EIGHT, checkpoint_every=every,
                          fault={"rank": 5, "step": kill_at, "kind": "kill"}, **common)
            raise RuntimeError(f"{lost.path}: the killed run finished; the fault did not fire")
        except RunFailed as failed:
            lost_dir = Path(failed.run.path)
        saved = checkpoint.latest(lost_dir / "checkpoints")
        resumed_from = checkpoint_load.Reader(saved).step
        later = launch("nd", 4, runs_dir=root, wait=True, options=FOUR, resume=str(saved), **common)
        first = Run(lost_dir)
        want = {m["step"]: m["loss"] for m in ref.metrics(0)}
        rows = []
        for what, r, ranks, options in ((f"{_name(EIGHT)}, killed", first, 8, EIGHT),
                                        (f"{_name(FOUR)}, resumed", later, 4, FOUR)):
            ms = r.metrics(0)
            rows.append({"name": what, "ranks": ranks, "first_step": ms[0]["step"],
                         "last_step": ms[-1]["step"], "last_loss": ms[-1]["loss"],
                         "max_loss_diff_vs_single": max(abs(m["loss"] - want[m["step"]]) for m in ms),
                         "step_s": step_time(r), "options": options})
        ms = ref.metrics(0)
        rows.insert(0, {"name": "single", "ranks": 1, "first_step": 0, "last_step": ms[-1]["step"],
                        "first_loss": ms[0]["loss"], "last_loss": ms[-1]["loss"],
                        "step_s": step_time(ref)})
        # the resumed run's first loss against the killed run's at the same step: the same
        # parameters under two layouts, so what is left is the forward's summation order
        killed = {m["step"]: m["loss"] for m in first.metrics(0)}
        rows.append({"name": "checkpoint", "killed_at": kill_at, "resumed_from": resumed_from,
                     "redone_steps": kill_at - resumed_from, "every": every,
                     "loss_diff_at_resume": abs(later.metrics(0)[0]["loss"] - killed[resumed_from])})
        if not quick:
            _draw(ref, first, later, kill_at, resumed_from)
    return rows


def _draw(ref, first, later, kill_at: int, resumed_from: int) -> None:
    fig = new_figure(figsize=(9, 6))
    ax, gap = fig.subplots(2, 1, sharex=True, height_ratios=(2, 1))
    want = {m["step"]: m["loss"] for m in ref.metrics(0)}
    ax.plot(list(want), list(want.values()), label="single (uninterrupted)", color="0.6", lw=3)
    for run, label, color in ((first, _name(EIGHT) + ", 8 ranks", "C0"),
                              (later, _name(FOUR) + ", 4 ranks, resumed", "C3")):
        ms = run.metrics(0)
        steps = [m["step"] for m in ms]
        ax.plot(steps, [m["loss"] for m in ms], label=label, color=color, lw=1)
        gap.semilogy(steps, [max(abs(m["loss"] - want[m["step"]]), 1e-9) for m in ms],
                     color=color, lw=1)
    for a in (ax, gap):
        a.axvline(kill_at, color="k", ls=":", lw=1, label=f"rank 5 killed (step {kill_at})")
        a.axvline(resumed_from, color="C3", ls="--", lw=1,
                  label=f"checkpoint resumed (step {resumed_from})")
    ax.set_ylabel("loss (bytes, nats)")
    ax.legend(fontsize=8)
    gap.set_ylabel("|loss - single's|")
    style(ax, "nd: the lab GPT on the corpus, killed under one layout, resumed under another "
              "(fp32, Adam)", "")
    style(gap, "|loss - single's|: the layouts' summation order, amplified by Adam before any "
               "checkpoint; the resume adds no step", "step")
    FIGURE.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(FIGURE, dpi=110)
