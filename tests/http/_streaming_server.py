"""A Starlette or FastAPI app with a streaming endpoint, served by uvicorn for test_servers.py.

``POST /stream`` records each execution (its idempotency key, one line in the executions
file), then streams a response whose first chunk leaves at once; on the first execution of a
key the rest waits for a minute, so a client with a short read timeout gives up mid-stream.
Prints ``listening on http://host:port`` once it accepts connections.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import Route

import oncely
from oncely.http import HttpPolicy
from oncely.http.asgi import IdempotencyMiddleware


def executions(path: Path, key: str) -> int:
    """How many times the handler ran for *key*."""
    if not path.exists():
        return 0
    return path.read_text().splitlines().count(key)


def create_app(framework: str, store: oncely.AsyncStore, record: Path, lease: float) -> Any:
    async def pieces(key: str) -> AsyncIterator[bytes]:
        yield b"first;"
        if executions(record, key) == 1:
            await asyncio.sleep(60)  # cancelled by Starlette when the client disconnects
        yield b"rest"

    def run_handler(key: str) -> None:
        with record.open("a") as file:
            file.write(key + "\n")

    policy = HttpPolicy(lease=lease)
    if framework == "fastapi":
        app = FastAPI()

        @app.post("/stream", status_code=201)
        async def stream(request: Request) -> StreamingResponse:
            key = request.headers["idempotency-key"]
            run_handler(key)
            return StreamingResponse(pieces(key), 201, media_type="text/plain")

        app.add_middleware(IdempotencyMiddleware, store=store, policy=policy)
        return app

    async def starlette_stream(request: Request) -> StreamingResponse:
        key = request.headers["idempotency-key"]
        run_handler(key)
        return StreamingResponse(pieces(key), 201, media_type="text/plain")

    return Starlette(
        routes=[Route("/stream", starlette_stream, methods=["POST"])],
        middleware=[Middleware(IdempotencyMiddleware, store=store, policy=policy)],
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--framework", choices=["starlette", "fastapi"], required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--executions", type=Path, required=True)
    parser.add_argument("--lease", type=float, default=1.0)
    args = parser.parse_args()
    store = oncely.open_store(args.store, namespace=args.namespace)
    app = create_app(args.framework, store, args.executions, args.lease)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    print(f"listening on http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    try:
        config = uvicorn.Config(app, log_level="warning", lifespan="off")
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
        store.close()


if __name__ == "__main__":
    main()
