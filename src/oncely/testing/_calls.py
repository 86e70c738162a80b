"""The store's verbs as plain calls (sync or async), and the child process of the races."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from oncely._core.protocols import Store
from oncely._core.records import Record, Status, StoreHealth
from oncely.stores import open_store

__all__ = ["StoreCalls", "claim_in_process"]


class StoreCalls:
    """The store's verbs as plain calls: sync directly, or async on one event loop."""

    def __init__(self, store: Store, mode: str) -> None:
        self.store = store
        self.mode = mode
        self._loop = asyncio.new_event_loop() if mode == "async" else None

    def _call(self, verb: str, *args: Any, **kwargs: Any) -> Any:
        if self._loop is None:
            return getattr(self.store, verb)(*args, **kwargs)
        return self._loop.run_until_complete(getattr(self.store, "a" + verb)(*args, **kwargs))

    def claim(self, key: str, fingerprint: str, *, lease: timedelta, ttl: timedelta) -> Any:
        return self._call("claim", key, fingerprint, lease=lease, ttl=ttl)

    def complete(self, key: str, token: int, result: bytes, *, ttl: timedelta) -> Any:
        return self._call("complete", key, token, result, ttl=ttl)

    def fail(self, key: str, token: int, error: bytes, *, ttl: timedelta) -> Any:
        return self._call("fail", key, token, error, ttl=ttl)

    def release(self, key: str, token: int) -> Any:
        return self._call("release", key, token)

    def extend(self, key: str, token: int, *, lease: timedelta) -> Any:
        return self._call("extend", key, token, lease=lease)

    def get(self, key: str) -> Record | None:
        result: Record | None = self._call("get", key)
        return result

    def claim_many(
        self,
        requests: list[tuple[str, str]],
        *,
        lease: timedelta,
        ttl: timedelta,
        ops: list[str] | None = None,
    ) -> list[Any]:
        extra = {} if ops is None else {"ops": ops}
        answers: list[Any] = self._call("claim_many", requests, lease=lease, ttl=ttl, **extra)
        return answers

    def complete_many(self, items: list[tuple[str, int, bytes]], *, ttl: timedelta) -> list[Any]:
        answers: list[Any] = self._call("complete_many", items, ttl=ttl)
        return answers

    def check(self) -> StoreHealth:
        health: StoreHealth = self._call("check")
        return health

    def forget(self, key: str, *, force: bool = False) -> Status | None:
        status: Status | None = self._call("forget", key, force=force)
        return status

    def close(self) -> None:
        if self._loop is not None:
            # End the loop as asyncio.run does, so stores that keep per-loop connections
            # (closed when the loop shuts its async generators down) release them.
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()


def claim_in_process(url: str, namespace: str, key: str, barrier: Any, results: Any) -> None:
    """Open *url* in this (child) process, wait at *barrier*, claim *key*, report the answer."""
    store = open_store(url, namespace=namespace)
    try:
        barrier.wait(timeout=60)
        answer = store.claim(key, "fp", lease=timedelta(minutes=1), ttl=timedelta(minutes=5))
        results.put(type(answer).__name__)
    except BaseException as exc:
        results.put(f"error: {exc!r}")
        raise
    finally:
        store.close()
