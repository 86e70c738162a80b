"""Stores for the consumer tests: one that counts batch calls, one that hides the batch verbs."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from oncely import StoreUnavailableError
from oncely.stores.memory import MemoryStore


class BatchingStore(MemoryStore):
    """A memory store (which has the batch verbs) counting the batch calls; a verb named in
    ``down`` fails as an unreachable store would, one in ``once`` likewise but once; one named
    in ``lost`` is applied once with its reply lost (it raises as a timeout would)."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.calls: list[str] = []
        self.down: set[str] = set()
        self.lost: set[str] = set()
        self.once: set[str] = set()

    def _enter(self, verb: str) -> None:
        self.calls.append(verb)
        if verb in self.once:
            self.once.discard(verb)
            raise StoreUnavailableError("connection reset", backend="test")
        if verb in self.down:
            raise StoreUnavailableError("down", backend="test")

    def _reply(self, verb: str, answers: list[Any]) -> list[Any]:
        if verb in self.lost:
            self.lost.discard(verb)
            raise StoreUnavailableError("timed out", backend="test")
        return answers

    def claim_many(
        self, requests: Sequence[tuple[str, str]], *, lease: timedelta, ttl: timedelta
    ) -> list[Any]:
        self._enter("claim_many")
        return self._reply("claim_many", super().claim_many(requests, lease=lease, ttl=ttl))

    def complete_many(
        self, items: Sequence[tuple[str, int, bytes]], *, ttl: timedelta
    ) -> list[Any]:
        self._enter("complete_many")
        return self._reply("complete_many", super().complete_many(items, ttl=ttl))

    async def aclaim_many(
        self, requests: Sequence[tuple[str, str]], *, lease: timedelta, ttl: timedelta
    ) -> list[Any]:
        return self.claim_many(requests, lease=lease, ttl=ttl)

    async def acomplete_many(
        self, items: Sequence[tuple[str, int, bytes]], *, ttl: timedelta
    ) -> list[Any]:
        return self.complete_many(items, ttl=ttl)


class SingleVerbs:
    """A store seen without its batch verbs, as a third-party store may be: the consumers
    then claim and complete one message at a time."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def __getattr__(self, name: str) -> Any:
        if name.endswith("_many"):
            raise AttributeError(name)
        return getattr(self.store, name)
