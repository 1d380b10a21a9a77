"""Models every strategy trains: ``gpt`` (a small decoder-only transformer), ``moe`` (the same
with mixture-of-experts MLPs) and ``mlp``.

``build(name, options, seed)`` makes the same weights on every rank and in the single-process
reference: the generator is seeded right before construction and the model is built on the CPU
(then moved), so the result does not depend on the device, the rank or what ran before.
"""
from __future__ import annotations

import math

import torch

from dlab.models.data import BYTE_VOCAB
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


def problems(name: str, options: dict) -> list[str]:
    """What is wrong with model ``name`` and ``options``, each saying what to change: an
    unknown model or option, an option of the wrong kind, the model's own checks
    (``GPTConfig.problems``), a vocabulary smaller than the data's byte values."""
    if not isinstance(options, dict):
        return [f"model_options must be a dict of option name -> value (got {options!r})"]
    try:
        mc = model_config(name, options)
    except (ValueError, TypeError) as e:
        return [str(e)]
    p = []
    for key, value in options.items():
        kind = type(mc.__dataclass_fields__[key].default)
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
            p.append(f"model option {key} must be {what} (got {value!r})")
    if p:
        return p
    p += mc.problems()
    vocab = getattr(mc, "vocab_size", None)
    if vocab is not None and vocab < BYTE_VOCAB:
        p.append(f"model option vocab_size={vocab} is smaller than the data's {BYTE_VOCAB} "
                 f"token values (the corpus is bytes); use vocab_size >= {BYTE_VOCAB}")
    return p


def build(name: str, options: dict, seed: int) -> torch.nn.Module:
    cfg = model_config(name, options)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MODELS[name][1](cfg)


__all__ = ["GPT", "GPTConfig", "MLP", "MLPConfig", "MODELS", "MoEConfig", "MoEGPT", "build",
           "model_config", "problems"]
