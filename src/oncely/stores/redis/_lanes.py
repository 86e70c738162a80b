"""The store's calls straight on a pooled redis-py connection: send the command, read the reply.

redis-py's ``execute_command`` wraps every command in layers the store does not use: a pool
checkout with metrics and events, a retry object with two closures, response callbacks and
their option parsing. A store call is one ``FCALL`` whose reply the store decodes itself, so a
lane takes a connection (`SyncLane`: from the pool's `checkout`; `AsyncLane`: from the loop's
own list of idle connections), packs the command as the connection would (with hiredis when
it is installed: `packer`), has the connection send it and read the reply (with the hiredis
parser when it is installed). What each step does on a failure is redis-py's own: the
connection disconnects on a socket error, a timeout or an interruption, so it never hands out
a reply that belongs to another command.

The retries are those `RedisStore` documents, as redis-py's ``Retry`` runs them: after a
connection error or a timeout the connection (connected afresh) sends the command again, at
most ``retries`` times, after a backoff. An error reply (``ResponseError``) is raised as is:
the store decides what it means (a library to load, a script to run instead).

Only a standalone server's plain clients take this path (see `lane_for`); a cluster's commands
stay on redis-py's cluster client, which follows ``MOVED`` and ``ASK`` and refreshes its map.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

__all__ = ["AsyncLane", "Gate", "SyncLane", "lane_for", "packer"]

Packer = Callable[[Sequence[Any]], list[bytes]]
"""Packs one command into the bytes to send."""


def lane_for(pool: Any) -> bool:
    """Whether the calls on *pool* may take a lane: not when redis-py must see each command
    (client-side caching, RESP3 push notifications, credentials renewed on release)."""
    options = pool.connection_kwargs
    if getattr(pool, "cache", None) is not None or options.get("cache") is not None:
        return False
    if str(options.get("protocol") or 2) not in ("2",):
        return False
    return options.get("credential_provider") is None


def packer(hiredis_packs: bool) -> Packer | None:
    """``hiredis.pack_command`` for connections that pack with it (*hiredis_packs*), else None:
    the connection's own ``pack_command`` packs.

    redis-py's hiredis serializer only splits a first argument with spaces (no store command
    has one) and turns ``bytearray`` and ``memoryview`` into ``bytes`` (the store sends
    neither) before it calls ``hiredis.pack_command``: the bytes are the same.
    """
    if not hiredis_packs:
        return None
    from hiredis import pack_command

    def pack(command: Sequence[Any]) -> list[bytes]:
        return [pack_command(tuple(command))]

    return pack


class _Lane:
    """What both lanes share: their settings, and the plan of the retries (`_pauses`) that
    each drives its own way (`SyncLane._again`, `AsyncLane._again`)."""

    __slots__ = ("_backoff", "_errors", "_pack", "_pool", "_retries")

    def __init__(
        self,
        pool: Any,
        retries: int,
        backoff: Any,
        errors: tuple[type[BaseException], ...],
        pack: Packer | None,
    ) -> None:
        self._pool = pool
        self._retries = retries
        self._backoff = backoff
        self._errors = errors  # what redis-py retries: ConnectionError, TimeoutError
        self._pack = pack

    def _pauses(self) -> Iterator[float]:
        """After a first try that failed, the pause before each try again, as redis-py's Retry
        runs them: ``retries`` tries at most. The connection disconnects before each, and
        after the last one fails (then its error is raised)."""
        self._backoff.reset()
        for failures in range(1, self._retries + 1):
            yield self._backoff.compute(failures)


class SyncLane(_Lane):
    """The sync calls of one store, on the connections of its queuing pool (`_pool`)."""

    __slots__ = ()

    def call(self, command: Sequence[Any]) -> Any:
        """Send *command* and return its reply (raises ``ResponseError`` for an error reply)."""
        pool = self._pool
        connection = pool.checkout()
        try:
            pack = self._pack
            packed = connection.pack_command(*command) if pack is None else pack(command)
            try:
                connection.send_packed_command(packed)
                return connection.read_response()
            except self._errors as exc:
                return self._again(connection, packed, exc)
        finally:
            pool.checkin(connection)

    def _again(self, connection: Any, packed: list[bytes], error: BaseException) -> Any:
        """Re-send *packed* after the *error* of its first try, as redis-py's Retry would."""
        for delay in self._pauses():
            connection.disconnect()
            if delay > 0:
                time.sleep(delay)
            try:
                connection.send_packed_command(packed)
                return connection.read_response()
            except self._errors as exc:
                error = exc
        connection.disconnect()
        raise error


class AsyncLane(_Lane):
    """The async calls of one store in one event loop, on the connections of its client's pool.

    The loop's idle connections wait in a list of the lane's own: the store's semaphore already
    bounds the calls in flight to ``max_connections``, and one event loop needs no lock. They
    stay in the pool's count of connections in use, so closing the client closes them too.
    """

    __slots__ = ("_idle",)

    def __init__(
        self,
        pool: Any,
        retries: int,
        backoff: Any,
        errors: tuple[type[BaseException], ...],
        pack: Packer | None,
    ) -> None:
        super().__init__(pool, retries, backoff, errors, pack)
        self._idle: list[Any] = []

    async def call(self, command: Sequence[Any]) -> Any:
        """Async `SyncLane.call`."""
        idle = self._idle
        connection = idle.pop() if idle else await self._pool.get_connection()
        try:
            pack = self._pack
            packed = connection.pack_command(*command) if pack is None else pack(command)
            try:
                await _send(connection, packed)
                return await connection.read_response()
            except self._errors as exc:
                return await self._again(connection, packed, exc)
        finally:
            idle.append(connection)

    async def _again(self, connection: Any, packed: list[bytes], error: BaseException) -> Any:
        """Async `SyncLane._again`."""
        for delay in self._pauses():
            await connection.disconnect()
            if delay > 0:
                await asyncio.sleep(delay)
            try:
                await _send(connection, packed)
                return await connection.read_response()
            except self._errors as exc:
                error = exc
        await connection.disconnect()
        raise error


async def _send(connection: Any, packed: list[bytes]) -> None:
    """Send the *packed* command on the async *connection*, as ``send_packed_command`` would.

    redis-py waits for every command's ``drain()`` in ``asyncio.wait_for``: a task and a turn
    of the loop more per command, for a buffer that is empty again as soon as the socket took
    the bytes, as it does at once for a command this small. So the bytes go to the transport,
    and only when some are left in its buffer does redis-py's own send wait for them to go
    (with its timeout and its handling of errors). A connection that is not connected, or
    checks its health before commands, goes through redis-py's send as a whole.
    """
    writer = connection._writer
    if writer is None or connection.health_check_interval:
        await connection.send_packed_command(packed)
        return
    writer.writelines(packed)
    if writer.transport.get_write_buffer_size():
        await connection.send_packed_command([], check_health=False)


class Gate:
    """The slots of one event loop's commands in flight: ``size`` at most.

    redis-py's async pools raise ``MaxConnectionsError`` at once past ``max_connections``
    commands in flight, so each loop's commands take a slot first. ``asyncio.Semaphore`` does
    it in six Python calls per command (``locked`` twice, ``acquire``, ``release``...); the
    common case, a free slot, is here a test and a decrement (``free``) by the caller, and
    `release` one call. A command that finds no slot free queues (`wait`, first come first
    served); a released slot goes to the first caller still waiting, and only when none is
    does ``free`` count it, so while ``free`` is above 0 nobody waits.
    """

    __slots__ = ("_queue", "free")

    def __init__(self, size: int) -> None:
        self.free = size
        self._queue: collections.deque[asyncio.Future[None]] = collections.deque()

    async def wait(self, timeout: float | None) -> None:
        """Wait for a slot (``free`` is 0), *timeout* seconds at most (`asyncio.TimeoutError`)."""
        slot: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append(slot)
        try:
            await asyncio.wait_for(slot, timeout)
        except BaseException:
            if slot.done() and not slot.cancelled():
                self.release()  # handed a slot it will not use: the next caller's
            else:
                slot.cancel()  # `release` passes it by
            raise

    def release(self) -> None:
        """Give a slot back: to the first caller still waiting, else to ``free``."""
        queue = self._queue
        while queue:
            slot = queue.popleft()
            if not slot.done():
                slot.set_result(None)
                return
        self.free += 1
