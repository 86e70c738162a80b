"""Django's middleware and a streamed response larger than `max_response_bytes`.

A server-sent-events ``StreamingHttpResponse`` to a POST never ends on its own: read whole
before it leaves, it would never be answered. As under the ASGI middleware, a streamed response
over the limit is passed through as it comes (memory bounded by the limit), and its record is
completed with the not-stored marker (a repeat gets 500 ``response-not-stored``, never a rerun).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

import oncely
from oncely.http import HttpPolicy

importlib.import_module("django_app")  # configures Django (the examples' settings)

POLICY = HttpPolicy(max_response_bytes=1024)
CHUNK = b"data: " + b"x" * 500 + b"\n\n"  # three are over the limit


class _Events:
    """An endless event stream: three events at once, then one each time ``more`` is set."""

    def __init__(self) -> None:
        self.runs = 0
        self.more = threading.Event()

    def sync_view(self, request: Any) -> Any:
        from django.http import StreamingHttpResponse

        self.runs += 1

        def events() -> Iterator[bytes]:
            yield from (CHUNK, CHUNK, CHUNK)
            while True:
                self.more.wait()
                self.more.clear()
                yield CHUNK

        return StreamingHttpResponse(events(), content_type="text/event-stream")

    async def async_view(self, request: Any) -> Any:
        from django.http import StreamingHttpResponse

        self.runs += 1

        async def events() -> AsyncIterator[bytes]:
            for _ in range(3):
                yield CHUNK
            while True:
                await asyncio.get_running_loop().run_in_executor(None, self.more.wait, 0.05)
                if self.more.is_set():
                    self.more.clear()
                    yield CHUNK

        return StreamingHttpResponse(events(), content_type="text/event-stream")


def _middleware(view: Any) -> Any:
    from oncely.http.django import IdempotencyMiddleware

    return IdempotencyMiddleware(view, store=oncely.open_store("memory://"), policy=POLICY)


def _code(response: Any) -> str:
    return str(json.loads(response.content)["code"])


@pytest.mark.parametrize("read", ["four-events", "cut-after-one"])
def test_sync_stack_streams_an_endless_response_over_the_limit(read: str) -> None:
    from django.test import RequestFactory

    events = _Events()
    middleware = _middleware(events.sync_view)
    key = str(uuid.uuid4())

    def post() -> Any:
        request = RequestFactory().post(
            "/events", b"{}", content_type="application/json", headers={"Idempotency-Key": key}
        )
        return middleware(request)

    answered: list[Any] = []
    caller = threading.Thread(target=lambda: answered.append(post()), daemon=True)
    caller.start()
    caller.join(timeout=10)  # a safety net: the old code never returned
    events.more.set()  # let a reader stuck in the old code end the stream
    assert answered, "the middleware read the endless stream whole"
    response = answered[0]
    stream = iter(response.streaming_content)
    received = [next(stream)]
    if read == "four-events":
        received += [next(stream), next(stream)]
        events.more.set()
        received.append(next(stream))
    response.close()  # the client leaves: the stream never ends on its own
    assert all(chunk == CHUNK for chunk in received)

    repeat = post()
    assert repeat.status_code == 500
    assert _code(repeat) == "response-not-stored"
    assert events.runs == 1


EVENTS = _Events()


async def _events_view(request: Any) -> Any:
    return await EVENTS.async_view(request)


def _urlpatterns() -> list[Any]:
    from django.urls import path

    return [path("events", _events_view)]


urlpatterns = _urlpatterns()


async def _asgi_post(app: Any, key: str, events: int) -> list[dict[str, Any]]:
    """POST through Django's ASGI handler; the client leaves once *events* body chunks came."""
    sent: list[dict[str, Any]] = []
    gone = asyncio.Event()
    requested = False

    async def receive() -> dict[str, Any]:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": b"{}", "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if sum(1 for m in sent if m.get("body")) >= events:
            gone.set()

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/events",
        "raw_path": b"/events",
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"testserver"),
            (b"content-type", b"application/json"),
            (b"content-length", b"2"),
            (b"idempotency-key", key.encode()),
        ],
        "client": ("127.0.0.1", 40000),
        "server": ("testserver", 80),
    }
    await asyncio.wait_for(app(scope, receive, send), 10)  # a safety net: the old code hung
    return sent


def test_async_stack_streams_an_endless_response_over_the_limit() -> None:
    """Under Django's ASGI handler with an async stack: the events flow as they come, the
    client leaves after the fourth, and the repeat is 500 response-not-stored."""
    from django.core.handlers.asgi import ASGIHandler
    from django.test.utils import override_settings

    EVENTS.runs = 0
    EVENTS.more.clear()
    store = oncely.open_store("memory://")
    settings = {
        "ROOT_URLCONF": __name__,
        "MIDDLEWARE": ["oncely.http.django.IdempotencyMiddleware"],
        "ONCELY_STORE": store,
        "ONCELY_HTTP": POLICY,
    }
    key = str(uuid.uuid4())

    async def main() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        with override_settings(**settings):
            app = ASGIHandler()
            loop = asyncio.get_running_loop()
            loop.call_later(0.2, EVENTS.more.set)  # the fourth event, once three are out
            first = await _asgi_post(app, key, events=4)
            repeat = await _asgi_post(app, key, events=1)
        return first, repeat

    try:
        first, repeat = asyncio.run(main())
    finally:
        EVENTS.more.set()
    assert first[0]["status"] == 200
    assert [m["body"] for m in first if m.get("body")] == [CHUNK] * 4
    assert repeat[0]["status"] == 500
    body = b"".join(m.get("body", b"") for m in repeat)
    assert json.loads(body)["code"] == "response-not-stored"
    assert EVENTS.runs == 1
