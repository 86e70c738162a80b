"""Transactional inbox: an operation's record written in the caller's own database transaction.

When an operation's effect is writes to the database that holds its idempotency record, the
record can be written in the same transaction as the effect. Then a crash at any instant leaves
either both or neither: no lease window, no ambiguous commit.

.. code-block:: python

    inbox = oncely.Inbox(store)          # a PostgreSQL or SQLite store: the same table

    with connection.transaction():       # the application's own transaction (psycopg)
        with inbox.claim(connection, order_id, scope="orders.create", fingerprint=body) as entry:
            if entry.replayed:
                return entry.result      # committed by an earlier transaction
            connection.execute("INSERT INTO orders ...")
            entry.complete({"order_id": order_id})

How it behaves, seen from one transaction:

* The first transaction to **commit** a key wins. The claim is a row written in the caller's
  transaction, invisible to others until it commits, already completed by then.
* A concurrent duplicate **waits** (up to ``wait_timeout``; ``on_conflict="raise"`` answers at
  once) for the first to finish: if it committed, the duplicate replays its result; if it
  rolled back, the duplicate runs.
* The same key with another fingerprint raises `FingerprintMismatchError`.
* A key claimed with a lease elsewhere (`oncely.idempotent`, the HTTP middleware, a consumer)
  is respected: while that lease is live the inbox answers `InProgressError`.
* The block's own writes and the record go together: if the block raises, both are rolled back
  to a savepoint taken at the claim, and the exception propagates. oncely never commits or rolls
  back the caller's transaction itself.

Connections: psycopg 3 (`psycopg.Connection`; `psycopg.AsyncConnection` with `aclaim`), the
standard library's `sqlite3.Connection` (in a transaction that holds the write lock: ``BEGIN
IMMEDIATE``, or after a write), SQLAlchemy ``Session``/``Connection`` (and their async forms
with `aclaim`) over those drivers, and Django's ``django.db.connection`` inside
``transaction.atomic()``.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType
from typing import Any, Literal

from oncely import _execution, _txn
from oncely._core import codec as _codec
from oncely._core.codec import Codec, JSONCodec
from oncely._core.fingerprint import digest
from oncely._core.flow import Flow, adrive, drive
from oncely._core.keys import scope_key, validate_key
from oncely._core.policy import UNSET, Duration, Policy, _Unset, derive
from oncely._core.records import Acquired, ClaimResult, InProgress, LeaseLost, Mismatch, Replay
from oncely.errors import (
    ConfigurationError,
    FingerprintMismatchError,
    InProgressError,
    LeaseLostError,
    OncelyError,
)

__all__ = ["AsyncInboxEntry", "Inbox", "InboxEntry"]

_SAVEPOINT = "oncely_inbox"
_USER = "the inbox"
_BUSY_HINT = timedelta(seconds=1)
"""`InProgressError.retry_after` when another transaction holds the key: a short hint."""


class Inbox:
    """Record idempotency keys in the caller's own transaction, next to its writes.

    Args:
        store: The `PostgresStore` or `SQLiteStore` whose table holds the records (the same
            database the caller's connection writes to). Records are shared with every other
            entry point using that store: one ``migrate()``, one CLI, one purge.
        policy: The base `Policy`; the keyword arguments below override single fields of it.
        ttl: How long a committed outcome is replayed.
        on_conflict: For a duplicate whose first transaction has not finished: ``"wait"``
            (the default here, bounded by ``wait_timeout``) then replay or run; or ``"raise"``
            `InProgressError` at once.
        wait_timeout: The bound on waiting.
        codec: Serialises the value given to `InboxEntry.complete` (JSON by default).

    Raises:
        ConfigurationError: The store keeps its records in no SQL database.

    .. versionadded:: 0.1.0
    """

    def __init__(
        self,
        store: Any,
        *,
        policy: Policy | None = None,
        ttl: Duration | _Unset = UNSET,
        on_conflict: Literal["raise", "wait"] = "wait",
        wait_timeout: Duration | _Unset = UNSET,
        codec: Codec | None = None,
    ) -> None:
        backend = getattr(store, "backend", None)
        if backend not in ("postgres", "sqlite"):
            raise ConfigurationError(
                f"the inbox writes records in the caller's SQL transaction: it needs a "
                f"PostgresStore or an SQLiteStore, not {type(store).__name__}"
            )
        self.store = store
        self.policy = derive(
            policy, ttl=ttl, on_conflict=on_conflict, wait_timeout=wait_timeout, heartbeat=False
        )
        self.codec: Codec = codec or JSONCodec()

    def claim(
        self, connection: Any, key: str, *, scope: str, fingerprint: Any = None
    ) -> InboxEntry:
        """Claim *key* (within *scope*) in *connection*'s open transaction: a ``with`` block.

        Args:
            connection: The caller's connection or session, inside its transaction.
            key: The idempotency key; validated before it touches the database.
            scope: The operation's name; the same key in two scopes names two operations.
            fingerprint: What the operation was asked to do (any canonicalisable value), or
                ``None`` to skip the check.
        """
        plan = self._plan(key, scope, fingerprint)
        return InboxEntry(self, plan, _sync_performer(self.store, connection))

    def aclaim(
        self, connection: Any, key: str, *, scope: str, fingerprint: Any = None
    ) -> AsyncInboxEntry:
        """`claim` for an async connection or session: an ``async with`` block."""
        plan = self._plan(key, scope, fingerprint)
        return AsyncInboxEntry(self, plan, _AsyncPerformer(self.store, connection))

    def _plan(self, key: str, scope: str, fingerprint: Any) -> _Plan:
        if not isinstance(scope, str) or not scope:
            raise ConfigurationError("the inbox needs a scope naming the operation")
        scoped = scope_key(scope, validate_key(key))
        return _Plan(scoped, "" if fingerprint is None else digest([fingerprint]))


@dataclass(frozen=True, slots=True)
class _Plan:
    key: str
    fingerprint: str


# -- the flow, once for sync and async ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Begin:
    """Take a savepoint and claim. An `Acquired` answer keeps the savepoint open; any other
    answer (`InProgress` also when the wait for another transaction timed out) drops it."""

    key: str
    fingerprint: str
    lease: timedelta
    ttl: timedelta
    wait: timedelta


@dataclass(frozen=True, slots=True)
class _Finish:
    """Complete the record in the transaction, then drop the savepoint; answers `LeaseLost`
    (after rolling back to the savepoint) or ``None``."""

    key: str
    token: int
    result: bytes
    ttl: timedelta


@dataclass(frozen=True, slots=True)
class _Rollback:
    """Undo everything since the savepoint (the claim and the block's writes), drop it."""


def _enter(inbox: Inbox, plan: _Plan) -> Flow[Acquired | Replay]:
    policy = inbox.policy
    deadline = time.monotonic() + policy.wait_timeout.total_seconds()
    while True:
        wait = timedelta(0)
        if policy.on_conflict == "wait":
            wait = timedelta(seconds=max(deadline - time.monotonic(), 0))
        answer: ClaimResult = yield _Begin(
            plan.key, plan.fingerprint, policy.lease, policy.ttl, wait
        )
        if isinstance(answer, (Acquired, Replay)):
            return answer
        if isinstance(answer, Mismatch):
            raise FingerprintMismatchError(plan.key)
        remaining = deadline - time.monotonic()
        if policy.on_conflict == "raise" or remaining <= 0:
            raise InProgressError(plan.key, retry_after=min(answer.retry_after, _BUSY_HINT))
        # A lease held elsewhere (a transaction is waited for inside the claim itself).
        yield _execution.Sleep(min(answer.retry_after.total_seconds(), 0.05, remaining))


def _exit(
    inbox: Inbox, plan: _Plan, token: int, value: Any, error: BaseException | None
) -> Flow[None]:
    if error is not None:
        yield _Rollback()
        return
    try:
        payload = _codec.encode_value(inbox.codec.encode(value))
    except Exception as exc:  # ran, but cannot be stored: replays fail loudly, never re-run
        payload = _codec.encode_unavailable(f"{type(exc).__name__}: {exc}")
    answer = yield _Finish(plan.key, token, payload, inbox.policy.ttl)
    if isinstance(answer, LeaseLost):  # the row is ours until commit: only a foreign writer
        raise LeaseLostError(plan.key, token=token)


class _EntryState:
    """What the sync and async entries share: the plan, the claim's answer, the result."""

    def __init__(self, inbox: Inbox, plan: _Plan) -> None:
        self._inbox = inbox
        self._plan = plan
        self._acquired: Acquired | None = None
        self._replay: Replay | None = None
        self._value: Any = None

    @property
    def key(self) -> str:
        """The scoped key."""
        return self._plan.key

    @property
    def replayed(self) -> bool:
        """True when an earlier transaction committed this operation: use `result`."""
        return self._replay is not None

    @property
    def result(self) -> Any:
        """The committed outcome of the earlier transaction.

        Raises:
            OncelyError: This entry did not replay (it holds the claim).
        """
        if self._replay is None:
            raise OncelyError("this entry holds the claim: there is no stored result to replay")
        return _execution.replay(self._replay, self._inbox.codec, Any, self._inbox.policy)

    @property
    def token(self) -> int:
        """The fencing token of the claim."""
        if self._acquired is None:
            raise OncelyError("this entry replayed: it holds no claim")
        return self._acquired.token

    def complete(self, value: Any = None) -> None:
        """Set the outcome written when the block ends (``None`` if never called)."""
        if self._acquired is None:
            raise OncelyError("this entry replayed: there is nothing to complete")
        self._value = value

    def _entered(self, outcome: Acquired | Replay) -> None:
        if isinstance(outcome, Replay):
            self._replay = outcome
        else:
            self._acquired = outcome

    def _exit_flow(self, error: BaseException | None) -> Flow[None] | None:
        if self._acquired is None:
            return None  # replayed: nothing was written, the savepoint is gone
        return _exit(self._inbox, self._plan, self._acquired.token, self._value, error)


class InboxEntry(_EntryState):
    """One claim in the caller's transaction (from `Inbox.claim`): a ``with`` block.

    .. versionadded:: 0.1.0
    """

    def __init__(self, inbox: Inbox, plan: _Plan, perform: Callable[[Any], Any]) -> None:
        super().__init__(inbox, plan)
        self._perform = perform

    def __enter__(self) -> InboxEntry:
        self._entered(drive(_enter(self._inbox, self._plan), self._perform))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        flow = self._exit_flow(exc)
        if flow is not None:
            drive(flow, self._perform)


class AsyncInboxEntry(_EntryState):
    """One claim in the caller's async transaction (from `Inbox.aclaim`): ``async with``.

    .. versionadded:: 0.1.0
    """

    def __init__(self, inbox: Inbox, plan: _Plan, performer: _AsyncPerformer) -> None:
        super().__init__(inbox, plan)
        self._performer = performer

    async def __aenter__(self) -> AsyncInboxEntry:
        perform = await self._performer.bind()
        self._entered(await adrive(_enter(self._inbox, self._plan), perform))
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        flow = self._exit_flow(exc)
        if flow is not None:
            await adrive(flow, await self._performer.bind())


# -- drivers: what each operation is on each kind of connection ---------------------------------


def _sync_performer(store: Any, connection: Any) -> Callable[[Any], Any]:
    raw = _txn.raw_connection(connection, _USER)
    if store.backend == "postgres":
        return _PostgresPerformer(store, raw).perform
    return _SQLitePerformer(store, raw).perform


class _PostgresStatements:
    """The statements of each operation on PostgreSQL, for the sync and the async performer."""

    def __init__(self, store: Any) -> None:
        from oncely.stores.postgres import _sql

        self.sql = _sql
        self.store = store
        self.savepoint = _sql.Statement(f"SAVEPOINT {_SAVEPOINT}", None)
        self.release = _sql.Statement(f"RELEASE SAVEPOINT {_SAVEPOINT}", None)
        self.rollback = _sql.Statement(
            f"ROLLBACK TO SAVEPOINT {_SAVEPOINT}; RELEASE SAVEPOINT {_SAVEPOINT}", None
        )

    def wait(self, op: _Begin) -> Any:
        # SET LOCAL inside the savepoint: undone by a rollback to it; restored after the claim.
        wait_ms = max(int(op.wait.total_seconds() * 1000), 1)
        return self.sql.Statement(
            "SELECT current_setting('lock_timeout'), set_config('lock_timeout', %(ms)s, true)",
            {"ms": str(wait_ms)},
            op.key,
        )

    def restore(self, previous: str) -> Any:
        return self.sql.Statement(
            "SELECT set_config('lock_timeout', %(previous)s, true)", {"previous": previous}
        )

    def claim(self, op: _Begin) -> Flow[ClaimResult]:
        store = self.store
        stored = store._stored_key(op.key)
        return self.sql.claim(store._queries, stored, op.key, op.fingerprint, op.lease, op.ttl)

    def finish(self, op: _Finish) -> Flow[LeaseLost | None]:
        from oncely._core.records import Status

        store = self.store
        stored = store._stored_key(op.key)
        return self.sql.finish(
            store._queries, stored, op.key, op.token, Status.COMPLETED, op.result, op.ttl
        )


def _is_lock_timeout(exc: BaseException) -> bool:
    return getattr(exc, "sqlstate", None) == "55P03"  # lock_not_available


class _PostgresPerformer:
    def __init__(self, store: Any, connection: Any) -> None:
        from psycopg.rows import tuple_row

        _txn.check_psycopg_transaction(connection, _USER)
        self._statements = _PostgresStatements(store)
        self._cursor = connection.cursor(row_factory=tuple_row)

    def _run(self, statement: Any) -> Any:
        cursor = self._cursor
        cursor.execute(statement.sql, statement.params)
        rows = cursor.fetchall() if cursor.description is not None else []
        return self._statements.sql.Reply(rows, cursor.rowcount)

    def perform(self, op: Any) -> Any:
        statements, run = self._statements, self._run
        kind = type(op)
        if kind is _Begin:
            run(statements.savepoint)
            previous = run(statements.wait(op)).rows[0][0]
            try:
                answer = drive(statements.claim(op), run)
            except Exception as exc:
                if not _is_lock_timeout(exc):
                    raise  # the caller's driver error, in the caller's transaction
                run(statements.rollback)  # another transaction still holds the key
                return InProgress(retry_after=_BUSY_HINT)
            run(statements.restore(previous))
            if not isinstance(answer, Acquired):
                run(statements.release)  # nothing was written
            return answer
        if kind is _Finish:
            finished = drive(statements.finish(op), run)
            run(statements.rollback if isinstance(finished, LeaseLost) else statements.release)
            return finished
        if kind is _Rollback:
            return run(statements.rollback)
        if kind is _execution.Sleep:
            return time.sleep(op.seconds)
        raise TypeError(f"cannot perform {op!r}")


class _AsyncPerformer:
    """Async psycopg, directly or behind SQLAlchemy's ``AsyncSession`` / ``AsyncConnection``."""

    def __init__(self, store: Any, connection: Any) -> None:
        if store.backend != "postgres":
            raise ConfigurationError("aclaim needs PostgreSQL (async psycopg): SQLite is sync")
        self._statements = _PostgresStatements(store)
        self._connection = connection
        self._cursor: Any = None

    async def bind(self) -> Callable[[Any], Awaitable[Any]]:
        """Find the driver connection (an await for SQLAlchemy); return the performer."""
        if self._cursor is None:
            from psycopg.rows import tuple_row

            connection = await _txn.araw_connection(self._connection)
            _txn.check_psycopg_transaction(connection, _USER)
            self._cursor = connection.cursor(row_factory=tuple_row)
        return self.perform

    async def _run(self, statement: Any) -> Any:
        cursor = self._cursor
        await cursor.execute(statement.sql, statement.params)
        rows = await cursor.fetchall() if cursor.description is not None else []
        return self._statements.sql.Reply(rows, cursor.rowcount)

    async def perform(self, op: Any) -> Any:
        statements, run = self._statements, self._run
        kind = type(op)
        if kind is _Begin:
            await run(statements.savepoint)
            previous = (await run(statements.wait(op))).rows[0][0]
            try:
                answer = await adrive(statements.claim(op), run)
            except Exception as exc:
                if not _is_lock_timeout(exc):
                    raise
                await run(statements.rollback)
                return InProgress(retry_after=_BUSY_HINT)
            await run(statements.restore(previous))
            if not isinstance(answer, Acquired):
                await run(statements.release)
            return answer
        if kind is _Finish:
            finished = await adrive(statements.finish(op), run)
            await run(
                statements.rollback if isinstance(finished, LeaseLost) else statements.release
            )
            return finished
        if kind is _Rollback:
            return await run(statements.rollback)
        if kind is _execution.Sleep:
            return await asyncio.sleep(op.seconds)
        raise TypeError(f"cannot perform {op!r}")


class _SQLitePerformer:
    def __init__(self, store: Any, connection: Any) -> None:
        _txn.check_sqlite_transaction(connection, _USER)
        self._store = store
        self._connection = connection

    def perform(self, op: Any) -> Any:
        from oncely.stores._machine import _claim_step, _complete_step, _ms

        connection, store = self._connection, self._store
        kind = type(op)
        if kind is _Begin:
            stored = store._stored_key(op.key)
            step = _claim_step(stored, op.fingerprint, _ms(op.lease), _ms(op.ttl))
            connection.execute(f"SAVEPOINT {_SAVEPOINT}")
            with store._translate_errors(op.key):
                # SQLite has one writer at a time: the caller's transaction holds the write
                # lock, so the record read here cannot change before this transaction ends.
                answer = store._apply(connection, stored, step, store.clock.now_ms())
            if not isinstance(answer, Acquired):
                connection.execute(f"RELEASE SAVEPOINT {_SAVEPOINT}")
            return store._unscoped(answer)
        if kind is _Finish:
            stored = store._stored_key(op.key)
            finish = _complete_step(op.token, op.result, _ms(op.ttl))
            with store._translate_errors(op.key):
                finished = store._apply(connection, stored, finish, store.clock.now_ms())
            if isinstance(finished, LeaseLost):
                connection.execute(f"ROLLBACK TO SAVEPOINT {_SAVEPOINT}")
            connection.execute(f"RELEASE SAVEPOINT {_SAVEPOINT}")
            return finished
        if kind is _Rollback:
            connection.execute(f"ROLLBACK TO SAVEPOINT {_SAVEPOINT}")
            connection.execute(f"RELEASE SAVEPOINT {_SAVEPOINT}")
            return None
        if kind is _execution.Sleep:
            time.sleep(op.seconds)
            return None
        raise TypeError(f"cannot perform {op!r}")
