"""The four brokers behind one interface, for the publisher tests: make a destination, read what
arrived there, run the real oncely consumer adapter over it, clean up."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from oncely.consumers import ConsumerPolicy
from oncely.outbox import OutboxEvent, Publisher
from oncely.stores.memory import MemoryStore
from tests.conftest import service_url

FAST = ConsumerPolicy(lease=5, retry_delay=0.05)
KAFKA_PARTITIONS = 3
KAFKA_MAX_REQUEST = 16_384
"""The Kafka publisher's ``max_request_size`` in these tests: a larger event is refused."""


@dataclass(frozen=True)
class Arrived:
    """One message as a plain client read it."""

    payload: bytes
    headers: dict[str, str]
    broker_id: str | None = None  # AMQP message_id, Nats-Msg-Id; None where there is none
    record_key: str | None = None  # Kafka's record key


@dataclass
class Effects:
    """What a consumer's handler did: one count per idempotency key."""

    counts: Counter[str] = field(default_factory=Counter)

    def add(self, key: str) -> None:
        self.counts[key] += 1


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def until(check: Any, *, timeout: float = 20.0, interval: float = 0.02) -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not (value := await check()):
        if loop.time() > deadline:
            raise AssertionError(f"condition not met within {timeout}s: last value {value!r}")
        await asyncio.sleep(interval)
    return value


class Broker:
    """One broker's test fixtures; *name* is unique to the test."""

    id: str
    unreachable_url: str
    bad_urls: tuple[str, ...]
    url_at: str | None = None
    """The URL of the server on another port (a proxy's), ``{port}`` left to fill in."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.destination = name

    def publisher(self, url: str | None = None, **options: Any) -> Publisher:
        raise NotImplementedError

    async def setup(self) -> None:
        """Create the destination (and what a failing event needs)."""

    async def teardown(self) -> None:
        """Delete what `setup` and the consumers created."""

    def failing(self, event: OutboxEvent) -> OutboxEvent:
        """*event*, changed so that its publish fails by itself (the others may succeed)."""
        raise NotImplementedError

    async def read(self, count: int) -> list[Arrived]:
        """Wait until *count* messages arrived (fail otherwise); return them, in order."""
        raise NotImplementedError

    async def consume(self, copies: int) -> tuple[Effects, int]:
        """Run the oncely consumer over the *copies* messages published; return the handler's
        effects and how many deliveries it settled."""
        raise NotImplementedError


class RabbitMQ(Broker):
    id = "rabbitmq"
    unreachable_url = "amqp://guest:guest@127.0.0.1:9/"
    url_at = "amqp://guest:guest@127.0.0.1:{port}/"
    bad_urls = ("http://127.0.0.1:5672/", "amqp://", "amqp://guest:guest@127.0.0.1:notaport/")

    def publisher(self, url: str | None = None, **options: Any) -> Publisher:
        from oncely.outbox.rabbitmq import RabbitMQPublisher

        return RabbitMQPublisher.from_url(url or service_url("ONCELY_TEST_RABBITMQ_URL"), **options)

    async def setup(self) -> None:
        import aio_pika

        self.connection = await aio_pika.connect(service_url("ONCELY_TEST_RABBITMQ_URL"))
        self.channel = await self.connection.channel()
        self.queue = await self.channel.declare_queue(self.name)

    async def teardown(self) -> None:
        await self.queue.delete(if_unused=False, if_empty=False)
        await self.connection.close()

    def failing(self, event: OutboxEvent) -> OutboxEvent:
        return _with(event, destination=f"{self.name}-no-such-exchange/{self.name}")

    async def _messages(self, count: int) -> list[Any]:
        got: list[Any] = []

        async def enough() -> bool:
            while (message := await self.queue.get(no_ack=False, fail=False)) is not None:
                got.append(message)
            return len(got) >= count

        await until(enough)
        return got

    async def read(self, count: int) -> list[Arrived]:
        messages = await self._messages(count)
        for message in messages:
            await message.ack()
        return [
            Arrived(m.body, {k: _text(v) for k, v in (m.headers or {}).items()}, m.message_id)
            for m in messages
        ]

    async def consume(self, copies: int) -> tuple[Effects, int]:
        from oncely.consumers.rabbitmq import IdempotentHandler

        effects = Effects()

        async def handler(message: Any) -> None:
            effects.add(message.headers["Idempotency-Key"])

        handle = IdempotentHandler(handler, MemoryStore(), group=self.name, policy=FAST)
        for message in await self._messages(copies):
            await handle(message)
        return effects, copies


class Kafka(Broker):
    id = "kafka"
    unreachable_url = "kafka://127.0.0.1:9"
    bad_urls = (
        "127.0.0.1:9092",
        "redis://127.0.0.1:9092",
        "kafka://127.0.0.1",
        "kafka://127.0.0.1:9092,",
        "kafka://127.0.0.1:99999",
        "kafka://127.0.0.1:9092/topic",
    )

    def publisher(self, url: str | None = None, **options: Any) -> Publisher:
        from oncely.outbox.kafka import KafkaPublisher

        url = url or f"kafka://{service_url('ONCELY_TEST_KAFKA_BOOTSTRAP')}"
        options.setdefault("max_request_size", KAFKA_MAX_REQUEST)
        options.setdefault("request_timeout_ms", 5000)
        return KafkaPublisher.from_url(url, **options)

    async def setup(self) -> None:
        from confluent_kafka.admin import AdminClient, NewTopic

        self.admin = AdminClient(
            {"bootstrap.servers": service_url("ONCELY_TEST_KAFKA_BOOTSTRAP")}
        )  # kept: its futures fail once it is collected
        topics = [NewTopic(self.name, num_partitions=KAFKA_PARTITIONS)]
        for future in self.admin.create_topics(topics).values():
            future.result(10)

    async def teardown(self) -> None:
        for future in self.admin.delete_topics([self.name]).values():
            future.result(10)

    def failing(self, event: OutboxEvent) -> OutboxEvent:
        return _with(event, payload=b"x" * (KAFKA_MAX_REQUEST * 2))

    async def read(self, count: int) -> list[Arrived]:
        import aiokafka

        client = aiokafka.AIOKafkaConsumer(
            bootstrap_servers=service_url("ONCELY_TEST_KAFKA_BOOTSTRAP"),
            auto_offset_reset="earliest",
            enable_auto_commit=False,
        )
        await client.start()
        got: list[Arrived] = []
        try:
            client.assign([aiokafka.TopicPartition(self.name, p) for p in range(KAFKA_PARTITIONS)])

            async def enough() -> bool:
                for records in (await client.getmany(timeout_ms=100)).values():
                    got.extend(
                        Arrived(
                            r.value,
                            {k: _text(v) for k, v in r.headers},
                            record_key=None if r.key is None else _text(r.key),
                        )
                        for r in records
                    )
                return len(got) >= count

            await until(enough)
        finally:
            await client.stop()
        return got

    async def consume(self, copies: int) -> tuple[Effects, int]:
        import aiokafka

        from oncely.consumers.kafka import AsyncIdempotentKafkaConsumer

        bootstrap = service_url("ONCELY_TEST_KAFKA_BOOTSTRAP")
        effects = Effects()

        async def handler(record: Any) -> None:
            effects.add(dict(record.headers)["Idempotency-Key"].decode())

        client = aiokafka.AIOKafkaConsumer(
            bootstrap_servers=bootstrap,
            group_id=self.name,
            auto_offset_reset="earliest",
            enable_auto_commit=False,
            session_timeout_ms=2000,
            heartbeat_interval_ms=400,
            rebalance_timeout_ms=2000,
        )
        producer = aiokafka.AIOKafkaProducer(bootstrap_servers=bootstrap)
        consumer = AsyncIdempotentKafkaConsumer(
            client, [self.name], handler, store=MemoryStore(), producer=producer, policy=FAST
        )
        await producer.start()
        await client.start()
        settled = 0
        try:

            async def all_settled() -> bool:
                nonlocal settled
                settled += await consumer.apoll(timeout=0.2)
                return settled >= copies

            await until(all_settled)
        finally:
            await client.stop()
            await producer.stop()
        return effects, settled


class NATS(Broker):
    id = "nats"
    unreachable_url = "nats://127.0.0.1:9"
    url_at = "nats://127.0.0.1:{port}"
    bad_urls = ("http://127.0.0.1:4222", "nats://", "nats://127.0.0.1:notaport", "nats://h/path")

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.destination = f"{name}.events"

    def publisher(self, url: str | None = None, **options: Any) -> Publisher:
        from oncely.outbox.nats import NATSPublisher

        return NATSPublisher.from_url(url or service_url("ONCELY_TEST_NATS_URL"), **options)

    async def setup(self) -> None:
        import nats

        self.client = await nats.connect(service_url("ONCELY_TEST_NATS_URL"))
        self.js = self.client.jetstream()
        await self.js.add_stream(name=self.name, subjects=[f"{self.name}.>"])

    async def teardown(self) -> None:
        await self.js.delete_stream(self.name)
        await self.client.close()

    def failing(self, event: OutboxEvent) -> OutboxEvent:
        return _with(event, destination=f"{self.name}-no-stream.events")  # no stream takes it

    async def _messages(self, count: int) -> list[Any]:
        import nats.errors

        sub = await self.js.pull_subscribe(self.destination, stream=self.name)
        got: list[Any] = []

        async def enough() -> bool:
            with contextlib.suppress(nats.errors.TimeoutError, asyncio.TimeoutError):
                got.extend(await sub.fetch(count - len(got), timeout=0.2))
            return len(got) >= count

        try:
            await until(enough)
        finally:
            await sub.unsubscribe()
        return got

    async def read(self, count: int) -> list[Arrived]:
        messages = await self._messages(count)
        for message in messages:
            await message.ack()
        return [
            Arrived(m.data, dict(m.headers or {}), (m.headers or {}).get("Nats-Msg-Id"))
            for m in messages
        ]

    async def consume(self, copies: int) -> tuple[Effects, int]:
        from oncely.consumers.nats import IdempotentHandler

        effects = Effects()

        async def handler(message: Any) -> None:
            effects.add(message.headers["Idempotency-Key"])

        handle = IdempotentHandler(handler, MemoryStore(), group=self.name, policy=FAST)
        # JetStream keeps one copy: the re-publish fell in the stream's duplicate window.
        info = await self.js.stream_info(self.name)
        stored = info.state.messages
        for message in await self._messages(stored):
            await handle(message)
        return effects, stored


class RedisStreams(Broker):
    id = "redis_streams"
    unreachable_url = "redis://127.0.0.1:9/0"
    url_at = "redis://127.0.0.1:{port}/0"
    bad_urls = (
        "http://127.0.0.1:6379",
        "redis://127.0.0.1:notaport/0",
        "redis://127.0.0.1:6379/0?socket_timeout=soon",
    )

    def publisher(self, url: str | None = None, **options: Any) -> Publisher:
        from oncely.outbox.redis_streams import RedisStreamsPublisher

        url = url or service_url("ONCELY_TEST_REDIS_URL")
        return RedisStreamsPublisher.from_url(url, **options)

    async def setup(self) -> None:
        import redis.asyncio

        self.client = redis.asyncio.Redis.from_url(service_url("ONCELY_TEST_REDIS_URL"))
        await self.client.set(f"{self.name}:string", "not a stream")

    async def teardown(self) -> None:
        await self.client.delete(self.name, f"{self.name}:string")
        await self.client.aclose()

    def failing(self, event: OutboxEvent) -> OutboxEvent:
        return _with(event, destination=f"{self.name}:string")  # WRONGTYPE

    async def read(self, count: int) -> list[Arrived]:
        async def enough() -> list[Any] | None:
            entries = await self.client.xrange(self.name)
            return entries if len(entries) >= count else None

        entries = await until(enough)
        arrived = []
        for _, fields in entries:
            decoded = {_text(k): v for k, v in fields.items()}
            body = decoded.pop("body")
            arrived.append(Arrived(body, {k: _text(v) for k, v in decoded.items()}))
        return arrived

    async def consume(self, copies: int) -> tuple[Effects, int]:
        from oncely.consumers.redis_streams import RedisStreamConsumer

        effects = Effects()

        async def handler(entry: Any) -> None:
            effects.add(_text(entry.fields[b"Idempotency-Key"]))

        consumer = RedisStreamConsumer(
            self.client, self.name, "g", handler, store=MemoryStore(), policy=FAST, block=0.1
        )
        await consumer.acreate_group()
        settled = 0

        async def all_settled() -> bool:
            nonlocal settled
            settled += await consumer.apoll()
            return settled >= copies

        await until(all_settled)
        return effects, settled


BROKERS: tuple[type[Broker], ...] = (RabbitMQ, Kafka, NATS, RedisStreams)


def _with(event: OutboxEvent, **changes: Any) -> OutboxEvent:
    import dataclasses

    return dataclasses.replace(event, **changes)
