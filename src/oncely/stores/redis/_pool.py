"""A sync connection pool that makes threads past ``max_connections`` wait, cheaply.

redis-py's ``BlockingConnectionPool`` queues threads, but pays for it on every command: its
connections go in and out of a ``queue.LifoQueue``, two condition variables and their locks
per checkout. Its plain ``ConnectionPool`` costs a lock, but raises ``MaxConnectionsError`` at
once when every connection is busy. `queuing_pool` is the plain pool with a waiting room: the
common checkout is the plain pool's, and only a thread that finds every connection busy waits,
on a condition that a release signals when someone waits, for ``timeout`` seconds at most.

The store's own calls check connections out and in by `checkout` and `checkin`: the same
pool, without the bookkeeping redis-py adds to every checkout (metrics, events) that the
store has no use for.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from typing import Any

__all__ = ["queuing_pool"]


@functools.cache
def queuing_pool(base: type) -> Any:
    """A subclass of redis-py's ``ConnectionPool`` *base* that queues threads past its size."""
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import MaxConnectionsError, TimeoutError

    class QueuingConnectionPool(base):  # type: ignore[misc]
        """``ConnectionPool`` whose checkouts past ``max_connections`` wait up to ``timeout``."""

        def __init__(self, *args: Any, timeout: float | None = 5.0, **kwargs: Any) -> None:
            self.timeout = timeout
            super().__init__(*args, **kwargs)

        def reset(self) -> None:
            super().reset()  # also after a fork: a lock held then would never be released
            self._freed = threading.Condition(threading.Lock())
            self._waiting = 0

        def make_connection(self) -> Any:
            # redis-py before 6 raises a plain ConnectionError here when the pool is full,
            # which nothing tells from a failed connection: make it MaxConnectionsError (a
            # ConnectionError too), as later versions raise. Called under the pool's lock.
            if self._created_connections >= self.max_connections:
                raise MaxConnectionsError("Too many connections")
            return super().make_connection()

        def get_connection(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return super().get_connection(*args, **kwargs)
            except MaxConnectionsError:
                return self._wait_for_connection(*args, **kwargs)

        def _wait_for_connection(self, *args: Any, **kwargs: Any) -> Any:
            deadline = None if self.timeout is None else time.monotonic() + self.timeout
            with self._freed:
                # Counted before the next try: a release after it sees the count and signals.
                self._waiting += 1
                try:
                    while True:
                        try:
                            return super().get_connection(*args, **kwargs)
                        except MaxConnectionsError:
                            left = None if deadline is None else deadline - time.monotonic()
                            if left is not None and left <= 0:
                                raise RedisConnectionError("No connection available.") from None
                            self._freed.wait(left)
                finally:
                    self._waiting -= 1

        def release(self, connection: Any) -> None:
            super().release(connection)
            if self._waiting:
                with self._freed:
                    self._freed.notify()

        def checkout(self) -> Any:
            """An idle connection, checked as `get_connection` checks it (a connection the
            server closed, or that holds unread data, is connected afresh), or else one from
            `get_connection` (a new connection, a wait, or a forked process's reset)."""
            connection = None
            if self.pid == os.getpid():
                with self._lock:
                    if self._available_connections:
                        connection = self._available_connections.pop()
                        self._in_use_connections.add(connection)
            if connection is None:
                return self.get_connection()
            try:
                try:
                    if connection.can_read():  # connects a connection that has no socket
                        raise RedisConnectionError("Connection has data")
                except (RedisConnectionError, TimeoutError, OSError):
                    connection.disconnect()
                    connection.connect()
                    if connection.can_read():
                        raise RedisConnectionError("Connection not ready") from None
            except BaseException:
                self.checkin(connection)
                raise
            return connection

        def checkin(self, connection: Any) -> None:
            """Give back a connection of `checkout` (`release`, if a thread waits for one)."""
            if self._waiting or self.pid != os.getpid() or connection.pid != self.pid:
                self.release(connection)
                return
            with self._lock:
                try:
                    self._in_use_connections.remove(connection)
                except KeyError:  # the pool was reset meanwhile: the connection is not its own
                    return
                self._available_connections.append(connection)

    return QueuingConnectionPool
