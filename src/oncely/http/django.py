"""Django middleware for ``settings.MIDDLEWARE``: the HTTP rules at Django's request level.

It runs inside Django, after its authentication, so the user is the principal of the default
scope. It translates Django's request and response to the shared semantics and flows
(`oncely.http._semantics`, `oncely.http._flow`), as the ASGI and WSGI middleware do: same
answers, same records.

.. code-block:: python

    # settings.py
    MIDDLEWARE = [
        ...,
        "django.contrib.auth.middleware.AuthenticationMiddleware",
        "oncely.http.django.IdempotencyMiddleware",  # after authentication
        ...,
    ]
    ONCELY_STORE_URL = "postgresql://app@db/app"      # or ONCELY_STORE = a store object
    ONCELY_HTTP = {"require_key": False, "ttl": 86400}  # HttpPolicy options, or an HttpPolicy
    ONCELY_HTTP_ROUTES = {"POST /transfers": RouteOptions(require_key=True)}  # optional

Views decorated with `idempotent_route` get their options, as under the other middleware.
A streamed response is read before it leaves, up to `HttpPolicy.max_response_bytes`; one over
the limit (server-sent events) is passed on as the view yields it, and its record completed as
not stored when it ends or is cut short, as under the ASGI and WSGI middleware.

Sync and async: Django picks the mode when it builds its middleware stack. Under WSGI (or
when the layer below is sync) the middleware calls the store's sync verbs; under Django's ASGI
handler with an async stack (async views, or sync views that Django adapts) it awaits the
store's async verbs on the event loop, with no thread per request, and reads the user with
``request.auser()`` (Django 5.0+), so the session is never loaded synchronously.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import importlib
from collections.abc import AsyncIterator, Callable, Generator, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import oncely
from oncely import _events, _execution, _observed, _switches
from oncely._core.flow import Flow
from oncely._core.protocols import AsyncStore, BatchStore, SyncStore
from oncely.errors import ConfigurationError
from oncely.http import _flow, _semantics
from oncely.http._policy import HttpPolicy, RouteOptions
from oncely.http._routes import RouteTable, resolve_django
from oncely.http._semantics import Header, HttpRequest, Response, ResponseCapture
from oncely.stores._coalescing import CoalescingStore

__all__ = ["IdempotencyMiddleware"]


class IdempotencyMiddleware:
    """Makes covered Django requests that carry an ``Idempotency-Key`` take effect once.

    Sync and async capable: Django calls it in the mode of its stack (see the module).

    Args:
        get_response: The next layer (Django passes it).
        store: Any `oncely.SyncStore` (under an async stack: `oncely.AsyncStore`); default
            ``settings.ONCELY_STORE``, else a store opened from ``settings.ONCELY_STORE_URL``.
        policy: The app-wide `HttpPolicy`; default ``settings.ONCELY_HTTP`` (an `HttpPolicy`
            or a dict of its options), else the defaults.
        routes: `RouteOptions` by path pattern; default ``settings.ONCELY_HTTP_ROUTES``.

    Raises:
        ConfigurationError: No store is configured, the store lacks the verbs of the stack's
            mode, or an option is invalid.

    .. versionadded:: 0.1.0
    """

    sync_capable = True
    async_capable = True

    def __init__(
        self,
        get_response: Callable[[Any], Any],
        *,
        store: SyncStore | AsyncStore | None = None,
        policy: HttpPolicy | None = None,
        routes: Mapping[str, RouteOptions] | None = None,
    ) -> None:
        settings = importlib.import_module("django.conf").settings
        asgiref = importlib.import_module("asgiref.sync")
        if store is None:
            store = getattr(settings, "ONCELY_STORE", None)
        if store is None:
            url = getattr(settings, "ONCELY_STORE_URL", None)
            if not url:
                raise ConfigurationError(
                    "oncely.http.django.IdempotencyMiddleware needs settings.ONCELY_STORE_URL "
                    "(or ONCELY_STORE)"
                )
            store = oncely.open_store(url)
        self.async_mode: bool = asgiref.iscoroutinefunction(get_response)
        """Whether Django built an async stack around it (then `__call__` returns a coroutine)."""
        if self.async_mode:
            if not isinstance(store, AsyncStore):
                raise ConfigurationError(
                    f"{type(store).__name__} has no async verbs: the Django middleware in an "
                    "async stack needs an oncely.AsyncStore (any built-in store)"
                )
            # As the ASGI middleware does: concurrent claims and completions go in batches.
            self._acalls: AsyncStore = store
            if isinstance(store, BatchStore):
                self._acalls = CoalescingStore(store, max_in_flight=2)
            asgiref.markcoroutinefunction(self)
        elif not isinstance(store, SyncStore):
            raise ConfigurationError(
                f"{type(store).__name__} has no sync verbs: the Django middleware in a sync "
                "stack needs an oncely.SyncStore (any built-in store)"
            )
        if policy is None:
            configured = getattr(settings, "ONCELY_HTTP", None)
            if isinstance(configured, Mapping):
                configured = HttpPolicy(**configured)
            policy = configured
        if routes is None:
            routes = getattr(settings, "ONCELY_HTTP_ROUTES", None)
        self.get_response = get_response
        self.store = store
        self.routes = RouteTable(policy, routes, None)

    @property
    def policy(self) -> HttpPolicy:
        """The app-wide policy."""
        return self.routes.policy

    def __call__(self, request: Any) -> Any:
        """Handle one Django request (safe methods pass straight through); in an async stack,
        return the coroutine that does."""
        if _events.on and not _observed.serving():
            return _observed.django(self, request)
        if self.async_mode:
            return self._acall(request)
        admitted = self._admit(request)
        if admitted is None:
            return self.get_response(request)
        if isinstance(admitted, Response):
            return _to_django(admitted)
        store: SyncStore = self.store  # type: ignore[assignment]  # checked in __init__
        http_request = admitted.request(request, getattr(request, "user", None))
        given = _semantics.given(admitted.policy, http_request)
        plan = _semantics.plan(http_request, admitted.key, admitted.policy, given)
        if isinstance(plan, Response):
            return _to_django(plan)
        outcome = _execution.run(admitted.begin(plan), store)
        if outcome is _flow.PASS_THROUGH:
            return self.get_response(request)
        if isinstance(outcome, Response):
            return _to_django(outcome)
        capture = ResponseCapture(admitted.policy.max_response_bytes)
        rest: list[Iterator[bytes]] = []  # the stream's unread part, once over the limit
        head: list[bytes] = []

        def call() -> Any:
            response = self.get_response(request)
            chunks = _start(response, capture, admitted.policy)
            if chunks is not None:
                _add(capture, chunks)
                return response
            iterator = iter(response)  # a sync or async stream
            for chunk in iterator:
                head.append(bytes(chunk))
                capture.add(head[-1])
                if capture.overflowed:  # too large to store: stream the rest as it comes
                    rest.append(iterator)
                    return response
            response.streaming_content = head
            return response

        try:
            response = _execution.run(_flow.invoke(outcome), store, call)
        except BaseException as exc:
            _execution.run(_settling(outcome, capture, admitted.policy, exc), store)
            raise
        if rest:  # settled as the WSGI middleware settles a stream: when it ends, or is cut
            response.streaming_content = _Streamed(
                head, rest[0], outcome, capture, admitted.policy, store
            )
            return response
        _execution.run(_settling(outcome, capture, admitted.policy, None), store)
        return response

    async def _acall(self, request: Any) -> Any:
        """`__call__` in an async stack: the same steps, awaiting the store's async verbs."""
        admitted = self._admit(request)
        if admitted is None:
            return await self.get_response(request)
        if isinstance(admitted, Response):
            return _to_django(admitted)
        auser = getattr(request, "auser", None)  # Django 5.0+: the user, loaded without a thread
        user = await auser() if auser is not None else getattr(request, "user", None)
        http_request = admitted.request(request, user)
        given = await _semantics.agiven(admitted.policy, http_request)
        plan = _semantics.plan(http_request, admitted.key, admitted.policy, given)
        if isinstance(plan, Response):
            return _to_django(plan)
        outcome = await _execution.arun(admitted.begin(plan), self._acalls)
        if outcome is _flow.PASS_THROUGH:
            return await self.get_response(request)
        if isinstance(outcome, Response):
            return _to_django(outcome)
        capture = ResponseCapture(admitted.policy.max_response_bytes)
        rest: list[AsyncIterator[bytes]] = []  # the stream's unread part, once over the limit
        head: list[bytes] = []

        async def call() -> Any:
            response = await self.get_response(request)
            chunks = _start(response, capture, admitted.policy)
            if chunks is not None:
                _add(capture, chunks)
                return response
            iterator = aiter(response)  # a sync or async stream
            async for chunk in iterator:
                head.append(bytes(chunk))
                capture.add(head[-1])
                if capture.overflowed:  # too large to store: stream the rest as it comes
                    rest.append(iterator)
                    return response
            response.streaming_content = _aiterate(head)
            return response

        try:
            response = await _execution.arun(_flow.invoke(outcome), self._acalls, call)
        except BaseException as exc:
            settling = partial(_settling, outcome, capture, admitted.policy, exc)
            await _flow.asettle(settling, outcome, self._acalls)
            raise
        if rest:
            response.streaming_content = _astream(
                head, rest[0], outcome, capture, admitted.policy, self._acalls
            )
            return response
        settling = partial(_settling, outcome, capture, admitted.policy, None)
        await _flow.asettle(settling, outcome, self._acalls)
        return response

    def _admit(self, request: Any) -> _Admitted | Response | None:
        """What the request's method, route, key and size decide: ``None`` to pass it through,
        a `Response` to answer at once, else the request admitted for a claim."""
        method = str(request.method or "GET").upper()
        if method in _semantics.SAFE_METHODS or _switches.off(method, str(request.path)):
            return None
        path = str(request.path)
        route_match = resolve_django(request.path_info, getattr(request, "urlconf", None))
        policy, route = self.routes.select(method, path, route_match)
        if not policy.covers(method):
            return None
        meta = request.META
        raw = meta.get(policy.environ_key)
        decision = _semantics.decide(method, [] if raw is None else [_latin1(raw)], policy)
        if decision is None or isinstance(decision, Response):
            return decision
        limit = policy.max_request_bytes
        length = str(meta.get("CONTENT_LENGTH") or "").strip()
        declared = None
        if length.isascii() and length.isdigit():  # "²" is a digit to isdigit, not to int
            declared = int(length) if len(length) <= 20 else 10**20
        if declared is not None and declared > limit:
            return _semantics.request_too_large(policy)
        body = bytes(request.body)  # cached by Django: the view reads it again
        if len(body) > limit:
            return _semantics.request_too_large(policy)
        if declared is not None and len(body) < declared:
            # Django's WSGI request reads a body cut short (the client half-closed or left)
            # without complaint: run nothing, as the other middleware do.
            return _semantics.request_incomplete(declared, len(body))
        return _Admitted(method, path, route, decision, body, policy)


@dataclass(frozen=True)
class _Admitted:
    """A covered request with a valid key and a body within the limit."""

    method: str
    path: str
    route: str
    key: str
    body: bytes
    policy: HttpPolicy

    def request(self, request: Any, user: object) -> HttpRequest:
        """The request as the scope and principal callables see it, *user* being Django's
        user for it."""
        meta = request.META
        return HttpRequest(
            self.method,
            self.path,
            self.route,
            _latin1(meta.get("QUERY_STRING", "")),
            _request_headers(meta),
            self.body,
            _semantics.user_principal(user),
        )

    def begin(self, plan: _semantics.Plan) -> Flow[_execution.Lease | Response | Any]:
        return _flow.begin(plan, self.policy, method=self.method, path=self.path)


def _start(response: Any, capture: ResponseCapture, policy: HttpPolicy) -> list[bytes] | None:
    """Capture the view's status line and headers; return its body, or ``None`` if it
    streams (the caller reads the stream, sync or async)."""
    capture.start(
        int(response.status_code),
        _response_headers(response),
        policy,
        str(response.reason_phrase or "").encode("latin-1", "replace"),
    )
    return None if response.streaming else [bytes(response.content)]


def _add(capture: ResponseCapture, chunks: list[bytes]) -> None:
    for chunk in chunks:
        capture.add(chunk)


async def _aiterate(chunks: list[bytes]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk


class _Streamed:
    """A streamed response over the size limit, passed on as the view yields it (no chunk is
    held back: server-sent events arrive as they are sent). Its record is completed as not
    stored once the stream ends, or when it ends any other way (the view's iterator raised, the
    server closed it unread or part read): the handler ran, so it is never released."""

    __slots__ = ("_capture", "_chunks", "_head", "_lease", "_policy", "_rest", "_settled", "_store")

    def __init__(
        self,
        head: list[bytes],
        rest: Iterator[bytes],
        lease: _execution.Lease,
        capture: ResponseCapture,
        policy: HttpPolicy,
        store: SyncStore,
    ) -> None:
        self._head = head
        self._rest = rest
        self._lease = lease
        self._capture = capture
        self._policy = policy
        self._store = store
        self._chunks: Generator[bytes, None, None] | None = None
        self._settled = False

    def __iter__(self) -> Iterator[bytes]:
        if self._chunks is None:
            self._chunks = self._stream()
        return self._chunks

    def close(self) -> None:
        """Called by Django when the server is done with the response, read whole or not."""
        if self._chunks is not None:
            self._chunks.close()  # a stream cut short settles in its GeneratorExit
        self._settle(None, "the server closed the response before reading it")

    def _stream(self) -> Generator[bytes, None, None]:
        try:
            yield from self._head
            for part in self._rest:
                chunk = bytes(part)
                self._capture.add(chunk)
                yield chunk
            self._settle(None, "")
        except BaseException as exc:  # GeneratorExit: the server stopped reading (client gone)
            self._settle(exc, _cause(exc))
            raise

    def _settle(self, exc: BaseException | None, cause: str) -> None:
        if not self._settled:
            self._settled = True
            _execution.run(
                _streamed_settling(self._lease, self._capture, self._policy, cause), self._store
            )


async def _astream(
    head: list[bytes],
    rest: AsyncIterator[bytes],
    lease: _execution.Lease,
    capture: ResponseCapture,
    policy: HttpPolicy,
    calls: AsyncStore,
) -> AsyncIterator[bytes]:
    """Async `_Streamed`."""
    settled = False
    try:
        for chunk in head:
            yield chunk
        async for part in rest:
            chunk = bytes(part)
            capture.add(chunk)
            yield chunk
        settled = True
        await _flow.asettle(partial(_streamed_settling, lease, capture, policy, ""), lease, calls)
    except BaseException as exc:  # GeneratorExit: the server stopped reading (client gone)
        if not settled:
            settled = True
            settling = partial(_streamed_settling, lease, capture, policy, _cause(exc))
            await _flow.asettle(settling, lease, calls)
        raise


def _cause(exc: BaseException) -> str:
    if isinstance(exc, GeneratorExit):
        return "the server stopped reading it"
    return f"{type(exc).__name__} from the view's streamed response"


def _streamed_settling(
    lease: _execution.Lease, capture: ResponseCapture, policy: HttpPolicy, cause: str
) -> Flow[None]:
    """Settle a streamed response over the limit: *cause* is why it was cut short, or ``""``
    if it ended (completed with the not-stored marker either way)."""
    if not cause:
        capture.complete = True
        return _flow.finish(lease, capture, policy)
    return _flow.cut(lease, capture, cause, policy)


def _settling(
    lease: _execution.Lease,
    capture: ResponseCapture,
    policy: HttpPolicy,
    exc: BaseException | None,
) -> Flow[None]:
    """How the lease settles once the view is over: *exc* is what it (or reading its streamed
    response) raised, or ``None``."""
    if exc is None:
        capture.complete = True
        return _flow.finish(lease, capture, policy)
    if capture.started:  # the view answered; reading its streamed body failed
        cause = f"{type(exc).__name__} from the view's streamed response"
        return _flow.cut(lease, capture, cause, policy)
    return _flow.abort(lease, exc, policy)


def _latin1(value: Any) -> bytes:
    return str(value).encode("latin-1", "replace")


def _request_headers(meta: Mapping[str, Any]) -> tuple[Header, ...]:
    headers = []
    for name, value in meta.items():
        if name.startswith("HTTP_"):
            header = name[5:]
        elif name in ("CONTENT_TYPE", "CONTENT_LENGTH"):
            header = name
        else:
            continue
        headers.append((header.replace("_", "-").lower().encode("latin-1"), _latin1(value)))
    return tuple(headers)


def _response_headers(response: Any) -> list[Header]:
    headers = [(_latin1(name), _latin1(value)) for name, value in response.items()]
    for cookie in response.cookies.values():
        headers.append((b"Set-Cookie", _latin1(cookie.output(header="").strip())))
    return headers


def _to_django(response: Response) -> Any:
    """A Django response with *response*'s status, headers (repeats joined) and body."""
    http = importlib.import_module("django.http")
    reason = response.reason.decode("latin-1") or None
    out = http.HttpResponse(response.body, status=response.status, reason=reason)
    del out["Content-Type"]
    for name, value in response.headers:
        text_name, text_value = name.decode("latin-1"), value.decode("latin-1")
        if text_name.lower() == "set-cookie":
            # Django keeps cookies apart from headers: parse the stored line back into one.
            out.cookies.load(text_value)
        elif text_name in out:
            out[text_name] = f"{out[text_name]}, {text_value}"
        else:
            out[text_name] = text_value
    return out
