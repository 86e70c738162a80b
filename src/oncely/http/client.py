"""httpx transports that give each logical request one idempotency key and retry it safely.

The server side (`oncely.http.asgi`, `oncely.http.wsgi`) makes a repeat harmless; this module
makes the client repeat when it should. A covered request (POST and PATCH by default) gets an
``Idempotency-Key`` (a UUID4, unless the caller set one) that stays the same across every
attempt, and is sent again on connection errors, timeouts, 409 (still in progress), 429 and
503, with exponential backoff and full jitter, honouring ``Retry-After``, within a bounded
number of attempts and a time budget. Other methods pass through untouched.

A covered response is read whole inside the retry loop, so a timeout or a reset while its body
arrives is retried with the same key too (the server replays the stored response), and the
caller gets a response already read. When the retries run out after an attempt that may have
reached the server, `OutcomeUnknownError` is raised: it keeps the key, so the caller can retry
the same operation later instead of starting a new one.

.. code-block:: python

    import httpx
    from oncely.http.client import IdempotentTransport

    with httpx.Client(transport=IdempotentTransport(), base_url="https://api.example") as c:
        c.post("/payments", json={"amount": 500})   # one key, however many attempts

Both transports run one retry flow (`oncely.http._retry.retry_flow`); only sending and sleeping
differ. Needs the ``httpx`` extra: ``pip install 'oncely[httpx]'``.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable, Collection
from datetime import timedelta
from typing import Any

from oncely import _events, _observed, _switches
from oncely._core.flow import adrive, drive
from oncely._core.policy import Duration
from oncely.errors import ConfigurationError, MissingDependencyError
from oncely.http._policy import DEFAULT_METHODS
from oncely.http._retry import RETRY_STATUSES, CloseOp, RetryPolicy, SendOp, SleepOp, retry_flow
from oncely.http._semantics import is_token

try:
    import anyio
    import httpx
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise MissingDependencyError(
        "'httpx' is required for oncely.http.client; install it with: pip install 'oncely[httpx]'"
    ) from exc

__all__ = ["AsyncIdempotentTransport", "IdempotentTransport", "OutcomeUnknownError", "RetryPolicy"]

ATTEMPTS_EXTENSION = "oncely.attempts"
"""The key of ``response.extensions`` that holds how many attempts the request took."""

_RETRYABLE = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)
_UNSENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
"""Errors that show an attempt never reached the server."""


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, _RETRYABLE)


def _unsent(exc: BaseException) -> bool:
    return isinstance(exc, _UNSENT)


class OutcomeUnknownError(httpx.TransportError):
    """A covered request ran out of retries, and it may have taken effect.

    At least one attempt may have reached the server (it timed out or was cut while the
    request or the response travelled), so do not send the operation again under a new key,
    whatever the last attempt got (an error, or a 409, 429 or 503 refusal): retry it with
    `key` (the header the transport sent), and the server answers with the stored outcome if
    it ran. The last attempt's error, if it ended in one, is the ``__cause__``.

    Attributes:
        key: The idempotency key every attempt carried.
        attempts: How many attempts were made.

    .. versionadded:: 0.1.0
    """

    def __init__(self, message: str, *, request: httpx.Request, key: str, attempts: int) -> None:
        super().__init__(message, request=request)
        self.key = key
        self.attempts = attempts


class _Idempotent:
    """The settings and request preparation both transports share."""

    def __init__(
        self,
        *,
        methods: Collection[str],
        header: str,
        key_factory: Callable[[], str] | None,
        max_attempts: int,
        max_elapsed: Duration,
        backoff: Duration,
        max_backoff: Duration,
        retry_statuses: Collection[int],
        seed: int | None,
    ) -> None:
        if isinstance(methods, str) or not all(is_token(m) for m in methods):
            raise ConfigurationError(f"methods must be a collection of HTTP methods: {methods!r}")
        if not is_token(header):
            raise ConfigurationError(f"header must be an HTTP header name, not {header!r}")
        self.methods = frozenset(method.upper() for method in methods)
        self.header = header
        self.key_factory = key_factory or _uuid_key
        self.retry = RetryPolicy(
            max_attempts=max_attempts,
            max_elapsed=max_elapsed,
            backoff=backoff,
            max_backoff=max_backoff,
            statuses=retry_statuses,
        )
        self._rng = random.Random(seed)

    def _covers(self, request: httpx.Request) -> bool:
        """Whether *request* is retried; if so, make sure it carries a key."""
        if request.method not in self.methods or _switches.off(request.method, request.url.path):
            return False
        if self.header not in request.headers:
            request.headers[self.header] = self.key_factory()
        return True

    def _flow(self, request: httpx.Request) -> Any:
        key = request.headers[self.header]

        def outcome_unknown(last: Any, attempts: int) -> BaseException:
            if isinstance(last, httpx.Response):
                what = f"status {last.status_code}"
            else:
                what = type(last).__name__
            return OutcomeUnknownError(
                f"{request.method} {request.url} may have taken effect: {what} after "
                f"{attempts} attempt(s); retry it with {self.header}: {key}",
                request=request,
                key=key,
                attempts=attempts,
            )

        return retry_flow(
            self.retry,
            retryable=_retryable,
            rng=self._rng,
            describe=f"{request.method} {request.url} key={key}",
            unsent=_unsent,
            outcome_unknown=outcome_unknown,
        )


def _read(response: httpx.Response, raw: bytes) -> httpx.Response:
    """A response like *response* whose (still encoded) body is *raw*, held in memory."""
    return httpx.Response(
        response.status_code,
        headers=response.headers,
        stream=httpx.ByteStream(raw),
        extensions=response.extensions,
    )


def _read_whole(response: httpx.Response) -> httpx.Response:
    """Read *response*'s body to the end (errors go to the retry flow), then close it."""
    if response.is_stream_consumed:  # already in memory (a mock, a cache)
        return response
    try:
        raw = b"".join(response.iter_raw())
    finally:
        response.close()
    return _read(response, raw)


async def _aread_whole(response: httpx.Response) -> httpx.Response:
    """The async twin of `_read_whole`."""
    if response.is_stream_consumed:
        return response
    try:
        raw = b"".join([chunk async for chunk in response.aiter_raw()])
    finally:
        await response.aclose()
    return _read(response, raw)


def _uuid_key() -> str:
    return str(uuid.uuid4())


class IdempotentTransport(_Idempotent, httpx.BaseTransport):
    """A sync httpx transport that keys covered requests and retries them safely.

    Args:
        transport: The transport that sends each attempt (default: a new
            ``httpx.HTTPTransport()``); closed with this one.
        methods: The methods keyed and retried (default POST and PATCH).
        header: The key's header (default ``Idempotency-Key``). A request that already has it
            keeps its key.
        key_factory: Makes a new key (default: a UUID4 string).
        max_attempts: Attempts in all, the first included.
        max_elapsed: The time budget across attempts and pauses (timedelta or seconds).
        backoff: The first pause without ``Retry-After``; doubled per attempt, jittered.
        max_backoff: The longest backoff pause.
        retry_statuses: Response statuses that are retried (default 409, 429, 503).
        seed: Seeds the jitter (for reproducible tests).

    .. versionadded:: 0.1.0
    """

    def __init__(
        self,
        transport: httpx.BaseTransport | None = None,
        *,
        methods: Collection[str] = DEFAULT_METHODS,
        header: str = "Idempotency-Key",
        key_factory: Callable[[], str] | None = None,
        max_attempts: int = 5,
        max_elapsed: Duration = timedelta(seconds=30),
        backoff: Duration = timedelta(milliseconds=100),
        max_backoff: Duration = timedelta(seconds=5),
        retry_statuses: Collection[int] = RETRY_STATUSES,
        seed: int | None = None,
    ) -> None:
        super().__init__(
            methods=methods,
            header=header,
            key_factory=key_factory,
            max_attempts=max_attempts,
            max_elapsed=max_elapsed,
            backoff=backoff,
            max_backoff=max_backoff,
            retry_statuses=retry_statuses,
            seed=seed,
        )
        self.transport = transport if transport is not None else httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        """Send *request*; a covered one is retried under its one key until its whole
        response is read.

        Raises:
            OutcomeUnknownError: The retries ran out after an attempt that may have reached
                the server; retry with its ``key``.
        """
        if not self._covers(request):
            return self.transport.handle_request(request)
        request.read()  # a streamed body must be replayable
        attempts = 0

        def perform(op: Any) -> Any:
            nonlocal attempts
            if isinstance(op, SendOp):
                attempts = op.attempt
                return _read_whole(self.transport.handle_request(request))
            if isinstance(op, CloseOp):
                op.response.close()
            elif isinstance(op, SleepOp):
                time.sleep(op.seconds)
            return None

        flow = self._flow(request)
        if _events.on:
            flow = _observed.sending(flow, request)
        response: httpx.Response = drive(flow, perform)
        response.extensions[ATTEMPTS_EXTENSION] = attempts
        return response

    def close(self) -> None:
        """Close the wrapped transport."""
        self.transport.close()


class AsyncIdempotentTransport(_Idempotent, httpx.AsyncBaseTransport):
    """The async twin of `IdempotentTransport` (same arguments), for ``httpx.AsyncClient``.

    Args:
        transport: The transport that sends each attempt (default: a new
            ``httpx.AsyncHTTPTransport()``); closed with this one.
        methods: The methods keyed and retried (default POST and PATCH).
        header: The key's header (default ``Idempotency-Key``).
        key_factory: Makes a new key (default: a UUID4 string).
        max_attempts: Attempts in all, the first included.
        max_elapsed: The time budget across attempts and pauses.
        backoff: The first pause without ``Retry-After``; doubled per attempt, jittered.
        max_backoff: The longest backoff pause.
        retry_statuses: Response statuses that are retried (default 409, 429, 503).
        seed: Seeds the jitter.

    .. versionadded:: 0.1.0
    """

    def __init__(
        self,
        transport: httpx.AsyncBaseTransport | None = None,
        *,
        methods: Collection[str] = DEFAULT_METHODS,
        header: str = "Idempotency-Key",
        key_factory: Callable[[], str] | None = None,
        max_attempts: int = 5,
        max_elapsed: Duration = timedelta(seconds=30),
        backoff: Duration = timedelta(milliseconds=100),
        max_backoff: Duration = timedelta(seconds=5),
        retry_statuses: Collection[int] = RETRY_STATUSES,
        seed: int | None = None,
    ) -> None:
        super().__init__(
            methods=methods,
            header=header,
            key_factory=key_factory,
            max_attempts=max_attempts,
            max_elapsed=max_elapsed,
            backoff=backoff,
            max_backoff=max_backoff,
            retry_statuses=retry_statuses,
            seed=seed,
        )
        self.transport = transport if transport is not None else httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Send *request*; a covered one is retried under its one key until its whole
        response is read.

        Raises:
            OutcomeUnknownError: The retries ran out after an attempt that may have reached
                the server; retry with its ``key``.
        """
        if not self._covers(request):
            return await self.transport.handle_async_request(request)
        await request.aread()
        attempts = 0

        async def perform(op: Any) -> Any:
            nonlocal attempts
            if isinstance(op, SendOp):
                attempts = op.attempt
                return await _aread_whole(await self.transport.handle_async_request(request))
            if isinstance(op, CloseOp):
                await op.response.aclose()
            elif isinstance(op, SleepOp):
                await anyio.sleep(op.seconds)
            return None

        flow = self._flow(request)
        if _events.on:
            flow = _observed.sending(flow, request)
        response: httpx.Response = await adrive(flow, perform)
        response.extensions[ATTEMPTS_EXTENSION] = attempts
        return response

    async def aclose(self) -> None:
        """Close the wrapped transport."""
        await self.transport.aclose()
