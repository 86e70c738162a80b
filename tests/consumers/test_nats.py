"""NATS JetStream (nats-py) against the real server; effects are PostgreSQL rows."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig

from oncely import Status
from oncely.consumers import Delivery, Reason
from oncely.consumers.nats import IdempotentHandler, idempotent_handler
from oncely.consumers.producer import nats_headers, stamp
from oncely.stores.memory import MemoryStore
from oncely.stores.redis import RedisStore
from tests.conftest import service_url
from tests.consumers._effects import FAST, Ledger, Worker

pytestmark = pytest.mark.nats


@asynccontextmanager
async def jetstream(name: str) -> AsyncIterator[tuple[Client, JetStreamContext]]:
    """A connection and the test's own stream (subjects ``<name>.>``), deleted afterwards."""
    client = await nats.connect(service_url("ONCELY_TEST_NATS_URL"))
    try:
        js = client.jetstream()
        await js.add_stream(name=name, subjects=[f"{name}.>"])
        try:
            yield client, js
        finally:
            await js.delete_stream(name)
    finally:
        await client.close()


async def until(check: Callable[[], Any], *, timeout: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        if loop.time() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(0.02)


async def pull_loop(
    js: JetStreamContext, name: str, handler: IdempotentHandler, stop: asyncio.Event, **config: Any
) -> None:
    """One member of the durable pull consumer ``billing``, feeding *handler*."""
    sub = await js.pull_subscribe(
        f"{name}.orders", durable="billing", stream=name, config=ConsumerConfig(**config)
    )
    while not stop.is_set():
        try:
            messages = await sub.fetch(8, timeout=0.2)
        except (nats.errors.TimeoutError, asyncio.TimeoutError):
            continue
        for msg in messages:
            await handler(msg)


async def publish(js: JetStreamContext, name: str, key: str, headers: dict[str, str]) -> None:
    await js.publish(f"{name}.orders", json.dumps({"order": key}).encode(), headers=headers)


def settled(handlers: list[IdempotentHandler]) -> int:
    return sum(h.stats[Reason.PROCESSED] + h.stats[Reason.DUPLICATE] for h in handlers)


def test_many_copies_to_several_consumers_take_effect_once(
    store: RedisStore, ledger: Ledger, name: str
) -> None:
    """60 published copies (no Nats-Msg-Id, so JetStream keeps them all), 3 members: 15 effects."""
    keys = [f"order-{i}" for i in range(15)]
    copies = keys * 4
    random.Random(5).shuffle(copies)

    async def main() -> list[IdempotentHandler]:
        async with jetstream(name) as (_, js):
            handlers = []
            for worker in range(3):

                @idempotent_handler(store, group=name, policy=FAST)
                async def handle(msg: Msg, worker: int = worker) -> None:
                    await ledger.awrite(msg.headers["Idempotency-Key"], str(worker))
                    await asyncio.sleep(0.01)

                handlers.append(handle)
            stop = asyncio.Event()
            loops = [asyncio.create_task(pull_loop(js, name, h, stop)) for h in handlers]
            for key in copies:
                await publish(js, name, key, stamp(key))
            await until(lambda: settled(handlers) == len(copies))
            stop.set()
            await asyncio.gather(*loops)
            return handlers

    handlers = asyncio.run(main())
    assert ledger.counts() == {key: 1 for key in keys}
    assert sum(h.stats[Reason.DUPLICATE] for h in handlers) == 45


def test_publish_dedupe_and_consumer_dedupe_together(
    store: RedisStore, ledger: Ledger, name: str
) -> None:
    """nats_headers sets Nats-Msg-Id too: JetStream drops re-publishes inside its window."""

    async def main() -> IdempotentHandler:
        async with jetstream(name) as (_, js):

            @idempotent_handler(store, group=name, policy=FAST)
            async def handle(msg: Msg) -> None:
                await ledger.awrite(msg.headers["Idempotency-Key"])

            for _ in range(3):
                await publish(js, name, "order-1", nats_headers("order-1"))
            info = await js.stream_info(name)
            assert info.state.messages == 1
            stop = asyncio.Event()
            loop = asyncio.create_task(pull_loop(js, name, handle, stop))
            await until(lambda: handle.stats[Reason.PROCESSED] == 1)
            stop.set()
            await loop
            return handle

    asyncio.run(main())
    assert ledger.counts() == {"order-1": 1}


def test_consumer_killed_mid_handler_is_redelivered_and_applied_once(
    store: RedisStore, ledger: Ledger, name: str
) -> None:
    """SIGKILL before the write commits: redelivered after ack_wait, the lease recovers."""

    async def main() -> IdempotentHandler:
        async with jetstream(name) as (_, js):
            await js.add_consumer(name, ConsumerConfig(durable_name="billing", ack_wait=1))
            await publish(js, name, "order-1", stamp("order-1"))
            worker = Worker(
                "nats",
                {
                    "stream": name,
                    "subject": f"{name}.orders",
                    "group": name,
                    "namespace": name,
                    "table": ledger.table,
                },
            )
            try:
                assert await asyncio.to_thread(worker.wait_ready) == "order-1"
            finally:
                worker.kill()

            @idempotent_handler(store, group=name, policy=FAST)
            async def handle(msg: Msg) -> None:
                await ledger.awrite(msg.headers["Idempotency-Key"], "survivor")

            stop = asyncio.Event()
            loop = asyncio.create_task(pull_loop(js, name, handle, stop))
            await until(lambda: handle.stats[Reason.PROCESSED] == 1)
            stop.set()
            await loop
            return handle

    handle = asyncio.run(main())
    assert ledger.rows() == [("order-1", "survivor")]
    record = store.get(handle.consumer.key_for(Delivery(b"", {"Idempotency-Key": "order-1"})))
    assert record is not None
    assert record.status is Status.COMPLETED
    assert record.attempt == 2


def test_handler_that_raises_is_redelivered_then_dead_lettered(
    store: RedisStore, ledger: Ledger, name: str
) -> None:
    """A failing handler is nak'ed, runs max_attempts times, then is copied out and termed."""
    calls: list[str] = []

    async def main() -> tuple[IdempotentHandler, Any]:
        async with jetstream(name) as (_, js):

            @idempotent_handler(
                store, group=name, policy=FAST, dead_letter_subject=f"{name}.dead", jetstream=js
            )
            async def handle(msg: Msg) -> None:
                calls.append(msg.headers["Idempotency-Key"])
                raise RuntimeError("the payment provider is down")

            stop = asyncio.Event()
            loop = asyncio.create_task(pull_loop(js, name, handle, stop))
            await publish(js, name, "order-1", stamp("order-1"))
            await until(lambda: handle.stats[Reason.EXHAUSTED] == 1)
            stop.set()
            await loop
            return handle, await js.get_last_msg(name, f"{name}.dead")

    _, dead = asyncio.run(main())
    assert calls == ["order-1"] * FAST.max_attempts
    assert dead.headers["Idempotency-Key"] == "order-1"
    assert dead.headers["Oncely-Dead-Letter-Reason"] == "exhausted"
    assert dead.headers["Oncely-Source-Subject"] == f"{name}.orders"
    assert ledger.counts() == {}


def test_last_delivery_before_max_deliver_is_dead_lettered(
    store: RedisStore, ledger: Ledger, name: str
) -> None:
    """JetStream's max_deliver=2 comes before max_attempts: delivery 2 is dead-lettered."""

    async def main() -> tuple[IdempotentHandler, Any]:
        async with jetstream(name) as (_, js):

            @idempotent_handler(
                store,
                group=name,
                policy=FAST,
                max_deliver=2,
                dead_letter_subject=f"{name}.dead",
                jetstream=js,
            )
            async def handle(msg: Msg) -> None:
                raise RuntimeError("still down")

            stop = asyncio.Event()
            loop = asyncio.create_task(pull_loop(js, name, handle, stop, max_deliver=2))
            await publish(js, name, "order-1", stamp("order-1"))
            await until(lambda: handle.stats[Reason.HANDLER_FAILED] == 2)
            dead = None
            while dead is None:
                try:
                    dead = await js.get_last_msg(name, f"{name}.dead")
                except nats.js.errors.NotFoundError:
                    await asyncio.sleep(0.02)
            stop.set()
            await loop
            return handle, dead

    handle, dead = asyncio.run(main())
    assert dead.headers["Oncely-Dead-Letter-Reason"] == "handler_failed"
    assert handle.stats[Reason.EXHAUSTED] == 0


def test_in_progress_heartbeats_hold_a_slow_message(
    store: RedisStore, ledger: Ledger, name: str
) -> None:
    """A handler slower than ack_wait keeps its message: no redelivery while it runs."""

    async def main() -> tuple[IdempotentHandler, list[int]]:
        async with jetstream(name) as (_, js):
            deliveries: list[int] = []

            @idempotent_handler(store, group=name, policy=FAST, progress_interval=0.2)
            async def handle(msg: Msg) -> None:
                deliveries.append(msg.metadata.num_delivered)
                await asyncio.sleep(1.4)  # the work: longer than ack_wait=1
                await ledger.awrite(msg.headers["Idempotency-Key"])

            other = idempotent_handler(store, group=name, policy=FAST)(handle.__wrapped__)
            stop = asyncio.Event()
            loops = [
                asyncio.create_task(pull_loop(js, name, h, stop, ack_wait=1))
                for h in (handle, other)
            ]
            await publish(js, name, "order-1", stamp("order-1"))
            await until(lambda: handle.stats[Reason.PROCESSED] + other.stats[Reason.PROCESSED])
            stop.set()
            await asyncio.gather(*loops)
            assert handle.stats[Reason.IN_PROGRESS] + other.stats[Reason.IN_PROGRESS] == 0
            return handle, deliveries

    _, deliveries = asyncio.run(main())
    assert deliveries == [1]
    assert ledger.counts() == {"order-1": 1}


def test_a_batch_keeps_every_message_while_its_slow_one_runs(
    store: RedisStore, ledger: Ledger, name: str
) -> None:
    """In a fetched batch, a message whose handler is done waits unacked for the others (its
    completion and ack go with the batch's): the batch's in_progress beat holds it too, so a
    slow neighbour (longer than ack_wait) does not get it redelivered."""

    async def main() -> list[int]:
        async with jetstream(name) as (_, js):
            deliveries: list[int] = []

            @idempotent_handler(store, group=name, policy=FAST, progress_interval=0.2)
            async def handle(msg: Msg) -> None:
                deliveries.append(msg.metadata.num_delivered)
                if msg.headers["Idempotency-Key"] == "slow":
                    await asyncio.sleep(1.4)  # longer than ack_wait=1
                await ledger.awrite(msg.headers["Idempotency-Key"])

            sub = await js.pull_subscribe(
                f"{name}.orders", durable="billing", stream=name, config=ConsumerConfig(ack_wait=1)
            )
            for key in ("quick", "slow"):
                await publish(js, name, key, stamp(key))
            fetched: list[Msg] = []
            while len(fetched) < 2:
                fetched += await sub.fetch(2 - len(fetched), timeout=5)
            # another member pulls meanwhile: a message let go after ack_wait would come to it
            other = await js.pull_subscribe(f"{name}.orders", durable="billing", stream=name)
            spy = asyncio.ensure_future(other.fetch(1, timeout=2.5))
            verdicts = await handle.batch(fetched)
            assert [v.reason for v in verdicts] == [Reason.PROCESSED] * 2
            with pytest.raises((nats.errors.TimeoutError, asyncio.TimeoutError)):
                await spy  # nothing was redelivered
            return deliveries

    assert asyncio.run(main()) == [1, 1]
    assert ledger.counts() == {"quick": 1, "slow": 1}


@pytest.mark.parametrize(("unique", "fetch"), [(8, 10), (80, 120)])
def test_fetched_batches_take_effect_once(
    any_store: Any, ledger: Ledger, name: str, unique: int, fetch: int
) -> None:
    """handler.batch(fetched): 3 copies of 8 keys in batches of 10, two members: 8 effects;
    likewise 80 keys in batches of 120 (claimed in chunks, `CLAIM_CHUNK`)."""
    keys = [f"order-{i}" for i in range(unique)]

    async def main() -> list[IdempotentHandler]:
        async with jetstream(name) as (_, js):
            members = []
            for _ in range(2):

                @idempotent_handler(any_store, group=name, policy=FAST)
                async def handle(msg: Msg) -> None:
                    await ledger.awrite(msg.headers["Idempotency-Key"])

                members.append(handle)
            for key in keys * 3:
                await publish(js, name, key, stamp(key))

            async def member(handle: IdempotentHandler, stop: asyncio.Event) -> None:
                sub = await js.pull_subscribe(f"{name}.orders", durable="billing", stream=name)
                while not stop.is_set():
                    try:
                        await handle.batch(await sub.fetch(fetch, timeout=0.2))
                    except (nats.errors.TimeoutError, asyncio.TimeoutError):
                        continue

            stop = asyncio.Event()
            tasks = [asyncio.create_task(member(h, stop)) for h in members]
            await until(lambda: settled(members) == 3 * unique)
            stop.set()
            await asyncio.gather(*tasks)
            return members

    members = asyncio.run(main())
    assert ledger.counts() == {key: 1 for key in keys}
    assert sum(m.stats[Reason.DUPLICATE] for m in members) == 2 * unique


@pytest.mark.parametrize(
    "reply",
    [
        "$JS.ACK.orders.billing.1.42.7.1700000000000000000.3",
        "$JS.ACK._.ACCHASH.orders.billing.2.42.7.1700000000000000000.3",
        "$JS.ACK.hub.ACCHASH.orders.billing.2.42.7.1700000000000000000.3.token",
        "$JS.ACK.orders.billing.1",
        "_INBOX.reply",
        "",
    ],
)
def test_message_id_is_what_the_metadata_says(reply: str) -> None:
    """Without Nats-Msg-Id the id is the stream and its sequence, read from the ack subject as
    nats-py's own metadata reads it (both subject versions); core NATS messages have none."""
    msg = Msg(_client=None, subject="s", reply=reply, data=b"{}")  # type: ignore[arg-type]
    try:
        expected: str | None = f"{msg.metadata.stream}:{msg.metadata.sequence.stream}"
    except Exception:
        expected = None

    async def handler(msg: Msg) -> None:
        pass

    consumer = IdempotentHandler(handler, MemoryStore(), group="billing")
    assert consumer._delivery(msg).message_id == expected


def test_ack_subject_is_parsed_only_when_the_key_may_need_the_id() -> None:
    """A message whose key header is there is keyed by it: its ack subject is not parsed for an
    id nothing reads. Without the header, in another case, or with a key (fingerprint) callable,
    which may read it, the id is made; the keys are the same either way."""
    reply = "$JS.ACK.orders.c.1.7.9.1700000000000000000.0"

    async def handler(msg: Msg) -> None:
        pass

    def delivery(headers: dict[str, str] | None, **options: Any) -> Delivery:
        msg = Msg(_client=None, subject="s", reply=reply, data=b"{}", headers=headers)  # type: ignore[arg-type]
        return IdempotentHandler(handler, MemoryStore(), group="g", **options)._delivery(msg)

    stamped = stamp("k-1")
    assert delivery(stamped).message_id is None
    assert delivery(stamped, key="content").message_id is None
    assert delivery(None).message_id == "orders:7"
    assert delivery({"idempotency-key": "k-1"}).message_id == "orders:7"
    assert delivery(stamped, key=lambda d: d.message_id).message_id == "orders:7"
    assert delivery(stamped, fingerprint=lambda d: d.message_id).message_id == "orders:7"
    consumer = IdempotentHandler(handler, MemoryStore(), group="g").consumer
    assert consumer.key_for(delivery(stamped)) == consumer.key_for(
        Delivery(b"{}", stamped, "orders:7")
    )


def test_message_without_a_key_header_is_keyed_by_its_stream_sequence(
    store: RedisStore, ledger: Ledger, name: str
) -> None:
    """A real JetStream delivery with no key header is keyed by ``<stream>:<sequence>``."""

    async def main() -> None:
        async with jetstream(name) as (_, js):
            ack = await js.publish(f"{name}.orders", b'{"order": "no-key"}')

            @idempotent_handler(store, group=name, policy=FAST)
            async def handle(msg: Msg) -> None:
                await ledger.awrite("no-key")

            sub = await js.pull_subscribe(f"{name}.orders", durable="billing", stream=name)
            [msg] = await sub.fetch(1, timeout=5)
            verdict = await handle(msg)
            assert verdict.reason is Reason.PROCESSED
            assert verdict.key == f"{name}|{ack.stream}:{ack.seq}"

    asyncio.run(main())
    assert ledger.counts() == {"no-key": 1}


def test_a_cancellation_while_the_progress_beat_stops_is_not_swallowed(
    store: RedisStore, name: str
) -> None:
    """Cancelling the handler's task while its in_progress beat is drained raises there."""

    async def main() -> IdempotentHandler:
        async with jetstream(name) as (_, js):
            beating, stopping, let_go = asyncio.Event(), asyncio.Event(), asyncio.Event()

            @idempotent_handler(store, group=name, policy=FAST, progress_interval=0.05)
            async def handle(msg: Msg) -> None:
                await beating.wait()

            sub = await js.pull_subscribe(f"{name}.orders", durable="billing", stream=name)
            await publish(js, name, "order-1", stamp("order-1"))
            (msg,) = await sub.fetch(1, timeout=10)
            real_in_progress = msg.in_progress

            async def in_progress() -> None:  # sent, then slow to end once cancelled
                await real_in_progress()
                beating.set()
                try:
                    await asyncio.Event().wait()
                except asyncio.CancelledError:
                    stopping.set()
                    await let_go.wait()
                    raise

            msg.in_progress = in_progress  # type: ignore[method-assign]
            task = asyncio.create_task(handle(msg))
            await stopping.wait()  # the handler returned; its beat is being stopped
            task.cancel()
            await asyncio.sleep(0)
            let_go.set()
            with pytest.raises(asyncio.CancelledError):
                await task
            return handle

    handle = asyncio.run(main())
    assert handle.stats[Reason.PROCESSED] == 0


def test_documented_push_subscription_runs_the_handler(
    store: RedisStore, ledger: Ledger, name: str
) -> None:
    """The module docstring's form: ``js.subscribe(..., cb=on_order.callback, manual_ack=True)``
    is accepted by nats-py (a coroutine function) and settles each message once."""

    async def main() -> IdempotentHandler:
        async with jetstream(name) as (_, js):

            @idempotent_handler(store, group=name, policy=FAST, max_deliver=10)
            async def on_order(msg: Msg) -> None:
                await ledger.awrite(json.loads(msg.data)["order"])

            sub = await js.subscribe(
                f"{name}.*",
                durable="billing",
                cb=on_order.callback,
                manual_ack=True,
                config=ConsumerConfig(max_deliver=10, ack_wait=30),
            )
            try:
                for key in ["order-1", "order-2", "order-1"]:
                    await publish(js, name, key, stamp(key))
                await until(lambda: settled([on_order]) == 3)
                for _ in range(1500):  # the acks are on their way
                    if not (await js.consumer_info(name, "billing")).num_ack_pending:
                        break
                    await asyncio.sleep(0.02)
                else:
                    raise AssertionError("messages left unacked")
            finally:
                await sub.unsubscribe()
            return on_order

    on_order = asyncio.run(main())
    assert ledger.counts() == {"order-1": 1, "order-2": 1}
    assert on_order.stats[Reason.DUPLICATE] == 1


def test_last_delivery_of_a_key_running_elsewhere_waits_for_its_outcome(
    store: RedisStore, ledger: Ledger, name: str
) -> None:
    """max_deliver=1: the only delivery of a copy whose key another worker is running is held
    (in_progress) until that worker's outcome, then acked as a duplicate: never dead-lettered
    nor termed while the other copy runs."""

    async def main() -> tuple[IdempotentHandler, IdempotentHandler, list[str]]:
        async with jetstream(name) as (_, js):
            started, finish = asyncio.Event(), asyncio.Event()

            async def work(msg: Msg) -> None:
                started.set()
                await finish.wait()
                await ledger.awrite(msg.headers["Idempotency-Key"])

            first = IdempotentHandler(work, store, group=name, policy=FAST)
            last = IdempotentHandler(
                work,
                store,
                group=name,
                policy=FAST,
                max_deliver=1,
                dead_letter_subject=f"{name}.dead",
                jetstream=js,
            )
            sub = await js.pull_subscribe(
                f"{name}.orders",
                durable="billing",
                stream=name,
                config=ConsumerConfig(max_deliver=1, ack_wait=30),
            )
            await publish(js, name, "order-1", stamp("order-1"))
            await publish(js, name, "order-1", stamp("order-1"))  # a copy (no Nats-Msg-Id)
            [one] = await sub.fetch(1, timeout=5)
            running = asyncio.create_task(first(one))
            await started.wait()
            [copy] = await sub.fetch(1, timeout=5)
            held = asyncio.create_task(last(copy))
            await until(lambda: last.stats[Reason.IN_PROGRESS] >= 2)
            assert not held.done()  # neither dead-lettered nor termed meanwhile
            finish.set()
            await asyncio.gather(running, held)
            dead: list[str] = []
            try:
                message = await js.get_last_msg(name, f"{name}.dead")
                dead.append(message.headers["Idempotency-Key"])
            except nats.js.errors.NotFoundError:
                pass
            info = await js.consumer_info(name, "billing")
            assert info.num_ack_pending == 0
            return first, last, dead

    first, last, dead = asyncio.run(main())
    assert dead == []
    assert first.stats[Reason.PROCESSED] == 1
    assert last.stats[Reason.DUPLICATE] == 1
    assert ledger.counts() == {"order-1": 1}
