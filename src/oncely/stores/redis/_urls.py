"""Checking the Redis stores' URLs and client options, and parsing a Redis Cluster URL."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any, Final
from urllib.parse import unquote

from oncely.errors import (
    ConfigurationError,
)


def _check_options(options: Mapping[str, Any]) -> None:
    """Refuse the client options (or URL parameters) that would break the store."""
    if options.get("decode_responses") not in (None, False):
        raise ConfigurationError("the Redis store needs decode_responses=False (results are bytes)")
    if "retry" in options or "retry_on_timeout" in options:
        raise ConfigurationError(
            "the Redis store sets up retries itself: pass retries=<n> (0 to fail at once)"
        )


_URL_PARTS: Final = frozenset({"host", "port", "path", "db", "username", "password"})


def _check_url(
    redis: ModuleType,
    url: str,
    options: Mapping[str, Any],
    *more: type,
    also: Sequence[str] = (),
) -> None:
    """Refuse what redis-py's URL parser lets through to go wrong later: a database that is
    not a number (``redis://host/cache`` silently meant database 0) and query parameters that
    no connection takes (a ``TypeError`` at the first command, or dropped unsaid). *more* are
    classes whose parameters count too, *also* more names."""
    if url.partition("://")[0].lower() in ("redis", "rediss"):
        path = url.partition("://")[2].partition("?")[0].partition("/")[2]
        if path and not (path.isascii() and path.isdigit()):
            raise ConfigurationError(f"the database is a number (/0, /1…), not {path!r}")
    classes: list[type] = [redis.ConnectionPool, *more]
    connection_class = options.get("connection_class", redis.connection.Connection)
    classes.extend(getattr(connection_class, "__mro__", (connection_class,)))
    accepted = {*_URL_PARTS, *also}
    for cls in classes:
        init = vars(cls).get("__init__")
        if init is not None:
            with contextlib.suppress(TypeError, ValueError):  # a builtin: no signature
                accepted.update(inspect.signature(init).parameters)
    unknown = sorted(set(options) - accepted - {"connection_class"})
    if unknown:
        raise ConfigurationError(f"unknown parameters {unknown}: no Redis connection takes them")


def _masked(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    userinfo, at, hosts = rest.rpartition("@")
    if not at:
        return url
    user = userinfo.partition(":")[0]
    return f"{scheme}{sep}{user}:***@{hosts}" if ":" in userinfo else url


def _parse_cluster_url(redis: ModuleType, url: str) -> tuple[list[tuple[str, int]], dict[str, Any]]:
    """Split ``redis+cluster://[auth@]h:p,h:p[/0][?query]`` into startup nodes and options."""
    scheme, _, rest = url.partition("://")
    if scheme.lower() != "redis+cluster" or not rest:
        raise ConfigurationError(
            f"a Redis Cluster URL is redis+cluster://host:port,…, not {_masked(url)!r}"
        )
    rest, _, query = rest.partition("?")
    netloc, slash, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    nodes: list[tuple[str, int]] = []
    for address in hosts.split(","):
        host, colon, port = address.strip().rpartition(":")
        if not colon:
            host, port = address.strip(), "6379"
        host = host.strip("[]")
        if not host or not (port.isascii() and port.isdigit()):
            raise ConfigurationError(
                f"bad node {address!r} in the Redis Cluster URL {_masked(url)!r}"
            )
        nodes.append((unquote(host), int(port)))
    single = f"redis://{userinfo}{at}{hosts.split(',')[0]}{slash}{path}"
    try:
        options: dict[str, Any] = redis.connection.parse_url(
            f"{single}?{query}" if query else single
        )
    except ValueError as exc:
        raise ConfigurationError(f"malformed Redis Cluster URL {_masked(url)!r}: {exc}") from exc
    _check_options(options)
    try:
        cluster = redis.cluster
        allowed = getattr(cluster, "REDIS_ALLOWED_KEYS", ())  # what it passes to each node
        _check_url(redis, single, options, cluster.RedisCluster, also=allowed)
    except ConfigurationError as exc:
        raise ConfigurationError(f"malformed Redis Cluster URL {_masked(url)!r}: {exc}") from exc
    if options.pop("db", 0) not in (0, "0"):
        raise ConfigurationError("a Redis Cluster has only database 0")
    options.pop("host", None)
    options.pop("port", None)
    return nodes, options
