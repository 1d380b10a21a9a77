"""Every check a run passes before any process starts: ``launch`` calls ``validate``, and each
worker calls it again for runs started by torchrun or Slurm directly.

In order, each step only once the ones before it hold (the later checks compare and divide
what the earlier ones vouch for): what the config alone says (``RunConfig.problems``: field
kinds and ranges, the model, the devices, the fault), the checkpoint to resume from
(``checkpoint_load.resume_problems``), then the strategy: that it exists, can checkpoint if asked
to, trains what the model asks of it, takes these options (``Strategy.option_problems``), and
its own checks (``Strategy.problems``, which for the layouts of ``nd`` and ``pipeline-*`` is
``dlab.layout.Layout.problems``). Every message says what to change.
"""
from __future__ import annotations

from dlab import parallel
from dlab.core.config import ConfigError, RunConfig
from dlab.models.moe import TRAINING_OPTIONS
from dlab.runtime.checkpoint_load import resume_problems


def problems(cfg: RunConfig) -> list[str]:
    """Every reason ``cfg`` cannot run, each saying what to change (empty: it can)."""
    p = cfg.problems()
    if p:
        return p
    p += _resume_problems(cfg)
    if p:
        return p
    try:
        strategy = parallel.get(cfg.strategy)
    except ValueError as e:
        return [str(e)]
    if (cfg.checkpoint_every or cfg.resume) and not strategy.can_checkpoint():
        return [f"strategy {cfg.strategy!r} cannot save checkpoints yet; "
                f"set checkpoint_every=0 and resume=''"]
    trained_moe = [k for k in TRAINING_OPTIONS if cfg.model_options.get(k)]
    if cfg.model == "moe" and trained_moe and not strategy.trains_moe_options:
        which = " and ".join(n for n in parallel.names() if parallel.get(n).trains_moe_options)
        return [f"model options {', '.join(trained_moe)} are built for {which} (whole-batch "
                f"expert counts, losses taken where every layer's router is): use one of them, "
                f"or drop the options"]
    return strategy.option_problems(cfg) or strategy.problems(cfg)


def validate(cfg: RunConfig) -> RunConfig:
    """``cfg`` if it can run; else ``ConfigError`` listing every problem and what to change."""
    found = problems(cfg)
    if found:
        raise ConfigError("this run cannot start:\n  - " + "\n  - ".join(found))
    return cfg


def _resume_problems(cfg: RunConfig) -> list[str]:
    p = []
    if cfg.resume not in ("", "latest"):
        try:
            p += resume_problems(cfg, cfg.resume)
        except FileNotFoundError as e:
            p.append(f"resume: {e}")
    if cfg.max_restarts and not cfg.checkpoint_every:
        p.append("max_restarts without checkpoints restarts from step 0; "
                 "set checkpoint_every (e.g. 5) too")
    return p
