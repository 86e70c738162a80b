"""Kafka (confluent-kafka and aiokafka) against the real broker; effects are PostgreSQL rows."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from oncely import Status
from oncely.consumers import ConsumerPolicy, Delivery, IdempotentConsumer, Reason
from oncely.consumers.kafka import AsyncIdempotentKafkaConsumer, IdempotentKafkaConsumer
from oncely.consumers.producer import kafka_headers
from oncely.stores.redis import RedisStore
from tests._helpers import eventually
from tests._proxy import Proxy
from tests.conftest import service_url
from tests.consumers._effects import FAST, Ledger, Worker

pytestmark = pytest.mark.kafka

PARTITIONS = 3


@pytest.fixture
def bootstrap() -> str:
    return service_url("ONCELY_TEST_KAFKA_BOOTSTRAP")


@pytest.fixture
def topic(bootstrap: str, name: str) -> Iterator[str]:
    """The test's topic (3 partitions) and its dead-letter topic, created explicitly, deleted."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    topics = [NewTopic(name, num_partitions=PARTITIONS), NewTopic(f"{name}.dead", num_partitions=1)]
    for future in admin.create_topics(topics).values():
        future.result(10)
    yield name
    for future in admin.delete_topics([name, f"{name}.dead"]).values():
        future.result(10)


def config(bootstrap: str, group: str) -> dict[str, Any]:
    return {
        "bootstrap.servers": bootstrap,
        "group.id": group,
        "auto.offset.reset": "earliest",
        "session.timeout.ms": 2000,
        "heartbeat.interval.ms": 400,
    }


def produce(
    bootstrap: str, topic: str, keys: list[str], partition: int | None = None
) -> dict[int, int]:
    """Produce one record per key (spread over the partitions, or all to *partition*); return
    the end offset of each partition."""
    producer = Producer({"bootstrap.servers": bootstrap})
    ends: dict[int, int] = {}

    def delivered(error: Any, message: Any) -> None:
        assert error is None, error
        ends[message.partition()] = max(ends.get(message.partition(), 0), message.offset() + 1)

    for number, key in enumerate(keys):
        producer.produce(
            topic,
            value=json.dumps({"order": key}).encode(),
            headers=kafka_headers(key),
            partition=number % PARTITIONS if partition is None else partition,
            on_delivery=delivered,
        )
    assert producer.flush(10) == 0
    return ends


def committed(bootstrap: str, group: str, topic: str) -> dict[int, int]:
    """The group's committed offsets (without joining the group)."""
    probe = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    try:
        parts = probe.committed([TopicPartition(topic, p) for p in range(PARTITIONS)], timeout=10)
        return {p.partition: p.offset for p in parts if p.offset >= 0}
    finally:
        probe.close()


def header_key(message: Any) -> str:
    headers = message.headers() if callable(message.headers) else message.headers
    return str(dict(headers)["Idempotency-Key"].decode())


class Running:
    """confluent consumers, each polling in a thread until stopped, then closed."""

    def __init__(self, consumers: list[IdempotentKafkaConsumer]) -> None:
        self.consumers = consumers
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        for consumer in consumers:
            self.add(consumer)

    def add(self, consumer: IdempotentKafkaConsumer) -> None:
        if consumer not in self.consumers:
            self.consumers.append(consumer)
        thread = threading.Thread(target=consumer.run, args=(self.stop,))
        self.threads.append(thread)
        thread.start()

    def __enter__(self) -> Running:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join()
        for consumer in self.consumers:
            consumer.close()


def test_many_copies_to_several_consumers_take_effect_once(
    bootstrap: str, topic: str, any_store: Any, ledger: Ledger
) -> None:
    """60 records (15 keys, 4 copies each, across partitions), 3 members: 15 effects."""
    keys = [f"order-{i}" for i in range(15)]
    copies = keys * 4
    random.Random(11).shuffle(copies)

    def handle(message: Any) -> None:
        ledger.write(header_key(message), threading.current_thread().name)
        time.sleep(0.005)  # the work

    consumers = [
        IdempotentKafkaConsumer(
            config(bootstrap, topic),
            [topic],
            handle,
            store=any_store,
            policy=FAST,
            poll_timeout=0.1,
        )
        for _ in range(3)
    ]
    with Running(consumers):
        eventually(lambda: all(len(c.assignment) == 1 for c in consumers), timeout=30)
        ends = produce(bootstrap, topic, copies)  # each member owns one partition now
        eventually(lambda: committed(bootstrap, topic, topic) == ends, timeout=40)
    assert ledger.counts() == {key: 1 for key in keys}
    assert sum(c.stats[Reason.DUPLICATE] for c in consumers) == 45
    assert all(c.stats[Reason.PROCESSED] + c.stats[Reason.DUPLICATE] > 0 for c in consumers)


def test_async_consumers_take_effect_once(
    bootstrap: str, topic: str, store: RedisStore, ledger: Ledger
) -> None:
    """aiokafka: two members, partitions settled concurrently, 30 records, 10 effects."""
    import aiokafka

    keys = [f"order-{i}" for i in range(10)]

    async def main() -> None:
        producer = aiokafka.AIOKafkaProducer(bootstrap_servers=bootstrap)
        await producer.start()
        members = []
        try:

            async def handle(record: Any) -> None:
                await ledger.awrite(header_key(record))

            for _ in range(2):
                client = _aiokafka_consumer(bootstrap, topic)
                member = AsyncIdempotentKafkaConsumer(
                    client, [topic], handle, store=store, producer=producer, policy=FAST
                )
                await client.start()
                members.append(member)
            stop = asyncio.Event()
            tasks = [asyncio.create_task(m.arun(stop)) for m in members]
            await _until_async(lambda: all(m.assignment for m in members))
            ends = produce(bootstrap, topic, keys * 3)
            await _until_async(lambda: committed(bootstrap, topic, topic) == ends)
            stop.set()
            await asyncio.gather(*tasks)
        finally:
            for member in members:
                await member.client.stop()
            await producer.stop()

    asyncio.run(main())
    assert ledger.counts() == {key: 1 for key in keys}


def _aiokafka_consumer(bootstrap: str, group: str) -> Any:
    import aiokafka

    return aiokafka.AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        session_timeout_ms=2000,
        heartbeat_interval_ms=400,
        rebalance_timeout_ms=2000,
    )


async def _until_async(check: Callable[[], Any], timeout: float = 40.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await asyncio.to_thread(check):
        if loop.time() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(0.05)


def test_consumer_killed_mid_handler_is_redelivered_and_applied_once(
    bootstrap: str, topic: str, store: RedisStore, ledger: Ledger, name: str
) -> None:
    """SIGKILL before the write commits: after the session timeout the survivor redoes it."""
    produce(bootstrap, topic, ["order-1"])
    worker = Worker(
        "kafka", {"topic": topic, "group": topic, "namespace": name, "table": ledger.table}
    )
    try:
        assert worker.wait_ready() == "order-1"
    finally:
        worker.kill()

    def handle(message: Any) -> None:
        ledger.write(header_key(message), "survivor")

    survivor = IdempotentKafkaConsumer(
        config(bootstrap, topic), [topic], handle, store=store, policy=FAST, poll_timeout=0.1
    )
    with Running([survivor]):
        eventually(lambda: survivor.stats[Reason.PROCESSED] == 1, timeout=30)
    assert ledger.rows() == [("order-1", "survivor")]
    record = store.get(survivor.consumer.key_for(Delivery(b"", {"Idempotency-Key": "order-1"})))
    assert record is not None
    assert record.status is Status.COMPLETED
    assert record.attempt == 2
    assert committed(bootstrap, topic, topic) == {0: 1}


def test_consumer_killed_mid_batch_applies_each_record_once(
    bootstrap: str, topic: str, store: RedisStore, ledger: Ledger, name: str
) -> None:
    """SIGKILL in the third handler of a partition's batch of four: the first two were
    completed as their handlers returned, so the survivor finds them duplicates."""
    keys = [f"order-{number}" for number in range(1, 5)]
    produce(bootstrap, topic, keys, partition=0)
    probe = IdempotentConsumer(store, scope=f"kafka:{topic}")  # the keys' scope

    def status(key: str) -> Status | None:
        record = store.get(probe.key_for(Delivery(b"", {"Idempotency-Key": key})))
        return None if record is None else record.status

    worker = Worker(
        "kafka",
        {
            "topic": topic,
            "group": topic,
            "namespace": name,
            "table": ledger.table,
            "doomed": "order-3",
        },
    )
    try:
        assert worker.wait_ready() == "order-3"
        assert ledger.counts() == {"order-1": 1, "order-2": 1}
        eventually(lambda: [status(key) for key in keys[:2]] == [Status.COMPLETED] * 2)
    finally:
        worker.kill()

    def handle(message: Any) -> None:
        ledger.write(header_key(message), "survivor")

    survivor = IdempotentKafkaConsumer(
        config(bootstrap, topic), [topic], handle, store=store, policy=FAST, poll_timeout=0.1
    )
    with Running([survivor]):
        eventually(lambda: committed(bootstrap, topic, topic) == {0: 4}, timeout=30)
    assert ledger.counts() == {key: 1 for key in keys}
    assert survivor.stats[Reason.DUPLICATE] == 2
    assert [status(key) for key in keys] == [Status.COMPLETED] * 4


def test_handler_that_raises_is_retried_then_dead_lettered(
    bootstrap: str, topic: str, store: RedisStore, ledger: Ledger
) -> None:
    """A failing handler runs max_attempts times; the record goes to <topic>.dead; offset moves."""
    calls: list[str] = []

    def handle(message: Any) -> None:
        calls.append(header_key(message))
        raise RuntimeError("the payment provider is down")

    produce(bootstrap, topic, ["order-1", "order-2"])
    consumer = IdempotentKafkaConsumer(
        config(bootstrap, topic), [topic], handle, store=store, policy=FAST, poll_timeout=0.1
    )
    with Running([consumer]):
        eventually(lambda: committed(bootstrap, topic, topic) == {0: 1, 1: 1}, timeout=30)
    assert sorted(calls) == ["order-1"] * FAST.max_attempts + ["order-2"] * FAST.max_attempts
    dead = Consumer({"bootstrap.servers": bootstrap, "group.id": f"{topic}-dlq"})
    try:
        dead.assign([TopicPartition(f"{topic}.dead", 0, OFFSET_BEGINNING)])  # no group join
        records: list[Any] = []
        deadline = time.monotonic() + 20
        while len(records) < 2 and time.monotonic() < deadline:
            records += [m for m in dead.consume(2, 0.5) if m.error() is None]
    finally:
        dead.close()
    assert sorted(header_key(m) for m in records) == ["order-1", "order-2"]
    headers = dict(records[0].headers())
    assert headers["oncely-dead-letter-reason"] == b"exhausted"
    assert headers["oncely-source-topic"] == topic.encode()
    assert ledger.counts() == {}


def test_store_down_nothing_is_committed_until_it_returns(
    redis_url: str, bootstrap: str, topic: str, store: RedisStore, ledger: Ledger, name: str
) -> None:
    """The store unreachable: the record is retried in place and its offset is not committed."""
    produce(bootstrap, topic, ["order-1"])
    with Proxy(int(redis_url.rsplit(":", 1)[1].split("/")[0])) as proxy:
        flaky = RedisStore(
            f"redis://127.0.0.1:{proxy.port}/0", namespace=name, retries=0, socket_timeout=1
        )
        proxy.down()

        def handle(message: Any) -> None:
            ledger.write(header_key(message))

        consumer = IdempotentKafkaConsumer(
            config(bootstrap, topic), [topic], handle, store=flaky, policy=FAST, poll_timeout=0.1
        )
        try:
            with Running([consumer]):
                eventually(lambda: consumer.stats[Reason.STORE_UNAVAILABLE] >= 3, timeout=30)
                assert committed(bootstrap, topic, topic) == {}
                assert ledger.counts() == {}
                proxy.up()
                eventually(lambda: committed(bootstrap, topic, topic) == {0: 1}, timeout=30)
        finally:
            flaky.close()
    assert ledger.counts() == {"order-1": 1}


def test_rebalance_while_handlers_run_confluent(
    bootstrap: str, topic: str, store: RedisStore, ledger: Ledger
) -> None:
    """A second member joins while the first is mid-batch: every record takes effect once."""
    keys = [f"order-{i}" for i in range(160)]
    ends = produce(bootstrap, topic, keys)

    def handle(message: Any) -> None:
        ledger.write(header_key(message), threading.current_thread().name)
        # Slow work (8 s in all, for one member), so the join, which takes a few seconds of group
        # protocol, lands while handlers run even now that claims and completions are batched.
        time.sleep(0.05)

    def member() -> IdempotentKafkaConsumer:
        return IdempotentKafkaConsumer(
            config(bootstrap, topic),
            [topic],
            handle,
            store=store,
            policy=FAST,
            poll_timeout=0.1,
            batch_size=5,
        )

    first = member()
    with Running([first]) as running:
        eventually(lambda: first.stats[Reason.PROCESSED] >= 3, timeout=30)
        second = member()
        running.add(second)
        eventually(lambda: committed(bootstrap, topic, topic) == ends, timeout=60)
    assert ledger.counts() == {key: 1 for key in keys}
    assert second.stats[Reason.PROCESSED] + second.stats[Reason.DUPLICATE] > 0  # took a share


def test_rebalance_while_handlers_run_aiokafka(
    bootstrap: str, topic: str, any_store: Any, ledger: Ledger
) -> None:
    """aiokafka: a member joins while the first runs handlers on every partition at once."""
    import aiokafka

    keys = [f"order-{i}" for i in range(60)]
    ends = produce(bootstrap, topic, keys)
    revoked_mid_batch: list[bool] = []

    async def main() -> list[AsyncIdempotentKafkaConsumer]:
        producer = aiokafka.AIOKafkaProducer(bootstrap_servers=bootstrap)
        await producer.start()
        members: list[AsyncIdempotentKafkaConsumer] = []

        async def handle(record: Any) -> None:
            await ledger.awrite(header_key(record))
            await asyncio.sleep(0.1)  # slow work, so the join lands while handlers run

        async def join() -> AsyncIdempotentKafkaConsumer:
            client = _aiokafka_consumer(bootstrap, topic)
            made = AsyncIdempotentKafkaConsumer(
                client,
                [topic],
                handle,
                store=any_store,
                producer=producer,
                policy=FAST,
                batch_size=6,
            )
            await client.start()
            members.append(made)
            return made

        stop = asyncio.Event()
        tasks = []
        try:
            first = await join()
            revoke = first._revoked

            async def watched(partitions: Any) -> None:
                revoked_mid_batch.append(not first._idle.is_set())
                await revoke(partitions)

            first._revoked = watched  # type: ignore[method-assign]
            tasks.append(asyncio.create_task(first.arun(stop)))
            await _until_async(lambda: first.stats[Reason.PROCESSED] >= 3)
            second = await join()
            tasks.append(asyncio.create_task(second.arun(stop)))
            await _until_async(lambda: committed(bootstrap, topic, topic) == ends)
            stop.set()
            await asyncio.gather(*tasks)
        finally:
            for made in members:
                await made.client.stop()
            await producer.stop()
        return members

    members = asyncio.run(main())
    assert ledger.counts() == {key: 1 for key in keys}
    assert sum(m.stats[Reason.PROCESSED] for m in members) == 60
    assert True in revoked_mid_batch  # the rebalance really hit records in flight


class Watched(IdempotentKafkaConsumer):
    """Counts the partitions revoked from (or lost by) this member."""

    revoked = 0

    def _on_revoke(self, consumer: Any, partitions: list[Any]) -> None:
        self.revoked += len(partitions)
        super()._on_revoke(consumer, partitions)


def test_store_outage_keeps_polling_within_max_poll_interval(
    redis_url: str, bootstrap: str, topic: str, ledger: Ledger, name: str
) -> None:
    """The store down for longer than max.poll.interval.ms: the member keeps polling (the
    partition paused between rounds), so the group never evicts it; it settles on return."""
    produce(bootstrap, topic, ["order-1"])
    with Proxy(int(redis_url.rsplit(":", 1)[1].split("/")[0])) as proxy:
        flaky = RedisStore(
            f"redis://127.0.0.1:{proxy.port}/0", namespace=name, retries=0, socket_timeout=1
        )
        proxy.down()

        def handle(message: Any) -> None:
            ledger.write(header_key(message))

        consumer = Watched(
            {**config(bootstrap, topic), "max.poll.interval.ms": 3000},
            [topic],
            handle,
            store=flaky,
            policy=FAST,
            poll_timeout=0.1,
        )
        try:
            with Running([consumer]):
                eventually(lambda: consumer.stats[Reason.STORE_UNAVAILABLE] >= 1, timeout=30)
                time.sleep(5)  # the outage outlasts max.poll.interval.ms
                proxy.up()
                eventually(lambda: committed(bootstrap, topic, topic) == {0: 1}, timeout=30)
                assert consumer.revoked == 0  # never evicted from the group
        finally:
            flaky.close()
    assert ledger.counts() == {"order-1": 1}


def test_stop_is_honoured_during_a_store_outage(
    redis_url: str, bootstrap: str, topic: str, store: RedisStore, ledger: Ledger, name: str
) -> None:
    """run(stop) returns while the store is still down; the record is left uncommitted."""
    produce(bootstrap, topic, ["order-1"])
    with Proxy(int(redis_url.rsplit(":", 1)[1].split("/")[0])) as proxy:
        flaky = RedisStore(
            f"redis://127.0.0.1:{proxy.port}/0", namespace=name, retries=0, socket_timeout=1
        )
        proxy.down()
        consumer = IdempotentKafkaConsumer(
            config(bootstrap, topic),
            [topic],
            lambda message: ledger.write(header_key(message)),
            store=flaky,
            policy=FAST,
            poll_timeout=0.1,
        )
        stop = threading.Event()
        thread = threading.Thread(target=consumer.run, args=(stop,))
        thread.start()
        try:
            eventually(lambda: consumer.stats[Reason.STORE_UNAVAILABLE] >= 2, timeout=30)
            stop.set()
            thread.join(30)
            assert not thread.is_alive(), "run(stop) did not return while the store was down"
        finally:
            stop.set()
            proxy.up()
            thread.join()
            consumer.close()
            flaky.close()
    assert committed(bootstrap, topic, topic) == {}
    assert ledger.counts() == {}


def test_stop_is_honoured_while_a_record_is_retried(
    bootstrap: str, topic: str, store: RedisStore
) -> None:
    """A handler that keeps failing (attempts left): run(stop) returns, the record is left for
    the next owner (not committed, its lease released), and the handler is not started again."""
    policy = ConsumerPolicy(
        lease=timedelta(seconds=1.5),
        ttl=timedelta(minutes=5),
        max_attempts=1000,
        retry_delay=timedelta(milliseconds=100),
    )
    produce(bootstrap, topic, ["order-1"])
    calls: list[str] = []

    def handle(message: Any) -> None:
        calls.append(header_key(message))
        raise RuntimeError("the payment provider is down")

    consumer = IdempotentKafkaConsumer(
        config(bootstrap, topic), [topic], handle, store=store, policy=policy, poll_timeout=0.1
    )
    stop = threading.Event()
    thread = threading.Thread(target=consumer.run, args=(stop,))
    thread.start()
    try:
        eventually(lambda: len(calls) >= 2, timeout=30)
        stop.set()
        thread.join(30)
        alive = thread.is_alive()
        after_stop = len(calls)
    finally:
        consumer._stopping = True  # let an unfixed loop end
        thread.join()
        consumer.close()
    assert not alive, "run(stop) kept retrying the record"
    assert len(calls) == after_stop
    assert committed(bootstrap, topic, topic) == {}
    record = store.get(consumer.consumer.key_for(Delivery(b"", {"Idempotency-Key": "order-1"})))
    assert record is not None
    assert record.status is Status.RELEASED


def test_async_stop_is_honoured_while_a_record_is_retried(
    bootstrap: str, topic: str, store: RedisStore
) -> None:
    """aiokafka: arun(stop) returns while a failing record still has attempts left."""
    import aiokafka

    policy = ConsumerPolicy(
        lease=timedelta(seconds=1.5),
        ttl=timedelta(minutes=5),
        max_attempts=1000,
        retry_delay=timedelta(milliseconds=100),
    )
    produce(bootstrap, topic, ["order-1"])
    calls: list[str] = []

    async def main() -> bool:
        producer = aiokafka.AIOKafkaProducer(bootstrap_servers=bootstrap)
        await producer.start()
        client = _aiokafka_consumer(bootstrap, topic)

        async def handle(record: Any) -> None:
            calls.append(header_key(record))
            raise RuntimeError("the payment provider is down")

        member = AsyncIdempotentKafkaConsumer(
            client, [topic], handle, store=store, producer=producer, policy=policy
        )
        await client.start()
        stop = asyncio.Event()
        task = asyncio.create_task(member.arun(stop))
        try:
            await _until_async(lambda: len(calls) >= 2)
            stop.set()
            done, _ = await asyncio.wait([task], timeout=30)
            return bool(done)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await client.stop()
            await producer.stop()

    assert asyncio.run(main()), "arun(stop) kept retrying the record"
    assert committed(bootstrap, topic, topic) == {}


def test_dead_letter_that_cannot_be_produced_never_runs_the_handler_again(
    bootstrap: str, topic: str, store: RedisStore
) -> None:
    """A final error on attempt 1, then the dead-letter topic refuses the record a few times:
    the record stays uncommitted and is dead-lettered once producing works; the handler ran
    once (the dead-letter decision is recorded before producing)."""
    policy = ConsumerPolicy(
        lease=timedelta(seconds=1.5),
        ttl=timedelta(minutes=5),
        max_attempts=5,
        retry_delay=timedelta(milliseconds=100),
        dead_letter_on=(ValueError,),
    )
    produce(bootstrap, topic, ["order-1"])
    calls: list[str] = []
    tries: list[str] = []

    def handle(message: Any) -> None:
        calls.append(header_key(message))
        raise ValueError("not a valid order")

    def dead_letter_topic(source: str) -> str:
        tries.append(source)
        return "invalid topic!" if len(tries) <= 3 else f"{source}.dead"

    consumer = IdempotentKafkaConsumer(
        config(bootstrap, topic),
        [topic],
        handle,
        store=store,
        policy=policy,
        poll_timeout=0.1,
        dead_letter_topic=dead_letter_topic,
    )
    with Running([consumer]):
        eventually(lambda: committed(bootstrap, topic, topic) == {0: 1}, timeout=60)
    assert calls == ["order-1"]
    assert len(tries) == 4
    dead = Consumer({"bootstrap.servers": bootstrap, "group.id": f"{topic}-dlq"})
    try:
        dead.assign([TopicPartition(f"{topic}.dead", 0, OFFSET_BEGINNING)])
        records: list[Any] = []
        deadline = time.monotonic() + 20
        while not records and time.monotonic() < deadline:
            records += [m for m in dead.consume(1, 0.5) if m.error() is None]
    finally:
        dead.close()
    assert [header_key(m) for m in records] == ["order-1"]
    assert dict(records[0].headers())["oncely-dead-letter-reason"] == b"handler_failed"


@pytest.mark.slow
def test_aiokafka_leases_held_by_a_batch_revoked_past_revoke_timeout_are_released(
    bootstrap: str, topic: str, store: RedisStore, ledger: Ledger
) -> None:
    """A member's batch outlives revoke_timeout (its first record's handler is slow, then
    fails): the records behind it are blocked and their leases kept for the next round, by a
    partition already revoked. Those leases are released, not dropped while still held (the
    next owner would find the keys in progress for a whole lease, 60 s here)."""
    import aiokafka

    keys = ["order-0", "order-1", "order-2"]
    produce(bootstrap, topic, keys, partition=0)
    policy = ConsumerPolicy(
        lease=timedelta(seconds=60), ttl=timedelta(minutes=5), retry_delay=FAST.retry_delay
    )
    go = asyncio.Event()
    started: list[str] = []

    async def main() -> list[AsyncIdempotentKafkaConsumer]:
        producer = aiokafka.AIOKafkaProducer(bootstrap_servers=bootstrap)
        await producer.start()
        members: list[AsyncIdempotentKafkaConsumer] = []

        async def handle(record: Any) -> None:
            key = header_key(record)
            started.append(key)
            if key == keys[0] and started.count(key) == 1:
                await go.wait()  # outlives the revocation, then fails
                raise RuntimeError("the first attempt fails")
            await ledger.awrite(key)

        async def join() -> AsyncIdempotentKafkaConsumer:
            client = _aiokafka_consumer(bootstrap, topic)
            made = AsyncIdempotentKafkaConsumer(
                client,
                [topic],
                handle,
                store=store,
                producer=producer,
                policy=policy,
                batch_size=3,
                revoke_timeout=0.2,
            )
            await client.start()
            members.append(made)
            return made

        stop = asyncio.Event()
        tasks = []
        try:
            first = await join()
            revoked = asyncio.Event()
            revoke = first._revoked

            async def watched(partitions: Any) -> None:
                await revoke(partitions)  # times out: the first record's handler still runs
                revoked.set()

            first._revoked = watched  # type: ignore[method-assign]
            tasks.append(asyncio.create_task(first.arun(stop)))
            await _until_async(lambda: keys[0] in started)
            second = await join()  # the rebalance revokes the first member's partitions
            tasks.append(asyncio.create_task(second.arun(stop)))
            await asyncio.wait_for(revoked.wait(), 30)
            go.set()
            await _until_async(lambda: sorted(ledger.counts()) == keys, timeout=30)
            stop.set()
            await asyncio.gather(*tasks)
        finally:
            for made in members:
                await made.client.stop()
            await producer.stop()
        return members

    asyncio.run(main())
    assert ledger.counts() == {key: 1 for key in keys}
