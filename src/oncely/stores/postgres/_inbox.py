"""The transactional inbox on PostgreSQL: `oncely._inbox_store.InboxDriver` over psycopg 3.

A claim is one round trip on the caller's connection, in the caller's transaction: a savepoint
and one claim statement (prepared once per session), sent as one query. A key never seen (the
common case) is a single INSERT of the record *already completed* with the outcome of a block
that records nothing: the transaction hides it until the commit and takes it away with a
rollback, and a concurrent duplicate's INSERT waits on the unique index for that transaction
to end. So a block that records ``None`` costs nothing more, one that records a value one
UPDATE, and a replay nothing after its claim. Only a key that already has a row (an expired
record, a released one, a lease held elsewhere) goes through ``oncely_claim`` and an
in-progress record that the block's outcome then settles.

The savepoints are named by how deeply inbox claims are nested in this context, and the ones
no longer needed are left to the commit: releasing them would cost a round trip, and a later
claim at the same depth takes the name over (PostgreSQL rolls back to the newest of a name).

psycopg's exceptions meet the inbox in one place, `_translated`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import weakref
from collections.abc import Awaitable, Callable, Generator
from datetime import timedelta
from typing import Any

from psycopg import AsyncClientCursor, AsyncCursor, ClientCursor, Cursor, pq
from psycopg.rows import tuple_row

from oncely import _txn
from oncely._core.flow import adrive, drive
from oncely._core.records import Acquired, ClaimResult, InProgress, LeaseLost, Status
from oncely._inbox_store import Begin, Finish, Op, Rollback, Settle
from oncely.errors import SchemaMissingError
from oncely.stores.postgres import _sql

__all__ = ["InboxDriver"]

_USER = "the inbox"
_BUSY_HINT = timedelta(seconds=1)
"""`InProgress.retry_after` when another transaction holds the key: a short hint."""

_DEPTH: contextvars.ContextVar[int] = contextvars.ContextVar("oncely_inbox_depth", default=0)
"""How many inbox claims hold their savepoint around the code running in this context."""

_CLAIM_TYPES = ("text", "text", "bigint", "bigint", "text", "bytea", "text")

_CLAIM = """
PREPARE {name} (text, text, bigint, bigint, text, bytea, text) AS
WITH wait AS MATERIALIZED (
    SELECT previous, set_config('lock_timeout', $7, true)
      FROM (SELECT current_setting('lock_timeout') AS previous OFFSET 0) AS saved
), inserted AS (
    INSERT INTO {schema}.oncely_records AS r
           (key, status, fingerprint, token, attempt, lease_expires_at, expires_at, created_at,
            updated_at, result, op)
    SELECT $1, 'completed', $2, 1, 1, statement_timestamp(),
           statement_timestamp() + $4 * interval '1 millisecond',
           statement_timestamp(), statement_timestamp(), $6, $5
      FROM wait
    ON CONFLICT (key) DO NOTHING
    RETURNING 1
)
SELECT 'written'::text, NULL::timestamptz, NULL::text, NULL::text, 1::bigint, 1::integer,
       NULL::timestamptz, NULL::timestamptz, NULL::timestamptz, NULL::timestamptz, NULL::bytea,
       set_config('lock_timeout', wait.previous, true)
  FROM inserted, wait
UNION ALL
SELECT c.*, set_config('lock_timeout', wait.previous, true)
  FROM wait, {schema}.oncely_claim($1, $2, $3, $4, $5) AS c
 WHERE NOT EXISTS (SELECT FROM inserted)
"""
"""The claim, bounded by a ``lock_timeout`` of *wait_ms* set for it alone, in one statement,
prepared once per session: key, fingerprint, lease_ms, ttl_ms, op, result, wait_ms.

A key never seen is one INSERT of the record, completed with *result* (``written``). The
INSERT waits for a transaction holding the key: if that commits, ``oncely_claim`` judges its
record (its reads take fresh snapshots); if it rolls back, the INSERT goes ahead. The data flow
orders the rest: the timeout is set (``wait``) before the INSERT reads its row from it, and the
caller's is restored as each answer row is produced. The reply is ``oncely_claim``'s row with
the restored setting as a last column."""

_REWRITE = """
UPDATE {schema}.oncely_records
   SET status = %s, result = %s, updated_at = statement_timestamp()
 WHERE key = %s AND token = %s AND op = %s
"""
"""A written record's outcome changed: status, result, key, token, op (the claim's). Neither
the key nor the expiry changes: the update stays on its page (HOT). No row: the record is no
longer the one the claim wrote."""

_FINISH = """
UPDATE {schema}.oncely_records
   SET status = %s, result = %s, expires_at = statement_timestamp() + %s,
       lease_expires_at = statement_timestamp(), updated_at = statement_timestamp(), op = %s
 WHERE key = %s AND token = %s AND expires_at > statement_timestamp()
   AND status = 'in_progress'
"""
"""An in-progress record settled by its token: status, result, ttl, op, key, token. No row:
the lease was lost (or the record changed in this transaction)."""


def _translated(exc: BaseException) -> Exception | None:
    """The one place where psycopg's errors in the inbox become oncely's answers: the busy
    marker `InProgress` for a lock wait that timed out, `SchemaMissingError`, or ``None`` (the
    caller's own driver error, in the caller's transaction: it propagates as it is)."""
    sqlstate = getattr(exc, "sqlstate", None)
    if sqlstate == "55P03":  # lock_not_available: another transaction still holds the key
        return _Busy()
    if sqlstate == "26000":  # invalid_sql_statement_name: the claim is not prepared here
        return _Unprepared()
    if sqlstate == "42P05":  # duplicate_prepared_statement: it is, though not by this driver
        return _Prepared()
    if sqlstate in ("42P01", "42883"):  # undefined_table, undefined_function
        return SchemaMissingError(
            f"the oncely schema is missing or out of date: run store.migrate() or "
            f"`oncely migrate` ({str(exc).splitlines()[0] if str(exc) else exc!r})",
            backend="postgres",
        )
    return None


class _Busy(Exception):
    """The claim's wait for another transaction holding the key timed out."""


class _Unprepared(Exception):
    """The session has no claim statement prepared (it was reset since it was prepared)."""


class _Prepared(Exception):
    """The session has the claim statement prepared already (by another client of a pooler's
    server connection, or before this process knew of the connection)."""


_Script = list[tuple[str, Any]]
"""Statements and their parameters (a tuple, or ``None``), sent as one query: one round trip.
A single statement is bound on the server (and prepared by psycopg after a few uses); several
are bound on the client and sent together (the simple query protocol), which costs far less
client time than pipeline mode."""

_TUPLES_OK = 2
"""``psycopg.pq.ExecStatus.TUPLES_OK``: the result has rows to fetch."""

_PREPARED: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()
"""The claim statements prepared in each connection's session (a reset session, a pooler's
other server connection, is found out by the error and prepared again)."""

_Flow = Generator[_Script, list[_sql.Reply], Any]


class _Queue(list[tuple[str, Any]]):
    """A script queued in the caller's pipeline, answered when the caller syncs: no replies."""


def _guarded(update: str) -> str:
    """*update* made to fail when it changes no row. The cast is of a value known only at run
    time: PostgreSQL cannot fold it while planning."""
    return (
        f"WITH done AS ({update.strip()} RETURNING 1)\n"
        "SELECT CASE count(*) WHEN 1 THEN 1 ELSE "
        "('oncely: the inbox record was changed in this transaction ' || count(*))::int END "
        "FROM done"
    )


class _Statements:
    """The store's inbox statements, rendered once per driver."""

    def __init__(self, store: Any) -> None:
        schema = _sql.quote_identifier(store.schema)
        self.store = store
        text = _CLAIM.format(schema=schema, name="{name}")
        self.claim = "oncely_inbox_" + hashlib.sha256(text.encode()).hexdigest()[:16]
        self.prepare = text.format(name=self.claim).strip()
        # In the caller's pipeline (no multi-statement query there): the statement itself,
        # bound on the server, each parameter cast to the type PREPARE declares.
        body = text.split(" AS\n", 1)[1]
        for number, kind in enumerate(_CLAIM_TYPES, start=1):
            body = body.replace(f"${number}", f"%(p{number})s::{kind}")
        self.pipelined_claim = body
        self.rewrite = _REWRITE.format(schema=schema)
        self.finish = _FINISH.format(schema=schema)


class _Claim:
    """One claim's operations on one connection, as scripts (sync and async alike)."""

    __slots__ = ("_connection", "_op", "_reset", "_result", "_savepoint", "_sql", "_written")

    def __init__(self, statements: _Statements, connection: Any) -> None:
        self._sql = statements
        self._connection = connection
        self._written = False  # the claim inserted the record, completed with _result
        self._result = b""
        self._op = ""
        self._savepoint = ""
        self._reset: contextvars.Token[int] | None = None

    def flow(self, op: Op) -> _Flow:
        kind = type(op)
        if kind is Begin:
            return (yield from self._begin(op))  # type: ignore[arg-type]
        if kind is Finish:
            return (yield from self._finish(op))  # type: ignore[arg-type]
        if kind is Settle:
            return (yield from self._settle(op))  # type: ignore[arg-type]
        if kind is Rollback:
            self._leave()
            yield self._rollback()
            return None
        raise TypeError(f"cannot perform {op!r}")

    def _begin(self, op: Begin) -> _Flow:
        store = self._sql.store
        depth = _DEPTH.get()
        savepoint = self._savepoint = f"oncely_inbox_{depth}"
        self._op = _sql.call_id()
        params = (
            store._stored_key(op.key),
            op.fingerprint,
            _sql.ms(op.lease),
            _sql.ms(op.ttl),
            self._op,
            op.result,
            str(max(int(op.wait.total_seconds() * 1000), 1)),
        )
        pipelined = _pipelined(self._connection)
        prepared = _PREPARED.setdefault(self._connection, set())
        name = self._sql.claim
        while True:
            script: _Script = [(f"SAVEPOINT {savepoint}", None)]
            if pipelined:  # the statement itself: EXECUTE takes no parameters bound there
                named = {f"p{number}": value for number, value in enumerate(params, start=1)}
                script.append((self._sql.pipelined_claim, named))
            else:
                if name not in prepared:
                    script.append((self._sql.prepare, None))
                script.append((self._execute(params), None))
            if op.nested:
                script.append((f"SAVEPOINT {savepoint}_block", None))
            try:
                replies = yield script
            except Exception as exc:
                translated = _translated(exc)
                if translated is None:
                    raise  # the caller's driver error, in the caller's transaction
                yield self._rollback()  # the claim's failure undone; the transaction usable
                if type(translated) is _Unprepared and name in prepared:
                    prepared.discard(name)  # the session was reset: prepare it again
                    continue
                if type(translated) is _Prepared and name not in prepared:
                    prepared.add(name)
                    continue
                if type(translated) is _Busy:
                    return InProgress(retry_after=_BUSY_HINT)
                if isinstance(translated, (_Unprepared, _Prepared)):
                    raise  # not the session's state this driver knew: a driver error
                raise translated from exc
            if not pipelined:
                prepared.add(name)
            break
        row = replies[len(script) - 2 if op.nested else -1].rows[0]
        if row[0] == "written":
            self._written, self._result = True, op.result
            answer: ClaimResult = Acquired(1, attempt=1)
        else:
            rows = [row[:-1]]  # without the restored lock_timeout
            answer = _sql.decode_claim(op.key, _sql.Reply(rows, 1))
        if type(answer) is Acquired:
            self._reset = _DEPTH.set(depth + 1)
        return answer

    def _execute(self, params: tuple[Any, ...]) -> str:
        """The EXECUTE of the prepared claim with *params* as literals, escaped by libpq for
        this connection (no client-side adaptation machinery: the claim's hot path)."""
        escape = pq.Escaping(self._connection.pgconn).escape_literal
        encoding = self._connection.info.encoding
        key, fingerprint, lease, ttl, op, result, wait = params
        # The op (hex digits) and the wait (decimal digits) need no escaping; the result is
        # bytea's hex form.
        quoted_key = escape(key.encode(encoding)).decode(encoding)
        quoted_fingerprint = escape(fingerprint.encode(encoding)).decode(encoding)
        quoted_result = escape(b"\\x" + result.hex().encode()).decode()
        return (
            f"EXECUTE {self._sql.claim} ({quoted_key}, {quoted_fingerprint}, {lease:d}, "
            f"{ttl:d}, '{op}', {quoted_result}::bytea, '{wait}')"
        )

    def _finish(self, op: Finish) -> _Flow:
        self._leave()
        if self._written and not op.undo_block and op.result == self._result:
            return None  # the claim wrote this very outcome
        store = self._sql.store
        script: _Script = []
        if op.undo_block:
            script.append((f"ROLLBACK TO SAVEPOINT {self._savepoint}_block", None))
        stored, status, result = store._stored_key(op.key), op.status.value, bytes(op.result)
        if self._written:
            script.append((self._sql.rewrite, (status, result, stored, op.token, self._op)))
        else:
            ttl = timedelta(milliseconds=_sql.ms(op.ttl))
            params = (status, result, ttl, self._op, stored, op.token)
            script.append((self._sql.finish, params))
        if _pipelined(self._connection):
            # Queued in the caller's pipeline, sent with its next statements or its commit: no
            # round trip of its own. A record changed under the block fails the statement,
            # and with it the caller's transaction, at the caller's next sync.
            sql, params = script[-1]
            script[-1] = (_guarded(sql), params)
            yield _Queue(script)
            return None
        try:
            replies = yield script
        except Exception:
            with contextlib.suppress(Exception):  # give the caller its transaction back
                yield self._rollback()
            raise
        if replies[-1].rowcount == 1:
            return None
        yield self._rollback()  # the record changed under the block: undo the block too
        return LeaseLost()

    def _settle(self, op: Settle) -> _Flow:
        """Complete a record claimed with a lease elsewhere: no savepoint, one statement."""
        store = self._sql.store
        ttl = timedelta(milliseconds=_sql.ms(op.ttl))
        params = (
            Status.COMPLETED.value,
            bytes(op.result),
            ttl,
            _sql.call_id(),
            store._stored_key(op.key),
            op.token,
        )
        replies = yield [(self._sql.finish, params)]
        return None if replies[0].rowcount == 1 else LeaseLost()

    def _rollback(self) -> _Script:
        savepoint = self._savepoint
        return [
            (f"ROLLBACK TO SAVEPOINT {savepoint}", None),
            (f"RELEASE SAVEPOINT {savepoint}", None),
        ]

    def _leave(self) -> None:
        """The block is over: a claim after this one, at this depth, may take the name."""
        if self._reset is not None:
            with contextlib.suppress(ValueError):  # reset from another context: nothing to undo
                _DEPTH.reset(self._reset)
            self._reset = None


class InboxDriver:
    """The inbox on a `PostgresStore`'s database, through the caller's psycopg connection (or
    the SQLAlchemy session or connection, Django connection or cursor holding one)."""

    def __init__(self, store: Any) -> None:
        self._statements = _Statements(store)

    def bind(self, connection: Any) -> Callable[[Op], Any]:
        """See `oncely._inbox_store.InboxDriver.bind`."""
        raw = _txn.raw_connection(connection, _USER)
        _txn.check_psycopg_transaction(raw, _USER)
        claim, run = _Claim(self._statements, raw), functools.partial(_run, raw)
        return lambda op: drive(claim.flow(op), run)

    async def abind(self, connection: Any) -> Callable[[Op], Awaitable[Any]]:
        """See `oncely._inbox_store.InboxDriver.abind`."""
        raw = await _txn.araw_connection(connection)
        _txn.check_psycopg_transaction(raw, _USER)
        claim, run = _Claim(self._statements, raw), functools.partial(_arun, raw)

        async def perform(op: Op) -> Any:
            return await adrive(claim.flow(op), run)

        return perform


def _query(script: _Script) -> tuple[str, tuple[Any, ...] | None]:
    """*script* as one query of several statements, with all their parameters."""
    params: tuple[Any, ...] = ()
    for _, each in script:
        if each is not None:
            params += each
    return "; ".join(sql for sql, _ in script), params or None


def _pipelined(connection: Any) -> bool:
    """Whether the caller's connection is in pipeline mode (no multi-statement query there)."""
    return bool(connection.pgconn.pipeline_status)


def _run(connection: Any, script: _Script) -> list[_sql.Reply]:
    """Send *script* in one round trip; each statement's reply, in order."""
    if type(script) is _Queue:
        for sql, params in script:
            Cursor(connection, row_factory=tuple_row).execute(sql, params)
        return []
    if _pipelined(connection):
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


async def _arun(connection: Any, script: _Script) -> list[_sql.Reply]:
    if type(script) is _Queue:
        for sql, params in script:
            await AsyncCursor(connection, row_factory=tuple_row).execute(sql, params)
        return []
    if _pipelined(connection):
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
