"""Execute notebooks and store the outputs nbval checks, and no others.

nbval (``--nbval-lax``, as ``make test`` runs it) compares a cell's fresh output with the stored
one only in cells marked ``# NBVAL_CHECK_OUTPUT``, and a checked cell with nothing stored fails.
So the stored notebooks keep those outputs: the stable, teaching ones (a formula's value, a
parity verdict). Cells tagged ``reference`` keep theirs too: the measured figures of one run on
the 2-core CI machine, for a learner to compare with their own; they are also tagged
``nbval-ignore-output``, so nbval runs them without comparing. Every other cell is saved empty,
and the widgets' saved state is dropped, which keeps diffs readable. Each kept output records
the hash of the source that printed it (``metadata.dlab.source``), so a cell edited after its
output was stored is caught (tests/test_stored_claims.py) until it is stored again. Run this
after editing a notebook:

    .venv/bin/python tests/store_notebook_outputs.py notebooks/05_zero_fsdp.ipynb   # or no args: all
"""

from __future__ import annotations

import datetime
import hashlib
import os
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
CHECK = "NBVAL_CHECK_OUTPUT"
REFERENCE = "reference"


def source_hash(source: str) -> str:
    """What a stored output records of the cell that printed it."""
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def store(path: Path, timeout: int = 900) -> int:
    """Run the notebook and keep its checked and reference outputs; the notebook's metadata
    says when they were taken and how busy the machine was (``dlab.stored``: the date, the
    cores, the load average before and after), which the timing lessons point to."""
    nb = nbformat.read(path, as_version=4)
    before = os.getloadavg()[0]
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    nb.metadata["dlab"] = {"stored": {"date": datetime.date.today().isoformat(),
                                      "cores": os.cpu_count(),
                                      "load": [round(before, 2), round(os.getloadavg()[0], 2)]}}
    nbformat.write(nb, path)
    return strip(path, ran=True)


def strip(path: Path, ran: bool = False) -> int:
    """Keep only checked and reference cells' outputs. nbval refuses a cell with outputs but no
    execution count ("unrun reference cell"), so a kept cell is numbered by its place among code
    cells, which is what a run from the top gives it. Only a run (``ran``) records which source
    printed an output; stripping alone keeps what was recorded."""
    nb = nbformat.read(path, as_version=4)
    nb.metadata.pop("widgets", None)
    code = [c for c in nb.cells if c.cell_type == "code"]
    kept = 0
    for number, cell in enumerate(code, start=1):
        cell.metadata.pop("execution", None)
        tags = cell.metadata.get("tags", [])
        if REFERENCE in tags and "nbval-ignore-output" not in tags:
            cell.metadata["tags"] = [*tags, "nbval-ignore-output"]
        if CHECK in cell.source or REFERENCE in tags:
            for out in cell.outputs:  # a widget's view needs its saved state, which is dropped
                out.get("data", {}).pop("application/vnd.jupyter.widget-view+json", None)
            cell.outputs = [o for o in cell.outputs if o.get("output_type") == "stream" or o.get("data")]
            kept += 1
            if ran or "dlab" not in cell.metadata:
                cell.metadata["dlab"] = {"source": source_hash(cell.source)}
            cell.execution_count = number
            for out in cell.outputs:
                if "execution_count" in out:
                    out["execution_count"] = number
        else:
            cell.metadata.pop("dlab", None)
            cell.execution_count, cell.outputs = None, []
    nbformat.write(nb, path)
    return kept


def main(argv: list[str]) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    only_strip = "--strip" in argv  # renumber and drop unchecked outputs, without running
    paths = [Path(a).resolve() for a in argv if a != "--strip"] or sorted(NOTEBOOKS.glob("*.ipynb"))
    for path in paths:
        kept = strip(path) if only_strip else store(path)
        print(f"{path.name}: stored {kept} checked outputs", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
