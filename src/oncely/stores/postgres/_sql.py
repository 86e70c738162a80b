"""PostgreSQL statements and the flows that use them, shared by the sync and the async verbs.

Each verb is a sans-I/O flow (`oncely._core.flow`): it yields `Statement`s (or one `Batch` of
them), receives their `Reply`, and decodes it. The store runs a flow with `drive` for sync
callers and `adrive` for async ones, so statements, parameters and decoding exist once. Every
transition is one statement, and so one round trip, judged by the server's clock; a batch is
one round trip for all its statements.

Statements name their tables through ``{schema}``, filled in once per store by `Queries`.

Every transition carries an id of its own call (``op``) that it writes to the record, and
recognises as its own: a statement whose connection died after the commit (the reply lost) can
be re-sent, and answers as the first send did (its own lease is Acquired, its own completion
done) rather than InProgress or LeaseLost. Such statements are marked ``resend``: the store
re-sends them once on a fresh connection when the first one broke (see `Statement`).
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from importlib import resources
from typing import Any, Final, TypeVar

from oncely._core.flow import Flow
from oncely._core.records import (
    Acquired,
    ClaimResult,
    InProgress,
    LeaseLost,
    Mismatch,
    Record,
    Replay,
    Status,
)
from oncely.errors import CorruptRecordError, StoreError
from oncely.stores import _namespace
from oncely.stores._batch import call_ids
from oncely.stores._machine import _ms

__all__ = [
    "SCHEMA_VERSION",
    "Batch",
    "Queries",
    "Reply",
    "Statement",
    "claim_many",
    "claim_statement",
    "decode_claim",
    "decode_claim_one",
    "extend_many",
    "finish_many",
    "finish_statement",
    "get",
    "held",
    "migrate",
    "ms",
    "purge",
    "release",
    "scan",
]

BACKEND: Final = "postgres"

SCHEMA_VERSION: Final = 3
"""The schema version this code reads and writes (see ``schema.sql``)."""

_COLUMNS: Final = (
    "status, fingerprint, token, attempt, lease_expires_at, expires_at, created_at, updated_at"
)

FORGET: Final = """
WITH old AS (
    SELECT key, status FROM {schema}.oncely_records
     WHERE key = %(key)s AND expires_at > statement_timestamp()
       AND status IN ('in_progress', 'completed', 'failed')
       FOR UPDATE
), changed AS (
    UPDATE {schema}.oncely_records AS r
       SET status = 'released', result = NULL, op = NULL, updated_at = statement_timestamp(),
           lease_expires_at = least(r.lease_expires_at, statement_timestamp())
      FROM old
     WHERE r.key = old.key AND (old.status <> 'in_progress' OR %(force)s)
    RETURNING r.key
)
SELECT old.status, EXISTS (SELECT 1 FROM changed) FROM old
"""
"""Parameters: key, force. No row: no live record (or a tombstone); else the status it had and
whether it became a tombstone (not an in-progress one without force)."""

VERSION: Final = "SELECT version FROM {schema}.oncely_schema WHERE id = 1"
"""No parameters. The applied schema version: one row, or none before the first migration."""

CLAIM: Final = """
WITH r AS (
    SELECT *, clock_timestamp() AS t FROM {schema}.oncely_records WHERE key = $1::text
), inserted AS (
    INSERT INTO {schema}.oncely_records AS n
           (key, status, fingerprint, token, attempt, lease_expires_at, expires_at,
            created_at, updated_at, result, op)
    SELECT $1, 'in_progress', $2::text, 1, 1, c.t + $3::bigint * interval '1 millisecond',
           c.t + $4::bigint * interval '1 millisecond', c.t, c.t, NULL, $5::text
      FROM (SELECT clock_timestamp() AS t) AS c
     WHERE NOT EXISTS (SELECT FROM r)
    ON CONFLICT (key) DO NOTHING
    RETURNING n.token, n.attempt
)
SELECT CASE WHEN r.expires_at > r.t
             AND (r.status IN ('completed', 'failed')
                  OR (r.status = 'in_progress'
                      AND (r.fingerprint <> $2
                           OR (r.lease_expires_at > r.t AND r.op IS DISTINCT FROM $5
                               AND r.op IS DISTINCT FROM $5 || '+'))))
            THEN CASE WHEN r.fingerprint <> $2 THEN 'mismatch'
                      WHEN r.status = 'in_progress' THEN 'in_progress'
                      ELSE 'replay' END
       END AS claimed,
       r.t, r.status, r.fingerprint, r.token, r.attempt, r.lease_expires_at, r.expires_at,
       r.created_at, r.updated_at,
       CASE WHEN r.fingerprint = $2 AND r.status <> 'in_progress' THEN r.result END
  FROM r
UNION ALL
SELECT 'acquired', NULL, NULL, NULL, i.token, i.attempt, NULL, NULL, NULL, NULL, NULL
  FROM inserted AS i
"""
"""Parameters, in order: key, fingerprint, lease_ms, lease_ms + the margin (``oncely_claim``'s:
max(ttl, lease)), op (see `claim_statement`). Written with the server's own numbered
placeholders (``$1``…, in `NUMBERED`), each value used where it is needed, sent once: five
parameters to encode, send and bind rather than eleven. psycopg's cursor takes it through a
``RawCursor`` (the store's path for a connection whose client encoding is not UTF-8).

The claim of a single key, written for the two common cases, with no function in the plan: a
plan holding a PL/pgSQL call costs the server more on every execution, even one whose one-time
filter never runs the call (measured per statement by the backend's CPU time, some 50 µs for a
new key and 15 for a replay, against ``oncely_claim`` behind a filter, as `CLAIM_MANY` is).
A scalar function guarding the insert (called only when no row was read) saves no more than
2-3 µs of the replay's 40 (backend CPU, interleaved, load 9-11) and nothing on a new key.

A key with no row in the statement's snapshot is inserted, as ``oncely_claim`` would insert it
(``ON CONFLICT DO NOTHING``, so it waits for a concurrent claimer's insert and then does
nothing); a row that decides the claim without a write (a replay, a mismatch, a live lease held
by another call: ``oncely_claim``'s lock-free read, the same conditions in the same order) is
answered as read. The answer is one row with its outcome, as `CLAIM_CALL`'s, or, when neither
happened (the insert lost a race, or the row is expired, released, a lapsed lease, this call's
own lease, an unknown status), a row without one or no row at all: nothing was written, and
the caller sends `CLAIM_CALL` to decide it (`decode_claim_one`)."""

CLAIM_CALL: Final = """
SELECT * FROM {schema}.oncely_claim(%s, %s, %s, %s, %s)
"""
"""Parameters, in order: key, fingerprint, lease_ms, ttl_ms, op. One row, as `CLAIM_MANY`'s."""

_SEEN: Final = """CASE WHEN r.fingerprint <> p.fingerprint THEN 'mismatch'
                WHEN r.status = 'in_progress' THEN 'in_progress'
                ELSE 'replay' END,
           r.t, r.status, r.fingerprint, r.token, r.attempt, r.lease_expires_at, r.expires_at,
           r.created_at, r.updated_at,
           CASE WHEN r.fingerprint = p.fingerprint AND r.status <> 'in_progress' THEN r.result END
      FROM p, LATERAL (SELECT *, clock_timestamp() AS t FROM {schema}.oncely_records
                        WHERE key = p.key) AS r
     WHERE r.expires_at > r.t
       AND (r.status IN ('completed', 'failed')
            OR (r.status = 'in_progress'
                AND (r.fingerprint <> p.fingerprint
                     OR (r.lease_expires_at > r.t AND r.op IS DISTINCT FROM p.op
                         AND r.op IS DISTINCT FROM p.op || '+'))))
"""
"""The claims that write nothing (a replay, a mismatch, a live lease held by another call),
judged from a plain read of each item's row (items ``p``: key, fingerprint, op) as
``oncely_claim`` judges them on its own first, lock-free read: a select list and the rest of
its query, one text for `CLAIM_MANY` and `CLAIM_SET`."""

CLAIM_MANY: Final = (
    """
WITH p AS (
    SELECT %s::text AS key, %s::text AS fingerprint, %s::bigint AS lease_ms,
           %s::bigint AS ttl_ms, %s::text AS op
), seen AS (
    SELECT """
    + _SEEN
    + """)
SELECT * FROM seen
UNION ALL
SELECT c.*
  FROM p, {schema}.oncely_claim(p.key, p.fingerprint, p.lease_ms, p.ttl_ms, p.op) AS c
 WHERE NOT EXISTS (SELECT FROM seen)
"""
)
"""Parameters, in order (positional, as `CLAIM`'s): key, fingerprint, lease_ms, ttl_ms, op.
One row: the outcome, the server time it was judged at, and the record as it stands afterwards
(its result only for a replay). The claims of a `Batch`: their statements share a transaction,
so each is decided in its one statement.

The claims that write nothing (a replay, a mismatch, a live lease held by another call) are
answered by ``seen``, a plain read of the row as the statement's snapshot has it, judged as
``oncely_claim`` judges it on its own first, lock-free read (the same conditions, in the same
order, by the server's clock); the function runs (a one-time filter: not at all otherwise) for
everything else: a key never seen, an expired or released record, a lapsed lease, this call's
own lease (a claim sent again), an unknown status. A plain read costs the server a fraction of
a PL/pgSQL call (measured with pgbench: about 18 µs for the read, 37 µs for the function)."""

CLAIM_SET: Final = (
    """
WITH p AS MATERIALIZED (
    SELECT * FROM unnest((SELECT %(keys)s::text[]), (SELECT %(fingerprints)s::text[]),
                         (SELECT %(ops)s::text[]))
           WITH ORDINALITY AS p(key, fingerprint, op, n)
), seen AS MATERIALIZED (
    SELECT p.n,
           """
    + _SEEN
    + """)
SELECT * FROM seen
UNION ALL
SELECT p.n, c.*
  FROM p, LATERAL {schema}.oncely_claim(p.key, p.fingerprint, %(lease_ms)s::bigint,
                                        %(ttl_ms)s::bigint, p.op) AS c
 WHERE NOT EXISTS (SELECT FROM seen WHERE seen.n = p.n)
 ORDER BY 1
"""
)
"""Parameters: keys, fingerprints, ops (arrays, one element per item, in stored-key order),
lease_ms, ttl_ms. One row per item: its number (from 1), then `CLAIM_MANY`'s row.

The claims of a batch in one statement: each item is judged as `CLAIM_MANY` judges it alone.
The rows ``seen`` answers (a replay, a mismatch, a live lease held by another call) are ones
no claim writes to, so reading them all from the statement's snapshot, before any item runs
``oncely_claim``, answers each as its own statement would have. The other items call the
function one after the other, in the arrays' order (a nested loop over ``p``): a volatile
function's statements each see what the calls before them wrote, so two items of one key
answer as two claims in a row (the second finds the first's lease), and the rows are locked in
stored-key order, as a `Batch`'s are.

Each array is passed through ``(SELECT …)``, in the set statements alike, so that the planner
never sees its length: every batch then costs the same plan, and the prepared statement moves to
its generic plan after five executions. Seen, a custom plan is always the cheaper and the
statement is planned again on every execution (about 150 µs of server CPU, measured with
``EXPLAIN ANALYZE``: more than a batch of two saves)."""

FINISH_SET: Final = """
WITH p AS (
    SELECT * FROM unnest((SELECT %(keys)s::text[]), (SELECT %(tokens)s::bigint[]),
                         (SELECT %(results)s::bytea[]), (SELECT %(ops)s::text[]))
           WITH ORDINALITY AS p(key, token, result, op, n)
)
UPDATE {schema}.oncely_records AS r
   SET status = %(status)s, result = p.result, expires_at = statement_timestamp() + %(ttl)s,
       lease_expires_at = statement_timestamp(), updated_at = statement_timestamp(), op = p.op
  FROM p
 WHERE r.key = p.key AND r.token = p.token AND r.expires_at > statement_timestamp()
   AND (r.status = 'in_progress' OR (r.status = %(status)s AND r.op = p.op))
RETURNING p.n
"""
"""Parameters: keys, tokens, results, ops (arrays, one element per item; the keys distinct),
status, ttl. `COMPLETE` for every item in one statement: the number (from 1) of each item that
is done; any other lost its lease. Only for distinct keys: an ``UPDATE`` changes a row once, so
two items of one key go as a `Batch` of `COMPLETE`s instead (`finish_many`)."""

EXTEND_SET: Final = """
WITH p AS (
    SELECT * FROM unnest((SELECT %(keys)s::text[]), (SELECT %(tokens)s::text[]::bigint[]))
           WITH ORDINALITY AS p(key, token, n)
)
UPDATE {schema}.oncely_records AS r
   SET lease_expires_at = statement_timestamp() + %(lease)s,
       expires_at = greatest(
           r.expires_at,
           statement_timestamp() + %(lease)s + greatest(r.expires_at - r.lease_expires_at,
                                                        %(lease)s)
       ),
       updated_at = statement_timestamp()
  FROM p
 WHERE r.key = p.key AND r.token = p.token AND r.status = 'in_progress'
   AND r.expires_at > statement_timestamp()
RETURNING p.n
"""
"""Parameters: keys, tokens (arrays of text; the keys distinct), lease. `EXTEND` for every item
in one statement: the number (from 1) of each item extended; any other lost its lease. Only
for distinct keys, as `FINISH_SET`. The tokens come as text: asyncpg looks a ``bigint[]``'s type
up on each connection before it first prepares a statement taking one (seven round trips and
some 13 ms of the server's time), and a heartbeat's grouped extend must not wait for that."""

COMPLETE: Final = """
UPDATE {schema}.oncely_records
   SET status = %s, result = %s, expires_at = statement_timestamp() + %s,
       lease_expires_at = statement_timestamp(), updated_at = statement_timestamp(), op = %s
 WHERE key = %s AND token = %s AND expires_at > statement_timestamp()
   AND (status = 'in_progress' OR (status = %s AND op = %s))
"""
"""Parameters, in order (positional, as `CLAIM`'s): status ('completed' or 'failed'), result,
ttl, op, key, token, status, op. One affected row means done (by this statement, or by this
very call before: op); none means the lease was lost."""

RELEASE: Final = """
UPDATE {schema}.oncely_records
   SET status = 'released', lease_expires_at = statement_timestamp(),
       updated_at = statement_timestamp(), op = %(op)s
 WHERE key = %(key)s AND token = %(token)s AND expires_at > statement_timestamp()
   AND (status = 'in_progress' OR (status = 'released' AND op = %(op)s))
"""
"""Parameters: key, token, op. The record stays as a tombstone keeping its token; zero affected
rows means the lease was lost."""

EXTEND: Final = """
UPDATE {schema}.oncely_records
   SET lease_expires_at = statement_timestamp() + %(lease)s,
       expires_at = greatest(
           expires_at,
           statement_timestamp() + %(lease)s + greatest(expires_at - lease_expires_at, %(lease)s)
       ),
       updated_at = statement_timestamp()
 WHERE key = %(key)s AND token = %(token)s AND status = 'in_progress'
   AND expires_at > statement_timestamp()
"""
"""Parameters: key, token, lease. Zero affected rows means the lease was lost. The record keeps
its margin past the lease's end (at least the new lease). Running it again only moves the lease
again, so it needs no op."""

GET: Final = f"""
SELECT {_COLUMNS}, result
  FROM {{schema}}.oncely_records
 WHERE key = %(key)s AND expires_at > statement_timestamp()
"""
"""Parameters: key. The live record's row, or nothing."""

PURGE: Final = """
DELETE FROM {schema}.oncely_records
 WHERE key IN (SELECT key FROM {schema}.oncely_records
                WHERE expires_at <= statement_timestamp()
                ORDER BY expires_at LIMIT %(batch)s
                  FOR UPDATE SKIP LOCKED)
"""
"""Parameters: batch. Deletes one batch of expired records through the ``expires_at`` index,
skipping rows a claimer has locked; returns how many were deleted."""

SCAN: Final = f"""
SELECT key, {_COLUMNS}, NULL::bytea
  FROM {{schema}}.oncely_records
 WHERE key > %(after)s AND key < %(before)s AND expires_at > statement_timestamp()
 ORDER BY key LIMIT %(limit)s
"""
"""Parameters: after, before (exclusive bounds on the stored key), limit. Live records in key
order, without their results."""

SCAN_ALL: Final = f"""
SELECT key, {_COLUMNS}, NULL::bytea
  FROM {{schema}}.oncely_records
 WHERE key > %(after)s AND expires_at > statement_timestamp()
   AND (strpos(key, ':') = 0 OR strpos(split_part(key, ':', 1), '|') > 0)
 ORDER BY key LIMIT %(limit)s
"""
"""Parameters: after, limit. `SCAN` for the default namespace, whose stored keys have no ``:``
or a ``|`` before the first one (`oncely.stores._namespace`)."""

MIGRATE_PREFIX: Final = """
SET LOCAL client_min_messages = warning;
SELECT pg_advisory_xact_lock({lock});
CREATE SCHEMA IF NOT EXISTS {schema};
SET LOCAL search_path TO {schema};
"""
"""Runs before ``schema.sql`` in the same transaction: one migration per schema at a time."""


@dataclass(frozen=True, slots=True)
class Queries:
    """The statements of one store, with its schema's name quoted into them.

    Attributes:
        schema: The schema holding oncely's tables, as given (unquoted).
    """

    schema: str
    claim: str = field(init=False)
    claim_call: str = field(init=False)
    claim_many: str = field(init=False)
    claim_set: str = field(init=False)
    finish_set: str = field(init=False)
    extend_set: str = field(init=False)
    complete: str = field(init=False)
    release: str = field(init=False)
    extend: str = field(init=False)
    get: str = field(init=False)
    purge: str = field(init=False)
    scan: str = field(init=False)
    scan_all: str = field(init=False)
    migrate: str = field(init=False)
    version: str = field(init=False)
    forget: str = field(init=False)
    numbered: frozenset[str] = field(init=False)
    """The statements written with the server's ``$n`` placeholders rather than ``%s``."""

    def __post_init__(self) -> None:
        quoted = quote_identifier(self.schema)
        render = {"schema": quoted}
        for name, template in (
            ("claim", CLAIM),
            ("claim_call", CLAIM_CALL),
            ("claim_many", CLAIM_MANY),
            ("claim_set", CLAIM_SET),
            ("finish_set", FINISH_SET),
            ("extend_set", EXTEND_SET),
            ("complete", COMPLETE),
            ("release", RELEASE),
            ("extend", EXTEND),
            ("get", GET),
            ("purge", PURGE),
            ("scan", SCAN),
            ("scan_all", SCAN_ALL),
            ("version", VERSION),
            ("forget", FORGET),
        ):
            object.__setattr__(self, name, template.format(**render))
        object.__setattr__(self, "numbered", frozenset({self.claim}))
        prefix = MIGRATE_PREFIX.format(schema=quoted, lock=migration_lock(self.schema))
        object.__setattr__(self, "migrate", prefix + _schema_script())


def quote_identifier(name: str) -> str:
    """Quote *name* as a PostgreSQL identifier."""
    if not name or "\x00" in name:
        raise ValueError(f"{name!r} is not a valid PostgreSQL identifier")
    return '"' + name.replace('"', '""') + '"'


def migration_lock(schema: str) -> int:
    """The advisory lock key that serialises migrations of *schema* (a signed 64-bit integer)."""
    digest = hashlib.sha256(b"oncely.migrate:" + schema.encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


@functools.lru_cache(maxsize=1)
def _schema_script() -> str:
    return resources.files("oncely.stores.postgres").joinpath("schema.sql").read_text()


# -- operations and replies ---------------------------------------------------------------------


@dataclass(slots=True)
class Statement:
    """Execute one statement on a pooled connection in autocommit mode: one round trip.

    Attributes:
        sql: The statement (or, for a script, several separated by semicolons).
        params: Its parameters, or ``None`` for a script (sent with the simple query protocol).
        key: The key it concerns, for error messages.
        resend: Sending it again after its connection broke answers as the first send would
            have, applied or not (a read, or a transition carrying its op).
    """

    sql: str
    params: Mapping[str, Any] | Sequence[Any] | None
    key: str = ""
    resend: bool = False

    @property
    def subject(self) -> str:
        """What the statement concerns, for error messages."""
        return repr(self.key)


@dataclass(frozen=True, slots=True)
class Batch:
    """Execute *statements* in order on one connection, in one round trip and one transaction.

    The store sends them in pipeline mode followed by a single Sync, so the server runs them in
    one implicit transaction, committed at the Sync: each statement sees the effects of those
    before it, and they take effect together or (when one fails, or the session dies first) not
    at all, in which case the whole call raises. The transaction holds the row locks of every
    statement until it ends, so flows put the statements in the order of their stored keys:
    every batch then locks rows in one global order, and two batches over the same keys wait
    for each other instead of deadlocking.

    A Sync after each statement would give each its own transaction instead, but psycopg has no
    public call that sends a Sync without waiting for the results (``Pipeline.sync()`` waits),
    so it would cost a round trip per statement; and one commit for the batch is one WAL flush
    where a commit per item would be one each.

    Attributes:
        statements: What to run; the reply is a list of `Reply`, one per statement, in order.
        keys: The keys the batch concerns, for error messages, when its statements do not say
            (one set-based statement for many keys: `CLAIM_SET`).
    """

    statements: Sequence[Statement]
    keys: Sequence[str] = ()

    @property
    def resend(self) -> bool:
        """Whether the whole batch may be sent again (see `Statement.resend`)."""
        return all(statement.resend for statement in self.statements)

    @property
    def subject(self) -> str:
        """What the batch concerns, for error messages."""
        named = self.keys or [statement.key for statement in self.statements]
        keys = list(dict.fromkeys(named))
        shown = ", ".join(repr(key) for key in keys[:3])
        return f"a batch of {len(keys)} keys ({shown}{', …' if len(keys) > 3 else ''})"


@dataclass(slots=True)
class Reply:
    """What a `Statement` answered.

    Attributes:
        rows: The rows it returned (empty for a statement returning none, or left in *raw*).
        rowcount: How many rows it returned or affected.
        raw: The driver's own result, whose rows are read where it is decoded, or ``None``
            (the store's libpq path: `oncely.stores.postgres._wire`).
    """

    rows: Sequence[tuple[Any, ...]]
    rowcount: int
    raw: Any = None


# -- flows --------------------------------------------------------------------------------------


def call_id() -> str:
    """A new id for one call: unique across calls, processes and hosts (64 random bits)."""
    return os.urandom(8).hex()


ms = _ms
"""*duration* in whole milliseconds, at least one (the stores' one conversion, cached)."""


def _interval(duration: timedelta) -> timedelta:
    return timedelta(milliseconds=ms(duration))


def claim_statement(
    queries: Queries, stored: str, key: str, fingerprint: str, lease_ms: int, ttl_ms: int
) -> Statement:
    """The claim of *stored* (the namespaced key), whose record comes back named *key*; its
    reply goes to `decode_claim_one`. One statement: the store runs it without a flow."""
    params = (stored, fingerprint, lease_ms, lease_ms + max(ttl_ms, lease_ms), call_id())
    return Statement(queries.claim, params, key, resend=True)


def decode_claim_one(
    queries: Queries, statement: Statement, reply: Reply
) -> ClaimResult | Statement:
    """What `claim_statement`'s *reply* says: the answer, or the `CLAIM_CALL` statement that
    decides a claim `CLAIM` left undecided (it wrote nothing then)."""
    rows = reply.rows
    if rows and rows[0][0] is not None:
        return decode_claim(statement.key, reply)
    claimed: Sequence[Any] = statement.params  # type: ignore[assignment]
    stored, fingerprint, lease_ms, expiry_ms, op = claimed
    # oncely_claim's margin is max(ttl, lease): passing the margin as the ttl gives the same.
    params = (stored, fingerprint, lease_ms, expiry_ms - lease_ms, op)
    return Statement(queries.claim_call, params, statement.key, resend=True)


def claim_many(
    queries: Queries,
    requests: Sequence[tuple[str, str, str]],
    lease: timedelta,
    ttl: timedelta,
    ops: Sequence[str] | None = None,
) -> Flow[list[ClaimResult | StoreError]]:
    """`claim` for each ``(stored, key, fingerprint)`` in one statement (`CLAIM_SET`, or
    `CLAIM_MANY` for one), sent as a `Batch` of one (one round trip, its preparation included),
    answered in order.

    *ops*, one per request, are the claims' call ids (new ones when omitted): a caller that
    sends the batch again with them, after its reply was lost, gets its own claims back."""
    if not requests:
        return []
    ids = call_ids(requests, ops)
    if len(requests) == 1:
        # Alone, `CLAIM_MANY` costs the server less than the set-based statement's plan.
        (stored, key, fingerprint), op = requests[0], ids[0]
        alone = Statement(
            queries.claim_many, (stored, fingerprint, ms(lease), ms(ttl), op), key, resend=True
        )
        return (yield from _batch([(stored, alone)], decode_claim))
    order = _in_key_order(requests)
    params = {
        "keys": [requests[index][0] for index in order],
        "fingerprints": [requests[index][2] for index in order],
        "ops": [ids[index] for index in order],
        "lease_ms": ms(lease),
        "ttl_ms": ms(ttl),
    }
    statement = Statement(queries.claim_set, params, resend=True)
    (reply,) = yield Batch([statement], [requests[index][1] for index in order])
    rows: dict[int, list[tuple[Any, ...]]] = {}
    for row in reply.rows:
        rows.setdefault(row[0], []).append(tuple(row)[1:])
    answers: list[ClaimResult | StoreError] = [None] * len(requests)  # type: ignore[list-item]
    for number, index in enumerate(order, 1):
        key, found = requests[index][1], rows.get(number, [])
        try:
            answers[index] = decode_claim(key, Reply(found, len(found)))
        except CorruptRecordError as exc:
            answers[index] = exc
    return answers


def _in_key_order(items: Sequence[tuple[Any, ...]]) -> list[int]:
    """The indexes of *items* in the order of their stored keys (their first field; a stable
    sort, so one key's items keep their order): see `Batch` for why."""
    return sorted(range(len(items)), key=lambda index: items[index][0])


def _distinct(items: Sequence[tuple[Any, ...]]) -> bool:
    return len({item[0] for item in items}) == len(items)


def _done(reply: Reply, count: int, order: Sequence[int]) -> list[LeaseLost | StoreError | None]:
    """The answers of a set-based finish or extend whose *reply* numbers the items done."""
    done = {row[0] for row in reply.rows}
    answers: list[LeaseLost | StoreError | None] = [LeaseLost()] * count
    for number, index in enumerate(order, 1):
        if number in done:
            answers[index] = None
    return answers


def finish_statement(
    queries: Queries,
    stored: str,
    key: str,
    token: int,
    status: Status,
    result: bytes,
    ttl: timedelta,
) -> Statement:
    """Store *result* as the final outcome (``status`` completed or failed) if *token* holds;
    its reply goes to `held`."""
    op, value = call_id(), status.value
    params = (value, bytes(result), _interval(ttl), op, stored, token, value, op)
    return Statement(queries.complete, params, key, resend=True)


def finish_many(
    queries: Queries,
    items: Sequence[tuple[str, str, int, bytes]],
    status: Status,
    ttl: timedelta,
) -> Flow[list[LeaseLost | StoreError | None]]:
    """`finish` for each ``(stored, key, token, result)`` in one round trip, answered in order:
    one statement (`FINISH_SET`) when the keys are distinct, else a `Batch` of `COMPLETE`s."""
    if len(items) > 1 and _distinct(items):
        return _finish_set(queries, items, status, ttl)
    return _batch(
        [
            (stored, finish_statement(queries, stored, key, token, status, result, ttl))
            for stored, key, token, result in items
        ],
        lambda key, reply: held(reply),
    )


def _finish_set(
    queries: Queries,
    items: Sequence[tuple[str, str, int, bytes]],
    status: Status,
    ttl: timedelta,
) -> Flow[list[LeaseLost | StoreError | None]]:
    order = _in_key_order(items)
    params = {
        "keys": [items[index][0] for index in order],
        "tokens": [items[index][2] for index in order],
        "results": [bytes(items[index][3]) for index in order],
        "ops": [call_id() for _ in order],
        "status": status.value,
        "ttl": _interval(ttl),
    }
    statement = Statement(queries.finish_set, params, resend=True)
    (reply,) = yield Batch([statement], [items[index][1] for index in order])
    return _done(reply, len(items), order)


_T = TypeVar("_T")


def _batch(
    work: Sequence[tuple[str, Statement]], decode: Callable[[str, Reply], _T]
) -> Flow[list[_T | StoreError]]:
    """Run each ``(stored key, statement)`` of *work* in one `Batch`; decode each reply.

    The batch runs in stored-key order (a stable sort, so one key's items keep their order),
    for the reason given in `Batch`; answers come back in the order of *work*. An item whose
    record cannot be read is answered by its `CorruptRecordError`.
    """
    if not work:
        return []
    order = sorted(range(len(work)), key=lambda index: work[index][0])
    replies: Sequence[Reply] = yield Batch([work[index][1] for index in order])
    answers: dict[int, _T | StoreError] = {}
    for index, reply in zip(order, replies, strict=True):
        try:
            answers[index] = decode(work[index][1].key, reply)
        except CorruptRecordError as exc:
            answers[index] = exc
    return [answers[index] for index in range(len(work))]


def release(queries: Queries, stored: str, key: str, token: int) -> Flow[LeaseLost | None]:
    """Give up the lease *token* holds, keeping the record as a tombstone."""
    params = {"key": stored, "token": token, "op": call_id()}
    reply: Reply = yield Statement(queries.release, params, key, resend=True)
    return held(reply)


def _extend_statement(
    queries: Queries, stored: str, key: str, token: int, lease: timedelta
) -> Statement:
    params = {"key": stored, "token": token, "lease": _interval(lease)}
    return Statement(queries.extend, params, key, resend=True)


def extend_many(
    queries: Queries, items: Sequence[tuple[str, str, int]], lease: timedelta
) -> Flow[list[LeaseLost | StoreError | None]]:
    """Move the end of the lease each ``(stored, key, token)`` holds to *lease* from now, in
    one round trip (preparation included), answered in order: one statement (`EXTEND_SET`) when
    the keys are distinct, else a `Batch` of `EXTEND`s. The store sends every extend this way,
    alone or grouped.

    A lease named twice (a heartbeat's two beats in flight, grouped) is extended once, and both
    answered by it: extending it twice at once moves it to the same end. So a group stays one
    statement, which the asyncpg driver runs in one round trip where it runs a `Batch` in a
    round trip per statement (plus its transaction's two)."""
    unique = list(dict.fromkeys(items))
    if len(unique) < len(items):
        return _each_answered(extend_many(queries, unique, lease), unique, items)
    if len(items) > 1 and _distinct(items):
        return _extend_set(queries, items, lease)
    return _batch(
        [
            (stored, _extend_statement(queries, stored, key, token, lease))
            for stored, key, token in items
        ],
        lambda key, reply: held(reply),
    )


def _each_answered(
    flow: Flow[list[_T]], unique: Sequence[Hashable], items: Sequence[Hashable]
) -> Flow[list[_T]]:
    """*flow*'s answers for the distinct *unique*, given to each of *items* (the same ones,
    some of them twice)."""
    answers = yield from flow
    answer = dict(zip(unique, answers, strict=True))
    return [answer[item] for item in items]


def _extend_set(
    queries: Queries, items: Sequence[tuple[str, str, int]], lease: timedelta
) -> Flow[list[LeaseLost | StoreError | None]]:
    order = _in_key_order(items)
    params = {
        "keys": [items[index][0] for index in order],
        "tokens": [str(items[index][2]) for index in order],  # see EXTEND_SET
        "lease": _interval(lease),
    }
    statement = Statement(queries.extend_set, params, resend=True)
    (reply,) = yield Batch([statement], [items[index][1] for index in order])
    return _done(reply, len(items), order)


def held(reply: Reply) -> LeaseLost | None:
    """What a finishing statement's *reply* means: ``None`` done, or `LeaseLost`."""
    # The statements change the row only while the token holds the lease.
    return None if reply.rowcount == 1 else LeaseLost()


def get(queries: Queries, stored: str, key: str) -> Flow[Record | None]:
    """Read the live record of *stored*, named *key*."""
    reply: Reply = yield Statement(queries.get, {"key": stored}, key, resend=True)
    return decode_record(key, reply.rows[0]) if reply.rows else None


def purge(queries: Queries, batch: int, limit: int | None) -> Flow[int]:
    """Delete expired records, *batch* per statement, until none is left or *limit* is reached."""
    if batch < 1:
        raise ValueError("batch must be at least 1")
    removed = 0
    while limit is None or removed < limit:
        size = batch if limit is None else min(batch, limit - removed)
        reply: Reply = yield Statement(queries.purge, {"batch": size})
        removed += reply.rowcount
        if reply.rowcount < size:
            break
    return removed


def scan(queries: Queries, namespace: str, after: str, limit: int) -> Flow[list[Record]]:
    """Live records of *namespace* whose stored key sorts after *after*'s, results left out."""
    params: dict[str, Any] = {"after": _namespace.stored_key(namespace, after), "limit": limit}
    if namespace:
        # Keys are "C"-collated: a named namespace is a range of stored keys.
        params["before"] = _namespace.namespace_range(namespace)[1]
        sql = queries.scan
    else:
        sql = queries.scan_all
    reply: Reply = yield Statement(sql, params)
    return [decode_record(_namespace.caller_key(namespace, row[0]), row[1:]) for row in reply.rows]


def forget(queries: Queries, stored: str, key: str, force: bool) -> Flow[tuple[str | None, bool]]:
    """Make *stored*'s finished record a tombstone: (the status it had, whether it was refused)."""
    reply: Reply = yield Statement(queries.forget, {"key": stored, "force": force}, key)
    if not reply.rows:
        return None, False
    status, changed = reply.rows[0]
    return status, not changed


def schema_version(queries: Queries) -> Flow[int | None]:
    """The schema version the database holds (``None``: the version table has no row)."""
    reply: Reply = yield Statement(queries.version, {}, "the check", resend=True)
    return int(reply.rows[0][0]) if reply.rows else None


def migrate(queries: Queries) -> Flow[None]:
    """Create or upgrade the schema: one script, one transaction, one round trip."""
    yield Statement(queries.migrate, None)


# -- decoding -----------------------------------------------------------------------------------

_EPOCH: Final = datetime(1970, 1, 1, tzinfo=timezone.utc)
_ONE_MS: Final = timedelta(milliseconds=1)


_STATUSES: Final = {status.value: status for status in Status}


def _epoch_ms(moment: Any) -> int:
    # A naive datetime, or anything but a datetime, raises TypeError here: no isinstance tests
    # on the hot path (a timestamptz column always loads as an aware datetime).
    return (moment - _EPOCH) // _ONE_MS  # type: ignore[no-any-return]


def decode_record(key: str, row: Sequence[Any]) -> Record:
    """Build a `Record` from the columns ``status .. updated_at, result``.

    Raises:
        CorruptRecordError: The row is not a record this version of oncely can read.
    """
    try:
        (status, fingerprint, token, attempt, lease_end, expires, created, updated, result) = row
        if type(token) is not int or type(attempt) is not int:
            raise TypeError(f"{token!r} or {attempt!r} is not an integer")
        if type(fingerprint) is not str:
            raise TypeError(f"fingerprint {fingerprint!r} is not text")
        if result is not None and type(result) is not bytes:
            raise TypeError(f"result of type {type(result).__name__} is not bytea")
        known = _STATUSES.get(status)
        if known is None:
            raise ValueError(f"{status!r} is not a valid Status")
        # `_epoch_ms` inline: a frame less per timestamp, on every replay of the cursor's and
        # asyncpg's paths.
        return Record(
            key=key,
            status=known,
            fingerprint=fingerprint,
            token=token,
            attempt=attempt,
            lease_expires_at_ms=(lease_end - _EPOCH) // _ONE_MS,
            expires_at_ms=(expires - _EPOCH) // _ONE_MS,
            created_at_ms=(created - _EPOCH) // _ONE_MS,
            updated_at_ms=(updated - _EPOCH) // _ONE_MS,
            result=result,
        )
    except (TypeError, ValueError) as exc:
        raise CorruptRecordError(str(exc), backend=BACKEND, key=key) from exc


def decode_claim(key: str, reply: Reply) -> ClaimResult:
    """Turn the row ``oncely_claim`` returned into the caller's answer."""
    if len(reply.rows) != 1:
        raise CorruptRecordError(
            f"oncely_claim returned {len(reply.rows)} rows", backend=BACKEND, key=key
        )
    row = reply.rows[0]
    outcome, judged_at, columns = row[0], row[1], row[2:]
    if outcome == "corrupt":
        raise CorruptRecordError(f"unknown status {columns[0]!r}", backend=BACKEND, key=key)
    if outcome == "acquired" or outcome == "recovered":
        # The lease this very statement wrote: its token and attempt are all the caller needs,
        # so the rest of the row is not decoded (a record, four timestamps) on every new key.
        token, attempt = row[4], row[5]
        if type(token) is not int or type(attempt) is not int:
            raise CorruptRecordError(
                f"{token!r} or {attempt!r} is not an integer", backend=BACKEND, key=key
            )
        return Acquired(token, recovered=outcome == "recovered", attempt=attempt)
    record = decode_record(key, columns)
    if outcome == "replay":
        return Replay(record, judged_at_ms=_epoch_ms(judged_at))
    if outcome == "mismatch":
        return Mismatch(stored_fingerprint=record.fingerprint)
    if outcome == "in_progress":
        # Microseconds, not the record's milliseconds: a lease that ends within the next
        # millisecond still has a positive retry_after.
        return InProgress(retry_after=columns[4] - judged_at)
    raise CorruptRecordError(f"unknown claim outcome {outcome!r}", backend=BACKEND, key=key)
