"""`oncely dashboard`: the command serves the page and /metrics for a store URL."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
from datetime import timedelta
from pathlib import Path

import oncely


def test_the_command_serves_a_store_until_stopped(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    store = oncely.open_store(url)
    claimed = store.claim("jobs|j-1", "fp", lease=timedelta(seconds=30), ttl=timedelta(hours=1))
    assert isinstance(claimed, oncely.Acquired)
    store.close()
    process = subprocess.Popen(
        [sys.executable, "-m", "oncely.cli", "--store", url, "dashboard", "--port", "0"],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "ONCELY_DASHBOARD_TOKEN": ""},
    )
    try:
        assert process.stderr is not None
        deadline = time.monotonic() + 30
        address = None
        while address is None and time.monotonic() < deadline:
            line = process.stderr.readline()
            assert line or process.poll() is None, "the command exited"
            found = re.search(r"(http://127\.0\.0\.1:\d+/)", line)
            address = found.group(1) if found else None
        assert address, "the command never said where it listens"
        with urllib.request.urlopen(address + "metrics", timeout=10) as response:
            text = response.read().decode()
        assert 'oncely_records{status="in_progress"} 1' in text
        with urllib.request.urlopen(address, timeout=10) as response:
            assert b"<title>oncely dashboard</title>" in response.read()
    finally:
        process.terminate()
        process.wait(timeout=10)
        if process.stderr is not None:
            process.stderr.close()
