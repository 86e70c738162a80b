"""Outbox publishers against the raw driver publishing the same events with confirms.

Not a test. For each broker, the same events (payload, headers, ordering keys) go out in
batches, as a relay hands them over: through the oncely publisher (`oncely.outbox.*`), and
through the broker's client alone, pipelined and confirmed the plain way (aio-pika publishes
gathered, aiokafka sends then their futures gathered, nats-py ``publish_async`` then the acks
gathered, one redis-py pipeline of XADDs per batch). Modes alternate within each round; rates
are medians over rounds, the ratio the median of the per-round ratios.

    python benchmarks/outbox/bench_publish.py     # writes benchmarks/results/outbox_publish.md
    python benchmarks/outbox/bench_publish.py --events 4000 --batch 200 --rounds 5

Servers: the test URLs (``ONCELY_TEST_*``, see scripts/services) or the loopback defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

from oncely.consumers import producer
from oncely.outbox import OutboxEvent, Publisher

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "outbox_publish.md"

RABBITMQ_URL = os.environ.get("ONCELY_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
KAFKA_URL = os.environ.get("ONCELY_TEST_KAFKA_BOOTSTRAP", "127.0.0.1:9092")
NATS_URL = os.environ.get("ONCELY_TEST_NATS_URL", "nats://127.0.0.1:4222")
REDIS_URL = os.environ.get("ONCELY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")

Batch = Sequence[OutboxEvent]


class Bench:
    """One broker: a destination, its publisher, and the raw driver's way to publish."""

    name: str

    def __init__(self, destination: str) -> None:
        self.destination = destination

    async def setup(self) -> None: ...

    async def teardown(self) -> None: ...

    def publisher(self) -> Publisher:
        raise NotImplementedError

    async def raw(self, batch: Batch) -> None:
        """Publish *batch* with the driver alone, every message confirmed."""
        raise NotImplementedError


class RabbitMQ(Bench):
    name = "rabbitmq"

    def publisher(self) -> Publisher:
        from oncely.outbox.rabbitmq import RabbitMQPublisher

        return RabbitMQPublisher.from_url(RABBITMQ_URL)

    async def setup(self) -> None:
        import aio_pika

        self.connection = await aio_pika.connect(RABBITMQ_URL)
        self.channel = await self.connection.channel(publisher_confirms=True)
        self.queue = await self.channel.declare_queue(self.destination)

    async def teardown(self) -> None:
        await self.queue.delete(if_unused=False, if_empty=False)
        await self.connection.close()

    async def raw(self, batch: Batch) -> None:
        import aio_pika

        exchange = self.channel.default_exchange
        await asyncio.gather(
            *(
                exchange.publish(
                    aio_pika.Message(
                        e.payload,
                        headers=producer.stamp(e.message_id, e.headers),
                        message_id=e.message_id,
                        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                    ),
                    e.destination,
                    mandatory=True,
                )
                for e in batch
            )
        )


class Kafka(Bench):
    name = "kafka"

    def publisher(self) -> Publisher:
        from oncely.outbox.kafka import KafkaPublisher

        return KafkaPublisher.from_url(f"kafka://{KAFKA_URL}")

    async def setup(self) -> None:
        import aiokafka
        from confluent_kafka.admin import AdminClient, NewTopic

        self.admin = AdminClient({"bootstrap.servers": KAFKA_URL})
        for future in self.admin.create_topics([NewTopic(self.destination, 3)]).values():
            future.result(10)
        self.producer = aiokafka.AIOKafkaProducer(bootstrap_servers=KAFKA_URL, acks="all")
        await self.producer.start()

    async def teardown(self) -> None:
        await self.producer.stop()
        for future in self.admin.delete_topics([self.destination]).values():
            future.result(10)

    async def raw(self, batch: Batch) -> None:
        sent = [
            await self.producer.send(
                e.destination,
                e.payload,
                key=None if e.ordering_key is None else e.ordering_key.encode(),
                headers=producer.kafka_headers(e.message_id, e.headers),
            )
            for e in batch
        ]
        await asyncio.gather(*sent)


class NATS(Bench):
    name = "nats"

    def __init__(self, destination: str) -> None:
        super().__init__(f"{destination}.events")
        self.stream = destination

    def publisher(self) -> Publisher:
        from oncely.outbox.nats import NATSPublisher

        return NATSPublisher.from_url(NATS_URL)

    async def setup(self) -> None:
        import nats

        self.client = await nats.connect(NATS_URL)
        self.js = self.client.jetstream()
        await self.js.add_stream(name=self.stream, subjects=[f"{self.stream}.>"])

    async def teardown(self) -> None:
        await self.js.delete_stream(self.stream)
        await self.client.close()

    async def raw(self, batch: Batch) -> None:
        acks = [
            await self.js.publish_async(
                e.destination, e.payload, headers=producer.nats_headers(e.message_id, e.headers)
            )
            for e in batch
        ]
        await asyncio.gather(*acks)


class RedisStreams(Bench):
    name = "redis_streams"

    def publisher(self) -> Publisher:
        from oncely.outbox.redis_streams import RedisStreamsPublisher

        return RedisStreamsPublisher.from_url(REDIS_URL)

    async def setup(self) -> None:
        import redis.asyncio

        self.client = redis.asyncio.Redis.from_url(REDIS_URL)

    async def teardown(self) -> None:
        await self.client.delete(self.destination)
        await self.client.aclose()

    async def raw(self, batch: Batch) -> None:
        async with self.client.pipeline(transaction=False) as pipeline:
            for e in batch:
                pipeline.xadd(
                    e.destination,
                    producer.redis_fields(e.message_id, {"body": e.payload, **e.headers}),
                )
            await pipeline.execute()


BENCHES = (RabbitMQ, Kafka, NATS, RedisStreams)


def make_events(destination: str, count: int, keys: int) -> list[OutboxEvent]:
    run = uuid.uuid4().hex[:8]
    return [
        OutboxEvent(
            id=n,
            message_id=f"{run}-{n}",
            destination=destination,
            payload=b'{"order": %d, "total": "12.50", "lines": [1, 2, 3]}' % n,
            headers={"Content-Type": "application/json", "Event-Type": "order.created"},
            ordering_key=f"customer-{n % keys}" if keys else None,
        )
        for n in range(count)
    ]


async def timed(batches: list[Batch], publish: Callable[[Batch], Awaitable[Any]]) -> float:
    """Events per second for publishing every batch, one after the other."""
    started = time.perf_counter()
    for batch in batches:
        await publish(batch)
    return sum(len(b) for b in batches) / (time.perf_counter() - started)


async def bench(kind: type[Bench], args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """The rates of the publisher and of the raw driver, one pair per round."""
    target = kind(f"oncely-bench-pub-{uuid.uuid4().hex[:8]}")
    await target.setup()
    publisher = target.publisher()
    oncely_rates: list[float] = []
    raw_rates: list[float] = []

    async def through_publisher(batch: Batch) -> None:
        outcomes = await publisher.publish(batch)
        failed = [o for o in outcomes if o is not None]
        assert not failed, failed[:3]

    try:
        warm = make_events(target.destination, args.batch, args.keys)
        await through_publisher(warm)  # connects, and proves the destination
        await target.raw(warm)
        for number in range(args.rounds):
            modes = [("oncely", through_publisher), ("raw", target.raw)]
            if number % 2:
                modes.reverse()
            for mode, publish in modes:
                events = make_events(target.destination, args.events, args.keys)
                batches = [events[i : i + args.batch] for i in range(0, len(events), args.batch)]
                rate = await timed(batches, publish)
                (oncely_rates if mode == "oncely" else raw_rates).append(rate)
            print(
                f"{kind.name} round {number + 1}: oncely {oncely_rates[-1]:,.0f}/s, "
                f"raw {raw_rates[-1]:,.0f}/s",
                file=sys.stderr,
            )
    finally:
        await publisher.aclose()
        await target.teardown()
    return oncely_rates, raw_rates


def header(title: str, script: str, load: tuple[float, ...], *extra: str) -> list[str]:
    """A results file's title, command and machine section (*extra*: more machine lines)."""
    command = f"python benchmarks/outbox/{script} " + " ".join(sys.argv[1:])
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return [
        f"# {title}",
        "",
        f"Generated by `{command.strip()}` on {now}.",
        "",
        "## Machine",
        "",
        f"- {platform.system()} {platform.release()} {platform.machine()}, "
        f"{os.cpu_count()} CPUs; Python {platform.python_version()}",
        f"- load average at start: {' '.join(f'{x:.1f}' for x in load)}; at the end: "
        f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} (the machine and servers are "
        "shared with other work: treat single figures with care, ratios within a round "
        "are fairer)",
        *extra,
        f"- aio-pika {version('aio-pika')}, aiokafka {version('aiokafka')}, "
        f"nats-py {version('nats-py')}, redis {version('redis')}",
        "- servers on loopback: RabbitMQ, tansu (Kafka protocol, memory storage), "
        "NATS JetStream (file storage), Redis",
        "",
    ]


def report(args: argparse.Namespace, load: tuple[float, ...], rows: list[str]) -> str:
    return "\n".join(
        [
            *header("Outbox publish benchmark", "bench_publish.py", load),
            "## Method",
            "",
            f"{args.events} events per mode and round, in batches of {args.batch} (one "
            f"`publish` call each, as a relay makes), ordering keys over {args.keys} "
            "customers, a 50-byte JSON payload and two headers. *oncely*: the broker's "
            "`oncely.outbox` publisher; *raw*: the same events through the driver alone, "
            "pipelined and confirmed (aio-pika publishes gathered; aiokafka sends, then their "
            "futures gathered; nats-py `publish_async`, then the acks gathered; one redis-py "
            "pipeline of XADDs per batch), with the same key header stamped. Connections are "
            "open and destinations proven before timing. Each figure is the median of "
            f"{args.rounds} rounds, modes alternating in order; the ratio is the median of the "
            "per-round ratios. The issue's target: at least 0.7 of a plain producer.",
            "",
            "| broker | raw events/s | oncely events/s | ratio |",
            "|---|---:|---:|---:|",
            *rows,
            "",
        ]
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=4000, help="events per mode and round")
    parser.add_argument("--batch", type=int, default=200, help="events per publish call")
    parser.add_argument("--keys", type=int, default=32, help="ordering keys (0: none)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--brokers", nargs="*", default=[b.name for b in BENCHES])
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    load = os.getloadavg()
    rows = []
    for kind in BENCHES:
        if kind.name not in args.brokers:
            continue
        oncely_rates, raw_rates = await bench(kind, args)
        ratio = statistics.median(o / r for o, r in zip(oncely_rates, raw_rates, strict=True))
        rows.append(
            f"| {kind.name} | {statistics.median(raw_rates):,.0f} | "
            f"{statistics.median(oncely_rates):,.0f} | {ratio:.2f} |"
        )
    args.output.write_text(report(args, load, rows))
    print(args.output.read_text())


if __name__ == "__main__":
    asyncio.run(main())
