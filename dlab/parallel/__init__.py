"""The strategy registry: a strategy is launched by name from a notebook, the CLI or torchrun.

A module of ``dlab.parallel`` (at any depth) registers its strategies with ``@register("name")``
on a class, so a new strategy family is one new file and nothing else to edit. ``names()`` reads
those decorators from the package's sources without importing anything, and ``get(name)``
imports only the module that registers ``name``: importing every strategy module (torch's
pipelining, DTensor and FSDP2 come with some of them) cost every rank of every run 1.4 s on the
2-core machine, about a fifth of a two-rank launch, for strategies it never runs.
"""
from __future__ import annotations

import ast
import difflib
import functools
import importlib
from pathlib import Path

from dlab.parallel.base import Context, Strategy

_REGISTRY: dict[str, type[Strategy]] = {}


def register(name: str):
    def add(cls: type[Strategy]) -> type[Strategy]:
        cls.name = name
        _REGISTRY[name] = cls
        return cls
    return add


@functools.cache
def declared() -> dict[str, str]:
    """Strategy name -> the module that registers it, read from every ``@register("...")`` on a
    class in the package's sources (parsed, not imported: 0.1 s on the 2-core machine)."""
    found: dict[str, str] = {}
    root = Path(__file__).parent
    for path in sorted(root.rglob("*.py")):
        source = path.read_text()
        if "@register(" not in source:
            continue
        module = ".".join((__name__, *path.relative_to(root).with_suffix("").parts))
        for node in ast.walk(ast.parse(source, str(path))):
            if not isinstance(node, ast.ClassDef):
                continue
            for deco in node.decorator_list:
                if (isinstance(deco, ast.Call) and getattr(deco.func, "id", None) == "register"
                        and len(deco.args) == 1 and isinstance(deco.args[0], ast.Constant)):
                    found[deco.args[0].value] = module.removesuffix(".__init__")
    return found


def names() -> list[str]:
    return sorted(declared())


def get(name: str) -> type[Strategy]:
    module = declared().get(name) if isinstance(name, str) else None
    if module is None:
        close = difflib.get_close_matches(str(name), names(), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"there is no strategy {name!r}.{hint} Known strategies: "
                         f"{', '.join(names())}")
    if name not in _REGISTRY:
        importlib.import_module(module)
    return _REGISTRY[name]


__all__ = ["Context", "Strategy", "declared", "get", "names", "register"]
