"""Benchmark idempotent consumers against the same consumer without dedup, per broker.

    python benchmarks/consumers/run.py                          # every broker, 3 rounds
    python benchmarks/consumers/run.py --brokers rabbitmq nats --unique 2000 --rounds 1

For each broker, the same deliveries are published to two fresh queues (topics, streams): a
set of unique messages plus 20% duplicates (copies of random ones, shuffled in; so 1 delivery
in 5 is a duplicate). One queue is drained by a plain consumer (the handler and the broker's
ack or commit, nothing else: the baseline), the other by oncely's adapter with a Redis store.
Throughput is deliveries per second from the first delivery handled to the last one settled
(connection and group-join time excluded). Modes alternate within each round and the report
gives medians over rounds; the ratio is oncely's rate over the baseline's in the same round.
The handler does no work: the ratio is the whole cost of dedup, in its worst case.

Servers come from ``scripts/services --env`` (``ONCELY_TEST_*``). Not collected by pytest.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT / "src"))

import oncely  # noqa: E402
from oncely.consumers import ConsumerPolicy, Reason  # noqa: E402
from oncely.consumers.producer import kafka_headers, redis_fields, stamp  # noqa: E402

BROKERS = ["rabbitmq", "kafka-confluent", "kafka-aiokafka", "nats", "redis-streams"]
POLICY = ConsumerPolicy(
    lease=timedelta(seconds=30), ttl=timedelta(minutes=10), retry_delay=timedelta(milliseconds=100)
)
"""retry_delay: a copy of a key that is in flight elsewhere (a concurrent duplicate) is
redelivered after 100 ms instead of 1 s, so a run does not end waiting for one redelivery."""
PARTITIONS = 4
WORK: float | str = 0.0
"""What each handler call does (set per workload): seconds of I/O (a sleep), or ``"db"``: one
INSERT into a PostgreSQL table (a real effect, as the tests count them)."""
DB_POOL = 16
"""Connections the async consumers' handlers share for the ``db`` workload (64 run at once)."""


def env(name: str, default: str) -> str:
    return os.environ.get(name, default)


REDIS = env("ONCELY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
POSTGRES = env("ONCELY_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
RABBIT = env("ONCELY_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
NATS = env("ONCELY_TEST_NATS_URL", "nats://127.0.0.1:4222")
KAFKA = env("ONCELY_TEST_KAFKA_BOOTSTRAP", "127.0.0.1:9092")


INSERT = "INSERT INTO {table} (worker) VALUES ('bench')"


@dataclass
class Clock:
    """Counts settled deliveries; the rate runs from the first to the last.

    Use it as a context manager (``with`` in sync consumers, ``async with`` in async ones): for
    the ``db`` workload it creates the effects table and the connections, and drops them.
    """

    total: int
    needed: int = 0
    """Effects the run must have seen to end: a redelivery (after a Kafka rebalance, say)
    settles a delivery twice, and must not end the run before every key has run."""
    first: float | None = None
    last: float = 0.0
    cpu_first: float = 0.0
    cpu_last: float = 0.0
    """The process's CPU time at the first and the last settle: what the consumer's client
    spent per delivery (all threads), a figure the machine's load moves less than a rate."""
    settled: int = 0
    effects: int = 0
    done: threading.Event = field(default_factory=threading.Event)
    table: str = field(default_factory=lambda: f"oncely_bench_effects_{uuid.uuid4().hex[:10]}")
    _connection: Any = None
    _pool: Any = None

    def handled(self) -> None:
        """The handler ran (an effect), doing the workload's blocking I/O."""
        self.effects += 1
        if WORK == "db":
            self._connection.execute(INSERT.format(table=self.table))
        elif WORK:
            time.sleep(WORK)

    async def ahandled(self) -> None:
        """The async handler ran (an effect), awaiting the workload's I/O."""
        self.effects += 1
        if WORK == "db":
            async with self._pool.connection() as connection:
                await connection.execute(INSERT.format(table=self.table))
        elif WORK:
            await asyncio.sleep(WORK)

    def __enter__(self) -> Clock:
        if WORK == "db":
            import psycopg

            self._connection = psycopg.connect(POSTGRES, autocommit=True)
            self._connection.execute(
                f"CREATE TABLE {self.table} (id bigserial PRIMARY KEY, worker text)"
            )
        return self

    def __exit__(self, *exc: object) -> None:
        if self._connection is not None:
            self._connection.execute(f"DROP TABLE IF EXISTS {self.table}")
            self._connection.close()

    async def __aenter__(self) -> Clock:
        self.__enter__()
        if WORK == "db":
            from psycopg_pool import AsyncConnectionPool

            self._pool = AsyncConnectionPool(
                POSTGRES,
                min_size=DB_POOL,
                max_size=DB_POOL,
                kwargs={"autocommit": True},
                open=False,
            )
            await self._pool.open(wait=True)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._pool is not None:
            await self._pool.close()
        self.__exit__()

    def settle(self, count: int = 1) -> None:
        """*count* deliveries were acked or committed (or found duplicate)."""
        now = time.perf_counter()
        cpu = time.process_time()
        if self.first is None:
            self.first, self.cpu_first = now, cpu
        self.settled += count
        self.last, self.cpu_last = now, cpu
        if self.settled >= self.total and self.effects >= self.needed:
            self.done.set()

    @property
    def rate(self) -> float:
        assert self.first is not None
        return self.total / max(self.last - self.first, 1e-9)

    @property
    def cpu_us(self) -> float:
        """Client CPU time per delivery, in microseconds."""
        return (self.cpu_last - self.cpu_first) / self.total * 1e6


def deliveries(unique: int, seed: int) -> list[str]:
    """Unique keys plus 25% more copies of random ones: 20% of deliveries are duplicates."""
    rng = random.Random(seed)
    keys = [f"m-{seed}-{n}" for n in range(unique)]
    copies = keys + [rng.choice(keys) for _ in range(unique // 4)]
    rng.shuffle(copies)
    return copies


class SingleVerbs:
    """A store seen without its batch verbs (as a third-party store may be): one claim and one
    completion per message, whatever the adapter could batch."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def __getattr__(self, name: str) -> Any:
        if name.endswith("_many"):
            raise AttributeError(name)
        return getattr(self.store, name)


def open_store(namespace: str, mode: str = "oncely") -> Any:
    """The Redis store as shipped, or (``one-by-one``) without its batch verbs."""
    store = oncely.open_store(REDIS, namespace=namespace)
    return SingleVerbs(store) if mode == "one-by-one" else store


def drop_namespace(namespace: str) -> None:
    import redis

    from oncely.stores.redis._codec import Keyspace

    client = redis.Redis.from_url(REDIS)
    names = list(client.scan_iter(match=Keyspace("oncely:", namespace).pattern(), count=1000))
    for start in range(0, len(names), 1000):
        client.delete(*names[start : start + 1000])
    client.close()


def body(key: str) -> bytes:
    return json.dumps({"order": key, "amount": 500}).encode()


# -- RabbitMQ ------------------------------------------------------------------------------------


async def rabbitmq(keys: list[str], mode: str, name: str, clock: Clock) -> Clock:
    import aio_pika

    from oncely.consumers.rabbitmq import idempotent_handler

    connection = await aio_pika.connect(RABBIT)
    async with connection:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=64)  # the same 64 in flight in every mode
        queue = await channel.declare_queue(name)
        try:
            for key in keys:
                await channel.default_exchange.publish(
                    aio_pika.Message(body(key), headers=stamp(key)), routing_key=name
                )
            finished = asyncio.Event()
            store = None
            if mode == "baseline":

                async def plain(message: aio_pika.abc.AbstractIncomingMessage) -> None:
                    await clock.ahandled()
                    await message.ack()
                    clock.settle()
                    if clock.done.is_set():
                        finished.set()

                tag = await queue.consume(plain)
            else:
                store = open_store(name, mode)

                async def handler(message: Any) -> None:
                    await clock.ahandled()

                idem = idempotent_handler(store, group=name, policy=POLICY)(handler)

                async def wrapped(message: aio_pika.abc.AbstractIncomingMessage) -> None:
                    verdict = await idem(message)
                    if verdict.reason in (Reason.PROCESSED, Reason.DUPLICATE):
                        clock.settle()
                    if clock.done.is_set():
                        finished.set()

                tag = await queue.consume(wrapped)
            await asyncio.wait_for(finished.wait(), 300)
            await queue.cancel(tag)
            if store is not None:
                await store.aclose()
        finally:
            await queue.delete(if_unused=False, if_empty=False)
    return clock


# -- NATS JetStream ------------------------------------------------------------------------------


async def nats(keys: list[str], mode: str, name: str, clock: Clock) -> Clock:
    import nats as nats_py

    from oncely.consumers.nats import idempotent_handler

    client = await nats_py.connect(NATS)
    js = client.jetstream()
    await js.add_stream(name=name, subjects=[f"{name}.>"])
    try:
        for start in range(0, len(keys), 500):
            acks = [
                js.publish(f"{name}.orders", body(key), headers=stamp(key))
                for key in keys[start : start + 500]
            ]
            await asyncio.gather(*acks)
        sub = await js.pull_subscribe(f"{name}.orders", durable="bench", stream=name)
        store = open_store(name, mode)

        async def handler(msg: Any) -> None:
            await clock.ahandled()

        idem = idempotent_handler(store, group=name, policy=POLICY)(handler)
        # one-by-one: below the store's pool of 100 connections. The baseline, like `batch`,
        # runs every message of a fetched batch at once.
        gate = asyncio.Semaphore(64 if mode == "one-by-one" else 1_000_000)

        async def one(msg: Any) -> None:
            async with gate:
                if mode == "baseline":
                    await clock.ahandled()
                    await msg.ack()
                    clock.settle()
                    return
                verdict = await idem(msg)
            if verdict.reason in (Reason.PROCESSED, Reason.DUPLICATE):
                clock.settle()

        while not clock.done.is_set():
            try:
                messages = await sub.fetch(200, timeout=1)
            except (nats_py.errors.TimeoutError, asyncio.TimeoutError):
                continue
            if mode == "oncely":
                verdicts = await idem.batch(messages)
                clock.settle(
                    sum(v.reason in (Reason.PROCESSED, Reason.DUPLICATE) for v in verdicts)
                )
            else:
                await asyncio.gather(*(one(msg) for msg in messages))
        await store.aclose()
    finally:
        await js.delete_stream(name)
        await client.close()
    return clock


# -- Redis Streams -------------------------------------------------------------------------------


def redis_streams(keys: list[str], mode: str, name: str, clock: Clock) -> Clock:
    import redis

    from oncely.consumers.redis_streams import RedisStreamConsumer, StreamEntry

    client = redis.Redis.from_url(REDIS)
    try:
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.xadd(name, redis_fields(key, {"body": body(key)}))
        pipe.execute()
        client.xgroup_create(name, "bench", id="0")
        if mode == "baseline":
            while not clock.done.is_set():
                for _, entries in client.xreadgroup("bench", "c", {name: ">"}, count=200) or ():
                    for _ in entries:
                        clock.handled()
                    client.xack(name, "bench", *(entry_id for entry_id, _ in entries))
                    clock.settle(len(entries))
        else:
            store = open_store(name, mode)

            def handler(entry: StreamEntry) -> None:
                clock.handled()

            consumer = RedisStreamConsumer(
                client, name, "bench", handler, store=store, policy=POLICY, batch_size=200
            )
            before = 0
            while not clock.done.is_set():
                consumer.poll()
                now = consumer.stats[Reason.PROCESSED] + consumer.stats[Reason.DUPLICATE]
                clock.settle(now - before)
                before = now
            store.close()
    finally:
        client.delete(name)
        client.close()
    return clock


# -- Kafka ---------------------------------------------------------------------------------------


def _create_topic(name: str) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": KAFKA})
    for future in admin.create_topics([NewTopic(name, num_partitions=PARTITIONS)]).values():
        future.result(10)


def _delete_topic(name: str) -> None:
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": KAFKA})
    for future in admin.delete_topics([name]).values():
        future.result(10)


def _produce(name: str, keys: list[str]) -> None:
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": KAFKA, "linger.ms": 5})
    for number, key in enumerate(keys):
        producer.produce(name, body(key), headers=kafka_headers(key), partition=number % PARTITIONS)
        if number % 1000 == 0:
            producer.poll(0)
    producer.flush(30)


GROUP = {"session.timeout.ms": 2000, "heartbeat.interval.ms": 400, "auto.offset.reset": "earliest"}


def kafka_confluent(keys: list[str], mode: str, name: str, clock: Clock) -> Clock:
    from confluent_kafka import Consumer, TopicPartition

    from oncely.consumers.kafka import IdempotentKafkaConsumer

    _create_topic(name)
    try:
        _produce(name, keys)
        config = {"bootstrap.servers": KAFKA, "group.id": name, **GROUP}
        if mode == "baseline":
            consumer = Consumer({**config, "enable.auto.commit": False})
            consumer.subscribe([name])
            while not clock.done.is_set():
                batch = [m for m in consumer.consume(500, 1.0) if m.error() is None]
                ends: dict[int, int] = {}
                for message in batch:
                    clock.handled()
                    ends[message.partition()] = message.offset() + 1
                if ends:
                    consumer.commit(
                        offsets=[TopicPartition(name, p, o) for p, o in ends.items()],
                        asynchronous=False,
                    )
                    clock.settle(len(batch))
            consumer.close()
        else:
            store = open_store(name, mode)
            idem = IdempotentKafkaConsumer(
                config,
                [name],
                lambda m: clock.handled(),
                store=store,
                policy=POLICY,
                batch_size=500,
            )
            before = 0
            while not clock.done.is_set():
                idem.poll()
                now = idem.stats[Reason.PROCESSED] + idem.stats[Reason.DUPLICATE]
                clock.settle(now - before)
                before = now
            idem.close()
            store.close()
    finally:
        _delete_topic(name)
    return clock


async def kafka_aiokafka(keys: list[str], mode: str, name: str, clock: Clock) -> Clock:
    import aiokafka

    from oncely.consumers.kafka import AsyncIdempotentKafkaConsumer

    _create_topic(name)
    try:
        _produce(name, keys)
        options = {
            "bootstrap_servers": KAFKA,
            "group_id": name,
            "enable_auto_commit": False,
            "auto_offset_reset": "earliest",
            "session_timeout_ms": 2000,
            "heartbeat_interval_ms": 400,
            "rebalance_timeout_ms": 2000,
            "max_poll_records": 500,
        }
        client = aiokafka.AIOKafkaConsumer(*([name] if mode == "baseline" else []), **options)
        if mode == "baseline":
            await client.start()
            try:
                while not clock.done.is_set():
                    batch = await client.getmany(timeout_ms=1000, max_records=500)

                    async def partition(tp: Any, records: list[Any]) -> None:
                        for _ in records:  # in order within a partition, as the adapter does
                            await clock.ahandled()
                        await client.commit({tp: records[-1].offset + 1})

                    await asyncio.gather(*(partition(tp, rs) for tp, rs in batch.items() if rs))
                    count = sum(len(records) for records in batch.values())
                    if count:
                        clock.settle(count)
            finally:
                await client.stop()
        else:
            store = open_store(name, mode)
            producer = aiokafka.AIOKafkaProducer(bootstrap_servers=KAFKA)
            await producer.start()

            async def handler(record: Any) -> None:
                await clock.ahandled()

            idem = AsyncIdempotentKafkaConsumer(
                client,
                [name],
                handler,
                store=store,
                producer=producer,
                policy=POLICY,
                batch_size=500,
            )
            await client.start()
            try:
                before = 0
                while not clock.done.is_set():
                    await idem.apoll()
                    now = idem.stats[Reason.PROCESSED] + idem.stats[Reason.DUPLICATE]
                    clock.settle(now - before)
                    before = now
            finally:
                await client.stop()
                await producer.stop()
                await store.aclose()
    finally:
        _delete_topic(name)
    return clock


RUNNERS: dict[str, Callable[[list[str], str, str, Clock], Clock | Awaitable[Clock]]] = {
    "rabbitmq": rabbitmq,
    "kafka-confluent": kafka_confluent,
    "kafka-aiokafka": kafka_aiokafka,
    "nats": nats,
    "redis-streams": redis_streams,
}


def measure(broker: str, keys: list[str], mode: str) -> Clock:
    name = f"oncely-bench-{uuid.uuid4().hex[:10]}"
    expected = len(keys) if mode == "baseline" else len(set(keys))
    clock = Clock(len(keys), expected)
    runner = RUNNERS[broker]
    try:
        if asyncio.iscoroutinefunction(runner):

            async def run_async() -> None:
                async with clock:
                    await runner(keys, mode, name, clock)

            asyncio.run(run_async())
        else:
            with clock:
                runner(keys, mode, name, clock)
    finally:
        drop_namespace(name)
    if clock.effects != expected:
        raise AssertionError(f"{broker}/{mode}: {clock.effects} effects, expected {expected}")
    return clock


MODES = ["baseline", "one-by-one", "oncely"]


Results = dict[str, dict[str, list[float]]]
"""Per broker, per mode: one figure per round."""


def main() -> None:
    global WORK
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--brokers", nargs="+", default=BROKERS, choices=BROKERS)
    parser.add_argument("--unique", type=int, default=4000, help="unique messages per run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--work",
        nargs="+",
        type=_workload,
        default=[0.0, 1.0, "db"],
        help="what each handler call does: milliseconds of I/O (a sleep), or db (one INSERT)",
    )
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks/results/consumers.md")
    args = parser.parse_args()
    load_start = os.getloadavg()
    started = datetime.datetime.now(datetime.timezone.utc)
    tables: dict[float | str, tuple[Results, Results, Results]] = {}
    for work in args.work:
        WORK = work if work == "db" else work / 1000
        rates: Results = {b: {m: [] for m in MODES} for b in args.brokers}
        ratios: Results = {b: {m: [] for m in MODES} for b in args.brokers}
        cpus: Results = {b: {m: [] for m in MODES} for b in args.brokers}
        for round_number in range(args.rounds):
            for broker in args.brokers:
                keys = deliveries(args.unique, seed=round_number)
                modes = list(MODES)
                if round_number % 2:
                    modes.reverse()
                clocks = {mode: measure(broker, keys, mode) for mode in modes}
                got = {mode: clock.rate for mode, clock in clocks.items()}
                line = f"{_label(work)}, round {round_number + 1} {broker:16}"
                for mode, rate in got.items():
                    rates[broker][mode].append(rate)
                    ratios[broker][mode].append(rate / got["baseline"])
                    cpus[broker][mode].append(clocks[mode].cpu_us)
                    line += (
                        f" {mode} {rate:8.0f}/s ({rate / got['baseline']:.2f},"
                        f" {clocks[mode].cpu_us:.0f} us CPU)"
                    )
                print(line, flush=True)
        tables[work] = (rates, ratios, cpus)
    write_report(args, tables, started, load_start)


def _workload(text: str) -> float | str:
    return "db" if text == "db" else float(text)


def _argument(work: float | str) -> str:
    return "db" if work == "db" else f"{work:g}"


def _label(work: float | str) -> str:
    return (
        "one PostgreSQL INSERT per handler call"
        if work == "db"
        else f"{work:g} ms of handler I/O per call"
    )


def _median(values: list[float], form: str) -> str:
    return format(statistics.median(values), form) if values else "n/a"


def write_report(
    args: argparse.Namespace,
    tables: dict[float | str, tuple[Results, Results, Results]],
    started: datetime.datetime,
    load_start: tuple[float, float, float],
) -> None:
    import importlib.metadata as metadata

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "absent"

    deliveries_per_run = args.unique + args.unique // 4
    lines = [
        "# Consumer benchmark",
        "",
        f"Generated by `python benchmarks/consumers/run.py --unique {args.unique} "
        f"--rounds {args.rounds} --work {' '.join(map(_argument, args.work))}` on "
        f"{started:%Y-%m-%d %H:%M} UTC.",
        "",
        "## Machine",
        "",
        f"- {platform.system()} {platform.release()} {platform.machine()}, "
        f"{os.cpu_count()} CPUs; Python {platform.python_version()}",
        f"- load average at start: {' '.join(f'{x:.1f}' for x in load_start)}; at the end: "
        f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} (the machine and servers are shared "
        "with other work: treat single figures with care, ratios within a round are fairer)",
        f"- aio-pika {version('aio-pika')}, confluent-kafka {version('confluent-kafka')}, "
        f"aiokafka {version('aiokafka')}, nats-py {version('nats-py')}, redis {version('redis')}",
        "- servers on loopback: RabbitMQ, tansu (Kafka protocol, memory storage), NATS "
        "JetStream, Redis (also the oncely store), PostgreSQL (the `db` workload's effects)",
        "",
        "## Method",
        "",
        f"{deliveries_per_run} deliveries per run: {args.unique} unique messages plus "
        f"{args.unique // 4} duplicates (20% of deliveries), shuffled, published before the "
        "consumer starts. The handler records an effect and waits for its I/O: a sleep "
        "(`time.sleep` in sync consumers, `asyncio.sleep` in async ones), or a real write, one "
        f"INSERT into a PostgreSQL table (one connection in sync consumers, a pool of {DB_POOL} "
        "in async ones); with 0 ms of work the ratio is the whole cost of dedup, in its worst "
        "case.",
        "",
        "- *baseline*: the broker's client alone, no dedup (duplicates run the handler again): "
        "handler, then ack (RabbitMQ: per message, 64 in flight; NATS: per message, a fetched "
        "batch of 200 at once; Redis Streams: one XACK "
        "per fetched batch; Kafka: partitions in order, one commit per partition per batch).",
        "- *one-by-one*: the adapter (`oncely.consumers.*`) with the Redis store seen without "
        "its batch verbs, as a store of your own may be: claim, run, complete per message (two "
        "store round trips each), then the same acks.",
        "- *oncely*: the same adapter with the Redis store as shipped: a fetched batch (Kafka, "
        "Redis Streams, NATS `batch`) is claimed with one Lua call (`claim_many`; NATS's 200 "
        "in chunks of 50 sent at once, its first handlers running meanwhile), and each "
        "message is completed as its handler returns, the completions made meanwhile going "
        "together in one `complete_many` call; for messages pushed one per callback "
        "(RabbitMQ), one claim (completion) goes to the store at a time and those that arrive "
        "meanwhile go together in one such call (group commit).",
        "",
        "Rate: deliveries / (last settled - first handled), connection and group-join time "
        f"excluded. Each figure is the median of {args.rounds} round(s), modes alternating in "
        "order; a ratio is the median of the per-round ratios to the baseline of the same "
        "round. Every run checks the effect count: one per unique key with oncely, one per "
        "delivery without. CPU: the consumer process's CPU time (all its threads) from the "
        "first to the last settled delivery, per delivery (median), which the load of the "
        "machine moves less than a rate.",
    ]
    for work, (rates, ratios, cpus) in tables.items():
        lines += [
            "",
            f"## {_label(work)}",
            "",
            "| broker | baseline msg/s | one-by-one msg/s | ratio | oncely msg/s | ratio "
            "| CPU us/msg: baseline | oncely |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for broker in args.brokers:
            r, q, c = rates[broker], ratios[broker], cpus[broker]
            lines.append(
                f"| {broker} | {_median(r['baseline'], ',.0f')} | "
                f"{_median(r['one-by-one'], ',.0f')} | {_median(q['one-by-one'], '.2f')} | "
                f"{_median(r['oncely'], ',.0f')} | {_median(q['oncely'], '.2f')} | "
                f"{_median(c['baseline'], '.0f')} | {_median(c['oncely'], '.0f')} |"
            )
    lines += ["", NOTES, ""]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("\n".join(lines))
    print(f"wrote {args.output}")


NOTES = """## Reading the figures

The target is a ratio of at least 0.8. Rounds on this shared machine vary (the PostgreSQL
workload most: its server is shared too); the per-round lines printed by the run show the
spread, and a load average well above the 2 CPUs (other work on the machine) lowers every
ratio whose consumer waits on more processes than its baseline does (the store's server).

- With a real effect per message (one INSERT into PostgreSQL, what the tests count), the
  handler's I/O dominates, and the 20% of duplicates skip theirs: on a quiet machine
  (2026-11-23) NATS, Redis Streams and RabbitMQ ran at about the plain consumer's rate,
  aiokafka above the target, and confluent-kafka just below it (its sync consumer waits for
  each batch's claim and completion in turn with its handlers).
- Kafka: copies of one key in two partitions used to block each other: the second
  claim answered in progress and blocked the rest of its partition, holding those records'
  leases, which a later poll of another partition found busy in turn (155-390 such retries
  and 1,160-2,800 blocked records per aiokafka run of 2,500, each block a rewind, a pause
  and a fetch again). The partitions of a member now share those keys: a copy runs under
  the lease claimed or kept for it in another partition if that one has not started, else
  waits for that run and is its duplicate (0-3 retries, 0-200 blocked, each record fetched
  once, at a load of 4-14).
- aiokafka with 1 ms of I/O is then bound by one completion round trip per record: a
  partition's records run one after the other (as the baseline's do), and each completion
  is sent as its handler returns, so its reply wakes the event loop during the next
  handler's sleep (whose remaining wait epoll rounds up to a whole millisecond). One
  Redis call beside each 1 ms sleep added 0.6-1.1 ms of wall time per iteration at a load
  average of 4 on this machine (a bare PING as much as a completion).
- With 1 ms of I/O per message (a sleep, which costs the client almost no CPU), the consumers
  that settle a fetched batch (Kafka with both clients, Redis Streams) met it on a quiet
  machine with the store as shipped (one `claim_many` and one `complete_many` per fetched
  batch), and do not without the batch verbs (`one-by-one`: two round trips per message).
  RabbitMQ and NATS do not: their baselines run many handlers at once, the sleeps overlap and
  the client's per-message CPU sets the pace (aio-pika about 130-220 us a message here,
  nats-py 55-75 us), so oncely's own per-message work shows in full. Since the hot-path work
  (issue 12) the adapter layer costs 85-109 us of client CPU a message with the Redis store,
  62-65 us with the memory store (64 in flight, fake broker; 140-185 and 96-107 before), and
  the Redis store's batch verbs alone cost 12-15 us of client CPU per message at 64 items a
  call, about 30 at the 12-17 that RabbitMQ's group commit forms, plus 15-17 us of Redis
  time per item and call, for which a NATS batch waits with nothing else to do. 0.8 allows
  a quarter of the baseline's cost: 35-55 us (RabbitMQ), 15-20 us (NATS).
- With a handler that does nothing, no consumer that records each key can come near a client
  that only iterates over a fetched batch (Kafka and Redis Streams baselines spend a few
  microseconds per message): that table is the worst case, not the target's setting."""


if __name__ == "__main__":
    main()
