"""``python -m dlab assignments``: the checked exercises as an nbgrader course, answers withheld.

The course is generated from what the repository already holds, so nothing is written twice:
each notebook with checked exercises (``dlab.exercises``, ``Exercise.notebook``) becomes one
assignment, ``source/<notebook>/<notebook>.ipynb``, whose cells per exercise are

- the notebook's own text introducing the exercise (its pointer to the reference solution cut),
- the learner's stub from the notebook's exercise cell, every ``raise NotImplementedError`` in it
  replaced by the body of the reference solution (``docs/instructor/solutions/NAME.py``) between
  nbgrader's ``### BEGIN SOLUTION`` / ``### END SOLUTION``: the solution cell,
- the notebook's ``check(...)`` call, asserting the report: the locked autograder cell (an
  exercise that calls an earlier one's function, ``Exercise.pieces``, gets the learner's own from
  that exercise's solution cell above it);

with a locked setup cell on top (``check``, and ``torch``, ``dist`` and ``math``: the names
``check`` gives the learner's function on the ranks) and, where an exercise cell sets up more
(the capstone prints its brief), a locked cell of that before its solution cell. nbgrader's own
``generate_assignment`` then writes ``release/``, each solution region replaced by its stub
(``raise NotImplementedError()``), outputs cleared, checksums recorded for autograding.

Only ``source/``, ``release/`` and ``nbgrader_config.py`` are rewritten: an instructor's
``submitted/``, ``autograded/``, ``feedback/`` and ``gradebook.db`` in the same folder stay.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import json
import os
import re
import shutil
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from dlab.exercises import EXERCISES, Exercise

REPO = Path(__file__).resolve().parents[2]
COURSE_ID = "dlab"
DEFAULT_OUT = "build/assignments"  # git-ignored (build/), apart from the learners' notebooks/
POINTS = 1  # per checked exercise: each is right or not, as check says
INSTALL_GRADING = 'pip install -e ".[grading]"'  # from the repository; make assignments runs it
# what the exercises' functions may use without importing it: dlab.exercises.registry.define's
# scope on the ranks, given to the notebook's process too by the setup cell
SCOPE = ("import math", "import torch", "import torch.distributed as dist")
SETUP = (*SCOPE, "from dlab.exercises import check")  # the assignment's first cell
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
# the sentence each exercise's text ends with in the learners' notebooks; a graded course's
# learners have no docs/instructor/
POINTER = re.compile(r"\s*A reference\s+solution\s+is\s+in\s+`docs/instructor/solutions/\w+\.py`;"
                     r"\s+try\s+first\.")
CONFIG = f"""\
# nbgrader's course configuration, written by python -m dlab assignments: run nbgrader from here
c = get_config()  # noqa: F821 - nbgrader's config loader defines it
c.CourseDirectory.course_id = {COURSE_ID!r}
# an autograder cell starts 2-4 ranks (a few seconds each, more on a busy machine), past
# nbgrader's 30 s per cell
c.Execute.timeout = 600
# the run directories check writes beside a notebook (runs/exercises/): not copied from a
# submission into autograded/ and feedback/
c.CourseDirectory.ignore.append("runs")
"""


class AssignmentError(ValueError):
    """The notebooks, the solutions and the register disagree: said before anything is written."""


@dataclass
class Part:
    """One checked exercise, as the assignment's cells hold it."""
    exercise: Exercise
    text: str       # markdown
    setup: list     # the exercise cell's statements that are neither its stub nor its check
    stub: str       # the learner's definitions, as the notebook gives them
    check: str      # the notebook's check(...) call
    solution: str = ""  # the stub with the reference solution in its marked regions


@dataclass
class Assignment:
    name: str  # the notebook's stem
    title: str
    parts: list = field(default_factory=list)


def assignments(repo: Path = REPO) -> list[Assignment]:
    """One assignment per notebook with checked exercises, in the course's order."""
    notebooks, solutions = repo / "notebooks", repo / "docs" / "instructor" / "solutions"
    if not solutions.is_dir() or not notebooks.is_dir():
        raise AssignmentError(f"the assignments are built from a clone of the repository "
                              f"(notebooks/ and docs/instructor/solutions/); {repo} has none")
    out: dict[str, Assignment] = {}
    for ex in EXERCISES.values():
        path = notebooks / f"{ex.notebook}.ipynb"
        if not path.is_file():
            raise AssignmentError(f"exercise {ex.name}: its notebook {path} does not exist")
        solution = solutions / f"{ex.name}.py"
        if not solution.is_file():
            raise AssignmentError(f"exercise {ex.name}: no reference solution at {solution}")
        cells = json.loads(path.read_text())["cells"]
        if ex.notebook not in out:
            out[ex.notebook] = Assignment(ex.notebook, _title(cells, ex.notebook))
        earlier = [p.exercise.name for p in out[ex.notebook].parts]
        missing = [u for u in ex.pieces if u not in earlier]
        if missing:  # the learner's own function is defined by an earlier solution cell
            raise AssignmentError(f"exercise {ex.name} calls {missing[0]}: register {missing[0]} "
                                  f"for notebook {ex.notebook} before it")
        part = _part(ex, cells, path)
        part.solution = solution_cell(part.stub, solution.read_text(), f"{ex.name} ({solution})")
        out[ex.notebook].parts.append(part)
    return [out[name] for name in sorted(out)]


def _title(cells: list, name: str) -> str:
    first = "".join(cells[0]["source"]).splitlines()[0] if cells else ""
    return first.lstrip("# ").strip() or name


def _calls_check(node: ast.stmt, name: str) -> bool:
    call = node.value if isinstance(node, ast.Expr) else None
    return (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "check"
            and bool(call.args) and isinstance(call.args[0], ast.Constant) and call.args[0].value == name)


def _part(ex: Exercise, cells: list, path: Path) -> Part:
    """The exercise's cell in its notebook (the code cell calling ``check("NAME", ...)``), cut
    into setup, stub and check, with the markdown cell before it."""
    found = []
    for i, cell in enumerate(cells):
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue  # a cell with IPython syntax is not an exercise cell
        if any(_calls_check(node, ex.name) for node in tree.body):
            found.append((i, source, tree))
    if len(found) != 1:
        raise AssignmentError(f"{path.name}: {len(found)} cells call check({ex.name!r}, ...); the "
                              f"exercise's cell is the one that does")
    i, source, tree = found[0]
    lines = source.splitlines()
    setup, stub, check = [], [], None
    for node in tree.body:
        first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", ()))])
        text = "\n".join(lines[first - 1:node.end_lineno])
        if _calls_check(node, ex.name):
            check = text
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            stub.append(text)
        else:
            setup.append(text)
    before = cells[i - 1] if i else None
    text = "".join(before["source"]) if before and before["cell_type"] == "markdown" else ""
    if f"`{ex.name}`" not in text:  # no text of its own: the register's one line
        text = f"**`{ex.name}`**: write `{ex.task}`."
    return Part(ex, POINTER.sub("", text), setup, "\n\n\n".join(stub), check)


def _defs(tree: ast.Module, where: str) -> dict[str, ast.FunctionDef]:
    """``{"f": def, "Class.method": def}`` for the module's functions and its classes' methods."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            out[node.name] = node
        elif isinstance(node, ast.ClassDef):
            out.update({f"{node.name}.{m.name}": m for m in node.body if isinstance(m, ast.FunctionDef)})
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            line = ast.unparse(node)
            if line not in SCOPE:
                raise AssignmentError(f"{where}: {line!r} at module level: the function is sent to "
                                      f"the ranks alone, with {', '.join(SCOPE)}; import it inside")
        elif not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):
            raise AssignmentError(f"{where}: line {node.lineno} is neither a definition nor an "
                                  f"import; the assignment would leave it out")
    return out


def _unwritten(fn: ast.FunctionDef) -> ast.Raise | None:
    """The stub's ``raise NotImplementedError`` in ``fn``'s body, if it has one."""
    for node in fn.body:
        exc = node.exc if isinstance(node, ast.Raise) else None
        exc = exc.func if isinstance(exc, ast.Call) else exc
        if isinstance(exc, ast.Name) and exc.id == "NotImplementedError":
            return node
    return None


def _body(fn: ast.FunctionDef, lines: list[str]) -> str:
    """``fn``'s body as written (its docstring left out, the comments above its first
    statement kept), dedented."""
    body = fn.body[1:] if ast.get_docstring(fn) is not None else fn.body
    if not body:
        return "pass"
    start = min([body[0].lineno, *(d.lineno for d in getattr(body[0], "decorator_list", ()))]) - 1
    while start > 0 and lines[start - 1].strip().startswith("#"):
        start -= 1
    return textwrap.dedent("\n".join(lines[start:fn.end_lineno]))


def solution_cell(stub: str, solution: str, where: str) -> str:
    """The stub with each ``raise NotImplementedError`` replaced by the solution's body of the
    same function (or method), between nbgrader's solution delimiters."""
    stub_defs = _defs(ast.parse(stub), f"the stub of {where}")
    solution_defs = _defs(ast.parse(solution), where)
    todo = {name: raised for name, fn in stub_defs.items() if (raised := _unwritten(fn))}
    if not todo:
        raise AssignmentError(f"{where}: the notebook's stub raises NotImplementedError nowhere: "
                              f"there is nothing for the learner to write")
    missing = sorted(set(todo) - set(solution_defs))
    extra = sorted(set(solution_defs) - set(todo))
    if missing or extra:
        raise AssignmentError(f"{where}: the stub leaves {sorted(todo)} to write, the solution "
                              f"defines {sorted(solution_defs)}: make them name the same functions")
    lines, solution_lines = stub.splitlines(), solution.splitlines()
    for name, raised in sorted(todo.items(), key=lambda item: -item[1].lineno):
        indent = re.match(r"\s*", lines[raised.lineno - 1]).group(0)
        body = textwrap.indent(_body(solution_defs[name], solution_lines), indent)
        lines[raised.lineno - 1:raised.end_lineno] = [indent + BEGIN, *body.splitlines(), indent + END]
    cell = "\n".join(lines)
    ast.parse(cell)  # the regions fit their functions
    return cell


def _meta(grade_id: str, *, solution: bool = False, grade: bool = False, locked: bool = False) -> dict:
    meta = {"grade": grade, "grade_id": grade_id, "locked": locked, "schema_version": 3,
            "solution": solution}
    if grade:
        meta["points"] = POINTS
    return {"nbgrader": meta}


def _cell(kind: str, cell_id: str, source: str, metadata: dict | None = None) -> dict:
    cell = {"cell_type": kind, "id": cell_id, "metadata": metadata or {}, "source": source}
    if kind == "code":
        cell.update(execution_count=None, outputs=[])
    return cell


def source_notebook(assignment: Assignment, kernel: dict) -> dict:
    """The instructor's version: every solution in its region, the autograder cells locked."""
    names = ", ".join(f"`{p.exercise.name}`" for p in assignment.parts)
    points = _points(POINTS) + (" each" if len(assignment.parts) > 1 else "")
    cells = [
        _cell("markdown", "header", f"# {assignment.title}: checked exercises\n\n"
              f"The checked exercises of notebook `{assignment.name}`: {names}, {points}. "
              f"Run the setup cell, write each function where it says `# YOUR CODE HERE` "
              f"(delete the `raise NotImplementedError()`), and run the test cell below it: "
              f"`dlab.exercises.check` runs your function (on fresh ranks where the exercise is "
              f"distributed) against a reference and says what is wrong. The autograder runs "
              f"the same test cells."),
        _cell("code", "setup", "\n".join(SETUP), _meta("setup", locked=True))]
    for part in assignment.parts:
        name = part.exercise.name
        cells.append(_cell("markdown", f"text-{name}", part.text))
        own = [line for line in part.setup if line not in SETUP]  # e.g. the capstone's brief
        if own:
            cells.append(_cell("code", f"setup-{name}", "\n".join(own), _meta(f"setup_{name}", locked=True)))
        cells += [_cell("code", name, part.solution, _meta(name, solution=True)),
                  _cell("code", f"test-{name}",
                        f"report = {part.check}\nprint(report)\nassert report.ok, report.message",
                        _meta(f"test_{name}", grade=True, locked=True))]
    return {"cells": cells, "metadata": kernel, "nbformat": 4, "nbformat_minor": 5}


def build(out: Path, repo: Path = REPO) -> list[dict]:
    """Write the course into ``out`` (source/, release/, nbgrader_config.py) and return what
    was written: one row per assignment."""
    if importlib.util.find_spec("nbgrader") is None:
        raise AssignmentError(f"building the assignments needs nbgrader: {INSTALL_GRADING} "
                              f"(make assignments does it)")
    from nbgrader.apps import NbGraderAPI  # the grading extra: loaded when assignments are built

    course = assignments(repo)  # every check of the inputs before anything is written
    out.mkdir(parents=True, exist_ok=True)
    (out / "nbgrader_config.py").write_text(CONFIG)
    for generated in ("source", "release"):
        shutil.rmtree(out / generated, ignore_errors=True)
    rows = []
    for assignment in course:
        notebook = json.loads((repo / "notebooks" / f"{assignment.name}.ipynb").read_text())
        kernel = {k: v for k, v in notebook["metadata"].items() if k in ("kernelspec", "language_info")}
        folder = out / "source" / assignment.name
        folder.mkdir(parents=True)
        path = folder / f"{assignment.name}.ipynb"
        path.write_text(json.dumps(source_notebook(assignment, kernel), indent=1) + "\n")
        rows.append({"assignment": assignment.name, "exercises": [p.exercise.name for p in assignment.parts],
                     "points": POINTS * len(assignment.parts), "source": path,
                     "release": out / "release" / assignment.name / path.name})
    api = NbGraderAPI()
    api.coursedir.root = str(out.resolve())
    api.coursedir.course_id = COURSE_ID
    with venv_on_path():
        for row in rows:
            result = api.generate_assignment(row["assignment"])
            if not result["success"]:
                raise AssignmentError(f"nbgrader generate_assignment {row['assignment']} failed:\n"
                                      f"{result.get('log', '')}\n{result.get('error', '')}")
    return rows


@contextlib.contextmanager
def venv_on_path():
    """This interpreter's scripts first on PATH: nbgrader's gradebook runs the ``alembic``
    command it installed (``nbgrader.api.get_alembic_version``), which a venv used without
    activating it (``.venv/bin/python -m dlab ...``) does not put on PATH."""
    before = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), before])
    try:
        yield
    finally:
        os.environ["PATH"] = before


def _points(n: int) -> str:
    return f"{n} point{'s' if n != 1 else ''}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dlab assignments", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=DEFAULT_OUT, help=f"the course folder (default {DEFAULT_OUT})")
    args = p.parse_args(argv)
    try:
        rows = build(Path(args.out))
    except AssignmentError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for row in rows:
        print(f"{row['assignment']:26s} {_points(row['points']):9s} {', '.join(row['exercises'])}")
        print(f"{'':26s} source  {row['source']}\n{'':26s} release {row['release']}")
    print(f"\n{len(rows)} assignments in {args.out}: give learners release/, keep source/ and "
          f"docs/instructor/ (docs/instructor/assignments.md)")
    return 0
