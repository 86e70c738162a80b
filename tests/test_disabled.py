"""`ONCELY_DISABLED` / `oncely.testing.disabled()` turn off every entry point.

Each entry point runs its operation unprotected, logs the one warning, and never touches the
store: the store here is a Redis store on a port nothing listens on, so any call to it would
raise (or answer 503) at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import oncely
from oncely.consumers import Action, ConsumerPolicy, Delivery, IdempotentConsumer, Reason
from oncely.testing import disabled

WARNING = "runs UNPROTECTED"


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def down() -> Iterator[Any]:
    """A store nothing answers for: touching it fails at once."""
    store = oncely.open_store(f"redis://127.0.0.1:{_closed_port()}/0")
    with pytest.raises(oncely.StoreUnavailableError):
        store.get("k")  # the proof that any use of it would show
    yield store
    store.close()


def _warned(caplog: pytest.LogCaptureFixture) -> int:
    return sum(WARNING in r.getMessage() for r in caplog.records)


def test_guard(down: Any, caplog: pytest.LogCaptureFixture) -> None:
    ran = []

    async def twice_async() -> None:
        for _ in range(2):
            async with oncely.Guard(down, "r-1", scope="refunds") as guard:
                assert (guard.replayed, guard.token, guard.attempt) == (False, 0, 1)
                ran.append("async")
                await guard.acomplete("done")

    with caplog.at_level(logging.WARNING, logger="oncely"), disabled():
        for _ in range(2):
            with oncely.Guard(down, "r-1", scope="refunds") as guard:
                assert (guard.replayed, guard.token) == (False, 0)
                ran.append("sync")
        with pytest.raises(RuntimeError), oncely.Guard(down, "r-1", scope="refunds"):
            raise RuntimeError("the block fails: nothing is recorded either")
        asyncio.run(twice_async())
    assert ran == ["sync", "sync", "async", "async"]
    assert _warned(caplog) == 5


def test_asgi_middleware(down: Any, caplog: pytest.LogCaptureFixture) -> None:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from oncely.http.asgi import IdempotencyMiddleware

    ran: list[int] = []

    async def pay(request: Request) -> JSONResponse:
        ran.append(1)
        return JSONResponse({"run": len(ran)}, status_code=201)

    app = IdempotencyMiddleware(
        Starlette(routes=[Route("/pay", pay, methods=["POST"])]), store=down
    )

    async def go() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://a") as client:
            return [
                await client.post("/pay", json={}, headers={"idempotency-key": "k"}) for _ in "ab"
            ]

    with caplog.at_level(logging.WARNING, logger="oncely"), disabled():
        answers = asyncio.run(go())
    assert [(a.status_code, a.json()) for a in answers] == [(201, {"run": 1}), (201, {"run": 2})]
    assert "idempotent-replayed" not in answers[1].headers
    assert _warned(caplog) == 2


def test_wsgi_middleware_and_flask(down: Any, caplog: pytest.LogCaptureFixture) -> None:
    from flask import Flask

    from oncely.http.flask import Idempotency

    app = Flask(__name__)
    ran: list[int] = []

    @app.post("/pay")
    def pay() -> tuple[dict[str, int], int]:
        ran.append(1)
        return {"run": len(ran)}, 201

    Idempotency(app, store=down)
    transport = httpx.WSGITransport(app=app)
    with (
        caplog.at_level(logging.WARNING, logger="oncely"),
        disabled(),
        httpx.Client(transport=transport, base_url="http://a") as c,
    ):
        answers = [c.post("/pay", json={}, headers={"idempotency-key": "k"}) for _ in "ab"]
    assert [(a.status_code, a.json()) for a in answers] == [(201, {"run": 1}), (201, {"run": 2})]
    assert _warned(caplog) == 2


def test_client_transport(caplog: pytest.LogCaptureFixture) -> None:
    from oncely.http.client import AsyncIdempotentTransport, IdempotentTransport

    seen: list[str | None] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("idempotency-key"))
        return httpx.Response(503)

    async def send_async() -> int:
        transport = AsyncIdempotentTransport(httpx.MockTransport(answer))
        async with httpx.AsyncClient(transport=transport) as client:
            return (await client.post("http://a/pay", json={})).status_code

    transport = IdempotentTransport(httpx.MockTransport(answer))
    with (
        caplog.at_level(logging.WARNING, logger="oncely"),
        disabled(),
        httpx.Client(transport=transport) as client,
    ):
        assert client.post("http://a/pay", json={}).status_code == 503
        assert asyncio.run(send_async()) == 503
    assert seen == [None, None]  # no key added, not retried
    assert _warned(caplog) == 2


POLICY = ConsumerPolicy(max_attempts=3)


def _delivery(key: str) -> Delivery:
    return Delivery(json.dumps({"key": key}).encode(), {"Idempotency-Key": key}, raw=key)


def test_consumer_runner(down: Any, caplog: pytest.LogCaptureFixture) -> None:
    consumer = IdempotentConsumer(down, scope="billing", policy=POLICY)
    ran: list[str] = []

    def handle(raw: Any = None) -> str:
        ran.append("ran")
        return "charged"

    def fail() -> None:
        raise RuntimeError("fails")

    async def aprocess() -> Any:
        async def ahandle() -> str:
            return handle()

        return await consumer.aprocess(_delivery("m-1"), ahandle)

    with caplog.at_level(logging.WARNING, logger="oncely"), disabled():
        verdicts = [consumer.process(_delivery("m-1"), handle) for _ in "ab"]
        verdicts.append(asyncio.run(aprocess()))
        verdicts += consumer.process_batch([_delivery("m-1"), _delivery("m-2")], handle)
        failed = consumer.process(_delivery("m-1"), fail)
    assert [(v.action, v.reason, v.result) for v in verdicts] == [
        (Action.ACK, Reason.PROCESSED, "charged")
    ] * 5
    assert (failed.action, failed.reason) == (Action.RETRY, Reason.HANDLER_FAILED)
    assert ran == ["ran"] * 5
    assert _warned(caplog) == 6


@pytest.mark.rabbitmq
def test_rabbitmq_adapter(down: Any, caplog: pytest.LogCaptureFixture) -> None:
    import uuid

    import aio_pika

    from oncely.consumers.producer import amqp_message
    from oncely.consumers.rabbitmq import idempotent_handler
    from tests.conftest import service_url

    queue_name = f"oncely-disabled-{uuid.uuid4().hex[:8]}"
    ran: list[str] = []

    async def main() -> list[Any]:
        connection = await aio_pika.connect(service_url("ONCELY_TEST_RABBITMQ_URL"))
        try:
            channel = await connection.channel()
            queue = await channel.declare_queue(queue_name, auto_delete=True)

            @idempotent_handler(down, group="disabled")
            async def handle(message: aio_pika.abc.AbstractIncomingMessage) -> None:
                ran.append(message.body.decode())

            verdicts = []
            for _ in "ab":  # the same message twice
                await channel.default_exchange.publish(
                    amqp_message(b'{"n": 1}', "k-1"), routing_key=queue_name
                )
                message = await queue.get(timeout=10)
                verdicts.append(await handle(message))
            await queue.delete(if_unused=False, if_empty=False)
            return verdicts
        finally:
            await connection.close()

    with caplog.at_level(logging.WARNING, logger="oncely"), disabled():
        verdicts = asyncio.run(main())
    assert [v.reason for v in verdicts] == [Reason.PROCESSED, Reason.PROCESSED]
    assert len(ran) == 2
    assert _warned(caplog) == 2


def test_the_environment_variable_turns_every_entry_point_off(down: Any) -> None:
    """``ONCELY_DISABLED=1`` is read once, at import: a Guard and a consumer in a fresh
    process run unprotected against a store nothing answers for."""
    code = (
        "import sys, oncely\n"
        "from oncely.consumers import Delivery, IdempotentConsumer\n"
        "store = oncely.open_store(sys.argv[1])\n"
        "with oncely.Guard(store, 'k', scope='s') as guard:\n"
        "    print('guard', guard.token)\n"
        "verdict = IdempotentConsumer(store, scope='s').process(\n"
        "    Delivery(b'{}', {'Idempotency-Key': 'k'}), lambda: 'ok')\n"
        "print('consumer', verdict.reason, verdict.result)\n"
    )
    env = {**os.environ, "ONCELY_DISABLED": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code, down.url],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["guard 0", "consumer processed ok"]
    assert done.stderr.count(WARNING) == 2
