"""The async verbs of `PostgresStore` on asyncpg (``async_driver="asyncpg"``).

The store's flows (`_sql`) stay the one source of statements and decoding: this module only
runs their `Statement`s and `Batch`es, with ``%s`` and ``%(name)s`` numbered as asyncpg's ``$n``
once per statement text (`numbered`). Each connection prepares a statement the first time it
runs it and keeps it (`_Connection`), so a statement is then one round trip (Bind, Execute,
Sync), its reply decoded by asyncpg's C codecs; it prepares a heartbeat's extends as it opens
(`Driver.warm`), so that no beat waits for a preparation.

Connections: each event loop has its own (`_LoopConnections`), handed out last in first out,
so a sequential caller keeps one connection and one server process; at most ``max_size`` are
open per loop, a caller waits ``pool_timeout`` for one. asyncpg's own pool is not used: it
resets a connection on every release, a round trip per statement.

A batch of one statement runs alone (autocommit: its own transaction, as in pipeline mode), and
the batch verbs send one statement for the whole batch (`_sql.CLAIM_SET`). A longer batch (a
key twice in a batch of completions or extends) runs in one explicit transaction, a round trip
per statement: asyncpg has no public call that pipelines statements and answers each one's rows
and row count (``executemany`` answers neither). The transaction, the key order and the
all-or-nothing outcome are the same as the psycopg pipeline's (see `_sql.Batch`).

Sessions that die under a statement are handled as in the psycopg path: a statement marked
``resend`` is sent once more on a fresh connection. A cancelled caller's connection is closed
(its statement may still be running); the store's verbs then re-send what must land. asyncpg's
exceptions become oncely's in `Driver.translated`, and nowhere else.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import re
from collections.abc import AsyncGenerator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from oncely._deps import require
from oncely.errors import (
    ConfigurationError,
    SchemaMissingError,
    StoreError,
    StoreUnavailableError,
)
from oncely.stores.postgres import _sql
from oncely.stores.postgres._errors import REFUSALS, first_line

if TYPE_CHECKING:
    import asyncpg
else:
    asyncpg = require("asyncpg", extra="asyncpg")

__all__ = ["DRIVERS", "Driver", "connect_options", "numbered"]

BACKEND = "postgres"

DRIVERS = ("psycopg", "asyncpg")
"""The values of `PostgresStore`'s ``async_driver``."""

_RESENDS = 1
"""As the psycopg path's: a re-sendable statement goes once more after its session died."""

_SCHEMA_MISSING = frozenset({"42P01", "42883", "42703", "3F000"})
"""SQLSTATEs of an undefined table, function, column or schema: the oncely schema is missing
or older than this code."""

_UNAVAILABLE = frozenset({"08", "40", "53", "54", "55", "57", "58"})
"""SQLSTATE classes psycopg raises as ``OperationalError`` (a connection, a rollback, resources,
an operator, the system): `StoreUnavailableError`, as in the psycopg path."""

_REFUSED = frozenset({"28", "3D"})
"""SQLSTATE classes of a connection the server refuses (authorisation, no such database)."""

_PLACEHOLDER = re.compile(r"%%|%\((\w+)\)s|%s")


@functools.lru_cache(maxsize=64)
def numbered(sql: str) -> tuple[str, tuple[str, ...] | None]:
    """*sql* with psycopg's placeholders numbered as asyncpg's ``$1``, ``$2``…, and the names of
    its ``%(name)s`` parameters in the order of their numbers (``None``: positional ``%s``)."""
    names: list[str] = []
    count = 0

    def number(match: re.Match[str]) -> str:
        nonlocal count
        name = match.group(1)
        if match.group(0) == "%%":
            return "%"
        if name is None:
            count += 1
            return f"${count}"
        if name not in names:
            names.append(name)
        return f"${names.index(name) + 1}"

    text = _PLACEHOLDER.sub(number, sql)
    return text, tuple(names) if names else None


def connect_options(params: Mapping[str, str]) -> dict[str, Any]:
    """asyncpg's ``connect`` arguments for libpq's *params* (`conninfo_to_dict`'s).

    Raises:
        ConfigurationError: A libpq parameter asyncpg has no equivalent for.
    """
    options: dict[str, Any] = {}
    settings: dict[str, str] = {}
    for name, value in params.items():
        if name in ("host", "user", "password", "passfile", "target_session_attrs"):
            options[name] = value
        elif name == "port":
            options["port"] = int(value) if value.isdigit() else value
        elif name == "dbname":
            options["database"] = value
        elif name == "sslmode":
            options["ssl"] = value
        elif name == "connect_timeout":
            options["timeout"] = float(value)
        elif name == "application_name":
            settings["application_name"] = value
        elif name == "options":
            for setting in re.findall(r"-c\s*(\S+)", value):
                key, _, setting_value = setting.partition("=")
                settings[key.replace("-", "_")] = setting_value
        else:
            raise ConfigurationError(
                f"the libpq parameter {name!r} has no asyncpg equivalent: "
                "use async_driver='psycopg' for it"
            )
    options["server_settings"] = settings
    return options


class _Connection(asyncpg.Connection):  # type: ignore[misc]
    """An asyncpg connection that keeps the statements it prepared, by their text."""

    __slots__ = ("_oncely_prepared",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._oncely_prepared: dict[str, Any] = {}


class _PoolTimeout(Exception):
    """No connection came free within the store's ``pool_timeout``."""


class _Closed(Exception):
    """The store was closed."""


class _LoopConnections:
    """The connections of one event loop: idle ones (last in, first out) and waiting callers."""

    def __init__(self, driver: Driver, loop: asyncio.AbstractEventLoop) -> None:
        self.driver = driver
        self.loop = loop
        self.idle: list[_Connection] = []
        self.size = 0  # open or opening
        self.waiters: collections.deque[asyncio.Future[_Connection | None]] = collections.deque()
        self.closed = False
        self.finaliser: AsyncGenerator[None, None] | None = None

    async def get(self) -> _Connection:
        """An idle connection, a new one, or the next one given back (within the timeout)."""
        if self.idle:
            return self.idle.pop()
        if self.closed:
            raise _Closed
        if self.size >= self.driver.max_size:
            waiter: asyncio.Future[_Connection | None] = self.loop.create_future()
            self.waiters.append(waiter)
            try:
                given = await asyncio.wait_for(waiter, self.driver.pool_timeout)
            except BaseException as exc:
                if waiter.done() and not waiter.cancelled():
                    late = waiter.result()  # handed over just as the wait ended
                    if late is not None:
                        self.put(late, True)
                    else:
                        self._wake()
                with contextlib.suppress(ValueError):
                    self.waiters.remove(waiter)
                if isinstance(exc, asyncio.TimeoutError):
                    raise _PoolTimeout from None
                raise
            if given is not None:
                return given
        return await self._open()

    async def _open(self) -> _Connection:
        self.size += 1
        try:
            connection: _Connection = await asyncpg.connect(
                connection_class=_Connection, **self.driver.options
            )
        except BaseException as exc:
            self.size -= 1
            self._wake()
            if isinstance(exc, Exception):
                raise self.driver.unreachable(exc) from exc
            raise
        if self.closed:
            connection.terminate()
            self.size -= 1
            raise _Closed
        try:
            await self.driver.warm(connection)
        except BaseException:
            self._discard(connection)
            raise
        return connection

    def put(self, connection: _Connection, reusable: bool) -> None:
        """Give *connection* to the next waiting caller, or keep it idle; close it instead when
        it is not *reusable* (or broken, or left in a transaction)."""
        if not reusable or self.closed or connection.is_closed() or connection.is_in_transaction():
            self._discard(connection)
            return
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(connection)
                return
        self.idle.append(connection)

    def _discard(self, connection: _Connection) -> None:
        with contextlib.suppress(Exception):
            connection.terminate()
        self.size -= 1
        self._wake()

    def _wake(self) -> None:
        """A connection closed: the first waiting caller may open one in its place."""
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def drop_idle(self) -> None:
        """Close the idle connections: after one died, they likely died with it."""
        idle, self.idle = self.idle, []
        for connection in idle:
            self._discard(connection)

    async def aclose(self) -> None:
        """Close every idle connection in this loop (those in use close as they come back)."""
        self.closed = True
        idle, self.idle = self.idle, []
        for connection in idle:
            self.size -= 1
            try:
                await asyncio.wait_for(connection.close(), 5)
            except Exception:
                connection.terminate()
        finaliser, self.finaliser = self.finaliser, None
        if finaliser is not None:
            await finaliser.aclose()

    def abandon(self) -> None:
        """Close the idle connections without the loop (closed, or running elsewhere)."""
        self.closed = True
        idle, self.idle = self.idle, []
        if self.loop.is_closed() or not self.loop.is_running():
            for connection in idle:
                with contextlib.suppress(Exception):
                    connection.terminate()
            return
        for connection in idle:
            self.loop.call_soon_threadsafe(connection.terminate)


async def _close_with_loop(entry: _LoopConnections) -> AsyncGenerator[None, None]:
    """An async generator the loop finalises at its shutdown, closing *entry*'s connections."""
    try:
        yield
    finally:
        if entry.finaliser is not None:
            entry.finaliser = None
            entry.driver.forget(entry)
            await entry.aclose()


class Driver:
    """Runs a store's statements on asyncpg connections, one set of them per event loop.

    Args:
        options: asyncpg's ``connect`` arguments (`connect_options`).
        max_size: Connections open at most per event loop.
        pool_timeout: Seconds a statement waits for a connection when ``max_size`` are in use.
        prepare: Prepare statements on the server (else each runs unnamed: two round trips).
        where: ``host:port/dbname``, for messages.
        schema: The store's schema, for messages.
        warm: Statements each connection prepares as it opens (with ``prepare``): those a
            deadline rides on, whose first run must not wait for their preparation.
    """

    def __init__(
        self,
        options: dict[str, Any],
        *,
        max_size: int,
        pool_timeout: float,
        prepare: bool,
        where: str,
        schema: str,
        warm: Sequence[str] = (),
    ) -> None:
        self.options = options
        self.max_size = max_size
        self.pool_timeout = pool_timeout
        self.prepare = prepare
        self.where = where
        self.schema = schema
        self.warmed = [numbered(sql)[0] for sql in warm] if prepare else []
        self.loops: dict[asyncio.AbstractEventLoop, _LoopConnections] = {}
        self.closed = False

    def _entry(self) -> _LoopConnections:
        loop = asyncio.get_running_loop()
        entry = self.loops.get(loop)
        if entry is None:
            if self.closed:
                raise _Closed
            for stale in [other for other in self.loops if other.is_closed()]:
                self.loops.pop(stale).abandon()
            entry = self.loops[loop] = _LoopConnections(self, loop)
        return entry

    def forget(self, entry: _LoopConnections) -> None:
        if self.loops.get(entry.loop) is entry:
            del self.loops[entry.loop]

    async def execute(self, op: _sql.Statement | _sql.Batch) -> Any:
        """Run a `Statement` (a `_sql.Reply`) or a `Batch` (a list of them)."""
        try:
            entry = self.loops.get(asyncio.get_running_loop()) or self._entry()
            if entry.finaliser is None and not entry.closed:
                entry.finaliser = _close_with_loop(entry)
                await entry.finaliser.__anext__()  # from now on the loop tracks it
            sends_left = _RESENDS if op.resend else 0
            while True:
                # An idle connection without a coroutine of `get`'s: the path of nearly every call.
                connection = entry.idle.pop() if entry.idle else await entry.get()
                reusable = False
                try:
                    if type(op) is _sql.Statement:
                        reply: Any = await self._run(connection, op)
                    else:
                        reply = await self._run_batch(connection, op)  # type: ignore[arg-type]
                    reusable = True
                    return reply
                except Exception:
                    if not connection.is_closed():
                        reusable = True  # the server refused the statement: the session lives
                        raise
                    # The session died, perhaps after the server applied op but before its
                    # reply came back: op recognises its own effect (see _sql): send it again,
                    # on a fresh connection (the idle ones likely died with this one).
                    entry.drop_idle()
                    if not sends_left:
                        raise
                    sends_left -= 1
                finally:
                    # A cancelled caller's statement may still be running: its session goes.
                    entry.put(connection, reusable)
        except Exception as exc:
            translated = self.translated(exc, op.subject)
            if translated is None:
                raise
            raise translated from exc

    async def warm(self, connection: _Connection) -> None:
        """Prepare the ``warm`` statements on *connection*, which just opened: their first run
        on it is then one round trip, as every later one, not two. A heartbeat's extend has a
        deadline, its lease's end: under a latency of a quarter lease, grouped extends that
        paid for their preparation queued behind others and arrived after it. A statement the
        server refuses (the schema missing, or older than this code) is left to be prepared,
        and refused, when it runs."""
        prepared = connection._oncely_prepared
        for text in self.warmed:
            try:
                prepared[text] = await connection.prepare(text)
            except asyncpg.PostgresError:
                return

    async def _run(self, connection: _Connection, op: _sql.Statement) -> _sql.Reply:
        params = op.params
        if params is None:  # a script: the simple query protocol, one transaction
            await connection.execute(op.sql)
            return _sql.Reply([], 0)
        text, names = numbered(op.sql)
        args = [params[name] for name in names] if names else params  # type: ignore[call-overload]
        prepared = connection._oncely_prepared
        statement = prepared.get(text)
        if statement is None:
            statement = await connection.prepare(text, name=None if self.prepare else "")
            if self.prepare:
                prepared[text] = statement
        try:
            rows = await statement.fetch(*args)
        except asyncpg.exceptions.InvalidCachedStatementError:
            # The schema changed under the prepared statement (a migration): prepare it again.
            prepared.pop(text, None)
            return await self._run(connection, op)
        if rows:  # a statement's tag counts the rows it returned (``SELECT 1``, ``UPDATE 1``…)
            return _sql.Reply(rows, len(rows))
        status: str = statement.get_statusmsg()
        count = status.rpartition(" ")[2]
        return _sql.Reply(rows, int(count) if count.isdigit() else 0)

    async def _run_batch(self, connection: _Connection, batch: _sql.Batch) -> list[_sql.Reply]:
        statements = batch.statements
        if len(statements) == 1:
            return [await self._run(connection, statements[0])]
        async with connection.transaction():
            return [await self._run(connection, op) for op in statements]

    def translated(self, exc: BaseException, subject: str) -> Exception | None:
        """asyncpg's exception *exc* as oncely's while serving *subject* (``None``: not one)."""
        if isinstance(exc, _Closed):
            return StoreError("the store is closed", backend=BACKEND)
        if isinstance(exc, _PoolTimeout):
            return StoreUnavailableError(
                f"no connection to PostgreSQL at {self.where} within {self.pool_timeout}s "
                f"for {subject}",
                backend=BACKEND,
            )
        if isinstance(exc, asyncpg.PostgresError):
            state = str(getattr(exc, "sqlstate", "") or "")
            if state in _SCHEMA_MISSING:
                return SchemaMissingError(
                    f"the oncely schema is missing or out of date in schema {self.schema!r} at "
                    f"{self.where}: run store.migrate() or `oncely migrate` ({first_line(exc)})",
                    backend=BACKEND,
                )
            if state[:2] in _UNAVAILABLE:
                return self._unavailable(exc, subject)
            return StoreError(
                f"PostgreSQL at {self.where} failed on {subject}: {first_line(exc)}",
                backend=BACKEND,
            )
        if isinstance(exc, asyncpg.InterfaceError | OSError):
            # The connection closed under the statement, or the network failed.
            return self._unavailable(exc, subject)
        if isinstance(exc, asyncpg.exceptions.InternalClientError):  # a protocol error
            return StoreError(
                f"PostgreSQL at {self.where} failed on {subject}: {first_line(exc)}",
                backend=BACKEND,
            )
        return None

    def _unavailable(self, exc: BaseException, subject: str) -> StoreUnavailableError:
        return StoreUnavailableError(
            f"PostgreSQL at {self.where} could not serve {subject}: {first_line(exc)}",
            backend=BACKEND,
        )

    def unreachable(self, exc: Exception) -> Exception:
        """A failed connection attempt: `ConfigurationError` if the server refused these
        settings, else `StoreUnavailableError`, quoting asyncpg's reason."""
        state = str(getattr(exc, "sqlstate", "") or "")
        reason = first_line(exc) or type(exc).__name__
        if (
            state[:2] in _REFUSED
            or isinstance(exc, asyncpg.exceptions.ClientConfigurationError)
            or any(refusal in str(exc) for refusal in REFUSALS)
        ):
            return ConfigurationError(
                f"PostgreSQL at {self.where} refused the store's settings: {reason}"
            )
        return StoreUnavailableError(
            f"cannot connect to PostgreSQL at {self.where}: {reason}", backend=BACKEND
        )

    def detach(self) -> list[_LoopConnections]:
        """Close the driver: no new connections; the loops' connections, to close."""
        self.closed = True
        entries, self.loops = list(self.loops.values()), {}
        return entries

    def after_fork(self) -> list[_LoopConnections]:
        """Forget the parent's connections (never closed here: they are its sessions)."""
        entries, self.loops = list(self.loops.values()), {}
        return entries
