"""What ``pip install -e .`` promises: every package that dlab/ imports is declared in
``pyproject.toml`` (the lab's figures, dashboard and magics in the ``lab`` extra, nbgrader for
``python -m dlab assignments`` in the ``grading`` extra, the rest in the dependencies), torch
has a floor that ``make test-compat`` runs on and no cap (a cap makes pip swap a newer torch, a
multi-GB CUDA build, for an older one), and a venv built from the declared dependencies alone
launches a run and answers ``python -m dlab`` commands, saying what to install for the lab
rather than failing in it."""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11; the checks are the same on 3.10

REPO = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
# import name -> distribution name, where they differ
DISTRIBUTION = {"IPython": "ipython"}
# where dlab imports the lab extras: figures, the dashboard and the magics, each loaded only
# when one is asked for (tests/test_architecture.py holds them to that)
LAB_SIDE = ("dlab/ui/", "dlab/tools/magic.py")
# where dlab imports the grading extra (nbgrader): python -m dlab assignments, when it runs
GRADING_SIDE = ("dlab/tools/assignments.py",)


def requirement_names(lines: list[str]) -> dict[str, str]:
    """``{distribution name: its requirement}`` (an extra's ``dlab[lab]`` left out)."""
    out = {}
    for line in lines:
        name = re.match(r"[A-Za-z0-9_.-]+", line).group(0).lower()
        if name != "dlab":
            out[name] = line
    return out


CORE = requirement_names(PYPROJECT["dependencies"])
LAB = requirement_names(PYPROJECT["optional-dependencies"]["lab"])
GRADING = requirement_names(PYPROJECT["optional-dependencies"]["grading"])


def third_party_imports() -> dict[str, set[str]]:
    """``{top-level module: the files of dlab/ that import it}`` for every import that is
    neither the standard library nor dlab, imports inside functions included."""
    found: dict[str, set[str]] = {}
    for path in sorted((REPO / "dlab").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "dlab":
                    found.setdefault(top, set()).add(str(path.relative_to(REPO)))
    return found


def test_every_third_party_import_is_declared():
    imports = third_party_imports()
    assert {"torch", "numpy", "psutil"} <= set(imports), sorted(imports)  # the scan sees them
    assert "nbgrader" in imports  # the scan sees the deferred import of an extra
    for module, files in imports.items():
        dist = DISTRIBUTION.get(module, module).lower()
        assert dist in CORE or dist in LAB or dist in GRADING, (
            f"dlab imports {module} ({sorted(files)}) but pyproject.toml declares no {dist}")
        if dist not in CORE:
            extra, side = ("lab", LAB_SIDE) if dist in LAB else ("grading", GRADING_SIDE)
            outside = [f for f in files if not f.startswith(side)]
            assert not outside, (f"{module} is in the {extra} extra only, but {outside} import it: "
                                 f"declare it in dependencies or move the import to {side}")


def test_torch_has_a_floor_that_make_test_compat_runs_and_no_cap():
    torch_req = CORE["torch"]
    assert "<" not in torch_req and "!=" not in torch_req, (
        f"{torch_req}: a cap makes pip replace a newer torch with an older multi-GB build")
    floor = re.fullmatch(r"torch>=(\d+\.\d+)", torch_req)
    assert floor, torch_req
    makefile = (REPO / "Makefile").read_text()
    assert f"TORCH_FLOOR ?= torch=={floor.group(1)}.0" in makefile, "test-compat tests another floor"
    have = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    assert have >= tuple(int(x) for x in floor.group(1).split(".")), (torch.__version__, torch_req)


def _pip(venv: Path, *args: str) -> None:
    done = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *args],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


# slow: building a venv installs torch again (about a minute on the 2-core machine); the
# declarations it relies on are checked by the two tests above in the default run
@pytest.mark.slow
def test_a_venv_from_the_declared_dependencies_alone_launches_a_run(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    # this interpreter's torch build, so pip takes the wheel it already took, not a CUDA one
    pins = tmp_path / "pins.txt"
    pins.write_text(f"torch=={torch.__version__}\n")
    _pip(venv, "-c", str(pins), "-e", str(REPO))
    python = str(venv / "bin" / "python")
    listed = subprocess.run([python, "-m", "pip", "list", "--format=freeze"], capture_output=True,
                            text=True, check=True).stdout.lower()
    for extra in ("matplotlib", "ipywidgets", "jupyterlab"):  # the declared dependencies alone
        assert f"\n{extra}==" not in f"\n{listed}", f"{extra} came in without being asked for"
    check = subprocess.run([python, "-m", "pip", "check"], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["OMP_NUM_THREADS"] = "1"
    launch = ("import dlab\n"
              f"run = dlab.launch('ddp', 2, steps=2, wait=True, runs_dir={str(tmp_path / 'runs')!r})\n"
              "print(run.state, len(run.metrics(1)))\n")
    done = subprocess.run([python, "-c", launch], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.split()[-2:] == ["ok", "2"], (
        done.stdout[-2000:] + done.stderr[-3000:])
    done = subprocess.run([python, "-m", "dlab", "strategies"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "zero3" in done.stdout, done.stderr[-3000:]
    done = subprocess.run([python, "-m", "dlab", "lab"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "http" not in done.stdout, done.stdout + done.stderr
    assert 'pip install -e ".[lab]"' in done.stderr and "jupyterlab" in done.stderr, done.stderr
