"""Publish outbox events to Kafka (aiokafka), each acknowledged by all in-sync replicas.

.. code-block:: python

    from oncely.outbox.kafka import KafkaPublisher

    publisher = KafkaPublisher.from_url("kafka://broker-1:9092,broker-2:9092")
    outcomes = await publisher.publish(events)   # one outcome per event: None once acked

An event's ``destination`` is the topic and its ``ordering_key`` the record's key, so the events
of one key land in one partition, in order: aiokafka keeps one request in flight per
partition, retries included. Records carry the event's headers and its ``message_id`` as the
``Idempotency-Key`` header, what `oncely.consumers.kafka` takes as the key. The producer waits
for ``acks=all``; records are sent back to back and their acknowledgements awaited together.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Any
from urllib.parse import urlsplit

from oncely._deps import require
from oncely.consumers import producer
from oncely.errors import ConfigurationError
from oncely.outbox._event import OutboxEvent, Outcome
from oncely.outbox._publishing import check_options, positive, publish_ordered

__all__ = ["KafkaPublisher"]

_FORCED = ("acks", "bootstrap_servers", "enable_idempotence", "loop")


class KafkaPublisher:
    """Publishes events to Kafka with ``acks=all`` (see the module's docstring).

    Build it with `from_url`; it starts its producer on the first `publish`, and a new one on
    the next call after the producer failed to start.

    .. versionadded:: 0.1.0
    """

    def __init__(
        self,
        bootstrap_servers: list[str],
        *,
        idempotent: bool = False,
        timeout: float | None = 30.0,
        producer_options: dict[str, Any] | None = None,
    ) -> None:
        self.bootstrap_servers = bootstrap_servers
        self.idempotent = idempotent
        self.timeout = timeout
        self._proven: set[str] = set()  # destinations confirmed once
        self._options = producer_options or {}
        self._producer: Any = None
        self._lock = asyncio.Lock()

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        idempotent: bool = False,
        timeout: float | None = 30.0,
        **producer_options: Any,
    ) -> KafkaPublisher:
        """Return a publisher for ``kafka://host:port[,host:port…]``, without connecting.

        Args:
            url: The bootstrap servers.
            idempotent: Use Kafka's idempotent producer, so the producer's own retries never
                write a record twice. Needs a broker that grants producer ids to aiokafka
                (Apache Kafka 0.11 or later); some Kafka-protocol brokers (tansu) refuse it.
                Without it a retried request may write a record twice, which the consumer's
                record of the ``Idempotency-Key`` makes harmless.
            timeout: Seconds to wait for the acknowledgements of one `publish` call.
            **producer_options: Passed to `aiokafka.AIOKafkaProducer` (security settings,
                ``linger_ms``, ``compression_type``, ``max_request_size``...), except
                ``acks`` and ``bootstrap_servers``.

        Raises:
            ConfigurationError: The URL or an option is malformed.
            MissingDependencyError: aiokafka is not installed (``oncely[kafka]``).
        """
        parts = urlsplit(url)
        if parts.scheme != "kafka":
            raise ConfigurationError(f"a Kafka URL starts with kafka://, not {url!r}")
        if parts.path not in ("", "/") or parts.query or parts.fragment or "@" in parts.netloc:
            raise ConfigurationError(f"a Kafka URL is kafka://host:port[,host:port], not {url!r}")
        servers = [server.strip() for server in parts.netloc.split(",")]
        for server in servers:
            host, colon, port = server.rpartition(":")
            if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigurationError(
                    f"a Kafka URL names each server as host:port, not {server!r} in {url!r}"
                )
        forced = sorted(set(producer_options) & set(_FORCED))
        if forced:
            raise ConfigurationError(
                f"KafkaPublisher sets {', '.join(forced)} itself (acks=all, servers from the URL)"
            )
        aiokafka = require("aiokafka", extra="kafka")
        check_options(aiokafka.AIOKafkaProducer, producer_options, "aiokafka.AIOKafkaProducer")
        return cls(
            servers,
            idempotent=idempotent,
            timeout=positive(timeout, "timeout"),
            producer_options=producer_options,
        )

    async def publish(self, events: Sequence[OutboxEvent]) -> Sequence[Outcome]:
        """Publish *events*; return one outcome per event (see `oncely.outbox.Publisher`).

        Raises:
            KafkaConnectionError: Or another driver error: the producer could not start.
        """
        if not events:
            return []
        client = await self._started()

        async def send(event: OutboxEvent) -> Awaitable[Any]:
            key = None if event.ordering_key is None else event.ordering_key.encode()
            headers = producer.kafka_headers(event.message_id, event.headers)
            # Waits only to enqueue (metadata, buffer space); raises for a record too large.
            sent: Awaitable[Any] = await client.send(
                event.destination, event.payload, key=key, headers=headers
            )
            return sent

        return await publish_ordered(events, send, timeout=self.timeout, proven=self._proven)

    async def _started(self) -> Any:
        async with self._lock:
            if self._producer is None:
                aiokafka = require("aiokafka", extra="kafka")
                client = aiokafka.AIOKafkaProducer(
                    bootstrap_servers=self.bootstrap_servers,
                    acks="all",
                    enable_idempotence=self.idempotent,
                    **self._options,
                )
                try:
                    await client.start()
                except BaseException:
                    await client.stop()
                    raise
                self._producer = client
            return self._producer

    async def aclose(self) -> None:
        """Flush and stop the producer (the next `publish` starts a new one)."""
        async with self._lock:
            client, self._producer = self._producer, None
            if client is not None:
                await client.stop()

    def __repr__(self) -> str:
        return f"KafkaPublisher({','.join(self.bootstrap_servers)!r})"
