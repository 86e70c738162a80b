"""Redis Streams (redis-py consumer groups) against the real server; effects are PostgreSQL rows."""

from __future__ import annotations

import asyncio
import json
import random
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.asyncio

from oncely import Status
from oncely.consumers import Delivery, Reason
from oncely.consumers.producer import redis_fields
from oncely.consumers.redis_streams import RedisStreamConsumer, StreamEntry
from oncely.stores.redis import RedisStore
from tests._helpers import eventually
from tests._proxy import Proxy
from tests.consumers._effects import FAST, Ledger, Worker

pytestmark = pytest.mark.redis


@pytest.fixture
def client(redis_url: str, name: str) -> Iterator[redis.Redis]:
    """A client of the shared Redis; the test's streams are deleted afterwards."""
    made = redis.Redis.from_url(redis_url)
    yield made
    made.delete(name, f"{name}:dead")
    made.close()


def add(client: redis.Redis, stream: str, key: str) -> None:
    client.xadd(stream, redis_fields(key, {"body": json.dumps({"order": key})}))


def key_of(entry: StreamEntry) -> str:
    return str(entry.fields[b"Idempotency-Key"].decode())


def settled(consumers: list[RedisStreamConsumer]) -> int:
    return sum(c.stats[Reason.PROCESSED] + c.stats[Reason.DUPLICATE] for c in consumers)


def done(
    client: redis.Redis, stream: str, consumers: list[RedisStreamConsumer], entries: int
) -> bool:
    """Every entry was acked at least once and none is pending (reclaims may ack twice)."""
    return (
        settled(consumers) >= entries
        and client.xpending(stream, "billing")["pending"] == 0
        and client.xinfo_groups(stream)[0]["entries-read"] == entries
    )


def test_many_copies_to_several_consumers_take_effect_once(
    client: redis.Redis, any_store: Any, ledger: Ledger, name: str
) -> None:
    """60 entries (15 keys, 4 copies each) read by 3 threads of one group: 15 effects."""
    keys = [f"order-{i}" for i in range(15)]
    copies = keys * 4
    random.Random(3).shuffle(copies)

    def handle(entry: StreamEntry) -> None:
        ledger.write(key_of(entry), threading.current_thread().name)

    consumers = [
        RedisStreamConsumer(
            client, name, "billing", handle, store=any_store, policy=FAST, block=0.05
        )
        for _ in range(3)
    ]
    assert consumers[0].create_group() is True
    assert consumers[1].create_group() is False  # already there
    stop = threading.Event()
    threads = [threading.Thread(target=c.run, args=(stop,)) for c in consumers]
    for thread in threads:
        thread.start()
    try:
        for key in copies:
            add(client, name, key)
        eventually(lambda: done(client, name, consumers, len(copies)), timeout=30)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert ledger.counts() == {key: 1 for key in keys}
    assert sum(c.stats[Reason.DUPLICATE] for c in consumers) == 45
    assert client.xpending(name, "billing")["pending"] == 0


def test_async_consumers_take_effect_once(
    redis_url: str, client: redis.Redis, any_store: Any, ledger: Ledger, name: str
) -> None:
    """The same with redis.asyncio and async handlers: two consumers, 30 entries, 10 effects."""
    keys = [f"order-{i}" for i in range(10)]
    for key in keys * 3:
        add(client, name, key)

    async def main() -> list[RedisStreamConsumer]:
        aclient = redis.asyncio.Redis.from_url(redis_url)
        try:

            async def handle(entry: StreamEntry) -> None:
                await ledger.awrite(key_of(entry))
                await asyncio.sleep(0.005)

            consumers = [
                RedisStreamConsumer(
                    aclient, name, "billing", handle, store=any_store, policy=FAST, block=0.05
                )
                for _ in range(2)
            ]
            await consumers[0].acreate_group()
            stop = asyncio.Event()
            tasks = [asyncio.create_task(c.arun(stop)) for c in consumers]
            await asyncio.to_thread(eventually, lambda: done(client, name, consumers, 30))
            stop.set()
            await asyncio.gather(*tasks)
            return consumers
        finally:
            await aclient.aclose()

    consumers = asyncio.run(main())
    assert done(client, name, consumers, 30)
    assert ledger.counts() == {key: 1 for key in keys}


def test_consumer_killed_mid_handler_is_reclaimed_and_applied_once(
    client: redis.Redis, store: RedisStore, ledger: Ledger, name: str
) -> None:
    """SIGKILL before the write commits: XAUTOCLAIM reclaims the entry, the lease recovers."""
    probe = RedisStreamConsumer(client, name, "billing", lambda e: None, store=store)
    probe.create_group()
    add(client, name, "order-1")
    worker = Worker(
        "redis_streams",
        {"stream": name, "group": "billing", "namespace": name, "table": ledger.table},
    )
    try:
        assert worker.wait_ready() == "order-1"
    finally:
        worker.kill()

    def handle(entry: StreamEntry) -> None:
        ledger.write(key_of(entry), "survivor")

    survivor = RedisStreamConsumer(
        client, name, "billing", handle, store=store, policy=FAST, block=0.05, claim_idle=0.1
    )
    eventually(lambda: survivor.poll() >= 0 and survivor.stats[Reason.PROCESSED] == 1)
    assert ledger.rows() == [("order-1", "survivor")]
    assert survivor.stats[Reason.IN_PROGRESS] >= 1  # reclaimed while the dead lease was live
    record = store.get(survivor.consumer.key_for(Delivery(b"", {"Idempotency-Key": "order-1"})))
    assert record is not None
    assert record.status is Status.COMPLETED
    assert record.attempt == 2
    assert client.xpending(name, "billing")["pending"] == 0


def test_consumer_killed_mid_batch_applies_each_entry_once(
    client: redis.Redis, store: RedisStore, ledger: Ledger, name: str
) -> None:
    """SIGKILL in the third handler of a batch of four: the first two were completed as their
    handlers returned, so after the lease recovers they are duplicates, not run again."""
    probe = RedisStreamConsumer(client, name, "billing", lambda e: None, store=store)
    probe.create_group()
    keys = [f"order-{number}" for number in range(1, 5)]
    for key in keys:
        add(client, name, key)

    def status(key: str) -> Status | None:
        record = store.get(probe.consumer.key_for(Delivery(b"", {"Idempotency-Key": key})))
        return None if record is None else record.status

    worker = Worker(
        "redis_streams",
        {
            "stream": name,
            "group": "billing",
            "namespace": name,
            "table": ledger.table,
            "doomed": "order-3",
        },
    )
    try:
        assert worker.wait_ready() == "order-3"  # one batch: the first two have taken effect
        assert ledger.counts() == {"order-1": 1, "order-2": 1}
        eventually(lambda: [status(key) for key in keys[:2]] == [Status.COMPLETED] * 2)
    finally:
        worker.kill()

    def handle(entry: StreamEntry) -> None:
        ledger.write(key_of(entry), "survivor")

    survivor = RedisStreamConsumer(
        client, name, "billing", handle, store=store, policy=FAST, block=0.05, claim_idle=0.1
    )
    eventually(lambda: survivor.poll() >= 0 and done(client, name, [survivor], len(keys)))
    assert ledger.counts() == {key: 1 for key in keys}
    assert survivor.stats[Reason.DUPLICATE] == 2
    assert [status(key) for key in keys] == [Status.COMPLETED] * 4


def test_handler_that_raises_is_reclaimed_then_dead_lettered(
    client: redis.Redis, store: RedisStore, ledger: Ledger, name: str
) -> None:
    """A failing handler runs max_attempts times; then copy-to-dead-stream and XACK, atomically."""
    calls: list[str] = []

    def handle(entry: StreamEntry) -> None:
        calls.append(key_of(entry))
        raise RuntimeError("the payment provider is down")

    consumer = RedisStreamConsumer(
        client, name, "billing", handle, store=store, policy=FAST, block=0.05, claim_idle=0.05
    )
    consumer.create_group()
    add(client, name, "order-1")
    eventually(lambda: consumer.poll() >= 0 and consumer.stats[Reason.EXHAUSTED] == 1)
    assert calls == ["order-1"] * FAST.max_attempts
    [(_, fields)] = client.xrange(f"{name}:dead")
    assert fields[b"Idempotency-Key"] == b"order-1"
    assert fields[b"oncely-dead-letter-reason"] == b"exhausted"
    assert client.xpending(name, "billing")["pending"] == 0
    assert ledger.counts() == {}


def test_store_down_leaves_the_entry_pending_until_it_returns(
    redis_url: str, client: redis.Redis, store: RedisStore, ledger: Ledger, name: str
) -> None:
    """The store unreachable: nothing runs, nothing is acked; the entry is handled once later."""
    with Proxy(int(redis_url.rsplit(":", 1)[1].split("/")[0])) as proxy:
        flaky = RedisStore(
            f"redis://127.0.0.1:{proxy.port}/0", namespace=name, retries=0, socket_timeout=1
        )
        proxy.down()
        try:

            def handle(entry: StreamEntry) -> Any:
                ledger.write(key_of(entry))

            consumer = RedisStreamConsumer(
                client,
                name,
                "billing",
                handle,
                store=flaky,
                policy=FAST,
                block=0.05,
                claim_idle=0.05,
            )
            consumer.create_group()
            add(client, name, "order-1")
            eventually(lambda: consumer.poll() >= 0 and consumer.stats["store_unavailable"] >= 2)
            assert client.xpending(name, "billing")["pending"] == 1
            assert ledger.counts() == {}
            proxy.up()
            eventually(lambda: consumer.poll() >= 0 and consumer.stats[Reason.PROCESSED] == 1)
        finally:
            flaky.close()
    assert ledger.counts() == {"order-1": 1}
    assert client.xpending(name, "billing")["pending"] == 0
