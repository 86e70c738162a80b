"""Tiered specifics: which batch items the cache answers, and inner stores without batch verbs."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from oncely import Acquired, InProgress, Replay
from oncely.errors import StoreUnavailableError
from oncely.stores.memory import MemoryStore
from oncely.stores.tiered import TieredStore
from oncely.testing import FrozenClock

LEASE, TTL = timedelta(seconds=30), timedelta(hours=1)


class SingleVerbStore:
    """A store with only the single verbs, as a third-party store may be; counts calls."""

    def __init__(self, inner: MemoryStore, *, failing: str | None = None) -> None:
        self.inner = inner
        self.failing = failing
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        if name.endswith("_many"):
            raise AttributeError(name)
        verb = getattr(self.inner, name)

        def call(key: str, *args: Any, **kwargs: Any) -> Any:
            self.calls.append(f"{name}:{key}")
            if key == self.failing:
                raise StoreUnavailableError("down for this key", backend="test")
            return verb(key, *args, **kwargs)

        return call


def test_batch_hits_are_answered_from_the_cache() -> None:
    """Finished records the cache holds never reach the inner store; misses go in one batch."""
    clock = FrozenClock()
    inner = SingleVerbStore(MemoryStore(clock=clock))
    store = TieredStore(inner, clock=clock)  # type: ignore[arg-type]
    claimed = store.claim_many([("a", "fp"), ("b", "fp")], lease=LEASE, ttl=TTL)
    assert claimed == [Acquired(1, recovered=False, attempt=1)] * 2
    assert store.complete_many([("a", 1, b"A"), ("b", 1, b"B")], ttl=TTL) == [None, None]
    first = store.claim_many([("a", "fp"), ("b", "fp")], lease=LEASE, ttl=TTL)
    assert [answer.record.result for answer in first if isinstance(answer, Replay)] == [b"A", b"B"]
    inner.calls.clear()
    again = store.claim_many([("a", "fp"), ("c", "fp"), ("b", "fp")], lease=LEASE, ttl=TTL)
    assert isinstance(again[0], Replay)
    assert again[1] == Acquired(1, recovered=False, attempt=1)
    assert isinstance(again[2], Replay)
    assert inner.calls == ["claim:c"]


def test_inner_failures_answer_in_their_own_place() -> None:
    """Without batch verbs the inner store is called per item; one failing item does not
    lose the leases taken for the others (sync and async)."""
    inner = SingleVerbStore(MemoryStore(), failing="b")
    store = TieredStore(inner)  # type: ignore[arg-type]
    answers = store.claim_many([("a", "fp"), ("b", "fp"), ("c", "fp")], lease=LEASE, ttl=TTL)
    assert answers[0] == answers[2] == Acquired(1, recovered=False, attempt=1)
    assert isinstance(answers[1], StoreUnavailableError)
    completed = store.complete_many([("a", 1, b""), ("b", 1, b"")], ttl=TTL)
    assert completed[0] is None
    assert isinstance(completed[1], StoreUnavailableError)

    async def async_twins() -> tuple[list[Any], list[Any]]:
        claims = await store.aclaim_many([("c", "fp"), ("b", "fp")], lease=LEASE, ttl=TTL)
        settled = await store.acomplete_many([("c", 1, b""), ("b", 1, b"")], ttl=TTL)
        return claims, settled

    claims, settled = asyncio.run(async_twins())
    assert isinstance(claims[0], InProgress)
    assert isinstance(claims[1], StoreUnavailableError)
    assert settled[0] is None
    assert isinstance(settled[1], StoreUnavailableError)
