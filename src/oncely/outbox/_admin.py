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

from typing import Any, Final

from oncely.errors import ConfigurationError
from oncely.outbox._store import (
    Change,
    EventState,
    NoSuchEventError,
    StateError,
    backend_for,
)

__all__ = [
    "EventState",
    "NoSuchEventError",
    "StateError",
    "dead_letters",
    "dead_letter",
    "resend",
    "retry",
]


def dead_letters(store: Any, limit: int = 100) -> list[EventState]:
    """The dead-lettered events, oldest first, at most *limit*."""
    return backend_for(store, "the outbox").dead_letters(limit)


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


_ALLOWED: Final[dict[str, dict[str, Change]]] = {
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
    backend = backend_for(store, "the outbox")
    if isinstance(event_id, bool) or not isinstance(event_id, int):
        raise ConfigurationError(f"an outbox event id is an integer, not {event_id!r}")
    return backend.transition(event_id, lambda before: _change(verb, before, event_id))


def _change(verb: str, before: EventState | None, event_id: int) -> Change:
    if before is None:
        raise NoSuchEventError(f"no outbox event {event_id}")
    change = _ALLOWED[verb].get(before.state)
    if change is None:
        advice = _ADVICE.get((verb, before.state), f"it is {before.state}")
        raise StateError(f"cannot {verb} outbox event {event_id}: {advice}")
    return change
