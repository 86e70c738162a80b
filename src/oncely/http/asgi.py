"""ASGI middleware: answer repeats of unsafe requests from the store (docs/guides/http.md).

A pure ASGI middleware (never Starlette's ``BaseHTTPMiddleware``), so it works with FastAPI,
Starlette, Litestar or a bare ASGI app, keeps streaming responses streaming, and imports no
framework. Every rule comes from `oncely.http._semantics` and every store step from the shared
flows in `oncely.http._flow`; this module only moves ASGI messages.

.. code-block:: python

    from oncely.http.asgi import IdempotencyMiddleware

    app.add_middleware(IdempotencyMiddleware, store=oncely.open_store("sqlite:///oncely.db"))

How a protected request travels:

* its body is read in full (to fingerprint it) and the same ``http.request`` messages are
  handed to the app afterwards, chunk for chunk; a body over `HttpPolicy.max_request_bytes` is
  answered 413 (at once if ``Content-Length`` says so, else when it grows past the limit);
* the response streams through as the app sends it, except the final body chunk, which is held
  until the record is completed (or released), so a client that has the whole response can
  never see its own retry answered 409, and ``http.response.start``, which leaves with the
  first body message, so a whole response whose start cannot be sent (the client left, ASGI
  2.4) has been captured and stored by then;
* once the app has started its response, the handler has run: if the response is then cut
  short (the client left, the app raised or was cancelled mid-response), the record is
  completed as not replayable, never released, so a retry cannot run the handler again;
* the ``http.response.pathsend`` and ``zerocopysend`` extensions are hidden from the app for
  protected requests, so file responses arrive as bytes that can be stored.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from functools import partial
from typing import Any, Final

from oncely import _events, _execution, _observed, _switches
from oncely._core.protocols import AsyncStore, BatchStore
from oncely._core.records import Acquired, ClaimResult, Replay
from oncely.errors import ConfigurationError
from oncely.http import _flow, _semantics
from oncely.http._policy import HttpPolicy, RouteOptions
from oncely.http._routes import RouteResolver, RouteTable, is_django, resolve_asgi
from oncely.http._semantics import HttpRequest, Response, ResponseCapture
from oncely.http._types import ASGIApp, Message, Receive, Scope, Send
from oncely.http.fastapi import _Parked, _parking
from oncely.stores._coalescing import CoalescingStore

__all__ = ["IdempotencyMiddleware"]

_HIDDEN_EXTENSIONS = ("http.response.pathsend", "http.response.zerocopysend")


class IdempotencyMiddleware:
    """Make unsafe requests with an ``Idempotency-Key`` take effect once (pure ASGI).

    Args:
        app: The ASGI application to protect.
        store: Any `oncely.AsyncStore` (every built-in store is one).
        policy: The app-wide `HttpPolicy` (default: POST and PATCH covered, key optional).
        routes: `RouteOptions` by path pattern, ``"[METHOD ]/path/{param}"``; the first match
            applies. Views decorated with `idempotent_route` override both.
        resolver: Finds the route (template and view) a request reaches; by default Starlette,
            FastAPI and Litestar routing are understood, and other apps use the path.
        coalesce: With a store that has the batch verbs (`oncely.BatchStore`: every built-in
            store), let two claims (completions) go to the store at once, four while the event
            loop has CPU to spare, and send those that arrive meanwhile together as one batch
            call. Same answers, fewer round trips under load, no wait when idle.

    Raises:
        ConfigurationError: The store cannot serve async callers, or an option is invalid.

    .. versionadded:: 0.1.0
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        store: AsyncStore,
        policy: HttpPolicy | None = None,
        routes: Mapping[str, RouteOptions] | None = None,
        resolver: RouteResolver | None = None,
        coalesce: bool = True,
    ) -> None:
        if not isinstance(store, AsyncStore):
            raise ConfigurationError(
                f"{type(store).__name__} has no async verbs: the ASGI middleware needs an "
                "oncely.AsyncStore (any built-in store)"
            )
        self.app = app
        self.store = store
        self._calls: AsyncStore = store
        # A store whose verbs never suspend (memory://) has nothing in flight to group.
        inline = getattr(type(store), "_inline_async", None) is type(store)
        if coalesce and not inline and isinstance(store, BatchStore):
            # Past two calls at once, the waiting calls go together, which is what lets a
            # server short of CPU keep up (fewer round trips, each costing CPU); but a call
            # that waits pays for the call in flight too, so up to four go alone while the
            # loop has CPU to spare (PostgreSQL, 50 ms handlers: 0.81 -> 0.86 of the bare app).
            self._calls = CoalescingStore(store, max_in_flight=2, burst=4)
        self.routes = RouteTable(policy, routes, resolver)
        # Only a Django app needs itself to be resolved (see resolve_asgi): decided once.
        self._resolve: RouteResolver = resolver or (
            partial(resolve_asgi, app=app) if is_django(app) else resolve_asgi
        )

    @property
    def policy(self) -> HttpPolicy:
        """The app-wide policy."""
        return self.routes.policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Handle one ASGI connection (non-HTTP scopes and safe methods pass straight through)."""
        if _events.on and not _observed.serving():
            return await _observed.asgi(self, scope, receive, send)
        if scope["type"] != "http" or scope["method"] in _semantics.SAFE_METHODS:
            await self.app(scope, receive, send)
            return
        method: str = scope["method"]
        path: str = scope.get("path", "")
        if _switches.disabled and _switches.off(method, path):
            return await self.app(scope, receive, send)
        policy, route = self.routes.select(method, path, self._resolve(scope))
        scope, parked = _parking(policy, route, scope)  # a route that claims in a dependency
        if not policy.covers(method):
            await self.app(scope, receive, send)
            return
        headers = scope.get("headers") or ()
        keys, length, read = _semantics.scan_headers(headers, policy.header_name)
        decision = _semantics.decide_key(keys, policy)
        if decision is None:
            await self.app(scope, receive, send)
            return
        if isinstance(decision, Response):
            await _send_response(send, decision)
            return
        limit = policy.max_request_bytes
        if length is not None and _declared_length(length) > limit:  # before the body is read
            await _send_response(send, _semantics.request_too_large(policy))
            return
        message = await receive()
        body = message.get("body", b"")
        if (
            message["type"] == "http.request"
            and not message.get("more_body", False)
            and len(body) <= limit
        ):  # the usual request: its whole body in one message
            messages = [message]
        else:
            buffered = await _read_body(receive, limit, message)
            if buffered is None:  # the client left before its request was complete: run nothing
                return
            if buffered is _TOO_LARGE:
                await _send_response(send, _semantics.request_too_large(policy))
                return
            messages, body = buffered
        user = scope.get("user")  # set by Starlette's AuthenticationMiddleware run before this
        principal = None if user is None else _semantics.user_principal(user)
        query = scope.get("query_string", b"")
        if parked is not None:  # `oncely.http.fastapi.idempotent_for` claims, inside the app
            calls = self._calls if not _events.on else _observed.timed(self._calls)
            parked.park(calls, method, path, query, tuple(headers), body, principal, decision)
            receive = _BufferedReceive(messages, receive)
            await self._run(None, policy, _app_scope(scope), receive, send, parked)
            return
        given = None
        if policy.principal is not None:  # the request is built only for it to see
            request = HttpRequest(method, path, route, query, tuple(headers), body, principal)
            given = await _semantics.agiven(policy, request)
        plan = _semantics.plan_parts(
            method, path, route, query, headers, body, principal, decision, policy, given, read
        )
        if isinstance(plan, Response):
            await _send_response(send, plan)
            return
        receive = _BufferedReceive(messages, receive)
        # The straight line: a claim that acquires (run, complete) or replays. Any other answer
        # or error goes on in `_flow.begin` from the point reached; with the reference flows
        # switched on, the whole claim is `_flow.begin`'s (and the settling `_flow.finish`'s).
        calls, core = self._calls, policy.core
        if _events.on:
            calls = _observed.timed(calls)
        answer: ClaimResult | Exception | None = None
        if not _switches.reference_flows:
            try:
                answer = await _execution.aclaim(
                    calls, plan.key, plan.fingerprint, lease=core.lease, ttl=core.ttl
                )
            except Exception as exc:
                answer = exc
            if isinstance(answer, Acquired):
                lease = _execution.acquired(plan.key, answer, core)
                if core.heartbeat:
                    _execution.start_async_heartbeat(calls, lease)
                await self._run(lease, policy, _app_scope(scope), receive, send)
                return
            if isinstance(answer, Replay):
                _execution.suppressed(plan.key, answer)
                await _send_response(send, _flow.replay(answer, policy))
                return
        outcome = await _execution.arun(
            _flow.begin(plan, policy, method=method, path=path, first=answer), calls
        )
        if outcome is _flow.PASS_THROUGH:
            await self.app(scope, receive, send)
        elif isinstance(outcome, Response):
            await _send_response(send, outcome)
        else:
            await self._run(outcome, policy, _app_scope(scope), receive, send)

    async def _run(
        self,
        lease: _execution.Lease | None,
        policy: HttpPolicy,
        scope: Scope,
        receive: Receive,
        send: Send,
        parked: _Parked | None = None,
    ) -> None:
        # The lease's heartbeat was started with it (`oncely._execution`'s: a timer that becomes
        # a task only if the request outlives a third of its lease); settling stops it.
        calls = self._calls if not _events.on else _observed.timed(self._calls)
        capture = ResponseCapture(policy.max_response_bytes)
        settled = False
        held: Message | None = None  # the response start, until the first body message
        trailers = False

        async def capture_send(message: Message) -> None:
            nonlocal settled, held, trailers, lease
            if lease is None:  # parked: claimed by the dependency, or not at all
                assert parked is not None
                lease = parked.lease
                if lease is None:
                    await parked.unclaimed(message, send, scope)
                    return
            if not settled:
                kind = message["type"]
                if kind == "http.response.start":
                    capture.start(int(message["status"]), message.get("headers") or (), policy)
                    trailers = bool(message.get("trailers", False))
                    # Held until the first body message, so that a response whose start
                    # cannot be sent (the client left, ASGI 2.4) has been captured by then.
                    held = message
                    return
                if kind == "http.response.body":
                    capture.add(message.get("body", b""))
                    if not message.get("more_body", False) and not trailers:
                        # Settle before the last chunk leaves: the client can only hold the
                        # whole response once its record is complete.
                        settled = capture.complete = True
                        if _switches.reference_flows:
                            await _flow.asettle(
                                partial(_flow.finish, lease, capture, policy), lease, calls
                            )
                        else:
                            await _flow.afinish(lease, capture, policy, calls)
                elif kind == "http.response.trailers" and not message.get("more_trailers"):
                    settled = True
                    await _flow.asettle(
                        partial(_flow.finish_with_trailers, lease, capture, policy),
                        lease,
                        calls,
                    )
            if held is not None:
                start, held = held, None
                await send(start)
            await send(message)

        try:
            reset = _execution.CURRENT.set(lease)  # `oncely.current_lease()` in the handler
            try:
                await self.app(scope, receive, capture_send)
            finally:
                _execution.CURRENT.reset(reset)
        except BaseException as exc:
            if lease is None and parked is not None:
                lease = parked.lease
            if lease is None:  # parked, and never claimed: nothing to settle
                if parked is not None and await parked.answers(exc, send):
                    return
            elif not settled:
                settled = True
                if capture.started:  # the handler ran and started answering: never again
                    cause = f"{type(exc).__name__} while it was sent"
                    await _flow.asettle(
                        partial(_flow.cut, lease, capture, cause, policy), lease, calls
                    )
                else:
                    await _flow.asettle(partial(_flow.abort, lease, exc, policy), lease, calls)
            raise
        if lease is None and parked is not None:
            lease = parked.lease
        if lease is None:
            if parked is not None:
                await parked.answers(None, send)
        elif not settled:
            settled = True
            if capture.started:
                cause = "the app returned before completing it"
                await _flow.asettle(partial(_flow.cut, lease, capture, cause, policy), lease, calls)
            else:
                await _flow.asettle(partial(_flow.abort, lease, None, policy), lease, calls)


class _BufferedReceive:
    """Hands the app the request messages read for fingerprinting, then the real ``receive``."""

    __slots__ = ("_messages", "_receive")

    def __init__(self, messages: list[Message], receive: Receive) -> None:
        self._messages = messages[::-1]  # popped from the end: most requests are one message
        self._receive = receive

    async def __call__(self) -> Message:
        if self._messages:
            return self._messages.pop()
        return await self._receive()


class _TooLarge(enum.Enum):
    TOO_LARGE = "TOO_LARGE"


_TOO_LARGE: Final = _TooLarge.TOO_LARGE


def _declared_length(value: bytes) -> int:
    """The length a ``Content-Length`` *value* announces (0 if unreadable: the server rejects
    those, and the reading loop bounds the body anyway)."""
    value = value.strip()
    if not value.isdigit():
        return 0
    return int(value) if len(value) <= 20 else 10**20


async def _read_body(
    receive: Receive, limit: int, first: Message
) -> tuple[list[Message], bytes] | _TooLarge | None:
    """Read the whole request from its *first* message on; ``None`` if the client disconnected
    first, `_TOO_LARGE` as soon as the body grows past *limit* bytes (the rest is never read)."""
    messages: list[Message] = []
    chunks: list[bytes] = []
    size = 0
    message: Message | None = first
    while True:
        if message is None:
            message = await receive()
        kind = message["type"]
        if kind == "http.disconnect":
            return None
        messages.append(message)
        if kind == "http.request":
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return _TOO_LARGE
            chunks.append(chunk)
            if not message.get("more_body", False):
                return messages, b"".join(chunks)
        message = None


def _app_scope(scope: Scope) -> Scope:
    extensions: dict[str, Any] | None = scope.get("extensions")
    if not extensions or not any(name in extensions for name in _HIDDEN_EXTENSIONS):
        return scope
    scope = dict(scope)
    scope["extensions"] = {
        name: value for name, value in extensions.items() if name not in _HIDDEN_EXTENSIONS
    }
    return scope


async def _send_response(send: Send, response: Response) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": response.status,
            "headers": list(response.headers),
        }
    )
    await send({"type": "http.response.body", "body": response.body})
