"""The SQL text of the PostgreSQL outbox (`oncely.stores.postgres._outbox`): each statement with
the parameters it takes, ``{schema}`` left for `PostgresQueries` to fill in."""

from __future__ import annotations

from typing import Final

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
