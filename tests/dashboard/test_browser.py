"""The dashboard in a real headless Chromium while a load runs: it loads, the charts follow the
live data (records from a thread of this process, replays recorded by another process), client-
chosen keys stay text, and the console stays clean.

The browser is Debian's ``chromium`` with its ``chromedriver`` (``scripts/services`` installs
both); Selenium is told the driver's path, so it never tries to download one. The screenshot in
the docs is this test's: ``ONCELY_UPDATE_SCREENSHOTS=1`` writes it to ``docs/images``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import oncely
from oncely.dashboard import serve

ROOT = Path(__file__).resolve().parent.parent.parent
TOKEN = "browser-test-token-1234"
# A client-chosen key that would run script if the page ever treated keys as markup.
HOSTILE = '<img src=x onerror="window.__owned=1">'

pytestmark = pytest.mark.slow

# Another process of the app: replays (and refusals) through the decorator, activity recorded.
APP_PROCESS = textwrap.dedent(
    """
    import os, sys, time
    from datetime import timedelta
    import oncely, oncely.observe
    store = oncely.open_store(sys.argv[1])
    recorder = oncely.observe.record_activity(store, interval=0.3)

    @oncely.idempotent(store=store, key="order", scope="refunds", ttl=timedelta(hours=1))
    def refund(order):
        return order

    deadline = time.monotonic() + 90
    n = 0
    while not os.path.exists(sys.argv[2]) and time.monotonic() < deadline:
        refund(str(n // 4))  # three replays in four calls
        if n % 50 == 0:
            try:
                refund("")
            except oncely.InvalidKeyError:
                pass
        n += 1
        time.sleep(0.005)
    recorder.close()
    store.close()
    """
)


def _driver_path() -> str:
    path = os.environ.get("ONCELY_TEST_CHROMEDRIVER") or shutil.which("chromedriver")
    if not path:
        pytest.fail("chromedriver is missing: run the tests through scripts/test (it installs it)")
    return path


@pytest.fixture
def browser() -> Iterator[Any]:
    os.environ["SE_OFFLINE"] = "1"  # never let Selenium Manager reach for a download
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage"):
        options.add_argument(argument)
    options.add_argument("--window-size=1200,2000")  # the whole page in the screenshot
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(_driver_path()), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(condition: Any, what: str, seconds: float = 30.0) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    pytest.fail(f"the page never showed {what}")


def test_the_dashboard_follows_a_live_load_in_chromium(browser: Any, tmp_path: Path) -> None:
    store = oncely.open_store(f"sqlite:///{tmp_path / 'dashboard.db'}")
    lease, ttl = timedelta(seconds=30), timedelta(hours=1)
    stuck = store.claim(f"payments|{HOSTILE}", "fp", lease=timedelta(milliseconds=1), ttl=ttl)
    assert isinstance(stuck, oncely.Acquired)
    done = threading.Event()
    calls = {"n": 0}

    @oncely.idempotent(store=store, key="order", ttl=ttl, lease=lease)
    def ship(order: int) -> int:
        return order

    def load() -> None:  # bounded: at most 4,000 calls or until the test ends
        while not done.is_set() and calls["n"] < 4_000:
            ship(calls["n"] // 2)  # every other call is a replay
            calls["n"] += 1
            time.sleep(0.002)

    worker = threading.Thread(target=load, daemon=True)
    stop = tmp_path / "stop"
    app_process = subprocess.Popen(
        [sys.executable, "-c", APP_PROCESS, f"sqlite:///{tmp_path / 'dashboard.db'}", str(stop)],
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    server = serve(store, port=0, token=TOKEN, refresh=0.2, minutes=60)
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    serving.start()
    worker.start()
    try:
        base = f"http://127.0.0.1:{server.server_port}"
        browser.get(f"{base}/?token={TOKEN}")  # sets the cookie, then redirects to the page
        _wait(lambda: browser.execute_script("return document.body.dataset.loaded"), "data")
        chart = browser.find_element("id", "chart")
        first = int(_wait(lambda: chart.get_attribute("data-points"), "a chart"))
        lines = chart.find_elements("css selector", "polyline")
        assert [line.get_attribute("data-series") for line in lines] == [
            "started",
            "finished",
            "retried",
        ]
        # The page polls every 3 s: the chart must grow with the load while it runs.
        later = _wait(
            lambda: (
                int(chart.get_attribute("data-points") or 0) > first
                and int(chart.get_attribute("data-points") or 0)
            ),
            "the chart move with the load",
        )
        assert later > first
        activity = browser.find_element("id", "activity-chart")
        replays = int(_wait(lambda: activity.get_attribute("data-points"), "replays"))
        lines = activity.find_elements("css selector", "polyline")
        assert [line.get_attribute("data-series") for line in lines] == ["replayed", "duplicate"]
        _wait(
            lambda: int(activity.get_attribute("data-points") or 0) > replays,
            "the replays chart move with the other process's load",
        )
        recent = _wait(
            lambda: browser.find_elements("css selector", "#recent tbody tr"), "a refusal"
        )
        cells = [cell.text for cell in recent[0].find_elements("tag name", "td")]
        assert cells[0] == "refunds"
        assert cells[2:] == ["refused", "function", "InvalidKeyError"]
        stuck_rows = browser.find_elements("css selector", "#stuck tbody tr")
        assert [row.find_element("tag name", "td").text for row in stuck_rows] == [
            f"payments|{HOSTILE}"
        ]
        assert browser.find_elements("css selector", "#stuck img") == []
        assert browser.execute_script("return window.__owned") is None
        completed = browser.find_element("css selector", "#statuses").text
        assert "completed" in completed
        shot = tmp_path / "dashboard.png"
        assert browser.save_screenshot(str(shot))
        if os.environ.get("ONCELY_UPDATE_SCREENSHOTS"):
            target = ROOT / "docs" / "images" / "dashboard.png"
            target.parent.mkdir(exist_ok=True)
            shutil.copyfile(shot, target)
        errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
        assert errors == []
    finally:
        done.set()
        stop.touch()
        assert app_process.wait(timeout=30) == 0
        worker.join(timeout=10)
        server.shutdown()
        server.server_close()
        store.close()
