"""The theory the run charts set beside their measurements, read off a run's config: the
pipeline layout (schedule, replicas, tensor-parallel ranks) whose bubble the formula gives, and
the model state each rank should hold. Part of ``dlab.ui.plots``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dlab.layout.schedules import Schedule

FULL_REPLICA = ("single", "dp-naive", "ddp", "torch-ddp")
ZERO_STAGE = {"zero1": 1, "zero2": 2, "zero3": 3}
MODEL_STATE = ("parameters", "gradients", "optimizer")
@dataclass(frozen=True)
class PipelineLayout:
    """What a pipeline run's config makes of its ranks: the schedule's action lists on p
    pipeline ranks, d replicas, t tensor-parallel ranks per stage; ``name`` is the schedule's
    name in ``dlab.theory.pipeline`` (that of the ``pipeline-*`` strategy)."""
    name: str
    schedule: Schedule
    d: int
    t: int

    @property
    def p(self) -> int:
        return self.schedule.p

    @property
    def m(self) -> int:
        return self.schedule.m

    @property
    def v(self) -> int:
        return self.schedule.v

    def pipelines(self) -> list[list[int]]:
        """The global ranks of each pipeline, by pipeline rank (the mesh is row-major over
        dp, pp, tp)."""
        return [[(i * self.p + s) * self.t + k for s in range(self.p)]
                for i in range(self.d) for k in range(self.t)]


def _run_config(config: dict | None):
    """(``RunConfig``, strategy class) of a run's config, or None where it names no known
    strategy (a hand-written or older config): the charts then show the measurements alone."""
    from dlab import parallel
    from dlab.core.config import ConfigError, RunConfig
    try:
        cfg = RunConfig.from_dict(config or {})
        return cfg, parallel.get(cfg.strategy)
    except (ConfigError, ValueError, TypeError):
        return None


def pipeline_layout(config: dict | None) -> PipelineLayout | None:
    """The layout of a ``pipeline-*`` run (p, m, v as ``Pipeline.layout`` reads the options),
    None for other strategies or a layout the schedule refuses."""
    from dlab.layout import schedules
    from dlab.parallel.pipeline.strategy import Pipeline
    found = _run_config(config)
    if found is None or not issubclass(found[1], Pipeline):
        return None
    cfg, cls = found
    p, d, t, m, v = cls.layout(cfg)
    try:
        return PipelineLayout(cls.schedule, schedules.build(cls.schedule, p, m, v), d, t)
    except ValueError:
        return None


def bubble_formula(layout: PipelineLayout) -> float | None:
    """The schedule's closed-form bubble (``dlab.theory.pipeline.bubble``) at equal forward,
    input-gradient and weight-gradient times; None where no closed form applies."""
    from dlab.theory.pipeline import bubble
    return bubble(layout.name, layout.p, layout.m, layout.v)


def model_state(config: dict | None, rank: int) -> dict[str, int] | None:
    """Parameters, gradients and optimizer state that ``dlab.theory.memory`` predicts rank
    ``rank`` holds: a full fp32 replica for single-process and plain data-parallel runs, dlab's
    exact ZeRO accounting (padding and step counters included) for zero1-3, ``estimate.nd`` for
    ``nd`` (each rank by its pipeline rank); None for the strategies it has no per-rank formula
    for."""
    from dlab import models
    from dlab.theory import memory
    found = _run_config(config)
    if found is None:
        return None
    cfg = found[0]
    if cfg.strategy in FULL_REPLICA:
        import torch
        with torch.device("meta"):  # the parameters' shapes, without allocating them
            model = models.build(cfg.model, cfg.model_options, cfg.seed)
        return memory.ddp_memory([p.numel() for p in model.parameters()], cfg.optimizer)
    if cfg.strategy in ZERO_STAGE and cfg.model in ("gpt", "mlp"):
        state = memory.zero_memory(memory.model_units(cfg.model, cfg.model_options), cfg.world_size,
                                   ZERO_STAGE[cfg.strategy], cfg.options.get("mixed_precision", False),
                                   cfg.optimizer, rank)
        return {k: state[k] for k in MODEL_STATE}
    if cfg.strategy == "nd" and cfg.model in ("gpt", "moe"):
        from dlab.theory import nd
        from dlab.layout.layout import Layout
        lay = Layout.from_config(cfg)
        state = nd.model_state(cfg.model_config(), lay, rank // (cfg.world_size // lay.pp),
                               cfg.optimizer)
        return {k: state[k] for k in MODEL_STATE}
    return None


# --- the dashboard's panels -------------------------------------------------------------------
