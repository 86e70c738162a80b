"""SQLite specifics: URLs, schema, corrupt rows, purge, locking faults and killed workers."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import oncely
from oncely import (
    Acquired,
    ConfigurationError,
    CorruptRecordError,
    InProgress,
    InProgressError,
    LeaseLost,
    Mismatch,
    Replay,
    SchemaMissingError,
    Status,
    StoreError,
    StoreUnavailableError,
)
from oncely.stores.sqlite import SQLiteStore
from oncely.testing import FrozenClock
from tests._helpers import eventually

LEASE = timedelta(seconds=30)
TTL = timedelta(hours=1)


def test_url_forms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """sqlite:///relative, sqlite:////absolute, :memory: and query options all open."""
    monkeypatch.chdir(tmp_path)
    with oncely.open_store("sqlite:///relative.db?timeout=2&synchronous=normal") as store:
        assert isinstance(store, SQLiteStore)
        assert store.path == "relative.db"
    assert (tmp_path / "relative.db").exists()
    with oncely.open_store(f"sqlite:///{tmp_path}/absolute.db") as store:
        assert isinstance(store, SQLiteStore)
        assert store.path == str(tmp_path / "absolute.db")
    with oncely.open_store("sqlite:///:memory:") as store:
        assert isinstance(store.claim("k", "fp", lease=LEASE, ttl=TTL), Acquired)
        assert isinstance(store.claim("k", "fp", lease=LEASE, ttl=TTL), InProgress)


@pytest.mark.parametrize(
    "url",
    [
        "sqlite://",
        "sqlite:///",
        "sqlite://host/x.db",
        "sqlite:///x.db?bogus=1",
        "sqlite:///x?timeout=a",
    ],
)
def test_bad_urls_are_configuration_errors(url: str) -> None:
    """Malformed SQLite URLs are rejected with a message naming the expected form."""
    with pytest.raises(ConfigurationError):
        oncely.open_store(url)


def test_missing_schema_without_migrate(tmp_path: Path) -> None:
    """migrate=False on an empty file raises SchemaMissingError naming migrate()."""
    with pytest.raises(SchemaMissingError, match="migrate"):
        SQLiteStore(tmp_path / "empty.db", migrate=False)
    SQLiteStore(tmp_path / "empty.db").close()
    SQLiteStore(tmp_path / "empty.db", migrate=False).close()


def _migrate(path: str) -> None:
    SQLiteStore(path).close()


def test_migrate_is_idempotent_across_processes(tmp_path: Path) -> None:
    """Several processes opening (and migrating) one new file at once all succeed."""
    path = str(tmp_path / "shared.db")
    context = multiprocessing.get_context("forkserver")
    workers = [context.Process(target=_migrate, args=(path,)) for _ in range(8)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    assert [worker.exitcode for worker in workers] == [0] * 8
    with SQLiteStore(path) as store:
        store.migrate()
        assert isinstance(store.claim("k", "fp", lease=LEASE, ttl=TTL), Acquired)


def _open_fresh_files(directory: str, trials: int, barrier: Any, results: Any) -> None:
    """Open t0.db, t1.db, ... in *directory*, each at *barrier* with the other processes."""
    failures = []
    for trial in range(trials):
        barrier.wait(timeout=60)
        path = os.path.join(directory, f"t{trial}.db")
        try:
            with SQLiteStore(path, synchronous="off") as store:  # the open is what is tested
                store.claim("k", "fp", lease=LEASE, ttl=TTL)
        except Exception as exc:
            failures.append(f"trial {trial}: {exc!r}")
    results.put(failures)


def test_first_opens_of_a_fresh_file_at_one_instant_all_succeed(tmp_path: Path) -> None:
    """Processes opening the same new file at the same moment, many times over: every open
    succeeds (switching a fresh file to WAL needs a lock SQLite takes without its busy handler,
    so without retrying a few percent of them failed with "database is locked"), the file ends
    up in WAL mode, and exactly one claim of each file is Acquired."""
    processes, trials = 8, 200
    context = multiprocessing.get_context("forkserver")
    barrier = context.Barrier(processes)
    results = context.Queue()
    workers = [
        context.Process(target=_open_fresh_files, args=(str(tmp_path), trials, barrier, results))
        for _ in range(processes)
    ]
    for worker in workers:
        worker.start()
    try:
        failures = [failure for _ in workers for failure in results.get(timeout=300)]
    finally:
        for worker in workers:
            worker.join(60)
        results.close()
        results.join_thread()
    assert failures == []
    assert [worker.exitcode for worker in workers] == [0] * processes
    for trial in range(trials):
        raw = sqlite3.connect(tmp_path / f"t{trial}.db")
        try:
            assert raw.execute("PRAGMA journal_mode").fetchone() == ("wal",)
            assert raw.execute("SELECT token, attempt FROM oncely_records").fetchall() == [(1, 1)]
        finally:
            raw.close()


@pytest.mark.parametrize(
    ("column", "value"),
    [("status", "exploded"), ("token", "one"), ("fingerprint", b"\xff"), ("result", "text")],
)
def test_corrupt_rows_fail_closed(tmp_path: Path, column: str, value: object) -> None:
    """A damaged row is CorruptRecordError on claim: never treated as absent."""
    path = tmp_path / "oncely.db"
    with SQLiteStore(path) as store:
        token = store.claim("k", "fp", lease=LEASE, ttl=TTL)
        assert isinstance(token, Acquired)
        store.complete("k", token.token, b"r", ttl=TTL)
    with sqlite3.connect(path) as raw:
        raw.execute(f"UPDATE oncely_records SET {column} = ?", (value,))
    raw.close()
    with SQLiteStore(path) as store:
        with pytest.raises(CorruptRecordError):
            store.claim("k", "fp", lease=LEASE, ttl=TTL)
        with pytest.raises(CorruptRecordError):
            store.get("k")


def test_batch_answers_a_corrupt_row_in_its_own_place(tmp_path: Path) -> None:
    """A damaged row in a batch is CorruptRecordError for that item; the others are answered
    and written in the same transaction."""
    path = tmp_path / "oncely.db"
    with SQLiteStore(path) as store:
        store.claim("bad", "fp", lease=LEASE, ttl=TTL)
    with sqlite3.connect(path) as raw:
        raw.execute("UPDATE oncely_records SET status = 'exploded'")
    raw.close()
    with SQLiteStore(path) as store:
        requests = [("a", "fp"), ("bad", "fp"), ("b", "fp")]
        first, bad, last = store.claim_many(requests, lease=LEASE, ttl=TTL)
        assert isinstance(first, Acquired)
        assert isinstance(bad, CorruptRecordError)
        assert bad.key == "bad"
        assert isinstance(last, Acquired)
        done, broken = store.complete_many([("a", 1, b"r"), ("bad", 1, b"r")], ttl=TTL)
        assert done is None
        assert isinstance(broken, CorruptRecordError)
    with SQLiteStore(path) as store:
        record = store.get("a")
        assert record is not None
        assert record.result == b"r"


def test_batch_in_a_locked_database_is_unavailable(tmp_path: Path) -> None:
    """A write lock held past the timeout fails the whole batch closed, nothing written."""
    path = tmp_path / "oncely.db"
    store = SQLiteStore(path, timeout=0.05)
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(StoreUnavailableError):
            store.claim_many([("a", "fp"), ("b", "fp")], lease=LEASE, ttl=TTL)
    finally:
        blocker.execute("COMMIT")
        blocker.close()
    assert store.get("a") is None
    assert store.claim_many([("a", "fp")], lease=LEASE, ttl=TTL) == [
        Acquired(1, recovered=False, attempt=1)
    ]
    store.close()


def test_claims_that_write_nothing_are_answered_while_another_writer_holds_the_lock(
    tmp_path: Path,
) -> None:
    """A replay, a mismatch and a live lease need no write lock: they are answered from a read
    (WAL) while another connection holds it, sync and async; a claim that writes still waits
    for the lock, and fails closed when it does not get it in time."""
    path = tmp_path / "oncely.db"
    store = SQLiteStore(path, timeout=0.05)
    done = store.claim("done", "fp", lease=LEASE, ttl=TTL)
    assert isinstance(done, Acquired)
    assert store.complete("done", done.token, b"result", ttl=TTL) is None
    assert isinstance(store.claim("held", "fp", lease=LEASE, ttl=TTL), Acquired)
    blocker = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    blocker.execute("BEGIN IMMEDIATE")
    try:
        replay = store.claim("done", "fp", lease=LEASE, ttl=TTL)
        assert isinstance(replay, Replay)
        assert replay.record.result == b"result"
        assert replay.record.key == "done"
        assert isinstance(store.claim("done", "other", lease=LEASE, ttl=TTL), Mismatch)
        assert isinstance(store.claim("held", "fp", lease=LEASE, ttl=TTL), InProgress)

        async def main() -> None:
            answer = await store.aclaim("done", "fp", lease=LEASE, ttl=TTL)
            assert isinstance(answer, Replay)
            assert isinstance(await store.aclaim("held", "fp", lease=LEASE, ttl=TTL), InProgress)
            with pytest.raises(StoreUnavailableError):
                await store.aclaim("new", "fp", lease=LEASE, ttl=TTL)

        asyncio.run(main())
        with pytest.raises(StoreUnavailableError):
            store.claim("new", "fp", lease=LEASE, ttl=TTL)
    finally:
        blocker.execute("COMMIT")
        blocker.close()
    assert store.claim("new", "fp", lease=LEASE, ttl=TTL) == Acquired(1, False, 1)
    store.close()


def test_a_namespaced_replay_carries_the_callers_key(tmp_path: Path) -> None:
    """The read that answers a replay names the record by the caller's key, not the stored one."""
    store = SQLiteStore(tmp_path / "oncely.db", namespace="billing")
    claim = store.claim("k", "fp", lease=LEASE, ttl=TTL)
    assert isinstance(claim, Acquired)
    assert store.complete("k", claim.token, b"r", ttl=TTL) is None
    replay = store.claim("k", "fp", lease=LEASE, ttl=TTL)
    assert isinstance(replay, Replay)
    assert replay.record.key == "k"
    store.close()


def _threads_of_transitions(store: SQLiteStore) -> list[str]:
    """The names of the threads that make *store*'s writes, as they try them."""
    names: list[str] = []
    original = store._execute

    def spy(*args: Any) -> Any:
        names.append(threading.current_thread().name)
        return original(*args)

    store._execute = spy  # type: ignore[method-assign]
    return names


def test_async_calls_run_inline_unless_another_writer_holds_the_lock(tmp_path: Path) -> None:
    """synchronous="normal": an async claim runs on the loop's thread; while another process
    (here another connection) holds the write lock it waits in a worker thread instead, and
    succeeds once the lock is free, without blocking the event loop meanwhile."""
    path = tmp_path / "oncely.db"
    store = SQLiteStore(path, synchronous="normal")
    threads = _threads_of_transitions(store)
    blocker = sqlite3.connect(path, isolation_level=None, check_same_thread=False)

    async def main() -> None:
        assert await store.aclaim("a", "fp", lease=LEASE, ttl=TTL) == Acquired(1, False, 1)
        blocker.execute("BEGIN EXCLUSIVE")
        claim = asyncio.ensure_future(store.aclaim("b", "fp", lease=LEASE, ttl=TTL))
        ticks = 0
        while not claim.done() and ticks < 20:  # the loop keeps running meanwhile
            await asyncio.sleep(0.01)
            ticks += 1
        assert not claim.done()
        blocker.execute("COMMIT")
        assert await claim == Acquired(1, recovered=False, attempt=1)

    try:
        asyncio.run(main())
    finally:
        blocker.close()
        store.close()
    main_thread = threading.main_thread().name
    assert threads[0] == main_thread
    assert threads[-1].startswith("oncely-sqlite")


def test_async_calls_with_full_sync_use_worker_threads(tmp_path: Path) -> None:
    """synchronous="full" (the default): commits wait for the disk, so never on the loop."""
    store = SQLiteStore(tmp_path / "oncely.db")
    names = _threads_of_transitions(store)
    asyncio.run(store.aclaim("a", "fp", lease=LEASE, ttl=TTL))
    store.close()
    assert len(names) == 1
    assert names[0].startswith("oncely-sqlite")


def _write_between_read_and_swap(store: SQLiteStore, write: Any) -> None:
    """Make *store*'s next read call *write* (another process's transition, say) right after
    it reads: *store* then decides on a record that is no longer the one stored."""
    original = store._fetch

    def fetch(*args: Any) -> Any:
        row = original(*args)
        store._fetch = original  # type: ignore[method-assign]
        write()
        return row

    store._fetch = fetch  # type: ignore[method-assign]


@pytest.mark.parametrize("synchronous", ["full", "normal"])
def test_a_claim_decided_on_a_stale_read_decides_again(tmp_path: Path, synchronous: str) -> None:
    """Between a claim's read and its write another store takes the key: the write (insert if
    absent, swap if unchanged) does not apply, and the claim decides again under the write lock,
    sync and async, for a new key and for the takeover of a lapsed lease."""
    clock = FrozenClock()
    path = tmp_path / "oncely.db"
    store = SQLiteStore(path, clock=clock, synchronous=synchronous)
    other = SQLiteStore(path, clock=clock)
    lease = timedelta(seconds=1)

    def take(key: str, token: int) -> Any:
        def write() -> None:
            assert other.claim(key, "fp", lease=lease, ttl=TTL) == Acquired(token, token > 1, token)

        return write

    _write_between_read_and_swap(store, take("new", 1))
    assert isinstance(store.claim("new", "fp", lease=lease, ttl=TTL), InProgress)
    clock.advance(timedelta(seconds=2))  # the lease lapsed: the next claim takes it over
    _write_between_read_and_swap(store, take("new", 2))
    assert isinstance(store.claim("new", "fp", lease=lease, ttl=TTL), InProgress)

    async def main() -> None:
        _write_between_read_and_swap(store, take("anew", 1))
        assert isinstance(await store.aclaim("anew", "fp", lease=lease, ttl=TTL), InProgress)
        clock.advance(timedelta(seconds=2))
        _write_between_read_and_swap(store, take("anew", 2))
        assert isinstance(await store.aclaim("anew", "fp", lease=lease, ttl=TTL), InProgress)

    asyncio.run(main())
    for key in ("new", "anew"):
        record = store.get(key)
        assert record is not None
        assert (record.token, record.attempt) == (2, 2)
    store.close()
    other.close()


@pytest.mark.parametrize("synchronous", ["full", "normal"])
def test_settling_a_lease_taken_over_or_a_corrupt_row(tmp_path: Path, synchronous: str) -> None:
    """complete and fail write in one UPDATE where the lease holds; where it does not, the
    state machine decides on the record: the lease is lost (the new holder's record untouched),
    or the record is corrupt (fail closed); sync and async, alone and in a batch."""
    clock = FrozenClock()
    path = tmp_path / "oncely.db"
    store = SQLiteStore(path, clock=clock, synchronous=synchronous)
    lease = timedelta(seconds=1)
    for key in ("a", "b", "bad"):
        assert store.claim(key, "fp", lease=lease, ttl=TTL) == Acquired(1, False, 1)
    clock.advance(timedelta(seconds=2))
    assert store.claim("a", "fp", lease=lease, ttl=TTL) == Acquired(2, True, 2)
    with sqlite3.connect(path) as raw:
        raw.execute("UPDATE oncely_records SET fingerprint = x'ff' WHERE key = 'bad'")
    raw.close()

    assert store.complete("a", 1, b"late", ttl=TTL) == LeaseLost()
    assert store.fail("a", 1, b"late", ttl=TTL) == LeaseLost()
    with pytest.raises(CorruptRecordError):
        store.complete("bad", 2, b"r", ttl=TTL)  # no lease to settle: the machine reads it

    async def main() -> list[Any]:
        assert await store.acomplete("a", 1, b"late", ttl=TTL) == LeaseLost()
        with pytest.raises(CorruptRecordError):
            await store.afail("bad", 2, b"r", ttl=TTL)
        store._write_lock.acquire()  # the writes queue up (synchronous="full": one batch)
        settles = [
            asyncio.ensure_future(store.acomplete("a", 1, b"late", ttl=TTL)),
            asyncio.ensure_future(store.acomplete("bad", 2, b"r", ttl=TTL)),
            asyncio.ensure_future(store.afail("b", 1, b"error", ttl=TTL)),
        ]
        await asyncio.sleep(0.1)
        store._write_lock.release()
        return await asyncio.gather(*settles, return_exceptions=True)

    late, bad, failed = asyncio.run(main())
    assert late == LeaseLost()
    assert isinstance(bad, CorruptRecordError)
    assert failed is None
    record = store.get("a")
    assert record is not None
    assert (record.status, record.token, record.result) == (Status.IN_PROGRESS, 2, None)
    record = store.get("b")
    assert record is not None
    assert (record.status, record.result) == (Status.FAILED, b"error")
    store.close()


def test_async_writes_queued_together_share_one_transaction(tmp_path: Path) -> None:
    """synchronous="full": async claims queued while the writer thread waits for the lock are
    written in one transaction; of several claims of one new key exactly one acquires it."""
    store = SQLiteStore(tmp_path / "oncely.db")
    batches: list[int] = []
    original = store._write_batch

    def spy(writes: Any) -> Any:
        batches.append(len(writes))
        return original(writes)

    store._write_batch = spy  # type: ignore[method-assign]

    async def main() -> list[Any]:
        store._write_lock.acquire()  # as another thread of this process writing
        claims = [
            asyncio.ensure_future(store.aclaim(key, "fp", lease=LEASE, ttl=TTL))
            for key in ["a", "b", "c", "same", "same", "same", "d"]
        ]
        await asyncio.sleep(0.2)
        store._write_lock.release()
        return await asyncio.gather(*claims)

    answers = asyncio.run(main())
    assert answers[:3] == [Acquired(1, False, 1)] * 3
    assert answers[-1] == Acquired(1, False, 1)
    same = answers[3:6]
    assert same.count(Acquired(1, False, 1)) == 1
    assert sum(isinstance(answer, InProgress) for answer in same) == 2
    assert sum(batches) == 7
    assert max(batches) > 1
    store.close()


def test_a_failed_write_in_a_batch_fails_alone(tmp_path: Path) -> None:
    """A write that fails in a batch rolls the batch's transaction back; each write is then
    made alone, and only the failing one answers the error."""
    store = SQLiteStore(tmp_path / "oncely.db")
    original = store._execute

    def execute(connection: Any, sql: str, params: Any) -> bool:
        if "bad" in params:
            raise sqlite3.OperationalError("disk I/O error")
        return original(connection, sql, params)

    store._execute = execute  # type: ignore[method-assign]

    async def main() -> list[Any]:
        store._write_lock.acquire()
        claims = [
            asyncio.ensure_future(store.aclaim(key, "fp", lease=LEASE, ttl=TTL))
            for key in ["a", "bad", "b"]
        ]
        await asyncio.sleep(0.2)
        store._write_lock.release()
        return await asyncio.gather(*claims, return_exceptions=True)

    first, bad, last = asyncio.run(main())
    assert first == last == Acquired(1, False, 1)
    assert isinstance(bad, StoreError)
    assert store.get("bad") is None
    assert store.get("a") is not None
    store.close()


def test_an_async_write_cancelled_while_queued_leaves_the_writer_serving(tmp_path: Path) -> None:
    """A caller cancelled while its write waits: the writer still serves the others (the write
    itself may be made: as with any store, a lease taken for nobody lapses)."""
    store = SQLiteStore(tmp_path / "oncely.db")

    async def main() -> Any:
        store._write_lock.acquire()
        doomed = asyncio.ensure_future(store.aclaim("a", "fp", lease=LEASE, ttl=TTL))
        await asyncio.sleep(0.05)
        doomed.cancel()
        store._write_lock.release()
        with pytest.raises(asyncio.CancelledError):
            await doomed
        return await store.aclaim("b", "fp", lease=LEASE, ttl=TTL)

    assert asyncio.run(main()) == Acquired(1, False, 1)
    store.close()
    with pytest.raises(StoreError):
        asyncio.run(store.aclaim("c", "fp", lease=LEASE, ttl=TTL))


def test_not_a_database(tmp_path: Path) -> None:
    """A file that is not SQLite is a StoreError, not a crash with a driver exception."""
    path = tmp_path / "junk.db"
    path.write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreError):
        SQLiteStore(path)


def test_purge_deletes_only_expired_records(tmp_path: Path) -> None:
    """purge() removes expired records in batches and keeps live ones."""
    clock = FrozenClock()
    with SQLiteStore(tmp_path / "oncely.db", clock=clock) as store:
        for index in range(25):
            answer = store.claim(f"old{index}", "fp", lease=LEASE, ttl=TTL)
            assert isinstance(answer, Acquired)
            store.complete(f"old{index}", answer.token, b"", ttl=timedelta(minutes=1))
        store.claim("live", "fp", lease=LEASE, ttl=TTL)
        clock.advance(timedelta(minutes=2))
        assert store.purge(batch=10) == 25
        assert store.purge() == 0
        assert store.get("live") is not None
        assert [record.key for record in store.scan()] == ["live"]


def test_locked_database_is_unavailable_then_completion_retries(tmp_path: Path) -> None:
    """A write lock held past the timeout: claim fails closed; complete is retried."""
    path = tmp_path / "oncely.db"
    store = SQLiteStore(path, timeout=0.05)
    calls = []
    blocker = sqlite3.connect(path, isolation_level=None, check_same_thread=False)

    @oncely.idempotent(store=store, key="k")
    def op(k: str) -> str:
        calls.append(k)
        if k == "during":
            blocker.execute("BEGIN EXCLUSIVE")
            threading.Timer(0.3, blocker.execute, args=("COMMIT",)).start()
        return "done"

    blocker.execute("BEGIN EXCLUSIVE")
    with pytest.raises(StoreUnavailableError):
        op("before")
    blocker.execute("COMMIT")
    assert calls == []
    assert op("during") == "done"  # complete failed while locked, then succeeded on retry
    assert op("during") == "done"
    assert calls == ["during"]
    blocker.close()
    store.close()


_WORKER = textwrap.dedent(
    """
    import sys, threading
    import oncely

    store = oncely.open_store(sys.argv[1])

    @oncely.idempotent(store=store, key="k", lease=float(sys.argv[2]), scope="crash")
    def charge(k):
        print("started", flush=True)
        threading.Event().wait(60)

    charge("payment-1")
    """
)


def test_worker_killed_between_claim_and_complete(tmp_path: Path) -> None:
    """A SIGKILLed worker: duplicates wait while its lease is live, then recover it once."""
    url = f"sqlite:///{tmp_path}/oncely.db"
    worker = subprocess.Popen(
        [sys.executable, "-c", _WORKER, url, "0.5"], stdout=subprocess.PIPE, text=True
    )
    assert worker.stdout is not None
    assert worker.stdout.readline().strip() == "started"
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait(10)
    worker.stdout.close()

    store = oncely.open_store(url)
    runs = []

    @oncely.idempotent(store=store, key="k", lease=0.5, scope="crash")
    def charge(k: str) -> str:
        runs.append(k)
        return "charged"

    with pytest.raises(InProgressError):
        charge("payment-1")  # the dead worker's lease is still live: never run twice

    def recovered() -> str | None:
        try:
            return charge("payment-1")
        except InProgressError:
            return None

    assert eventually(recovered, timeout=10) == "charged"
    assert charge("payment-1") == "charged"
    assert runs == ["payment-1"]
    record = store.get("crash|payment-1")
    assert record is not None
    assert record.attempt == 2
    assert record.token == 2
    store.close()


def test_forked_child_opens_its_own_connections(tmp_path: Path) -> None:
    """A store used before fork keeps working in the child and the parent."""
    store = SQLiteStore(tmp_path / "oncely.db")
    assert isinstance(store.claim("parent", "fp", lease=LEASE, ttl=TTL), Acquired)
    context = multiprocessing.get_context("fork")
    child = context.Process(target=_claim_child, args=(store,))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    assert isinstance(store.claim("child", "fp", lease=LEASE, ttl=TTL), InProgress)
    store.close()


def _claim_child(store: SQLiteStore) -> None:
    answer = store.claim("child", "fp", lease=LEASE, ttl=TTL)
    os._exit(0 if isinstance(answer, Acquired) else 1)


def test_memory_store_scan_and_purge() -> None:
    """The memory store offers the same maintenance verbs as the SQL stores."""
    from oncely.stores.memory import MemoryStore

    clock = FrozenClock()
    store = MemoryStore(clock=clock, namespace="ns")
    for key in ("b", "a", "c"):
        store.claim(key, "fp", lease=LEASE, ttl=TTL)
    assert [record.key for record in store.scan(after="a")] == ["b", "c"]
    clock.advance(TTL * 2)
    assert store.purge() == 3
    assert store.scan() == []


def test_in_memory_database_serves_concurrent_threads_and_tasks() -> None:
    """sqlite:///:memory: under threads and asyncio tasks claiming, completing and reading at
    once: every call answers (a shared-cache table lock would fail some at once, ignoring the
    busy timeout), and every key is acquired exactly once."""
    store = oncely.open_store("sqlite:///:memory:")
    threads, tasks, rounds = 6, 6, 150
    barrier = threading.Barrier(threads + 1)
    acquired: list[str] = []
    errors: list[BaseException] = []

    def settle(key: str, answer: object) -> None:
        if isinstance(answer, Acquired):
            acquired.append(key)

    def worker(index: int) -> None:
        barrier.wait(timeout=60)
        try:
            for step in range(rounds):
                key = f"k{step % 25}"
                answer = store.claim(key, "fp", lease=LEASE, ttl=TTL)
                settle(key, answer)
                if isinstance(answer, Acquired):
                    assert store.complete(key, answer.token, b"r", ttl=TTL) is None
                store.get(key)
                store.scan(limit=5)
        except BaseException as exc:
            errors.append(exc)

    async def racing_tasks() -> None:
        async def one(index: int) -> None:
            for step in range(rounds):
                key = f"a{step % 25}"
                answer = await store.aclaim(key, "fp", lease=LEASE, ttl=TTL)
                settle(key, answer)
                if isinstance(answer, Acquired):
                    assert await store.acomplete(key, answer.token, b"r", ttl=TTL) is None
                await store.aget(key)

        barrier.wait(timeout=60)
        try:
            await asyncio.gather(*(one(index) for index in range(tasks)))
        except BaseException as exc:
            errors.append(exc)

    pool = [threading.Thread(target=worker, args=(index,)) for index in range(threads)]
    for thread in pool:
        thread.start()
    asyncio.run(racing_tasks())
    for thread in pool:
        thread.join(120)
    store.close()
    assert errors == []
    assert sorted(acquired) == sorted({f"k{i}" for i in range(25)} | {f"a{i}" for i in range(25)})


def test_scans_list_only_their_own_namespace(tmp_path: Path) -> None:
    """In one file, the default namespace's scan lists none of the named namespaces' records
    (whose keys look like ``billing:...``), and a named one's lists none of the others'; pages
    of one record walk each namespace to its end."""
    path = tmp_path / "oncely.db"
    keys = {"": ["a", "billing:eu:x", "s|k:1"], "billing": ["eu:x", "y"], "billing:eu": ["x"]}
    stores = {space: SQLiteStore(path, namespace=space) for space in keys}
    try:
        for space, store in stores.items():
            for key in keys[space]:
                assert isinstance(store.claim(key, "fp", lease=LEASE, ttl=TTL), Acquired)
        for space, store in stores.items():
            assert sorted(record.key for record in store.scan()) == sorted(keys[space])
            paged, after = [], ""
            while page := store.scan(after=after, limit=1):
                paged.append(page[0].key)
                after = page[0].key
            assert sorted(paged) == sorted(keys[space])
    finally:
        for store in stores.values():
            store.close()


def test_records_stored_before_the_escaping_are_found(tmp_path: Path) -> None:
    """The common case keeps its stored key: a named namespace without ``%:|`` and a default
    namespace key scoped as ``<scope>|<key>``, as earlier versions wrote them, still replay."""
    path = tmp_path / "oncely.db"
    with SQLiteStore(path) as store:  # creates the schema
        pass
    raw = sqlite3.connect(path)
    now = FrozenClock().now_ms()
    rows = [("billing:scope|k:1", b"named"), ("scope|k:1", b"default")]
    with raw:
        for key, result in rows:
            raw.execute(
                "INSERT INTO oncely_records VALUES "
                "(?, 'completed', 'fp', 1, 1, ?, ?, ?, ?, ?, NULL)",
                (key, now, now + 3_600_000, now, now, result),
            )
    raw.close()
    clock = FrozenClock()
    for space, expected in (("billing", b"named"), ("", b"default")):
        with SQLiteStore(path, namespace=space, clock=clock) as store:
            replay = store.claim("scope|k:1", "fp", lease=LEASE, ttl=TTL)
            assert isinstance(replay, oncely.Replay)
            assert (replay.record.key, replay.record.result) == ("scope|k:1", expected)


def test_migrate_upgrades_a_version_1_database(tmp_path: Path) -> None:
    """A version 1 database (no op column) keeps its records through migrate(); until then a
    store opened without migrating says the schema is out of date. Afterwards a batch claim
    sent again with its call ids gets its own lease back."""
    path = tmp_path / "v1.db"
    with SQLiteStore(path) as store:
        taken = store.claim("old", "fp", lease=LEASE, ttl=TTL)
        assert isinstance(taken, Acquired)
    raw = sqlite3.connect(path)
    with raw:  # back to version 1's shape, with the record in it
        raw.execute("ALTER TABLE oncely_records DROP COLUMN op")
        raw.execute("UPDATE oncely_schema SET version = 1")
    raw.close()
    with pytest.raises(SchemaMissingError):
        SQLiteStore(path, migrate=False)
    with SQLiteStore(path) as store:
        assert store.check().schema_version == 2
        assert store.complete("old", taken.token, b"kept", ttl=TTL) is None
        replay = store.claim("old", "fp", lease=LEASE, ttl=TTL)
        assert isinstance(replay, Replay)
        assert replay.record.result == b"kept"
        first = store.claim_many([("new", "fp")], lease=LEASE, ttl=TTL, ops=["op-1"])
        again = store.claim_many([("new", "fp")], lease=LEASE, ttl=TTL, ops=["op-1"])
        assert first == again == [Acquired(1, recovered=False, attempt=1)]
        store.migrate()  # idempotent
