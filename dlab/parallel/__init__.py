"""The strategy registry: a strategy is launched by name from a notebook, the CLI or torchrun.

A module of ``dlab.parallel`` (at any depth) registers its strategies with ``@register(name)``
when imported; ``names()`` and ``get(name)`` import every module of the package on first use,
so a new strategy family is one new file and nothing else to edit.
"""
from __future__ import annotations

import difflib
import importlib
import pkgutil

from dlab.parallel.base import Context, Strategy

_REGISTRY: dict[str, type[Strategy]] = {}
_BROKEN: dict[str, str] = {}  # module -> its import error, shown when a strategy is not found


def register(name: str):
    def add(cls: type[Strategy]) -> type[Strategy]:
        cls.name = name
        _REGISTRY[name] = cls
        return cls
    return add


def names() -> list[str]:
    for module in pkgutil.walk_packages(__path__, prefix=__name__ + "."):
        try:
            importlib.import_module(module.name)
        except Exception as e:  # noqa: BLE001 - one broken module must not hide the others
            _BROKEN[module.name] = f"{type(e).__name__}: {e}"
    return sorted(_REGISTRY)


def get(name: str) -> type[Strategy]:
    known = names()
    if name not in _REGISTRY:
        close = difflib.get_close_matches(str(name), known, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        broken = "".join(f"\n  {m} failed to import: {err}" for m, err in _BROKEN.items())
        raise ValueError(f"there is no strategy {name!r}.{hint} Known strategies: "
                         f"{', '.join(known)}" + (f"\nNot loaded:{broken}" if broken else ""))
    return _REGISTRY[name]


__all__ = ["Context", "Strategy", "get", "names", "register"]
