"""The demo (``python -m oncely.demo``): a retry storm with crashing workers, checked by a ledger.

Each test runs the demo in a subprocess, as a user would, then reads the bank's ledger itself
rather than trusting the demo's own check.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from oncely._demos.storm import main

SMALL = [
    "--payments", "40", "--attempts", "4", "--processes", "2", "--threads", "2",
    "--crash-rate", "0.1", "--seed", "1",
]  # fmt: skip


def run_demo(*args: str) -> tuple[int, dict[str, Any]]:
    """Run the demo with --json; return its exit code and summary."""
    done = subprocess.run(
        [sys.executable, "-m", "oncely.demo", *args, "--json"],
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


@pytest.fixture(scope="module")
def storm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The summary of one small storm with oncely, crashes included."""
    code, summary = run_demo(*SMALL, "--db", str(tmp_path_factory.mktemp("demo") / "oncely.db"))
    assert code == 0, summary
    return summary


def test_every_payment_is_charged_exactly_once_despite_crashes(storm: dict[str, Any]) -> None:
    summary = storm
    assert summary["ledger_ok"] is True
    assert summary["ledger_check"].startswith("ledger check: OK")
    charged = ledger(summary["bank"], summary["run"])
    assert charged == Counter({f"pay-{n:04d}": 1 for n in range(40)})
    assert summary["charges"] == summary["executions_returned"] == 40
    # Every client call ends in exactly one charge or one replay; crashed calls are redelivered.
    assert summary["attempts"] == 160
    assert summary["charges"] + summary["replays"] == 160
    assert summary["lease_lost"] == summary["errors"] == 0


def test_crashed_leases_are_recovered_one_for_one(storm: dict[str, Any]) -> None:
    summary = storm
    # The plan (seeded) crashes some executions after their claim; interleaving cannot change it.
    assert summary["crashes"] == summary["crashes_planned"] > 0
    assert 0 < summary["worker_restarts"] <= summary["crashes"]
    # Each crash leaves exactly one lease held (the crash waits for its process's other calls
    # to return), and each such lease is taken over once it expires: the store's records
    # (attempt - 1, summed) and oncely's "lease recovered" log lines agree with the crashes.
    assert summary["recovered"] == summary["crashes"]
    assert summary["recovered_logged"] == summary["crashes"]


def test_without_oncely_the_ledger_check_fails(tmp_path: Path) -> None:
    code, summary = run_demo(*SMALL, "--db", str(tmp_path / "oncely.db"), "--unsafe")

    assert code == 1
    assert summary["mode"] == "unsafe"
    assert summary["ledger_ok"] is False
    assert summary["ledger_check"].startswith("ledger check: FAILED")
    charged = ledger(summary["bank"], summary["run"])
    # Every call charged: 4 attempts of each of the 40 payments, 120 of them duplicates.
    assert charged == Counter({f"pay-{n:04d}": 4 for n in range(40)})
    assert summary["duplicates"] == 120


def test_human_output_is_a_table_and_a_verdict() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "oncely.demo", *SMALL, "--quiet"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )

    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1].startswith("ledger check: OK")
    for label in ("attempts", "charges executed", "replays", "conflicts", "crashes"):
        assert any(line.strip().startswith(label) for line in lines), (label, lines)


@pytest.mark.parametrize("option", [["--payments", "0"], ["--crash-rate", "1"], ["--threads", "x"]])
def test_bad_options_are_usage_errors(
    option: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(option)

    assert exited.value.code == 2
    assert "usage:" in capsys.readouterr().err
