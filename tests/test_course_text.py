"""What a learner reads holds no words of the project's own development: no review or reviewer
that an edit answered, no helper, stop or issue number, no path outside the repository. Read
by a learner: every notebook's markdown, the answer keys, the cheat sheet and NOTATION.md.

The phrases are the ones such text had (a prose pointer to "the run the course's review read",
an answer key citing the development machine's /work/shared/TORCH_ON_CPU.md) and their kin,
each one that only development talk uses. "session" is not among them: notebook 15 teaches a
GPU session (`make gpu-session`). Data-driven: a new notebook or answer key is read without
editing this file."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

DEVELOPMENT = [  # (regex, what it names)
    (r"\bthe\s+(?:course's\s+|instructor's\s+)?review\b", "a review of the course, unseen by a learner"),
    (r"\breviewers?\b", "the course's reviewers"),
    (r"\bthis\s+stop\b", "a development stop"),
    (r"\bhelpers?\b(?!\s+(?:functions?|modules?|class|script|process(?:es)?)\b)",
     "the project's helpers (a helper function is fine)"),
    (r"\bissue\s+#?\d{2,}\b", "an issue of the project's tracker"),
    (r"TORCH_ON_CPU\.md|DESIGN\.md|\.\./shared\b|/work/|\bworktrees?\b",
     "a file or folder outside the repository"),
]


def _learner_texts():
    """(name, text) of every text a learner reads: one per notebook markdown cell. Prose
    breaks its lines anywhere, so the phrases match across line breaks."""
    for nb in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        for i, cell in enumerate(json.loads(nb.read_text())["cells"]):
            if cell["cell_type"] == "markdown":
                yield f"{nb.name}[{i}]", "".join(cell["source"])
    for md in [*sorted((ROOT / "docs" / "instructor" / "answers").glob("*.md")),
               ROOT / "docs" / "CHEATSHEET.md", ROOT / "notebooks" / "NOTATION.md"]:
        yield str(md.relative_to(ROOT)), md.read_text()


def _hits(text: str) -> list[str]:
    return [f"{m.group(0)!r} ({why})" for pattern, why in DEVELOPMENT
            for m in re.finditer(pattern, text, re.IGNORECASE)]


def test_learner_facing_text_has_no_development_words():
    texts = list(_learner_texts())
    assert len(texts) > 100, "the notebooks' markdown and the answer keys were not found"
    found = [f"{name}: {hit}" for name, text in texts for hit in _hits(text)]
    assert not found, ("development words in learner-facing text; say what the learner can "
                       "check instead:\n" + "\n".join(found))


@pytest.mark.parametrize("text", [
    "the run the\ncourse's review read found exactly that",
    "(the run the review read; under a different load)",
    "as the reviewer noted", "since this stop", "the helper's branch", "issue 46 asked for it",
    "`/work/shared/TORCH_ON_CPU.md`", "see ../shared/DESIGN.md",
])
def test_the_phrases_are_caught(text):
    assert _hits(text), f"{text!r} is development talk and should be caught"


@pytest.mark.parametrize("text", [
    "a helper function the cell defines", "the GPU session's folder", "make gpu-session",
    "each rank must issue 2 sends", "review the table above", "the shared memory algorithm",
])
def test_course_words_pass(text):
    assert not _hits(text), f"{text!r} is course text, not development talk"
