"""Django middleware for ``settings.MIDDLEWARE``: the HTTP rules at Django's request level.

It runs inside Django, after its authentication, so ``request.user`` is the principal of the
default scope. It translates Django's request and response to the shared semantics and flows
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
Streaming responses are read whole before they leave (the response is stored whole anyway).
Sync only: under Django's ASGI handler, Django runs it in a thread.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

import oncely
from oncely import _execution
from oncely._core.protocols import SyncStore
from oncely.errors import ConfigurationError
from oncely.http import _flow, _semantics
from oncely.http._policy import HttpPolicy, RouteOptions
from oncely.http._routes import RouteTable, resolve_django
from oncely.http._semantics import Header, HttpRequest, Response, ResponseCapture

__all__ = ["IdempotencyMiddleware"]


class IdempotencyMiddleware:
    """Makes covered Django requests that carry an ``Idempotency-Key`` take effect once.

    Args:
        get_response: The next layer (Django passes it).
        store: Any `oncely.SyncStore`; default ``settings.ONCELY_STORE``, else a store opened
            from ``settings.ONCELY_STORE_URL``.
        policy: The app-wide `HttpPolicy`; default ``settings.ONCELY_HTTP`` (an `HttpPolicy`
            or a dict of its options), else the defaults.
        routes: `RouteOptions` by path pattern; default ``settings.ONCELY_HTTP_ROUTES``.

    Raises:
        ConfigurationError: No store is configured, or an option is invalid.

    .. versionadded:: 0.1.0
    """

    sync_capable = True
    async_capable = False

    def __init__(
        self,
        get_response: Callable[[Any], Any],
        *,
        store: SyncStore | None = None,
        policy: HttpPolicy | None = None,
        routes: Mapping[str, RouteOptions] | None = None,
    ) -> None:
        settings = importlib.import_module("django.conf").settings
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
        if not isinstance(store, SyncStore):
            raise ConfigurationError(
                f"{type(store).__name__} has no sync verbs: the Django middleware needs an "
                "oncely.SyncStore (any built-in store)"
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
        """Handle one Django request (safe methods pass straight through)."""
        method = str(request.method or "GET").upper()
        if method in _semantics.SAFE_METHODS:
            return self.get_response(request)
        path = str(request.path)
        policy, route = self.routes.select(method, path, resolve_django(request.path_info))
        if not policy.covers(method):
            return self.get_response(request)
        meta = request.META
        raw = meta.get(policy.environ_key)
        decision = _semantics.decide(method, [] if raw is None else [_latin1(raw)], policy)
        if decision is None:
            return self.get_response(request)
        if isinstance(decision, Response):
            return _to_django(decision)
        limit = policy.max_request_bytes
        length = str(meta.get("CONTENT_LENGTH") or "").strip()
        if length.isascii() and length.isdigit() and int(length) > limit:
            return _to_django(_semantics.request_too_large(policy))
        body = bytes(request.body)  # cached by Django: the view reads it again
        if len(body) > limit:
            return _to_django(_semantics.request_too_large(policy))
        http_request = HttpRequest(
            method,
            path,
            route,
            _latin1(meta.get("QUERY_STRING", "")),
            _request_headers(meta),
            body,
            _semantics.user_principal(getattr(request, "user", None)),
        )
        plan = _semantics.plan(http_request, decision, policy)
        outcome = _execution.run(_flow.begin(plan, policy, method=method, path=path), self.store)
        if outcome is _flow.PASS_THROUGH:
            return self.get_response(request)
        if isinstance(outcome, Response):
            return _to_django(outcome)
        return self._run(outcome, policy, request)

    def _run(self, lease: _execution.Lease, policy: HttpPolicy, request: Any) -> Any:
        capture = ResponseCapture(policy.max_response_bytes)
        started = False

        def call() -> Any:
            nonlocal started
            response = self.get_response(request)
            capture.start(
                int(response.status_code),
                _response_headers(response),
                policy,
                str(response.reason_phrase or "").encode("latin-1", "replace"),
            )
            started = True
            if response.streaming:
                chunks = [bytes(chunk) for chunk in response.streaming_content]
                response.streaming_content = chunks
            else:
                chunks = [bytes(response.content)]
            for chunk in chunks:
                capture.add(chunk)
            return response

        try:
            response = _execution.run(_flow.invoke(lease), self.store, call)
        except BaseException as exc:
            if started:  # the view answered; reading its streamed body failed
                cause = f"{type(exc).__name__} from the view's streamed response"
                _execution.run(_flow.cut(lease, capture, cause, policy), self.store)
            else:
                _execution.run(_flow.abort(lease, exc, policy), self.store)
            raise
        capture.complete = True
        _execution.run(_flow.finish(lease, capture, policy), self.store)
        return response


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
