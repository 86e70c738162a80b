"""The benchmarked server: one Starlette app, served by uvicorn, with one idempotency layer.

``python benchmarks/http/app.py SCENARIO --work SECONDS`` binds a free loopback port, prints
``listening on http://127.0.0.1:PORT`` and serves until SIGINT. Scenarios:

* ``baseline``: no idempotency middleware.
* ``oncely-memory``, ``oncely-sqlite``, ``oncely-redis``, ``oncely-postgres``: oncely's ASGI
  middleware on that store (URLs from ``--sqlite-path``, ``--redis-url``, ``--postgres-url``).
* ``oncely-postgres-direct``: the same on PostgreSQL with ``coalesce=False``: every claim and
  completion its own call, as they come, none grouped into a batch call. What the grouping
  costs a request's latency, or saves the server's CPU, is the difference with
  ``oncely-postgres``.
* ``idemkit-redis``: idemkit's ASGI middleware on its Redis backend.
* ``fastapi-idempotency-key-redis``: fastapi-idempotency-key's middleware on its Redis backend.
* ``floor-redis``, ``floor-postgres``: the floor, `RawFloor`: no idempotency package, the same
  two round trips a first request costs (claim the key, store the response) written by hand on
  a pooled redis-py (hiredis) client, or on psycopg connections with prepared statements.

Every scenario serves the same endpoint: ``POST /payments`` sleeps ``--work`` seconds (the
simulated database and payment-provider calls), then answers 201 with a small JSON body.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import uuid
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

TTL_SECONDS = 600
"""Records expire soon after the run, so the shared Redis and PostgreSQL are left clean."""


def payments_app(work: float) -> Starlette:
    """The endpoint every scenario serves."""
    counter = {"n": 0}

    async def create_payment(request: Request) -> JSONResponse:
        payment = await request.json()
        if work:
            await asyncio.sleep(work)
        counter["n"] += 1
        return JSONResponse(
            {"id": counter["n"], **payment},
            status_code=201,
            headers={"Location": f"/payments/{counter['n']}"},
        )

    return Starlette(routes=[Route("/payments", create_payment, methods=["POST"])])


def with_idempotency(app: Starlette, args: argparse.Namespace) -> Any:
    """Wrap *app* in the scenario's idempotency middleware."""
    scenario = args.scenario
    if scenario == "baseline":
        return app
    if scenario.startswith("oncely-"):
        import oncely
        from oncely.http import HttpPolicy
        from oncely.http.asgi import IdempotencyMiddleware

        backend = scenario.removeprefix("oncely-")
        direct = backend.endswith("-direct")
        backend = backend.removesuffix("-direct")
        url = {
            "memory": "memory://",
            "sqlite": f"sqlite:///{args.sqlite_path}?synchronous=normal",
            "redis": args.redis_url,
            "postgres": args.postgres_url,
        }[backend]
        store = oncely.open_store(url, namespace=f"bench-{uuid.uuid4().hex[:8]}")
        policy = HttpPolicy(ttl=TTL_SECONDS)
        return IdempotencyMiddleware(app, store=store, policy=policy, coalesce=not direct)
    if scenario == "idemkit-redis":
        import redis.asyncio
        from idemkit import HttpConfig, IdempotencyMiddleware
        from idemkit.backends.redis import RedisBackend

        backend = RedisBackend(
            redis.asyncio.Redis.from_url(args.redis_url), namespace=f"bench-{uuid.uuid4().hex[:8]}"
        )
        config = HttpConfig(expires_after_seconds=TTL_SECONDS, scope_mode="single_tenant")
        return IdempotencyMiddleware(app, backend=backend, config=config)
    if scenario == "fastapi-idempotency-key-redis":
        from fastapi_idempotency_key import IdempotencyMiddleware, RedisBackend

        backend = RedisBackend(redis_url=args.redis_url, prefix=f"bench-{uuid.uuid4().hex[:8]}:")
        return IdempotencyMiddleware(app, backend=backend, default_ttl=TTL_SECONDS)
    if scenario == "floor-redis":
        return RawFloor(app, "redis", args.redis_url)
    if scenario == "floor-postgres":
        return RawFloor(app, "postgres", args.postgres_url)
    raise SystemExit(f"unknown scenario {scenario!r}")


class RawFloor:
    """The cheapest honest hand-written version of what a first request costs: the body read,
    one round trip that claims the key (``SET NX PX``; ``INSERT ... ON CONFLICT DO NOTHING``),
    the app run with its response captured, one round trip that stores it (``SET XX PX``;
    ``UPDATE``), then the response sent. No fingerprint, no replay, no rules: a floor, not a
    product."""

    def __init__(self, app: Any, backend: str, url: str) -> None:
        self.app = app
        self.backend = backend
        self.url = url
        self.prefix = f"floor-{uuid.uuid4().hex[:8]}:"
        self._redis: Any = None
        self._pool: Any = None
        self._opened = False
        self._lock = asyncio.Lock()

    async def _open(self) -> None:
        async with self._lock:  # the first requests arrive together: one client for all
            if self.backend == "redis" and self._redis is None:
                import redis.asyncio

                self._redis = redis.asyncio.Redis.from_url(self.url)
            elif self.backend == "postgres" and self._pool is None:
                await self._open_pool()
            self._opened = True

    async def _claim(self, key: str) -> bool:
        if not self._opened:
            await self._open()
        if self.backend == "redis":
            return bool(await self._redis.set(key, b"", nx=True, px=60_000))
        async with self._pool.connection() as connection:
            cursor = await connection.execute(
                "INSERT INTO floor_http (key) VALUES (%s) ON CONFLICT DO NOTHING RETURNING 1",
                (key,),
                prepare=True,
            )
            return await cursor.fetchone() is not None

    async def _store(self, key: str, body: bytes) -> None:
        if self.backend == "redis":
            await self._redis.set(key, body, xx=True, px=TTL_SECONDS * 1000)
            return
        async with self._pool.connection() as connection:
            await connection.execute(
                "UPDATE floor_http SET body = %s WHERE key = %s", (body, key), prepare=True
            )

    async def _open_pool(self) -> None:
        from psycopg_pool import AsyncConnectionPool

        base, _, query = self.url.partition("?")
        schema = dict(part.split("=", 1) for part in query.split("&") if part).get("schema")
        kwargs: dict[str, Any] = {"autocommit": True}
        if schema:
            kwargs["options"] = f"-c search_path={schema}"
        pool = AsyncConnectionPool(base, min_size=4, max_size=10, kwargs=kwargs, open=False)
        await pool.open()
        async with pool.connection() as connection:
            await connection.execute(
                "CREATE TABLE IF NOT EXISTS floor_http (key text PRIMARY KEY, body bytea)"
            )
        self._pool = pool

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        key = next((v for k, v in scope["headers"] if k == b"idempotency-key"), None)
        if key is None:
            await self.app(scope, receive, send)
            return
        message = await receive()
        key_text = self.prefix + key.decode("latin-1")
        if not await self._claim(key_text):
            await send({"type": "http.response.start", "status": 409, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        messages = [message]
        held: list[dict[str, Any]] = []

        async def replay() -> Any:
            return messages.pop() if messages else await receive()

        async def capture(out: dict[str, Any]) -> None:
            held.append(out)

        await self.app(scope, replay, capture)
        body = b"".join(m.get("body", b"") for m in held if m["type"] == "http.response.body")
        await self._store(key_text, body)
        for out in held:
            await send(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario")
    parser.add_argument("--work", type=float, default=0.0)
    parser.add_argument("--sqlite-path", default="bench-oncely.db")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--postgres-url", default="")
    args = parser.parse_args()

    import uvicorn

    app = with_idempotency(payments_app(args.work), args)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets that say they are TCP; without
    # it, a response written in two parts waits out the client's delayed ACK (about 40 ms).
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(2048)
    print(f"listening on http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    config = uvicorn.Config(
        app, log_level="warning", access_log=False, lifespan="off", backlog=2048
    )
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
