"""`BloomStore`: a duplicate that arrives after its record expired is still recognised."""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta

import pytest

import oncely
from oncely import Acquired, Replay, Status
from oncely.bloom import BloomFilter, RedisBloomFilter
from oncely.consumers import Action, ConsumerPolicy, Delivery, IdempotentConsumer, Reason
from oncely.stores.bloom import LATE_DUPLICATE, BloomStore
from oncely.stores.memory import MemoryStore
from oncely.testing import FrozenClock
from tests.conftest import service_url

TTL = timedelta(minutes=10)
LEASE = timedelta(seconds=30)


@pytest.fixture
def clock() -> FrozenClock:
    return FrozenClock()


@pytest.fixture
def store(clock: FrozenClock) -> BloomStore:
    return BloomStore(MemoryStore(clock=clock), BloomFilter(10_000, 0.001))


def test_a_key_completed_before_its_record_expired_is_not_run_again(
    store: BloomStore, clock: FrozenClock
) -> None:
    runs: list[str] = []

    @oncely.idempotent(store=store, key="order", ttl=TTL)
    def ship(order: str) -> str:
        runs.append(order)
        return f"shipped {order}"

    assert ship("o-1") == "shipped o-1"
    assert ship("o-1") == "shipped o-1"  # a replay within the ttl, as always
    clock.advance(TTL * 2)  # the record is gone; the filter remembers
    assert not store.inner.scan()  # type: ignore[attr-defined]
    with pytest.raises(oncely.ResultUnavailableError, match="Bloom filter"):
        ship("o-1")
    assert runs == ["o-1"]
    assert store.late_duplicates == 1
    # The late duplicate left a finished record: the next copy is an ordinary replay.
    with pytest.raises(oncely.ResultUnavailableError):
        ship("o-1")
    assert store.late_duplicates == 1
    assert ship("o-2") == "shipped o-2"  # certainly new: no store read, it runs
    assert runs == ["o-1", "o-2"]


def test_only_outcomes_are_remembered(store: BloomStore, clock: FrozenClock) -> None:
    """A run that raised released its lease: it took no effect, so a retry after the ttl runs.
    A failure declared final is an outcome, remembered like a result."""
    attempts: list[int] = []

    class Declined(Exception):
        pass

    @oncely.idempotent(store=store, key="n", ttl=TTL, final_errors=(Declined,))
    def work(n: int) -> int:
        attempts.append(n)
        if n == 1:
            raise RuntimeError("transient")
        if n == 2:
            raise Declined()
        return n

    with pytest.raises(RuntimeError):
        work(1)
    with pytest.raises(Declined):
        work(2)
    clock.advance(TTL * 2)
    with pytest.raises(RuntimeError):
        work(1)  # released, never remembered: it runs again
    with pytest.raises(oncely.ResultUnavailableError):
        work(2)  # failed for good before: a late duplicate
    assert attempts == [1, 2, 1]


def test_a_batch_claim_checks_its_fresh_keys_at_once(store: BloomStore, clock: FrozenClock) -> None:
    claimed = store.claim_many([("a", "fp"), ("b", "fp")], lease=LEASE, ttl=TTL)
    tokens = [answer.token for answer in claimed if isinstance(answer, Acquired)]
    assert store.complete_many([("a", tokens[0], b"A")], ttl=TTL) == [None]
    assert store.release("b", tokens[1]) is None
    clock.advance(TTL * 2)
    again = store.claim_many([("a", "fp"), ("b", "fp"), ("c", "fp")], lease=LEASE, ttl=TTL)
    assert isinstance(again[0], Replay)
    assert again[0].record.status is Status.COMPLETED
    assert LATE_DUPLICATE.encode() in (again[0].record.result or b"")
    assert isinstance(again[1], Acquired)
    assert isinstance(again[2], Acquired)
    assert store.late_duplicates == 1


def test_a_consumer_acknowledges_a_late_duplicate_without_running(
    store: BloomStore, clock: FrozenClock
) -> None:
    consumer = IdempotentConsumer(store, scope="events", policy=ConsumerPolicy(ttl=TTL))
    delivery = Delivery(body=b'{"n": 1}', headers={"Idempotency-Key": "evt-1"})
    runs: list[int] = []
    first = consumer.process(delivery, lambda: runs.append(1))
    assert first.action is Action.ACK
    clock.advance(TTL * 2)
    late = consumer.process(delivery, lambda: runs.append(2))
    assert late.action is Action.ACK
    assert late.reason is Reason.DUPLICATE
    assert runs == [1]


@pytest.mark.redis
def test_processes_share_a_filter_in_redis() -> None:
    """Two stores (two processes, as far as each knows) over one Redis and one shared filter:
    what one completed, the other recognises after the record is gone, sync and async."""
    import redis
    import redis.asyncio

    url = service_url("ONCELY_TEST_REDIS_URL")
    namespace = f"oncely-test-bloom-{uuid.uuid4().hex[:8]}"
    name = f"{namespace}:filter"
    sync_client = redis.Redis.from_url(url)
    async_client = redis.asyncio.Redis.from_url(url)

    def open_one() -> BloomStore:
        shared = RedisBloomFilter(sync_client, name, 10_000, 0.001, async_client=async_client)
        return BloomStore(oncely.open_store(url, namespace=namespace), shared)

    first, second = open_one(), open_one()
    try:
        claimed = first.claim("k", "fp", lease=LEASE, ttl=TTL)
        assert isinstance(claimed, Acquired)
        assert first.complete("k", claimed.token, b"done", ttl=TTL) is None
        assert first.forget("k") is Status.COMPLETED  # as if it had expired
        late = second.claim("k", "fp", lease=LEASE, ttl=TTL)
        assert isinstance(late, Replay)
        assert LATE_DUPLICATE.encode() in (late.record.result or b"")

        async def run() -> None:
            fresh = await second.aclaim("k2", "fp", lease=LEASE, ttl=TTL)
            assert isinstance(fresh, Acquired)
            assert await second.acomplete("k2", fresh.token, b"ok", ttl=TTL) is None
            assert second.forget("k2") is Status.COMPLETED
            assert isinstance(await first.aclaim("k2", "fp", lease=LEASE, ttl=TTL), Replay)
            await async_client.aclose()

        asyncio.run(run())
    finally:
        sync_client.delete(name)
        first.close()
        second.close()
        sync_client.close()


def test_a_filter_without_the_client_for_a_call_says_so() -> None:
    class SyncOnly:
        async def execute_command(self) -> None: ...

        def register_script(self, script: str) -> object:
            return lambda **kwargs: [1]

    only_async = RedisBloomFilter(SyncOnly(), "f", 10, 0.1)
    with pytest.raises(oncely.ConfigurationError, match="no sync redis client"):
        only_async.add("x")
