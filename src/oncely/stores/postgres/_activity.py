"""Activity (see `oncely.observe.activity`) in PostgreSQL: two small tables beside the records.

``oncely_activity`` holds counts by (namespace, minute, scope, kind); ``oncely_activity_recent``
the last mismatches and refusals. A flush is one statement: an upsert of the counts (in key
order, so that concurrent flushes lock rows in the same order), the recent events' insert and,
once a minute, the removal of what is older than kept. The tables are created on first use
(or by `migrate`), under an advisory lock so that two processes starting together do not race.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import psycopg
from psycopg import sql

from oncely.stores._own_connection import OwnConnection

__all__ = ["PostgresActivity"]


_DDL = """
CREATE TABLE IF NOT EXISTS {counts} (
    namespace text NOT NULL,
    minute bigint NOT NULL,
    scope text NOT NULL,
    kind text NOT NULL,
    count bigint NOT NULL,
    PRIMARY KEY (namespace, minute, scope, kind)
);
CREATE TABLE IF NOT EXISTS {recent} (
    id bigserial PRIMARY KEY,
    namespace text NOT NULL,
    at_ms bigint NOT NULL,
    scope text NOT NULL,
    surface text NOT NULL,
    kind text NOT NULL,
    reason text NOT NULL
);
CREATE INDEX IF NOT EXISTS {recent_index} ON {recent} (namespace, id);
"""

_WRITE = """
WITH counted AS (
    INSERT INTO {counts} AS a (namespace, minute, scope, kind, count)
    SELECT %(ns)s, t.m, t.s, t.k, t.c
    FROM unnest(%(minutes)s::bigint[], %(scopes)s::text[], %(kinds)s::text[], %(counts)s::bigint[])
        AS t(m, s, k, c)
    ORDER BY t.m, t.s, t.k
    ON CONFLICT (namespace, minute, scope, kind) DO UPDATE SET count = a.count + EXCLUDED.count
), added AS (
    INSERT INTO {recent} (namespace, at_ms, scope, surface, kind, reason)
    SELECT %(ns)s, t.at, t.s, t.f, t.k, t.r
    FROM unnest(%(at)s::bigint[], %(rscopes)s::text[], %(surfaces)s::text[], %(rkinds)s::text[],
                %(reasons)s::text[]) AS t(at, s, f, k, r)
), aged AS (
    DELETE FROM {counts} WHERE %(prune)s AND namespace = %(ns)s AND minute < %(oldest)s
), trimmed AS (
    DELETE FROM {recent} WHERE %(prune)s AND namespace = %(ns)s AND id <= (
        SELECT id FROM {recent} WHERE namespace = %(ns)s ORDER BY id DESC OFFSET %(keep)s LIMIT 1
    )
)
SELECT 1
"""

_READ_COUNTS = """
SELECT minute, scope, kind, count FROM {counts}
WHERE namespace = %(ns)s AND minute BETWEEN %(since)s AND %(until)s
"""

_READ_RECENT = """
SELECT at_ms, scope, surface, kind, reason FROM {recent}
WHERE namespace = %(ns)s ORDER BY id DESC LIMIT %(limit)s
"""


class PostgresActivity(OwnConnection):
    """Activity in the store's database, through a connection of its own."""

    def __init__(
        self, conninfo: str, options: Mapping[str, Any], schema: str, namespace: str
    ) -> None:
        self._conninfo = conninfo
        self._options = {**options, "autocommit": True}
        self._namespace = namespace
        names = {
            "counts": sql.Identifier(schema, "oncely_activity"),
            "recent": sql.Identifier(schema, "oncely_activity_recent"),
            "recent_index": sql.Identifier("oncely_activity_recent_ns_id"),
        }
        self._ddl = sql.SQL(_DDL).format(**names)
        self._schema = schema
        self._write = sql.SQL(_WRITE).format(**names)
        self._read_counts = sql.SQL(_READ_COUNTS).format(**names)
        self._read_recent = sql.SQL(_READ_RECENT).format(**names)
        self._connection: psycopg.Connection[Any] | None = None
        self._lock = threading.Lock()
        self._pruned_minute = -1

    def schema_sql(self) -> str:
        """The tables' DDL for this schema, as text for a migration tool (idempotent)."""

        def quoted(name: str) -> str:
            return '"' + name.replace('"', '""') + '"'

        schema = quoted(self._schema)
        return _DDL.format(
            counts=f"{schema}.{quoted('oncely_activity')}",
            recent=f"{schema}.{quoted('oncely_activity_recent')}",
            recent_index=quoted("oncely_activity_recent_ns_id"),
        )

    @classmethod
    def of(cls, store: Any) -> PostgresActivity:
        """The activity of a `PostgresStore` (its settings, a connection of its own)."""
        return cls(store._conninfo, store._kwargs, store.schema, store.namespace)

    def _connect(self) -> psycopg.Connection[Any]:
        if self._connection is None or self._connection.closed:
            self._connection = psycopg.connect(self._conninfo, **self._options)
        return self._connection

    def _run(self, statement: Any, params: Mapping[str, Any], *, create: bool) -> list[Any]:
        """Run *statement*; a missing table is created (*create*) or read as no rows."""
        with self._lock:
            try:
                connection = self._connect()
                try:
                    return connection.execute(statement, params).fetchall()
                except psycopg.errors.UndefinedTable:
                    if not create:
                        return []
                    self._migrate(connection)
                    return connection.execute(statement, params).fetchall()
            except psycopg.OperationalError:
                self._drop()  # reconnect on the next call
                raise

    def _migrate(self, connection: psycopg.Connection[Any]) -> None:
        with connection.transaction():
            connection.execute("SELECT pg_advisory_xact_lock(hashtext('oncely_activity'))")
            connection.execute(self._ddl)

    def migrate(self) -> None:
        """Create the tables if they are missing."""
        with self._lock:
            self._migrate(self._connect())

    def write(
        self,
        counts: Mapping[tuple[int, str, str], int],
        recent: Sequence[tuple[int, str, str, str, str]],
        *,
        now_ms: int,
        keep_minutes: int,
        keep_recent: int,
    ) -> None:
        """See `oncely.observe.activity.Sink.write`: one statement."""
        minute = now_ms // 60_000
        keys = sorted(counts)
        params = {
            "ns": self._namespace,
            "minutes": [key[0] for key in keys],
            "scopes": [key[1] for key in keys],
            "kinds": [key[2] for key in keys],
            "counts": [counts[key] for key in keys],
            "at": [row[0] for row in recent],
            "rscopes": [row[1] for row in recent],
            "surfaces": [row[2] for row in recent],
            "rkinds": [row[3] for row in recent],
            "reasons": [row[4] for row in recent],
            "prune": minute != self._pruned_minute,
            "oldest": minute - keep_minutes,
            "keep": keep_recent,
        }
        self._run(self._write, params, create=True)
        self._pruned_minute = minute

    def read(
        self, *, since_minute: int, until_minute: int, limit: int
    ) -> tuple[list[tuple[int, str, str, int]], list[tuple[int, str, str, str, str]]]:
        """See `oncely.observe.activity.Sink.read`."""
        params = {"ns": self._namespace, "since": since_minute, "until": until_minute}
        rows = self._run(self._read_counts, params, create=False)
        recent = (
            self._run(self._read_recent, {"ns": self._namespace, "limit": limit}, create=False)
            if limit > 0
            else []
        )
        return [tuple(row) for row in rows], [tuple(row) for row in recent]
