"""`sqlite:///path/to.db`: the embedded default store.

Durable, and safe for several processes on one host: the database runs in WAL mode, and every
transition is atomic across the threads and processes that share the file. A transition reads
the record without the write lock (WAL gives the read a consistent snapshot) and lets the
reference state machine decide on it. A replay, a mismatch or a live lease write nothing and
are answered from that read, as PostgreSQL's claim answers them. A transition that writes does
so in one statement that applies only while the record is still the one read (`_sql.INSERT`
for a key that had none, `_sql.SWAP` for an unchanged row): a compare-and-swap, atomic as every
SQLite statement is, serialised with every other writer by SQLite's write lock. A swap that
finds the record changed by another writer meanwhile decides again in a ``BEGIN IMMEDIATE``
transaction, holding the lock from the read to the write. All processes of one host share its
clock, which judges leases and expiry.

Sync callers use a connection per thread. Async callers read on the event loop's thread (a
WAL read never waits for a writer) and decide there. Their writes go to the store's writer
thread when commits wait for the disk (``synchronous="full"``, the default, or ``"extra"``):
the writes queued while it commits go in one transaction, one commit (one fsync) for them all,
and each event loop is woken once per batch. When commits do not wait for the disk
(``synchronous="normal"`` or ``"off"``, or an in-memory database), a write that finds the
write lock free is made at once on the event loop's thread: it takes tens of microseconds, less
than the hop to a thread and back. The event loop never waits for the lock (another writer's
transaction) nor for an fsync. The less common async calls run in a small pool of threads
owned by the store (never a thread per call), each with its own connection.

An in-memory database has one connection, used under the store's lock by every caller: SQLite's
shared cache, the other way to share one, locks tables without heeding the busy timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import queue
import random
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from importlib import resources
from pathlib import Path
from typing import Any, NoReturn, TypeVar
from urllib.parse import parse_qs

from oncely._core import machine
from oncely._core.clock import Clock
from oncely._core.records import ClaimResult, LeaseLost, Record, Replay, Status
from oncely.errors import (
    ConfigurationError,
    CorruptRecordError,
    SchemaMissingError,
    StoreError,
    StoreUnavailableError,
)
from oncely.stores._machine import MachineStore, Step, _claim_step, _keeping_op, _ms
from oncely.stores._namespace import namespace_range, stored_key
from oncely.stores.sqlite import _sql

__all__ = ["SQLiteStore"]

T = TypeVar("T")

_SYNCHRONOUS = ("off", "normal", "full", "extra")

_COMPLETED, _FAILED = Status.COMPLETED, Status.FAILED

_STATUSES = {status.value: status for status in Status}
"""Statuses by their stored text: a dict lookup, where ``Status(text)`` goes through EnumMeta."""


class _Local(threading.local):
    """What a thread keeps: its connections, and whether it runs an event loop's call inline."""

    inline = False
    connection: sqlite3.Connection | None = None
    inline_connection: sqlite3.Connection | None = None  # timeout 0: never waits for a lock


class _Busy(Exception):
    """An inline attempt found the write lock taken: nothing was done; use a worker thread."""


_Write = tuple[str, str, tuple[Any, ...], Any, Step[Any]]
"""A conditional write of a record: ``(key, sql, params, answer, step)``. If *sql* changes one
row, the transition is done and answers *answer*; else *step* decides again under the write
lock. (A plain tuple: one is made per write.)"""


_Outcome = tuple[bool, Any]
"""How a write went: ``(True, answer)`` or ``(False, exception)``."""

_Waiter = tuple[_Write, asyncio.AbstractEventLoop, "asyncio.Future[Any]"]

_BATCH = 256
"""The most writes one transaction of the writer thread makes."""


class _Writer:
    """The thread that makes async callers' writes when commits wait for the disk.

    The writes queued while it works go in one batch to *serve*, which makes them in one
    transaction (one commit, one fsync); then each event loop that waits on the batch is woken
    once, by one callback that settles all of its futures.
    """

    def __init__(self, serve: Callable[[list[_Write]], list[_Outcome]]) -> None:
        self._serve = serve
        self._queue: queue.SimpleQueue[_Waiter | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._stopped = False
        # A daemon: a process that exits without closing the store must not hang on it. A
        # write cut short by the exit is never committed, and its caller never answered.
        self._thread = threading.Thread(target=self._run, name="oncely-sqlite-writer", daemon=True)
        self._thread.start()

    def submit(self, write: _Write) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:  # never queued behind the stop: nobody would make it
            if self._stopped:
                raise StoreError("the store is closed", backend="sqlite")
            self._queue.put((write, loop, future))
        return future

    def stop(self) -> None:
        """Make the writes queued so far, then end the thread."""
        with self._lock:
            self._stopped = True
            self._queue.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        take, more = self._queue.get, self._queue.empty
        while True:
            item = take()
            waiters: list[_Waiter] = []
            while item is not None:
                waiters.append(item)
                if len(waiters) == _BATCH or more():
                    break
                item = take()
            if waiters:
                self._answer(waiters)
            if item is None:
                return

    def _answer(self, waiters: list[_Waiter]) -> None:
        try:
            outcomes = self._serve([write for write, _, _ in waiters])
        except BaseException as exc:  # a bug: never leave a caller waiting forever
            outcomes = [(False, exc)] * len(waiters)
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[Any], _Outcome]]] = {}
        for (_, loop, future), outcome in zip(waiters, outcomes, strict=True):
            by_loop.setdefault(loop, []).append((future, outcome))
        for loop, settled in by_loop.items():
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits
                loop.call_soon_threadsafe(_settle, settled)


def _settle(settled: list[tuple[asyncio.Future[Any], _Outcome]]) -> None:
    """Give each waiting future its outcome (on its loop's thread)."""
    for future, (ok, value) in settled:
        if future.done():  # cancelled: its caller no longer waits
            continue
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)


class SQLiteStore(MachineStore):
    """Records in a SQLite database file.

    Args:
        path: The database file (created if missing), or ``":memory:"`` for a private
            in-memory database of this store alone (one connection, used under a lock).
        namespace: A prefix that keeps this store's keys apart from others' in the same file.
        clock: The clock that judges leases and expiry (the host's by default).
        timeout: How long a transition waits for the write lock before
            `StoreUnavailableError` (seconds).
        synchronous: SQLite's ``synchronous`` pragma: ``"full"`` (default) survives power loss,
            ``"normal"`` survives process crashes only and is faster.
        migrate: Create or upgrade the schema when the store opens (default). With ``False`` a
            missing schema raises `SchemaMissingError`.
        async_workers: Threads serving async callers.

    Raises:
        ConfigurationError: The file's folder does not exist, or an option is invalid.

    .. versionadded:: 0.1.0
    """

    backend = "sqlite"

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        namespace: str = "",
        clock: Clock | None = None,
        timeout: float = 30.0,
        synchronous: str = "full",
        migrate: bool = True,
        async_workers: int = 4,
    ) -> None:
        super().__init__(namespace=namespace, clock=clock)
        self._prefix = stored_key(namespace, "") if namespace else None
        if synchronous.lower() not in _SYNCHRONOUS:
            raise ConfigurationError(f"synchronous must be one of {_SYNCHRONOUS}")
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not 0 <= timeout < float("inf")
        ):
            raise ConfigurationError(f"timeout must be a finite number of seconds, not {timeout!r}")
        workers_ok = isinstance(async_workers, int) and not isinstance(async_workers, bool)
        if not workers_ok or async_workers < 1:
            raise ConfigurationError(f"async_workers must be 1 or more, not {async_workers!r}")
        self._memory = str(path) == ":memory:"
        self.path = ":memory:" if self._memory else str(Path(path))
        if not self._memory:
            _require_folder(Path(path))
        self._timeout = timeout
        self._synchronous = synchronous.upper()
        # Commits that never wait for the disk may run on the event loop's thread (see above).
        self._inline = self._synchronous in ("OFF", "NORMAL") or self._memory
        self._async_workers = async_workers
        self._local = _Local()
        self._connections: list[sqlite3.Connection] = []
        self._connections_lock = threading.Lock()
        # This process's writers queue here, woken at once, instead of in SQLite's busy handler,
        # which sleeps (1, 2, 5, 10... ms) between tries: that sleep, not the write, is what a
        # contended transition would cost. Other processes still meet the busy handler.
        self._write_lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._writer: _Writer | None = None
        self._forks = _forks
        self._closed = False
        # An in-memory database is private to its one connection: every use of it holds
        # `_write_lock` (see `_exclusive`).
        self._shared = self._connect() if self._memory else None
        if migrate:
            self.migrate()
        else:
            self._check_schema()

    @classmethod
    def from_url(cls, url: str, **options: Any) -> SQLiteStore:
        """Open ``sqlite:///relative/path.db``, ``sqlite:////absolute/path.db`` or
        ``sqlite:///:memory:``; query parameters ``timeout`` and ``synchronous`` are accepted.
        """
        rest = url.partition("://")[2]
        if not rest.startswith("/"):
            raise ConfigurationError(
                f"a SQLite URL is sqlite:///relative/path.db or sqlite:////absolute/path.db, "
                f"not {url!r}"
            )
        path, _, query = rest[1:].partition("?")
        if not path:
            raise ConfigurationError(f"the SQLite URL {url!r} names no database file")
        params = {name: values[-1] for name, values in parse_qs(query).items()}
        unknown = set(params) - {"timeout", "synchronous"}
        if unknown:
            raise ConfigurationError(f"unknown SQLite URL parameters: {sorted(unknown)}")
        if "timeout" in params:
            try:
                options.setdefault("timeout", float(params["timeout"]))
            except ValueError:
                raise ConfigurationError(
                    f"timeout must be a number, not {params['timeout']!r}"
                ) from None
        if "synchronous" in params:
            options.setdefault("synchronous", params["synchronous"])
        return cls(path, **options)

    # -- connections ---------------------------------------------------------------------------

    def _connect(self, timeout: float | None = None) -> sqlite3.Connection:
        with self._translate_errors(""):
            connection = sqlite3.connect(
                self.path,
                timeout=self._timeout if timeout is None else timeout,
                isolation_level=None,  # transactions are explicit: BEGIN IMMEDIATE
                check_same_thread=False,  # used by one thread; closed by whoever closes the store
            )
            try:
                if not self._memory:
                    self._enter_wal(connection)
                connection.execute(f"PRAGMA synchronous={self._synchronous}")
            except BaseException:
                connection.close()
                raise
        with self._connections_lock:
            self._connections.append(connection)
        return connection

    def _enter_wal(self, connection: sqlite3.Connection) -> None:
        """Put the database in WAL mode (a no-op once it is), retrying while it is locked.

        Leaving the rollback journal needs an exclusive lock, which SQLite asks for without its
        busy handler (the connection holds a shared lock, and waiting could deadlock): two
        first opens of a fresh file can meet ``database is locked`` however long the timeout.
        Each try ends its statement and so drops the shared lock; the next one, after a short
        random backoff, finds the file converted or converts it.
        """
        deadline = time.monotonic() + self._timeout
        delay = 0.001
        while True:
            try:
                connection.execute("PRAGMA journal_mode=WAL")
                return
            except sqlite3.OperationalError as exc:
                if not _is_busy(exc):
                    raise
                if self._local.inline:
                    raise _Busy from exc  # the event loop's thread never waits: use a worker
                if time.monotonic() + delay > deadline:
                    raise
            time.sleep(delay * random.uniform(0.5, 1.5))
            delay = min(delay * 2, 0.05)

    def _connection(self) -> sqlite3.Connection:
        if self._closed:
            raise StoreError("the store is closed", backend=self.backend)
        if _forks != self._forks:
            # A forked child must not use its parent's connections: forget them, never close.
            # (A counter bumped at fork, rather than os.getpid(), a system call, on every call.)
            self._forks = _forks
            self._local = _Local()
            self._connections = []
            self._connections_lock = threading.Lock()
            self._write_lock = threading.Lock()
            self._executor = None
            self._writer = None
        if self._shared is not None:
            return self._shared
        local = self._local
        if local.inline:  # never waits for another writer
            if local.inline_connection is None:
                local.inline_connection = self._connect(timeout=0)
            return local.inline_connection
        if local.connection is None:
            local.connection = self._connect()
        return local.connection

    @contextlib.contextmanager
    def _translate_errors(self, key: str) -> Iterator[None]:
        try:
            yield
        except sqlite3.DatabaseError as exc:
            translated = self._translated(exc, key)
            if translated is None:
                raise
            raise translated from exc

    def _translated(self, exc: Exception, key: str) -> StoreError | None:
        """The one place where sqlite3's exceptions become oncely's (``None``: not one)."""
        if isinstance(exc, sqlite3.OperationalError):
            message = str(exc)
            if "no such table" in message:
                return SchemaMissingError(
                    "the oncely tables are missing from the SQLite database: run "
                    "store.migrate() or `oncely migrate`",
                    backend=self.backend,
                )
            if _is_busy(exc) or "unable to open" in message:
                return StoreUnavailableError(
                    f"SQLite database {self.path!r} could not serve {key!r}: {message}",
                    backend=self.backend,
                )
            return StoreError(f"SQLite failed on {key!r}: {message}", backend=self.backend)
        if isinstance(exc, sqlite3.DatabaseError):
            return StoreError(f"SQLite failed on {key!r}: {exc}", backend=self.backend)
        return None

    # -- schema --------------------------------------------------------------------------------

    @staticmethod
    def schema_sql() -> str:
        """The script `migrate` runs, without running it (for migration tools; idempotent)."""
        return resources.files("oncely.stores.sqlite").joinpath("schema.sql").read_text()

    def migrate(self) -> None:
        """Create or upgrade the schema. Idempotent, and safe to run from several processes."""
        script = self.schema_sql()
        connection = self._connection()
        with self._guarded(""), self._translate_errors(""):
            connection.execute("BEGIN IMMEDIATE")
            try:
                columns = {row[0] for row in connection.execute(_sql.COLUMNS)}
                if columns and "op" not in columns:  # a version 1 table
                    connection.execute(_sql.ADD_OP)
                for statement in script.split(";"):
                    if statement.strip():
                        connection.execute(statement)
            except BaseException:
                connection.execute("ROLLBACK")
                raise
            connection.execute("COMMIT")
        self._check_schema()

    def _check_schema(self) -> int:
        with self._guarded(""), self._translate_errors(""):
            row = self._connection().execute(_sql.SELECT_VERSION).fetchone()
        if row is None or row[0] < _sql.SCHEMA_VERSION:
            raise SchemaMissingError(
                "the SQLite database's oncely schema is older than this version: run "
                "store.migrate() or `oncely migrate`",
                backend=self.backend,
            )
        version: int = row[0]
        return version

    def _schema_version(self) -> int:
        return self._check_schema()

    # -- the atomic primitive: read, decide, swap (see the module's docstring) ----------------

    def _atomic(self, key: str, step: Step[T]) -> T:
        row = self._fetch(key)
        return self._decide(key, row, step, self.clock.now_ms())

    def _decide(self, key: str, row: tuple[Any, ...] | None, step: Step[T], now_ms: int) -> T:
        """Let *step* decide on *row*, the record of *key* as read, and make its write if the
        record is still that one; else decide again under the write lock."""
        new, op, answer = self._step(key, row, step, now_ms)
        if new is None:
            return answer
        made: T = self._make((key, *_swap(row, new, op), answer, step))
        return made

    def _make(self, write: _Write) -> Any:
        """Make *write* in a transaction of its own; if it changes no row, decide again."""
        key, sql, params, answer, step = write
        if self._write(self._connection(), key, sql, params):
            return answer
        return self._locked(key, step)

    def _locked(self, key: str, step: Step[T]) -> T:
        """*step* in a ``BEGIN IMMEDIATE`` transaction: the record cannot change meanwhile."""
        with self._transaction(key) as connection:
            return self._apply(connection, key, step, self.clock.now_ms())

    def _atomic_many(self, steps: Sequence[tuple[str, Step[T]]]) -> list[T | StoreError]:
        # One transaction for the batch: one fsync instead of one per item. Each item is still
        # decided on the record as the items before it left it.
        answers: list[T | StoreError] = []
        with self._transaction(steps[0][0] if steps else "") as connection:
            now_ms = self.clock.now_ms()
            for key, step in steps:
                try:
                    answers.append(self._apply(connection, key, step, now_ms))
                except CorruptRecordError as exc:
                    answers.append(exc)
        return answers

    @contextlib.contextmanager
    def _exclusive(self, key: str) -> Iterator[None]:
        """Hold this process's write lock (an inline caller never waits for it: `_Busy`)."""
        self._lock_writes(key, self._local.inline)
        try:
            yield
        finally:
            self._write_lock.release()

    def _lock_writes(self, key: str, inline: bool) -> None:
        """Take this process's write lock (an inline caller never waits for it: `_Busy`)."""
        if inline:
            if not self._write_lock.acquire(blocking=False):
                raise _Busy
        elif not self._write_lock.acquire(timeout=self._timeout):
            raise StoreUnavailableError(
                f"SQLite database {self.path!r} could not serve {key!r}: this process's other "
                f"writers held it for over {self._timeout} s",
                backend=self.backend,
            )

    def _guarded(self, key: str) -> contextlib.AbstractContextManager[None]:
        """Reads of a file need no lock (WAL); the one connection of an in-memory one does."""
        return self._exclusive(key) if self._memory else contextlib.nullcontext()

    @contextlib.contextmanager
    def _transaction(self, key: str) -> Iterator[sqlite3.Connection]:
        """One ``BEGIN IMMEDIATE`` transaction under this process's write lock, sqlite3's errors
        as oncely's (an inline caller that meets a lock: `_Busy`, nothing done)."""
        inline = self._local.inline
        connection = self._connection()
        self._lock_writes(key, inline)
        try:
            connection.execute("BEGIN IMMEDIATE")
            try:
                yield connection
                connection.execute("COMMIT")
            except BaseException:
                if connection.in_transaction:  # a failed COMMIT may leave it open
                    with contextlib.suppress(sqlite3.Error):
                        connection.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            self._fail(exc, key, inline)
        finally:
            self._write_lock.release()

    def _fail(self, exc: sqlite3.Error, key: str, inline: bool) -> NoReturn:
        """Raise *exc* as oncely's error; `_Busy` if an inline caller met a lock."""
        if inline and _is_busy(exc):
            raise _Busy from exc  # nothing was done: wait for the lock in a thread
        translated = self._translated(exc, key)
        if translated is None:
            raise exc
        raise translated from exc

    def _apply(self, connection: sqlite3.Connection, key: str, step: Step[T], now_ms: int) -> T:
        """Read, decide and write on *connection*, whose transaction holds the write lock."""
        row = connection.execute(_sql.SELECT, (key,)).fetchone()
        new, op, answer = self._step(key, row, step, now_ms)
        if new is not None:
            connection.execute(_sql.UPSERT, (*_encode(new), op))
        return answer

    def _step(
        self, key: str, row: tuple[Any, ...] | None, step: Step[T], now_ms: int
    ) -> tuple[Record | None, str | None, T]:
        found = row[10] if row is not None and isinstance(row[10], str) else None
        return step(self._decode(key, row), found, now_ms)

    def _write(
        self, connection: sqlite3.Connection, key: str, sql: str, params: tuple[Any, ...]
    ) -> bool:
        """`_execute` in a transaction of its own, under this process's write lock (an inline
        caller that meets a lock: `_Busy`)."""
        inline = self._local.inline
        self._lock_writes(key, inline)
        try:
            return self._execute(connection, sql, params)
        except sqlite3.Error as exc:
            self._fail(exc, key, inline)
        finally:
            self._write_lock.release()

    @staticmethod
    def _execute(connection: sqlite3.Connection, sql: str, params: tuple[Any, ...]) -> bool:
        """Run a conditional write (`_swap`, `_sql.FINISH`); whether it changed the row."""
        return connection.execute(sql, params).rowcount == 1

    def _read(self, key: str) -> Record | None:
        return self._decode(key, self._fetch(key))

    def _fetch(self, key: str) -> tuple[Any, ...] | None:
        """The row of stored *key*, read without a transaction (an inline caller that meets a
        lock gets `_Busy`)."""
        connection = self._connection()
        try:
            if self._memory:
                with self._exclusive(key):
                    row: tuple[Any, ...] | None = connection.execute(_sql.SELECT, (key,)).fetchone()
            else:  # WAL: a read needs no lock of this process
                row = connection.execute(_sql.SELECT, (key,)).fetchone()
        except sqlite3.Error as exc:
            self._fail(exc, key, self._local.inline)
        return row

    def _fetch_inline(self, key: str) -> tuple[Any, ...] | None:
        """`_fetch` on the event loop's thread: never waits for a lock (`_Busy` instead)."""
        self._local.inline = True
        try:
            return self._fetch(key)
        finally:
            self._local.inline = False

    # -- claims, and their async twins ---------------------------------------------------------

    def claim(self, key: str, fingerprint: str, *, lease: timedelta, ttl: timedelta) -> ClaimResult:
        """See `oncely.SyncStore.claim`."""
        stored = self._stored_key(key)
        row = self._fetch(stored)
        now_ms = self.clock.now_ms()
        answer = self._read_answer(key, row, fingerprint, now_ms)
        if answer is not None:
            return answer
        step = _claim_step(stored, fingerprint, _ms(lease), _ms(ttl))
        claimed: ClaimResult = self._unscoped(self._decide(stored, row, step, now_ms))
        return claimed

    async def aclaim(
        self, key: str, fingerprint: str, *, lease: timedelta, ttl: timedelta
    ) -> ClaimResult:
        """See `oncely.AsyncStore.aclaim`."""
        stored = self._stored_key(key)
        try:
            row = self._fetch_inline(stored)
        except _Busy:  # rare (a WAL read meets a lock only while the file is recovered)
            return await self._run_async(
                functools.partial(self.claim, key, fingerprint, lease=lease, ttl=ttl)
            )
        now_ms = self.clock.now_ms()
        answer = self._read_answer(key, row, fingerprint, now_ms)
        if answer is not None:
            return answer
        step = _claim_step(stored, fingerprint, _ms(lease), _ms(ttl))
        claimed: ClaimResult = self._unscoped(await self._adecide(stored, row, step, now_ms))
        return claimed

    # -- settling: one UPDATE where the lease holds (`_sql.FINISH`), as PostgreSQL's ----------

    def complete(self, key: str, token: int, result: bytes, *, ttl: timedelta) -> LeaseLost | None:
        """See `oncely.SyncStore.complete`."""
        answer: LeaseLost | None = self._make(self._finish(key, token, result, ttl, _COMPLETED))
        return answer

    async def acomplete(
        self, key: str, token: int, result: bytes, *, ttl: timedelta
    ) -> LeaseLost | None:
        """See `oncely.AsyncStore.acomplete`."""
        answer: LeaseLost | None = await self._awrite(
            self._finish(key, token, result, ttl, _COMPLETED)
        )
        return answer

    def fail(self, key: str, token: int, error: bytes, *, ttl: timedelta) -> LeaseLost | None:
        """See `oncely.SyncStore.fail`."""
        answer: LeaseLost | None = self._make(self._finish(key, token, error, ttl, _FAILED))
        return answer

    async def afail(
        self, key: str, token: int, error: bytes, *, ttl: timedelta
    ) -> LeaseLost | None:
        """See `oncely.AsyncStore.afail`."""
        answer: LeaseLost | None = await self._awrite(self._finish(key, token, error, ttl, _FAILED))
        return answer

    def _finish(
        self, key: str, token: int, result: bytes, ttl: timedelta, status: Status
    ) -> _Write:
        """The write that settles *key* as *status* with *result* if *token* holds its lease;
        the state machine decides when it finds nothing to settle (a lost lease, or a record
        that is not what it should be)."""
        stored, ttl_ms, now_ms, outcome = (
            self._stored_key(key),
            _ms(ttl),
            self.clock.now_ms(),
            bytes(result),
        )
        settle = machine.complete if status is _COMPLETED else machine.fail

        def decide(record: Record | None, at_ms: int) -> tuple[Record | None, LeaseLost | None]:
            return settle(record, token, outcome, now_ms=at_ms, ttl_ms=ttl_ms)

        params = (status, outcome, now_ms, now_ms + ttl_ms, now_ms, stored, token, now_ms)
        return stored, _sql.FINISH, params, None, _keeping_op(decide)

    async def _adecide(
        self, key: str, row: tuple[Any, ...] | None, step: Step[T], now_ms: int
    ) -> T:
        """Async `_decide`: the write at once on the event loop's thread when commits do not
        wait for the disk and the lock is free, else on the writer thread."""
        new, op, answer = self._step(key, row, step, now_ms)
        if new is None:
            return answer
        made: T = await self._awrite((key, *_swap(row, new, op), answer, step))
        return made

    async def _awrite(self, write: _Write) -> Any:
        """Make *write*: at once on the event loop's thread when commits do not wait for the
        disk and the lock is free, else on the writer thread."""
        if self._inline:
            key, sql, params, answer, _ = write
            self._local.inline = True
            try:
                if self._write(self._connection(), key, sql, params):
                    return answer
            except _Busy:
                pass  # nothing was written: the writer thread waits for the lock
            finally:
                self._local.inline = False
        writer = self._writer
        if writer is None:
            writer = self._start_writer()
        return await writer.submit(write)

    def _start_writer(self) -> _Writer:
        with self._connections_lock:
            if self._closed:
                raise StoreError("the store is closed", backend=self.backend)
            if self._writer is None:
                self._writer = _Writer(self._write_batch)
            return self._writer

    def _write_batch(self, writes: list[_Write]) -> list[_Outcome]:
        """Make *writes* (on the writer thread): several in one transaction, each swapped if
        its record is as read, else decided again (the transaction holds the write lock)."""
        if len(writes) > 1:
            try:
                with self._transaction(writes[0][0]) as connection:
                    return [
                        (True, answer)
                        if self._execute(connection, sql, params)
                        else (True, self._apply(connection, key, step, self.clock.now_ms()))
                        for key, sql, params, answer, step in writes
                    ]
            except Exception:  # nothing was committed: make each write alone instead
                pass
        outcomes: list[_Outcome] = []
        for write in writes:
            try:
                outcomes.append((True, self._make(write)))
            except Exception as exc:
                outcomes.append((False, exc))
        return outcomes

    def _stored_key(self, key: str) -> str:
        if self._prefix is not None:  # a named namespace: its escaped name, once
            return self._prefix + key
        return super()._stored_key(key)

    def _read_answer(
        self, key: str, row: tuple[Any, ...] | None, fingerprint: str, now_ms: int
    ) -> ClaimResult | None:
        """The claim's answer if the record as read (*row*) needs no write, else ``None``."""
        if row is None:
            return None  # a new key: the claim writes
        record = self._decode(key, row)  # named by the caller's key: no copy to unscope it
        if (
            record is not None
            and (record.status is _COMPLETED or record.status is _FAILED)
            and record.fingerprint == fingerprint
            and now_ms < record.expires_at_ms
        ):
            return Replay(record, judged_at_ms=now_ms)  # machine.claim's answer, at once
        # The lease and ttl shape only a record to write, and a claim that writes is not
        # answered here: zero spares converting them.
        new, answer = machine.claim(key, record, fingerprint, now_ms=now_ms, lease_ms=0, ttl_ms=0)
        return None if new is not None else answer

    def _decode(self, key: str, row: tuple[Any, ...] | None) -> Record | None:
        if row is None:
            return None
        _, status, fingerprint, token, attempt, lease_end, expires, created, updated, result, _ = (
            row
        )
        try:
            if not (
                type(token) is int
                and type(attempt) is int
                and type(lease_end) is int
                and type(expires) is int
                and type(created) is int
                and type(updated) is int
            ):
                raise TypeError(f"{row[3:9]!r} are not all integers")
            if type(fingerprint) is not str:
                raise TypeError(f"fingerprint {fingerprint!r} is not text")
            if result is not None and type(result) is not bytes:
                raise TypeError(f"result of type {type(result).__name__} is not a blob")
            known = _STATUSES.get(status)
            if known is None:
                raise ValueError(f"{status!r} is not a valid Status")
        except (TypeError, ValueError) as exc:
            raise CorruptRecordError(str(exc), backend=self.backend, key=key) from exc
        return Record(
            key=key,
            status=known,
            fingerprint=fingerprint,
            token=token,
            attempt=attempt,
            lease_expires_at_ms=lease_end,
            expires_at_ms=expires,
            created_at_ms=created,
            updated_at_ms=updated,
            result=result,
        )

    # -- maintenance ---------------------------------------------------------------------------

    def purge(self, *, batch: int = 1000, limit: int | None = None) -> int:
        """Delete expired records in batches of *batch*; return how many were deleted.

        Args:
            batch: Records deleted per transaction, so writers are never blocked for long.
            limit: Stop after about this many (default: until none is left).
        """
        connection = self._connection()
        removed = 0
        while limit is None or removed < limit:
            with self._guarded(""), self._translate_errors(""):
                cursor = connection.execute(_sql.PURGE, (self.clock.now_ms(), batch))
            removed += cursor.rowcount
            if cursor.rowcount < batch:
                break
        return removed

    def scan(self, *, after: str = "", limit: int = 100) -> list[Record]:
        """Return up to *limit* live records whose key sorts after *after*, results left out."""
        start, now_ms = self._stored_key(after), self.clock.now_ms()
        params: tuple[str | int, ...]
        if self.namespace:
            sql, params = _sql.SCAN, (start, namespace_range(self.namespace)[1], now_ms, limit)
        else:
            sql, params = _sql.SCAN_DEFAULT, (start, now_ms, limit)
        with self._guarded(""), self._translate_errors(""):
            rows = self._connection().execute(sql, params).fetchall()
        records = [self._decode(row[0], row) for row in rows]
        return [self._unscoped(record) for record in records if record is not None]

    # -- async and lifecycle -------------------------------------------------------------------

    async def _run_async(self, call: Callable[[], T]) -> T:
        if self._inline and not self._closed:
            self._local.inline = True
            try:
                return call()
            except _Busy:
                pass  # nothing was done: wait for the lock in a worker thread instead
            finally:
                self._local.inline = False
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=self._async_workers, thread_name_prefix="oncely-sqlite"
            )
        return await asyncio.get_running_loop().run_in_executor(self._executor, call)

    def close(self) -> None:
        """Close every connection and the async worker threads."""
        with self._connections_lock:
            if self._closed:
                return
            self._closed = True
        if self._writer is not None and self._forks == _forks:
            self._writer.stop()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        with self._connections_lock:
            connections, self._connections = self._connections, []
        for connection in connections:
            connection.close()

    async def aclose(self) -> None:
        """Close every connection and the async worker threads."""
        self.close()


_forks = 0
"""How many times this process is a forked child of the one that imported this module."""


def _count_fork() -> None:
    global _forks
    _forks += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_count_fork)


def _is_busy(exc: sqlite3.Error) -> bool:
    """Whether SQLite answered "not now" (another connection holds a lock)."""
    message = str(exc)
    return "locked" in message or "busy" in message


def _swap(row: tuple[Any, ...] | None, new: Record, op: str | None) -> tuple[str, tuple[Any, ...]]:
    """The statement, and its parameters, that write *new* (and *op*) if the record is still
    *row* (``None``: absent)."""
    values = (
        new.status,  # a str enum: sqlite3 binds its text, with no call to Enum.value
        new.fingerprint,
        new.token,
        new.attempt,
        new.lease_expires_at_ms,
        new.expires_at_ms,
        new.created_at_ms,
        new.updated_at_ms,
        new.result,
        op,
    )
    if row is None:
        return _sql.INSERT, (new.key, *values)
    return _sql.SWAP, (*values, *row)


def _encode(record: Record) -> tuple[Any, ...]:
    return (
        record.key,
        record.status.value,
        record.fingerprint,
        record.token,
        record.attempt,
        record.lease_expires_at_ms,
        record.expires_at_ms,
        record.created_at_ms,
        record.updated_at_ms,
        record.result,
    )


def _require_folder(path: Path) -> None:
    """Refuse a database file whose folder is missing: SQLite would only say, at the first
    call, that it is "unable to open database file", which reads as an outage."""
    folder = path.parent
    if not folder.exists():
        raise ConfigurationError(
            f"the folder {str(folder)!r} of the SQLite database {str(path)!r} does not exist: "
            "create it first (the store creates the file, not its folders)"
        )
    if not folder.is_dir():
        raise ConfigurationError(
            f"{str(folder)!r}, the folder of the SQLite database {str(path)!r}, is not a folder"
        )
