"""The HTTP contract (docs/guides/http.md) as pure functions: no I/O, no framework imports.

Everything the ASGI and WSGI middleware decide comes from here: which requests are covered,
reading the ``Idempotency-Key`` header (quoted or bare), the key's scope and the request's
fingerprint, the problem+json answers (400, 409, 413, 422, 503, 500), which responses are stored,
which headers are replayed, and the stored response snapshot: a versioned binary format, never
pickle (`oncely.http._snapshot`, exported here). The adapters only move bytes between the
server, this module, the store and the app.

======================================================  ==========================================
situation                                               answer (function here)
======================================================  ==========================================
method not covered                                      pass through (`decide` returns ``None``)
covered, no key, key optional                           pass through (`decide` returns ``None``)
covered, no key, key required                           400 (`key_missing`)
key empty, too long, not a valid header string          400 (`key_invalid`), nothing stored
body over `HttpPolicy.max_request_bytes`                413 (`request_too_large`), nothing stored
first request                                           executed; stored if `HttpPolicy.stores`
repeat of a completed request                           stored response + marker (`replayed`)
repeat while the first runs                             409 + Retry-After: 1 (`in_progress`)
same key, other fingerprint                             422 (`mismatch`)
same key, used by another principal                     422 (`owned_elsewhere`)
no principal where `HttpPolicy.require_principal`       401 (`principal_required`)
store unreachable                                       503 + Retry-After (`unavailable`)
handler answered 5xx or raised                          not stored; the lease is released
response over the size limit                            passed through; repeats 500
                                                        (`not_replayable`)
response cut short after the app started it            never released; repeats 500
                                                        (`not_replayable`)
======================================================  ==========================================
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
from collections.abc import Collection, Iterable, Sequence
from datetime import timedelta
from json.encoder import encode_basestring_ascii as _ascii_string
from typing import TYPE_CHECKING, Any, Final, NamedTuple

from oncely import _events, _observed
from oncely._core.fingerprint import digest
from oncely._core.keys import MAX_KEY_LENGTH, scope_key
from oncely.errors import InvalidKeyError
from oncely.http._request import (
    HOP_BY_HOP,
    PLAIN_JSON,
    SAFE_METHODS,
    Header,
    HttpRequest,
    default_fingerprint,
    default_scope,
    digest_of_body,
    is_token,
    media_type,
    query_pairs,
)
from oncely.http._snapshot import (
    Response,
    ResponseCapture,
    _phrase,
    decode_snapshot,
    encode_snapshot,
    replayed,
    storable_headers,
)
from oncely.keys import from_header

if TYPE_CHECKING:
    from oncely.http._policy import HttpPolicy

__all__ = [
    "HOP_BY_HOP",
    "IN_PROGRESS_RETRY_AFTER",
    "SAFE_METHODS",
    "Header",
    "HttpRequest",
    "Plan",
    "Response",
    "ResponseCapture",
    "corrupt",
    "decide",
    "decide_key",
    "scan_headers",
    "agiven",
    "decode_snapshot",
    "default_fingerprint",
    "default_scope",
    "encode_snapshot",
    "given",
    "in_progress",
    "is_token",
    "key_invalid",
    "key_missing",
    "mismatch",
    "not_replayable",
    "owned_elsewhere",
    "owner_of",
    "plan",
    "plan_parts",
    "principal_required",
    "problem",
    "read_key",
    "replayed",
    "request_too_large",
    "reusing",
    "retry_after_value",
    "storable_headers",
    "unavailable",
    "user_principal",
]


# -- requests -----------------------------------------------------------------------------------


ReadHeaders = tuple[bytes | None, bytes | None, list[bytes]]
"""`_read_headers`' answer: the first ``Authorization`` and ``Content-Type`` values and every
``Cookie`` value."""

ScannedHeaders = tuple[list[bytes], bytes | None, ReadHeaders]
"""`scan_headers`' answer: the key header's values, the first ``Content-Length``, and
`_read_headers`' answer."""


def scan_headers(headers: Iterable[Header], key_name: bytes) -> ScannedHeaders:
    """Every value of the header *key_name* (a lowercase name, matched in any case), the first
    ``Content-Length``, and what `_read_headers` reads, in one pass over *headers* (the ASGI
    middleware's: the one place both are read)."""
    keys: list[bytes] = []
    length = authorization = content_type = None
    cookies: list[bytes] = []
    for name, value in headers:
        lowered = name.lower()
        if lowered == key_name:
            keys.append(value)
        if lowered == b"content-length":
            if length is None:
                length = value
        elif name == b"authorization":
            if authorization is None:
                authorization = value
        elif name == b"content-type":
            if content_type is None:
                content_type = value
        elif lowered == b"cookie":
            cookies.append(value)
    return keys, length, (authorization, content_type, cookies)


def _read_headers(headers: Iterable[Header]) -> ReadHeaders:
    """The first ``Authorization`` and ``Content-Type`` values and every ``Cookie`` value of
    *headers*, in one pass (names as `HttpRequest.header` compares them)."""
    return scan_headers(headers, b"")[2]


ANONYMOUS: Final = "-"
"""The owner of a record made by a request without any principal."""


def owner_of(
    user: str | None,
    given: str | None,
    authorization: bytes | None,
    cookies: list[bytes],
    policy: HttpPolicy,
) -> str | None:
    """The owner a request's record gets: a tagged digest of its principal, `ANONYMOUS`, or
    ``None`` when `HttpPolicy.require_principal` is set and no stable source names one.

    Sources, the first found wins: the framework's authenticated *user*
    (`HttpRequest.principal`); *given*, what `HttpPolicy.principal` returned; the cookies
    named in `HttpPolicy.session_cookies`. Only when none of these is configured does the raw
    credential name the owner: the ``Authorization`` header, else every cookie. Each kind is
    tagged, so no header can forge another kind's digest.
    """
    if user is not None:
        return "u:" + _digest(user.encode("utf-8", "surrogatepass"))
    if given is not None:
        return "p:" + _digest(given.encode("utf-8", "surrogatepass"))
    names = policy.session_cookies
    if names:
        session = _session(cookies, names)
        if session is not None:
            return "s:" + _digest(session)
    if policy.require_principal:
        return None
    if names or policy.principal is not None:  # a stable source is configured: it found nobody
        return ANONYMOUS
    if authorization is not None:
        return "a:" + _digest(authorization)
    if cookies:
        return "c:" + _digest(b"; ".join(cookies))  # HTTP/2 sends each cookie on its own
    return ANONYMOUS


def _session(cookies: list[bytes], names: Collection[str]) -> bytes | None:
    """The configured session cookies among *cookies*, as ``name=value`` pairs in name order,
    or ``None`` if there is none."""
    found = []
    for header in cookies:
        for pair in header.decode("latin-1").split(";"):
            name, sep, value = pair.strip().partition("=")
            if sep and name in names and value:
                found.append(f"{name}={value}")
    if not found:
        return None
    return "; ".join(sorted(found)).encode("latin-1")


def given(policy: HttpPolicy, request: HttpRequest) -> str | None:
    """What `HttpPolicy.principal` returns for *request* (sync callers); ``None`` without
    asking it when the framework names the user (`owner_of` takes that first).

    Raises:
        TypeError: It returned something else than a string or ``None`` (an awaitable: an async
            callable needs an async adapter).
    """
    if policy.principal is None or request.principal is not None:
        return None
    return _principal_value(policy.principal(request))


async def agiven(policy: HttpPolicy, request: HttpRequest) -> str | None:
    """`given` for async callers: an async `HttpPolicy.principal` is awaited."""
    if policy.principal is None or request.principal is not None:
        return None
    value = policy.principal(request)
    if inspect.isawaitable(value):
        value = await value
    return _principal_value(value)


def _principal_value(value: object) -> str | None:
    if value is None or isinstance(value, str):
        return value or None
    hint = ""
    if inspect.isawaitable(value):
        hint = " (an async callable needs the ASGI middleware, or Django's in an async stack)"
        if inspect.iscoroutine(value):
            value.close()
    raise TypeError(f"the principal callable returned {type(value).__name__}, not str{hint}")


def _owned(owner: str, request_digest: str) -> str:
    """The stored fingerprint: the owner, a space, the request's digest (neither holds a
    space). The store compares fingerprints for equality only."""
    return f"{owner} {request_digest}"


def reusing(ours: str, stored: str) -> str:
    """What a key whose record has another fingerprint means for this request.

    Returns:
        ``"owned"``: another principal owns the record (refuse: `owned_elsewhere`);
        ``"reused"``: the same owner, or an anonymous one, used it for another request
        (`mismatch`); ``"adopt"``: an anonymous (or older, ownerless) record of this very
        request, which answers any caller: claim it again with *stored*.
    """
    our_owner, _, our_digest = ours.partition(" ")
    stored_owner, sep, stored_digest = stored.partition(" ")
    if not sep:  # written before records had owners: the digest alone
        stored_owner, stored_digest = ANONYMOUS, stored
    if stored_owner == ANONYMOUS:
        return "adopt" if stored_digest == our_digest else "reused"
    return "reused" if stored_owner == our_owner else "owned"


def _digest(material: bytes) -> str:
    return hashlib.sha256(material).hexdigest()[:32]


def user_principal(user: object) -> str | None:
    """The principal a framework's user object names, or ``None`` if it is not authenticated.

    Duck-typed: the user must say ``is_authenticated``; it is then named by the first of its
    ``identity`` (Starlette), ``pk`` (Django), ``id``, ``username`` or ``display_name`` that is
    set. A user that says it is authenticated but has none of them gives ``None``.

    .. versionadded:: 0.1.0
    """
    if user is None:
        return None
    try:
        if getattr(user, "is_authenticated", False) is not True:
            return None
    except Exception:  # a user object that cannot say is not trusted as one
        return None
    for name in ("identity", "pk", "id", "username", "display_name"):
        try:
            value = getattr(user, name, None)
        except Exception:  # Starlette's BaseUser.identity raises NotImplementedError
            continue
        if value is not None and value != "":
            return f"{name}={value}"
    return None


def read_key(values: Sequence[bytes]) -> str | None:
    """Return the key in the header *values* (quoted or bare), or ``None`` if absent.

    A key may not hold a comma, quoted or not: a WSGI server hands the middleware a repeated
    header as one value joined with commas, so a key with a comma cannot be told from two
    keys there. Refusing both everywhere makes every adapter answer the same.

    Raises:
        InvalidKeyError: The key is empty, over 255 characters, not printable ASCII, a
            malformed quoted string, holds a comma, or the header was sent more than once.
    """
    if not values:
        return None
    if len(values) > 1:
        raise InvalidKeyError("the idempotency key header was sent more than once")
    value = values[0]
    if isinstance(value, bytes) and value.isascii():
        # The usual key, answered without `from_header`'s character loop: bare, 1 to 255
        # printable ASCII characters (str.isprintable on ASCII is exactly " " to "~"), no
        # space or tab at either end, no comma. Anything else (quoted, padded, invalid) goes
        # the long way.
        key = value.decode("ascii")
        if (
            0 < len(key) <= MAX_KEY_LENGTH
            and key.isprintable()
            and key[0] not in ' "'
            and key[-1] != " "
            and "," not in key
        ):
            return key
    key = from_header(value)
    if "," in key:
        raise InvalidKeyError(
            "the idempotency key holds a comma (or the header was sent more than once)"
        )
    return key


def decide(method: str, key_values: Sequence[bytes], policy: HttpPolicy) -> str | Response | None:
    """Decide what to do with a request from its method and key header alone.

    Returns:
        ``None`` to pass the request through untouched, a `Response` to answer at once (400),
        or the key, to protect the request with it.
    """
    if not policy.covers(method):
        return None
    return decide_key(key_values, policy)


def decide_key(key_values: Sequence[bytes], policy: HttpPolicy) -> str | Response | None:
    """`decide` for a method *policy* is known to cover (the ASGI middleware has checked it)."""
    try:
        key = read_key(key_values)
    except InvalidKeyError as exc:
        return key_invalid(policy, str(exc))
    if key is None:
        return key_missing(policy) if policy.require_key else None
    return key


class Plan(NamedTuple):
    """What a protected request is claimed with: the scoped key and the fingerprint, which
    holds the record's owner and the request's digest (a tuple: made on every protected
    request, it costs less than a frozen dataclass)."""

    key: str
    fingerprint: str


def plan(
    request: HttpRequest, key: str, policy: HttpPolicy, given: str | None = None
) -> Plan | Response:
    """Scope *key* and fingerprint *request* as *policy* says; *given* is what
    `HttpPolicy.principal` returned for it (the caller runs it: it may be async).

    Returns:
        The plan, or the 401 answer (`principal_required`) when the policy requires a principal
        and no stable source names one.
    """
    authorization, _, cookies = _read_headers(request.headers)
    owner = owner_of(request.principal, given, authorization, cookies, policy)
    if owner is None:
        return principal_required(policy)
    if policy.scope is default_scope:
        scope = f"{request.method} {request.route}"
    else:
        scope = policy.scope(request)
        if not isinstance(scope, str):
            raise TypeError(f"the scope callable returned {type(scope).__name__}, not str")
    if policy.fingerprint is default_fingerprint:
        fingerprint = _default_digest(
            request.method,
            request.path,
            request.query_string,
            digest_of_body(request.body, request.content_type),
        )
    else:
        fingerprint = digest([policy.fingerprint(request)])
    return Plan(scope_key(scope, key), _owned(owner, fingerprint))


def plan_parts(
    method: str,
    path: str,
    route: str,
    query_string: bytes,
    headers: Sequence[Header],
    body: bytes,
    principal: str | None,
    key: str,
    policy: HttpPolicy,
    given: str | None = None,
    read: ReadHeaders | None = None,
) -> Plan | Response:
    """`plan` of the `HttpRequest` these parts make, which only a custom scope or fingerprint
    callable needs to see built (the ASGI middleware's path: one object less per request).

    *read* is ``_read_headers(headers)`` when the caller has already read them (the ASGI
    middleware reads them in its own pass over the headers)."""
    if policy.scope is default_scope and policy.fingerprint is default_fingerprint:
        authorization, content_type, cookies = read or _read_headers(headers)
        return _default_plan(
            method,
            path,
            route,
            query_string,
            authorization,
            content_type,
            cookies,
            body,
            principal,
            key,
            policy,
            given,
        )
    request = HttpRequest(method, path, route, query_string, tuple(headers), body, principal)
    return plan(request, key, policy, given)


def _default_plan(
    method: str,
    path: str,
    route: str,
    query_string: bytes,
    authorization: bytes | None,
    content_type: bytes | None,
    cookies: list[bytes],
    body: bytes,
    principal: str | None,
    key: str,
    policy: HttpPolicy,
    given: str | None,
) -> Plan | Response:
    # The usual policy, on the headers `_read_headers` read.
    owner = owner_of(principal, given, authorization, cookies, policy)
    if owner is None:
        return principal_required(policy)
    media = "" if content_type is None else media_type(content_type.decode("latin-1"))
    return Plan(
        scope_key(f"{method} {route}", key),
        _owned(owner, _default_digest(method, path, query_string, digest_of_body(body, media))),
    )


def _default_digest(method: str, path: str, query_string: bytes, body_digest: str) -> str:
    # The digest of `default_fingerprint`'s parts, spelt as
    # ``json.dumps(parts, ensure_ascii=True, separators=(",", ":"))`` without building the
    # list: this runs on every protected request. The body digest is hex behind an ASCII tag,
    # so it needs no escaping.
    query = PLAIN_JSON.encode(query_pairs(query_string)) if query_string else "[]"
    text = f'[{_ascii_string(method)},{_ascii_string(path)},{query},"{body_digest}"]'
    return "h1:" + hashlib.sha256(text.encode("ascii")).hexdigest()


# -- responses ----------------------------------------------------------------------------------


def retry_after_value(delay: timedelta) -> bytes:
    """A ``Retry-After`` value: whole seconds, rounded up, at least 1."""
    return str(max(1, math.ceil(delay.total_seconds()))).encode("ascii")


def problem(
    status: int,
    code: str,
    detail: str,
    *,
    headers: Iterable[Header] = (),
    **members: Any,
) -> Response:
    """Build an ``application/problem+json`` response (RFC 9457).

    The type is ``about:blank`` with the status's phrase as title; *code* is a stable
    extension member that names the situation (``idempotency-key-in-use``...).
    """
    document = {
        "type": "about:blank",
        "title": _phrase(status),
        "status": status,
        "detail": detail,
        "code": code,
        **members,
    }
    body = json.dumps(document, separators=(",", ":")).encode()
    return Response(
        status,
        (
            (b"content-type", b"application/problem+json"),
            (b"content-length", str(len(body)).encode("ascii")),
            *headers,
        ),
        body,
    )


def key_missing(policy: HttpPolicy) -> Response:
    """400: the route requires a key and the request has none."""
    if _events.on:
        _observed.refused()
    return problem(
        400,
        "idempotency-key-missing",
        f"This endpoint requires an {policy.header} header.",
        header=policy.header,
    )


def key_invalid(policy: HttpPolicy, reason: str) -> Response:
    """400: the key is malformed; nothing was stored."""
    if _events.on:
        _observed.refused()
    return problem(
        400,
        "idempotency-key-invalid",
        f"The {policy.header} header is invalid: {reason}.",
        header=policy.header,
    )


def request_too_large(policy: HttpPolicy) -> Response:
    """413: the body is larger than `HttpPolicy.max_request_bytes`; nothing was run or stored."""
    if _events.on:
        _observed.refused()
    limit = policy.max_request_bytes
    return problem(
        413,
        "request-too-large",
        f"A request with an {policy.header} header may have a body of at most {limit} bytes.",
        max_request_bytes=limit,
    )


def request_incomplete(declared: int, received: int) -> Response:
    """400: the body ended before its ``Content-Length`` (the client half-closed or left);
    nothing was run or stored, so the full request may be sent again with the same key."""
    return problem(
        400,
        "request-incomplete",
        f"The body ended after {received} of the {declared} bytes its Content-Length "
        "announced; nothing was run or stored.",
    )


IN_PROGRESS_RETRY_AFTER: Final = timedelta(seconds=1)
"""The ``Retry-After`` of a 409: a hint to poll again soon. Never the lease's remaining time,
which is up to a whole lease (30 s by default) and would make clients give up or wait long after
the first request finished."""


def in_progress() -> Response:
    """409 with a short ``Retry-After``: a request with this key is still being processed."""
    value = retry_after_value(IN_PROGRESS_RETRY_AFTER)
    return problem(
        409,
        "idempotency-key-in-use",
        "A request with this idempotency key is still being processed; retry after "
        f"{value.decode()} s.",
        headers=[(b"retry-after", value)],
    )


def mismatch(policy: HttpPolicy) -> Response:
    """422: the key was already used for a request with another method, path, query or body."""
    return problem(
        422,
        "idempotency-key-reused",
        f"This {policy.header} was already used for a different request; use a new key for a "
        "new operation.",
    )


def owned_elsewhere(policy: HttpPolicy) -> Response:
    """422: another principal used this key on this route; nothing runs, nothing is replayed.

    422, as for a key reused with another request: the request cannot be processed with this
    key, and retrying it unchanged never helps (not 403, which would tell a client its
    credentials lack a right, and not 409, which says retry). The answer says nothing of the
    other principal's request.
    """
    return problem(
        422,
        "idempotency-key-owned-by-another-principal",
        f"This {policy.header} was already used by another principal; use a new key.",
    )


def principal_required(policy: HttpPolicy) -> Response:
    """401: the route requires a principal (`HttpPolicy.require_principal`) and none of the
    configured sources names one; nothing runs. It carries the policy's challenge in
    ``WWW-Authenticate``, as every 401 must."""
    return problem(
        401,
        "principal-required",
        f"A request with an {policy.header} header must be authenticated on this endpoint.",
        headers=[(b"www-authenticate", policy.www_authenticate.encode("latin-1"))],
    )


def unavailable(policy: HttpPolicy) -> Response:
    """503 with ``Retry-After``: the store cannot be reached, so the request was not run."""
    delay = policy.unavailable_retry_after
    if not isinstance(delay, timedelta):
        delay = timedelta(seconds=delay)
    return problem(
        503,
        "idempotency-store-unavailable",
        "The request was not processed because its idempotency record cannot be checked; "
        "retry later with the same key.",
        headers=[(b"retry-after", retry_after_value(delay))],
    )


def not_replayable(reason: str) -> Response:
    """500: the operation ran, but its response was not stored; it is never run again."""
    return problem(
        500,
        "response-not-stored",
        f"The request with this idempotency key was processed, but its response cannot be "
        f"replayed ({reason}). It will not be processed again.",
    )


def corrupt() -> Response:
    """500: the stored record cannot be decoded; fail closed, never run again."""
    return problem(
        500,
        "idempotency-record-corrupt",
        "The stored outcome of this idempotency key cannot be read. The request was not "
        "processed again.",
    )
