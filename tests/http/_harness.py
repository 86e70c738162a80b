"""In-process drivers for ASGI and WSGI apps, a store that fails on demand, and the test API.

The drivers play the server's part byte for byte (raw header values, chunked request bodies,
an exception becoming a 500 as uvicorn, waitress or gunicorn would answer), so the suite
controls exactly what reaches the middleware. Real servers over sockets are in
``test_servers.py``.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar
from urllib.parse import urlencode

from anyio.from_thread import BlockingPortal

from oncely import ClaimResult, LeaseLost, Record, Store, StoreUnavailableError

T = TypeVar("T")

Headers = list[tuple[bytes, bytes]]


@dataclass
class Reply:
    """A response as a client sees it."""

    status: int
    headers: Headers
    body: bytes

    def header(self, name: str) -> str | None:
        wanted = name.lower().encode()
        for key, value in self.headers:
            if key.lower() == wanted:
                return value.decode("latin-1")
        return None

    def headers_named(self, name: str) -> list[str]:
        wanted = name.lower().encode()
        return [value.decode("latin-1") for key, value in self.headers if key.lower() == wanted]

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def replayed(self) -> bool:
        return self.header("idempotent-replayed") == "true"

    def comparable_headers(self) -> list[tuple[bytes, bytes]]:
        """Headers without the replay marker, names lower-cased, in order."""
        return [
            (key.lower(), value)
            for key, value in self.headers
            if key.lower() != b"idempotent-replayed"
        ]


# -- ASGI -------------------------------------------------------------------------------------


async def call_asgi(
    app: Any,
    method: str,
    path: str,
    *,
    query: bytes = b"",
    headers: Headers = (),  # type: ignore[assignment]
    chunks: Sequence[bytes] = (b"",),
) -> Reply:
    """Run one request through an ASGI app, as a server would."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query,
        "root_path": "",
        "headers": [(b"host", b"testserver"), *headers],
        "client": ("127.0.0.1", 50000),
        "server": ("testserver", 80),
        "extensions": {"http.response.pathsend": {}},
        "state": {},
    }
    pending = deque(
        {"type": "http.request", "body": chunk, "more_body": number < len(chunks)}
        for number, chunk in enumerate(chunks, start=1)
    )
    never = asyncio.Event()
    status = 0
    response_headers: Headers = []
    body: list[bytes] = []
    complete = False

    async def receive() -> dict[str, Any]:
        if pending:
            return pending.popleft()
        await never.wait()  # the client stays connected until the response is over
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status, response_headers, complete
        if message["type"] == "http.response.start":
            status = message["status"]
            response_headers = [(bytes(k), bytes(v)) for k, v in message.get("headers", [])]
        elif message["type"] == "http.response.body":
            body.append(message.get("body", b""))
            complete = not message.get("more_body", False)

    try:
        await app(scope, receive, send)
    except Exception:
        logging.getLogger("tests.http").exception("the ASGI app raised")
        if status == 0:  # what a server answers when the app raised before responding
            return Reply(500, [(b"content-type", b"text/plain")], b"Internal Server Error")
        if not complete:
            raise
        # Starlette's ServerErrorMiddleware answers 500, then re-raises for the server to log.
    assert status, "the app returned without starting a response"
    assert complete, "the app returned without completing its response"
    return Reply(status, response_headers, b"".join(body))


# -- WSGI -------------------------------------------------------------------------------------


def call_wsgi(
    app: Any,
    method: str,
    path: str,
    *,
    query: bytes = b"",
    headers: Headers = (),  # type: ignore[assignment]
    chunks: Sequence[bytes] = (b"",),
) -> Reply:
    """Run one request through a WSGI app, as a server would (PEP 3333)."""
    body = b"".join(chunks)
    environ: dict[str, Any] = {
        "REQUEST_METHOD": method,
        "SCRIPT_NAME": "",
        "PATH_INFO": path.encode().decode("latin-1"),
        "QUERY_STRING": query.decode("latin-1"),
        "SERVER_NAME": "testserver",
        "SERVER_PORT": "80",
        "SERVER_PROTOCOL": "HTTP/1.1",
        "REMOTE_ADDR": "127.0.0.1",
        "HTTP_HOST": "testserver",
        "wsgi.version": (1, 0),
        "wsgi.url_scheme": "http",
        "wsgi.input": io.BytesIO(body),
        "wsgi.errors": io.StringIO(),
        "wsgi.multithread": True,
        "wsgi.multiprocess": False,
        "wsgi.run_once": False,
    }
    if len(chunks) > 1:  # a chunked request: no length, the server marks the input terminated
        environ["HTTP_TRANSFER_ENCODING"] = "chunked"
        environ["wsgi.input_terminated"] = True
    else:
        environ["CONTENT_LENGTH"] = str(len(body))
    for name, value in headers:
        key = name.decode("latin-1").upper().replace("-", "_")
        if key == "CONTENT_LENGTH":
            continue  # set from the body above
        key = key if key == "CONTENT_TYPE" else "HTTP_" + key
        text = value.decode("latin-1")
        environ[key] = f"{environ[key]},{text}" if key in environ and key != "HTTP_HOST" else text
    started: list[Any] = []

    def start_response(
        status: str, response_headers: list[tuple[str, str]], exc_info: Any = None
    ) -> Any:
        started[:] = [status, response_headers]
        return lambda data: None

    try:
        result = app(environ, start_response)
        try:
            content = b"".join(result)
        finally:
            close = getattr(result, "close", None)
            if close is not None:
                close()
    except Exception:
        logging.getLogger("tests.http").exception("the WSGI app raised")
        return Reply(500, [(b"content-type", b"text/plain")], b"Internal Server Error")
    status, response_headers = started
    return Reply(
        int(status.split()[0]),
        [(k.encode("latin-1"), v.encode("latin-1")) for k, v in response_headers],
        content,
    )


# -- a store that fails on demand -------------------------------------------------------------


class FaultyStore:
    """Wraps a store; raises `StoreUnavailableError` on chosen verbs a chosen number of times.

    ``corrupt_results`` makes `complete` store bytes that are not an oncely outcome.
    """

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.calls: Counter[str] = Counter()
        self.corrupt_results = False
        self._faults: dict[str, int] = {}
        self._lock = threading.Lock()

    def inject(self, verb: str, times: int = 10**9) -> None:
        """Make the next *times* calls of *verb* (sync or async) raise StoreUnavailableError."""
        with self._lock:
            self._faults[verb] = times

    def heal(self) -> None:
        with self._lock:
            self._faults.clear()

    def _check(self, verb: str) -> None:
        with self._lock:
            self.calls[verb] += 1
            left = self._faults.get(verb, 0)
            if left:
                self._faults[verb] = left - 1
                raise StoreUnavailableError(f"injected fault on {verb}", backend="faulty")

    def _result(self, result: bytes) -> bytes:
        return b"oncely1v\x00\x01garbage" if self.corrupt_results else result

    def claim(self, key: str, fingerprint: str, *, lease: timedelta, ttl: timedelta) -> ClaimResult:
        self._check("claim")
        return self.inner.claim(key, fingerprint, lease=lease, ttl=ttl)

    def complete(self, key: str, token: int, result: bytes, *, ttl: timedelta) -> LeaseLost | None:
        self._check("complete")
        return self.inner.complete(key, token, self._result(result), ttl=ttl)

    def fail(self, key: str, token: int, error: bytes, *, ttl: timedelta) -> LeaseLost | None:
        raise AssertionError("HTTP requests never store failures")

    def release(self, key: str, token: int) -> LeaseLost | None:
        self._check("release")
        return self.inner.release(key, token)

    def extend(self, key: str, token: int, *, lease: timedelta) -> LeaseLost | None:
        self._check("extend")
        return self.inner.extend(key, token, lease=lease)

    def get(self, key: str) -> Record | None:
        return self.inner.get(key)

    def close(self) -> None:
        """The wrapped store outlives the wrapper."""

    async def aclaim(
        self, key: str, fingerprint: str, *, lease: timedelta, ttl: timedelta
    ) -> ClaimResult:
        self._check("claim")
        return await self.inner.aclaim(key, fingerprint, lease=lease, ttl=ttl)

    async def acomplete(
        self, key: str, token: int, result: bytes, *, ttl: timedelta
    ) -> LeaseLost | None:
        self._check("complete")
        return await self.inner.acomplete(key, token, self._result(result), ttl=ttl)

    async def afail(
        self, key: str, token: int, error: bytes, *, ttl: timedelta
    ) -> LeaseLost | None:
        raise AssertionError("HTTP requests never store failures")

    async def arelease(self, key: str, token: int) -> LeaseLost | None:
        self._check("release")
        return await self.inner.arelease(key, token)

    async def aextend(self, key: str, token: int, *, lease: timedelta) -> LeaseLost | None:
        self._check("extend")
        return await self.inner.aextend(key, token, lease=lease)

    async def aget(self, key: str) -> Record | None:
        return await self.inner.aget(key)

    async def aclose(self) -> None:
        """The wrapped store outlives the wrapper."""


# -- the API the suite talks to -----------------------------------------------------------------


class Api:
    """One protected example app, driven in process: ``api.post(...)`` returns a `Reply`."""

    def __init__(
        self, app: Any, kind: str, portal: BlockingPortal, ledger: Any, store: FaultyStore
    ) -> None:
        self.app = app
        self.kind = kind
        self.portal = portal
        self.ledger = ledger
        self.store = store

    def request(
        self,
        method: str,
        path: str = "/payments",
        *,
        key: str | bytes | None = None,
        json_body: Any = None,
        content: bytes | None = None,
        chunks: Sequence[bytes] | None = None,
        content_type: str | None = None,
        headers: Iterable[tuple[str | bytes, str | bytes]] = (),
        params: dict[str, Any] | None = None,
    ) -> Reply:
        raw: Headers = []
        if key is not None:
            raw.append((b"idempotency-key", key if isinstance(key, bytes) else key.encode()))
        for name, value in headers:
            raw.append((_bytes(name).lower(), _bytes(value)))
        if json_body is not None:
            content = json.dumps(json_body).encode()
            content_type = content_type or "application/json"
        if content_type is not None:
            raw.append((b"content-type", content_type.encode()))
        if chunks is None:
            chunks = [content or b""]
            raw.append((b"content-length", str(len(chunks[0])).encode()))
        query = urlencode(params or {}).encode()
        if self.kind == "asgi":
            return self.portal.call(
                lambda: call_asgi(self.app, method, path, query=query, headers=raw, chunks=chunks)
            )
        return call_wsgi(self.app, method, path, query=query, headers=raw, chunks=chunks)

    def post(self, path: str = "/payments", **options: Any) -> Reply:
        return self.request("POST", path, **options)

    def concurrently(self, calls: Sequence[Callable[[], T]]) -> list[T]:
        """Run *calls* at the same time (threads released together); return their results."""
        barrier = threading.Barrier(len(calls))

        def run(call: Callable[[], T]) -> T:
            barrier.wait()
            return call()

        with ThreadPoolExecutor(len(calls)) as pool:
            return list(pool.map(run, calls))


def _bytes(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode("latin-1")
