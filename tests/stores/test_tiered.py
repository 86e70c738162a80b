"""Tiered specifics: which batch items the cache answers, inner stores without batch verbs,
cache expiry judged by the store's clock, and changes made elsewhere reaching the cache."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from oncely import Acquired, InProgress, Replay, Store
from oncely.errors import ConfigurationError, StoreUnavailableError
from oncely.stores import open_store
from oncely.stores.memory import MemoryStore
from oncely.stores.tiered import TieredStore
from oncely.testing import FrozenClock
from tests._helpers import eventually
from tests.conftest import service_url

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


class _HostClockBehind:
    """The host's wall clock, running *behind_ms* late (a host whose clock is behind)."""

    def __init__(self, behind_ms: int) -> None:
        self.behind_ms = behind_ms

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000 - self.behind_ms


def _replays(store: Store, key: str) -> bytes | None:
    answer = store.claim(key, "fp", lease=LEASE, ttl=TTL)
    return answer.record.result if isinstance(answer, Replay) else None


def test_cache_expiry_follows_the_store_clock_not_the_host_clock() -> None:
    """A host whose clock is ten minutes behind the store's caches a finished record; time
    passes, the record expires by the store's clock and runs again elsewhere: the host's next
    claim replays the new result, not its cached copy of the expired one (sync and async)."""
    for mode in ("sync", "async"):
        store_clock = FrozenClock()
        host_clock = FrozenClock(store_clock.now_ms() - 10 * 60_000)
        inner = MemoryStore(clock=store_clock)
        here = TieredStore(inner, clock=host_clock, max_staleness=TTL)
        assert here.claim("k", "fp", lease=LEASE, ttl=TTL) == Acquired(1, False, 1)
        assert here.complete("k", 1, b"first", ttl=timedelta(minutes=1)) is None
        assert _replays(here, "k") == _replays(here, "k") == b"first"
        assert here.hits == 1  # served from the cache while the record lives
        for clock in (store_clock, host_clock):
            clock.advance(timedelta(minutes=2))
        elsewhere = inner.claim("k", "fp", lease=LEASE, ttl=TTL)  # another host, no cache
        assert isinstance(elsewhere, Acquired)
        assert inner.complete("k", elsewhere.token, b"second", ttl=TTL) is None
        if mode == "sync":
            assert _replays(here, "k") == b"second"
        else:
            answer = asyncio.run(here.aclaim("k", "fp", lease=LEASE, ttl=TTL))
            assert isinstance(answer, Replay)
            assert answer.record.result == b"second"


@contextlib.contextmanager
def _server_store(kind: str) -> Iterator[str]:
    """A store URL on a real server whose clock judges time: Redis, or PostgreSQL in a schema
    of its own (dropped afterwards)."""
    if kind == "redis":
        yield service_url("ONCELY_TEST_REDIS_URL")
        return
    import psycopg

    base = service_url("ONCELY_TEST_POSTGRES_URL")
    schema = f"oncely_tiered_{uuid.uuid4().hex[:10]}"
    url = f"{base}{'&' if '?' in base else '?'}schema={schema}&application_name=oncely_tiered"
    with open_store(url) as store:
        store.migrate()  # type: ignore[attr-defined]
    try:
        yield url
    finally:
        with psycopg.connect(base, autocommit=True) as connection:
            connection.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.fixture(params=["redis", "postgres"])
def server_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A store URL on Redis or PostgreSQL."""
    with _server_store(request.param) as url:
        yield url


def test_cache_expiry_follows_the_server_clock(server_url: str) -> None:
    """A host whose clock is ten minutes behind the server's caches a finished record; the
    record expires by the server's clock and runs again through another host: the first host
    then replays the new result, never its cached copy of the expired record."""
    namespace = f"tiered-{uuid.uuid4().hex[:12]}"
    here = TieredStore(
        open_store(server_url, namespace=namespace),
        clock=_HostClockBehind(10 * 60_000),
        max_staleness=TTL,  # only expiry drops the record
    )
    elsewhere = open_store(server_url, namespace=namespace)
    try:
        assert here.claim("k", "fp", lease=LEASE, ttl=TTL) == Acquired(1, False, 1)
        # The record lives a few seconds: long enough to be cached on a loaded machine, short
        # enough to wait for.
        assert here.complete("k", 1, b"first", ttl=timedelta(seconds=4)) is None
        assert _replays(here, "k") == b"first"  # now in the cache, if it is kept at all

        def run_again_elsewhere() -> bool:
            answer = elsewhere.claim("k", "fp", lease=LEASE, ttl=TTL)
            assert isinstance(answer, (Replay, Acquired)), answer
            if isinstance(answer, Replay):
                return False  # not expired yet by the server's clock
            assert elsewhere.complete("k", answer.token, b"second", ttl=TTL) is None
            return True

        eventually(run_again_elsewhere, timeout=30, interval=0.1)
        assert _replays(here, "k") == b"second"
    finally:
        here.close()
        elsewhere.close()


MAX_STALENESS = timedelta(seconds=1)
"""The documented default bound on how long a change made elsewhere may go unseen."""

_ELSEWHERE = """
import sys
from datetime import timedelta

from oncely import Acquired
from oncely.stores import open_store

url, namespace, key, forget = sys.argv[1:]
with open_store("tiered+" + url, namespace=namespace) as store:
    if forget == "forget":
        assert store.forget(key) is not None
    claimed = store.claim(key, "fp", lease=timedelta(seconds=30), ttl=timedelta(hours=1))
    assert isinstance(claimed, Acquired), claimed
    assert store.complete(key, claimed.token, b"second", ttl=timedelta(hours=1)) is None
"""


def _run(*args: str) -> None:
    done = subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr


@pytest.fixture(params=["redis", "redis_cluster", "postgres", "sqlite"])
def shared_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A store URL that several processes open: Redis, Redis Cluster, PostgreSQL (a schema of
    this test's own), or a SQLite file."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'shared.db'}"
        return
    if request.param == "redis_cluster":
        yield service_url("ONCELY_TEST_REDIS_CLUSTER_URL")
        return
    with _server_store(request.param) as url:
        yield url


def test_a_forget_and_rerun_elsewhere_reach_the_cache_within_the_bound(shared_url: str) -> None:
    """Process A caches a finished record; another process forgets it (through its own tiered
    store, or `oncely forget`) and runs the key again: once the bound has passed on A's clock,
    A replays the new result, never its cached copy of the forgotten one (sync and async)."""
    namespace = f"tiered-{uuid.uuid4().hex[:12]}"
    clock = FrozenClock(time.time_ns() // 1_000_000)
    here = TieredStore(open_store(shared_url, namespace=namespace), clock=clock)
    try:
        for mode, how in (("sync", "process"), ("async", "cli")):
            key = f"k-{mode}"
            assert here.claim(key, "fp", lease=LEASE, ttl=TTL) == Acquired(1, False, 1)
            assert here.complete(key, 1, b"first", ttl=TTL) is None
            assert _replays(here, key) == b"first"
            hits = here.hits
            assert _replays(here, key) == b"first"
            assert here.hits == hits + 1  # answered from A's cache
            if how == "cli":
                cli = [sys.executable, "-m", "oncely.cli", "--store", shared_url]
                _run(*cli, "--namespace", namespace, "forget", key)
            _run(
                sys.executable,
                "-c",
                _ELSEWHERE,
                shared_url,
                namespace,
                key,
                "forget" if how == "process" else "",
            )
            clock.advance(MAX_STALENESS)
            if mode == "sync":
                assert _replays(here, key) == b"second"
            else:
                answer = asyncio.run(here.aclaim(key, "fp", lease=LEASE, ttl=TTL))
                assert isinstance(answer, Replay)
                assert answer.record.result == b"second"
    finally:
        here.close()


class _PausingStore:
    """Delegates to *inner*; a claim that read a record waits for `go` before answering, and
    an async claim awaits `landing` (a forget then lands between the read and the caller
    caching what it read)."""

    def __init__(self, inner: MemoryStore) -> None:
        self.inner = inner
        self.pause = False
        self.read = threading.Event()
        self.go = threading.Event()
        self.landing: Callable[[], Awaitable[object]] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _paused(self, answer: Any) -> Any:
        if self.pause:
            self.read.set()
            assert self.go.wait(30)
        return answer

    def claim(self, *args: Any, **kwargs: Any) -> Any:
        return self._paused(self.inner.claim(*args, **kwargs))

    def claim_many(self, *args: Any, **kwargs: Any) -> Any:
        return self._paused(self.inner.claim_many(*args, **kwargs))

    async def aclaim(self, *args: Any, **kwargs: Any) -> Any:
        answer = await self.inner.aclaim(*args, **kwargs)
        if self.landing is not None:
            await self.landing()
        return answer


@pytest.mark.parametrize("verb", ["claim", "claim_many", "aclaim"])
def test_a_forget_during_a_claim_is_not_undone_by_it(verb: str) -> None:
    """A claim reads a finished record; a forget through the same tiered store lands before
    the claim caches it: the forgotten record is not cached, and the next claim runs again."""
    inner = _PausingStore(MemoryStore())
    store = TieredStore(inner)  # type: ignore[arg-type]
    assert store.claim("k", "fp", lease=LEASE, ttl=TTL) == Acquired(1, False, 1)
    assert store.complete("k", 1, b"old", ttl=TTL) is None
    if verb == "aclaim":

        async def forget() -> None:
            assert await store.aforget("k") is not None

        inner.landing = forget
        stale = asyncio.run(store.aclaim("k", "fp", lease=LEASE, ttl=TTL))
    else:
        inner.pause = True
        answers: list[Any] = []

        def claim() -> None:
            if verb == "claim":
                answers.append(store.claim("k", "fp", lease=LEASE, ttl=TTL))
            else:
                answers.extend(store.claim_many([("k", "fp")], lease=LEASE, ttl=TTL))

        claimer = threading.Thread(target=claim)
        claimer.start()
        assert inner.read.wait(30)
        inner.pause = False
        assert store.forget("k") is not None
        inner.go.set()
        claimer.join(30)
        [stale] = answers
    assert isinstance(stale, Replay)  # read before the forget: the old result, once
    assert len(store) == 0
    assert isinstance(store.claim("k", "fp", lease=LEASE, ttl=TTL), Acquired)


def test_a_change_made_past_the_cache_reaches_it_within_the_bound() -> None:
    """Over a memory store forgotten directly and run again, the cache answers the old result
    until max_staleness has passed on its clock, then the new one."""
    clock = FrozenClock()
    inner = MemoryStore(clock=clock)
    store = TieredStore(inner, max_staleness=timedelta(seconds=5))
    assert store.claim("k", "fp", lease=LEASE, ttl=TTL) == Acquired(1, False, 1)
    assert store.complete("k", 1, b"first", ttl=TTL) is None
    assert _replays(store, "k") == b"first"
    assert inner.forget("k") is not None
    rerun = inner.claim("k", "fp", lease=LEASE, ttl=TTL)
    assert isinstance(rerun, Acquired)
    assert inner.complete("k", rerun.token, b"second", ttl=TTL) is None
    clock.advance(timedelta(milliseconds=4999))
    assert _replays(store, "k") == b"first"  # within the bound
    clock.advance(timedelta(milliseconds=1))
    assert _replays(store, "k") == b"second"


@pytest.mark.parametrize("bound", [timedelta(0), timedelta(seconds=-1), 1.0, None])
def test_max_staleness_must_be_a_positive_timedelta(bound: Any) -> None:
    with pytest.raises(ConfigurationError, match="max_staleness"):
        TieredStore(MemoryStore(), max_staleness=bound)


def test_open_store_passes_max_staleness() -> None:
    with open_store("tiered+memory://", max_staleness=timedelta(seconds=3)) as store:
        assert isinstance(store, TieredStore)
        assert store.max_staleness == timedelta(seconds=3)
