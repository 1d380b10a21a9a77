"""The notebooks' stored outputs agree with the prose beside them, and were printed by the cells
as they are now.

A reference output is one run's measurement, stored for the learner to compare with their own
(``tests/store_notebook_outputs.py``). Two ways it goes wrong without any test running a
notebook: the cell is edited and its old output stays (each kept output records the hash of
the source that printed it), or the prose states a result the stored figures contradict (a
timing lesson whose measurement, taken on a loaded machine, teaches the opposite). For the
second, each lesson's claim is read from the stored text here, with the relation the prose
states; the cells print their figures in a fixed form for this.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from store_notebook_outputs import CHECK, REFERENCE, source_hash  # noqa: E402

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def _cells(name: str) -> list[dict]:
    return json.loads((NOTEBOOKS / f"{name}.ipynb").read_text())["cells"]


def _text(cell: dict) -> str:
    out = []
    for o in cell.get("outputs", []):
        out.append("".join(o.get("text", "")) or "".join(o.get("data", {}).get("text/plain", "")))
    return "".join(out)


def stored(name: str, marker: str) -> str:
    """The stored text output of the one code cell of notebook ``name`` whose source holds
    ``marker``."""
    found = [c for c in _cells(name) if c["cell_type"] == "code" and marker in "".join(c["source"])]
    assert len(found) == 1, f"{name}: {len(found)} cells hold {marker!r}"
    text = _text(found[0])
    assert text, f"{name}: the cell with {marker!r} has no stored output: store the notebook"
    return text


def number(text: str, pattern: str) -> float:
    m = re.search(pattern, text)
    assert m, f"{pattern!r} not in the stored output:\n{text}"
    return float(m.group(1).replace(",", ""))


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.stem)
def test_every_stored_output_was_printed_by_the_cell_as_it_is(path):
    stale = []
    for i, cell in enumerate(json.loads(path.read_text())["cells"]):
        if cell["cell_type"] != "code" or not cell.get("outputs"):
            continue
        source = "".join(cell["source"])
        if CHECK not in source and REFERENCE not in cell["metadata"].get("tags", []):
            continue
        if cell["metadata"].get("dlab", {}).get("source") != source_hash(source):
            stale.append(i)
    assert not stale, (f"{path.name}: cells {stale} were edited after their output was stored; "
                       f"store them again: .venv/bin/python tests/store_notebook_outputs.py {path}")


def test_01_full_recomputation_costs_about_its_flops():
    """01 says the step grows by about the FLOPs ratio: measured within half of it, and above 1."""
    text = stored("01_one_device", "full / none step time")
    measured = number(text, r"full / none step time: ([\d.]+) measured")
    model = number(text, r"FLOPs ratio \(model\) ([\d.]+)")
    assert 1.0 < measured < 1.5 * model, text


def test_01_autocast_rounds_less_and_the_two_scalers_agree():
    """01 says autocast's bf16 losses stay nearer fp32's than the hand-rolled bf16 run's, and that
    GradScaler and the hand-rolled LossScaler skipped the same steps with the same history of S."""
    text = stored("01_one_device", "torch_runs = {")
    hand = number(text, r"bf16, hand-rolled\s+(?:[\d.]+\s+){5}([\d.]+)")
    auto = number(text, r"bf16, autocast\s+(?:[\d.]+\s+){5}([\d.]+)")
    assert 0 < auto < hand, text
    ours = re.search(r"LossScaler \(hand-rolled\)\s+([\d ]+)$", text, re.M).group(1).split()
    theirs = re.search(r"GradScaler\('cpu'\)\s+([\d ]+)$", text, re.M).group(1).split()
    assert ours == theirs and len(ours) == 20, text
    skipped = re.findall(r"^fp16, .*\s(\d+)$", text, re.M)
    assert len(skipped) == 2 and skipped[0] == skipped[1] != "0", text


def test_01_the_allocators_peak_exceeds_what_it_holds_by_the_logits():
    """01 says the forward's peak is the saved tensors plus the logits, 4 b s V bytes."""
    text = stored("01_one_device", "AllocatorPeak()")
    measured = number(text, r"peak - allocated at the end \(measured\)\s+([\d,]+)")
    assert measured == number(text, r"the logits, 4 b s V \(model\)\s+([\d,]+)"), text
    assert "+ the loss (4): True" in text, text


def test_04_the_fastest_step_has_few_messages_and_the_model_an_intermediate_cap():
    """04 says the fastest step here comes with one bucket and that backward grows with the
    number of messages (the compute pays for the overlap on shared cores), and that the model,
    where moving bytes does not slow the compute, puts the least exposed time at an
    intermediate cap."""
    text = stored("04_data_parallel", "fastest = min(")
    fastest = re.search(r"fastest step: measured at cap (\S+)", text).group(1)
    assert fastest == "25", text
    sweep = stored("04_data_parallel", "ROUNDS = 2")
    row = r"^\s+(0\.02|25)\s+\d+\s+[\d.]+ \([\d-]+\)\s+([\d.]+)"  # cap, messages, step, backward
    backward = {cap: float(ms) for cap, ms in re.findall(row, sweep, re.MULTILINE)}
    assert backward["0.02"] > backward["25"], sweep
    model = stored("04_data_parallel", "least exposed by the model")
    caps = [int(c) for c in re.findall(r"cap\s+(\d+) MiB:", model)]
    best = int(number(model, r"least exposed by the model: cap (\d+) MiB"))
    assert min(caps) < best < max(caps), model


@pytest.mark.parametrize("name", ["07_tensor_sequence", "08_context_parallel", "09_expert_parallel",
                                  "10_nd_parallelism", "00_start_here", "04_data_parallel"])
def test_stored_summaries_carry_todays_columns(name):
    """A summary table stored before the communication columns were split into busy and
    exposed time shows a column the code no longer prints."""
    for cell in _cells(name):
        text = _text(cell)
        if "rank  steps" in text:
            assert "comm ms/step" not in text, f"{name}: a stored summary has the retired column"
            assert "comm exposed ms" in text and "comm busy ms" in text, name


def test_05_prefetch_takes_exposed_time_off_where_its_condition_holds():
    """05 says prefetch takes gathers off the exposed figure where t_gather <= t_compute, and
    that a 7B block's gather outlasts its forward at a few thousand tokens per rank, the
    condition asking for about ten thousand."""
    text = stored("05_zero_fsdp", "ROUNDS = 3")
    holds = re.search(r"condition t_gather <= t_compute (holds|fails)", text).group(1) == "holds"
    off = number(text, r"exposed communication\s*: prefetch off ([\d.]+) ms")
    on = number(text, r"exposed communication\s*:.*prefetch on\s+([\d.]+) ms")
    if holds:
        assert on < off, text
    model = stored("05_zero_fsdp", "Llama-2-7B block")
    gather = number(model, r"its gather over 400 Gb/s: ([\d.]+) ms")
    assert number(model, r"forward at  4,096 tokens per rank:\s+([\d.]+) ms") < gather
    assert 8000 < number(model, r"tokens >= F / B: ([\d,]+) tokens") < 12000


@pytest.mark.parametrize("name", ["01_one_device", "04_data_parallel", "05_zero_fsdp"])
def test_the_timing_lessons_say_when_their_outputs_were_taken(name):
    """Their prose points to ``dlab.stored`` (the date, the cores, the load before and after),
    which ``store_notebook_outputs.py`` writes when it runs the notebook."""
    meta = json.loads((NOTEBOOKS / f"{name}.ipynb").read_text())["metadata"]
    stored_at = meta.get("dlab", {}).get("stored")
    assert stored_at and {"date", "cores", "load"} <= set(stored_at), name
