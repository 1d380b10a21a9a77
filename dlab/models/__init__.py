"""Models every strategy trains: ``gpt`` (a small decoder-only transformer), ``moe`` (the same
with mixture-of-experts MLPs) and ``mlp``.

``build(name, options, seed)`` makes the same weights on every rank and in the single-process
reference: the generator is seeded right before construction and the model is built on the CPU
(then moved), so the result does not depend on the device, the rank or what ran before.
"""
from __future__ import annotations

import torch

from dlab.models.gpt import GPT, GPTConfig
from dlab.models.mlp import MLP, MLPConfig
from dlab.models.moe import MoEConfig, MoEGPT

MODELS = {"gpt": (GPTConfig, GPT), "moe": (MoEConfig, MoEGPT), "mlp": (MLPConfig, MLP)}


def model_config(name: str, options: dict):
    """The config dataclass for ``name`` with ``options`` applied; raises ValueError saying what
    to change for an unknown model or option."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}")
    cls = MODELS[name][0]
    known = set(cls.__dataclass_fields__)
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for model {name!r}; it takes {sorted(known)}")
    return cls(**options)


def build(name: str, options: dict, seed: int) -> torch.nn.Module:
    cfg = model_config(name, options)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MODELS[name][1](cfg)


__all__ = ["GPT", "GPTConfig", "MLP", "MLPConfig", "MODELS", "MoEConfig", "MoEGPT", "build",
           "model_config"]
