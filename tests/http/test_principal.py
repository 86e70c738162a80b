"""The principal in the default scope: the framework's user where it knows one (Starlette's
``scope["user"]``, WSGI's ``REMOTE_USER``), else ``Authorization``, else the cookies.
Cookie sessions across every adapter are in ``test_http.py``
(``test_cookie_sessions_are_isolated``)."""

from __future__ import annotations

import hashlib
import importlib
import io
import itertools
import uuid
from pathlib import Path
from typing import Any

import anyio
import httpx
from anyio.from_thread import BlockingPortal
from starlette.applications import Starlette
from starlette.authentication import AuthCredentials, AuthenticationBackend, SimpleUser
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import oncely
from oncely.http import HttpPolicy, HttpRequest, default_scope
from oncely.http._semantics import user_principal
from oncely.http.asgi import IdempotencyMiddleware as AsgiMiddleware
from oncely.http.wsgi import IdempotencyMiddleware as WsgiMiddleware
from tests.http._harness import Api, FaultyStore, Reply


class _HeaderUser(AuthenticationBackend):
    """Authenticates whoever the ``X-User`` header names (a stand-in for a session lookup)."""

    async def authenticate(self, conn: HTTPConnection) -> tuple[AuthCredentials, Any] | None:
        name = conn.headers.get("x-user")
        if not name:
            return None
        return AuthCredentials(["authenticated"]), SimpleUser(name)


def test_starlette_user_is_the_principal() -> None:
    """Two users with the same key and body, no Authorization and no cookie, run two
    operations; one user's requests replay whatever their cookies."""
    runs = itertools.count(1)

    async def pay(request: Request) -> JSONResponse:
        return JSONResponse({"run": next(runs), "user": request.user.display_name}, 201)

    app = Starlette(
        routes=[Route("/payments", pay, methods=["POST"])],
        middleware=[  # the first is the outermost: the user is known before oncely runs
            Middleware(AuthenticationMiddleware, backend=_HeaderUser()),
            Middleware(AsgiMiddleware, store=oncely.open_store("memory://")),
        ],
    )
    key = str(uuid.uuid4())

    async def go() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            replies = []
            for user, cookie in (("alice", ""), ("bob", ""), ("alice", "theme=light")):
                headers = {"idempotency-key": key, "x-user": user}
                if cookie:
                    headers["cookie"] = cookie
                replies.append(await client.post("/payments", json={"amount": 1}, headers=headers))
            return replies

    alice, bob, again = anyio.run(go)

    assert (alice.status_code, bob.status_code, again.status_code) == (201, 201, 201)
    assert "idempotent-replayed" not in bob.headers
    assert bob.json() == {"run": 2, "user": "bob"}
    assert again.headers["idempotent-replayed"] == "true"
    assert again.json() == {"run": 1, "user": "alice"}


def test_wsgi_remote_user_is_the_principal() -> None:
    runs = itertools.count(1)

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        start_response("201 Created", [("Content-Type", "text/plain")])
        return [str(next(runs)).encode()]

    protected = WsgiMiddleware(app, store=oncely.open_store("memory://"))
    key = str(uuid.uuid4())

    def post(user: str) -> tuple[bytes, dict[str, str]]:
        headers: dict[str, str] = {}

        def start_response(status: str, response_headers: list[tuple[str, str]]) -> None:
            headers.update((name.lower(), value) for name, value in response_headers)

        environ = {
            "REQUEST_METHOD": "POST",
            "PATH_INFO": "/payments",
            "HTTP_IDEMPOTENCY_KEY": key,
            "REMOTE_USER": user,
            "CONTENT_LENGTH": "0",
            "wsgi.input": io.BytesIO(b""),
        }
        return b"".join(protected(environ, start_response)), headers

    assert post("alice")[0] == b"1"
    assert post("bob")[0] == b"2"
    body, headers = post("alice")
    assert body == b"1"
    assert headers["idempotent-replayed"] == "true"


def _request(*headers: tuple[bytes, bytes], principal: str | None = None) -> HttpRequest:
    return HttpRequest("POST", "/payments", "/payments", b"", headers, b"{}", principal)


class TestDefaultScope:
    def test_cookies_name_the_principal_without_authorization(self) -> None:
        anonymous = default_scope(_request())
        alice = default_scope(_request((b"cookie", b"sessionid=alice")))
        bob = default_scope(_request((b"cookie", b"sessionid=bob")))

        assert anonymous == "POST /payments"
        assert len({anonymous, alice, bob}) == 3
        assert "alice" not in alice  # a digest, never the cookie

    def test_split_cookie_headers_count_together(self) -> None:
        """HTTP/2 sends each cookie in a header of its own: all of them count."""
        one = default_scope(_request((b"cookie", b"a=1"), (b"cookie", b"sid=alice")))
        other = default_scope(_request((b"cookie", b"a=1"), (b"cookie", b"sid=bob")))
        assert one != other

    def test_authorization_wins_over_cookies_and_keeps_its_scope(self) -> None:
        bearer = (b"authorization", b"Bearer alice")
        with_cookie = default_scope(_request(bearer, (b"cookie", b"sid=1")))
        without = default_scope(_request(bearer))
        assert with_cookie == without
        # the digest of Authorization alone, as before cookies counted: existing keys keep it
        assert without == "POST /payments @" + hashlib.sha256(b"Bearer alice").hexdigest()[:32]

    def test_framework_user_wins_and_cannot_be_forged(self) -> None:
        user = default_scope(_request((b"authorization", b"Bearer x"), principal="pk=1"))
        assert user == default_scope(_request((b"cookie", b"sid=2"), principal="pk=1"))
        assert user != default_scope(_request(principal="pk=2"))
        assert user.startswith("POST /payments @u:")
        forged = default_scope(_request((b"authorization", b"u:pk=1")))
        assert forged != user


class _User:
    def __init__(self, authenticated: bool, **names: Any) -> None:
        self.is_authenticated = authenticated
        self.__dict__.update(names)


def test_user_principal_reads_authenticated_users_only() -> None:
    assert user_principal(None) is None
    assert user_principal(_User(False, pk=1)) is None
    assert user_principal(_User(True, pk=7)) == "pk=7"
    assert user_principal(_User(True, username="ann")) == "username=ann"
    assert user_principal(SimpleUser("ann")) in ("identity=ann", "username=ann")
    assert user_principal(_User(True)) is None


def test_django_request_user_is_the_principal(portal: BlockingPortal, tmp_path: Path) -> None:
    """Under ``oncely.http.django.IdempotencyMiddleware`` (after authentication), two users with
    the same key, body and cookies run two operations; one user replays whatever the cookies."""
    module = importlib.import_module("django_middleware_app")
    ledger = importlib.import_module("_payments").Ledger(tmp_path / "payments.db")
    store = FaultyStore(oncely.open_store("memory://"))
    api = Api(module.create_app(store, ledger, HttpPolicy()), "wsgi", portal, ledger, store)
    key = str(uuid.uuid4())
    body = {"amount": 5, "currency": "EUR"}

    def post(user: str, cookie: str) -> Reply:
        return api.post(key=key, json_body=body, headers=[("x-user", user), ("cookie", cookie)])

    alice, bob = post("alice", "sid=shared"), post("bob", "sid=shared")

    assert (alice.status, bob.status) == (201, 201)
    assert not bob.replayed
    assert ledger.count() == 2
    again = post("alice", "sid=other")
    assert again.replayed
    assert again.body == alice.body
    assert ledger.count() == 2


def test_django_middleware_under_django_asgi(tmp_path: Path) -> None:
    """The sync Django middleware under Django's ASGI handler (Django runs it in a thread):
    the principal and the view's `idempotent_route` options hold there too."""
    from django.core.handlers.asgi import ASGIHandler
    from django.test.utils import override_settings

    module = importlib.import_module("django_middleware_app")
    django_app = importlib.import_module("django_app")
    ledger = importlib.import_module("_payments").Ledger(tmp_path / "payments.db")
    django_app.LEDGER, django_app.ASGI = ledger, True
    store = oncely.open_store("memory://")
    with override_settings(MIDDLEWARE=module.MIDDLEWARE, ONCELY_STORE=store, ONCELY_HTTP=None):
        app = ASGIHandler()
    key = str(uuid.uuid4())
    body = {"amount": 5, "currency": "EUR"}

    async def go() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            replies = [
                await client.post(
                    "/payments", json=body, headers={"idempotency-key": key, "x-user": user}
                )
                for user in ("alice", "bob", "alice")
            ]
            replies.append(await client.post("/transfers", json=body))  # the key is required
            return replies

    alice, bob, again, missing = anyio.run(go)

    assert (alice.status_code, bob.status_code, again.status_code) == (201, 201, 201)
    assert "idempotent-replayed" not in bob.headers
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == alice.content
    assert missing.status_code == 400
    assert missing.json()["code"] == "idempotency-key-missing"
    assert ledger.count() == 2
