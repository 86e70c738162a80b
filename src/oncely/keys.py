"""Key helpers: the four ways to name one logical operation.

* client-provided: `from_header` validates (and unquotes) what a client sent;
* content hash: `content_hash` digests the canonical form of the payload, so dict order and
  number formatting do not change it, with chosen or excluded fields;
* entity + operation (+ version): `entity_key`;
* time-windowed: `windowed` puts a key in a time bucket ("at most once per hour").

A value that is too long or not ASCII to be a key itself (a long natural key, a name with
accents) becomes one with `hashed`.

Every entry point scopes keys before they reach a store (by function, route and principal, or
consumer group), so one caller can never read or overwrite another's record.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta, timezone
from typing import Any

from oncely._core.fingerprint import canonical_json, parse_document
from oncely._core.keys import MAX_KEY_LENGTH, content_key, hashed_key, validate_key
from oncely.errors import ConfigurationError, FingerprintError, InvalidKeyError

__all__ = [
    "MAX_KEY_LENGTH",
    "content_hash",
    "entity_key",
    "from_header",
    "hashed",
    "validate_key",
    "windowed",
]


def from_header(value: str | bytes) -> str:
    """Return the key a client sent in an ``Idempotency-Key`` header.

    Both forms are accepted: a structured-field string (``"8e03978e-..."``, as the IETF draft
    writes it) and a bare token.

    Raises:
        InvalidKeyError: The value is empty, over 255 characters, not printable ASCII, or a
            malformed quoted string.
    """
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError as exc:
            raise InvalidKeyError(
                "the idempotency key is not ASCII; derive a valid key from it with "
                "oncely.keys.hashed(value)"
            ) from exc
    value = value.strip(" \t")
    if len(value) > 2 * MAX_KEY_LENGTH + 2:  # too long even quoted with every char escaped
        raise InvalidKeyError(
            f"the idempotency key has {len(value)} characters; at most {MAX_KEY_LENGTH} are "
            "allowed; derive a valid key from it with oncely.keys.hashed(value)"
        )
    if value.startswith('"'):
        if len(value) < 2 or not value.endswith('"'):
            raise InvalidKeyError("the quoted idempotency key has no closing quote")
        inner, out, escaped = value[1:-1], [], False
        for char in inner:
            if escaped:
                if char not in '"\\':
                    raise InvalidKeyError('only \\" and \\\\ may be escaped in a quoted key')
                out.append(char)
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                raise InvalidKeyError("the quoted idempotency key has an unescaped quote")
            else:
                out.append(char)
        if escaped:
            raise InvalidKeyError("the quoted idempotency key ends in a backslash")
        value = "".join(out)
    return validate_key(value)


def hashed(value: str | bytes, *, prefix: str = "sha256:") -> str:
    """Return a valid key derived from any text: ``<prefix><SHA-256 hex digest>``.

    Use it for values that are too long (over 255 characters) or not printable ASCII to be keys
    themselves. Text is digested as its UTF-8 bytes, so ``hashed("café")`` is
    ``"sha256:" + hashlib.sha256("café".encode()).hexdigest()`` on every host; the result has
    64 hex digits after *prefix*. Unlike `content_hash`, the value is taken as it is: no
    canonical JSON, so ``" a"`` and ``"a"`` are different keys.

    Raises:
        InvalidKeyError: *prefix* makes the result invalid (over 255 characters in all, or not
            printable ASCII).
    """
    return hashed_key(value, prefix)


def content_hash(
    payload: Any,
    *,
    include: Iterable[str] | None = None,
    exclude: Iterable[str] = (),
    prefix: str = "sha256:",
) -> str:
    """Return a key derived from *payload*'s content: ``<prefix>v2:<sha-256 hex>``.

    The digest is taken over canonical JSON: key order, ``1`` versus ``1.0`` and tuples versus
    lists do not change it, and numbers are compared exactly (every digit of a `decimal.Decimal`
    counts). ``v2`` is the version of the key format: keys of the first format
    (``<prefix><hex>``, numbers read as floats where fields were chosen) never equal these.

    Args:
        payload: A JSON-like value, dataclass or pydantic model.
        include: Top-level fields that define the operation (default: all).
        exclude: Top-level fields to leave out, such as timestamps or trace ids.
        prefix: Prepended to the version and the hex digest.

    Raises:
        FingerprintError: The payload holds a value with no canonical form, or fields are chosen
            on a payload that is not a mapping.
    """
    include = list(include) if include is not None else None
    exclude = set(exclude)
    if include is not None or exclude:
        # Read back exactly (numbers as Decimals), so choosing fields loses no digit.
        mapping = parse_document(canonical_json(payload).encode("ascii"))
        if not isinstance(mapping, Mapping):
            raise FingerprintError("include= and exclude= need a mapping payload")
        chosen = include if include is not None else list(mapping)
        payload = {name: mapping.get(name) for name in chosen if name not in exclude}
    return content_key(canonical_json(payload), prefix)


def entity_key(entity: str, entity_id: Any, operation: str, *, version: Any = None) -> str:
    """Return ``entity:id:operation[:vN]``, e.g. ``order:123:charge:v2``.

    Raises:
        InvalidKeyError: The result is not a valid key (too long, or not printable ASCII).
    """
    parts = [entity, str(entity_id), operation]
    if version is not None:
        parts.append(f"v{version}")
    return validate_key(":".join(parts))


def windowed(key: str, window: timedelta, *, at: datetime) -> str:
    """Return *key* within the time bucket of length *window* that contains *at*.

    Use it for "at most once per window" operations (a daily digest e-mail). Buckets are
    aligned to the Unix epoch in UTC; pass the event's own time as *at*, so that a retry
    hours later still lands in the same bucket.

    Raises:
        ConfigurationError: *window* is not positive, or *at* has no timezone.
    """
    if window <= timedelta(0):
        raise ConfigurationError("the window must be positive")
    if at.tzinfo is None:
        raise ConfigurationError("`at` must be timezone-aware, so every host agrees on buckets")
    bucket = (at - datetime(1970, 1, 1, tzinfo=timezone.utc)) // window
    return validate_key(f"{key}@{int(window.total_seconds())}s:{bucket}")
