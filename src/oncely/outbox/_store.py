"""What the outbox needs of a database: the interface each SQL backend implements.

The writer (`Outbox`), the `Relay` and the operators' verbs hold no SQL and import no driver:
they call an `OutboxBackend`, found for a store by its ``backend`` name in `BACKENDS` and
imported only when used. Each backend (``oncely.stores.<backend>._outbox``) holds its
statements, and maps its driver's exceptions to oncely's in one place.

What a backend promises, whatever its database:

* **Commit order per key.** `OutboxBackend.add` numbers each ordering key's events in the order
  their transactions commit, and the ids of one key's events follow that order: when an event
  is visible, every earlier event of its key has committed and is visible too.
* **A scope is worked on by one relay at a time, from its head.** A scope is one ordering key
  to one destination (every event without a key is a scope of its own). `OutboxBackend.claim`
  returns due heads (pending events without an earlier pending event of their scope) that no
  other live claim holds, with the following pending events of the scopes it holds, in id
  order, so a batch holds a prefix of each scope's pending events.
* **A claim lasts until its outcomes are recorded.** Until `ClaimedBatch.settle` (or the end of
  the claim, which lets go of an unsettled batch as it was), no other relay sees the scope's
  next head. A relay that dies holding a claim leaves every row as it was: the next claim
  publishes them again (at least once; consumers deduplicate by message id).
"""

from __future__ import annotations

import asyncio
import importlib
import json
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Final, Literal, Protocol

from oncely.errors import ConfigurationError, OncelyError
from oncely.outbox._event import OutboxEvent

__all__ = [
    "BACKENDS",
    "OPERATOR_ERROR",
    "Change",
    "ClaimedBatch",
    "EventState",
    "Failure",
    "NewEvent",
    "NoSuchEventError",
    "OutboxBackend",
    "Settlement",
    "StateError",
    "backend_for",
    "check_store",
    "event_from_row",
    "iso",
    "iso_ms",
    "ms",
]

BACKENDS: Final = {
    "postgres": "oncely.stores.postgres._outbox:PostgresOutbox",
    "sqlite": "oncely.stores.sqlite._outbox:SQLiteOutbox",
}
"""A store's ``backend`` → ``module:class`` of its outbox backend, built from the store."""

OPERATOR_ERROR: Final = "dead-lettered by an operator"
"""The ``last_error`` an operator's dead-lettering records."""

Change = Literal["requeue", "due", "dead"]
"""An operator's change to one event: made pending again after every event of its key (a new
id), due now, or dead-lettered."""


class StateError(OncelyError):
    """The event is not in a state the verb applies to."""


class NoSuchEventError(StateError):
    """No event of that id is in the outbox (never added, or published and purged)."""


@dataclass(frozen=True, slots=True)
class NewEvent:
    """An event `Outbox.add` validated, as a backend stores it."""

    message_id: str
    destination: str
    payload: bytes
    headers: str
    """JSON text: an object of strings."""
    ordering_key: str | None


@dataclass(frozen=True, slots=True)
class Failure:
    """A failed event's record: its error, when to try again, whether it is now dead."""

    id: int
    error: str
    delay: timedelta
    dead: bool


@dataclass(slots=True)
class Settlement:
    """What to record for a batch: *note* is the failure that stopped it, if one did,
    recorded as the untouched events' ``last_error`` (not counted against them)."""

    published: list[int] = field(default_factory=list)
    failed: list[Failure] = field(default_factory=list)
    untouched: list[int] = field(default_factory=list)
    note: str | None = None


@dataclass(frozen=True, slots=True)
class EventState:
    """One outbox event as an operator sees it (times as ISO 8601 UTC, or ``None``)."""

    id: int
    message_id: str
    destination: str
    ordering_key: str | None
    attempts: int
    created_at: str | None
    next_attempt_at: str | None
    published_at: str | None
    dead_at: str | None
    last_error: str | None

    @property
    def state(self) -> str:
        """``published``, ``dead`` or ``pending``."""
        if self.published_at is not None:
            return "published"
        return "dead" if self.dead_at is not None else "pending"


class ClaimedBatch(Protocol):
    """The events one claim holds, in id order, and how their outcomes are recorded."""

    events: list[OutboxEvent]

    async def extend(self) -> None:
        """Hold the claim for another *hold* (before another publish call)."""

    async def settle(self, settlement: Settlement) -> None:
        """Record the outcomes; the claim ends with them (at the end of the ``async with``)."""


class OutboxBackend(Protocol):
    """The outbox's statements on one database (see the module's docstring for the promises).

    Every method raises oncely's errors (`StoreError`, `StoreUnavailableError`,
    `SchemaMissingError`), never the driver's, except `add` and `aadd`, which run in the
    caller's transaction and leave its driver's errors to the caller.
    """

    # -- the writer, in the caller's transaction --------------------------------------------

    def add(self, connection: Any, event: NewEvent, *, notify: bool) -> bool:
        """Store *event* in the open transaction of *connection* (the driver's, or a
        SQLAlchemy or Django one over it); whether it was added (``False``: its message id is
        taken, the transaction still usable).

        Raises:
            ConfigurationError: *connection* has no open transaction (or a failed one).
        """
        ...

    async def aadd(self, connection: Any, event: NewEvent, *, notify: bool) -> bool:
        """`add` on an async connection (a `ConfigurationError` where the driver has none)."""
        ...

    # -- the relay ---------------------------------------------------------------------------

    def claim(self, limit: int, hold: timedelta) -> AbstractAsyncContextManager[ClaimedBatch]:
        """Claim at most *limit* events for at least *hold* (see the module's docstring)."""
        ...

    async def listen(self, wake: asyncio.Event) -> asyncio.Task[None] | None:
        """Set *wake* whenever an event is added (a task to cancel), or ``None``: poll."""
        ...

    async def purge(self, retention: timedelta) -> int:
        """Delete the events published more than *retention* ago; return how many."""
        ...

    async def stats(self) -> dict[str, Any]:
        """``pending``, ``dead`` and ``published`` counts and ``oldest_pending`` (ISO 8601)."""
        ...

    async def aclose(self) -> None:
        """Release what the backend opened itself (not the store)."""
        ...

    # -- the operators' verbs (sync) ---------------------------------------------------------

    def dead_letters(self, limit: int) -> list[EventState]:
        """The dead-lettered events, oldest first, at most *limit*."""
        ...

    def transition(
        self, event_id: int, decide: Callable[[EventState | None], Change]
    ) -> EventState:
        """Apply ``decide(the event's state)`` to event *event_id*, atomically with what
        *decide* saw, and return its new state (under its new id after a requeue). *decide*
        raises to refuse; a backend may call it again if the event changed meanwhile.

        Raises:
            StateError: The backend refuses the change (on SQLite: dead-lettering an event a
                relay's live claim holds).
        """
        ...


def check_store(store: Any, user: str) -> None:
    """Refuse a store whose records live in no SQL database the caller can share."""
    backend = getattr(store, "backend", None)
    if backend not in BACKENDS:
        raise ConfigurationError(
            f"{user} writes in the caller's SQL transaction: it needs a PostgresStore or an "
            f"SQLiteStore, not {type(store).__name__}"
        )
    if backend == "sqlite" and store.path == ":memory:":
        raise ConfigurationError(
            f"{user} needs a SQLite database file the application shares, not ':memory:'"
        )


def backend_for(store: Any, user: str) -> OutboxBackend:
    """The outbox backend of *store* (checked with `check_store`)."""
    check_store(store, user)
    module, _, name = BACKENDS[store.backend].partition(":")
    backend: OutboxBackend = getattr(importlib.import_module(module), name)(store)
    return backend


# -- what the backends share ----------------------------------------------------------------------


def event_from_row(row: Sequence[Any]) -> OutboxEvent:
    """An `OutboxEvent` from a row of its fields in order (headers as JSON text or a dict)."""
    event_id, message_id, destination, payload, headers, ordering_key, attempts = row
    if isinstance(headers, str):
        headers = json.loads(headers)
    return OutboxEvent(
        event_id, message_id, destination, bytes(payload), headers, ordering_key, attempts
    )


def ms(duration: timedelta) -> int:
    """*duration* in whole milliseconds."""
    return int(duration // timedelta(milliseconds=1))


def iso(moment: datetime) -> str:
    """*moment* as ISO 8601 UTC, to the millisecond."""
    return moment.astimezone(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def iso_ms(epoch_ms: int) -> str:
    """Epoch milliseconds as ISO 8601 UTC."""
    return iso(datetime.fromtimestamp(epoch_ms / 1000, tz=timezone.utc))
