"""A run's configuration: every field declared once, with its kind, range and help, and the
checks of what the config alone can say (fields, model, devices, fault).

A field is declared by ``setting(...)``: the dataclass field, its ``Option`` (kind, range, help)
and its command-line flag in one place. ``FIELDS``, ``add_arguments`` (the flags of ``python -m
dlab run`` and ``python -m dlab.worker``) and ``from_args`` are derived from the declarations, so
a new field is one line here.

What the config cannot say alone - whether the strategy takes these options, whether a
checkpoint to resume from fits - is checked by ``dlab.worker.validate``, which ``launch``
runs before any process starts (and each worker again, for runs started by torchrun or Slurm
directly). Every message says what to change.
"""
from __future__ import annotations

import json
import os
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

from dlab import models
from dlab.core.machine import gpu_count
from dlab.core.options import Option


class ConfigError(ValueError):
    """A run configuration that cannot work; the message says what to change."""


#: the faults a run may ask for, and the keys each takes beyond rank, step and kind
#: (``dlab.runtime.faults`` injects them and says what each does)
FAULT_KINDS = ("raise", "kill", "hang", "exit", "slow", "preempt")
FAULT_EXTRA_KEYS = {"slow": ("delay_s", "steps")}


def setting(kind: str, help: str, default=MISSING, *, flag: str | None = None,
            short: str | None = None, metavar: str | None = None, **limits):
    """A ``RunConfig`` field: its default, its ``Option`` (kind, help, limits) and, when it is
    not ``--<name-with-dashes>``, its command-line ``flag`` (``short``: a one-letter alias)."""
    option = Option(kind, help, None if default is MISSING else default, **limits)
    meta = {"option": option, "flag": flag, "short": short, "metavar": metavar}
    if kind == "dict" and default is MISSING:
        return field(default_factory=dict, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class RunConfig:
    strategy: str = setting("str", "a strategy name (python -m dlab strategies lists them)")
    world_size: int = setting("int", "the number of ranks", 2, minimum=1, short="-n")
    steps: int = setting("int", "optimizer steps to run", 20, minimum=1)
    model: str = setting("choice", "the model every rank trains", "gpt",
                         choices=tuple(models.MODELS))
    model_options: dict = setting("dict", "model settings by name, e.g. {'n_layer': 4} "
                                  "(--model-opt n_layer=4, repeatable)", flag="--model-opt")
    batch_size: int = setting("int", "the global batch, in sequences (samples for the mlp)", 8,
                              minimum=1)
    optimizer: str = setting("choice", "the optimizer every rank builds", "adam",
                             choices=("adam", "sgd"))
    lr: float = setting("number", "the learning rate, e.g. 3e-3", 3e-3, minimum=0, above=True)
    seed: int = setting("int", "the seed of weights, data and sampling", 0, minimum=0)
    backend: str = setting("choice", "auto picks NCCL with a GPU per rank, else Gloo", "auto",
                           choices=("auto", "gloo", "nccl"))
    device: str = setting("choice", "auto follows the backend", "auto",
                          choices=("auto", "cpu", "cuda"))
    threads_per_rank: int = setting("int", "CPU threads each rank may use", 1, minimum=1,
                                    flag="--threads")
    timeout_s: float = setting("number", "seconds every collective, the rendezvous and every "
                               "step may take before the run is ended", 60.0, minimum=0,
                               above=True, flag="--timeout")
    options: dict = setting("dict", "strategy options by name, e.g. {'bucket_cap_mb': 1} "
                            "(--opt bucket_cap_mb=1, repeatable)", flag="--opt")
    fault: dict | None = setting(
        "dict", "a fault caused on purpose: {'rank': r, 'step': s, 'kind': 'raise'|'kill'|'hang'|"
        "'exit'|'preempt'}, or {'kind': 'slow', 'rank': r, 'step': s, 'delay_s': d, 'steps': k} "
        "(--fault RANK:STEP:KIND or RANK:STEP:slow:DELAY_S[:STEPS])", None, none_ok=True,
        metavar="RANK:STEP:KIND")
    save_final: bool = setting("bool", "every rank writes the full final parameters to "
                               "final_state_rank{r}.pt (rank 0 also to final_state.pt)", False)
    checkpoint_every: int = setting("int", "steps between checkpoints, 0 for none", 0, minimum=0)
    checkpoint_kind: str = setting("choice", "a file per rank, or one gathered file", "sharded",
                                   choices=("sharded", "full"))
    checkpoint_async: bool = setting("bool", "write checkpoints in a thread while training "
                                     "goes on", False)
    keep_checkpoints: int = setting("int", "how many complete checkpoints to keep", 2, minimum=1)
    resume: str = setting("str", "'' (none), 'latest' (this run directory's newest checkpoint), "
                          "or a checkpoint or run directory", "", metavar="latest|PATH")
    max_restarts: int = setting("int", "torchrun restarts every rank this often after a "
                                "failure", 0, minimum=0)
    name: str = setting("str", "a label for the run directory, e.g. 'ddp-small'", "")

    # --- derived -------------------------------------------------------------------------
    def model_config(self):
        return models.model_config(self.model, self.model_options)

    def resolved_backend(self) -> str:
        """``auto`` is NCCL when every rank can have its own GPU, else Gloo on the CPU."""
        if self.backend != "auto":
            return self.backend
        if self.device == "cpu":
            return "gloo"
        return "nccl" if gpu_count() >= self.world_size else "gloo"

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        return "cuda" if self.resolved_backend() == "nccl" else "cpu"

    # --- what the config alone can say -----------------------------------------------------
    def problems(self) -> list[str]:
        """Every reason this config cannot run that it can tell by itself, each saying what to
        change: the kinds and ranges of the fields first, then the model's options, the
        devices and the fault. (``dlab.worker.validate`` adds the strategy's checks and the
        checkpoint to resume from.)"""
        p = self.field_problems()
        if p:  # the checks below compare and divide fields, so they need the right kinds
            return p
        return (models.problems(self.model, self.model_options) + self.device_problems()
                + self.fault_problems())

    def field_problems(self, names=None) -> list[str]:
        """The kind and range of each field in ``names`` (default: all), from ``FIELDS``."""
        p = [problem for name in (names or FIELDS)
             if (problem := FIELDS[name].problem(name, getattr(self, name), label="")) is not None]
        if isinstance(self.name, str) and (names is None or "name" in names):
            p += _name_problems(self.name)
        return p

    def device_problems(self) -> list[str]:
        p = []
        if os.name != "posix":  # start_new_session, killpg: what stops a run whole
            p.append("dlab runs each job in its own process session and ends it with POSIX "
                     "signals, which this system lacks: use Linux, or WSL on Windows")
        gpus = gpu_count()
        if self.backend == "nccl" and gpus == 0:
            p.append("backend='nccl' needs CUDA GPUs and this machine has none; "
                     "use backend='gloo' (or 'auto')")
        elif self.backend == "nccl" and gpus < self.world_size:
            p.append(f"backend='nccl' needs one GPU per rank: world_size={self.world_size} but "
                     f"{gpus} GPU(s) here; lower world_size or use backend='gloo' "
                     f"(ranks may share a GPU under Gloo)")
        if self.device == "cuda" and gpus == 0:
            p.append("device='cuda' but this machine has no CUDA GPU; use device='cpu' or 'auto'")
        if self.backend == "nccl" and self.device == "cpu":
            p.append("NCCL moves CUDA tensors only; use backend='gloo' with device='cpu'")
        return p

    def fault_problems(self) -> list[str]:
        if self.fault is None:
            return []
        f = self.fault
        p = []
        kind = f.get("kind")
        if kind not in FAULT_KINDS:
            p.append(f"fault kind must be one of {FAULT_KINDS} (got {kind!r})")
        keys = ["rank", "step", "kind", *FAULT_EXTRA_KEYS.get(kind, ())]
        unknown = sorted(set(f) - set(keys), key=str)
        if unknown:
            kind_s = f"a {kind!r} " if kind in FAULT_EXTRA_KEYS else ""
            p.append(f"{kind_s}fault takes the keys {', '.join(keys[:-1])} and {keys[-1]} "
                     f"(got also {unknown})")
        rank = f.get("rank", 0)
        if not _whole(rank) or not 0 <= rank < max(self.world_size, 1):
            p.append(f"fault rank {rank!r} is not a rank of this run (0..{self.world_size - 1})")
        step = f.get("step", 0)
        if not _whole(step) or not 0 <= step < max(self.steps, 1):
            p.append(f"fault step {step!r} is outside the run's steps (0..{self.steps - 1})")
        if kind == "slow":
            delay = f.get("delay_s")
            number = isinstance(delay, (int, float)) and not isinstance(delay, bool)
            if not number or not 0 < delay < self.timeout_s:
                p.append(f"a 'slow' fault needs delay_s, seconds of delay per step, above 0 and "
                         f"below timeout_s={self.timeout_s:g} (got {delay!r}), e.g. "
                         f"{{'kind': 'slow', 'rank': 1, 'step': 2, 'delay_s': 0.1}}")
            n = f.get("steps")
            if n is not None and (not _whole(n) or n < 1):
                p.append(f"a 'slow' fault's steps is how many steps it lasts, at least 1, or "
                         f"absent for the rest of the run (got {n!r})")
        if kind == "preempt" and not self.checkpoint_every:
            p.append("a 'preempt' fault needs checkpoint_every > 0: the checkpoint it writes at "
                     "the notice goes where the run's checkpoints go, and resumes from there")
        return p

    # --- files ---------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return asdict(self)

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))

    @classmethod
    def from_dict(cls, d: dict) -> RunConfig:
        unknown = sorted(set(d) - set(FIELDS))
        if unknown:
            raise ConfigError(f"unknown config key(s) {unknown}; known keys: {sorted(FIELDS)}")
        if "strategy" not in d:
            raise ConfigError("a config needs a strategy, e.g. strategy='ddp'")
        return cls(**d)

    @classmethod
    def load(cls, path: Path) -> RunConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))


#: every field's ``Option``, by name, read off the declarations above
FIELDS: dict[str, Option] = {f.name: f.metadata["option"] for f in fields(RunConfig)}


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _name_problems(name: str) -> list[str]:
    """The name becomes part of a directory name: one path component, printable, not too long."""
    if not name:
        return []
    bad = sorted({c for c in name if c in '/\\:*?"<>|' or not c.isprintable()})
    if bad or name in (".", "..") or len(name) > 100:
        return [f"name {name!r} cannot be part of a directory name (it has {bad or 'no usable form'}"
                f"{'' if len(name) <= 100 else ', over 100 characters'}); use letters, digits, "
                f"'-', '_' and '.', e.g. 'ddp-small'"]
    return []


# --- command-line flags (``python -m dlab run`` and ``python -m dlab.worker``), derived -----

def _value(text: str):
    """``k=v`` values: JSON when they parse (numbers, true/false, lists), else the string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _pairs(items: list[str] | None, flag: str) -> dict:
    out = {}
    for item in items or []:
        if "=" not in item:
            raise ConfigError(f"{flag} takes key=value (got {item!r})")
        key, val = item.split("=", 1)
        out[key] = _value(val)
    return out


def _fault(text: str | None) -> dict | None:
    if not text:
        return None
    try:
        r, s, kind, *extra = text.split(":")
        fault = {"rank": int(r), "step": int(s), "kind": kind}
        if kind == "slow":
            fault["delay_s"] = float(extra.pop(0))
            if extra:
                fault["steps"] = int(extra.pop(0))
        if extra:
            raise ValueError
    except (ValueError, IndexError):
        raise ConfigError(
            f"--fault takes RANK:STEP:KIND, e.g. 1:3:raise, or RANK:STEP:slow:DELAY_S[:STEPS], "
            f"e.g. 1:2:slow:0.1:5 (got {text!r})") from None
    return fault


def _flag(f) -> str:
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


def add_arguments(parser, strategy_required: bool = True) -> None:
    """One flag per ``RunConfig`` field, its help and default from the declaration."""
    for f in fields(RunConfig):
        option: Option = f.metadata["option"]
        if f.name == "strategy":
            parser.add_argument("strategy", nargs=None if strategy_required else "?",
                                help=option.help)
            continue
        names = [_flag(f)] + ([f.metadata["short"]] if f.metadata["short"] else [])
        kw = {"dest": f.name, "help": option.help, "metavar": f.metadata["metavar"]}
        if option.kind == "bool":
            kw = {"dest": f.name, "help": option.help, "action": "store_true"}
        elif option.kind == "dict" and f.name != "fault":
            kw.update(action="append", metavar="KEY=VALUE")
        else:
            kw.update(default=option.default,
                      type={"int": int, "number": float}.get(option.kind, str))
            if option.kind == "choice":
                kw["choices"] = option.choices
        parser.add_argument(*names, **{k: v for k, v in kw.items() if v is not None})


def from_args(args) -> RunConfig:
    """The ``RunConfig`` of flags parsed by ``add_arguments``."""
    values = {}
    for f in fields(RunConfig):
        value = getattr(args, f.name)
        if f.name == "fault":
            value = _fault(value)
        elif f.metadata["option"].kind == "dict":
            value = _pairs(value, _flag(f))
        values[f.name] = value
    return RunConfig(**values)
