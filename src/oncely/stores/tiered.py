"""`tiered+<url>`: an in-process LRU of finished records in front of any store.

Replays of hot keys are answered from memory with no round trip. Only completed and failed
records are cached: they change only by expiring, so the cache can never answer a stale
in-progress state. Claims that miss, and every state change, go to the inner store.

Expiry is the store's: a replay says the store's clock when it answered (`Replay.judged_at_ms`:
Redis ``TIME``, PostgreSQL's clock, the clock of a memory or SQLite store), so the record has
``expires_at_ms - judged_at_ms`` left from a moment after the claim was sent. The cache keeps it
that long, less a margin, measured on the local clock from when the claim was sent: a local clock
that is minutes off never serves a record the store has expired (and may have run again).

A record can also change before it expires: forgotten (through another process, or `oncely
forget`) and run again. No process is told, so a cached record is kept at most `max_staleness`
(one second by default) from when its claim was sent: a change made anywhere reaches every
process's cache within that bound. A forget through this store takes effect at once, and a claim
in flight when it lands does not cache what it read before it (the forget count, below).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

from oncely._core.clock import Clock, SystemClock
from oncely._core.flow import Flow, adrive, drive
from oncely._core.protocols import Store
from oncely._core.records import (
    ClaimResult,
    Mismatch,
    Record,
    Replay,
    Status,
)
from oncely.errors import ConfigurationError, StoreError
from oncely.stores import _batch
from oncely.stores._wrapper import StoreWrapper

__all__ = ["TieredStore"]

_EXPIRY_MARGIN_MS = 1000
"""Cached records are dropped this long before they expire by the store's clock, to absorb
differences in the rate of the local clock and the store's."""


@dataclass(frozen=True, slots=True)
class _Entry:
    record: Record
    deadline_ms: int  # on the tiered store's clock: past it, the record may have expired


class TieredStore(StoreWrapper):
    """Caches finished records of *inner* in this process.

    Args:
        inner: The store that owns the records.
        max_entries: The most records kept.
        max_bytes: The most result bytes kept (records larger than a tenth of it are not cached).
        max_staleness: The longest a cached record answers, from when its claim was sent: a
            record forgotten or run again elsewhere is replayed from this cache no longer.
        clock: The local clock that measures how long a cached record has left (by default the
            inner store's clock, else the host's); a store whose replies do not say its clock
            (`Replay.judged_at_ms`) is taken to share it.

    Raises:
        ConfigurationError: A bound is not positive.

    Every verb it does not list here is the inner store's own (`oncely.Store`).

    .. versionadded:: 0.1.0
    """

    backend = "tiered"

    def __init__(
        self,
        inner: Store,
        *,
        max_entries: int = 10_000,
        max_bytes: int = 64 * 1024 * 1024,
        max_staleness: timedelta = timedelta(seconds=1),
        clock: Clock | None = None,
    ) -> None:
        if max_entries < 1 or max_bytes < 1:
            raise ConfigurationError("max_entries and max_bytes must be positive")
        if not isinstance(max_staleness, timedelta) or max_staleness < timedelta(milliseconds=1):
            raise ConfigurationError(
                f"max_staleness must be a timedelta of at least 1 ms, not {max_staleness!r}"
            )
        super().__init__(inner)
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.max_staleness = max_staleness
        self._staleness_ms = max_staleness // timedelta(milliseconds=1)
        inner_clock = getattr(inner, "clock", None)
        if not callable(getattr(inner_clock, "now_ms", None)):
            inner_clock = None
        self.clock: Clock = clock or inner_clock or SystemClock()
        self._cache: OrderedDict[str, _Entry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._forgets = 0
        """Forgets through this store so far: a claim caches what it read only if none landed
        while it was in flight (the read may predate the forget)."""
        self.hits = 0

    # -- cache ---------------------------------------------------------------------------------

    def _cached(self, key: str, fingerprint: str) -> ClaimResult | None:
        with self._lock:
            entry = self._cache.get(key)
            if entry is None:
                return None
            if self.clock.now_ms() >= entry.deadline_ms:
                self._drop(key)
                return None
            self._cache.move_to_end(key)
            self.hits += 1
        record = entry.record
        if record.fingerprint != fingerprint:
            return Mismatch(stored_fingerprint=record.fingerprint)
        return Replay(record)

    def _asking(self) -> tuple[int, int]:
        """The local clock and the forget count, taken before a claim is sent."""
        with self._lock:
            return self.clock.now_ms(), self._forgets

    def _remember(self, answer: ClaimResult, asked: tuple[int, int]) -> ClaimResult:
        """Cache *answer* if it is a replay; *asked* is `_asking` before the claim."""
        if isinstance(answer, Replay):
            asked_at_ms, forgets = asked
            record = answer.record
            judged_at_ms = answer.judged_at_ms
            if judged_at_ms is None:  # the store does not say its clock: take the local one
                judged_at_ms = asked_at_ms
            # The store judged after the claim was sent: the record lives at least this long.
            deadline_ms = min(
                asked_at_ms + record.expires_at_ms - judged_at_ms - _EXPIRY_MARGIN_MS,
                asked_at_ms + self._staleness_ms,
            )
            size = len(record.result or b"")
            if size <= self.max_bytes // 10 and deadline_ms > asked_at_ms:
                with self._lock:
                    if forgets != self._forgets:
                        return answer
                    self._drop(record.key)
                    self._cache[record.key] = _Entry(record, deadline_ms)
                    self._bytes += size
                    while len(self._cache) > self.max_entries or self._bytes > self.max_bytes:
                        self._drop(next(iter(self._cache)))
        return answer

    def _claim_many(
        self, requests: Sequence[tuple[str, str]]
    ) -> Flow[list[ClaimResult | StoreError]]:
        """Answer what the cache holds; yield the indexes of the misses for the inner store,
        once, in order."""
        answers: list[ClaimResult | StoreError | None] = [
            self._cached(key, fingerprint) for key, fingerprint in requests
        ]
        misses = [index for index, answer in enumerate(answers) if answer is None]
        if misses:
            asked = self._asking()
            fetched: list[ClaimResult | StoreError] = yield misses
            for index, answer in zip(misses, fetched, strict=True):
                answers[index] = (
                    answer if isinstance(answer, StoreError) else self._remember(answer, asked)
                )
        return [answer for answer in answers if answer is not None]

    def _drop(self, key: str) -> None:
        entry = self._cache.pop(key, None)
        if entry is not None:
            self._bytes -= len(entry.record.result or b"")

    def __len__(self) -> int:
        return len(self._cache)

    # -- sync verbs ----------------------------------------------------------------------------

    def claim(self, key: str, fingerprint: str, *, lease: timedelta, ttl: timedelta) -> ClaimResult:
        """See `oncely.SyncStore.claim`; a cached finished record answers without a round trip."""
        cached = self._cached(key, fingerprint)
        if cached is not None:
            return cached
        asked = self._asking()
        answer = self.inner.claim(key, fingerprint, lease=lease, ttl=ttl)
        return self._remember(answer, asked)

    def claim_many(
        self,
        requests: Sequence[tuple[str, str]],
        *,
        lease: timedelta,
        ttl: timedelta,
        ops: Sequence[str] | None = None,
    ) -> list[ClaimResult | StoreError]:
        """See `oncely.BatchStore.claim_many`; only the cache's misses reach the inner store,
        with their call ids *ops* (one per request) when given and the inner store takes them.
        """
        if ops is not None:
            _batch.check_ops(requests, ops)
        return drive(
            self._claim_many(requests),
            lambda missed: _batch.claim_many(
                self.inner,
                [requests[i] for i in missed],
                lease=lease,
                ttl=ttl,
                ops=None if ops is None else [ops[i] for i in missed],
            ),
        )

    def forget(self, key: str, *, force: bool = False) -> Status | None:
        """The inner store's ``forget``; *key* then leaves the cache, and a claim in flight
        does not put it back."""
        try:
            status: Status | None = self._inner_verb("forget")(key, force=force)
        finally:  # a forget whose reply was lost may still have been applied
            self._forgotten(key)
        return status

    async def aforget(self, key: str, *, force: bool = False) -> Status | None:
        """Async `forget`."""
        try:
            status: Status | None = await self._inner_verb("aforget")(key, force=force)
        finally:
            self._forgotten(key)
        return status

    def _forgotten(self, key: str) -> None:
        with self._lock:
            self._forgets += 1
            self._drop(key)

    # -- async verbs ---------------------------------------------------------------------------

    async def aclaim(
        self, key: str, fingerprint: str, *, lease: timedelta, ttl: timedelta
    ) -> ClaimResult:
        """See `oncely.AsyncStore.aclaim`."""
        cached = self._cached(key, fingerprint)
        if cached is not None:
            return cached
        asked = self._asking()
        answer = await self.inner.aclaim(key, fingerprint, lease=lease, ttl=ttl)
        return self._remember(answer, asked)

    async def aclaim_many(
        self,
        requests: Sequence[tuple[str, str]],
        *,
        lease: timedelta,
        ttl: timedelta,
        ops: Sequence[str] | None = None,
    ) -> list[ClaimResult | StoreError]:
        """See `claim_many`."""
        if ops is not None:
            _batch.check_ops(requests, ops)

        async def fetch(missed: list[int]) -> list[ClaimResult | StoreError]:
            return await _batch.aclaim_many(
                self.inner,
                [requests[i] for i in missed],
                lease=lease,
                ttl=ttl,
                ops=None if ops is None else [ops[i] for i in missed],
            )

        return await adrive(self._claim_many(requests), fetch)
