"""The FastStream middleware on its Kafka, RabbitMQ, NATS and Redis brokers (real servers)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from datetime import timedelta
from typing import Any

import pytest

from oncely.consumers import ConsumerPolicy, Reason
from oncely.consumers.faststream import IdempotencyMiddleware, publish_to
from oncely.consumers.producer import stamp
from oncely.stores.redis import RedisStore
from tests.conftest import service_url
from tests.consumers._effects import FAST, Ledger

Handler = Callable[[dict[str, Any]], Awaitable[None]]
Harness = Callable[
    [str, IdempotencyMiddleware, Handler],
    AbstractAsyncContextManager[Callable[[str], Awaitable[None]]],
]
"""Starts a broker with the middleware and *handler* subscribed; yields ``publish(key)``
(``publish(key, stamped=False)`` sends no key header)."""


@asynccontextmanager
async def rabbit(
    name: str, middleware: IdempotencyMiddleware, handler: Handler
) -> AsyncIterator[Any]:
    import aio_pika
    from faststream.rabbit import RabbitBroker, RabbitQueue

    from oncely.consumers.rabbitmq import dead_letter_arguments

    url = service_url("ONCELY_TEST_RABBITMQ_URL")
    broker = RabbitBroker(url, logger=None)
    broker.add_middleware(middleware)
    queue = RabbitQueue(name, arguments=dead_letter_arguments(f"{name}.dead"))
    broker.subscriber(queue)(handler)
    try:
        async with broker:
            await broker.declare_queue(RabbitQueue(f"{name}.dead"))
            await broker.start()

            async def publish(key: str, stamped: bool = True) -> None:
                await broker.publish({"order": key}, name, headers=stamp(key) if stamped else None)

            yield publish
    finally:
        async with await aio_pika.connect(url) as connection:
            channel = await connection.channel()
            await channel.queue_delete(name)
            await channel.queue_delete(f"{name}.dead")


@asynccontextmanager
async def kafka(
    name: str, middleware: IdempotencyMiddleware, handler: Handler
) -> AsyncIterator[Any]:
    from confluent_kafka.admin import AdminClient, NewTopic
    from faststream import AckPolicy
    from faststream.kafka import KafkaBroker

    bootstrap = service_url("ONCELY_TEST_KAFKA_BOOTSTRAP")
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(name, 1), NewTopic(f"{name}.dead", 1)]).values():
        future.result(10)
    broker = KafkaBroker(bootstrap, logger=None)
    broker.add_middleware(middleware)
    subscriber = broker.subscriber(
        name,
        group_id=name,
        auto_offset_reset="earliest",
        session_timeout_ms=2000,
        heartbeat_interval_ms=400,
        rebalance_timeout_ms=2000,
        ack_policy=AckPolicy.MANUAL,  # Kafka's default, ACK_FIRST, commits before the handler
    )
    subscriber(handler)
    try:
        async with broker:
            await broker.start()

            async def publish(key: str, stamped: bool = True) -> None:
                await broker.publish({"order": key}, name, headers=stamp(key) if stamped else None)

            publish.broker = broker  # type: ignore[attr-defined]
            yield publish
    finally:
        for future in admin.delete_topics([name, f"{name}.dead"]).values():
            future.result(10)


@asynccontextmanager
async def nats(
    name: str, middleware: IdempotencyMiddleware, handler: Handler
) -> AsyncIterator[Any]:
    import nats as nats_py
    from faststream.nats import JStream, NatsBroker, PullSub

    url = service_url("ONCELY_TEST_NATS_URL")
    broker = NatsBroker(url, logger=None)
    broker.add_middleware(middleware)
    stream = JStream(name, subjects=[f"{name}.>"])
    broker.subscriber(
        f"{name}.orders", stream=stream, durable="billing", pull_sub=PullSub(batch_size=4)
    )(handler)
    try:
        async with broker:
            await broker.start()

            async def publish(key: str, stamped: bool = True) -> None:
                await broker.publish(
                    {"order": key},
                    f"{name}.orders",
                    headers=stamp(key) if stamped else None,
                    stream=name,
                )

            yield publish
    finally:
        client = await nats_py.connect(url)
        try:
            await client.jetstream().delete_stream(name)
        finally:
            await client.close()


@asynccontextmanager
async def redis(
    name: str, middleware: IdempotencyMiddleware, handler: Handler
) -> AsyncIterator[Any]:
    import redis as redis_py
    from faststream.redis import RedisBroker, StreamSub

    url = service_url("ONCELY_TEST_REDIS_URL")
    broker = RedisBroker(url, logger=None)
    broker.add_middleware(middleware)
    broker.subscriber(stream=StreamSub(name, group="billing", consumer="c1"))(handler)
    # A subscriber with min_idle_time only reclaims (XAUTOCLAIM): it redelivers what a nack (or
    # a dead consumer) left pending; FastStream reads new entries with another one.
    reclaim = StreamSub(name, group="billing", consumer="c2", min_idle_time=1000)
    broker.subscriber(stream=reclaim)(handler)
    try:
        async with broker:
            await broker.start()

            async def publish(key: str, stamped: bool = True) -> None:
                headers = stamp(key) if stamped else None
                await broker.publish({"order": key}, stream=name, headers=headers)

            yield publish
    finally:
        client = redis_py.Redis.from_url(url)
        client.delete(name)
        client.close()


BROKERS = [
    pytest.param(rabbit, id="rabbitmq", marks=pytest.mark.rabbitmq),
    pytest.param(kafka, id="kafka", marks=pytest.mark.kafka),
    pytest.param(nats, id="nats", marks=pytest.mark.nats),
    pytest.param(redis, id="redis", marks=pytest.mark.redis),
]


async def until(check: Callable[[], Any], timeout: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        if loop.time() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("harness", BROKERS)
def test_duplicates_take_effect_once(
    harness: Harness, store: RedisStore, ledger: Ledger, name: str
) -> None:
    """Three copies of each of three keys: three effects, six acked duplicates."""
    middleware = IdempotencyMiddleware(store, group=name, policy=FAST)

    async def handle(body: dict[str, Any]) -> None:
        await ledger.awrite(body["order"])

    async def main() -> None:
        async with harness(name, middleware, handle) as publish:
            for key in ["a", "b", "c"] * 3:
                await publish(key)
            await until(lambda: middleware.stats["processed"] + middleware.stats["duplicate"] == 9)

    asyncio.run(main())
    assert ledger.counts() == {"a": 1, "b": 1, "c": 1}
    assert middleware.stats[Reason.DUPLICATE] == 6


@pytest.mark.parametrize("harness", BROKERS)
def test_failing_handler_is_retried_then_dead_lettered(
    harness: Harness, store: RedisStore, ledger: Ledger, name: str
) -> None:
    """A handler that always raises runs max_attempts times, then goes to the dead letters."""
    dead: list[Any] = []
    calls: list[str] = []

    async def record_dead(message: Any, verdict: Any) -> None:
        dead.append((message.headers.get("Idempotency-Key"), str(verdict.reason)))

    rabbit_native = harness is rabbit
    middleware = IdempotencyMiddleware(
        store,
        group=name,
        policy=FAST,
        dead_letter=None if rabbit_native else record_dead,
    )

    async def handle(body: dict[str, Any]) -> None:
        calls.append(body["order"])
        raise RuntimeError("the payment provider is down")

    async def main() -> None:
        async with harness(name, middleware, handle) as publish:
            await publish("a")
            await until(lambda: middleware.stats[Reason.EXHAUSTED] == 1)

    asyncio.run(main())
    assert calls == ["a"] * FAST.max_attempts
    if not rabbit_native:
        assert dead == [("a", "exhausted")]
    assert ledger.counts() == {}


@pytest.mark.parametrize("harness", BROKERS)
def test_without_a_key_header_the_brokers_id_keys_each_delivery(
    harness: Harness, store: RedisStore, ledger: Ledger, name: str
) -> None:
    """A message published without a key is keyed by the broker's id of it, the same on every
    redelivery: a handler that always raises runs max_attempts times, then is dead-lettered.
    (FastStream makes up a new id on every delivery of a Redis or NATS message without its
    ``message_id`` header: that copy was a new key each time, retried for ever.)"""
    calls: list[str] = []
    dead: list[str] = []

    async def record_dead(message: Any, verdict: Any) -> None:
        dead.append(str(verdict.reason))

    rabbit_native = harness is rabbit
    middleware = IdempotencyMiddleware(
        store, group=name, policy=FAST, dead_letter=None if rabbit_native else record_dead
    )

    async def handle(body: dict[str, Any]) -> None:
        calls.append(body["order"])
        raise RuntimeError("the payment provider is down")

    async def main() -> None:
        async with harness(name, middleware, handle) as publish:
            await publish("a", stamped=False)
            await until(lambda: middleware.stats[Reason.EXHAUSTED] == 1, timeout=20)

    asyncio.run(main())
    assert calls == ["a"] * FAST.max_attempts
    if not rabbit_native:
        assert dead == ["exhausted"]


@pytest.mark.kafka
def test_publish_to_dead_letter_topic(store: RedisStore, ledger: Ledger, name: str) -> None:
    """publish_to() sends the dead message through the broker, with the reason as a header."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    policy = ConsumerPolicy(lease=FAST.lease, ttl=FAST.ttl, max_attempts=1)
    brokers: list[Any] = []

    async def dead_letter(message: Any, verdict: Any) -> Any:
        return await publish_to(brokers[0], f"{name}.dead")(message, verdict)

    middleware = IdempotencyMiddleware(store, group=name, policy=policy, dead_letter=dead_letter)

    async def handle(body: dict[str, Any]) -> None:
        raise ValueError("malformed")

    def read_dead_letters() -> list[Any]:
        probe = Consumer(
            {"bootstrap.servers": service_url("ONCELY_TEST_KAFKA_BOOTSTRAP"), "group.id": name}
        )
        try:
            probe.assign([TopicPartition(f"{name}.dead", 0, OFFSET_BEGINNING)])
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                received = [m for m in probe.consume(1, 0.25) if m.error() is None]
                if received:
                    return received
            return []
        finally:
            probe.close()

    async def main() -> list[Any]:
        async with kafka(name, middleware, handle) as publish:
            brokers.append(publish.broker)
            await publish("a")
            await until(lambda: middleware.stats[Reason.EXHAUSTED] == 1)
            return await asyncio.to_thread(read_dead_letters)

    [message] = asyncio.run(main())
    assert dict(message.headers())["oncely-dead-letter-reason"] == b"exhausted"
    assert dict(message.headers())["Idempotency-Key"] == b"a"


@pytest.mark.parametrize("harness", BROKERS)
def test_dead_letter_that_fails_never_runs_the_handler_again(
    harness: Harness, store: RedisStore, ledger: Ledger, name: str
) -> None:
    """A declared dead-letter error, and a dead_letter target that fails twice: the message is
    kept and dead-lettered once the target works; the handler ran once."""
    policy = ConsumerPolicy(
        lease=timedelta(seconds=1.5),
        ttl=timedelta(minutes=5),
        max_attempts=5,
        retry_delay=timedelta(milliseconds=100),
        dead_letter_on=(ValueError,),
    )
    tries: list[str] = []
    calls: list[str] = []

    async def dead_letter(message: Any, verdict: Any) -> None:
        tries.append(str(verdict.reason))
        if len(tries) <= 2:
            raise ConnectionError("the dead-letter target is down")

    middleware = IdempotencyMiddleware(store, group=name, policy=policy, dead_letter=dead_letter)

    async def handle(body: dict[str, Any]) -> None:
        calls.append(body["order"])
        raise ValueError("not a valid order")

    async def main() -> None:
        async with harness(name, middleware, handle) as publish:
            await publish("a")
            await until(lambda: len(tries) == 3)

    asyncio.run(main())
    assert calls == ["a"]
    assert tries == ["handler_failed"] * 3


@pytest.mark.kafka
def test_kafka_records_without_a_key_are_told_apart_by_partition(
    store: RedisStore, ledger: Ledger, name: str
) -> None:
    """FastStream names a Kafka record ``<offset>-<timestamp>``: two records without a key
    header at the same offset of two partitions, stamped the same millisecond, shared it, so
    the second was dead-lettered as a mismatch (or acked unrun as a duplicate). Their key is
    ``topic/partition/offset``, as in `oncely.consumers.kafka`."""
    from confluent_kafka.admin import AdminClient, NewTopic
    from faststream import AckPolicy
    from faststream.kafka import KafkaBroker

    bootstrap = service_url("ONCELY_TEST_KAFKA_BOOTSTRAP")
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(name, 2)]).values():
        future.result(10)
    seen: list[str] = []
    middleware = IdempotencyMiddleware(store, group=name, policy=FAST, dead_letter=None)

    async def handle(body: dict[str, Any]) -> None:
        seen.append(body["order"])
        await ledger.awrite(body["order"])

    async def main() -> None:
        broker = KafkaBroker(bootstrap, logger=None)
        broker.add_middleware(middleware)
        broker.subscriber(
            name,
            group_id=name,
            auto_offset_reset="earliest",
            session_timeout_ms=2000,
            heartbeat_interval_ms=400,
            rebalance_timeout_ms=2000,
            ack_policy=AckPolicy.MANUAL,
        )(handle)
        async with broker:
            await broker.start()
            stamp_ms = int(time.time() * 1000)
            for partition, order in enumerate(["left", "right"]):
                await broker.publish(
                    {"order": order}, name, partition=partition, timestamp_ms=stamp_ms
                )
            await until(lambda: sum(middleware.stats.snapshot().values()) >= 2)

    try:
        asyncio.run(main())
    finally:
        for future in admin.delete_topics([name]).values():
            future.result(10)
    assert sorted(seen) == ["left", "right"]
    assert middleware.stats[Reason.PROCESSED] == 2
