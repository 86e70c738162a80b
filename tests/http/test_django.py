"""`oncely.http.django.IdempotencyMiddleware` in the mode of Django's stack.

The HTTP suite (``test_http.py``) runs both modes against every store (``django-middleware``:
a sync stack under WSGI; ``django-async``: an async stack with async views under ASGI); here
are what only Django has: the mode follows the stack, the async mode reads the user with
``request.auser()``, and the URLconf a middleware sets on the request routes the options.
"""

from __future__ import annotations

import importlib
import threading
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from asgiref.sync import markcoroutinefunction
from django.http import HttpRequest, JsonResponse
from django.urls import path

import oncely
from oncely import ClaimResult, LeaseLost, Record
from oncely.errors import ConfigurationError
from oncely.http import idempotent_route

PAYMENT = {"amount": 5, "currency": "EUR"}

importlib.import_module("django_app")  # configures Django (the examples' settings)


@idempotent_route(require_key=True)
def only_here(request: HttpRequest) -> JsonResponse:
    """A view only this module's URLconf routes to."""
    return JsonResponse({"ok": True}, status=201)


urlpatterns = [path("only-here", only_here)]


class _AsyncOnlyStore:
    """A store with the async verbs only, recording the threads they are awaited on."""

    def __init__(self, inner: oncely.Store) -> None:
        self.inner = inner
        self.threads: set[int] = set()

    async def aclaim(
        self, key: str, fingerprint: str, *, lease: timedelta, ttl: timedelta
    ) -> ClaimResult:
        self.threads.add(threading.get_ident())
        return await self.inner.aclaim(key, fingerprint, lease=lease, ttl=ttl)

    async def acomplete(
        self, key: str, token: int, result: bytes, *, ttl: timedelta
    ) -> LeaseLost | None:
        self.threads.add(threading.get_ident())
        return await self.inner.acomplete(key, token, result, ttl=ttl)

    async def afail(
        self, key: str, token: int, error: bytes, *, ttl: timedelta
    ) -> LeaseLost | None:
        return await self.inner.afail(key, token, error, ttl=ttl)

    async def arelease(self, key: str, token: int) -> LeaseLost | None:
        return await self.inner.arelease(key, token)

    async def aextend(self, key: str, token: int, *, lease: timedelta) -> LeaseLost | None:
        return await self.inner.aextend(key, token, lease=lease)

    async def aget(self, key: str) -> Record | None:
        return await self.inner.aget(key)

    async def aclose(self) -> None:
        await self.inner.aclose()


class _LazyUserMiddleware:
    """Like Django's AuthenticationMiddleware in an async stack: ``request.user`` may not be
    read on the event loop (it would load the session synchronously); ``request.auser()``
    gives the user named by ``X-User``."""

    sync_capable = False
    async_capable = True

    def __init__(self, get_response: Callable[[Any], Any]) -> None:
        self.get_response = get_response
        markcoroutinefunction(self)

    async def __call__(self, request: Any) -> Any:
        users = importlib.import_module("django_middleware_app")
        name = request.headers.get("x-user")

        async def auser() -> Any:
            return users.HeaderUser(name) if name else None

        request.user, request.auser = _Unreadable(), auser
        return await self.get_response(request)


class _Unreadable:
    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"request.user.{name} read in an async stack")


class _OwnUrlconfMiddleware:
    """Routes requests through this module's URLconf, as hosts-based routing does."""

    def __init__(self, get_response: Callable[[Any], Any]) -> None:
        self.get_response = get_response

    def __call__(self, request: Any) -> Any:
        request.urlconf = __name__
        return self.get_response(request)


def _asgi_app(middleware: list[str], store: object, ledger_path: Path) -> Any:
    from django.core.handlers.asgi import ASGIHandler
    from django.test.utils import override_settings

    django_app = importlib.import_module("django_app")
    django_app.LEDGER = importlib.import_module("_payments").Ledger(ledger_path)
    django_app.ASGI = True
    with override_settings(MIDDLEWARE=middleware, ONCELY_STORE=store, ONCELY_HTTP=None):
        return ASGIHandler()


def _post_all(app: Any, requests: list[tuple[str, dict[str, str]]]) -> list[httpx.Response]:
    async def go() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            return [await client.post(url, json=PAYMENT, headers=h) for url, h in requests]

    return anyio.run(go)


def test_async_stack_awaits_the_async_verbs_on_the_event_loop(tmp_path: Path) -> None:
    """With async views, Django builds an async stack: the middleware needs only the store's
    async verbs and awaits them on the loop's thread (no thread per request)."""
    module = importlib.import_module("django_async_app")
    store = _AsyncOnlyStore(oncely.open_store("memory://"))
    app = _asgi_app(module.MIDDLEWARE, store, tmp_path / "payments.db")
    # A user, else the cookie the first answer sets would make the repeat another principal's.
    key = {"idempotency-key": str(uuid.uuid4()), "x-user": "alice"}
    loop_thread: list[int] = []

    async def go() -> list[httpx.Response]:
        loop_thread.append(threading.get_ident())
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            return [await client.post("/payments", json=PAYMENT, headers=key) for _ in "ab"]

    first, again = anyio.run(go)

    assert (first.status_code, again.status_code) == (201, 201)
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert store.threads == set(loop_thread)


def test_async_stack_reads_the_user_with_auser(tmp_path: Path) -> None:
    """In an async stack the principal comes from ``await request.auser()``: another user with
    the same key and body is refused, one user's repeat replays."""
    module = importlib.import_module("django_async_app")
    middleware = [
        f"{module.__name__}.AsyncViewsMiddleware",
        f"{__name__}._LazyUserMiddleware",
        "oncely.http.django.IdempotencyMiddleware",
    ]
    app = _asgi_app(middleware, oncely.open_store("memory://"), tmp_path / "payments.db")
    key = str(uuid.uuid4())
    alice, bob, again = _post_all(
        app,
        [
            ("/payments", {"idempotency-key": key, "x-user": user})
            for user in ("alice", "bob", "alice")
        ],
    )

    assert (alice.status_code, bob.status_code, again.status_code) == (201, 422, 201)
    assert bob.json()["code"] == "idempotency-key-owned-by-another-principal"
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == alice.content
    assert importlib.import_module("django_app").LEDGER.count() == 1


def test_store_without_the_verbs_of_the_stack_is_a_configuration_error(tmp_path: Path) -> None:
    from django.core.handlers.wsgi import WSGIHandler
    from django.test.utils import override_settings

    module = importlib.import_module("django_async_app")
    async_only = _AsyncOnlyStore(oncely.open_store("memory://"))
    with (
        override_settings(
            MIDDLEWARE=["oncely.http.django.IdempotencyMiddleware"], ONCELY_STORE=async_only
        ),
        pytest.raises(ConfigurationError, match="has no sync verbs"),
    ):
        WSGIHandler()

    class SyncOnly:
        def claim(self, *args: Any, **kwargs: Any) -> Any: ...
        def complete(self, *args: Any, **kwargs: Any) -> Any: ...
        def fail(self, *args: Any, **kwargs: Any) -> Any: ...
        def release(self, *args: Any, **kwargs: Any) -> Any: ...
        def extend(self, *args: Any, **kwargs: Any) -> Any: ...
        def get(self, *args: Any, **kwargs: Any) -> Any: ...
        def close(self) -> None: ...

    with pytest.raises(ConfigurationError, match="has no async verbs"):
        _asgi_app(module.MIDDLEWARE, SyncOnly(), tmp_path / "payments.db")


@pytest.mark.parametrize("stack", ["sync", "async"])
def test_the_urlconf_a_middleware_sets_routes_the_options(stack: str, tmp_path: Path) -> None:
    """A middleware that sets ``request.urlconf`` (hosts-based routing) routes the request,
    and so its view's `idempotent_route` options: here a key is required."""
    middleware = [f"{__name__}._OwnUrlconfMiddleware", "oncely.http.django.IdempotencyMiddleware"]
    store = oncely.open_store("memory://")
    if stack == "async":
        app = _asgi_app(middleware, store, tmp_path / "payments.db")
        (missing,) = _post_all(app, [("/only-here", {})])
        status, body = missing.status_code, missing.json()
    else:
        from django.test import Client
        from django.test.utils import override_settings

        with override_settings(MIDDLEWARE=middleware, ONCELY_STORE=store, ONCELY_HTTP=None):
            response = Client().post("/only-here", PAYMENT, content_type="application/json")
        status, body = response.status_code, response.json()

    assert status == 400
    assert body["code"] == "idempotency-key-missing"
