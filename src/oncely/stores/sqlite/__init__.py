"""The SQLite store: the embedded default."""

from oncely.stores.sqlite.store import SQLiteStore

__all__ = ["SQLiteStore"]
