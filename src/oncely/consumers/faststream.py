"""One FastStream middleware for its Kafka, RabbitMQ, NATS and Redis brokers.

.. code-block:: python

    from oncely.consumers.faststream import IdempotencyMiddleware, publish_to

    broker = KafkaBroker("localhost:9092")
    broker.add_middleware(
        IdempotencyMiddleware(store, group="billing", dead_letter=publish_to(broker, "orders.dead"))
    )

    @broker.subscriber("orders", group_id="billing", ack_policy=AckPolicy.MANUAL)
    async def on_order(order: Order) -> None:
        ...

The middleware wraps each handler call in `oncely.consumers.IdempotentConsumer` and settles
the message itself, whatever the subscriber's ``ack_policy``, except ``ACK_FIRST``: it
acknowledges (commits) before the handler runs, and is refused with a `ConfigurationError`.
FastStream's Kafka subscribers default to it: give them another, as above.

* ack: ``message.ack()`` once the record is completed; the handler's return value goes to the
  subscriber's publishers as usual. A completed duplicate is acked too, and its stored result
  is returned, so a reply lost by a crash after the completion is published again;
* retry: ``message.nack()`` (``nack(delay=...)`` on NATS; RabbitMQ holds the delivery for the
  delay first). Kafka seeks back to the record; Redis Streams leave the entry pending;
* dead-letter: with a *dead_letter* callable (see `publish_to`), the message is handed to it
  and then acked. Without one, RabbitMQ rejects it to the queue's dead-letter exchange; the
  other brokers have no dead-letter target of their own, so the message is kept (nacked after
  the retry delay) and an error is logged each time: nothing is dropped.

For any verdict but ack the handler's publishers are skipped (the call ends in FastStream's
`SkipMessage`, logged at INFO by FastStream).

Keys come from the ``Idempotency-Key``/``x-idempotency-key`` header, else the broker's id of
the message, stable across redeliveries: ``topic/partition/offset`` in Kafka, the AMQP
``message_id``, ``Nats-Msg-Id`` or the stream sequence, the Redis stream entry id (a Redis list
or channel message has none but a ``message_id`` header). A re-publish is a new message to all
of them, so stamp keys on what you publish (`oncely.consumers.producer.stamp`) or pass
``key=``.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeAlias

from oncely._core.codec import Codec
from oncely._core.protocols import AsyncStore
from oncely._deps import require
from oncely._log import fields, get_logger
from oncely.consumers._consumer import IdempotentConsumer
from oncely.consumers._verdicts import (
    KEY_HEADERS,
    Action,
    ConsumerPolicy,
    ConsumerStats,
    Delivery,
    FingerprintSource,
    KeySource,
    Verdict,
    seconds,
)
from oncely.errors import ConfigurationError

require("faststream", extra="faststream")

from faststream import BaseMiddleware  # noqa: E402 - after the friendly check above
from faststream.exceptions import SkipMessage  # noqa: E402

if TYPE_CHECKING:
    from faststream._internal.context.repository import ContextRepo
    from faststream.message import StreamMessage

__all__ = ["DEAD_LETTER_REASON_HEADER", "DeadLetter", "IdempotencyMiddleware", "publish_to"]

logger = get_logger(__name__)

DeadLetter: TypeAlias = "Callable[[StreamMessage[Any], Verdict], Awaitable[Any]]"
"""Moves one message to a dead-letter destination; raises if it could not."""

DEAD_LETTER_REASON_HEADER = "oncely-dead-letter-reason"
"""The header `publish_to` adds to a dead-lettered copy."""


def publish_to(broker: Any, destination: str, **options: Any) -> DeadLetter:
    """Return a *dead_letter* callable publishing the message to *destination* through *broker*.

    The copy keeps the body and headers and gains ``oncely-dead-letter-reason``.

    Args:
        broker: The FastStream broker (any of them).
        destination: The queue, topic, subject or stream (as ``broker.publish`` takes it).
        **options: Other ``broker.publish`` arguments.

    .. versionadded:: 0.1.0
    """

    async def dead_letter(message: StreamMessage[Any], verdict: Verdict) -> Any:
        headers = {**dict(message.headers or {}), DEAD_LETTER_REASON_HEADER: str(verdict.reason)}
        return await broker.publish(message.body, destination, headers=headers, **options)

    return dead_letter


class IdempotencyMiddleware:
    """A FastStream broker middleware: each message takes effect once per *group*.

    Pass the instance to ``broker.add_middleware`` (or ``middlewares=[...]``); FastStream calls
    it once per message.

    Args:
        store: Where the records are kept.
        group: The scope of the keys: two groups (services) each process a message once.
            Use one middleware per group.
        policy: Leases, retention and attempts (`oncely.consumers.ConsumerPolicy`).
        key: Where the key comes from (see `oncely.consumers.KeySource`).
        key_headers: The headers tried for ``key="header"``.
        fingerprint: What defines the operation (default: the canonical body).
        codec: Serialises what the handler returns, for the record and for duplicates.
        dead_letter: Moves a message to a dead-letter destination (see `publish_to`).

    .. versionadded:: 0.1.0
    """

    def __init__(
        self,
        store: AsyncStore,
        *,
        group: str,
        policy: ConsumerPolicy | None = None,
        key: KeySource = "header",
        key_headers: tuple[str, ...] = KEY_HEADERS,
        fingerprint: FingerprintSource = "body",
        codec: Codec | None = None,
        dead_letter: DeadLetter | None = None,
    ) -> None:
        if not group:
            raise ConfigurationError("IdempotencyMiddleware needs a group (the keys' scope)")
        self.consumer = IdempotentConsumer(
            store,
            scope=group,
            policy=policy,
            key=key,
            key_headers=key_headers,
            fingerprint=fingerprint,
            codec=codec,
        )
        self.dead_letter = dead_letter

    @property
    def stats(self) -> ConsumerStats:
        """Counters of verdicts (processed, duplicate, in_progress...)."""
        return self.consumer.stats

    def __call__(self, msg: Any, /, *, context: ContextRepo) -> Any:
        """Build the per-message middleware, as FastStream expects of a middleware factory."""
        return _IdempotencyScope(msg, context=context, owner=self)

    async def consume(self, call_next: Callable[..., Awaitable[Any]], msg: Any) -> Any:
        """Run one message through the runner and settle it (what ``consume_scope`` does)."""
        if getattr(msg, "committed", None) is not None:
            raise ConfigurationError(
                "the message was settled before its handler ran (AckPolicy.ACK_FIRST, the "
                "default of FastStream's Kafka subscribers): subscribe with "
                "ack_policy=AckPolicy.MANUAL (or NACK_ON_ERROR) to use IdempotencyMiddleware"
            )
        headers: Mapping[str, Any] = msg.headers or {}
        delivery = Delivery(msg.body, dict(headers), _message_id(msg), raw=msg)
        verdict = await self.consumer.aprocess(delivery, functools.partial(call_next, msg))
        await self._settle(msg, verdict)
        if verdict.action is not Action.ACK:
            raise SkipMessage()
        return verdict.result

    async def _settle(self, msg: Any, verdict: Verdict) -> None:
        if verdict.action is Action.ACK:
            await msg.ack()
            return
        if verdict.action is Action.DEAD_LETTER:
            if self.dead_letter is not None:
                try:
                    await self.dead_letter(msg, verdict)
                except Exception as exc:
                    logger.error(
                        "could not dead-letter key=%s; kept: %s",
                        verdict.key,
                        exc,
                        extra=fields(key=verdict.key, outcome="dead_letter_failed"),
                    )
                else:
                    await msg.ack()
                    return
            elif _is_rabbit(msg):
                await msg.reject()  # to the queue's dead-letter exchange
                return
            else:
                logger.error(
                    "key=%s must be dead-lettered but no dead_letter= is configured; kept",
                    verdict.key,
                    extra=fields(key=verdict.key, outcome="dead_letter_failed"),
                )
            delay = seconds(self.consumer.policy.retry_delay)
        else:
            delay = seconds(verdict.delay)
        if delay and _nack_takes_delay(msg):
            await msg.nack(delay=delay)
            return
        if delay:
            await asyncio.sleep(delay)
        await msg.nack()


def _message_id(msg: Any) -> str | None:
    """The broker's identity of *msg*, stable across redeliveries, or ``None``.

    Read from the broker's own message, as the other adapters do, never FastStream's message
    id alone: FastStream names a Kafka record ``<offset>-<timestamp>`` (which two partitions
    share whenever their records at one offset carry the same millisecond) and makes up a
    random id, on every delivery, for a RabbitMQ message without ``message_id`` and a Redis
    or NATS message without its ``message_id`` header.
    """
    module = type(msg).__module__
    raw = msg.raw_message
    if module.startswith(("faststream.kafka", "faststream.confluent")):
        # aiokafka's ConsumerRecord has attributes; confluent-kafka's Message has methods.
        topic, partition, offset = (getattr(raw, name, None) for name in _POSITION)
        if callable(topic) and callable(partition) and callable(offset):
            topic, partition, offset = topic(), partition(), offset()
        if isinstance(topic, str) and isinstance(partition, int) and isinstance(offset, int):
            return f"{topic}/{partition}/{offset}"
        return None  # a batch
    if module.startswith("faststream.rabbit"):
        return getattr(raw, "message_id", None) or None  # the publisher's (aio-pika sets one)
    if module.startswith("faststream.nats"):
        from oncely.consumers.nats import _message_id as nats_message_id  # nats-py is there

        return nats_message_id(raw) if hasattr(raw, "reply") else None
    if module.startswith("faststream.redis"):
        ids = raw.get("message_ids") if isinstance(raw, Mapping) else None
        if ids and len(ids) == 1 and raw.get("type") == "stream":
            entry = ids[0]
            return entry.decode() if isinstance(entry, bytes) else str(entry)
        return (msg.headers or {}).get("message_id") or None
    return msg.message_id or None


_POSITION = ("topic", "partition", "offset")


def _is_rabbit(msg: Any) -> bool:
    return type(msg).__module__.startswith("faststream.rabbit")


def _nack_takes_delay(msg: Any) -> bool:
    return type(msg).__module__.startswith("faststream.nats")


class _IdempotencyScope(BaseMiddleware):
    """The per-message middleware FastStream enters; it defers to its `IdempotencyMiddleware`."""

    def __init__(self, msg: Any, /, *, context: ContextRepo, owner: IdempotencyMiddleware) -> None:
        super().__init__(msg, context=context)
        self.owner = owner

    async def consume_scope(
        self, call_next: Callable[..., Awaitable[Any]], msg: StreamMessage[Any]
    ) -> Any:
        return await self.owner.consume(call_next, msg)
