"""Checkpoints: atomic on disk, verified on load, resumable exactly, readable at another layout.

Format. Every tensor is stored as *pieces of its flattened full shape*: ``{"shape", "start",
"data"}`` where ``data`` is a 1-D run of elements starting at flat offset ``start``. A replica
holds one piece per tensor (start 0, everything); a ZeRO rank holds the cut of each parameter
that falls in its shard, at any offset. A reader assembles whatever range it is asked for from
whichever files hold it, so a checkpoint written at one world size or layout loads at another
(resharding), including into ``single``. A piece of a tensor-parallel shard says which slice of
the whole tensor it is a run of (``"slice": [dim, offset, size]``: ``data`` then runs over the
flattened ``full.narrow(dim, offset, size)``), so a ZeRO cut of a tensor-parallel shard, as
``nd`` holds, is one piece too. ``torch.distributed.checkpoint`` reshards DTensor and
ShardedTensor layouts; ZeRO's flat, padded shards cut parameters at arbitrary offsets, which a
1-D range index describes directly, so dlab keeps its own small format and adds on top:

- atomicity: files go to ``checkpoints/.partial-step-N/``; when every rank's file is written,
  flushed and hashed, rank 0 writes ``manifest.json`` and renames the directory to ``step-N``.
  A writer killed midway leaves only a ``.partial-*`` directory, which loading ignores; the
  previous checkpoint stays until the new one is complete; the newest ``keep`` are kept.
- verification: the manifest lists each file's size and SHA-256; a mismatch is refused with
  an error naming the file. The manifest carries its own ``digest``: the SHA-256 of its
  canonical JSON (sorted keys, no spaces) without that field, so an edited step or file list
  is refused too. A tensor the pieces do not wholly cover is refused, naming it.
- what wrote it: the model (``model``, ``model_config``), the layout (``layout``: strategy,
  world size, options) and the optimizer (``optimizer``, ``lr``). A resume into another model
  is refused before start (``resume_problems``), and so is one with another optimizer (its state
  has other keys: Adam's moments are no SGD momentum) or another learning rate (dlab has no
  learning-rate schedule: a run trains at one rate, the checkpoint's hyper-parameters carry it,
  and a resume that asked for another would train at the checkpoint's while its config.json
  said otherwise). Another layout is fine (that is resharding), and so is another way of
  running the same model (``GPTConfig.EXECUTION_FIELDS``: activation recomputation, the
  attention core) and another precision: the parameters saved are the fp32 values the
  optimizer steps (``dlab.parallel.mixed``: the masters in mixed precision), from which a
  16-bit working copy is derived on load, whatever precision wrote them.
- safe loading: ``torch.load(weights_only=True)`` - tensors and plain containers only.
- exact resume, in every precision: the parameters (fp32 masters), optimizer state and
  hyper-parameters, fp16's loss scaler (``scaler``: its scale, its clean-step count towards the
  next growth, its skipped steps), the step (the data position: the global batch is a function
  of the step) and every rank's RNG state.
- asynchronous saving: the state is copied to CPU memory while training waits; a thread writes
  it while training goes on. Completion is signalled through files (``rankR.done``), never by a
  collective off the main thread (Gloo collectives from a second thread race the training ones).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dlab.comm import wire
from dlab.comm.host import host_copies_done, to_host
from dlab.core.disk import ELSEWHERE, DiskError, disk_error
from dlab.core.rundir import RunDir

# /3 added pieces that are runs over a tensor-parallel slice ("slice"); a /2 reader would have
# ignored the key and assembled the wrong tensor, so the version moved. /2 checkpoints (no
# slices) read the same under /3.
FORMAT = "dlab-checkpoint/3"
READABLE = (FORMAT, "dlab-checkpoint/2")


class CorruptCheckpoint(RuntimeError):
    pass


def digest(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def run_meta(config) -> dict:
    """What a checkpoint records of the run that wrote it."""
    from dataclasses import asdict
    return {"strategy": config.strategy, "model": config.model,
            "model_config": asdict(config.model_config()),
            "layout": {"strategy": config.strategy, "world_size": config.world_size,
                       "options": config.options},
            "optimizer": config.optimizer, "lr": config.lr}


# --- pieces -----------------------------------------------------------------------------------

def piece(tensor: torch.Tensor, start: int = 0, shape: tuple | None = None,
          cut: tuple[int, int, int] | None = None) -> dict:
    """A 1-D run of a tensor's flattened elements (the whole tensor by default), copied to the
    host (from a GPU through pinned memory, landed before it is returned), so a checkpoint
    holds CPU tensors wherever it was written and loads on a machine without a GPU. ``cut``
    ``(dim, offset, size)``: the run is of the slice ``full.narrow(dim, offset, size)`` of the
    whole tensor of ``shape`` (a tensor-parallel shard), not of the whole tensor."""
    flat = tensor.detach().reshape(-1)
    data = to_host(flat)
    host_copies_done(flat.device)
    out = {"shape": list(shape if shape is not None else tensor.shape), "start": int(start),
           "data": data}
    if cut is not None:
        out["slice"] = [int(c) for c in cut]
    return out


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class _Writes:
    """A file ``torch.save`` writes through, keeping the file system's error: torch's own
    writer swallows it and raises "unexpected pos ..." (torch 2.13), which names neither the
    file nor a full disk."""

    def __init__(self, file):
        self.file, self.error = file, None

    def write(self, data) -> int:
        try:
            return self.file.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.file.flush()


def _write(obj, path: Path) -> dict:
    with open(path, "wb") as f:
        out = _Writes(f)
        try:
            torch.save(obj, out)
        except RuntimeError:
            if out.error is None:
                raise
            raise out.error from None
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": path.stat().st_size, "sha256": file_sha256(path)}


def _partial(root: Path, step: int) -> Path:
    """Where a checkpoint of ``step`` is written until it is complete."""
    return root / f".partial-step-{step:08d}"


def discard_partial(root: Path) -> None:
    """Remove every incomplete checkpoint under ``root``: once no writer is left (the run
    ended, or the writer failed), a ``.partial-*`` directory is only space taken."""
    for partial in Path(root).glob(".partial-step-*"):
        shutil.rmtree(partial, ignore_errors=True)


# --- saving -----------------------------------------------------------------------------------

class Checkpointer:
    """Saves one rank's part of the run's checkpoints under ``root``.

    ``kind="sharded"``: each rank writes its own pieces (a replicated strategy writes rank 0's
    only - the others hold the same). ``kind="full"``: rank 0 gathers every rank's pieces and
    writes one file of whole tensors.
    """

    def __init__(self, root: Path, rank: int, world_size: int, kind: str = "sharded",
                 keep: int = 2, asynchronous: bool = False, meta: dict | None = None,
                 device: torch.device | None = None):
        self.root, self.rank, self.world_size = Path(root), rank, world_size
        self.device = device or torch.device("cpu")
        self.kind, self.keep, self.asynchronous = kind, keep, asynchronous
        self.meta = meta or {}
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, strategy, step: int) -> float:
        """Returns the seconds training was blocked."""
        start = time.perf_counter()
        self.wait()  # one save in flight at a time
        state = strategy.checkpoint_state()
        state.update(step=step, rank=self.rank, rng=torch.get_rng_state())
        scaler = getattr(strategy, "scaler", None)  # fp16's (``Strategy.scaler``), every rank's alike
        if scaler is not None:
            state["scaler"] = scaler.state_dict()
        if self.device.type == "cuda":  # dropout and sampling on the GPU draw from its own generator
            state["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        writers = [0] if strategy.replicated else list(range(self.world_size))
        if self.kind == "full" and not strategy.replicated:
            gathered = [None] * self.world_size
            dist.all_gather_object(gathered, state)
            state, writers = (merge(gathered) if self.rank == 0 else None), [0]
        if self.rank in writers and state is not None:
            name = "full.pt" if self.kind == "full" else f"rank{self.rank}.pt"
            self._thread = threading.Thread(target=self._guarded, daemon=True,
                                            args=(state, step, name, writers))
            self._thread.start()
            if not self.asynchronous:
                self.wait()
        return time.perf_counter() - start

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, DiskError):
                raise error  # it names the file and says what to do: nothing to add
            raise RuntimeError(f"saving a checkpoint failed: {error}") from error

    def _guarded(self, state: dict, step: int, name: str, writers: list[int]) -> None:
        # the file writes of this thread are not wire bytes (dlab.comm.wire)
        try:
            with wire.meter.off_wire():
                self._write_and_commit(state, step, name, writers)
        except BaseException as e:  # noqa: BLE001 - re-raised on the main thread by wait()
            # a checkpoint that cannot be finished is no checkpoint: its part written so far
            # goes (on a full disk it is what fills it; the previous checkpoint stays)
            shutil.rmtree(_partial(self.root, step), ignore_errors=True)
            where = Path(e.filename) if isinstance(e, OSError) and e.filename else (
                _partial(self.root, step) / name)
            fewer = f"keep fewer checkpoints (keep_checkpoints={self.keep}), or " if self.keep > 1 else ""
            self._error = disk_error(e, where, instead=f"{fewer}{ELSEWHERE}") if isinstance(
                e, OSError) else e

    def _write_and_commit(self, state: dict, step: int, name: str, writers: list[int]) -> None:
        partial = _partial(self.root, step)
        partial.mkdir(parents=True, exist_ok=True)
        info = _write(state, partial / name)
        # written aside, then renamed: rank 0 polls for this file and must never read it half
        # written (a plain write_text let it read an empty file: "Expecting value")
        tmp = partial / f".rank{self.rank}.done.tmp"
        tmp.write_text(json.dumps({name: info}))
        os.replace(tmp, partial / f"rank{self.rank}.done")
        if self.rank != 0:
            return
        files = {}
        deadline = time.monotonic() + 600
        run = RunDir(self.root.parent)  # where the writers' pid files are, in a run
        for r in writers:  # the other writers' files, announced through the file system
            done = partial / f"rank{r}.done"
            polls = 0
            while not done.exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {r} never finished writing {partial}")
                # a writer killed midway never announces: say so at once (worded as a peer
                # gone, a symptom: the killed rank is the cause), not after the deadline, and
                # not by ignoring the teardown's SIGTERM (this rank would take it for a notice)
                if polls % 50 == 0 and run.rank_gone(r):
                    raise RuntimeError(f"rank {r}, a peer, ended before it finished writing its "
                                       f"part of {partial}")
                polls += 1
                time.sleep(0.01)
            files.update(json.loads(done.read_text()))
        manifest = {"format": FORMAT, "step": step, "kind": self.kind, "world_size": self.world_size,
                    "files": files, "created": time.time(), **self.meta}
        manifest["digest"] = digest(manifest)
        (partial / "manifest.json").write_text(json.dumps(manifest, indent=1))
        for r in writers:
            (partial / f"rank{r}.done").unlink()
        os.replace(partial, self.root / f"step-{step:08d}")
        for old in complete(self.root)[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)


def merge(states: list[dict]) -> dict:
    """Every rank's pieces put together into whole tensors (one piece each)."""
    out = {k: v for k, v in states[0].items() if k not in ("params", "optim")}
    out["params"] = _merge_section([s["params"] for s in states])
    names = {n for s in states for n in s["optim"]}
    out["optim"] = {}
    for n in sorted(names):
        keys = {k for s in states for k in s["optim"].get(n, {})}
        out["optim"][n] = {k: merge_one([s["optim"][n][k] for s in states if k in s["optim"].get(n, {})],
                                         f"optim {n}/{k}")
                           for k in keys}
    return out


def _merge_section(sections: list[dict]) -> dict:
    names = {n for s in sections for n in s}
    return {n: merge_one([s[n] for s in sections if n in s], f"params {n}") for n in sorted(names)}


def merge_one(parts: list, what: str = "a tensor"):
    """The whole tensor from its pieces; every element must come from a piece (the buffer is
    allocated uninitialised, so a gap would otherwise load as garbage)."""
    if isinstance(parts[0], torch.Tensor):  # a replicated scalar such as Adam's step
        return parts[0]
    shape = parts[0]["shape"]
    numel = int(torch.Size(shape).numel())
    full = torch.empty(numel, dtype=parts[0]["data"].dtype)
    covered = torch.zeros(numel, dtype=torch.bool)
    for p in parts:
        at = _whole_offsets(p, shape, what)
        full[at] = p["data"]
        covered[at] = True
    if not bool(covered.all()):
        missing = int((~covered).sum())
        first = int((~covered).nonzero()[0])
        raise CorruptCheckpoint(f"{what}: the pieces cover {numel - missing} of {numel} elements "
                                f"(first missing at flat offset {first}); a piece is missing or "
                                f"short; refusing to load it")
    return {"shape": shape, "start": 0, "data": full}


def _whole_offsets(p: dict, shape: list, what: str):
    """Where a piece's elements sit in the whole flattened tensor of ``shape``: a range, or,
    for a run over a slice (``"slice"``), the slice's flat offsets in the whole."""
    start, n = p["start"], p["data"].numel()
    cut = p.get("slice")
    numel = int(torch.Size(shape).numel())
    if cut is None:
        if p["shape"] != shape or start < 0 or start + n > numel:
            raise CorruptCheckpoint(f"{what}: a piece [{start}, {start + n}) of shape {p['shape']} "
                                    f"does not fit the tensor of shape {shape}; refusing to load it")
        return slice(start, start + n)
    dim, offset, size = cut
    sliced = numel // shape[dim] * size if 0 <= dim < len(shape) and shape[dim] else -1
    if (p["shape"] != shape or not 0 <= dim < len(shape) or offset < 0 or size < 0
            or offset + size > shape[dim] or start < 0 or start + n > sliced):
        raise CorruptCheckpoint(f"{what}: a piece [{start}, {start + n}) of the slice {size} at "
                                f"{offset} along dim {dim} does not fit the tensor of shape "
                                f"{shape}; refusing to load it")
    index = torch.arange(numel).view(shape).narrow(dim, offset, size).reshape(-1)
    return index[start:start + n]


# --- finding and loading ----------------------------------------------------------------------

def complete(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first (``.partial-*`` are not)."""
    if not Path(root).exists():
        return []
    return sorted(p for p in Path(root).glob("step-*") if (p / "manifest.json").exists())


def latest(root: Path) -> Path | None:
    found = complete(root)
    return found[-1] if found else None


# --- the state of a whole-model replica (single, torch-ddp, dlab's data parallelism) ----------

def replica_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  masters: list[torch.Tensor] | None = None) -> dict:
    """Parameters by name and the optimizer's per-parameter state, all whole tensors.
    The optimizer was built on ``model.parameters()``, or on ``masters`` (mixed precision: the
    fp32 copies it steps, one per parameter in the same order), so its i-th tensor is the i-th
    name; the parameters saved are the optimizer's own (the masters: the exact values, of which
    the 16-bit model is a rounding)."""
    names = [n for n, _ in model.named_parameters()]
    held = masters if masters else [p for _, p in model.named_parameters()]
    sd = optimizer.state_dict()
    optim = {}
    for i, name in enumerate(names):
        optim[name] = {k: (piece(v) if v.dim() else v.detach().to("cpu", copy=True))
                       for k, v in sd["state"].get(i, {}).items()}
    return {"params": {n: piece(p) for n, p in zip(names, held, strict=True)}, "optim": optim,
            "hparams": [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]}
