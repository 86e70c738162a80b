"""`oncely.http.client`: one key per logical request, retried safely, sync and async alike.

The wrapped transport is an ``httpx.MockTransport`` scripted per test; ``test_servers.py`` runs
the transports against real servers over sockets.
"""

from __future__ import annotations

import email.utils
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import anyio
import httpx
import pytest

from oncely.http._retry import MAX_RETRY_AFTER, RetryPolicy, parse_retry_after
from oncely.http.client import (
    ATTEMPTS_EXTENSION,
    AsyncIdempotentTransport,
    IdempotentTransport,
    OutcomeUnknownError,
)

Step = int | tuple[int, dict[str, str]] | type[Exception]


class Server:
    """Answers each attempt from a script: a status, (status, headers), or an exception type."""

    def __init__(self, *steps: Step) -> None:
        self.steps = list(steps)
        self.requests: list[httpx.Request] = []
        self.bodies: list[bytes] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        self.bodies.append(request.read())
        step = self.steps.pop(0) if self.steps else 201
        if isinstance(step, type):
            raise step("scripted failure", request=request)  # type: ignore[call-arg]
        status, headers = step if isinstance(step, tuple) else (step, {})
        return httpx.Response(status, headers=headers, content=b"answer")

    @property
    def keys(self) -> list[str | None]:
        return [r.headers.get("idempotency-key") for r in self.requests]


FAST = {"backoff": 0.001, "max_backoff": 0.002, "seed": 1}


def sync_post(server: Server, **options: Any) -> Callable[..., httpx.Response]:
    def post(method: str = "POST", **kwargs: Any) -> httpx.Response:
        transport = IdempotentTransport(httpx.MockTransport(server), **{**FAST, **options})
        with httpx.Client(transport=transport, base_url="http://api") as client:
            return client.request(method, "/payments", **kwargs)

    return post


def async_post(server: Server, **options: Any) -> Callable[..., httpx.Response]:
    def post(method: str = "POST", **kwargs: Any) -> httpx.Response:
        async def go() -> httpx.Response:
            transport = AsyncIdempotentTransport(httpx.MockTransport(server), **{**FAST, **options})
            async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
                return await client.request(method, "/payments", **kwargs)

        return anyio.run(go)

    return post


@pytest.fixture(params=["sync", "async"])
def client(request: pytest.FixtureRequest) -> Callable[..., Callable[..., httpx.Response]]:
    """A factory: ``client(server, **options)`` returns a ``post(method, **kwargs)``."""
    return sync_post if request.param == "sync" else async_post


def test_covered_request_gets_one_key_for_every_attempt(client: Any) -> None:
    """Each attempt carries the same generated key."""
    server = Server(503, httpx.ConnectError, 409, 429, 201)
    response = client(server)(json={"amount": 5})

    assert response.status_code == 201
    assert response.extensions[ATTEMPTS_EXTENSION] == 5
    assert len(set(server.keys)) == 1
    assert uuid.UUID(str(server.keys[0]))
    assert set(server.bodies) == {b'{"amount":5}'}


def test_caller_key_is_kept(client: Any) -> None:
    server = Server(503, 201)
    client(server)(json={}, headers={"Idempotency-Key": "mine"})
    assert server.keys == ["mine", "mine"]


def test_logical_requests_get_different_keys() -> None:
    server = Server()
    transport = IdempotentTransport(httpx.MockTransport(server))
    with httpx.Client(transport=transport, base_url="http://api") as http:
        http.post("/payments")
        http.post("/payments")
    assert server.keys[0] != server.keys[1]


@pytest.mark.parametrize(
    "failure",
    [httpx.ConnectError, httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout,
     httpx.ReadError, httpx.RemoteProtocolError],
)  # fmt: skip
def test_connection_errors_and_timeouts_are_retried(client: Any, failure: type[Exception]) -> None:
    server = Server(failure, failure, 201)
    assert client(server)().status_code == 201
    assert len(server.requests) == 3


@pytest.mark.parametrize("status", [400, 404, 422, 500, 502])
def test_other_statuses_are_returned_at_once(client: Any, status: int) -> None:
    server = Server(status)
    assert client(server)().status_code == status
    assert len(server.requests) == 1


def test_non_retryable_errors_are_raised_at_once(client: Any) -> None:
    server = Server(httpx.UnsupportedProtocol)
    with pytest.raises(httpx.UnsupportedProtocol):
        client(server)()
    assert len(server.requests) == 1


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE", "HEAD"])
def test_uncovered_methods_pass_through_without_key_or_retry(client: Any, method: str) -> None:
    server = Server(503)
    assert client(server)(method).status_code == 503
    assert server.keys == [None]


def test_covered_methods_are_configurable(client: Any) -> None:
    server = Server(503, 200)
    assert client(server, methods={"PUT"})("PUT").status_code == 200
    assert len(set(server.keys)) == 1


def test_attempts_are_bounded(client: Any) -> None:
    server = Server(*[503] * 10)
    response = client(server, max_attempts=3)()
    assert response.status_code == 503
    assert len(server.requests) == 3


def test_last_error_is_raised_when_attempts_run_out(client: Any) -> None:
    server = Server(*[httpx.ConnectError] * 10)
    with pytest.raises(httpx.ConnectError):
        client(server, max_attempts=4)()
    assert len(server.requests) == 4


def test_retry_after_is_honoured(client: Any) -> None:
    """A 429's Retry-After (whole seconds) is waited for, not the tiny backoff."""
    server = Server((429, {"Retry-After": "1"}), 201)
    started = time.monotonic()
    assert client(server)().status_code == 201
    assert time.monotonic() - started >= 1.0


def test_in_progress_is_retried_within_the_budget(client: Any) -> None:
    """A 409 is polled again within the budget, even when its Retry-After names a whole lease:
    the request in progress may finish any moment."""
    server = Server((409, {"Retry-After": "30"}), (409, {"Retry-After": "30"}), 201)
    response = client(server, max_elapsed=30, max_backoff=0.01)()
    assert response.status_code == 201
    assert len(server.requests) == 3
    assert len(set(server.keys)) == 1


def test_retry_after_beyond_the_time_budget_returns_the_response(client: Any) -> None:
    """A pause that would end past max_elapsed is not taken."""
    server = Server((503, {"Retry-After": "120"}), 201)
    started = time.monotonic()
    response = client(server, max_elapsed=5)()
    assert response.status_code == 503
    assert response.headers["retry-after"] == "120"
    assert time.monotonic() - started < 1
    assert len(server.requests) == 1


@pytest.mark.parametrize("value", ["\u00b2".encode(), b"\xb2", "\u0663".encode(), b"1e9"])
def test_a_retry_after_that_is_not_delay_seconds_falls_back_to_the_backoff(
    client: Any, value: bytes
) -> None:
    """A server's Retry-After of a superscript two (a digit to ``str.isdigit``, not to
    ``float``) or other non-ASCII digits is absent: the backoff applies, nothing raises."""
    seen: list[bytes] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.read())
        if len(seen) == 1:
            return httpx.Response(503, headers=[(b"Retry-After", value)])
        return httpx.Response(201)

    transport = client(handler)
    assert transport().status_code == 201
    assert len(seen) == 2


def test_retried_responses_are_closed(client: Any) -> None:
    """The transport closes each response it retries, returning connections to the pool."""
    closed: list[int] = []

    class Tracked(httpx.ByteStream):
        def close(self) -> None:
            closed.append(1)

        async def aclose(self) -> None:
            closed.append(1)

    statuses = [503, 503, 201]

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(statuses.pop(0), stream=Tracked(b"x"))

    response = client(handler)()
    assert response.status_code == 201
    assert len(closed) >= 2


def test_streamed_request_bodies_are_replayed_whole(client: Any) -> None:
    """A body given as an iterator is read once and sent whole on every attempt."""
    server = Server(503, 201)

    def pieces() -> Iterator[bytes]:
        yield b"ab"
        yield b"cd"

    post = client(server)
    if post.__qualname__.startswith("async"):

        async def apieces() -> Any:
            for piece in pieces():
                yield piece

        post(content=apieces())
    else:
        post(content=pieces())
    assert server.bodies == [b"abcd", b"abcd"]


class TestRetryPolicy:
    def test_backoff_grows_and_is_capped_with_jitter(self) -> None:
        import random

        policy = RetryPolicy(backoff=0.1, max_backoff=1.0)
        rng = random.Random(3)
        pauses = [policy.pause(attempt, rng) for attempt in range(1, 8)]
        assert 0.05 <= pauses[0] <= 0.1
        assert 0.1 <= pauses[1] <= 0.2
        assert all(0.5 <= pause <= 1.0 for pause in pauses[4:])

    @pytest.mark.parametrize(
        "options", [{"max_attempts": 0}, {"backoff": -1}, {"max_attempts": True}]
    )
    def test_invalid(self, options: dict[str, Any]) -> None:
        from oncely import ConfigurationError

        with pytest.raises(ConfigurationError):
            RetryPolicy(**options)

    def test_parse_retry_after(self) -> None:
        now = datetime(2030, 1, 1, tzinfo=timezone.utc)
        later = email.utils.format_datetime(now + timedelta(seconds=30), usegmt=True)
        assert parse_retry_after("7") == 7.0
        assert parse_retry_after(later, now=now) == 30.0
        assert (
            parse_retry_after(email.utils.format_datetime(now, usegmt=True), now=now + timedelta(1))
            == 0.0
        )
        assert parse_retry_after(None) is None
        assert parse_retry_after("soon") is None
        assert parse_retry_after("-1") is None

    @pytest.mark.parametrize(
        "value", ["\u00b2", "1\u00b2", "\u0663", "\uff17", "1_0", "+5", "1.5", " "]
    )
    def test_a_retry_after_that_is_not_ascii_digits_is_absent(self, value: str) -> None:
        """RFC 9110: delay-seconds is 1*DIGIT in ASCII; anything else (a superscript two,
        Arabic-Indic or full-width digits, an underscore int() accepts) is treated as absent."""
        assert parse_retry_after(value) is None

    def test_an_absurd_retry_after_is_capped(self) -> None:
        now = datetime(2030, 1, 1, tzinfo=timezone.utc)
        far = email.utils.format_datetime(datetime(9999, 1, 1, tzinfo=timezone.utc), usegmt=True)
        assert parse_retry_after("1" + "0" * 20) == MAX_RETRY_AFTER
        assert parse_retry_after("9" * 5000) == MAX_RETRY_AFTER
        assert parse_retry_after(far, now=now) == MAX_RETRY_AFTER
        assert parse_retry_after(str(int(MAX_RETRY_AFTER) - 1)) == MAX_RETRY_AFTER - 1


def test_importing_the_client_without_httpx_names_the_extra(tmp_path: Any) -> None:
    """With httpx missing, the import fails with MissingDependencyError naming oncely[httpx]."""
    import subprocess
    import sys

    (tmp_path / "httpx.py").write_text("raise ImportError('no httpx here')\n")
    code = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "try:\n    import oncely.http.client\n"
        "except ImportError as exc:\n    print(type(exc).__name__, exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True
    )
    assert "MissingDependencyError" in done.stdout
    assert "oncely[httpx]" in done.stdout


def test_a_body_that_fails_mid_read_is_retried_with_the_key(client: Any) -> None:
    """The transport reads the whole body inside the retry loop: a timeout while it arrives
    is retried under the same key, and the caller gets a response already read."""
    keys: list[str | None] = []

    class Stalls(httpx.SyncByteStream, httpx.AsyncByteStream):
        def __iter__(self) -> Iterator[bytes]:
            yield b"par"
            raise httpx.ReadTimeout("the body stalled")

        async def __aiter__(self) -> Any:
            yield b"par"
            raise httpx.ReadTimeout("the body stalled")

    def handler(request: httpx.Request) -> httpx.Response:
        keys.append(request.headers.get("idempotency-key"))
        if len(keys) == 1:
            return httpx.Response(201, stream=Stalls())
        return httpx.Response(201, content=b"whole")

    response = client(handler)()
    assert response.content == b"whole"
    assert response.extensions[ATTEMPTS_EXTENSION] == 2
    assert len(keys) == 2
    assert keys[0] == keys[1]


@pytest.mark.parametrize(
    ("steps", "raised"),
    [
        ([httpx.ReadTimeout] * 3, OutcomeUnknownError),
        ([httpx.RemoteProtocolError] * 3, OutcomeUnknownError),
        ([httpx.WriteTimeout] * 3, OutcomeUnknownError),
        ([httpx.ReadTimeout, httpx.ConnectError, httpx.ConnectError], OutcomeUnknownError),
        ([httpx.ReadTimeout, 409, httpx.ConnectError], OutcomeUnknownError),
        ([409, httpx.ConnectError, httpx.ConnectError], httpx.ConnectError),
        ([503, httpx.ConnectError, httpx.ConnectError], httpx.ConnectError),
        ([httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout], httpx.PoolTimeout),
    ],
)
def test_out_of_attempts_after_the_request_may_have_run(
    client: Any, steps: list[Step], raised: type[Exception]
) -> None:
    """Giving up after an attempt that may have reached the server raises OutcomeUnknownError
    with the key; when no attempt got through (connect errors only), the last error as is."""
    server = Server(*steps)
    with pytest.raises(raised) as error:
        client(server, max_attempts=3)(headers={"Idempotency-Key": "mine"})
    assert len(server.requests) == 3
    if raised is OutcomeUnknownError:
        assert isinstance(error.value, httpx.TransportError)
        assert error.value.key == "mine"  # type: ignore[attr-defined]
        assert error.value.attempts == 3  # type: ignore[attr-defined]
        assert isinstance(error.value.__cause__, steps[-1])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "steps",
    [
        pytest.param([httpx.ReadTimeout, 503, 503], id="timeout-then-unavailable"),
        pytest.param([httpx.ReadError, 429, 429], id="reset-then-rate-limited"),
        pytest.param([httpx.ReadTimeout, 409, 409], id="timeout-then-still-running"),
    ],
)
def test_out_of_attempts_on_a_refusal_after_the_request_may_have_run(
    client: Any, steps: list[Step]
) -> None:
    """An earlier attempt may have run, and the last one was refused "not now": returning
    that refusal would invite a retry under a new key, so the transport raises
    OutcomeUnknownError with the key instead, and closes the refused response."""
    server = Server(*steps)
    with pytest.raises(OutcomeUnknownError) as error:
        client(server, max_attempts=3)(headers={"Idempotency-Key": "mine"})

    assert len(server.requests) == 3
    assert error.value.key == "mine"
    assert f"status {steps[-1]}" in str(error.value)


@pytest.mark.parametrize("steps", [[503, 429, 503], [409, 409, 409]])
def test_refusals_alone_are_returned(client: Any, steps: list[Step]) -> None:
    """When every attempt was refused, the last refusal is returned: it says what happened
    (a 409 names the key that is still running)."""
    server = Server(*steps)
    assert client(server, max_attempts=3)().status_code == steps[-1]
