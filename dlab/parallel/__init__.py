"""The strategy registry: a strategy is launched by name from a notebook, the CLI or torchrun.

Modules listed in ``_MODULES`` register their strategies with ``@register(name)`` when
imported; ``get(name)`` imports them on first use.
"""
from __future__ import annotations

import difflib
import importlib

from dlab.parallel.base import Context, Strategy

_MODULES = ["dlab.parallel.reference"]
_REGISTRY: dict[str, type[Strategy]] = {}


def register(name: str):
    def add(cls: type[Strategy]) -> type[Strategy]:
        cls.name = name
        _REGISTRY[name] = cls
        return cls
    return add


def names() -> list[str]:
    for module in _MODULES:
        importlib.import_module(module)
    return sorted(_REGISTRY)


def get(name: str) -> type[Strategy]:
    known = names()
    if name not in _REGISTRY:
        close = difflib.get_close_matches(str(name), known, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"there is no strategy {name!r}.{hint} Known strategies: {', '.join(known)}")
    return _REGISTRY[name]


__all__ = ["Context", "Strategy", "get", "names", "register"]
