"""How a delivery is keyed and fingerprinted."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from oncely._core.fingerprint import (
    body_digest,
    canonical_body,
    canonical_json,
    parse_document,
)
from oncely._core.keys import content_key
from oncely.consumers._verdicts import (
    Delivery,
)
from oncely.keys import from_header


def body_value(body: bytes) -> Any:
    """Return *body* parsed as JSON when it is JSON, else the bytes themselves.

    Numbers with a fraction or an exponent are `decimal.Decimal` (every digit kept), so keys
    and fingerprints derived from the result are exact and do not change with JSON key order,
    spacing or number formatting. A body nested too deeply or with a number out of range is
    returned as bytes.
    """
    try:
        return parse_document(body)
    except ValueError:  # UnicodeDecodeError included
        return body


def _body_fingerprint(body: bytes) -> str:
    """Return the fingerprint of a message body: its canonical JSON when it is JSON (numbers
    compared exactly, as decimals), else its bytes."""
    return body_digest(body)


def _content_key(delivery: Delivery) -> str:
    """``content_hash(body_value(body))``, exact; a body without a canonical JSON form (not
    JSON, NaN, nested too deeply) is keyed by its bytes, as ``content_hash(body)``."""
    body = delivery.body
    text = canonical_body(body)
    return content_key(canonical_json(body) if text is None else text)


def _header_key(delivery: Delivery, headers: tuple[str, ...]) -> str:
    for name in headers:
        value = delivery.header(name)
        if value is not None:
            return from_header(value)
    if delivery.message_id:
        return from_header(delivery.message_id)
    raise KeyError(
        f"the message has none of the headers {', '.join(headers)} and no message id: "
        "stamp a key on it (oncely.consumers.producer) or configure key="
    )


def reads_message_id(
    key: Any, key_headers: tuple[str, ...], fingerprint: Any, headers: Mapping[str, Any]
) -> bool:
    """Whether a delivery with *headers* may need its message id, with this *key*, *key_headers*
    and *fingerprint* (a consumer's): a callable may read it, and a header key falls back to it
    when no key header has a value. An adapter whose message id costs a parse (NATS: the ack
    subject's) makes it only then. A key header in another case than *key_headers* answers
    yes: `_header_key` finds it, the id is made all the same."""
    if callable(key) or callable(fingerprint):
        return True
    if key == "content":
        return False
    return not any(headers.get(name) is not None for name in key_headers)


def default_scope(handler: Callable[..., Any], group: str | None) -> str:
    """Return *group*, or the handler's qualified name: the scope of an adapter's keys."""
    if group:
        return group
    target = getattr(handler, "func", handler)  # functools.partial
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or type(target).__qualname__
    return f"{module}.{name}" if module else name
