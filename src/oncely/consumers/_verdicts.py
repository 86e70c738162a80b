"""What an adapter gives and gets: deliveries, verdicts, the consumer policy and its counters."""

from __future__ import annotations

import enum
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal, TypeAlias

from oncely._core.policy import Duration, Policy, to_timedelta
from oncely.errors import ConfigurationError

__all__ = [
    "Action",
    "ConsumerPolicy",
    "ConsumerStats",
    "Delivery",
    "FingerprintSource",
    "KEY_HEADERS",
    "KeySource",
    "Reason",
    "seconds",
    "Verdict",
]

KEY_HEADERS: tuple[str, ...] = ("Idempotency-Key", "x-idempotency-key")
"""Headers read for the key, in this order and case-insensitively."""


# -- what an adapter gives and gets ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Delivery:
    """One delivery of a message, as every broker adapter describes it.

    Attributes:
        body: The payload, as bytes.
        headers: The message's headers (values may be ``str`` or ``bytes``).
        message_id: The broker's identity of the message, stable across redeliveries
            (an AMQP ``message_id``, a stream sequence, ``topic/partition/offset``, a stream
            entry id), used as the key when no header carries one. ``None`` if it has none.
        raw: The broker's own message object, for key and fingerprint callables.

    .. versionadded:: 0.1.0
    """

    body: bytes
    headers: Mapping[str, Any] = field(default_factory=dict)
    message_id: str | None = None
    raw: Any = None

    def header(self, name: str) -> str | bytes | None:
        """Return the header *name* (case-insensitive), or ``None``."""
        wanted = name.lower()
        for header, value in self.headers.items():
            if header.lower() == wanted and value is not None:
                return value if isinstance(value, (str, bytes)) else str(value)
        return None


class Action(str, enum.Enum):
    """What the adapter must tell the broker about one delivery."""

    ACK = "ack"
    """Acknowledge (commit): the message has taken effect, or already had."""
    RETRY = "retry"
    """Do not acknowledge: have it redelivered (after `Verdict.delay` when one is given)."""
    DEAD_LETTER = "dead_letter"
    """Move it to the dead-letter target (the broker's, or one the adapter was given)."""

    def __str__(self) -> str:
        return self.value


class Reason(str, enum.Enum):
    """Why a `Verdict` was reached; also the name of the counter it increments."""

    PROCESSED = "processed"
    DUPLICATE = "duplicate"
    IN_PROGRESS = "in_progress"
    HANDLER_FAILED = "handler_failed"
    EXHAUSTED = "exhausted"
    MISMATCH = "mismatch"
    INVALID_KEY = "invalid_key"
    CORRUPT_RECORD = "corrupt_record"
    STORE_UNAVAILABLE = "store_unavailable"
    LEASE_LOST = "lease_lost"
    BLOCKED = "blocked"
    """Not run: an earlier message of the same ordered batch must be retried first."""

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class Verdict:
    """The runner's decision for one delivery.

    Attributes:
        action: What to tell the broker.
        reason: Why.
        key: The scoped key, when one could be derived.
        delay: For `Action.RETRY`: wait this long before the redelivery; ``None`` leaves the
            timing to the broker's own redelivery policy (a handler that raised).
        attempt: The record's attempt number when the handler was started (0: not started).
        error: The handler's exception, or the error that decided the verdict.
        result: What the handler returned (`Reason.PROCESSED`), or what its first run returned,
            decoded from the record (`Reason.DUPLICATE`; ``None`` if it cannot be decoded).

    .. versionadded:: 0.1.0
    """

    action: Action
    reason: Reason
    key: str | None = None
    delay: timedelta | None = None
    attempt: int = 0
    error: BaseException | None = None
    result: Any = None


KeySource: TypeAlias = "Literal['header', 'content'] | Callable[[Delivery], str | int | uuid.UUID]"
"""Where a message's key comes from.

``"header"``: the first of `KEY_HEADERS` present, else the broker's message id; ``"content"``:
a canonical hash of the body (JSON bodies are canonicalised, so key order and number formatting
do not matter); or a callable over the `Delivery` returning the key (a string, an int or a
`uuid.UUID`).
"""

FingerprintSource: TypeAlias = "Literal['body'] | Callable[[Delivery], Any] | None"
"""What defines a message's operation: ``"body"`` (canonical), a callable, or ``None``."""


# -- policy and counters -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ConsumerPolicy:
    """How an idempotent consumer treats deliveries (docs/guides/consumers.md). Immutable.

    Attributes:
        lease: How long a handler may run before another worker may take the message over; the
            heartbeat extends it every third of it while the handler runs.
        ttl: How long a processed key is remembered (duplicates arriving later run again). Keep
            it longer than the broker can redeliver: its retention, or its retry horizon.
        max_attempts: Starts of the handler, across all workers, before the message is
            dead-lettered (counted in the record, so they survive redelivery and crashes).
        retry_delay: The longest a delivery waits before it is redelivered when its key is busy
            elsewhere or the store is unreachable (never longer than the remaining lease).
        heartbeat: Keep the lease alive while the handler runs.
        dead_letter_on: Exception types that dead-letter a message at once, without retries
            (a malformed payload will not parse on the fifth try either).
        coalesce: With a store that has the batch verbs (`oncely.BatchStore`), send one claim
            (completion) at a time and those that concurrent deliveries make meanwhile together
            as one batch call (group commit): same answers, far fewer round trips. Async only.

    .. versionadded:: 0.1.0
    """

    lease: timedelta = timedelta(seconds=30)
    ttl: timedelta = timedelta(days=7)
    max_attempts: int = 5
    retry_delay: timedelta = timedelta(seconds=1)
    heartbeat: bool = True
    dead_letter_on: tuple[type[BaseException], ...] = ()
    coalesce: bool = True

    def __post_init__(self) -> None:
        for name in ("lease", "ttl", "retry_delay"):
            object.__setattr__(self, name, to_timedelta(getattr(self, name), name))
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int):
            raise ConfigurationError(f"max_attempts must be an int, not {self.max_attempts!r}")
        if self.max_attempts < 1:
            raise ConfigurationError(f"max_attempts must be 1 or more, not {self.max_attempts}")
        errors = self.dead_letter_on
        errors = (errors,) if isinstance(errors, type) else tuple(errors)
        for error in errors:
            if not (isinstance(error, type) and issubclass(error, BaseException)):
                raise ConfigurationError(f"dead_letter_on must be exception types, not {error!r}")
        object.__setattr__(self, "dead_letter_on", errors)
        self.as_policy()  # validates the rest (ttl not shorter than the lease)

    def as_policy(self) -> Policy:
        """The `oncely.Policy` the shared claim and settle flows run under."""
        return Policy(ttl=self.ttl, lease=self.lease, on_conflict="raise", heartbeat=self.heartbeat)


class ConsumerStats:
    """Thread-safe counters of verdicts, by `Reason`, for one consumer.

    .. versionadded:: 0.1.0
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[Reason] = Counter()

    def add(self, reason: Reason) -> None:
        """Count one verdict reached for *reason*."""
        with self._lock:
            self._counts[reason] += 1

    def __getitem__(self, reason: Reason | str) -> int:
        """Return how many verdicts were reached for *reason*."""
        with self._lock:
            return self._counts[Reason(reason)]

    def snapshot(self) -> dict[str, int]:
        """Return every non-zero counter, by reason name."""
        with self._lock:
            return {str(reason): count for reason, count in self._counts.items() if count}

    def __repr__(self) -> str:
        return f"ConsumerStats({self.snapshot()!r})"


def seconds(value: Duration | None) -> float:
    """Return a duration in seconds (``None``: 0)."""
    if value is None:
        return 0.0
    return value.total_seconds() if isinstance(value, timedelta) else float(value)
