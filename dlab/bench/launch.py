"""``python -m dlab bench launch``: what dlab's launcher costs over plain torchrun.

The same work (torch-ddp on a small GPT, a few steps) is started two ways: ``dlab.launch`` and
a bare ``python -m torch.distributed.run --standalone ... -m dlab.worker``. For each we time
from the call to the first metric line in the run directory (start-up: interpreters, imports,
rendezvous, process group, model build, first step) and to completion. Median of repeats.
Both sides get the CPU's matmul peak through ``DLAB_CPU_PEAK_FLOPS`` (measured once here, as
``dlab.launch`` does), so neither rank runs the probe.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dlab.bench import compared, median
from dlab.core.machine import measure_cpu_peak_flops
from dlab.procs.launch import launch

WORK = {"steps": 10, "model_options": {"n_layer": 2, "d_model": 64, "n_head": 4}, "batch_size": 8}


def _first_line(path: Path, proc_alive, start: float) -> float:
    while not (path.exists() and path.stat().st_size) and proc_alive():
        time.sleep(0.01)
    return time.perf_counter() - start


def _dlab(n: int, root: Path) -> tuple[float, float]:
    start = time.perf_counter()
    run = launch("torch-ddp", n, runs_dir=root, **WORK)
    first = _first_line(run.dir.metrics_file(0), lambda: run.proc.poll() is None, start)
    run.wait()
    return first, time.perf_counter() - start


def _torchrun(n: int, root: Path) -> tuple[float, float]:
    run_dir = root / f"plain-{time.monotonic_ns()}"
    opts = [f"--model-opt={k}={v}" for k, v in WORK["model_options"].items()]
    # --log-dir, as dlab.launch gives it: both sides write the agent's logs to the run, and
    # neither leaves a torchelastic_* folder in the temp directory per torchrun
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
           f"--log-dir={run_dir / 'torchelastic'}", "-m", "dlab.worker", "--run-dir", str(run_dir),
           "torch-ddp", "--steps", str(WORK["steps"]),
           "--batch-size", str(WORK["batch_size"]), *opts]
    log = root / f"{run_dir.name}.log"
    start = time.perf_counter()
    with open(log, "w") as out:
        # The CPU's matmul peak as dlab.launch hands it to its ranks, so these ranks skip the
        # 0.3 s probe too: both sides do the same work.
        env = {**os.environ, "OMP_NUM_THREADS": "1", "DLAB_CPU_PEAK_FLOPS": str(measure_cpu_peak_flops(1))}
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        first = _first_line(run_dir / "metrics" / "rank0.jsonl", lambda: proc.poll() is None, start)
        code = proc.wait()
    if code != 0:
        tail = "\n".join(log.read_text().splitlines()[-30:])
        raise RuntimeError(f"plain torchrun failed ({code}): {' '.join(cmd)}\n{tail}")
    return first, time.perf_counter() - start


def run(quick: bool = False) -> list[dict]:
    repeats = 1 if quick else 3
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in (2, 4):
            mine = [_dlab(n, Path(tmp)) for _ in range(repeats)]
            peer = [_torchrun(n, Path(tmp)) for _ in range(repeats)]
            for i, metric in enumerate(("to_first_metric_s", "to_completion_s")):
                rows.append(compared(median([m[i] for m in mine]), median([p[i] for p in peer]),
                                     name="launch", ranks=n, metric=metric))
    return rows
