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
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = 'run = dlab.launch("torch-ddp", 4, dashboard=True, **TINY)'


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


@pytest.fixture
def lab(tmp_path):
    from dlab.tools.jupyter import command

    port = _free_port()
    launch_index = _notebook_copy(tmp_path)
    cmd, env, url = command(port, root=tmp_path, extra=["--no-browser"])
    # every cell in the page (JupyterLab 4 otherwise keeps only the visible ones in the DOM)
    settings = tmp_path / ".settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    (settings / "tracker.jupyterlab-settings").write_text('{"windowingMode": "none"}')
    news = tmp_path / ".settings" / "@jupyterlab" / "apputils-extension"  # no pop-up over the page
    news.mkdir(parents=True)
    (news / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')
    env = {**env, "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / ".settings")}
    server = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2)
            break
        except OSError:
            time.sleep(0.5)
    yield url.replace("/lab?", "/lab/tree/00_start_here.ipynb?"), launch_index, tmp_path
    server.terminate()
    server.wait(timeout=20)


@pytest.fixture
def browser():
    pytest.importorskip("selenium", reason="make browser-test installs Selenium")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver):
        pytest.skip("needs Debian's chromium and chromium-driver (apt-get install chromium "
                    "chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(flag)
    b = webdriver.Chrome(service=Service(driver), options=options)
    yield b
    b.quit()


def _wait(what, timeout: float, every: float = 0.25):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(every)
    raise TimeoutError(f"waited {timeout:g} s")


def test_the_dashboard_renders_updates_and_stops_in_chromium(lab, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    url, launch_index, root = lab
    start = time.monotonic()
    browser.get(url)
    def cell(i):
        return browser.find_elements(By.CSS_SELECTOR, ".jp-Notebook .jp-Cell")[i]

    _wait(lambda: len(browser.find_elements(By.CSS_SELECTOR, ".jp-Notebook .jp-Cell")) > launch_index, 60)
    cell(0).click()  # cells run before the kernel is up wait in its queue
    for _ in range(launch_index + 1):  # the cells above the launch cell, then the launch cell
        browser.switch_to.active_element.send_keys(Keys.SHIFT, Keys.ENTER)
        time.sleep(0.3)

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

    _wait(chart, 120)
    shown_after = time.monotonic() - start
    _wait(lambda: steps_done() >= 3, 60)  # curves to draw
    time.sleep(2)  # the dashboard redraws every 1.5 s
    first, at_first = shot(), steps_done()
    second = _wait(lambda: (lambda png: png if png != first else None)(shot()), 30)
    assert steps_done() > at_first, "the second chart should show more steps"
    shots = Path(os.environ.get("DLAB_SCREENSHOTS") or root / "screenshots")
    shots.mkdir(parents=True, exist_ok=True)
    (shots / "dashboard-1.png").write_bytes(first)
    (shots / "dashboard-2.png").write_bytes(second)
    assert _ranks_of(root), "the run's processes should be alive while the charts change"

    stop = _wait(lambda: [b for b in cell(launch_index).find_elements(By.CSS_SELECTOR, "button")
                          if "Stop" in b.text], 10)[0]
    stop.click()
    _wait(lambda: "stopped" in cell(launch_index).text, 30)
    _wait(lambda: not _ranks_of(root), 30)
    cell(launch_index).screenshot(str(shots / "dashboard-stopped.png"))
    print(f"chart shown {shown_after:.1f} s after opening the notebook; "
          f"whole test {time.monotonic() - start:.1f} s; screenshots in {shots}")
