"""The principal that owns a record: the framework's user where it knows one (Starlette's
``scope["user"]``, Django's ``request.user``, WSGI's ``REMOTE_USER``), else ``Authorization``,
else the cookies. The identity table across every adapter is in ``test_identity.py``."""

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
from oncely.http import HttpPolicy, HttpRequest, _semantics, default_scope
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
    """Two users with the same key and body, no Authorization and no cookie: the second is
    refused, never given the first one's response; one user's requests replay whatever their
    cookies."""
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

    assert (alice.status_code, bob.status_code, again.status_code) == (201, 422, 201)
    assert bob.json()["code"] == "idempotency-key-owned-by-another-principal"
    assert "alice" not in bob.text
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
    refused, _ = post("bob")
    assert b"idempotency-key-owned-by-another-principal" in refused
    body, headers = post("alice")
    assert body == b"1"
    assert headers["idempotent-replayed"] == "true"


def _request(*headers: tuple[bytes, bytes], principal: str | None = None) -> HttpRequest:
    return HttpRequest("POST", "/payments", "/payments", b"", headers, b"{}", principal)


def _owner(request: HttpRequest) -> str:
    planned = _semantics.plan(request, "k", HttpPolicy())
    assert isinstance(planned, _semantics.Plan)
    assert default_scope(request) == "POST /payments"  # who is asking is not in the scope
    return planned.fingerprint.partition(" ")[0]


class TestDefaultOwner:
    def test_cookies_name_the_owner_without_authorization(self) -> None:
        anonymous = _owner(_request())
        alice = _owner(_request((b"cookie", b"sessionid=alice")))
        bob = _owner(_request((b"cookie", b"sessionid=bob")))

        assert anonymous == _semantics.ANONYMOUS
        assert len({anonymous, alice, bob}) == 3
        assert "alice" not in alice  # a digest, never the cookie

    def test_split_cookie_headers_count_together(self) -> None:
        """HTTP/2 sends each cookie in a header of its own: all of them count."""
        one = _owner(_request((b"cookie", b"a=1"), (b"cookie", b"sid=alice")))
        other = _owner(_request((b"cookie", b"a=1"), (b"cookie", b"sid=bob")))
        assert one != other

    def test_authorization_wins_over_cookies(self) -> None:
        bearer = (b"authorization", b"Bearer alice")
        with_cookie = _owner(_request(bearer, (b"cookie", b"sid=1")))
        without = _owner(_request(bearer))
        assert with_cookie == without
        assert without == "a:" + hashlib.sha256(b"Bearer alice").hexdigest()[:32]

    def test_framework_user_wins_and_cannot_be_forged(self) -> None:
        user = _owner(_request((b"authorization", b"Bearer x"), principal="pk=1"))
        assert user == _owner(_request((b"cookie", b"sid=2"), principal="pk=1"))
        assert user != _owner(_request(principal="pk=2"))
        assert user.startswith("u:")
        forged = _owner(_request((b"authorization", b"u:pk=1")))
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
    """Under ``oncely.http.django.IdempotencyMiddleware`` (after authentication), a second user
    with the same key, body and cookies is refused; one user replays whatever the cookies."""
    module = importlib.import_module("django_middleware_app")
    ledger = importlib.import_module("_payments").Ledger(tmp_path / "payments.db")
    store = FaultyStore(oncely.open_store("memory://"))
    api = Api(module.create_app(store, ledger, HttpPolicy()), "wsgi", portal, ledger, store)
    key = str(uuid.uuid4())
    body = {"amount": 5, "currency": "EUR"}

    def post(user: str, cookie: str) -> Reply:
        return api.post(key=key, json_body=body, headers=[("x-user", user), ("cookie", cookie)])

    alice, bob = post("alice", "sid=shared"), post("bob", "sid=shared")

    assert (alice.status, bob.status) == (201, 422)
    assert bob.json()["code"] == "idempotency-key-owned-by-another-principal"
    assert ledger.count() == 1
    again = post("alice", "sid=other")
    assert again.replayed
    assert again.body == alice.body
    assert ledger.count() == 1


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

    assert (alice.status_code, bob.status_code, again.status_code) == (201, 422, 201)
    assert bob.json()["code"] == "idempotency-key-owned-by-another-principal"
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == alice.content
    assert missing.status_code == 400
    assert missing.json()["code"] == "idempotency-key-missing"
    assert ledger.count() == 1
