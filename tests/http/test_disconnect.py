"""A response cut short after the handler ran: the record is completed, never released.

The HTTP contract (docs/guides/http.md): "handler started sending a response and the client
went away: the record is completed (or marked not replayable), never released, since the
handler ran". The apps here are Starlette and FastAPI endpoints behind the ASGI middleware,
driven in process by a server that plays both disconnect behaviours of the ASGI spec: 2.4
(``send`` raises `OSError` once the client is gone) and 2.3 (``send`` is silently dropped,
``receive`` answers ``http.disconnect`` and Starlette cancels the streaming task).
``test_servers.py`` runs the same story through a real uvicorn process and a client that times
out.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from anyio.from_thread import BlockingPortal

from oncely.http import HttpPolicy
from oncely.http.asgi import IdempotencyMiddleware
from tests.http._harness import FaultyStore, Reply, call_asgi

POLICY = HttpPolicy(lease=5)


@dataclass
class Handlers:
    """What the endpoints did: one entry per execution."""

    executions: list[str] = field(default_factory=list)


def starlette_app(store: FaultyStore, handlers: Handlers, policy: HttpPolicy = POLICY) -> Any:
    from starlette.applications import Starlette
    from starlette.background import BackgroundTask
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    async def stream(request: Request) -> Response:
        handlers.executions.append("stream")

        async def pieces() -> AsyncIterator[bytes]:
            yield b"first;"
            await asyncio.sleep(0)  # a 2.3 server delivers the disconnect here
            yield b"second;"
            yield b"last"

        return StreamingResponse(pieces(), 201, media_type="text/plain")

    async def broken(request: Request) -> Response:
        handlers.executions.append("broken")

        async def pieces() -> AsyncIterator[bytes]:
            yield b"first;"
            raise RuntimeError("the stream broke after the handler ran")

        return StreamingResponse(pieces(), 201, media_type="text/plain")

    async def late(request: Request) -> Response:
        handlers.executions.append("late")

        async def pieces() -> AsyncIterator[bytes]:
            if handlers.executions.count("late") == 1:
                await asyncio.sleep(3600)  # the client leaves before the first chunk
            yield b"at last"

        return StreamingResponse(pieces(), 201, media_type="text/plain")

    async def plain(request: Request) -> Response:
        handlers.executions.append("plain")
        return Response(b"done", 201, media_type="text/plain")

    async def empty(request: Request) -> Response:
        handlers.executions.append("empty")
        return Response(status_code=204)

    async def background(request: Request) -> Response:
        handlers.executions.append("background")

        async def after() -> None:
            raise RuntimeError("the background task failed after the response")

        return Response(b"done", 201, background=BackgroundTask(after))

    routes = [
        Route("/stream", stream, methods=["POST"]),
        Route("/broken", broken, methods=["POST"]),
        Route("/plain", plain, methods=["POST"]),
        Route("/late", late, methods=["POST"]),
        Route("/empty", empty, methods=["POST"]),
        Route("/background", background, methods=["POST"]),
    ]
    return IdempotencyMiddleware(Starlette(routes=routes), store=store, policy=policy)


def fastapi_app(store: FaultyStore, handlers: Handlers, policy: HttpPolicy = POLICY) -> Any:
    from fastapi import FastAPI
    from fastapi.responses import Response, StreamingResponse

    app = FastAPI()

    @app.post("/stream", status_code=201)
    async def stream() -> StreamingResponse:
        handlers.executions.append("stream")

        async def pieces() -> AsyncIterator[bytes]:
            yield b"first;"
            await asyncio.sleep(0)
            yield b"second;"
            yield b"last"

        return StreamingResponse(pieces(), 201, media_type="text/plain")

    @app.post("/plain", status_code=201)
    async def plain() -> Response:
        handlers.executions.append("plain")
        return Response(b"done", 201, media_type="text/plain")

    return IdempotencyMiddleware(app, store=store, policy=policy)


APPS = {"starlette": starlette_app, "fastapi": fastapi_app}


class ClientGone(OSError):
    """What an ASGI 2.4 server's ``send`` raises once the client has disconnected."""


async def cut_short(
    app: Any, path: str, key: str, *, spec: str, messages_before_disconnect: int
) -> list[dict[str, Any]]:
    """Serve one POST whose client disconnects after *messages_before_disconnect* response
    messages; return what the client received. With spec 2.4 the next ``send`` raises; with
    2.3 it is dropped and ``receive`` answers ``http.disconnect``."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": spec},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"testserver"), (b"idempotency-key", key.encode())],
        "client": ("127.0.0.1", 50000),
        "server": ("testserver", 80),
        "state": {},
    }
    request = [{"type": "http.request", "body": b"", "more_body": False}]
    gone = asyncio.Event()
    received: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if request:
            return request.pop()
        if messages_before_disconnect:
            await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if len(received) >= messages_before_disconnect:
            gone.set()
            if spec == "2.4":
                raise ClientGone("the client disconnected")
            return
        received.append(message)
        if len(received) == messages_before_disconnect:
            gone.set()

    try:
        await app(scope, receive, send)
    except Exception:  # what the server logs; the client sees a cut connection
        logging.getLogger("tests.http").info("the ASGI app raised", exc_info=True)
    return received


def problem_code(reply: Reply) -> str:
    assert reply.header("content-type") == "application/problem+json", reply
    return str(json.loads(reply.body)["code"])


@pytest.fixture
def key() -> str:
    return f"cut-{uuid.uuid4()}"


@pytest.mark.parametrize("spec", ["2.3", "2.4"])
@pytest.mark.parametrize("framework", ["starlette", "fastapi"])
def test_streaming_response_cut_by_a_disconnect_is_not_run_again(
    store: FaultyStore, portal: BlockingPortal, key: str, spec: str, framework: str
) -> None:
    """The client leaves after the first chunk; the retry does not run the handler again."""
    handlers = Handlers()
    app = APPS[framework](store, handlers)
    received = portal.call(
        lambda: cut_short(app, "/stream", key, spec=spec, messages_before_disconnect=2)
    )
    assert [m["type"] for m in received] == ["http.response.start", "http.response.body"]

    retry = portal.call(lambda: call_asgi(app, "POST", "/stream", headers=idempotency(key)))

    assert handlers.executions == ["stream"]
    assert store.calls["release"] == 0
    assert retry.status == 500
    assert problem_code(retry) == "response-not-stored"


@pytest.mark.parametrize("framework", ["starlette", "fastapi"])
def test_plain_response_whose_send_fails_is_not_run_again(
    store: FaultyStore, portal: BlockingPortal, key: str, framework: str
) -> None:
    """A whole (non-streaming) response whose ``send`` raises (the client left while the
    handler ran, ASGI 2.4): the response was captured whole, so the retry replays it."""
    handlers = Handlers()
    app = APPS[framework](store, handlers)
    received = portal.call(
        lambda: cut_short(app, "/plain", key, spec="2.4", messages_before_disconnect=0)
    )
    assert received == []

    retry = portal.call(lambda: call_asgi(app, "POST", "/plain", headers=idempotency(key)))

    assert handlers.executions == ["plain"]
    assert store.calls["release"] == 0
    assert (retry.status, retry.body, retry.replayed) == (201, b"done", True)


def test_stream_cut_before_its_first_chunk_is_not_run_again(
    store: FaultyStore, portal: BlockingPortal, key: str
) -> None:
    """ASGI 2.3: the endpoint returned a StreamingResponse (it ran) and the client left before
    the first chunk; Starlette cancels the stream. The app had started its response, so the
    record is completed as not replayable."""
    handlers = Handlers()
    app = starlette_app(store, handlers)
    received = portal.call(
        lambda: cut_short(app, "/late", key, spec="2.3", messages_before_disconnect=0)
    )
    assert received == []

    retry = portal.call(lambda: call_asgi(app, "POST", "/late", headers=idempotency(key)))

    assert handlers.executions == ["late"]
    assert store.calls["release"] == 0
    assert retry.status == 500
    assert problem_code(retry) == "response-not-stored"


def test_exception_mid_stream_is_not_run_again(
    store: FaultyStore, portal: BlockingPortal, key: str
) -> None:
    """The app raised after it started answering: the client got part of a 201, so the handler
    ran; a retry answers ``response-not-stored`` rather than running it again."""
    handlers = Handlers()
    app = starlette_app(store, handlers)
    received = portal.call(
        lambda: cut_short(app, "/broken", key, spec="2.4", messages_before_disconnect=10)
    )
    assert received[0]["status"] == 201

    retry = portal.call(lambda: call_asgi(app, "POST", "/broken", headers=idempotency(key)))

    assert handlers.executions == ["broken"]
    assert retry.status == 500
    assert problem_code(retry) == "response-not-stored"


@pytest.mark.parametrize("path", ["/empty", "/background"])
def test_bodyless_and_background_responses_replay(
    store: FaultyStore, portal: BlockingPortal, key: str, path: str
) -> None:
    """A 204 without a body, and a response whose background task fails after it was sent,
    are stored and replayed: the handler runs once."""
    handlers = Handlers()
    app = starlette_app(store, handlers)
    first = portal.call(lambda: call_asgi(app, "POST", path, headers=idempotency(key)))
    second = portal.call(lambda: call_asgi(app, "POST", path, headers=idempotency(key)))

    assert len(handlers.executions) == 1
    assert second.replayed
    assert (second.status, second.body) == (first.status, first.body)


def idempotency(key: str) -> list[tuple[bytes, bytes]]:
    return [(b"idempotency-key", key.encode())]


class _SlowComplete:
    """A memory store whose ``acomplete`` waits until the test lets it answer."""

    def __init__(self) -> None:
        import oncely

        self.inner = oncely.open_store("memory://")
        self.entered = asyncio.Event()
        self.proceed = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def acomplete(self, key: str, token: int, result: bytes, *, ttl: Any) -> Any:
        self.entered.set()
        await self.proceed.wait()
        return await self.inner.acomplete(key, token, result, ttl=ttl)


def test_cancellation_while_completing_still_completes(key: str) -> None:
    """ASGI 2.3: the client leaves while the last chunk's record is being completed, and
    Starlette cancels the streaming task. The completion still reaches the store, so the
    retry replays instead of waiting out the lease and running the handler again."""

    async def scenario() -> tuple[Reply, Handlers]:
        store = _SlowComplete()
        handlers = Handlers()
        app = starlette_app(store, handlers)  # type: ignore[arg-type]
        scope_messages: list[dict[str, Any]] = []
        request = [{"type": "http.request", "body": b"", "more_body": False}]

        async def receive() -> dict[str, Any]:
            if request:
                return request.pop()
            await store.entered.wait()  # the last chunk is being settled: the client leaves
            asyncio.get_running_loop().call_later(0.1, store.proceed.set)
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            scope_messages.append(message)

        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/stream",
            "raw_path": b"/stream",
            "query_string": b"",
            "root_path": "",
            "headers": [(b"host", b"testserver"), *idempotency(key)],
            "client": ("127.0.0.1", 50000),
            "server": ("testserver", 80),
            "state": {},
        }
        await app(scope, receive, send)
        retry = await call_asgi(app, "POST", "/stream", headers=idempotency(key))
        return retry, handlers

    retry, handlers = asyncio.run(scenario())

    assert handlers.executions == ["stream"]
    assert retry.replayed
    assert (retry.status, retry.body) == (201, b"first;second;last")


def test_response_with_trailers_is_settled_after_them(
    store: FaultyStore, portal: BlockingPortal, key: str
) -> None:
    """A response that declares trailers (``http.response.trailers``) is complete only with
    them; they are not stored, so repeats answer ``response-not-stored`` instead of a replay
    that silently drops them, and the handler runs once."""
    handlers = Handlers()

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        handlers.executions.append("trailers")
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"trailer", b"grpc-status")],
                "trailers": True,
            }
        )
        await send({"type": "http.response.body", "body": b"payload"})
        await send({"type": "http.response.trailers", "headers": [(b"grpc-status", b"0")]})

    app = IdempotencyMiddleware(inner, store=store, policy=POLICY)
    sent: list[dict[str, Any]] = []

    async def drive() -> None:
        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.4"},
            "method": "POST",
            "path": "/grpc",
            "query_string": b"",
            "headers": idempotency(key),
            "extensions": {"http.response.trailers": {}},
        }
        await app(scope, receive, send)

    portal.call(drive)
    assert [m["type"] for m in sent] == [
        "http.response.start",
        "http.response.body",
        "http.response.trailers",
    ]
    retry = portal.call(lambda: call_asgi(app, "POST", "/grpc", headers=idempotency(key)))

    assert handlers.executions == ["trailers"]
    assert retry.status == 500
    assert problem_code(retry) == "response-not-stored"


def test_settling_again_after_a_cancellation_skips_an_applied_settle(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A cancelled settle may have been applied before the cancellation: running it again
    then does nothing (rather than finding the lease gone and logging it as lost)."""
    import oncely
    from oncely import _execution
    from oncely.http import _flow
    from oncely.http._semantics import ResponseCapture

    store = oncely.open_store("memory://")
    capture = ResponseCapture(1024)
    capture.start(201, [], POLICY)
    capture.add(b"done")
    capture.complete = True
    lease = _execution.run(_execution.acquire("k", "fp", POLICY.core), store)
    assert isinstance(lease, _execution.Lease)
    _execution.run(_flow.finish(lease, capture, POLICY), store)
    with caplog.at_level(logging.ERROR, logger="oncely"):
        _execution.run(_flow.settle_again(lease, _flow.finish(lease, capture, POLICY)), store)

    assert caplog.records == []
    assert not lease.lost
    record = store.get("k")
    assert record is not None
    assert record.status.value == "completed"
