"""A request cancelled while its claim is in flight gives the lease back (ASGI, Django async).

The server cancels the request's task (its client left, a timeout) after the claim was applied
and before its reply arrived: nothing ran, so the lease is released before the cancellation
propagates, and the client's retry runs at once instead of getting 409 for a whole lease.
"""

from __future__ import annotations

import asyncio
import importlib
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from oncely.http import HttpPolicy
from oncely.http.asgi import IdempotencyMiddleware as AsgiMiddleware
from tests._gated import GatedClaims

BODY = b'{"amount": 500, "currency": "EUR"}'
POLICY = HttpPolicy(lease=30)


def _asgi(store: GatedClaims, runs: list[str]) -> Callable[[str], Awaitable[int]]:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        runs.append(scope["path"])
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"charged"})

    middleware = AsgiMiddleware(app, store=store, policy=POLICY)

    async def post(key: str) -> int:
        sent: list[dict[str, Any]] = []
        scope = {
            "type": "http",
            "method": "POST",
            "path": "/payments",
            "headers": [(b"idempotency-key", key.encode()), (b"content-type", b"application/json")],
        }

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": BODY, "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await middleware(scope, receive, send)
        return int(sent[0]["status"])

    return post


def _django(store: GatedClaims, runs: list[str]) -> Callable[[str], Awaitable[int]]:
    importlib.import_module("django_app")  # configures Django (the examples' settings)
    from django.http import HttpResponse
    from django.test import AsyncRequestFactory
    from django.test.utils import override_settings

    from oncely.http.django import IdempotencyMiddleware

    async def view(request: Any) -> Any:
        runs.append(request.path)
        return HttpResponse(b"charged", status=201)

    with override_settings(ONCELY_HTTP=None, ONCELY_HTTP_ROUTES=None):
        middleware = IdempotencyMiddleware(view, store=store, policy=POLICY)
    factory = AsyncRequestFactory()

    async def post(key: str) -> int:
        request = factory.post(
            "/payments", BODY, content_type="application/json", headers={"Idempotency-Key": key}
        )
        response = await middleware(request)
        return int(response.status_code)

    return post


@pytest.mark.parametrize("entry", ["asgi", "django-async"])
def test_a_request_cancelled_while_its_claim_is_in_flight_releases_the_lease(entry: str) -> None:
    async def main() -> tuple[list[int], list[str]]:
        store = GatedClaims()
        runs: list[str] = []
        post = (_asgi if entry == "asgi" else _django)(store, runs)
        key = str(uuid.uuid4())
        task = asyncio.ensure_future(post(key))
        await store.sent.wait()
        task.cancel()
        store.open()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert runs == []
        return [await post(key), await post(key)], runs

    statuses, runs = asyncio.run(main())
    assert statuses == [201, 201]
    assert runs == ["/payments"]
