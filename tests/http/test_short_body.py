"""A request whose body ends before its ``Content-Length`` (the client half-closed, or left).

Under ASGI the server says so (``http.disconnect``) and the middleware runs nothing. Under WSGI
``wsgi.input`` just ends early (wsgiref, gunicorn, Django's ``LimitedStream``): the middleware
must see it too, run nothing, store nothing and answer 400 ``request-incomplete``, so that the
client's full retry runs once rather than getting 422 for the truncated body's fingerprint.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import socket
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import oncely
from oncely.http.wsgi import IdempotencyMiddleware

BODY = b'{"amount": 500, "currency": "EUR"}'


class _App:
    """A bare WSGI app that counts its runs and echoes the body it read."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    def __call__(
        self, environ: dict[str, Any], start_response: Callable[..., Any]
    ) -> Iterable[bytes]:
        length = int(environ.get("CONTENT_LENGTH") or 0)
        body = environ["wsgi.input"].read(length)
        self.bodies.append(body)
        start_response("201 Created", [("Content-Type", "application/json")])
        return [json.dumps({"run": len(self.bodies), "size": len(body)}).encode()]


class _Gone(io.BytesIO):
    """An input whose client reset the connection after *after* bytes."""

    def __init__(self, data: bytes, after: int) -> None:
        super().__init__(data[:after])

    def read(self, size: int | None = -1) -> bytes:
        chunk = super().read(size)
        if not chunk:
            raise ConnectionResetError("the client reset the connection")
        return chunk


def _environ(key: str, stream: io.BytesIO, length: int) -> dict[str, Any]:
    return {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": "/payments",
        "HTTP_IDEMPOTENCY_KEY": key,
        "CONTENT_TYPE": "application/json",
        "CONTENT_LENGTH": str(length),
        "wsgi.input": stream,
    }


def _call(app: Any, environ: dict[str, Any]) -> tuple[int, bytes]:
    started: list[str] = []

    def start_response(status: str, headers: Any, exc_info: Any = None) -> Callable[..., None]:
        started.append(status)
        return lambda data: None

    result = app(environ, start_response)
    try:
        body = b"".join(result)
    finally:
        close = getattr(result, "close", None)
        if close is not None:
            close()
    return int(started[-1].split()[0]), body


@pytest.mark.parametrize("stream", ["ends", "resets"])
def test_wsgi_body_shorter_than_its_length_runs_nothing(stream: str) -> None:
    """Half the body, then the end of the input (or a reset): 400 request-incomplete, the app
    never runs, nothing is stored; the full retry runs once, its repeat replays."""
    app = _App()
    middleware = IdempotencyMiddleware(app, store=oncely.open_store("memory://"))
    key = str(uuid.uuid4())
    half = len(BODY) // 2
    cut = io.BytesIO(BODY[:half]) if stream == "ends" else _Gone(BODY, half)

    status, body = _call(middleware, _environ(key, cut, len(BODY)))
    assert status == 400
    assert json.loads(body)["code"] == "request-incomplete"
    assert app.bodies == []

    full, again = (_call(middleware, _environ(key, io.BytesIO(BODY), len(BODY))) for _ in "ab")
    assert full[0] == again[0] == 201
    assert again[1] == full[1]
    assert app.bodies == [BODY]


def _django_wsgi(tmp_path: Path) -> Any:
    module = importlib.import_module("django_middleware_app")
    ledger = importlib.import_module("_payments").Ledger(tmp_path / "payments.db")
    return module.create_app(oncely.open_store("memory://"), ledger)


def test_django_body_shorter_than_its_length_runs_nothing(tmp_path: Path) -> None:
    """Django's WSGI request reads a short body without complaint (``LimitedStream``): its
    middleware answers 400 request-incomplete, charges nothing, and the full retry runs once."""
    app = _django_wsgi(tmp_path)
    ledger = importlib.import_module("django_app").LEDGER
    key = str(uuid.uuid4())

    def environ(data: bytes) -> dict[str, Any]:
        return {
            **_environ(key, io.BytesIO(data), len(BODY)),
            "SERVER_NAME": "testserver",
            "SERVER_PORT": "80",
            "wsgi.url_scheme": "http",
            "wsgi.errors": io.StringIO(),
            "HTTP_X_USER": "alice",
        }

    status, body = _call(app, environ(BODY[: len(BODY) // 2]))
    assert status == 400
    assert json.loads(body)["code"] == "request-incomplete"
    assert ledger.count() == 0

    full, again = (_call(app, environ(BODY)) for _ in "ab")
    assert (full[0], again[0]) == (201, 201)
    assert again[1] == full[1]
    assert ledger.count() == 1


# -- over a real socket -----------------------------------------------------------------------


@contextlib.contextmanager
def _serving(kind: str, app: Any) -> Iterator[int]:
    """Serve *app* on a free loopback port in a thread; yield the port."""
    if kind == "waitress":
        from waitress.server import create_server

        server: Any = create_server(app, host="127.0.0.1", port=0, threads=2)
        port = server.effective_port
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        try:
            yield port
        finally:
            server.close()
        return
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    class Quiet(WSGIRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

    simple = make_server("127.0.0.1", 0, app, handler_class=Quiet)
    thread = threading.Thread(target=simple.serve_forever, daemon=True)
    thread.start()
    try:
        yield simple.server_port
    finally:
        simple.shutdown()
        simple.server_close()


def _half_close(port: int, key: str) -> bytes:
    """Send the head and half the body, half-close, and read whatever comes back."""
    head = (
        f"POST /payments HTTP/1.1\r\nHost: 127.0.0.1\r\nIdempotency-Key: {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(BODY)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head + BODY[: len(BODY) // 2])
        sock.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    return reply


@pytest.mark.parametrize("kind", ["wsgiref", "waitress"])
def test_half_closed_request_over_a_socket_runs_nothing(kind: str) -> None:
    """A raw client sends half its body and half-closes: wsgiref hands the app the short input
    (the middleware answers 400), waitress never dispatches it. Either way nothing ran, and the
    full retry runs once."""
    app = _App()
    middleware = IdempotencyMiddleware(app, store=oncely.open_store("memory://"))
    key = str(uuid.uuid4())
    with _serving(kind, middleware) as port:
        reply = _half_close(port, key)
        if reply:  # waitress closes the connection without an answer
            assert reply.split(b" ", 2)[1] == b"400"
            assert b"request-incomplete" in reply
        assert app.bodies == []
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            headers = {"Idempotency-Key": key, "Content-Type": "application/json"}
            full = client.post("/payments", content=BODY, headers=headers)
            again = client.post("/payments", content=BODY, headers=headers)
    assert full.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert app.bodies == [BODY]
