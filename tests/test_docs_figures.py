"""Figures that README.md and docs/*.md quote from the stored benches (``docs/bench/*.json``)
equal the JSON they name. The convention (written in docs/RESULTS.md's head): a quoted figure
is followed by a comment naming its source,

    0.62<!-- figure: zero.json strategy=zero3 ranks=2 metric=step_s : ratio -->

``FILE ROW : KEY [* SCALE]``: FILE under docs/bench/ (``check.json#strategies`` for the list
under that key of a JSON object); ROW, ``field=value`` pairs (a value in JSON, or a bare word)
that pick exactly one row; KEY, the row's field; SCALE, a factor (``1e3`` for seconds to ms,
``1e-6`` for bytes to MB, ``100`` for a share to a percent). The figure is the last number
between the previous comment on its line (or the line's start) and this one, thousands commas
or an exponent allowed; it must equal the value times SCALE rounded to the decimals written
(``4.8e-7``: to the mantissa's decimals).
"""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "docs" / "bench"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
COMMENT = re.compile(r"<!--\s*figure:(.*?)-->")
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:e-?\d+)?")


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse(spec: str) -> tuple[str, dict, str, float]:
    """(file, row selector, key, scale) of one comment's text."""
    row_part, _, key_part = spec.partition(":")
    words = shlex.split(row_part)
    assert words and key_part.strip(), f"figure comment {spec!r}: FILE ROW : KEY [* SCALE]"
    selector = {}
    for w in words[1:]:
        field, eq, value = w.partition("=")
        assert eq, f"figure comment {spec!r}: {w!r} is not field=value"
        selector[field] = _value(value)
    key, _, scale = key_part.partition("*")
    return words[0], selector, key.strip(), float(scale) if scale.strip() else 1.0


def figures_in(line: str) -> list[tuple[str, str]]:
    """(the figure as written, the comment's text) for each figure comment of one line."""
    out, start = [], 0
    for m in COMMENT.finditer(line):
        numbers = NUMBER.findall(line[start:m.start()])
        out.append((numbers[-1] if numbers else "", m.group(1)))
        start = m.end()
    return out


def quoted() -> list[tuple[str, int, str, str]]:
    """(document, line number, the figure as written, the comment's text) for every figure."""
    return [(str(doc.relative_to(REPO)), n, figure, spec) for doc in DOCS
            for n, line in enumerate(doc.read_text().splitlines(), 1)
            for figure, spec in figures_in(line)]


FIGURES = quoted()


def test_the_docs_quote_figures_under_the_convention():
    """A guard on the scan itself: the convention is in use where this test was written."""
    assert {doc for doc, *_ in FIGURES} >= {"README.md", "docs/RESULTS.md"}


def mismatch(figure: str, spec: str, bench: Path = BENCH) -> str | None:
    """Why ``figure`` is not what ``spec`` names in ``bench``, or None when it is."""
    name, selector, key, scale = parse(spec)
    file, _, section = name.partition("#")
    path = bench / file
    if not path.is_file():
        return f"no {path}"
    rows = json.loads(path.read_text())
    rows = rows[section] if section else rows
    picked = [r for r in rows if all(r.get(k) == v for k, v in selector.items())]
    if len(picked) != 1:
        return f"{selector} picks {len(picked)} rows of {name}, not one"
    if not isinstance(picked[0].get(key), (int, float)):
        return f"the row of {name} has no number {key!r}"
    if not figure:
        return f"no number before the comment {spec!r}"
    written = figure.replace(",", "")
    mantissa, e, _ = written.partition("e")
    decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
    value = picked[0][key] * scale
    want = float(f"{value:.{decimals}e}") if e else round(value, decimals)
    if abs(float(written) - want) > abs(want) * 1e-9 + (0 if e else 10 ** -decimals / 100):
        return f"{figure} written, {name} {selector} {key} gives {picked[0][key]} (x {scale:g} = {want})"
    return None


@pytest.mark.parametrize("doc,line,figure,spec", FIGURES, ids=[f"{d}:{n}" for d, n, *_ in FIGURES])
def test_a_quoted_figure_equals_its_stored_bench_row(doc, line, figure, spec):
    problem = mismatch(figure, spec)
    assert problem is None, f"{doc}:{line}: {problem}"


def test_the_check_refuses_a_wrong_figure_and_a_loose_row(tmp_path):
    (tmp_path / "x.json").write_text(json.dumps([
        {"strategy": "zero3", "ranks": 2, "ratio": 0.6174, "bytes": 2331680},
        {"strategy": "zero3", "ranks": 4, "ratio": 0.4123, "bytes": 3302000}]))
    spec = " x.json strategy=zero3 ranks=2 : ratio"
    assert parse(spec) == ("x.json", {"strategy": "zero3", "ranks": 2}, "ratio", 1.0)
    assert mismatch("0.62", spec, tmp_path) is None
    assert "0.61 written" in mismatch("0.61", spec, tmp_path)
    assert mismatch("2.332", " x.json ranks=2 : bytes * 1e-6", tmp_path) is None
    assert mismatch("2,331,680", " x.json ranks=2 : bytes", tmp_path) is None
    assert "2,331,681 written" in mismatch("2,331,681", " x.json ranks=2 : bytes", tmp_path)
    assert "picks 2 rows" in mismatch("0.62", " x.json strategy=zero3 : ratio", tmp_path)
    (tmp_path / "y.json").write_text(json.dumps({"rows": [{"name": "a", "diff": 4.76837e-07}]}))
    assert mismatch("4.8e-7", " y.json#rows name=a : diff", tmp_path) is None
    assert "4.7e-7 written" in mismatch("4.7e-7", " y.json#rows name=a : diff", tmp_path)
    line = ("| zero3 | 0.62 x<!-- figure: x.json ranks=2 : ratio --> / "
            "0.41 x<!-- figure: x.json ranks=4 : ratio --> |")
    assert [f for f, _ in figures_in(line)] == ["0.62", "0.41"]
