"""Helpers for testing code that uses oncely, and the store conformance suite.

* `FrozenClock`: a clock that moves only when told, for deterministic expiry tests.
* `StoreConformance`: the one test suite every store must pass (DESIGN.md sections 2 and 3).
  Subclass it in a pytest module and implement `open_store`; it needs pytest and hypothesis.

.. code-block:: python

    from oncely.testing import StoreConformance

    class TestMyStore(StoreConformance):
        def open_store(self, clock):
            return MyStore(..., clock=clock)

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import TYPE_CHECKING, Any

__all__ = ["FrozenClock", "StoreConformance"]

if TYPE_CHECKING:
    from oncely._conformance import StoreConformance


class FrozenClock:
    """A `oncely.Clock` that stands still until `advance` moves it. Thread-safe.

    Args:
        now_ms: The starting time, epoch milliseconds.
    """

    def __init__(self, now_ms: int = 1_700_000_000_000) -> None:
        self._now_ms = now_ms
        self._lock = threading.Lock()

    def now_ms(self) -> int:
        """Return the frozen time."""
        with self._lock:
            return self._now_ms

    def advance(self, by: timedelta | int) -> None:
        """Move the clock forward by *by* (a timedelta, or milliseconds)."""
        step = by // timedelta(milliseconds=1) if isinstance(by, timedelta) else by
        if step < 0:
            raise ValueError("a clock only moves forward")
        with self._lock:
            self._now_ms += step


def __getattr__(name: str) -> Any:
    if name == "StoreConformance":
        from oncely._conformance import StoreConformance

        return StoreConformance
    raise AttributeError(f"module 'oncely.testing' has no attribute {name!r}")
