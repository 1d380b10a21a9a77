"""``python -m dlab bench checkpoint``: what checkpoints cost, and what a fault costs.

1. Save and load of a ``zero3`` run (fp32: each rank holds 1/N of the parameters and of Adam's
   state), for full (gathered to rank 0, one file), sharded (a file per rank, written in
   parallel) and async (sharded, written by a thread while training goes on) at 2 and 4
   ranks: the time a training step is
   blocked by the save (median over saves), the size on disk, and the time to read, verify
   (SHA-256) and load it into a model. The peer is ``torch.save`` of the same model and
   optimizer state dicts to one file, the usual baseline; dlab's full save adds the fsync, the
   checksum and the rename that make it atomic. The sharded save also stands beside
   ``torch.distributed.checkpoint`` (DCP) saving the same model sharded by FSDP2 on the same
   ranks, each rank writing its own shards: the sharded peer.
2. A fault: rank 1 is killed at the start of step ``f``; torchrun restarts every rank, which
   resume from the newest checkpoint. The time lost is the hurt run's wall time minus a clean
   run's (the clean run saves nothing). It decomposes as
   ``lost = redone * step time + restart + saves``: redone = f - (last checkpoint before f)
   steps are trained twice, restart is detection, new processes, rendezvous and loading, and
   saves is the time the run's checkpoints blocked training. ``restart`` is measured once,
   from the run checkpointing every step (redone = 0: ``restart = lost - saves``), and then
   predicts the other intervals (that row carries no formula: it would restate
   itself). Averaged over where a fault lands, redone is interval / 2,
   which gives the planning formula ``E[lost] = interval / 2 * step time + restart`` per fault,
   against ``steps / interval * save time`` paid always (Young 1974; Daly 2006).
"""
from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch

from dlab import models
from dlab.analysis.steps import step_time
from dlab.bench import compared, median
from dlab.parallel.zero.torch_fsdp import shard_with_fsdp2
from dlab.procs.launch import launch
from dlab.procs.spawn import spawn
from dlab.runtime import checkpoint, checkpoint_load

MODEL = {"n_layer": 4, "d_model": 192, "n_head": 4, "seq_len": 64}
FAULT_BATCH = 64  # sequences per step: steps long enough that redone work shows beside restart


def _state_bytes(path: Path) -> int:
    manifest = json.loads((path / "manifest.json").read_text())
    return sum(f["bytes"] for f in manifest["files"].values())


def _load_seconds(path: Path) -> float:
    model = models.build("gpt", MODEL, seed=0)
    opt = torch.optim.Adam(model.parameters())
    start = time.perf_counter()
    checkpoint_load.load_replica(model, opt, checkpoint_load.Reader(path))
    return time.perf_counter() - start


def _torch_save_seconds(root: Path) -> tuple[float, int]:
    model = models.build("gpt", MODEL, seed=0)
    opt = torch.optim.Adam(model.parameters())
    model(torch.zeros(1, 8, dtype=torch.long)).sum().backward()
    opt.step()
    path = root / "torch_save.pt"
    start = time.perf_counter()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)
    return time.perf_counter() - start, path.stat().st_size


def dcp_seconds(model_options: dict, path: str, repeats: int = 3) -> tuple[float, float, int]:
    """On every rank, under ``dlab.spawn``: a GPT sharded by FSDP2 after one Adam step, saved
    ``repeats`` times with ``torch.distributed.checkpoint`` and loaded back. Returns the median
    save seconds, the load seconds and the bytes of one checkpoint on disk."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


    model = shard_with_fsdp2(models.build("gpt", model_options, seed=0))
    opt = torch.optim.Adam(model.parameters())
    x = torch.zeros(1, 8, dtype=torch.long)
    model.criterion(model(x), x).backward()
    opt.step()
    saves = []
    for i in range(repeats):
        state = dict(zip(("model", "optim"), get_state_dict(model, opt), strict=True))
        dist.barrier()
        start = time.perf_counter()
        dcp.save(state, checkpoint_id=f"{path}/{i}")
        saves.append(time.perf_counter() - start)
    dist.barrier()
    state = dict(zip(("model", "optim"), get_state_dict(model, opt), strict=True))
    start = time.perf_counter()
    dcp.load(state, checkpoint_id=f"{path}/0")
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    load_s = time.perf_counter() - start
    size = sum(f.stat().st_size for f in Path(f"{path}/0").iterdir())
    return median(saves), load_s, size


def _save_rows(root: Path, ranks: int, steps: int) -> list[dict]:
    peer_s, peer_bytes = _torch_save_seconds(root)
    rows = []
    for label, kind, asynchronous in (("full", "full", False), ("sharded", "sharded", False),
                                      ("async", "sharded", True)):
        run = launch("zero3", ranks, runs_dir=root, wait=True, steps=steps, checkpoint_every=2,
                     checkpoint_kind=kind, checkpoint_async=asynchronous, model_options=MODEL,
                     batch_size=8, keep_checkpoints=1)
        blocked = median([m["checkpoint_s"] for m in run.metrics(0) if "checkpoint_s" in m])
        newest = checkpoint.latest(run.path / "checkpoints")
        what = {"name": "checkpoint", "kind": label, "ranks": ranks}
        rows.append(compared(blocked, peer_s, **what, metric="save_blocked_s"))
        rows.append(compared(_state_bytes(newest), peer_bytes, **what, metric="bytes"))
        rows.append({**what, "metric": "load_s", "dlab": _load_seconds(newest)})
        if label == "sharded":
            sharded_s = blocked
    per_rank = spawn(dcp_seconds, ranks, MODEL, str(root / f"dcp-{ranks}"), runs_dir=root,
                          timeout=300)
    save_s = max(r[0] for r in per_rank)  # the slowest rank holds the step back
    what = {"name": "checkpoint", "kind": "sharded vs DCP", "ranks": ranks}
    rows.append(compared(sharded_s, save_s, **what, metric="save_blocked_s"))
    rows.append({**what, "metric": "dcp_load_s", "peer": max(r[1] for r in per_rank)})
    rows.append({**what, "metric": "dcp_bytes", "peer": per_rank[0][2]})
    return rows


def _fault_rows(root: Path, steps: int, fault_step: int, intervals: list[int]) -> list[dict]:
    """``intervals[0]`` must be 1: that run (redone = 0) measures the restart cost."""
    common = {"steps": steps, "model_options": MODEL, "batch_size": FAULT_BATCH}
    start = time.perf_counter()
    clean = launch("torch-ddp", 2, runs_dir=root, wait=True, **common)
    clean_s = time.perf_counter() - start
    step_s = step_time(clean)
    measured = []
    for k in intervals:
        start = time.perf_counter()
        hurt = launch("torch-ddp", 2, runs_dir=root, wait=True, checkpoint_every=k, max_restarts=1,
                      fault={"rank": 1, "step": fault_step, "kind": "kill"}, **common)
        lost = time.perf_counter() - start - clean_s
        saves = sum(m.get("checkpoint_s", 0.0) for m in hurt.metrics(0))
        measured.append((k, fault_step - (fault_step // k) * k, lost, saves))
    _, _, lost_1, saves_1 = measured[0]
    restart = lost_1 - saves_1
    # The interval-1 row is where restart was fitted: its formula would restate its own
    # measurement, so it carries none; the other rows are predictions.
    return [{"name": "fault", "interval": k, "fault_step": fault_step, "redone_steps": redone,
             "step_s": step_s, "saves_s": saves, "restart_s": restart, "lost_s": lost,
             "formula_s": "" if i == 0 else redone * step_s + restart + saves,
             "role": "fits restart" if i == 0 else "predicted",
             "expected_per_fault_s": k / 2 * step_s + restart}
            for i, (k, redone, lost, saves) in enumerate(measured)]


def run(quick: bool = False) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        rows = []
        for ranks in ((2,) if quick else (2, 4)):
            rows += _save_rows(root, ranks, steps=4 if quick else 8)
        rows += _fault_rows(root, steps=12, fault_step=7, intervals=[1, 4] if quick else [1, 2, 4, 8])
    return rows
