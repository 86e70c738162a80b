"""The conformance suite, run against every built-in store in sync and async use."""

from __future__ import annotations

from pathlib import Path

import pytest

from oncely import Store
from oncely.stores.memory import MemoryStore
from oncely.stores.sqlite import SQLiteStore
from oncely.stores.tiered import TieredStore
from oncely.testing import FrozenClock, StoreConformance


class TestMemoryStore(StoreConformance):
    def open_store(self, clock: FrozenClock | None, namespace: str) -> Store:
        return MemoryStore(clock=clock, namespace=namespace)

    # A memory store lives in one process: there is nothing to race across processes.
    test_claim_race_processes_exactly_one_acquires = None  # type: ignore[assignment]


class TestSQLiteStore(StoreConformance):
    @pytest.fixture(autouse=True)
    def _database(self, tmp_path: Path) -> None:
        self.path = tmp_path / "oncely.db"

    def store_url(self) -> str:
        return f"sqlite:///{self.path}"

    def open_store(self, clock: FrozenClock | None, namespace: str) -> Store:
        return SQLiteStore(self.path, clock=clock, namespace=namespace)


class TestSQLiteStoreWithoutDiskWaits(TestSQLiteStore):
    """synchronous="normal": async transitions run on the event loop's thread when they can."""

    def store_url(self) -> str:
        return f"sqlite:///{self.path}?synchronous=normal"

    def open_store(self, clock: FrozenClock | None, namespace: str) -> Store:
        return SQLiteStore(self.path, clock=clock, namespace=namespace, synchronous="normal")


class TestSQLiteInMemoryStore(StoreConformance):
    """sqlite:///:memory:: one connection under the store's lock, races included."""

    def store_url(self) -> str:
        return "sqlite:///:memory:"

    def open_store(self, clock: FrozenClock | None, namespace: str) -> Store:
        return SQLiteStore(":memory:", clock=clock, namespace=namespace)

    # An in-memory database lives in one process: there is nothing to race across processes.
    test_claim_race_processes_exactly_one_acquires = None  # type: ignore[assignment]


class TestTieredSQLiteStore(StoreConformance):
    @pytest.fixture(autouse=True)
    def _database(self, tmp_path: Path) -> None:
        self.path = tmp_path / "oncely.db"

    def store_url(self) -> str:
        return f"tiered+sqlite:///{self.path}"

    def open_store(self, clock: FrozenClock | None, namespace: str) -> Store:
        return TieredStore(SQLiteStore(self.path, clock=clock, namespace=namespace))
