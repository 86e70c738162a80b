"""WSGI middleware: answer repeats of unsafe requests from the store (docs/guides/http.md).

Wraps any WSGI app (Flask, Django, Falcon, a bare function) and imports no framework. Every rule
comes from `oncely.http._semantics` and every store step from the shared flows in
`oncely.http._flow`, run with the same drivers as the decorator; this module only moves bytes.

.. code-block:: python

    from oncely.http.wsgi import IdempotencyMiddleware

    app.wsgi_app = IdempotencyMiddleware(app.wsgi_app, store=oncely.open_store("sqlite:///o.db"))

How a protected request travels:

* its body is read in full (to fingerprint it) and ``wsgi.input`` is replaced by a
  `io.BytesIO` holding the same bytes, with ``CONTENT_LENGTH`` set (chunked requests included);
  a body over `HttpPolicy.max_request_bytes` is answered 413 (unread if ``CONTENT_LENGTH`` says
  so, else read only up to the limit);
* the response is buffered up to `HttpPolicy.max_response_bytes`, the record completed (or
  released), and only then is the response handed to the server, so a client that has the
  whole response can never see its own retry answered 409;
* a response over the limit is streamed instead; its record is completed with a marker just
  before the last chunk leaves, or when the stream ends early (never released: the handler ran);
* the app's response iterable is closed when the server closes the response (PEP 3333).

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import io
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from typing import Any

from oncely import _events, _execution, _observed, _switches
from oncely._core.protocols import SyncStore
from oncely.errors import ConfigurationError
from oncely.http import _flow, _semantics
from oncely.http._policy import HttpPolicy, RouteOptions
from oncely.http._routes import RouteResolver, RouteTable, resolve_wsgi
from oncely.http._semantics import Header, HttpRequest, Response, ResponseCapture
from oncely.http._types import ExcInfo, StartResponse, WSGIApp, WSGIEnviron

__all__ = ["IdempotencyMiddleware"]

_READ_SIZE = 64 * 1024


class IdempotencyMiddleware:
    """Make unsafe requests with an ``Idempotency-Key`` take effect once (WSGI).

    Args:
        app: The WSGI application to protect (for Flask, ``app.wsgi_app``; for Django, the
            ``get_wsgi_application()`` handler).
        store: Any `oncely.SyncStore` (every built-in store is one).
        policy: The app-wide `HttpPolicy` (default: POST and PATCH covered, key optional).
        routes: `RouteOptions` by path pattern, ``"[METHOD ]/path/{param}"``; the first match
            applies. Views decorated with `idempotent_route` override both.
        resolver: Finds the route (template and view) a request reaches; by default Flask and
            Django routing are understood, and other apps use the path.

    Raises:
        ConfigurationError: The store cannot serve sync callers, or an option is invalid.

    .. versionadded:: 0.1.0
    """

    def __init__(
        self,
        app: WSGIApp,
        *,
        store: SyncStore,
        policy: HttpPolicy | None = None,
        routes: Mapping[str, RouteOptions] | None = None,
        resolver: RouteResolver | None = None,
    ) -> None:
        if not isinstance(store, SyncStore):
            raise ConfigurationError(
                f"{type(store).__name__} has no sync verbs: the WSGI middleware needs an "
                "oncely.SyncStore (any built-in store)"
            )
        self.app = app
        self.store = store
        self.routes = RouteTable(policy, routes, resolver)
        self._resolve: RouteResolver = resolver or (lambda environ: resolve_wsgi(app, environ))

    @property
    def policy(self) -> HttpPolicy:
        """The app-wide policy."""
        return self.routes.policy

    def __call__(self, environ: WSGIEnviron, start_response: StartResponse) -> Iterable[bytes]:
        """Handle one WSGI request (safe methods pass straight through)."""
        if _events.on and not _observed.serving():
            return _observed.wsgi(self, environ, start_response)  # type: ignore[no-any-return]
        method = str(environ.get("REQUEST_METHOD", "GET")).upper()
        if method in _semantics.SAFE_METHODS or _switches.off(method, environ.get("PATH_INFO")):
            return self.app(environ, start_response)
        path = _text(environ.get("SCRIPT_NAME", "")) + _text(environ.get("PATH_INFO", ""))
        policy, route = self.routes.select(method, path, self._resolve(environ))
        if not policy.covers(method):
            return self.app(environ, start_response)
        raw = environ.get(policy.environ_key)
        decision = _semantics.decide(method, [] if raw is None else [_latin1(raw)], policy)
        if decision is None:
            return self.app(environ, start_response)
        if isinstance(decision, Response):
            return _respond(start_response, decision)
        body = _read_body(environ, policy.max_request_bytes)
        if body is None:
            return _respond(start_response, _semantics.request_too_large(policy))
        if isinstance(body, Response):  # the client left mid-body: run nothing, as ASGI does
            return _respond(start_response, body)
        environ["wsgi.input"] = io.BytesIO(body)
        environ["CONTENT_LENGTH"] = str(len(body))
        request = HttpRequest(
            method,
            path,
            route,
            _latin1(environ.get("QUERY_STRING", "")),
            _request_headers(environ),
            body,
            _remote_user(environ),
        )
        plan = _semantics.plan(request, decision, policy, _semantics.given(policy, request))
        if isinstance(plan, Response):
            return _respond(start_response, plan)
        outcome = _execution.run(_flow.begin(plan, policy, method=method, path=path), self.store)
        if outcome is _flow.PASS_THROUGH:
            return self.app(environ, start_response)
        if isinstance(outcome, Response):
            return _respond(start_response, outcome)
        return self._run(outcome, policy, environ, start_response)

    def _run(
        self,
        lease: _execution.Lease,
        policy: HttpPolicy,
        environ: WSGIEnviron,
        start_response: StartResponse,
    ) -> Iterable[bytes]:
        capture = ResponseCapture(policy.max_response_bytes)
        pending: deque[bytes] = deque()
        streaming = False

        def write(data: bytes) -> None:
            pending.append(data)
            capture.add(data)

        def capture_start(
            status: str, headers: list[tuple[str, str]], exc_info: ExcInfo | None = None
        ) -> Callable[[bytes], object]:
            if exc_info is not None and streaming:
                raise exc_info[1].with_traceback(exc_info[2])
            code, _, reason = status.partition(" ")
            pending.clear()  # a second call (with exc_info) replaces the first response
            capture.start(int(code), _encode_headers(headers), policy, reason.encode("latin-1"))
            return write

        iterating = False

        def call() -> tuple[Iterable[bytes], Iterator[bytes] | None]:
            nonlocal iterating
            result = self.app(environ, capture_start)
            iterating = True
            try:
                iterator = iter(result)
                for chunk in iterator:
                    write(chunk)
                    if capture.overflowed:
                        return result, iterator  # too large to store: stream the rest
            except BaseException:
                _close(result)
                raise
            # Closed when the server closes the response, as PEP 3333 has it: an error in
            # close() is then the server's to log, after the stored response went out.
            return result, None

        try:
            result, rest = _execution.run(_flow.invoke(lease), self.store, call)
            if not capture.started:
                _close(result)
                raise RuntimeError("the WSGI app returned without calling start_response")
        except BaseException as exc:
            if iterating and capture.started:
                # The view returned and started its response; its body failed: the handler
                # ran, so the key is never released (as in ASGI).
                cause = f"{type(exc).__name__} from the app's response iterable"
                _execution.run(_flow.cut(lease, capture, cause, policy), self.store)
            else:
                _execution.run(_flow.abort(lease, exc, policy), self.store)
            raise
        if rest is None:
            capture.complete = True
            _execution.run(_flow.finish(lease, capture, policy), self.store)
            start_response(_status_line(capture), _decode_headers(capture.headers))
            if callable(getattr(result, "close", None)):
                return _Buffered(pending, result)
            return pending
        streaming = True
        start_response(_status_line(capture), _decode_headers(capture.headers))
        return _Stream(self.store, lease, policy, capture, pending, result, rest)


class _Buffered(list[bytes]):
    """A buffered response whose ``close()`` closes the app's response iterable."""

    __slots__ = ("_result",)

    def __init__(self, chunks: Iterable[bytes], result: Iterable[bytes]) -> None:
        super().__init__(chunks)
        self._result = result

    def close(self) -> None:
        _close(self._result)


class _Stream:
    """A response over the size limit, streamed as the app yields it.

    Its record is settled just before the last chunk leaves; if the stream ends any other way
    (the app's iterable raised, the server stopped reading or closed it unread because its
    client left), the handler has run all the same, so the record is completed as not
    replayable (`_flow.cut`), never released.
    """

    __slots__ = (
        "_capture",
        "_chunks",
        "_iterator",
        "_lease",
        "_open",
        "_pending",
        "_policy",
        "_result",
        "_settled",
        "_store",
    )

    def __init__(
        self,
        store: SyncStore,
        lease: _execution.Lease,
        policy: HttpPolicy,
        capture: ResponseCapture,
        pending: deque[bytes],
        result: Iterable[bytes],
        iterator: Iterator[bytes],
    ) -> None:
        self._store = store
        self._lease = lease
        self._policy = policy
        self._capture = capture
        self._pending = pending
        self._result = result
        self._iterator = iterator
        self._chunks: Generator[bytes, None, None] | None = None
        self._settled = False
        self._open = True

    def __iter__(self) -> Iterator[bytes]:
        if self._chunks is None:
            self._chunks = self._stream()
        return self._chunks

    def close(self) -> None:
        """Called by the server when it is done with the response, read whole or not."""
        try:
            if self._chunks is not None:
                self._chunks.close()  # a stream cut short settles in its GeneratorExit
            self._cut("the server closed the response before reading it")
        finally:
            self._close_result()

    def _stream(self) -> Generator[bytes, None, None]:
        try:
            while self._pending:
                yield self._pending.popleft()
            held: bytes | None = None
            for chunk in self._iterator:
                self._capture.add(chunk)
                if held is not None:
                    yield held
                held = chunk
            if not self._settled:
                self._settled = self._capture.complete = True
                _execution.run(_flow.finish(self._lease, self._capture, self._policy), self._store)
            if held is not None:
                yield held
        except GeneratorExit:  # the server stopped early (client gone); the handler ran
            self._cut("the server stopped reading it")
            raise
        except BaseException as exc:
            self._cut(f"{type(exc).__name__} from the app's response iterable")
            raise
        finally:
            self._close_result()

    def _cut(self, cause: str) -> None:
        if not self._settled:
            self._settled = True
            _execution.run(_flow.cut(self._lease, self._capture, cause, self._policy), self._store)

    def _close_result(self) -> None:
        if self._open:
            self._open = False
            _close(self._result)


def _text(value: Any) -> str:
    # PEP 3333 strings are bytes decoded as latin-1; paths are UTF-8 on the wire.
    return str(value).encode("latin-1", "replace").decode("utf-8", "replace")


def _latin1(value: Any) -> bytes:
    return str(value).encode("latin-1", "replace")


def _request_headers(environ: WSGIEnviron) -> tuple[Header, ...]:
    headers = []
    for name, value in environ.items():
        if name.startswith("HTTP_"):
            header = name[5:]
        elif name in ("CONTENT_TYPE", "CONTENT_LENGTH"):
            header = name
        else:
            continue
        headers.append((header.replace("_", "-").lower().encode("latin-1"), _latin1(value)))
    return tuple(headers)


def _read_body(environ: WSGIEnviron, limit: int) -> bytes | Response | None:
    """Read the whole request body; ``None`` if it is over *limit* bytes (then at most
    *limit* + 1 bytes are read, none if ``CONTENT_LENGTH`` says so), the 400 to answer if it ends
    before ``CONTENT_LENGTH`` (a server hands the app a short input when its client
    half-closed or left; reading a reset connection raises `OSError`)."""
    stream = environ.get("wsgi.input")
    if stream is None:
        return b""
    text = str(environ.get("CONTENT_LENGTH") or "").strip()
    length: int | None = None
    if text.isascii() and text.isdigit():  # "²" is a digit to isdigit, not to int
        length = int(text) if len(text) <= 20 else 10**20
    declared = length is not None
    if length is None:
        # Without a length, only a server that marks the input as terminated may be read to EOF.
        if not environ.get("wsgi.input_terminated"):
            return b""
        length = limit + 1
    elif length > limit:
        return None
    chunks = []
    size = 0
    while size < length:
        try:
            chunk = stream.read(min(length - size, _READ_SIZE))
        except OSError:
            if declared:
                return _semantics.request_incomplete(length, size)
            raise
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    if size > limit:
        return None
    if declared and size < length:
        return _semantics.request_incomplete(length, size)
    return b"".join(chunks)


def _encode_headers(headers: Iterable[tuple[str, str]]) -> list[Header]:
    return [(_latin1(name), _latin1(value)) for name, value in headers]


def _decode_headers(headers: Iterable[Header]) -> list[tuple[str, str]]:
    return [(name.decode("latin-1"), value.decode("latin-1")) for name, value in headers]


def _status_line(capture: ResponseCapture) -> str:
    return Response(capture.status, (), b"", capture.reason).status_line()


def _respond(start_response: StartResponse, response: Response) -> list[bytes]:
    start_response(response.status_line(), _decode_headers(response.headers))
    return [response.body]


def _close(result: Iterable[bytes]) -> None:
    close = getattr(result, "close", None)
    if callable(close):
        close()


def _remote_user(environ: WSGIEnviron) -> str | None:
    """The user a server or an outer middleware authenticated (CGI's ``REMOTE_USER``)."""
    user = environ.get("REMOTE_USER")
    return f"remote_user={_text(user)}" if isinstance(user, str) and user else None
