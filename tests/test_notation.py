"""Every notebook against notebooks/NOTATION.md and the README's notebook table, where a regex
can tell: the parity tolerance quoted in prose, the link figures, the header's run time, and the
letters NOTATION.md gives one meaning. Data-driven: it reads all of notebooks/*.ipynb, so a new
or renumbered notebook is checked without editing this file."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
NOTATION = (ROOT / "notebooks" / "NOTATION.md").read_text()
README = (ROOT / "README.md").read_text()


def _figure(pattern: str) -> float:
    """A number NOTATION.md states, found by the sentence that states it."""
    m = re.search(pattern, NOTATION)
    assert m, f"NOTATION.md no longer states {pattern!r}"
    return float(m.group(1))


TOLERANCE = _figure(r"losses within (1e-\d+) at every step")
LINKS = {  # link: (regex naming it in prose, GB/s one direction as NOTATION.md states it)
    "NVLink": (r"NVLink", _figure(r"\*\*B = (\d+) GB/s in one direction\*\*")),
    "InfiniBand NDR": (r"(?:InfiniBand )?NDR", _figure(r"NDR: 400 Gb/s = (\d+) GB/s")),
    "100 GbE": (r"100 ?GbE", _figure(r"100 GbE: about (\d+) GB/s")),
}
BOTH_DIRECTIONS = re.compile(r"both directions|bidirectional|two directions")

# A letter NOTATION.md gives one meaning, used with another ("Written otherwise" there). Each
# rule: (regex, what NOTATION.md says instead). A paper's own letter may be named once as the
# paper's ("the paper's N_d"); those mentions are skipped.
MISUSES = [
    (r"\bB\s*=\s*N\s*(?:\\cdot|·|\*|\\times)?\s*b\b|(?:global )?batch(?: size)?,? \$?B\$?\b(?! ?/)",
     "B is a link bandwidth; the global batch is G"),
    (r"\$B/\d\$", "B is a link bandwidth; the global batch is G"),
    (r"\$?B\$? buckets|buckets,? \$?B\$?\b", "B is a link bandwidth; write 'the buckets' (n_buckets)"),
    (r"\bN_(?:\{?active\}?|\{?d\}?|\{?p\}?|\{?t\}?)\b|\bN_\\text",
     "N is the number of ranks; parameters are Ψ (Ψ_active), degrees d, p, t"),
    (r"\bT\s*(?:x|×|\\times)\s*T\b|sequence length,? \$?T\b|\bL\s*d\s*T\b|of \$?T\$? tokens"
     r"|\bT = \d+ tokens",
     "the sequence length is s (an attention score matrix is s × s), not T"),
    (r"(?:model |hidden )?width,? \$?d\$? ?=|\bd_model\s*=\s*d\b|of width d\b",
     "d is the data-parallel degree; the model width is h"),
    (r"group of \$?G\$? tokens", "G is the global batch; an MoE group is the rank's b·s tokens"),
    (r"\bP (?:pieces|chunks)\b", "P is parameter bytes; say 'pieces' or 'chunks' in words"),
    (r"\$?L\$? blocks of (?:a|the|its|this) stage|stage holding \$?L\$? blocks",
     "L is the model's layers; a stage holds L/p blocks"),
    (r"\bd_i\b|\bd_\{i\}", "d is the data-parallel degree; a rank's delay is δ_i"),
    (r"\bt_b\b(?! *\()", "t_B is the input-gradient backward; a bucket's all-reduce is t_bucket"),
]
PAPERS_OWN = re.compile(r"(?:paper's|papers'|their|(?:et al\.|ZeRO)'s) \S*$")

# Notebooks owned by other work in progress, found against NOTATION.md on main: (notebook,
# rule's message) -> the cells. Remove an entry when its notebook is fixed; a stale entry fails.
KNOWN: dict[tuple[str, str], list[int]] = {}  # none today


def _cells(nb: Path):
    return json.loads(nb.read_text())["cells"]


def _prose(nb: Path):
    """(cell index, text) of every markdown cell, and of every code cell's comments."""
    for i, cell in enumerate(_cells(nb)):
        text = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            yield i, re.sub(r"`[^`\n]*`", "`code`", text)  # code spans name code (t_b=...), not notation
        else:
            yield i, "\n".join(line.split("#", 1)[1] for line in text.splitlines() if "#" in line)


def _sentences(text: str):
    return re.split(r"(?<=[.;:!?])\s+(?=[A-Z(*])|\n\n", text)


WORDS = {"a": 1, "an": 1, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5}


def _readme_seconds() -> dict[str, float]:
    rows = re.findall(r"^\| `(\d\d_\w+)` \|.*\| (\d+) \|$", README, re.M)
    assert rows, "README.md's notebook table (| `NN_name` | ... | seconds |) not found"
    return {name: float(s) for name, s in rows}


def _header_seconds(nb: Path) -> float | None:
    head = "".join(_cells(nb)[0]["source"])
    m = re.search(r"cells run in about (\d+(?:\.\d+)?|a|an|one|two|three|four|five) ?"
                  r"(s|seconds?|min(?:utes?)?)\b", head)
    if not m:
        return None
    count = WORDS[m.group(1)] if m.group(1) in WORDS else float(m.group(1))
    return count * (60 if m.group(2).startswith("min") else 1)


def test_notation_states_the_figures_the_course_checks():
    assert TOLERANCE == 1e-5
    assert LINKS["NVLink"][1] == 450 and LINKS["InfiniBand NDR"][1] == 50


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_parity_tolerance_is_notations(nb):
    wrong = []
    for i, text in _prose(nb):
        for sentence in _sentences(text):
            if not re.search(r"toleran|parity|must agree|agree to", sentence, re.I):
                continue
            for value in re.findall(r"\b1e-(\d+)\b|10\^\{?-(\d+)\}?", sentence):
                exponent = int(value[0] or value[1])
                if 10.0 ** -exponent != TOLERANCE:
                    wrong.append(f"cell {i}: {sentence.strip()[:120]!r} quotes 1e-{exponent}")
    assert not wrong, f"{nb.name}: the parity tolerance is {TOLERANCE:g} (NOTATION.md):\n" + "\n".join(wrong)


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_link_figures_are_notations(nb):
    wrong = []
    for i, text in _prose(nb):
        for sentence in _sentences(text):
            for link, (name, per_direction) in LINKS.items():
                for m in re.finditer(rf"{name}[^.;]{{0,60}}?(\d+(?:\.\d+)?) GB/s", sentence):
                    value = float(m.group(1))
                    both = BOTH_DIRECTIONS.search(sentence[m.end():m.end() + 60])
                    if value != per_direction and not (both and value == 2 * per_direction):
                        wrong.append(f"cell {i}: {link} at {value:g} GB/s in {m.group(0)!r}")
    assert not wrong, (f"{nb.name}: NOTATION.md's figures, one direction: "
                       f"{ {k: v for k, (_, v) in LINKS.items()} } GB/s (twice that only if "
                       "'both directions' follows):\n" + "\n".join(wrong))


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_header_run_time_is_the_readmes(nb):
    """'the cells run in about N s' within half (or 15 s) of the seconds the README's table
    measured under nbval on the 2-core machine."""
    measured = _readme_seconds().get(nb.stem)
    said = _header_seconds(nb)
    assert said is not None, (f"{nb.name}: the first cell must say 'the cells run in about N s' "
                              f"(or N minutes)")
    assert measured is not None, f"{nb.stem} has no row in README.md's notebook table"
    assert abs(said - measured) <= max(15.0, 0.5 * measured), (
        f"{nb.name}: the header says about {said:g} s, the README's table measured {measured:g} s")


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_letters_keep_notations_meaning(nb):
    found: dict[str, list[int]] = {}
    for i, text in _prose(nb):
        for pattern, instead in MISUSES:
            for m in re.finditer(pattern, text):
                if not PAPERS_OWN.search(text[max(0, m.start() - 40):m.start()]):
                    found.setdefault(instead, []).append(i)
    for (name, instead), cells in KNOWN.items():
        if name == nb.stem:
            assert sorted(set(found.pop(instead, []))) == cells, (
                f"KNOWN[{name!r}, {instead!r}] is stale: update or remove it")
    assert not found, f"{nb.name}: " + "; ".join(f"cells {sorted(set(c))}: {k}" for k, c in found.items())
