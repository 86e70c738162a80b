"""Publish outbox events to NATS JetStream (nats-py), each acknowledged by its stream.

.. code-block:: python

    from oncely.outbox.nats import NATSPublisher

    publisher = NATSPublisher.from_url("nats://localhost:4222")
    outcomes = await publisher.publish(events)   # one outcome per event: None once acked

An event's ``destination`` is the subject; a stream must capture it (a subject no stream takes
answers an error outcome, ``NoStreamResponseError``). Messages carry the event's headers and its
``message_id`` twice: as ``Nats-Msg-Id``, so JetStream drops a re-publish within the stream's
duplicate window (two minutes by default), and as the ``Idempotency-Key`` header that
`oncely.consumers.nats` takes as the key, which catches what the window does not. Messages are
published back to back on one connection (one subject's messages are stored in that order) and
their acknowledgements awaited together.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

from oncely._deps import require
from oncely.consumers import producer
from oncely.errors import ConfigurationError
from oncely.outbox._event import OutboxEvent, Outcome
from oncely.outbox._publishing import check_options, masked, positive, publish_ordered

__all__ = ["NATSPublisher"]

_SCHEMES = ("nats", "tls", "ws", "wss")

_MAX_PENDING = 4000
"""Messages awaiting their ack at once (nats-py's default); more wait for a free slot."""

_CONNECT_DEFAULTS: dict[str, Any] = {
    "allow_reconnect": False,
    "max_reconnect_attempts": 1,  # 0 means forever to nats-py: two tries per server
    "reconnect_time_wait": 0.5,
}


class NATSPublisher:
    """Publishes events to JetStream and waits for their acks (see the module's docstring).

    Build it with `from_url`; it connects on the first `publish`, and again on the next one
    after its connection was closed.

    .. versionadded:: 0.1.0
    """

    def __init__(
        self,
        servers: list[str],
        *,
        timeout: float | None = 30.0,
        connect_options: dict[str, Any] | None = None,
    ) -> None:
        self.servers = servers
        self.timeout = timeout
        self._proven: set[str] = set()  # destinations confirmed once
        self._connect_options = connect_options or {}
        self._client: Any = None
        self._jetstream: Any = None
        self._awaiting: set[asyncio.Future[Any]] = set()  # acks not yet received
        self._lock = asyncio.Lock()

    @classmethod
    def from_url(
        cls, url: str, *, timeout: float | None = 30.0, **connect_options: Any
    ) -> NATSPublisher:
        """Return a publisher for ``nats://[user:password@]host:port[,host:port…]`` (or
        ``tls://``, ``ws://``, ``wss://``), without connecting.

        Args:
            url: The servers; those after the first may leave out the scheme.
            timeout: Seconds to wait for the acknowledgements of one `publish` call.
            **connect_options: Passed to `nats.connect` (``name``, ``tls``, ``user_credentials``,
                ``connect_timeout``...). Reconnecting is left to the next publish
                (``allow_reconnect=False``, ``max_reconnect_attempts=1``): a publish fails in
                about a second when no server answers, rather than after nats-py's two
                minutes of retries.

        Raises:
            ConfigurationError: The URL or an option is malformed.
            MissingDependencyError: nats-py is not installed (``oncely[nats]``).
        """
        scheme = url.partition("://")[0]
        if "://" not in url or scheme not in _SCHEMES:
            raise ConfigurationError(
                f"a NATS URL starts with nats://, tls://, ws:// or wss://, not {masked(url)!r}"
            )
        servers = [s if "://" in s else f"{scheme}://{s}" for s in url.split(",")]
        for server in servers:
            parts = urlsplit(server)
            try:
                parts.port  # noqa: B018 - raises for a malformed port
            except ValueError as exc:
                raise ConfigurationError(f"malformed NATS URL {masked(url)!r}: {exc}") from exc
            if parts.scheme not in _SCHEMES or not parts.hostname or parts.path not in ("", "/"):
                raise ConfigurationError(
                    f"a NATS URL names each server as [scheme://]host[:port], not "
                    f"{masked(server)!r}"
                )
        require("nats", extra="nats")
        client = require("nats.aio.client", extra="nats").Client
        check_options(client.connect, {"servers": (), **connect_options}, "nats.connect")
        for option, value in _CONNECT_DEFAULTS.items():
            connect_options.setdefault(option, value)
        return cls(servers, timeout=positive(timeout, "timeout"), connect_options=connect_options)

    async def publish(self, events: Sequence[OutboxEvent]) -> Sequence[Outcome]:
        """Publish *events*; return one outcome per event (see `oncely.outbox.Publisher`).

        Raises:
            NoServersError: Or another driver error: no server can be reached.
        """
        if not events:
            return []
        jetstream = await self._connected()

        async def send(event: OutboxEvent) -> Awaitable[Any]:
            # A bounded wait for a free slot costs nats-py a task per message: only when full.
            full = jetstream.publish_async_pending() >= _MAX_PENDING
            acked: asyncio.Future[Any] = await jetstream.publish_async(
                event.destination,
                event.payload,
                wait_stall=self.timeout if full else None,
                headers=producer.nats_headers(event.message_id, event.headers),
            )
            self._awaiting.add(acked)
            acked.add_done_callback(self._awaiting.discard)
            return acked

        return await publish_ordered(events, send, timeout=self.timeout, proven=self._proven)

    async def _connected(self) -> Any:
        async with self._lock:
            if self._client is None or self._client.is_closed:
                nats = require("nats", extra="nats")
                options = dict(self._connect_options)
                for name in ("disconnected_cb", "closed_cb"):
                    options[name] = self._on_lost(options.get(name))
                self._client = await nats.connect(self.servers, **options)
                self._jetstream = self._client.jetstream(publish_async_max_pending=_MAX_PENDING)
            return self._jetstream

    def _on_lost(self, then: Callable[[], Awaitable[None]] | None) -> Callable[[], Awaitable[None]]:
        """A connection callback failing the acks still awaited (nats-py would leave them
        pending until the call's timeout), then calling the application's own *then*."""

        async def lost() -> None:
            for acked in list(self._awaiting):
                if not acked.done():
                    acked.set_exception(ConnectionError("the NATS connection was lost"))
            if then is not None:
                await then()

        return lost

    async def aclose(self) -> None:
        """Close the connection (the next `publish` opens a new one)."""
        async with self._lock:
            client, self._client = self._client, None
            self._jetstream = None
            if client is not None and not client.is_closed:
                await client.close()

    def __repr__(self) -> str:
        return f"NATSPublisher({[masked(server) for server in self.servers]!r})"
