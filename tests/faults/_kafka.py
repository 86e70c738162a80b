"""Kafka through the adapter (`oncely.consumers.kafka.IdempotentKafkaConsumer`) under a forced
redelivery: a partition's batch is blocked behind a message whose handler fails once, and the
batch comes back after a retry delay longer than the lease. Meanwhile a copy of a blocked key,
on another topic, is consumed by another consumer in the same scope: the blocked lease has
expired, so it takes the key over and runs it. The first consumer must then not run that key
again under the lease it held across the rounds.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from datetime import timedelta
from typing import Any

import oncely
from tests.faults._effects import Effects, Fenced
from tests.faults._history import History, now


def run(
    history: History,
    lock: threading.Lock,
    *,
    bootstrap: str,
    store_url: str,
    namespace: str,
    effects: Effects,
    keys: list[str],
    lease: float,
) -> list[str]:
    """Run the scenario; return the faults injected."""
    import psycopg
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    from oncely.consumers import ConsumerPolicy
    from oncely.consumers.kafka import IdempotentKafkaConsumer
    from oncely.consumers.producer import kafka_headers

    name = f"oncely-faults-{uuid.uuid4().hex[:10]}"
    first, copy = f"{name}-a", f"{name}-b"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics(
        [NewTopic(first, num_partitions=1), NewTopic(copy, num_partitions=1)]
    ).values():
        future.result(10)
    store = oncely.open_store(store_url, namespace=namespace)
    policy = ConsumerPolicy(
        lease=timedelta(seconds=lease),
        ttl=timedelta(minutes=5),
        retry_delay=timedelta(seconds=lease * 2.5),
    )
    blocker, blocked = f"{keys[0]}-blocker", keys[0]
    failed_once = threading.Event()
    faults: list[str] = []

    def record(ev: str, op: str, key: str, worker: str, **fields: Any) -> None:
        with lock:
            history.add({"ev": ev, "op": op, "key": key, "worker": worker, "t": now(), **fields})

    def handler(worker: str) -> Any:
        runs = iter(range(1, 1000))

        def handle(message: Any) -> None:
            key = json.loads(message.value())["order"]
            op = f"{worker}-{message.topic()[-1]}{message.offset()}.{next(runs)}"
            current = oncely.current_lease()
            assert current is not None
            record("run", op, key, worker, token=current.token)
            try:
                if key == blocker and not failed_once.is_set():
                    failed_once.set()
                    faults.append("redelivery")
                    raise RuntimeError("the first delivery fails: the batch is redelivered")
                with psycopg.connect(effects.url, autocommit=True) as conn:
                    standing = effects.begin(conn, key, current.token)
                    if standing is None:
                        accepted = effects.write(conn, key, op, current.token)
                        record("effect", op, key, worker, token=current.token, accepted=accepted)
                        if not accepted:
                            raise Fenced(f"{op}'s write was rejected")
            finally:
                record("end", op, key, worker)

        return handle

    def consumer(worker: str, topic: str) -> IdempotentKafkaConsumer:
        return IdempotentKafkaConsumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"{name}-{worker}",
                "auto.offset.reset": "earliest",
                "session.timeout.ms": 2000,
                "heartbeat.interval.ms": 400,
            },
            [topic],
            handler(worker),
            store=store,
            scope=f"faults-{name}",
            policy=policy,
            poll_timeout=0.1,
        )

    producer = Producer({"bootstrap.servers": bootstrap})

    def produce(topic: str, key: str) -> None:
        value = json.dumps({"order": key}).encode()
        producer.produce(topic, value=value, headers=kafka_headers(key))
        assert producer.flush(10) == 0

    stop = threading.Event()
    consumers = [consumer("K1", first), consumer("K2", copy)]
    threads = [threading.Thread(target=c.run, args=(stop,), daemon=True) for c in consumers]
    try:
        for thread in threads:
            thread.start()
        produce(first, blocker)
        produce(first, blocked)
        if failed_once.wait(30):
            time.sleep(lease + 0.3)  # the blocked key's lease, held and not extended, expires
            produce(copy, blocked)  # its copy: K2 may take it over
        deadline = time.monotonic() + lease * 4 + 10
        while time.monotonic() < deadline:  # until both copies were settled by someone
            with lock:
                ended = {e["key"] for e in history.events if e["ev"] == "effect"}
            if {blocker, blocked} <= ended:
                break
            time.sleep(0.1)
        time.sleep(lease * 2.5 + 0.5)  # K1's redelivered round, if it runs the key again
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
        for each in consumers:
            each.close()
        store.close()
        for future in admin.delete_topics([first, copy]).values():
            future.result(10)
    return faults


# -- a consumer-group rebalance ----------------------------------------------------------------
# Two member processes of one group on a topic of `PARTITIONS` partitions, their handlers slow
# enough that records are in flight when partitions move: with ``rebalance@join`` member B
# joins while A runs the first records of every partition; with ``rebalance@kill`` both run
# and A is SIGKILLed in one of its handlers, before its write: after the session timeout B gets
# A's partitions and redoes A's uncommitted records. What the group committed is read from the
# broker at the end.

PARTITIONS = 3


def member(config: dict[str, Any], pipe: Any) -> None:
    """A group member (a worker process); ``config["kill_at"]``: die in that handler (1-based)."""
    import os
    import signal

    import psycopg

    from oncely.consumers import ConsumerPolicy
    from oncely.consumers.kafka import IdempotentKafkaConsumer

    worker = config["worker"]
    lock = threading.Lock()
    effects = Effects(config["effects"]["url"], config["effects"]["schema"])
    store = oncely.open_store(config["store"]["url"], **config["store"].get("options", {}))
    runs = iter(range(1, 10_000))

    def event(ev: str, op: str, key: str, **fields: Any) -> None:
        with lock:
            pipe.send({"ev": ev, "op": op, "key": key, "worker": worker, "t": now(), **fields})

    def handle(message: Any) -> None:
        key = json.loads(message.value())["order"]
        run = next(runs)
        op = f"{worker}-p{message.partition()}@{message.offset()}.{run}"
        current = oncely.current_lease()
        assert current is not None
        event("run", op, key, token=current.token)
        try:
            with psycopg.connect(effects.url, autocommit=True) as conn:
                if effects.begin(conn, key, current.token) is not None:
                    return
                time.sleep(config["hold"])  # in flight: the rebalance lands here
                if run == config.get("kill_at"):
                    event("fault", op, key, kind="rebalance@kill", excuses=True)
                    os.kill(os.getpid(), signal.SIGKILL)
                    threading.Event().wait()
                accepted = effects.write(conn, key, op, current.token)
                event("effect", op, key, token=current.token, accepted=accepted)
                if not accepted:
                    raise Fenced(f"{op}'s write was rejected")
        finally:
            event("end", op, key)

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    consumer = IdempotentKafkaConsumer(
        {
            "bootstrap.servers": config["bootstrap"],
            "group.id": config["group"],
            "auto.offset.reset": "earliest",
            "session.timeout.ms": 2000,
            "heartbeat.interval.ms": 400,
        },
        [config["topic"]],
        handle,
        store=store,
        scope=f"faults-{config['group']}",
        policy=ConsumerPolicy(lease=timedelta(seconds=config["lease"]), ttl=timedelta(minutes=5)),
        poll_timeout=0.1,
        batch_size=4,
    )
    thread = threading.Thread(target=consumer.run, args=(stop,))
    thread.start()
    while thread.is_alive():  # the main thread stays free for the SIGTERM handler
        thread.join(0.05)
    consumer.close()
    store.close()
    pipe.close()


def async_member(config: dict[str, Any], pipe: Any) -> None:
    """A group member on aiokafka (`AsyncIdempotentKafkaConsumer`): its partitions can be
    revoked while its handlers run, which a ``revoked`` event with ``mid`` says."""
    asyncio.run(_async_member(config, pipe))


async def _async_member(config: dict[str, Any], pipe: Any) -> None:
    import signal

    import aiokafka
    import psycopg

    from oncely.consumers import ConsumerPolicy
    from oncely.consumers.kafka import AsyncIdempotentKafkaConsumer

    worker = config["worker"]
    effects = Effects(config["effects"]["url"], config["effects"]["schema"])
    store: Any = oncely.open_store(config["store"]["url"], **config["store"].get("options", {}))
    runs = iter(range(1, 10_000))

    def event(ev: str, op: str, key: str, **fields: Any) -> None:
        pipe.send({"ev": ev, "op": op, "key": key, "worker": worker, "t": now(), **fields})

    async def handle(record: Any) -> None:
        key = json.loads(record.value)["order"]
        op = f"{worker}-p{record.partition}@{record.offset}.{next(runs)}"
        current = oncely.current_lease()
        assert current is not None
        event("run", op, key, token=current.token)
        try:
            async with await psycopg.AsyncConnection.connect(effects.url, autocommit=True) as conn:
                if await effects.abegin(conn, key, current.token) is not None:
                    return
                await asyncio.sleep(config["hold"])  # in flight: the rebalance lands here
                accepted = await effects.awrite(conn, key, op, current.token)
                event("effect", op, key, token=current.token, accepted=accepted)
                if not accepted:
                    raise Fenced(f"{op}'s write was rejected")
        finally:
            event("end", op, key)

    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    producer = aiokafka.AIOKafkaProducer(bootstrap_servers=config["bootstrap"])
    client = aiokafka.AIOKafkaConsumer(
        bootstrap_servers=config["bootstrap"],
        group_id=config["group"],
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        session_timeout_ms=2000,
        heartbeat_interval_ms=400,
        rebalance_timeout_ms=2000,
    )
    consumer = AsyncIdempotentKafkaConsumer(
        client,
        [config["topic"]],
        handle,
        store=store,
        producer=producer,
        scope=f"faults-{config['group']}",
        policy=ConsumerPolicy(lease=timedelta(seconds=config["lease"]), ttl=timedelta(minutes=5)),
        poll_timeout=0.1,
        batch_size=4,
    )
    revoke = consumer._revoked  # the test's own probe, as tests/consumers do

    async def watched(partitions: Any) -> None:
        mid = not consumer._idle.is_set()
        event("revoked", f"{worker}-revoke", "", mid=mid, partitions=len(partitions))
        await revoke(partitions)

    consumer._revoked = watched  # type: ignore[method-assign]  # a probe, not a patch
    await producer.start()
    await client.start()
    try:
        await consumer.arun(stop)
    finally:
        await client.stop()
        await producer.stop()
        await store.aclose()
        pipe.close()


def create(bootstrap: str, topic: str, keys: list[str]) -> dict[str, int]:
    """Create *topic* and produce one record per key, round robin over the partitions; return
    each key's partition and offset as ``"partition:offset"`` keyed by key."""
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    from oncely.consumers.producer import kafka_headers

    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(topic, num_partitions=PARTITIONS)]).values():
        future.result(10)
    producer = Producer({"bootstrap.servers": bootstrap})
    where: dict[str, Any] = {}

    def delivered(error: Any, message: Any) -> None:
        assert error is None, error
        where[json.loads(message.value())["order"]] = (message.partition(), message.offset())

    for number, key in enumerate(keys):
        value = json.dumps({"order": key}).encode()
        producer.produce(
            topic,
            value=value,
            headers=kafka_headers(key),
            partition=number % PARTITIONS,
            on_delivery=delivered,
        )
    assert producer.flush(10) == 0
    return where


def committed(bootstrap: str, group: str, topic: str) -> dict[int, int]:
    """The group's committed offsets (without joining the group)."""
    from confluent_kafka import Consumer, TopicPartition

    probe = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    try:
        parts = probe.committed([TopicPartition(topic, p) for p in range(PARTITIONS)], timeout=10)
        return {p.partition: p.offset for p in parts if p.offset >= 0}
    finally:
        probe.close()


def settle(
    bootstrap: str, group: str, topic: str, where: dict[str, Any], timeout: float
) -> set[str]:
    """Wait (bounded) until the group committed past every record; return the keys committed."""
    ends: dict[int, int] = {}
    for partition, offset in where.values():
        ends[partition] = max(ends.get(partition, 0), offset + 1)
    deadline = time.monotonic() + timeout
    while (done := committed(bootstrap, group, topic)) != ends and time.monotonic() < deadline:
        time.sleep(0.2)
    return {key for key, (partition, offset) in where.items() if offset < done.get(partition, 0)}


def drop(bootstrap: str, topic: str) -> None:
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.delete_topics([topic]).values():
        future.result(10)
