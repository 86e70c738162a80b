"""Transactional outbox: events written in the caller's transaction, published by a relay.

`Outbox.add` stores an event in the application's own transaction; a `Relay` publishes the
committed events through a `Publisher` (RabbitMQ, Kafka, NATS JetStream, Redis Streams, or your
own), in each ordering key's commit order, at least once, each carrying its message id as the
idempotency key an oncely consumer reads.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

from oncely.outbox._event import NOT_ATTEMPTED, NotAttempted, OutboxEvent, Outcome, Publisher
from oncely.outbox._registry import publisher_from_url
from oncely.outbox._relay import Relay
from oncely.outbox._writer import Outbox

__all__ = [
    "NOT_ATTEMPTED",
    "NotAttempted",
    "Outbox",
    "OutboxEvent",
    "Outcome",
    "Publisher",
    "Relay",
    "publisher_from_url",
]
