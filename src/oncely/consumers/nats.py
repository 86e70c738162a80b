"""NATS JetStream consumers (nats-py): each message takes effect once, however often delivered.

.. code-block:: python

    from oncely.consumers.nats import idempotent_handler

    @idempotent_handler(store, group="billing", max_deliver=10)
    async def on_order(msg: nats.aio.msg.Msg) -> None:
        await charge(json.loads(msg.data))

    await js.subscribe("orders.*", durable="billing", cb=on_order.callback, manual_ack=True,
                       config=ConsumerConfig(max_deliver=10, ack_wait=30))
    # or, pulling: for msg in await sub.fetch(10): await on_order(msg)
    # or, a fetched batch at once (one claim round trip with a batching store):
    #     await on_order.batch(await sub.fetch(100))

How the runner's verdicts reach the broker (docs/guides/consumers.md):

* ack: ``msg.ack()``, only once the record is completed (or for a completed duplicate);
* retry: ``msg.nak(delay=...)`` when the key is busy elsewhere or the store is unreachable;
  a plain ``msg.nak()`` after the handler raised (JetStream redelivers at once);
* dead-letter: a copy is published to *dead_letter_subject* (when given; JetStream has no
  dead-letter queue of its own), then ``msg.term()`` stops redelivery.

While the handler runs, ``msg.in_progress()`` is sent every *progress_interval* so JetStream
does not redeliver a slow message after ``ack_wait``. A worker killed mid-handler stops those
heartbeats: JetStream redelivers after ``ack_wait`` and the copy runs once the dead worker's
lease has ended.

nats-py wants a coroutine function as ``cb=``: pass the handler's `IdempotentHandler.callback`
(the handler object itself is awaited like a function, but nats-py's check refuses objects).

JetStream gives up on a message after the consumer's ``max_deliver`` deliveries, silently for
the application. Pass the same *max_deliver* here: the last delivery is then dead-lettered
rather than dropped. Except when its key is running elsewhere (in progress, or our lease was
taken over): a ``nak`` would never be redelivered and ``term()`` would drop a message another
worker may still fail, so the last delivery is held (``in_progress()``) and decided again after
the verdict's delay, until that worker's outcome is known (a duplicate then, acked). Keep
`ConsumerPolicy.max_attempts` below *max_deliver*.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeAlias

from oncely._core.codec import Codec
from oncely._core.policy import Duration, to_timedelta
from oncely._core.protocols import AsyncStore
from oncely._deps import require
from oncely._log import fields, get_logger
from oncely.consumers._consumer import IdempotentConsumer
from oncely.consumers._drivers import mark_coroutine_function
from oncely.consumers._keys import default_scope, reads_message_id
from oncely.consumers._verdicts import (
    KEY_HEADERS,
    Action,
    ConsumerPolicy,
    ConsumerStats,
    Delivery,
    FingerprintSource,
    KeySource,
    Reason,
    Verdict,
    seconds,
)
from oncely.errors import ConfigurationError

require("nats", extra="nats")

if TYPE_CHECKING:
    from nats.aio.msg import Msg
    from nats.js import JetStreamContext

__all__ = ["DEAD_LETTER_HEADERS", "IdempotentHandler", "idempotent_handler", "MessageHandler"]

logger = get_logger(__name__)

MessageHandler: TypeAlias = "Callable[[Msg], Awaitable[Any]]"
"""A nats-py message callback."""

DEAD_LETTER_HEADERS = ("Oncely-Dead-Letter-Reason", "Oncely-Source-Subject", "Oncely-Source-Seq")
"""Headers added to a dead-lettered copy: why, and where it came from."""

_ELSEWHERE = frozenset({Reason.IN_PROGRESS, Reason.LEASE_LOST})
"""Retries because another worker runs the key: its outcome decides the message."""


def _message_id(msg: Msg) -> str | None:
    """``Nats-Msg-Id``, else ``<stream>:<stream sequence>``; ``None`` for a core NATS message."""
    headers = msg.headers
    if headers and headers.get("Nats-Msg-Id"):
        return headers["Nats-Msg-Id"]
    # What `msg.metadata` reads from the ack subject (ADR-15: 9 tokens, or 11 and more with a
    # domain), without building its timestamp: this runs for every delivery.
    tokens = (msg.reply or "").split(".")
    if tokens[:2] == ["$JS", "ACK"] and (len(tokens) == 9 or len(tokens) >= 11):
        stream, sequence = (tokens[2], tokens[5]) if len(tokens) == 9 else (tokens[4], tokens[7])
        with contextlib.suppress(ValueError):
            return f"{stream}:{int(sequence)}"
    return None


class IdempotentHandler:
    """A nats-py JetStream callback that runs *handler* once per key and settles the message.

    Args:
        handler: The user's callback; it must not ack, nak or term the message itself.
        store: Where the records are kept.
        group: The scope of the keys (default: the handler's qualified name).
        policy: Leases, retention and attempts (`oncely.consumers.ConsumerPolicy`).
        key: Where the key comes from: a header (then ``Nats-Msg-Id``, then the stream
            sequence), the content, or a callable over the `oncely.consumers.Delivery`.
        key_headers: The headers tried for ``key="header"``.
        fingerprint: What defines the operation (default: the canonical body).
        codec: Serialises what the handler returns, for the record.
        progress_interval: How often ``in_progress()`` is sent while the handler runs; keep it
            below the consumer's ``ack_wait``.
        max_deliver: The JetStream consumer's ``max_deliver``: its last delivery is
            dead-lettered instead of being left to expire.
        dead_letter_subject: Where dead-lettered copies are published (through *jetstream*).
        jetstream: The JetStream context that publishes dead-lettered copies.

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
        progress_interval: Duration = timedelta(seconds=10),
        max_deliver: int | None = None,
        dead_letter_subject: str | None = None,
        jetstream: JetStreamContext | None = None,
    ) -> None:
        if dead_letter_subject is not None and jetstream is None:
            raise ConfigurationError("dead_letter_subject needs jetstream= to publish with")
        if max_deliver is not None and max_deliver < 1:
            raise ConfigurationError(f"max_deliver must be 1 or more, not {max_deliver}")
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
        self.progress_interval = to_timedelta(progress_interval, "progress_interval")
        self.max_deliver = max_deliver
        self.dead_letter_subject = dead_letter_subject
        self.jetstream = jetstream
        functools.update_wrapper(self, handler)
        mark_coroutine_function(self)

    @property
    def stats(self) -> ConsumerStats:
        """Counters of verdicts (processed, duplicate, in_progress...)."""
        return self.consumer.stats

    async def __call__(self, msg: Msg) -> Verdict:
        """Process one delivery and ack, nak or term it; return the verdict."""
        return await self._settle(msg, await self._process(msg))

    async def callback(self, msg: Msg) -> None:
        """`__call__` as a coroutine function: what nats-py's ``subscribe(cb=...)`` accepts."""
        await self(msg)

    async def _process(self, msg: Msg) -> Verdict:
        return await self.consumer.aprocess(self._delivery(msg), functools.partial(self._run, msg))

    async def _settle(self, msg: Msg, verdict: Verdict) -> Verdict:
        """Ack, nak or term *msg* as *verdict* says; return the verdict that decided it."""
        while verdict.reason in _ELSEWHERE and self._last_delivery(msg):
            # Never redelivered after a nak, and term() would drop it while the other copy may
            # still fail: hold it, and ask again once the other worker may be done.
            await self._hold(msg, verdict)
            verdict = await self._process(msg)
        action = verdict.action
        if action is Action.RETRY and self._last_delivery(msg):
            logger.error(
                "message dead-lettered: key=%s reached max_deliver",
                verdict.key,
                extra=fields(key=verdict.key, attempt=verdict.attempt, outcome="dead_lettered"),
            )
            action = Action.DEAD_LETTER
        if action is Action.ACK:
            await msg.ack()
        elif action is Action.DEAD_LETTER:
            await self._dead_letter(msg, verdict)
        elif verdict.delay is not None:
            await msg.nak(delay=seconds(verdict.delay))
        else:
            await msg.nak()
        return verdict

    async def _hold(self, msg: Msg, verdict: Verdict) -> None:
        """Keep *msg* from redelivery for the verdict's delay (at most `progress_interval`)."""
        try:
            await msg.in_progress()
        except Exception as exc:  # ack_wait decides; the next decision may still get through
            logger.warning("in_progress failed for %s: %s", msg.subject, exc)
        delay = verdict.delay if verdict.delay is not None else self.consumer.policy.retry_delay
        await asyncio.sleep(min(seconds(delay), seconds(self.progress_interval)))

    async def batch(self, msgs: Sequence[Msg]) -> list[Verdict]:
        """Process a fetched batch (a pull subscription's ``fetch``) and settle each message.

        With a store that has the batch verbs, the batch's keys are claimed in one call, the
        handlers run concurrently, and each message is completed as its handler returns, the
        completions grouped into batch calls (see
        `oncely.consumers.IdempotentConsumer.batch_flow`). Without them the messages run one
        after the other. Either way the messages are acked once the batch is decided, and until
        then one ``in_progress()`` beat every *progress_interval* holds all of them, those whose
        handler is done (or yet to start) too.

        Returns:
            One verdict per message, in order.
        """
        self.consumer._required(AsyncStore)  # raises before the first beat
        deliveries = [self._delivery(msg) for msg in msgs]
        async with self._progress(msgs):  # one beat for the batch, not a timer per message
            verdicts = await self.consumer.aprocess_batch(deliveries, self.handler)
        # Acks are buffered publishes: no task each.
        return [
            await self._settle(msg, verdict) for msg, verdict in zip(msgs, verdicts, strict=True)
        ]

    def _delivery(self, msg: Msg) -> Delivery:
        headers = dict(msg.headers or {})
        consumer = self.consumer
        if reads_message_id(consumer.key, consumer.key_headers, consumer.fingerprint, headers):
            return Delivery(msg.data, headers, _message_id(msg), raw=msg)
        return Delivery(msg.data, headers, None, raw=msg)  # the key is in a header: no parse

    def _last_delivery(self, msg: Msg) -> bool:
        if self.max_deliver is None:
            return False
        try:
            return bool(msg.metadata.num_delivered >= self.max_deliver)
        except Exception:  # not a JetStream message
            return False

    async def _run(self, msg: Msg) -> Any:
        async with self._progress((msg,)):
            return await self.handler(msg)

    @contextlib.asynccontextmanager
    async def _progress(self, msgs: Sequence[Msg]) -> AsyncIterator[None]:
        """Send ``in_progress()`` for *msgs* every `progress_interval` while the block runs.

        The first beat is a timer, not a task: blocks shorter than the interval (most
        handlers) cost no task to start and cancel.
        """
        loop = asyncio.get_running_loop()
        beat: asyncio.Task[None] | None = None

        def start() -> None:
            nonlocal beat
            beat = loop.create_task(self._beats(msgs))

        timer = loop.call_later(seconds(self.progress_interval), start)
        try:
            yield
        finally:
            timer.cancel()
            if beat is not None:
                beat.cancel()
                await asyncio.wait((beat,))  # raises only a cancellation of this task

    async def _beats(self, msgs: Sequence[Msg]) -> None:
        interval = seconds(self.progress_interval)
        while True:
            for msg in msgs:
                try:
                    await msg.in_progress()
                except Exception as exc:  # the next beat may get through; ack_wait decides
                    logger.warning("in_progress failed for %s: %s", msg.subject, exc)
            await asyncio.sleep(interval)

    async def _dead_letter(self, msg: Msg, verdict: Verdict) -> None:
        if self.dead_letter_subject is not None and self.jetstream is not None:
            headers = dict(msg.headers or {})
            reason, subject, sequence = DEAD_LETTER_HEADERS
            headers[reason] = str(verdict.reason)
            headers[subject] = msg.subject
            with contextlib.suppress(Exception):
                headers[sequence] = str(msg.metadata.sequence.stream)
            # Published before term(): if the publish fails, the message is redelivered.
            await self.jetstream.publish(self.dead_letter_subject, msg.data, headers=headers)
        await msg.term()


def idempotent_handler(
    store: AsyncStore,
    *,
    group: str | None = None,
    policy: ConsumerPolicy | None = None,
    key: KeySource = "header",
    key_headers: tuple[str, ...] = KEY_HEADERS,
    fingerprint: FingerprintSource = "body",
    codec: Codec | None = None,
    progress_interval: Duration = timedelta(seconds=10),
    max_deliver: int | None = None,
    dead_letter_subject: str | None = None,
    jetstream: JetStreamContext | None = None,
) -> Callable[[MessageHandler], IdempotentHandler]:
    """Decorate a nats-py callback so each message takes effect once (see `IdempotentHandler`).

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
            progress_interval=progress_interval,
            max_deliver=max_deliver,
            dead_letter_subject=dead_letter_subject,
            jetstream=jetstream,
        )

    return decorate
