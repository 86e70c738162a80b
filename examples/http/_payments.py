"""What every example payments API shares: the ledger (the effect), parsing, and serving.

The payment effect is one row in a SQLite table, so "executed exactly once" can be counted.
The endpoints take a few query parameters that simulate trouble, used by the tests and the
demo: ``delay`` (seconds of work), ``fail`` (a status such as ``500`` or ``409`` is answered
after the charge, ``raise`` raises after it), ``pad`` (bytes of padding in the response) and
``chunks`` (send the response body in that many pieces).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import socket
import sqlite3
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import oncely

SCHEMA = """
CREATE TABLE IF NOT EXISTS payments (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    amount INTEGER NOT NULL,
    currency TEXT NOT NULL,
    body_sha256 TEXT NOT NULL,
    body_size INTEGER NOT NULL
)
"""


class Ledger:
    """The bank: one row per executed charge, in a SQLite file shared across processes."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        with self._connect() as connection:
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute(SCHEMA)

    @contextlib.contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        connection = sqlite3.connect(self.path, timeout=30)
        try:
            with connection:
                yield connection
        finally:
            connection.close()

    def charge(self, payment: Payment) -> dict[str, Any]:
        """Execute the payment: insert its row; return it as the API shows it."""
        with self._connect() as connection:
            cursor = connection.execute(
                "INSERT INTO payments (amount, currency, body_sha256, body_size) "
                "VALUES (?, ?, ?, ?)",
                (payment.amount, payment.currency, payment.body_sha256, payment.body_size),
            )
            payment_id = int(cursor.lastrowid or 0)
        return {"id": payment_id, **payment.as_dict()}

    def get(self, payment_id: int) -> dict[str, Any] | None:
        """Return a payment by id, or ``None``."""
        with self._connect() as connection:
            row = connection.execute(
                "SELECT id, amount, currency, body_sha256, body_size FROM payments WHERE id = ?",
                (payment_id,),
            ).fetchone()
        if row is None:
            return None
        return dict(zip(("id", "amount", "currency", "body_sha256", "body_size"), row, strict=True))

    def count(self) -> int:
        """How many charges were executed."""
        with self._connect() as connection:
            return int(connection.execute("SELECT count(*) FROM payments").fetchone()[0])


@dataclass(frozen=True)
class Payment:
    """A payment request as read from a body: JSON ``{"amount", "currency"}`` or any bytes."""

    amount: int
    currency: str
    body_sha256: str
    body_size: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "amount": self.amount,
            "currency": self.currency,
            "body_sha256": self.body_sha256,
            "body_size": self.body_size,
        }


def parse_payment(body: bytes, content_type: str) -> Payment | None:
    """Read a payment; ``None`` when the body claims to be JSON but is not a payment object."""
    digest = hashlib.sha256(body).hexdigest()
    if "json" not in content_type.lower():
        return Payment(0, "XXX", digest, len(body))  # a binary upload, say
    try:
        data = json.loads(body)
        return Payment(
            int(data.get("amount", 0)), str(data.get("currency", "EUR")), digest, len(body)
        )
    except (ValueError, TypeError, AttributeError, RecursionError):
        return None


def adjustment(body: bytes) -> Payment:
    """An amount-free ledger entry (what ``PUT /payments/{id}`` records, uncovered by default)."""
    return Payment(0, "ADJ", hashlib.sha256(body).hexdigest(), len(body))


@dataclass(frozen=True)
class Simulation:
    """The trouble a request asks for through its query string."""

    delay: float = 0.0
    fail: str = ""
    pad: int = 0
    chunks: int = 1

    @classmethod
    def from_query(cls, query: Mapping[str, str]) -> Simulation:
        return cls(
            delay=float(query.get("delay", 0) or 0),
            fail=str(query.get("fail", "")),
            pad=int(query.get("pad", 0) or 0),
            chunks=max(1, int(query.get("chunks", 1) or 1)),
        )

    @property
    def status(self) -> int:
        """The status the handler answers after charging: ``fail=<status>`` or 201."""
        return int(self.fail) if self.fail.isdigit() else 201

    def body(self, document: dict[str, Any]) -> bytes:
        """The response body: the document, padded as asked."""
        if self.pad:
            document = {**document, "pad": "x" * self.pad}
        return json.dumps(document).encode()

    def pieces(self, body: bytes) -> list[bytes]:
        """*body* split into `chunks` pieces."""
        size = max(1, -(-len(body) // self.chunks))
        return [body[start : start + size] for start in range(0, len(body), size)] or [b""]


class SimulatedFailure(RuntimeError):
    """Raised by a handler asked to ``fail=raise``."""


def payment_headers(payment_id: int) -> list[tuple[str, str]]:
    """Location, ETag and a session cookie: what a create endpoint answers with."""
    return [
        ("location", f"/payments/{payment_id}"),
        ("etag", f'"payment-{payment_id}"'),
        ("set-cookie", f"last_payment={payment_id}; Path=/; HttpOnly"),
    ]


# -- running an example as a server -------------------------------------------------------------


def listening_socket(host: str, port: int) -> socket.socket:
    """Bind and listen (port 0 picks a free port), and print the address for whoever waits."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets that say they are TCP; without
    # it, a response written in two parts waits out the client's delayed ACK (about 40 ms).
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.set_inheritable(True)
    print(f"listening on http://{host}:{sock.getsockname()[1]}", flush=True)
    return sock


def main(kind: str, create_app: Callable[..., Any], description: str) -> None:
    """Serve an example: uvicorn for ASGI apps, waitress for WSGI apps."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--store", default="sqlite:///oncely.db", help="an oncely store URL")
    parser.add_argument("--namespace", default="", help="keeps these keys apart in the store")
    parser.add_argument("--ledger", default="payments.db", help="the payments SQLite file")
    parser.add_argument("--lease", type=float, default=30.0, help="lease seconds")
    args = parser.parse_args()
    from oncely.http import HttpPolicy

    store = oncely.open_store(args.store, namespace=args.namespace)
    app = create_app(store, Ledger(args.ledger), HttpPolicy(lease=args.lease))
    sock = listening_socket(args.host, args.port)
    try:
        if kind == "asgi":
            import uvicorn

            config = uvicorn.Config(app, log_level="warning", lifespan="off")
            uvicorn.Server(config).run(sockets=[sock])
        else:
            import waitress

            waitress.serve(app, sockets=[sock], threads=16, _quiet=True)
    finally:
        sock.close()
        store.close()
