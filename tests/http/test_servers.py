"""The main flows over real sockets: uvicorn serving the FastAPI example and the async Django
example (oncely's Django middleware in an async stack), and waitress serving the Flask example,
each in its own process, against every store.

The server and the test share only the store's server (or file) and the payments ledger file,
as two hosts would.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.cookiejar
import json
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from oncely.http.client import (
    ATTEMPTS_EXTENSION,
    AsyncIdempotentTransport,
    IdempotentTransport,
    OutcomeUnknownError,
)
from tests._helpers import eventually
from tests._proxy import Proxy
from tests.http.conftest import EXAMPLES, store_url

SERVERS = {
    "uvicorn": "fastapi_app.py",
    "uvicorn-django": "django_async_app.py",
    "waitress": "flask_app.py",
}
BACKEND_MARKS = {"postgres": [pytest.mark.postgres], "redis": [pytest.mark.redis]}
PARAMS = [
    pytest.param((server, backend), id=f"{server}-{backend}", marks=BACKEND_MARKS.get(backend, []))
    for server in SERVERS
    for backend in ("memory", "sqlite", "postgres", "redis")
]
PAYMENT = {"amount": 500, "currency": "EUR"}


@dataclass
class Running:
    """A server process serving an example, and what the test needs to talk to it."""

    url: str
    ledger_path: Path
    process: subprocess.Popen[str]
    kind: str = "uvicorn"

    @property
    def host_port(self) -> tuple[str, int]:
        host, port = self.url.removeprefix("http://").split(":")
        return host, int(port)

    def charges(self) -> int:
        import sqlite3

        connection = sqlite3.connect(self.ledger_path, timeout=10)
        try:
            return int(connection.execute("SELECT count(*) FROM payments").fetchone()[0])
        finally:
            connection.close()

    def client(self, **options: Any) -> httpx.Client:
        options.setdefault("timeout", 10)
        # No cookie jar: the example apps set a cookie, and cookies are part of the default
        # scope, so a client that kept them would send each repeat as another principal's.
        options.setdefault(
            "cookies",
            http.cookiejar.CookieJar(http.cookiejar.DefaultCookiePolicy(allowed_domains=[])),
        )
        return httpx.Client(base_url=self.url, **options)


@pytest.fixture(scope="module", params=PARAMS)
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Running]:
    """Start the example's server process on a free loopback port; stop it afterwards."""
    kind, backend = request.param
    directory = tmp_path_factory.mktemp(f"{kind}-{backend}")
    ledger = directory / "payments.db"
    command = [
        sys.executable,
        str(EXAMPLES / SERVERS[kind]),
        "--port", "0",
        "--store", store_url(request, backend, directory),
        "--namespace", f"srv-{uuid.uuid4().hex[:10]}",
        "--ledger", str(ledger),
        "--lease", "1",
    ]  # fmt: skip
    with _serve(
        command, directory, signal.SIGINT if kind.startswith("uvicorn") else signal.SIGTERM
    ) as (
        url,
        process,
    ):
        yield Running(url, ledger, process, kind)


@contextlib.contextmanager
def _serve(
    command: list[str], directory: Path, stop: signal.Signals
) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """Run a server process until the block ends; yield its address and the process."""
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=directory
    )
    try:
        yield _wait_for_address(process), process
    finally:
        process.send_signal(stop)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        assert process.stdout is not None
        assert process.stderr is not None
        process.stdout.close()
        process.stderr.close()


def _wait_for_address(process: subprocess.Popen[str]) -> str:
    assert process.stdout is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        ready, _, _ = select.select([process.stdout], [], [], 0.1)
        if ready:
            line = process.stdout.readline()
            found = re.search(r"listening on (http://\S+)", line)
            if found:
                return found.group(1)
        if process.poll() is not None:
            assert process.stderr is not None
            raise AssertionError(f"the server exited: {process.stderr.read()}")
    raise AssertionError("the server did not start within 30 s")


def comparable(response: httpx.Response) -> list[tuple[str, str]]:
    """Headers as replayed: without the server's own (date, server) and the replay marker."""
    skip = {"date", "server", "idempotent-replayed", "set-cookie"}
    return [(k.lower(), v) for k, v in response.headers.multi_items() if k.lower() not in skip]


def test_first_request_and_replay_byte_for_byte(server: Running) -> None:
    """Over a socket: 201 once, then the same status, headers and body with the marker."""
    key = str(uuid.uuid4())
    before = server.charges()
    with server.client() as client:
        first = client.post("/payments", json=PAYMENT, headers={"Idempotency-Key": key})
        second = client.post("/payments", json=PAYMENT, headers={"Idempotency-Key": f'"{key}"'})

    assert first.status_code == second.status_code == 201
    assert second.headers["idempotent-replayed"] == "true"
    assert "set-cookie" in first.headers
    assert "set-cookie" not in second.headers
    assert second.content == first.content
    assert comparable(second) == comparable(first)
    assert server.charges() == before + 1


def test_conflicts_over_a_socket(server: Running) -> None:
    """Concurrent duplicates execute once; a reused key is 422; a missing required key 400."""
    key = str(uuid.uuid4())
    before = server.charges()
    barrier = threading.Barrier(6)
    replies: list[httpx.Response] = []

    def post() -> None:
        with server.client() as client:
            barrier.wait()
            replies.append(
                client.post(
                    "/payments",
                    params={"delay": 0.3},
                    json=PAYMENT,
                    headers={"Idempotency-Key": key},
                )
            )

    threads = [threading.Thread(target=post) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    statuses = sorted(reply.status_code for reply in replies)
    assert statuses.count(201) >= 1
    assert set(statuses) <= {201, 409}
    assert server.charges() == before + 1
    with server.client() as client:
        other = client.post("/payments", json={"amount": 1}, headers={"Idempotency-Key": key})
        missing = client.post("/transfers", json=PAYMENT)
    assert other.status_code == 422
    assert other.headers["content-type"] == "application/problem+json"
    assert missing.status_code == 400
    assert missing.json()["header"] == "Idempotency-Key"
    assert server.charges() == before + 1


def test_dropped_response_is_replayed(server: Running) -> None:
    """The client hangs up before reading the response; the retry gets the stored response and
    the payment is charged once.

    Django's ASGI handler cancels an async view whose client left: there the view is cancelled
    before its charge, the key released (a view that raised), and the retry runs it, once.
    """
    cancelled = server.kind == "uvicorn-django"
    delay = 1 if cancelled else 0.3  # cancelled long before it charges
    key = str(uuid.uuid4())
    before = server.charges()
    body = json.dumps(PAYMENT).encode()
    raw = (
        f"POST /payments?delay={delay} HTTP/1.1\r\nHost: test\r\n".encode()
        + f"Idempotency-Key: {key}\r\n".encode()
        + b"Content-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    with socket.create_connection(server.host_port) as sock:
        sock.sendall(raw)
        time.sleep(0.15)  # the handler is running; now the connection drops
    if not cancelled:
        eventually(lambda: server.charges() == before + 1)

    with server.client() as client:

        def retried() -> httpx.Response | None:
            reply = client.post(
                "/payments", params={"delay": delay}, json=PAYMENT, headers={"Idempotency-Key": key}
            )
            return reply if reply.status_code != 409 else None

        reply = eventually(retried)
    assert reply.status_code == 201
    assert reply.headers.get("idempotent-replayed") == (None if cancelled else "true")
    assert server.charges() == before + 1


def test_chunked_request_body_over_a_socket(server: Running) -> None:
    """A chunked upload reaches the app intact and fingerprints like the same bytes sent whole."""
    key = str(uuid.uuid4())
    pieces = [b'{"amount": ', b"42, ", b'"currency": "NOK"}']

    def stream() -> Iterator[bytes]:
        yield from pieces

    with server.client() as client:
        first = client.post(
            "/payments",
            content=stream(),
            headers={"Idempotency-Key": key, "Content-Type": "application/json"},
        )
        second = client.post(
            "/payments",
            content=b"".join(pieces),
            headers={"Idempotency-Key": key, "Content-Type": "application/json"},
        )

    assert first.request.headers["transfer-encoding"] == "chunked"
    assert first.status_code == 201
    assert first.json()["body_sha256"] == hashlib.sha256(b"".join(pieces)).hexdigest()
    assert second.headers["idempotent-replayed"] == "true"


@pytest.mark.parametrize(
    "server",
    [
        pytest.param(("uvicorn", "sqlite"), id="uvicorn-sqlite"),
        pytest.param(("waitress", "sqlite"), id="waitress-sqlite"),
    ],
    indirect=True,
)
def test_client_transport_rides_out_a_timeout(server: Running) -> None:
    """The httpx transport times out, retries under the same key, waits out the 409's
    Retry-After and gets the stored response: one charge."""
    before = server.charges()
    transport = IdempotentTransport(httpx.HTTPTransport(), max_attempts=6, backoff=0.05, seed=2)
    with httpx.Client(transport=transport, base_url=server.url, timeout=0.4) as client:
        reply = client.post("/payments", params={"delay": 0.8}, json=PAYMENT)

    assert reply.status_code == 201
    assert reply.headers["idempotent-replayed"] == "true"
    assert reply.extensions[ATTEMPTS_EXTENSION] >= 2
    assert server.charges() == before + 1


@pytest.mark.parametrize(
    "server",
    [
        pytest.param(("uvicorn", "sqlite"), id="uvicorn-sqlite"),
        pytest.param(("waitress", "sqlite"), id="waitress-sqlite"),
    ],
    indirect=True,
)
def test_number_with_a_huge_exponent_is_answered_at_once(server: Running) -> None:
    """``1e999999`` (14 bytes with its braces) is fingerprinted without expanding it: the
    request is answered and the server goes on serving (the old code spent 14-50 s building a
    million-digit integer on the event loop). The timeouts only make the old code fail fast."""
    key = str(uuid.uuid4())
    assert len(b'{"n":1e999999}') == 14
    body = b'{"amount": 500, "currency": "EUR", "n":1e999999}'
    respelt = b'{"amount":500,"currency":"EUR","n":10E+999998}'
    headers = {"Idempotency-Key": key, "Content-Type": "application/json"}
    before = server.charges()
    with server.client(timeout=5) as client:
        first = client.post("/payments", content=body, headers=headers)
        other = client.post("/payments", json=PAYMENT, headers={"Idempotency-Key": f"{key}-2"})
        again = client.post("/payments", content=respelt, headers=headers)

    assert first.status_code == 201
    assert other.status_code == 201
    assert again.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert server.charges() == before + 2


@pytest.mark.parametrize(
    "server",
    [
        pytest.param(("uvicorn", "sqlite"), id="uvicorn-sqlite"),
        pytest.param(("waitress", "sqlite"), id="waitress-sqlite"),
    ],
    indirect=True,
)
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_request_body_over_the_limit_is_413_over_a_socket(server: Running, chunked: bool) -> None:
    """A body over the default 1 MiB `max_request_bytes` is answered 413, nothing runs or is
    stored, and the same key with a small body then runs once."""
    key = str(uuid.uuid4())
    body = b'{"amount": 500, "currency": "EUR", "pad": "' + b"x" * (1 << 20) + b'"}'
    headers = {"Idempotency-Key": key, "Content-Type": "application/json"}
    before = server.charges()

    def stream() -> Iterator[bytes]:
        for start in range(0, len(body), 65536):
            yield body[start : start + 65536]

    with server.client(timeout=10) as client:
        reply = client.post("/payments", content=stream() if chunked else body, headers=headers)
    assert reply.status_code == 413
    assert reply.json()["code"] == "request-too-large"
    assert server.charges() == before
    with server.client(timeout=10) as client:
        first = client.post("/payments", json=PAYMENT, headers={"Idempotency-Key": key})
    assert first.status_code == 201
    assert "idempotent-replayed" not in first.headers


@dataclass
class Streaming:
    """uvicorn serving `_streaming_server`'s app, and the file that counts its executions."""

    url: str
    executions_path: Path

    def executions(self, key: str) -> int:
        from tests.http._streaming_server import executions

        return executions(self.executions_path, key)


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(("starlette", "sqlite"), id="starlette-sqlite"),
        pytest.param(("fastapi", "postgres"), id="fastapi-postgres", marks=pytest.mark.postgres),
    ],
)
def streaming(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Streaming]:
    """A real uvicorn (ASGI spec 2.3) serving a Starlette or FastAPI StreamingResponse."""
    framework, backend = request.param
    directory = tmp_path_factory.mktemp(f"streaming-{framework}")
    record = directory / "executions.txt"
    command = [
        sys.executable,
        str(Path(__file__).with_name("_streaming_server.py")),
        "--framework", framework,
        "--store", store_url(request, backend, directory),
        "--namespace", f"stream-{uuid.uuid4().hex[:10]}",
        "--executions", str(record),
        "--lease", "1",
    ]  # fmt: skip
    with _serve(command, directory, signal.SIGINT) as (url, _):
        yield Streaming(url, record)


def test_streaming_response_cut_by_a_client_timeout_runs_once(streaming: Streaming) -> None:
    """The client reads the first chunk, times out on the rest and hangs up; uvicorn tells the
    app (``http.disconnect``) and Starlette cancels the stream. The handler ran, so the record
    is completed as not replayable: the retry with the same key gets ``response-not-stored``
    and the handler is not run again."""
    key = str(uuid.uuid4())
    headers = {"Idempotency-Key": key}
    timeout = httpx.Timeout(10, read=0.5)
    with (
        httpx.Client(base_url=streaming.url, timeout=timeout) as client,
        client.stream("POST", "/stream", headers=headers) as cut,
    ):
        assert cut.status_code == 201
        with pytest.raises(httpx.ReadTimeout):
            cut.read()
    assert streaming.executions(key) == 1

    with httpx.Client(base_url=streaming.url, timeout=10) as client:

        def retried() -> httpx.Response | None:
            reply = client.post("/stream", headers=headers)
            return reply if reply.status_code != 409 else None

        reply = eventually(retried)
    assert streaming.executions(key) == 1
    assert reply.status_code == 500
    assert reply.json()["code"] == "response-not-stored"


CLIENT_SERVERS = [
    pytest.param(("uvicorn", "sqlite"), id="uvicorn-sqlite"),
    pytest.param(("waitress", "sqlite"), id="waitress-sqlite"),
]


def _post_through(
    mode: str, url: str, transport_options: dict[str, Any], **request: Any
) -> httpx.Response:
    """POST /payments through the sync or async idempotent transport (0.5 s read timeout)."""
    timeout = httpx.Timeout(10, read=0.5)
    if mode == "sync":
        transport = IdempotentTransport(httpx.HTTPTransport(), **transport_options)
        with httpx.Client(transport=transport, base_url=url, timeout=timeout) as client:
            return client.post("/payments", **request)

    async def post() -> httpx.Response:
        transport = AsyncIdempotentTransport(httpx.AsyncHTTPTransport(), **transport_options)
        async with httpx.AsyncClient(transport=transport, base_url=url, timeout=timeout) as client:
            return await client.post("/payments", **request)

    return anyio.run(post)


@pytest.mark.parametrize("server", CLIENT_SERVERS, indirect=True)
@pytest.mark.parametrize("fault", ["stall", "reset"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_client_transport_retries_a_body_cut_in_transit(
    server: Running, fault: str, mode: str
) -> None:
    """The first response's headers arrive, then its body stalls past the read timeout (or the
    connection is reset mid-body). The transport retries with the same key until it has read a
    whole response: the caller gets the stored response, and the payment ran once."""
    before = server.charges()
    key = str(uuid.uuid4())
    options = {"max_attempts": 6, "backoff": 0.05, "seed": 2}
    with Proxy(server.host_port[1], responses=[fault]) as proxy:
        reply = _post_through(
            mode, proxy.url, options, json=PAYMENT, headers={"Idempotency-Key": key}
        )

        assert proxy.accepted >= 2
    assert reply.status_code == 201
    assert reply.headers["idempotent-replayed"] == "true"
    assert reply.json()["amount"] == 500
    assert reply.extensions[ATTEMPTS_EXTENSION] >= 2
    assert server.charges() == before + 1


@pytest.mark.parametrize("server", CLIENT_SERVERS, indirect=True)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_client_transport_out_of_attempts_mid_body_keeps_the_key(
    server: Running, mode: str
) -> None:
    """Every attempt's body stalls: the transport gives up with `OutcomeUnknownError`, which
    says the request may have taken effect and carries its key; a later retry with that key
    gets the stored response, and the payment ran once."""
    before = server.charges()
    options = {"max_attempts": 2, "backoff": 0.05, "seed": 2}
    with (
        Proxy(server.host_port[1], responses=["stall", "stall"]) as proxy,
        pytest.raises(OutcomeUnknownError) as raised,
    ):
        _post_through(mode, proxy.url, options, json=PAYMENT)

    error = raised.value
    assert isinstance(error.__cause__, httpx.ReadTimeout)
    assert error.attempts == 2
    assert "may have taken effect" in str(error)
    assert error.key in str(error)
    with server.client() as client:
        again = client.post("/payments", json=PAYMENT, headers={"Idempotency-Key": error.key})
    assert again.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert server.charges() == before + 1
