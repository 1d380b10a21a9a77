"""``python -m dlab gpu``: one prepared session for a lent GPU, every step written to a folder.

A GPU is lent to some tasks only, for minutes, drawn by chance. This command spends them on
what the CPU lab cannot measure, in order of what a later lesson loses most without it, and
writes everything under ``data/gpu/<device>-<date>/`` to be committed whole:

=============== ==========================================================================
env             versions (torch, CUDA, cuDNN, NCCL, driver), the GPUs, their features
calibrate       ``plan calibrate``: matmul efficiency over the planner's shape grid,
                attention over sequence lengths, memory bandwidth: ``profile.json``, the
                cluster profile ``plan --cluster`` reads
step_profile    one training step of the lab GPT under ``torch.profiler``: the trace, and its
                kernels summed by dlab's own timeline phases (forward, backward, optimizer)
attention       SDPA's flash, memory-efficient, cuDNN and math kernels: time and memory
                against sequence length
matmul          fp32, TF32, bf16 and FP8 matmul throughput against the peak (the roofline)
allocator       the CUDA caching allocator's peak beside dlab's count by category, and a
                memory snapshot
collectives     NCCL at the GPUs' count of ranks (one: its fixed cost per call), Gloo with
                CUDA tensors at two
check           ``dlab check --quick``: every family of strategies against ``single``
=============== ==========================================================================

``check`` comes last: it has run on an H100 before (README, 2026-11-24) and takes longest.
Each step runs in a process of its own (``child.py``) under a budget; one that fails or runs
past its budget is recorded with its reason and the session goes on, and the whole session
stops starting steps when its own budget is spent. Every step's JSON validates against one
schema (``dlab.tools.gpu.schema``). Rerunning is safe: a step's old files are removed before
it runs again, and ``--steps`` reruns only some, keeping the others' rows.

Without CUDA (``--cpu``, or no GPU) every step runs at CPU sizes, what needs CUDA in it (the
flash and memory-efficient kernels, TF32, FP8, the allocator, NCCL) recorded as not measured
with the reason: the test suite runs this mode.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dlab.models.data import CORPUS
from dlab.procs.process import kill_tree, spawn_tied_to_this_process
from dlab.tools.gpu import child, schema

#: committed sessions live here, one folder each
SESSIONS = CORPUS.parent / "gpu"
CHILD = Path(child.__file__)
#: a step is not started with less than this left of the session's budget
MIN_STEP_S = 15.0
#: the whole session on a GPU: under the 10 minutes asked, leaving time for the machine's start
GPU_BUDGET_S, CPU_BUDGET_S = 540.0, 300.0


@dataclass(frozen=True)
class Step:
    name: str
    target: str  # "module:function", run by ``child.execute``
    budget_s: float  # the most it may take (a ceiling, not an estimate of its time)
    what: str


STEPS = (
    Step("env", "dlab.tools.gpu.environment:run", 60, "versions, GPUs and their features"),
    Step("calibrate", "dlab.tools.gpu.calibration:run", 150,
         "plan calibrate: matmul grid, attention, bandwidth -> profile.json"),
    Step("step_profile", "dlab.tools.gpu.step_profile:run", 120,
         "one GPT step under torch.profiler beside dlab's timeline -> trace.json.gz"),
    Step("attention", "dlab.tools.gpu.attention:run", 120,
         "SDPA flash / efficient / cuDNN / math: time and memory against s"),
    Step("matmul", "dlab.tools.gpu.matmul:run", 90, "fp32, TF32, bf16, FP8 matmuls against the peak"),
    Step("allocator", "dlab.tools.gpu.allocator:run", 60,
         "the caching allocator's peak beside dlab's count by category"),
    Step("collectives", "dlab.tools.gpu.collectives:run", 120,
         "NCCL at the GPUs' ranks, Gloo with CUDA tensors at 2"),
    # every case a torchrun whose ranks each start CUDA: its first 15 took 243 s on an H200
    Step("check", "dlab.tools.gpu.checks:run", 400, "dlab check --quick"),
)


def device_name(cuda: bool) -> str:
    """The GPU's name as the driver gives it (without starting CUDA in this process), or the CPU."""
    if cuda:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30, check=True).stdout
            if out.strip():
                return out.strip().splitlines()[0].strip()
        except (OSError, subprocess.SubprocessError):
            pass
        return torch.cuda.get_device_name(0)
    return f"cpu-{platform.machine()}"


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def default_out(name: str, day: datetime.date | None = None) -> Path:
    """``data/gpu/<device>-<date>``: one folder per device and day; a rerun that day reuses it."""
    return SESSIONS / f"{slug(name)}-{(day or datetime.date.today()).isoformat()}"


def _now() -> str:
    return datetime.datetime.now().isoformat(timespec="seconds")


def _versions(folder: Path) -> dict:
    """The env step's versions where it ran, else what this process knows without CUDA."""
    env = folder / "env.json"
    if env.exists():
        return json.loads(env.read_text())["versions"]
    return {"torch": torch.__version__, "cuda": torch.version.cuda}


def _run_isolated(step: Step, ctx: dict, budget: float, log_dir: Path) -> dict:
    """The step in its own process, killed whole at ``budget`` seconds; its result or why not."""
    log_dir.mkdir(exist_ok=True)
    log_path = log_dir / f"{step.name}.log"
    with tempfile.TemporaryDirectory(prefix="dlab-gpu-step-") as tmp:
        ctx_path, result_path = Path(tmp) / "ctx.json", Path(tmp) / "result.json"
        ctx_path.write_text(json.dumps(ctx))
        env = dict(os.environ)
        # the child runs by path: it must import this copy of dlab, not another installed one
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(CHILD.parents[3]), env.get("PYTHONPATH")]))
        with open(log_path, "w") as log:
            proc = spawn_tied_to_this_process(
                [sys.executable, str(CHILD), step.target, str(ctx_path), str(result_path)], log, env)
            try:
                proc.wait(timeout=budget)
            except subprocess.TimeoutExpired:
                kill_tree(proc, grace=5.0)
                return {"status": "timeout", "why": f"ran past its budget of {budget:.0f} s and was "
                                                     f"stopped (log: logs/{log_path.name})"}
            except BaseException:
                kill_tree(proc, grace=2.0)
                raise
        if not result_path.exists():
            tail = log_path.read_text().strip().splitlines()[-1:] or ["no output"]
            return {"status": "failed", "why": f"its process ended ({proc.returncode}) before it "
                                               f"reported: {tail[0][:300]} (log: logs/{log_path.name})"}
        result = json.loads(result_path.read_text())
    if "error" in result:
        return {"status": "failed", "why": f"{result['error'][:300]} (log: logs/{log_path.name})"}
    return {"status": "ok", **result}


def _run_here(step: Step, ctx: dict) -> dict:
    try:
        return {"status": "ok", **child.execute(step.target, ctx)}
    except Exception as e:  # noqa: BLE001 - the step's failure is its row; the session goes on
        return {"status": "failed", "why": f"{type(e).__name__}: {e}"[:300]}


def run_session(out: Path | str | None = None, cpu: bool = False, quick: bool = False,
                only: list[str] | None = None, budget_s: float | None = None, isolate: bool = True,
                steps: tuple[Step, ...] = STEPS, command: str = "", say=print) -> tuple[Path, dict]:
    """Run the session's ``steps`` (those named in ``only``; all by default) into ``out``, and
    return the folder and its index. ``cpu``: CPU mode even where CUDA is present. ``isolate=False`` runs the
    steps in this process (the tests' CPU mode): budgets are then not enforced. ``command``:
    how it was started, for the README."""
    cuda = torch.cuda.is_available() and not cpu
    unknown = sorted(set(only or ()) - {s.name for s in steps})
    if unknown:
        raise ValueError(f"no step {', '.join(unknown)}; the steps are {', '.join(s.name for s in steps)}")
    name = device_name(cuda)
    if not out:
        out = default_out(name) if cuda else tempfile.mkdtemp(prefix="dlab-gpu-cpu-")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    budget_s = budget_s or (GPU_BUDGET_S if cuda else CPU_BUDGET_S)
    index_path = out / "index.json"
    old = json.loads(index_path.read_text()) if index_path.exists() else {}
    rows = {r["name"]: r for r in old.get("steps", []) if only}  # a partial rerun keeps the rest
    index = {"format": "dlab-gpu-session", "version": schema.VERSION, "device": name, "cuda": cuda,
             "cpu_mode": not cuda, "quick": quick, "started": _now(), "finished": None,
             "command": command or "dlab.tools.gpu.session.run_session",
             "budget_s": budget_s, "versions": {}, "steps": []}
    runs_dir = Path(tempfile.mkdtemp(prefix="dlab-gpu-runs-"))
    deadline = time.monotonic() + budget_s
    mode = "CUDA" if cuda else "CPU mode: what needs CUDA is recorded as not measured"
    say(f"GPU session on {name} ({mode}) into {out}, budget {budget_s:.0f} s")
    try:
        for step in steps:
            if only and step.name not in only:
                continue
            for f in rows.pop(step.name, {}).get("files", []) + [f"{step.name}.json"]:
                (out / f).unlink(missing_ok=True)  # a rerun that fails leaves no stale success
            left = deadline - time.monotonic()
            budget = min(step.budget_s, left)
            ctx = {"step": step.name, "out": str(out), "cuda": cuda, "quick": quick,
                   "device": name, "runs_dir": str(runs_dir)}
            start = time.monotonic()
            if left < MIN_STEP_S:
                got = {"status": "skipped", "why": f"the session's budget of {budget_s:.0f} s was "
                                                   f"spent before it could start"}
            elif isolate:
                got = _run_isolated(step, ctx, budget, out / "logs")
            else:
                got = _run_here(step, ctx)
            rows[step.name] = {"name": step.name, "status": got["status"],
                               "seconds": round(time.monotonic() - start, 2), "budget_s": budget,
                               "files": got.get("files", []), "summary": got.get("summary", ""),
                               "why": got.get("why")}
            say(f"  {step.name:13s} {got['status']:8s} {rows[step.name]['seconds']:7.1f} s  "
                f"{got.get('summary') or got.get('why')}")
            _write(out, index, rows, steps)
        index["finished"] = _now()
    finally:
        _write(out, index, rows, steps)
        shutil.rmtree(runs_dir, ignore_errors=True)
    return out, index


def _write(out: Path, index: dict, rows: dict, steps: tuple[Step, ...]) -> None:
    index["steps"] = [rows[s.name] for s in steps if s.name in rows]
    index["versions"] = _versions(out)
    child.write_json(out / "index.json", index)
    (out / "README.md").write_text(readme(index, steps))


def readme(index: dict, steps: tuple[Step, ...] = STEPS) -> str:
    """The folder's README: what ran, on what, with which versions, and how to read it."""
    what = {s.name: s.what for s in steps}
    lines = [f"# GPU session: {index['device']}, {index['started'][:10]}", "",
             f"Written by `{index['command'].strip()}` ({'CUDA' if index['cuda'] else 'CPU mode'}"
             f"{', --quick' if index['quick'] else ''}), started {index['started']}, finished "
             f"{index['finished'] or '(not finished: the session was stopped)'}, budget "
             f"{index['budget_s']:.0f} s. Every figure here was measured on this one device on "
             f"this date; the notebooks show it labelled so wherever no GPU is present.", "",
             "| version | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in index["versions"].items()]
    lines += ["", "| step | what | status | s | result |", "|---|---|---|---|---|"]
    lines += [f"| {r['name']} | {what.get(r['name'], '')} | {r['status']} | {r['seconds']:.1f} | "
              f"{(r['summary'] if r['status'] == 'ok' else r['why'] or '').replace('|', '/')} |"
              for r in index["steps"]]
    lines += ["", "Reading it: `trace.json.gz` opens in https://ui.perfetto.dev (or chrome://tracing "
              "after gunzip); `memory_snapshot.pickle.gz`, gunzipped, in https://pytorch.org/memory_viz; "
              "`profile.json` is a cluster profile: `python -m dlab plan --cluster "
              "data/gpu/<this folder>/profile.json --model ... --gpus ...`. Each JSON file's fields "
              "are described in `dlab/tools/gpu/schema.py`; `python -m dlab gpu --validate <folder>` "
              "checks them.", ""]
    return "\n".join(lines)
