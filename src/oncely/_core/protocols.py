"""The store contract: one set of verbs for sync callers and one for async callers.

Built-in stores implement both (`Store`), so one object serves Flask and FastAPI alike. The
conformance suite in `oncely.testing`, not a base class, enforces the contract.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from oncely._core.records import ClaimResult, LeaseLost, Record, StoreHealth

if TYPE_CHECKING:
    from oncely.errors import StoreError

__all__ = ["AsyncStore", "BatchStore", "CheckableStore", "Store", "SyncStore"]


@runtime_checkable
class SyncStore(Protocol):
    """A store called from synchronous code. Each verb is one atomic transition."""

    def claim(self, key: str, fingerprint: str, *, lease: timedelta, ttl: timedelta) -> ClaimResult:
        """Take the lease on *key*, or say why not (docs/contract.md).

        *ttl* is how long an in-progress record is kept at the least, so that its fencing token
        survives the lease.
        """
        ...

    def complete(self, key: str, token: int, result: bytes, *, ttl: timedelta) -> LeaseLost | None:
        """Store *result* as the outcome for *ttl*; `LeaseLost` if *token* no longer holds it."""
        ...

    def fail(self, key: str, token: int, error: bytes, *, ttl: timedelta) -> LeaseLost | None:
        """Store a final *error* for *ttl*; `LeaseLost` if *token* no longer holds the lease."""
        ...

    def release(self, key: str, token: int) -> LeaseLost | None:
        """Give the lease up so the next claim executes; the token is kept."""
        ...

    def extend(self, key: str, token: int, *, lease: timedelta) -> LeaseLost | None:
        """Move the end of the lease to *lease* from now."""
        ...

    def get(self, key: str) -> Record | None:
        """Return the live record for *key*, or ``None``."""
        ...

    def close(self) -> None:
        """Release connections. The store cannot be used afterwards."""
        ...


@runtime_checkable
class AsyncStore(Protocol):
    """A store called from asyncio code: the same verbs, prefixed with ``a``."""

    async def aclaim(
        self, key: str, fingerprint: str, *, lease: timedelta, ttl: timedelta
    ) -> ClaimResult:
        """Async `SyncStore.claim`."""
        ...

    async def acomplete(
        self, key: str, token: int, result: bytes, *, ttl: timedelta
    ) -> LeaseLost | None:
        """Async `SyncStore.complete`."""
        ...

    async def afail(
        self, key: str, token: int, error: bytes, *, ttl: timedelta
    ) -> LeaseLost | None:
        """Async `SyncStore.fail`."""
        ...

    async def arelease(self, key: str, token: int) -> LeaseLost | None:
        """Async `SyncStore.release`."""
        ...

    async def aextend(self, key: str, token: int, *, lease: timedelta) -> LeaseLost | None:
        """Async `SyncStore.extend`."""
        ...

    async def aget(self, key: str) -> Record | None:
        """Async `SyncStore.get`."""
        ...

    async def aclose(self) -> None:
        """Async `SyncStore.close`."""
        ...


@runtime_checkable
class Store(SyncStore, AsyncStore, Protocol):
    """What every built-in backend implements: one object, both worlds."""


@runtime_checkable
class BatchStore(Protocol):
    """Optional verbs that settle many keys in one round trip (every built-in store has them).

    Each item is its own transition, answered exactly as the single verb would answer it, in
    order: the batch is not all-or-nothing. An item that fails alone (a corrupt record) comes
    back as a `StoreError` instance in its place; a failure of the whole call (the store is
    unreachable) raises, as the single verbs do. Consumers use them per fetched batch.

    Every built-in store's ``claim_many`` (and ``aclaim_many``) also takes ``ops``, the claims'
    call ids, one per request: a batch sent again with the same ids after its reply was lost
    gets its own applied claims back as `Acquired`, as the first send answered them. Consumers
    and the HTTP middleware's coalescing pass them when a store takes them.
    """

    def claim_many(
        self, requests: Sequence[tuple[str, str]], *, lease: timedelta, ttl: timedelta
    ) -> list[ClaimResult | StoreError]:
        """`SyncStore.claim` for each ``(key, fingerprint)``, in order."""
        ...

    def complete_many(
        self, items: Sequence[tuple[str, int, bytes]], *, ttl: timedelta
    ) -> list[LeaseLost | StoreError | None]:
        """`SyncStore.complete` for each ``(key, token, result)``, in order."""
        ...

    async def aclaim_many(
        self, requests: Sequence[tuple[str, str]], *, lease: timedelta, ttl: timedelta
    ) -> list[ClaimResult | StoreError]:
        """Async `claim_many`."""
        ...

    async def acomplete_many(
        self, items: Sequence[tuple[str, int, bytes]], *, ttl: timedelta
    ) -> list[LeaseLost | StoreError | None]:
        """Async `complete_many`."""
        ...


@runtime_checkable
class CheckableStore(Protocol):
    """An optional readiness probe (every built-in store has it), for a health endpoint.

    Optional, so that a store of one's own stays a `Store` without it; the conformance suite
    holds every store that has it to the same answers.
    """

    def check(self) -> StoreHealth:
        """Reach the store and verify its schema, in one or two round trips.

        Returns:
            What was found; raising is the only way a check fails.

        Raises:
            StoreUnavailableError: The store could not be reached.
            SchemaMissingError: The schema is missing or older than this oncely (run migrate).
            ConfigurationError: The server refused the store's settings (role, password,
                database).
            StoreError: The store is closed, or failed otherwise.
        """
        ...

    async def acheck(self) -> StoreHealth:
        """Async `check`."""
        ...
