"""Store URL schemes, resolved to classes only when a scheme is used."""

from __future__ import annotations

import importlib
import typing
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import Any, Final

from oncely._core.protocols import Store
from oncely.errors import ConfigurationError

__all__ = ["open_store"]

_BUILTIN_SCHEMES: Final[Mapping[str, str]] = {
    "memory": "oncely.stores.memory:MemoryStore",
    "sqlite": "oncely.stores.sqlite:SQLiteStore",
    "postgresql": "oncely.stores.postgres:PostgresStore",
    "postgres": "oncely.stores.postgres:PostgresStore",
    "postgresql+asyncpg": "oncely.stores.postgres.store:AsyncpgScheme",
    "redis": "oncely.stores.redis:RedisStore",
    "rediss": "oncely.stores.redis:RedisStore",
    "redis+cluster": "oncely.stores.redis:RedisClusterStore",
}


def _target(scheme: str) -> str | None:
    builtin = _BUILTIN_SCHEMES.get(scheme)
    if builtin is not None:
        return builtin
    for entry in entry_points(group="oncely.stores"):
        if entry.name == scheme:
            return str(entry.value)
    return None


def open_store(url: str, **options: Any) -> Store:
    """Open the store a URL names.

    ``memory://``, ``sqlite:///path/to.db``, ``postgresql://…`` (``postgresql+asyncpg://…``:
    its async verbs on asyncpg), ``redis://…``, ``rediss://…``, ``redis+cluster://host:port,…``,
    and ``tiered+<url>`` for an in-process cache of completed records in front of another store.
    Packages can add schemes through the ``oncely.stores`` entry-point group.

    Args:
        url: The store's URL.
        **options: Passed to the store class (``namespace=``, ``clock=``, …).

    Raises:
        ConfigurationError: No store is registered for the URL's scheme, or the URL is malformed.
        MissingDependencyError: The scheme's driver is not installed.

    .. versionadded:: 0.1.0
    """
    if not isinstance(url, str) or "://" not in url:
        raise ConfigurationError(f"a store URL looks like 'sqlite:///oncely.db', not {url!r}")
    scheme = url.partition("://")[0].lower()
    if scheme.startswith("tiered+"):
        from oncely.stores.tiered import TieredStore

        if scheme.startswith("tiered+tiered+"):
            raise ConfigurationError(
                f"a tiered store in front of a tiered store caches nothing more: {url!r}; "
                "use one tiered+ prefix"
            )

        tiered_options = {
            name: options.pop(name)
            for name in ("max_entries", "max_bytes", "max_staleness")
            if name in options
        }
        return TieredStore(open_store(url[len("tiered+") :], **options), **tiered_options)
    target = _target(scheme)
    if target is None:
        known = ", ".join(sorted(_BUILTIN_SCHEMES))
        raise ConfigurationError(f"no store is registered for {scheme!r} URLs (known: {known})")
    module_name, _, attr = target.partition(":")
    store_class = getattr(importlib.import_module(module_name), attr)
    return typing.cast(Store, store_class.from_url(url, **options))
