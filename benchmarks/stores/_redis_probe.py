"""Scratch probe: @idempotent and store verbs on Redis against raw redis-py, interleaved rounds.

PYTHONPATH=src python benchmarks/stores/_redis_probe.py --ops 2000 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
import uuid
from datetime import timedelta
from typing import Any

import redis
import redis.asyncio

import oncely
from oncely import Replay

LEASE = timedelta(seconds=30)
TTL = timedelta(seconds=300)
URL = os.environ.get("ONCELY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
RESULT = b'{"payment_id":"x","status":"captured","amount_cents":1250}'


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ops", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", default="")
    ns = parser.parse_args()
    run = uuid.uuid4().hex[:8]
    options: dict[str, Any] = {"socket_timeout": 5.0, "socket_connect_timeout": 2.0}
    client = redis.Redis.from_url(URL, **options)
    store = oncely.open_store(URL, namespace="probe", prefix=f"oncely-probe-{run}:")

    @oncely.idempotent(store=store, key="payment_id", ttl=TTL, lease=LEASE)
    def charge(payment_id: str, amount_cents: int) -> dict[str, Any]:
        return {"payment_id": payment_id, "status": "captured", "amount_cents": amount_cents}

    @oncely.idempotent(store=store, key="payment_id", ttl=TTL, lease=LEASE)
    async def acharge(payment_id: str, amount_cents: int) -> dict[str, Any]:
        return {"payment_id": payment_id, "status": "captured", "amount_cents": amount_cents}

    raw_prefix = f"oncely-probe-{run}-raw:"

    def raw_new(key: str) -> None:
        assert client.set(raw_prefix + key, b"in_progress|x", nx=True, px=30000)
        client.set(raw_prefix + key, RESULT, ex=300)

    def raw_replay(key: str) -> None:
        assert client.get(raw_prefix + key) is not None

    def verbs_new(key: str) -> None:
        c = store.claim(key, "fp", lease=LEASE, ttl=TTL)
        store.complete(key, c.token, RESULT, ttl=TTL)

    def verbs_replay(key: str) -> None:
        assert isinstance(store.claim(key, "fp", lease=LEASE, ttl=TTL), Replay)

    def deco(key: str) -> None:
        charge(key, 1250)

    aclient: Any = None

    async def araw_new(key: str) -> None:
        assert await aclient.set(raw_prefix + key, b"in_progress|x", nx=True, px=30000)
        await aclient.set(raw_prefix + key, RESULT, ex=300)

    async def araw_replay(key: str) -> None:
        assert await aclient.get(raw_prefix + key) is not None

    async def averbs_new(key: str) -> None:
        c = await store.aclaim(key, "fp", lease=LEASE, ttl=TTL)
        await store.acomplete(key, c.token, RESULT, ttl=TTL)

    async def averbs_replay(key: str) -> None:
        assert isinstance(await store.aclaim(key, "fp", lease=LEASE, ttl=TTL), Replay)

    async def adeco(key: str) -> None:
        await acharge(key, 1250)

    sync_subjects = {
        "raw": (raw_new, raw_replay),
        "verbs": (verbs_new, verbs_replay),
        "deco": (deco, deco),
    }
    async_subjects = {
        "raw": (araw_new, araw_replay),
        "verbs": (averbs_new, averbs_replay),
        "deco": (adeco, adeco),
    }
    results: dict[tuple[str, str, str], list[float]] = {}
    cpu: dict[tuple[str, str, str], list[float]] = {}

    def record(what: tuple[str, str, str], wall: float, used: float) -> None:
        results.setdefault(what, []).append((time.perf_counter() - wall) / ns.ops * 1e6)
        cpu.setdefault(what, []).append((time.process_time() - used) / ns.ops * 1e6)

    def sync_round(r: int) -> None:
        names = list(sync_subjects)
        names = names[r % len(names) :] + names[: r % len(names)]
        for name in names:
            new, replay = sync_subjects[name]
            keys = [f"s{r}-{name}-{i}" for i in range(ns.ops)]
            t, c = time.perf_counter(), time.process_time()
            for k in keys:
                new(k)
            record(("sync", "new", name), t, c)
            t, c = time.perf_counter(), time.process_time()
            for k in keys:
                replay(k)
            record(("sync", "replay", name), t, c)

    async def async_round(r: int) -> None:
        names = list(async_subjects)
        names = names[r % len(names) :] + names[: r % len(names)]
        for name in names:
            new, replay = async_subjects[name]
            keys = [f"a{r}-{name}-{i}" for i in range(ns.ops)]
            t, c = time.perf_counter(), time.process_time()
            for k in keys:
                await new(k)
            record(("async", "new", name), t, c)
            t, c = time.perf_counter(), time.process_time()
            for k in keys:
                await replay(k)
            record(("async", "replay", name), t, c)

    async def amain() -> None:
        nonlocal aclient
        aclient = redis.asyncio.Redis.from_url(URL, **options)
        for r in range(ns.rounds + 1):
            if ns.only != "async":
                sync_round(r)
            if ns.only != "sync":
                await async_round(r)
            if r == 0:
                results.clear()  # warm-up
                cpu.clear()
        await aclient.aclose()
        await store.aclose()

    try:
        asyncio.run(amain())
    finally:
        for name in client.scan_iter(match=f"oncely-probe-{run}*", count=1000):
            client.delete(name)
        client.close()
    print(f"load {os.getloadavg()[0]:.2f}  ops {ns.ops} rounds {ns.rounds}")
    for mode in ("sync", "async"):
        for op in ("new", "replay"):
            raw = results.get((mode, op, "raw"))
            if not raw:
                continue
            for label, table in (("wall", results), ("cpu", cpu)):
                base = table[(mode, "" + op, "raw")]
                cells = []
                for name in ("raw", "verbs", "deco"):
                    us = table[(mode, op, name)]
                    ratio = statistics.median(a / b for a, b in zip(base, us, strict=True))
                    cells.append(f"{name} {statistics.median(us):6.1f}us {ratio:.2f}")
                print(f"{mode:5} {op:6} {label:4} " + " | ".join(cells))


if __name__ == "__main__":
    main()
