"""`CoalescingStore`: an async view of a store whose claims and completions go through a
`oncely.stores._coalesce.Coalescer` each (`_Claims`, `_Completions`), grouped into batch calls
while the store is busy (group commit). The grouping, its rules and the guarantees each caller
keeps are `oncely.stores._coalesce`'s.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, ClassVar

from oncely._cancel import give_back
from oncely._core.records import ClaimResult, LeaseLost, Record
from oncely.errors import StoreError
from oncely.stores._batch import takes_ops
from oncely.stores._coalesce import MAX_BATCH, ClaimRule, Coalescer, _CompletionRule, _LoopState

__all__ = ["CoalescingStore"]


class _Claims(ClaimRule, Coalescer):
    def __init__(
        self, store: Any, max_in_flight: int, max_batch: int, singles: bool, burst: int | None
    ) -> None:
        super().__init__(
            store.aclaim, store.aclaim_many, max_in_flight, max_batch, singles, burst=burst
        )
        self.takes_ops = takes_ops(store.aclaim_many)
        self._store = store

    async def _call_single(self, item: tuple[Any, ...], options: dict[str, Any]) -> Any:
        return await self._single(*item[:2], **options)

    def _abandoned(
        self,
        loop: asyncio.AbstractEventLoop,
        state: _LoopState,
        item: tuple[Any, ...],
        answer: asyncio.Future[Any],
    ) -> asyncio.Future[Any] | None:
        """A claim not sent yet is not sent (it would take a lease nobody uses); one in flight
        gives its lease back once it answers `Acquired`, before the caller goes on being
        cancelled (its retry then runs at once)."""
        for group in state.waiting.values():
            if any(future is answer for _, future in group):
                answer.cancel()
                return None
        releasing = loop.create_task(give_back(answer, self._store, item[0]))
        self._track(releasing)
        return releasing


class _Completions(_CompletionRule, Coalescer):
    def __init__(
        self, store: Any, max_in_flight: int, max_batch: int, singles: bool, burst: int | None
    ) -> None:
        super().__init__(
            store.acomplete,
            store.acomplete_many,
            max_in_flight,
            max_batch,
            singles,
            get=store.aget,
            burst=burst,
        )


class CoalescingStore:
    """An async view of a store with the batch verbs that group concurrent claims and
    completions into batch calls (group commit).

    Args:
        store: A store with the `oncely.BatchStore` verbs.
        max_in_flight: Claims (and, separately, completions) sent at once per event loop before
            later ones wait to go together.
        max_batch: The most items sent in one batch call.
        singles: Send a call that need not wait alone, with the single verb; else every call
            goes with the batch verb (a consumer's: the same script, warm, for every call).
        burst: Claims (completions) sent at once, alone, while the event loop's thread has
            CPU to spare (see `Coalescer`); at most *max_in_flight* otherwise.
    """

    _cancel_safe: ClassVar[type[CoalescingStore]]
    """A cancelled caller's claim is settled here, its finish lands (see the module's
    docstring): `oncely._cancel.guards_itself` says so to the entry points."""

    def __init__(
        self,
        store: Any,
        *,
        max_in_flight: int = 4,
        max_batch: int = MAX_BATCH,
        singles: bool = True,
        burst: int | None = None,
    ) -> None:
        self.store = store
        self._ids = itertools.count()
        self._prefix = secrets.token_hex(8)  # call ids: unique per view, cheap per claim
        self._claims = _Claims(store, max_in_flight, max_batch, singles, burst)
        self._completions = _Completions(store, max_in_flight, max_batch, singles, burst)

    async def aclaim(
        self, key: str, fingerprint: str, *, lease: timedelta, ttl: timedelta
    ) -> ClaimResult:
        """`oncely.AsyncStore.aclaim`, batched with other claims while the store is busy."""
        options = {"lease": lease, "ttl": ttl}
        op = f"{self._prefix}.{next(self._ids)}"  # its call id, the same if it is sent again
        answer: ClaimResult = await self._claims.submit((key, fingerprint, op), options)
        return answer

    async def acomplete(
        self, key: str, token: int, result: bytes, *, ttl: timedelta
    ) -> LeaseLost | None:
        """`oncely.AsyncStore.acomplete`, batched with other completions while it is busy."""
        answer: LeaseLost | None = await self._completions.submit(
            (key, token, result), {"ttl": ttl}
        )
        return answer

    async def afail(
        self, key: str, token: int, error: bytes, *, ttl: timedelta
    ) -> LeaseLost | None:
        """`oncely.AsyncStore.afail` (not batched: failures are rare)."""
        answer: LeaseLost | None = await self.store.afail(key, token, error, ttl=ttl)
        return answer

    async def arelease(self, key: str, token: int) -> LeaseLost | None:
        """`oncely.AsyncStore.arelease`."""
        answer: LeaseLost | None = await self.store.arelease(key, token)
        return answer

    async def aextend(self, key: str, token: int, *, lease: timedelta) -> LeaseLost | None:
        """`oncely.AsyncStore.aextend`."""
        answer: LeaseLost | None = await self.store.aextend(key, token, lease=lease)
        return answer

    async def aget(self, key: str) -> Record | None:
        """`oncely.AsyncStore.aget`."""
        record: Record | None = await self.store.aget(key)
        return record

    async def aclaim_many(
        self,
        requests: Sequence[tuple[str, str]],
        *,
        lease: timedelta,
        ttl: timedelta,
        ops: Sequence[str] | None = None,
    ) -> list[ClaimResult | StoreError]:
        """`oncely.BatchStore.aclaim_many`, sent as it is (with the claims' call ids *ops* when
        given and the store takes them)."""
        if ops is not None and self._claims.takes_ops:
            answers: list[ClaimResult | StoreError] = await self.store.aclaim_many(
                requests, lease=lease, ttl=ttl, ops=ops
            )
        else:
            answers = await self.store.aclaim_many(requests, lease=lease, ttl=ttl)
        return answers

    async def acomplete_many(
        self, items: Sequence[tuple[str, int, bytes]], *, ttl: timedelta
    ) -> list[LeaseLost | StoreError | None]:
        """`oncely.BatchStore.acomplete_many`, sent as it is."""
        answers: list[LeaseLost | StoreError | None] = await self.store.acomplete_many(
            items, ttl=ttl
        )
        return answers

    async def adrain(self) -> None:
        """Wait until every claim and completion sent on this event loop has answered (those
        of cancelled callers included): before the store is closed."""
        await self._claims.drain()
        await self._completions.drain()

    async def aclose(self) -> None:
        """Close the store underneath, once the calls in flight have answered."""
        await self.adrain()
        await self.store.aclose()


CoalescingStore._cancel_safe = CoalescingStore
