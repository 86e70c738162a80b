"""Record keys and the scripts' replies, for the sync and the async client alike.

One record is one Redis string (packed: see `HEAD`) named ``<prefix>{<namespace>:<key>}``. The
braces are a Redis Cluster hash tag: its content decides the slot. So that a key's own braces
can never end the tag early (or leave it empty, which would hash the whole name), ``%``, ``{``
and ``}`` are percent-escaped in the key and the namespace, and ``:`` in the namespace too,
which makes the name injective: two (namespace, key) pairs never share a record.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Final

from oncely._core.records import (
    Acquired,
    ClaimResult,
    InProgress,
    LeaseLost,
    Mismatch,
    Record,
    Replay,
    Status,
)
from oncely.errors import (
    ConfigurationError,
    CorruptRecordError,
    StoreError,
    StoreUnavailableError,
)

__all__ = [
    "BACKEND",
    "TRANSIENT_REPLIES",
    "Keyspace",
    "claim_answer",
    "record_or_none",
    "rejected",
    "settle_answer",
]

BACKEND: Final = "redis"
"""The backend name carried by the errors this store raises."""

TRANSIENT_REPLIES: Final = frozenset(
    {"BUSY", "LOADING", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN", "READONLY"}
)
"""Error replies that mean "not now" rather than "never": failovers, loading, a busy script."""

_ESCAPES: Final = {"%": "%25", "{": "%7B", "}": "%7D"}
_NAMESPACE_ESCAPES: Final = {**_ESCAPES, ":": "%3A"}
_GLOB_SPECIAL: Final = frozenset("*?[]\\")


def _escape(text: str, table: dict[str, str]) -> str:
    return "".join(table.get(char, char) for char in text)


def _escape_key(key: str) -> str:
    """`_escape` with `_ESCAPES`, fast for the usual key that needs none ("%" goes first)."""
    if "%" in key or "{" in key or "}" in key:
        return key.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")
    return key


def _unescape(text: str) -> str:
    for plain, escaped in _ESCAPES.items():
        if plain != "%":
            text = text.replace(escaped, plain)
    return text.replace("%25", "%")


def _glob_escape(text: str) -> str:
    return "".join("\\" + char if char in _GLOB_SPECIAL else char for char in text)


@dataclass(frozen=True, slots=True)
class Keyspace:
    """Where one store's records live: a key prefix and a namespace.

    Attributes:
        prefix: Starts every record's name (``"oncely:"`` by default); it must not contain
            braces, which would move the cluster hash tag.
        namespace: Keeps this store's keys apart from other stores' on the same server.
    """

    prefix: str
    namespace: str
    _head: str = field(init=False, repr=False, compare=False)  # the escaped name up to the key

    def __post_init__(self) -> None:
        if "{" in self.prefix or "}" in self.prefix:
            raise ConfigurationError(
                f"the Redis key prefix must not contain braces: {self.prefix!r}"
            )
        head = f"{self.prefix}{{{_escape(self.namespace, _NAMESPACE_ESCAPES)}:"
        object.__setattr__(self, "_head", head)

    def name(self, key: str) -> bytes:
        """Return the name of the key holding *key*'s record."""
        return (self._head + _escape_key(key) + "}").encode()

    def pattern(self) -> bytes:
        """Return a SCAN ``MATCH`` pattern for every record of this namespace."""
        return f"{_glob_escape(self._head)}*}}".encode()

    def key_of(self, name: bytes) -> str | None:
        """Return the key whose record is stored at *name*, or ``None`` for a foreign name."""
        text = name.decode("utf-8", errors="replace")
        if not (text.startswith(self._head) and text.endswith("}")):
            return None
        escaped = text[len(self._head) : -1]
        return None if "{" in escaped or "}" in escaped else _unescape(escaped)


# -- replies -----------------------------------------------------------------------------------


def _corrupt(key: str, reason: Any) -> CorruptRecordError:
    text = reason.decode("utf-8", errors="replace") if isinstance(reason, bytes) else str(reason)
    return CorruptRecordError(text, backend=BACKEND, key=key)


def _unexpected(key: str, reply: Any) -> StoreError:
    return StoreError(
        f"unexpected reply from a Redis script for {key!r}: {reply!r:.200}", backend=BACKEND
    )


HEAD: Final = struct.Struct(">BBqIqqqqII")
"""The fixed head of a packed record (``HEAD`` in ``lua/record.lua``): version, status, token,
attempt, lease, expires, created, updated, and the lengths of the fingerprint and the call id
that follow it; the result is the rest."""

_STATUSES: Final = (None, Status.IN_PROGRESS, Status.COMPLETED, Status.FAILED, Status.RELEASED)
"""Each status by its code in a packed record."""

_FINISHED: Final = frozenset({Status.COMPLETED, Status.FAILED})


def _record(key: str, packed: Any) -> Record:
    """Decode a record as `record.lua` stores it (the script has checked its layout)."""
    try:
        version, code, token, attempt, lease, expires, created, updated, nfp, nop = (
            HEAD.unpack_from(packed)
        )
        status = _STATUSES[code] if version == 1 else None
        if status is None:
            raise ValueError(f"not an oncely record (version {version}, status {code})")
        start = HEAD.size + nfp
        return Record(
            key=key,
            status=status,
            fingerprint=packed[HEAD.size : start].decode(),
            token=token,
            attempt=attempt,
            lease_expires_at_ms=lease,
            expires_at_ms=expires,
            created_at_ms=created,
            updated_at_ms=updated,
            result=packed[start + nop :] if status in _FINISHED else None,
        )
    except (TypeError, ValueError, IndexError, struct.error) as exc:  # incl. UnicodeDecodeError
        raise _corrupt(key, exc) from exc


def rejected(key: str, message: str) -> StoreError:
    """The error for an error reply *message* about *key* (Redis's, or one item's of a batch).

    A foreign value (``WRONGTYPE``) is a corrupt record, a transient reply (a failover, a busy
    server) makes the store unavailable, anything else is a plain `StoreError`.
    """
    code = message.split(" ", 1)[0]
    if code == "WRONGTYPE":
        return CorruptRecordError(message, backend=BACKEND, key=key)
    if code in TRANSIENT_REPLIES:
        return StoreUnavailableError(f"Redis could not serve {key!r}: {message}", backend=BACKEND)
    return StoreError(f"Redis rejected an operation on {key!r}: {message}", backend=BACKEND)


def _tagged(key: str, reply: Any) -> tuple[bytes, list[Any]]:
    if not isinstance(reply, list) or not reply or not isinstance(reply[0], bytes):
        raise _unexpected(key, reply)
    if reply[0] == b"corrupt":
        raise _corrupt(key, reply[1] if len(reply) > 1 else "no reason given")
    if reply[0] == b"error" and len(reply) == 2:  # one item of a batch failed (batch.lua)
        raise rejected(key, bytes(reply[1]).decode("utf-8", errors="replace"))
    return reply[0], reply[1:]


def claim_answer(key: str, reply: Any) -> ClaimResult:
    """Decode `claim.lua`'s reply for the caller's *key*.

    Raises:
        CorruptRecordError: The record at the key could not be decoded.
    """
    tag, rest = _tagged(key, reply)
    if tag == b"acquired" and len(rest) == 3:
        token, attempt, recovered = rest
        return Acquired(int(token), recovered=bool(recovered), attempt=int(attempt))
    if tag == b"in_progress" and len(rest) == 1:
        return InProgress(retry_after=timedelta(milliseconds=int(rest[0])))
    if tag == b"replay" and len(rest) == 2:
        return Replay(_record(key, rest[1]), judged_at_ms=int(rest[0]))
    if tag == b"mismatch" and len(rest) == 1:
        try:
            return Mismatch(stored_fingerprint=rest[0].decode())
        except UnicodeDecodeError as exc:
            raise _corrupt(key, exc) from exc
    raise _unexpected(key, reply)


def settle_answer(key: str, reply: Any) -> LeaseLost | None:
    """Decode the reply of `complete.lua`, `fail.lua`, `release.lua` or `extend.lua`."""
    if reply == 1:
        return None
    if reply == 0:
        return LeaseLost()
    _tagged(key, reply)  # raises for a corrupt record
    raise _unexpected(key, reply)


def forget_answer(key: str, reply: Any) -> tuple[Status | None, bool]:
    """Decode `forget.lua`'s reply: (the status the record had, whether it was refused)."""
    tag, rest = _tagged(key, reply)
    if tag == b"absent":
        return None, False
    if tag == b"refused":
        return None, True
    if tag == b"forgot" and len(rest) == 1:
        try:
            return Status(rest[0].decode()), False
        except (AttributeError, ValueError) as exc:
            raise _corrupt(key, f"unknown status {rest[0]!r}") from exc
    raise _unexpected(key, reply)


def record_or_none(key: str, reply: Any) -> Record | None:
    """Decode `get.lua`'s reply: the live record, or ``None``."""
    tag, rest = _tagged(key, reply)
    if tag == b"absent":
        return None
    if tag == b"record" and len(rest) == 1:
        return _record(key, rest[0])
    raise _unexpected(key, reply)
