"""The live dashboard in a real browser: JupyterLab in headless Chromium, driven by Selenium.

``make browser-test`` runs it (it installs Selenium; Chromium and its driver come from Debian:
``apt-get install chromium chromium-driver``; nothing is downloaded at run time). It copies
notebook 00 to a temporary directory with its launch cell's run lengthened (20 steps end before
a screenshot can be taken twice), serves that directory with ``dlab.tools.jupyter``'s command line, and in
the browser: runs the cells down to the launch cell by Shift+Enter, waits for the dashboard's
chart, takes two screenshots of it seconds apart and requires them to differ (the run is live),
clicks Stop and requires the cell to end with the run stopped and no rank process left. The
screenshots go to the test's temporary directory, so a test run changes nothing tracked;
``make screenshots`` runs the same test with ``DLAB_SCREENSHOTS=docs/screenshots`` to refresh
the README's images, on purpose.
"""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import psutil
import pytest
from chromium import ROOT, cells, run_cells, wait

pytestmark = pytest.mark.browser

LAUNCH = 'run = dlab.launch("torch-ddp", 4, dashboard=True, **TINY)'


def _notebook_copy(tmp: Path) -> int:
    """Notebook 00 in ``tmp`` with a launch cell that runs long enough to watch; returns the
    launch cell's index."""
    import nbformat

    nb = nbformat.read(ROOT / "notebooks" / "00_start_here.ipynb", as_version=4)
    index = next(i for i, c in enumerate(nb.cells) if LAUNCH in c.source)
    nb.cells[index].source = nb.cells[index].source.replace("steps=20", "steps=5000")
    nbformat.write(nb, tmp / "00_start_here.ipynb")
    shutil.copy(ROOT / "notebooks" / "NOTATION.md", tmp)
    return index


def _ranks_of(root: Path) -> list[psutil.Process]:
    """Processes whose command line names a run under ``root`` (the ranks and their agent)."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        if any(str(root) in a for a in (p.info["cmdline"] or [])) and "jupyterlab" not in " ".join(
                p.info["cmdline"]):
            out.append(p)
    return out


def test_the_dashboard_renders_updates_and_stops_in_chromium(jupyter_lab, browser, tmp_path):
    from selenium.webdriver.common.by import By

    launch_index, root = _notebook_copy(tmp_path), tmp_path
    start = time.monotonic()
    browser.get(jupyter_lab("00_start_here.ipynb"))

    def cell(i):
        return cells(browser)[i]

    run_cells(browser, launch_index + 1)  # the cells above the launch cell, then the launch cell

    def chart():
        imgs = cell(launch_index).find_elements(By.CSS_SELECTOR, ".jp-OutputArea img")
        return imgs[0] if imgs and imgs[0].size["height"] > 50 else None

    def steps_done() -> int:
        files = list(root.glob("runs/*/metrics/rank0.jsonl"))
        return len(files[0].read_text().splitlines()) if files else 0

    def shot():
        image = chart()
        browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", image)
        time.sleep(0.2)
        return image.screenshot_as_png

    wait(chart, 120)
    shown_after = time.monotonic() - start
    wait(lambda: steps_done() >= 3, 60)  # curves to draw
    time.sleep(2)  # the dashboard redraws every 1.5 s
    first, at_first = shot(), steps_done()
    second = wait(lambda: (lambda png: png if png != first else None)(shot()), 30)
    assert steps_done() > at_first, "the second chart should show more steps"
    shots = Path(os.environ.get("DLAB_SCREENSHOTS") or root / "screenshots")
    shots.mkdir(parents=True, exist_ok=True)
    (shots / "dashboard-1.png").write_bytes(first)
    (shots / "dashboard-2.png").write_bytes(second)
    assert _ranks_of(root), "the run's processes should be alive while the charts change"

    stop = wait(lambda: [b for b in cell(launch_index).find_elements(By.CSS_SELECTOR, "button")
                          if "Stop" in b.text], 10)[0]
    stop.click()
    wait(lambda: "stopped" in cell(launch_index).text, 30)
    wait(lambda: not _ranks_of(root), 30)
    cell(launch_index).screenshot(str(shots / "dashboard-stopped.png"))
    print(f"chart shown {shown_after:.1f} s after opening the notebook; "
          f"whole test {time.monotonic() - start:.1f} s; screenshots in {shots}")
