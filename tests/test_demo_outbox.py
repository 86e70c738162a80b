"""The end-to-end demo (``python -m oncely.demo --outbox``): HTTP → inbox + order + outbox in one
transaction → relay → broker → consumer inbox + shipment, with crashes at the three points.

Each run is a subprocess, as a user starts it; the test then reads the three SQLite files
itself rather than trusting the demo's own check.
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

from oncely._demos.outbox import crash_planned, message_id, order_key

SEEDS = (1, 2)
ORDERS = 16
RATE = 0.2


UNSAFE = 0
"""The key of the ``--unsafe`` run (seed 1) in `runs`."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[Path, int, dict[str, Any]]]:
    """One demo run per seed and one --unsafe, all at once (each spends most of its time
    waiting out the relay's claim): seed (or `UNSAFE`) → (its directory, exit code, summary)."""
    started = {}
    for seed in (*SEEDS, UNSAFE):
        directory = tmp_path_factory.mktemp(f"outbox-demo-{seed}")
        command = [
            sys.executable, "-m", "oncely.demo", "--outbox", "--dir", str(directory),
            "--orders", str(ORDERS), "--crash-rate", str(RATE), "--seed", str(seed or 1), "--json",
            *(["--unsafe"] if seed == UNSAFE else []),
        ]  # fmt: skip
        started[seed] = (
            directory,
            subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
        )
    done = {}
    for seed, (directory, process) in started.items():
        stdout, stderr = process.communicate(timeout=180)
        assert stdout, stderr
        done[seed] = (directory, process.returncode, json.loads(stdout))
    return done


def rows(path: Path, sql: str) -> list[tuple[Any, ...]]:
    connection = sqlite3.connect(path)
    try:
        return connection.execute(sql).fetchall()
    finally:
        connection.close()


@pytest.mark.parametrize("seed", SEEDS)
def test_each_request_makes_one_order_and_one_shipment_despite_crashes(
    runs: dict[int, tuple[Path, int, dict[str, Any]]], seed: int
) -> None:
    tmp_path, code, summary = runs[seed]
    orders = ORDERS
    assert code == 0, summary
    assert summary["check_ok"] is True, summary["problems"]
    keys = {order_key(n) for n in range(orders)}

    # The databases themselves: one order per key, one event per order, one shipment per order.
    made = Counter(key for (key,) in rows(tmp_path / "shop.db", "SELECT request_key FROM orders"))
    assert made == Counter(keys)
    events = rows(tmp_path / "shop.db", "SELECT message_id, published_at_ms FROM oncely_outbox")
    assert sorted(mid for mid, _ in events) == sorted(message_id(key) for key in keys)
    assert all(published is not None for _, published in events)
    shipped = rows(tmp_path / "warehouse.db", "SELECT request_key, message_id FROM shipments")
    assert Counter(key for key, _ in shipped) == Counter(keys)
    assert all(mid == message_id(key) for key, mid in shipped)
    queued = rows(tmp_path / "broker.db", "SELECT message_id, acked FROM queue")
    assert {mid for mid, _ in queued} == {message_id(key) for key in keys}
    assert all(acked for _, acked in queued)

    # Every planned crash of the API and the consumer happened (one per item: they run one
    # request or message at a time); the relay's crash a batch at a time.
    planned = summary["crashes_planned"]
    assert planned == {
        point: sum(
            crash_planned(
                seed, RATE, point, order_key(n) if point == "api" else message_id(order_key(n))
            )
            for n in range(orders)
        )
        for point in ("api", "relay", "consumer")
    }
    assert summary["crashes"]["api"] == planned["api"]
    assert summary["crashes"]["consumer"] == planned["consumer"]
    assert 0 < summary["crashes"]["relay"] <= planned["relay"]
    assert summary["restarts"] == summary["crashes"]
    # What the crashes cost downstream was absorbed: re-published and redelivered messages
    # were all deduplicated by the consumer's inbox, none made a second shipment.
    assert summary["republished"] == len(queued) - len(keys) > 0
    assert summary["redelivered"] >= summary["crashes"]["consumer"]
    # Every delivery but one per order was a duplicate, and the consumer's inbox caught it.
    deduplicated = summary["deduplicated_republishes"] + summary["deduplicated_redeliveries"]
    assert deduplicated == summary["republished"] + summary["redelivered"]
    assert summary["deliveries"] == orders + deduplicated
    # Crashed API workers' clients got the committed order replayed, never a second one.
    assert summary["replayed_responses"] == summary["double_submits"] + planned["api"]
    assert summary["requests"] == orders + summary["double_submits"]


def test_without_the_inboxes_the_check_fails(
    runs: dict[int, tuple[Path, int, dict[str, Any]]],
) -> None:
    """--unsafe: the same pipeline and crashes, no inbox: retries make second orders and
    events, re-publishes and redeliveries second shipments; the demo says so, exit code 1."""
    directory, code, summary = runs[UNSAFE]
    assert code == 1
    assert summary["mode"] == "unsafe"
    assert summary["check_ok"] is False
    assert summary["check"].startswith("end-to-end check: FAILED")
    made = Counter(key for (key,) in rows(directory / "shop.db", "SELECT request_key FROM orders"))
    assert sum(made.values()) == summary["orders"] > ORDERS  # a retried or doubled request ran
    shipped = rows(directory / "warehouse.db", "SELECT COUNT(*) FROM shipments")[0][0]
    assert shipped == summary["shipments"] == summary["deliveries"] > summary["orders"]
    assert summary["deduplicated_republishes"] == summary["deduplicated_redeliveries"] == 0


def test_the_main_demo_lists_the_mode_and_refuses_a_used_directory(tmp_path: Path) -> None:
    listed = subprocess.run(
        [sys.executable, "-m", "oncely.demo", "--help"], capture_output=True, text=True, check=True
    )
    assert "--outbox" in listed.stdout
    (tmp_path / "shop.db").write_bytes(b"")
    done = subprocess.run(
        [sys.executable, "-m", "oncely.demo", "--outbox", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 3
    assert "exists" in done.stderr
