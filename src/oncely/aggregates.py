"""Versioned aggregates: optimistic locking for rows that events change, in the caller's
transaction.

An aggregate is a row with a ``version`` (how many events changed it) and a ``last_event_id``
(the event that changed it last). `VersionedTable.apply` changes a row for one event only if
the row is still at the version the change was computed from and the event is not the one
applied last; when another writer moved the row on in between, it reads the row again and
recomputes the change, a bounded number of times, then raises `VersionConflictError`.

.. code-block:: python

    accounts = VersionedTable("accounts")

    with conn.transaction():
        accounts.apply(
            conn, "acct-1", event_id,
            lambda row: {"balance": row["balance"] + amount},
        )

``last_event_id`` catches the redelivery of the event applied last (the usual one: a consumer
that died between its commit and its ack). For redeliveries that other events overtook, claim
the event id in the same transaction with `oncely.Inbox` as well (see the inbox guide).

Connections: psycopg 3 (sync, and async with `VersionedTable.aapply`), the standard library's
``sqlite3`` (in a transaction holding the write lock: ``BEGIN IMMEDIATE``), SQLAlchemy sessions
and connections over those drivers, and Django's connection. On PostgreSQL the retry works under
``READ COMMITTED`` (the default): each read sees the latest committed row. Under
``REPEATABLE READ`` a concurrent change is PostgreSQL's serialization error: retry the
transaction.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from oncely._core.flow import Flow, adrive, drive
from oncely._inbox_entry import _araw_connection, _raw_connection
from oncely.errors import ConfigurationError, VersionConflictError

__all__ = ["Applied", "Change", "VersionedTable"]

Change = Callable[[dict[str, Any] | None], Mapping[str, Any]]
"""Computes an event's change from the row as read (``None``: there is no row yet): the
columns to set. ``version`` and ``last_event_id`` are set by `VersionedTable.apply`."""

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True, slots=True)
class Applied:
    """What `VersionedTable.apply` did.

    Attributes:
        applied: False when the event was the one applied last: nothing was written.
        version: The row's version now.
        row: The row now (as written, or as read when nothing was written).
        attempts: How many times the change was computed (more than 1 after conflicts).

    .. versionadded:: 0.1.0
    """

    applied: bool
    version: int
    row: dict[str, Any]
    attempts: int


@dataclass(frozen=True, slots=True)
class _Read:
    sql: str
    params: tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class _Write:
    sql: str
    params: tuple[Any, ...]


class VersionedTable:
    """Apply events to the rows of *table* with optimistic locking.

    Args:
        table: The table's name (letters, digits and underscores).
        schema: Its schema, or ``None`` for the connection's search path (PostgreSQL).
        id_column: The primary key column.
        version_column: The integer column counting the events applied (a new row starts at 1).
        event_column: The column holding the id of the event applied last.
        retries: How many times a change is recomputed after a conflict before
            `VersionConflictError`.

    Raises:
        ConfigurationError: A name is not a plain identifier, or *retries* is negative.

    .. versionadded:: 0.1.0
    """

    def __init__(
        self,
        table: str,
        *,
        schema: str | None = None,
        id_column: str = "id",
        version_column: str = "version",
        event_column: str = "last_event_id",
        retries: int = 5,
    ) -> None:
        for name in (table, schema or "x", id_column, version_column, event_column):
            _check_identifier(name)
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ConfigurationError(f"retries must be a whole number >= 0, not {retries!r}")
        self.table = table
        self.retries = retries
        self._name = f'"{schema}"."{table}"' if schema else f'"{table}"'
        self._id, self._version, self._event = id_column, version_column, event_column

    def apply(
        self,
        connection: Any,
        aggregate_id: Any,
        event_id: Any,
        change: Change,
        *,
        expected_version: int | None = None,
    ) -> Applied:
        """Apply the event *event_id* to row *aggregate_id*, in *connection*'s transaction.

        Args:
            connection: The caller's connection or session, inside its transaction.
            aggregate_id: The row's id.
            event_id: The event's id, written to the event column.
            change: Computes the columns to set from the row as read; called again after a
                conflict, so it must only compute (no side effects).
            expected_version: The version the caller decided the change on, if it read the
                row earlier: any other version is a conflict at once, never retried.

        Raises:
            VersionConflictError: The row is not at *expected_version*, or kept moving on
                through all the retries.
        """
        raw = _raw_connection(connection)
        mark = "?" if type(raw).__module__ == "sqlite3" else "%s"
        flow = self._flow(mark, aggregate_id, event_id, change, expected_version)
        return drive(flow, _SyncPerformer(raw).perform)

    async def aapply(
        self,
        connection: Any,
        aggregate_id: Any,
        event_id: Any,
        change: Change,
        *,
        expected_version: int | None = None,
    ) -> Applied:
        """`apply` for an async psycopg connection or SQLAlchemy async session."""
        raw = await _araw_connection(connection)
        flow = self._flow("%s", aggregate_id, event_id, change, expected_version)
        return await adrive(flow, _AsyncPerformer(raw).perform)

    def _flow(
        self,
        mark: str,
        aggregate_id: Any,
        event_id: Any,
        change: Change,
        expected: int | None,
    ) -> Flow[Applied]:
        """Read, compute, write if unchanged; again after a conflict (sync and async alike)."""
        key = f"{self.table}:{aggregate_id}"
        read = _Read(
            f"SELECT * FROM {self._name} WHERE {self._quoted(self._id)} = {mark}", (aggregate_id,)
        )
        version: int | None = None
        for attempt in range(1, self.retries + 2):
            row: dict[str, Any] | None = yield read
            version = None if row is None else int(row[self._version])
            if row is not None and _same(row[self._event], event_id):
                return Applied(False, int(row[self._version]), row, attempt)
            if expected is not None and (version or 0) != expected:
                raise VersionConflictError(key, expected=expected, actual=version)
            changes = dict(change(None if row is None else dict(row)))
            for name in changes:
                _check_identifier(name)
                if name in (self._id, self._version, self._event):
                    raise ConfigurationError(
                        f"the change sets {name!r}, which apply() maintains itself"
                    )
            written = yield self._write(mark, aggregate_id, event_id, version, changes)
            if written == 1:
                new = version + 1 if version is not None else 1
                base = row if row is not None else {self._id: aggregate_id}
                state = {**base, **changes, self._version: new, self._event: event_id}
                return Applied(True, new, state, attempt)
        row = yield read  # to say where it is now
        actual = None if row is None else int(row[self._version])
        raise VersionConflictError(key, expected=version or 0, actual=actual)

    def _write(
        self,
        mark: str,
        aggregate_id: Any,
        event_id: Any,
        version: int | None,
        changes: dict[str, Any],
    ) -> _Write:
        quoted = self._quoted
        if version is None:  # a new row: someone else creating it first is a conflict too
            columns = [self._id, self._version, self._event, *changes]
            values = (aggregate_id, 1, event_id, *changes.values())
            return _Write(
                f"INSERT INTO {self._name} ({', '.join(map(quoted, columns))}) "
                f"VALUES ({', '.join([mark] * len(columns))}) ON CONFLICT DO NOTHING",
                values,
            )
        sets = [f"{quoted(name)} = {mark}" for name in changes]
        sets += [f"{quoted(self._version)} = {mark}", f"{quoted(self._event)} = {mark}"]
        event = quoted(self._event)
        return _Write(
            f"UPDATE {self._name} SET {', '.join(sets)} "
            f"WHERE {quoted(self._id)} = {mark} AND {quoted(self._version)} = {mark} "
            f"AND ({event} IS NULL OR {event} <> {mark})",
            (*changes.values(), version + 1, event_id, aggregate_id, version, event_id),
        )

    @staticmethod
    def _quoted(name: str) -> str:
        return f'"{name}"'


def _check_identifier(name: object) -> None:
    if not isinstance(name, str) or not _IDENTIFIER.fullmatch(name):
        raise ConfigurationError(
            f"{name!r} is not a plain SQL name (letters, digits and underscores)"
        )


def _row(cursor: Any, found: tuple[Any, ...] | None) -> dict[str, Any] | None:
    if found is None:
        return None
    return dict(zip([column[0] for column in cursor.description], found, strict=True))


def _same(stored: Any, event_id: Any) -> bool:
    """Whether the stored event id is *event_id* (SQLite may give back text for a number)."""
    return stored is not None and (stored == event_id or str(stored) == str(event_id))


class _SyncPerformer:
    def __init__(self, connection: Any) -> None:
        if type(connection).__module__ == "sqlite3":
            self._cursor = connection.cursor()
            self._cursor.row_factory = None  # plain tuples, whatever the connection's factory
        else:
            from psycopg.rows import tuple_row

            self._cursor = connection.cursor(row_factory=tuple_row)

    def perform(self, op: _Read | _Write) -> Any:
        cursor = self._cursor
        cursor.execute(op.sql, op.params)
        return _row(cursor, cursor.fetchone()) if type(op) is _Read else cursor.rowcount


class _AsyncPerformer:
    def __init__(self, connection: Any) -> None:
        from psycopg.rows import tuple_row

        self._cursor = connection.cursor(row_factory=tuple_row)

    async def perform(self, op: _Read | _Write) -> Any:
        cursor = self._cursor
        await cursor.execute(op.sql, op.params)
        if type(op) is _Write:
            return cursor.rowcount
        return _row(cursor, await cursor.fetchone())
