"""Stores keep records; `open_store` opens one from a URL.

Backend classes are imported lazily, so ``import oncely.stores`` loads no driver.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from oncely.stores._registry import open_store

if TYPE_CHECKING:
    from oncely.stores.bloom import BloomStore
    from oncely.stores.memory import MemoryStore
    from oncely.stores.postgres import PostgresStore
    from oncely.stores.redis import RedisClusterStore, RedisStore
    from oncely.stores.sqlite import SQLiteStore
    from oncely.stores.tiered import TieredStore

__all__ = [
    "BloomStore",
    "MemoryStore",
    "open_store",
    "PostgresStore",
    "RedisClusterStore",
    "RedisStore",
    "SQLiteStore",
    "TieredStore",
]

_LAZY = {
    "BloomStore": "oncely.stores.bloom",
    "MemoryStore": "oncely.stores.memory",
    "PostgresStore": "oncely.stores.postgres",
    "RedisClusterStore": "oncely.stores.redis",
    "RedisStore": "oncely.stores.redis",
    "SQLiteStore": "oncely.stores.sqlite",
    "TieredStore": "oncely.stores.tiered",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'oncely.stores' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
