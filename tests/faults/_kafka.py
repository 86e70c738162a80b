"""Kafka through the adapter (`oncely.consumers.kafka.IdempotentKafkaConsumer`) under a forced
redelivery: a partition's batch is blocked behind a message whose handler fails once, and the
batch comes back after a retry delay longer than the lease. Meanwhile a copy of a blocked key,
on another topic, is consumed by another consumer in the same scope: the blocked lease has
expired, so it takes the key over and runs it. The first consumer must then not run that key
again under the lease it held across the rounds.
"""

from __future__ import annotations

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
