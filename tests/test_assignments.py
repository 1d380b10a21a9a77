"""The checked exercises as an nbgrader course (``python -m dlab assignments``, make assignments):
a source and a release for every notebook with checked exercises, no line of any reference
solution in a release, every release solution cell raising where the learner writes, and
nbgrader's own ``autograde`` giving the reference solutions full marks and the typical mistakes
of tests/test_exercises.py none, with the checker's message in the graded notebook."""
from __future__ import annotations

import ast
import json
import linecache
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import WITHOUT_A_CHECKED_EXERCISE, processes_of
from test_exercises import MISTAKES, SOLUTIONS

from dlab.exercises import EXERCISES
from dlab.tools import assignments

NOTEBOOKS = SOLUTIONS.parents[2] / "notebooks"
# autograded in the default run: one distributed exercise (2 ranks), its reference and its
# mistake (~30 CPU-seconds: nbgrader, two kernels, two checks); every other assignment goes the
# same way (nbgrader, a kernel, check) in the slow test
DEFAULT_AUTOGRADE = ("09_expert_parallel",)
# the assignment's stub names row_parallel_linear's g ReduceFromParallel; MISTAKES calls it G
RENAMED = {"row_parallel_linear": ("G", "ReduceFromParallel")}


@pytest.fixture(scope="module")
def course(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("course")
    assignments.build(out)
    return out


def cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def code(cell: dict) -> str:
    return cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])


def grading(cell: dict) -> dict:
    return cell["metadata"].get("nbgrader", {})


def notebooks_calling_check() -> set[str]:
    """The learners' notebooks with a cell that calls ``dlab.exercises.check``, read from the
    notebooks themselves (not from the register the builder reads)."""
    return {p.stem for p in NOTEBOOKS.glob("*.ipynb")
            if any(c["cell_type"] == "code" and "from dlab.exercises import check" in code(c)
                   and re.search(r"^check\(", code(c), re.M) for c in cells(p))}


def test_a_source_and_a_release_for_every_notebook_with_checked_exercises(course):
    from nbgrader.nbgraderformat import read  # validates nbgrader's cell metadata (schema 3)

    expected = notebooks_calling_check()
    assert expected == {ex.notebook for ex in EXERCISES.values()}
    assert expected == {p.stem for p in NOTEBOOKS.glob("*.ipynb")} - WITHOUT_A_CHECKED_EXERCISE
    for folder in ("source", "release"):
        assert {p.name for p in (course / folder).iterdir()} == expected, folder
    graded = {}
    for name in expected:
        source = course / "source" / name / f"{name}.ipynb"
        release = course / "release" / name / f"{name}.ipynb"
        for path in (source, release):
            with path.open() as f:
                read(f, as_version=4)
        for cell in cells(source):
            meta = grading(cell)
            if meta.get("grade"):
                assert meta["locked"] and meta["points"] == 1 and not meta["solution"], meta
                graded[meta["grade_id"]] = name
                assert f"check({meta['grade_id'].removeprefix('test_')!r}" in code(cell).replace('"', "'")
            if meta.get("solution"):
                assert not meta["grade"] and not meta["locked"], meta
        for cell in cells(release):  # nbgrader locked the setup and the autograder cells
            if grading(cell).get("locked"):
                assert cell["metadata"]["editable"] is False, code(cell)
    # every exercise graded once, in its own notebook's assignment
    assert graded == {f"test_{n}": ex.notebook for n, ex in EXERCISES.items()}
    assert "c.CourseDirectory.course_id = 'dlab'" in (course / "nbgrader_config.py").read_text()


def test_no_release_holds_a_line_of_a_reference_solution(course):
    """Every line of docs/instructor/solutions/*.py that the learners' notebooks do not already
    show (imports aside) is in its source notebook, and in no release notebook."""
    public = {line.strip() for p in NOTEBOOKS.glob("*.ipynb") for c in cells(p)
              if c["cell_type"] == "code" for line in code(c).splitlines()}

    def lines(folder: str, name: str | None = None) -> set[str]:
        paths = (course / folder).glob(f"{name or '*'}/*.ipynb")
        return {line.strip() for p in paths for c in cells(p) for line in code(c).splitlines()}

    released = lines("release")
    text = "".join(p.read_text() for p in (course / "release").glob("*/*.ipynb"))
    assert "docs/instructor" not in text  # the learners' notebooks point there; a release does not
    for path in sorted(SOLUTIONS.glob("*.py")):
        withheld = {line.strip() for line in path.read_text().splitlines()
                    if line.strip() and not line.strip().startswith(("import ", "from "))} - public
        in_source = withheld & lines("source", EXERCISES[path.stem].notebook)
        assert len(in_source) >= 1, f"{path.name}: none of its lines is in its source notebook"
        leaked = sorted(withheld & released)
        assert not leaked, f"{path.name}: lines in a release: {leaked}"


def test_a_solution_goes_into_its_stub_between_the_delimiters():
    stub = ('class F(torch.autograd.Function):\n    @staticmethod\n    def forward(ctx, x):\n'
            '        raise NotImplementedError\n\n\n'
            'def f(x):\n    """Doc."""\n    raise NotImplementedError\n')
    solution = ('import torch\n\n\nclass F(torch.autograd.Function):\n    """Theirs."""\n\n'
                '    @staticmethod\n    def forward(ctx, x):\n        return x.view_as(x)\n\n\n'
                'def f(x):\n    """Mine."""\n    # why\n    y = F.apply(x)\n    return y\n')
    assert assignments.solution_cell(stub, solution, "f") == (
        'class F(torch.autograd.Function):\n    @staticmethod\n    def forward(ctx, x):\n'
        '        ### BEGIN SOLUTION\n        return x.view_as(x)\n        ### END SOLUTION\n\n\n'
        'def f(x):\n    """Doc."""\n    ### BEGIN SOLUTION\n    # why\n    y = F.apply(x)\n'
        '    return y\n    ### END SOLUTION')


@pytest.mark.parametrize("solution,says", [
    ("def g(x):\n    return x\n", "the stub leaves ['f'] to write, the solution defines ['g']"),
    ("import numpy\n\n\ndef f(x):\n    return x\n", "'import numpy' at module level"),
    ("SCALE = 2\n\n\ndef f(x):\n    return SCALE * x\n", "line 1 is neither a definition"),
])
def test_a_solution_that_does_not_fit_its_stub_is_refused(solution, says):
    """Before anything is written: a solution the stub has no place for would be lost."""
    with pytest.raises(assignments.AssignmentError, match=re.escape(says)):
        assignments.solution_cell("def f(x):\n    raise NotImplementedError\n", solution, "f")


def test_a_folder_without_the_notebooks_and_solutions_is_refused(tmp_path):
    """An installed package (a wheel holds dlab/ only) says where the course is built from."""
    with pytest.raises(assignments.AssignmentError, match="built from a clone of the repository"):
        assignments.assignments(tmp_path)


def _run(source: str, where: str, scope: dict) -> None:
    """Execute a cell as a kernel would, its lines kept where ``inspect`` (and so ``check``)
    finds them."""
    linecache.cache[where] = (len(source), None, source.splitlines(True), where)
    exec(compile(source, where, "exec"), scope)  # noqa: S102 - the release's own cells


def test_every_release_solution_cell_raises_where_the_learner_writes(course):
    """Run as it is released, each assignment defines the learner's functions, each of which
    raises NotImplementedError, and each autograder cell fails saying what to write (no rank
    starts: check sees the stub)."""
    for path in sorted((course / "release").glob("*/*.ipynb")):
        scope: dict = {}
        for i, cell in enumerate(cells(path)):
            if cell["cell_type"] != "code":
                continue
            source, meta, where = code(cell), grading(cell), f"<{path.stem} cell {i}>"
            if meta.get("grade"):
                with pytest.raises(AssertionError, match="^not written yet: "):
                    _run(source, where, scope)
                continue
            _run(source, where, scope)
            if not meta.get("solution"):
                continue
            assert "# YOUR CODE HERE" in source and "SOLUTION" not in source, source
            stubs = []
            for node in ast.parse(source).body:
                if isinstance(node, ast.FunctionDef):
                    stubs.append((node.name, scope[node.name], len(node.args.args)))
                elif isinstance(node, ast.ClassDef):
                    stubs += [(f"{node.name}.{m.name}", getattr(scope[node.name], m.name), len(m.args.args))
                              for m in node.body if isinstance(m, ast.FunctionDef)]
            assert stubs, source
            for name, fn, n_args in stubs:
                try:
                    fn(*[None] * n_args)
                except NotImplementedError:
                    continue
                pytest.fail(f"{path.name}: {name} returned instead of raising NotImplementedError")


def mistaken(solution_cell: str, name: str) -> str:
    """A solution cell holding ``name``'s typical mistake: the reference's definitions, then the
    mistake's, which replace theirs (column_parallel_linear's f written, then not applied)."""
    wrong = MISTAKES[name][0]
    if name in RENAMED:
        old, new = RENAMED[name]
        wrong = re.sub(rf"\b{old}\b", new, wrong)
    return f"{solution_cell}\n\n\n{wrong}"


def autograde(course: Path, names: tuple[str, ...], tmp_path: Path) -> dict:
    """nbgrader's ``autograde`` (its command line, in a copy of the course) of two submissions
    per assignment: ``reference``, the source notebook itself, and ``mistake``, each solution
    cell holding its exercise's typical mistake. ``{(assignment, student): (score, max score,
    {exercise: its autograder cell's output})}``."""
    from nbgrader.api import Gradebook  # the grading extra

    copy = tmp_path / "course"
    shutil.copytree(course, copy)
    for name in names:
        notebook = json.loads((copy / "source" / name / f"{name}.ipynb").read_text())
        for student in ("reference", "mistake"):
            if student == "mistake":
                for cell in notebook["cells"]:
                    if grading(cell).get("solution"):
                        cell["source"] = mistaken(code(cell), grading(cell)["grade_id"])
            target = copy / "submitted" / student / name / f"{name}.ipynb"
            target.parent.mkdir(parents=True)
            target.write_text(json.dumps(notebook))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with assignments.venv_on_path():
        env["PATH"] = os.environ["PATH"]
        done = subprocess.run([sys.executable, "-m", "nbgrader", "autograde", "*", "--force"],
                              cwd=copy, env=env, capture_output=True, text=True, timeout=1800)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
        assert not processes_of(copy), "an autograded check left a rank behind"
        out = {}
        with Gradebook(f"sqlite:///{copy / 'gradebook.db'}", assignments.COURSE_ID) as gb:
            for name in names:
                for student in ("reference", "mistake"):
                    graded = copy / "autograded" / student / name / f"{name}.ipynb"
                    said = {grading(c)["grade_id"].removeprefix("test_"): _output(c)
                            for c in cells(graded) if grading(c).get("grade")}
                    submission = gb.find_submission(name, student)
                    out[name, student] = (submission.score, submission.max_score, said)
    return out


def _output(cell: dict) -> str:
    """What the cell printed, and its exception's message."""
    return "\n".join("".join(o.get("text", "")) + o.get("evalue", "") for o in cell["outputs"])


def mistake_says(name: str) -> str:
    """What the mistake submission's report of ``name`` says. An assembled exercise's pieces are
    the submission's own functions, which hold their typical mistakes there: its checker names
    the first piece, which fails its own check."""
    pieces = EXERCISES[name].pieces
    return f"your {pieces[0]} does not pass its own check yet" if pieces else MISTAKES[name][1]


def _assert_graded(results: dict, names: tuple[str, ...]) -> None:
    wrong = []
    for name in names:
        score, top, said = results[name, "reference"]
        exercises = [n for n, ex in EXERCISES.items() if ex.notebook == name]
        if not (score == top == len(exercises)):
            wrong.append(f"{name}, the reference solutions: {score} of {top} points: {said}")
        score, _, said = results[name, "mistake"]
        if score != 0:
            wrong.append(f"{name}, the typical mistakes: {score} points: {said}")
        wrong += [f"{name}, {n}'s mistake: {mistake_says(n)!r} not in {said[n]!r}"
                  for n in exercises if mistake_says(n) not in said[n]]
        wrong += [f"{name}, {n}'s reference: {said[n]!r}" for n in exercises
                  if "correct" not in results[name, "reference"][2][n]]
    assert not wrong, "\n".join(wrong)


def test_the_autograder_passes_the_reference_and_names_the_mistake(course, tmp_path):
    _assert_graded(autograde(course, DEFAULT_AUTOGRADE, tmp_path), DEFAULT_AUTOGRADE)


@pytest.mark.slow  # every other assignment: ~20 checks of 2-4 ranks, through nbgrader's kernels
def test_the_autograder_grades_every_assignment(course, tmp_path):
    names = tuple(sorted({ex.notebook for ex in EXERCISES.values()} - set(DEFAULT_AUTOGRADE)))
    _assert_graded(autograde(course, names, tmp_path), names)
