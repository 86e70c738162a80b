"""Batches: one claim call and one completion call per fetched batch, the same decisions."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from oncely import Status
from oncely.consumers import Action, ConsumerPolicy, Delivery, IdempotentConsumer, Reason, Verdict
from oncely.consumers._base import no_broker, run_with
from oncely.stores.memory import MemoryStore
from oncely.testing import FrozenClock
from tests.consumers._batching import BatchingStore, SingleVerbs

POLICY = ConsumerPolicy(lease=timedelta(seconds=10), max_attempts=2, retry_delay=0.5)


Batch = Callable[[IdempotentConsumer, list[Delivery], Callable[[Any], Any]], list[Verdict]]


@pytest.fixture(params=["sync", "async"])
def batch(request: pytest.FixtureRequest) -> Batch:
    if request.param == "sync":
        return lambda consumer, deliveries, handler: consumer.process_batch(deliveries, handler)

    def run_async(consumer: IdempotentConsumer, deliveries: list[Delivery], handler: Any) -> Any:
        async def call(message: Any) -> Any:
            return handler(message)

        return asyncio.run(consumer.aprocess_batch(deliveries, call))

    return run_async


@pytest.fixture
def store() -> BatchingStore:
    return BatchingStore(clock=FrozenClock())


def deliveries(*keys: str, body: dict[str, Any] | None = None) -> list[Delivery]:
    out = []
    for number, key in enumerate(keys):
        payload = json.dumps(body if body is not None else {"key": key}).encode()
        out.append(Delivery(payload, {"Idempotency-Key": key}, raw=(number, key)))
    return out


def reasons(verdicts: list[Verdict]) -> list[str]:
    return [str(v.reason) for v in verdicts]


def test_one_claim_and_one_completion_per_batch(store: BatchingStore, batch: Batch) -> None:
    """Five new keys: two store calls in all; handlers run in order with their messages."""
    consumer = IdempotentConsumer(store, scope="s", policy=POLICY)
    assert consumer.batches
    seen: list[Any] = []
    verdicts = batch(consumer, deliveries("a", "b", "c", "d", "e"), seen.append)
    assert reasons(verdicts) == ["processed"] * 5
    assert [v.action for v in verdicts] == [Action.ACK] * 5
    assert seen == [(0, "a"), (1, "b"), (2, "c"), (3, "d"), (4, "e")]
    assert store.calls == ["claim_many", "complete_many"]
    record = store.get("s|c")
    assert record is not None
    assert record.status is Status.COMPLETED


def test_copies_in_a_batch_run_once(store: BatchingStore, batch: Batch) -> None:
    """Copies of a key within the batch are duplicates of its first copy; later batches replay."""
    consumer = IdempotentConsumer(store, scope="s", policy=POLICY)
    seen: list[Any] = []
    first = batch(consumer, deliveries("a", "b", "a", "a"), lambda m: seen.append(m) or m[1])
    assert reasons(first) == ["processed", "processed", "duplicate", "duplicate"]
    assert first[2].result == "a"
    later = batch(consumer, deliveries("b", "c"), lambda m: seen.append(m) or m[1])
    assert reasons(later) == ["duplicate", "processed"]
    assert later[0].result == "b"  # the stored result of the first run
    assert [m[1] for m in seen] == ["a", "b", "c"]
    assert consumer.stats[Reason.DUPLICATE] == 3


def test_a_failing_handler_fails_alone(store: BatchingStore, batch: Batch) -> None:
    """One handler raising releases its lease (retry); the rest of the batch completes."""
    consumer = IdempotentConsumer(store, scope="s", policy=POLICY)

    def handler(message: Any) -> None:
        if message[1] == "b":
            raise RuntimeError("boom")

    verdicts = batch(consumer, deliveries("a", "b", "c"), handler)
    assert reasons(verdicts) == ["processed", "handler_failed", "processed"]
    assert verdicts[1].action is Action.RETRY
    record = store.get("s|b")
    assert record is not None
    assert record.status is Status.RELEASED
    again = batch(consumer, deliveries("b"), handler)  # attempt 2 of 2: dead-lettered
    assert again[0].action is Action.DEAD_LETTER
    assert again[0].reason is Reason.EXHAUSTED


def test_busy_mismatched_and_keyless_messages(store: BatchingStore, batch: Batch) -> None:
    """In one batch: a key held elsewhere retries, a reused key and a keyless one dead-letter."""
    consumer = IdempotentConsumer(store, scope="s", policy=POLICY)
    store.claim(
        "s|busy",
        consumer.fingerprint_for(deliveries("busy")[0]),
        lease=POLICY.lease,
        ttl=POLICY.ttl,
    )
    batch(consumer, deliveries("used"), lambda m: None)
    mixed = [
        *deliveries("busy"),
        *deliveries("used", body={"other": 1}),
        Delivery(b"{}", {}),
        *deliveries("new"),
        *deliveries("new", body={"other": 2}),
    ]
    verdicts = batch(consumer, mixed, lambda m: None)
    assert reasons(verdicts) == ["in_progress", "mismatch", "invalid_key", "processed", "mismatch"]
    assert verdicts[0].delay == POLICY.retry_delay
    assert [v.action for v in verdicts[1:3]] == [Action.DEAD_LETTER] * 2


@pytest.mark.parametrize("down", ["claim_many", "complete_many"])
def test_store_down_nothing_acked(
    store: BatchingStore, batch: Batch, down: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store down for the claim or the completion: every verdict is a retry, never an ack."""
    monkeypatch.setattr("oncely._execution.SETTLE_RETRY_DELAYS", (0.0,))
    consumer = IdempotentConsumer(store, scope="s", policy=POLICY)
    store.down.add(down)
    seen: list[Any] = []
    verdicts = batch(consumer, deliveries("a", "b", "a"), seen.append)
    assert {v.action for v in verdicts} == {Action.RETRY}
    assert reasons(verdicts)[:2] == ["store_unavailable"] * 2
    assert len(seen) == (0 if down == "claim_many" else 2)


def test_stores_without_batch_verbs_go_one_by_one(batch: Batch) -> None:
    """A store without the batch verbs gets the same verdicts, one delivery at a time."""
    consumer = IdempotentConsumer(SingleVerbs(MemoryStore()), scope="s", policy=POLICY)
    assert not consumer.batches
    seen: list[Any] = []
    verdicts = batch(consumer, deliveries("a", "b", "a"), seen.append)
    assert reasons(verdicts) == ["processed", "processed", "duplicate"]
    assert len(seen) == 2


def test_ordered_batches_run_nothing_after_a_retry(store: BatchingStore) -> None:
    """ordered=True: after a failure the rest is blocked, its leases held (not counted again)."""
    consumer = IdempotentConsumer(store, scope="s", policy=ConsumerPolicy(max_attempts=3))
    held: dict[str, Any] = {}
    failing = {"b"}
    seen: list[str] = []

    def handler(message: Any) -> None:
        seen.append(message[1])
        if message[1] in failing:
            raise RuntimeError("boom")

    def run(*keys: str) -> list[str]:
        flow = consumer.batch_flow(deliveries(*keys), ordered=True, held=held)
        return reasons(run_with(flow, store, handler, no_broker))

    assert run("a", "b", "c") == ["processed", "handler_failed", "blocked"]
    assert seen == ["a", "b"]
    assert set(held) == {"s|c"}
    failing.clear()
    verdicts = run("b", "c")
    assert verdicts == ["processed", "processed"]
    assert held == {}
    record = store.get("s|c")
    assert record is not None
    assert record.attempt == 1  # being blocked did not count as a start


def test_ordered_blocking_by_a_busy_key_and_giving_leases_back(store: BatchingStore) -> None:
    """A key busy elsewhere blocks what follows; release_flow gives held leases back."""
    consumer = IdempotentConsumer(store, scope="s", policy=POLICY)
    store.claim(
        "s|busy",
        consumer.fingerprint_for(deliveries("busy")[0]),
        lease=POLICY.lease,
        ttl=POLICY.ttl,
    )
    held: dict[str, Any] = {}
    flow = consumer.batch_flow(deliveries("busy", "x", "y"), ordered=True, held=held)
    assert reasons(run_with(flow, store, lambda m: None, no_broker)) == [
        "in_progress",
        "blocked",
        "blocked",
    ]
    assert set(held) == {"s|x", "s|y"}
    run_with(consumer.release_flow(held), store, lambda m: None, no_broker)
    assert held == {}
    record = store.get("s|x")
    assert record is not None
    assert record.status is Status.RELEASED


def test_ordered_without_batch_verbs_stops_at_the_first_retry() -> None:
    """The one-by-one path keeps order the same way, without claiming what it cannot run."""
    consumer = IdempotentConsumer(SingleVerbs(MemoryStore()), scope="s", policy=POLICY)
    seen: list[str] = []

    def handler(message: Any) -> None:
        seen.append(message[1])
        if message[1] == "b":
            raise RuntimeError("boom")

    flow = consumer.batch_flow(deliveries("a", "b", "c"), ordered=True)
    verdicts = run_with(flow, consumer.store, handler, no_broker)  # type: ignore[arg-type]
    assert reasons(verdicts) == ["processed", "handler_failed", "blocked"]
    assert seen == ["a", "b"]
    assert consumer.store.get("s|c") is None  # never claimed


def test_async_handlers_of_a_batch_run_concurrently(store: BatchingStore) -> None:
    """Unordered async batches run their handlers as concurrent tasks."""
    consumer = IdempotentConsumer(store, scope="s", policy=POLICY)

    async def main() -> list[Verdict]:
        started: list[str] = []
        everyone = asyncio.Event()

        async def handler(message: Any) -> None:
            started.append(message[1])
            if len(started) == 3:
                everyone.set()
            await asyncio.wait_for(everyone.wait(), 5)  # only if all three run at once

        return await consumer.aprocess_batch(deliveries("a", "b", "c"), handler)

    assert reasons(asyncio.run(main())) == ["processed"] * 3


def test_batch_verbs_are_the_batch_store_protocol() -> None:
    """BATCH_VERBS names exactly the verbs of oncely.BatchStore, which `batches` checks."""
    import typing

    from oncely import BatchStore
    from oncely.consumers import BATCH_VERBS

    members = typing._get_protocol_attrs(BatchStore)  # type: ignore[attr-defined]
    assert sorted(members) == sorted(BATCH_VERBS)


def test_a_cancellation_during_the_batch_completion_still_records_it() -> None:
    """The handlers ran: cancelling during complete_many must not leave them to run again."""
    clock = FrozenClock()

    class CompletionHangs(BatchingStore):
        def __init__(self) -> None:
            super().__init__(clock=clock)
            self.completing = asyncio.Event()
            self.go = asyncio.Event()

        async def acomplete_many(self, items: Any, *, ttl: timedelta) -> list[Any]:
            self.completing.set()
            await self.go.wait()
            return self.complete_many(items, ttl=ttl)

    store = CompletionHangs()
    consumer = IdempotentConsumer(store, scope="s", policy=POLICY)
    ran: list[Any] = []

    async def handler(message: Any) -> None:
        ran.append(message)

    async def main() -> list[Verdict]:
        task = asyncio.create_task(consumer.aprocess_batch(deliveries("a", "b"), handler))
        await store.completing.wait()
        task.cancel()
        await asyncio.sleep(0)
        store.go.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        clock.advance(timedelta(minutes=1))  # the leases are long gone
        store.go.set()
        return await consumer.aprocess_batch(deliveries("a", "b"), handler)

    assert reasons(asyncio.run(main())) == ["duplicate", "duplicate"]
    assert len(ran) == 2
