"""A run's configuration, and the checks that refuse a run that cannot work.

``RunConfig.validate()`` runs in ``launch()`` before any process starts (and again in each
worker, for runs started by torchrun or Slurm directly). Every message says what to change.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from dlab import models
from dlab.runtime.faults import EXTRA_KEYS as FAULT_EXTRA_KEYS
from dlab.runtime.faults import KINDS as FAULT_KINDS

BYTE_VOCAB = 256  # dlab.models.data feeds bytes: every token id is one of 256 values


class ConfigError(ValueError):
    """A run configuration that cannot work; the message says what to change."""


@dataclass(frozen=True)
class Option:
    """A config field or a strategy option: its kind, the values it may take and what it does
    (``help``, shown when a value is refused). ``kind`` is ``"int"`` (a whole number, not a
    bool), ``"number"`` (a finite int or float), ``"bool"``, ``"str"``, ``"dict"`` or
    ``"choice"`` (one of ``choices``); ``minimum`` bounds numbers (``above`` makes it strict);
    ``none_ok`` lets None through (e.g. "unbounded"). Strategies declare theirs in
    ``Strategy.OPTIONS``; the run's fields are in ``FIELDS``."""

    kind: str
    help: str
    default: object = None
    minimum: float | None = None
    above: bool = False
    choices: tuple = ()
    none_ok: bool = False

    def problem(self, name: str, value, label: str = "option ") -> str | None:
        """What is wrong with ``value``, as a sentence saying what to use; None when it fits."""
        if value is None and self.none_ok:
            return None
        ok = {"int": isinstance(value, int) and not isinstance(value, bool),
              "number": isinstance(value, (int, float)) and not isinstance(value, bool)
              and math.isfinite(value),
              "bool": isinstance(value, bool),
              "str": isinstance(value, str),
              "dict": isinstance(value, dict),
              "choice": value in self.choices if _hashable(value) else False}[self.kind]
        if ok and self.minimum is not None and (value <= self.minimum if self.above
                                                else value < self.minimum):
            ok = False
        if ok:
            return None
        if self.kind == "choice":
            return (f"{label}{name}={value!r} is not one of {list(self.choices)}; {name} must be "
                    f"one of those: {self.help}")
        return f"{label}{name} must be {self.describe()} (got {value!r}): {self.help}"

    def describe(self) -> str:
        if self.kind == "bool":
            return "True or False"
        if self.kind == "choice":
            return "one of " + ", ".join(repr(c) for c in self.choices)
        if self.kind in ("str", "dict"):
            return ("a string" if self.kind == "str" else "a dict") + (" or None" if self.none_ok else "")
        what = "a whole number" if self.kind == "int" else "a finite number"
        if self.kind == "number" and self.minimum == 0 and self.above:
            what = "a positive finite number"
        elif self.minimum is not None:
            what += f" {'>' if self.above else '>='} {self.minimum:g}"
        return what + (" or None" if self.none_ok else "")


def _hashable(value) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


#: the MoE model options that change training (capacity, balancing losses), and the
#: strategies that implement them as ``single`` does (``dlab.models.moe``)
MOE_TRAINING = ("capacity_factor", "aux_loss", "z_loss")
MOE_TRAINING_STRATEGIES = ("single", "ep")


@dataclass
class RunConfig:
    strategy: str
    world_size: int = 2
    steps: int = 20
    model: str = "gpt"
    model_options: dict = field(default_factory=dict)  # e.g. {"n_layer": 4, "d_model": 128}
    batch_size: int = 8  # the global batch, in sequences (or samples for the MLP)
    optimizer: str = "adam"
    lr: float = 3e-3
    seed: int = 0
    backend: str = "auto"  # auto | gloo | nccl
    device: str = "auto"  # auto | cpu | cuda
    threads_per_rank: int = 1
    timeout_s: float = 60.0  # deadline for the rendezvous, every collective and every step
    options: dict = field(default_factory=dict)  # strategy-specific, see each strategy's doc
    fault: dict | None = None  # {"rank": r, "step": s, "kind": ...}: dlab.runtime.faults
    save_final: bool = False  # every rank writes the full final parameters (final_state_rank{r}.pt)
    checkpoint_every: int = 0  # steps between checkpoints (0: none)
    checkpoint_kind: str = "sharded"  # sharded (a file per rank) | full (one gathered file)
    checkpoint_async: bool = False  # write in a thread while training goes on
    keep_checkpoints: int = 2
    resume: str = ""  # "latest" (this run directory's newest checkpoint), or a checkpoint or run path
    max_restarts: int = 0  # torchrun restarts every rank this often after a failure
    name: str = ""

    # --- derived -------------------------------------------------------------------------
    def model_config(self):
        return models.model_config(self.model, self.model_options)

    def resolved_backend(self) -> str:
        """``auto`` is NCCL when every rank can have its own GPU, else Gloo on the CPU."""
        if self.backend != "auto":
            return self.backend
        if self.device == "cpu":
            return "gloo"
        return "nccl" if _gpu_count() >= self.world_size else "gloo"

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        return "cuda" if self.resolved_backend() == "nccl" else "cpu"

    # --- validation ----------------------------------------------------------------------
    def validate(self) -> RunConfig:
        problems = self.problems()
        if problems:
            raise ConfigError("this run cannot start:\n  - " + "\n  - ".join(problems))
        return self

    def problems(self) -> list[str]:
        """Every reason this config cannot run, each saying what to change. Kinds and ranges of
        the fields first (``FIELDS``), then the model's options, devices, fault and
        checkpoints; the strategy's option kinds and its own checks only once those hold."""
        p = self.field_problems()
        if p:  # the checks below compare and divide fields, so they need the right kinds
            return p
        p += self._model_problems()
        p += self._device_problems()
        p += self._fault_problems()
        p += self._checkpoint_problems()
        if p:  # strategy checks assume the basics hold
            return p
        from dlab import parallel
        try:
            strategy = parallel.get(self.strategy)
        except ValueError as e:
            return [str(e)]
        if (self.checkpoint_every or self.resume) and not strategy.can_checkpoint():
            return [f"strategy {self.strategy!r} cannot save checkpoints yet; "
                    f"set checkpoint_every=0 and resume=''"]
        trained_moe = [k for k in MOE_TRAINING if self.model_options.get(k)]
        if self.model == "moe" and trained_moe and self.strategy not in MOE_TRAINING_STRATEGIES:
            return [f"model options {', '.join(trained_moe)} are built for "
                    f"{' and '.join(MOE_TRAINING_STRATEGIES)} (whole-batch expert counts, losses "
                    f"taken where every layer's router is): use one of them, or drop the options"]
        return strategy.option_problems(self) or strategy.problems(self)

    def field_problems(self, names=None) -> list[str]:
        """The kind and range of each field in ``names`` (default: all), from ``FIELDS``."""
        p = [problem for name in (names or FIELDS)
             if (problem := FIELDS[name].problem(name, getattr(self, name), label="")) is not None]
        if isinstance(self.name, str) and (names is None or "name" in names):
            p += _name_problems(self.name)
        return p

    def _model_problems(self) -> list[str]:
        try:
            mc = self.model_config()
        except (ValueError, TypeError) as e:
            return [str(e)]
        p = []
        for name, value in self.model_options.items():
            kind = type(mc.__dataclass_fields__[name].default)
            if kind in (bool, str):
                ok = isinstance(value, kind)
            elif kind is float:
                ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
                      and math.isfinite(value))
            else:
                ok = isinstance(value, int) and not isinstance(value, bool)
            if not ok:
                what = {bool: "True or False", str: "a string",
                        float: "a finite number"}.get(kind, "a whole number")
                p.append(f"model option {name} must be {what} (got {value!r})")
        if p:
            return p
        p += mc.problems()
        vocab = getattr(mc, "vocab_size", None)
        if vocab is not None and vocab < BYTE_VOCAB:
            p.append(f"model option vocab_size={vocab} is smaller than the data's {BYTE_VOCAB} "
                     f"token values (the corpus is bytes); use vocab_size >= {BYTE_VOCAB}")
        return p

    def _checkpoint_problems(self) -> list[str]:
        p = []
        if self.resume not in ("", "latest"):
            from dlab.runtime.checkpoint import resume_problems
            try:
                p += resume_problems(self, self.resume)
            except FileNotFoundError as e:
                p.append(f"resume: {e}")
            except ValueError:  # the model config is wrong: reported on its own above
                pass
        if self.max_restarts and not self.checkpoint_every:
            p.append("max_restarts without checkpoints restarts from step 0; "
                     "set checkpoint_every (e.g. 5) too")
        return p

    def _device_problems(self) -> list[str]:
        p = []
        if os.name != "posix":  # start_new_session, killpg: what stops a run whole
            p.append("dlab runs each job in its own process session and ends it with POSIX "
                     "signals, which this system lacks: use Linux, or WSL on Windows")
        gpus = _gpu_count()
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

    def _fault_problems(self) -> list[str]:
        if self.fault is None:
            return []
        f = self.fault
        p = []
        kind = f.get("kind")
        if kind not in FAULT_KINDS:
            p.append(f"fault kind must be one of {FAULT_KINDS} (got {kind!r})")
        keys = ["rank", "step", "kind", *sorted(FAULT_EXTRA_KEYS.get(kind, ()))]
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
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown config key(s) {unknown}; known keys: {sorted(known)}")
        if "strategy" not in d:
            raise ConfigError("a config needs a strategy, e.g. strategy='ddp'")
        return cls(**d)

    @classmethod
    def load(cls, path: Path) -> RunConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))


FIELDS = {
    "strategy": Option("str", "a strategy name (python -m dlab strategies lists them)"),
    "world_size": Option("int", "the number of ranks", minimum=1),
    "steps": Option("int", "optimizer steps to run", minimum=1),
    "model": Option("str", "gpt, moe or mlp"),
    "model_options": Option("dict", "model settings by name, e.g. {'n_layer': 4}"),
    "batch_size": Option("int", "the global batch, in sequences (samples for the mlp)", minimum=1),
    "optimizer": Option("choice", "the optimizer every rank builds", choices=("adam", "sgd")),
    "lr": Option("number", "the learning rate, e.g. 3e-3", minimum=0, above=True),
    "seed": Option("int", "the seed of weights, data and sampling", minimum=0),
    "backend": Option("choice", "auto picks NCCL with a GPU per rank, else Gloo",
                      choices=("auto", "gloo", "nccl")),
    "device": Option("choice", "auto follows the backend", choices=("auto", "cpu", "cuda")),
    "threads_per_rank": Option("int", "CPU threads each rank may use", minimum=1),
    "timeout_s": Option("number", "seconds every collective, the rendezvous and every step "
                        "may take before the run is ended", minimum=0, above=True),
    "options": Option("dict", "strategy options by name, e.g. {'bucket_cap_mb': 1}"),
    "fault": Option("dict", "{'rank': r, 'step': s, 'kind': 'raise'|'kill'|'hang'|'exit'|"
                    "'preempt'}, or {'kind': 'slow', 'rank': r, 'step': s, 'delay_s': d, "
                    "'steps': k}",
                    none_ok=True),
    "save_final": Option("bool", "every rank writes the full final parameters to "
                                 "final_state_rank{r}.pt (rank 0 also to final_state.pt)"),
    "checkpoint_every": Option("int", "steps between checkpoints, 0 for none", minimum=0),
    "checkpoint_kind": Option("choice", "a file per rank, or one gathered file",
                              choices=("sharded", "full")),
    "checkpoint_async": Option("bool", "write checkpoints in a thread while training goes on"),
    "keep_checkpoints": Option("int", "how many complete checkpoints to keep", minimum=1),
    "resume": Option("str", "'' (none), 'latest', or a checkpoint or run directory"),
    "max_restarts": Option("int", "torchrun restarts after a failure", minimum=0),
    "name": Option("str", "a label for the run directory, e.g. 'ddp-small'"),
}


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


def _gpu_count() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# --- command-line flags (shared by ``python -m dlab run`` and ``python -m dlab.worker``) ------

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


def add_arguments(parser, strategy_required: bool = True) -> None:
    d = RunConfig(strategy="")
    parser.add_argument("strategy", nargs=None if strategy_required else "?",
                        help="strategy name (python -m dlab strategies lists them)")
    parser.add_argument("--world-size", "-n", type=int, default=d.world_size)
    parser.add_argument("--steps", type=int, default=d.steps)
    parser.add_argument("--model", default=d.model, help="gpt or mlp")
    parser.add_argument("--model-opt", action="append", metavar="KEY=VALUE",
                        help="model option, e.g. n_layer=4 (repeatable)")
    parser.add_argument("--batch-size", type=int, default=d.batch_size, help="global batch")
    parser.add_argument("--optimizer", default=d.optimizer)
    parser.add_argument("--lr", type=float, default=d.lr)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--backend", default=d.backend)
    parser.add_argument("--device", default=d.device)
    parser.add_argument("--threads", type=int, default=d.threads_per_rank, help="threads per rank")
    parser.add_argument("--timeout", type=float, default=d.timeout_s,
                        help="deadline in seconds for the rendezvous, each collective and each step")
    parser.add_argument("--opt", action="append", metavar="KEY=VALUE",
                        help="strategy option, e.g. bucket_cap_mb=1 (repeatable)")
    parser.add_argument("--fault", metavar="RANK:STEP:KIND",
                        help=f"inject a fault; KIND is one of {', '.join(FAULT_KINDS)}")
    parser.add_argument("--save-final", action="store_true")
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--checkpoint-kind", default=d.checkpoint_kind, help="sharded or full")
    parser.add_argument("--checkpoint-async", action="store_true")
    parser.add_argument("--resume", default="", metavar="latest|PATH",
                        help="start from a checkpoint: this run's newest, or a checkpoint or run directory")
    parser.add_argument("--max-restarts", type=int, default=0)
    parser.add_argument("--name", default="")


def from_args(args) -> RunConfig:
    fault = None
    if args.fault:
        try:
            r, s, kind, *extra = args.fault.split(":")
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
                f"e.g. 1:2:slow:0.1:5 (got {args.fault!r})") from None
    return RunConfig(
        strategy=args.strategy, world_size=args.world_size, steps=args.steps, model=args.model,
        model_options=_pairs(args.model_opt, "--model-opt"), batch_size=args.batch_size,
        optimizer=args.optimizer, lr=args.lr, seed=args.seed, backend=args.backend,
        device=args.device, threads_per_rank=args.threads, timeout_s=args.timeout,
        options=_pairs(args.opt, "--opt"), fault=fault, save_final=args.save_final,
        checkpoint_every=args.checkpoint_every, checkpoint_kind=args.checkpoint_kind,
        checkpoint_async=args.checkpoint_async, resume=args.resume,
        max_restarts=args.max_restarts, name=args.name)
