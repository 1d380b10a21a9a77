"""The package's layers import one way, and no import hides a circle inside a function.

Every ``import`` of a dlab module in ``dlab/`` is read from the source (module level and inside
functions alike), and three rules are checked over that graph:

- a module imports only from its own layer or the layers before it in ``LAYERS`` (so there is
  no circle between packages);
- no circle between modules, deferred imports included (a function-level import that closes a
  circle is still a circle: it only moves the failure to the first call);
- an import inside a function of a dlab module says why at its line (``# ...``), e.g. the CLI
  loading one command's heavy dependencies only when that command runs.

The table of layers is the one in CONTRIBUTING.md.
"""
from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "dlab"

#: each layer imports only from itself and the layers above it in this list
LAYERS = (
    ("models",),          # the GPT, the MoE, the MLP, recomputation, the corpus and its batches
    ("core",),            # options, RunConfig, the run directory, events, metrics, the machine
    ("comm",),            # instrumented collectives, wire bytes, hand-written algorithms
    ("layout",),          # a layout on paper: degrees and their rules, schedules, rank groups
    ("theory",),          # formulas (test oracles) and the planner at scale
    ("runtime",),         # what a rank runs besides its strategy: life, checkpoints, faults
    ("parallel",),        # the strategies, the mesh, the data-rank reduction
    ("worker",),          # python -m dlab.worker: validation, the training rank, the loop
    ("analysis",),        # reading runs: the reader, summary, diagnosis, step times
    ("ui",),              # figures and the dashboard: they draw run directories, start nothing
    ("procs",),           # what the notebook starts and stops: launch, Run, spawn, pool, elastic
    ("tools", "exercises"),  # built on runs: magics, check, calibration, JupyterLab; exercises
    ("bench",),           # python -m dlab bench NAME; notebooks never import it
    ("cli",),             # python -m dlab
    ("", "plan", "__main__"),  # the public faces: dlab, dlab.plan, python -m dlab
)
LAYER_OF = {pkg: i for i, names in enumerate(LAYERS) for pkg in names}


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("dlab", *path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _resolve(name: str, known: dict) -> str | None:
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def _targets(node, mod: str, is_pkg: bool, known: dict) -> list[str]:
    """The dlab modules an import statement names (relative imports resolved)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            here = mod if is_pkg else mod.rpartition(".")[0]
            for _ in range(node.level - 1):
                here = here.rpartition(".")[0]
            base = f"{here}.{base}" if base else here
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    found = (_resolve(n, known) for n in names if n.split(".")[0] == "dlab")
    return [t for t in found if t and t != mod]


def imports() -> list[tuple[str, str, int, bool, str]]:
    """(importer, imported, line, inside a function, the line's text) for every dlab import."""
    known = modules()
    out = []
    for mod, path in known.items():
        source = path.read_text()
        lines = source.splitlines()
        stack = [(node, False) for node in ast.iter_child_nodes(ast.parse(source))]
        while stack:
            node, in_function = stack.pop()
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                out += [(mod, t, node.lineno, in_function, lines[node.lineno - 1])
                        for t in _targets(node, mod, path.name == "__init__.py", known)]
            nested = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            stack += [(child, nested) for child in ast.iter_child_nodes(node)]
    return out


def test_every_package_has_a_layer():
    missing = sorted({package(m) for m in modules()} - set(LAYER_OF))
    assert not missing, f"packages with no layer in LAYERS: {missing}; add them where they belong"


def test_layers_import_one_way():
    wrong = [f"{a} (layer {package(a) or 'dlab'}) imports {b} (layer {package(b) or 'dlab'}), "
             f"line {line}"
             for a, b, line, _, _ in imports() if LAYER_OF[package(b)] > LAYER_OF[package(a)]]
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)


def test_no_circle_between_modules():
    graph = defaultdict(set)
    for a, b, *_ in imports():
        graph[a].add(b)
    circles = [c for c in _strongly_connected(graph) if len(c) > 1]
    assert not circles, f"modules that import each other (deferred imports included): {circles}"


def test_a_deferred_import_says_why():
    silent = [f"{a}:{line}: {text.strip()}" for a, b, line, deferred, text in imports()
              if deferred and "#" not in text]
    assert not silent, ("imports inside functions with no reason at the line (fix the layering, "
                        "or say why it waits):\n" + "\n".join(silent))


def test_the_checker_sees_a_circle_and_a_wrong_way_import():
    """The rules above can fail: a made-up graph with a circle and an upward import."""
    graph = {"dlab.core.a": {"dlab.core.b"}, "dlab.core.b": {"dlab.core.a"}}
    assert [sorted(c) for c in _strongly_connected(graph) if len(c) > 1] == [["dlab.core.a",
                                                                           "dlab.core.b"]]
    assert LAYER_OF[package("dlab.procs.launch")] > LAYER_OF[package("dlab.core.config")]


def _strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            out.append(comp)

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def test_no_notebook_imports_the_benches():
    """The benches sit at the top, under the CLI: a notebook reads runs through ``dlab`` and
    ``dlab.analysis``, and a bench's helper a lesson needs moves down to the layer it belongs
    to (as ``torch_run`` moved to ``dlab.parallel.pipeline.torch_pipelining``)."""
    import json

    found = []
    for path in sorted((PACKAGE.parent / "notebooks").glob("*.ipynb")):
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            if cell["cell_type"] != "code":
                continue
            for node in ast.walk(ast.parse(_without_magics("".join(cell["source"])))):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                found += [f"{path.name} cell {i}: {n}" for n in names
                          if n == "dlab.bench" or n.startswith("dlab.bench.")]
    assert not found, found


def _without_magics(source: str) -> str:
    """A cell's Python: IPython's magics and shell escapes (``%``, ``!``) blanked out."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line
                     for line in source.splitlines())


def test_no_test_imports_conftest():
    """tests/ and tests/browser each have a conftest.py; a test that imports ``conftest`` gets
    whichever pytest imported last, so shared helpers live in tests/helpers.py."""
    tests = Path(__file__).resolve().parent
    importing = [p.name for p in tests.rglob("test_*.py")
                 if re.search(r"^\s*(from conftest import|import conftest\b)", p.read_text(), re.M)]
    assert not importing, f"import from helpers, not conftest: {importing}"
