"""The one grouping of claims and completions (`CoalescingStore`), as the consumers use it:
what a cancelled caller leaves behind."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest

from oncely import Status
from oncely.stores._coalescing import CoalescingStore
from tests.consumers._batching import BatchingStore

LEASE = timedelta(seconds=30)


class _GatedBatches(BatchingStore):
    """Batch completions wait for ``gate`` once ``sent`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = asyncio.Event()
        self.gate = asyncio.Event()

    async def acomplete_many(self, items: Any, *, ttl: timedelta) -> list[Any]:
        self.sent.set()
        await self.gate.wait()
        return await super().acomplete_many(items, ttl=ttl)


@pytest.mark.parametrize("when", ["in_flight", "waiting"])
def test_a_cancelled_completion_lands_before_its_caller_goes_on(when: str) -> None:
    """The caller of a completion cancelled before the store answered (in flight, or waiting
    behind another) goes on being cancelled once its completion (the work ran) has landed."""

    async def main() -> tuple[Any, Any, bool]:
        store = _GatedBatches()
        grouped = CoalescingStore(store, max_in_flight=1, singles=False)
        first = store.claim("a", "", lease=LEASE, ttl=LEASE)
        second = store.claim("b", "", lease=LEASE, ttl=LEASE)
        one = asyncio.ensure_future(grouped.acomplete("a", first.token, b"x", ttl=LEASE))  # type: ignore[union-attr]
        await store.sent.wait()
        two = asyncio.ensure_future(grouped.acomplete("b", second.token, b"y", ttl=LEASE))  # type: ignore[union-attr]
        await asyncio.sleep(0)  # "b" waits behind "a"
        cancelled = two if when == "waiting" else one
        cancelled.cancel()
        asyncio.get_running_loop().call_later(0.05, store.gate.set)
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        landed = store.get("b" if when == "waiting" else "a")
        await grouped.adrain()
        return landed, store.get("a"), store.get("b")

    landed, a, b = asyncio.run(main())
    assert landed is not None
    assert landed.status is Status.COMPLETED
    assert a is not None
    assert a.status is Status.COMPLETED
    assert b is not None
    assert b.status is Status.COMPLETED


def test_a_claim_cancelled_in_flight_is_released_before_its_caller_goes_on() -> None:
    """A claim applied while its caller was cancelled is given back before the cancellation
    propagates: a retry right after finds the key free."""

    class GatedClaims(BatchingStore):
        def __init__(self) -> None:
            super().__init__()
            self.sent = asyncio.Event()
            self.gate = asyncio.Event()

        async def aclaim_many(self, requests: Any, **options: Any) -> list[Any]:
            answers = await super().aclaim_many(requests, **options)
            self.sent.set()
            await self.gate.wait()
            return answers

    async def main() -> Any:
        store = GatedClaims()
        grouped = CoalescingStore(store, max_in_flight=1, singles=False)
        claim = asyncio.ensure_future(grouped.aclaim("k", "", lease=LEASE, ttl=LEASE))
        await store.sent.wait()
        claim.cancel()
        store.gate.set()
        with pytest.raises(asyncio.CancelledError):
            await claim
        return store.get("k")

    record = asyncio.run(main())
    assert record is not None
    assert record.status is Status.RELEASED
