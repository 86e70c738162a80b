"""The store's connections: the sync pool, one async pool per event loop, and the connections
the store keeps between statements.

A pool checkout per statement costs a lock, a queue and the pool's bookkeeping each way, and the
pool hands its connections out in turn, so a sequential caller's statements go to a different
server process each time (whose caches are cold). `Parked` keeps the connections it got from
the pool for the next statement instead, last in first out, as long as no caller waits for the
pool (through the store, or directly: the pool's own queue of waiters is looked at too): a
sequential caller keeps one connection and one server process, and concurrent callers share the
pool as before. At most ``min_size`` connections (one at least) are parked, so the pool still
shrinks to its own idle minimum, and a parked connection goes back to the pool now and then
(`PARK_SECONDS`), so its lifetime and health checks still see it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
import weakref
from collections.abc import AsyncGenerator, Callable, Iterator
from typing import TYPE_CHECKING, Any

from oncely._deps import require
from oncely._log import get_logger
from oncely.stores.postgres._errors import server_message

if TYPE_CHECKING:
    import psycopg
    import psycopg_pool
else:
    psycopg = require("psycopg", extra="postgres")
    psycopg_pool = require("psycopg_pool", extra="postgres")

__all__ = [
    "CONNECTIONS",
    "POOL_NUMBERS",
    "QUIET_POOLS",
    "LoopPool",
    "Parked",
    "close_elsewhere",
    "running_loop",
]

logger = get_logger("oncely")

_IDLE = psycopg.pq.TransactionStatus.IDLE

PARK_SECONDS = 5.0
"""How long a connection stays out of its pool, parked between statements, before it is given
back to the pool once (which may then hand it out again)."""


def _waiters(pool: Any) -> Any:
    """The queue of *pool*'s callers waiting for a connection (empty if it has none to see)."""
    return getattr(pool, "_waiting", ())


def _parkable(connection: Any, now: float) -> bool:
    """Whether *connection* may wait for the next statement outside its pool: idle, outside a
    transaction, and out of the pool for less than `PARK_SECONDS`."""
    idle: bool = connection.pgconn.transaction_status == _IDLE
    return idle and now - connection._oncely_since < PARK_SECONDS


class Parked:
    """The sync pool, and the connections taken from it that wait for the next statement."""

    __slots__ = ("idle", "lock", "most", "pool", "queue", "wanting")

    def __init__(self, pool: psycopg_pool.ConnectionPool[Any], most: int) -> None:
        self.pool = pool
        self.most = max(1, most)
        self.idle: list[psycopg.Connection[Any]] = []
        self.wanting = 0  # callers waiting for the pool: while there are any, nothing parks
        self.queue = _waiters(pool)
        self.lock = threading.Lock()

    def get(self) -> psycopg.Connection[Any]:
        """A parked connection, or one from the pool (waiting up to its timeout)."""
        with self.lock:
            if self.idle:
                return self.idle.pop()
            self.wanting += 1
        try:
            connection: psycopg.Connection[Any] = self.pool.getconn()
        finally:
            with self.lock:
                self.wanting -= 1
        connection._oncely_since = time.monotonic()  # type: ignore[attr-defined]
        return connection

    def put(self, connection: psycopg.Connection[Any], reusable: bool) -> None:
        """Park *connection* for the next statement, or give it back to the pool: when a
        caller waits for one, when its statement failed (*reusable* false), or when the pool
        should see it again."""
        if (
            reusable
            and not self.queue
            and not self.pool.closed  # a closed pool closes what it gets back
            and _parkable(connection, time.monotonic())
        ):
            with self.lock:
                if not self.wanting and len(self.idle) < self.most:
                    self.idle.append(connection)
                    return
        self.pool.putconn(connection)

    def flush(self) -> None:
        """Give every parked connection back to the pool (before it checks or closes them)."""
        with self.lock:
            idle, self.idle = self.idle, []
        for connection in idle:
            with contextlib.suppress(Exception):
                self.pool.putconn(connection)


POOL_NUMBERS = itertools.count(1)
"""Pool names are unique in the process: a loop's tasks are told apart by their pool's name."""

CLOSING: set[asyncio.Task[None]] = set()
"""Pool closes scheduled on a running loop by a sync `close`; referenced until they finish."""


class LoopPool:
    """The async pool of one event loop, the connections it made, and what closes it with the loop.

    A loop ends in one of two ways, and the pool must close in both, in that loop. Runners such
    as ``asyncio.run`` first cancel every task: psycopg_pool's maintenance tasks swallow the
    cancellation while they run a job, so the loop would wait for them forever. The guard, a
    task of the pool's own, is cancelled along with them and closes the pool, which stops them
    for good. Loops shut down without cancelling (``loop.shutdown_asyncgens()``, then
    ``close()``) finalise live async generators instead: the finaliser closes the pool then.
    """

    def __init__(
        self, loop: asyncio.AbstractEventLoop, pool: psycopg_pool.AsyncConnectionPool[Any]
    ) -> None:
        self.loop = loop
        self.pool = pool
        self.connections: weakref.WeakSet[psycopg.AsyncConnection[Any]] = weakref.WeakSet()
        self.guard: asyncio.Task[None] | None = None
        self.finaliser: AsyncGenerator[None, None] | None = None
        self.forget: Callable[[LoopPool], None] = lambda entry: None
        self.closing = False
        self.idle: list[psycopg.AsyncConnection[Any]] = []  # as `Parked`'s
        self.wanting = 0
        self.most = max(1, pool.min_size)
        self.queue = _waiters(pool)

    async def get(self) -> psycopg.AsyncConnection[Any]:
        """A parked connection, or one from the pool (as `Parked.get`)."""
        if self.idle:
            return self.idle.pop()
        self.wanting += 1
        try:
            connection: psycopg.AsyncConnection[Any] = await self.pool.getconn()
        finally:
            self.wanting -= 1
        connection._oncely_since = time.monotonic()  # type: ignore[attr-defined]
        return connection

    async def put(self, connection: psycopg.AsyncConnection[Any], reusable: bool) -> None:
        """Park *connection* or give it back to the pool (as `Parked.put`)."""
        if (
            reusable
            and not self.wanting
            and not self.queue
            and len(self.idle) < self.most
            and not self.closing
            and _parkable(connection, time.monotonic())
        ):
            self.idle.append(connection)
            return
        await self.pool.putconn(connection)

    async def flush(self) -> None:
        """Give every parked connection back to the pool."""
        idle, self.idle = self.idle, []
        for connection in idle:
            with contextlib.suppress(Exception):
                await self.pool.putconn(connection)

    async def open(self, forget: Callable[[LoopPool], None]) -> None:
        """Open the pool (in its loop), tied to the loop's shutdown; *forget* drops the entry."""
        if self.guard is None:
            self.forget = forget
            self.guard = self.loop.create_task(self._guard(), name=f"{self.pool.name}-guard")
            self.finaliser = _close_with_loop(self)
            await self.finaliser.__anext__()  # from now on the loop tracks it
        await self.pool.open()

    async def _guard(self) -> None:
        try:
            await self.loop.create_future()
        except asyncio.CancelledError:
            await self.shut_down()
            raise

    async def shut_down(self) -> None:
        """The loop is ending: forget the pool and close it."""
        if not self.closing:
            self.forget(self)
        await self.close()

    async def close(self) -> None:
        """Close the pool from inside its loop (again: at once)."""
        self.closing = True
        if self.guard is not None and self.guard is not asyncio.current_task():
            self.guard.cancel()
        try:
            await self.flush()
            await self.pool.close()
        except asyncio.CancelledError:
            # At shutdown the pool's workers were cancelled too, and its close gives up on
            # them before it closes the sessions: end those here.
            self.end_sessions()
            raise
        finaliser, self.finaliser = self.finaliser, None
        if finaliser is not None:
            await finaliser.aclose()

    def end_sessions(self) -> None:
        """Close the pool's connections at the libpq level, without the loop."""
        for connection in list(self.connections):
            with contextlib.suppress(Exception):
                connection.pgconn.finish()

    def abandon(self) -> None:
        """End the pool's sessions without its loop (closed, or idle while another one runs).

        If the loop is still open, the guard closes the pool itself when the loop shuts down.
        """
        self.closing = True
        self.end_sessions()
        if self.loop.is_closed():
            # The pool's tasks can never run again. Finish their coroutines here, where the
            # "Event loop is closed" each raises on its way out can be swallowed, rather than
            # in the garbage collector, where it would surface as an unraisable exception.
            for task in asyncio.all_tasks(self.loop):
                if task.get_name().startswith(self.pool.name):
                    with contextlib.suppress(RuntimeError):
                        task.get_coro().close()
                    # Nor report it as destroyed while pending: it is finished, as far as it can be.
                    task._log_destroy_pending = False  # type: ignore[attr-defined]


async def _close_with_loop(entry: LoopPool) -> AsyncGenerator[None, None]:
    """An async generator the loop finalises when it shuts down, closing *entry*'s pool."""
    try:
        yield
    finally:
        if entry.finaliser is not None:  # not closed through entry.close()
            entry.finaliser = None
            await entry.shut_down()


def close_elsewhere(loop: asyncio.AbstractEventLoop, entry: LoopPool) -> None:
    """Close an async pool from outside its loop, as far as that loop's state allows."""
    if loop.is_closed():
        entry.abandon()
        return
    if loop.is_running():
        if running_loop() is loop:  # a sync close() called inside this loop
            task = loop.create_task(entry.close())
            CLOSING.add(task)
            task.add_done_callback(CLOSING.discard)
            return
        future = asyncio.run_coroutine_threadsafe(entry.close(), loop)
        try:
            future.result(timeout=10)
        except Exception:
            logger.warning("could not close an oncely PostgreSQL pool in its event loop")
        return
    if running_loop() is None:
        loop.run_until_complete(entry.close())
    else:
        entry.abandon()


class _QuietPools(logging.Filter):
    """Keeps the warnings psycopg_pool logs from its background threads about this module's
    pools (a failed reconnection, every few seconds while the server is down) out of the
    application's logs: the next call that cannot get a connection says it, with the reason
    kept here."""

    def __init__(self) -> None:
        super().__init__()
        self._last: dict[str, str] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if record.levelno < logging.WARNING or not isinstance(args, tuple) or not args:
            return True
        name = args[0]
        if not isinstance(name, str):  # about a connection: one of this module's pools'?
            return name not in CONNECTIONS
        if not name.startswith("oncely-"):
            return True
        if len(args) > 1 and isinstance(args[1], BaseException):
            self._last[name] = server_message(args[1])
        return False

    def last_error(self, pools: Iterator[Any]) -> str | None:
        """The reason of the last failed connection of one of *pools*, if any."""
        for pool in pools:
            reason = self._last.get(pool.name)
            if reason is not None:
                return reason
        return None


CONNECTIONS: weakref.WeakSet[Any] = weakref.WeakSet()
"""The connections this module's pools made (see `_QuietPools`)."""

QUIET_POOLS = _QuietPools()
logging.getLogger("psycopg.pool").addFilter(QUIET_POOLS)


def running_loop() -> asyncio.AbstractEventLoop | None:
    """The running event loop of this thread, if any."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
