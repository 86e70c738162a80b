"""`sqlite:///path/to.db`: the embedded default store.

Durable, and safe for several processes on one host: the database runs in WAL mode and every
transition is one ``BEGIN IMMEDIATE`` transaction (read the record, let the reference state
machine decide, write), so concurrent claimers in any number of threads and processes are
serialised by SQLite's write lock. All processes of one host share its clock, which judges
leases and expiry.

A claim reads first without the write lock (WAL gives the read a consistent snapshot), and
answers a replay, a mismatch or a live lease from that read, as PostgreSQL's claim does: those
write nothing, and the answer is the one the state machine gives on the record as it stood at
the snapshot. Only a claim that writes (a new key, an expired or released record, a lapsed
lease) takes ``BEGIN IMMEDIATE`` and decides again on the record as it stands then. Async
callers make that first read on the event loop's thread: it never waits for the disk.

Sync callers use a connection per thread. Async callers hop to a small pool of threads owned by
the store (never a thread per call), each with its own connection; except that when commits do
not wait for the disk (``synchronous="normal"`` or ``"off"`` in WAL mode, or an in-memory
database), a transition that finds the write lock free runs at once on the event loop's thread:
it takes tens of microseconds, less than the hop to a thread and back.

An in-memory database has one connection, used under the store's lock by every caller: SQLite's
shared cache, the other way to share one, locks tables without heeding the busy timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import random
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qs

from oncely._core import machine
from oncely._core.clock import Clock
from oncely._core.records import ClaimResult, Record, Replay, Status
from oncely.errors import (
    ConfigurationError,
    CorruptRecordError,
    SchemaMissingError,
    StoreError,
    StoreUnavailableError,
)
from oncely.stores._machine import MachineStore, Step
from oncely.stores._namespace import namespace_range, stored_key
from oncely.stores.sqlite import _sql

__all__ = ["SQLiteStore"]

T = TypeVar("T")

_SYNCHRONOUS = ("off", "normal", "full", "extra")

_STATUSES = {status.value: status for status in Status}
"""Statuses by their stored text: a dict lookup, where ``Status(text)`` goes through EnumMeta."""


class _Busy(Exception):
    """An inline attempt found the write lock taken: nothing was done; use a worker thread."""


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
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        self._connections_lock = threading.Lock()
        # This process's writers queue here, woken at once, instead of in SQLite's busy handler,
        # which sleeps (1, 2, 5, 10... ms) between tries: that sleep, not the write, is what a
        # contended transition would cost. Other processes still meet the busy handler.
        self._write_lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
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
                if getattr(self._local, "inline", False):
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
            self._local = threading.local()
            self._connections = []
            self._connections_lock = threading.Lock()
            self._write_lock = threading.Lock()
            self._executor = None
        if self._shared is not None:
            return self._shared
        if getattr(self._local, "inline", False):  # never waits for another writer
            inline: sqlite3.Connection | None = getattr(self._local, "inline_connection", None)
            if inline is None:
                inline = self._local.inline_connection = self._connect(timeout=0)
            return inline
        connection: sqlite3.Connection | None = getattr(self._local, "connection", None)
        if connection is None:
            connection = self._local.connection = self._connect()
        return connection

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

    # -- the atomic primitive ------------------------------------------------------------------

    def _atomic(self, key: str, step: Step[T]) -> T:
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
        self._lock_writes(key, getattr(self._local, "inline", False))
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
        as oncely's. One context manager with plain try blocks inside (rather than one each for
        the lock and the errors): this runs once per transition."""
        inline = getattr(self._local, "inline", False)
        connection = self._connection()
        self._lock_writes(key, inline)
        try:
            try:
                connection.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as exc:
                if inline and _is_busy(exc):
                    raise _Busy from exc  # another process writes: wait in a thread
                raise
            try:
                yield connection
            except BaseException:
                connection.execute("ROLLBACK")
                raise
            connection.execute("COMMIT")
        except sqlite3.DatabaseError as exc:
            translated = self._translated(exc, key)
            if translated is None:
                raise
            raise translated from exc
        finally:
            self._write_lock.release()

    def _apply(self, connection: sqlite3.Connection, key: str, step: Step[T], now_ms: int) -> T:
        row = connection.execute(_sql.SELECT, (key,)).fetchone()
        record = self._decode(key, row)
        found = row[-1] if row is not None and isinstance(row[-1], str) else None
        new, op, answer = step(record, found, now_ms)
        if new is not None:
            connection.execute(_sql.UPSERT, (*_encode(new), op))
        return answer

    def _read(self, key: str) -> Record | None:
        return self._decode(key, self._fetch(key))

    def _fetch(self, key: str) -> tuple[Any, ...] | None:
        """The row of stored *key*, read without a transaction (an inline caller that meets a
        lock gets `_Busy`)."""
        connection = self._connection()
        if self._memory:
            with self._exclusive(key):
                return self._fetch_on(connection, key)
        return self._fetch_on(connection, key)  # WAL: a read needs no lock of this process

    def _fetch_on(self, connection: sqlite3.Connection, key: str) -> tuple[Any, ...] | None:
        try:
            row: tuple[Any, ...] | None = connection.execute(_sql.SELECT, (key,)).fetchone()
        except sqlite3.Error as exc:
            if getattr(self._local, "inline", False) and _is_busy(exc):
                raise _Busy from exc
            translated = self._translated(exc, key)
            if translated is None:
                raise
            raise translated from exc
        return row

    # -- claims: a read without the write lock first (see the module's docstring) --------------

    def claim(self, key: str, fingerprint: str, *, lease: timedelta, ttl: timedelta) -> ClaimResult:
        """See `oncely.SyncStore.claim`."""
        answer = self._answer_read(key, fingerprint)
        if answer is None:
            return super().claim(key, fingerprint, lease=lease, ttl=ttl)
        return answer

    async def aclaim(
        self, key: str, fingerprint: str, *, lease: timedelta, ttl: timedelta
    ) -> ClaimResult:
        """See `oncely.AsyncStore.aclaim`."""
        answer: ClaimResult | None = None
        if not self._closed:
            self._local.inline = True
            try:
                answer = self._answer_read(key, fingerprint)
            except _Busy:
                pass  # a lock met on the way: read again, and decide, in a worker thread
            finally:
                self._local.inline = False
        if answer is None:
            return await self._run_async(
                functools.partial(super().claim, key, fingerprint, lease=lease, ttl=ttl)
            )
        return answer

    def _stored_key(self, key: str) -> str:
        if self._prefix is not None:  # a named namespace: its escaped name, once
            return self._prefix + key
        return super()._stored_key(key)

    def _answer_read(self, key: str, fingerprint: str) -> ClaimResult | None:
        """The claim's answer if the record as read now needs no write, else ``None``."""
        row = self._fetch(self._stored_key(key))
        if row is None:
            return None  # a new key: the claim writes
        record = self._decode(key, row)  # named by the caller's key: no copy to unscope it
        now_ms = self.clock.now_ms()
        # The lease and ttl shape only a record to write, and a claim that writes is not
        # answered here: zero spares converting them on every replay.
        new, answer = machine.claim(key, record, fingerprint, now_ms=now_ms, lease_ms=0, ttl_ms=0)
        if new is not None:
            return None
        if isinstance(answer, Replay):
            return Replay(answer.record, judged_at_ms=now_ms)
        return answer

    def _decode(self, key: str, row: tuple[Any, ...] | None) -> Record | None:
        if row is None:
            return None
        try:
            (
                _,
                status,
                fingerprint,
                token,
                attempt,
                lease_end,
                expires,
                created,
                updated,
                result,
            ) = row[:10]
            numbers = {type(token), type(attempt), type(lease_end), type(expires), type(created)}
            if type(updated) is not int or numbers != {int}:
                raise TypeError(f"{row[3:9]!r} are not all integers")
            if not isinstance(fingerprint, str):
                raise TypeError(f"fingerprint {fingerprint!r} is not text")
            if result is not None and not isinstance(result, bytes):
                raise TypeError(f"result of type {type(result).__name__} is not a blob")
            known = _STATUSES.get(status)
            if known is None:
                raise ValueError(f"{status!r} is not a valid Status")
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
        except (TypeError, ValueError) as exc:
            raise CorruptRecordError(str(exc), backend=self.backend, key=key) from exc

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
        if self._closed:
            return
        self._closed = True
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
