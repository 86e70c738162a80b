"""The HTTP suite: the HTTP contract (docs/guides/http.md), run against every adapter x every store.

Each test drives one of the example payments APIs (bare ASGI, bare WSGI, FastAPI, Starlette,
Flask, Django) in process, and counts the payment effect in the example's SQLite ledger.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import logging
import time
from collections.abc import Callable, MutableMapping
from typing import Any

import pytest

from oncely import _execution
from oncely.http import HttpPolicy
from oncely.http.asgi import IdempotencyMiddleware as AsgiMiddleware
from oncely.http.wsgi import IdempotencyMiddleware as WsgiMiddleware
from oncely.stores.memory import MemoryStore
from tests._helpers import eventually
from tests.http._harness import Api, Reply
from tests.http.conftest import LEASE, MAX_RESPONSE

PAYMENT = {"amount": 500, "currency": "EUR"}

BAD_KEYS = [
    b"",
    b"k" * 256,
    "clé".encode("latin-1"),
    "ключ".encode(),
    b"a\x01b",
    b'"unterminated',
    b'"a"b"',
    b'""',
]
"""Empty, too long, not ASCII (latin-1 and UTF-8), a control character, malformed quoting."""

NOT_JSON = [b"{not json", b"\xff\xfe\x00garbage", b"[" * 100_000, b'{"amount": NaN}']
"""Bodies labelled JSON that are not: malformed, not UTF-8, too deeply nested, NaN."""


def problem(reply: Reply, status: int, code: str) -> dict[str, object]:
    """Assert *reply* is a problem+json of *status* and *code*; return the document."""
    assert reply.status == status, (reply.status, reply.body)
    assert reply.header("content-type") == "application/problem+json"
    document = reply.json()
    assert document["status"] == status
    assert document["code"] == code
    assert document["detail"]
    return document  # type: ignore[no-any-return]


@pytest.fixture(autouse=True)
def _fast_settle_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settle retries of an unavailable store pause briefly (the real pauses add up to 1.75 s)."""
    monkeypatch.setattr(_execution.flows, "SETTLE_RETRY_DELAYS", (0.01, 0.02))


class TestNotProtected:
    """Rows 1-2: requests the middleware passes through untouched."""

    def test_method_not_covered_passes_through(self, api: Api, key: str) -> None:
        """PUT and DELETE are not covered by default: each request runs, nothing is replayed."""
        for method in ("PUT", "DELETE"):
            first = api.request(method, "/payments/1", key=key, content=b"{}")
            second = api.request(method, "/payments/1", key=key, content=b"{}")
            assert first.status == second.status
            assert not first.replayed
            assert not second.replayed
        assert first.status in (404, 405)  # DELETE: no such route in the examples
        assert api.ledger.count() == 2  # the PUT executed twice
        assert api.store.calls["claim"] == 0

    def test_get_passes_through(self, api: Api, key: str) -> None:
        """Safe methods are never covered."""
        created = api.post(key=key, json_body=PAYMENT).json()
        reply = api.request("GET", f"/payments/{created['id']}", key=key)
        assert reply.status == 200
        assert not reply.replayed
        assert reply.json()["amount"] == 500

    def test_covered_method_without_key_passes_through(self, api: Api) -> None:
        """Without a key on a route that does not require one, each request executes."""
        first, second = api.post(json_body=PAYMENT), api.post(json_body=PAYMENT)

        assert first.status == second.status == 201
        assert not second.replayed
        assert api.ledger.count() == 2
        assert api.store.calls["claim"] == 0


class TestKeys:
    """Rows 3-4, and the two spellings of a key."""

    def test_missing_key_on_required_route_is_400_naming_the_header(self, api: Api) -> None:
        """A route that requires a key answers 400 problem+json naming the header."""
        document = problem(
            api.post("/transfers", json_body=PAYMENT), 400, "idempotency-key-missing"
        )

        assert document["header"] == "Idempotency-Key"
        assert "Idempotency-Key" in str(document["detail"])
        assert api.ledger.count() == 0

    def test_required_route_with_key_is_protected(self, api: Api, key: str) -> None:
        """The same route with a key executes once and replays."""
        first = api.post("/transfers", key=key, json_body=PAYMENT)
        second = api.post("/transfers", key=key, json_body=PAYMENT)

        assert first.status == second.status == 201
        assert second.replayed
        assert api.ledger.count() == 1

    def test_invalid_keys_are_400_and_store_nothing(self, api: Api) -> None:
        """An empty, too long or non-header-safe key is rejected before it touches the store."""
        for bad_key in BAD_KEYS:
            reply = api.post(key=bad_key, json_body=PAYMENT)
            assert reply.status == 400, bad_key
            problem(reply, 400, "idempotency-key-invalid")

        assert api.ledger.count() == 0
        assert api.store.calls["claim"] == 0

    @pytest.mark.parametrize(
        "values",
        [
            pytest.param([b"k1", b"k2"], id="two-keys"),
            pytest.param([b"k1", b"k1"], id="same-key-twice"),
            pytest.param([b'"k1"', b'"k2"'], id="two-quoted"),
            pytest.param([b'"k1', b'k2"'], id="quoted-halves"),
            pytest.param([b"k1", b""], id="key-and-empty"),
            pytest.param([b"k1,k2"], id="bare-with-comma"),
            pytest.param([b"k1, k2"], id="bare-with-comma-space"),
            pytest.param([b'"k1,k2"'], id="quoted-with-comma"),
            pytest.param([b'"k1, k2"'], id="quoted-with-comma-space"),
        ],
    )
    def test_repeated_key_header_or_comma_is_400_and_stores_nothing(
        self, api: Api, values: list[bytes]
    ) -> None:
        """A repeated key header is ambiguous, and so is a key with a comma: a WSGI server
        joins repeated headers with a comma, so the two cannot be told apart there. Every
        adapter answers 400 to both, and nothing is stored."""
        headers = [("idempotency-key", value) for value in values]
        problem(api.post(json_body=PAYMENT, headers=headers), 400, "idempotency-key-invalid")

        assert api.ledger.count() == 0
        assert api.store.calls["claim"] == 0

    def test_longest_valid_key_is_accepted(self, api: Api) -> None:
        """255 characters is the limit, inclusive."""
        long_key = "k" * 250 + hashlib.sha256(api.ledger.path.encode()).hexdigest()[:5]
        assert api.post(key=long_key, json_body=PAYMENT).status == 201
        assert api.post(key=long_key, json_body=PAYMENT).replayed

    def test_quoted_and_bare_keys_name_the_same_operation(self, api: Api, key: str) -> None:
        """A structured-field string ("...") and the bare token are the same key."""
        first = api.post(key=f'"{key}"', json_body=PAYMENT)
        second = api.post(key=key, json_body=PAYMENT)

        assert first.status == 201
        assert second.replayed
        assert api.ledger.count() == 1


class TestFirstAndRepeat:
    """Rows 5-6: the first request executes and is stored; repeats replay it byte for byte."""

    def test_first_request_executes(self, api: Api, key: str) -> None:
        reply = api.post(key=key, json_body=PAYMENT)

        assert reply.status == 201
        assert not reply.replayed
        assert reply.json()["amount"] == 500
        assert reply.header("location") == f"/payments/{reply.json()['id']}"
        assert api.ledger.count() == 1

    def test_repeat_replays_status_headers_and_body_byte_for_byte(self, api: Api, key: str) -> None:
        """The replay is the stored status, headers (Location, ETag, Content-Type) and body,
        plus ``Idempotent-Replayed: true``; Set-Cookie is not replayed."""
        first = api.post(key=key, json_body=PAYMENT)
        second = api.post(key=key, json_body=PAYMENT)
        third = api.post(key=key, json_body=PAYMENT)

        assert second.status == third.status == first.status == 201
        assert second.body == third.body == first.body
        assert second.replayed
        assert third.replayed
        assert first.header("set-cookie") is not None
        assert second.header("set-cookie") is None
        expected = [(k, v) for k, v in first.comparable_headers() if k != b"set-cookie"]
        assert second.comparable_headers() == expected
        for name in ("location", "etag", "content-type", "content-length"):
            assert second.header(name) == first.header(name), name
        assert api.ledger.count() == 1

    def test_json_body_is_canonicalised(self, api: Api, key: str) -> None:
        """Key order, spacing and number spelling do not make another operation."""
        api.post(
            key=key, content=b'{"amount": 500, "currency": "EUR"}', content_type="application/json"
        )
        again = api.post(
            key=key,
            content=b'{ "currency":"EUR",\n "amount":500.0 }',
            content_type="application/json; charset=utf-8",
        )

        assert again.replayed
        assert api.ledger.count() == 1

    def test_4xx_answers_are_stored(self, api: Api, key: str) -> None:
        """A 4xx is an answer: it is stored and replayed (only 5xx are not)."""
        first = api.post(key=key, content=b"{not json", content_type="application/json")
        second = api.post(key=key, content=b"{not json", content_type="application/json")

        assert first.status == second.status == 400
        assert second.replayed
        assert second.body == first.body

    @pytest.mark.parametrize("status", [401, 403, 408, 409, 422, 423, 425, 429])
    def test_refusals_are_not_stored_and_a_retry_executes(
        self, api: Api, key: str, status: int
    ) -> None:
        """A 4xx that says "not carried out, may succeed later" releases the lease."""
        first = api.post(key=key, json_body=PAYMENT, params={"fail": status})
        second = api.post(key=key, json_body=PAYMENT, params={"fail": status})

        assert first.status == second.status == status
        assert not second.replayed
        assert api.ledger.count() == 2
        third = api.post(key=key, json_body=PAYMENT, params={"fail": status})
        assert not third.replayed
        assert api.ledger.count() == 3

    @pytest.mark.parametrize("status", [400, 404, 410, 412])
    def test_other_4xx_outcomes_are_stored(self, api: Api, key: str, status: int) -> None:
        """The rest of 4xx is an outcome: stored and replayed."""
        first = api.post(key=key, json_body=PAYMENT, params={"fail": status})
        second = api.post(key=key, json_body=PAYMENT, params={"fail": status})

        assert first.status == second.status == status
        assert second.replayed
        assert api.ledger.count() == 1

    def test_streamed_response_is_stored_byte_for_byte(self, api: Api, key: str) -> None:
        """A response sent in several chunks is stored whole."""
        first = api.post(key=key, json_body=PAYMENT, params={"chunks": 5, "pad": 3000})
        second = api.post(key=key, json_body=PAYMENT, params={"chunks": 5, "pad": 3000})

        assert first.status == 201
        assert len(first.body) > 3000
        assert second.replayed
        assert second.body == first.body
        assert api.ledger.count() == 1


class TestConflicts:
    """Rows 7-8: repeats while the first runs (also `test_handler_slower_than_the_lease`), and
    a key reused for another request."""

    def test_concurrent_duplicates_execute_once(self, api: Api, key: str) -> None:
        """Eight identical requests at once: one execution, the others 409 or a replay."""
        replies = api.concurrently(
            [lambda: api.post(key=key, json_body=PAYMENT, params={"delay": 0.1})] * 8
        )

        executed = [r for r in replies if r.status == 201 and not r.replayed]
        assert len(executed) == 1
        for reply in replies:
            assert reply.status == 409 or (reply.status == 201 and reply.body == executed[0].body)
        assert api.ledger.count() == 1

    @pytest.mark.store_independent
    def test_in_progress_retry_after_is_short_whatever_the_lease(
        self, make_api: Callable[..., Api], key: str
    ) -> None:
        """A 409's Retry-After is about a second, never the lease's remaining time (30 s)."""
        api = make_api(HttpPolicy(lease=30))
        slow = {"delay": 1.5}

        def first() -> Reply:
            return api.post(key=key, json_body=PAYMENT, params=slow)

        def duplicate() -> Reply:
            time.sleep(0.5)
            return api.post(key=key, json_body=PAYMENT, params=slow)

        replies = api.concurrently([first, duplicate])

        conflicts = [reply for reply in replies if reply.status == 409]
        assert len(conflicts) == 1, [reply.status for reply in replies]
        problem(conflicts[0], 409, "idempotency-key-in-use")
        assert conflicts[0].header("retry-after") == "1"
        assert api.ledger.count() == 1

    def test_same_key_different_request_is_422(self, api: Api, key: str) -> None:
        """A key reused for another body, query or media is a client bug: 422, nothing runs."""
        api.post(key=key, json_body=PAYMENT)
        changes: list[dict[str, Any]] = [
            {"json_body": {"amount": 501, "currency": "EUR"}},
            {"json_body": PAYMENT, "params": {"pad": 1}},
            {"content": b"\x00binary", "content_type": "application/octet-stream"},
        ]
        for change in changes:
            problem(api.post(key=key, **change), 422, "idempotency-key-reused")
        assert api.ledger.count() == 1

    def test_principals_are_isolated(self, api: Api, key: str) -> None:
        """The same key from another client is refused: it never runs, never sees the owner's
        response, and the owner still replays its own (test_identity.py has the table)."""
        alice = [("authorization", "Bearer alice")]
        bob = [("authorization", "Bearer bob")]
        alice_first = api.post(key=key, json_body=PAYMENT, headers=alice)
        bob_first = api.post(key=key, json_body={"amount": 9, "currency": "USD"}, headers=bob)
        anonymous = api.post(key=key, json_body=PAYMENT)

        assert alice_first.status == 201
        for refused in (bob_first, anonymous):
            problem(refused, 422, "idempotency-key-owned-by-another-principal")
            assert alice_first.body not in refused.body
        assert api.ledger.count() == 1
        alice_again = api.post(key=key, json_body=PAYMENT, headers=alice)
        assert alice_again.replayed
        assert alice_again.body == alice_first.body
        assert api.ledger.count() == 1

    def test_cookie_sessions_are_isolated(self, api: Api, key: str) -> None:
        """Without Authorization, the cookies name the owner: a second session with the same
        key and body is refused instead of receiving the first one's response."""
        alice = [("cookie", "sessionid=alice; theme=dark")]
        bob = [("cookie", "sessionid=bob; theme=dark")]
        alice_first = api.post(key=key, json_body=PAYMENT, headers=alice)
        bob_first = api.post(key=key, json_body=PAYMENT, headers=bob)

        assert alice_first.status == 201
        problem(bob_first, 422, "idempotency-key-owned-by-another-principal")
        assert api.ledger.count() == 1
        alice_again = api.post(key=key, json_body=PAYMENT, headers=alice)
        assert alice_again.replayed
        assert alice_again.body == alice_first.body
        assert api.ledger.count() == 1

    def test_same_key_on_another_route_is_another_operation(self, api: Api, key: str) -> None:
        """The default scope includes the route."""
        assert api.post("/payments", key=key, json_body=PAYMENT).status == 201
        assert not api.post("/transfers", key=key, json_body=PAYMENT).replayed
        assert api.ledger.count() == 2


class TestFailures:
    """Rows 9-10: the handler failing, and the store failing before, during and after it."""

    @pytest.mark.parametrize("fail", ["500", "raise"])
    def test_handler_5xx_or_raise_is_not_stored_and_a_retry_executes(
        self, api: Api, key: str, fail: str
    ) -> None:
        """The lease is released at once, so the retry executes (no 409)."""
        first = api.post(key=key, json_body=PAYMENT, params={"fail": fail})
        second = api.post(key=key, json_body=PAYMENT, params={"fail": fail})

        assert first.status == second.status == 500
        assert not second.replayed
        assert api.ledger.count() == 2
        assert api.store.calls["release"] == 2
        assert api.store.calls["complete"] == 0

    def test_store_unavailable_before_claim_is_503_and_nothing_runs(
        self, api: Api, key: str
    ) -> None:
        """Fail closed: 503 with Retry-After, the handler is not entered."""
        api.store.inject("claim")
        reply = api.post(key=key, json_body=PAYMENT)

        problem(reply, 503, "idempotency-store-unavailable")
        assert reply.header("retry-after") == "1"
        assert api.ledger.count() == 0
        api.store.heal()
        assert api.post(key=key, json_body=PAYMENT).status == 201
        assert api.ledger.count() == 1

    def test_fail_open_route_runs_unprotected_and_logs_it(
        self, api: Api, key: str, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A route that opted into fail-open serves requests while the store is down, and logs
        every one."""
        api.store.inject("claim")
        with caplog.at_level(logging.WARNING, logger="oncely.http"):
            first = api.post("/webhooks", key=key, json_body=PAYMENT)
            second = api.post("/webhooks", key=key, json_body=PAYMENT)

        assert first.status == second.status == 201
        assert api.ledger.count() == 2
        unprotected = [r for r in caplog.records if "UNPROTECTED" in r.getMessage()]
        assert len(unprotected) == 2
        assert "/webhooks" in unprotected[0].getMessage()

    @pytest.mark.store_independent
    def test_store_unavailable_during_handler(self, make_api: Callable[..., Api], key: str) -> None:
        """Heartbeats failing while the handler runs do not stop it; the response is stored."""
        api = make_api(HttpPolicy(lease=0.15))
        api.store.inject("extend")
        first = api.post(key=key, json_body=PAYMENT, params={"delay": 0.3})  # outlives it
        api.store.heal()

        assert first.status == 201
        assert api.store.calls["extend"] >= 1
        assert api.post(key=key, json_body=PAYMENT, params={"delay": 0.3}).replayed
        assert api.ledger.count() == 1

    def test_store_briefly_unavailable_after_handler_still_stores(self, api: Api, key: str) -> None:
        """Completing is retried, so a blip after the handler loses nothing."""
        api.store.inject("complete", times=1)
        first = api.post(key=key, json_body=PAYMENT)

        assert first.status == 201
        assert api.store.calls["complete"] == 2
        second = api.post(key=key, json_body=PAYMENT)
        assert second.replayed
        assert second.body == first.body
        assert api.ledger.count() == 1

    @pytest.mark.store_independent
    def test_store_down_after_handler_still_delivers_the_response(
        self, make_api: Callable[..., Api], key: str
    ) -> None:
        """The handler ran, so its response goes out. Its record stays in progress: repeats
        get 409 until the lease expires, then the request is recovered and runs again (the
        documented limit of an outage at complete; fencing tokens guard downstream writes).
        The lease (0.5 s) outlasts the time the repeat takes to arrive on a busy machine."""
        api = make_api(HttpPolicy(lease=0.5))
        api.store.inject("complete")
        first = api.post(key=key, json_body=PAYMENT)
        api.store.heal()

        assert first.status == 201
        assert not first.replayed
        problem(api.post(key=key, json_body=PAYMENT), 409, "idempotency-key-in-use")
        assert api.ledger.count() == 1
        eventually(lambda: api.post(key=key, json_body=PAYMENT).status == 201, timeout=5)
        assert api.ledger.count() == 2

    def test_store_unavailable_after_complete(self, api: Api, key: str) -> None:
        """A repeat while the store is down gets 503 (never a re-execution); then a replay."""
        first = api.post(key=key, json_body=PAYMENT)
        api.store.inject("claim")
        problem(api.post(key=key, json_body=PAYMENT), 503, "idempotency-store-unavailable")
        api.store.heal()

        replay = api.post(key=key, json_body=PAYMENT)
        assert replay.replayed
        assert replay.body == first.body
        assert api.ledger.count() == 1

    def test_corrupt_record_fails_closed(self, api: Api, key: str) -> None:
        """A stored outcome that cannot be decoded answers 500 and never executes again."""
        api.store.corrupt_results = True
        assert api.post(key=key, json_body=PAYMENT).status == 201

        problem(api.post(key=key, json_body=PAYMENT), 500, "idempotency-record-corrupt")
        assert api.ledger.count() == 1

    @pytest.mark.store_independent
    def test_handler_slower_than_the_lease(self, make_api: Callable[..., Api], key: str) -> None:
        """A repeat while the first request executes gets 409 with Retry-After, without entering
        the handler; the heartbeat keeps a short lease alive, so that holds even when the repeat
        arrives after the lease would have expired. The lease leaves the heartbeat 200 ms of
        slack: a SQLite commit that waits for the disk can stall that long on a busy machine."""
        lease = 0.3
        api = make_api(HttpPolicy(lease=lease))
        slow = {"delay": lease * 2.6}

        def first() -> Reply:
            return api.post(key=key, json_body=PAYMENT, params=slow)

        def late_duplicate() -> Reply:
            time.sleep(lease * 1.8)
            return api.post(key=key, json_body=PAYMENT, params=slow)

        original, duplicate = api.concurrently([first, late_duplicate])

        assert original.status == 201
        problem(duplicate, 409, "idempotency-key-in-use")
        assert duplicate.header("retry-after") == "1"
        assert api.store.calls["extend"] >= 2
        assert api.post(key=key, json_body=PAYMENT, params=slow).replayed
        assert api.ledger.count() == 1


class TestBodies:
    """Bodies that are not JSON, labelled JSON but are not, binary, chunked and large."""

    def test_binary_body_reaches_the_handler_intact_and_replays(self, api: Api, key: str) -> None:
        body = bytes(range(256)) * 64
        first = api.post(key=key, content=body, content_type="application/octet-stream")
        second = api.post(key=key, content=body, content_type="application/octet-stream")

        assert first.status == 201
        assert first.json()["body_sha256"] == hashlib.sha256(body).hexdigest()
        assert second.replayed
        assert second.body == first.body
        assert api.ledger.count() == 1

    def test_body_labelled_json_that_is_not_json(self, api: Api, key: str) -> None:
        """The raw bytes are fingerprinted: no crash, the app answers, repeats replay."""
        for number, body in enumerate(NOT_JSON):
            body_key = f"{key}-{number}"
            first = api.post(key=body_key, content=body, content_type="application/json")
            second = api.post(key=body_key, content=body, content_type="application/json")
            other = api.post(key=body_key, content=body + b" ", content_type="application/json")

            assert first.status in (201, 400), body[:20]
            assert second.replayed
            assert second.body == first.body
            assert other.status == 422

    def test_chunked_request_body_reaches_the_handler_intact(self, api: Api, key: str) -> None:
        """A body streamed in several chunks is read to fingerprint it and handed on whole."""
        chunks = [b'{"amount": ', b"700, ", b'"currency": "CHF"}']
        first = api.post(key=key, chunks=chunks, content_type="application/json")
        second = api.post(key=key, json_body={"amount": 700, "currency": "CHF"})

        assert first.status == 201
        assert first.json()["body_sha256"] == hashlib.sha256(b"".join(chunks)).hexdigest()
        assert second.replayed
        assert api.ledger.count() == 1

    def test_numbers_past_float_precision_are_another_request(self, api: Api, key: str) -> None:
        """Two amounts that differ in their 35th digit (different even as floats) are two
        requests: 422, never a replay of the first (the old fingerprint rounded them alike)."""
        first, second = (
            b'{"amount": 500, "currency": "EUR", "rate": 1.0000000000000001110223024625156540}',
            b'{"amount": 500, "currency": "EUR", "rate": 1.0000000000000001110223024625156541}',
        )
        assert api.post(key=key, content=first, content_type="application/json").status == 201
        reply = api.post(key=key, content=second, content_type="application/json")
        problem(reply, 422, "idempotency-key-reused")
        respelt = first.replace(b"6540}", b"654e0}")
        assert api.post(key=key, content=respelt, content_type="application/json").replayed
        assert api.ledger.count() == 1

    @pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
    def test_request_body_over_the_limit_is_413_and_stores_nothing(
        self, make_api: Callable[..., Api], key: str, chunked: bool
    ) -> None:
        """A body over `max_request_bytes`, announced by Content-Length or growing past the limit
        in chunks, is 413: the handler never runs and no record is claimed, so the same key
        with a body within the limit is a first request."""
        api = make_api(
            HttpPolicy(lease=LEASE, max_response_bytes=MAX_RESPONSE, max_request_bytes=64)
        )
        body = b'{"amount": 500, "currency": "EUR", "note": "' + b"x" * 100 + b'"}'
        options: dict[str, Any] = (
            {"chunks": [body[:40], body[40:80], body[80:]]} if chunked else {"content": body}
        )
        reply = api.post(key=key, content_type="application/json", **options)

        document = problem(reply, 413, "request-too-large")
        assert document["max_request_bytes"] == 64
        assert api.ledger.count() == 0
        assert api.store.calls["claim"] == 0
        first = api.post(key=key, json_body=PAYMENT)
        assert (first.status, first.replayed) == (201, False)
        assert api.post(key=key, json_body=PAYMENT).replayed
        assert api.ledger.count() == 1

    def test_request_body_at_the_limit_is_served(
        self, make_api: Callable[..., Api], key: str
    ) -> None:
        """Exactly `max_request_bytes` is within the limit, whole or in chunks."""
        body = json.dumps(PAYMENT).encode()
        policy = HttpPolicy(
            lease=LEASE, max_response_bytes=MAX_RESPONSE, max_request_bytes=len(body)
        )
        api = make_api(policy)
        first = api.post(key=key, chunks=[body[:5], body[5:]], content_type="application/json")
        assert first.status == 201
        assert api.post(key=key, content=body, content_type="application/json").replayed

    def test_large_request_body(self, make_api: Callable[..., Api], key: str) -> None:
        """A 2 MiB body, in 32 chunks, arrives intact; a one-byte change is another request."""
        policy = HttpPolicy(lease=LEASE, max_response_bytes=MAX_RESPONSE, max_request_bytes=4 << 20)
        api = make_api(policy)
        body = hashlib.sha256(key.encode()).digest() * (2 * 1024 * 1024 // 32)
        chunks = [body[i : i + 65536] for i in range(0, len(body), 65536)]
        first = api.post(key=key, chunks=chunks, content_type="application/octet-stream")
        changed = body[:-1] + bytes([body[-1] ^ 1])

        assert first.status == 201
        assert first.json()["body_size"] == len(body)
        assert first.json()["body_sha256"] == hashlib.sha256(body).hexdigest()
        assert api.post(key=key, content=body, content_type="application/octet-stream").replayed
        assert (
            api.post(key=key, content=changed, content_type="application/octet-stream").status
            == 422
        )
        assert api.ledger.count() == 1

    @pytest.mark.parametrize("chunks", [1, 7])
    def test_response_over_the_limit_passes_through_and_repeats_get_a_problem(
        self, api: Api, key: str, chunks: int
    ) -> None:
        """Above the size limit the response is delivered intact but not stored; repeats get
        500 ``response-not-stored`` and the handler never runs again."""
        params = {"pad": MAX_RESPONSE + 10, "chunks": chunks}
        first = api.post(key=key, json_body=PAYMENT, params=params)

        assert first.status == 201
        assert len(first.body) > MAX_RESPONSE
        assert first.json()["pad"] == "x" * (MAX_RESPONSE + 10)
        repeat = api.post(key=key, json_body=PAYMENT, params=params)
        problem(repeat, 500, "response-not-stored")
        assert api.ledger.count() == 1


class TestLogInjection:
    """Keys, scopes and paths from clients are escaped in log lines: one call, one line."""

    FORGED = "/nowhere\nCRITICAL oncely: payment refunded"
    """A path as the server decodes it from ``/nowhere%0ACRITICAL%20oncely...``."""

    def test_an_unresolved_path_cannot_forge_a_log_line(
        self, api: Api, key: str, caplog: pytest.LogCaptureFixture
    ) -> None:
        with caplog.at_level(logging.DEBUG, logger="oncely"):
            first = api.post(self.FORGED, key=key, json_body=PAYMENT)
            second = api.post(self.FORGED, key=key, json_body=PAYMENT)

        assert second.status == first.status
        messages = [r.getMessage() for r in caplog.records if r.name.startswith("oncely")]
        about_it = [m for m in messages if "refunded" in m]
        assert about_it, messages  # the duplicate is logged, with the path in its key
        assert not [m for m in messages if "\n" in m or "\r" in m]


class _CountingInput(io.BytesIO):
    """A ``wsgi.input`` that counts the bytes the middleware read."""

    consumed = 0

    def read(self, size: int | None = -1) -> bytes:
        data = super().read(size)
        self.consumed += len(data)
        return data


def _unexpected_app(*args: Any) -> Any:
    raise AssertionError("the app must not run for a body over the limit")


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_asgi_reads_no_more_than_the_limit(chunked: bool) -> None:
    """ASGI: a Content-Length over the limit is refused before any message is received; a
    chunked body is received only until it passes the limit."""
    received: list[int] = []

    async def receive() -> dict[str, Any]:
        received.append(1)
        return {"type": "http.request", "body": b"x" * 40, "more_body": True}

    sent: list[MutableMapping[str, Any]] = []

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    headers = [(b"idempotency-key", b"k-asgi-limit"), (b"content-type", b"application/json")]
    if not chunked:
        headers.append((b"content-length", b"1000"))
    scope = {"type": "http", "method": "POST", "path": "/payments", "headers": headers}
    middleware = AsgiMiddleware(
        _unexpected_app, store=MemoryStore(), policy=HttpPolicy(max_request_bytes=100)
    )
    asyncio.run(middleware(scope, receive, send))

    assert sent[0]["status"] == 413
    assert len(received) == (3 if chunked else 0)  # 40 + 40 + 40 > 100


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_wsgi_reads_no_more_than_the_limit(chunked: bool) -> None:
    """WSGI: a CONTENT_LENGTH over the limit is refused unread; a body without a length is read
    to at most one byte past the limit."""
    stream = _CountingInput(b"x" * 10_000)
    environ: dict[str, Any] = {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": "/payments",
        "HTTP_IDEMPOTENCY_KEY": "k-wsgi-limit",
        "CONTENT_TYPE": "application/json",
        "wsgi.input": stream,
    }
    if chunked:
        environ["wsgi.input_terminated"] = True
    else:
        environ["CONTENT_LENGTH"] = "10000"
    started: list[str] = []

    def start_response(status: str, headers: Any, exc_info: Any = None) -> Callable[[bytes], None]:
        started.append(status)
        return lambda data: None

    middleware = WsgiMiddleware(
        _unexpected_app, store=MemoryStore(), policy=HttpPolicy(max_request_bytes=100)
    )
    body = b"".join(middleware(environ, start_response))

    assert started[0].startswith("413 ")
    assert json.loads(body)["code"] == "request-too-large"
    assert stream.consumed == (101 if chunked else 0)
