"""Activity (see `oncely.observe.activity`) in SQLite: two small tables in the store's file.

The same tables as on PostgreSQL (``oncely_activity``, ``oncely_activity_recent``), created on
first use. A flush is one write transaction on a connection of the sink's own.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from oncely.stores._own_connection import OwnConnection

__all__ = ["SQLiteActivity"]


_DDL = """
CREATE TABLE IF NOT EXISTS oncely_activity (
    namespace TEXT NOT NULL,
    minute INTEGER NOT NULL,
    scope TEXT NOT NULL,
    kind TEXT NOT NULL,
    count INTEGER NOT NULL,
    PRIMARY KEY (namespace, minute, scope, kind)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS oncely_activity_recent (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    namespace TEXT NOT NULL,
    at_ms INTEGER NOT NULL,
    scope TEXT NOT NULL,
    surface TEXT NOT NULL,
    kind TEXT NOT NULL,
    reason TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS oncely_activity_recent_ns_id ON oncely_activity_recent (namespace, id);
"""

_UPSERT = """
INSERT INTO oncely_activity (namespace, minute, scope, kind, count) VALUES (?, ?, ?, ?, ?)
ON CONFLICT (namespace, minute, scope, kind) DO UPDATE SET count = count + excluded.count
"""
_ADD = """
INSERT INTO oncely_activity_recent (namespace, at_ms, scope, surface, kind, reason)
VALUES (?, ?, ?, ?, ?, ?)
"""
_AGE = "DELETE FROM oncely_activity WHERE namespace = ? AND minute < ?"
_TRIM = """
DELETE FROM oncely_activity_recent WHERE namespace = ? AND id <= (
    SELECT id FROM oncely_activity_recent WHERE namespace = ? ORDER BY id DESC LIMIT 1 OFFSET ?
)
"""
_READ_COUNTS = """
SELECT minute, scope, kind, count FROM oncely_activity
WHERE namespace = ? AND minute BETWEEN ? AND ?
"""
_READ_RECENT = """
SELECT at_ms, scope, surface, kind, reason FROM oncely_activity_recent
WHERE namespace = ? ORDER BY id DESC LIMIT ?
"""


class SQLiteActivity(OwnConnection):
    """Activity in the store's database file, through a connection of its own."""

    def __init__(self, path: str, namespace: str, timeout: float = 5.0) -> None:
        self._path = path
        self._namespace = namespace
        self._timeout = timeout
        self._connection: sqlite3.Connection | None = None
        self._lock = threading.Lock()

    @staticmethod
    def schema_sql() -> str:
        """The tables' DDL, as text for a migration tool (idempotent)."""
        return _DDL

    @classmethod
    def of(cls, store: Any) -> SQLiteActivity:
        """The activity of a `SQLiteStore` kept in a file."""
        return cls(str(store.path), store.namespace)

    def _connect(self) -> sqlite3.Connection:
        if self._connection is None:
            connection = sqlite3.connect(
                self._path, timeout=self._timeout, isolation_level=None, check_same_thread=False
            )
            try:
                connection.executescript(_DDL)
            except BaseException:
                connection.close()
                raise
            self._connection = connection
        return self._connection

    def migrate(self) -> None:
        """Create the tables if they are missing."""
        with self._lock:
            self._connect()

    def write(
        self,
        counts: Mapping[tuple[int, str, str], int],
        recent: Sequence[tuple[int, str, str, str, str]],
        *,
        now_ms: int,
        keep_minutes: int,
        keep_recent: int,
    ) -> None:
        """See `oncely.observe.activity.Sink.write`: one write transaction."""
        ns = self._namespace
        with self._lock:
            connection = self._connect()
            connection.execute("BEGIN IMMEDIATE")
            try:
                connection.executemany(
                    _UPSERT, [(ns, *key, count) for key, count in sorted(counts.items())]
                )
                connection.executemany(_ADD, [(ns, *row) for row in recent])
                connection.execute(_AGE, (ns, now_ms // 60_000 - keep_minutes))
                connection.execute(_TRIM, (ns, ns, keep_recent))
            except BaseException:
                connection.execute("ROLLBACK")
                raise
            connection.execute("COMMIT")

    def read(
        self, *, since_minute: int, until_minute: int, limit: int
    ) -> tuple[list[tuple[int, str, str, int]], list[tuple[int, str, str, str, str]]]:
        """See `oncely.observe.activity.Sink.read`."""
        ns = self._namespace
        with self._lock:
            connection = self._connect()
            rows = connection.execute(_READ_COUNTS, (ns, since_minute, until_minute)).fetchall()
            recent = connection.execute(_READ_RECENT, (ns, limit)).fetchall() if limit > 0 else []
        return [tuple(row) for row in rows], [tuple(row) for row in recent]
