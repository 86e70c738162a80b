"""Publish outbox events to RabbitMQ (aio-pika), each confirmed by the broker.

.. code-block:: python

    from oncely.outbox.rabbitmq import RabbitMQPublisher

    publisher = RabbitMQPublisher.from_url("amqp://guest:guest@localhost:5672/")
    outcomes = await publisher.publish(events)   # one outcome per event: None once confirmed

An event's ``destination`` is a routing key on the default exchange (so: a queue's name), or
``exchange/routing_key``; the routing key is everything after the first ``/`` (``/a/b`` is the
routing key ``a/b`` on the default exchange). Messages are persistent, published with
``mandatory`` (one no queue takes comes back as an error, rather than being confirmed and
dropped) on one channel in publisher-confirm mode, their confirmations awaited together. The
message's AMQP ``message_id`` and its ``Idempotency-Key`` header are the event's
``message_id``: what `oncely.consumers.rabbitmq` takes as the key.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Sequence
from typing import Any
from urllib.parse import urlsplit

from oncely._deps import require
from oncely.consumers import producer
from oncely.errors import ConfigurationError
from oncely.outbox._event import OutboxEvent, Outcome
from oncely.outbox._publishing import check_options, masked, positive, publish_ordered

__all__ = ["RabbitMQPublisher"]

_PERSISTENT = 2
_TRANSIENT = 1


class RabbitMQPublisher:
    """Publishes events to RabbitMQ with publisher confirms (see the module's docstring).

    Build it with `from_url`; it connects on the first `publish`, and again on the next one
    after its connection was lost.

    .. versionadded:: 0.1.0
    """

    def __init__(
        self,
        url: str,
        *,
        persistent: bool = True,
        mandatory: bool = True,
        timeout: float | None = 30.0,
        connect_options: dict[str, Any] | None = None,
    ) -> None:
        self.url = url
        self.persistent = persistent
        self.mandatory = mandatory
        self.timeout = timeout
        self._proven: set[str] = set()  # destinations confirmed once
        self._connect_options = connect_options or {}
        self._connection: Any = None
        self._channel: Any = None  # aio-pika's, in confirm mode
        self._probe: Any = None  # where exchanges are checked: a missing one closes it
        self._exchanges: set[str] = set()  # known to exist on this connection
        self._lock = asyncio.Lock()

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        persistent: bool = True,
        mandatory: bool = True,
        timeout: float | None = 30.0,
        **connect_options: Any,
    ) -> RabbitMQPublisher:
        """Return a publisher for ``amqp://user:password@host:port/vhost`` (or ``amqps://``),
        without connecting.

        Args:
            url: The broker's URL, with aio-pika's query parameters if any.
            persistent: Publish persistent messages (delivery mode 2): durable queues keep them
                across a broker restart.
            mandatory: Have the broker return a message no queue takes, as an error outcome.
                Turn it off for exchanges where an unrouted event is fine (a fanout nobody
                listens to yet).
            timeout: Seconds to wait for the confirmations of one `publish` call.
            **connect_options: Passed to `aio_pika.connect` (``timeout``, ``ssl_context``,
                ``client_properties``...); connection parameters such as ``heartbeat`` go in
                the URL's query.

        Raises:
            ConfigurationError: The URL or an option is malformed.
            MissingDependencyError: aio-pika is not installed (``oncely[rabbitmq]``).
        """
        parts = urlsplit(url)
        if parts.scheme not in ("amqp", "amqps"):
            raise ConfigurationError(
                f"a RabbitMQ URL starts with amqp:// or amqps://, not {masked(url)!r}"
            )
        try:
            parts.port  # noqa: B018 - raises for a malformed port
        except ValueError as exc:
            raise ConfigurationError(f"malformed RabbitMQ URL {masked(url)!r}: {exc}") from exc
        if not parts.hostname:
            raise ConfigurationError(f"the RabbitMQ URL {masked(url)!r} names no host")
        aio_pika = require("aio_pika", extra="rabbitmq")
        check_options(aio_pika.connect, connect_options, "aio_pika.connect")
        return cls(
            url,
            persistent=persistent,
            mandatory=mandatory,
            timeout=positive(timeout, "timeout"),
            connect_options=connect_options,
        )

    async def publish(self, events: Sequence[OutboxEvent]) -> Sequence[Outcome]:
        """Publish *events*; return one outcome per event (see `oncely.outbox.Publisher`).

        Raises:
            ConnectionError: Or the driver's error: the broker cannot be reached.
        """
        if not events:
            return []
        channel = await self._connected()
        underlay = await channel.get_underlay_channel()

        async def send(event: OutboxEvent) -> Awaitable[Any]:
            exchange, routing_key = _split(event.destination)
            if exchange:
                await self._check_exchange(exchange)
            message = producer.amqp_message(
                event.payload,
                event.message_id,
                headers=event.headers,
                delivery_mode=_PERSISTENT if self.persistent else _TRANSIENT,
            )
            # Started in call order: aiormq writes them in the order they take its lock.
            confirm: asyncio.Future[Any] = asyncio.ensure_future(
                underlay.basic_publish(
                    message.body,
                    exchange=exchange,
                    routing_key=routing_key,
                    properties=message.properties,
                    mandatory=self.mandatory,
                )
            )
            return confirm

        try:
            return await publish_ordered(events, send, timeout=self.timeout, proven=self._proven)
        finally:
            if channel.is_closed:  # by the broker (an exchange deleted meanwhile): a new one
                self._channel = None

    async def _connected(self) -> Any:
        async with self._lock:
            connection = self._connection
            # A connection the broker dropped is not `is_closed` (that is close()), only
            # no longer `connected`.
            if connection is None or connection.is_closed or not connection.connected.is_set():
                await self._drop()
                aio_pika = require("aio_pika", extra="rabbitmq")
                self._connection = await aio_pika.connect(self.url, **self._connect_options)
            if self._channel is None or self._channel.is_closed:
                self._channel = await self._connection.channel(
                    publisher_confirms=True, on_return_raises=True
                )
            return self._channel

    async def _check_exchange(self, name: str) -> None:
        """Raise if exchange *name* does not exist; publishing to it would close the channel
        and fail every message in flight on it."""
        if name in self._exchanges:
            return
        if self._probe is None or self._probe.is_closed:
            self._probe = await self._connection.channel(publisher_confirms=False)
        await self._probe.declare_exchange(name, passive=True)
        self._exchanges.add(name)

    async def _drop(self) -> None:
        connection, self._connection = self._connection, None
        self._channel = self._probe = None
        self._exchanges.clear()
        if connection is not None and not connection.is_closed:
            with contextlib.suppress(Exception):  # the broker may have dropped it already
                await connection.close()

    async def aclose(self) -> None:
        """Close the connection (the next `publish` opens a new one)."""
        async with self._lock:
            await self._drop()

    def __repr__(self) -> str:
        return f"RabbitMQPublisher({masked(self.url)!r})"


def _split(destination: str) -> tuple[str, str]:
    """``exchange/routing_key``, or a routing key on the default exchange."""
    exchange, slash, routing_key = destination.partition("/")
    return (exchange, routing_key) if slash else ("", destination)
