"""The optional verbs: the readiness probe, forget and scan."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import pytest

from oncely._core.protocols import CheckableStore, Store
from oncely._core.records import Acquired, LeaseLost, Record, Status, StoreHealth
from oncely.errors import ConflictError
from oncely.testing._base import SuiteBase
from oncely.testing._calls import StoreCalls


class ProbeChecks(SuiteBase):
    """check, forget and scan, held to the contract where the store declares them."""

    # -- the readiness probe -----------------------------------------------

    def _check_api(self, api: StoreCalls) -> StoreCalls:
        if not self.check_verbs:
            assert not isinstance(api.store, CheckableStore)
            pytest.skip("the store declares no check (check_verbs = False)")
        assert isinstance(api.store, CheckableStore)
        return api

    def test_check_answers_what_it_found(self, api: StoreCalls, key: str) -> None:
        """check() on a working store answers its backend, a schema version (``None`` for a
        store without a schema, else 1 or more) and a latency, and changes no record."""
        api = self._check_api(api)
        self._acquire(api, key)
        before = api.get(key)
        health = api.check()
        assert isinstance(health, StoreHealth)
        assert health.backend == getattr(api.store, "backend", None)
        assert health.schema_version is None or health.schema_version >= 1
        assert health.latency_ms >= 0
        assert api.get(key) == before
        assert api.check().schema_version == health.schema_version

    # -- forget ---------------------------------------------------------

    def _forget_api(self, api: StoreCalls) -> StoreCalls:
        if not self.forget_verb:
            assert getattr(api.store, "forget", None) is None
            pytest.skip("the store declares no forget (forget_verb = False)")
        return api

    def test_forget_a_finished_record_runs_the_next_claim(self, api: StoreCalls, key: str) -> None:
        """forget on a completed (or failed) record answers its status and leaves a released
        tombstone without its result that keeps the token: the next claim runs again with the
        next token. Forgetting again, or an absent key, answers None."""
        api = self._forget_api(api)
        for suffix, settle in (("c", api.complete), ("f", api.fail)):
            one = f"{key}-{suffix}"
            token = self._acquire(api, one).token
            assert settle(one, token, b"outcome", ttl=self.ttl) is None
            status = Status.COMPLETED if suffix == "c" else Status.FAILED
            assert api.forget(one) == status
            record = api.get(one)
            assert record is not None
            assert (record.status, record.token, record.result) == (Status.RELEASED, 1, None)
            assert api.forget(one) is None
            again = api.claim(one, "fp", lease=self.short_lease, ttl=self.ttl)
            assert again == Acquired(2, recovered=False, attempt=2), again
        assert api.forget(f"{key}-absent") is None

    def test_forget_refuses_an_in_progress_record_unless_forced(
        self, api: StoreCalls, key: str
    ) -> None:
        """An in-progress record is refused (ConflictError, nothing changes); forced, its
        lease ends: the worker's complete finds it lost, and the next claim runs again."""
        api = self._forget_api(api)
        token = self._acquire(api, key).token
        before = api.get(key)
        with pytest.raises(ConflictError, match="force"):
            api.forget(key)
        assert api.get(key) == before
        assert api.forget(key, force=True) == Status.IN_PROGRESS
        assert api.complete(key, token, b"late", ttl=self.ttl) == LeaseLost()
        again = api.claim(key, "fp", lease=self.short_lease, ttl=self.ttl)
        assert isinstance(again, Acquired), again
        assert again.token == token + 1

    def test_scan_pages_through_live_records_of_every_status(
        self, store: Store, key: str, wait: Callable[[timedelta], None]
    ) -> None:
        """scan (``oncely stats`` and ``leases`` page through it) lists the namespace's live
        records of every status in key order without results, in full pages until the last;
        an expired record is left out and does not shorten a page."""
        scan = getattr(store, "scan", None)
        if scan is None:
            pytest.skip("the store has no scan")
        api = StoreCalls(store, "sync")
        token = self._acquire(api, f"{key}-a").token
        api.complete(f"{key}-a", token, b"r", ttl=timedelta(milliseconds=300))
        token = self._acquire(api, f"{key}-b").token
        api.complete(f"{key}-b", token, b"r", ttl=self.ttl)
        token = self._acquire(api, f"{key}-c").token
        api.fail(f"{key}-c", token, b"e", ttl=self.ttl)
        api.claim(f"{key}-d", "fp", lease=self.ttl, ttl=self.ttl)
        token = self._acquire(api, f"{key}-e").token
        api.release(f"{key}-e", token)
        wait(timedelta(milliseconds=600))
        pages: list[list[Record]] = []
        after = ""
        while not pages or len(pages[-1]) == 2:
            pages.append(scan(after=after, limit=2))
            after = pages[-1][-1].key if pages[-1] else after
        assert [[record.key[-1] for record in page] for page in pages] == [
            ["b", "c"],
            ["d", "e"],
            [],
        ]
        statuses = [record.status for page in pages for record in page]
        assert statuses == [Status.COMPLETED, Status.FAILED, Status.IN_PROGRESS, Status.RELEASED]
        assert all(record.result is None for page in pages for record in page)
