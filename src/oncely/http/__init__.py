"""HTTP integrations: server middleware (ASGI, WSGI) and a retrying httpx client transport.

The middleware implements the HTTP contract (docs/guides/http.md): unsafe requests carrying
an ``Idempotency-Key`` take effect once, repeats get the stored response byte for byte (with
``Idempotent-Replayed: true``), concurrent repeats get 409, a reused key with another request
gets 422, and a store outage answers 503 instead of running unprotected.

* `oncely.http.asgi.IdempotencyMiddleware`: FastAPI, Starlette, Litestar, any ASGI app.
* `oncely.http.wsgi.IdempotencyMiddleware`: Flask, Django, any WSGI app.
* `oncely.http.django.IdempotencyMiddleware`: Django's ``settings.MIDDLEWARE`` (``request.user``
  is the principal).
* `oncely.http.client.IdempotentTransport` and ``AsyncIdempotentTransport``: httpx transports
  that give each logical request one key and retry it safely (needs ``oncely[httpx]``).

This package holds what both middlewares share: `HttpPolicy`, per-route `RouteOptions`, the
`idempotent_route` view decorator, and the default scope and fingerprint.
A record remembers its owner (who sent it): another principal's request with the same key is
refused (422), never run or replayed. Importing it (or
``oncely.http.asgi`` / ``oncely.http.wsgi``) imports no web framework.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

from oncely.http._policy import (
    DEFAULT_METHODS,
    FingerprintFunc,
    HttpPolicy,
    PrincipalFunc,
    RouteOptions,
    ScopeFunc,
)
from oncely.http._routes import RouteMatch, RouteResolver, idempotent_route
from oncely.http._semantics import HttpRequest, default_fingerprint, default_scope

__all__ = [
    "default_fingerprint",
    "DEFAULT_METHODS",
    "default_scope",
    "FingerprintFunc",
    "HttpPolicy",
    "HttpRequest",
    "idempotent_route",
    "PrincipalFunc",
    "RouteMatch",
    "RouteOptions",
    "RouteResolver",
    "ScopeFunc",
]
