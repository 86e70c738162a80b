"""What a running operation knows of its lease, and `current_lease` for the protected code."""

from __future__ import annotations

import contextvars
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

__all__ = ["CURRENT", "CurrentLease", "Lease", "ainvoke_under", "current_lease", "invoke_under"]

T = TypeVar("T")


@dataclass(slots=True, eq=False)
class Lease:
    """What one acquired lease knows about itself while the operation runs."""

    key: str
    token: int
    lease: timedelta
    recovered: bool = False
    attempt: int = 1
    lost: bool = False
    heartbeat: Any = None
    settling: bool = False
    """Set once a settle call may have been sent: from then on only the settle's answer counts
    (an extend that lands after a complete answers `LeaseLost`, and means nothing)."""

    viewed: CurrentLease | None = None
    unstorable: Exception | None = None
    """Why the codec could not store the operation's value (see `outcome_of`)."""
    ttl: timedelta | None = None
    """How long the outcome is kept, for a settle made elsewhere (`committed`)."""
    committed: bool = False
    """Completed in the operation's own database transaction, now committed
    (`oncely.Inbox.transactional`): there is nothing left to settle."""

    def view(self) -> CurrentLease:
        """The public, read-only view of this lease (made once, when first asked for)."""
        if self.viewed is None:
            self.viewed = CurrentLease(self.key, self.token, self.attempt, self.recovered)
        return self.viewed


@dataclass(frozen=True, slots=True)
class CurrentLease:
    """The lease held by the protected function that is running now.

    Attributes:
        key: The scoped key.
        token: The fencing token: pass it to downstream writes so they can reject stale workers.
        attempt: How many times this operation has been started, this run included.
        recovered: True when the lease was taken over from a worker whose lease expired.

    .. versionadded:: 0.1.0
    """

    key: str
    token: int
    attempt: int
    recovered: bool


CURRENT: contextvars.ContextVar[Lease | None] = contextvars.ContextVar(
    "oncely_current_lease", default=None
)


def current_lease() -> CurrentLease | None:
    """Return the lease of the `idempotent` function running in this context, or ``None``.

    .. code-block:: python

        @oncely.idempotent(store=store, key="payment_id")
        def charge(payment_id: str) -> None:
            lease = oncely.current_lease()
            bank.charge(payment_id, fencing_token=lease.token)

    .. versionadded:: 0.1.0
    """
    lease = CURRENT.get()
    return None if lease is None else lease.view()


def invoke_under(lease: Lease, call: Callable[..., T], *args: Any) -> T:
    """Call ``call(*args)`` with *lease* as `current_lease`."""
    reset = CURRENT.set(lease)
    try:
        return call(*args)
    finally:
        CURRENT.reset(reset)


async def ainvoke_under(lease: Lease, call: Callable[..., Awaitable[T]], *args: Any) -> T:
    """Await ``call(*args)`` with *lease* as `current_lease`."""
    reset = CURRENT.set(lease)
    try:
        return await call(*args)
    finally:
        CURRENT.reset(reset)
