"""The transactional inbox on PostgreSQL: `oncely._inbox_store.InboxDriver` over psycopg 3.

A claim is one round trip on the caller's connection, in the caller's transaction: a savepoint
and one claim statement (prepared once per session), sent straight to libpq in its pipeline
mode with binary parameters, as `_wire` sends the store's statements (``_inbox_io.Piped``), or
as one query through psycopg where that path does not go (a client encoding other than UTF-8,
the caller's own pipeline mode). A key never seen (the common case) is a single INSERT of the
record *already completed* with the outcome of a block that records nothing: the transaction
hides it until the commit and takes it away with a rollback, and a concurrent duplicate's
INSERT waits on the unique index for that transaction to end. So a block that records ``None``
costs nothing more, one that records a value one UPDATE, and a replay nothing after its claim.
Only a key that already has a row (an expired record, a released one, a lease held elsewhere)
goes through ``oncely_claim`` and an in-progress record that the block's outcome then settles.

A transaction the inbox owns (``Begin.own``) is begun in the claim's round trip, with no
savepoint (ROLLBACK undoes the claim), and committed in the outcome's: the UPDATE guarded
(`_guarded`), so that a record changed under the block fails the COMMIT sent with it.

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
from typing import Any, Final

import psycopg.generators
from psycopg import pq

from oncely import _txn
from oncely._core.flow import adrive, drive
from oncely._core.records import Acquired, ClaimResult, InProgress, LeaseLost, Replay, Status
from oncely._inbox_store import Begin, Commit, Finish, Op, Open, Rollback, Settle
from oncely.errors import ConfigurationError, OncelyError, SchemaMissingError
from oncely.stores.postgres import _inbox_io as _io
from oncely.stores.postgres import _sql, _wire

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


_PREPARED: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()
"""The claim statements prepared in each connection's session (a reset session, a pooler's
other server connection, is found out by the error and prepared again)."""

_Flow = Generator[Any, Any, Any]
"""Yields an `_inbox_io.Script` (answered by its `_sql.Reply` list), an `_inbox_io.Queue` (no
answer) or an `_inbox_io.Piped` (answered by a libpq result per step)."""


_WRITTEN: Final = b"written"


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
        body = claim_body = text.split(" AS\n", 1)[1].strip()
        for number, kind in enumerate(_CLAIM_TYPES, start=1):
            body = body.replace(f"${number}", f"%(p{number})s::{kind}")
        self.pipelined_claim = body
        self.rewrite = _REWRITE.format(schema=schema)
        self.finish = _FINISH.format(schema=schema)
        # The libpq path (`_wire`): the claim's body, prepared by the protocol, binary.
        self.wire_claim = _wire.Wire.of(claim_body, "tt88tbt")
        self.wire_rewrite = _wire.Wire.of(self.rewrite, "tbt8t")
        self.wire_finish = _wire.Wire.of(self.finish, "tbitt8")
        # Sent with the COMMIT of a transaction the inbox owns: failing when they change no
        # row, so that the COMMIT, in the same round trip, does not commit the block alone.
        self.wire_guarded_rewrite = _wire.Wire.of(_guarded(self.rewrite), "tbt8t")
        self.wire_guarded_finish = _wire.Wire.of(_guarded(self.finish), "tbitt8")
        # Prepared together, the first time on a session; the UPDATEs of a store made with
        # ``prepare=False`` (behind a pooler) go unnamed (`Wired`), the claim is prepared.
        self.wires: tuple[_wire.Wire, ...] = (
            self.wire_claim,
            self.wire_rewrite,
            self.wire_finish,
            self.wire_guarded_rewrite,
            self.wire_guarded_finish,
        )
        if not store._prepare:
            self.wires = (self.wire_claim,)


class _Claim:
    """One claim's operations on one connection, as scripts (sync and async alike)."""

    __slots__ = (
        "_connection",
        "_op",
        "_own",
        "_reset",
        "_result",
        "_savepoint",
        "_sql",
        "_written",
    )

    def __init__(self, statements: _Statements, connection: Any, own: bool = False) -> None:
        self._sql = statements
        self._connection = connection
        self._own = own  # the inbox opens and ends the transaction (`Begin.own`)
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
        if kind is Commit:
            self._ended()
            yield _io.Piped([(b"COMMIT",)])
            return None
        if kind is Open:
            yield _io.Piped([(self._start(),)])
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
        if self._own:
            names = _wire.prepared_on(self._connection)
            if names is None:  # refused at bind: the encoding changed since
                raise ConfigurationError(_OWN_ENCODING)
            return (yield from self._begin_wired(op, params, names, depth, self._start()))
        pipelined = _io.pipelined(self._connection)
        names = None if pipelined else _wire.prepared_on(self._connection)
        if names is not None:
            begin = b""
            if not self._connection.pgconn.transaction_status:  # IDLE: psycopg would BEGIN
                start = getattr(self._connection, "_get_tx_start_command", None)
                begin = start() if start is not None else b""
            if begin or self._connection.pgconn.transaction_status:
                return (yield from self._begin_wired(op, params, names, depth, begin))
        prepared = _PREPARED.setdefault(self._connection, set())
        name = self._sql.claim
        while True:
            script: _io.Script = [(f"SAVEPOINT {savepoint}", None)]
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

    def _begin_wired(
        self, op: Begin, params: tuple[Any, ...], names: set[bytes], depth: int, begin: bytes
    ) -> _Flow:
        """`_begin` on the libpq path: the savepoint, the claim and the block's savepoint,
        pipelined, binary. The first time on a session, the claim and the two UPDATEs that
        may follow it are prepared in the same round trip. A connection that has not begun
        the transaction psycopg would begin (not in autocommit, idle: Django's ``atomic``)
        begins it with *begin* (psycopg's BEGIN statement for it), in the same round trip."""
        wire = self._sql.wire_claim
        values = _wire.encoded(wire, params)
        savepoint, own = self._savepoint, self._own
        while True:
            steps = _io.Piped([(begin,)] if begin else [])
            if not own:  # an owned transaction is the claim's savepoint: ROLLBACK undoes it
                steps.append((f"SAVEPOINT {savepoint}".encode(),))
                begin = b""  # begun, whatever the claim's fate
            prepares: list[_wire.Wire] = []
            if wire.name not in names:
                prepares = [w for w in self._sql.wires if w.name not in names]
                steps.extend((each, None) for each in prepares)
            steps.append((wire, values))
            if op.nested:
                steps.append((f"SAVEPOINT {savepoint}_block".encode(),))
            try:
                results = yield steps
            except Exception as exc:
                translated = _translated(exc)
                if translated is None:
                    if own:  # the inbox's transaction: ended, if the connection still can
                        with contextlib.suppress(Exception):
                            yield self._rollback()
                    raise  # the caller's driver error, in the caller's transaction
                yield self._rollback()  # the claim's failure undone; the transaction usable
                if type(translated) is _Unprepared and wire.name in names:
                    # The session was reset: prepare them all again, in this round trip (the
                    # UPDATEs could not be, later: in the caller's transaction, their failure
                    # would abort it).
                    names.difference_update(each.name for each in self._sql.wires)
                    continue
                if type(translated) is _Prepared and prepares:
                    # One of them is (which, the error does not say): a statement still not
                    # prepared is prepared again when its execution finds it missing.
                    names.update(each.name for each in prepares)
                    continue
                if type(translated) is _Busy:
                    names.update(each.name for each in prepares)  # only the claim failed
                    return InProgress(retry_after=_BUSY_HINT)
                if isinstance(translated, (_Unprepared, _Prepared)):
                    raise  # not the session's state this driver knew: a driver error
                raise translated from exc
            except BaseException:  # cancelled, interrupted: the inbox's transaction ended
                if own:
                    with contextlib.suppress(Exception):
                        yield self._rollback()
                raise
            if prepares:
                names.update(each.name for each in prepares)
            break
        result = results[len(steps) - 2 if op.nested else -1]
        if result.ntuples == 1 and result.get_value(0, 0) == _WRITTEN:
            self._written, self._result = True, op.result
            answer: ClaimResult | None = Acquired(1, attempt=1)
        else:
            answer = _wire.claim_answer(op.key, result, decided=True)
        if type(answer) is Acquired:
            self._reset = _DEPTH.set(depth + 1)
        elif own and type(answer) is not Replay:  # no block runs: the transaction ends here
            yield self._rollback()
        return answer

    def _start(self) -> bytes:
        """The BEGIN psycopg would send (with the connection's isolation level, read-only,
        deferrable), for a transaction the inbox owns."""
        start = getattr(self._connection, "_get_tx_start_command", None)
        return start() if start is not None else b"BEGIN"

    def _ended(self) -> None:
        """Refuse to end an owned transaction that the block ended itself."""
        if not self._connection.pgconn.transaction_status:  # IDLE
            raise OncelyError(
                "the inbox's transaction was ended inside its block (a commit or rollback "
                "there): the block's writes and the record no longer go together"
            )

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
        if op.end:
            return (yield from self._finish_owned(op))
        if self._written and not op.undo_block and op.result == self._result:
            return None  # the claim wrote this very outcome
        store = self._sql.store
        script: _io.Script = []
        if op.undo_block:
            script.append((f"ROLLBACK TO SAVEPOINT {self._savepoint}_block", None))
        stored, status, result = store._stored_key(op.key), op.status.value, bytes(op.result)
        if self._written:
            script.append((self._sql.rewrite, (status, result, stored, op.token, self._op)))
        else:
            ttl = timedelta(milliseconds=_sql.ms(op.ttl))
            params = (status, result, ttl, self._op, stored, op.token)
            script.append((self._sql.finish, params))
        sent: Any = script
        pipelined = _io.pipelined(self._connection)
        if not pipelined and len(script) == 1 and self._connection.pgconn.transaction_status:
            names = _wire.prepared_on(self._connection)
            if names is not None:  # the libpq path: prepared once, binary
                wire = self._sql.wire_rewrite if self._written else self._sql.wire_finish
                sent = _io.Wired(wire, script[0][1], names, store)
        if pipelined:
            # Queued in the caller's pipeline, sent with its next statements or its commit: no
            # round trip of its own. A record changed under the block fails the statement,
            # and with it the caller's transaction, at the caller's next sync.
            sql, params = script[-1]
            script[-1] = (_guarded(sql), params)
            yield _io.Queue(script)
            return None
        try:
            replies = yield sent
        except Exception:
            with contextlib.suppress(Exception):  # give the caller its transaction back
                yield self._rollback()
            raise
        if replies[-1].rowcount == 1:
            return None
        yield self._rollback()  # the record changed under the block: undo the block too
        return LeaseLost()

    def _finish_owned(self, op: Finish) -> _Flow:
        """`_finish` in a transaction the inbox owns: the outcome's UPDATE (guarded: failing
        when it changes no row) and the COMMIT in one round trip; just the COMMIT when the
        claim wrote this very outcome. A guard that fails rolls back: `LeaseLost`."""
        self._ended()
        steps = _io.Piped()
        if op.undo_block:
            steps.append((f"ROLLBACK TO SAVEPOINT {self._savepoint}_block".encode(),))
        if not self._written or op.undo_block or op.result != self._result:
            stored, status, result = self._sql.store._stored_key(op.key), op.status.value, op.result
            if self._written:
                wire = self._sql.wire_guarded_rewrite
                params: tuple[Any, ...] = (status, result, stored, op.token, self._op)
            else:
                ttl = timedelta(milliseconds=_sql.ms(op.ttl))
                wire = self._sql.wire_guarded_finish
                params = (status, result, ttl, self._op, stored, op.token)
            values = _wire.encoded(wire, params)
            prepared = self._sql.store._prepare
            steps.append((wire, values) if prepared else (wire, values, False))
        steps.append((b"COMMIT",))
        try:
            yield steps
        except BaseException as exc:  # also cancelled or interrupted: never left open
            pgconn = self._connection.pgconn
            if pgconn.transaction_status in (_INTRANS, _INERROR):  # not ended by the COMMIT
                with contextlib.suppress(Exception):
                    yield self._rollback()
            if _guard_failed(exc):
                return LeaseLost()
            raise  # the COMMIT failed (or the connection): nothing done
        return None

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
        pgconn = self._connection.pgconn
        idle = pgconn.pipeline_status or not pgconn.transaction_status  # psycopg would BEGIN
        names = None if idle else _wire.prepared_on(self._connection)
        script: Any = [(self._sql.finish, params)]
        if names is not None:
            script = _io.Wired(self._sql.wire_finish, params, names, store)
        replies = yield script
        return None if replies[0].rowcount == 1 else LeaseLost()

    def _rollback(self) -> Any:
        if self._own:
            return _io.Piped([(b"ROLLBACK",)])
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

    def bind(self, connection: Any, own: bool = False) -> Callable[[Op], Any]:
        """See `oncely._inbox_store.InboxDriver.bind`."""
        if own:
            raw = _idle(connection, psycopg.Connection)
        else:
            raw = _txn.raw_connection(connection, _USER)
            _txn.check_psycopg_transaction(raw, _USER)
        claim, run = _Claim(self._statements, raw, own), functools.partial(_io.run, raw)
        return lambda op: drive(claim.flow(op), run)

    async def abind(self, connection: Any, own: bool = False) -> Callable[[Op], Awaitable[Any]]:
        """See `oncely._inbox_store.InboxDriver.abind`."""
        if own:
            raw = _idle(connection, psycopg.AsyncConnection)
        else:
            raw = await _txn.araw_connection(connection)
            _txn.check_psycopg_transaction(raw, _USER)
        claim, run = _Claim(self._statements, raw, own), functools.partial(_io.arun, raw)

        async def perform(op: Op) -> Any:
            return await adrive(claim.flow(op), run)

        return perform


_OWN_ENCODING = (
    "Inbox.transaction needs a connection whose client encoding is UTF-8: with another, open "
    "the transaction yourself and use Inbox.claim in it"
)
_INTRANS: Final = 2
_INERROR: Final = 3
"""libpq's transaction statuses (``psycopg.pq.TransactionStatus``), as integers."""


def _idle(connection: Any, kind: type[Any]) -> Any:
    """*connection*, a psycopg connection of *kind* in no transaction and not in pipeline
    mode, for a transaction the inbox owns; or `ConfigurationError` saying to use ``claim``."""
    hint = "open the transaction yourself and use Inbox.claim in it"
    if not isinstance(connection, kind):
        raise ConfigurationError(
            f"Inbox.transaction opens the transaction itself on a psycopg {kind.__name__}, "
            f"not a {type(connection).__name__}: {hint}"
        )
    pgconn = connection.pgconn
    if pgconn.transaction_status:  # not IDLE
        raise ConfigurationError(f"the connection is in a transaction already: {hint}")
    if pgconn.pipeline_status:
        raise ConfigurationError(f"the connection is in pipeline mode: {hint}")
    if _wire.prepared_on(connection) is None:
        raise ConfigurationError(_OWN_ENCODING)
    return connection


def _guard_failed(exc: BaseException) -> bool:
    """Whether *exc* is a guarded UPDATE's (`_guarded`) failure: its record was changed."""
    return getattr(exc, "sqlstate", None) == "22P02" and "oncely: the inbox record" in str(exc)
