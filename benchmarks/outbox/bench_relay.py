"""The outbox relay against a plain producer, and commit-to-publish latency.

Not a test. Two measurements, per broker (the publishers of `oncely.outbox`):

*Throughput.* The same number of outbox rows (written by `oncely.Outbox.add`, untimed) are
drained twice per round, modes alternating: by the `Relay` (``run_once`` until all are
published), and by a plain producer doing the same job by hand on one psycopg connection:
``SELECT ... FOR UPDATE SKIP LOCKED`` a batch of pending rows, publish them through the broker's
driver alone, pipelined and confirmed (the raw modes of ``bench_publish.py``), ``UPDATE`` them
published, commit. The plain producer does not keep each key's commit order across relays, nor
count failures: that is what the relay adds. Rates are medians over rounds, the ratio the median
of the per-round ratios.

*Latency.* ``oncely relay`` runs as its own process (as deployed). This process commits one
event at a time and takes the time from just before its ``COMMIT`` until a consumer subscribed
on the broker receives the message: PostgreSQL with ``LISTEN/NOTIFY``, and SQLite, where the
relay polls (every ``--poll-interval`` seconds), for contrast.

    python benchmarks/outbox/bench_relay.py     # writes benchmarks/results/outbox_relay.md
    python benchmarks/outbox/bench_relay.py --brokers kafka rabbitmq --rounds 3

Servers: the test URLs (``ONCELY_TEST_*``, see scripts/services) or the loopback defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_publish  # the brokers' setup and raw publishing, shared
from bench_publish import BENCHES, Bench

import oncely
from oncely.outbox import OutboxEvent, Publisher, Relay

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "outbox_relay.md"
POSTGRES_URL = os.environ.get("ONCELY_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1/test")
BROKER_URLS = {
    "rabbitmq": bench_publish.RABBITMQ_URL,
    "kafka": f"kafka://{bench_publish.KAFKA_URL}",
    "nats": bench_publish.NATS_URL,
    "redis_streams": bench_publish.REDIS_URL,
}
PAYLOAD = b'{"order": %d, "total": "12.50", "lines": [1, 2, 3]}'
HEADERS = {"Content-Type": "application/json", "Event-Type": "order.created"}

PLAIN_CLAIM = """
SELECT id, message_id, destination, payload, headers, ordering_key
  FROM {schema}.oncely_outbox
 WHERE published_at IS NULL AND dead_at IS NULL
 ORDER BY id
 LIMIT %(limit)s
   FOR UPDATE SKIP LOCKED
"""
PLAIN_MARK = """
UPDATE {schema}.oncely_outbox SET published_at = now() WHERE id = ANY(%(ids)s::bigint[])
"""


# -- databases ------------------------------------------------------------------------------------


@contextlib.contextmanager
def postgres_schema() -> Any:
    """A migrated PostgreSQL schema of the benchmark's own: (store URL, quoted schema)."""
    schema = f"oncely_bench_relay_{uuid.uuid4().hex[:8]}"
    url = f"{POSTGRES_URL}{'&' if '?' in POSTGRES_URL else '?'}schema={schema}"
    with oncely.open_store(url) as store:
        store.migrate()  # type: ignore[attr-defined]
    try:
        yield url, f'"{schema}"'
    finally:
        with psycopg.connect(POSTGRES_URL, autocommit=True) as connection:
            connection.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def fill(outbox: oncely.Outbox, destination: str, count: int, keys: int) -> None:
    """Commit *count* events through `Outbox.add`, 500 to a transaction."""
    with psycopg.connect(POSTGRES_URL) as connection:
        for start in range(0, count, 500):
            with connection.transaction():
                for n in range(start, min(count, start + 500)):
                    outbox.add(
                        connection,
                        destination,
                        PAYLOAD % n,
                        headers=HEADERS,
                        ordering_key=f"customer-{n % keys}" if keys else None,
                    )


def empty(schema: str) -> None:
    with psycopg.connect(POSTGRES_URL, autocommit=True) as connection:
        connection.execute(f"TRUNCATE {schema}.oncely_outbox, {schema}.oncely_outbox_keys")


# -- throughput -----------------------------------------------------------------------------------


class Confirmed:
    """A publisher whose broker confirms everything at once."""

    async def publish(self, events: Sequence[OutboxEvent]) -> list[None]:
        return [None] * len(events)

    async def aclose(self) -> None: ...


class NoBroker(Bench):
    """No broker: what is left is each mode's work in the database (and in Python)."""

    name = "none"

    def publisher(self) -> Publisher:
        return Confirmed()

    async def raw(self, batch: bench_publish.Batch) -> None: ...


async def drain_relay(relay: Relay, count: int) -> None:
    published = 0
    while published < count:
        done = await relay.run_once()
        assert done, "the relay stopped publishing"
        published += done


async def drain_plain(
    connection: psycopg.AsyncConnection[Any], schema: str, target: Bench, count: int, batch: int
) -> None:
    claim, mark = PLAIN_CLAIM.format(schema=schema), PLAIN_MARK.format(schema=schema)
    published = 0
    while published < count:
        async with connection.transaction():
            rows = await (await connection.execute(claim, {"limit": batch})).fetchall()
            assert rows, "the plain producer found nothing to publish"
            events = [
                OutboxEvent(id=r[0], message_id=r[1], destination=r[2], payload=r[3],
                            headers=r[4], ordering_key=r[5])
                for r in rows
            ]  # fmt: skip
            await target.raw(events)
            await connection.execute(mark, {"ids": [r[0] for r in rows]})
        published += len(rows)


async def throughput(kind: type[Bench], args: argparse.Namespace) -> tuple[float, float, float]:
    """Median rates of the plain producer and the relay, and the median per-round ratio."""
    target = kind(f"oncely-bench-relay-{uuid.uuid4().hex[:8]}")
    await target.setup()
    with postgres_schema() as (url, schema):
        store = oncely.open_store(url)
        outbox = oncely.Outbox(store, notify=False)
        relay = Relay(store, target.publisher(), batch_size=args.batch, listen=False)
        connection = await psycopg.AsyncConnection.connect(POSTGRES_URL)
        rates: dict[str, list[float]] = {"relay": [], "plain": []}
        drains: dict[str, Callable[[int], Awaitable[None]]] = {
            "relay": lambda count: drain_relay(relay, count),
            "plain": lambda count: drain_plain(connection, schema, target, count, args.batch),
        }
        try:
            for drain in drains.values():  # warm: connections open, destinations proven
                fill(outbox, target.destination, args.batch, args.keys)
                await drain(args.batch)
            for number in range(args.rounds):
                modes = ["relay", "plain"] if number % 2 == 0 else ["plain", "relay"]
                for mode in modes:
                    empty(schema)
                    fill(outbox, target.destination, args.events, args.keys)
                    started = time.perf_counter()
                    await drains[mode](args.events)
                    rates[mode].append(args.events / (time.perf_counter() - started))
                print(
                    f"{kind.name} round {number + 1}: relay {rates['relay'][-1]:,.0f}/s, "
                    f"plain {rates['plain'][-1]:,.0f}/s",
                    file=sys.stderr,
                )
        finally:
            await connection.close()
            await relay.aclose()
            store.close()
            await target.teardown()
    ratio = statistics.median(r / p for r, p in zip(rates["relay"], rates["plain"], strict=True))
    return statistics.median(rates["plain"]), statistics.median(rates["relay"]), ratio


# -- latency --------------------------------------------------------------------------------------

Received = dict[str, float]  # message id -> perf_counter when the consumer got it


@contextlib.asynccontextmanager
async def consumer(
    target: Bench, received: Received, arrived: asyncio.Event
) -> AsyncIterator[None]:
    """A subscriber on *target*'s destination, noting when each message id arrives."""

    def note(message_id: str | bytes | None) -> None:
        if isinstance(message_id, bytes):
            message_id = message_id.decode()
        if message_id is not None:
            received[message_id] = time.perf_counter()
            arrived.set()

    closers: list[Callable[[], Awaitable[Any]]] = []
    task: asyncio.Task[None] | None = None
    if target.name == "rabbitmq":
        queue = target.queue  # type: ignore[attr-defined]
        tag = await queue.consume(lambda m: _ack(m, note), no_ack=False)
        closers.append(lambda: queue.cancel(tag))
    elif target.name == "kafka":
        import aiokafka

        kafka = aiokafka.AIOKafkaConsumer(
            target.destination,
            bootstrap_servers=bench_publish.KAFKA_URL,
            auto_offset_reset="earliest",
            fetch_max_wait_ms=5,
        )
        await kafka.start()
        closers.append(kafka.stop)

        async def read_kafka() -> None:
            async for record in kafka:
                note(dict(record.headers).get("Idempotency-Key"))

        task = asyncio.create_task(read_kafka())
    elif target.name == "nats":
        js = target.js  # type: ignore[attr-defined]
        subscription = await js.subscribe(
            target.destination, cb=lambda m: _nats(m, note), manual_ack=False
        )
        closers.append(subscription.unsubscribe)
    else:
        import redis.asyncio

        client = redis.asyncio.Redis.from_url(bench_publish.REDIS_URL)
        closers.append(client.aclose)

        async def read_redis() -> None:
            last = "0-0"
            while True:
                reply = await client.xread({target.destination: last}, block=1000)
                for _, entries in reply:
                    for entry_id, fields in entries:
                        last = entry_id
                        note(fields.get(b"Idempotency-Key"))

        task = asyncio.create_task(read_redis())
    try:
        yield
    finally:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for close in closers:
            with contextlib.suppress(Exception):
                await close()


async def _ack(message: Any, note: Callable[[str | None], None]) -> None:
    note(message.headers.get("Idempotency-Key"))
    await message.ack()


async def _nats(message: Any, note: Callable[[str | None], None]) -> None:
    note((message.headers or {}).get("Idempotency-Key"))


@contextlib.contextmanager
def relay_process(store_url: str, broker_url: str, poll_interval: float) -> Any:
    """``oncely relay`` in a process of its own; its log in a temporary file."""
    oncely_command = str(Path(sys.executable).with_name("oncely"))
    command = [oncely_command, "relay", "--store", store_url, "--to", broker_url]
    command += ["--poll-interval", str(poll_interval)]
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            yield process
        finally:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            if process.returncode not in (0, -15):
                log.seek(0)
                print(f"the relay exited {process.returncode}:\n{log.read()}", file=sys.stderr)


class Writer:
    """Commits one event per transaction to PostgreSQL or SQLite."""

    def __init__(self, store_url: str, path: str | None) -> None:
        self.store = oncely.open_store(store_url)
        self.outbox = oncely.Outbox(self.store)
        self.path = path
        self.connection: Any = None

    async def open(self) -> None:
        if self.path is None:
            self.connection = await psycopg.AsyncConnection.connect(POSTGRES_URL, autocommit=True)
        else:
            import sqlite3

            self.connection = sqlite3.connect(self.path, isolation_level=None, timeout=30)

    async def commit_one(self, destination: str, n: int) -> tuple[str, float]:
        """Add one event and commit; return its message id and the time just before COMMIT."""
        if self.path is None:
            await self.connection.execute("BEGIN")
            message_id = await self.outbox.aadd(
                self.connection, destination, PAYLOAD % n, headers=HEADERS
            )
            started = time.perf_counter()
            await self.connection.execute("COMMIT")
        else:
            self.connection.execute("BEGIN IMMEDIATE")
            message_id = self.outbox.add(self.connection, destination, PAYLOAD % n, headers=HEADERS)
            started = time.perf_counter()
            self.connection.execute("COMMIT")
        return message_id, started

    async def close(self) -> None:
        if self.path is None:
            await self.connection.close()
        else:
            self.connection.close()
        self.store.close()


async def latency(kind: type[Bench], database: str, args: argparse.Namespace) -> list[float]:
    """Milliseconds from just before COMMIT until the consumer received the event."""
    target = kind(f"oncely-bench-latency-{uuid.uuid4().hex[:8]}")
    await target.setup()
    received: Received = {}
    arrived = asyncio.Event()
    samples: list[float] = []
    count = args.latency_events if database == "postgres" else args.polled_events
    # Events a few ms apart; polled, at a random point of the relay's poll interval.
    gap = (0.005, 0.02) if database == "postgres" else (0.0, args.poll_interval)
    with contextlib.ExitStack() as stack:
        if database == "postgres":
            store_url, _ = stack.enter_context(postgres_schema())
            path = None
        else:
            path = str(Path(stack.enter_context(tempfile.TemporaryDirectory())) / "app.db")
            store_url = f"sqlite:///{path}"
            oncely.open_store(store_url).close()  # creates the tables
        writer = Writer(store_url, path)
        await writer.open()
        try:
            async with consumer(target, received, arrived):
                stack.enter_context(
                    relay_process(store_url, BROKER_URLS[kind.name], args.poll_interval)
                )
                for n in range(-args.latency_warmup, count):
                    message_id, started = await writer.commit_one(target.destination, n)
                    while message_id not in received:
                        arrived.clear()
                        await asyncio.wait_for(arrived.wait(), 30)
                    if n >= 0:
                        samples.append((received[message_id] - started) * 1000)
                    await asyncio.sleep(random.uniform(*gap))
        finally:
            await writer.close()
            await target.teardown()
    print(
        f"{kind.name} {database}: p50 {statistics.median(samples):.1f} ms, "
        f"p99 {percentile(samples, 99):.1f} ms",
        file=sys.stderr,
    )
    return samples


def percentile(samples: list[float], pct: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(pct / 100 * (len(ordered) - 1)))]


# -- report ---------------------------------------------------------------------------------------


def report(
    args: argparse.Namespace,
    load: tuple[float, ...],
    rates: list[str],
    latencies: list[str],
    loads: dict[str, str],
) -> str:
    with psycopg.connect(POSTGRES_URL) as connection:
        server = connection.execute("SHOW server_version").fetchone()
    database = f"- PostgreSQL {server[0] if server else '?'}, psycopg {version('psycopg')}"
    return "\n".join(
        [
            *bench_publish.header("Outbox relay benchmark", "bench_relay.py", load, database),
            "## Relay throughput",
            "",
            f"{args.events} outbox rows per mode and round, written by `Outbox.add` before the "
            f"clock starts, ordering keys over {args.keys} customers, a 50-byte JSON payload "
            f"and two headers; batches of {args.batch}. *relay*: `Relay.run_once` until every "
            "row is published (claim the batch in each key's commit order, publish through "
            "the `oncely.outbox` publisher, record the outcomes, commit). *plain*: the same "
            "job by hand on one psycopg connection: `SELECT … ORDER BY id LIMIT n FOR UPDATE "
            "SKIP LOCKED` the pending rows, publish them through the broker's driver alone, "
            "pipelined and confirmed (as in `bench_publish.py`), `UPDATE` them published, "
            "commit. Each figure is the median of "
            f"{args.rounds} rounds, modes alternating in order; the ratio is the median of the "
            "per-round ratios. The target: at least 0.8 of the plain producer on every broker. "
            "*none*: no broker (a publisher that confirms at once, and nothing for the plain "
            "producer), so each mode's own work in the database and in Python.",
            "",
            f"Load average (1 min) {loads['throughput']}, on 2 cores shared with other work.",
            "",
            "| broker | plain events/s | relay events/s | relay / plain |",
            "|---|---:|---:|---:|",
            *rates,
            "",
            "## Commit-to-publish latency",
            "",
            "`oncely relay --store … --to …` runs in a process of its own. The benchmark "
            "commits one event per transaction (5 to 20 ms apart with NOTIFY, at a random point "
            "of the poll interval on SQLite) and measures from "
            "just before `COMMIT` until a consumer subscribed on the broker receives the "
            "message (a RabbitMQ queue consumer, an aiokafka consumer with "
            "`fetch_max_wait_ms=5`, a JetStream push subscription, `XREAD BLOCK`): so the "
            "figures include the broker's delivery to a consumer, not only its confirmation to "
            f"the relay. PostgreSQL: {args.latency_events} events, the relay woken by the "
            f"outbox's `NOTIFY`. SQLite: {args.polled_events} events, the relay polling every "
            f"{args.poll_interval:g} s (SQLite has no notifications). After "
            f"{args.latency_warmup} warm-up events. The issue's target: p50 under 10 ms "
            "on loopback, with NOTIFY.",
            "",
            f"Load average (1 min) {loads['latency']}, on 2 cores shared with other work: "
            "each step from the commit to the consumer wakes another process (PostgreSQL, the "
            "relay, the broker, the consumer), and on busy cores each waits for its turn.",
            "",
            "| database | relay wakes on | broker | p50 | p90 | p99 |",
            "|---|---|---|---:|---:|---:|",
            *latencies,
            "",
        ]
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = [b.name for b in BENCHES]
    parser.add_argument("--events", type=int, default=4000, help="rows per mode and round")
    parser.add_argument("--batch", type=int, default=100, help="the relay's batch_size")
    parser.add_argument("--keys", type=int, default=32, help="ordering keys (0: none)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--brokers", nargs="*", default=[*names, "none"], help="throughput")
    parser.add_argument("--latency-brokers", nargs="*", default=names)
    parser.add_argument("--latency-events", type=int, default=300, help="with NOTIFY")
    parser.add_argument("--polled-events", type=int, default=40, help="on SQLite")
    parser.add_argument("--polled-broker", default="redis_streams", choices=names)
    parser.add_argument("--latency-warmup", type=int, default=5)
    parser.add_argument("--poll-interval", type=float, default=1.0, help="the relay's default")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    load = os.getloadavg()
    benches = {b.name: b for b in (*BENCHES, NoBroker)}
    loads: dict[str, str] = {}
    rates = []
    started = os.getloadavg()[0]
    for name in args.brokers:
        plain, relay, ratio = await throughput(benches[name], args)
        rates.append(f"| {name} | {plain:,.0f} | {relay:,.0f} | {ratio:.2f} |")
    loads["throughput"] = f"{started:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    started = os.getloadavg()[0]
    latencies = []
    runs = [("postgres", name) for name in args.latency_brokers]
    runs += [("sqlite", args.polled_broker)] if args.polled_events else []
    for database, name in runs:
        samples = await latency(benches[name], database, args)
        wake = "NOTIFY" if database == "postgres" else f"polling every {args.poll_interval:g} s"
        title = "PostgreSQL" if database == "postgres" else "SQLite"
        latencies.append(
            f"| {title} | {wake} | {name} | {statistics.median(samples):.1f} ms | "
            f"{percentile(samples, 90):.1f} ms | {percentile(samples, 99):.1f} ms |"
        )
    loads["latency"] = f"{started:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    args.output.write_text(report(args, load, rates, latencies, loads))
    print(args.output.read_text())


if __name__ == "__main__":
    asyncio.run(main())
