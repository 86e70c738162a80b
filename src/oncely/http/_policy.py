"""`HttpPolicy` and `RouteOptions`: how the HTTP middleware behaves, for the app and per route.

Both are frozen and validated when built, so a bad setting fails at import time rather than on
the first request. A route's effective policy is the app's policy with the route's options
applied (`HttpPolicy.with_options`); the middleware derives it once per route and caches it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Collection, Container
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Final, TypeAlias

from oncely._core.policy import UNSET, Duration, Policy, _Unset, to_timedelta
from oncely.errors import ConfigurationError
from oncely.http._request import (
    HOP_BY_HOP,
    SAFE_METHODS,
    HttpRequest,
    default_fingerprint,
    default_scope,
    is_token,
)

__all__ = [
    "DEFAULT_METHODS",
    "DEFAULT_STORED_STATUSES",
    "REFUSAL_STATUSES",
    "FingerprintFunc",
    "HttpPolicy",
    "PrincipalFunc",
    "RouteOptions",
    "ScopeFunc",
]

ScopeFunc: TypeAlias = Callable[[HttpRequest], str]
"""Returns the scope of a request's key: the operation it names, and a tenant if the app has
them (see `default_scope`)."""

PrincipalFunc: TypeAlias = Callable[[HttpRequest], "str | Awaitable[str | None] | None"]
"""Returns who a request is from, as the app verifies it (the subject of a token it checked),
or ``None``; under ASGI it may be async."""

FingerprintFunc: TypeAlias = Callable[[HttpRequest], Any]
"""Returns what defines a request's operation, as any canonical-JSON value; oncely digests it."""

DEFAULT_METHODS: frozenset[str] = frozenset({"POST", "PATCH"})
"""The methods covered unless configured: the unsafe methods that are not idempotent already."""

REFUSAL_STATUSES: Final = frozenset({401, 403, 408, 409, 422, 423, 425, 429})
"""4xx statuses that say the request was not carried out and may succeed later, or with a
corrected request: unauthenticated, forbidden, timed out, conflict, validation (FastAPI's and
Pydantic's ``RequestValidationError`` answer 422), locked, too early, rate limited. Not stored
by default: the lease is released, so a retry runs."""


class _StoredStatuses(Container[int]):
    """The default `HttpPolicy.stored_statuses`: below 500, except `REFUSAL_STATUSES`."""

    __slots__ = ()

    def __contains__(self, status: object) -> bool:
        return isinstance(status, int) and status < 500 and status not in REFUSAL_STATUSES

    def __repr__(self) -> str:
        return "DEFAULT_STORED_STATUSES"


DEFAULT_STORED_STATUSES: Final[Container[int]] = _StoredStatuses()
"""Every status below 500 except `REFUSAL_STATUSES`: outcomes, not refusals."""


@dataclass(frozen=True, slots=True, kw_only=True)
class HttpPolicy:
    """How the HTTP middleware treats requests (docs/guides/http.md). Immutable.

    Attributes:
        methods: The methods whose requests are protected (default POST and PATCH). Safe methods
            (GET, HEAD, OPTIONS, TRACE) cannot be covered: they are idempotent by definition.
        header: The request header holding the key (default ``Idempotency-Key``).
        require_key: Answer 400 to a covered request without a key, instead of passing it
            through unprotected.
        enabled: ``False`` exempts a route entirely (useful as a route option).
        ttl: How long a stored response is replayed (a timedelta or seconds; default 24 h).
        lease: How long a request may run before a duplicate may take over; the heartbeat
            extends it every third of it while the handler runs (default 30 s).
        scope: The scope of a key: by default method + route (`default_scope`). A callable that
            adds a tenant gives each tenant a key space of its own. Who is asking is not part of
            it: each record remembers its owner, and a request from another principal is
            refused (422 ``idempotency-key-owned-by-another-principal``), never run or replayed.
        fingerprint: What defines the operation: by default method + path + sorted query +
            body (JSON bodies canonicalised). A key reused with another fingerprint gets 422.
        principal: Who a request is from, as the app itself verifies it: a callable over the
            `HttpRequest` returning the principal's stable name (a verified token's subject,
            never an unverified claim) or ``None``; async under ASGI if it needs to be. Used
            when the framework knows no authenticated user.
        session_cookies: Names of the cookies that identify a session (``("sessionid",)``):
            the principal when neither the framework nor `principal` names one, whatever
            other cookies come and go.
        require_principal: Every covered request must have a principal from a stable source
            (the framework's user, `principal`, `session_cookies`); one without gets 401
            (``principal-required``) and is not run. Requires `principal` or
            `session_cookies` (``principal=lambda request: request.principal`` takes the
            framework's user alone). Without it, when no stable source is configured, the raw
            ``Authorization`` header, else the cookies, name the owner.
        www_authenticate: The challenge a 401 ``principal-required`` answer carries in its
            ``WWW-Authenticate`` header, as RFC 9110 requires of a 401 (default ``Bearer``;
            say what the app's own login expects, e.g. ``Cookie realm="shop"``).
        stored_statuses: Response statuses that are stored and replayed (default: below 500,
            except the refusals 401, 403, 408, 409, 422, 423, 425 and 429, which say the
            request was not carried out; `REFUSAL_STATUSES`). Any other status releases the
            lease, so a retry executes again. ``range(100, 500)`` stores every 4xx.
        replay_header: The header (name, value) added to replayed responses, or ``None``.
        unreplayed_headers: Response headers that are neither stored nor replayed, besides the
            hop-by-hop ones, which never are (default: ``set-cookie``).
        max_request_bytes: The largest request body a protected request may have (default
            1 MiB). The body is read in full to fingerprint it, so a larger one is answered 413
            (``request-too-large``) without running the handler or storing anything: at once
            when ``Content-Length`` says so, else as soon as a chunked body grows past it.
        max_response_bytes: The largest response body stored (default 1 MiB). A larger response
            is passed through to the client unchanged and its record completed with a marker:
            repeats get a 500 problem response (``response-not-stored``) and the handler is
            never executed again for that key.
        fail_open: When the store is unreachable, serve the request unprotected (each one is
            logged) instead of answering 503. Off by default; meant for single routes.
        unavailable_retry_after: The ``Retry-After`` of a 503 answered while the store is
            unreachable.

    .. versionadded:: 0.1.0
    """

    methods: Collection[str] = DEFAULT_METHODS
    header: str = "Idempotency-Key"
    require_key: bool = False
    enabled: bool = True
    ttl: Duration = timedelta(hours=24)
    lease: Duration = timedelta(seconds=30)
    scope: ScopeFunc = default_scope
    fingerprint: FingerprintFunc = default_fingerprint
    principal: PrincipalFunc | None = None
    session_cookies: Collection[str] = ()
    require_principal: bool = False
    www_authenticate: str = "Bearer"
    stored_statuses: Container[int] = DEFAULT_STORED_STATUSES
    replay_header: tuple[str, str] | None = ("Idempotent-Replayed", "true")
    unreplayed_headers: Collection[str] = frozenset({"set-cookie"})
    max_request_bytes: int = 1024 * 1024
    max_response_bytes: int = 1024 * 1024
    fail_open: bool = False
    unavailable_retry_after: Duration = timedelta(seconds=1)
    core: Policy = field(init=False, repr=False, compare=False)
    """The `oncely.Policy` the shared flows run with (derived from ttl and lease)."""
    header_name: bytes = field(init=False, repr=False, compare=False)
    """`header` lower-cased, as ASGI spells header names."""
    environ_key: str = field(init=False, repr=False, compare=False)
    """`header` as a WSGI environ key (``HTTP_IDEMPOTENCY_KEY``)."""
    dropped_headers: frozenset[bytes] = field(init=False, repr=False, compare=False)
    """The response header names never stored, lower-case bytes: hop-by-hop and unreplayed."""

    def __post_init__(self) -> None:
        methods = frozenset(_strings(self.methods, "methods", upper=True))
        safe = methods & SAFE_METHODS
        if safe:
            raise ConfigurationError(
                f"safe methods are idempotent already and cannot be covered: {sorted(safe)}"
            )
        if not isinstance(self.header, str) or not is_token(self.header):
            raise ConfigurationError(f"header must be an HTTP header name, not {self.header!r}")
        for name in ("require_key", "enabled", "fail_open", "require_principal"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigurationError(f"{name} must be True or False")
        ttl = to_timedelta(self.ttl, "ttl")
        lease = to_timedelta(self.lease, "lease")
        retry_after = to_timedelta(self.unavailable_retry_after, "unavailable_retry_after")
        for name in ("scope", "fingerprint"):
            if not callable(getattr(self, name)):
                raise ConfigurationError(f"{name} must be a callable over an HttpRequest")
        if self.principal is not None and not callable(self.principal):
            raise ConfigurationError("principal must be a callable over an HttpRequest, or None")
        session_cookies = frozenset(_strings(self.session_cookies, "session_cookies"))
        if self.require_principal and self.principal is None and not session_cookies:
            raise ConfigurationError(
                "require_principal needs a stable principal source: principal= (the app's own "
                "verifier, or lambda request: request.principal for the framework's user) or "
                "session_cookies="
            )
        challenge = self.www_authenticate
        if (
            not isinstance(challenge, str)
            or not challenge.strip()
            or not _is_header_value(challenge)
        ):
            raise ConfigurationError(
                f"www_authenticate must be a header value, not {self.www_authenticate!r}"
            )
        if not isinstance(self.stored_statuses, Container) or isinstance(self.stored_statuses, str):
            raise ConfigurationError("stored_statuses must be a container of status codes")
        if self.replay_header is not None and (
            not isinstance(self.replay_header, tuple)
            or len(self.replay_header) != 2
            or not is_token(self.replay_header[0])
            or not _is_header_value(self.replay_header[1])
        ):
            raise ConfigurationError(
                f"replay_header must be a (name, value) pair or None, not {self.replay_header!r}"
            )
        unreplayed = frozenset(_strings(self.unreplayed_headers, "unreplayed_headers"))
        for name in ("max_request_bytes", "max_response_bytes"):
            size = getattr(self, name)
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise ConfigurationError(f"{name} must be an int >= 0, not {size!r}")
        try:
            core = Policy(ttl=ttl, lease=lease, on_conflict="raise", heartbeat=True)
        except ConfigurationError as exc:
            raise ConfigurationError(f"HttpPolicy: {exc}") from exc
        setattr_ = object.__setattr__
        setattr_(self, "methods", methods)
        setattr_(self, "ttl", ttl)
        setattr_(self, "lease", lease)
        setattr_(self, "unavailable_retry_after", retry_after)
        setattr_(self, "unreplayed_headers", frozenset(name.lower() for name in unreplayed))
        setattr_(self, "session_cookies", session_cookies)
        setattr_(self, "core", core)
        setattr_(self, "header_name", self.header.lower().encode("ascii"))
        setattr_(self, "environ_key", "HTTP_" + self.header.upper().replace("-", "_"))
        setattr_(
            self,
            "dropped_headers",
            frozenset(name.encode("ascii") for name in (*HOP_BY_HOP, *self.unreplayed_headers)),
        )

    def covers(self, method: str) -> bool:
        """Whether requests with *method* are protected under this policy."""
        return self.enabled and method in self.methods

    def stores(self, status: int) -> bool:
        """Whether a response with *status* is stored and replayed."""
        return status in self.stored_statuses

    def with_options(self, options: RouteOptions) -> HttpPolicy:
        """Return this policy with the fields *options* sets replaced (validated again).

        Raises:
            ConfigurationError: The combination is invalid (for example a ttl below the lease).
        """
        given = {
            f.name: getattr(options, f.name)
            for f in dataclasses.fields(options)
            if getattr(options, f.name) is not UNSET
        }
        if not given:
            return self
        init = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        return HttpPolicy(**{**init, **given})


@dataclass(frozen=True, slots=True, kw_only=True)
class RouteOptions:
    """Settings of one route that differ from the app's `HttpPolicy`; unset fields inherit.

    Give them to the middleware by path pattern (``routes={"POST /payments": RouteOptions(...)}``)
    or on the view itself with `idempotent_route`. The fields mean what they mean in
    `HttpPolicy`.

    .. versionadded:: 0.1.0
    """

    methods: Collection[str] | _Unset = UNSET
    require_key: bool | _Unset = UNSET
    enabled: bool | _Unset = UNSET
    ttl: Duration | _Unset = UNSET
    lease: Duration | _Unset = UNSET
    scope: ScopeFunc | _Unset = UNSET
    fingerprint: FingerprintFunc | _Unset = UNSET
    principal: PrincipalFunc | _Unset | None = UNSET
    session_cookies: Collection[str] | _Unset = UNSET
    require_principal: bool | _Unset = UNSET
    stored_statuses: Container[int] | _Unset = UNSET
    replay_header: tuple[str, str] | _Unset | None = UNSET
    unreplayed_headers: Collection[str] | _Unset = UNSET
    max_request_bytes: int | _Unset = UNSET
    max_response_bytes: int | _Unset = UNSET
    fail_open: bool | _Unset = UNSET
    unavailable_retry_after: Duration | _Unset = UNSET

    def __post_init__(self) -> None:
        # Validate now, not on the first request. `require_principal` alone is checked against
        # the app's policy, whose principal source it may rely on, when the two are combined.
        base = _WITH_A_SOURCE if self.require_principal is True else _DEFAULTS
        base.with_options(self)

    def __bool__(self) -> bool:
        return any(getattr(self, f.name) is not UNSET for f in dataclasses.fields(self))


def _nobody(request: HttpRequest) -> None:
    return None


def _strings(values: Any, name: str, *, upper: bool = False) -> list[str]:
    if isinstance(values, str) or not isinstance(values, Collection):
        raise ConfigurationError(f"{name} must be a collection of strings, not {values!r}")
    out = []
    for value in values:
        if not isinstance(value, str) or not is_token(value):
            raise ConfigurationError(f"{name} must hold HTTP tokens, not {value!r}")
        out.append(value.upper() if upper else value)
    return out


def _is_header_value(value: object) -> bool:
    return isinstance(value, str) and all(" " <= char <= "~" for char in value)


_DEFAULTS: Final = HttpPolicy()
_WITH_A_SOURCE: Final = HttpPolicy(principal=_nobody, session_cookies=("session",))
"""What `RouteOptions` are validated against (see its ``__post_init__``)."""
