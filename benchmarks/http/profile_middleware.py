"""Per-request cost of the ASGI middleware, in process: no server, no sockets, no load generator.

    python benchmarks/http/profile_middleware.py                 # bare app and memory store
    python benchmarks/http/profile_middleware.py --redis         # plus ONCELY_TEST_REDIS_URL
    python benchmarks/http/profile_middleware.py --profile memory-new

Calls the benchmark's app (``app.py``, no work) directly with ASGI scope / receive / send
callables, one request at a time on one event loop, and reports microseconds per request (wall
and this process's CPU: with a network store, the CPU figure is what a loaded server pays) for
the bare app, the middleware on a unique key per request (claim, run, complete) and the
middleware on a repeated key (replay). ``--profile SCENARIO`` adds a cProfile of that scenario,
top 30 by own time. Deterministic and short: meant for comparing two versions of the code, not
for the throughput figures (``run.py`` measures those against a real server).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import os
import pstats
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from app import payments_app

import oncely
from oncely.http import HttpPolicy
from oncely.http.asgi import IdempotencyMiddleware

BODY = b'{"amount":500,"currency":"EUR"}'
App = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


def _scope(key: bytes | None) -> dict[str, Any]:
    headers = [
        (b"host", b"127.0.0.1:8000"),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(BODY)).encode()),
    ]
    if key is not None:
        headers.append((b"idempotency-key", key))
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/payments",
        "raw_path": b"/payments",
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }


async def _request(app: App, key: bytes | None) -> int:
    status = 0
    message = {"type": "http.request", "body": BODY, "more_body": False}

    async def receive() -> dict[str, Any]:
        return message

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await app(_scope(key), receive, send)
    return status


async def _drive(app: App, keys: list[bytes | None], expected: int) -> tuple[float, float]:
    """Run one request per key; return (wall, CPU) microseconds per request."""
    gc.collect()
    start, cpu = time.perf_counter(), time.process_time()
    for key in keys:
        status = await _request(app, key)
        if status != expected:
            raise SystemExit(f"unexpected status {status} (expected {expected})")
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return wall / len(keys) * 1e6, cpu / len(keys) * 1e6


def _middleware(url: str) -> IdempotencyMiddleware:
    store = oncely.open_store(url, namespace=f"profile-{uuid.uuid4().hex[:8]}")
    return IdempotencyMiddleware(payments_app(0.0), store=store, policy=HttpPolicy(ttl=600))


async def _scenarios(args: argparse.Namespace) -> dict[str, tuple[App, list[bytes | None], int]]:
    n = args.requests
    run = uuid.uuid4().hex[:8]
    fresh = [f"{run}-{i}".encode() for i in range(n)]
    scenarios: dict[str, tuple[App, list[bytes | None], int]] = {
        "bare": (payments_app(0.0), [None] * n, 201),
    }
    urls = {"memory": "memory://"}
    if args.redis:
        urls["redis"] = os.environ.get("ONCELY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    for name, url in urls.items():
        middleware = _middleware(url)
        scenarios[f"{name}-new"] = (middleware, fresh, 201)
        replayed = _middleware(url)
        await _request(replayed, b"replayed")  # the first request stores the response
        scenarios[f"{name}-replay"] = (replayed, [b"replayed"] * n, 201)
    return scenarios


async def main(args: argparse.Namespace) -> None:
    scenarios = await _scenarios(args)
    for app, keys, expected in scenarios.values():  # warm up imports, caches and connections
        await _drive(app, keys[:200], expected)
    print(f"{args.requests} sequential requests each, {sys.version.split()[0]}")
    for name, (app, keys, expected) in scenarios.items():
        runs = []
        for attempt in range(args.repeat):
            if name.endswith("-new"):  # a fresh key per request on every run
                keys = [b"%s-t%d" % (key, attempt) for key in keys]  # type: ignore[str-bytes-safe]
            runs.append(await _drive(app, keys, expected))
        wall, cpu = min(runs, key=lambda run: run[1])
        print(f"  {name:<16} {wall:8.1f} us/request wall {cpu:8.1f} us CPU")
    if args.profile:
        app, keys, expected = scenarios[args.profile]
        if args.profile.endswith("-new"):
            keys = [key + b"-profiled" for key in keys]  # type: ignore[operator]
        profiler = cProfile.Profile()
        profiler.enable()
        await _drive(app, keys, expected)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", "-n", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=1, help="runs per scenario; best kept")
    parser.add_argument("--redis", action="store_true", help="add Redis (ONCELY_TEST_REDIS_URL)")
    parser.add_argument("--profile", metavar="SCENARIO", help="cProfile one scenario")
    asyncio.run(main(parser.parse_args()))
