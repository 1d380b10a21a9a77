"""The strategy interface: how every parallelism plugs into the one training loop.

A strategy builds this rank's model and optimizer, does one optimizer step on a *global* batch
(taking its own part of it), reports memory by category, and gives and takes state dicts. The
loop (``dlab.worker.train``) owns the data, timing, metrics and checkpoint cadence.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dlab import models
from dlab.comm.instrumented import REDUCE_SCATTER_ALGORITHMS, Comm
from dlab.core.config import RunConfig
from dlab.core.events import Timeline
from dlab.core.metrics import ActivationMeter, model_state_memory
from dlab.core.options import Option
from dlab.core.precision import LossScaler
from dlab.layout import Layout, shape
from dlab.layout.schedules import Schedule
from dlab.models.moe import moe_stats
from dlab.runtime import checkpoint, checkpoint_load
from dlab.theory import memory

#: the option of every strategy that reduce-scatters (ZeRO's gradients, sequence parallelism,
#: the all-gather attention's backward): Gloo's reduce_scatter is a whole all-reduce, twice the
#: ring's bytes, so dlab's own ring is offered beside it
REDUCE_SCATTER = {"reduce_scatter": Option(
    "choice", "'backend' (the backend's reduce_scatter_tensor; on Gloo a whole all-reduce) or "
    "'ring' (dlab's ring reduce-scatter: (N-1)/N of the input per rank)",
    default="backend", choices=REDUCE_SCATTER_ALGORITHMS)}


@dataclass
class Context:
    """What a strategy is handed on its rank. ``comm`` is the world group's counting wrapper;
    a strategy that needs subgroups builds them from here (there is no global mesh)."""

    config: RunConfig
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    timeline: Timeline
    comm: Comm


class Strategy:
    name = ""
    #: world sizes this strategy runs at (None: any)
    world_sizes: tuple[int, ...] | None = None
    #: the options this strategy takes, by name: the one place they are declared and checked
    OPTIONS: dict[str, Option] = {}
    #: it trains a MoE's capacity and balancing-loss options (``models.moe.TRAINING_OPTIONS``)
    #: as ``single`` does: every layer's router sees the whole batch's counts
    trains_moe_options = False

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.meter: ActivationMeter | None = None

    # --- checks (class level: run before any process starts) ------------------------------
    @classmethod
    def option_problems(cls, config: RunConfig) -> list[str]:
        """Unknown option names (with a did-you-mean), then each value's kind and range against
        ``OPTIONS``. ``RunConfig.problems`` runs these before ``problems``, which may then take
        every option to be of its declared kind."""
        if not isinstance(config.options, dict):
            return [f"options must be a dict of option name -> value (got {config.options!r})"]
        unknown = sorted((k for k in config.options if k not in cls.OPTIONS), key=str)
        if unknown:
            hints = [f"did you mean {close[0]!r} for {k!r}? " for k in unknown
                     if (close := difflib.get_close_matches(str(k), list(cls.OPTIONS), n=1))]
            return [f"unknown option(s) {unknown} for strategy {config.strategy!r}; {''.join(hints)}"
                    f"it takes {', '.join(cls.OPTIONS) or 'no options'}"]
        return [problem for key, value in config.options.items()
                if (problem := cls.OPTIONS[key].problem(key, value)) is not None]

    @classmethod
    def problems(cls, config: RunConfig) -> list[str]:
        """The world sizes it runs at, the models it splits (``model_problems``), then, for a
        strategy that splits the model over a layout, that layout's rules
        (``dlab.layout.Layout.problems``, the one place they live)."""
        if cls.world_sizes is not None and config.world_size not in cls.world_sizes:
            return [f"strategy {config.strategy!r} runs at world_size {list(cls.world_sizes)}, "
                    f"not {config.world_size}"]
        p = cls.model_problems(config)
        lay = cls.layout(config)
        if p or lay is None:
            return p
        return lay.problems(shape(config.model_config()), config.batch_size, config.world_size)

    @classmethod
    def model_problems(cls, config: RunConfig) -> list[str]:
        """What of the model the strategy cannot train (e.g. a pipeline of the MLP)."""
        return []

    @classmethod
    def layout(cls, config: RunConfig) -> Layout | None:
        """The layout its options ask for (``dlab.layout.Layout``: degrees, schedule, ...), for a
        strategy that splits the model over one; None for one whose every rank holds it whole."""
        return None

    #: why no option makes it train like ``single`` (``python -m dlab check`` leaves it out and
    #: names what checks it instead); None for a strategy that does
    differs_from_single: str | None = None

    @classmethod
    def check_options(cls) -> dict:
        """The options under which ``python -m dlab check`` sets a run of it beside ``single``:
        those that make it train like ``single`` where its defaults do not (for a composition,
        a layout that puts several of its parts to work)."""
        return {}

    @classmethod
    def replica_zero(cls) -> int | None:
        """For a data-parallel strategy (every rank a replica of the model, one gradient
        reduction per step over all of them), the ZeRO stage its state is sharded at (0: not at
        all); None for any other (a parameter server, local SGD, a split model)."""
        return None

    @classmethod
    def planned_layout(cls, config: RunConfig) -> Layout | None:
        """The layout the planner prices the run as (``dlab.analysis.prediction``): the one it
        splits the model over, or every rank a replica at its ZeRO stage; None where the
        planner has none for it."""
        lay = cls.layout(config)
        zero = cls.replica_zero()
        if lay is None and zero is not None:
            return Layout(dp=config.world_size, zero=zero if config.world_size > 1 else 0)
        return lay

    # --- its own theory (class level: the dashboard and ``check`` ask it, no name tables) ---
    @classmethod
    def predicted_state(cls, config: RunConfig, rank: int) -> dict[str, int] | None:
        """Bytes of parameters, gradients and optimizer state ``rank`` should hold, by the
        formulas of ``dlab.theory`` (written apart from this code); None where the strategy has
        no per-rank formula."""
        return None

    @classmethod
    def pipeline(cls, config: RunConfig) -> tuple[Schedule, list[list[int]]] | None:
        """For a strategy that pipelines: the schedule every pipeline runs and the global ranks
        of each pipeline, by pipeline rank (the bubble panel sets its formula beside the
        measurement); None otherwise."""
        return None

    # --- the interface --------------------------------------------------------------------
    def setup(self) -> None:
        raise NotImplementedError

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        """One optimizer step on the global ``batch``; returns the global mean loss."""
        raise NotImplementedError

    def memory(self) -> dict[str, int]:
        """Bytes held by this rank, by category (dlab.core.metrics.CATEGORIES)."""
        raise NotImplementedError

    def step_extras(self) -> dict:
        """Figures of the step beyond the standard record: the routing of the model's MoE
        layers on this rank (``models.moe.moe_stats``), where it has them."""
        model = getattr(self, "model", None)
        return moe_stats(model) if isinstance(model, torch.nn.Module) else {}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every model parameter at full size, on every rank (a collective for sharded
        strategies): what parity tests and full checkpoints compare."""
        raise NotImplementedError

    #: every rank holds the whole model and optimizer (a checkpoint needs rank 0's part only)
    replicated = False
    #: fp16's dynamic loss scaler (``dlab.core.precision.LossScaler``) where the strategy scales
    #: its loss: the loop records its decisions (a skipped step, the scale) in every step's
    #: metrics and checkpoints save and restore its state
    scaler: LossScaler | None = None

    def checkpoint_state(self) -> dict:
        """This rank's part of a checkpoint: ``{"params": {name: piece}, "optim": {name: {key:
        piece or scalar}}, "hparams": [...]}``, names as in the single model (``dlab.runtime.checkpoint``
        describes pieces). A strategy that does not implement it cannot checkpoint."""
        raise NotImplementedError

    def load_checkpoint_state(self, reader) -> None:
        """Take this rank's part from a ``dlab.runtime.checkpoint_load.Reader`` written at any layout."""
        raise NotImplementedError

    @classmethod
    def can_checkpoint(cls) -> bool:
        return cls.checkpoint_state is not Strategy.checkpoint_state

    def comms(self) -> list[Comm]:
        """The counting wrappers whose traffic this strategy generates."""
        return [self.ctx.comm]

    def comms_by_dim(self) -> dict[str, Comm | list[Comm]]:
        """The same wrappers named by the parallel dimension whose traffic each carries (a
        strategy of several dimensions says which is which; the metrics then split the step's
        bytes by dimension as ``comm_by_dim``; a dimension may talk over several, as USP's
        context parallelism does). Empty: no split."""
        return {}

    # --- helpers shared by strategies -----------------------------------------------------
    def build_model(self) -> torch.nn.Module:
        cfg = self.ctx.config
        return models.build(cfg.model, cfg.model_options, cfg.seed).to(self.ctx.device)

    def build_optimizer(self, params) -> torch.optim.Optimizer:
        cfg = self.ctx.config
        if cfg.optimizer == "adam":
            return torch.optim.Adam(params, lr=cfg.lr)
        return torch.optim.SGD(params, lr=cfg.lr, momentum=0.9)

    def forward_backward(self, x, y, scale: float = 1.0, module=None, **fields) -> torch.Tensor:
        """Forward and backward of one (micro-)batch through ``module`` (default
        ``self.model``; a wrapper such as DDP's), each on the timeline with ``fields``, the
        forward's saved tensors measured. The loss is multiplied by ``scale`` before backward
        (1/k for k accumulated micro-batches); returns the unscaled loss, detached."""
        tl = self.ctx.timeline
        with tl.span("forward", **fields), self.meter.track():
            loss = self.model.criterion((module or self.model)(x), y)
        with tl.span("backward", **fields):
            (loss * scale if scale != 1.0 else loss).backward()
        return loss.detach()

    def replica_memory(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Memory of a rank holding a whole model replica (no sharding)."""
        mem = model_state_memory(model.parameters(), optimizer)
        mem["activations"] = self.meter.peak if self.meter else 0
        mem["comm_buffers"] = 0
        return mem

    def mean_loss(self, loss: torch.Tensor, group: dist.ProcessGroup | None = None) -> float:
        """The global mean of a per-shard mean loss, for logging. It uses the raw backend, not
        ``Comm``, so the bytes a strategy is charged are its own."""
        t = loss.detach().float().reshape(1).clone()
        dist.all_reduce(t, group=group)
        return t.item() / dist.get_world_size(group)


class WholeModel(Strategy):
    """A strategy whose every rank holds the whole model (``self.model``) and its whole
    optimizer (``self.optimizer``): memory, full state and checkpoints are a replica's, and a
    checkpoint needs rank 0's part only."""

    replicated = True

    @classmethod
    def predicted_state(cls, config, rank):
        """A full replica in the run's precision (fp32): weights, gradients, optimizer state."""
        with torch.device("meta"):  # the parameters' shapes, without allocating them
            model = models.build(config.model, config.model_options, config.seed)
        return memory.ddp_memory([p.numel() for p in model.parameters()], config.optimizer)

    def memory(self):
        return self.replica_memory(self.model, self.optimizer)

    def full_state_dict(self):
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    def checkpoint_state(self):
        return checkpoint.replica_state(self.model, self.optimizer)

    def load_checkpoint_state(self, reader):
        checkpoint_load.load_replica(self.model, self.optimizer, reader)


#: the gradient bucket size of PyTorch's DDP and of dlab's ``ddp``
BUCKET_CAP_MB = Option("number", "MiB per gradient bucket, e.g. 25 (PyTorch's default) or 0.05 "
                       "for a tiny model", default=25, minimum=0, above=True)


def data_parallel_problems(config: RunConfig, dp: int) -> list[str]:
    """The global batch split over ``dp`` replicas (``Layout.batch_problems``)."""
    return Layout(dp=dp).batch_problems(config.batch_size)
