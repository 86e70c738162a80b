"""What a store does for the transactional inbox: the interface each SQL backend implements.

`oncely._inbox_flow` holds the flow (when to claim, wait, replay, record an outcome or undo),
`oncely.inbox` the public API; the flow speaks to the database only through the operations
below, performed on the caller's own connection inside the caller's open transaction (or one
the inbox opens: see below). A backend lives in
``oncely/stores/<backend>/_inbox.py`` and exposes ``InboxDriver(store)``, an `InboxDriver`. It
owns its SQL, its driver calls and the mapping of its driver's errors (one place per backend).

Every operation runs in the caller's transaction and never commits or rolls it back; what it
writes becomes visible to others only when the caller commits, and disappears if it rolls back.
The answers:

* `Begin` (the claim): `Acquired`, having written the record and taken a savepoint before it
  (the block's writes and the record are undone together by `Rollback`); or `Replay`,
  `Mismatch`, `InProgress` (also when the wait for another transaction holding the key timed
  out), having left nothing behind and the transaction usable.
* `Finish` (the block's outcome): ``None``; or `LeaseLost` when the record is no longer the
  one the claim wrote, having rolled back to the claim's savepoint.
* `Settle` (a record claimed elsewhere with a lease, completed by its token): ``None``, or
  `LeaseLost` (the caller must then roll its transaction back).
* `Rollback`: undo everything since the claim's savepoint.

A transaction the inbox owns (`Inbox.transaction`: the connection idle, no transaction open)
changes three of them: `Begin` with *own* opens the transaction itself, in the claim's round trip,
with no savepoint before the claim (the transaction is the inbox's to roll back), and ends it
(rolled back) with any answer but `Acquired` or `Replay`; `Finish` with *end* commits it, in the
outcome's round trip (`LeaseLost`: rolled back instead); `Rollback` with *end* rolls it back.
`Commit` ends a replay's; `Open` opens one with no claim (the block of a disabled inbox). A
commit that fails raises the driver's error, the transaction ended.

A driver error raised in the caller's transaction (a broken connection, a failed statement)
propagates as the backend maps it; the caller's transaction is then the caller's to end.
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

from oncely._core.records import Status

__all__ = [
    "Begin",
    "Finish",
    "InboxDriver",
    "Commit",
    "Op",
    "Open",
    "Rollback",
    "Settle",
    "driver_for",
    "supported",
]


@dataclass(frozen=True, slots=True)
class Begin:
    """Claim *key* in the caller's transaction, waiting up to *wait* for another transaction
    that holds it. *nested*: also take the block's savepoint after the claim (a final error
    undoes the block back to it and keeps the claim). *result*: the outcome recorded if the
    block ends without another (a backend may write the record already complete with it: the
    transaction hides it until commit). *own*: open the transaction first (see the module)."""

    key: str
    fingerprint: str
    lease: timedelta
    ttl: timedelta
    wait: timedelta
    nested: bool
    result: bytes
    own: bool = False


@dataclass(frozen=True, slots=True)
class Finish:
    """Settle the claimed record as *status* (completed, or failed with a final error after
    undoing the block back to its savepoint when *undo_block*); with *end*, then commit the
    transaction the inbox opened."""

    key: str
    token: int
    status: Status
    result: bytes
    ttl: timedelta
    undo_block: bool = False
    end: bool = False


@dataclass(frozen=True, slots=True)
class Settle:
    """Complete a record claimed with a lease (a consumer's), by its token, in the caller's
    transaction."""

    key: str
    token: int
    result: bytes
    ttl: timedelta


@dataclass(frozen=True, slots=True)
class Rollback:
    """Undo everything since the claim's savepoint (the claim and the block's writes); with
    *end*, roll back the whole transaction the inbox opened."""

    end: bool = False


@dataclass(frozen=True, slots=True)
class Commit:
    """Commit the transaction the inbox opened, writing nothing more (a replay's)."""


@dataclass(frozen=True, slots=True)
class Open:
    """Open a transaction on the idle connection, claiming nothing (a disabled inbox's)."""


Op = Begin | Finish | Settle | Rollback | Commit | Open
"""What the inbox asks of a backend."""


class InboxDriver(Protocol):
    """One backend's inbox: binds the caller's connection, then performs `Op` on it."""

    def bind(self, connection: Any, own: bool = False) -> Callable[[Op], Any]:
        """Check *connection* (or the session or cursor holding it) is in an open transaction
        this backend can write in (with *own*: a connection of its driver, in none, that the
        inbox opens and ends itself), and return what performs one claim's operations on it.

        Raises:
            ConfigurationError: No open transaction (with *own*: one), or a connection of
                another kind.
        """
        ...

    async def abind(self, connection: Any, own: bool = False) -> Callable[[Op], Awaitable[Any]]:
        """`bind` for an async connection or session.

        Raises:
            ConfigurationError: As for `bind`, or the backend has no async driver.
        """
        ...


_DRIVERS = {
    "postgres": "oncely.stores.postgres._inbox",
    "sqlite": "oncely.stores.sqlite._inbox",
}
"""The module of each backend's `InboxDriver`, imported when an inbox first needs it."""


def supported(store: Any) -> bool:
    """Whether *store* keeps its records in a SQL database an inbox can write to."""
    return getattr(store, "backend", None) in _DRIVERS


def driver_for(store: Any) -> InboxDriver:
    """The `InboxDriver` of *store*'s backend (see `supported`)."""
    module = importlib.import_module(_DRIVERS[store.backend])
    driver: InboxDriver = module.InboxDriver(store)
    return driver
