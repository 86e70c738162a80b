"""The HTTP contract (docs/guides/http.md) as pure functions: `oncely.http._semantics` and
the shared flows.

No app, no server, no store: the flows are fed their replies by hand (they are sans-I/O), so
every row of the table is pinned down here before the HTTP suite runs it through real adapters.
"""

from __future__ import annotations

import hashlib
import json
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from oncely import (
    Acquired,
    ConfigurationError,
    CorruptRecordError,
    InProgress,
    InvalidKeyError,
    LeaseLost,
    Mismatch,
    Record,
    Replay,
    Status,
    StoreUnavailableError,
    _execution,
)
from oncely._core import codec
from oncely._core.fingerprint import canonical_json
from oncely._core.flow import drive
from oncely.http import (
    HttpPolicy,
    HttpRequest,
    RouteOptions,
    _flow,
    _semantics,
    default_fingerprint,
    default_scope,
)
from oncely.http._policy import REFUSAL_STATUSES
from oncely.http._routes import RouteMatch, RouteTable, compile_pattern, idempotent_route
from oncely.http._semantics import Response, ResponseCapture
from oncely.keys import from_header

POLICY = HttpPolicy()


def request(
    body: bytes = b'{"amount": 500}',
    *,
    method: str = "POST",
    path: str = "/payments",
    route: str | None = None,
    query: bytes = b"",
    headers: tuple[tuple[bytes, bytes], ...] = ((b"content-type", b"application/json"),),
) -> HttpRequest:
    return HttpRequest(method, path, route or path, query, headers, body)


class Script:
    """Answers a flow's store calls from a table (a value, or an exception to raise)."""

    def __init__(self, **answers: Any) -> None:
        self.answers = answers
        self.ops: list[Any] = []

    def __call__(self, op: Any) -> Any:
        self.ops.append(op)
        if isinstance(op, _execution.StoreCall):
            answer = self.answers.get(op.verb)
            if isinstance(answer, list):
                answer = answer.pop(0)
            if isinstance(answer, BaseException):
                raise answer
            return answer
        return None

    @property
    def verbs(self) -> list[str]:
        return [op.verb for op in self.ops if isinstance(op, _execution.StoreCall)]


def record(result: bytes | None, status: Status = Status.COMPLETED) -> Record:
    return Record(
        key="k",
        status=status,
        fingerprint="fp",
        token=1,
        attempt=1,
        lease_expires_at_ms=0,
        expires_at_ms=10**13,
        created_at_ms=0,
        updated_at_ms=0,
        result=result,
    )


def begin(script: Script, policy: HttpPolicy = POLICY) -> Any:
    plan = _semantics.Plan("scope|key", "fp")
    return drive(_flow.begin(plan, policy, method="POST", path="/payments"), script)


def document(response: Response) -> dict[str, Any]:
    assert dict(response.headers)[b"content-type"] == b"application/problem+json"
    assert dict(response.headers)[b"content-length"] == str(len(response.body)).encode()
    return json.loads(response.body)  # type: ignore[no-any-return]


# -- the table, row by row ------------------------------------------------------------------------


class TestDecide:
    """Rows 1-4: decided from the method and the key header alone."""

    @pytest.mark.parametrize("method", ["GET", "HEAD", "OPTIONS", "PUT", "DELETE"])
    def test_method_not_covered_passes_through(self, method: str) -> None:
        assert _semantics.decide(method, [b"key"], POLICY) is None

    def test_covered_method_without_key_passes_through(self) -> None:
        assert _semantics.decide("POST", [], POLICY) is None
        assert _semantics.decide("PATCH", [], POLICY) is None

    def test_covered_method_without_key_on_required_route_is_400_naming_the_header(self) -> None:
        policy = HttpPolicy(require_key=True, header="X-Request-Key")
        answer = _semantics.decide("POST", [], policy)

        assert isinstance(answer, Response)
        assert answer.status == 400
        body = document(answer)
        assert body["code"] == "idempotency-key-missing"
        assert body["header"] == "X-Request-Key"
        assert "X-Request-Key" in body["detail"]

    @pytest.mark.parametrize(
        "value",
        [b"", b" ", b"k" * 256, b"caf\xe9", "ключ".encode(), b"a\x00b", b"tab\there", b'"open',
         b'"a"b"', b'""', b'"bad\\escape"'],
    )  # fmt: skip
    def test_invalid_key_is_400(self, value: bytes) -> None:
        answer = _semantics.decide("POST", [value], POLICY)

        assert isinstance(answer, Response)
        assert answer.status == 400
        assert document(answer)["code"] == "idempotency-key-invalid"

    def test_key_sent_twice_is_400(self) -> None:
        answer = _semantics.decide("POST", [b"a", b"a"], POLICY)
        assert isinstance(answer, Response)
        assert answer.status == 400

    @pytest.mark.parametrize(
        ("value", "key"),
        [
            (b"8e03978e-40d5-43e8-bc93-6894a57f9324", "8e03978e-40d5-43e8-bc93-6894a57f9324"),
            (b'"8e03978e-40d5"', "8e03978e-40d5"),
            (b'"with \\"quotes\\" inside"', 'with "quotes" inside'),
            (b"k" * 255, "k" * 255),
            (b"  padded  ", "padded"),
        ],
    )
    def test_quoted_and_bare_keys_are_accepted(self, value: bytes, key: str) -> None:
        assert _semantics.decide("POST", [value], POLICY) == key

    @given(st.binary(max_size=300) | st.text(st.characters(max_codepoint=127)).map(str.encode))
    def test_read_key_agrees_with_from_header(self, value: bytes) -> None:
        """The fast path for bare keys answers exactly as `oncely.keys.from_header`, except
        that a key with a comma is refused (it cannot be told from a repeated header)."""
        try:
            expected: str | type[InvalidKeyError] = from_header(value)
        except InvalidKeyError:
            expected = InvalidKeyError
        if isinstance(expected, str) and "," in expected:
            expected = InvalidKeyError
        try:
            got: str | type[InvalidKeyError] = _semantics.read_key([value])
        except InvalidKeyError:
            got = InvalidKeyError
        assert got == expected


class TestBegin:
    """Rows 5-9: what the claim's answer turns into."""

    def test_first_request_acquires_the_lease_and_starts_the_heartbeat(self) -> None:
        script = Script(claim=Acquired(7))
        lease = begin(script)

        assert isinstance(lease, _execution.Lease)
        assert lease.token == 7
        assert isinstance(script.ops[-1], _execution.StartHeartbeat)
        claim = script.ops[0]
        assert claim.args == ("scope|key", "fp")
        assert claim.kwargs == {"lease": timedelta(seconds=30), "ttl": timedelta(hours=24)}

    def test_repeat_of_a_completed_request_replays_it_with_the_marker(self) -> None:
        stored = Response(201, ((b"location", b"/p/1"), (b"etag", b'"1"')), b"\x00body\xff")
        result = codec.encode_value(_semantics.encode_snapshot(stored))
        answer = begin(Script(claim=Replay(record(result))))

        assert answer.status == 201
        assert answer.body == b"\x00body\xff"
        assert answer.headers == (
            (b"location", b"/p/1"),
            (b"etag", b'"1"'),
            (b"idempotent-replayed", b"true"),
        )

    def test_replay_marker_is_configurable(self) -> None:
        stored = codec.encode_value(_semantics.encode_snapshot(Response(200, (), b"")))
        answer = begin(Script(claim=Replay(record(stored))), HttpPolicy(replay_header=None))
        assert answer.headers == ()
        answer = begin(Script(claim=Replay(record(stored))), HttpPolicy(replay_header=("X-R", "1")))
        assert answer.headers == ((b"x-r", b"1"),)

    def test_repeat_while_the_first_executes_is_409_with_a_short_retry_after(self) -> None:
        """Retry-After is a short hint to poll again, never the lease's remaining time."""
        answer = begin(Script(claim=InProgress(timedelta(seconds=25))))

        assert answer.status == 409
        assert dict(answer.headers)[b"retry-after"] == b"1"
        assert document(answer)["code"] == "idempotency-key-in-use"

    def test_retry_after_is_at_least_one_second(self) -> None:
        answer = begin(Script(claim=InProgress(timedelta(milliseconds=5))))
        assert dict(answer.headers)[b"retry-after"] == b"1"

    def test_same_key_different_fingerprint_is_422(self) -> None:
        answer = begin(Script(claim=Mismatch("other")))

        assert answer.status == 422
        assert document(answer)["code"] == "idempotency-key-reused"

    def test_store_unreachable_is_503_with_retry_after(self) -> None:
        answer = begin(Script(claim=StoreUnavailableError("down", backend="x")))

        assert answer.status == 503
        assert dict(answer.headers)[b"retry-after"] == b"1"
        assert document(answer)["code"] == "idempotency-store-unavailable"

    def test_unavailable_retry_after_is_configurable(self) -> None:
        policy = HttpPolicy(unavailable_retry_after=timedelta(seconds=7))
        answer = begin(Script(claim=StoreUnavailableError("down", backend="x")), policy)
        assert dict(answer.headers)[b"retry-after"] == b"7"

    def test_store_unreachable_on_a_fail_open_route_passes_through_and_logs(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        answer = begin(
            Script(claim=StoreUnavailableError("down", backend="x")), HttpPolicy(fail_open=True)
        )

        assert answer is _flow.PASS_THROUGH
        assert "UNPROTECTED" in caplog.text

    def test_corrupt_record_fails_closed_even_when_fail_open(self) -> None:
        corrupt = CorruptRecordError("bad", backend="x", key="k")
        answer = begin(Script(claim=corrupt), HttpPolicy(fail_open=True))

        assert answer.status == 500
        assert document(answer)["code"] == "idempotency-record-corrupt"

    @pytest.mark.parametrize(
        "result",
        [
            None,
            b"not an outcome",
            codec.encode_value(b"not a snapshot"),
            codec.encode_value(_semantics.encode_snapshot(Response(200, (), b"x"))[:-1]),
            codec.encode_error(ValueError("stored failure")),
        ],
    )
    def test_undecodable_stored_outcome_fails_closed(self, result: bytes | None) -> None:
        answer = begin(Script(claim=Replay(record(result))))
        assert answer.status == 500
        assert document(answer)["code"] == "idempotency-record-corrupt"

    def test_failed_record_fails_closed(self) -> None:
        stored = codec.encode_value(_semantics.encode_snapshot(Response(200, (), b"")))
        answer = begin(Script(claim=Replay(record(stored, Status.FAILED))))
        assert answer.status == 500

    def test_response_that_was_too_large_is_a_500_problem_never_a_rerun(self) -> None:
        marker = codec.encode_unavailable("the response body is over the 10-byte limit")
        answer = begin(Script(claim=Replay(record(marker))))

        assert answer.status == 500
        body = document(answer)
        assert body["code"] == "response-not-stored"
        assert "10-byte limit" in body["detail"]


class TestFinish:
    """Row 10 and storage: which responses are stored, and how."""

    def lease(self) -> _execution.Lease:
        return _execution.Lease("scope|key", 3, timedelta(seconds=30))

    def capture(self, status: int, *chunks: bytes, policy: HttpPolicy = POLICY) -> ResponseCapture:
        capture = ResponseCapture(policy.max_response_bytes)
        capture.start(status, [(b"content-type", b"text/plain"), (b"set-cookie", b"s=1")], policy)
        for chunk in chunks:
            capture.add(chunk)
        capture.complete = True
        return capture

    @pytest.mark.parametrize("status", [200, 201, 204, 301, 400, 404, 410, 412, 499])
    def test_outcomes_below_500_are_stored(self, status: int) -> None:
        script = Script(complete=None)
        drive(_flow.finish(self.lease(), self.capture(status, b"ab", b"cd"), POLICY), script)

        assert script.verbs == ["complete"]
        payload = script.ops[0].args[2]
        stored = _semantics.decode_snapshot(codec.decode_outcome(payload).body)
        assert stored.status == status
        assert stored.body == b"abcd"
        assert stored.headers == ((b"content-type", b"text/plain"),)  # no set-cookie

    @pytest.mark.parametrize(
        "extra",
        [(), ((b"connection", b"x-hop"), (b"x-hop", b"1"), (b"x-kept", b"2"))],
        ids=["plain", "connection"],
    )
    def test_the_stored_outcome_is_the_framed_snapshot_byte_for_byte(
        self, extra: tuple[tuple[bytes, bytes], ...]
    ) -> None:
        # The snapshot is written behind the outcome's frame in one join: the same bytes as
        # framing the snapshot afterwards, on both encoding paths (with and without Connection).
        capture = ResponseCapture(POLICY.max_response_bytes)
        headers = [(b"content-type", b"text/plain"), (b"set-cookie", b"s=1"), *extra]
        capture.start(201, headers, POLICY)
        capture.add(b"ab")
        capture.add(b"cd")
        expected = codec.encode_value(
            _semantics.encode_snapshot(
                Response(201, _semantics.storable_headers(headers, POLICY), b"abcd")
            )
        )
        assert _flow.stored_outcome(self.lease(), capture, POLICY) == expected

    @pytest.mark.parametrize("status", [401, 403, 408, 409, 422, 423, 425, 429, 500, 502, 503, 504])
    def test_refusals_and_5xx_are_not_stored_and_the_lease_is_released(self, status: int) -> None:
        script = Script(release=None)
        drive(_flow.finish(self.lease(), self.capture(status, b"oops"), POLICY), script)
        assert script.verbs == ["release"]

    def test_stored_statuses_are_configurable(self) -> None:
        policy = HttpPolicy(stored_statuses={200, 201, 503})
        script = Script(complete=None)
        drive(_flow.finish(self.lease(), self.capture(503, policy=policy), policy), script)
        assert script.verbs == ["complete"]
        script = Script(release=None)
        drive(_flow.finish(self.lease(), self.capture(404, policy=policy), policy), script)
        assert script.verbs == ["release"]

    def test_handler_raised_releases_the_lease(self) -> None:
        script = Script(release=None)
        drive(_flow.abort(self.lease(), RuntimeError("boom"), POLICY), script)
        assert script.verbs == ["release"]

    def test_response_over_the_limit_completes_with_a_marker(self) -> None:
        policy = HttpPolicy(max_response_bytes=10)
        capture = self.capture(201, b"x" * 6, b"y" * 6, policy=policy)
        script = Script(complete=None)
        drive(_flow.finish(self.lease(), capture, policy), script)

        assert capture.overflowed
        assert capture.chunks == []  # nothing kept past the limit
        outcome = codec.decode_outcome(script.ops[0].args[2])
        assert outcome.kind == "unavailable"
        assert "10-byte limit" in outcome.reason

    def test_exactly_the_limit_is_stored(self) -> None:
        policy = HttpPolicy(max_response_bytes=10)
        script = Script(complete=None)
        drive(
            _flow.finish(self.lease(), self.capture(201, b"x" * 10, policy=policy), policy), script
        )
        assert codec.decode_outcome(script.ops[0].args[2]).kind == "value"

    def test_store_failure_after_the_handler_is_logged_not_raised(
        self, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        monkeypatch.setattr(_execution.flows, "SETTLE_RETRY_DELAYS", (0.0,))
        down = StoreUnavailableError("down", backend="x")
        script = Script(complete=[down, down])
        drive(_flow.finish(self.lease(), self.capture(201, b"ok"), POLICY), script)

        assert script.verbs == ["complete", "complete"]
        assert "after the handler ran" in caplog.text

    def test_lease_lost_at_complete_is_logged_not_raised(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        script = Script(complete=LeaseLost())
        drive(_flow.finish(self.lease(), self.capture(201, b"ok"), POLICY), script)
        assert "lease lost" in caplog.text


# -- scope and fingerprint ------------------------------------------------------------------------


class TestScope:
    def test_scope_is_method_and_route(self) -> None:
        """Who is asking is not in the scope: a refreshed token finds its record."""
        anonymous = default_scope(request(route="/payments/{id}", path="/payments/1"))
        alice = default_scope(
            request(route="/payments/{id}", headers=((b"authorization", b"Bearer alice"),))
        )
        assert anonymous == alice == "POST /payments/{id}"

    def test_plan_keeps_the_owner_in_the_fingerprint(self) -> None:
        alice = _semantics.plan(
            request(headers=((b"authorization", b"Bearer alice"),)), "k", POLICY
        )
        bob = _semantics.plan(request(headers=((b"authorization", b"Bearer bob"),)), "k", POLICY)
        anonymous = _semantics.plan(request(), "k", POLICY)
        assert isinstance(alice, _semantics.Plan)
        assert isinstance(bob, _semantics.Plan)
        assert isinstance(anonymous, _semantics.Plan)
        assert alice.key == bob.key == anonymous.key
        assert len({alice.fingerprint, bob.fingerprint, anonymous.fingerprint}) == 3
        assert anonymous.fingerprint.startswith("- h1:")
        assert alice.fingerprint.startswith("a:")
        assert "alice" not in alice.fingerprint  # a digest, never the credential

    def test_custom_scope_and_fingerprint(self) -> None:
        policy = HttpPolicy(
            scope=lambda r: r.header("x-tenant") or "none",
            fingerprint=lambda r: r.body[:3],
        )
        one = request(b"abc-1", headers=((b"x-tenant", b"t1"),))
        two = request(b"abc-2", headers=((b"x-tenant", b"t1"),))
        assert _semantics.plan(one, "k", policy) == _semantics.plan(two, "k", policy)


class TestFingerprint:
    def fp(self, req: HttpRequest) -> str:
        """The request's digest, without the owner (anonymous here)."""
        planned = _semantics.plan(req, "k", POLICY)
        assert isinstance(planned, _semantics.Plan)
        owner, _, digest = planned.fingerprint.partition(" ")
        assert owner == _semantics.ANONYMOUS
        return digest

    def test_json_bodies_are_canonical(self) -> None:
        assert self.fp(request(b'{"a": 1, "b": [1.0, "x"]}')) == self.fp(
            request(b'{"b":[1,"x"],\n"a":1.00}')
        )

    def test_json_media_types(self) -> None:
        problem_json = ((b"content-type", b"application/merge-patch+json; charset=utf-8"),)
        assert self.fp(request(b'{"a":1}', headers=problem_json)) == self.fp(
            request(b'{ "a" : 1 }', headers=problem_json)
        )

    def test_non_json_bodies_are_raw_bytes(self) -> None:
        form = ((b"content-type", b"application/x-www-form-urlencoded"),)
        assert self.fp(request(b'{"a":1}', headers=form)) != self.fp(
            request(b'{ "a":1}', headers=form)
        )

    def test_query_order_does_not_matter_but_values_do(self) -> None:
        assert self.fp(request(query=b"a=1&b=2")) == self.fp(request(query=b"b=2&a=1"))
        assert self.fp(request(query=b"a=1&b=2")) != self.fp(request(query=b"a=1&b=3"))

    @pytest.mark.parametrize(
        "change", [{"method": "PATCH"}, {"path": "/payments/2"}, {"body": b'{"amount": 501}'}]
    )
    def test_method_path_and_body_matter(self, change: dict[str, Any]) -> None:
        assert self.fp(request()) != self.fp(request(**change))

    @pytest.mark.parametrize(
        "body",
        [b"{not json", b"\xff\xfe", b"[" * 50_000, b'{"a": NaN}', b"\x00" * 10],
    )
    def test_body_labelled_json_that_is_not_json_is_fingerprinted_raw(self, body: bytes) -> None:
        fingerprint = default_fingerprint(request(body))
        assert fingerprint[-1].startswith("raw:")
        assert self.fp(request(body)) != self.fp(request(body + b"!"))

    def test_large_numbers_keep_their_precision(self) -> None:
        assert self.fp(request(b'{"a": 0.10000000000000000001}')) != self.fp(request(b'{"a": 0.1}'))

    @given(st.binary(max_size=512), st.sampled_from(["application/json", "text/plain", ""]))
    def test_any_body_fingerprints_without_raising(self, body: bytes, media: str) -> None:
        headers = ((b"content-type", media.encode()),)
        planned = _semantics.plan(request(body, headers=headers), "k", POLICY)
        assert isinstance(planned, _semantics.Plan)
        assert planned.fingerprint

    @pytest.mark.parametrize(
        ("query", "content_type", "body", "fingerprint"),
        [
            (b"", b"application/json", b'{"amount":500,"currency":"EUR"}',
             "89ebb2a6de3b94f86bd0384b60b0dbb0817b47b22db2522bf4bab70be71a5452"),
            (b"b=2&a=1&a=0", b"application/json",
             b'{"b":[1.0,"x\\u00e9\\ud800"],"a":1.10,"c":{"z":null,"y":true}}',
             "aee9c95bc10d2a97ba5e9e10aa58fb1f6b4ab887b35571c5f9d0e7d1e030d981"),
            (b"", b"application/merge-patch+json; charset=utf-8",
             b"[1e100, -0, 12345678901234567890, 1e-100]",
             "543e2626f6b06b218f777bcce34d13ce11477f5a32684a8180fd1f6961e44b26"),
            # Past 100 zeros a number keeps its exponent ("1e400"); it used to be expanded, at
            # a cost that grew with the exponent (1e1000000 took seconds), so this one changed.
            (b"", b"application/merge-patch+json; charset=utf-8",
             b"[1e400, -0, 12345678901234567890]",
             "6f7803c479a89f4751b1d7387dcde66dc7870c9346b684e661327cac2d506219"),
            (b"", b"application/json", b'{"a": NaN}',
             "114fcfd7da6cf64c73b281eaaf2769a1f24d44fd2bea8003cb15c9f731576371"),
            (b"", b"application/json", b'\xef\xbb\xbf{"a":1}',
             "bb97a6193e8bf7efe9a612ec62be8d398b5f1a6b4bbc3ba4987766e0fccf7e7f"),
            (b"", b"application/json", '{"a":"\u00e9"}'.encode("utf-16"),
             "16abba070222ab817f083f949f6d41036f3b2743e396280530b818f200c4713d"),
        ],
    )  # fmt: skip
    def test_golden_fingerprints(
        self, query: bytes, content_type: bytes, body: bytes, fingerprint: str
    ) -> None:
        """Fingerprints are stored: the default one never changes for the same request."""
        req = request(body, query=query, headers=((b"content-type", content_type),))
        assert self.fp(req) == "h1:" + fingerprint

    @given(
        st.recursive(
            st.none()
            | st.booleans()
            | st.integers()
            | st.text()
            | st.floats(allow_nan=False, allow_infinity=False),
            lambda inner: (
                st.lists(inner, max_size=4)
                | st.dictionaries(st.text(max_size=8), inner, max_size=4)
            ),
            max_leaves=20,
        ),
        st.text(max_size=20),
        st.sampled_from([b"", b"b=2&a=1", b"x=%C3%A9&x=1&flag"]),
    )
    def test_default_fingerprint_is_its_digest(
        self, document: Any, path: str, query: bytes
    ) -> None:
        """The digest of a request is the digest of `default_fingerprint`'s parts, with JSON
        bodies in `canonical_json`'s spelling, however the fast paths compute it."""
        body = json.dumps(document).encode()
        req = request(body, path=path, query=query)
        parts = default_fingerprint(req)
        assert (
            parts[-1]
            == "json:"
            + hashlib.sha256(
                canonical_json(json.loads(body, parse_float=Decimal)).encode("ascii")
            ).hexdigest()
        )
        text = json.dumps(parts, ensure_ascii=True, separators=(",", ":"))
        assert self.fp(req) == "h1:" + hashlib.sha256(text.encode("ascii")).hexdigest()


# -- headers and the snapshot ---------------------------------------------------------------------


class TestHeaders:
    def test_hop_by_hop_and_set_cookie_are_not_stored(self) -> None:
        headers = [
            (b"Content-Type", b"application/json"),
            (b"Connection", b"keep-alive, X-Per-Hop"),
            (b"Keep-Alive", b"timeout=5"),
            (b"Transfer-Encoding", b"chunked"),
            (b"X-Per-Hop", b"1"),
            (b"Set-Cookie", b"session=secret"),
            (b"Location", b"/p/1"),
            (b"ETag", b'"v1"'),
            (b"Link", b"<a>"),
            (b"Link", b"<b>"),
        ]
        assert _semantics.storable_headers(headers, POLICY) == (
            (b"Content-Type", b"application/json"),
            (b"Location", b"/p/1"),
            (b"ETag", b'"v1"'),
            (b"Link", b"<a>"),
            (b"Link", b"<b>"),
        )

    @given(
        st.lists(
            st.tuples(
                st.sampled_from([b"Connection", b"connection", b"Set-Cookie", b"TE", b"\xc4"])
                | st.binary(max_size=6),
                st.sampled_from([b"close", b"X-A, \xe4", b""]) | st.binary(max_size=6),
            ),
            max_size=6,
        )
    )
    def test_storable_headers_match_their_definition(
        self, headers: list[tuple[bytes, bytes]]
    ) -> None:
        dropped = set(_semantics.HOP_BY_HOP) | set(POLICY.unreplayed_headers)
        for name, value in headers:
            if name.lower() == b"connection":
                dropped.update(t.strip().lower() for t in value.decode("latin-1").split(","))
        kept = [(n, v) for n, v in headers if n.decode("latin-1").lower() not in dropped]
        assert _semantics.storable_headers(headers, POLICY) == tuple(kept)

    def test_unreplayed_headers_are_configurable(self) -> None:
        policy = HttpPolicy(unreplayed_headers={"X-Secret"})
        headers = [(b"set-cookie", b"a=1"), (b"x-secret", b"2"), (b"upgrade", b"h2c")]
        assert _semantics.storable_headers(headers, policy) == ((b"set-cookie", b"a=1"),)


class TestSnapshot:
    @given(
        st.integers(100, 999),
        st.lists(st.tuples(st.binary(max_size=40), st.binary(max_size=200)), max_size=8),
        st.binary(max_size=4096),
        st.binary(max_size=255),
    )
    def test_round_trip_is_byte_for_byte(
        self, status: int, headers: list[tuple[bytes, bytes]], body: bytes, reason: bytes
    ) -> None:
        response = Response(status, tuple(headers), body, reason)
        assert _semantics.decode_snapshot(_semantics.encode_snapshot(response)) == response

    def test_format_is_versioned_and_never_pickle(self) -> None:
        data = _semantics.encode_snapshot(Response(201, ((b"a", b"b"),), b"body"))
        assert data.startswith(b"oncely-http\x01")
        assert b"\x80\x04" not in data[:2]  # not a pickle protocol header

    @pytest.mark.parametrize(
        "data",
        [
            b"",
            b"oncely-http",
            b"something-else-entirely-long-enough",
            b"oncely-http\x02" + b"\x00" * 20,
        ],
    )
    def test_foreign_or_unknown_versions_are_rejected(self, data: bytes) -> None:
        with pytest.raises(ValueError):
            _semantics.decode_snapshot(data)

    def test_truncation_and_padding_are_rejected(self) -> None:
        data = _semantics.encode_snapshot(Response(200, ((b"k", b"v"),), b"body"))
        for cut in range(len(data)):
            with pytest.raises(ValueError):
                _semantics.decode_snapshot(data[:cut])
        with pytest.raises(ValueError):
            _semantics.decode_snapshot(data + b"x")

    def test_status_out_of_range_is_rejected(self) -> None:
        with pytest.raises(ValueError):
            _semantics.encode_snapshot(Response(42, (), b""))

    def test_wsgi_status_line_keeps_the_reason(self) -> None:
        assert Response(201, (), b"", b"CREATED").status_line() == "201 CREATED"
        assert Response(201, (), b"").status_line() == "201 Created"
        assert Response(599, (), b"").status_line() == "599 Unknown"


# -- policy and routes ----------------------------------------------------------------------------


class TestPolicy:
    def test_defaults(self) -> None:
        policy = HttpPolicy()
        assert policy.methods == {"POST", "PATCH"}
        assert policy.covers("POST")
        assert not policy.covers("PUT")
        assert policy.stores(499)
        assert policy.stores(400)
        assert not policy.stores(500)
        assert not any(policy.stores(status) for status in REFUSAL_STATUSES)
        assert repr(policy.stored_statuses) == "DEFAULT_STORED_STATUSES"
        assert policy.core.lease == timedelta(seconds=30)
        assert policy.environ_key == "HTTP_IDEMPOTENCY_KEY"
        assert policy.header_name == b"idempotency-key"

    @pytest.mark.parametrize(
        "options",
        [
            {"methods": ["GET"]},
            {"methods": "POST"},
            {"header": "Bad Header"},
            {"ttl": 1, "lease": 5},
            {"lease": 0},
            {"max_response_bytes": -1},
            {"replay_header": ("ok", "bad\nvalue")},
            {"require_key": "yes"},
            {"scope": "not callable"},
        ],
    )
    def test_invalid_settings_fail_at_construction(self, options: dict[str, Any]) -> None:
        with pytest.raises(ConfigurationError):
            HttpPolicy(**options)

    def test_route_options_override_only_what_they_set(self) -> None:
        base = HttpPolicy(lease=5, ttl=60)
        derived = base.with_options(RouteOptions(require_key=True, methods={"post", "put"}))

        assert derived.require_key
        assert derived.methods == {"POST", "PUT"}
        assert derived.core.lease == timedelta(seconds=5)
        assert base.with_options(RouteOptions()) is base

    def test_route_options_are_validated_when_built(self) -> None:
        with pytest.raises(ConfigurationError):
            RouteOptions(lease=-1)
        with pytest.raises(ConfigurationError):
            idempotent_route(methods=["HEAD"])


class TestRoutes:
    @pytest.mark.parametrize(
        ("pattern", "path", "matches"),
        [
            ("/payments", "/payments", True),
            ("/payments", "/payments/1", False),
            ("/payments/{id}", "/payments/1", True),
            ("/payments/{id}", "/payments/1/refunds", False),
            ("/files/{rest:path}", "/files/a/b/c", True),
            ("/a/*/c", "/a/b/c", True),
            ("/a/**", "/a/b/c", True),
            ("/x.y", "/xzy", False),
        ],
    )
    def test_patterns(self, pattern: str, path: str, matches: bool) -> None:
        _, regex, _ = compile_pattern(pattern)
        assert bool(regex.fullmatch(path)) is matches

    def test_bad_patterns_are_configuration_errors(self) -> None:
        for pattern in ("payments", "POST payments", "/a/{id:float}"):
            with pytest.raises(ConfigurationError):
                compile_pattern(pattern)

    def test_precedence_app_then_pattern_then_view(self) -> None:
        @idempotent_route(lease=9)
        def view() -> None: ...

        table = RouteTable(
            HttpPolicy(lease=3),
            {
                "POST /payments/{id}": RouteOptions(require_key=True),
                "/payments/**": RouteOptions(lease=4),
            },
            None,
        )
        policy, route = table.select("POST", "/payments/1", None)
        assert (policy.require_key, policy.core.lease, route) == (
            True,
            timedelta(seconds=3),
            "/payments/{id}",
        )
        policy, route = table.select("PATCH", "/payments/1", None)
        assert (policy.require_key, policy.core.lease, route) == (
            False,
            timedelta(seconds=4),
            "/payments/**",
        )
        policy, route = table.select("POST", "/payments/1", RouteMatch("/payments/{pid}", view))
        assert (policy.require_key, policy.core.lease, route) == (
            True,
            timedelta(seconds=9),
            "/payments/{pid}",
        )
        policy, route = table.select("POST", "/other", None)
        assert (policy.core.lease, route) == (timedelta(seconds=3), "/other")

    def test_decorator_returns_the_view_unchanged(self) -> None:
        def view() -> str:
            return "ok"

        assert idempotent_route(require_key=True)(view) is view
        assert view() == "ok"
