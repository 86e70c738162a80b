"""RabbitMQ and NATS JetStream through their adapters (`oncely.consumers.rabbitmq`,
`oncely.consumers.nats`, the FastStream middleware `oncely.consumers.faststream` on a RabbitMQ
broker, and Celery workers with `oncely.consumers.celery` on RabbitMQ): two member processes of
one queue (one durable JetStream consumer);
member A is SIGKILLed in its first handler, before its fenced write (``kill@mid``) or after it,
before the adapter completes the record and acks (``kill@effect``). RabbitMQ redelivers the
dead member's message at once, JetStream after ``ack_wait``; member B waits out A's lease and
runs it. What the broker acknowledged is read from the broker once both members are gone, not
from the members: an ack sent too early shows as a message acked with no write standing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import oncely
from tests.faults._effects import Effects, Fenced
from tests.faults._history import now

ACK_WAIT = 2.0
"""JetStream's ``ack_wait`` (seconds): a dead member's message comes back after it."""


def member(config: dict[str, Any], pipe: Any) -> None:
    """A member process of ``config["broker"]`` (``rabbitmq``, ``nats``, ``faststream`` or
    ``celery``).

    ``config["kill"]``: ``mid`` or ``effect``, the point of its first handler where it dies.
    """
    if config["broker"] == "celery":  # a Celery worker wants the main thread: no event loop
        _celery(_Member(config, pipe))
    else:
        asyncio.run(_member(_Member(config, pipe)))


class _Member:
    """What every member has: its store and policy, its events, its death and its writes."""

    def __init__(self, config: dict[str, Any], pipe: Any) -> None:
        from oncely.consumers import ConsumerPolicy

        self.config = config
        self.pipe = pipe
        self.worker: str = config["worker"]
        self.lock = threading.Lock()
        self.effects = Effects(config["effects"]["url"], config["effects"]["schema"])
        self.store: Any = oncely.open_store(
            config["store"]["url"], **config["store"].get("options", {})
        )
        self.policy = ConsumerPolicy(
            lease=timedelta(seconds=config["lease"]),
            ttl=timedelta(minutes=5),
            retry_delay=timedelta(seconds=0.2),
        )
        self.runs = iter(range(1, 10_000))
        self.kill = config.get("kill")
        self.running: dict[str, str] = {}  # op -> key, the handlers in flight in this process

    def event(self, ev: str, op: str, key: str, **fields: Any) -> None:
        with self.lock:
            self.pipe.send(
                {"ev": ev, "op": op, "key": key, "worker": self.worker, "t": now(), **fields}
            )

    def die(self, op: str, key: str, point: str) -> None:
        self.event("fault", op, key, kind=f"kill@{point}", excuses=True)
        for other, its_key in self.running.items():  # they die too (FastStream runs several)
            if other != op:
                self.event("fault", other, its_key, kind=f"kill@{point}", excuses=True, along=True)
        os.kill(os.getpid(), signal.SIGKILL)
        threading.Event().wait()

    def started(self, key: str) -> tuple[str, int]:
        """A handler starts on *key*: its op id and its lease's token."""
        op = f"{self.worker}-{next(self.runs)}"
        current = oncely.current_lease()
        assert current is not None
        self.event("run", op, key, token=current.token)
        self.running[op] = key
        return op, current.token

    def wrote(self, op: str, key: str, token: int, accepted: bool) -> None:
        """The handler's write was *accepted* or fenced off; it dies here if it is to."""
        self.event("effect", op, key, token=token, accepted=accepted)
        if not accepted:
            raise Fenced(f"{op}'s write was rejected")
        if self.kill == "effect":
            self.die(op, key, "effect")

    def ended(self, op: str, key: str) -> None:
        self.running.pop(op, None)
        self.event("end", op, key)

    def settled(self, key: str, verdict: Any) -> None:
        """What the member saw (the campaign waits on it; the broker's state is the judge)."""
        from oncely.consumers import Action

        if verdict is None or verdict.action is Action.ACK:
            self.event("settled", f"{self.worker}-settled", key)


async def _member(member: _Member) -> None:
    import psycopg

    config, effects = member.config, member.effects

    async def effect(key: str) -> None:
        op, token = member.started(key)
        try:
            async with await psycopg.AsyncConnection.connect(effects.url, autocommit=True) as conn:
                if await effects.abegin(conn, key, token) is not None:
                    return  # an earlier run's write stands: adopt it
                if member.kill == "mid":
                    member.die(op, key, "mid")
                member.wrote(op, key, token, await effects.awrite(conn, key, op, token))
        finally:
            member.ended(op, key)

    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    consume = {"rabbitmq": _rabbitmq, "nats": _nats, "faststream": _faststream}[config["broker"]]
    try:
        await consume(config, member.store, member.policy, effect, member.settled, stop)
    finally:
        with contextlib.suppress(Exception):
            await member.store.aclose()
        member.pipe.close()


def celery_app(url: str, queue: str) -> Any:
    """The Celery app of a history: its one queue (on the default exchange), late acks."""
    from celery import Celery
    from kombu import Queue

    app = Celery(queue, broker=url, set_as_current=False)
    app.conf.update(
        task_default_queue=queue,
        task_queues=[Queue(queue, routing_key=queue)],
        task_ignore_result=True,
        broker_heartbeat=0,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        worker_redirect_stdouts=False,
        worker_prefetch_multiplier=1,
        worker_enable_remote_control=False,  # its reply queue is per host: workers would clash
    )
    return app


CELERY_TASK = "faults.charge"


def _celery(member: _Member) -> None:
    """A Celery worker (solo pool: the task runs in this process, which SIGKILL ends) with an
    `oncely.consumers.celery.IdempotentTask`; SIGTERM is its warm shutdown."""
    import psycopg

    from oncely.consumers.celery import IdempotentTask

    config, effects = member.config, member.effects
    app = celery_app(config["url"], config["queue"])

    class Watched(IdempotentTask):  # type: ignore[misc]
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            result = super().__call__(*args, **kwargs)  # a retry or a reject raises
            if not self.request.called_directly:
                member.settled(args[0], None)
            return result

    @app.task(
        name=CELERY_TASK,
        base=Watched,
        oncely_store=member.store,
        oncely_group=config["group"],
        oncely_policy=member.policy,
        shared=False,
    )
    def charge(key: str) -> None:
        op, token = member.started(key)
        try:
            with psycopg.connect(effects.url, autocommit=True) as conn:
                if effects.begin(conn, key, token) is not None:
                    return  # an earlier run's write stands: adopt it
                if member.kill == "mid":
                    member.die(op, key, "mid")
                member.wrote(op, key, token, effects.write(conn, key, op, token))
        finally:
            member.ended(op, key)

    try:
        app.worker_main(
            [
                "--quiet",  # no banner
                "worker",
                "-P",
                "solo",
                "--loglevel=WARNING",
                "--without-mingle",
                "--without-gossip",
                "--without-heartbeat",
                f"--hostname={member.worker}-{config['queue']}@%h",
            ]
        )
    except SystemExit:
        pass
    finally:
        with contextlib.suppress(Exception):
            member.store.close()
        member.pipe.close()


async def _rabbitmq(
    config: dict[str, Any],
    store: Any,
    policy: Any,
    effect: Callable[[str], Awaitable[None]],
    settled: Callable[[str, Any], None],
    stop: asyncio.Event,
) -> None:
    import aio_pika

    from oncely.consumers.rabbitmq import IdempotentHandler

    async def handle(message: Any) -> None:
        await effect(message.headers["Idempotency-Key"])

    handler = IdempotentHandler(handle, store, group=config["group"], policy=policy)

    async def callback(message: Any) -> None:
        settled(message.headers["Idempotency-Key"], await handler(message))

    connection = await aio_pika.connect(config["url"])
    async with connection:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=1)
        queue = await channel.get_queue(config["queue"])
        await queue.consume(callback)
        await stop.wait()


async def _nats(
    config: dict[str, Any],
    store: Any,
    policy: Any,
    effect: Callable[[str], Awaitable[None]],
    settled: Callable[[str, Any], None],
    stop: asyncio.Event,
) -> None:
    import nats
    from nats.js.api import ConsumerConfig

    from oncely.consumers.nats import IdempotentHandler

    async def handle(msg: Any) -> None:
        await effect(msg.headers["Idempotency-Key"])

    handler = IdempotentHandler(
        handle, store, group=config["group"], policy=policy, progress_interval=ACK_WAIT / 4
    )
    client = await nats.connect(config["url"])
    try:
        js = client.jetstream()
        sub = await js.pull_subscribe(
            f"{config['stream']}.orders",
            durable="members",
            stream=config["stream"],
            config=ConsumerConfig(ack_wait=ACK_WAIT),
        )
        while not stop.is_set():
            try:
                messages = await sub.fetch(1, timeout=0.2)
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                continue
            for msg in messages:
                settled(msg.headers["Idempotency-Key"], await handler(msg))
    finally:
        await client.close()


async def _faststream(
    config: dict[str, Any],
    store: Any,
    policy: Any,
    effect: Callable[[str], Awaitable[None]],
    settled: Callable[[str, Any], None],
    stop: asyncio.Event,
) -> None:
    """The FastStream middleware on a RabbitMQ broker (it settles the message itself)."""
    from faststream.rabbit import RabbitBroker, RabbitQueue

    from oncely.consumers import Verdict
    from oncely.consumers.faststream import IdempotencyMiddleware

    class Watched(IdempotencyMiddleware):
        async def _settle(self, msg: Any, verdict: Verdict) -> None:
            await super()._settle(msg, verdict)
            settled(str((msg.headers or {})["Idempotency-Key"]), verdict)

    broker = RabbitBroker(config["url"], logger=None)
    broker.add_middleware(Watched(store, group=config["group"], policy=policy))

    @broker.subscriber(RabbitQueue(config["queue"], durable=False))
    async def handle(body: dict[str, Any]) -> None:
        await effect(body["order"])

    async with broker:
        await broker.start()
        await stop.wait()


# -- the broker's side (the campaign process) --------------------------------------------------


class RabbitQueue:
    """The history's own queue: created, filled, read back after the members, deleted."""

    def __init__(self, url: str, name: str) -> None:
        self.url = url
        self.name = name

    def publish(self, keys: list[str]) -> None:
        asyncio.run(self._publish(keys))

    async def _publish(self, keys: list[str]) -> None:
        import aio_pika

        from oncely.consumers.producer import amqp_message

        connection = await aio_pika.connect(self.url)
        async with connection:
            channel = await connection.channel()
            await channel.declare_queue(self.name)
            for key in keys:
                body = json.dumps({"order": key}).encode()
                message = amqp_message(body, key, content_type="application/json")
                await channel.default_exchange.publish(message, routing_key=self.name)

    def unacked(self) -> set[str]:
        """The keys of the messages still in the queue (once no member holds any), then the
        queue is deleted."""
        return asyncio.run(self._unacked())

    async def _unacked(self) -> set[str]:
        import aio_pika

        connection = await aio_pika.connect(self.url)
        left: set[str] = set()
        async with connection:
            channel = await connection.channel()
            queue = await channel.declare_queue(self.name)  # made by `publish`, or now
            while (message := await queue.get(no_ack=True, fail=False)) is not None:
                left.add(str((message.headers or {})["Idempotency-Key"]))
            await queue.delete(if_unused=False, if_empty=False)
        return left


class CeleryQueue(RabbitQueue):
    """The history's own Celery queue: tasks sent with `celery_options`, read back after the
    members (a retried task keeps its id, the key), deleted."""

    def publish(self, keys: list[str]) -> None:
        from oncely.consumers.celery import celery_options

        app = celery_app(self.url, self.name)
        try:
            for key in keys:
                app.send_task(CELERY_TASK, args=(key,), **celery_options(key))
        finally:
            app.close()

    def unacked(self) -> set[str]:
        app = celery_app(self.url, self.name)
        left: set[str] = set()
        try:
            with app.connection_for_write() as connection:
                channel = connection.default_channel
                channel.queue_declare(self.name, durable=True, auto_delete=False)
                while (message := channel.basic_get(self.name, no_ack=True)) is not None:
                    headers = message.headers or {}
                    left.add(str(headers.get("Idempotency-Key") or headers["id"]))
                channel.queue_delete(self.name)
                channel.exchange_delete(self.name)  # the app's default exchange
        finally:
            app.close()
        return left


class NatsStream:
    """The history's own stream (subjects ``<name>.>``) and its durable consumer ``members``."""

    def __init__(self, url: str, name: str) -> None:
        self.url = url
        self.name = name
        self.sequences: dict[str, int] = {}

    def publish(self, keys: list[str]) -> None:
        asyncio.run(self._publish(keys))

    async def _publish(self, keys: list[str]) -> None:
        import nats

        from oncely.consumers.producer import nats_headers

        client = await nats.connect(self.url)
        try:
            js = client.jetstream()
            await js.add_stream(name=self.name, subjects=[f"{self.name}.>"])
            for key in keys:
                ack = await js.publish(
                    f"{self.name}.orders", key.encode(), headers=nats_headers(key)
                )
                self.sequences[key] = ack.seq
        finally:
            await client.close()

    def unacked(self) -> set[str]:
        """The keys above the durable consumer's ack floor (then the stream is deleted)."""
        return asyncio.run(self._unacked())

    async def _unacked(self) -> set[str]:
        import nats

        client = await nats.connect(self.url)
        try:
            js = client.jetstream()
            try:
                info = await js.consumer_info(self.name, "members")
                floor = info.ack_floor.stream_seq if info.ack_floor is not None else 0
            except nats.js.errors.NotFoundError:  # no member ever subscribed
                floor = 0
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await js.delete_stream(self.name)
        finally:
            await client.close()
        return {key for key, seq in self.sequences.items() if (seq or 0) > (floor or 0)}


def wait_settled(
    events: Callable[[], list[dict[str, Any]]], keys: list[str], timeout: float
) -> None:
    """Wait (bounded) until a member has settled (acked) every key."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if set(keys) <= {event["key"] for event in events() if event["ev"] == "settled"}:
            return
        time.sleep(0.1)
