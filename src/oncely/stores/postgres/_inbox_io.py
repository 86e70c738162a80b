"""How the PostgreSQL inbox's scripts reach the server, sync and async: as one query through
psycopg, queued in the caller's pipeline, or straight to libpq in its pipeline mode (`Piped`),
each in one round trip and under the connection's lock. `oncely.stores.postgres._inbox` decides
what to send; this module only sends it and reads the replies back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Any, Final

import psycopg.generators
from psycopg import AsyncClientCursor, AsyncCursor, ClientCursor, Cursor, pq
from psycopg.rows import tuple_row

from oncely.stores.postgres import _sql, _wire

__all__ = ["Piped", "Queue", "Script", "Wired", "arun", "pipelined", "run"]

Script = list[tuple[str, Any]]
"""Statements and their parameters (a tuple, or ``None``), sent as one query: one round trip.
A single statement is bound on the server (and prepared by psycopg after a few uses); several
are bound on the client and sent together (the simple query protocol), which costs far less
client time than pipeline mode."""

_TUPLES_OK = 2
"""``psycopg.pq.ExecStatus.TUPLES_OK``: the result has rows to fetch."""


class Piped(list[tuple[Any, ...]]):
    """Steps sent to libpq in one round trip (its pipeline mode, one sync): a statement with
    no parameters ``(sql,)``, a prepare ``(wire, None)``, an execution of a prepared
    statement ``(wire, values)`` or of an unnamed one ``(wire, values, False)``; answered by
    each step's libpq result. The path of a connection whose client encoding is UTF-8 and that
    is not in pipeline mode itself."""


class Wired:
    """One statement run by `_wire.run`, binary: answered by one `_sql.Reply` with no rows.
    Prepared once per session (with the claim), but for a store made with ``prepare=False``
    (behind a pooler): sent unnamed."""

    __slots__ = ("names", "params", "wire")

    def __init__(self, wire: _wire.Wire, params: Any, names: set[bytes], store: Any) -> None:
        self.wire, self.params = wire, params
        self.names = names if store._prepare else None


_SEND: Final = psycopg.generators.send
_FETCH_MANY: Final = psycopg.generators.fetch_many
_OK: Final = (pq.ExecStatus.TUPLES_OK, pq.ExecStatus.COMMAND_OK)


class Queue(list[tuple[str, Any]]):
    """A script queued in the caller's pipeline, answered when the caller syncs: no replies."""


def _query(script: Script) -> tuple[str, tuple[Any, ...] | None]:
    """*script* as one query of several statements, with all their parameters."""
    params: tuple[Any, ...] = ()
    for _, each in script:
        if each is not None:
            params += each
    return "; ".join(sql for sql, _ in script), params or None


def pipelined(connection: Any) -> bool:
    """Whether the caller's connection is in pipeline mode (no multi-statement query there)."""
    return bool(connection.pgconn.pipeline_status)


def _send(pgconn: Any, steps: Piped) -> None:
    """Queue *steps* in libpq's pipeline mode, and their sync."""
    pgconn.enter_pipeline_mode()
    for step in steps:
        if len(step) == 1:
            pgconn.send_query_params(step[0], None)
        elif step[1] is None:
            wire = step[0]
            pgconn.send_prepare(wire.name, wire.sql, wire.types)
        elif len(step) == 3:  # unnamed: a store made with ``prepare=False``
            wire = step[0]
            pgconn.send_query_params(wire.sql, step[1], wire.types, wire.formats, 1)
        else:
            wire = step[0]
            pgconn.send_query_prepared(wire.name, step[1], wire.formats, 1)
    pgconn.pipeline_sync()


def _exchange(pgconn: Any, count: int) -> Generator[Any, Any, list[Any]]:
    """psycopg's generator that flushes the pipeline and reads back *count* steps' results
    (the last of each) and the sync's."""
    yield from _SEND(pgconn)
    results = []
    for _ in range(count):
        results.append((yield from _FETCH_MANY(pgconn))[-1])
    yield from _FETCH_MANY(pgconn)
    return results


def _piped(pgconn: Any, results: list[Any]) -> list[Any]:
    """*results* once out of pipeline mode, or the first failed step's error raised."""
    pgconn.exit_pipeline_mode()
    for result in results:
        if result.status not in _OK:
            _wire.checked([result])  # raises its error
    return results


def _left(pgconn: Any) -> None:
    """Leave pipeline mode after an interrupted exchange, if libpq lets us (it does not with
    results not read: the connection is then in no state to be used anyway)."""
    if pgconn.pipeline_status:
        with contextlib.suppress(Exception):
            pgconn.exit_pipeline_mode()


def run(connection: Any, script: Any) -> list[Any]:
    """Send *script* in one round trip; each statement's reply, in order."""
    kind = type(script)
    if kind is Wired:
        wired: Any = script
        # The connection's lock, as psycopg's cursors take it: another thread may share it.
        with connection.lock:
            result = _wire.run(connection, wired.wire, wired.params, wired.names)
        return [_sql.Reply([], result.command_tuples)]
    if kind is Piped:
        pgconn = connection.pgconn
        with connection.lock:
            try:
                _send(pgconn, script)
                results = connection.wait(_exchange(pgconn, len(script)))
            except BaseException:
                _left(pgconn)
                raise
            return _piped(pgconn, results)
    if kind is Queue:
        for sql, params in script:
            Cursor(connection, row_factory=tuple_row).execute(sql, params)
        return []
    if pipelined(connection):
        cursors = [Cursor(connection, row_factory=tuple_row) for _ in script]
        with connection.pipeline():  # nested in the caller's: synced on leaving
            for each, (sql, params) in zip(cursors, script, strict=True):
                each.execute(sql, params)
        return [_reply(each) for each in cursors]
    if len(script) == 1:
        # Server-side binding whatever the connection's cursor factory (Django's binds on the
        # client): the statement is prepared after a few uses.
        cursor: Any = Cursor(connection, row_factory=tuple_row)
        cursor.execute(*script[0])
    else:
        cursor = ClientCursor(connection, row_factory=tuple_row)
        cursor.execute(*_query(script))
    replies = []
    while True:
        replies.append(_reply(cursor))
        if not cursor.nextset():
            return replies


def _reply(cursor: Any) -> _sql.Reply:
    # The result's status, not ``description``: that builds a Column per field on each read.
    result = cursor.pgresult
    rows = cursor.fetchall() if result is not None and result.status == _TUPLES_OK else []
    return _sql.Reply(rows, cursor.rowcount)


async def arun(connection: Any, script: Any) -> list[Any]:
    kind = type(script)
    if kind is Wired:
        wired: Any = script
        async with connection.lock:  # as in `run`: another task may share the connection
            result = await _wire.arun(connection, wired.wire, wired.params, wired.names)
        return [_sql.Reply([], result.command_tuples)]
    if kind is Piped:
        pgconn = connection.pgconn
        async with connection.lock:
            try:
                _send(pgconn, script)
                results = await connection.wait(_exchange(pgconn, len(script)))
            except BaseException:
                _left(pgconn)
                raise
            return _piped(pgconn, results)
    if kind is Queue:
        for sql, params in script:
            await AsyncCursor(connection, row_factory=tuple_row).execute(sql, params)
        return []
    if pipelined(connection):
        cursors = [AsyncCursor(connection, row_factory=tuple_row) for _ in script]
        async with connection.pipeline():
            for each, (sql, params) in zip(cursors, script, strict=True):
                await each.execute(sql, params)
        return [await _areply(each) for each in cursors]
    if len(script) == 1:
        cursor: Any = AsyncCursor(connection, row_factory=tuple_row)
        await cursor.execute(*script[0])
    else:
        cursor = AsyncClientCursor(connection, row_factory=tuple_row)
        await cursor.execute(*_query(script))
    replies = []
    while True:
        replies.append(await _areply(cursor))
        if not cursor.nextset():
            return replies


async def _areply(cursor: Any) -> _sql.Reply:
    result = cursor.pgresult
    rows = await cursor.fetchall() if result is not None and result.status == _TUPLES_OK else []
    return _sql.Reply(rows, cursor.rowcount)
