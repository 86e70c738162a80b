"""RabbitMQ (aio-pika) against the real broker: the effect is a PostgreSQL row, counted."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aio_pika
import pytest
from aio_pika.abc import (
    AbstractChannel,
    AbstractIncomingMessage,
    AbstractQueue,
)

from oncely import Status
from oncely.consumers import Reason
from oncely.consumers.producer import amqp_message
from oncely.consumers.rabbitmq import IdempotentHandler, dead_letter_arguments, idempotent_handler
from oncely.stores.redis import RedisStore
from tests._proxy import Proxy
from tests.conftest import service_url
from tests.consumers._effects import FAST, Ledger, Worker

pytestmark = pytest.mark.rabbitmq


async def until(check: Callable[[], Any], *, timeout: float = 30.0) -> Any:
    """Poll *check* (bounded) on the event loop until it is truthy."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not (value := check()):
        if loop.time() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(0.02)
    return value


@asynccontextmanager
async def broker(
    name: str,
) -> AsyncIterator[tuple[aio_pika.abc.AbstractRobustConnection, AbstractQueue]]:
    """A connection, the test's queue (dead-lettering to ``<name>.dead``), deleted afterwards."""
    connection = await aio_pika.connect_robust(service_url("ONCELY_TEST_RABBITMQ_URL"))
    async with connection:
        channel = await connection.channel()
        dead = await channel.declare_queue(f"{name}.dead")
        queue = await channel.declare_queue(name, arguments=dead_letter_arguments(f"{name}.dead"))
        try:
            yield connection, dead
        finally:
            await queue.delete(if_unused=False, if_empty=False)
            await dead.delete(if_unused=False, if_empty=False)


async def publish(channel: AbstractChannel, queue: str, key: str, body: Any = None) -> None:
    payload = json.dumps(body if body is not None else {"key": key}).encode()
    await channel.default_exchange.publish(amqp_message(payload, key), routing_key=queue)


async def consume(
    connection: aio_pika.abc.AbstractConnection, queue: str, handler: IdempotentHandler
) -> AbstractChannel:
    channel = await connection.channel()
    await channel.set_qos(prefetch_count=8)
    await (await channel.get_queue(queue)).consume(handler)
    return channel


def settled(handlers: list[IdempotentHandler]) -> int:
    return sum(h.stats[Reason.PROCESSED] + h.stats[Reason.DUPLICATE] for h in handlers)


def test_many_copies_to_several_consumers_take_effect_once(
    store: RedisStore, ledger: Ledger, name: str
) -> None:
    """60 deliveries of 15 keys to 3 concurrent consumers: 15 effects, 45 acked duplicates."""
    keys = [f"order-{i}" for i in range(15)]
    copies = keys * 4
    random.Random(7).shuffle(copies)

    async def main() -> list[IdempotentHandler]:
        async with broker(name) as (connection, _):
            handlers = []
            for worker in range(3):

                @idempotent_handler(store, group=name, policy=FAST)
                async def handle(message: AbstractIncomingMessage, worker: int = worker) -> None:
                    await ledger.awrite(str(message.headers["Idempotency-Key"]), str(worker))
                    await asyncio.sleep(0.01)  # some work, so that copies overlap

                handlers.append(handle)
                await consume(connection, name, handle)
            channel = await connection.channel()
            for key in copies:
                await publish(channel, name, key)
            await until(lambda: settled(handlers) == len(copies))
            return handlers

    handlers = asyncio.run(main())
    assert ledger.counts() == {key: 1 for key in keys}
    assert sum(h.stats[Reason.PROCESSED] for h in handlers) == 15
    assert sum(h.stats[Reason.DUPLICATE] for h in handlers) == 45
    assert sum(h.stats[Reason.PROCESSED] > 0 for h in handlers) >= 2  # really shared


def test_consumer_killed_mid_handler_is_redelivered_and_applied_once(
    store: RedisStore, ledger: Ledger, name: str
) -> None:
    """SIGKILL before the write commits: RabbitMQ redelivers, the lease is recovered, one row."""

    async def main() -> IdempotentHandler:
        async with broker(name) as (connection, _):
            await publish(await connection.channel(), name, "order-1")
            worker = Worker(
                "rabbitmq",
                {"queue": name, "group": name, "namespace": name, "table": ledger.table},
            )
            try:
                assert await asyncio.to_thread(worker.wait_ready) == "order-1"
            finally:
                worker.kill()

            @idempotent_handler(store, group=name, policy=FAST)
            async def handle(message: AbstractIncomingMessage) -> None:
                await ledger.awrite(str(message.headers["Idempotency-Key"]), "survivor")

            await consume(connection, name, handle)
            await until(lambda: handle.stats[Reason.PROCESSED] == 1)
            return handle

    handle = asyncio.run(main())
    assert ledger.rows() == [("order-1", "survivor")]
    assert handle.stats[Reason.IN_PROGRESS] >= 1  # redelivered at once, waited for the lease
    record = store.get(handle.consumer.key_for(_delivery("order-1")))
    assert record is not None
    assert record.status is Status.COMPLETED
    assert record.attempt == 2  # the killed start counted


def _delivery(key: str) -> Any:
    from oncely.consumers import Delivery

    return Delivery(b"", {"Idempotency-Key": key})


def test_handler_that_raises_is_redelivered_then_dead_lettered(
    store: RedisStore, ledger: Ledger, name: str
) -> None:
    """A failing handler runs max_attempts times, then the message lands in the DLX queue."""
    calls: list[str] = []

    async def main() -> tuple[IdempotentHandler, AbstractIncomingMessage]:
        async with broker(name) as (connection, dead):

            @idempotent_handler(store, group=name, policy=FAST)
            async def handle(message: AbstractIncomingMessage) -> None:
                calls.append(str(message.headers["Idempotency-Key"]))
                raise RuntimeError("the payment provider is down")

            await consume(connection, name, handle)
            await publish(await connection.channel(), name, "order-1")
            lost = await until_message(dead)
            await lost.ack()
            return handle, lost

    handle, lost = asyncio.run(main())
    assert calls == ["order-1"] * FAST.max_attempts
    assert handle.stats[Reason.HANDLER_FAILED] == FAST.max_attempts - 1
    assert handle.stats[Reason.EXHAUSTED] == 1
    assert lost.headers["Idempotency-Key"] == "order-1"
    assert ledger.counts() == {}


async def until_message(queue: AbstractQueue, timeout: float = 30.0) -> AbstractIncomingMessage:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while (message := await queue.get(fail=False, no_ack=False)) is None:
        if loop.time() > deadline:
            raise AssertionError(f"nothing arrived on {queue.name} within {timeout}s")
        await asyncio.sleep(0.05)
    return message


def _redis_port(url: str) -> int:
    from urllib.parse import urlsplit

    return urlsplit(url).port or 6379


def test_store_down_at_claim_nothing_is_acked_until_it_returns(
    redis_url: str, store: RedisStore, ledger: Ledger, name: str
) -> None:
    """The store unreachable: the handler does not run and the message is not acked."""
    with Proxy(_redis_port(redis_url)) as proxy:
        flaky = RedisStore(
            f"redis://127.0.0.1:{proxy.port}/0",
            namespace=name,
            retries=0,
            socket_timeout=1,
            socket_connect_timeout=1,
        )
        proxy.down()

        async def main() -> IdempotentHandler:
            async with broker(name) as (connection, _):

                @idempotent_handler(flaky, group=name, policy=FAST)
                async def handle(message: AbstractIncomingMessage) -> None:
                    await ledger.awrite(str(message.headers["Idempotency-Key"]))

                await consume(connection, name, handle)
                await publish(await connection.channel(), name, "order-1")
                await until(lambda: handle.stats[Reason.STORE_UNAVAILABLE] >= 3)
                assert handle.stats[Reason.PROCESSED] == 0
                assert ledger.counts() == {}
                proxy.up()
                await until(lambda: handle.stats[Reason.PROCESSED] == 1)
                return handle

        try:
            asyncio.run(main())
        finally:
            flaky.close()
    assert ledger.counts() == {"order-1": 1}


def test_store_down_at_completion_the_message_is_not_acked(
    redis_url: str,
    store: RedisStore,
    ledger: Ledger,
    name: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The store vanishes after the handler's write: no ack until a record is completed.

    The effect is applied twice here: the kill-or-outage window between the write and the
    completion is closed only by recording the key in the write's own transaction (the
    transactional inbox). This test pins exactly that documented behaviour.
    """
    monkeypatch.setattr("oncely._execution.flows.SETTLE_RETRY_DELAYS", (0.05,))
    with Proxy(_redis_port(redis_url)) as proxy:
        flaky = RedisStore(
            f"redis://127.0.0.1:{proxy.port}/0",
            namespace=name,
            retries=0,
            socket_timeout=1,
            socket_connect_timeout=1,
        )

        async def main() -> IdempotentHandler:
            async with broker(name) as (connection, _):

                @idempotent_handler(flaky, group=name, policy=FAST)
                async def handle(message: AbstractIncomingMessage) -> None:
                    await ledger.awrite(str(message.headers["Idempotency-Key"]))
                    if handle.stats[Reason.STORE_UNAVAILABLE] == 0:
                        proxy.down()  # the store goes away before the completion

                await consume(connection, name, handle)
                await publish(await connection.channel(), name, "order-1")
                await until(lambda: handle.stats[Reason.STORE_UNAVAILABLE] >= 1)
                assert handle.stats[Reason.PROCESSED] == 0  # not acked
                proxy.up()
                await until(lambda: handle.stats[Reason.PROCESSED] == 1)
                return handle

        try:
            handle = asyncio.run(main())
        finally:
            flaky.close()
    record = store.get(handle.consumer.key_for(_delivery("order-1")))
    assert record is not None
    assert record.status is Status.COMPLETED
    assert ledger.counts() == {"order-1": 2}  # see the docstring: the inbox closes this
