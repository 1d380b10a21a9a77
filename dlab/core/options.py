"""``Option``: one setting's kind, range and meaning, declared once where the setting lives.

A run's fields (``dlab.core.config.RunConfig``), a strategy's options (``Strategy.OPTIONS``) and
the planner's layout fields are each declared with one ``Option``; the checks, the help text
and the command-line flags are derived from it, so a setting is never described twice.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Option:
    """A config field or a strategy option: its kind, the values it may take and what it does
    (``help``, shown when a value is refused). ``kind`` is ``"int"`` (a whole number, not a
    bool), ``"number"`` (a finite int or float), ``"bool"``, ``"str"``, ``"dict"`` or
    ``"choice"`` (one of ``choices``); ``minimum`` bounds numbers (``above`` makes it strict);
    ``none_ok`` lets None through (e.g. "unbounded"). Strategies declare theirs in
    ``Strategy.OPTIONS``; the run's fields are in ``FIELDS``."""

    kind: str
    help: str
    default: object = None
    minimum: float | None = None
    above: bool = False
    choices: tuple = ()
    none_ok: bool = False

    def problem(self, name: str, value, label: str = "option ") -> str | None:
        """What is wrong with ``value``, as a sentence saying what to use; None when it fits."""
        if value is None and self.none_ok:
            return None
        ok = {"int": isinstance(value, int) and not isinstance(value, bool),
              "number": isinstance(value, (int, float)) and not isinstance(value, bool)
              and math.isfinite(value),
              "bool": isinstance(value, bool),
              "str": isinstance(value, str),
              "dict": isinstance(value, dict),
              "choice": value in self.choices if _hashable(value) else False}[self.kind]
        if ok and self.minimum is not None and (value <= self.minimum if self.above
                                                else value < self.minimum):
            ok = False
        if ok:
            return None
        if self.kind == "choice":
            return (f"{label}{name}={value!r} is not one of {list(self.choices)}; {name} must be "
                    f"one of those: {self.help}")
        return f"{label}{name} must be {self.describe()} (got {value!r}): {self.help}"

    def describe(self) -> str:
        if self.kind == "bool":
            return "True or False"
        if self.kind == "choice":
            return "one of " + ", ".join(repr(c) for c in self.choices)
        if self.kind in ("str", "dict"):
            return ("a string" if self.kind == "str" else "a dict") + (" or None" if self.none_ok else "")
        what = "a whole number" if self.kind == "int" else "a finite number"
        if self.kind == "number" and self.minimum == 0 and self.above:
            what = "a positive finite number"
        elif self.minimum is not None:
            what += f" {'>' if self.above else '>='} {self.minimum:g}"
        return what + (" or None" if self.none_ok else "")


def _hashable(value) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True
