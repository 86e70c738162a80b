"""A consumer process that the tests SIGKILL mid-handler, before its write commits.

Run as ``python -m tests.consumers._worker BROKER CONFIG_JSON``. The handler opens a PostgreSQL
transaction, inserts its effect, prints ``READY <key>`` and then blocks: the test kills the
process there, so the insert is rolled back and the record is left in progress with a lease
that nobody extends.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import psycopg

import oncely
from tests.consumers._effects import FAST, Ledger, env


def _ready(key: str) -> None:
    print(f"READY {key}", flush=True)


async def _doomed_write(ledger: Ledger, key: str) -> None:
    async with await psycopg.AsyncConnection.connect(ledger.url) as conn, conn.transaction():
        await conn.execute(ledger.insert_statement(), (key, "doomed"))
        _ready(key)
        await asyncio.Event().wait()  # killed here, the transaction open


def _doomed_write_sync(ledger: Ledger, key: str) -> None:
    import threading

    with psycopg.connect(ledger.url) as conn, conn.transaction():
        conn.execute(ledger.insert_statement(), (key, "doomed"))
        _ready(key)
        threading.Event().wait()


def _effect_sync(config: dict[str, Any], ledger: Ledger, key: str) -> None:
    """The doomed write for the key ``config["doomed"]`` (every key without one); a write that
    commits for the others, so that a batch's earlier messages take effect before the kill."""
    if config.get("doomed", key) == key:
        _doomed_write_sync(ledger, key)
    else:
        ledger.write(key, "first")


async def rabbitmq(config: dict[str, Any], store: Any, ledger: Ledger) -> None:
    import aio_pika

    from oncely.consumers.rabbitmq import idempotent_handler

    connection = await aio_pika.connect(env("ONCELY_TEST_RABBITMQ_URL"))
    channel = await connection.channel()
    await channel.set_qos(prefetch_count=1)
    queue = await channel.get_queue(config["queue"])

    @idempotent_handler(store, group=config["group"], policy=FAST)
    async def handle(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        await _doomed_write(ledger, str(message.headers["Idempotency-Key"]))

    await queue.consume(handle)
    await asyncio.Event().wait()


def redis_streams(config: dict[str, Any], store: Any, ledger: Ledger) -> None:
    import threading

    import redis

    from oncely.consumers.redis_streams import RedisStreamConsumer, StreamEntry

    client = redis.Redis.from_url(env("ONCELY_TEST_REDIS_URL"))

    def handle(entry: StreamEntry) -> None:
        _effect_sync(config, ledger, entry.fields[b"Idempotency-Key"].decode())

    consumer = RedisStreamConsumer(
        client, config["stream"], config["group"], handle, store=store, policy=FAST, block=0.1
    )
    consumer.run(threading.Event())


async def nats(config: dict[str, Any], store: Any, ledger: Ledger) -> None:
    import nats as nats_py

    from oncely.consumers.nats import idempotent_handler

    client = await nats_py.connect(env("ONCELY_TEST_NATS_URL"))
    js = client.jetstream()
    sub = await js.pull_subscribe(config["subject"], durable="billing", stream=config["stream"])

    @idempotent_handler(store, group=config["group"], policy=FAST, progress_interval=0.2)
    async def handle(msg: Any) -> None:
        await _doomed_write(ledger, msg.headers["Idempotency-Key"])

    while True:
        try:
            messages = await sub.fetch(1, timeout=1)
        except (nats_py.errors.TimeoutError, asyncio.TimeoutError):
            continue
        for msg in messages:
            await handle(msg)


def kafka(config: dict[str, Any], store: Any, ledger: Ledger) -> None:
    import threading

    from oncely.consumers.kafka import IdempotentKafkaConsumer

    def handle(message: Any) -> None:
        _effect_sync(config, ledger, dict(message.headers())["Idempotency-Key"].decode())

    consumer = IdempotentKafkaConsumer(
        {
            "bootstrap.servers": env("ONCELY_TEST_KAFKA_BOOTSTRAP"),
            "group.id": config["group"],
            "auto.offset.reset": "earliest",
            "session.timeout.ms": 2000,
            "heartbeat.interval.ms": 400,
        },
        [config["topic"]],
        handle,
        store=store,
        policy=FAST,
    )
    consumer.run(threading.Event())


def celery(config: dict[str, Any], store: Any, ledger: Ledger) -> None:
    from tests.consumers.test_celery import make_app

    app = make_app(config["queue"])

    @app.task(name="orders.charge", bind=True, **options(store))
    def charge(self: Any, order: str) -> None:
        _doomed_write_sync(ledger, order)

    app.worker_main(
        ["worker", "-P", "solo", "--loglevel=WARNING", "--without-mingle", "--without-gossip"]
    )


def options(store: Any) -> dict[str, Any]:
    from oncely.consumers.celery import IdempotentTask

    return {"base": IdempotentTask, "oncely_store": store, "oncely_policy": FAST, "shared": False}


def main() -> None:
    broker, raw = sys.argv[1], sys.argv[2]
    config = json.loads(raw)
    store = oncely.open_store(env("ONCELY_TEST_REDIS_URL"), namespace=config["namespace"])
    ledger = Ledger(env("ONCELY_TEST_POSTGRES_URL"), table=config["table"])
    target = globals()[broker]
    if asyncio.iscoroutinefunction(target):
        asyncio.run(target(config, store, ledger))
    else:
        target(config, store, ledger)


if __name__ == "__main__":
    main()
