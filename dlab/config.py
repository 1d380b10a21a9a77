"""A run's configuration, and the checks that refuse a run that cannot work.

``RunConfig.validate()`` runs in ``launch()`` before any process starts (and again in each
worker, for runs started by torchrun or Slurm directly). Every message says what to change.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from dlab import models

FAULT_KINDS = ("raise", "kill", "hang", "exit")


class ConfigError(ValueError):
    """A run configuration that cannot work; the message says what to change."""


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
    timeout_s: float = 60.0  # deadline for rendezvous and for every collective
    options: dict = field(default_factory=dict)  # strategy-specific, see each strategy's doc
    fault: dict | None = None  # {"rank": r, "step": s, "kind": raise|kill|hang|exit}
    save_final: bool = False  # rank 0 writes the full final parameters to final_state.pt
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
        p: list[str] = []
        if not isinstance(self.world_size, int) or self.world_size < 1:
            p.append(f"world_size must be a whole number >= 1 (got {self.world_size!r})")
        if not isinstance(self.steps, int) or self.steps < 1:
            p.append(f"steps must be >= 1 (got {self.steps!r})")
        if self.batch_size < 1:
            p.append(f"batch_size (the global batch) must be >= 1 (got {self.batch_size})")
        if self.optimizer not in ("adam", "sgd"):
            p.append(f"optimizer must be 'adam' or 'sgd' (got {self.optimizer!r})")
        if self.timeout_s <= 0:
            p.append(f"timeout_s must be positive (got {self.timeout_s})")
        if self.threads_per_rank < 1:
            p.append(f"threads_per_rank must be >= 1 (got {self.threads_per_rank})")
        try:
            p += self.model_config().problems()
        except ValueError as e:
            p.append(str(e))
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
        return strategy.problems(self)

    def _checkpoint_problems(self) -> list[str]:
        p = []
        if self.checkpoint_kind not in ("sharded", "full"):
            p.append(f"checkpoint_kind must be 'sharded' or 'full' (got {self.checkpoint_kind!r})")
        if self.checkpoint_every < 0 or self.keep_checkpoints < 1 or self.max_restarts < 0:
            p.append("checkpoint_every and max_restarts must be >= 0, keep_checkpoints >= 1")
        if self.resume not in ("", "latest"):
            from dlab.checkpoint import resume_problems
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
        if self.backend not in ("auto", "gloo", "nccl"):
            p.append(f"backend must be auto, gloo or nccl (got {self.backend!r})")
        if self.device not in ("auto", "cpu", "cuda"):
            p.append(f"device must be auto, cpu or cuda (got {self.device!r})")
        gpus = _gpu_count()
        if self.backend == "nccl" and gpus == 0:
            p.append("backend='nccl' needs CUDA GPUs and this machine has none; "
                     "use backend='gloo' (or 'auto')")
        elif self.backend == "nccl" and gpus < (self.world_size if isinstance(self.world_size, int) else 0):
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
        if f.get("kind") not in FAULT_KINDS:
            p.append(f"fault kind must be one of {FAULT_KINDS} (got {f.get('kind')!r})")
        rank = f.get("rank", 0)
        if not isinstance(rank, int) or not 0 <= rank < max(self.world_size, 1):
            p.append(f"fault rank {rank!r} is not a rank of this run (0..{self.world_size - 1})")
        step = f.get("step", 0)
        if not isinstance(step, int) or not 0 <= step < max(self.steps, 1):
            p.append(f"fault step {step!r} is outside the run's steps (0..{self.steps - 1})")
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
                        help="deadline in seconds for rendezvous and each collective")
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
            r, s, kind = args.fault.split(":")
            fault = {"rank": int(r), "step": int(s), "kind": kind}
        except ValueError:
            raise ConfigError(
                f"--fault takes RANK:STEP:KIND, e.g. 1:3:raise (got {args.fault!r})") from None
    return RunConfig(
        strategy=args.strategy, world_size=args.world_size, steps=args.steps, model=args.model,
        model_options=_pairs(args.model_opt, "--model-opt"), batch_size=args.batch_size,
        optimizer=args.optimizer, lr=args.lr, seed=args.seed, backend=args.backend,
        device=args.device, threads_per_rank=args.threads, timeout_s=args.timeout,
        options=_pairs(args.opt, "--opt"), fault=fault, save_final=args.save_final,
        checkpoint_every=args.checkpoint_every, checkpoint_kind=args.checkpoint_kind,
        checkpoint_async=args.checkpoint_async, resume=args.resume,
        max_restarts=args.max_restarts, name=args.name)
