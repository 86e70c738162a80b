"""FastAPI: a route's key owned by the app's own current-user dependency
(`oncely.http.fastapi.idempotent_for` under ``HttpPolicy(principal=FROM_DEPENDENCY)``).

The app authenticates in a dependency, which runs after every middleware: the middleware parks
the request, and the dependency claims its key with the owner the user names, before the
handler runs.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel

import oncely
import oncely.observe
from oncely._core.keys import scope_key
from oncely._core.records import Status
from oncely.errors import ConfigurationError
from oncely.http import HttpPolicy, RouteOptions
from oncely.http.asgi import IdempotencyMiddleware
from oncely.http.fastapi import FROM_DEPENDENCY, default_principal, idempotent_for
from oncely.http.wsgi import IdempotencyMiddleware as WsgiMiddleware
from oncely.stores.memory import MemoryStore
from tests.http.conftest import LEASE

pytestmark = pytest.mark.store_independent

PAYMENT = {"amount": 500, "currency": "EUR"}
OWNED = "idempotency-key-owned-by-another-principal"
TOKENS = {"alice-token": "alice", "alice-token-refreshed": "alice", "bob-token": "bob"}
RECORD = scope_key("POST /payments", "k1")


def _user_of(request: Request) -> str | None:
    authorization = request.headers.get("authorization", "")
    user = TOKENS.get(authorization.removeprefix("Bearer "))
    if user is None and request.cookies.get("session") == "alice-session":
        user = "alice"
    return user


def sync_user(request: Request) -> str:
    """The app's current-user dependency (sync: FastAPI runs it in a thread)."""
    user = _user_of(request)
    if user is None:
        raise HTTPException(401)
    return user


async def async_user(request: Request) -> str:
    """The same, async."""
    return sync_user(request)


class Payments:
    """A FastAPI payments app whose route is protected through the dependency."""

    def __init__(
        self,
        current_user: Callable[..., Any] = sync_user,
        *,
        policy: HttpPolicy | None = None,
        protected: bool = True,
        middleware: bool = True,
        catch_all: bool = False,
        status: int = 201,
        routes: dict[str, RouteOptions] | None = None,
        outside: bool = False,
    ) -> None:
        self.store = MemoryStore()
        self.charges: list[str] = []
        self.caught: list[str] = []
        self.leases: list[Any] = []
        self.entered = asyncio.Event()
        self.proceed: asyncio.Event | None = None
        self.status = status
        app = FastAPI()
        extra = [Depends(idempotent_for(current_user))] if protected else []

        @app.post("/payments", status_code=201, dependencies=extra)
        async def pay(response: Response, user: str = Depends(current_user)) -> dict[str, Any]:
            self.charges.append(user)
            self.leases.append(oncely.current_lease())
            self.entered.set()
            if self.proceed is not None:
                await self.proceed.wait()
            response.status_code = self.status
            return {"charge": len(self.charges), "user": user}

        if catch_all:

            @app.exception_handler(Exception)
            async def everything(request: Request, exc: Exception) -> JSONResponse:
                self.caught.append(type(exc).__name__)
                return JSONResponse({"caught": type(exc).__name__}, status_code=500)

        self.app: Any = app
        if outside:  # around the whole app: FastAPI's error middleware runs inside it
            self.app = IdempotencyMiddleware(
                app, store=self.store, policy=HttpPolicy(lease=LEASE, principal=FROM_DEPENDENCY)
            )
        elif middleware:
            app.add_middleware(
                IdempotencyMiddleware,
                store=self.store,
                policy=policy or HttpPolicy(lease=LEASE, principal=FROM_DEPENDENCY),
                routes=routes,
            )

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://a")

    async def pay(
        self, client: httpx.AsyncClient, token: str | None, key: str | None = "k1", **kw: Any
    ) -> httpx.Response:
        headers = {"idempotency-key": key} if key else {}
        if token is not None:
            headers["authorization"] = f"Bearer {token}"
        return await client.post("/payments", json=PAYMENT, headers=headers, **kw)

    def attempts(self, *tokens: str | None) -> list[httpx.Response]:
        async def go() -> list[httpx.Response]:
            async with self.client() as client:
                return [await self.pay(client, token) for token in tokens]

        return asyncio.run(go())


@pytest.mark.parametrize("current_user", [sync_user, async_user], ids=["sync", "async"])
def test_token_refresh_replays_the_first_response(current_user: Callable[..., Any]) -> None:
    app = Payments(current_user)
    first, again = app.attempts("alice-token", "alice-token-refreshed")
    assert first.status_code == 201
    assert "idempotent-replayed" not in first.headers
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content == b'{"charge":1,"user":"alice"}'
    assert app.charges == ["alice"]
    assert [lease.key for lease in app.leases] == [RECORD]  # the handler runs under the lease
    assert oncely.current_lease() is None


@pytest.mark.parametrize("current_user", [sync_user, async_user], ids=["sync", "async"])
def test_another_user_with_the_same_key_is_refused(current_user: Callable[..., Any]) -> None:
    app = Payments(current_user)
    _, bob, again = app.attempts("alice-token", "bob-token", "alice-token")
    assert bob.status_code == 422
    assert bob.headers["content-type"] == "application/problem+json"
    assert bob.json()["code"] == OWNED
    assert again.headers["idempotent-replayed"] == "true"
    assert app.charges == ["alice"]


def test_concurrent_duplicate_gets_409_and_runs_once() -> None:
    app = Payments()

    async def go() -> tuple[httpx.Response, httpx.Response]:
        app.proceed = asyncio.Event()
        async with app.client() as client:
            first = asyncio.ensure_future(app.pay(client, "alice-token"))
            await asyncio.wait_for(app.entered.wait(), 10)
            duplicate = await app.pay(client, "alice-token-refreshed")
            app.proceed.set()
            return await first, duplicate

    first, duplicate = asyncio.run(go())
    assert (first.status_code, duplicate.status_code) == (201, 409)
    assert duplicate.headers["retry-after"] == "1"
    assert app.charges == ["alice"]


def test_server_error_releases_the_key() -> None:
    app = Payments(status=503)
    first = app.attempts("alice-token")[0]
    assert first.status_code == 503
    app.status = 201
    again = app.attempts("alice-token-refreshed")[0]
    assert again.status_code == 201
    assert "idempotent-replayed" not in again.headers
    assert app.charges == ["alice", "alice"]


def test_auth_failure_claims_nothing(caplog: pytest.LogCaptureFixture) -> None:
    app = Payments()
    with caplog.at_level(logging.WARNING, logger="oncely.http"):
        refused, *_ = app.attempts(None)
    assert not caplog.records  # the route has the dependency: its own 401 came first
    assert refused.status_code == 401
    assert refused.json() == {"detail": "Unauthorized"}
    assert app.store.get(RECORD) is None
    assert app.charges == []
    ok = app.attempts("alice-token")[0]
    assert ok.status_code == 201
    assert "idempotent-replayed" not in ok.headers


@pytest.mark.parametrize("outside", [False, True], ids=["add_middleware", "around-the-app"])
def test_catch_all_exception_handler_never_sees_a_refusal(outside: bool) -> None:
    """An app-wide ``exception_handler(Exception)`` never sees the refusal, wherever the
    middleware sits: it stops the handler as a FastAPI ``HTTPException``, which FastAPI answers
    itself, and the middleware answers in its place."""
    app = Payments(catch_all=True, outside=outside)
    first, again, bob = app.attempts("alice-token", "alice-token-refreshed", "bob-token")
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert bob.json()["code"] == OWNED
    assert app.charges == ["alice"]
    assert app.caught == []


def test_cancelled_after_the_claim_releases_the_key() -> None:
    """The request is cancelled (the server stops it, the client left) while the handler runs,
    before it answered: the key is released, as for a claim made up front, never left in
    progress for a lease."""
    app = Payments()

    async def go() -> tuple[Any, httpx.Response]:
        app.proceed = asyncio.Event()
        async with app.client() as client:
            task = asyncio.ensure_future(app.pay(client, "alice-token"))
            await asyncio.wait_for(app.entered.wait(), 10)
            in_flight = await app.store.aget(RECORD)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            app.proceed = None
            return in_flight, await app.pay(client, "alice-token-refreshed")

    in_flight, retry = asyncio.run(go())
    assert in_flight is not None
    assert in_flight.status is Status.IN_PROGRESS
    assert retry.status_code == 201
    assert app.charges == ["alice", "alice"]


def test_anonymous_first_response_answers_the_retry_with_its_cookie() -> None:
    """An optional-auth route: the first attempt is anonymous and its response sets the
    session cookie; the retry carries it and is a user now, and is replayed, not run."""
    store = MemoryStore()
    charges: list[str | None] = []
    app = FastAPI()

    def maybe_user(request: Request) -> str | None:
        return _user_of(request)

    @app.post("/payments", status_code=201, dependencies=[Depends(idempotent_for(maybe_user))])
    def pay(response: Response, user: str | None = Depends(maybe_user)) -> dict[str, Any]:
        charges.append(user)
        response.set_cookie("session", "alice-session")
        return {"charge": len(charges)}

    app.add_middleware(
        IdempotencyMiddleware, store=store, policy=HttpPolicy(principal=FROM_DEPENDENCY)
    )

    async def go() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://a") as client:
            headers = {"idempotency-key": "k1"}
            first = await client.post("/payments", json=PAYMENT, headers=headers)
            again = await client.post("/payments", json=PAYMENT, headers=headers)  # cookie jar
            bob = await client.post(
                "/payments",
                json={"amount": 1},
                headers={**headers, "authorization": "Bearer bob-token"},
            )
            return [first, again, bob]

    first, again, bob = asyncio.run(go())
    assert first.headers["set-cookie"].startswith("session=alice-session")
    assert again.headers["idempotent-replayed"] == "true"
    assert "set-cookie" not in again.headers
    assert again.content == first.content
    assert bob.json()["code"] == "idempotency-key-reused"
    assert charges == [None]


def test_required_principal_refuses_a_user_that_names_nobody() -> None:
    policy = HttpPolicy(principal=FROM_DEPENDENCY, require_principal=True)
    store = MemoryStore()
    app = FastAPI()
    charges: list[str] = []

    def nobody(request: Request) -> str:
        return ""

    @app.post("/payments", dependencies=[Depends(idempotent_for(nobody))])
    def pay() -> dict[str, str]:
        charges.append("ran")
        return {}

    app.add_middleware(IdempotencyMiddleware, store=store, policy=policy)
    reply = asyncio.run(_post(app, {"idempotency-key": "k1"}))
    assert reply.status_code == 401
    assert reply.json()["code"] == "principal-required"
    assert charges == []


def test_route_without_the_dependency_passes_through_and_warns_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = Payments(protected=False)
    with caplog.at_level(logging.WARNING, logger="oncely.http"):
        first, again = app.attempts("alice-token", "alice-token")
    assert (first.status_code, again.status_code) == (201, 201)
    assert "idempotent-replayed" not in again.headers
    assert app.charges == ["alice", "alice"]
    warnings = [r.getMessage() for r in caplog.records if "UNPROTECTED" in r.getMessage()]
    assert len(warnings) == 1
    assert "POST /payments" in warnings[0]
    assert "idempotent_for" in warnings[0]


def test_requests_the_middleware_does_not_claim_run_as_usual() -> None:
    """No key, a safe method on a router-wide dependency: the handler runs, nothing stored."""
    store = MemoryStore()
    router = APIRouter(dependencies=[Depends(idempotent_for(async_user))])
    seen: list[str] = []

    @router.get("/payments")
    def listing(user: str = Depends(async_user)) -> list[str]:
        return seen

    @router.post("/payments")
    def pay(user: str = Depends(async_user)) -> dict[str, str]:
        seen.append(user)
        return {"user": user}

    app = FastAPI()
    app.include_router(router)
    app.add_middleware(
        IdempotencyMiddleware, store=store, policy=HttpPolicy(principal=FROM_DEPENDENCY)
    )

    async def go() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://a") as client:
            auth = {"authorization": "Bearer alice-token"}
            return [
                await client.post("/payments", json=PAYMENT, headers=auth),
                await client.post("/payments", json=PAYMENT, headers=auth),
                await client.get("/payments", headers=auth),
            ]

    first, second, listed = asyncio.run(go())
    assert (first.status_code, second.status_code, listed.status_code) == (200, 200, 200)
    assert listed.json() == ["alice", "alice"]


@pytest.mark.parametrize(
    ("middleware", "policy"),
    [(False, None), (True, HttpPolicy(lease=LEASE))],
    ids=["no-middleware", "policy-not-in-that-mode"],
)
def test_dependency_without_its_middleware_is_a_configuration_error(
    middleware: bool, policy: HttpPolicy | None
) -> None:
    app = Payments(middleware=middleware, policy=policy)
    with pytest.raises(ConfigurationError, match="FROM_DEPENDENCY"):
        app.attempts("alice-token")
    assert app.charges == []


def test_route_option_puts_one_route_in_that_mode() -> None:
    only = {"POST /payments": RouteOptions(principal=FROM_DEPENDENCY)}
    app = Payments(policy=HttpPolicy(lease=LEASE), routes=only)
    _, again = app.attempts("alice-token", "alice-token-refreshed")
    assert again.headers["idempotent-replayed"] == "true"
    assert app.charges == ["alice"]


def test_other_middlewares_refuse_the_mode_clearly() -> None:
    def wsgi_app(environ: Any, start_response: Any) -> list[bytes]:
        start_response("201 Created", [])
        return [b""]

    app = WsgiMiddleware(
        wsgi_app, store=oncely.open_store("memory://"), policy=HttpPolicy(principal=FROM_DEPENDENCY)
    )
    environ = {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": "/payments",
        "HTTP_IDEMPOTENCY_KEY": "k1",
        "CONTENT_LENGTH": "0",
        "wsgi.input": __import__("io").BytesIO(b""),
    }
    with pytest.raises(ConfigurationError, match="ASGI middleware"):
        app(environ, lambda *args: lambda data: None)


async def _post(app: Any, headers: dict[str, str]) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://a") as client:
        return await client.post("/payments", json=PAYMENT, headers=headers)


class _User:
    def __init__(self, ident: int) -> None:
        self.id = ident


def test_default_principal() -> None:
    assert default_principal("alice") == "alice"
    assert default_principal("") is None
    assert default_principal(None) is None
    assert default_principal(_User(7)) == "7"
    with pytest.raises(ConfigurationError, match="principal="):
        default_principal(object())
    with pytest.raises(ConfigurationError):
        idempotent_for(sync_user, principal="id")  # type: ignore[arg-type]


def test_client_gone_after_the_claim_runs_once_over_a_socket() -> None:
    """uvicorn: the client gives up while the handler runs (a read timeout) and retries with a
    refreshed token. The handler finishes for the client that left, its response is stored,
    and the retry replays it: the payment ran once."""
    store = MemoryStore()
    charges: list[str] = []
    release = threading.Event()
    app = FastAPI()

    @app.post("/payments", status_code=201, dependencies=[Depends(idempotent_for(async_user))])
    async def pay(user: str = Depends(async_user)) -> dict[str, Any]:
        charges.append(user)
        await asyncio.to_thread(release.wait, 30)
        return {"charge": len(charges), "user": user}

    app.add_middleware(
        IdempotencyMiddleware, store=store, policy=HttpPolicy(principal=FROM_DEPENDENCY)
    )
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        with httpx.Client(base_url=base, timeout=httpx.Timeout(10, read=0.3)) as client:
            headers = {"idempotency-key": "k1", "authorization": "Bearer alice-token"}
            with pytest.raises(httpx.ReadTimeout):
                client.post("/payments", json=PAYMENT, headers=headers)
        assert charges == ["alice"]  # claimed and running when the client left
        release.set()
        deadline = time.monotonic() + 30  # a safety net: the handler finishes at once
        while (record := store.get(RECORD)) is None or record.status is Status.IN_PROGRESS:
            assert time.monotonic() < deadline, record
            time.sleep(0.01)
        with httpx.Client(base_url=base, timeout=10) as client:
            headers["authorization"] = "Bearer alice-token-refreshed"
            retry = client.post("/payments", json=PAYMENT, headers=headers)
    finally:
        release.set()
        server.should_exit = True
        thread.join(30)
        sock.close()
    assert retry.status_code == 201
    assert retry.headers["idempotent-replayed"] == "true"
    assert retry.json() == {"charge": 1, "user": "alice"}
    assert charges == ["alice"]


class Order(BaseModel):
    amount: int


def test_body_reaches_the_handler_and_an_invalid_one_releases_the_key() -> None:
    """The handler reads the body the middleware fingerprinted; a body FastAPI refuses (422,
    after the dependency claimed) releases the key, so the corrected request runs."""
    store = MemoryStore()
    amounts: list[int] = []
    app = FastAPI()

    @app.post("/payments", status_code=201, dependencies=[Depends(idempotent_for(sync_user))])
    def pay(order: Order) -> dict[str, int]:
        amounts.append(order.amount)
        return {"amount": order.amount}

    app.add_middleware(
        IdempotencyMiddleware, store=store, policy=HttpPolicy(principal=FROM_DEPENDENCY)
    )

    async def go() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://a") as client:
            headers = {"idempotency-key": "k1", "authorization": "Bearer alice-token"}
            return [
                await client.post("/payments", json={"amount": "lots"}, headers=headers),
                await client.post("/payments", json={"amount": 5}, headers=headers),
                await client.post("/payments", json={"amount": 5}, headers=headers),
            ]

    invalid, first, again = asyncio.run(go())
    assert invalid.status_code == 422
    assert "idempotency" not in invalid.text
    assert (first.status_code, first.json()) == (201, {"amount": 5})
    assert again.headers["idempotent-replayed"] == "true"
    assert amounts == [5]


def test_each_outcome_is_reported_to_the_event_stream() -> None:
    """The claim made in the dependency is observed like one made up front."""
    app = Payments()

    async def go() -> list[Any]:
        with oncely.observe.outcomes() as seen:
            async with app.client() as client:
                for token in ("alice-token", "alice-token-refreshed", "bob-token"):
                    await app.pay(client, token)
        return seen

    seen = asyncio.run(go())
    assert [(event.surface, event.outcome) for event in seen] == [
        ("http", "acquired"),
        ("http", "replayed"),
        ("http", "mismatch"),
    ]
    assert seen[0].operation == "POST /payments"
    assert seen[2].detail == "422"


def test_an_http_middleware_between_runs_the_app_in_its_own_task() -> None:
    """``@app.middleware("http")`` inside oncely's runs the app in a task of its own: the
    dependency's claim and the handler's lease live there, and the response still settles."""
    app = Payments()

    @app.app.middleware("http")
    async def timing(request: Request, call_next: Any) -> Any:
        response = await call_next(request)
        response.headers["x-timing"] = "1"
        return response

    app.app.user_middleware.reverse()  # oncely's outside, the http middleware inside it
    first, again, bob = app.attempts("alice-token", "alice-token-refreshed", "bob-token")
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert again.headers["x-timing"] == "1"  # stored with the response
    assert bob.json()["code"] == OWNED
    assert "x-timing" not in bob.headers  # oncely answered, outside the http middleware
    assert [lease.key for lease in app.leases] == [RECORD]
    assert app.charges == ["alice"]
