"""The optional batch verbs: claim_many and complete_many answer as the verbs one by one."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest

from oncely._core.clock import FrozenClock
from oncely._core.protocols import BatchStore, Store
from oncely._core.records import Acquired, InProgress, LeaseLost, Mismatch, Replay, Status
from oncely.stores._batch import takes_ops
from oncely.testing._base import SuiteBase
from oncely.testing._calls import StoreCalls


class BatchChecks(SuiteBase):
    """claim_many and complete_many, and their races."""

    # -- batch verbs -----------------------------------------------------------------------------

    def _batch_api(self, api: StoreCalls) -> StoreCalls:
        if not self.batch_verbs:
            assert not isinstance(api.store, BatchStore)
            pytest.skip("the store declares no batch verbs (batch_verbs = False)")
        assert isinstance(api.store, BatchStore)
        return api

    def test_batch_of_nothing_is_nothing(self, api: StoreCalls) -> None:
        """claim_many([]) and complete_many([]) answer [] (and send nothing)."""
        api = self._batch_api(api)
        assert api.claim_many([], lease=self.short_lease, ttl=self.ttl) == []
        assert api.complete_many([], ttl=self.ttl) == []

    def test_batch_claim_answers_as_claims_one_by_one(self, api: StoreCalls, key: str) -> None:
        """Every row of the claim table in one batch: each item answered as `claim` would."""
        api = self._batch_api(api)
        keys = {
            name: f"{key}-{name}" for name in ("new", "busy", "done", "failed", "other", "freed")
        }
        held = api.claim(keys["busy"], "fp", lease=self.live_lease, ttl=self.ttl)
        assert isinstance(held, Acquired)
        token = self._acquire(api, keys["done"]).token
        api.complete(keys["done"], token, b"\x00done", ttl=self.ttl)
        token = self._acquire(api, keys["failed"]).token
        api.fail(keys["failed"], token, b"declined", ttl=self.ttl)
        self._acquire(api, keys["other"], "fp-1")
        token = self._acquire(api, keys["freed"]).token
        api.release(keys["freed"], token)
        requests = [
            (keys["new"], "fp"),
            (keys["busy"], "fp"),
            (keys["done"], "fp"),
            (keys["failed"], "fp"),
            (keys["other"], "fp-2"),
            (keys["freed"], "fp"),
        ]
        answers = api.claim_many(requests, lease=self.short_lease, ttl=self.ttl)
        assert len(answers) == len(requests)
        new, busy, done, failed, other, freed = answers
        assert new == Acquired(1, recovered=False, attempt=1)
        assert isinstance(busy, InProgress)
        assert timedelta(0) < busy.retry_after <= self.live_lease
        assert isinstance(done, Replay)
        assert (done.record.key, done.record.status, done.record.result) == (
            keys["done"],
            Status.COMPLETED,
            b"\x00done",
        )
        assert isinstance(failed, Replay)
        assert (failed.record.status, failed.record.result) == (Status.FAILED, b"declined")
        assert other == Mismatch(stored_fingerprint="fp-1")
        assert freed == Acquired(2, recovered=False, attempt=2)
        record = api.get(keys["new"])
        assert record is not None
        assert (record.status, record.token, record.fingerprint) == (Status.IN_PROGRESS, 1, "fp")

    def test_batch_claim_of_one_key_twice_sees_the_first(self, api: StoreCalls, key: str) -> None:
        """A key twice in one batch: the second copy answers as a claim after the first."""
        api = self._batch_api(api)
        answers = api.claim_many(
            [(key, "fp"), (key, "fp"), (key, "fp-2")], lease=self.short_lease, ttl=self.ttl
        )
        assert answers[0] == Acquired(1, recovered=False, attempt=1)
        assert isinstance(answers[1], InProgress)
        assert answers[2] == Mismatch(stored_fingerprint="fp")

    def test_batch_claim_recovers_expired_leases(
        self, api: StoreCalls, key: str, wait: Callable[[timedelta], None]
    ) -> None:
        """An expired lease in a batch is recovered (token + 1, attempt + 1)."""
        api = self._batch_api(api)
        self._acquire(api, key)
        wait(self.short_lease + timedelta(milliseconds=50))
        answers = api.claim_many([(key, "fp")], lease=self.short_lease, ttl=self.ttl)
        assert answers == [Acquired(2, recovered=True, attempt=2)]

    def test_batch_claim_sent_again_with_its_call_ids_answers_as_the_first(
        self, api: StoreCalls, key: str, wait: Callable[[timedelta], None]
    ) -> None:
        """A batch claim sent again with the same call ids (``ops``), as after a reply that
        never came, gets its own leases back as the first send answered them (Acquired, same
        token, recovered or not); other ids find the lease taken (InProgress)."""
        api = self._batch_api(api)
        if not self.batch_call_ids:
            assert not takes_ops(getattr(api.store, "claim_many", None))
            pytest.skip("the store's batch claims take no call ids (batch_call_ids = False)")
        fresh, expired = f"{key}-fresh", f"{key}-expired"
        self._acquire(api, expired)
        wait(self.short_lease + timedelta(milliseconds=50))
        requests = [(fresh, "fp"), (expired, "fp")]
        ops = [uuid.uuid4().hex, uuid.uuid4().hex]
        first = api.claim_many(requests, lease=self.lease, ttl=self.ttl, ops=ops)
        assert first == [
            Acquired(1, recovered=False, attempt=1),
            Acquired(2, recovered=True, attempt=2),
        ]
        again = api.claim_many(requests, lease=self.lease, ttl=self.ttl, ops=ops)
        assert again == first
        others = api.claim_many(
            requests, lease=self.lease, ttl=self.ttl, ops=[uuid.uuid4().hex, uuid.uuid4().hex]
        )
        assert all(isinstance(answer, InProgress) for answer in others), others
        # The ids answer only for the lease they took: once it is settled, they are a claim
        # like any other.
        assert api.complete(fresh, 1, b"done", ttl=self.ttl) is None
        (replay,) = api.claim_many([(fresh, "fp")], lease=self.lease, ttl=self.ttl, ops=ops[:1])
        assert isinstance(replay, Replay)

    def test_batch_complete_answers_as_completes_one_by_one(
        self, api: StoreCalls, key: str
    ) -> None:
        """complete_many: the holder's items complete, wrong tokens and absent keys are
        LeaseLost, a second completion of one key in the batch is LeaseLost."""
        api = self._batch_api(api)
        first, second, third = f"{key}-1", f"{key}-2", f"{key}-3"
        claimed = api.claim_many(
            [(first, "fp"), (second, "fp"), (third, "fp")], lease=self.short_lease, ttl=self.ttl
        )
        tokens = [answer.token for answer in claimed]
        answers = api.complete_many(
            [
                (first, tokens[0], b"one"),
                (second, tokens[1] + 1, b"wrong token"),
                (third, tokens[2], b""),
                (f"{key}-absent", 1, b"nobody"),
                (first, tokens[0], b"twice"),
            ],
            ttl=self.ttl,
        )
        assert answers == [None, LeaseLost(), None, LeaseLost(), LeaseLost()]
        done, busy, empty = api.get(first), api.get(second), api.get(third)
        assert done is not None
        assert (done.status, done.result) == (Status.COMPLETED, b"one")
        assert busy is not None
        assert (busy.status, busy.token) == (Status.IN_PROGRESS, tokens[1])
        assert empty is not None
        assert (empty.status, empty.result) == (Status.COMPLETED, b"")
        assert api.get(f"{key}-absent") is None
        replays = api.claim_many(
            [(first, "fp"), (third, "fp")], lease=self.short_lease, ttl=self.ttl
        )
        assert [answer.record.result for answer in replays] == [b"one", b""]

    def test_batch_of_many_items(self, api: StoreCalls, key: str) -> None:
        """A batch of 1000 keys, binary results included, round-trips in order."""
        api = self._batch_api(api)
        keys = [f"{key}-{index}" for index in range(1000)]
        claimed = api.claim_many(
            [(k, f"fp{i}") for i, k in enumerate(keys)], lease=self.lease, ttl=self.ttl
        )
        assert all(answer == Acquired(1, recovered=False, attempt=1) for answer in claimed)
        results = [index.to_bytes(2, "big") + b"\x00\xff" for index in range(len(keys))]
        items = [(k, 1, result) for k, result in zip(keys, results, strict=True)]
        assert api.complete_many(items, ttl=self.ttl) == [None] * len(keys)
        replays = api.claim_many(
            [(k, f"fp{i}") for i, k in enumerate(keys)], lease=self.lease, ttl=self.ttl
        )
        assert [answer.record.result for answer in replays] == results
        assert [answer.record.key for answer in replays] == keys

    def test_batch_namespaces_are_isolated(self, store: Store, clock: FrozenClock | None) -> None:
        """Batches in one namespace never see another namespace's records."""
        if not self.batch_verbs:
            pytest.skip("the store declares no batch verbs (batch_verbs = False)")
        assert isinstance(store, BatchStore)
        other = self.open_store(clock, f"other{uuid.uuid4().hex[:8]}")
        try:
            assert isinstance(other, BatchStore)
            mine = store.claim_many([("shared", "fp")], lease=self.lease, ttl=self.ttl)
            theirs = other.claim_many([("shared", "fp")], lease=self.lease, ttl=self.ttl)
            assert mine == theirs == [Acquired(1, recovered=False, attempt=1)]
        finally:
            other.close()

    def test_batch_race_threads_exactly_one_acquires_each_key(self, store: Store, key: str) -> None:
        """Threads claim overlapping batches of the same keys in different orders at once:
        every key is Acquired exactly once, and no batch deadlocks or fails."""
        if not self.batch_verbs:
            pytest.skip("the store declares no batch verbs (batch_verbs = False)")
        assert isinstance(store, BatchStore)
        keys = [f"{key}-{index}" for index in range(40)]
        racers = min(self.racers, 16)
        barrier = threading.Barrier(racers)

        def claim(racer: int) -> list[tuple[str, Any]]:
            order = keys[racer % len(keys) :] + keys[: racer % len(keys)]
            if racer % 2:
                order.reverse()
            barrier.wait(timeout=60)
            answers = store.claim_many(
                [(k, "fp") for k in order], lease=timedelta(minutes=1), ttl=self.ttl
            )
            return list(zip(order, answers, strict=True))

        with ThreadPoolExecutor(max_workers=racers) as pool:
            results = [pair for answers in pool.map(claim, range(racers)) for pair in answers]
        assert all(isinstance(answer, (Acquired, InProgress)) for _, answer in results), results
        acquired = sorted(k for k, answer in results if isinstance(answer, Acquired))
        assert acquired == sorted(keys)

    def test_batch_race_async_tasks_exactly_one_acquires_each_key(
        self, store: Store, key: str
    ) -> None:
        """asyncio tasks claim overlapping batches at once: every key Acquired exactly once."""
        if not self.batch_verbs:
            pytest.skip("the store declares no batch verbs (batch_verbs = False)")
        assert isinstance(store, BatchStore)
        keys = [f"{key}-{index}" for index in range(40)]

        async def race() -> list[list[Any]]:
            return await asyncio.gather(
                *(
                    store.aclaim_many(
                        [(k, "fp") for k in (keys if racer % 2 else keys[::-1])],
                        lease=timedelta(minutes=1),
                        ttl=self.ttl,
                    )
                    for racer in range(16)
                )
            )

        answers = [answer for batch in asyncio.run(race()) for answer in batch]
        assert all(isinstance(answer, (Acquired, InProgress)) for answer in answers), answers
        assert sum(isinstance(answer, Acquired) for answer in answers) == len(keys)
