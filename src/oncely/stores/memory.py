"""`memory://`: records in a dict, for tests and single-process apps."""

from __future__ import annotations

import heapq
import threading
from collections.abc import Sequence
from dataclasses import replace
from datetime import timedelta
from typing import Any, ClassVar, TypeVar

from oncely._core import machine
from oncely._core.clock import Clock
from oncely._core.records import Acquired, ClaimResult, LeaseLost, Record, Replay
from oncely.errors import ConfigurationError, StoreError
from oncely.stores import _namespace
from oncely.stores._machine import MachineStore, Step, _ms

__all__ = ["MemoryStore"]

T = TypeVar("T")


class MemoryStore(MachineStore):
    """Keeps records in this process's memory; nothing survives a restart.

    Both sync and async callers use the same object; calls never block for I/O.

    Args:
        namespace: A prefix that keeps this store's keys apart from others'.
        clock: The clock that judges leases and expiry (``oncely.testing.FrozenClock`` in tests).

    .. versionadded:: 0.1.0
    """

    backend = "memory"
    _inline_async: ClassVar[type[MemoryStore]]

    def __init__(self, *, namespace: str = "", clock: Clock | None = None) -> None:
        super().__init__(namespace=namespace, clock=clock)
        self._records: dict[str, Record] = {}
        self._ops: dict[str, str] = {}  # the call id kept with a record (see _machine)
        self._expiries: list[tuple[int, str]] = []
        self._lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str, **options: Any) -> MemoryStore:
        """Open ``memory://``.

        Raises:
            ConfigurationError: The URL has a host, a path or parameters (``memory://foo``):
                a memory store has none, and each `open_store` call makes a new one.
        """
        if url.partition("://")[2]:
            raise ConfigurationError(
                f"memory:// takes no host, path or parameters, not {url!r}: every "
                "open_store('memory://') is a new, empty store of this process"
            )
        return cls(**options)

    def claim(self, key: str, fingerprint: str, *, lease: timedelta, ttl: timedelta) -> ClaimResult:
        """See `oncely.SyncStore.claim`."""
        stored = self._stored_key(key)
        lease_ms, ttl_ms = _ms(lease), _ms(ttl)
        with self._lock:
            now_ms = self.clock.now_ms()
            record, answer = machine.claim(
                stored,
                self._records.get(stored),
                fingerprint,
                now_ms=now_ms,
                lease_ms=lease_ms,
                ttl_ms=ttl_ms,
            )
            if record is not None:
                self._write(stored, record, now_ms)
                if type(answer) is Acquired:  # a lease taken without a call id keeps none
                    self._ops.pop(stored, None)
        if type(answer) is Replay:
            answer = self._unscoped(answer)
        return answer

    def complete(self, key: str, token: int, result: bytes, *, ttl: timedelta) -> LeaseLost | None:
        """See `oncely.SyncStore.complete`."""
        stored = self._stored_key(key)
        ttl_ms = _ms(ttl)
        if type(result) is not bytes:
            result = bytes(result)
        with self._lock:
            now_ms = self.clock.now_ms()
            record, lost = machine.complete(
                self._records.get(stored), token, result, now_ms=now_ms, ttl_ms=ttl_ms
            )
            if record is not None:
                self._write(stored, record, now_ms)
        return lost

    def _atomic(self, key: str, step: Step[T]) -> T:
        with self._lock:
            now_ms = self.clock.now_ms()
            return self._apply(key, step, now_ms)

    def _atomic_many(self, steps: Sequence[tuple[str, Step[T]]]) -> list[T | StoreError]:
        with self._lock:
            now_ms = self.clock.now_ms()
            answers: list[T | StoreError] = [self._apply(key, step, now_ms) for key, step in steps]
            self._purge_locked(now_ms, limit=8)
            return answers

    def _apply(self, key: str, step: Step[T], now_ms: int) -> T:
        record, op, answer = step(self._records.get(key), self._ops.get(key), now_ms)
        if record is not None:
            if op is None:
                self._ops.pop(key, None)
            else:
                self._ops[key] = op
            self._write(key, record, now_ms)
        return answer

    def _write(self, key: str, record: Record, now_ms: int) -> None:
        """Keep *record* (the lock held), and purge a few expired records if any is due."""
        self._records[key] = record
        expiries = self._expiries
        heapq.heappush(expiries, (record.expires_at_ms, key))
        if expiries[0][0] <= now_ms:
            self._purge_locked(now_ms, limit=8)

    async def aclaim(
        self, key: str, fingerprint: str, *, lease: timedelta, ttl: timedelta
    ) -> ClaimResult:
        """See `oncely.AsyncStore.aclaim`: the sync verb, inline (this store never blocks)."""
        return self.claim(key, fingerprint, lease=lease, ttl=ttl)

    async def acomplete(
        self, key: str, token: int, result: bytes, *, ttl: timedelta
    ) -> LeaseLost | None:
        """See `oncely.AsyncStore.acomplete`: the sync verb, inline."""
        return self.complete(key, token, result, ttl=ttl)

    def _read(self, key: str) -> Record | None:
        with self._lock:
            return self._records.get(key)

    def purge(self, *, batch: int = 1000, limit: int | None = None) -> int:
        """Delete expired records (up to *limit*); return how many were deleted."""
        with self._lock:
            return self._purge_locked(self.clock.now_ms(), limit=limit or len(self._records))

    def scan(self, *, after: str = "", limit: int = 100) -> list[Record]:
        """Return up to *limit* live records whose key sorts after *after*, results left out."""
        start = self._stored_key(after)
        ours = _namespace.member(self.namespace)
        now_ms = self.clock.now_ms()
        with self._lock:
            keys = sorted(
                key
                for key, record in self._records.items()
                if key > start and ours(key) and record.is_live(now_ms)
            )[:limit]
            records = [replace(self._records[key], result=None) for key in keys]
        return [self._unscoped(record) for record in records]

    def _purge_locked(self, now_ms: int, *, limit: int) -> int:
        removed = 0
        while self._expiries and self._expiries[0][0] <= now_ms and removed < limit:
            _, key = heapq.heappop(self._expiries)
            record = self._records.get(key)
            if record is not None and record.expires_at_ms <= now_ms:
                del self._records[key]
                self._ops.pop(key, None)
                removed += 1
        return removed

    def __len__(self) -> int:
        return len(self._records)


MemoryStore._inline_async = MemoryStore
"""The class whose async verbs finish without ever suspending (so nothing can cancel one
midway, and `oncely._execution.acall` awaits its complete unshielded): this one, and not its
subclasses, which may override them."""
