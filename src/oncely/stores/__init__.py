"""Stores keep records; `open_store` opens one from a URL.

Backend classes are imported lazily, so ``import oncely.stores`` loads no driver.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from oncely.stores._registry import open_store

if TYPE_CHECKING:
    from oncely.stores.memory import MemoryStore
    from oncely.stores.sqlite import SQLiteStore

__all__ = ["MemoryStore", "SQLiteStore", "open_store"]

_LAZY = {
    "MemoryStore": "oncely.stores.memory",
    "SQLiteStore": "oncely.stores.sqlite",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'oncely.stores' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
