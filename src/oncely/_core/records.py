"""Records as the stores keep them, and the values store operations return."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TypeAlias

__all__ = [
    "Acquired",
    "ClaimResult",
    "InProgress",
    "LeaseLost",
    "Mismatch",
    "Record",
    "Replay",
    "Status",
    "StoreHealth",
]


class Status(str, enum.Enum):
    """The state of a record (docs/contract.md).

    ``RELEASED`` is a tombstone: it answers claims as if absent, but keeps the fencing token so
    tokens never repeat while a worker holding an older one may still be alive.
    """

    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    FAILED = "failed"
    RELEASED = "released"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True, kw_only=True, init=False)
class Record:
    """What a store keeps for one scoped key. Times are epoch milliseconds of the store's clock.

    Attributes:
        key: The scoped key.
        status: Where the record is in the state machine.
        fingerprint: Digest of what the operation was asked to do.
        token: Fencing token of the latest lease; only grows for a given key.
        attempt: How many times the operation was started since the record was created.
        lease_expires_at_ms: When the current lease ends (meaningful while in progress).
        expires_at_ms: When the whole record expires and the key behaves as absent.
        created_at_ms: When the record was created (first claim).
        updated_at_ms: When the record last changed.
        result: The stored outcome (completed or failed), as opaque bytes.
    """

    key: str
    status: Status
    fingerprint: str
    token: int
    attempt: int
    lease_expires_at_ms: int
    expires_at_ms: int
    created_at_ms: int
    updated_at_ms: int
    result: bytes | None = None

    def __init__(
        self,
        *,
        key: str,
        status: Status,
        fingerprint: str,
        token: int,
        attempt: int,
        lease_expires_at_ms: int,
        expires_at_ms: int,
        created_at_ms: int,
        updated_at_ms: int,
        result: bytes | None = None,
    ) -> None:
        # What `dataclass` writes for a frozen class, but through each slot's own setter rather
        # than ``object.__setattr__`` by name, at half the cost: every store call makes records.
        _set_key(self, key)
        _set_status(self, status)
        _set_fingerprint(self, fingerprint)
        _set_token(self, token)
        _set_attempt(self, attempt)
        _set_lease_expires_at_ms(self, lease_expires_at_ms)
        _set_expires_at_ms(self, expires_at_ms)
        _set_created_at_ms(self, created_at_ms)
        _set_updated_at_ms(self, updated_at_ms)
        _set_result(self, result)

    def is_live(self, now_ms: int) -> bool:
        """Whether the record still exists at *now_ms* (not past its expiry)."""
        return now_ms < self.expires_at_ms


(
    _set_key,
    _set_status,
    _set_fingerprint,
    _set_token,
    _set_attempt,
    _set_lease_expires_at_ms,
    _set_expires_at_ms,
    _set_created_at_ms,
    _set_updated_at_ms,
    _set_result,
) = (
    Record.__dict__[name].__set__
    for name in (
        "key",
        "status",
        "fingerprint",
        "token",
        "attempt",
        "lease_expires_at_ms",
        "expires_at_ms",
        "created_at_ms",
        "updated_at_ms",
        "result",
    )
)


@dataclass(frozen=True, slots=True)
class Acquired:
    """The caller now holds the lease and must complete, fail or release it.

    Attributes:
        token: The fencing token of this lease.
        recovered: True when the lease was taken over from a worker whose lease expired.
        attempt: How many times the operation has been started for this record, this one included.
    """

    token: int
    recovered: bool = False
    attempt: int = 1


@dataclass(frozen=True, slots=True)
class InProgress:
    """Another worker holds a live lease.

    Attributes:
        retry_after: How long that lease has left.
    """

    retry_after: timedelta


@dataclass(frozen=True, slots=True)
class Replay:
    """The operation already finished (completed or failed); here is its record.

    Attributes:
        record: The finished record.
        judged_at_ms: The store's clock when it answered (epoch milliseconds), where the store
            says: the tiered cache keeps the record only while it lives by that clock.
    """

    record: Record
    judged_at_ms: int | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class Mismatch:
    """A live record for this key has another fingerprint."""

    stored_fingerprint: str


ClaimResult: TypeAlias = Acquired | InProgress | Replay | Mismatch
"""What `claim` answers: exactly one of the four outcomes."""


@dataclass(frozen=True, slots=True)
class LeaseLost:
    """A settle call (complete, fail, release, extend) found the lease no longer held."""


@dataclass(frozen=True, slots=True)
class StoreHealth:
    """What a store's ``check()`` found: it answered, and its schema can serve this oncely.

    Attributes:
        backend: The store's ``backend`` name (``"postgres"``, ``"redis"``, ...).
        schema_version: The schema version the store holds (at least the one this oncely
            uses; a newer one is accepted, so that a rolling upgrade keeps older workers
            ready), or ``None`` for a backend without a schema (memory, Redis).
        latency_ms: How long the probe took, round trips included.
    """

    backend: str
    schema_version: int | None
    latency_ms: float
