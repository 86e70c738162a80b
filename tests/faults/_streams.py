"""Redis Streams through the adapter (`oncely.consumers.redis_streams.RedisStreamConsumer`): two
member processes of one group; member A is SIGKILLed in the middle of its first handler, and
member B reclaims the dead member's pending entry once it has been idle for a lease (XAUTOCLAIM)
and runs it. At the end, every entry the group acknowledged must have a write that stands.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta
from typing import Any

import oncely
from tests.faults._effects import Effects, Fenced
from tests.faults._history import now


def member(config: dict[str, Any], pipe: Any) -> None:
    """A group member (a worker process); ``config["kill_first"]``: die in its first handler."""
    import psycopg
    import redis

    from oncely.consumers import ConsumerPolicy
    from oncely.consumers.redis_streams import RedisStreamConsumer, StreamEntry

    worker = config["worker"]
    lock = threading.Lock()
    effects = Effects(config["effects"]["url"], config["effects"]["schema"])
    store = oncely.open_store(config["store"]["url"], **config["store"].get("options", {}))
    runs = iter(range(1, 10_000))

    def event(ev: str, op: str, key: str, **fields: Any) -> None:
        with lock:
            pipe.send({"ev": ev, "op": op, "key": key, "worker": worker, "t": now(), **fields})

    def handle(entry: StreamEntry) -> None:
        key = entry.fields[b"Idempotency-Key"].decode()
        op = f"{worker}-{entry.id}.{next(runs)}"
        current = oncely.current_lease()
        assert current is not None
        event("run", op, key, token=current.token)
        try:
            with psycopg.connect(effects.url, autocommit=True) as conn:
                if effects.begin(conn, key, current.token) is not None:
                    return
                if config.get("kill_first"):
                    event("fault", op, key, kind="kill@mid", excuses=True)
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
    client = redis.Redis.from_url(config["redis"])
    consumer = RedisStreamConsumer(
        client,
        config["stream"],
        config["group"],
        handle,
        store=store,
        consumer=worker,
        policy=ConsumerPolicy(lease=timedelta(seconds=config["lease"]), ttl=timedelta(minutes=5)),
        block=0.1,
    )
    thread = threading.Thread(target=consumer.run, args=(stop,))
    thread.start()
    while thread.is_alive():  # the main thread stays free for the SIGTERM handler
        thread.join(0.05)
    client.close()
    pipe.close()


def settle(redis_url: str, stream: str, group: str, keys: list[str], timeout: float) -> set[str]:
    """Wait (bounded) until the group has nothing pending and has read every entry; return the
    keys of the entries acknowledged."""
    import redis

    with redis.Redis.from_url(redis_url) as client:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pending = int(client.xpending(stream, group)["pending"])
            info = {g["name"].decode(): g for g in client.xinfo_groups(stream)}[group]
            started = info["last-delivered-id"] != b"0-0"
            if pending == 0 and int(info.get("lag") or 0) == 0 and started:
                break
            time.sleep(0.1)
        pending_ids = {
            p["message_id"] for p in client.xpending_range(stream, group, "-", "+", 1000)
        }
        acked = set()
        for entry_id, fields in client.xrange(stream):
            if entry_id not in pending_ids:
                acked.add(fields[b"Idempotency-Key"].decode())
        return acked & set(keys)
