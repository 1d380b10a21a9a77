"""Checkpoints read back: a checkpoint found (a directory, or a run's newest complete one), its
manifest's format and digest checked, every file's size and SHA-256 checked against it, a resume
refused before it starts when the checkpoint's model, optimizer or learning rate is not the run's
(``resume_problems``), and any tensor (or any range of one) assembled from whichever files hold
its pieces (``Reader``), so a checkpoint loads at another world size or layout. The format, and
how it is written, are ``dlab.runtime.checkpoint``'s.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from dlab.runtime.checkpoint import (
    FORMAT,
    READABLE,
    CorruptCheckpoint,
    digest,
    file_sha256,
    latest,
    merge_one,
)


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
    if manifest.get("digest") != digest(manifest):
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
            if file_sha256(file) != info["sha256"]:
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
            merged = merge_one(self._pieces(section, name, key), what)
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
