"""Batches: one claim call and one completion call per fetched batch, the same decisions."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis

import oncely
from oncely import Acquired, Status, _switches
from oncely.consumers import Action, ConsumerPolicy, Delivery, IdempotentConsumer, Reason, Verdict
from oncely.consumers._drivers import Parallel, ano_broker, arun_with, no_broker, run_with
from oncely.stores.memory import MemoryStore
from oncely.testing import FrozenClock
from tests._helpers import eventually
from tests.consumers._batching import BatchingStore, SingleVerbs
from tests.consumers.conftest import delete_namespace

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


def make_busy(consumer: IdempotentConsumer, store: Any) -> None:
    """Have key ``busy`` claimed by another worker."""
    busy = deliveries("busy")[0]
    store.claim("s|busy", consumer.fingerprint_for(busy), lease=POLICY.lease, ttl=POLICY.ttl)


def reasons(verdicts: list[Verdict]) -> list[str]:
    return [str(v.reason) for v in verdicts]


def test_one_claim_per_batch(store: BatchingStore, batch: Batch) -> None:
    """Five new keys: one claim call; handlers run in order with their messages; completions
    go in batch calls (those finishing while one is in flight go together)."""
    consumer = IdempotentConsumer(store, scope="s", policy=POLICY)
    assert consumer.batches
    seen: list[Any] = []
    verdicts = batch(consumer, deliveries("a", "b", "c", "d", "e"), seen.append)
    assert reasons(verdicts) == ["processed"] * 5
    assert [v.action for v in verdicts] == [Action.ACK] * 5
    assert seen == [(0, "a"), (1, "b"), (2, "c"), (3, "d"), (4, "e")]
    assert store.calls[0] == "claim_many"
    assert set(store.calls[1:]) == {"complete_many"}
    assert len(store.calls) <= 6
    for key in "abcde":
        record = store.get(f"s|{key}")
        assert record is not None
        assert record.status is Status.COMPLETED


@pytest.mark.parametrize("mode", ["sync", "ordered", "async"])
def test_each_message_is_completed_as_its_handler_returns(store: BatchingStore, mode: str) -> None:
    """A later handler of the batch finds the earlier messages completed already: a worker
    killed there does not run them again after their leases expire."""
    consumer = IdempotentConsumer(store, scope="s", policy=POLICY)
    found: list[Any] = []

    def completed() -> bool:
        records = [store.get(f"s|{key}") for key in "ab"]
        return all(r is not None and r.status is Status.COMPLETED for r in records)

    def handler(message: Any) -> None:
        if message[1] == "c":
            found.append(eventually(completed))

    async def ahandler(message: Any) -> None:
        if message[1] == "c":
            for _ in range(500):  # bounded: 10 s
                if completed():
                    found.append(True)
                    break
                await asyncio.sleep(0.02)

    ordered = mode == "ordered"
    flow = consumer.batch_flow(deliveries("a", "b", "c"), ordered=ordered, held={})
    if mode == "async":
        verdicts = asyncio.run(arun_with(flow, store, ahandler, ano_broker))
    else:
        verdicts = run_with(flow, store, handler, no_broker)
    assert reasons(verdicts) == ["processed"] * 3
    assert found == [True]


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
    make_busy(consumer, store)
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
    monkeypatch.setattr("oncely._execution.flows.SETTLE_RETRY_DELAYS", (0.0,))
    consumer = IdempotentConsumer(store, scope="s", policy=POLICY)
    store.down.add(down)
    seen: list[Any] = []
    verdicts = batch(consumer, deliveries("a", "b", "a"), seen.append)
    assert {v.action for v in verdicts} == {Action.RETRY}
    assert reasons(verdicts)[:2] == ["store_unavailable"] * 2
    assert len(seen) == (0 if down == "claim_many" else 2)


def test_sync_completions_that_did_not_land_retry_together(
    store: BatchingStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sync, the completions of a batch that did not land go on with the settle flow side by
    side, as async tasks do: each pause is taken once for all of them (not once per message),
    and each round's completions go together, a few batch calls, not one per message."""
    monkeypatch.setattr("oncely._execution.flows.SETTLE_RETRY_DELAYS", (0.013, 0.017))
    pauses: list[float] = []
    monkeypatch.setattr("oncely.consumers._grouping.time", SimpleNamespace(sleep=pauses.append))
    consumer = IdempotentConsumer(store, scope="s", policy=POLICY)
    store.down.add("complete_many")
    verdicts = consumer.process_batch(deliveries("a", "b", "c", "d"), lambda m: None)
    assert reasons(verdicts) == ["store_unavailable"] * 4
    assert pauses == [0.013, 0.017]
    # 3 rounds, each sent twice (once more to learn each item's outcome); in a round the
    # sender takes what is queued when it is free: the first item alone at worst, then the rest
    # (the first round goes as the handlers return: 4 calls at worst).
    assert store.calls.count("complete_many") <= 2 * (4 + 2 + 2)


def test_a_completion_applied_with_its_reply_lost_is_processed(
    store: BatchingStore, batch: Batch, monkeypatch: pytest.MonkeyPatch
) -> None:
    """complete_many applied but its reply lost: sent again it answers LeaseLost, and the
    record shows the completion was ours: processed and acked, not a lost lease."""
    monkeypatch.setattr("oncely._execution.flows.SETTLE_RETRY_DELAYS", (0.0,))
    consumer = IdempotentConsumer(store, scope="s", policy=POLICY)
    store.lost.add("complete_many")
    verdicts = batch(consumer, deliveries("a"), lambda m: m[1])
    assert reasons(verdicts) == ["processed"]
    assert verdicts[0].action is Action.ACK
    assert store.calls == ["claim_many", "complete_many", "complete_many"]


def test_a_claim_call_that_never_arrived_is_sent_again(store: BatchingStore, batch: Batch) -> None:
    """claim_many failed before it reached the store: sent once more, the batch runs now
    instead of waiting for its redelivery."""
    consumer = IdempotentConsumer(store, scope="s", policy=POLICY)
    store.once.add("claim_many")
    seen: list[Any] = []
    verdicts = batch(consumer, deliveries("a", "b"), seen.append)
    assert reasons(verdicts) == ["processed", "processed"]
    assert len(seen) == 2
    assert store.calls[:2] == ["claim_many", "claim_many"]


def test_a_claim_applied_with_its_reply_lost_never_runs(store: BatchingStore, batch: Batch) -> None:
    """claim_many applied but its reply lost: sent again, its own claims answer InProgress,
    which cannot be told from another worker's: not run, redelivered (never twice at once)."""
    consumer = IdempotentConsumer(store, scope="s", policy=POLICY)
    store.lost.add("claim_many")
    seen: list[Any] = []
    verdicts = batch(consumer, deliveries("a", "b"), seen.append)
    assert reasons(verdicts) == ["store_unavailable", "store_unavailable"]
    assert {v.action for v in verdicts} == {Action.RETRY}
    assert seen == []


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
    make_busy(consumer, store)
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


def _partitions(
    consumer: IdempotentConsumer, store: Any, *batches: list[Delivery], pause: float = 0.01
) -> tuple[list[list[Verdict]], list[Any]]:
    """Run *batches* as ordered flows of one async run (a Kafka member's partitions of one
    poll); return their verdicts and the messages handled, in order."""
    ran: list[Any] = []

    async def handler(message: Any) -> None:
        ran.append(message)
        await asyncio.sleep(pause)

    def flows() -> Any:
        runs = [consumer.batch_flow(b, ordered=True, held={}) for b in batches]
        verdicts: list[list[Verdict]] = yield Parallel(runs)
        return verdicts

    return asyncio.run(arun_with(flows(), store, handler, ano_broker)), ran


def test_a_copy_in_another_partition_runs_under_the_lease_not_yet_started(
    store: BatchingStore,
) -> None:
    """Two partitions of one poll hold copies of k: the one reaching it first runs it, under
    the lease the other one claimed; the other's copy is then a duplicate, not a retry."""
    consumer = IdempotentConsumer(store, scope="s", policy=POLICY)
    first = deliveries("a", "b", "k")
    second = [Delivery(d.body, d.headers, raw=("second", *d.raw)) for d in deliveries("k", "c")]
    (one, two), ran = _partitions(consumer, store, first, second)
    assert reasons(one) == ["processed", "processed", "duplicate"]
    assert reasons(two) == ["processed", "processed"]
    assert [m for m in ran if m[-1] == "k"] == [("second", 0, "k")]  # once, in the second
    record = store.get("s|k")
    assert record is not None
    assert record.status is Status.COMPLETED
    assert record.attempt == 1


def test_a_copy_in_another_partition_waits_for_the_running_one(store: BatchingStore) -> None:
    """The first partition runs k first: the second one's copy waits for it (no retry)."""
    consumer = IdempotentConsumer(store, scope="s", policy=POLICY)
    second = [Delivery(d.body, d.headers, raw=("second", *d.raw)) for d in deliveries("c", "k")]
    (one, two), ran = _partitions(consumer, store, deliveries("k", "a"), second, pause=0.05)
    assert reasons(one) == ["processed", "processed"]
    assert reasons(two) == ["processed", "duplicate"]
    assert [m for m in ran if m[-1] == "k"] == [(0, "k")]
    assert consumer.stats[Reason.IN_PROGRESS] == 0


def test_a_copy_with_another_payload_does_not_take_the_lease(store: BatchingStore) -> None:
    """A copy of k with another body is not run under the lease claimed for the first one."""
    consumer = IdempotentConsumer(store, scope="s", policy=POLICY)
    first = deliveries("a", "k")
    second = [Delivery(b'{"other": 1}', {"Idempotency-Key": "k"}, raw=("second", 0, "k"))]
    (one, two), ran = _partitions(consumer, store, first, second)
    assert reasons(one) == ["processed", "processed"]
    assert two[0].action is not Action.ACK
    assert [m for m in ran if m[-1] == "k"] == [(1, "k")]


def test_a_lease_held_in_one_partition_runs_a_copy_in_another(store: BatchingStore) -> None:
    """Kafka shares the leases held for blocked records across partitions: a copy of such a
    key in another partition runs under that lease (no start counted), instead of finding
    the key busy and blocking its partition too."""
    from oncely.consumers._kafka_flows import _Held, _PartitionState

    consumer = IdempotentConsumer(store, scope="s", policy=POLICY)
    make_busy(consumer, store)
    every: dict[Any, _PartitionState] = {}
    flow = consumer.batch_flow(deliveries("busy", "k"), ordered=True, held=_Held(every, ("t", 0)))
    assert reasons(run_with(flow, store, lambda m: None, no_broker)) == ["in_progress", "blocked"]
    assert set(every[("t", 0)].held) == {"s|k"}
    flow = consumer.batch_flow(deliveries("c", "k"), ordered=True, held=_Held(every, ("t", 1)))
    assert reasons(run_with(flow, store, lambda m: None, no_broker)) == ["processed"] * 2
    assert {part: state.held for part, state in every.items()} == {("t", 0): {}, ("t", 1): {}}
    record = store.get("s|k")
    assert record is not None
    assert record.status is Status.COMPLETED
    assert record.attempt == 1


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


def chunked_batch() -> tuple[list[str], list[Delivery]]:
    """130 keys, the first and the last ones delivered twice more at the batch's other end."""
    keys = [f"k{n}" for n in range(130)]
    return keys, deliveries(*keys, "k129", "k0", "k64")


def test_a_large_async_batch_is_claimed_in_chunks_sent_at_once(store: BatchingStore) -> None:
    """An async batch of more keys than `CLAIM_CHUNK` sends its claims in chunks at once: the
    first chunk's handlers run before the last chunk's claim is answered. A key's copies
    are in its first copy's chunk: duplicates of its one run, as in one claim."""
    from oncely.consumers._batch import CLAIM_CHUNK

    consumer = IdempotentConsumer(store, scope="s", policy=POLICY)
    keys, batch = chunked_batch()
    ran: list[str] = []

    async def main() -> list[Verdict]:
        first_ran = asyncio.Event()
        claim_many = store.aclaim_many

        async def aclaim_many(requests: Any, **options: Any) -> list[Any]:
            if requests[0][0] == f"s|k{CLAIM_CHUNK * 2}":  # the last chunk: after a handler
                await asyncio.wait_for(first_ran.wait(), 5)  # only if claims overlap handlers
            return await claim_many(requests, **options)

        async def handler(message: Any) -> None:
            ran.append(message[1])
            first_ran.set()

        store.aclaim_many = aclaim_many  # type: ignore[method-assign]
        return await consumer.aprocess_batch(batch, handler)

    verdicts = asyncio.run(main())
    assert store.calls.count("claim_many") == 3
    assert sorted(ran) == sorted(keys)
    assert reasons(verdicts) == ["processed"] * 130 + ["duplicate"] * 3
    assert [v.key for v in verdicts[130:]] == ["s|k129", "s|k0", "s|k64"]


def test_a_large_sync_batch_is_claimed_in_one_call(store: BatchingStore) -> None:
    """A sync driver runs flows one after the other: chunks would only add round trips."""
    consumer = IdempotentConsumer(store, scope="s", policy=POLICY)
    keys, batch = chunked_batch()
    ran: list[str] = []
    verdicts = consumer.process_batch(batch, lambda message: ran.append(message[1]))
    assert store.calls.count("claim_many") == 1
    assert sorted(ran) == sorted(keys)
    assert reasons(verdicts) == ["processed"] * 130 + ["duplicate"] * 3


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


def test_a_cancellation_during_a_failing_completion_still_records_it() -> None:
    """The batch is cancelled while its completion call is in flight, and that call fails
    (twice: the grouped store sends it again at once): the completion is sent again all the
    same (the handlers ran), and a later copy is a duplicate."""
    clock = FrozenClock()

    class CompletionHangsThenFails(BatchingStore):
        def __init__(self) -> None:
            super().__init__(clock=clock)
            self.completing = asyncio.Event()
            self.go = asyncio.Event()
            self.failures = 0

        async def acomplete_many(self, items: Any, *, ttl: timedelta) -> list[Any]:
            if self.failures < 2:
                self.failures += 1
                self.completing.set()
                await self.go.wait()
                raise oncely.StoreUnavailableError("connection reset", backend="test")
            return self.complete_many(items, ttl=ttl)

    store = CompletionHangsThenFails()
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
        return await consumer.aprocess_batch(deliveries("a", "b"), handler)

    assert reasons(asyncio.run(main())) == ["duplicate", "duplicate"]
    assert len(ran) == 2


@pytest.fixture
def redis_store(redis_url: str, name: str) -> Iterator[Any]:
    """The shared Redis, in a namespace of this test's own."""
    made = oncely.open_store(redis_url, namespace=name)
    yield made
    made.close()
    delete_namespace(redis_url, name)


@pytest.mark.redis
@pytest.mark.parametrize("other", ["completed", "running"])
def test_a_held_lease_taken_over_meanwhile_is_not_used(redis_store: Any, other: str) -> None:
    """An ordered batch holds the lease of a blocked key; it lapses, another worker recovers
    the key (and completes it, or is still running it): the held lease must not run it again."""
    policy = ConsumerPolicy(lease=timedelta(seconds=1), max_attempts=5, retry_delay=0.1)
    consumer = IdempotentConsumer(redis_store, scope="s", policy=policy)
    assert consumer.batches
    busy, blocked = deliveries("busy", "x")
    print_of = consumer.fingerprint_for
    lease, ttl = timedelta(seconds=30), policy.ttl
    assert isinstance(redis_store.claim("s|busy", print_of(busy), lease=lease, ttl=ttl), Acquired)
    held: dict[str, Any] = {}
    seen: list[str] = []

    def run() -> list[str]:
        flow = consumer.batch_flow([busy, blocked], ordered=True, held=held)
        return reasons(run_with(flow, redis_store, lambda m: seen.append(m[1]), no_broker))

    assert run() == ["in_progress", "blocked"]
    assert set(held) == {"s|x"}

    def take_over() -> Acquired | None:  # another worker, once the held lease has lapsed
        answer = redis_store.claim("s|x", print_of(blocked), lease=lease, ttl=ttl)
        return answer if isinstance(answer, Acquired) else None

    taken = eventually(take_over, timeout=15, interval=0.1)
    assert taken.recovered
    if other == "completed":
        assert redis_store.complete("s|x", taken.token, b'{"v":"other"}', ttl=ttl) is None
    stored = redis_store.get("s|busy")
    assert redis_store.release("s|busy", stored.token) is None
    verdicts = run()
    assert seen == ["busy"]  # x ran once, in the other worker
    assert verdicts == ["processed", "duplicate" if other == "completed" else "in_progress"]
    assert held == {}


@pytest.mark.redis
def test_a_held_lease_that_lapsed_unclaimed_is_still_used(redis_store: Any, redis_url: str) -> None:
    """A held lease that lapsed with nobody taking the key over is still ours: it runs, as
    the first attempt (being held is not a start)."""
    policy = ConsumerPolicy(lease=timedelta(milliseconds=300), heartbeat=False, retry_delay=0.1)
    consumer = IdempotentConsumer(redis_store, scope="s", policy=policy)
    busy, blocked = deliveries("busy", "x")
    lease, ttl = timedelta(seconds=30), policy.ttl
    redis_store.claim("s|busy", consumer.fingerprint_for(busy), lease=lease, ttl=ttl)
    held: dict[str, Any] = {}
    seen: list[str] = []

    def run() -> list[str]:
        flow = consumer.batch_flow([busy, blocked], ordered=True, held=held)
        return reasons(run_with(flow, redis_store, lambda m: seen.append(m[1]), no_broker))

    assert run() == ["in_progress", "blocked"]
    client = redis.Redis.from_url(redis_url)

    def lapsed() -> bool:
        seconds, micros = client.time()  # the server's clock, which judges leases
        return bool(redis_store.get("s|x").lease_expires_at_ms < seconds * 1000 + micros // 1000)

    eventually(lapsed)
    client.close()
    redis_store.release("s|busy", redis_store.get("s|busy").token)
    assert run() == ["processed", "processed"]
    assert seen == ["busy", "x"]
    record = redis_store.get("s|x")
    assert record.status is Status.COMPLETED
    assert record.attempt == 1


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_completions_of_two_consumers_in_one_driver_keep_their_own_ttl(mode: str) -> None:
    """Two consumers' batches driven together (a `Parallel`): their completions are grouped
    per consumer, each with its own ttl."""
    clock = FrozenClock()
    store = BatchingStore(clock=clock)
    short = IdempotentConsumer(store, scope="short", policy=ConsumerPolicy(ttl=3600))
    long = IdempotentConsumer(store, scope="long", policy=ConsumerPolicy(ttl=7200))

    def both() -> Any:
        return (
            yield Parallel(
                [short.batch_flow(deliveries("a", "b")), long.batch_flow(deliveries("a", "b"))]
            )
        )

    async def ahandler(message: Any) -> None:
        return None

    if mode == "sync":
        run_with(both(), store, lambda m: None, no_broker)
    else:
        asyncio.run(arun_with(both(), store, ahandler, ano_broker))
    for scope, ttl in (("short", 3600), ("long", 7200)):
        for key in "ab":
            record = store.get(f"{scope}|{key}")
            assert record is not None
            assert record.status is Status.COMPLETED
            assert record.expires_at_ms == record.updated_at_ms + ttl * 1000


@pytest.mark.redis
def test_a_batch_claim_applied_with_its_reply_lost_runs_once_on_redis(batch: Batch) -> None:
    """Against the real Redis: claim_many ran but its reply never came. Sent again with the
    same call ids, the runner's own claims answer Acquired: every handler runs once, now, and
    no key is left in progress for a lease."""
    from tests._proxy import Proxy
    from tests.conftest import service_url

    url = service_url("ONCELY_TEST_REDIS_URL")
    namespace = f"oncely-t-{uuid.uuid4().hex[:12]}"
    proxy = Proxy(urlsplit(url).port or 6379)
    through = oncely.open_store(
        f"redis://127.0.0.1:{proxy.port}/0?socket_timeout=0.5", namespace=namespace, retries=0
    )
    direct = oncely.open_store(url, namespace=namespace)
    try:
        consumer = IdempotentConsumer(through, scope="s", policy=POLICY)
        proxy.arm(b"s|b", hold=True)
        seen: list[Any] = []
        verdicts = batch(consumer, deliveries("a", "b", "c"), seen.append)
        assert proxy.cut.is_set()
        assert reasons(verdicts) == ["processed"] * 3
        assert seen == [(0, "a"), (1, "b"), (2, "c")]
        for key in "abc":
            record = direct.get(f"s|{key}")
            assert record is not None
            assert record.status is Status.COMPLETED
    finally:
        asyncio.run(through.aclose())
        through.close()
        direct.close()
        proxy.close()
        delete_namespace(url, namespace)


# -- deliveries handled one per task (aprocess): their claims and completions grouped ----------


@pytest.fixture
def grouped_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The grouping is the fast path's (the reference flow claims one delivery at a time, so it
    neither bounds group calls nor shares a running copy): held to it even in a run through the
    reference flows, where the rest of this section checks the same verdicts."""
    monkeypatch.setattr(_switches, "reference_flows", False)


def test_concurrent_deliveries_share_claim_and_completion_calls(store: BatchingStore) -> None:
    """Deliveries handled at once, one task each, claim and complete in a few batch calls
    (group commit), with every decision as alone: each runs once, the copy is a duplicate."""
    consumer = IdempotentConsumer(store, scope="orders", policy=POLICY)
    ran: list[Any] = []

    async def main() -> list[Verdict]:
        async def one(delivery: Delivery) -> Verdict:
            async def handler() -> str:
                await asyncio.sleep(0)
                ran.append(delivery.raw[1])
                return "done"

            return await consumer.aprocess(delivery, handler)

        first = await asyncio.gather(*(one(d) for d in deliveries(*"abcdefghij")))
        return [*first, await one(deliveries("a")[0])]

    verdicts = asyncio.run(main())
    assert sorted(ran) == list("abcdefghij")
    assert reasons(verdicts) == ["processed"] * 10 + ["duplicate"]
    assert all(v.action is Action.ACK for v in verdicts)
    # those made in one turn of the loop go together; the copy's claim comes later
    assert store.calls.count("claim_many") <= 3
    assert store.calls.count("complete_many") <= 2
    for key in "abcdefghij":
        record = store.get(consumer.key_for(deliveries(key)[0]))
        assert record is not None
        assert record.status is Status.COMPLETED


@pytest.mark.usefixtures("grouped_path")
def test_grouped_batch_calls_are_bounded() -> None:
    """However many deliveries wait, no batch call carries more than 256 of them."""
    sizes: list[int] = []

    class Sizes(BatchingStore):
        async def aclaim_many(self, requests: Any, **options: Any) -> list[Any]:
            sizes.append(len(requests))
            return await super().aclaim_many(requests, **options)

    consumer = IdempotentConsumer(Sizes(), scope="orders", policy=POLICY)

    async def handler() -> None:
        return None

    async def main() -> list[Verdict]:
        keys = [f"k{n}" for n in range(600)]
        return await asyncio.gather(*(consumer.aprocess(d, handler) for d in deliveries(*keys)))

    verdicts = asyncio.run(main())
    assert all(v.reason is Reason.PROCESSED for v in verdicts)
    assert sum(sizes) == 600
    assert max(sizes) <= 256


@pytest.mark.usefixtures("grouped_path")
def test_a_claim_cancelled_before_it_is_sent_takes_no_lease() -> None:
    """A delivery cancelled while its claim waits for the one in flight is not claimed: its
    redelivery runs at once, not after a lease nobody holds."""
    release: list[asyncio.Event] = []

    class Slow(BatchingStore):
        async def aclaim_many(self, requests: Any, **options: Any) -> list[Any]:
            await release[0].wait()
            return await super().aclaim_many(requests, **options)

    slow = Slow(clock=FrozenClock())
    consumer = IdempotentConsumer(slow, scope="orders", policy=POLICY)

    async def handler() -> None:
        return None

    async def main() -> None:
        release.append(asyncio.Event())
        first = asyncio.ensure_future(consumer.aprocess(deliveries("a")[0], handler))
        await asyncio.sleep(0)  # "a" is in flight; "b" waits behind it
        second = asyncio.ensure_future(consumer.aprocess(deliveries("b")[0], handler))
        await asyncio.sleep(0)
        second.cancel()
        release[0].set()
        assert (await first).reason is Reason.PROCESSED
        with pytest.raises(asyncio.CancelledError):
            await second

    asyncio.run(main())
    assert slow.get(consumer.key_for(deliveries("b")[0])) is None


@pytest.mark.usefixtures("grouped_path")
def test_a_copy_of_a_running_delivery_waits_for_it_and_is_a_duplicate(
    store: BatchingStore,
) -> None:
    """A copy of a delivery the consumer is running (a redelivery racing the first) waits for
    that run, then is acked as its duplicate: not retried after retry_delay, never run twice."""
    consumer = IdempotentConsumer(store, scope="orders", policy=POLICY)
    ran: list[int] = []

    async def main() -> list[Verdict]:
        async def handler() -> str:
            ran.append(1)
            await asyncio.sleep(0.05)
            return "done"

        first = asyncio.ensure_future(consumer.aprocess(deliveries("a")[0], handler))
        await asyncio.sleep(0.01)  # the first copy runs its handler
        copy = await consumer.aprocess(deliveries("a")[0], handler)
        return [await first, copy]

    verdicts = asyncio.run(main())
    assert ran == [1]
    assert [(v.action, v.reason) for v in verdicts] == [
        (Action.ACK, Reason.PROCESSED),
        (Action.ACK, Reason.DUPLICATE),
    ]
    assert verdicts[1].result == "done"


@pytest.mark.usefixtures("grouped_path")
def test_copies_of_a_running_delivery_all_wait_for_it(store: BatchingStore) -> None:
    """Two copies arriving while the first runs wait for that one run (the first copy to wait
    makes what they wait on): both are its duplicates, and nothing is left marked running."""
    consumer = IdempotentConsumer(store, scope="orders", policy=POLICY)
    ran: list[int] = []

    async def main() -> list[Verdict]:
        async def handler() -> str:
            ran.append(1)
            await asyncio.sleep(0.05)
            return "done"

        first = asyncio.ensure_future(consumer.aprocess(deliveries("a")[0], handler))
        await asyncio.sleep(0.01)  # the first copy runs its handler
        copies = [consumer.aprocess(deliveries("a")[0], handler) for _ in range(2)]
        verdicts = [await first, *await asyncio.gather(*copies)]
        assert not consumer._async_calls[2]  # no key left running
        return verdicts

    verdicts = asyncio.run(main())
    assert ran == [1]
    assert [v.reason for v in verdicts] == [Reason.PROCESSED, Reason.DUPLICATE, Reason.DUPLICATE]


def test_a_copy_waits_for_a_running_delivery_no_longer_than_retry_delay(
    store: BatchingStore,
) -> None:
    """A copy waits for the running delivery at most retry_delay: then its claim answers in
    progress and it is retried, as a copy running on another worker would be."""
    policy = ConsumerPolicy(lease=timedelta(seconds=10), retry_delay=0.05)
    consumer = IdempotentConsumer(store, scope="orders", policy=policy)

    async def main() -> Verdict:
        release = asyncio.Event()

        async def handler() -> None:
            await release.wait()

        first = asyncio.ensure_future(consumer.aprocess(deliveries("a")[0], handler))
        await asyncio.sleep(0.01)
        copy = await consumer.aprocess(deliveries("a")[0], handler)
        release.set()
        await first
        return copy

    verdict = asyncio.run(main())
    assert (verdict.action, verdict.reason) == (Action.RETRY, Reason.IN_PROGRESS)
