"""The processes of the PostgreSQL + Kafka end-to-end test, each SIGKILLed at its worst point.

Run as ``python -m tests.outbox._e2e ROLE CONFIG_FILE`` with ROLE one of:

* ``api``: uvicorn serving a bare ASGI app; ``POST /orders`` claims the ``Idempotency-Key``
  with `oncely.Inbox`, inserts the order and adds its event with `oncely.Outbox`, in one
  psycopg transaction. Killed once: after the commit, before the response, for the order key
  ``victims["api"]``.
* ``relay``: `oncely.outbox.Relay` with `KafkaPublisher`. Killed once: after Kafka acknowledged
  a batch holding ``victims["relay"]``, before the relay marked it published.
* ``consumer``: `IdempotentKafkaConsumer` (its records in the same PostgreSQL store) whose
  handler claims the message id with its own inbox and inserts the shipment in one
  transaction. Killed once: after that commit, before the handler returned (so before the
  consumer completed its record and committed the offset), for ``victims["consumer"]``.

Each process appends what it did to the JSON-lines file ``config["log"]`` with one ``write``
per line, before any kill, so the test reads every line.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

import oncely
from oncely.outbox import OutboxEvent, Outcome

ORDERS_SCOPE = "e2e.orders"
SHIPMENTS_SCOPE = "e2e.shipments"


def message_id(key: str) -> str:
    """The outbox message id of the order requested with *key*."""
    return f"{key}/placed"


def note(config: dict[str, Any], role: str, kind: str, key: str) -> None:
    """Append one line to the test's log (one write: whole even if the process dies next)."""
    line = json.dumps({"role": role, "kind": kind, "key": key, "pid": os.getpid()}) + "\n"
    fd = os.open(config["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def die(config: dict[str, Any], role: str, key: str) -> None:
    note(config, role, "killed", key)
    os.kill(os.getpid(), signal.SIGKILL)


def table(config: dict[str, Any], name: str) -> sql.Composed:
    return sql.SQL("{}.{}").format(sql.Identifier(config["schema"]), sql.Identifier(name))


# -- API ----------------------------------------------------------------------------------------


def api(config: dict[str, Any]) -> None:
    import uvicorn

    store = oncely.open_store(config["store"])
    inbox = oncely.Inbox(store)
    outbox = oncely.Outbox(store)
    insert = sql.SQL("INSERT INTO {} (request_key, item) VALUES (%s, %s) RETURNING id").format(
        table(config, "orders")
    )

    async def place(key: str, order: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        database = config["database"]
        async with (
            await psycopg.AsyncConnection.connect(database, autocommit=True) as conn,
            conn.transaction(),
            inbox.aclaim(conn, key, scope=ORDERS_SCOPE, fingerprint=order) as entry,
        ):
            if entry.replayed:
                return 200, dict(entry.result)
            cursor = await conn.execute(insert, (key, order["item"]))
            row = await cursor.fetchone()
            assert row is not None
            event = {"order_id": row[0], "request_key": key, **order}
            await outbox.aadd(
                conn,
                config["topic"],
                json.dumps(event),
                ordering_key=key,
                message_id=message_id(key),
            )
            result = {"order_id": row[0]}
            entry.complete(result)
        # Committed: the order, its record, its event. Dying now loses only the answer.
        note(config, "api", "committed", key)
        if key == config["victims"]["api"]:
            die(config, "api", key)  # committed; the client never hears it
        return 201, result

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        headers = dict(scope["headers"])
        key = headers[b"idempotency-key"].decode()
        status, document = await place(key, json.loads(body))
        reply = json.dumps(document).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": reply})

    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host="127.0.0.1",
            port=config["port"],
            log_level="error",
            lifespan="off",
            access_log=False,
        )
    )
    server.run()


# -- relay --------------------------------------------------------------------------------------


class KillingPublisher:
    """Kafka's publisher, killed once right after Kafka acknowledged the victim's batch."""

    def __init__(self, config: dict[str, Any]) -> None:
        from oncely.outbox.kafka import KafkaPublisher

        self.config = config
        self.inner = KafkaPublisher.from_url(f"kafka://{config['bootstrap']}", timeout=10)
        self.marker = Path(config["log"]).with_suffix(".relay-killed")

    async def publish(self, events: Sequence[OutboxEvent]) -> Sequence[Outcome]:
        outcomes = await self.inner.publish(events)
        for event, outcome in zip(events, outcomes, strict=True):
            note(
                self.config, "relay", "published" if outcome is None else "failed", event.message_id
            )
        victim = message_id(self.config["victims"]["relay"])
        confirmed = {
            event.message_id for event, o in zip(events, outcomes, strict=True) if o is None
        }
        if victim in confirmed and not self.marker.exists():
            self.marker.touch()
            die(self.config, "relay", victim)  # acknowledged by Kafka, not marked published
        return outcomes

    async def aclose(self) -> None:
        await self.inner.aclose()


def relay(config: dict[str, Any]) -> None:
    from oncely.outbox import Relay

    store = oncely.open_store(config["store"])
    Relay(
        store,
        KillingPublisher(config),
        poll_interval=0.1,
        backoff=0.05,
        max_backoff=0.5,
    ).run_forever()


# -- consumer -------------------------------------------------------------------------------------


def consumer(config: dict[str, Any]) -> None:
    from oncely.consumers.kafka import IdempotentKafkaConsumer
    from tests.consumers._effects import FAST
    from tests.consumers.test_kafka import config as kafka_config

    store = oncely.open_store(config["store"])
    inbox = oncely.Inbox(store)
    insert = sql.SQL(
        "INSERT INTO {} (order_id, request_key, message_id) VALUES (%s, %s, %s)"
    ).format(table(config, "shipments"))
    database = psycopg.connect(config["database"], autocommit=True)

    def handle(message: Any) -> None:
        key = dict(message.headers())["Idempotency-Key"].decode()
        event = json.loads(message.value())
        with (
            database.transaction(),
            inbox.claim(database, key, scope=SHIPMENTS_SCOPE, fingerprint=event) as entry,
        ):
            if entry.replayed:
                note(config, "consumer", "deduplicated", key)
                return
            database.execute(insert, (event["order_id"], event["request_key"], key))
            entry.complete(None)
        note(config, "consumer", "shipped", key)
        if key == message_id(config["victims"]["consumer"]):
            die(config, "consumer", key)  # effect committed; no completion, no offset commit

    kafka = IdempotentKafkaConsumer(
        kafka_config(config["bootstrap"], config["group"]),  # joins the group in a second or two
        [config["topic"]],
        handle,
        store=store,
        policy=FAST,  # 1.5 s leases: the killed consumer's lease is taken over soon
        poll_timeout=0.1,
    )
    kafka.run(threading.Event())


if __name__ == "__main__":
    role, path = sys.argv[1], sys.argv[2]
    settings = json.loads(Path(path).read_text())
    if role == "relay":
        relay(settings)
    elif role == "consumer":
        consumer(settings)
    else:
        api(settings)
