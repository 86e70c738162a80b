"""`Outbox`: events written in the caller's own transaction, next to its writes."""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any

from oncely import _events, _observed
from oncely._core.keys import validate_key
from oncely.errors import ConfigurationError, ConflictError
from oncely.outbox._store import NewEvent, backend_for

__all__ = ["Outbox"]

_MAX_NAME = 1024
"""The longest destination or ordering key accepted (brokers cap theirs lower still)."""

_RESERVED_HEADER = "idempotency-key"


class Outbox:
    """Store events in the caller's own transaction; a `Relay` publishes the committed ones.

    .. code-block:: python

        outbox = oncely.Outbox(store)        # a PostgreSQL or SQLite store: its database

        with connection.transaction():       # the application's own transaction (psycopg)
            connection.execute("INSERT INTO orders ...")
            outbox.add(connection, "orders.placed", body, ordering_key=order_id)

    The event commits or rolls back with the transaction: a rolled-back order publishes
    nothing, a committed one is published even if the process dies right after the commit.
    Events of one ``ordering_key`` to one destination are published in commit order. Each
    carries its ``message_id`` as the idempotency key an oncely consumer reads, so a
    re-publish (after a relay crash) takes effect once.

    Connections: as for `oncely.Inbox`: psycopg 3 (`aadd` for ``psycopg.AsyncConnection``),
    ``sqlite3`` (in a transaction), SQLAlchemy sessions and connections (async ones with
    `aadd`), Django's connection inside ``transaction.atomic()``. oncely never commits or rolls
    back the caller's transaction.

    Args:
        store: The `PostgresStore` or `SQLiteStore` of the database the caller writes to; its
            ``migrate()`` creates the outbox tables next to the records.
        notify: On PostgreSQL, ``NOTIFY`` the relays when the transaction commits, so they
            publish at once rather than at their next poll.

    Raises:
        ConfigurationError: The store keeps its records in no SQL database, or in memory.

    .. versionadded:: 0.1.0
    """

    def __init__(self, store: Any, *, notify: bool = True) -> None:
        self._backend = backend_for(store, "the outbox")
        self.store = store
        self.notify = notify

    def add(
        self,
        connection: Any,
        destination: str,
        payload: bytes | str,
        *,
        headers: Mapping[str, str] | None = None,
        ordering_key: str | None = None,
        message_id: str | None = None,
    ) -> str:
        """Store an event in *connection*'s open transaction; return its message id.

        Args:
            connection: The caller's connection or session, inside its transaction.
            destination: Where the relay's publisher sends it: a queue or routing key, a
                topic, a subject, a stream.
            payload: The message body (a ``str`` is encoded as UTF-8).
            headers: Application headers (strings), sent with the message.
            ordering_key: Events with the same key and destination are published in the order
                their transactions committed (the Kafka message key, say). ``None``: no order.
            message_id: The event's stable id, sent as its idempotency key; unique in the
                outbox. By default a fresh UUID.

        Raises:
            ConfigurationError: A bad destination, payload, header or ordering key, or no
                transaction open on *connection*.
            InvalidKeyError: A message id that cannot be an idempotency key.
            ConflictError: The message id is in the outbox already (the transaction stays
                usable).
        """
        if _events.on:
            headers = _observed.outbox_headers(destination, headers)
        event = _event(destination, payload, headers, ordering_key, message_id)
        return _added(event, self._backend.add(connection, event, notify=self.notify))

    async def aadd(
        self,
        connection: Any,
        destination: str,
        payload: bytes | str,
        *,
        headers: Mapping[str, str] | None = None,
        ordering_key: str | None = None,
        message_id: str | None = None,
    ) -> str:
        """`add` for an async connection or session (psycopg's, or SQLAlchemy's over it)."""
        if _events.on:
            headers = _observed.outbox_headers(destination, headers)
        event = _event(destination, payload, headers, ordering_key, message_id)
        return _added(event, await self._backend.aadd(connection, event, notify=self.notify))


def _event(
    destination: object,
    payload: object,
    headers: Mapping[str, str] | None,
    ordering_key: object,
    message_id: object,
) -> NewEvent:
    """Validate an event before it touches the database."""
    _check_name("destination", destination)
    if ordering_key is not None:
        _check_name("ordering_key", ordering_key)
    if isinstance(payload, str):
        payload = payload.encode()
    elif isinstance(payload, (bytearray, memoryview)):
        payload = bytes(payload)
    elif not isinstance(payload, bytes):
        raise ConfigurationError(f"an outbox payload is bytes or str, not {type(payload).__name__}")
    return NewEvent(
        message_id=str(uuid.uuid4()) if message_id is None else validate_key(message_id),
        destination=destination,  # type: ignore[arg-type]  # checked
        payload=payload,
        headers=_headers(headers),
        ordering_key=ordering_key,  # type: ignore[arg-type]  # checked
    )


def _check_name(what: str, value: object) -> None:
    if not isinstance(value, str):
        raise ConfigurationError(f"an outbox {what} is a string, not {type(value).__name__}")
    if not value or len(value) > _MAX_NAME or "\x00" in value:
        raise ConfigurationError(
            f"an outbox {what} must be 1 to {_MAX_NAME} characters without NUL, not {value!r:.80}"
        )


def _headers(headers: Mapping[str, str] | None) -> str:
    if headers is None:
        return "{}"
    if not isinstance(headers, Mapping):
        raise ConfigurationError(
            f"outbox headers are a mapping of strings, not {type(headers).__name__}"
        )
    for name, value in headers.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise ConfigurationError(
                f"outbox headers map strings to strings, not {name!r}: {value!r:.80}"
            )
        if not name or "\x00" in name or "\x00" in value:
            raise ConfigurationError(f"bad outbox header {name!r}: empty, or holding NUL")
        if name.lower() == _RESERVED_HEADER:
            raise ConfigurationError(
                "the Idempotency-Key header is the event's message id: pass message_id= instead"
            )
    return json.dumps(dict(headers), separators=(",", ":"), ensure_ascii=False)


def _added(event: NewEvent, added: bool) -> str:
    if not added:
        raise ConflictError(
            f"message id {event.message_id!r} is in the outbox already", key=event.message_id
        )
    return event.message_id
