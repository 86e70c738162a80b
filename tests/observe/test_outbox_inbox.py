"""The inbox reports its claims; the outbox writer stores the writer's trace context in the
event, and the relay's PRODUCER span links to it; dead letters and the backlog are reported."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import oncely
from oncely.outbox import Relay
from tests.observe.conftest import Sinks
from tests.outbox._publisher import FilePublisher


def connect(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(path, isolation_level=None, timeout=10)


def test_inbox_reports_acquired_and_replayed(sinks: Sinks, tmp_path: Path) -> None:
    path = tmp_path / "app.db"
    store = oncely.open_store(f"sqlite:///{path}")
    inbox = oncely.Inbox(store)
    connection = connect(path)
    for _ in range(2):
        connection.execute("BEGIN IMMEDIATE")
        with inbox.claim(connection, "o-1", scope="orders.place") as entry:
            if not entry.replayed:
                entry.complete({"order": 1})
        connection.execute("COMMIT")
    outcomes = [event.outcome for event in sinks.operations(surface="inbox")]
    assert outcomes == ["acquired", "replayed"]
    labels = {"surface": "inbox", "operation": "orders.place", "store": "sqlite"}
    assert sinks.prom("oncely_operations_total", **labels, outcome="acquired") == 1
    assert sinks.otel("oncely.operations", **labels, outcome="replayed") == 1
    assert len(sinks.finished("oncely orders.place")) == 2
    connection.close()
    store.close()


def test_outbox_links_the_relays_send_to_the_writers_trace(sinks: Sinks, tmp_path: Path) -> None:
    path = tmp_path / "app.db"
    store = oncely.open_store(f"sqlite:///{path}")
    store.migrate()  # type: ignore[attr-defined]
    outbox = oncely.Outbox(store)
    connection = connect(path)
    tracer = sinks.tracer_provider.get_tracer("app")
    with tracer.start_as_current_span("place order") as writer_span:
        connection.execute("BEGIN")
        outbox.add(connection, "orders.placed", b"{}")
        outbox.add(connection, "poison", b"{}")
        connection.execute("COMMIT")
    publisher = FilePublisher(tmp_path / "out")
    publisher.poison.add("poison")
    relay = Relay(store, publisher, max_attempts=1)
    assert asyncio.run(relay.run_once()) == 1
    assert sinks.prom("oncely_outbox_written_total", destination="orders.placed") == 1
    assert (
        sinks.prom("oncely_outbox_published_total", destination="orders.placed", result="published")
        == 1
    )
    assert (
        sinks.prom(
            "oncely_dead_letters_total", surface="outbox", operation="poison", reason="Poisoned"
        )
        == 1
    )
    (send,) = sinks.finished("send orders.placed")
    assert send.kind.name == "PRODUCER"
    assert [link.context.trace_id for link in send.links] == [
        writer_span.get_span_context().trace_id
    ]
    (failed,) = sinks.finished("send poison")
    assert not failed.status.is_ok

    async def one_cycle() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(relay.run(stop))
        while not any(type(e).__name__ == "OutboxBacklog" for e in sinks.events):  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        stop.set()
        await task

    asyncio.run(asyncio.wait_for(one_cycle(), 30))
    assert sinks.prom("oncely_outbox_dead") == 1
    assert sinks.prom("oncely_outbox_pending") == 0
    connection.close()
    store.close()


def test_inbox_transaction_whose_commit_fails_is_not_reported_done(
    sinks: Sinks, tmp_path: Path
) -> None:
    """`Inbox.transaction`: the COMMIT fails (a deferred foreign key): the driver's error
    propagates, the transaction is rolled back, and the operation is reported as failed."""
    import pytest

    path = tmp_path / "app.db"
    store = oncely.open_store(f"sqlite:///{path}")
    inbox = oncely.Inbox(store)
    connection = connect(path)
    connection.execute("PRAGMA foreign_keys = ON")
    connection.execute("CREATE TABLE customers (id TEXT PRIMARY KEY)")
    connection.execute(
        "CREATE TABLE orders (id TEXT PRIMARY KEY, customer TEXT REFERENCES customers (id) "
        "DEFERRABLE INITIALLY DEFERRED)"
    )
    for value in ({"order": 1}, None):
        with (
            pytest.raises(sqlite3.IntegrityError),
            inbox.transaction(connection, "o-1", scope="orders.place") as entry,
        ):
            connection.execute("INSERT INTO orders VALUES ('o-1', 'nobody')")
            entry.complete(value)
        assert not connection.in_transaction
    assert store.get("orders.place|o-1") is None
    operations = sinks.operations(surface="inbox")
    assert [event.error for event in operations] == ["IntegrityError", "IntegrityError"]
    connection.close()
    store.close()
