"""A memory store with the batch verbs the consumers use when a store has them."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from oncely import ClaimResult, LeaseLost, StoreUnavailableError
from oncely.stores.memory import MemoryStore


class BatchingStore(MemoryStore):
    """A memory store with the batch verbs (a loop each), counting the calls."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.calls: list[str] = []
        self.down: set[str] = set()

    def _enter(self, verb: str) -> None:
        self.calls.append(verb)
        if verb in self.down:
            raise StoreUnavailableError("down", backend="test")

    def claim_many(
        self, requests: Sequence[tuple[str, str]], *, lease: timedelta, ttl: timedelta
    ) -> list[ClaimResult]:
        self._enter("claim_many")
        return [self.claim(key, fp, lease=lease, ttl=ttl) for key, fp in requests]

    def complete_many(
        self, items: Sequence[tuple[str, int, bytes]], *, ttl: timedelta
    ) -> list[LeaseLost | None]:
        self._enter("complete_many")
        return [self.complete(key, token, result, ttl=ttl) for key, token, result in items]

    async def aclaim_many(
        self, requests: Sequence[tuple[str, str]], *, lease: timedelta, ttl: timedelta
    ) -> list[ClaimResult]:
        return self.claim_many(requests, lease=lease, ttl=ttl)

    async def acomplete_many(
        self, items: Sequence[tuple[str, int, bytes]], *, ttl: timedelta
    ) -> list[LeaseLost | None]:
        return self.complete_many(items, ttl=ttl)
