"""``python -m dlab check``: verify the whole lab on the machine at hand, in one command.

For every strategy, at the world sizes this machine allows, a short run is set beside ``single``
on the same device: losses and final parameters compared at a tolerance fit for the device,
model-state memory from dlab's accounting beside the formula (and, on CUDA, beside the caching
allocator's peak), MFU, and the all-reduce bus bandwidth of the backend beside dlab's own ring.
It prints one table and, with ``--json FILE``, writes the rows.

What runs where:

- one GPU per rank (N >= 2 GPUs): NCCL at world sizes 2 and 4 (those that fit);
- one GPU: ``single`` and the strategies that run at world size 1 on NCCL, and the multi-rank
  strategies on Gloo with every rank's tensors on that GPU (Gloo moves CUDA tensors by staging
  them through host memory; NCCL refuses two ranks on one GPU);
- no GPU: Gloo on the CPU, and the report says that no GPU was found. CI runs this mode.

Tolerances: fp32 on the CPU, the course's 1e-5 on losses and parameters (absolute); fp32 on
CUDA, 1e-4 (its kernels add in other orders, and the embedding's backward adds with atomics,
so two CUDA runs of one config already differ in the last bits). Every parity run uses SGD
(momentum 0.9), which does not hide a wrong gradient scale as Adam would.

``--quick`` runs one strategy of each family at world size 2; the full check runs every
registered strategy at every world size the machine allows.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field

import torch

from dlab import parallel
from dlab.analysis.diagnose import RunFailed
from dlab.analysis.tables import format_rows
from dlab.comm.algorithms import ALGORITHMS
from dlab.core.config import ConfigError, RunConfig
from dlab.core.machine import gpu_count
from dlab.core.output import check_output_path, write_output
from dlab.procs.launch import launch
from dlab.procs.spawn import spawn
from dlab.theory.comm import bus_bandwidth as busbw
from dlab.worker import validate

GPT = {"n_layer": 4, "d_model": 32, "n_head": 4, "seq_len": 32}
MOE = {**GPT, "n_expert": 4, "top_k": 2}
BASE = {"batch_size": 8, "steps": 3, "optimizer": "sgd", "save_final": True}
QUICK = ("torch-ddp", "ddp", "zero3", "pipeline-1f1b", "tp", "cp", "ep", "nd")
TOLERANCE = {"cpu": 1e-5, "cuda": 1e-4}
BUS_SIZES = (1 << 20, 16 << 20)


@dataclass
class Case:
    strategy: str
    world_size: int
    backend: str
    device: str
    options: dict = field(default_factory=dict)

    def config(self) -> dict:
        """The GPT, or the MoE for a strategy that trains only a mixture of experts (it says so
        in its ``model_problems``)."""
        gpt = {**BASE, "model": "gpt", "model_options": GPT, "backend": self.backend,
               "device": self.device, "options": self.options}
        trains_gpt = not parallel.get(self.strategy).model_problems(RunConfig.from_dict(
            {**gpt, "strategy": self.strategy, "world_size": self.world_size}))
        return gpt if trains_gpt else {**gpt, "model": "moe", "model_options": MOE}


def plan(strategies: list[str], gpus: int, quick: bool) -> list[Case]:
    """The cases this machine can run, as the module docstring lays out."""
    sizes = (2,) if quick else (2, 4)
    cases = []
    for name in strategies:
        opts = parallel.get(name).check_options()
        if gpus >= 2:
            cases += [Case(name, n, "nccl", "cuda", opts) for n in sizes if n <= gpus]
        elif gpus == 1:
            cases.append(Case(name, 1, "nccl", "cuda", opts))
            cases += [Case(name, n, "gloo", "cuda", opts) for n in sizes]
        else:
            cases += [Case(name, n, "gloo", "cpu", opts) for n in sizes]
    return cases


def compare(got: dict, want: dict, got_losses: list[float], want_losses: list[float]) -> dict:
    """The largest absolute differences between two runs: losses step by step, and every final
    parameter (a missing or extra name is reported, not skipped)."""
    if len(got_losses) != len(want_losses) or not want_losses:
        return {"loss_diff": float("inf"), "param_diff": float("inf"),
                "problem": f"{len(got_losses)} losses against {len(want_losses)}"}
    loss = max(abs(a - b) for a, b in zip(got_losses, want_losses))
    if got.keys() != want.keys():
        return {"loss_diff": loss, "param_diff": float("inf"),
                "problem": f"parameter names differ: {sorted(set(got) ^ set(want))[:4]}"}
    param = max((got[k].float().cpu() - want[k].float().cpu()).abs().max().item() for k in want)
    return {"loss_diff": loss, "param_diff": param}


def formula_bytes(case: Case, rank: int = 0) -> int | None:
    """Model-state bytes (parameters + gradients + optimizer) the strategy's own theory predicts
    for this rank (``Strategy.predicted_state``, the formulas of ``dlab.theory``); None where
    it states none."""
    cfg = RunConfig(strategy=case.strategy, world_size=case.world_size, **case.config())
    state = parallel.get(case.strategy).predicted_state(cfg, rank)
    return None if state is None else sum(state.values())


def failure(case: Case, error: Exception) -> dict:
    """A run that raised: on Gloo with CUDA tensors, an operation Gloo has no CUDA version of is
    reported as unsupported there (the table says which strategies those are); anything else
    is a failure of the check."""
    text = str(error)
    first = next((line for line in text.splitlines() if line.strip()), text)
    unsupported = any(w in text.lower() for w in ("unsupported", "not supported", "not implemented"))
    if case.backend == "gloo" and case.device == "cuda" and unsupported:
        return {"result": "skipped", "why": f"Gloo has no CUDA version of an operation it uses: {first}"}
    # Gloo's send/recv hand the tensor's pointer to the socket: a GPU pointer fails in writev
    # with EFAULT (measured on an H100, torch 2.11), so point-to-point strategies need CPU tensors
    if case.backend == "gloo" and case.device == "cuda" and "Bad address" in text:
        return {"result": "skipped", "why": f"Gloo's send/recv move CPU memory only: {first}"}
    return {"result": "FAIL", "why": first}


def _final(run) -> dict:
    return torch.load(run.path / "final_state.pt", weights_only=True, map_location="cpu")


def _losses(run) -> list[float]:
    return [m["loss"] for m in run.metrics(0)]


def check_case(case: Case, references: dict, runs_dir: str) -> dict:
    row = {"strategy": case.strategy, "ranks": case.world_size, "backend": case.backend,
           "device": case.device}
    # launch's own checks, asked first: a case they refuse (on one GPU, a layout needing more
    # ranks than there are) is a skipped row, not launch's ConfigError ending the whole table
    problems = validate.problems(RunConfig(strategy=case.strategy, world_size=case.world_size,
                                           **case.config()))
    if problems:
        return {**row, "result": "skipped", "why": problems[0]}
    key = (case.device, json.dumps(case.config()["model_options"], sort_keys=True))
    if key not in references:
        ref_cfg = {**case.config(), "backend": "auto" if case.device == "cpu" else "nccl", "options": {}}
        references[key] = launch("single", 1, runs_dir=runs_dir, wait=True, **ref_cfg)
    ref = references[key]
    try:
        run = launch(case.strategy, case.world_size, runs_dir=runs_dir, wait=True, **case.config())
    except RunFailed as e:
        return {**row, **failure(case, e)}
    diff = compare(_final(run), _final(ref), _losses(run), _losses(ref))
    tol = TOLERANCE[case.device]
    last = run.metrics(0)[-1]
    held = sum(last["memory"].get(k, 0) for k in ("parameters", "gradients", "optimizer"))
    summary = run.summary().rows[0]
    ok = diff["loss_diff"] <= tol and diff["param_diff"] <= tol
    return {**row, "result": "ok" if ok else "FAIL", **diff, "tolerance": tol,
            "model_state_bytes": held, "formula_bytes": formula_bytes(case),
            "cuda_peak_bytes": last.get("cuda_peak_bytes"), "mfu": summary.get("mfu"),
            "step_s": summary.get("step_time_s")}


def bus_bandwidth(sizes: tuple[int, ...], repeats: int) -> list[dict]:
    """On every rank: bus bandwidth (nccl-tests' busbw) of the backend's all_reduce and of
    dlab's ring, on the device the backend moves (CUDA for NCCL, else the CPU)."""
    import time

    import torch.distributed as dist

    n, backend = dist.get_world_size(), dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    rows = []
    for size in sizes:
        x = torch.ones(size // 4, device=device)
        seconds = {}
        for name, fn in (("backend", dist.all_reduce), ("ring", ALGORITHMS["ring"])):
            times = []
            for _ in range(repeats + 1):
                dist.barrier()
                t0 = time.perf_counter()
                fn(x)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - t0)
            seconds[name] = sorted(times[1:])[len(times[1:]) // 2]
        peer, mine = busbw(size, seconds["backend"], n), busbw(size, seconds["ring"], n)
        rows.append({"algorithm": "ring", "backend": backend, "device": device.type, "ranks": n,
                     "size": size, "metric": "busbw GB/s", "dlab": mine / 1e9, "peer": peer / 1e9,
                     "ratio": mine / peer})
    return rows


def checkable() -> list[str]:
    """Every strategy but ``single`` that some options make train like it."""
    return [n for n in parallel.names() if n != "single" and not parallel.get(n).differs_from_single]


def run_check(quick: bool, runs_dir: str = "runs/check", strategies: list[str] | None = None
              ) -> tuple[str, list[dict], list[dict]]:
    gpus = gpu_count()
    names = strategies or (list(QUICK) if quick else checkable())
    where = (f"{gpus} GPU(s): {torch.cuda.get_device_name(0)}" if gpus else
             "no GPU found: every check runs on Gloo/CPU")
    references: dict = {}
    rows = [check_case(c, references, runs_dir) for c in plan(names, gpus, quick)]
    bus = spawn(bus_bandwidth, 2, BUS_SIZES[:1] if quick else BUS_SIZES, 3 if quick else 10,
                     runs_dir=runs_dir, timeout_s=300)[0]
    return where, rows, bus


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dlab check", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="one strategy per family, 2 ranks")
    p.add_argument("--json", help="write the rows to this file")
    p.add_argument("--runs-dir", default="runs/check")
    p.add_argument("--strategies", help="comma-separated strategies to check instead (e.g. ddp,zero3)")
    args = p.parse_args(argv)
    strategies = None
    if args.strategies is not None:
        strategies = [n.strip() for n in args.strategies.split(",") if n.strip()]
        if not strategies:
            p.error(f"--strategies {args.strategies!r} names no strategy; give at least one "
                    f"(e.g. ddp,zero3), or leave --strategies out to check them all")
        unknown = [n for n in strategies if n not in parallel.names() or n == "single"]
        if unknown:
            p.error(f"--strategies: {', '.join(unknown)} not checkable; choose from "
                    f"{', '.join(checkable())}")
        for n in strategies:
            why = parallel.get(n).differs_from_single
            if why:
                p.error(f"--strategies: {n} cannot be checked against single: {why}")
        twice = sorted({n for n in strategies if strategies.count(n) > 1})
        if twice:
            # refused, not deduplicated: a repeated name is a typo for another strategy as often
            # as a slip, and the check must not run something other than what was asked
            p.error(f"--strategies names {', '.join(twice)} more than once; name each strategy "
                    f"once")
    if args.json:
        try:
            check_output_path(args.json)  # before minutes of runs, not after them
        except ConfigError as e:
            p.error(str(e))
    where, rows, bus = run_check(args.quick, args.runs_dir, strategies)
    print(where)
    print(format_rows(rows))
    print()
    print(format_rows(bus))
    failed = [r for r in rows if r["result"] == "FAIL"]
    skipped = [r for r in rows if r["result"] == "skipped"]
    if args.json:
        write_output(args.json, json.dumps({"machine": where, "strategies": rows,
                                            "allreduce": bus}, indent=1))
    print(f"\ndlab check: {len(rows) - len(failed) - len(skipped)} passed, {len(failed)} failed, "
          f"{len(skipped)} skipped (refused by the config checks, or an operation Gloo has no "
          f"CUDA version of; reason in the table)"
          + "".join(f"\nFAIL {r['strategy']} at {r['ranks']} ranks: {r}" for r in failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
