"""Identity: whose key it is, held by every adapter (the guide's identity table).

I1: with the default configuration, attempts with one key on one route by the same client never
run the handler twice, whatever happens to its credentials or cookies between them.
I2: a response stored for one principal is never replayed to another.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import httpx
import pytest
from fastapi import Depends, FastAPI, HTTPException, Request

from oncely import _execution
from oncely._core import codec
from oncely._core.records import Status
from oncely.errors import ConfigurationError
from oncely.http import HttpPolicy, HttpRequest, RouteOptions, _flow, _semantics
from oncely.http._semantics import Plan, Response
from oncely.http.asgi import IdempotencyMiddleware as AsgiMiddleware
from oncely.stores.memory import MemoryStore
from tests.http._harness import Api, Reply
from tests.http.conftest import LEASE, MAX_RESPONSE

pytestmark = pytest.mark.store_independent

PAYMENT = {"amount": 500, "currency": "EUR"}
OTHER = {"amount": 9, "currency": "USD"}

OWNED = "idempotency-key-owned-by-another-principal"

DEFAULTS = HttpPolicy()

TOKENS = {"alice-token": "alice", "alice-token-refreshed": "alice", "bob-token": "bob"}
"""The app's token store: what its own verifier checks a bearer token against."""


def verify(request: HttpRequest) -> str | None:
    """The app's token verifier as a principal source: the verified subject, or ``None``."""
    authorization = request.header("authorization") or ""
    scheme, _, token = authorization.partition(" ")
    return TOKENS.get(token) if scheme.lower() == "bearer" else None


def bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def cookies(value: str) -> list[tuple[str, str]]:
    return [("cookie", value)]


def policy(**options: Any) -> HttpPolicy:
    return HttpPolicy(lease=LEASE, max_response_bytes=MAX_RESPONSE, **options)


def refused(reply: Reply, status: int, code: str) -> dict[str, Any]:
    assert reply.status == status, (reply.status, reply.body)
    assert reply.header("content-type") == "application/problem+json"
    document: dict[str, Any] = reply.json()
    assert document["code"] == code
    return document


class TestOneClient:
    """I1: the same client's retry never runs again, whatever its credentials did."""

    def test_token_refresh_never_runs_twice(self, api: Api, key: str) -> None:
        """Default configuration: the retry is refused, never run (the raw header is all
        oncely can see, and it changed)."""
        first = api.post(key=key, json_body=PAYMENT, headers=bearer("alice-token"))
        again = api.post(key=key, json_body=PAYMENT, headers=bearer("alice-token-refreshed"))

        assert first.status == 201
        refused(again, 422, OWNED)
        assert api.ledger.count() == 1

    def test_token_refresh_replays_with_a_verifier(
        self, make_api: Callable[..., Api], key: str
    ) -> None:
        """With the app's verifier as the principal source, the refreshed token is the same
        principal: the retry gets the stored response."""
        api = make_api(policy(principal=verify))
        first = api.post(key=key, json_body=PAYMENT, headers=bearer("alice-token"))
        again = api.post(key=key, json_body=PAYMENT, headers=bearer("alice-token-refreshed"))

        assert first.status == again.status == 201
        assert again.replayed
        assert again.body == first.body
        assert api.ledger.count() == 1

    def test_cookie_the_first_response_set_replays(self, api: Api, key: str) -> None:
        """A cookie jar sends back the cookie the first response set: the record of an
        anonymous first attempt answers the retry."""
        first = api.post(key=key, json_body=PAYMENT)
        set_cookie = first.header("set-cookie")
        assert set_cookie is not None
        jar = set_cookie.partition(";")[0]
        again = api.post(key=key, json_body=PAYMENT, headers=cookies(jar))

        assert again.status == 201
        assert again.replayed
        assert again.body == first.body
        assert api.ledger.count() == 1

    def test_analytics_cookie_change_never_runs_twice(self, api: Api, key: str) -> None:
        first = api.post(key=key, json_body=PAYMENT, headers=cookies("sessionid=s1; _ga=1"))
        again = api.post(key=key, json_body=PAYMENT, headers=cookies("sessionid=s1; _ga=2"))

        assert first.status == 201
        refused(again, 422, OWNED)
        assert api.ledger.count() == 1

    def test_session_cookie_survives_other_cookies(
        self, make_api: Callable[..., Api], key: str
    ) -> None:
        """With the session cookie named, other cookies (analytics, one the first response
        set) change nothing."""
        api = make_api(policy(session_cookies=("sessionid",)))
        first = api.post(key=key, json_body=PAYMENT, headers=cookies("sessionid=s1; _ga=1"))
        again = api.post(
            key=key, json_body=PAYMENT, headers=cookies("_ga=2; last_payment=1; sessionid=s1")
        )

        assert first.status == again.status == 201
        assert again.replayed
        assert again.body == first.body
        assert api.ledger.count() == 1


class TestOtherPrincipals:
    """I2: a response stored for one principal is never replayed to another."""

    def test_deterministic_key_shared_by_two_users(self, api: Api, key: str) -> None:
        alice = api.post(key=key, json_body=PAYMENT, headers=bearer("alice-token"))
        bob = api.post(key=key, json_body=PAYMENT, headers=bearer("bob-token"))

        assert alice.status == 201
        document = refused(bob, 422, OWNED)
        assert alice.body not in bob.body
        assert str(alice.json()["id"]) not in str(document)
        assert api.ledger.count() == 1
        assert api.post(key=key, json_body=PAYMENT, headers=bearer("alice-token")).replayed

    def test_tenant_scope_gives_each_user_a_key_space(
        self, make_api: Callable[..., Api], key: str
    ) -> None:
        """An explicit scope (a tenant, here the verified user) keeps deterministic keys apart."""

        def tenant(request: HttpRequest) -> str:
            return f"{request.method} {request.route} tenant={verify(request)}"

        api = make_api(policy(scope=tenant, principal=verify))
        alice = api.post(key=key, json_body=PAYMENT, headers=bearer("alice-token"))
        bob = api.post(key=key, json_body=PAYMENT, headers=bearer("bob-token"))

        assert alice.status == bob.status == 201
        assert not bob.replayed
        assert bob.body != alice.body
        assert api.ledger.count() == 2

    def test_key_squatted_by_another_principal(self, api: Api, key: str) -> None:
        """Bob used the key first, for another request: Alice is refused without learning
        anything of Bob's request, and nothing runs."""
        bob = api.post(key=key, json_body=OTHER, headers=bearer("bob-token"))
        alice = api.post(key=key, json_body=PAYMENT, headers=bearer("alice-token"))

        assert bob.status == 201
        document = refused(alice, 422, OWNED)
        assert "USD" not in alice.body.decode()
        assert set(document) == {"type", "title", "status", "detail", "code"}
        assert api.ledger.count() == 1

    def test_owner_never_replays_to_an_anonymous_caller(self, api: Api, key: str) -> None:
        alice = api.post(key=key, json_body=PAYMENT, headers=bearer("alice-token"))
        anonymous = api.post(key=key, json_body=PAYMENT)

        assert alice.status == 201
        refused(anonymous, 422, OWNED)
        assert api.ledger.count() == 1

    def test_anonymous_record_answers_an_authenticated_retry(self, api: Api, key: str) -> None:
        first = api.post(key=key, json_body=PAYMENT)
        again = api.post(key=key, json_body=PAYMENT, headers=bearer("alice-token"))

        assert again.replayed
        assert again.body == first.body
        assert api.ledger.count() == 1

    def test_anonymous_record_with_another_request_is_reused(self, api: Api, key: str) -> None:
        api.post(key=key, json_body=OTHER)
        again = api.post(key=key, json_body=PAYMENT, headers=bearer("alice-token"))

        refused(again, 422, "idempotency-key-reused")
        assert api.ledger.count() == 1


class TestStrict:
    """``require_principal``: a stable principal source or nothing."""

    def test_refuses_to_start_without_a_stable_source(self) -> None:
        with pytest.raises(ConfigurationError, match="require_principal"):
            HttpPolicy(require_principal=True)
        route = RouteOptions(require_principal=True)  # the app's policy may have a source
        with pytest.raises(ConfigurationError, match="require_principal"):
            HttpPolicy().with_options(route)
        assert HttpPolicy(principal=verify).with_options(route).require_principal

    def test_request_without_a_principal_is_refused(
        self, make_api: Callable[..., Api], key: str
    ) -> None:
        api = make_api(policy(require_principal=True, principal=verify))
        nobody = api.post(key=key, json_body=PAYMENT, headers=cookies("sessionid=s1"))
        forged = api.post(key=key, json_body=PAYMENT, headers=bearer("forged"))
        alice = api.post(key=key, json_body=PAYMENT, headers=bearer("alice-token"))

        refused(nobody, 401, "principal-required")
        refused(forged, 401, "principal-required")
        # RFC 9110 15.5.2: a 401 carries at least one challenge.
        assert nobody.header("www-authenticate") == "Bearer"
        assert alice.status == 201
        assert api.ledger.count() == 1

    def test_challenge_is_the_policys(self, make_api: Callable[..., Api], key: str) -> None:
        challenge = 'Cookie realm="shop", form-action="/login"'
        api = make_api(policy(require_principal=True, principal=verify, www_authenticate=challenge))
        reply = api.post(key=key, json_body=PAYMENT)
        refused(reply, 401, "principal-required")
        assert reply.header("www-authenticate") == challenge
        assert api.ledger.count() == 0

    @pytest.mark.parametrize("challenge", ["Bearer\r\nSet-Cookie: x=1", "", 401])
    def test_a_challenge_that_is_no_header_value_is_refused(self, challenge: Any) -> None:
        with pytest.raises(ConfigurationError, match="www_authenticate"):
            HttpPolicy(www_authenticate=challenge)

    def test_session_cookie_is_a_stable_source(
        self, make_api: Callable[..., Api], key: str
    ) -> None:
        api = make_api(policy(require_principal=True, session_cookies=("sessionid",)))
        refused(
            api.post(key=key, json_body=PAYMENT, headers=cookies("_ga=1")),
            401,
            "principal-required",
        )
        first = api.post(key=key, json_body=PAYMENT, headers=cookies("sessionid=s1; _ga=1"))
        again = api.post(key=key, json_body=PAYMENT, headers=cookies("sessionid=s1; _ga=2"))

        assert first.status == 201
        assert again.replayed
        assert api.ledger.count() == 1


# -- the pure rules and the flow behind them ----------------------------------------------------


def http_request(
    headers: tuple[tuple[bytes, bytes], ...] = (), user: str | None = None
) -> HttpRequest:
    body = b'{"amount": 500}'
    return HttpRequest(
        "POST",
        "/payments",
        "/payments",
        b"",
        ((b"content-type", b"application/json"), *headers),
        body,
        user,
    )


def planned(req: HttpRequest, policy: HttpPolicy = DEFAULTS, given: str | None = None) -> Plan:
    answer = _semantics.plan(req, "k", policy, given)
    assert isinstance(answer, Plan)
    return answer


class TestOwner:
    def test_sources_first_found_wins(self) -> None:
        headers = ((b"authorization", b"Bearer t"), (b"cookie", b"sessionid=s1; _ga=1"))
        configured = HttpPolicy(principal=verify, session_cookies=("sessionid",))
        user = planned(http_request(headers, user="id=7"), configured, given="alice")
        given = planned(http_request(headers), configured, given="alice")
        session = planned(http_request(headers), configured)
        raw = planned(http_request(headers))
        owners = [p.fingerprint.partition(" ")[0][:2] for p in (user, given, session, raw)]
        assert owners == ["u:", "p:", "s:", "a:"]
        assert len({user.key, given.key, session.key, raw.key}) == 1

    def test_kinds_cannot_forge_each_other(self) -> None:
        """The same text as a user, a verified subject and a session cookie: three owners."""
        user = planned(http_request(user="alice"))
        given = planned(http_request(), HttpPolicy(principal=verify), given="alice")
        assert user.fingerprint != given.fingerprint

    def test_a_configured_source_that_finds_nobody_is_anonymous(self) -> None:
        """Not the raw cookies: the first response may set the session cookie."""
        answer = planned(
            http_request(((b"cookie", b"_ga=1"),)), HttpPolicy(session_cookies=("sessionid",))
        )
        assert answer.fingerprint.startswith(_semantics.ANONYMOUS + " ")

    def test_session_cookie_order_and_other_cookies_do_not_matter(self) -> None:
        policy = HttpPolicy(session_cookies=("sessionid", "csrftoken"))
        one = planned(http_request(((b"cookie", b"sessionid=s1; csrftoken=c; _ga=1"),)), policy)
        two = planned(
            http_request(((b"cookie", b"_ga=2"), (b"cookie", b"csrftoken=c;sessionid=s1"))), policy
        )
        assert one == two

    def test_strict_without_a_principal_is_401(self) -> None:
        policy = HttpPolicy(require_principal=True, principal=verify)
        answer = _semantics.plan(http_request(((b"authorization", b"Bearer t"),)), "k", policy)
        assert isinstance(answer, Response)
        assert answer.status == 401

    def test_the_verifier_is_not_asked_when_the_framework_names_the_user(self) -> None:
        asked: list[HttpRequest] = []

        def principal(request: HttpRequest) -> str:
            asked.append(request)
            return "alice"

        policy = HttpPolicy(principal=principal)
        assert _semantics.given(policy, http_request(user="pk=1")) is None
        assert _semantics.given(policy, http_request()) == "alice"
        assert len(asked) == 1

    def test_principal_callable_must_return_text(self) -> None:
        async def subject(request: HttpRequest) -> str:
            return "alice"

        policy = HttpPolicy(principal=subject)
        with pytest.raises(TypeError, match="async"):
            _semantics.given(policy, http_request())
        with pytest.raises(TypeError, match="int"):
            _semantics.given(HttpPolicy(principal=lambda r: 7), http_request())  # type: ignore[arg-type,return-value]
        assert asyncio.run(_semantics.agiven(policy, http_request())) == "alice"

    @pytest.mark.parametrize(
        ("ours", "stored", "verdict"),
        [
            ("a:1 h1:x", "a:2 h1:x", "owned"),
            ("a:1 h1:x", "a:2 h1:y", "owned"),
            ("- h1:x", "a:2 h1:x", "owned"),
            ("a:1 h1:x", "a:1 h1:y", "reused"),
            ("a:1 h1:x", "- h1:y", "reused"),
            ("a:1 h1:x", "- h1:x", "adopt"),
            ("a:1 h1:x", "h1:x", "adopt"),  # a record from before owners
            ("a:1 h1:x", "h1:y", "reused"),
        ],
    )
    def test_what_a_mismatch_means(self, ours: str, stored: str, verdict: str) -> None:
        assert _semantics.reusing(ours, stored) == verdict


class TestAnonymousRecordFlow:
    """An anonymous record of the same request answers an authenticated retry, in each of its
    states (the store decides atomically: it is claimed again with its own fingerprint)."""

    policy = HttpPolicy(lease=30)

    def begin(self, store: MemoryStore, plan: Plan) -> Any:
        return _execution.run(
            _flow.begin(plan, self.policy, method="POST", path="/payments"), store
        )

    def test_in_progress_then_replayed(self) -> None:
        store = MemoryStore()
        anonymous = planned(http_request())
        alice = planned(http_request(((b"authorization", b"Bearer alice"),)))
        lease = self.begin(store, anonymous)
        assert isinstance(lease, _execution.Lease)

        busy = self.begin(store, alice)
        assert isinstance(busy, Response)
        assert busy.status == 409

        snapshot = _semantics.encode_snapshot(Response(201, (), b"done"))
        store.complete(lease.key, lease.token, codec.encode_value(snapshot), ttl=timedelta(hours=1))
        replay = self.begin(store, alice)
        assert isinstance(replay, Response)
        assert (replay.status, replay.body) == (201, b"done")

    def test_lapsed_lease_is_handed_back_for_the_owner_to_run(self) -> None:
        """The anonymous attempt's lease lapsed: the retry is not run under the anonymous
        owner; it is told to retry, and then runs as its own principal."""
        store = MemoryStore()
        anonymous = planned(http_request())
        alice = planned(http_request(((b"authorization", b"Bearer alice"),)))
        store.claim(
            anonymous.key,
            anonymous.fingerprint,
            lease=timedelta(milliseconds=1),
            ttl=timedelta(hours=1),
        )
        time.sleep(0.01)

        retry = self.begin(store, alice)
        assert isinstance(retry, Response)
        assert retry.status == 409
        record = store.get(alice.key)
        assert record is not None
        assert record.status is Status.RELEASED
        lease = self.begin(store, alice)
        assert isinstance(lease, _execution.Lease)
        record = store.get(alice.key)
        assert record is not None
        assert record.fingerprint == alice.fingerprint

    def test_record_taken_by_another_principal_meanwhile_fails_closed(self) -> None:
        """The record changed between the two claims: 409, nothing run, nothing replayed."""
        store = MemoryStore()
        anonymous = planned(http_request())
        alice = planned(http_request(((b"authorization", b"Bearer alice"),)))
        bob = planned(http_request(((b"authorization", b"Bearer bob"),)))
        lease = self.begin(store, anonymous)
        flow = _flow.begin(alice, self.policy, method="POST", path="/payments")
        first = next(flow)  # alice's claim: mismatch with the anonymous record
        mismatch = store.claim(*first.args, **first.kwargs)
        store.release(lease.key, lease.token)
        store.claim(bob.key, bob.fingerprint, lease=timedelta(seconds=30), ttl=timedelta(hours=1))
        answer = _execution.run(_resume(flow, mismatch), store)
        assert isinstance(answer, Response)
        assert answer.status == 409
        record = store.get(alice.key)
        assert record is not None
        assert record.fingerprint == bob.fingerprint


def _resume(flow: Any, answer: Any) -> Any:
    """*flow*, which yielded its first operation already, from *answer* on."""
    try:
        operation = flow.send(answer)
        while True:
            operation = flow.send((yield operation))
    except StopIteration as stop:
        return stop.value


def current_user(request: Request) -> str:
    """The app's current-user dependency: the same token check as `verify`."""
    authorization = request.headers.get("authorization", "")
    user = TOKENS.get(authorization.removeprefix("Bearer "))
    if user is None:
        raise HTTPException(401)
    return user


class TestFastApiDependencyAuth:
    """FastAPI with ``Depends``-based auth, which runs after every middleware: the refreshed
    token never runs the payment twice, and the app's verifier given as `principal` replays."""

    @staticmethod
    def app(policy: HttpPolicy) -> tuple[FastAPI, list[str]]:
        charges: list[str] = []
        app = FastAPI()

        @app.post("/payments", status_code=201)
        def pay(user: str = Depends(current_user)) -> dict[str, Any]:
            charges.append(user)
            return {"charge": len(charges), "user": user}

        app.add_middleware(AsgiMiddleware, store=MemoryStore(), policy=policy)
        return app, charges

    @staticmethod
    def attempts(app: Any, *tokens: str) -> list[httpx.Response]:
        async def go() -> list[httpx.Response]:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
                return [
                    await client.post(
                        "/payments",
                        json=PAYMENT,
                        headers={"idempotency-key": "k1", "authorization": f"Bearer {token}"},
                    )
                    for token in tokens
                ]

        return asyncio.run(go())

    def test_default_configuration_refuses_the_refreshed_retry(self) -> None:
        app, charges = self.app(HttpPolicy())
        first, again = self.attempts(app, "alice-token", "alice-token-refreshed")
        assert (first.status_code, again.status_code) == (201, 422)
        assert again.json()["code"] == OWNED
        assert charges == ["alice"]

    def test_the_apps_verifier_replays_it(self) -> None:
        app, charges = self.app(HttpPolicy(principal=verify))
        first, again, bob = self.attempts(app, "alice-token", "alice-token-refreshed", "bob-token")
        assert (first.status_code, again.status_code) == (201, 201)
        assert again.headers["idempotent-replayed"] == "true"
        assert again.json() == first.json() == {"charge": 1, "user": "alice"}
        assert bob.status_code == 422
        assert charges == ["alice"]

    def test_an_async_verifier(self) -> None:
        async def averify(request: HttpRequest) -> str | None:
            return verify(request)

        app, charges = self.app(HttpPolicy(principal=averify))
        _, again = self.attempts(app, "alice-token", "alice-token-refreshed")
        assert again.headers["idempotent-replayed"] == "true"
        assert charges == ["alice"]
