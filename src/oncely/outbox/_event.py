"""The outbox's unit of work and the contract a broker publisher fulfils."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

__all__ = [
    "NOT_ATTEMPTED",
    "NotAttempted",
    "OutboxEvent",
    "Outcome",
    "Publisher",
    "in_order",
    "scope",
]


@dataclass(frozen=True)
class OutboxEvent:
    """One committed outbox row, as the relay hands it to a `Publisher`.

    Attributes:
        id: The row's id; within one ``ordering_key`` ids follow commit order.
        message_id: The event's stable id, unique in the outbox. Publishers send it as the
            message's idempotency key (the ``Idempotency-Key`` header, and the broker's own
            message id where it has one), so a re-publish after a relay crash takes effect once
            in an oncely consumer.
        destination: Where it goes: a queue or routing key, a topic, a subject, a stream.
        payload: The message body.
        headers: Application headers, sent as they are next to the key.
        ordering_key: Events with the same key and destination are published in commit order
            (the Kafka message key, say); ``None`` for no ordering.
        attempts: Earlier failed publish attempts of this event.
    """

    id: int
    message_id: str
    destination: str
    payload: bytes
    headers: Mapping[str, str] = field(default_factory=dict)
    ordering_key: str | None = None
    attempts: int = 0


class NotAttempted:
    """The outcome of an event a publisher did not get confirmed because an earlier event of
    its ordering key failed in the same call: publishing it would break commit order.

    Usually it was never sent. A publisher that pipelines may already have sent it when the
    earlier failure arrived; it is then published again later, which the consumer deduplicates
    by its message id (at-least-once publishing, effectively-once consumption)."""

    _instance: NotAttempted | None = None

    def __new__(cls) -> NotAttempted:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "NOT_ATTEMPTED"


NOT_ATTEMPTED = NotAttempted()

Outcome = BaseException | NotAttempted | None
"""Per event: ``None`` once the broker confirmed it, the error that stopped it, or
`NOT_ATTEMPTED`."""


@runtime_checkable
class Publisher(Protocol):
    """Publishes outbox events to one broker, each confirmed before it counts as published.

    `publish` receives events in commit order and returns one `Outcome` per event, in the same
    order. It publishes the events of one ordering scope (``destination`` and
    ``ordering_key``) in the order given (it may pipeline confirms); after an event fails,
    later events of its scope in that call are answered `NOT_ATTEMPTED` (and not sent, where
    they were not sent yet). Events without an ordering key are independent. It raises only
    for a failure of the whole call (not connected, say): the relay then counts it against no
    event. A call that does not return within the relay's ``publish_timeout`` is cancelled,
    and the relay finds the event it hangs on by publishing the batch in smaller parts.
    """

    async def publish(self, events: Sequence[OutboxEvent]) -> Sequence[Outcome]: ...

    async def aclose(self) -> None: ...


Scope = tuple[str, str]
"""An ordering scope: (destination, ordering key)."""


def scope(event: OutboxEvent) -> Scope | None:
    """The ordering scope of *event*: its destination and key, or ``None`` without a key."""
    key = event.ordering_key
    return None if key is None else (event.destination, key)


def in_order(events: Sequence[OutboxEvent], outcomes: list[Outcome]) -> list[Outcome]:
    """*outcomes*, with every event after the first unconfirmed one of its scope answering
    `NOT_ATTEMPTED`, confirmed or not: an event counts as published only when every earlier
    event of its scope was (a pipelined confirm past a refusal would say otherwise)."""
    if outcomes.count(None) == len(outcomes):
        return outcomes  # all confirmed: nothing to change
    broken: set[Scope] = set()
    for index, event in enumerate(events):
        where = scope(event)
        if where is None:
            continue
        if where in broken:
            outcomes[index] = NOT_ATTEMPTED
        elif outcomes[index] is not None:
            broken.add(where)
    return outcomes
