"""What the browser tests do in the page: wait for something, find the notebook's cells, run
them as a learner does; and the window a laptop gives the browser.
The fixtures are in this directory's ``conftest.py``.

``make browser-test`` runs them (it installs Selenium; Chromium and its driver come from Debian:
``apt-get install chromium chromium-driver``; nothing is downloaded at run time)."""
from __future__ import annotations

import socket
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WINDOW = (1400, 1000)  # a laptop's browser window, JupyterLab's side bar open


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait(what, timeout: float, every: float = 0.25):
    """``what()``'s first truthy value, polled every ``every`` seconds for ``timeout``. An element
    the page replaced while ``what`` read it (a figure redrawn, on a busy machine between finding
    the image and reading it) counts as not yet: the next poll finds the new one."""
    from selenium.common.exceptions import StaleElementReferenceException

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            got = what()
        except StaleElementReferenceException:
            got = None
        if got:
            return got
        time.sleep(every)
    raise TimeoutError(f"waited {timeout:g} s")


def cells(browser):
    from selenium.webdriver.common.by import By

    return browser.find_elements(By.CSS_SELECTOR, ".jp-Notebook .jp-Cell")


def run_cells(browser, count: int) -> None:
    """Run the notebook's first ``count`` cells as a learner does, by Shift+Enter (cells sent
    before the kernel is up wait in its queue)."""
    from selenium.webdriver.common.keys import Keys

    wait(lambda: len(cells(browser)) >= count, 60)
    cells(browser)[0].click()
    for _ in range(count):
        browser.switch_to.active_element.send_keys(Keys.SHIFT, Keys.ENTER)
        time.sleep(0.3)
