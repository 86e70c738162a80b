"""The transactional inbox on SQLite: `oncely._inbox_store.InboxDriver` over ``sqlite3``.

The caller's transaction holds SQLite's write lock (``BEGIN IMMEDIATE``, or after a write), so
the record read at the claim cannot change before that transaction ends: the claim is the
store's own state-machine step, applied on the caller's connection after a savepoint. sqlite3's
errors become oncely's in the store's one translation (``_translate_errors``).

A transaction the inbox owns (`Inbox.transaction`) is ``BEGIN IMMEDIATE`` (waiting for the write
lock as the connection's ``timeout`` says) and the claim, with no savepoint before it: ROLLBACK
undoes it; the outcome is written, then COMMIT.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

from oncely import _txn
from oncely._core import machine
from oncely._core.records import Acquired, LeaseLost, Replay, Status
from oncely._inbox_store import Begin, Commit, Finish, Op, Open, Rollback, Settle
from oncely.errors import ConfigurationError, OncelyError
from oncely.stores._machine import _claim_step, _keeping_op, _ms

__all__ = ["InboxDriver"]

_SAVEPOINT = "oncely_inbox"
_BLOCK_SAVEPOINT = "oncely_inbox_block"
_USER = "the inbox"


class InboxDriver:
    """The inbox on an `SQLiteStore`'s database, through the caller's ``sqlite3`` connection."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def bind(self, connection: Any, own: bool = False) -> Callable[[Op], Any]:
        """See `oncely._inbox_store.InboxDriver.bind`."""
        if not own:
            raw = _txn.raw_connection(connection, _USER)
            _txn.check_sqlite_transaction(raw, _USER)
            return _Performer(self._store, raw).perform
        hint = "open the transaction yourself and use Inbox.claim in it"
        if not isinstance(connection, sqlite3.Connection):
            raise ConfigurationError(
                f"Inbox.transaction opens the transaction itself on a sqlite3 Connection, not "
                f"a {type(connection).__name__}: {hint}"
            )
        if connection.in_transaction:
            raise ConfigurationError(f"the connection is in a transaction already: {hint}")
        return _Owner(self._store, connection).perform

    async def abind(self, connection: Any, own: bool = False) -> Callable[[Op], Awaitable[Any]]:
        """SQLite has no async driver here."""
        raise ConfigurationError("aclaim needs PostgreSQL (async psycopg): SQLite is sync")


class _Performer:
    def __init__(self, store: Any, connection: Any) -> None:
        self._store = store
        self._connection = connection

    def perform(self, op: Op) -> Any:
        connection = self._connection
        if type(op) is Begin:
            connection.execute(f"SAVEPOINT {_SAVEPOINT}")
            answer = self._claim(op)
            if not isinstance(answer, Acquired):
                connection.execute(f"RELEASE SAVEPOINT {_SAVEPOINT}")
            elif op.nested:
                connection.execute(f"SAVEPOINT {_BLOCK_SAVEPOINT}")
            return answer
        if type(op) is Settle:
            return self._finish(op.key, op.token, machine.complete, op.result, op.ttl)
        if type(op) is Finish:
            if op.undo_block:
                connection.execute(f"ROLLBACK TO SAVEPOINT {_BLOCK_SAVEPOINT}")
            finished = self._outcome(op)
            if isinstance(finished, LeaseLost):
                connection.execute(f"ROLLBACK TO SAVEPOINT {_SAVEPOINT}")
            connection.execute(f"RELEASE SAVEPOINT {_SAVEPOINT}")
            return finished
        if type(op) is Rollback:
            connection.execute(f"ROLLBACK TO SAVEPOINT {_SAVEPOINT}")
            connection.execute(f"RELEASE SAVEPOINT {_SAVEPOINT}")
            return None
        raise TypeError(f"cannot perform {op!r}")

    def _claim(self, op: Begin) -> Any:
        store, connection = self._store, self._connection
        stored = store._stored_key(op.key)
        step = _claim_step(stored, op.fingerprint, _ms(op.lease), _ms(op.ttl))
        with store._translate_errors(op.key):
            # SQLite has one writer at a time: the caller's transaction holds the write
            # lock, so the record read here cannot change before this transaction ends.
            return store._unscoped(store._apply(connection, stored, step, store.clock.now_ms()))

    def _outcome(self, op: Finish) -> Any:
        settle = machine.complete if op.status is Status.COMPLETED else machine.fail
        return self._finish(op.key, op.token, settle, op.result, op.ttl)

    def _finish(
        self, key: str, token: int, settle: Callable[..., Any], result: bytes, ttl: timedelta
    ) -> Any:
        """Settle *key*'s record by *token* in the caller's transaction (the write lock held)."""
        store, payload, ttl_ms = self._store, bytes(result), _ms(ttl)

        def finish(record: Any, now_ms: int) -> Any:
            return settle(record, token, payload, now_ms=now_ms, ttl_ms=ttl_ms)

        with store._translate_errors(key):
            return store._apply(
                self._connection, store._stored_key(key), _keeping_op(finish), store.clock.now_ms()
            )


class _Owner(_Performer):
    """The operations of a transaction the inbox owns (`Begin.own`): no claim savepoint."""

    def perform(self, op: Op) -> Any:
        connection = self._connection
        kind = type(op)
        if kind is Begin:
            connection.execute("BEGIN IMMEDIATE")
            try:
                answer = self._claim(op)  # type: ignore[arg-type]
            except BaseException:
                self._rollback()
                raise
            if isinstance(answer, Acquired):
                if op.nested:  # type: ignore[union-attr]
                    connection.execute(f"SAVEPOINT {_BLOCK_SAVEPOINT}")
            elif not isinstance(answer, Replay):  # no block runs: the transaction ends here
                connection.execute("ROLLBACK")
            return answer
        if kind is Finish:
            self._ended()
            if op.undo_block:  # type: ignore[union-attr]
                connection.execute(f"ROLLBACK TO SAVEPOINT {_BLOCK_SAVEPOINT}")
            try:
                finished = self._outcome(op)  # type: ignore[arg-type]
                if isinstance(finished, LeaseLost):
                    connection.execute("ROLLBACK")
                else:
                    self._commit()
            except BaseException:
                self._rollback()
                raise
            return finished
        if kind is Rollback:
            self._rollback()
            return None
        if kind is Commit:
            self._ended()
            self._commit()
            return None
        if kind is Open:
            connection.execute("BEGIN IMMEDIATE")
            return None
        return super().perform(op)  # Settle

    def _commit(self) -> None:
        """COMMIT; one that fails (a deferred constraint) leaves SQLite's transaction open:
        rolled back, the error raised."""
        try:
            self._connection.execute("COMMIT")
        except BaseException:
            self._rollback()
            raise

    def _rollback(self) -> None:
        if self._connection.in_transaction:
            self._connection.execute("ROLLBACK")

    def _ended(self) -> None:
        if not self._connection.in_transaction:
            raise OncelyError(
                "the inbox's transaction was ended inside its block (a commit or rollback "
                "there): the block's writes and the record no longer go together"
            )
