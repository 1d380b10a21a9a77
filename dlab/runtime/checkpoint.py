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


def _digest(manifest: dict) -> str:
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


def _sha256(path: Path) -> str:
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
    return {"bytes": path.stat().st_size, "sha256": _sha256(path)}


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
        manifest["digest"] = _digest(manifest)
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
        out["optim"][n] = {k: _merge_one([s["optim"][n][k] for s in states if k in s["optim"].get(n, {})],
                                         f"optim {n}/{k}")
                           for k in keys}
    return out


def _merge_section(sections: list[dict]) -> dict:
    names = {n for s in sections for n in s}
    return {n: _merge_one([s[n] for s in sections if n in s], f"params {n}") for n in sorted(names)}


def _merge_one(parts: list, what: str = "a tensor"):
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


def find(path: str | Path) -> Path:
    """A checkpoint directory, or the newest complete one of a run directory."""
    path = Path(path)
    if (path / "manifest.json").exists():
        return path
    newest = latest(path / "checkpoints")
    if newest is None:
        raise FileNotFoundError(f"{path} is neither a checkpoint nor a run with a complete one")
    return newest


def read_manifest(path: Path) -> dict:
    """The checkpoint's manifest, its format and digest checked; ``CorruptCheckpoint`` naming
    the file otherwise."""
    file = Path(path) / "manifest.json"
    try:
        manifest = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptCheckpoint(f"{file}: cannot be read as JSON ({e}); refusing to load it") from None
    if not isinstance(manifest, dict) or manifest.get("format") not in READABLE:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise CorruptCheckpoint(f"{file}: not a {FORMAT} checkpoint (format {found!r}); save it "
                                f"again with this dlab")
    if manifest.get("digest") != _digest(manifest):
        raise CorruptCheckpoint(f"{file}: its digest does not match its contents (edited or "
                                f"corrupt); refusing to load it")
    return manifest


def settings_problems(config, recorded: dict, where: Path) -> list[str]:
    """Why ``config`` cannot go on from a checkpoint trained with ``recorded`` (``optimizer``,
    ``lr``; a key that is None is not known and not checked): what it holds would not be
    honoured. Another optimizer's state has other keys (every rank would fail on Adam's missing
    ``exp_avg``); another learning rate would be overwritten by the checkpoint's
    hyper-parameters, so the run would train at the old rate while its config said the new."""
    p = []
    optimizer, lr = recorded.get("optimizer"), recorded.get("lr")
    if optimizer is not None and optimizer != config.optimizer:
        p.append(f"resume: the checkpoint {where} holds the state of optimizer={optimizer!r} and "
                 f"this run has optimizer={config.optimizer!r}, which cannot start from it; set "
                 f"optimizer={optimizer!r} (--optimizer {optimizer}) or start without resume")
    if lr is not None and lr != config.lr:
        p.append(f"resume: the checkpoint {where} was trained at lr={lr} and this run asks for "
                 f"lr={config.lr}; a resume goes on at the checkpoint's rate (dlab has no "
                 f"learning-rate schedule), so set lr={lr} (--lr {lr}), or start without resume")
    return p


def resume_problems(config, path: str | Path) -> list[str]:
    """Why ``config`` cannot resume from the checkpoint at ``path`` (a checkpoint or a run
    directory): a manifest that does not verify, another model, another optimizer or learning
    rate (``settings_problems``), or nothing left to run. The layout (strategy, world size,
    options, precision included) may differ: pieces reshard, and masters are fp32 in every
    precision."""
    where = find(path)
    try:
        manifest = read_manifest(where)
    except CorruptCheckpoint as e:
        return [f"resume: {e}"]
    p = []
    for name in manifest["files"]:
        if not (where / name).exists():
            p.append(f"resume: {where / name} is listed in the manifest but missing")
    if manifest.get("model") != config.model:
        p.append(f"resume: the checkpoint {where} holds model={manifest.get('model')!r}, this run "
                 f"model={config.model!r}; use the same model or another checkpoint")
    else:
        from dataclasses import asdict
        mc = config.model_config()
        theirs, mine = manifest.get("model_config", {}), asdict(mc)
        # how the model runs (activation recomputation, the attention core) is no part of its
        # parameters: a checkpoint written under one setting loads under another
        runtime = set(getattr(mc, "EXECUTION_FIELDS", ()))
        differ = [k for k in sorted(set(theirs) | set(mine))
                  if k not in runtime and theirs.get(k) != mine.get(k)]
        if differ:
            p.append("resume: the checkpoint " + str(where) + " does not fit this model: " + ", ".join(
                f"checkpoint has {k}={theirs.get(k)!r}, this run {k}={mine.get(k)!r}" for k in differ)
                + "; set the same model_options or start without resume")
    # a checkpoint written before the manifest recorded them is checked on load (Reader.settings)
    p += settings_problems(config, manifest, where)
    step = manifest.get("step", 0)
    if isinstance(config.steps, int) and step >= config.steps:
        p.append(f"resume: the checkpoint is at step {step} and steps={config.steps}: nothing to "
                 f"run; raise steps above {step}")
    return p


class Reader:
    """A verified checkpoint, read at any layout: ``tensor(section, name[, key])`` assembles the
    whole tensor, ``range(...)`` a 1-D run of it, from whichever files hold the pieces."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        self.states = {}
        for name, info in self.manifest["files"].items():
            file = self.path / name
            if not file.exists() or file.stat().st_size != info["bytes"]:
                raise CorruptCheckpoint(f"{file}: missing or of the wrong size "
                                        f"(manifest says {info['bytes']} bytes); refusing to load it")
            if _sha256(file) != info["sha256"]:
                raise CorruptCheckpoint(f"{file}: SHA-256 does not match the manifest; the file is "
                                        f"corrupt; refusing to load it")
            # map_location: a file from an older writer may hold device tensors
            self.states[name] = torch.load(file, weights_only=True, map_location="cpu")
        self.step = self.manifest["step"]
        self._whole: dict[tuple, torch.Tensor] = {}  # assembled once: a loader reads many ranges

    def _pieces(self, section: str, name: str, key: str | None) -> list:
        out = []
        for s in self.states.values():
            entry = s[section].get(name)
            if entry is not None and key is not None:
                entry = entry.get(key)
            if entry is not None:
                out.append(entry)
        if not out:
            raise KeyError(f"{self.path} holds no {section} entry {name}{'/' + key if key else ''}")
        return out

    def has(self, section: str, name: str) -> bool:
        return any(name in s[section] for s in self.states.values())

    def keys(self, name: str) -> set[str]:
        return {k for s in self.states.values() for k in s["optim"].get(name, {})}

    def tensor(self, section: str, name: str, key: str | None = None) -> torch.Tensor:
        if (section, name, key) not in self._whole:
            what = f"{self.path}: {section} {name}{'/' + key if key else ''}"
            merged = _merge_one(self._pieces(section, name, key), what)
            self._whole[section, name, key] = (merged if isinstance(merged, torch.Tensor)
                                               else merged["data"].view(merged["shape"]))
        return self._whole[section, name, key]

    def range(self, section: str, name: str, start: int, numel: int, key: str | None = None) -> torch.Tensor:
        return self.tensor(section, name, key).reshape(-1)[start:start + numel]

    def hparams(self) -> list[dict]:
        return next(iter(self.states.values()))["hparams"]

    def settings(self) -> dict:
        """The ``optimizer`` and ``lr`` the checkpoint was trained with: the manifest's, or, in
        one written before the manifest recorded them, read off the optimizer's
        hyper-parameters (Adam's groups have ``betas``, SGD's ``momentum``)."""
        if "optimizer" in self.manifest:
            return {"optimizer": self.manifest["optimizer"], "lr": self.manifest.get("lr")}
        groups = self.hparams()
        if not groups:
            return {}
        kind = "adam" if "betas" in groups[0] else "sgd" if "momentum" in groups[0] else None
        return {"optimizer": kind, "lr": groups[0].get("lr")}

    def scaler(self) -> dict | None:
        """fp16's loss scaler state (``LossScaler.state_dict``) when the run that wrote it had
        one; every rank's is the same."""
        return next(iter(self.states.values())).get("scaler")

    def rng(self, rank: int, generator: str = "rng") -> torch.Tensor | None:
        """Rank ``rank``'s saved state of the CPU generator (``"rng"``) or of its GPU's
        (``"cuda_rng"``, None when it was written on the CPU); a rank the checkpoint has no file
        of (a replicated run writes rank 0's only) gets the first file's."""
        for s in self.states.values():
            if s["rank"] == rank:
                return s.get(generator)
        return next(iter(self.states.values())).get(generator)


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


def load_replica(model: torch.nn.Module, optimizer: torch.optim.Optimizer, reader: Reader,
                 masters: list[torch.Tensor] | None = None) -> None:
    """The inverse of ``replica_state``: with ``masters``, the checkpoint's fp32 values go into
    them and the model's working copy is derived from them (rounded once to its dtype), as after
    an optimizer step."""
    names = [n for n, _ in model.named_parameters()]
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            saved = reader.tensor("params", name).view_as(p)
            if masters:
                masters[i].copy_(saved)
                p.copy_(masters[i])
            else:
                p.copy_(saved)
    state = {i: {k: reader.tensor("optim", n, k) for k in reader.keys(n)}
             for i, n in enumerate(names) if reader.keys(n)}
    groups = [dict(h, params=g["params"]) for h, g in
              zip(reader.hparams(), optimizer.state_dict()["param_groups"])]
    optimizer.load_state_dict({"state": state, "param_groups": groups})
