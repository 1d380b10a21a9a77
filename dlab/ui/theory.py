"""The theory the run charts set beside their measurements, read off a run's config by asking the
run's strategy (``Strategy.predicted_state``, ``Strategy.pipeline``): no table of strategy
names here, so a new strategy that states its theory gets its panels with nothing else to edit.
"""
from __future__ import annotations

from dataclasses import dataclass

from dlab import parallel
from dlab.core.config import ConfigError, RunConfig
from dlab.layout.schedules import Schedule
from dlab.theory.pipeline import bubble


@dataclass(frozen=True)
class PipelineView:
    """What a pipelining run makes of its ranks: the schedule every pipeline runs, and the
    global ranks of each pipeline by pipeline rank."""
    schedule: Schedule
    pipelines: list[list[int]]


def _strategy(config: dict | None):
    """(``RunConfig``, strategy class) of a run's config, or None where it names no known
    strategy or cannot run (a hand-written or older config, a spawn run): the charts then show
    the measurements alone."""
    try:
        cfg = RunConfig.from_dict(config or {})
        strategy = parallel.get(cfg.strategy)
        if strategy.option_problems(cfg) or strategy.problems(cfg):
            return None
        return cfg, strategy
    except (ConfigError, ValueError, TypeError, KeyError):
        return None


def pipeline_view(config: dict | None) -> PipelineView | None:
    """The schedule and pipelines of a run whose strategy pipelines (``pipeline-*``, ``nd`` with
    pp > 1), None for the others."""
    found = _strategy(config)
    if found is None:
        return None
    stated = found[1].pipeline(found[0])
    return PipelineView(*stated) if stated else None


def bubble_formula(view: PipelineView) -> float | None:
    """The schedule's closed-form bubble (``dlab.theory.pipeline.bubble``) at equal forward,
    input-gradient and weight-gradient times; None where no closed form applies."""
    s = view.schedule
    return bubble(s.name, s.p, s.m, s.v)


def model_state(config: dict | None, rank: int) -> dict[str, int] | None:
    """Parameters, gradients and optimizer state the run's strategy predicts ``rank`` holds,
    or None where it states no formula."""
    found = _strategy(config)
    return None if found is None else found[1].predicted_state(found[0], rank)
