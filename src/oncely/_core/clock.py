"""Clocks: time is passed into the core, never read by it."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Protocol

__all__ = ["Clock", "FrozenClock", "SystemClock"]


class Clock(Protocol):
    """A source of wall-clock time in integer epoch milliseconds."""

    def now_ms(self) -> int:
        """Return the current time as epoch milliseconds."""
        ...


class SystemClock:
    """The host's wall clock."""

    def now_ms(self) -> int:
        """Return `time.time()` as epoch milliseconds."""
        return time.time_ns() // 1_000_000


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
