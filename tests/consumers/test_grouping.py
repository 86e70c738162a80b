"""The one grouping of claims and completions (`CoalescingStore`), as the consumers use it:
what a cancelled caller leaves behind."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest

from oncely import AsyncStore, BatchStore, Status, SyncStore
from oncely.consumers import Delivery, IdempotentConsumer
from oncely.errors import ConfigurationError
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


def test_batches_share_one_grouped_store_until_the_store_is_replaced() -> None:
    """A consumer groups the calls of every batch (and delivery) through one `CoalescingStore`,
    made once per store, on every event loop; a store put in its place gets a new one, and
    the next batches' calls go to it alone."""
    first, second = BatchingStore(), BatchingStore()
    consumer = IdempotentConsumer(first, scope="grouped")

    async def handler(raw: Any) -> None:
        pass

    def batch(*keys: str) -> list[Any]:
        deliveries = [Delivery(b"{}", {"Idempotency-Key": key}) for key in keys]
        return asyncio.run(consumer.aprocess_batch(deliveries, handler))

    grouped = consumer._calls_to(first)
    assert [v.reason for v in batch("a", "b")] == [v.reason for v in batch("c", "d")]
    assert consumer._calls_to(first) is grouped
    assert grouped.store is first
    assert grouped._completions._loops  # the batches' completions went through it
    assert first.calls.count("complete_many") == 2  # one per batch, on two loops

    consumer.store = second
    verdicts = batch("a", "e")
    assert consumer._calls_to(second) is not grouped
    assert consumer._calls_to(second).store is second
    assert [v.reason.value for v in verdicts] == ["processed", "processed"]
    assert first.calls.count("complete_many") == 2
    assert second.calls.count("complete_many") == 1


def test_what_the_store_is_is_checked_once_per_store() -> None:
    """Whether the store is an `AsyncStore` (`BatchStore`...) is asked of each store once, not
    for every batch; a store put in the consumer's place is asked again, and one of the wrong
    kind is refused as ever."""

    class _Sync:
        """Not a store of any kind."""

    store = BatchingStore()
    consumer = IdempotentConsumer(store, scope="kinds")
    assert consumer.batches
    assert consumer._required(AsyncStore) is store
    assert consumer._kinds == (store, {BatchStore: True, AsyncStore: True})
    consumer.store = _Sync()  # type: ignore[assignment]
    assert not consumer.batches
    with pytest.raises(ConfigurationError, match="_Sync is not an AsyncStore"):
        consumer._required(AsyncStore)
    with pytest.raises(ConfigurationError, match="_Sync is not a SyncStore"):
        consumer._required(SyncStore)
