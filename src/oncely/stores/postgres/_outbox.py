"""The outbox on PostgreSQL: its statements, and how they keep each key's order.

The `oncely.outbox._store.OutboxBackend` of a `PostgresStore`; psycopg's errors become
oncely's in `PostgresOutbox._errors` (through the store's own mapping), the one boundary.

How events of one ordering key stay in commit order, with any number of writers and relays:

1. **Writers number each key's events in commit order.** `PG_ADD` increments the key's counter
   row in ``oncely_outbox_keys`` (``INSERT ... ON CONFLICT DO UPDATE SET seq = seq + 1
   RETURNING seq``) and stores the event with that ``seq``. The upsert leaves the counter row
   locked until the writer's transaction ends, so a second writer of the same key waits there
   until the first commits (then it reads the incremented counter and takes the next number) or
   rolls back (then it takes the same number, which was never seen). A sequence id drawn at
   insert time would not do: two transactions can commit in the other order than they drew
   ids. Hence: **when an event of seq n is visible, every event of its key with a lower seq has
   committed and is visible too** (or was published and purged). Writers of different keys
   never wait for each other; a transaction adding events of several keys takes their locks in
   the order it adds them (add them in one order everywhere, or a deadlock aborts one).
   On SQLite the single write lock, held from a transaction's first write to its commit, gives
   the same property without the counter's lock mattering.

2. **A relay only starts a scope at its head.** Order is kept per *scope*: the events of one
   ordering key to one destination (a failing destination holds back only its own events). The
   head of a scope is its pending event (neither published nor dead) with no pending event of
   a lower seq (`PG_HEADS`); seq, per key, orders a scope's events too. The relay locks heads
   with ``FOR UPDATE SKIP LOCKED``: a head another relay holds is skipped, and nothing else of
   that scope qualifies while the head is pending, so **a scope is worked on by one relay at a
   time**. (A claim first tries the oldest due pending events, locked with SKIP LOCKED, and
   keeps them when each one's earlier pending events of its scope are all among them
   (`PG_CLAIM_FIRST`): then it holds those scopes' heads too; else it rolls back and claims
   as follows.)
   Holding scopes' heads, the relay also locks the scopes' following pending events,
   oldest first (`PG_FOLLOWERS`), and hands the publisher the batch in id order. Within one
   key, id order is seq order (the later writer inserted after the earlier one committed), so
   a batch holds a prefix of each scope's pending events, in the scope's order.

3. **The locks are held until the outcome is recorded.** The relay's transaction stays open
   while the publisher publishes; it marks confirmed events published, counts the failures,
   and commits. Only then can another relay see the key's next head. A head that failed waits
   for its ``next_attempt_at``, and its scope with it; a dead-lettered head no longer counts as
   pending, so the scope moves on. A relay that dies before it commits leaves every row as it
   was: the next relay publishes the batch again (at-least-once; consumers deduplicate by the
   message id). So within a scope, seq n+1 is never marked published before n is published
   or dead-lettered.

   A relay whose snapshot predates another relay's commit sees the old head still pending:
   either it is locked (skipped), or it was updated since (PostgreSQL re-checks a row it locks
   against its newest version, which is published, dead or not yet due), and the events after
   it are not heads in that snapshot. On SQLite, where a claim cannot hold the write lock while
   publishing, a claim is a mark instead (``claimed_until_ms``), taken in one write transaction
   and treated like a lock until it passes.

Statements name their tables through ``{schema}``, filled in by `PostgresQueries`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import operator
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Final

import psycopg

from oncely import _switches, _txn
from oncely.outbox._store import (
    OPERATOR_ERROR,
    Change,
    ClaimedBatch,
    EventState,
    NewEvent,
    Settlement,
    event_from_row,
    iso,
    ms,
)
from oncely.stores.postgres._outbox_sql import (
    PG_ADD,
    PG_CLAIM,
    PG_CLAIM_FIRST,
    PG_DEAD_LETTER,
    PG_DUE,
    PG_FAILED,
    PG_FOLLOWERS,
    PG_HEADS,
    PG_NOTED,
    PG_NOTIFY,
    PG_PUBLISHED,
    PG_PURGE,
    PG_PURGE_KEYS,
    PG_REQUEUE,
    PG_STATS,
)
from oncely.stores.postgres._sql import Statement

__all__ = ["PostgresOutbox", "PostgresQueries", "channel"]

_USER: Final = "the outbox"
_ID: Final = operator.itemgetter(0)
"""A claimed row's id."""
_PURGE_BATCH: Final = 1000
_WINDOW: Final = 2
"""A claim looks for heads among the oldest ``limit`` times this many pending events first
(see `PG_HEADS`). Each claim reads the whole window, several times: twice the batch is room
enough for a batch of heads and their followers unless one key holds up most of it (then the
claim looks past it), and cost a relay catching up about a fifth of its rate less than four
times did."""


@dataclass(frozen=True, slots=True)
class PostgresQueries:
    """The outbox statements of one PostgreSQL schema."""

    schema: str
    add: str = field(init=False)
    add_notify: str = field(init=False)
    heads: str = field(init=False)
    followers: str = field(init=False)
    claim: str = field(init=False)
    claim_first: str = field(init=False)
    published: str = field(init=False)
    failed: str = field(init=False)
    noted: str = field(init=False)
    purge: str = field(init=False)
    purge_keys: str = field(init=False)
    stats: str = field(init=False)
    requeue: str = field(init=False)
    due: str = field(init=False)
    dead_letter: str = field(init=False)
    table: str = field(init=False)
    channel: str = field(init=False)

    def __post_init__(self) -> None:
        quoted = quote_identifier(self.schema)
        for name, template in (
            ("heads", PG_HEADS),
            ("followers", PG_FOLLOWERS),
            ("claim", PG_CLAIM),
            ("claim_first", PG_CLAIM_FIRST),
            ("published", PG_PUBLISHED),
            ("failed", PG_FAILED),
            ("noted", PG_NOTED),
            ("purge", PG_PURGE),
            ("purge_keys", PG_PURGE_KEYS),
            ("stats", PG_STATS),
            ("due", PG_DUE),
            ("dead_letter", PG_DEAD_LETTER),
        ):
            object.__setattr__(self, name, template.format(schema=quoted))
        table = f"{quoted}.oncely_outbox".replace("'", "''")
        sequence = f"pg_get_serial_sequence('{table}', 'id')"
        for name, notify in (("add", ""), ("add_notify", PG_NOTIFY)):
            rendered = PG_ADD.format(schema=quoted, sequence=sequence, notify=notify)
            object.__setattr__(self, name, rendered)
        object.__setattr__(self, "requeue", PG_REQUEUE.format(schema=quoted, sequence=sequence))
        object.__setattr__(self, "table", f"{quoted}.oncely_outbox")
        object.__setattr__(self, "channel", channel(self.schema))


def quote_identifier(name: str) -> str:
    """Quote *name* as a PostgreSQL identifier (the store checked it when it opened)."""
    return '"' + name.replace('"', '""') + '"'


def channel(schema: str) -> str:
    """The NOTIFY channel of *schema*'s outbox: one per schema, short of the 63-byte limit."""
    return "oncely_outbox_" + hashlib.sha256(schema.encode()).hexdigest()[:16]


_COLUMNS: Final = (
    "id, message_id, destination, ordering_key, attempts, created_at, next_attempt_at, "
    "published_at, dead_at, last_error"
)
"""The columns of an `EventState`, in its field order."""


@dataclass(frozen=True, slots=True)
class _Subject:
    subject: str = _USER


_SUBJECT: Final = _Subject()


class PostgresOutbox:
    """The outbox's statements on a `PostgresStore`'s schema (an `OutboxBackend`)."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.queries = PostgresQueries(store.schema)

    def _errors(self) -> contextlib.AbstractContextManager[None]:
        """psycopg's exceptions as oncely's: the store's one mapping."""
        return self._store._errors(_SUBJECT)  # type: ignore[no-any-return]

    # -- the writer ----------------------------------------------------------------------------

    def _add_statement(self, event: NewEvent, notify: bool) -> tuple[str, dict[str, Any]]:
        params = {
            "message_id": event.message_id,
            "destination": event.destination,
            "ordering_key": event.ordering_key,
            "payload": event.payload,
            "headers": event.headers,
        }
        if not notify:
            return self.queries.add, params
        params["channel"] = self.queries.channel
        return self.queries.add_notify, params

    def add(self, connection: Any, event: NewEvent, *, notify: bool) -> bool:
        """Store *event* in *connection*'s transaction (see `OutboxBackend.add`)."""
        connection = _txn.raw_connection(connection, _USER)
        _txn.check_psycopg_transaction(connection, _USER)
        statement, params = self._add_statement(event, notify)
        return connection.execute(statement, params).fetchone() is not None

    async def aadd(self, connection: Any, event: NewEvent, *, notify: bool) -> bool:
        """`add` on a psycopg ``AsyncConnection`` (or SQLAlchemy's over one)."""
        connection = await _txn.araw_connection(connection)
        _txn.check_psycopg_transaction(connection, _USER)
        statement, params = self._add_statement(event, notify)
        cursor = await connection.execute(statement, params)
        return await cursor.fetchone() is not None

    # -- the relay -----------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def claim(self, limit: int, hold: timedelta) -> AsyncIterator[ClaimedBatch]:
        """Lock a batch in a transaction that lasts until the outcomes are recorded (the
        module's docstring); *hold* is the transaction's own.

        Two round trips in all, in pipeline mode: ``BEGIN`` with the claim (`PG_CLAIM_FIRST`,
        and `PG_CLAIM` after it in a third when a row it locked is not ready), and the outcomes'
        statements with ``COMMIT`` (or ``ROLLBACK``), sent as the claim ends."""
        with self._errors():
            pool = await self._store._async_pool()
            async with pool.connection() as connection, connection.pipeline():
                await connection.execute(b"BEGIN")
                try:
                    batch = _Batch(self.queries, connection)
                    await batch.load(limit)
                    yield batch
                except BaseException:
                    # Queued, sent as the pipeline ends; a broken connection must not replace
                    # what is raised (the pool discards it, and the server rolls back).
                    with contextlib.suppress(Exception):
                        await connection.execute(b"ROLLBACK")
                    raise
                await connection.execute(b"COMMIT")

    async def listen(self, wake: asyncio.Event) -> asyncio.Task[None] | None:
        """Set *wake* on each ``NOTIFY`` of the outbox's channel."""
        return asyncio.get_running_loop().create_task(self._listen(wake), name="oncely-listen")

    async def _listen(self, wake: asyncio.Event) -> None:
        """Set *wake* on each NOTIFY, reconnecting (and waking once) after a failure."""
        from oncely._log import get_logger

        store = self._store
        delay = 0.1
        while True:
            try:
                connection = await psycopg.AsyncConnection.connect(store._conninfo, **store._kwargs)
                async with connection:
                    await connection.execute(f'LISTEN "{self.queries.channel}"')
                    delay = 0.1
                    wake.set()  # a notification sent before LISTEN took effect is not lost
                    async for _ in connection.notifies():
                        wake.set()
            except psycopg.Error as exc:
                get_logger("oncely.outbox").warning(
                    "outbox relay: LISTEN failed (%s); polling meanwhile, retrying in %.1f s",
                    exc,
                    delay,
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)

    async def purge(self, retention: timedelta) -> int:
        """Delete old published events, and the counters of keys with nothing pending."""
        store, queries = self._store, self.queries
        purged: int = 0
        while True:
            params = {"retention": retention, "batch": _PURGE_BATCH}
            reply = await store._aexecute(Statement(queries.purge, params, _USER))
            purged += reply.rowcount
            if reply.rowcount < _PURGE_BATCH:
                break
        while True:
            statement = Statement(queries.purge_keys, {"batch": _PURGE_BATCH}, _USER)
            if (await store._aexecute(statement)).rowcount < _PURGE_BATCH:
                return purged

    async def stats(self) -> dict[str, Any]:
        """The outbox's counts and its oldest pending event's time."""
        statement = Statement(self.queries.stats, {}, _USER, resend=True)
        pending, dead, published, oldest = (await self._store._aexecute(statement)).rows[0]
        return {
            "pending": pending,
            "dead": dead,
            "published": published,
            "oldest_pending": None if oldest is None else oldest.isoformat(),
        }

    async def aclose(self) -> None:
        """Nothing to close: the pool is the store's."""

    # -- the operators' verbs ------------------------------------------------------------------

    def _rows(self, sql: str, params: dict[str, Any]) -> list[Any]:
        return self._store._execute(Statement(sql, params, _USER)).rows  # type: ignore[no-any-return]

    def dead_letters(self, limit: int) -> list[EventState]:
        """The dead-lettered events, oldest first."""
        sql = f"SELECT {_COLUMNS} FROM {self.queries.table} WHERE dead_at IS NOT NULL"
        rows = self._rows(f"{sql} ORDER BY id LIMIT %(limit)s", {"limit": limit})
        return [_state(row) for row in rows]

    def _event(self, event_id: int) -> EventState | None:
        sql = f"SELECT {_COLUMNS} FROM {self.queries.table} WHERE id = %(id)s"
        rows = self._rows(sql, {"id": event_id})
        return _state(rows[0]) if rows else None

    def transition(
        self, event_id: int, decide: Callable[[EventState | None], Change]
    ) -> EventState:
        """One conditional statement: a relay publishing the event holds its row lock until it
        recorded the outcome, and the statement then sees the new state."""
        queries = self.queries
        statements = {"requeue": queries.requeue, "due": queries.due, "dead": queries.dead_letter}
        params = {"id": event_id, "channel": queries.channel, "error": OPERATOR_ERROR}
        while True:
            change = decide(self._event(event_id))
            rows = self._rows(statements[change], params)
            if rows:
                after = self._event(rows[0][0])
                assert after is not None
                return after
            # A relay (or another operator) changed it between the two statements: look again.


class _Batch:
    """The events one claim locked, on the claim's connection and transaction."""

    def __init__(self, queries: PostgresQueries, connection: Any) -> None:
        self._queries = queries
        self._connection = connection
        self.events: list[Any] = []

    async def load(self, limit: int) -> None:
        connection = self._connection
        if not _switches.reference_flows:  # the tests hold both ways to the same tests
            first = self._queries.claim_first
            rows = await (await connection.execute(first, {"limit": limit}, binary=True)).fetchall()
            if False not in [row[-1] for row in rows]:
                rows.sort(key=_ID)
                self.events = [event_from_row(row[:-1]) for row in rows]
                return
            # Let go of the rows that are not ready before claiming (see `PG_CLAIM_FIRST`).
            await connection.execute(b"ROLLBACK")
            await connection.execute(b"BEGIN")
        params = {"limit": limit, "window": limit * _WINDOW}
        cursor = await connection.execute(self._queries.claim, params, binary=True)
        rows = await cursor.fetchall()
        rows.sort(key=_ID)  # within a key, id order is commit order
        self.events = [event_from_row(row) for row in rows]

    async def settle(self, settlement: Settlement) -> None:
        """Queue the outcomes' statements: they go with the ``COMMIT`` that ends the claim."""
        queries, connection = self._queries, self._connection
        if settlement.published:
            await connection.execute(queries.published, {"ids": settlement.published})
        if settlement.failed:
            failed = settlement.failed
            params = {
                "ids": [failure.id for failure in failed],
                "errors": [failure.error for failure in failed],
                "delays": [ms(failure.delay) for failure in failed],
                "dead": [failure.dead for failure in failed],
            }
            await connection.execute(queries.failed, params)
        if settlement.note is not None and settlement.untouched:
            params = {"ids": settlement.untouched, "error": settlement.note}
            await connection.execute(queries.noted, params)

    async def extend(self) -> None:
        pass  # the rows stay locked until the transaction ends


def _state(row: Any) -> EventState:
    event_id, message_id, destination, key, attempts, *times, error = row
    created, due, published, dead = (None if t is None else iso(t) for t in times)
    return EventState(
        event_id, message_id, destination, key, attempts, created, due, published, dead, error
    )
