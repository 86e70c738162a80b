"""Publish outbox events to Redis Streams (redis.asyncio), one pipelined XADD each.

.. code-block:: python

    from oncely.outbox.redis_streams import RedisStreamsPublisher

    publisher = RedisStreamsPublisher.from_url("redis://localhost:6379/0", maxlen=100_000)
    outcomes = await publisher.publish(events)   # one outcome per event: None once added

An event's ``destination`` is the stream's key. Each event becomes one entry whose ``body``
field is the payload, with one more field per header and the ``Idempotency-Key`` field holding
the event's ``message_id``: the fields `oncely.consumers.redis_streams` reads (a header named
``body`` or like the key field is refused, as that consumer would misread it). One call's
entries go in one pipeline, in order, so a stream gets one key's events in commit order; the
server's reply to ``XADD`` is the confirmation (how durable it is depends on the server's
``appendonly`` and ``appendfsync``). Redis Streams drop no duplicates: the consumer's record of
the key does.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Any

from oncely._deps import require
from oncely.consumers import producer
from oncely.errors import ConfigurationError
from oncely.outbox._event import NOT_ATTEMPTED, OutboxEvent, Outcome, Scope, in_order, scope
from oncely.outbox._publishing import check_options, masked, positive, publish_ordered

__all__ = ["RedisStreamsPublisher"]

_RESERVED = frozenset({"body", producer.KEY_HEADER.lower()})
"""Header names that would collide with the fields the consumer reads."""


class RedisStreamsPublisher:
    """Adds events to Redis streams (see the module's docstring).

    Build it with `from_url`; the client connects on the first `publish`, and again after a
    lost connection.

    .. versionadded:: 0.1.0
    """

    def __init__(
        self,
        url: str,
        *,
        maxlen: int | None = None,
        timeout: float | None = 30.0,
        client_options: dict[str, Any] | None = None,
    ) -> None:
        self.url = url
        self.maxlen = maxlen
        self.timeout = timeout
        self._proven: set[str] = set()  # destinations confirmed once
        self._client_options = client_options or {}
        self._client: Any = None

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        maxlen: int | None = None,
        timeout: float | None = 30.0,
        **client_options: Any,
    ) -> RedisStreamsPublisher:
        """Return a publisher for ``redis://[[user]:password@]host[:port][/db]`` (or
        ``rediss://``, ``unix://``), without connecting.

        Args:
            url: The server's URL, with redis-py's query parameters if any.
            maxlen: Trim each stream to about this many entries as entries are added
                (``MAXLEN ~``): entries past it may be dropped before a slow consumer reads
                them. ``None`` keeps them all.
            timeout: Seconds to wait for the replies of one `publish` call.
            **client_options: Passed to `redis.asyncio.Redis.from_url`. ``retry`` defaults to
                none: a relay retries a failed call itself, later.

        Raises:
            ConfigurationError: The URL or an option is malformed.
            MissingDependencyError: redis-py is not installed (``oncely[redis]``).
        """
        if maxlen is not None and (
            isinstance(maxlen, bool) or not isinstance(maxlen, int) or maxlen < 1
        ):
            raise ConfigurationError(f"maxlen must be a positive int or None, not {maxlen!r}")
        redis = require("redis.asyncio", extra="redis")
        try:
            redis.connection.parse_url(url)
        except ValueError as exc:
            raise ConfigurationError(f"malformed Redis URL {masked(url)!r}: {exc}") from exc
        check_options(redis.Redis, client_options, "redis.asyncio.Redis")
        client_options.setdefault("retry", None)
        return cls(
            url,
            maxlen=maxlen,
            timeout=positive(timeout, "timeout"),
            client_options=client_options,
        )

    async def publish(self, events: Sequence[OutboxEvent]) -> Sequence[Outcome]:
        """Publish *events*; return one outcome per event (see `oncely.outbox.Publisher`).

        Raises:
            ConnectionError: Or the driver's error: the server cannot be reached.
        """
        if not events:
            return []
        if self._client is None:
            redis = require("redis.asyncio", extra="redis")
            self._client = redis.Redis.from_url(self.url, **self._client_options)
        client = self._client
        maxlen = {"maxlen": self.maxlen, "approximate": True} if self.maxlen else {}
        if all(event.destination in self._proven for event in events):
            return await self._pipelined(client, events, maxlen)
        queued: list[tuple[str, dict[str, Any], asyncio.Future[Any]]] = []

        async def send(event: OutboxEvent) -> Awaitable[Any]:
            fields = producer.redis_fields(event.message_id, _fields(event))
            reply: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            queued.append((event.destination, fields, reply))
            return reply

        async def flush() -> None:  # the entries queued, in one round trip, in order
            batch = queued[:]
            queued.clear()
            if not batch:
                return
            async with client.pipeline(transaction=False) as pipeline:
                for stream, fields, _ in batch:
                    pipeline.xadd(stream, fields, **maxlen)
                answers = await pipeline.execute(raise_on_error=False)
            for (_, _, reply), answer in zip(batch, answers, strict=True):
                if isinstance(answer, Exception):
                    reply.set_exception(answer)
                else:
                    reply.set_result(answer)

        return await publish_ordered(
            events, send, timeout=self.timeout, proven=self._proven, flush=flush
        )

    async def _pipelined(
        self, client: Any, events: Sequence[OutboxEvent], maxlen: dict[str, Any]
    ) -> list[Outcome]:
        """*events*, all to proven streams, in one pipeline: what `publish_ordered` does for
        them, without a future per event. An event refused before it is sent stops its
        scope's later events here; one the server refuses makes them `NOT_ATTEMPTED`."""
        outcomes: list[Outcome] = [None] * len(events)
        sent: list[int] = []
        stopped: set[Scope] = set()
        async with client.pipeline(transaction=False) as pipeline:
            for index, event in enumerate(events):
                where = scope(event)
                if where is not None and where in stopped:
                    outcomes[index] = NOT_ATTEMPTED
                    continue
                try:
                    fields = producer.redis_fields(event.message_id, _fields(event))
                except Exception as exc:
                    outcomes[index] = exc
                    if where is not None:
                        stopped.add(where)
                    continue
                pipeline.xadd(event.destination, fields, **maxlen)
                sent.append(index)
            answers = await pipeline.execute(raise_on_error=False) if sent else []
        for index, answer in zip(sent, answers, strict=True):
            if isinstance(answer, Exception):
                outcomes[index] = answer
        return in_order(events, outcomes)

    async def aclose(self) -> None:
        """Close the client's connections (the next `publish` opens new ones)."""
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    def __repr__(self) -> str:
        return f"RedisStreamsPublisher({masked(self.url)!r})"


def _fields(event: OutboxEvent) -> dict[str, Any]:
    for name in event.headers:
        if name.lower() in _RESERVED:
            raise ConfigurationError(
                f"a Redis stream entry cannot carry a header named {name!r}: the consumer "
                "reads that field as the body or the key"
            )
    return {"body": event.payload, **event.headers}
