"""Clocks: time is passed into the core, never read by it."""

from __future__ import annotations

import time
from typing import Protocol

__all__ = ["Clock", "SystemClock"]


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
