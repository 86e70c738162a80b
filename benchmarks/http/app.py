"""The benchmarked server: one Starlette app, served by uvicorn, with one idempotency layer.

``python benchmarks/http/app.py SCENARIO --work SECONDS`` binds a free loopback port, prints
``listening on http://127.0.0.1:PORT`` and serves until SIGINT. Scenarios:

* ``baseline``: no idempotency middleware.
* ``oncely-memory``, ``oncely-sqlite``, ``oncely-redis``, ``oncely-postgres``: oncely's ASGI
  middleware on that store (URLs from ``--sqlite-path``, ``--redis-url``, ``--postgres-url``).
* ``idemkit-redis``: idemkit's ASGI middleware on its Redis backend.
* ``fastapi-idempotency-key-redis``: fastapi-idempotency-key's middleware on its Redis backend.

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
        url = {
            "memory": "memory://",
            "sqlite": f"sqlite:///{args.sqlite_path}?synchronous=normal",
            "redis": args.redis_url,
            "postgres": args.postgres_url,
        }[backend]
        store = oncely.open_store(url, namespace=f"bench-{uuid.uuid4().hex[:8]}")
        return IdempotencyMiddleware(app, store=store, policy=HttpPolicy(ttl=TTL_SECONDS))
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
    raise SystemExit(f"unknown scenario {scenario!r}")


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
