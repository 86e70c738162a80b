"""What every group of conformance tests shares: the store's settings, fixtures and helpers."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, ClassVar

import pytest

from oncely._core.clock import FrozenClock
from oncely._core.protocols import Store
from oncely._core.records import Acquired
from oncely.stores import open_store
from oncely.testing._calls import StoreCalls


class SuiteBase:
    """The settings a store's subclass may change (see `StoreConformance`), and the fixtures."""

    controls_clock: ClassVar[bool] = True
    lease: ClassVar[timedelta] = timedelta(seconds=30)
    racers: ClassVar[int] = 64
    preload: ClassVar[tuple[str, ...]] = ()
    batch_verbs: ClassVar[bool] = True
    batch_call_ids: ClassVar[bool] = True
    check_verbs: ClassVar[bool] = True
    forget_verb: ClassVar[bool] = True

    def open_store(self, clock: FrozenClock | None, namespace: str) -> Store:
        """Return a fresh store using *clock* (when it controls one) and *namespace*."""
        return open_store(self.store_url(), namespace=namespace, clock=clock)

    def store_url(self) -> str:
        """Return a URL that other processes can open to reach the same records."""
        raise NotImplementedError

    # -- fixtures ------------------------------------------------------------------------------

    @pytest.fixture
    def clock(self) -> FrozenClock | None:
        return FrozenClock() if self.controls_clock else None

    @pytest.fixture
    def namespace(self) -> str:
        return f"t{uuid.uuid4().hex[:12]}"

    @pytest.fixture
    def store(self, clock: FrozenClock | None, namespace: str) -> Iterator[Store]:
        store = self.open_store(clock, namespace)
        yield store
        store.close()

    @pytest.fixture(params=["sync", "async"])
    def api(self, request: pytest.FixtureRequest, store: Store) -> Iterator[StoreCalls]:
        calls = StoreCalls(store, request.param)
        yield calls
        calls.close()

    @pytest.fixture
    def key(self) -> str:
        return f"key-{uuid.uuid4().hex}"

    @pytest.fixture
    def wait(self, clock: FrozenClock | None) -> Callable[[timedelta], None]:
        """Let *duration* pass on the store's clock."""

        def wait(duration: timedelta) -> None:
            if clock is not None:
                clock.advance(duration)
            else:
                time.sleep(duration.total_seconds())

        return wait

    @property
    def short_lease(self) -> timedelta:
        return self.lease if self.controls_clock else timedelta(milliseconds=300)

    @property
    def live_lease(self) -> timedelta:
        """A lease that a test which never waits for its end still finds live on a busy host."""
        return self.short_lease * 10

    ttl = timedelta(hours=1)

    def _acquire(self, api: StoreCalls, key: str, fingerprint: str = "fp") -> Acquired:
        answer = api.claim(key, fingerprint, lease=self.short_lease, ttl=self.ttl)
        assert isinstance(answer, Acquired), answer
        return answer

    def _settle(self, api: StoreCalls, verb: str, key: str, token: int) -> Any:
        if verb == "complete":
            return api.complete(key, token, b"r", ttl=self.ttl)
        if verb == "fail":
            return api.fail(key, token, b"e", ttl=self.ttl)
        if verb == "release":
            return api.release(key, token)
        return api.extend(key, token, lease=self.short_lease)
