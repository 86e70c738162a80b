"""The store conformance suite: every row of the state machine (docs/contract.md), run against
a real store.

Every test runs twice, through the sync verbs and through the async verbs. Stores that take an
injected clock (memory, SQLite) are driven by a `FrozenClock`; stores judged by a server's clock
use short leases and wait for them to pass.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import timedelta
from typing import Any, ClassVar

from oncely.errors import MissingDependencyError

try:
    import pytest
    from hypothesis import HealthCheck, settings
    from hypothesis import strategies as st
    from hypothesis.stateful import (
        Bundle,
        RuleBasedStateMachine,
        invariant,
        rule,
        run_state_machine_as_test,
    )
except ImportError as exc:
    raise MissingDependencyError(
        "StoreConformance needs pytest and hypothesis; install them with: "
        "pip install 'oncely[testing]'"
    ) from exc

from oncely._core import machine
from oncely._core.clock import FrozenClock
from oncely._core.protocols import BatchStore, CheckableStore, Store
from oncely._core.records import (
    Acquired,
    ClaimResult,
    InProgress,
    LeaseLost,
    Mismatch,
    Record,
    Replay,
    Status,
    StoreHealth,
)
from oncely.errors import ConflictError
from oncely.stores import open_store
from oncely.stores._batch import takes_ops

__all__ = ["StoreCalls", "StoreConformance", "claim_in_process"]


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


class StoreConformance:
    """Subclass in a pytest module and implement `open_store` (and `store_url` for processes).

    Attributes:
        controls_clock: The store judges time by the ``clock`` passed to `open_store`; when
            False it uses a server clock, and the suite waits for short leases to pass.
        lease: The lease used by tests that let it expire.
        racers: How many concurrent claimers the races use.
        preload: Modules the process race's forkserver imports once, so that 64 children do
            not each import the driver (effective when this class starts the forkserver).

        batch_verbs: The store has the optional `oncely.BatchStore` verbs, and the
            ``test_batch_*`` tests hold it to them (a store without them sets False: those
            tests then check that it does not pretend to have them).
        batch_call_ids: The store's ``claim_many`` takes the claims' call ids (``ops=``) and
            answers a batch sent again with them as the first send (every built-in store does;
            `CoalescingStore` relies on it after a lost reply). False: the test checks that
            it does not pretend to.
        check_verbs: The store has the optional `oncely.CheckableStore` probe, held to it by
            the ``test_check_*`` tests (False: they check that it does not pretend to).
        forget_verb: The store has the optional ``forget``/``aforget`` (every built-in store
            does; ``oncely forget`` needs it), held to it by the ``test_forget_*`` tests.

    A store that cannot be shared between processes (the memory store) sets
    ``test_claim_race_processes_exactly_one_acquires = None`` in its subclass.
    """

    # -- namespaces map (namespace, key) to records injectively ------------------------------
    # (session 4, storessql: kept here, apart from the additions at the end of the class)

    def test_namespaces_and_keys_never_share_a_record(
        self, clock: FrozenClock | None, namespace: str
    ) -> None:
        """Pairs whose plain ``namespace:key`` would be the same text are separate records:
        each is Acquired, completes with its own result and replays it under its own key; a
        named namespace's `scan` (where the store has one) lists its own record only."""
        pairs = [
            (namespace, "eu:x"),
            (f"{namespace}:eu", "x"),
            (f"{namespace}%3Aeu", "x"),
            (f"{namespace}|eu", "x"),
            ("", f"{namespace}:eu:x"),
            ("", f"|{namespace}:eu:x"),
            ("", f"{namespace}|eu:x"),
        ]
        stores = [self.open_store(clock, space) for space, _ in pairs]
        try:
            for store, (space, key) in zip(stores, pairs, strict=True):
                answer = store.claim(key, "fp", lease=self.lease, ttl=self.ttl)
                assert answer == Acquired(1, recovered=False, attempt=1), (space, key, answer)
            for index, (store, (_, key)) in enumerate(zip(stores, pairs, strict=True)):
                assert store.complete(key, 1, b"%d" % index, ttl=self.ttl) is None
            for index, (store, (space, key)) in enumerate(zip(stores, pairs, strict=True)):
                replay = store.claim(key, "fp", lease=self.lease, ttl=self.ttl)
                assert isinstance(replay, Replay), (space, key, replay)
                assert (replay.record.key, replay.record.result) == (key, b"%d" % index)
                scan = getattr(store, "scan", None)
                if space and scan is not None:
                    assert [record.key for record in scan(limit=10)] == [key], space
        finally:
            for store in stores:
                store.close()

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

    # -- claim ---------------------------------------------------------------------------------

    def test_claim_absent_key_is_acquired_with_token_1(self, api: StoreCalls, key: str) -> None:
        """claim on an absent key: in_progress, token 1, Acquired."""
        answer = self._acquire(api, key)
        assert answer == Acquired(1, recovered=False, attempt=1)
        record = api.get(key)
        assert record is not None
        assert (record.status, record.token, record.fingerprint) == (Status.IN_PROGRESS, 1, "fp")

    def test_claim_live_lease_same_fingerprint_is_in_progress(
        self, api: StoreCalls, key: str
    ) -> None:
        """claim while the lease is live: InProgress with the lease's remaining time."""
        assert isinstance(api.claim(key, "fp", lease=self.live_lease, ttl=self.ttl), Acquired)
        answer = api.claim(key, "fp", lease=self.short_lease, ttl=self.ttl)
        assert isinstance(answer, InProgress)
        assert timedelta(0) < answer.retry_after <= self.live_lease

    def test_claim_expired_lease_same_fingerprint_is_recovered(
        self, api: StoreCalls, key: str, wait: Callable[[timedelta], None]
    ) -> None:
        """claim after the lease expired: token + 1, attempt + 1, Acquired(recovered=True)."""
        self._acquire(api, key)
        wait(self.short_lease + timedelta(milliseconds=50))
        answer = api.claim(key, "fp", lease=self.short_lease, ttl=self.ttl)
        assert answer == Acquired(2, recovered=True, attempt=2)

    def test_claim_completed_same_fingerprint_replays(self, api: StoreCalls, key: str) -> None:
        """claim on a completed record: Replay of the record, result byte for byte."""
        token = self._acquire(api, key).token
        assert api.complete(key, token, b"\x00result\xff", ttl=self.ttl) is None
        answer = api.claim(key, "fp", lease=self.short_lease, ttl=self.ttl)
        assert isinstance(answer, Replay)
        assert answer.record.status is Status.COMPLETED
        assert answer.record.result == b"\x00result\xff"
        assert answer.record.key == key

    def test_claim_failed_same_fingerprint_replays(self, api: StoreCalls, key: str) -> None:
        """claim on a failed record: Replay of the stored error."""
        token = self._acquire(api, key).token
        assert api.fail(key, token, b"declined", ttl=self.ttl) is None
        answer = api.claim(key, "fp", lease=self.short_lease, ttl=self.ttl)
        assert isinstance(answer, Replay)
        assert (answer.record.status, answer.record.result) == (Status.FAILED, b"declined")

    @pytest.mark.parametrize("state", ["in_progress", "completed", "failed"])
    def test_claim_live_record_other_fingerprint_is_mismatch(
        self, api: StoreCalls, key: str, state: str
    ) -> None:
        """claim with another fingerprint on any live record: Mismatch, nothing changes."""
        token = self._acquire(api, key, "fp-1").token
        if state == "completed":
            api.complete(key, token, b"r", ttl=self.ttl)
        elif state == "failed":
            api.fail(key, token, b"e", ttl=self.ttl)
        before = api.get(key)
        answer = api.claim(key, "fp-2", lease=self.short_lease, ttl=self.ttl)
        assert answer == Mismatch(stored_fingerprint="fp-1")
        after = api.get(key)
        assert before is not None
        assert after is not None
        assert (after.status, after.token, after.fingerprint) == (
            before.status,
            before.token,
            before.fingerprint,
        )

    def test_claim_after_record_expiry_is_acquired_afresh(
        self, api: StoreCalls, key: str, wait: Callable[[timedelta], None]
    ) -> None:
        """claim on a record past its expiry: Acquired, not recovered, any fingerprint."""
        token = self._acquire(api, key).token
        short_ttl = self.short_lease * 2
        api.complete(key, token, b"old", ttl=short_ttl)
        wait(short_ttl + timedelta(milliseconds=50))
        assert api.get(key) is None
        answer = api.claim(key, "other-fp", lease=self.short_lease, ttl=self.ttl)
        assert isinstance(answer, Acquired)
        assert not answer.recovered
        assert answer.attempt == 1

    def test_claim_after_release_is_acquired_with_next_token(
        self, api: StoreCalls, key: str
    ) -> None:
        """A released key behaves as absent for claim but keeps its token."""
        token = self._acquire(api, key).token
        assert api.release(key, token) is None
        answer = api.claim(key, "fp", lease=self.short_lease, ttl=self.ttl)
        assert answer == Acquired(token + 1, recovered=False, attempt=2)

    def test_claim_after_release_accepts_another_fingerprint(
        self, api: StoreCalls, key: str
    ) -> None:
        """A released tombstone does not hold the old fingerprint against a new request."""
        token = self._acquire(api, key, "fp-1").token
        api.release(key, token)
        answer = api.claim(key, "fp-2", lease=self.short_lease, ttl=self.ttl)
        assert isinstance(answer, Acquired)
        assert answer.token == token + 1

    # -- settle --------------------------------------------------------------------------------

    @pytest.mark.parametrize("verb", ["complete", "fail", "release", "extend"])
    def test_settle_with_wrong_token_is_lease_lost(
        self, api: StoreCalls, key: str, verb: str
    ) -> None:
        """complete / fail / release / extend with a token that does not hold the lease."""
        token = self._acquire(api, key).token
        assert self._settle(api, verb, key, token + 1) == LeaseLost()
        record = api.get(key)
        assert record is not None
        assert (record.status, record.token) == (Status.IN_PROGRESS, token)

    @pytest.mark.parametrize("verb", ["complete", "fail", "release", "extend"])
    def test_settle_absent_key_is_lease_lost(self, api: StoreCalls, key: str, verb: str) -> None:
        """complete / fail / release / extend on an absent key: LeaseLost, nothing created."""
        assert self._settle(api, verb, key, 1) == LeaseLost()
        assert api.get(key) is None

    @pytest.mark.parametrize("first", ["complete", "fail", "release"])
    @pytest.mark.parametrize("verb", ["complete", "fail", "release", "extend"])
    def test_settle_after_settled_is_lease_lost(
        self, api: StoreCalls, key: str, first: str, verb: str
    ) -> None:
        """A lease settles once: any verb after complete, fail or release is LeaseLost."""
        token = self._acquire(api, key).token
        assert self._settle(api, first, key, token) is None
        before = api.get(key)
        assert self._settle(api, verb, key, token) == LeaseLost()
        after = api.get(key)
        assert before is not None
        assert after is not None
        assert (after.status, after.result) == (before.status, before.result)

    @pytest.mark.parametrize("verb", ["complete", "fail", "release", "extend"])
    def test_settle_after_takeover_is_lease_lost(
        self, api: StoreCalls, key: str, verb: str, wait: Callable[[timedelta], None]
    ) -> None:
        """A zombie whose lease was taken over cannot settle the new owner's record."""
        old = self._acquire(api, key).token
        wait(self.short_lease + timedelta(milliseconds=50))
        new = api.claim(key, "fp", lease=self.short_lease, ttl=self.ttl)
        assert isinstance(new, Acquired)
        assert new.recovered
        assert self._settle(api, verb, key, old) == LeaseLost()
        assert api.complete(key, new.token, b"mine", ttl=self.ttl) is None
        replay = api.claim(key, "fp", lease=self.short_lease, ttl=self.ttl)
        assert isinstance(replay, Replay)
        assert replay.record.result == b"mine"

    def test_complete_after_lease_expiry_without_takeover_succeeds(
        self, api: StoreCalls, key: str, wait: Callable[[timedelta], None]
    ) -> None:
        """A slow worker whose lease expired but was not taken over still holds the token."""
        token = self._acquire(api, key).token
        wait(self.short_lease + timedelta(milliseconds=50))
        assert api.complete(key, token, b"late", ttl=self.ttl) is None

    def test_extend_moves_the_lease_forward(
        self, api: StoreCalls, key: str, wait: Callable[[timedelta], None]
    ) -> None:
        """extend: a claim after the original lease's end still finds the lease live."""
        token = self._acquire(api, key).token
        wait(self.short_lease * 0.6)
        assert api.extend(key, token, lease=self.live_lease) is None
        wait(self.short_lease * 0.6)
        answer = api.claim(key, "fp", lease=self.short_lease, ttl=self.ttl)
        assert isinstance(answer, InProgress)

    def test_extend_on_expired_lease_before_takeover_succeeds(
        self, api: StoreCalls, key: str, wait: Callable[[timedelta], None]
    ) -> None:
        """extend after expiry, with no takeover yet, renews the lease for the same token."""
        token = self._acquire(api, key).token
        wait(self.short_lease + timedelta(milliseconds=50))
        assert api.extend(key, token, lease=self.live_lease) is None
        assert isinstance(api.claim(key, "fp", lease=self.short_lease, ttl=self.ttl), InProgress)

    def _settle(self, api: StoreCalls, verb: str, key: str, token: int) -> Any:
        if verb == "complete":
            return api.complete(key, token, b"r", ttl=self.ttl)
        if verb == "fail":
            return api.fail(key, token, b"e", ttl=self.ttl)
        if verb == "release":
            return api.release(key, token)
        return api.extend(key, token, lease=self.short_lease)

    # -- fencing -------------------------------------------------------------------------------

    def test_tokens_only_grow(
        self, api: StoreCalls, key: str, wait: Callable[[timedelta], None]
    ) -> None:
        """Tokens grow across release, takeover and completion-then-expiry of the lease."""
        tokens = [self._acquire(api, key).token]
        api.release(key, tokens[-1])
        tokens.append(self._acquire(api, key).token)
        wait(self.short_lease + timedelta(milliseconds=50))
        taken = api.claim(key, "fp", lease=self.short_lease, ttl=self.ttl)
        assert isinstance(taken, Acquired)
        tokens.append(taken.token)
        api.release(key, tokens[-1])
        tokens.append(self._acquire(api, key).token)
        assert tokens == sorted(set(tokens)), tokens
        assert tokens == [1, 2, 3, 4]

    # -- payloads ------------------------------------------------------------------------------

    def test_multi_mib_binary_result_round_trips(self, api: StoreCalls, key: str) -> None:
        """A 5 MiB result with every byte value replays byte for byte."""
        payload = os.urandom(5 * 1024 * 1024) + bytes(range(256)) + b"\x00" * 1024
        token = self._acquire(api, key).token
        assert api.complete(key, token, payload, ttl=self.ttl) is None
        answer = api.claim(key, "fp", lease=self.short_lease, ttl=self.ttl)
        assert isinstance(answer, Replay)
        assert answer.record.result == payload

    def test_empty_result_is_not_none(self, api: StoreCalls, key: str) -> None:
        """An empty result is stored as empty bytes, distinct from no result."""
        token = self._acquire(api, key).token
        api.complete(key, token, b"", ttl=self.ttl)
        answer = api.claim(key, "fp", lease=self.short_lease, ttl=self.ttl)
        assert isinstance(answer, Replay)
        assert answer.record.result == b""

    def test_keys_are_binary_safe_text(self, api: StoreCalls) -> None:
        """Keys with separators, quotes, braces and unicode do not collide or break the store."""
        keys = [f"{uuid.uuid4().hex}{suffix}" for suffix in ("|a", "{b}", "'c\"", "d:e", "é ü")]
        for key in keys:
            self._acquire(api, key)
        for key in keys:
            record = api.get(key)
            assert record is not None
            assert record.key == key

    def test_namespaces_are_isolated(self, store: Store, clock: FrozenClock | None) -> None:
        """Two stores with different namespaces over the same backend never see each other."""
        other = self.open_store(clock, f"other{uuid.uuid4().hex[:8]}")
        try:
            assert isinstance(
                store.claim("shared", "fp", lease=self.short_lease, ttl=self.ttl), Acquired
            )
            assert isinstance(
                other.claim("shared", "fp", lease=self.short_lease, ttl=self.ttl), Acquired
            )
        finally:
            other.close()

    # -- the readiness probe (session 5, storecheck) ----------------------------------------------

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

    # -- forget (session 5, storecheck) --------------------------------------------------------

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

    # -- races ---------------------------------------------------------------------------------

    def test_claim_race_threads_exactly_one_acquires(self, store: Store, key: str) -> None:
        """64 threads claim one key at once: exactly one is Acquired, the rest InProgress."""
        barrier = threading.Barrier(self.racers)

        def claim() -> ClaimResult:
            barrier.wait(timeout=60)
            return store.claim(key, "fp", lease=timedelta(minutes=1), ttl=self.ttl)

        with ThreadPoolExecutor(max_workers=self.racers) as pool:
            answers = list(pool.map(lambda _: claim(), range(self.racers)))
        acquired = [answer for answer in answers if isinstance(answer, Acquired)]
        assert len(acquired) == 1
        assert all(isinstance(a, (Acquired, InProgress)) for a in answers)

    def test_claim_race_async_tasks_exactly_one_acquires(self, store: Store, key: str) -> None:
        """64 asyncio tasks claim one key at once: exactly one is Acquired."""

        async def race() -> list[ClaimResult]:
            return await asyncio.gather(
                *(
                    store.aclaim(key, "fp", lease=timedelta(minutes=1), ttl=self.ttl)
                    for _ in range(self.racers)
                )
            )

        answers = asyncio.run(race())
        assert sum(isinstance(answer, Acquired) for answer in answers) == 1

    def test_claim_race_processes_exactly_one_acquires(self, namespace: str, key: str) -> None:
        """64 processes claim one key at once: exactly one is Acquired."""
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["oncely", "oncely._conformance", *self.preload])
        barrier = context.Barrier(self.racers)
        results = context.Queue()
        racers = [
            context.Process(
                target=claim_in_process,
                args=(self.store_url(), namespace, key, barrier, results),
            )
            for _ in range(self.racers)
        ]
        for racer in racers:
            racer.start()
        try:
            answers = [results.get(timeout=120) for _ in racers]
        finally:
            for racer in racers:
                racer.join(timeout=30)
            results.close()
            results.join_thread()
        assert answers.count("Acquired") == 1, answers
        assert set(answers) == {"Acquired", "InProgress"}, answers
        assert all(racer.exitcode == 0 for racer in racers)

    # -- model ---------------------------------------------------------------------------------

    def test_store_agrees_with_reference_machine(
        self, api: StoreCalls, clock: FrozenClock | None
    ) -> None:
        """Hypothesis drives the store and the pure state machine side by side: they agree."""
        run_state_machine_as_test(
            _model_machine(api, clock, self.lease),
            settings=settings(
                max_examples=25,
                stateful_step_count=25,
                deadline=None,
                suppress_health_check=list(HealthCheck),
            ),
        )

    # -- an in-progress record outlives its lease -----------------------------------------------
    # Tokens never repeat while a worker holding an older one may be alive: whatever the ttl,
    # an in-progress record stays at least max(ttl, lease) past the end of its lease (claim,
    # takeover, extend), so a claim after the lease lapsed takes over with the next token and
    # the zombie's complete is LeaseLost, instead of the key vanishing and restarting at 1.

    @property
    def _fence_lease(self) -> timedelta:
        """The lease of the tests below: on a server clock, long enough that a claim made
        just after it lapsed lands well inside the record's margin on a loaded machine."""
        return self.lease if self.controls_clock else timedelta(seconds=1)

    def _past(self, lease: timedelta) -> timedelta:
        return lease + timedelta(milliseconds=100)

    def _take_over(self, api: StoreCalls, key: str, previous: int) -> Acquired:
        answer = api.claim(key, "fp", lease=self._fence_lease, ttl=self._fence_lease)
        assert isinstance(answer, Acquired), answer
        assert answer.recovered, answer
        assert answer.token > previous, (answer, previous)
        return answer

    def _assert_zombie_is_fenced(self, api: StoreCalls, key: str, zombie: int, owner: int) -> None:
        assert api.complete(key, zombie, b"zombie", ttl=self.ttl) == LeaseLost()
        assert api.complete(key, owner, b"owner", ttl=self.ttl) is None
        replay = api.claim(key, "fp", lease=self._fence_lease, ttl=self.ttl)
        assert isinstance(replay, Replay)
        assert replay.record.result == b"owner"

    @pytest.mark.parametrize("ttl_share", [1.0, 0.5], ids=["ttl_equals_lease", "ttl_below_lease"])
    def test_record_outlives_its_lease_when_ttl_is_not_longer(
        self, api: StoreCalls, key: str, wait: Callable[[timedelta], None], ttl_share: float
    ) -> None:
        """ttl <= lease: after the lease lapses the next claimer gets a greater token, and the
        zombie holding the old one cannot complete its record."""
        lease = self._fence_lease
        first = api.claim(key, "fp", lease=lease, ttl=lease * ttl_share)
        assert isinstance(first, Acquired)
        wait(self._past(lease))
        second = self._take_over(api, key, first.token)
        self._assert_zombie_is_fenced(api, key, first.token, second.token)

    def test_record_outlives_a_lease_extended_past_the_ttl(
        self, api: StoreCalls, key: str, wait: Callable[[timedelta], None]
    ) -> None:
        """A heartbeat carries the lease past the ttl: the record outlives the extended lease."""
        lease = self._fence_lease
        first = api.claim(key, "fp", lease=lease, ttl=lease)
        assert isinstance(first, Acquired)
        assert api.extend(key, first.token, lease=lease * 1.5) is None
        wait(self._past(lease * 1.5))
        second = self._take_over(api, key, first.token)
        self._assert_zombie_is_fenced(api, key, first.token, second.token)

    def test_record_outlives_a_recovered_lease(
        self, api: StoreCalls, key: str, wait: Callable[[timedelta], None]
    ) -> None:
        """A takeover's lease ends past the record's first expiry: the record outlives it too."""
        lease = self._fence_lease
        first = api.claim(key, "fp", lease=lease, ttl=lease)
        assert isinstance(first, Acquired)
        wait(self._past(lease))
        second = self._take_over(api, key, first.token)
        wait(self._past(lease))
        third = self._take_over(api, key, second.token)
        assert api.complete(key, first.token, b"zombie", ttl=self.ttl) == LeaseLost()
        self._assert_zombie_is_fenced(api, key, second.token, third.token)

    @pytest.mark.parametrize("ttl_share", [0.5, 1.0, 4.0])
    def test_in_progress_record_expires_a_margin_past_its_lease(
        self, api: StoreCalls, key: str, ttl_share: float
    ) -> None:
        """The record's expiry is at least max(ttl, lease) past its lease's end, after a claim
        and after an extend (which keeps that margin past the new end)."""
        lease = self._fence_lease
        ttl = lease * ttl_share
        margin = max(ttl, lease) // timedelta(milliseconds=1)
        first = api.claim(key, "fp", lease=lease, ttl=ttl)
        assert isinstance(first, Acquired)
        record = api.get(key)
        assert record is not None
        assert record.expires_at_ms - record.lease_expires_at_ms >= margin, record
        assert api.extend(key, first.token, lease=lease * 2) is None
        extended = api.get(key)
        assert extended is not None
        assert extended.lease_expires_at_ms > record.lease_expires_at_ms
        assert extended.expires_at_ms - extended.lease_expires_at_ms >= margin, extended

    def test_a_settle_that_landed_is_recognised_by_its_record(
        self, api: StoreCalls, key: str
    ) -> None:
        """The one rule for a settle whose reply was lost (`oncely._core.machine.landed`), held
        against what this store keeps: sent again, the settle answers LeaseLost, and the record
        shows it landed for its own token, verb and result, and for nothing else."""
        ttl = timedelta(minutes=5)
        for verb in ("complete", "fail", "release"):
            name = f"{key}-{verb}"
            first = api.claim(name, "fp", lease=timedelta(seconds=30), ttl=ttl)
            assert isinstance(first, Acquired)
            assert not machine.landed(api.get(name), first.token)
            if verb == "release":
                assert api.release(name, first.token) is None
                again = api.release(name, first.token)
            else:
                settle = getattr(api, verb)
                assert settle(name, first.token, b"outcome", ttl=ttl) is None
                again = settle(name, first.token, b"outcome", ttl=ttl)
            assert isinstance(again, LeaseLost)
            record = api.get(name)
            result = None if verb == "release" else b"outcome"
            assert machine.landed(record, first.token)
            assert machine.landed(record, first.token, verb, result)
            assert not machine.landed(record, first.token + 1, verb, result)
            if result is not None:
                assert not machine.landed(record, first.token, verb, b"another outcome")
            other = "release" if verb != "release" else "complete"
            assert not machine.landed(record, first.token, other)


def _model_machine(
    api: StoreCalls, clock: FrozenClock | None, lease: timedelta
) -> type[RuleBasedStateMachine]:
    """A state machine class bound to one store; the reference machine is its oracle."""
    lease_ms = lease // timedelta(milliseconds=1)
    ttl_ms = lease_ms * 4
    # Without a controllable clock, time never matters: leases outlive the test.
    now = clock.now_ms if clock is not None else (lambda: 0)

    class StoreVersusModel(RuleBasedStateMachine):
        tokens = Bundle("tokens")

        def __init__(self) -> None:
            super().__init__()
            self.prefix = uuid.uuid4().hex[:10]
            self.model: dict[str, Record] = {}

        def _key(self, index: int) -> str:
            return f"{self.prefix}-{index}"

        def _apply(self, key: str, new: Record | None) -> None:
            if new is not None:
                self.model[key] = new

        @rule(target=tokens, index=st.integers(0, 2), fp=st.sampled_from(["a", "b"]))
        def claim(self, index: int, fp: str) -> int:
            key = self._key(index)
            found = self.model.get(key)
            new, expected = machine.claim(
                key, found, fp, now_ms=now(), lease_ms=lease_ms, ttl_ms=ttl_ms
            )
            actual: ClaimResult = api.claim(
                key,
                fp,
                lease=timedelta(milliseconds=lease_ms),
                ttl=timedelta(milliseconds=ttl_ms),
            )
            assert type(actual) is type(expected), (actual, expected)
            if (
                isinstance(expected, Acquired)
                and isinstance(actual, Acquired)
                and found is not None
                and not found.is_live(now())
                and actual.token == 1
                and new is not None
            ):
                # Past its expiry a record may be gone from the store (Redis TTL, a purge) or
                # still there: tokens restart at 1 or go on. Both are within the contract.
                new = replace(new, token=1)
                expected = replace(expected, token=1)
            self._apply(key, new)
            if isinstance(expected, Replay):
                assert isinstance(actual, Replay)
                got = actual.record
                assert (got.status, got.token, got.result, got.fingerprint) == (
                    expected.record.status,
                    expected.record.token,
                    expected.record.result,
                    expected.record.fingerprint,
                )
            elif isinstance(expected, InProgress):
                if clock is not None:
                    assert actual == expected
            else:
                assert actual == expected
            return expected.token if isinstance(expected, Acquired) else 0

        @rule(
            index=st.integers(0, 2),
            token=st.one_of(tokens, st.integers(0, 9)),
            verb=st.sampled_from(["complete", "fail", "release", "extend"]),
            payload=st.binary(max_size=16),
        )
        def settle(self, index: int, token: int, verb: str, payload: bytes) -> None:
            key = self._key(index)
            record = self.model.get(key)
            if verb == "complete":
                new, expected = machine.complete(
                    record, token, payload, now_ms=now(), ttl_ms=ttl_ms
                )
                actual = api.complete(key, token, payload, ttl=timedelta(milliseconds=ttl_ms))
            elif verb == "fail":
                new, expected = machine.fail(record, token, payload, now_ms=now(), ttl_ms=ttl_ms)
                actual = api.fail(key, token, payload, ttl=timedelta(milliseconds=ttl_ms))
            elif verb == "release":
                new, expected = machine.release(record, token, now_ms=now())
                actual = api.release(key, token)
            else:
                new, expected = machine.extend(record, token, now_ms=now(), lease_ms=lease_ms)
                actual = api.extend(key, token, lease=timedelta(milliseconds=lease_ms))
            self._apply(key, new)
            assert actual == expected, (verb, actual, expected)

        if clock is not None:

            @rule(ms=st.integers(0, lease_ms * 2))
            def advance(self, ms: int) -> None:
                assert clock is not None
                clock.advance(ms)

        @invariant()
        def records_agree(self) -> None:
            for index in range(3):
                key = self._key(index)
                expected = self.model.get(key)
                if expected is not None and not expected.is_live(now()):
                    expected = None
                actual = api.get(key)
                if expected is None or expected.status is Status.RELEASED:
                    assert actual is None or actual.status is Status.RELEASED
                else:
                    assert actual is not None
                    assert (actual.status, actual.token, actual.attempt, actual.result) == (
                        expected.status,
                        expected.token,
                        expected.attempt,
                        expected.result,
                    )

    return StoreVersusModel
