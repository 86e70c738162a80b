"""Per-route settings: path patterns, the `idempotent_route` decorator, and route resolution.

The middleware runs before the framework routes a request, so to honour a decorated view it
asks the framework which view the request will reach. That is done by duck typing, never by
importing a framework: Starlette and FastAPI (``scope["app"].router.routes``), Litestar
(``scope["route_handler"]``, set before its middleware runs), Flask (the app's ``url_map``) and
Django, under WSGI and ASGI alike (``django.urls.resolve``, imported only when the wrapped app
is Django's). Any other
framework can pass a ``resolver`` callable.
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias, TypeVar
from urllib.parse import quote

from oncely._core.policy import UNSET, Duration, _Unset
from oncely.errors import ConfigurationError
from oncely.http._policy import FingerprintFunc, HttpPolicy, RouteOptions, ScopeFunc

__all__ = [
    "ROUTE_ATTRIBUTE",
    "RouteMatch",
    "RouteResolver",
    "RouteTable",
    "idempotent_route",
    "is_django",
]

F = TypeVar("F", bound=Callable[..., Any])

ROUTE_ATTRIBUTE = "__oncely_route__"
"""The attribute `idempotent_route` sets on a view: its `RouteOptions`."""


@dataclass(frozen=True, slots=True)
class RouteMatch:
    """Which route of the app a request reaches.

    Attributes:
        template: The route's path template (``/payments/{payment_id}``), or ``None``.
        endpoint: The view that will handle it (read for `idempotent_route` options), or ``None``.
        options: Options the framework holds for the route itself (Litestar's ``opt``).

    .. versionadded:: 0.1.0
    """

    template: str | None
    endpoint: Any = None
    options: RouteOptions | None = None


RouteResolver: TypeAlias = Callable[[Mapping[str, Any]], "RouteMatch | None"]
"""Given the ASGI scope or WSGI environ, the route the request will reach (or ``None``)."""


def idempotent_route(
    *,
    methods: Any = UNSET,
    require_key: bool | _Unset = UNSET,
    enabled: bool | _Unset = UNSET,
    ttl: Duration | _Unset = UNSET,
    lease: Duration | _Unset = UNSET,
    scope: ScopeFunc | _Unset = UNSET,
    fingerprint: FingerprintFunc | _Unset = UNSET,
    stored_statuses: Any = UNSET,
    replay_header: tuple[str, str] | _Unset | None = UNSET,
    unreplayed_headers: Any = UNSET,
    max_request_bytes: int | _Unset = UNSET,
    max_response_bytes: int | _Unset = UNSET,
    fail_open: bool | _Unset = UNSET,
    unavailable_retry_after: Duration | _Unset = UNSET,
) -> Callable[[F], F]:
    """Give one view its own idempotency settings (the fields of `HttpPolicy`).

    The view is returned unchanged, with its `RouteOptions` attached; the ASGI or WSGI
    `IdempotencyMiddleware` finds them when a request is routed to the view. Works with
    FastAPI and Starlette endpoints, Flask views, Django function views (and ``as_view()``
    class views) and Litestar handlers, sync or async, in either decorator order.

    .. code-block:: python

        @app.post("/transfers")
        @idempotent_route(require_key=True, ttl=timedelta(days=7))
        async def create_transfer(...): ...

    Args:
        methods: The methods covered on this route.
        require_key: Answer 400 to a covered request without a key.
        enabled: ``False`` exempts the route.
        ttl: How long a response is replayed.
        lease: How long a request may run between heartbeats.
        scope: The scope callable for this route's keys.
        fingerprint: The fingerprint callable for this route's requests.
        stored_statuses: The statuses stored and replayed.
        replay_header: The header added to replays, or ``None``.
        unreplayed_headers: Response headers never stored or replayed.
        max_request_bytes: The largest request body accepted (413 above it).
        max_response_bytes: The largest response stored.
        fail_open: Serve unprotected (and log it) while the store is unreachable.
        unavailable_retry_after: The ``Retry-After`` of the 503.

    Returns:
        A decorator that attaches the options and returns the view itself.

    Raises:
        ConfigurationError: The options are invalid (checked here, at import time).

    .. versionadded:: 0.1.0
    """
    options = RouteOptions(
        methods=methods,
        require_key=require_key,
        enabled=enabled,
        ttl=ttl,
        lease=lease,
        scope=scope,
        fingerprint=fingerprint,
        stored_statuses=stored_statuses,
        replay_header=replay_header,
        unreplayed_headers=unreplayed_headers,
        max_request_bytes=max_request_bytes,
        max_response_bytes=max_response_bytes,
        fail_open=fail_open,
        unavailable_retry_after=unavailable_retry_after,
    )

    def attach(view: F) -> F:
        target = getattr(view, "__func__", view)  # a classmethod or staticmethod object
        try:
            setattr(target, ROUTE_ATTRIBUTE, options)
        except (AttributeError, TypeError) as exc:
            raise ConfigurationError(f"cannot attach idempotency options to {view!r}") from exc
        return view

    return attach


def _endpoint_options(endpoint: Any) -> RouteOptions | None:
    for candidate in (endpoint, getattr(endpoint, "view_class", None)):  # Django's as_view()
        options = getattr(candidate, ROUTE_ATTRIBUTE, None)
        if isinstance(options, RouteOptions):
            return options
    return None


_PATH_SAFE = "/:@!$&'()*+,;="
"""Characters a path segment may hold unencoded (RFC 3986 pchar, besides unreserved ones)."""


@functools.lru_cache(maxsize=1024)
def _quoted(path: str) -> str:
    """*path* percent-encoded as a client would send it (the same few paths come again and
    again: cached)."""
    return quote(path, safe=_PATH_SAFE)


# -- path patterns --------------------------------------------------------------------------

_PARAM = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(?::([A-Za-z]+))?\}|\*\*|\*")


def compile_pattern(pattern: str) -> tuple[str | None, re.Pattern[str], str]:
    """Compile ``"[METHOD ]/path/{param}/{rest:path}/*"`` into (method, regex, template).

    ``{name}`` and ``*`` match one path segment, ``{name:path}`` and ``**`` the rest of the path.

    Raises:
        ConfigurationError: The pattern is malformed.
    """
    prefix, _, path = pattern.strip().rpartition(" ")
    method = prefix.strip().upper() or None
    if not path.startswith("/"):
        raise ConfigurationError(f"a route pattern is '[METHOD ]/path', not {pattern!r}")
    regex, position = [], 0
    for found in _PARAM.finditer(path):
        regex.append(re.escape(path[position : found.start()]))
        token = found.group(0)
        kind = found.group(2)
        if token == "**" or kind == "path":
            regex.append(".*")
        elif token == "*" or kind in (None, "str", "int", "uuid", "slug"):
            regex.append("[^/]+")
        else:
            raise ConfigurationError(f"unknown parameter type {kind!r} in route {pattern!r}")
        position = found.end()
    regex.append(re.escape(path[position:]))
    return method, re.compile("".join(regex)), path


# -- the table the middleware consults ----------------------------------------------------------


class RouteTable:
    """Resolves each request to its effective `HttpPolicy` and route template.

    Precedence: the app's policy, then the first matching path pattern, then the options of the
    view the request reaches (most specific wins).
    """

    def __init__(
        self,
        policy: HttpPolicy | None,
        routes: Mapping[str, RouteOptions] | None,
        resolver: RouteResolver | None,
    ) -> None:
        if policy is None:
            policy = HttpPolicy()
        if not isinstance(policy, HttpPolicy):
            raise ConfigurationError(f"policy must be an oncely.http.HttpPolicy, not {policy!r}")
        self.policy = policy
        self.resolver = resolver
        self._patterns: list[tuple[str | None, re.Pattern[str], str, HttpPolicy]] = []
        for pattern, options in (routes or {}).items():
            if not isinstance(options, RouteOptions):
                raise ConfigurationError(
                    f"routes[{pattern!r}] must be a RouteOptions, not {options!r}"
                )
            method, regex, template = compile_pattern(pattern)
            self._patterns.append((method, regex, template, policy.with_options(options)))
        self._derived: dict[tuple[int, int], tuple[RouteOptions, HttpPolicy, HttpPolicy]] = {}
        # Whether any unsafe method may be covered at all: lets uncovered requests skip routing.
        self.may_cover_any = bool(self._patterns) or resolver is not None

    def select(self, method: str, path: str, match: RouteMatch | None) -> tuple[HttpPolicy, str]:
        """Return the effective policy and the route template for one request."""
        policy, template = self.policy, None
        for pattern_method, regex, pattern_template, pattern_policy in self._patterns:
            if (pattern_method is None or pattern_method == method) and regex.fullmatch(path):
                policy, template = pattern_policy, pattern_template
                break
        if match is not None:
            template = match.template or template
            for options in (match.options, _endpoint_options(match.endpoint)):
                if options:
                    policy = self._with(policy, options)
        # An unresolved route is named by its path, percent-encoded as a client would send it:
        # the decoded path may hold control characters, and the route becomes part of the key.
        return policy, template or _quoted(path)

    def _with(self, policy: HttpPolicy, options: RouteOptions) -> HttpPolicy:
        cache_key = (id(policy), id(options))
        cached = self._derived.get(cache_key)
        if cached is None or cached[0] is not options or cached[1] is not policy:
            cached = (options, policy, policy.with_options(options))
            self._derived[cache_key] = cached
        return cached[2]


# -- duck-typed resolution for known frameworks ---------------------------------------------------


def resolve_asgi(scope: Mapping[str, Any], app: Any = None) -> RouteMatch | None:
    """The route an ASGI request reaches in Litestar, Starlette, FastAPI, or Django's ASGI
    handler when it is *app*; else ``None``."""
    if app is not None and is_django(app):
        path = str(scope.get("path", "/") or "/")
        root = str(scope.get("root_path", "") or "")
        if root and path.startswith(root):  # Django's ASGIHandler takes the root path off too
            path = path[len(root) :] or "/"
        return resolve_django(path)
    handler = scope.get("route_handler")
    if handler is not None:  # Litestar routes before its middleware runs
        opt = getattr(handler, "opt", None) or {}
        options = opt.get("idempotency") if isinstance(opt, Mapping) else None
        return RouteMatch(
            scope.get("path_template"),
            getattr(handler, "fn", None),
            options if isinstance(options, RouteOptions) else None,
        )
    routes = getattr(getattr(scope.get("app"), "router", None), "routes", None)
    if routes is None:
        return None
    return _match_routes(routes, scope, "")


def _match_routes(routes: Any, scope: Mapping[str, Any], prefix: str) -> RouteMatch | None:
    partial: RouteMatch | None = None
    for route in routes:
        try:
            match, child = route.matches(scope)
        except Exception:  # a route that cannot judge this scope does not match it
            continue
        kind = getattr(match, "name", "NONE")
        if kind == "NONE":
            continue
        template = prefix + str(getattr(route, "path", "") or "")
        inner = getattr(route, "routes", None)
        found: RouteMatch | None = None
        if inner:  # a Mount or Host: its sub-routes decide
            found = _match_routes(inner, {**scope, **child}, template)
        elif "endpoint" not in child and callable(getattr(route, "_match", None)):
            found = _match_included(route, scope)
        if found is None:
            found = RouteMatch(template or None, child.get("endpoint"))
        if kind == "FULL":
            return found
        if partial is None:
            partial = found
    return partial


def _match_included(router: Any, scope: Mapping[str, Any]) -> RouteMatch | None:
    # FastAPI's included routers (0.13x and later) match through a private `_match` that
    # returns the route and its effective context (path with prefixes); best effort.
    try:
        _, _, route, context = router._match(dict(scope))
    except Exception:
        return None
    if route is not None and callable(getattr(route, "_match", None)):
        return _match_included(route, scope)
    original = getattr(context, "original_route", route)
    template = getattr(context, "path_format", None) or getattr(route, "path_format", None)
    endpoint = getattr(original, "endpoint", None)
    if endpoint is None and template is None:
        return None
    return RouteMatch(str(template) if template else None, endpoint)


def resolve_wsgi(app: Any, environ: Mapping[str, Any]) -> RouteMatch | None:
    """The route a WSGI request reaches in Flask or Django; else ``None``."""
    target = getattr(app, "__self__", app)  # Flask's app.wsgi_app is a bound method
    url_map = getattr(target, "url_map", None)
    views = getattr(target, "view_functions", None)
    if url_map is not None and isinstance(views, Mapping):
        try:
            rule, _ = url_map.bind_to_environ(environ).match(return_rule=True)
        except Exception:  # not found, method not allowed, redirect: the app answers
            return None
        return RouteMatch(_flask_template(str(rule.rule)), views.get(rule.endpoint))
    if is_django(target):
        raw = str(environ.get("PATH_INFO", "/") or "/")
        return resolve_django(raw.encode("latin-1").decode("utf-8", "replace"))
    return None


def is_django(app: Any) -> bool:
    return type(app).__module__.startswith("django.core.handlers")


def _flask_template(rule: str) -> str:
    return re.sub(r"<(?:[^:<>]+:)?([^<>]+)>", r"{\1}", rule)


def resolve_django(path_info: str, urlconf: str | None = None) -> RouteMatch | None:
    """The route a Django request reaches, from its path inside the app (``PATH_INFO``) and
    the request's own URLconf (``request.urlconf``, set by a middleware) if it has one."""
    # Only called for a Django app, so Django is installed; imported here, never at import time.
    resolve = importlib.import_module("django.urls").resolve

    path = path_info or "/"
    try:
        match = resolve(path, urlconf)
    except Exception:  # Resolver404: Django answers it
        return None
    route = getattr(match, "route", None)
    template = "/" + re.sub(r"<(?:[^:<>]+:)?([^<>]+)>", r"{\1}", route) if route else None
    return RouteMatch(template, match.func)
