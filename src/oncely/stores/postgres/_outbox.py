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

_EVENT: Final = (
    "o.id, o.message_id, o.destination, o.payload, o.headers, o.ordering_key, o.attempts"
)
"""The columns an `OutboxEvent` is made of, in its field order."""

PG_ADD: Final = """
WITH next AS (
    INSERT INTO {schema}.oncely_outbox_keys AS k (ordering_key, seq)
    SELECT %(ordering_key)s::text, 1 WHERE %(ordering_key)s::text IS NOT NULL
    ON CONFLICT (ordering_key) DO UPDATE SET seq = k.seq + 1
    RETURNING k.seq, nextval({sequence}) AS id
), added AS (
    INSERT INTO {schema}.oncely_outbox
           (id, message_id, destination, ordering_key, seq, payload, headers)
    VALUES (coalesce((SELECT id FROM next), nextval({sequence})), %(message_id)s,
            %(destination)s, %(ordering_key)s::text, (SELECT seq FROM next), %(payload)s,
            %(headers)s::jsonb)
    ON CONFLICT (message_id) DO NOTHING
    RETURNING id
)
SELECT id{notify} FROM added
"""
"""Parameters: message_id, destination, ordering_key, payload, headers (JSON text), and with
notify, channel. One row (the new id), or none when the message id is taken already (the
transaction stays usable; the key's counter skipped a number, which is harmless).

A keyed event draws its id in ``next``, once it holds its key's counter row: so within a key,
ids follow seq (commit) order too, as `OutboxEvent.id` promises. Drawn by the column's default,
the id could be taken before the counter's lock is granted (a test caught exactly that: a
writer that waited for the lock carried a lower id than the events committed before it)."""

PG_NOTIFY: Final = ", pg_notify(%(channel)s, '')"

_HEADS_CTES: Final = """
near AS MATERIALIZED (
    SELECT o.id, o.ordering_key, o.destination, o.seq, o.next_attempt_at
      FROM {schema}.oncely_outbox AS o
     WHERE o.published_at IS NULL AND o.dead_at IS NULL
     ORDER BY o.id
     LIMIT %(window)s
), near_heads AS (
    SELECT DISTINCT ON (n.ordering_key, n.destination)
           n.id, n.ordering_key, n.destination, n.seq, n.next_attempt_at
      FROM near AS n
     WHERE n.ordering_key IS NOT NULL
     ORDER BY n.ordering_key, n.destination, n.seq
), keyed AS (
    (SELECT o.ordering_key, o.destination, o.seq FROM {schema}.oncely_outbox AS o
      WHERE o.ordering_key IS NOT NULL AND o.published_at IS NULL AND o.dead_at IS NULL
      ORDER BY o.ordering_key, o.destination, o.seq LIMIT 1)
    UNION ALL
    SELECT m.ordering_key, m.destination, m.seq
      FROM keyed AS k,
           LATERAL (SELECT o.ordering_key, o.destination, o.seq
                      FROM {schema}.oncely_outbox AS o
                     WHERE (o.ordering_key, o.destination) > (k.ordering_key, k.destination)
                       AND o.ordering_key IS NOT NULL
                       AND o.published_at IS NULL AND o.dead_at IS NULL
                     ORDER BY o.ordering_key, o.destination, o.seq LIMIT 1) AS m
), beyond AS (
    -- Look past the window only when it is full and cannot fill a batch by itself.
    SELECT (SELECT count(*) FROM near) >= %(window)s
       AND (SELECT count(*) FROM near AS n
             WHERE (n.ordering_key IS NULL AND n.next_attempt_at <= statement_timestamp())
                OR (n.ordering_key, n.destination) IN (
                       SELECT h.ordering_key, h.destination FROM near_heads AS h
                        WHERE h.next_attempt_at <= statement_timestamp()))
           < %(limit)s AS yes
), heads_near AS MATERIALIZED (
    -- The window's own heads, named by id: the table is read only where they are.
    SELECT {event}
      FROM {schema}.oncely_outbox AS o
     WHERE o.id = ANY(ARRAY(
               SELECT n.id FROM near AS n
                WHERE n.ordering_key IS NULL AND NOT (SELECT b.yes FROM beyond AS b)
               UNION ALL
               SELECT h.id FROM near_heads AS h WHERE NOT (SELECT b.yes FROM beyond AS b)))
       AND o.published_at IS NULL AND o.dead_at IS NULL
       AND o.next_attempt_at <= statement_timestamp()
     ORDER BY o.id
     LIMIT %(limit)s
       FOR UPDATE OF o SKIP LOCKED
), heads_far AS MATERIALIZED (
    SELECT {event}
      FROM {schema}.oncely_outbox AS o
     WHERE (SELECT b.yes FROM beyond AS b)
       AND o.published_at IS NULL AND o.dead_at IS NULL
       AND o.next_attempt_at <= statement_timestamp()
       AND (o.ordering_key IS NULL
            OR (o.ordering_key, o.seq) IN (SELECT k.ordering_key, k.seq FROM keyed AS k))
     ORDER BY o.id
     LIMIT %(limit)s
       FOR UPDATE OF o SKIP LOCKED
)
""".replace("{event}", _EVENT)
"""The ``WITH`` queries `PG_HEADS` and `PG_CLAIM` share (see `PG_HEADS`)."""

_HEADS_SELECT: Final = """
SELECT * FROM heads_near
UNION ALL
SELECT * FROM heads_far
"""

PG_HEADS: Final = f"""
WITH RECURSIVE {_HEADS_CTES}
{_HEADS_SELECT}
"""
"""Parameters: limit, window. Due pending events without an earlier pending event of their
scope, the (ordering key, destination) pair (every event without a key is one), locked,
skipping those another relay holds.

Heads are found without testing each event against its key's others (that cost each claim the
backlog times its keys' depth: a relay catching up on 4000 events of 32 keys claimed about 70
a second). ``near`` is the oldest *window* pending events: a key with an event among them has
its first pending event among them too (within a key id order is seq order), so their heads
are the scopes' heads, found in the window alone (one sort of the window: a join of the
window with its own aggregate let the planner pick a nested loop on a busy table), and the
claim reads no further than the window: it locks the heads by id (``heads_near``), reading
the table only where they are. Only when the window is full and cannot fill a batch itself
(fewer than *limit* of its events are due heads, their keys' later events or due events
without a key: a key held up by a failing head, say) does the claim look beyond it
(``beyond``): ``keyed`` then finds every scope's head by skipping from scope to scope
through the ``(ordering_key, destination, seq)`` index of pending events, one descent per
scope, and ``heads_far`` scans past the window, for events without a key too. There a head is
named by its ``(ordering_key, seq)``, unique among pending events."""

PG_FOLLOWERS: Final = f"""
SELECT {_EVENT}
  FROM {{schema}}.oncely_outbox AS o
 WHERE o.ordering_key = ANY(%(keys)s::text[])
   AND (o.ordering_key, o.destination) IN (
           SELECT * FROM unnest(%(keys)s::text[], %(destinations)s::text[]))
   AND o.published_at IS NULL AND o.dead_at IS NULL
   AND o.id <> ALL(%(ids)s::bigint[])
 ORDER BY o.id
 LIMIT %(limit)s
   FOR UPDATE OF o
"""
"""Parameters: keys and destinations (the scopes whose heads this relay holds, pairwise), ids
(those heads), limit. The pending events after them, locked (no other relay can hold them:
their scope's head is pending and ours), oldest first. Within a key id order is seq order, so
what the limit keeps of each scope is a prefix of its pending events; and the rows are those
the heads' scan read first, near each other."""

PG_CLAIM: Final = f"""
WITH RECURSIVE {_HEADS_CTES}, heads AS MATERIALIZED ({_HEADS_SELECT}), follower_ids AS (
    SELECT n.id FROM near AS n
     WHERE NOT (SELECT b.yes FROM beyond AS b)
       AND (n.ordering_key, n.destination) IN (
               SELECT h.ordering_key, h.destination FROM heads AS h
                WHERE h.ordering_key IS NOT NULL)
       AND n.id NOT IN (SELECT h.id FROM heads AS h)
    UNION ALL
    SELECT f.id
      FROM heads AS h,
           LATERAL (SELECT o.id FROM {{schema}}.oncely_outbox AS o
                     WHERE o.ordering_key = h.ordering_key AND o.destination = h.destination
                       AND o.seq > (SELECT p.seq FROM {{schema}}.oncely_outbox AS p
                                     WHERE p.id = h.id)
                       AND o.published_at IS NULL AND o.dead_at IS NULL
                     ORDER BY o.ordering_key, o.destination, o.seq
                     LIMIT %(limit)s) AS f
     WHERE (SELECT b.yes FROM beyond AS b) AND h.ordering_key IS NOT NULL
), followers AS (
    SELECT {_EVENT}
      FROM {{schema}}.oncely_outbox AS o
     WHERE o.id = ANY(ARRAY(
               SELECT f.id FROM follower_ids AS f
                ORDER BY f.id
                LIMIT greatest(0, %(limit)s - (SELECT count(*) FROM heads))))
       AND o.published_at IS NULL AND o.dead_at IS NULL
     ORDER BY o.id
       FOR UPDATE OF o
)
SELECT * FROM heads
UNION ALL
SELECT * FROM followers
"""
"""Parameters: limit, window. `PG_HEADS` and `PG_FOLLOWERS` in one statement, one round trip:
the heads, locked, then the pending events after them in the scopes they hold, locked, oldest
first, up to *limit* in all. Both parts read one snapshot, where every scope's visible pending
events are a prefix of its events (a writer's later event commits after its earlier one), so
what the limit keeps of each scope is a prefix of its pending events; events committed since
wait for the next claim. Rows come unordered: the caller sorts them by id.

The followers are named by id before they are read, so every plan, a generic one too, reads
them through an index: from the window when the heads came from it (a scope's events in the
window are a prefix of its pending events), else from the scope index, up to *limit* a scope.
(Read with a limit in the statement, the planner of a prepared statement sorted every pending
event instead.)"""

PG_CLAIM_FIRST: Final = f"""
WITH batch AS MATERIALIZED (
    SELECT {_EVENT}, o.seq
      FROM {{schema}}.oncely_outbox AS o
     WHERE o.published_at IS NULL AND o.dead_at IS NULL
       AND o.next_attempt_at <= statement_timestamp()
     ORDER BY o.id
     LIMIT %(limit)s
       FOR UPDATE OF o SKIP LOCKED
), paired AS (
    SELECT b.*,
           lag(b.seq) OVER (PARTITION BY b.ordering_key, b.destination ORDER BY b.seq) AS before
      FROM batch AS b
)
SELECT b.id, b.message_id, b.destination, b.payload, b.headers, b.ordering_key, b.attempts,
       CASE WHEN b.ordering_key IS NULL OR b.before = b.seq - 1 THEN true
            ELSE NOT EXISTS (
                SELECT FROM {{schema}}.oncely_outbox AS p
                 WHERE p.ordering_key = b.ordering_key AND p.destination = b.destination
                   AND p.seq < b.seq AND p.seq > coalesce(b.before, -1)
                   AND p.published_at IS NULL AND p.dead_at IS NULL)
       END AS ready
  FROM paired AS b
"""
"""Parameters: limit. The claim's first try, what a relay alone on a healthy outbox needs: the
oldest *limit* due pending events, locked, skipping those another relay holds (the plain
producer's statement), each with *ready*: no pending event of its scope lies between it and
the batch's previous event of that scope (*before*), or before it if it is the scope's first in
the batch. When every row is ready, each scope's events in the batch are a prefix of its pending
events, started at its head: a claim (`PostgresOutbox.claim` takes it: one index scan of the
batch, a sort of it, and an index-only descent into the scope index for each scope's first
event and each gap in seq, none for the next seq of a key, against `PG_CLAIM`'s window, its
sort and second reading of every row). A scope's earlier events are checked as a gap from the
previous one, not each against all: that read the scope's batched events again for each of
them, quadratic in how many of one key a batch holds. A row is not ready when an earlier
event of its scope is held by another relay, not yet due, or a failing head's, and then the
batch may be short of what is due elsewhere: the claim rolls back, which lets go of its locks,
and runs `PG_CLAIM` in a new transaction (sent with them, one round trip). Held until the relay
commits, the lock of a row that is not ready (a follower of a scope another relay holds) would
make that relay's `PG_CLAIM` wait for it at its followers (``FOR UPDATE``), for as long as this
relay publishes, or deadlock with it.

*ready* reads the statement's snapshot, which may be older than a row's lock: an earlier event
published since still counts as pending (the row waits for the next claim), and none can be
missing: the row was visible in the snapshot, so every earlier event of its key had
committed (the module's docstring, 1)."""

PG_PUBLISHED: Final = """
UPDATE {schema}.oncely_outbox SET published_at = statement_timestamp()
 WHERE id = ANY(%(ids)s::bigint[])
"""

PG_FAILED: Final = """
UPDATE {schema}.oncely_outbox AS o
   SET attempts = o.attempts + 1,
       last_error = f.error,
       next_attempt_at = statement_timestamp() + f.delay_ms * interval '1 millisecond',
       dead_at = CASE WHEN f.dead THEN statement_timestamp() END
  FROM unnest(%(ids)s::bigint[], %(errors)s::text[], %(delays)s::bigint[], %(dead)s::boolean[])
       AS f(id, error, delay_ms, dead)
 WHERE o.id = f.id
"""
"""Parameters: ids, errors, delays (ms), dead: one element per failed event."""

PG_NOTED: Final = """
UPDATE {schema}.oncely_outbox SET last_error = %(error)s WHERE id = ANY(%(ids)s::bigint[])
"""
"""Parameters: error, ids. A failure of the whole publish call: recorded, not counted."""

PG_PURGE: Final = """
DELETE FROM {schema}.oncely_outbox
 WHERE id IN (SELECT id FROM {schema}.oncely_outbox
               WHERE published_at < statement_timestamp() - %(retention)s
               ORDER BY published_at LIMIT %(batch)s
                 FOR UPDATE SKIP LOCKED)
"""
"""Parameters: retention (an interval), batch. Deletes one batch of old published events."""

PG_PURGE_KEYS: Final = """
DELETE FROM {schema}.oncely_outbox_keys AS k
 USING (SELECT c.ordering_key, c.seq FROM {schema}.oncely_outbox_keys AS c
         WHERE NOT EXISTS (SELECT 1 FROM {schema}.oncely_outbox AS o
                            WHERE o.ordering_key = c.ordering_key
                              AND o.published_at IS NULL AND o.dead_at IS NULL)
         LIMIT %(batch)s) AS idle
 WHERE k.ordering_key = idle.ordering_key AND k.seq = idle.seq
"""
"""Parameters: batch. Deletes counters of keys with no pending event (their next event starts
again at 1, which is harmless: only pending events are compared). ``k.seq = idle.seq`` keeps
a counter whose writer committed a new event after this statement's snapshot: PostgreSQL
re-checks the row it waited for, and finds its seq moved on."""

PG_STATS: Final = """
SELECT count(*) FILTER (WHERE published_at IS NULL AND dead_at IS NULL),
       count(*) FILTER (WHERE dead_at IS NOT NULL),
       count(*) FILTER (WHERE published_at IS NOT NULL),
       min(created_at) FILTER (WHERE published_at IS NULL AND dead_at IS NULL)
  FROM {schema}.oncely_outbox
"""
"""No parameters. Pending, dead and published counts, and the oldest pending event's time."""


PG_REQUEUE: Final = """
WITH target AS (
    SELECT o.id, o.ordering_key FROM {schema}.oncely_outbox AS o
     WHERE o.id = %(id)s AND (o.published_at IS NOT NULL OR o.dead_at IS NOT NULL)
       FOR UPDATE
), next AS (
    INSERT INTO {schema}.oncely_outbox_keys AS k (ordering_key, seq)
    SELECT t.ordering_key, 1 FROM target AS t WHERE t.ordering_key IS NOT NULL
    ON CONFLICT (ordering_key) DO UPDATE SET seq = k.seq + 1
    RETURNING k.seq, nextval({sequence}) AS id
)
UPDATE {schema}.oncely_outbox AS o
   SET id = coalesce((SELECT n.id FROM next AS n), nextval({sequence})),
       seq = (SELECT n.seq FROM next AS n),
       attempts = 0, next_attempt_at = statement_timestamp(), published_at = NULL,
       dead_at = NULL
  FROM target AS t
 WHERE o.id = t.id
RETURNING o.id, pg_notify(%(channel)s, '')
"""
"""Parameters: id, channel. A published or dead event made pending again, after every event of
its key (a new id and the key's next seq, drawn as `PG_ADD` draws them); its new id, or no row
when it is pending (or gone)."""

PG_DUE: Final = """
UPDATE {schema}.oncely_outbox SET next_attempt_at = statement_timestamp()
 WHERE id = %(id)s AND published_at IS NULL AND dead_at IS NULL
RETURNING id, pg_notify(%(channel)s, '')
"""
"""Parameters: id, channel. A pending event due now (its backoff cut short)."""

PG_DEAD_LETTER: Final = """
UPDATE {schema}.oncely_outbox SET dead_at = statement_timestamp(), last_error = %(error)s
 WHERE id = %(id)s AND published_at IS NULL AND dead_at IS NULL
RETURNING id, pg_notify(%(channel)s, '')
"""
"""Parameters: id, error, channel. A pending event set aside; its scope's next event is due."""


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
