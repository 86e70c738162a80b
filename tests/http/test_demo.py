"""The HTTP demo: a payments API served by uvicorn, a retry storm over real sockets with dropped
responses, and the exactly-once ledger check. The tests read the bank's ledger themselves."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from oncely._demos.api import Settings, build_http_parser
from oncely._demos.storm import build_parser

SMALL = [
    "--payments",
    "30",
    "--attempts",
    "3",
    "--threads",
    "6",
    "--drop-rate",
    "0.3",
    "--seed",
    "3",
]


def run_demo(*args: str) -> tuple[int, dict[str, Any]]:
    """Run the HTTP demo with --json in a subprocess; return its exit code and summary."""
    done = subprocess.run(
        [sys.executable, "-m", "oncely._demos.api", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.stdout, done.stderr
    return done.returncode, json.loads(done.stdout)


def ledger(bank: str, run: str) -> Counter[str]:
    """How many times the bank charged each payment in *run*."""
    connection = sqlite3.connect(bank)
    try:
        rows = connection.execute("SELECT payment_id FROM ledger WHERE run = ?", (run,)).fetchall()
    finally:
        connection.close()
    return Counter(payment_id for (payment_id,) in rows)


def test_every_payment_is_charged_exactly_once_despite_dropped_responses(tmp_path: Path) -> None:
    code, summary = run_demo(*SMALL, "--db", str(tmp_path / "oncely.db"))

    assert code == 0, summary
    assert summary["ledger_ok"] is True
    assert summary["ledger_check"].startswith("ledger check: OK")
    assert ledger(summary["bank"], summary["run"]) == Counter(
        {f"pay-{n:04d}": 1 for n in range(30)}
    )
    assert summary["requests"] == 90
    assert summary["errors"] == 0
    assert summary["responses_dropped"] > 0  # the storm really lost answers...
    assert summary["http_attempts"] > summary["requests"]  # ...and the clients retried them
    assert summary["executed_responses"] + summary["replayed_responses"] == 90
    assert summary["executed_responses"] <= 30


def test_without_oncely_the_ledger_check_fails(tmp_path: Path) -> None:
    code, summary = run_demo(*SMALL, "--db", str(tmp_path / "oncely.db"), "--unsafe")

    assert code == 1
    assert summary["mode"] == "unsafe"
    assert summary["ledger_ok"] is False
    charged = ledger(summary["bank"], summary["run"])
    assert sum(charged.values()) == summary["http_attempts"]  # every attempt charged
    assert summary["duplicates"] > 0


def test_the_main_demo_options_are_understood() -> None:
    """`run_http_demo` takes the main demo's namespace: --threads is the client count."""
    args = build_parser().parse_args(["--payments", "7", "--threads", "3", "--json"])
    settings = Settings.from_args(args)
    assert (settings.payments, settings.clients, settings.json) == (7, 3, True)
    assert settings.drop_rate == Settings().drop_rate

    own = Settings.from_args(build_http_parser().parse_args(["--drop-rate", "0.5"]))
    assert own.drop_rate == 0.5


@pytest.mark.parametrize("option", [["--payments", "0"], ["--drop-rate", "1"]])
def test_bad_options_are_usage_errors(
    option: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        build_http_parser().parse_args(option)
    assert exited.value.code == 2
    assert "usage:" in capsys.readouterr().err
