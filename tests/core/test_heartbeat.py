"""Heartbeats: concurrent sync extends, late extend answers, and forked children."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

import oncely
from oncely import (
    Acquired,
    Guard,
    InProgress,
    LeaseLost,
    LeaseLostError,
    Status,
    Store,
    StoreUnavailableError,
)
from oncely._execution import heartbeat
from oncely._execution.lease import Lease
from oncely.stores.memory import MemoryStore
from oncely.stores.redis import RedisStore
from tests._helpers import eventually
from tests.conftest import service_url


class _Wrapped:
    """Passes every verb on to a real store; subclasses make some of them misbehave."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _StallsOneKey(_Wrapped):
    """A store whose extends of one key hang until `unstall`; counts the others' extends."""

    def __init__(self, inner: Store, stalled: str) -> None:
        super().__init__(inner)
        self.stalled = stalled
        self.stalling = threading.Event()
        self._gate = threading.Event()
        self._lock = threading.Lock()
        self.extended: dict[str, int] = {}

    def unstall(self) -> None:
        self._gate.set()

    def extend(self, key: str, token: int, *, lease: timedelta) -> LeaseLost | None:
        if key == self.stalled and not self._gate.is_set():
            self.stalling.set()
            self._gate.wait(60)
        answer = self.inner.extend(key, token, lease=lease)
        if answer is None:
            with self._lock:
                self.extended[key] = self.extended.get(key, 0) + 1
        return answer

    def count(self, key: str) -> int:
        with self._lock:
            return self.extended.get(key, 0)


@pytest.fixture
def redis_store() -> Iterator[RedisStore]:
    url = service_url("ONCELY_TEST_REDIS_URL")
    with RedisStore(url, namespace=f"t{uuid.uuid4().hex[:12]}") as store:
        yield store


@pytest.mark.redis
def test_a_stalled_extend_holds_up_no_other_lease(redis_store: RedisStore) -> None:
    """One key's extend hangs; the other sync leases are still extended: none is taken over."""
    lease = timedelta(seconds=1.5)  # a beat every 0.5 s, a second of slack for a loaded machine
    keys = [f"job-{n}" for n in range(6)]
    store = _StallsOneKey(redis_store, f"guard|{keys[0]}")
    finish = threading.Event()
    entered = threading.Barrier(len(keys) + 1)
    errors: dict[str, BaseException] = {}

    def job(key: str) -> None:
        try:
            with Guard(store, key, scope="guard", lease=lease, ttl=60):  # type: ignore[arg-type]
                entered.wait(10)
                finish.wait(60)
        except BaseException as exc:
            errors[key] = exc

    threads = [threading.Thread(target=job, args=(key,)) for key in keys]
    for thread in threads:
        thread.start()
    try:
        entered.wait(10)
        assert store.stalling.wait(10)
        others = [f"guard|{key}" for key in keys[1:]]
        start = {key: store.count(key) for key in others}
        # Probe the others while each of them is extended seven more times (over two leases
        # while the stalled extend hangs): a claim must find every one of them still running.
        deadline = time.monotonic() + 30
        while any(store.count(key) < start[key] + 7 for key in others):
            assert time.monotonic() < deadline, "the other leases were not extended"
            for key in others:
                answer = redis_store.claim(key, "", lease=lease, ttl=timedelta(seconds=60))
                assert isinstance(answer, InProgress), f"{key} was taken over: {answer!r}"
            time.sleep(0.1)
    finally:
        store.unstall()
        finish.set()
        for thread in threads:
            thread.join(30)
    # The stalled key's lease may have lapsed (its extends hung): it learns that at complete.
    assert set(errors) <= {keys[0]}
    assert all(isinstance(error, LeaseLostError) for error in errors.values())


class _FirstExtendHangs(_Wrapped):
    """A store whose first extend hangs (until the test ends); counts the successful ones."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.hanging = threading.Event()
        self.gate = threading.Event()
        self.extended = 0

    def extend(self, key: str, token: int, *, lease: timedelta) -> LeaseLost | None:
        if not self.hanging.is_set():
            self.hanging.set()
            self.gate.wait(60)
        answer = self.inner.extend(key, token, lease=lease)
        self.extended += answer is None
        return answer

    async def aextend(self, key: str, token: int, *, lease: timedelta) -> LeaseLost | None:
        if not self.hanging.is_set():
            self.hanging.set()
            await asyncio.Event().wait()  # only a cancellation ends it
        answer = await self.inner.aextend(key, token, lease=lease)
        self.extended += answer is None
        return answer


def _probe_until_extended(store: _FirstExtendHangs, key: str, lease: timedelta) -> None:
    """Claim *key* every 0.1 s until it has been extended five times (over two leases)."""
    deadline = time.monotonic() + 30
    while store.extended < 5:
        assert time.monotonic() < deadline, "the lease was not extended"
        answer = store.inner.claim(key, "", lease=lease, ttl=timedelta(seconds=60))
        assert isinstance(answer, InProgress), f"{key} was taken over: {answer!r}"
        time.sleep(0.1)


@pytest.mark.redis
def test_the_next_beat_retries_a_hung_sync_extend(redis_store: RedisStore) -> None:
    """A sync extend that never answers is a failed beat: the next one keeps the lease."""
    lease = timedelta(seconds=1.5)
    store = _FirstExtendHangs(redis_store)
    try:
        with Guard(store, "k", scope="guard", lease=lease, ttl=60) as guard:  # type: ignore[arg-type]
            _probe_until_extended(store, "guard|k", lease)
        assert store.hanging.is_set()
        assert not guard.lease_lost
    finally:
        store.gate.set()


@pytest.mark.redis
def test_the_next_beat_retries_a_hung_async_extend(redis_store: RedisStore) -> None:
    """An async extend that never answers is cancelled at its timeout and sent again."""
    lease = timedelta(seconds=1.5)
    store = _FirstExtendHangs(redis_store)

    async def main() -> Guard:
        async with Guard(store, "k", scope="guard", lease=lease, ttl=60) as guard:  # type: ignore[arg-type]
            await asyncio.to_thread(_probe_until_extended, store, "guard|k", lease)
        return guard

    guard = asyncio.run(main())
    assert store.hanging.is_set()
    assert not guard.lease_lost


class _ExtendLandsAfterComplete(_Wrapped):
    """A store whose first extend reaches the record only after complete has been applied."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.extending = threading.Event()
        self.completed = threading.Event()
        self.answers: list[LeaseLost | None] = []
        self.aextending = asyncio.Event()
        self.acompleted = asyncio.Event()
        self.aanswered = asyncio.Event()

    def extend(self, key: str, token: int, *, lease: timedelta) -> LeaseLost | None:
        if self.answers:
            return self.inner.extend(key, token, lease=lease)
        self.extending.set()
        assert self.completed.wait(10)
        answer = self.inner.extend(key, token, lease=lease)
        self.answers.append(answer)
        return answer

    def complete(self, key: str, token: int, result: bytes, *, ttl: timedelta) -> LeaseLost | None:
        answer = self.inner.complete(key, token, result, ttl=ttl)
        self.completed.set()
        return answer

    async def aextend(self, key: str, token: int, *, lease: timedelta) -> LeaseLost | None:
        if self.answers:
            return await self.inner.aextend(key, token, lease=lease)
        self.aextending.set()
        await self.acompleted.wait()
        answer = await self.inner.aextend(key, token, lease=lease)
        self.answers.append(answer)
        self.aanswered.set()
        return answer

    async def acomplete(
        self, key: str, token: int, result: bytes, *, ttl: timedelta
    ) -> LeaseLost | None:
        answer = await self.inner.acomplete(key, token, result, ttl=ttl)
        self.acompleted.set()
        await self.aanswered.wait()  # the extend's answer reaches the heartbeat first
        return answer


def _lease_lost_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "lease lost" in r.getMessage()]


def test_an_extend_answered_after_complete_is_not_a_lost_lease(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Sync: an extend in flight when complete lands answers LeaseLost; that is no lost lease."""
    store = _ExtendLandsAfterComplete(MemoryStore())
    with caplog.at_level(logging.INFO, logger="oncely"):
        with Guard(store, "k", scope="guard", lease=0.6, ttl=60) as guard:  # type: ignore[arg-type]
            assert store.extending.wait(10)
            guard.complete("done")
        eventually(lambda: store.answers)
        eventually(heartbeat.SCHEDULER.idle)
    assert store.answers == [LeaseLost()]
    assert not guard.lease_lost
    assert _lease_lost_lines(caplog) == []
    record = store.inner.get("guard|k")
    assert record is not None
    assert record.status is Status.COMPLETED


def test_an_async_extend_answered_after_complete_is_not_a_lost_lease(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Async: the same race, with the heartbeat task handling the answer before it is stopped."""
    store = _ExtendLandsAfterComplete(MemoryStore())

    async def main() -> Guard:
        async with Guard(store, "k", scope="guard", lease=0.6, ttl=60) as guard:  # type: ignore[arg-type]
            await store.aextending.wait()
            await guard.acomplete("done")
        return guard

    with caplog.at_level(logging.INFO, logger="oncely"):
        guard = asyncio.run(main())
    assert store.answers == [LeaseLost()]
    assert not guard.lease_lost
    assert _lease_lost_lines(caplog) == []


def _child_runs_a_long_guard(path: str) -> None:
    store = MemoryStore()
    with Guard(store, "child", scope="guard", lease=0.6, ttl=60) as guard:
        answer = None
        for _ in range(4):  # over two leases: the child's heartbeat must extend it
            time.sleep(0.3)
            answer = store.claim("guard|child", "", lease=timedelta(seconds=1), ttl=timedelta(1))
            assert isinstance(answer, InProgress), answer
        guard.complete(answer is not None)
    with open(path, "w") as out:
        out.write("ok")


def test_a_forked_child_beats_on_its_own(tmp_path: Any) -> None:
    """A child forked while the parent's heartbeats run gets a scheduler of its own."""
    store = MemoryStore()
    path = str(tmp_path / "child.txt")
    with Guard(store, "parent", scope="guard", lease=0.6, ttl=60) as guard:
        eventually(lambda: store.get("guard|parent") and _extended(store, "guard|parent"))
        process = multiprocessing.get_context("fork").Process(
            target=_child_runs_a_long_guard, args=(path,)
        )
        process.start()
        process.join(30)
        guard.complete(os.getpid())
    assert process.exitcode == 0
    with open(path) as made:
        assert made.read() == "ok"
    assert not guard.lease_lost


def _extended(store: MemoryStore, key: str) -> bool:
    record = store.get(key)
    return record is not None and record.updated_at_ms > record.created_at_ms


class _CompleteDownFourTimes(_Wrapped):
    """A store unreachable for the first four completes; each attempt probes the lease."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.attempts = 0
        self.probes: list[object] = []

    def _attempt(self, key: str) -> None:
        self.attempts += 1
        if self.attempts <= 4:  # the retries span over 1.7 s: longer than the lease
            probe = self.inner.claim(key, "", lease=timedelta(seconds=1), ttl=timedelta(1))
            self.probes.append(probe)
            raise StoreUnavailableError("down", backend="test")

    def complete(self, key: str, token: int, result: bytes, *, ttl: timedelta) -> LeaseLost | None:
        self._attempt(key)
        return self.inner.complete(key, token, result, ttl=ttl)

    async def acomplete(
        self, key: str, token: int, result: bytes, *, ttl: timedelta
    ) -> LeaseLost | None:
        self._attempt(key)
        return await self.inner.acomplete(key, token, result, ttl=ttl)


def test_the_heartbeat_goes_on_while_complete_is_retried() -> None:
    """Sync and async: retrying a complete for longer than the lease does not lose it."""
    store = _CompleteDownFourTimes(MemoryStore())
    with Guard(store, "k", scope="guard", lease=0.6, ttl=60) as guard:  # type: ignore[arg-type]
        guard.complete(1)
    assert not guard.lease_lost
    assert len(store.probes) == 4
    assert all(isinstance(p, InProgress) for p in store.probes), store.probes

    astore = _CompleteDownFourTimes(MemoryStore())

    async def main() -> Guard:
        async with Guard(astore, "k", scope="guard", lease=0.6, ttl=60) as aguard:  # type: ignore[arg-type]
            await aguard.acomplete(1)
        return aguard

    assert not asyncio.run(main()).lease_lost
    assert len(astore.probes) == 4
    assert all(isinstance(p, InProgress) for p in astore.probes), astore.probes


class _SlowExtends(MemoryStore):
    """Every async extend answers a little later than a beat: too slow for the beat's timeout,
    in time for the lease (a store behind a slow network)."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    async def aextend(self, key: str, token: int, *, lease: timedelta) -> Any:
        await asyncio.sleep(self.delay)
        return await super().aextend(key, token, lease=lease)


def test_slow_async_extends_still_keep_the_lease() -> None:
    """An extend slower than a beat but faster than the lease is waited for, not cancelled:
    cancelled, none would ever land (and on a real driver the cancel costs the connection)."""
    lease = 0.6
    store = _SlowExtends(delay=lease / 3 * 1.25)

    async def main() -> list[Any]:
        answers: list[Any] = []
        async with Guard(store, "k", lease=lease) as guard:
            for _ in range(6):  # three leases: only the heartbeat keeps it
                await asyncio.sleep(lease / 2)
                answers.append(
                    await store.aclaim(
                        guard.key, "", lease=timedelta(seconds=lease), ttl=timedelta(hours=1)
                    )
                )
            guard.complete("done")
        return answers

    answers = asyncio.run(main())
    assert all(isinstance(answer, InProgress) for answer in answers), answers


def test_heartbeats_of_ended_calls_do_not_pile_up() -> None:
    """Each call leaves a beat in a heap, due a third of a lease later; the stopped ones are
    compacted away, so the heap follows the calls in flight, not those of the last interval."""
    store = MemoryStore()
    calls = 3 * heartbeat._COMPACT_AT

    @oncely.idempotent(store=store, key="key", lease=30, ttl=60)
    def sync(key: str) -> int:
        return 1

    @oncely.idempotent(store=store, key="key", lease=30, ttl=60)
    async def async_(key: str) -> int:
        return 1

    for index in range(calls):
        sync(f"s{index}")
    assert len(heartbeat.SCHEDULER._timers) < calls * 3 / 4

    async def many() -> int:
        for index in range(calls):
            await async_(f"a{index}")
        return len(heartbeat._STARTS.by_loop[asyncio.get_running_loop()].due)

    assert asyncio.run(many()) < calls * 3 / 4


class _CountedCondition:
    """A condition whose ``notify`` calls are counted (the timer thread's wake-ups)."""

    def __init__(self, inner: threading.Condition) -> None:
        self.inner = inner
        self.notified = 0

    def notify(self, n: int = 1) -> None:
        self.notified += 1
        self.inner.notify(n)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_sequential_calls_do_not_wake_the_timer_thread() -> None:
    """A call's beat is due a lease's third after it starts, after every beat already in the
    heap: the timer thread, asleep until the first of those, has no reason to wake (even when
    the stopped beats were compacted away, the heap left empty), so a sequential caller pays
    no thread wake-up, only the first call does."""
    scheduler = heartbeat._HeartbeatScheduler()
    counted = _CountedCondition(scheduler._timer_wakeup)
    scheduler._timer_wakeup = counted  # type: ignore[assignment]
    store = MemoryStore()
    for index in range(6 * heartbeat._COMPACT_AT):
        lease = Lease(f"k{index}", 1, timedelta(seconds=30))
        lease.heartbeat = scheduler.start(store, lease)
        scheduler.stop(lease)
    assert counted.notified <= 1


def test_a_beat_due_before_the_timer_wakes_still_wakes_it() -> None:
    """A short lease started while the timer sleeps until a long lease's beat is extended on
    time."""
    store = MemoryStore()
    long = store.claim("long", "", lease=timedelta(seconds=60), ttl=timedelta(seconds=60))
    short = store.claim("short", "", lease=timedelta(seconds=1), ttl=timedelta(seconds=60))
    assert isinstance(long, Acquired)
    assert isinstance(short, Acquired)
    scheduler = heartbeat._HeartbeatScheduler()
    slow = Lease("long", long.token, timedelta(seconds=60))
    slow.heartbeat = scheduler.start(store, slow)
    eventually(lambda: scheduler._timer_running)
    time.sleep(0.05)  # the timer thread is asleep until the long lease's beat
    quick = Lease("short", short.token, timedelta(seconds=1))
    quick.heartbeat = scheduler.start(store, quick)
    try:
        time.sleep(2.5)  # two and a half of its lease: expired unless extended
        assert isinstance(
            store.claim("short", "", lease=timedelta(1), ttl=timedelta(1)), InProgress
        )
    finally:
        scheduler.stop(quick)
        scheduler.stop(slow)
