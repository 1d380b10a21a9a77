"""The dashboard and the static plots: a recorded run directory replays without a kernel, the
bubble fraction matches its definition, a live run blocks and ends with its summary or its
failing rank's error, and the Stop button stops a run while the cell is still busy (in a real
kernel, with the click sent as JupyterLab sends it)."""
from __future__ import annotations

import json
import time

import pytest
from helpers import TINY_GPT

import dlab
from dlab.analysis.steps import bubble_fractions
from dlab.ui.collectives import collective_diagram
from dlab.ui.dashboard import Dashboard, show
from dlab.ui.plots import compare, plot

MEMORY = {"parameters": 4000, "gradients": 4000, "optimizer": 8000, "activations": 3000,
          "comm_buffers": 1000}


def record_pipeline_run(path, steps: int = 3, wire_bytes: int | None = None) -> None:
    """A finished 2-stage pipeline run written by hand, as ranks write it: rank 0 does forward
    of micro-batches 0, 1 then their backwards; rank 1 starts 1 s later (the warm-up bubble).
    ``wire_bytes``: each step's bytes measured on the wire (left out of the records if None, as
    in runs that could not measure them)."""
    for sub in ("metrics", "timeline", "ranks", "logs"):
        (path / sub).mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"strategy": "pipeline-gpipe", "world_size": 2,
                                                  "steps": steps,
                                                  "options": {"microbatches": 2}}))
    for r in (0, 1):
        metrics, events = [], []
        for s in range(steps):
            t = 10.0 * s
            metrics.append({"step": s, "rank": r, "time": t + 6, "loss": 3.0 - 0.5 * s,
                            "step_time": 6.0, "tokens": 512, "tokens_per_s": 512 / 6.0, "mfu": 0.01,
                            "memory": MEMORY, "comm": {"calls": 2, "sent_bytes": 2 * 2 ** 20,
                                                       "recv_bytes": 2 * 2 ** 20, "seconds": 0.5},
                            "comm_by_op": {}})
            if wire_bytes is not None:
                metrics[-1]["comm"]["wire_bytes"] = wire_bytes
            # rank 0: F0 [0,1] F1 [1,2] ... B1 [4,5] B0 [5,6]; rank 1: F0 [1,2] F1 [2,3] B1 [3,4] B0 [4,5]
            spans = ([("forward", 0, 0, 1), ("forward", 1, 1, 2), ("backward", 1, 4, 5),
                      ("backward", 0, 5, 6)] if r == 0 else
                     [("forward", 0, 1, 2), ("forward", 1, 2, 3), ("backward", 1, 3, 4),
                      ("backward", 0, 4, 5)])
            events += [{"kind": k, "step": s, "start": t + a, "end": t + b, "mb": mb, "stage": r}
                       for k, mb, a, b in spans]
            events.append({"kind": "step", "step": s, "start": t, "end": t + 6})
        (path / f"metrics/rank{r}.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
        (path / f"timeline/rank{r}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
        (path / f"ranks/rank{r}.json").write_text(json.dumps({"rank": r, "ok": True}))
        (path / f"logs/rank{r}.log").write_text(f"hello from rank {r}\n")


def test_bubble_fraction_is_idle_over_the_step_window(tmp_path):
    record_pipeline_run(tmp_path / "run")
    run = dlab.attach(tmp_path / "run")
    # window [0, 6] on both ranks; rank 0 computes 4 s of it, rank 1 computes 4 s of it
    assert bubble_fractions(run.timeline()) == pytest.approx({0: 2 / 6, 1: 2 / 6})
    # rank 1's backward of mb 0 takes 3 s instead of 1 (ends at 7): the window widens to [0, 7],
    # rank 0 still computes 4 s of it, rank 1 now 6 s
    late = [dict(e, end=e["end"] + 2) if (e["rank"], e["kind"], e.get("mb")) == (1, "backward", 0)
            else e for e in run.timeline()]
    assert bubble_fractions(late) == pytest.approx({0: 3 / 7, 1: 1 / 7})


def test_dashboard_replays_a_recorded_run_without_a_kernel(tmp_path):
    record_pipeline_run(tmp_path / "run")
    dash = show(tmp_path / "run")
    assert bytes(dash.image.value[:4]) == b"\x89PNG"
    titles = [ax.get_title() for ax in dash.figure.axes]
    for expected in ("loss", "throughput", "memory by category", "communication", "bubble",
                     "timeline of step 2"):
        assert any(expected in t for t in titles), (expected, titles)
    assert len(dash.metrics[0]) == len(dash.metrics[1]) == 3
    assert "ok" in dash.status.value and "step 3/3" in dash.status.value
    assert dash.stop_button.disabled  # nothing to stop in a replay
    memory_ax = next(ax for ax in dash.figure.axes if "memory" in ax.get_title())
    tops = [p.get_y() + p.get_height() for p in memory_ax.patches if p.get_gid() != "model"]
    assert max(tops) == pytest.approx(sum(MEMORY.values()) / 2 ** 20)
    dash.log_choice.value = 1
    assert "hello from rank 1" in dash.log_view.value


def test_dashboard_follows_a_run_as_it_is_written(tmp_path):
    """Only what the ranks appended since the last update is read (the live path)."""
    record_pipeline_run(tmp_path / "run", steps=2)
    dash = Dashboard(tmp_path / "run")
    dash.update()
    assert [m["step"] for m in dash.metrics[0]] == [0, 1]
    with open(tmp_path / "run/metrics/rank0.jsonl", "a") as f:
        f.write(json.dumps(dict(dash.metrics[0][-1], step=2)) + "\n")
    assert dash.poll() and [m["step"] for m in dash.metrics[0]] == [0, 1, 2]
    assert not dash.poll()


def test_a_restart_replaces_the_redone_steps_and_is_marked(tmp_path):
    record_pipeline_run(tmp_path / "run", steps=3)
    dash = Dashboard(tmp_path / "run")
    dash.update()
    for r in (0, 1):  # torchrun restarted the ranks; they resumed from a checkpoint at step 1
        with open(tmp_path / f"run/timeline/rank{r}.jsonl", "a") as f:
            f.write(json.dumps({"kind": "restart", "step": 1, "start": 0.0, "end": 0.0,
                                "attempt": 1, "from_step": 1}) + "\n")
        with open(tmp_path / f"run/metrics/rank{r}.jsonl", "a") as f:
            f.write(json.dumps(dict(dash.metrics[r][1], loss=9.0, attempt=1)) + "\n")
    dash.update()
    assert [(m["step"], m["loss"]) for m in dash.metrics[0]] == [(0, 3.0), (1, 9.0)]
    loss_ax = next(ax for ax in dash.figure.axes if ax.get_title().startswith("loss"))
    labels = [line.get_label() for line in loss_ax.get_lines()]
    assert "restart 1: resumed at step 1" in labels


def test_static_plots(tmp_path):
    record_pipeline_run(tmp_path / "a")
    record_pipeline_run(tmp_path / "b", steps=2)
    assert len(plot(tmp_path / "a").axes) == 8
    fig = compare([tmp_path / "a", tmp_path / "b"])
    titles = " ".join(ax.get_title() for ax in fig.axes)
    assert all(w in titles for w in ("step time", "throughput", "memory per rank", "sent per step"))
    with pytest.raises(ValueError, match="pick one of"):
        collective_diagram("allreduce")
    assert len(collective_diagram("all_to_all", 4).axes) == 2


def test_launch_with_dashboard_blocks_then_summarises_or_raises(runs_dir, capsys):
    run = dlab.launch("torch-ddp", 2, runs_dir=runs_dir, dashboard=True, **TINY_GPT)
    assert run.state == "ok" and [len(run.metrics(r)) for r in (0, 1)] == [4, 4]
    shown = capsys.readouterr().out
    assert "ok" in shown and "rank  steps" in shown  # the summary table, no rank log lines
    with pytest.raises(dlab.RunFailed) as failed:
        dlab.launch("torch-ddp", 2, runs_dir=runs_dir, dashboard=True,
                    fault={"rank": 1, "step": 1, "kind": "raise"}, **TINY_GPT)
    assert failed.value.rank == 1 and "InjectedFault" in str(failed.value)


def test_the_dashboard_and_wait_let_torchrun_restart_a_rank_that_failed_once(runs_dir, capsys):
    """One supervision loop (``Run.wait``): with ``max_restarts`` a rank killed once is restarted
    by torchrun from the last checkpoint whether the cell waits or shows the dashboard, and both
    end alike: ok, two attempts, the same losses. (The dashboard's own loop used to stop such a
    run two seconds after the failure.)"""
    config = {**TINY_GPT, "steps": 6, "checkpoint_every": 2, "max_restarts": 1,
              "fault": {"rank": 1, "step": 3, "kind": "kill"}}
    waited = dlab.launch("ddp", 2, runs_dir=runs_dir, wait=True, **config)
    shown = dlab.launch("ddp", 2, runs_dir=runs_dir, dashboard=True, **config)
    for run in (waited, shown):
        assert run.state == "ok", run.error()
        assert {m["attempt"] for m in run.metrics(0)} == {0, 1}, "the kill must have restarted the run"
    loss = lambda run: [m["loss"] for m in run.metrics(0)]  # noqa: E731
    assert loss(shown) == loss(waited)


def test_stop_button_stops_a_run_while_the_cell_is_busy(runs_dir):
    """JupyterLab sends a click as a comm message on the shell channel; the kernel's main thread
    is busy in the blocking cell, yet the run must stop within seconds."""
    jupyter_client = pytest.importorskip("jupyter_client")
    km, kc = jupyter_client.manager.start_new_kernel(kernel_name="python3")
    try:
        code = (f"import dlab\nrun = dlab.launch('torch-ddp', 2, runs_dir={str(runs_dir)!r}, "
                f"dashboard=True, **{dict(TINY_GPT, steps=100_000)!r})")
        msg_id = kc.execute(code)
        button = None
        deadline = time.monotonic() + 60
        while button is None and time.monotonic() < deadline:
            msg = kc.get_iopub_msg(timeout=60)
            state = msg["content"].get("data", {}).get("state", {})
            if msg["msg_type"] == "comm_open" and state.get("_model_name") == "ButtonModel":
                button = msg["content"]["comm_id"]
        assert button, "the dashboard never showed its Stop button"
        while not list(runs_dir.glob("*/metrics/rank0.jsonl")) and time.monotonic() < deadline:
            time.sleep(0.2)
        kc.shell_channel.send(kc.session.msg("comm_msg", {
            "comm_id": button, "data": {"method": "custom", "content": {"event": "click"}}}))
        clicked = time.monotonic()
        reply = kc.get_shell_msg(timeout=30)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = kc.get_shell_msg(timeout=30)
        assert reply["content"]["status"] == "ok", reply["content"]
        assert time.monotonic() - clicked < 15
        (run_dir,) = runs_dir.iterdir()
        status = json.loads((run_dir / "status.json").read_text())
        assert status["state"] == "stopped"
        assert sum(1 for _ in open(run_dir / "metrics/rank0.jsonl")) < 100_000
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
