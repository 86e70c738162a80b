"""RabbitMQ consumers (aio-pika): each message takes effect once, however often it is delivered.

.. code-block:: python

    from oncely.consumers.rabbitmq import dead_letter_arguments, idempotent_handler

    @idempotent_handler(store, group="billing")
    async def on_order(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        await charge(json.loads(message.body))

    queue = await channel.declare_queue("orders", arguments=dead_letter_arguments("orders.dead"))
    await queue.consume(on_order)          # no_ack=False (the default): oncely acks

How the runner's verdicts reach the broker (docs/guides/consumers.md):

* ack: ``message.ack()``, only once the record is completed (or the message is a completed
  duplicate);
* retry: ``message.nack(requeue=True)``, after the verdict's delay when the key is busy
  elsewhere or the store is unreachable (the delivery stays unacked meanwhile: a crash in that
  window redelivers it too);
* dead-letter: ``message.reject(requeue=False)``, which RabbitMQ routes to the queue's
  dead-letter exchange. Declare the queue with `dead_letter_arguments` (or a policy): without a
  dead-letter exchange RabbitMQ discards rejected messages.

A consumer process that dies mid-handler has its deliveries requeued by RabbitMQ at once; the
copy waits (retries) until the dead worker's lease ends, then runs.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeAlias

from oncely._core.codec import Codec
from oncely._core.protocols import AsyncStore
from oncely._deps import require
from oncely.consumers._consumer import IdempotentConsumer
from oncely.consumers._drivers import mark_coroutine_function
from oncely.consumers._keys import default_scope
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

require("aio_pika", extra="rabbitmq")

if TYPE_CHECKING:
    from aio_pika.abc import AbstractIncomingMessage

__all__ = ["dead_letter_arguments", "IdempotentHandler", "idempotent_handler", "MessageHandler"]

MessageHandler: TypeAlias = "Callable[[AbstractIncomingMessage], Awaitable[Any]]"
"""An aio-pika consumer callback: takes the incoming message, returns an awaitable."""


def dead_letter_arguments(routing_key: str, *, exchange: str = "") -> dict[str, Any]:
    """Return queue arguments that dead-letter rejected messages to *routing_key*.

    With the default exchange (``""``), *routing_key* is the name of the dead-letter queue.

    .. versionadded:: 0.1.0
    """
    return {"x-dead-letter-exchange": exchange, "x-dead-letter-routing-key": routing_key}


class IdempotentHandler:
    """An aio-pika consumer callback that runs *handler* once per key and settles the message.

    Args:
        handler: The user's callback; it must not ack, nack or reject the message itself.
        store: Where the records are kept.
        group: The scope of the keys (default: the handler's qualified name). Two groups each
            process a message once.
        policy: Leases, retention and attempts (`oncely.consumers.ConsumerPolicy`).
        key: Where the key comes from: a header (then the AMQP ``message_id``), the content,
            or a callable over the `oncely.consumers.Delivery`.
        key_headers: The headers tried for ``key="header"``.
        fingerprint: What defines the operation (default: the canonical body).
        codec: Serialises what the handler returns, for the record.

    .. versionadded:: 0.1.0
    """

    def __init__(
        self,
        handler: MessageHandler,
        store: AsyncStore,
        *,
        group: str | None = None,
        policy: ConsumerPolicy | None = None,
        key: KeySource = "header",
        key_headers: tuple[str, ...] = KEY_HEADERS,
        fingerprint: FingerprintSource = "body",
        codec: Codec | None = None,
    ) -> None:
        self.handler = handler
        self.consumer = IdempotentConsumer(
            store,
            scope=default_scope(handler, group),
            policy=policy,
            key=key,
            key_headers=key_headers,
            fingerprint=fingerprint,
            codec=codec,
        )
        functools.update_wrapper(self, handler)
        mark_coroutine_function(self)

    @property
    def stats(self) -> ConsumerStats:
        """Counters of verdicts (processed, duplicate, in_progress...)."""
        return self.consumer.stats

    async def __call__(self, message: AbstractIncomingMessage) -> Verdict:
        """Process one delivery and ack, nack or reject it; return the verdict."""
        delivery = Delivery(
            message.body, dict(message.headers or {}), message.message_id, raw=message
        )
        verdict = await self.consumer.aprocess(delivery, functools.partial(self.handler, message))
        if verdict.action is Action.ACK:
            await message.ack()
        elif verdict.action is Action.DEAD_LETTER:
            await message.reject(requeue=False)
        else:
            if verdict.delay is not None:
                await asyncio.sleep(seconds(verdict.delay))
            await message.nack(requeue=True)
        return verdict


def idempotent_handler(
    store: AsyncStore,
    *,
    group: str | None = None,
    policy: ConsumerPolicy | None = None,
    key: KeySource = "header",
    key_headers: tuple[str, ...] = KEY_HEADERS,
    fingerprint: FingerprintSource = "body",
    codec: Codec | None = None,
) -> Callable[[MessageHandler], IdempotentHandler]:
    """Decorate an aio-pika callback so each message takes effect once (see `IdempotentHandler`).

    .. versionadded:: 0.1.0
    """

    def decorate(handler: MessageHandler) -> IdempotentHandler:
        return IdempotentHandler(
            handler,
            store,
            group=group,
            policy=policy,
            key=key,
            key_headers=key_headers,
            fingerprint=fingerprint,
            codec=codec,
        )

    return decorate
