"""A connection a side channel keeps of its own across calls (the dashboard's activity sinks),
apart from the store's pool, and what becomes of it after a fork and at close."""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["OwnConnection"]

_INHERITED: list[Any] = []
"""A parent process's connections, kept referenced in a forked child: never used nor closed
there (closing one would end the parent's session)."""


class OwnConnection:
    """The lifecycle of one connection (``_connection``, guarded by ``_lock``)."""

    _connection: Any
    _lock: threading.Lock

    def _drop(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()

    def after_fork(self) -> None:
        """In a forked child: leave the parent's connection to the parent, unclosed and
        referenced; connect anew on next use."""
        _INHERITED.append(self._connection)
        self._connection = None
        self._lock = threading.Lock()

    def close(self) -> None:
        """Close the connection."""
        with self._lock:
            self._drop()
