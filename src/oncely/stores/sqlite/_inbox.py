"""The transactional inbox on SQLite: `oncely._inbox_store.InboxDriver` over ``sqlite3``.

The caller's transaction holds SQLite's write lock (``BEGIN IMMEDIATE``, or after a write), so
the record read at the claim cannot change before that transaction ends: the claim is the
store's own state-machine step, applied on the caller's connection after a savepoint. sqlite3's
errors become oncely's in the store's one translation (``_translate_errors``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

from oncely import _txn
from oncely._core import machine
from oncely._core.records import Acquired, LeaseLost, Status
from oncely._inbox_store import Begin, Finish, Op, Rollback, Settle
from oncely.errors import ConfigurationError
from oncely.stores._machine import _claim_step, _keeping_op, _ms

__all__ = ["InboxDriver"]

_SAVEPOINT = "oncely_inbox"
_BLOCK_SAVEPOINT = "oncely_inbox_block"
_USER = "the inbox"


class InboxDriver:
    """The inbox on an `SQLiteStore`'s database, through the caller's ``sqlite3`` connection."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def bind(self, connection: Any) -> Callable[[Op], Any]:
        """See `oncely._inbox_store.InboxDriver.bind`."""
        raw = _txn.raw_connection(connection, _USER)
        _txn.check_sqlite_transaction(raw, _USER)
        return _Performer(self._store, raw).perform

    async def abind(self, connection: Any) -> Callable[[Op], Awaitable[Any]]:
        """SQLite has no async driver here."""
        raise ConfigurationError("aclaim needs PostgreSQL (async psycopg): SQLite is sync")


class _Performer:
    def __init__(self, store: Any, connection: Any) -> None:
        self._store = store
        self._connection = connection

    def perform(self, op: Op) -> Any:
        connection, store = self._connection, self._store
        if type(op) is Begin:
            stored = store._stored_key(op.key)
            step = _claim_step(stored, op.fingerprint, _ms(op.lease), _ms(op.ttl))
            connection.execute(f"SAVEPOINT {_SAVEPOINT}")
            with store._translate_errors(op.key):
                # SQLite has one writer at a time: the caller's transaction holds the write
                # lock, so the record read here cannot change before this transaction ends.
                answer = store._apply(connection, stored, step, store.clock.now_ms())
            if not isinstance(answer, Acquired):
                connection.execute(f"RELEASE SAVEPOINT {_SAVEPOINT}")
            elif op.nested:
                connection.execute(f"SAVEPOINT {_BLOCK_SAVEPOINT}")
            return store._unscoped(answer)
        if type(op) is Settle:
            return self._finish(op.key, op.token, machine.complete, op.result, op.ttl)
        if type(op) is Finish:
            if op.undo_block:
                connection.execute(f"ROLLBACK TO SAVEPOINT {_BLOCK_SAVEPOINT}")
            settle = machine.complete if op.status is Status.COMPLETED else machine.fail
            finished = self._finish(op.key, op.token, settle, op.result, op.ttl)
            if isinstance(finished, LeaseLost):
                connection.execute(f"ROLLBACK TO SAVEPOINT {_SAVEPOINT}")
            connection.execute(f"RELEASE SAVEPOINT {_SAVEPOINT}")
            return finished
        if type(op) is Rollback:
            connection.execute(f"ROLLBACK TO SAVEPOINT {_SAVEPOINT}")
            connection.execute(f"RELEASE SAVEPOINT {_SAVEPOINT}")
            return None
        raise TypeError(f"cannot perform {op!r}")

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
