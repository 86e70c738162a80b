"""The outbox demo's processes: the shop's API workers, the relay and its broker, the
warehouse's consumers, and what they share (the plan of crashes, the reports to the parent).

Each role runs in a process of its own, started by `oncely._demos.outbox.Pipeline` (see that
module's docstring for the pipeline as a whole); everything here is importable by the spawn
start method.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer
from multiprocessing.connection import Connection
from typing import Any, NoReturn, cast

from oncely._demos._common import (
    PipeLogHandler,
    fraction,
)

__all__ = [
    "Config",
    "api_main",
    "consumer_main",
    "crash_planned",
    "message_id",
    "order_key",
    "prepare",
    "relay_main",
]

CRASH_EXIT_CODE = 86
"""The exit status of a process that crashed on purpose (anything else aborts the demo)."""

POINTS = ("api", "relay", "consumer")
"""The crash points: after commit before response; after publish before mark; after the
effect before the ack."""

ORDERS_SCOPE = "orders.create"
SHIPMENTS_SCOPE = "shipments.create"
DESTINATION = "orders.placed"

VISIBILITY_SECONDS = 1.0
"""How long a received message stays invisible to other consumers before it is redelivered."""

PUBLISH_TIMEOUT = 0.5
"""The relay's publish timeout; on SQLite its claim on a batch lasts twice that plus 5 s, which
is how long a batch waits after the relay died holding it."""

RUN_TIMEOUT = 120.0
"""Give up (and check what arrived) if the pipeline has not drained after this many seconds."""

DOUBLE_SUBMIT = 0.25
"""Share of orders a client sends a second time after its first answer (a double click)."""


# -- the plan ---------------------------------------------------------------------------------


def order_key(number: int) -> str:
    """The Idempotency-Key of order request *number*."""
    return f"order-{number:04d}"


def message_id(key: str) -> str:
    """The outbox message id of the event of the order requested with *key*: stable per key."""
    return f"{key}/placed"


def crash_planned(seed: int, rate: float, point: str, label: str) -> bool:
    """Whether the item *label* (an order key or message id) crashes its process at *point*."""
    return fraction(seed, f"{point}:{label}") < rate


@dataclass(frozen=True)
class Config:
    """What every child process needs (pickled to it by the spawn start method)."""

    shop: str
    broker: str
    warehouse: str
    seed: int
    crash_rate: float
    unsafe: bool = False


# -- reporting from children ------------------------------------------------------------------


class Reporter:
    """Sends messages to the parent over a pipe; a message is in the pipe once `send` returns,
    so it survives the ``os._exit`` right after it."""

    def __init__(self, connection: Connection[Any, Any], role: str) -> None:
        self._connection = connection
        self._lock = threading.Lock()
        self.role = role

    def send(self, kind: str, **fields: Any) -> None:
        """Report one event."""
        with self._lock:
            self._connection.send({"kind": kind, "role": self.role, "pid": os.getpid(), **fields})

    def crash(self, label: str, what: str) -> NoReturn:
        """Report a planned crash, then die without any cleanup."""
        self.send("crash", label=label, text=what)
        os._exit(CRASH_EXIT_CODE)


def _child_setup(reports: Connection[Any, Any], role: str) -> Reporter:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    reporter = Reporter(reports, role)
    logger = logging.getLogger("oncely")
    logger.addHandler(PipeLogHandler(cast(Any, reporter)))  # it only calls send()
    logger.setLevel(logging.WARNING)
    logger.propagate = False
    return reporter


def _connect(path: str) -> sqlite3.Connection:
    """An application connection: autocommit mode, so transactions are explicit ``BEGIN``s."""
    connection = sqlite3.connect(path, timeout=60.0, isolation_level=None)
    connection.execute("PRAGMA journal_mode=WAL")
    connection.execute("PRAGMA synchronous=NORMAL")
    return connection


@contextlib.contextmanager
def _transaction(connection: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """``BEGIN IMMEDIATE`` (the write lock the inbox and outbox need on SQLite) ... ``COMMIT``."""
    connection.execute("BEGIN IMMEDIATE")
    try:
        yield connection
    except BaseException:
        connection.execute("ROLLBACK")
        raise
    connection.execute("COMMIT")


# -- the shop: the API worker -----------------------------------------------------------------

_SHOP_SCHEMA = """
CREATE TABLE IF NOT EXISTS orders (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    request_key TEXT NOT NULL,  -- deliberately not UNIQUE: a second order would be a second row
    item TEXT NOT NULL,
    quantity INTEGER NOT NULL,
    pid INTEGER NOT NULL
)
"""


class _Service:
    """A process's side of one database: the oncely store on it, its inbox, a connection."""

    def __init__(self, config: Config, reporter: Reporter, path: str) -> None:
        import oncely

        self.config = config
        self.reporter = reporter
        self.store = oncely.open_store(f"sqlite:///{path}", synchronous="normal")
        self.inbox = oncely.Inbox(self.store)
        self.db = _connect(path)


class Shop(_Service):
    """The API's handler logic: one transaction for the inbox record, the order and its event."""

    def __init__(self, config: Config, reporter: Reporter) -> None:
        import oncely

        super().__init__(config, reporter, config.shop)
        self.outbox = oncely.Outbox(self.store)

    def place_order(self, key: str, order: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """Create the order requested with *key* once; answer 201, or 200 with the replay."""
        if self.config.unsafe:
            return self._place_without_inbox(key, order)
        with (
            _transaction(self.db) as db,
            self.inbox.claim(db, key, scope=ORDERS_SCOPE, fingerprint=order) as entry,
        ):
            if entry.replayed:
                return 200, dict(entry.result)
            order_id = self._write(db, key, order, message_id(key))
            result = {"order_id": order_id}
            entry.complete(result)
        # Committed: the order, its record and its event. Dying now loses only the answer.
        self._committed(key, order_id)
        return 201, result

    def _place_without_inbox(self, key: str, order: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """``--unsafe``: the same writes, without the inbox record; each request runs."""
        with _transaction(self.db) as db:
            (earlier,) = db.execute(
                "SELECT COUNT(*) FROM orders WHERE request_key = ?", (key,)
            ).fetchone()
            order_id = self._write(db, key, order, f"{message_id(key)}#{earlier + 1}")
        if not earlier:  # crash after the first execution only, as the safe run does
            self._committed(key, order_id)
        return 201, {"order_id": order_id}

    def _write(self, db: sqlite3.Connection, key: str, order: dict[str, Any], event_id: str) -> int:
        """Insert the order and add its event, in the transaction open on *db*."""
        order_id = db.execute(
            "INSERT INTO orders (request_key, item, quantity, pid) VALUES (?, ?, ?, ?)",
            (key, order["item"], order["quantity"], os.getpid()),
        ).lastrowid
        assert order_id is not None
        event = {"order_id": order_id, "request_key": key, **order}
        self.outbox.add(
            db,
            DESTINATION,
            json.dumps(event),
            headers={"type": "order.placed"},
            message_id=event_id,
        )
        return order_id

    def _committed(self, key: str, order_id: int) -> None:
        if crash_planned(self.config.seed, self.config.crash_rate, "api", key):
            self.reporter.crash(key, f"after committing order {order_id}, before responding")


def api_main(reports: Connection[Any, Any], config: Config) -> None:
    """An API worker process: serves ``POST /orders`` on a free loopback port, one request at a
    time (so a crash interrupts only its own request)."""
    reporter = _child_setup(reports, "api")
    shop = Shop(config, reporter)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            key = self.headers.get("Idempotency-Key")
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.path != "/orders" or not key:
                self._answer(400, {"error": "POST /orders with an Idempotency-Key"})
                return
            status, document = shop.place_order(key, json.loads(body))
            self._answer(status, document)

        def _answer(self, status: int, document: dict[str, Any]) -> None:
            body = json.dumps(document).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # no access log

    server = HTTPServer(("127.0.0.1", 0), Handler)
    reporter.send("ready", port=server.server_address[1])
    server.serve_forever()


# -- the broker: a durable queue in a SQLite table --------------------------------------------

_BROKER_SCHEMA = """
CREATE TABLE IF NOT EXISTS queue (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    message_id TEXT NOT NULL,
    destination TEXT NOT NULL,
    payload BLOB NOT NULL,
    headers TEXT NOT NULL,
    visible_at_ms INTEGER NOT NULL DEFAULT 0,
    deliveries INTEGER NOT NULL DEFAULT 0,
    acked INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS queue_ready ON queue (acked, visible_at_ms, id)
"""


def _now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True)
class Delivery:
    """One received message: its queue row, and how many times it was delivered."""

    row: int
    payload: bytes
    headers: dict[str, str]
    delivery: int


class Broker:
    """The demo's broker: publish commits messages; receive hides one for the visibility
    timeout; ack removes it for good. Unacked messages come back: at-least-once delivery."""

    def __init__(self, path: str) -> None:
        self.db = _connect(path)

    def publish(self, events: Sequence[Any]) -> list[int]:
        """Store *events* (`OutboxEvent`) durably, in one transaction; return for each how many
        times its message id was published (1 the first time)."""
        from oncely.consumers import producer

        counts = []
        with _transaction(self.db) as db:
            for event in events:
                (earlier,) = db.execute(
                    "SELECT COUNT(*) FROM queue WHERE message_id = ?", (event.message_id,)
                ).fetchone()
                # The header oncely's broker publishers stamp, and its consumers read.
                headers = producer.stamp(event.message_id, dict(event.headers))
                db.execute(
                    "INSERT INTO queue (message_id, destination, payload, headers) "
                    "VALUES (?, ?, ?, ?)",
                    (event.message_id, event.destination, event.payload, json.dumps(headers)),
                )
                counts.append(earlier + 1)
        return counts

    def receive(self) -> Delivery | None:
        """Take the oldest visible unacked message, hidden for `VISIBILITY_SECONDS`."""
        now = _now_ms()
        with _transaction(self.db) as db:
            row = db.execute(
                "SELECT id, payload, headers, deliveries FROM queue "
                "WHERE acked = 0 AND visible_at_ms <= ? ORDER BY id LIMIT 1",
                (now,),
            ).fetchone()
            if row is None:
                return None
            db.execute(
                "UPDATE queue SET visible_at_ms = ?, deliveries = deliveries + 1 WHERE id = ?",
                (now + int(VISIBILITY_SECONDS * 1000), row[0]),
            )
        return Delivery(row[0], bytes(row[1]), json.loads(row[2]), row[3] + 1)

    def ack(self, delivery: Delivery) -> None:
        """The message is done: never delivered again."""
        self.db.execute("UPDATE queue SET acked = 1 WHERE id = ?", (delivery.row,))


class QueuePublisher:
    """The relay's `oncely.outbox.Publisher` for the demo's broker: a batch counts as confirmed
    once its transaction committed. Crashes on purpose right after that, before the relay can
    mark the batch published, when the plan says so for an event's first publication."""

    def __init__(self, config: Config, reporter: Reporter) -> None:
        self.config = config
        self.reporter = reporter
        self.broker = Broker(config.broker)

    async def publish(self, events: Sequence[Any]) -> list[None]:
        counts = self.broker.publish(events)  # committed: the broker has them
        doomed = [
            event.message_id
            for event, count in zip(events, counts, strict=True)
            if count == 1
            and crash_planned(self.config.seed, self.config.crash_rate, "relay", event.message_id)
        ]
        if doomed:
            self.reporter.crash(
                ", ".join(doomed),
                f"after the broker confirmed {len(events)} events, before marking them published",
            )
        self.reporter.send("published", count=len(events))
        return [None] * len(events)

    async def aclose(self) -> None:
        self.broker.db.close()


def relay_main(reports: Connection[Any, Any], config: Config) -> None:
    """The relay process: `oncely.outbox.Relay` with `QueuePublisher`, until SIGTERM."""
    import oncely
    from oncely.outbox import Relay

    reporter = _child_setup(reports, "relay")
    store = oncely.open_store(f"sqlite:///{config.shop}", synchronous="normal")
    relay = Relay(
        store,
        QueuePublisher(config, reporter),
        batch_size=8,
        poll_interval=0.05,
        backoff=0.05,
        max_backoff=0.5,
        publish_timeout=PUBLISH_TIMEOUT,
    )
    reporter.send("ready")
    relay.run_forever()


# -- the warehouse: the consumer ----------------------------------------------------------------

_WAREHOUSE_SCHEMA = """
CREATE TABLE IF NOT EXISTS shipments (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    order_id INTEGER NOT NULL,
    request_key TEXT NOT NULL,
    message_id TEXT NOT NULL,  -- deliberately not UNIQUE: a second shipment would be a row
    pid INTEGER NOT NULL
)
"""


class Warehouse(_Service):
    """The consumer's handler: its inbox record and the shipment in one transaction."""

    def __init__(self, config: Config, reporter: Reporter) -> None:
        super().__init__(config, reporter, config.warehouse)

    def handle(self, delivery: Delivery) -> None:
        """Ship the order of *delivery* once, however often the message arrives."""
        from oncely.consumers.producer import KEY_HEADER

        key = delivery.headers[KEY_HEADER]
        event = json.loads(delivery.payload)
        if self.config.unsafe:
            self._ship_without_inbox(key, event)
            return
        with (
            _transaction(self.db) as db,
            self.inbox.claim(db, key, scope=SHIPMENTS_SCOPE, fingerprint=event) as entry,
        ):
            if entry.replayed:
                # A second delivery of one queued message is a redelivery; a first delivery of
                # a message whose id was consumed already is the relay's re-publish.
                kind = "redelivery" if delivery.delivery > 1 else "republish"
                self.reporter.send("deduplicated", label=key, how=kind)
                return
            shipment = self._write(db, key, event)
            entry.complete({"shipment": shipment})
        self._committed(key, shipment)

    def _ship_without_inbox(self, key: str, event: dict[str, Any]) -> None:
        """``--unsafe``: the shipment without the inbox record; each delivery ships."""
        with _transaction(self.db) as db:
            (earlier,) = db.execute(
                "SELECT COUNT(*) FROM shipments WHERE message_id = ?", (key,)
            ).fetchone()
            shipment = self._write(db, key, event)
        if not earlier:  # crash after the first execution only, as the safe run does
            self._committed(key, shipment)

    def _write(self, db: sqlite3.Connection, key: str, event: dict[str, Any]) -> int:
        shipment = db.execute(
            "INSERT INTO shipments (order_id, request_key, message_id, pid) VALUES (?, ?, ?, ?)",
            (event["order_id"], event["request_key"], key, os.getpid()),
        ).lastrowid
        assert shipment is not None
        return shipment

    def _committed(self, key: str, shipment: int) -> None:
        if crash_planned(self.config.seed, self.config.crash_rate, "consumer", key):
            self.reporter.crash(key, f"after committing shipment {shipment}, before the ack")
        self.reporter.send("shipped", label=key)


def consumer_main(reports: Connection[Any, Any], config: Config) -> None:
    """A consumer process: receive, handle, ack, one message at a time, until terminated."""
    reporter = _child_setup(reports, "consumer")
    broker = Broker(config.broker)
    warehouse = Warehouse(config, reporter)
    reporter.send("ready")
    while True:
        delivery = broker.receive()
        if delivery is None:
            time.sleep(0.02)
            continue
        warehouse.handle(delivery)
        broker.ack(delivery)


# -- the parent: clients, supervision, the check ----------------------------------------------


def prepare(config: Config) -> None:
    """Create the three databases' tables: oncely's, and the shop's, broker's, warehouse's."""
    import oncely

    for path in (config.shop, config.warehouse):  # the oncely tables: records, outbox
        oncely.open_store(f"sqlite:///{path}").close()
    for path, schema in (
        (config.shop, _SHOP_SCHEMA),
        (config.broker, _BROKER_SCHEMA),
        (config.warehouse, _WAREHOUSE_SCHEMA),
    ):
        with contextlib.closing(_connect(path)) as connection:
            connection.executescript(schema)
