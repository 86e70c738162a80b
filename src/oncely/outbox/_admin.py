"""Operators' verbs on single outbox events: list dead letters, retry, dead-letter, re-send.

Each verb is one statement (PostgreSQL) or one write transaction (SQLite), conditional on the
event's state, so it never races a relay into a state nobody asked for: a relay publishing the
event holds its row lock (PostgreSQL) until it recorded the outcome, and the verb then sees
the new state; on SQLite a relay's claim refuses dead-lettering until the claim ends.

A *requeued* event (a dead event retried, a published or dead event re-sent) is pending again
with no attempts, its message id and last error unchanged, and placed after every event of
its key: it takes
a new id and its key's next seq, as a newly added event would. Events of its scope published
after it are not re-sent, so a consumer gets it after them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Final

from oncely.errors import ConfigurationError, OncelyError
from oncely.outbox import _sql
from oncely.outbox._relay import iso_ms, sqlite_write
from oncely.outbox._writer import check_store

__all__ = [
    "EventState",
    "NoSuchEventError",
    "StateError",
    "dead_letters",
    "dead_letter",
    "resend",
    "retry",
]

_OPERATOR_ERROR: Final = "dead-lettered by an operator"

_PG_COLUMNS: Final = (
    "id, message_id, destination, ordering_key, attempts, created_at, next_attempt_at, "
    "published_at, dead_at, last_error"
)
_SQLITE_COLUMNS: Final = (
    "id, message_id, destination, ordering_key, attempts, created_at_ms, next_attempt_at_ms, "
    "published_at_ms, dead_at_ms, last_error, claimed_until_ms"
)


class StateError(OncelyError):
    """The event is not in a state the verb applies to."""


class NoSuchEventError(StateError):
    """No event of that id is in the outbox (never added, or published and purged)."""


@dataclass(frozen=True, slots=True)
class EventState:
    """One outbox event as an operator sees it (times as ISO 8601 UTC, or ``None``)."""

    id: int
    message_id: str
    destination: str
    ordering_key: str | None
    attempts: int
    created_at: str | None
    next_attempt_at: str | None
    published_at: str | None
    dead_at: str | None
    last_error: str | None

    @property
    def state(self) -> str:
        """``published``, ``dead`` or ``pending``."""
        if self.published_at is not None:
            return "published"
        return "dead" if self.dead_at is not None else "pending"


def dead_letters(store: Any, limit: int = 100) -> list[EventState]:
    """The dead-lettered events, oldest first, at most *limit*."""
    check_store(store, "the outbox")
    if store.backend == "postgres":
        queries = _sql.PostgresQueries(store.schema)
        sql = f"SELECT {_PG_COLUMNS} FROM {queries.table} WHERE dead_at IS NOT NULL"
        rows = _pg(store, f"{sql} ORDER BY id LIMIT %(limit)s", {"limit": limit}).rows
        return [_pg_state(row) for row in rows]
    sql = f"SELECT {_SQLITE_COLUMNS} FROM oncely_outbox WHERE dead_at_ms IS NOT NULL"
    with _sqlite(store) as connection:
        rows = connection.execute(f"{sql} ORDER BY id LIMIT ?", (limit,)).fetchall()
    return [_sqlite_state(row) for row in rows]


def retry(store: Any, event_id: int) -> EventState:
    """Publish event *event_id* again soon: a dead event is requeued; a pending one, waiting
    for its backoff, is due now. Return its new state.

    Raises:
        StateError: No such event, or it was published (`resend` it).
    """
    return _apply(store, event_id, "retry")


def dead_letter(store: Any, event_id: int) -> EventState:
    """Set pending event *event_id* aside as a dead letter, so its scope's later events go on.

    Raises:
        StateError: No such event, it is not pending, or (SQLite) a relay is publishing it now.
    """
    return _apply(store, event_id, "dead-letter")


def resend(store: Any, event_id: int) -> EventState:
    """Requeue published or dead event *event_id*, with its message id, to be published again
    (an oncely consumer that had it deduplicates it).

    Raises:
        StateError: No such event, or it is pending (the relay will publish it: `retry`).
    """
    return _apply(store, event_id, "resend")


_ALLOWED: Final = {
    "retry": {"dead": "requeue", "pending": "due"},
    "dead-letter": {"pending": "dead"},
    "resend": {"published": "requeue", "dead": "requeue"},
}
_ADVICE: Final = {
    ("retry", "published"): "it was published: `resend` it to publish it again",
    ("resend", "pending"): "it is pending: the relay publishes it (`retry` makes it due now)",
    ("dead-letter", "dead"): "it is dead-lettered already",
    ("dead-letter", "published"): "it was published",
}


def _apply(store: Any, event_id: int, verb: str) -> EventState:
    check_store(store, "the outbox")
    if isinstance(event_id, bool) or not isinstance(event_id, int):
        raise ConfigurationError(f"an outbox event id is an integer, not {event_id!r}")
    if store.backend == "postgres":
        return _pg_apply(store, event_id, verb)
    return _sqlite_apply(store, event_id, verb)


def _state(row: Any, iso: Callable[[Any], str]) -> EventState:
    event_id, message_id, destination, key, attempts, *times, error = row
    created, due, published, dead = (None if t is None else iso(t) for t in times)
    return EventState(
        event_id, message_id, destination, key, attempts, created, due, published, dead, error
    )


def _change(verb: str, before: EventState | None, event_id: int) -> str:
    if before is None:
        raise NoSuchEventError(f"no outbox event {event_id}")
    change = _ALLOWED[verb].get(before.state)
    if change is None:
        advice = _ADVICE.get((verb, before.state), f"it is {before.state}")
        raise StateError(f"cannot {verb} outbox event {event_id}: {advice}")
    return change


# -- PostgreSQL -----------------------------------------------------------------------------------


def _pg(store: Any, sql: str, params: dict[str, Any]) -> Any:
    from oncely.stores.postgres._sql import Statement

    return store._execute(Statement(sql, params, "the outbox"))


def _pg_state(row: Any) -> EventState:
    return _state(row, _iso)


def _pg_event(store: Any, queries: _sql.PostgresQueries, event_id: int) -> EventState | None:
    sql = f"SELECT {_PG_COLUMNS} FROM {queries.table} WHERE id = %(id)s"
    rows = _pg(store, sql, {"id": event_id}).rows
    return _pg_state(rows[0]) if rows else None


def _pg_apply(store: Any, event_id: int, verb: str) -> EventState:
    queries = _sql.PostgresQueries(store.schema)
    statements = {"requeue": queries.requeue, "due": queries.due, "dead": queries.dead_letter}
    params = {"id": event_id, "channel": queries.channel, "error": _OPERATOR_ERROR}
    while True:
        change = _change(verb, _pg_event(store, queries, event_id), event_id)
        rows = _pg(store, statements[change], params).rows
        if rows:
            after = _pg_event(store, queries, rows[0][0])
            assert after is not None
            return after
        # A relay (or another operator) changed it between the two statements: look again.


# -- SQLite ---------------------------------------------------------------------------------------


def _sqlite(store: Any) -> Any:
    """A write transaction on the store's connection (its errors as the store's)."""
    return sqlite_write(store)


def _sqlite_state(row: Any) -> EventState:
    return _state(row[:-1], iso_ms)  # without claimed_until_ms


def _sqlite_apply(store: Any, event_id: int, verb: str) -> EventState:
    select = f"SELECT {_SQLITE_COLUMNS} FROM oncely_outbox WHERE id = ?"
    with _sqlite(store) as connection:
        row = connection.execute(select, (event_id,)).fetchone()
        before = None if row is None else _sqlite_state(row)
        change = _change(verb, before, event_id)
        now = store.clock.now_ms()
        if change == "dead":
            if row[-1] is not None and row[-1] > now:
                raise StateError(
                    f"cannot dead-letter outbox event {event_id}: a relay is publishing it now; "
                    "try again in a moment"
                )
            connection.execute(_sql.SQLITE_DEAD_LETTER, (now, _OPERATOR_ERROR, event_id))
            new_id = event_id
        elif change == "due":
            connection.execute(_sql.SQLITE_DUE, (now, event_id))
            new_id = event_id
        else:
            assert before is not None  # _change checked it
            new_id = _sqlite_requeue(connection, before, now)
        after = connection.execute(select, (new_id,)).fetchone()
    return _sqlite_state(after)


def _sqlite_requeue(connection: Any, event: EventState, now: int) -> int:
    """Delete *event* and add it again, as `Outbox.add` would: a new id, its key's next seq."""
    payload, headers = connection.execute(
        "DELETE FROM oncely_outbox WHERE id = ? RETURNING payload, headers", (event.id,)
    ).fetchone()
    seq = None
    if event.ordering_key is not None:
        seq = connection.execute(_sql.SQLITE_NEXT_SEQ, (event.ordering_key,)).fetchone()[0]
    row = (event.message_id, event.destination, event.ordering_key, seq, payload, headers)
    new_id: int = connection.execute(_sql.SQLITE_ADD, (*row, now, now)).fetchone()[0]
    keep = "UPDATE oncely_outbox SET last_error = ? WHERE id = ?"  # why it needed an operator
    connection.execute(keep, (event.last_error, new_id))
    return new_id


# -- times ----------------------------------------------------------------------------------------


def _iso(moment: datetime) -> str:
    return moment.astimezone(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")
