"""Fixtures the browser tests share: JupyterLab serving a temporary directory, and headless
Chromium at a laptop's window size (``chromium.WINDOW``)."""
from __future__ import annotations

import shutil
import subprocess
import time
import urllib.request

import pytest
from chromium import WINDOW, free_port


@pytest.fixture
def jupyter_lab(tmp_path):
    """JupyterLab serving ``tmp_path``; yields a function that gives a notebook's URL there."""
    from dlab.tools.jupyter import command

    cmd, env, url = command(free_port(), root=tmp_path, extra=["--no-browser"])
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
    yield lambda name: url.replace("/lab?", f"/lab/tree/{name}?")
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
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                 f"--window-size={WINDOW[0]},{WINDOW[1]}"):
        options.add_argument(flag)
    b = webdriver.Chrome(service=Service(driver), options=options)
    yield b
    b.quit()
