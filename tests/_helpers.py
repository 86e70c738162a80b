"""Small shared helpers for tests: bounded polling and stores of each kind."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

from oncely import ClaimResult, LeaseLost, Record, Store

T = TypeVar("T")


def eventually(check: Callable[[], T], *, timeout: float = 10.0, interval: float = 0.02) -> T:
    """Call *check* until it returns a truthy value or *timeout* passes (then fail)."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s: last value {value!r}")
        time.sleep(interval)


class SyncOnlyStore:
    """Exposes only a store's sync verbs, like a third-party store without async support."""

    def __init__(self, inner: Store) -> None:
        self._inner = inner

    def claim(self, key: str, fingerprint: str, *, lease: timedelta, ttl: timedelta) -> ClaimResult:
        return self._inner.claim(key, fingerprint, lease=lease, ttl=ttl)

    def complete(self, key: str, token: int, result: bytes, *, ttl: timedelta) -> LeaseLost | None:
        return self._inner.complete(key, token, result, ttl=ttl)

    def fail(self, key: str, token: int, error: bytes, *, ttl: timedelta) -> LeaseLost | None:
        return self._inner.fail(key, token, error, ttl=ttl)

    def release(self, key: str, token: int) -> LeaseLost | None:
        return self._inner.release(key, token)

    def extend(self, key: str, token: int, *, lease: timedelta) -> LeaseLost | None:
        return self._inner.extend(key, token, lease=lease)

    def get(self, key: str) -> Record | None:
        return self._inner.get(key)

    def close(self) -> None:
        self._inner.close()


class Counter:
    """Counts calls of a protected function, and records their arguments."""

    def __init__(self) -> None:
        self.calls: list[Any] = []

    @property
    def count(self) -> int:
        return len(self.calls)


DJANGO_SQLITE = """
import sys
from contextlib import contextmanager

import django
from django.conf import settings

settings.configure(
    DATABASES={
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": sys.argv[1],
            "OPTIONS": {"transaction_mode": "IMMEDIATE"},
        }
    },
    INSTALLED_APPS=[],
)
django.setup()
from django.db import connection, transaction

import oncely
"""
"""The start of a Django script run in a subprocess (Django is configured once per process):
settings for the SQLite file named by its first argument, in ``IMMEDIATE`` transactions, then
``connection``, ``transaction``, ``contextmanager`` and ``oncely`` imported."""
