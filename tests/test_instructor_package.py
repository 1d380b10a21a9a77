"""The instructor's package keeps up with the notebooks:

- every open exercise of a notebook (the numbered items under its "## Exercises" heading, up to
  its "### Checked exercise") has an answer in ``docs/instructor/answers/<notebook>.md`` (a
  heading "## N."), and every answer there answers an exercise that exists;
- every notebook ends with exactly one checked exercise, whose cell calls
  ``check("<name>", ...)`` for an exercise ``dlab.exercises`` registers for that notebook (its
  solution and typical mistake are ``tests/test_exercises.py``'s);
- the instructor's README and the syllabus name every notebook.

One case per notebook, so a failure names the notebook and the exercise.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers import WITHOUT_A_CHECKED_EXERCISE

from dlab.exercises import EXERCISES

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
ANSWERS = ROOT / "docs" / "instructor" / "answers"


def _markdown(path: Path) -> list[str]:
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"]
            if c["cell_type"] == "markdown"]


def open_exercises(path: Path) -> list[int]:
    """The numbers of the notebook's open exercises, in order."""
    found = []
    for text in _markdown(path):
        if not re.search(r"^## Exercises\s*$", text, re.M):
            continue
        section = re.split(r"^## Exercises\s*$", text, flags=re.M)[1]
        section = re.split(r"^### Checked exercise", section, flags=re.M)[0]
        found += [int(n) for n in re.findall(r"^(\d+)\. ", section, re.M)]
    return found


def answers(notebook: str) -> list[int] | None:
    """The exercise numbers ``answers/<notebook>.md`` answers (its "## N." headings), or None
    where there is no such file."""
    path = ANSWERS / f"{notebook}.md"
    if not path.exists():
        return None
    return [int(n) for n in re.findall(r"^## (\d+)\.", path.read_text(), re.M)]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_open_exercise_has_an_answer(path):
    name = path.stem
    exercises = open_exercises(path)
    assert exercises, f"{name}: no numbered open exercises under a '## Exercises' heading"
    assert exercises == list(range(1, len(exercises) + 1)), f"{name}: exercises numbered {exercises}"
    got = answers(name)
    assert got is not None, (f"{name}: {len(exercises)} open exercises and no answer key: write "
                             f"docs/instructor/answers/{name}.md with a '## N.' heading per exercise")
    missing = [n for n in exercises if n not in got]
    extra = [n for n in got if n not in exercises]
    assert not missing, f"{name}: exercise(s) {missing} have no answer in answers/{name}.md"
    assert not extra, f"{name}: answers/{name}.md answers exercise(s) {extra}, which the notebook lacks"
    assert len(got) == len(set(got)), f"{name}: answers/{name}.md answers an exercise twice: {got}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_notebook_ends_with_one_checked_exercise(path):
    name = path.stem
    headings = [t for t in _markdown(path) if re.search(r"^### Checked exercise", t, re.M)]
    if name in WITHOUT_A_CHECKED_EXERCISE:
        assert not headings, f"{name} has a checked exercise now: drop it from WITHOUT_A_CHECKED_EXERCISE"
        return
    assert len(headings) == 1, f"{name}: {len(headings)} '### Checked exercise' headings, not 1"
    cells = json.loads(path.read_text())["cells"]
    called = {m for c in cells if c["cell_type"] == "code"
              for m in re.findall(r"""check\(["'](\w+)["']""", "".join(c["source"]))}
    mine = {n for n, ex in EXERCISES.items() if ex.notebook == name}
    assert called and called <= mine, (f"{name}: its cells check {sorted(called)}, dlab.exercises "
                                       f"registers {sorted(mine)} for it")


@pytest.mark.parametrize("doc", ["README.md", "syllabus.md"])
def test_the_instructor_documents_name_every_notebook(doc):
    text = (ROOT / "docs" / "instructor" / doc).read_text()
    missing = [p.stem for p in NOTEBOOKS if p.stem[:2] + " " not in text and p.stem not in text]
    assert not missing, f"docs/instructor/{doc} does not name notebook(s) {missing}"


def test_the_parser_reads_a_notebook_it_was_not_written_for(tmp_path):
    cells = [{"cell_type": "markdown", "source": ["## Exercises\n\n1. one\n   more\n2. two\n\n"
                                                  "### Checked exercise: `x`\n\n3. not open\n"]}]
    nb = tmp_path / "99_x.ipynb"
    nb.write_text(json.dumps({"cells": cells}))
    assert open_exercises(nb) == [1, 2]


def test_every_name_the_cheat_sheet_cites_exists():
    """The cheat sheet's formulas cite the ``dlab.theory`` functions that compute them: each cited
    dotted name (``theory.memory.paper_memory``, ``dlab.plan.step_range``) must resolve, so a
    rename shows here rather than as a dead reference."""
    import importlib

    text = (ROOT / "docs" / "CHEATSHEET.md").read_text()
    cited = set(re.findall(r"`((?:dlab\.)?(?:theory|models|core|comm|layout|plan)\.[\w.]+)`", text))
    assert len(cited) > 20
    missing = []
    for name in sorted(cited):
        parts = ("dlab." + name if not name.startswith("dlab.") else name).split(".")
        for cut in range(len(parts), 1, -1):  # the longest importable module, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ModuleNotFoundError:
                continue
            try:
                for attr in parts[cut:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                missing.append(name)
            break
        else:
            missing.append(name)
    assert not missing, f"docs/CHEATSHEET.md cites names dlab does not have: {missing}"
