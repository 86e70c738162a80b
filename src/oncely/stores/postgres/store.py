"""`postgresql://…`: records in PostgreSQL, for several hosts and the user's HA cluster.

Every transition is one statement in autocommit mode, so one round trip, judged by the
server's clock: workers whose clocks disagree by minutes still cannot take a live lease. A claim
inserts a new key, or answers a replay, a mismatch or a live lease from a plain read; what
needs a decision on a locked row (a lapsed lease, an expired or released record, a lost insert
race) goes on to the ``oncely_claim`` function that `PostgresStore.migrate` installs (see
``schema.sql`` for why that takes a function to be race-free), in a second round trip. The other
verbs are single ``UPDATE``s. The batch verbs send one statement over arrays of their items
(`_sql.CLAIM_SET`, `_sql.FINISH_SET`, `_sql.EXTEND_SET`) in pipeline mode: one round trip and
one transaction per batch (see `_sql.Batch` for why one transaction, and why in key order).

A transition whose session dies under it (a restart, a failover, a proxy cutting the
connection, perhaps after the commit with the reply lost) is sent once more on a fresh
connection: each carries the id of its call, so a re-sent claim finds its own lease and a
re-sent complete its own completion, and the caller gets the answer the lost reply carried.

Sync callers share a `psycopg_pool.ConnectionPool`; async callers share an
`psycopg_pool.AsyncConnectionPool` per event loop, opened on first use in that loop (``_pools``,
which also keeps a sequential caller on one connection between statements). Both run the same
flows from ``_sql.py``, so statements and decoding exist once. Statements are prepared on the
server the first time each connection runs them. Driver errors become oncely's in ``_errors``.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, overload
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from oncely._cancel import release_unused, shielded
from oncely._core.clock import Clock
from oncely._core.flow import Flow, adrive, drive
from oncely._core.records import ClaimResult, LeaseLost, Record, Status, StoreHealth
from oncely._deps import require
from oncely._log import get_logger
from oncely.errors import (
    ConfigurationError,
    CorruptRecordError,
    SchemaMissingError,
    StoreError,
)
from oncely.stores import _namespace
from oncely.stores._coalesce import Coalescer
from oncely.stores._machine import in_progress_refusal
from oncely.stores.postgres import _pools, _sql, _wire
from oncely.stores.postgres._errors import Boundary

if TYPE_CHECKING:
    import psycopg
    import psycopg.conninfo
    import psycopg_pool

    from oncely.stores.postgres import _asyncpg
else:
    psycopg = require("psycopg", extra="postgres")
    psycopg_pool = require("psycopg_pool", extra="postgres")
    require("psycopg.conninfo", extra="postgres")

__all__ = ["PostgresStore"]

logger = get_logger("oncely")

_TUPLES_OK = psycopg.pq.ExecStatus.TUPLES_OK

_PIPELINE = psycopg.Pipeline.is_supported()
"""Whether libpq has pipeline mode (14 and later; psycopg's binary wheels bundle one)."""


def _has_rows(cursor: Any) -> bool:
    # Cheaper than `cursor.description`, which builds a Column object per column on each call.
    result = cursor.pgresult
    return result is not None and result.status == _TUPLES_OK


@overload
def _cursor(connection: psycopg.Connection[Any]) -> psycopg.Cursor[Any]: ...
@overload
def _cursor(connection: psycopg.AsyncConnection[Any]) -> psycopg.AsyncCursor[Any]: ...
def _cursor(connection: Any) -> Any:
    """The cursor that runs *connection*'s single statements, made on its first one.

    ``connection.execute`` makes a cursor per statement (and its adapters and transformer);
    a cursor can run any number of statements one after the other, and a pooled connection
    runs one at a time. Kept on the connection, it goes with it.
    """
    try:
        return connection._oncely_cursor
    except AttributeError:
        cursor = connection._oncely_cursor = connection.cursor()
        return cursor


@functools.lru_cache(maxsize=64)
def _encoded(sql: str) -> bytes | str:
    """*sql* as bytes, made once: psycopg encodes a ``str`` query on every execution, and
    hashes the new bytes to find its cached parsing and its prepared statement (a claim's
    text is 1.5 kB). Only ASCII text, the same bytes in any client encoding."""
    return sql.encode() if sql.isascii() else sql


def _reply(result: Any) -> _sql.Reply:
    """A `_wire` statement's libpq *result* as a `_sql.Reply`: its rows left in it (``raw``)."""
    affected = result.command_tuples
    return _sql.Reply((), -1 if affected is None else affected, result)


def _claimed(
    queries: _sql.Queries, statement: _sql.Statement, reply: _sql.Reply
) -> ClaimResult | _sql.Statement:
    """`_sql.decode_claim_one`, for a reply of either path."""
    if reply.raw is not None:
        answer = _wire.claim_answer(statement.key, reply.raw, decided=False)
        if answer is not None:
            return answer
    return _sql.decode_claim_one(queries, statement, reply)


def _decided(key: str, reply: _sql.Reply) -> ClaimResult:
    """`_sql.decode_claim`, for a reply of either path."""
    if reply.raw is not None:
        return _wire.claim_answer(key, reply.raw, decided=True)  # type: ignore[return-value]
    return _sql.decode_claim(key, reply)


_S = TypeVar("_S", bound="PostgresStore")

_RESENDS = 1
"""How often a statement that can be re-sent (`_sql.Statement.resend`) is sent again after its
session died under it. psycopg and psycopg_pool never re-send a statement themselves: a broken
connection raises, and the pool only discards it."""

_URL_OPTIONS: dict[str, Callable[[str], object]] = {
    "schema": str,
    "min_size": int,
    "max_size": int,
    "connect_timeout": float,
    "pool_timeout": float,
    "statement_timeout": float,
    "prepare": lambda text: text.lower() in ("1", "true", "yes", "on"),
    "async_driver": str,
}
"""Query parameters of a store URL that configure the store rather than libpq."""

_INHERITED: list[object] = []
"""Pools a forked child inherited: kept alive, never closed, since the parent owns their
connections (closing them would end the parent's sessions)."""

_OPEN_STORES: weakref.WeakSet[PostgresStore] = weakref.WeakSet()
"""Every store of this process, so a forked child can make them forget their parent's pools."""


class PostgresStore:
    """Records in a PostgreSQL table, shared by any number of processes and hosts.

    The schema is created by `migrate` (or ``oncely migrate``), never on first use: until then
    every verb raises `SchemaMissingError`. Nothing connects before the first call.

    Args:
        conninfo: A libpq connection string or ``postgresql://`` URL.
        namespace: A prefix that keeps this store's keys apart from others' in the same table.
        schema: The PostgreSQL schema holding oncely's table and function.
        clock: Accepted for symmetry with the other stores and unused: the server's clock
            judges leases and expiry.
        min_size: Connections each pool keeps open.
        max_size: Connections each pool opens at most (sync callers share one pool; each event
            loop has its own).
        connect_timeout: Seconds to wait for a new connection (libpq's minimum is 2).
        pool_timeout: Seconds a call waits for a free connection before
            `StoreUnavailableError`; while the server is unreachable, every call fails after it.
        statement_timeout: Seconds after which the server cancels a statement (``None``: the
            server's setting).
        application_name: Reported in ``pg_stat_activity`` unless the conninfo sets one.
        prepare: Prepare statements on the server (set ``False`` behind a pooler without
            prepared-statement support).
        async_driver: ``"psycopg"``, or ``"asyncpg"`` to run the async verbs on asyncpg
            (``pip install 'oncely[asyncpg]'``); the sync verbs, inbox and outbox use psycopg.

    Raises:
        ConfigurationError: A malformed connection string or option; on first use, a role,
            password or database the server refuses (with the server's reason).
        MissingDependencyError: psycopg is not installed (``pip install 'oncely[postgres]'``).

    .. versionadded:: 0.1.0
    """

    backend = "postgres"
    _cancel_safe: ClassVar[type[PostgresStore]]  # see aclaim

    def __init__(
        self,
        conninfo: str = "",
        *,
        namespace: str = "",
        schema: str = "public",
        clock: Clock | None = None,
        min_size: int = 1,
        max_size: int = 10,
        connect_timeout: float | None = None,
        pool_timeout: float = 5.0,
        statement_timeout: float | None = 10.0,
        application_name: str = "oncely",
        prepare: bool = True,
        async_driver: str = "psycopg",
    ) -> None:
        del clock  # the server's clock judges time
        if not 0 <= min_size <= max_size or max_size < 1:
            raise ConfigurationError("pool sizes need 0 <= min_size <= max_size and max_size >= 1")
        if pool_timeout <= 0 or (statement_timeout is not None and statement_timeout <= 0):
            raise ConfigurationError("pool_timeout and statement_timeout must be positive")
        try:
            self._queries = _sql.Queries(schema)
            self._wires = _wire.wires(self._queries)
            params = psycopg.conninfo.conninfo_to_dict(conninfo)
        except (ValueError, psycopg.Error) as exc:
            raise ConfigurationError(f"bad PostgreSQL store settings: {exc}") from exc
        self.namespace = namespace
        self._prefix = _namespace.stored_key(namespace, "") if namespace else None
        self.schema = schema
        self._conninfo = conninfo
        self._kwargs: dict[str, Any] = {"autocommit": True}
        if "application_name" not in params:
            self._kwargs["application_name"] = application_name
        if connect_timeout is not None or "connect_timeout" not in params:
            self._kwargs["connect_timeout"] = max(2, round(connect_timeout or 5))
        if statement_timeout is not None:
            setting = f"-c statement_timeout={round(statement_timeout * 1000)}"
            self._kwargs["options"] = f"{params.get('options', '')} {setting}".strip()
        self._min_size = min_size
        self._max_size = max_size
        self._pool_timeout = pool_timeout
        self._prepare = prepare
        self._where = "{}:{}/{}".format(
            params.get("host") or "localhost", params.get("port") or 5432, params.get("dbname", "")
        )
        self._boundary = Boundary(self._where, schema, pool_timeout)
        self._driver = _driver(async_driver, params, self._kwargs, self)
        self._lock = threading.Lock()
        self._pool: psycopg_pool.ConnectionPool[Any] | None = None
        self._parked: _pools.Parked | None = None
        self._loop_pools: dict[asyncio.AbstractEventLoop, _pools.LoopPool] = {}
        self._extends = Coalescer(
            self._aextend_alone, self._aextend_many, max_in_flight=2, max_batch=256
        )
        self._closed = False
        _OPEN_STORES.add(self)

    @classmethod
    def from_url(cls, url: str, **options: Any) -> PostgresStore:
        """Open ``postgresql://user:password@host:port/dbname?…`` (or ``postgres://``).

        Query parameters ``schema``, ``min_size``, ``max_size``, ``connect_timeout``,
        ``pool_timeout``, ``statement_timeout``, ``prepare`` and ``async_driver`` configure the
        store (keyword *options* take precedence); any other, such as ``sslmode``, goes to libpq.
        """
        parts = urlsplit(url)
        passed = []
        for name, value in parse_qsl(parts.query, keep_blank_values=True):
            convert = _URL_OPTIONS.get(name)
            if convert is None:
                passed.append((name, value))
                continue
            try:
                options.setdefault(name, convert(value))
            except ValueError:
                raise ConfigurationError(f"bad value {value!r} for {name} in {url!r}") from None
        return cls(urlunsplit(parts._replace(query=urlencode(passed))), **options)

    # -- connections ---------------------------------------------------------------------------

    def _usable(self) -> None:
        if self._closed:
            raise StoreError("the store is closed", backend=self.backend)

    def _after_fork(self) -> None:
        # Only the forking thread survives, and it may have left the lock held: take a new one.
        # The parent's pools stay referenced and unclosed, since closing them would end the
        # parent's sessions; this process opens its own on first use.
        self._lock = threading.Lock()
        _INHERITED.extend([self._pool, self._parked, *self._loop_pools.values()])
        _INHERITED.extend(self._driver.after_fork() if self._driver else ())
        self._pool, self._parked, self._loop_pools = None, None, {}

    def _sync_parked(self) -> _pools.Parked:
        self._usable()
        parked = self._parked
        if parked is None:
            self._probe()  # outside the lock: a slow connect must not hold up other threads
            with self._lock:
                parked = self._parked
                if parked is None:
                    pool = psycopg_pool.ConnectionPool(
                        self._conninfo,
                        kwargs=self._kwargs,
                        min_size=self._min_size,
                        max_size=self._max_size,
                        timeout=self._pool_timeout,
                        name=f"oncely-{next(_pools.POOL_NUMBERS)}",
                        configure=_pools.CONNECTIONS.add,
                        open=False,
                    )
                    pool.open()
                    self._pool, parked = pool, _pools.Parked(pool, self._min_size)
                    self._parked = parked
        return parked

    async def _async_pool(self) -> psycopg_pool.AsyncConnectionPool[Any]:
        """The running loop's pool, for callers that take its connections themselves (with
        the parked ones given back to it first)."""
        entry = await self._loop_pool()
        await entry.flush()
        return entry.pool

    async def _loop_pool(self) -> _pools.LoopPool:
        self._usable()
        loop = asyncio.get_running_loop()
        entry = self._loop_pools.get(loop)
        if entry is None:
            with self._lock:
                entry = self._loop_pools.get(loop)
                if entry is None:
                    for stale in [other for other in self._loop_pools if other.is_closed()]:
                        self._loop_pools.pop(stale).abandon()
                    entry = self._loop_pools[loop] = self._new_loop_pool(loop)
        if entry.pool.closed:  # not opened yet; opening twice is harmless
            await self._aprobe()
            await entry.open(self._forget)
        return entry

    def _probe(self) -> None:
        """Connect once before a pool opens, so a server that cannot be reached, or refuses
        the settings, fails the call at once with its reason.

        The pool connects in the background and retries a failed connection until
        ``pool_timeout``, logging each failure: that would make a wrong role, password or
        database look like an outage, and a server that is down take ``pool_timeout`` to
        report, without its reason. No pool is opened until a connection succeeds.
        """
        try:
            psycopg.connect(self._conninfo, **self._kwargs).close()
        except psycopg.OperationalError as exc:
            raise self._unreachable(exc) from exc

    async def _aprobe(self) -> None:
        """Async `_probe`."""
        try:
            await (await psycopg.AsyncConnection.connect(self._conninfo, **self._kwargs)).close()
        except psycopg.OperationalError as exc:
            raise self._unreachable(exc) from exc

    def _unreachable(self, exc: psycopg.OperationalError) -> Exception:
        return self._boundary.unreachable(exc)

    def _forget(self, entry: _pools.LoopPool) -> None:
        with self._lock:
            if self._loop_pools.get(entry.loop) is entry:
                del self._loop_pools[entry.loop]

    def _new_loop_pool(self, loop: asyncio.AbstractEventLoop) -> _pools.LoopPool:
        async def track(connection: psycopg.AsyncConnection[Any]) -> None:
            entry.connections.add(connection)
            _pools.CONNECTIONS.add(connection)

        entry = _pools.LoopPool(
            loop,
            psycopg_pool.AsyncConnectionPool(
                self._conninfo,
                kwargs=self._kwargs,
                min_size=self._min_size,
                max_size=self._max_size,
                timeout=self._pool_timeout,
                name=f"oncely-async-{next(_pools.POOL_NUMBERS)}",
                configure=track,
                open=False,
            ),
        )
        return entry

    @contextlib.contextmanager
    def _errors(self, op: Any) -> Iterator[None]:
        """psycopg's exceptions as oncely's (*op* failed), for callers outside the verbs."""
        try:
            yield
        except Exception as exc:
            translated = self._translated(exc, op)
            if translated is None:
                raise
            raise translated from exc

    def _translated(self, exc: BaseException, op: Any) -> Exception | None:
        """psycopg's exception *exc* as oncely's, *op* failing (``None``: not psycopg's)."""
        last = None
        if isinstance(exc, psycopg_pool.PoolTimeout):
            pools = (p for p in (self._pool, *(e.pool for e in self._loop_pools.values())) if p)
            last = _pools.QUIET_POOLS.last_error(pools)
        return self._boundary.translated(exc, op.subject, last)

    # The verbs' path: a plain try (free in CPython 3.11 until something raises) rather than
    # the context managers of `_errors` and ``pool.connection()``, and the pool's `getconn` and
    # `putconn` behind `_pools.Parked` rather than ``pool.connection()``, whose
    # ``with connection:`` adds a commit call (a no-op in autocommit mode) to every statement.
    # A connection whose statement failed goes back to the pool, which resets it.

    def _execute(self, op: _sql.Statement | _sql.Batch) -> Any:
        """Run a `Statement` (a `Reply`) or a `Batch` (a list of them) on a pooled connection."""
        try:
            parked = self._parked or self._sync_parked()
            sends_left = _RESENDS if op.resend else 0
            while True:
                connection = parked.get()
                reusable = False
                try:
                    if type(op) is _sql.Statement:
                        reply: Any = _run(self, connection, op)
                    else:
                        reply = _run_batch(self, connection, op)  # type: ignore[arg-type]
                    reusable = True
                    return reply
                except psycopg.OperationalError:
                    if not connection.broken:
                        raise
                    # A session that died usually did not die alone (a restart, a failover, a
                    # kill): weed out the pool's other dead sessions now, so that the next
                    # attempt gets a live one rather than the next dead one.
                    parked.flush()
                    parked.pool.check()
                    if not sends_left:
                        raise
                    # The session died, perhaps after the server applied op but before its
                    # reply came back: op recognises its own effect (see _sql): send it again.
                    sends_left -= 1
                finally:
                    parked.put(connection, reusable)
        except Exception as exc:
            translated = self._translated(exc, op)
            if translated is None:
                raise
            raise translated from exc

    async def _aexecute(self, op: _sql.Statement | _sql.Batch) -> Any:
        """Async `_execute` (on asyncpg if the store's async driver is)."""
        if self._driver is not None:
            return await self._driver.execute(op)
        try:
            entry = await self._loop_pool()
            sends_left = _RESENDS if op.resend else 0
            while True:
                connection = await entry.get()
                reusable = False
                try:
                    if type(op) is _sql.Statement:
                        reply: Any = await _arun(self, connection, op)
                    else:
                        reply = await _arun_batch(self, connection, op)  # type: ignore[arg-type]
                    reusable = True
                    return reply
                except psycopg.OperationalError:
                    if not connection.broken:
                        raise
                    await entry.flush()  # as in _execute
                    await entry.pool.check()
                    if not sends_left:
                        raise
                    sends_left -= 1
                finally:
                    await entry.put(connection, reusable)
        except Exception as exc:
            translated = self._translated(exc, op)
            if translated is None:
                raise
            raise translated from exc

    def _stored_key(self, key: str) -> str:
        if self._prefix is not None:  # a named namespace: its escaped name, once
            return self._prefix + key
        return _namespace.stored_key("", key)

    # -- sync verbs ----------------------------------------------------------------------------

    def claim(self, key: str, fingerprint: str, *, lease: timedelta, ttl: timedelta) -> ClaimResult:
        """See `oncely.SyncStore.claim`. One statement, judged by the server's clock."""
        # Two for a key whose record is expired, released or a lapsed lease, or that another
        # call inserted at the same moment (see `_sql.CLAIM`).
        statement = self._claim(key, fingerprint, lease, ttl)
        answer = _claimed(self._queries, statement, self._execute(statement))
        if type(answer) is _sql.Statement:
            return _decided(key, self._execute(answer))
        return answer  # type: ignore[return-value]

    def complete(self, key: str, token: int, result: bytes, *, ttl: timedelta) -> LeaseLost | None:
        """See `oncely.SyncStore.complete`."""
        return _sql.held(self._execute(self._finish(key, token, Status.COMPLETED, result, ttl)))

    def fail(self, key: str, token: int, error: bytes, *, ttl: timedelta) -> LeaseLost | None:
        """See `oncely.SyncStore.fail`."""
        return _sql.held(self._execute(self._finish(key, token, Status.FAILED, error, ttl)))

    # The claim and the finishes are one statement each: run without a flow (`drive` and a
    # generator per call), their statements built and their replies decoded by _sql alike.

    def _claim(
        self, key: str, fingerprint: str, lease: timedelta, ttl: timedelta
    ) -> _sql.Statement:
        stored = self._stored_key(key)
        return _sql.claim_statement(
            self._queries, stored, key, fingerprint, _sql.ms(lease), _sql.ms(ttl)
        )

    def _finish(
        self, key: str, token: int, status: Status, result: bytes, ttl: timedelta
    ) -> _sql.Statement:
        stored = self._stored_key(key)
        return _sql.finish_statement(self._queries, stored, key, token, status, result, ttl)

    def release(self, key: str, token: int) -> LeaseLost | None:
        """See `oncely.SyncStore.release`."""
        return drive(_sql.release(self._queries, self._stored_key(key), key, token), self._execute)

    def extend(self, key: str, token: int, *, lease: timedelta) -> LeaseLost | None:
        """See `oncely.SyncStore.extend`: a batch of one, so one round trip even on a pooled
        connection that has not prepared it yet (a new one, opened over a slow network)."""
        flow = _sql.extend_many(self._queries, [(self._stored_key(key), key, token)], lease)
        (answer,) = drive(flow, self._execute)
        if isinstance(answer, StoreError):
            raise answer
        return answer

    def get(self, key: str) -> Record | None:
        """See `oncely.SyncStore.get`."""
        return drive(_sql.get(self._queries, self._stored_key(key), key), self._execute)

    def claim_many(
        self,
        requests: Sequence[tuple[str, str]],
        *,
        lease: timedelta,
        ttl: timedelta,
        ops: Sequence[str] | None = None,
    ) -> list[ClaimResult | StoreError]:
        """See `oncely.BatchStore.claim_many`: one round trip and one transaction.

        *ops*, one per request, are the claims' call ids (new ones when omitted): a batch sent
        again with the same ids, after a reply that never came, gets its own applied claims
        back as `Acquired` (not `InProgress`)."""
        return drive(self._claim_many(requests, lease, ttl, ops), self._execute)

    def complete_many(
        self, items: Sequence[tuple[str, int, bytes]], *, ttl: timedelta
    ) -> list[LeaseLost | StoreError | None]:
        """See `oncely.BatchStore.complete_many`: one round trip and one transaction."""
        return drive(self._complete_many(items, ttl), self._execute)

    def _claim_many(
        self,
        requests: Sequence[tuple[str, str]],
        lease: timedelta,
        ttl: timedelta,
        ops: Sequence[str] | None,
    ) -> Flow[list[ClaimResult | StoreError]]:
        named = [(self._stored_key(key), key, fingerprint) for key, fingerprint in requests]
        return _sql.claim_many(self._queries, named, lease, ttl, ops)

    def _complete_many(
        self, items: Sequence[tuple[str, int, bytes]], ttl: timedelta
    ) -> Flow[list[LeaseLost | StoreError | None]]:
        named = [(self._stored_key(key), key, token, result) for key, token, result in items]
        return _sql.finish_many(self._queries, named, Status.COMPLETED, ttl)

    # -- async verbs ---------------------------------------------------------------------------

    # A caller cancelled while its claim or finish is in flight: the statement may have been
    # applied with its reply lost. Each carries its call's op, so sending it again (shielded)
    # finds its own effect: a claim's lease is then given back, a finish has landed. So the
    # entry points await these verbs directly, without a task of their own to shield them
    # (`_cancel_safe`).

    async def aclaim(
        self, key: str, fingerprint: str, *, lease: timedelta, ttl: timedelta
    ) -> ClaimResult:
        """See `oncely.AsyncStore.aclaim`; a cancelled caller's lease is given back."""
        statement = self._claim(key, fingerprint, lease, ttl)
        try:
            return await self._aclaimed(key, statement)
        except asyncio.CancelledError:
            await shielded(self._give_back(key, statement))
            raise

    async def _aclaimed(self, key: str, statement: _sql.Statement) -> ClaimResult:
        answer = _claimed(self._queries, statement, await self._aexecute(statement))
        if type(answer) is _sql.Statement:
            return _decided(key, await self._aexecute(answer))
        return answer  # type: ignore[return-value]

    async def _give_back(self, key: str, statement: _sql.Statement) -> None:
        try:
            answer = await self._aclaimed(key, statement)
        except Exception:
            return  # not known: a lease it took expires on its own
        await release_unused(self, key, answer)

    async def acomplete(
        self, key: str, token: int, result: bytes, *, ttl: timedelta
    ) -> LeaseLost | None:
        """See `oncely.AsyncStore.acomplete`; it lands even if its caller is cancelled."""
        return await self._afinish(self._finish(key, token, Status.COMPLETED, result, ttl))

    async def afail(
        self, key: str, token: int, error: bytes, *, ttl: timedelta
    ) -> LeaseLost | None:
        """See `oncely.AsyncStore.afail`; it lands even if its caller is cancelled."""
        return await self._afinish(self._finish(key, token, Status.FAILED, error, ttl))

    async def _afinish(self, statement: _sql.Statement) -> LeaseLost | None:
        try:
            return _sql.held(await self._aexecute(statement))
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await shielded(self._aexecute(statement))
            raise

    async def arelease(self, key: str, token: int) -> LeaseLost | None:
        """See `oncely.AsyncStore.arelease`."""
        flow = _sql.release(self._queries, self._stored_key(key), key, token)
        return await adrive(flow, self._aexecute)

    async def aextend(self, key: str, token: int, *, lease: timedelta) -> LeaseLost | None:
        """See `oncely.AsyncStore.aextend`.

        Heartbeats of many leases beat together: the extends of one event loop go to the
        server two calls at a time at most, and those that arrive meanwhile go together as the
        next call, each call one round trip (pipeline mode, statement preparation included).
        So a loop's extends hold two pooled connections at most and never wait for the pool to
        open new ones, which over a slow network would cost them round trips each (and their
        leases)."""
        answer: LeaseLost | None = await self._extends.submit((key, token), {"lease": lease})
        return answer

    async def _aextend_many(
        self, items: Sequence[tuple[str, int]], *, lease: timedelta
    ) -> list[LeaseLost | StoreError | None]:
        named = [(self._stored_key(key), key, token) for key, token in items]
        return await adrive(_sql.extend_many(self._queries, named, lease), self._aexecute)

    async def _aextend_alone(self, key: str, token: int, *, lease: timedelta) -> LeaseLost | None:
        # A batch of one: one round trip even on a connection that has not prepared it yet.
        (answer,) = await self._aextend_many([(key, token)], lease=lease)
        if isinstance(answer, StoreError):
            raise answer
        return answer

    async def aget(self, key: str) -> Record | None:
        """See `oncely.AsyncStore.aget`."""
        return await adrive(_sql.get(self._queries, self._stored_key(key), key), self._aexecute)

    async def aclaim_many(
        self,
        requests: Sequence[tuple[str, str]],
        *,
        lease: timedelta,
        ttl: timedelta,
        ops: Sequence[str] | None = None,
    ) -> list[ClaimResult | StoreError]:
        """See `claim_many`."""
        return await adrive(self._claim_many(requests, lease, ttl, ops), self._aexecute)

    async def acomplete_many(
        self, items: Sequence[tuple[str, int, bytes]], *, ttl: timedelta
    ) -> list[LeaseLost | StoreError | None]:
        """See `oncely.BatchStore.acomplete_many`."""
        return await adrive(self._complete_many(items, ttl), self._aexecute)

    # -- schema and maintenance ----------------------------------------------------------------

    def migrate(self) -> None:
        """Create or upgrade the schema, table, index and claim function.

        Idempotent, and safe to run from several processes at once: the script runs in one
        transaction under an advisory lock per schema.

        Raises:
            StoreError: The database holds a newer schema than this version of oncely, or
                refused the script (for example for lack of privileges).
            StoreUnavailableError: The server could not be reached.
        """
        drive(_sql.migrate(self._queries), self._execute)

    async def amigrate(self) -> None:
        """Async `migrate`."""
        await adrive(_sql.migrate(self._queries), self._aexecute)

    def schema_sql(self) -> str:
        """The script `migrate` runs, rendered for this store's schema, without running it.

        For migration tools (Alembic, Django): run it in one transaction, as they do (with
        ``psql``, pass ``--single-transaction``). It is idempotent, like `migrate`.
        """
        return (
            f"-- oncely schema {_sql.SCHEMA_VERSION} for PostgreSQL schema {self.schema!r}: "
            "run it in one transaction.\n" + self._queries.migrate.lstrip("\n")
        )

    def forget(self, key: str, *, force: bool = False) -> Status | None:
        """See `oncely.stores.memory.MemoryStore.forget`. One statement."""
        flow = _sql.forget(self._queries, self._stored_key(key), key, force)
        return _forgotten(key, drive(flow, self._execute))

    async def aforget(self, key: str, *, force: bool = False) -> Status | None:
        """Async `forget`."""
        flow = _sql.forget(self._queries, self._stored_key(key), key, force)
        return _forgotten(key, await adrive(flow, self._aexecute))

    def check(self) -> StoreHealth:
        """See `oncely.CheckableStore.check`: one statement reads the schema's version."""
        started = time.perf_counter()
        version = drive(_sql.schema_version(self._queries), self._execute)
        return _health(self, version, started)

    async def acheck(self) -> StoreHealth:
        """Async `check`."""
        started = time.perf_counter()
        version = await adrive(_sql.schema_version(self._queries), self._aexecute)
        return _health(self, version, started)

    def purge(self, *, batch: int = 1000, limit: int | None = None) -> int:
        """Delete expired records in batches; return how many were deleted.

        Args:
            batch: Records deleted per statement, so no lock is held for long.
            limit: Stop after this many (default: until none is left).
        """
        return drive(_sql.purge(self._queries, batch, limit), self._execute)

    async def apurge(self, *, batch: int = 1000, limit: int | None = None) -> int:
        """Async `purge`."""
        return await adrive(_sql.purge(self._queries, batch, limit), self._aexecute)

    def scan(self, *, after: str = "", limit: int = 100) -> list[Record]:
        """Return up to *limit* live records whose key sorts after *after*, results left out."""
        return drive(_sql.scan(self._queries, self.namespace, after, limit), self._execute)

    async def ascan(self, *, after: str = "", limit: int = 100) -> list[Record]:
        """Async `scan`."""
        flow = _sql.scan(self._queries, self.namespace, after, limit)
        return await adrive(flow, self._aexecute)

    # -- lifecycle -----------------------------------------------------------------------------

    def _detach(self) -> tuple[_pools.Parked | None, list[Any]]:
        with self._lock:
            if self._closed:
                return None, []
            self._closed = True
            parked, self._pool, self._parked = self._parked, None, None
            loop_pools, self._loop_pools = list(self._loop_pools.items()), {}
        return parked, loop_pools

    def close(self) -> None:
        """Close every pool. Async pools whose loop is running elsewhere are closed there."""
        parked, loop_pools = self._detach()
        if parked is not None:
            parked.flush()
            parked.pool.close()
        for loop, entry in loop_pools:
            _pools.close_elsewhere(loop, entry)
        for connections in self._driver.detach() if self._driver else ():
            connections.abandon()

    async def aclose(self) -> None:
        """Close every pool, awaiting the one of the running loop."""
        parked, loop_pools = self._detach()
        if parked is not None:
            parked.flush()
            await asyncio.to_thread(parked.pool.close)
        current = asyncio.get_running_loop()
        for loop, entry in loop_pools:
            if loop is current:
                await entry.close()
            else:
                _pools.close_elsewhere(loop, entry)
        for connections in self._driver.detach() if self._driver else ():
            await (connections.aclose() if connections.loop is current else _abandon(connections))

    def __enter__(self: _S) -> _S:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self: _S) -> _S:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return (
            f"PostgresStore({self._where!r}, schema={self.schema!r}, namespace={self.namespace!r})"
        )


# -- running statements on a connection ------------------------------------------------------


def _run(
    store: PostgresStore, connection: psycopg.Connection[Any], op: _sql.Statement
) -> _sql.Reply:
    wire = store._wires.get(op.sql)
    if wire is not None:  # the claim and the finishes: straight to libpq (`_wire`)
        prepared = _wire.prepared_on(connection)
        if prepared is not None:
            names = prepared if store._prepare else None
            return _reply(_wire.run(connection, wire, op.params, names))  # type: ignore[arg-type]
    script = op.params is None
    if op.sql in store._queries.numbered:  # `$n` placeholders: psycopg's raw cursor, cold path
        cursor: psycopg.Cursor[Any] = psycopg.RawCursor(connection)
    else:
        cursor = _cursor(connection)
    cursor.execute(
        _encoded(op.sql), op.params, prepare=store._prepare and not script, binary=not script
    )
    return _sql.Reply(cursor.fetchall() if _has_rows(cursor) else [], cursor.rowcount)


async def _arun(
    store: PostgresStore, connection: psycopg.AsyncConnection[Any], op: _sql.Statement
) -> _sql.Reply:
    wire = store._wires.get(op.sql)
    if wire is not None:  # as in _run
        prepared = _wire.prepared_on(connection)
        if prepared is not None:
            names = prepared if store._prepare else None
            result = await _wire.arun(connection, wire, op.params, names)  # type: ignore[arg-type]
            return _reply(result)
    script = op.params is None
    if op.sql in store._queries.numbered:  # as in _run
        cursor: psycopg.AsyncCursor[Any] = psycopg.AsyncRawCursor(connection)
    else:
        cursor = _cursor(connection)
    await cursor.execute(
        _encoded(op.sql), op.params, prepare=store._prepare and not script, binary=not script
    )
    return _sql.Reply(await cursor.fetchall() if _has_rows(cursor) else [], cursor.rowcount)


def _run_batch(
    store: PostgresStore, connection: psycopg.Connection[Any], batch: _sql.Batch
) -> list[_sql.Reply]:
    # Pipeline mode: every statement is sent without waiting, then one Sync, whose reply
    # ends the round trip and commits the implicit transaction (see `_sql.Batch`). An older
    # libpq gets the same transaction at a round trip per statement.
    if not _PIPELINE:
        with connection.transaction():
            return [_run(store, connection, op) for op in batch.statements]
    with connection.pipeline():
        cursors = [
            connection.execute(op.sql, op.params, prepare=store._prepare, binary=True)
            for op in batch.statements
        ]
    return [
        _sql.Reply(cursor.fetchall() if _has_rows(cursor) else [], cursor.rowcount)
        for cursor in cursors
    ]


async def _arun_batch(
    store: PostgresStore, connection: psycopg.AsyncConnection[Any], batch: _sql.Batch
) -> list[_sql.Reply]:
    if not _PIPELINE:
        async with connection.transaction():
            return [await _arun(store, connection, op) for op in batch.statements]
    async with connection.pipeline():
        cursors = [
            await connection.execute(op.sql, op.params, prepare=store._prepare, binary=True)
            for op in batch.statements
        ]
    return [
        _sql.Reply(await cursor.fetchall() if _has_rows(cursor) else [], cursor.rowcount)
        for cursor in cursors
    ]


def _close_at_exit() -> None:
    """Close the pools of stores still open when the interpreter exits, while it can: left to
    the garbage collector, a sync pool's workers are joined from a dying thread and an async
    pool's tasks are destroyed pending, each printing an error."""
    for store in list(_OPEN_STORES):
        with contextlib.suppress(Exception):
            store.close()


atexit.register(_close_at_exit)


def _forget_parent_pools() -> None:
    for store in list(_OPEN_STORES):
        store._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_parent_pools)


PostgresStore._cancel_safe = PostgresStore


class AsyncpgScheme:
    """``postgresql+asyncpg://``: a `PostgresStore` whose async verbs run on asyncpg."""

    @staticmethod
    def from_url(url: str, **options: Any) -> PostgresStore:
        """`PostgresStore.from_url` with ``async_driver="asyncpg"`` (unless *options* say)."""
        options.setdefault("async_driver", "asyncpg")
        return PostgresStore.from_url("postgresql" + url[url.index("://") :], **options)


def _health(store: PostgresStore, version: int | None, started: float) -> StoreHealth:
    if version is None or version < _sql.SCHEMA_VERSION:
        raise SchemaMissingError(
            f"the oncely schema in schema {store.schema!r} at {store._where} is at version "
            f"{version}, older than {_sql.SCHEMA_VERSION}: run store.migrate() or "
            "`oncely migrate`",
            backend=store.backend,
        )
    return StoreHealth(store.backend, version, (time.perf_counter() - started) * 1000)


def _driver(
    name: str, params: dict[str, Any], kwargs: dict[str, Any], store: PostgresStore
) -> _asyncpg.Driver | None:
    """The asyncpg driver of *store*'s async verbs, if *name* asks for it (``None``: psycopg)."""
    if name == "psycopg":
        return None
    if name != "asyncpg":
        raise ConfigurationError(f"async_driver is 'psycopg' or 'asyncpg', not {name!r}")
    from oncely.stores.postgres import _asyncpg

    settings = {**params, **{option: str(value) for option, value in kwargs.items()}}
    del settings["autocommit"]
    return _asyncpg.Driver(
        _asyncpg.connect_options(settings),
        max_size=store._max_size,
        pool_timeout=store._pool_timeout,
        prepare=store._prepare,
        where=store._where,
        schema=store.schema,
        # A heartbeat's extends: alone, and grouped (`_sql.extend_many`).
        warm=(store._queries.extend, store._queries.extend_set),
    )


async def _abandon(connections: Any) -> None:
    connections.abandon()


def _forgotten(key: str, answer: tuple[str | None, bool]) -> Status | None:
    """`forget`'s answer: the status the record had, or the refusal of a held lease."""
    status, refused = answer
    if refused:
        raise in_progress_refusal(key)
    try:
        return None if status is None else Status(status)
    except ValueError as exc:
        raise CorruptRecordError(f"unknown status {status!r}", backend="postgres", key=key) from exc
