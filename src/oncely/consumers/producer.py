"""Stamp the idempotency key on outgoing messages, so one key crosses HTTP → broker → consumer.

An HTTP handler that received ``Idempotency-Key: 8e03978e`` and publishes an event passes the
same key on; the consumer reads it from the header (``key="header"``, the default of every
adapter) and a client's retry, the broker's redelivery and a producer's re-publish all collapse
into one effect downstream.

.. code-block:: python

    from oncely.consumers import producer

    def create_order(request):                       # the HTTP side
        key = request.headers["Idempotency-Key"]
        kafka.produce("orders", body, headers=producer.kafka_headers(key))
        # one request, several messages: give each its own, still stable, key
        kafka.produce("emails", mail, headers=producer.kafka_headers(producer.derive(key, "mail")))

Every helper validates the key (quoted structured-field strings, as HTTP clients send them, are
unquoted) and returns plain values the broker's client accepts; only `amqp_message` imports a
driver.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from oncely._deps import require
from oncely.consumers._verdicts import KEY_HEADERS
from oncely.keys import from_header, validate_key

if TYPE_CHECKING:
    import aio_pika

__all__ = [
    "amqp_message",
    "derive",
    "KEY_HEADER",
    "kafka_headers",
    "nats_headers",
    "redis_fields",
    "stamp",
]

KEY_HEADER = KEY_HEADERS[0]
"""The header every helper writes by default: ``Idempotency-Key``, as the HTTP draft names it."""

V = TypeVar("V")


def derive(key: str, part: str) -> str:
    """Return a stable key for one of several messages caused by the operation *key*.

    ``derive("8e03978e", "mail")`` is ``"8e03978e/mail"``: the same on every retry of the
    request, and distinct from the key of the other messages it publishes.

    Raises:
        InvalidKeyError: The result is not a valid key (over 255 characters, say).
    """
    return validate_key(f"{from_header(key)}/{part}")


def stamp(
    key: str, existing: Mapping[str, V] | None = None, *, header: str = KEY_HEADER
) -> dict[str, V | str]:
    """Return *existing* headers (copied) with the key in *header*.

    Raises:
        InvalidKeyError: *key* is empty, too long or not header-safe.
    """
    stamped: dict[str, V | str] = dict(existing or {})
    stamped[header] = from_header(key)
    return stamped


def kafka_headers(
    key: str,
    existing: Mapping[str, str | bytes] | Iterable[tuple[str, str | bytes]] | None = None,
    *,
    header: str = KEY_HEADER,
) -> list[tuple[str, bytes]]:
    """Return Kafka record headers (for confluent-kafka and aiokafka) carrying the key.

    Raises:
        InvalidKeyError: *key* is empty, too long or not header-safe.
    """
    items = existing.items() if isinstance(existing, Mapping) else (existing or ())
    out = [
        (name, value.encode() if isinstance(value, str) else value)
        for name, value in items
        if name.lower() != header.lower()
    ]
    out.append((header, from_header(key).encode()))
    return out


def nats_headers(
    key: str, existing: Mapping[str, str] | None = None, *, header: str = KEY_HEADER
) -> dict[str, str]:
    """Return NATS headers carrying the key, also as ``Nats-Msg-Id``.

    JetStream drops a re-publish with the same ``Nats-Msg-Id`` within the stream's duplicate
    window (two minutes by default), so a producer's retry is stopped at the broker; the
    consumer's record catches everything the window does not.

    Raises:
        InvalidKeyError: *key* is empty, too long or not header-safe.
    """
    stamped = dict(existing or {})
    stamped[header] = stamped["Nats-Msg-Id"] = from_header(key)
    return stamped


def redis_fields(
    key: str, fields: Mapping[str, Any], *, header: str = KEY_HEADER
) -> dict[str, Any]:
    """Return Redis stream entry *fields* (copied) with the key as one more field.

    Raises:
        InvalidKeyError: *key* is empty, too long or not header-safe.
    """
    stamped = dict(fields)
    stamped[header] = from_header(key)
    return stamped


def amqp_message(
    body: bytes,
    key: str,
    *,
    headers: Mapping[str, Any] | None = None,
    header: str = KEY_HEADER,
    **properties: Any,
) -> aio_pika.Message:
    """Return an `aio_pika.Message` carrying the key as a header and as its ``message_id``.

    Args:
        body: The payload.
        key: The idempotency key.
        headers: Other headers.
        header: The header that carries the key.
        **properties: Other message properties (``content_type``, ``delivery_mode``, ...).

    Raises:
        InvalidKeyError: *key* is empty, too long or not header-safe.
        MissingDependencyError: aio-pika is not installed (``oncely[rabbitmq]``).
    """
    driver = require("aio_pika", extra="rabbitmq")
    stamped = dict(headers or {})
    stamped[header] = from_header(key)
    properties.setdefault("message_id", stamped[header])
    message: aio_pika.Message = driver.Message(body, headers=stamped, **properties)
    return message
