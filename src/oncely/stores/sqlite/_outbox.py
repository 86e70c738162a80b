"""The outbox on SQLite: its statements, run in a thread of the relay's own.

The `oncely.outbox._store.OutboxBackend` of an `SQLiteStore`. Its statements keep each key's
order as PostgreSQL's do (`oncely.stores.postgres._outbox` explains how); the single write lock,
held from a transaction's first write to its commit, numbers each key's events in commit order.
As a claim cannot hold the write lock while the relay publishes, a claim is a mark instead
(``claimed_until_ms``), taken in one write transaction and treated like a lock until it
passes. sqlite3's errors become oncely's in the store's transactions (`_write`, `_read`), the
one boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, Final, TypeVar

from oncely import _txn
from oncely.outbox._event import OutboxEvent
from oncely.outbox._store import (
    OPERATOR_ERROR,
    Change,
    ClaimedBatch,
    EventState,
    NewEvent,
    Settlement,
    StateError,
    event_from_row,
    iso_ms,
    ms,
)

__all__ = ["SQLiteOutbox"]

T = TypeVar("T")

_USER: Final = "the outbox"
_PURGE_BATCH: Final = 1000

_EVENT: Final = (
    "o.id, o.message_id, o.destination, o.payload, o.headers, o.ordering_key, o.attempts"
)
"""The columns an `OutboxEvent` is made of, in its field order."""

SQLITE_NEXT_SEQ: Final = """
INSERT INTO oncely_outbox_keys (ordering_key, seq) VALUES (?, 1)
ON CONFLICT (ordering_key) DO UPDATE SET seq = seq + 1
RETURNING seq
"""
"""Parameters: ordering_key. One row: the key's next seq."""

SQLITE_ADD: Final = """
INSERT INTO oncely_outbox (message_id, destination, ordering_key, seq, payload, headers,
                           created_at_ms, next_attempt_at_ms)
VALUES (?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (message_id) DO NOTHING
RETURNING id
"""
"""Parameters: message_id, destination, ordering_key, seq, payload, headers (JSON text), now_ms
twice. One row (the new id), or none when the message id is taken already."""

SQLITE_HEADS: Final = f"""
SELECT {_EVENT}
  FROM oncely_outbox AS o
 WHERE o.published_at_ms IS NULL AND o.dead_at_ms IS NULL
   AND o.next_attempt_at_ms <= :now
   AND (o.claimed_until_ms IS NULL OR o.claimed_until_ms <= :now)
   AND NOT EXISTS (SELECT 1 FROM oncely_outbox AS p
                    WHERE p.ordering_key = o.ordering_key AND p.destination = o.destination
                      AND p.seq < o.seq
                      AND p.published_at_ms IS NULL AND p.dead_at_ms IS NULL)
 ORDER BY o.id
 LIMIT :limit
"""
"""`oncely.stores.postgres._outbox_sql.PG_HEADS` with claims for locks: a head claimed by a live
relay is skipped."""

SQLITE_FOLLOWERS: Final = f"""
SELECT {_EVENT}
  FROM oncely_outbox AS o
 WHERE o.ordering_key IN (SELECT json_extract(value, '$[0]') FROM json_each(:scopes))
   AND EXISTS (SELECT 1 FROM json_each(:scopes) AS s
                WHERE json_extract(s.value, '$[0]') = o.ordering_key
                  AND json_extract(s.value, '$[1]') = o.destination)
   AND o.published_at_ms IS NULL AND o.dead_at_ms IS NULL
   AND o.id NOT IN (SELECT value FROM json_each(:ids))
 ORDER BY o.id
 LIMIT :limit
"""
"""Parameters: scopes (a JSON array of [key, destination] pairs), ids (a JSON array), limit. See
`oncely.stores.postgres._outbox_sql.PG_FOLLOWERS`."""

SQLITE_CLAIM: Final = """
UPDATE oncely_outbox SET claimed_until_ms = :until WHERE id IN (SELECT value FROM json_each(:ids))
"""

SQLITE_PUBLISHED: Final = """
UPDATE oncely_outbox SET published_at_ms = ?, claimed_until_ms = NULL WHERE id = ?
"""

SQLITE_FAILED: Final = """
UPDATE oncely_outbox
   SET attempts = attempts + 1, last_error = ?, next_attempt_at_ms = ?, dead_at_ms = ?,
       claimed_until_ms = NULL
 WHERE id = ?
"""
"""Parameters: error, next_attempt_at_ms, dead_at_ms (or NULL), id."""

SQLITE_RELEASED: Final = """
UPDATE oncely_outbox SET claimed_until_ms = NULL, last_error = coalesce(?, last_error)
 WHERE id = ?
"""
"""Parameters: error (or NULL to keep the last one), id. Ends a claim without counting."""

SQLITE_PURGE: Final = """
DELETE FROM oncely_outbox
 WHERE id IN (SELECT id FROM oncely_outbox WHERE published_at_ms < ?
               ORDER BY published_at_ms LIMIT ?)
"""

SQLITE_PURGE_KEYS: Final = """
DELETE FROM oncely_outbox_keys
 WHERE ordering_key IN (
       SELECT c.ordering_key FROM oncely_outbox_keys AS c
        WHERE NOT EXISTS (SELECT 1 FROM oncely_outbox AS o
                           WHERE o.ordering_key = c.ordering_key
                             AND o.published_at_ms IS NULL AND o.dead_at_ms IS NULL)
        LIMIT ?)
"""

SQLITE_STATS: Final = """
SELECT coalesce(sum(published_at_ms IS NULL AND dead_at_ms IS NULL), 0),
       coalesce(sum(dead_at_ms IS NOT NULL), 0),
       coalesce(sum(published_at_ms IS NOT NULL), 0),
       min(CASE WHEN published_at_ms IS NULL AND dead_at_ms IS NULL THEN created_at_ms END)
  FROM oncely_outbox
"""

SQLITE_DUE: Final = """
UPDATE oncely_outbox SET next_attempt_at_ms = ?
 WHERE id = ? AND published_at_ms IS NULL AND dead_at_ms IS NULL
"""
"""Parameters: now_ms, id. See `oncely.stores.postgres._outbox_sql.PG_DUE`."""

SQLITE_DEAD_LETTER: Final = """
UPDATE oncely_outbox SET dead_at_ms = ?, last_error = ?
 WHERE id = ? AND published_at_ms IS NULL AND dead_at_ms IS NULL
"""
"""Parameters: now_ms, error, id. See `oncely.stores.postgres._outbox_sql.PG_DEAD_LETTER`."""

_COLUMNS: Final = (
    "id, message_id, destination, ordering_key, attempts, created_at_ms, next_attempt_at_ms, "
    "published_at_ms, dead_at_ms, last_error, claimed_until_ms"
)
"""The columns of an `EventState`, in its field order, and the claim."""


class SQLiteOutbox:
    """The outbox's statements on an `SQLiteStore`'s file (an `OutboxBackend`)."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self._executor: ThreadPoolExecutor | None = None

    @contextlib.contextmanager
    def _write(self) -> Iterator[Any]:
        """A write transaction on the store's connection of this thread; sqlite3's errors as
        the store's (a missing table is `SchemaMissingError`)."""
        store = self._store
        with store._translate_errors(_USER), store._transaction(_USER) as connection:
            yield connection

    async def _call(self, function: Callable[..., T], *args: Any) -> T:
        """Run *function* in the backend's own thread (SQLite is sync)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="oncely-outbox")
        return await asyncio.get_running_loop().run_in_executor(self._executor, function, *args)

    # -- the writer ----------------------------------------------------------------------------

    def add(self, connection: Any, event: NewEvent, *, notify: bool) -> bool:
        """Store *event* in *connection*'s transaction (see `OutboxBackend.add`)."""
        connection = _txn.raw_connection(connection, _USER)
        _txn.check_sqlite_transaction(connection, _USER)
        store = self._store
        with store._translate_errors(event.message_id):
            seq = None
            if event.ordering_key is not None:
                seq = connection.execute(SQLITE_NEXT_SEQ, (event.ordering_key,)).fetchone()[0]
            now_ms = store.clock.now_ms()
            row = connection.execute(
                SQLITE_ADD,
                (
                    event.message_id,
                    event.destination,
                    event.ordering_key,
                    seq,
                    event.payload,
                    event.headers,
                    now_ms,
                    now_ms,
                ),
            ).fetchone()
        return row is not None

    async def aadd(self, connection: Any, event: NewEvent, *, notify: bool) -> bool:
        """Refused: sqlite3 is sync."""
        from oncely.errors import ConfigurationError

        raise ConfigurationError("aadd needs PostgreSQL (async psycopg): SQLite is sync")

    # -- the relay -----------------------------------------------------------------------------

    def _claim(self, limit: int, hold_ms: int) -> list[OutboxEvent]:
        with self._write() as connection:
            now = self._store.clock.now_ms()
            rows = connection.execute(SQLITE_HEADS, {"now": now, "limit": limit}).fetchall()
            scopes = list(dict.fromkeys((row[5], row[2]) for row in rows if row[5] is not None))
            if scopes and len(rows) < limit:
                params = {
                    "scopes": json.dumps(scopes),
                    "ids": json.dumps([row[0] for row in rows]),
                    "limit": limit - len(rows),
                }
                rows += connection.execute(SQLITE_FOLLOWERS, params).fetchall()
            if rows:
                claim = {"until": now + hold_ms, "ids": json.dumps([row[0] for row in rows])}
                connection.execute(SQLITE_CLAIM, claim)
        rows.sort(key=lambda row: row[0])  # within a key, id order is commit order
        return [event_from_row(row) for row in rows]

    @contextlib.asynccontextmanager
    async def claim(self, limit: int, hold: timedelta) -> AsyncIterator[ClaimedBatch]:
        """Mark a batch claimed for *hold*; an unsettled batch is let go at the end."""
        batch = _Batch(self, await self._call(self._claim, limit, ms(hold)), ms(hold))
        try:
            yield batch
        finally:
            if not batch.settled and batch.events:  # cancelled, or the store failed: let go
                with contextlib.suppress(Exception):
                    await self._call(self._release, [event.id for event in batch.events])

    def _settle(self, settlement: Settlement) -> None:
        with self._write() as connection:
            now = self._store.clock.now_ms()
            connection.executemany(
                SQLITE_PUBLISHED, [(now, event_id) for event_id in settlement.published]
            )
            connection.executemany(
                SQLITE_FAILED,
                [
                    (f.error, now + ms(f.delay), now if f.dead else None, f.id)
                    for f in settlement.failed
                ],
            )
            connection.executemany(
                SQLITE_RELEASED,
                [(settlement.note, event_id) for event_id in settlement.untouched],
            )

    def _extend(self, ids: list[int], hold_ms: int) -> None:
        with self._write() as connection:
            until = self._store.clock.now_ms() + hold_ms
            connection.execute(SQLITE_CLAIM, {"until": until, "ids": json.dumps(ids)})

    def _release(self, ids: list[int]) -> None:
        with self._write() as connection:
            connection.executemany(SQLITE_RELEASED, [(None, event_id) for event_id in ids])

    async def listen(self, wake: asyncio.Event) -> asyncio.Task[None] | None:
        """``None``: SQLite has no notifications, the relay polls."""
        return None

    def _purge(self, retention: timedelta) -> int:
        purged: int = 0
        while True:
            with self._write() as connection:
                before = self._store.clock.now_ms() - ms(retention)
                count = connection.execute(SQLITE_PURGE, (before, _PURGE_BATCH)).rowcount
            purged += count
            if count < _PURGE_BATCH:
                break
        while True:
            with self._write() as connection:
                count = connection.execute(SQLITE_PURGE_KEYS, (_PURGE_BATCH,)).rowcount
            if count < _PURGE_BATCH:
                return purged

    async def purge(self, retention: timedelta) -> int:
        """Delete old published events, and the counters of keys with nothing pending."""
        return await self._call(self._purge, retention)

    def _stats(self) -> dict[str, Any]:
        store = self._store
        with store._guarded(""), store._translate_errors(_USER):
            row = store._connection().execute(SQLITE_STATS).fetchone()
        pending, dead, published, oldest = row
        return {
            "pending": pending,
            "dead": dead,
            "published": published,
            "oldest_pending": None if oldest is None else iso_ms(oldest),
        }

    async def stats(self) -> dict[str, Any]:
        """The outbox's counts and its oldest pending event's time."""
        return await self._call(self._stats)

    async def aclose(self) -> None:
        """Stop the backend's thread (its connection is the store's, closed with it)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None

    # -- the operators' verbs ------------------------------------------------------------------

    def dead_letters(self, limit: int) -> list[EventState]:
        """The dead-lettered events, oldest first."""
        sql = f"SELECT {_COLUMNS} FROM oncely_outbox WHERE dead_at_ms IS NOT NULL"
        with self._write() as connection:
            rows = connection.execute(f"{sql} ORDER BY id LIMIT ?", (limit,)).fetchall()
        return [_state(row) for row in rows]

    def transition(
        self, event_id: int, decide: Callable[[EventState | None], Change]
    ) -> EventState:
        """One write transaction: read, decide, write. A relay's live claim refuses
        dead-lettering until the claim ends."""
        select = f"SELECT {_COLUMNS} FROM oncely_outbox WHERE id = ?"
        with self._write() as connection:
            row = connection.execute(select, (event_id,)).fetchone()
            before = None if row is None else _state(row)
            change = decide(before)
            now = self._store.clock.now_ms()
            if change == "dead":
                if row[-1] is not None and row[-1] > now:
                    raise StateError(
                        f"cannot dead-letter outbox event {event_id}: a relay is publishing it "
                        "now; try again in a moment"
                    )
                connection.execute(SQLITE_DEAD_LETTER, (now, OPERATOR_ERROR, event_id))
                new_id = event_id
            elif change == "due":
                connection.execute(SQLITE_DUE, (now, event_id))
                new_id = event_id
            else:
                assert before is not None  # decide refuses a missing event
                new_id = _requeue(connection, before, now)
            after = connection.execute(select, (new_id,)).fetchone()
        return _state(after)


class _Batch:
    """The events one claim marked, settled in the backend's thread."""

    def __init__(self, backend: SQLiteOutbox, events: list[OutboxEvent], hold_ms: int) -> None:
        self._backend = backend
        self._hold_ms = hold_ms
        self.events = events
        self.settled = False

    async def settle(self, settlement: Settlement) -> None:
        await self._backend._call(self._backend._settle, settlement)
        self.settled = True

    async def extend(self) -> None:
        ids = [event.id for event in self.events]
        await self._backend._call(self._backend._extend, ids, self._hold_ms)


def _requeue(connection: Any, event: EventState, now: int) -> int:
    """Delete *event* and add it again, as `Outbox.add` would: a new id, its key's next seq."""
    payload, headers = connection.execute(
        "DELETE FROM oncely_outbox WHERE id = ? RETURNING payload, headers", (event.id,)
    ).fetchone()
    seq = None
    if event.ordering_key is not None:
        seq = connection.execute(SQLITE_NEXT_SEQ, (event.ordering_key,)).fetchone()[0]
    row = (event.message_id, event.destination, event.ordering_key, seq, payload, headers)
    new_id: int = connection.execute(SQLITE_ADD, (*row, now, now)).fetchone()[0]
    keep = "UPDATE oncely_outbox SET last_error = ? WHERE id = ?"  # why it needed an operator
    connection.execute(keep, (event.last_error, new_id))
    return new_id


def _state(row: Sequence[Any]) -> EventState:
    event_id, message_id, destination, key, attempts, *times, error, _claimed = row
    created, due, published, dead = (None if t is None else iso_ms(t) for t in times)
    return EventState(
        event_id, message_id, destination, key, attempts, created, due, published, dead, error
    )
