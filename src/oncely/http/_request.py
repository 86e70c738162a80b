"""What a covered request is, as the scope and fingerprint callables see it, and their defaults.

Apart from `oncely.http._semantics` so that the policy (`oncely.http._policy`), which names the
defaults, and the semantics, which read the policy, do not import each other.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import parse_qsl

from oncely._core.fingerprint import canonical_body

__all__ = [
    "HOP_BY_HOP",
    "PLAIN_JSON",
    "SAFE_METHODS",
    "Header",
    "HttpRequest",
    "default_fingerprint",
    "default_scope",
    "digest_of_body",
    "is_token",
    "media_type",
    "query_pairs",
]


Header = tuple[bytes, bytes]
"""One header as it travels: (name, value) in bytes, names as the app wrote them."""


SAFE_METHODS: Final = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
"""Methods that are idempotent by definition and never covered."""


HOP_BY_HOP: Final = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
"""Headers that describe one connection (RFC 9110 section 7.6.1): never stored or replayed."""


_TCHAR: Final = frozenset(
    "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
)


def is_token(value: str) -> bool:
    """Whether *value* is an HTTP token (a valid header name or method)."""
    return bool(value) and all(char in _TCHAR for char in value)


@dataclass(frozen=True, slots=True)
class HttpRequest:
    """A covered request as the scope and fingerprint callables see it.

    Attributes:
        method: The request method, upper-case.
        path: The request path (percent-decoded, as the server gives it).
        route: The route template when the framework's routing is known (``/payments/{id}``),
            else the matched route pattern, else the path.
        query_string: The raw query string, without ``?``.
        headers: The request headers as (lower-case name, value) byte pairs.
        body: The whole request body.
        principal: The authenticated user as the framework knows it (`user_principal` of
            Starlette's ``scope["user"]``, Django's ``request.user``, WSGI's ``REMOTE_USER``),
            or ``None``.

    .. versionadded:: 0.1.0
    """

    method: str
    path: str
    route: str
    query_string: bytes
    headers: tuple[Header, ...]
    body: bytes
    principal: str | None = None

    def header(self, name: str) -> str | None:
        """Return the first value of header *name* (any case) as text, or ``None``."""
        wanted = name.lower().encode("latin-1")
        for key, value in self.headers:
            if key == wanted:
                return value.decode("latin-1")
        return None

    @property
    def content_type(self) -> str:
        """The media type of the body, lower-case and without parameters (``""`` if none)."""
        return media_type(self.header("content-type") or "")


def media_type(content_type: str) -> str:
    return content_type.partition(";")[0].strip().lower()


def default_scope(request: HttpRequest) -> str:
    """The default scope of a key: method + route.

    Who is asking is not part of the scope: it is the record's owner, kept with the record
    and checked on every repeat, so a client whose token is refreshed or whose
    cookies change between two attempts still finds its record. A scope callable that adds a
    tenant gives each tenant a key space of its own (the tenant must not change between a
    client's attempts).

    .. versionadded:: 0.1.0
    """
    return f"{request.method} {request.route}"


def default_fingerprint(request: HttpRequest) -> list[Any]:
    """The default fingerprint: method + path + sorted query + body.

    JSON bodies (``application/json`` or ``+json``) are canonicalised, so key order, spacing
    and number spelling do not change the fingerprint. A body that is labelled JSON but is not
    (or is not UTF-8, nests deeper than 200 levels, or holds NaN) is fingerprinted as raw
    bytes: it never raises. Numbers are compared exactly, every digit, and the work is linear in
    the size of the body (`HttpPolicy.max_request_bytes` bounds that).

    .. versionadded:: 0.1.0
    """
    body = digest_of_body(request.body, request.content_type)
    return [request.method, request.path, query_pairs(request.query_string), body]


def query_pairs(query_string: bytes) -> list[list[str]]:
    if not query_string:
        return []
    pairs = parse_qsl(query_string.decode("latin-1"), keep_blank_values=True)
    return [list(pair) for pair in sorted(pairs)]


PLAIN_JSON: Final = json.JSONEncoder(ensure_ascii=True, separators=(",", ":"))
"""Compact ASCII JSON, as ``json.dumps(value, ensure_ascii=True, separators=(",", ":"))``."""


def digest_of_body(body: bytes, media: str) -> str:
    """The digest of a request *body* whose media type (`HttpRequest.content_type`) is *media*."""
    if body and (media == "application/json" or media.endswith("+json")):
        text = canonical_body(body)
        if text is not None:  # else labelled JSON but it is not: the raw bytes define it
            return "json:" + hashlib.sha256(text.encode("ascii")).hexdigest()
    return "raw:" + hashlib.sha256(body).hexdigest()
