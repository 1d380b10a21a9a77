"""Notebook 11's explorer as a learner uses it: JupyterLab in headless Chromium at a laptop's
window (1,400 pixels wide, the side bar open), the notebook run down to the explorer by
Shift+Enter. Its rows of controls fit the notebook's width (no sideways scrolling, every control
visible, the ZeRO slider with its track), its figure shows with no warning in the output, and
changing a control redraws the figure."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from chromium import ROOT, cells, run_cells, wait

pytestmark = pytest.mark.browser

NOTEBOOK = "11_planning_at_scale.ipynb"
EXPLORER = "W.interactive_output(show, ui)"


def _notebook_copy(tmp) -> int:
    """Notebook 11 in ``tmp`` down to its explorer cell (the cells after it launch runs this
    test does not need); returns the explorer cell's index."""
    import nbformat

    nb = nbformat.read(ROOT / "notebooks" / NOTEBOOK, as_version=4)
    index = next(i for i, c in enumerate(nb.cells) if EXPLORER in c.source)
    nb.cells = nb.cells[:index + 1]
    nbformat.write(nb, tmp / NOTEBOOK)
    return index


def _figure(cell):
    from selenium.webdriver.common.by import By

    imgs = [i for i in cell.find_elements(By.CSS_SELECTOR, ".jp-OutputArea img") if i.size["height"] > 50]
    return imgs[0].get_attribute("src") if imgs else None


def _warnings(cell) -> list[str]:
    """Text the cell's output shows on stderr, or that names a warning."""
    from selenium.webdriver.common.by import By

    stderr = cell.find_elements(By.CSS_SELECTOR, "[data-mime-type='application/vnd.jupyter.stderr']")
    return [e.text for e in stderr] + [line for line in cell.text.splitlines() if "Warning" in line]


def test_the_explorer_fits_a_laptop_window_and_redraws_when_a_control_changes(jupyter_lab, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    index = _notebook_copy(tmp_path)
    browser.get(jupyter_lab(NOTEBOOK))
    run_cells(browser, index + 1)
    cell = lambda: cells(browser)[index]  # noqa: E731 (the page re-renders cells: look again)
    first = wait(lambda: _figure(cell()), 240)
    assert not _warnings(cell()), _warnings(cell())

    rows = cell().find_elements(By.CSS_SELECTOR, ".widget-hbox")
    assert len(rows) >= 3, "the controls come in rows of four"
    for row in rows:
        scroll, client = browser.execute_script(
            "return [arguments[0].scrollWidth, arguments[0].clientWidth]", row)
        assert scroll <= client + 1, f"a row of controls scrolls sideways: {scroll} > {client} pixels"
    area = cell().find_element(By.CSS_SELECTOR, ".jp-OutputArea")
    right = area.location["x"] + area.size["width"]
    for label in ("batch", "ZeRO", "recompute"):
        control = cell().find_element(By.XPATH, f".//label[normalize-space()='{label}']/..")
        assert control.location["x"] + control.size["width"] <= right + 1, f"{label} is cut off"
    track = cell().find_elements(By.CSS_SELECTOR, ".widget-slider .slider-container")
    assert track and track[0].size["width"] > 80, "the ZeRO slider lost its track"
    shots = Path(os.environ.get("DLAB_SCREENSHOTS") or tmp_path / "screenshots")
    shots.mkdir(parents=True, exist_ok=True)
    cell().screenshot(str(shots / "explorer.png"))

    tp = Select(cell().find_element(By.XPATH, ".//label[normalize-space()='tp']/..//select"))
    start = time.monotonic()
    tp.select_by_visible_text("4")
    second = wait(lambda: (lambda src: src if src and src != first else None)(_figure(cell())), 60)
    assert second != first
    time.sleep(1)  # the redraw done: read the output as it stands
    said = wait(lambda: [_warnings(cell())], 10)[0]
    assert not said, said
    print(f"the explorer redrew {time.monotonic() - start:.1f} s after tp changed")
