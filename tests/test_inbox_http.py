"""examples/inbox: a FastAPI route and a Django view write an order and its record in one
PostgreSQL transaction. Each app runs in a process of its own (Django's settings are
process-wide), driven by its framework's test client; the crash is the process dying mid-
transaction (``os._exit``), as a SIGKILL would leave it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.conftest import service_url

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "inbox"

DRIVER = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
framework, requests = sys.argv[2], json.loads(sys.argv[3])
if framework == "fastapi":
    from fastapi.testclient import TestClient
    import fastapi_orders
    app = fastapi_orders.create_app(os.environ["DATABASE_URL"], os.environ["ONCELY_STORE_URL"])
    client = TestClient(app, raise_server_exceptions=False).__enter__()
    post = lambda body, headers: client.post("/orders", json=body, headers=headers)
else:
    import django_orders
    from django.test import Client
    django_orders.setup()
    client = Client(raise_request_exception=False)
    post = lambda body, headers: client.post(
        "/orders", data=json.dumps(body), content_type="application/json", headers=headers
    )
for key, body, simulate in requests:
    headers = {"Idempotency-Key": key} | ({"X-Simulate": simulate} if simulate else {})
    response = post(body, headers)
    answer = response.json() if response.status_code < 500 else None
    print(json.dumps([response.status_code, answer, response.headers.get("Idempotent-Replayed")]))
"""


@pytest.fixture
def database(request: pytest.FixtureRequest) -> Iterator[tuple[str, str, str]]:
    """(database URL with a search path of its own, store URL in that schema, schema)."""
    base = service_url("ONCELY_TEST_POSTGRES_URL")
    schema = f"oncely_orders_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(base, autocommit=True) as connection:
        connection.execute(f'CREATE SCHEMA "{schema}"')
    join = "&" if "?" in base else "?"
    yield f"{base}{join}options=-c%20search_path%3D{schema}", f"{base}{join}schema={schema}", schema
    with psycopg.connect(base, autocommit=True) as connection:
        connection.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def drive(
    framework: str, database: tuple[str, str, str], requests: list[Any]
) -> tuple[int, list[Any]]:
    """Send *requests* ``(key, body, simulate)`` to the app in a new process."""
    env = {**os.environ, "DATABASE_URL": database[0], "ONCELY_STORE_URL": database[1]}
    result = subprocess.run(
        [sys.executable, "-c", DRIVER, str(EXAMPLES), framework, json.dumps(requests)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    if result.returncode not in (0, 9):
        raise AssertionError(result.stderr)
    return result.returncode, [json.loads(line) for line in result.stdout.splitlines()]


def rows(database: tuple[str, str, str]) -> tuple[list[tuple[Any, ...]], list[str]]:
    """(the orders, the keys of oncely's records) in the example's schema."""
    with psycopg.connect(database[0]) as connection:
        orders = connection.execute("SELECT id, item, cents FROM orders ORDER BY id").fetchall()
        keys = connection.execute("SELECT key FROM oncely_records ORDER BY key").fetchall()
    return orders, [key for (key,) in keys]


@pytest.mark.postgres
@pytest.mark.parametrize("framework", ["fastapi", "django"])
def test_order_and_record_commit_together(framework: str, database: tuple[str, str, str]) -> None:
    book, pen = {"item": "book", "cents": 1200}, {"item": "pen", "cents": 300}
    code, answers = drive(framework, database, [["k-crash", book, "crash"]])
    assert (code, answers) == (9, [])  # died after writing the order, before the commit
    assert rows(database) == ([], [])  # neither the order nor its record

    code, answers = drive(
        framework,
        database,
        [
            ["k-1", book, "fail"],  # raised after writing: rolled back, nothing stays
            ["k-1", book, None],  # so the retry runs
            ["k-1", book, None],  # and a repeat replays
            ["k-1", pen, None],  # another order under the same key
            ["k-crash", book, None],  # the crashed request's retry runs
        ],
    )
    assert code == 0
    assert [answer[0] for answer in answers] == [500, 201, 201, 422, 201]
    placed, replayed, recovered = answers[1], answers[2], answers[4]
    assert replayed[1] == placed[1]
    assert (placed[2], replayed[2]) == (None, "true")
    orders, keys = rows(database)
    assert sorted(orders) == sorted(
        [(placed[1]["id"], "book", 1200), (recovered[1]["id"], "book", 1200)]
    )
    assert keys == ["orders.create|k-1", "orders.create|k-crash"]
