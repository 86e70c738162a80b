"""`StoreWrapper`: a store in front of another, every verb the inner store's unless overridden.

The tiered cache and the Bloom filter store change a few verbs each; the rest (and the
operators' verbs: forget, scan, purge, migrate, check) pass through here, written once.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from oncely._core.protocols import CheckableStore, Store
from oncely._core.records import ClaimResult, LeaseLost, Record, Status, StoreHealth
from oncely.errors import StoreError
from oncely.stores import _batch

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["StoreWrapper"]


class StoreWrapper:
    """Every verb of *inner*, for a subclass to override the ones it changes."""

    backend = "wrapper"

    def __init__(self, inner: Store) -> None:
        self.inner = inner

    # -- sync verbs ----------------------------------------------------------------------------

    def claim(self, key: str, fingerprint: str, *, lease: timedelta, ttl: timedelta) -> ClaimResult:
        """See `oncely.SyncStore.claim`."""
        return self.inner.claim(key, fingerprint, lease=lease, ttl=ttl)

    def claim_many(
        self,
        requests: Sequence[tuple[str, str]],
        *,
        lease: timedelta,
        ttl: timedelta,
        ops: Sequence[str] | None = None,
    ) -> list[ClaimResult | StoreError]:
        """See `oncely.BatchStore.claim_many`."""
        return _batch.claim_many(self.inner, requests, lease=lease, ttl=ttl, ops=ops)

    def complete(self, key: str, token: int, result: bytes, *, ttl: timedelta) -> LeaseLost | None:
        """See `oncely.SyncStore.complete`."""
        return self.inner.complete(key, token, result, ttl=ttl)

    def complete_many(
        self, items: Sequence[tuple[str, int, bytes]], *, ttl: timedelta
    ) -> list[LeaseLost | StoreError | None]:
        """See `oncely.BatchStore.complete_many`."""
        return _batch.complete_many(self.inner, items, ttl=ttl) if items else []

    def fail(self, key: str, token: int, error: bytes, *, ttl: timedelta) -> LeaseLost | None:
        """See `oncely.SyncStore.fail`."""
        return self.inner.fail(key, token, error, ttl=ttl)

    def release(self, key: str, token: int) -> LeaseLost | None:
        """See `oncely.SyncStore.release`."""
        return self.inner.release(key, token)

    def extend(self, key: str, token: int, *, lease: timedelta) -> LeaseLost | None:
        """See `oncely.SyncStore.extend`."""
        return self.inner.extend(key, token, lease=lease)

    def get(self, key: str) -> Record | None:
        """See `oncely.SyncStore.get` (always read from the inner store)."""
        return self.inner.get(key)

    def close(self) -> None:
        """Close the inner store."""
        self.inner.close()

    # -- the operators' verbs, where the inner store has them -----------------------------------

    def forget(self, key: str, *, force: bool = False) -> Status | None:
        """The inner store's ``forget``."""
        status: Status | None = self._inner_verb("forget")(key, force=force)
        return status

    async def aforget(self, key: str, *, force: bool = False) -> Status | None:
        """Async `forget`."""
        status: Status | None = await self._inner_verb("aforget")(key, force=force)
        return status

    def scan(self, *, after: str = "", limit: int = 100) -> list[Record]:
        """The inner store's ``scan``."""
        records: list[Record] = self._inner_verb("scan")(after=after, limit=limit)
        return records

    def purge(self, *, batch: int = 1000, limit: int | None = None) -> int:
        """The inner store's ``purge``."""
        deleted: int = self._inner_verb("purge")(batch=batch, limit=limit)
        return deleted

    def migrate(self) -> None:
        """The inner store's ``migrate``."""
        self._inner_verb("migrate")()

    def _inner_verb(self, verb: str) -> Any:
        method = getattr(self.inner, verb, None)
        if method is None:
            raise StoreError(
                f"the inner store {self.inner!r} has no {verb}()", backend=self.backend
            )
        return method

    def _checkable(self) -> CheckableStore:
        if not isinstance(self.inner, CheckableStore):
            raise StoreError(f"the inner store {self.inner!r} has no check()", backend=self.backend)
        return self.inner

    def check(self) -> StoreHealth:
        """See `oncely.CheckableStore.check`: the inner store's, under this store's name."""
        health = self._checkable().check()
        return StoreHealth(self.backend, health.schema_version, health.latency_ms)

    async def acheck(self) -> StoreHealth:
        """Async `check`."""
        health = await self._checkable().acheck()
        return StoreHealth(self.backend, health.schema_version, health.latency_ms)

    # -- async verbs ---------------------------------------------------------------------------

    async def aclaim(
        self, key: str, fingerprint: str, *, lease: timedelta, ttl: timedelta
    ) -> ClaimResult:
        """See `oncely.AsyncStore.aclaim`."""
        return await self.inner.aclaim(key, fingerprint, lease=lease, ttl=ttl)

    async def aclaim_many(
        self,
        requests: Sequence[tuple[str, str]],
        *,
        lease: timedelta,
        ttl: timedelta,
        ops: Sequence[str] | None = None,
    ) -> list[ClaimResult | StoreError]:
        """See `claim_many`."""
        return await _batch.aclaim_many(self.inner, requests, lease=lease, ttl=ttl, ops=ops)

    async def acomplete(
        self, key: str, token: int, result: bytes, *, ttl: timedelta
    ) -> LeaseLost | None:
        """See `oncely.AsyncStore.acomplete`."""
        return await self.inner.acomplete(key, token, result, ttl=ttl)

    async def acomplete_many(
        self, items: Sequence[tuple[str, int, bytes]], *, ttl: timedelta
    ) -> list[LeaseLost | StoreError | None]:
        """See `oncely.BatchStore.acomplete_many`."""
        return await _batch.acomplete_many(self.inner, items, ttl=ttl) if items else []

    async def afail(
        self, key: str, token: int, error: bytes, *, ttl: timedelta
    ) -> LeaseLost | None:
        """See `oncely.AsyncStore.afail`."""
        return await self.inner.afail(key, token, error, ttl=ttl)

    async def arelease(self, key: str, token: int) -> LeaseLost | None:
        """See `oncely.AsyncStore.arelease`."""
        return await self.inner.arelease(key, token)

    async def aextend(self, key: str, token: int, *, lease: timedelta) -> LeaseLost | None:
        """See `oncely.AsyncStore.aextend`."""
        return await self.inner.aextend(key, token, lease=lease)

    async def aget(self, key: str) -> Record | None:
        """See `oncely.AsyncStore.aget`."""
        return await self.inner.aget(key)

    async def aclose(self) -> None:
        """Close the inner store."""
        await self.inner.aclose()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
