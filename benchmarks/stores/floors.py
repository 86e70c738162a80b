"""The floors of the store benchmark: each driver's cheapest honest way to make the same round
trips as the raw reference, so that a ratio to it says how far oncely is from the physical limit.

- PostgreSQL, psycopg (sync and async): one plain connection, no pool, in autocommit mode,
  statements prepared on the server (``prepare=True``) and run on one cursor kept for them.
- PostgreSQL, asyncpg (async): one plain connection; asyncpg prepares each statement once and
  keeps it in its statement cache.

Both make the round trips of `bench_stores.RawPostgres` (``INSERT … ON CONFLICT DO NOTHING
RETURNING`` then ``UPDATE``; the replay a ``SELECT``) on the same table. A floor is one
sequential worker (x1), as a plain connection serves one statement at a time. Redis has no
subject here: its raw reference, a pooled redis-py client with hiredis, already is its floor.
"""

from __future__ import annotations

import datetime
from typing import Any


class BenchError(Exception):
    """A floor answered something other than what the measured path expects."""


def _dollars(sql: str) -> str:
    """*sql* with psycopg's ``%s`` placeholders numbered as asyncpg's ``$1``, ``$2``…"""
    parts = sql.split("%s")
    return "".join(
        part + (f"${index}" if index < len(parts) else "") for index, part in enumerate(parts, 1)
    )


class PsycopgFloor:
    """psycopg on one plain connection (sync, and an async one made in the event loop), every
    statement prepared on the server and run on one cursor kept for it."""

    name = "psycopg floor"
    worlds = ("sync", "async")

    def __init__(
        self,
        url: str,
        queries: tuple[str, str, str],
        fingerprint: str,
        result: bytes,
        lease: datetime.timedelta,
        ttl: datetime.timedelta,
    ) -> None:
        import psycopg

        self.url = url
        self.insert, self.update, self.select = (query.encode() for query in queries)
        self.fingerprint, self.result, self.lease, self.ttl = fingerprint, result, lease, ttl
        self.connection = psycopg.connect(url, autocommit=True)
        self.cursor = self.connection.cursor()
        self.aconnection: Any = None
        self.acursor: Any = None

    def key(self, serial: str) -> str:
        return "floor-" + serial

    def cycle(self, key: str) -> None:
        cursor = self.cursor
        cursor.execute(self.insert, (key, self.fingerprint, self.lease, self.ttl), prepare=True)
        row = cursor.fetchone()
        if row is None:
            raise BenchError(f"psycopg floor: INSERT of a new key {key!r} conflicted")
        cursor.execute(self.update, (self.result, self.ttl, key, row[0]), prepare=True)
        if cursor.rowcount != 1:
            raise BenchError(f"psycopg floor: UPDATE of {key!r} matched no row")

    def replay(self, key: str) -> None:
        cursor = self.cursor
        cursor.execute(self.select, (key,), prepare=True)
        if cursor.fetchone() is None:
            raise BenchError(f"psycopg floor: SELECT of a completed key {key!r} found nothing")

    async def open_async(self) -> None:
        import psycopg

        self.aconnection = await psycopg.AsyncConnection.connect(self.url, autocommit=True)
        self.acursor = self.aconnection.cursor()

    async def acycle(self, key: str) -> None:
        cursor = self.acursor
        params = (key, self.fingerprint, self.lease, self.ttl)
        await cursor.execute(self.insert, params, prepare=True)
        row = await cursor.fetchone()
        if row is None:
            raise BenchError(f"psycopg floor: INSERT of a new key {key!r} conflicted")
        await cursor.execute(self.update, (self.result, self.ttl, key, row[0]), prepare=True)
        if cursor.rowcount != 1:
            raise BenchError(f"psycopg floor: UPDATE of {key!r} matched no row")

    async def areplay(self, key: str) -> None:
        cursor = self.acursor
        await cursor.execute(self.select, (key,), prepare=True)
        if await cursor.fetchone() is None:
            raise BenchError(f"psycopg floor: SELECT of a completed key {key!r} found nothing")

    async def close_async(self) -> None:
        if self.aconnection is not None:
            await self.aconnection.close()

    def close(self) -> None:
        self.connection.close()


class AsyncpgFloor:
    """asyncpg on one plain connection (async only), its statements prepared once."""

    name = "asyncpg floor"
    worlds = ("async",)

    def __init__(
        self,
        url: str,
        queries: tuple[str, str, str],
        fingerprint: str,
        result: bytes,
        lease: datetime.timedelta,
        ttl: datetime.timedelta,
    ) -> None:
        self.url = url
        self.insert, self.update, self.select = (_dollars(query) for query in queries)
        self.fingerprint, self.result, self.lease, self.ttl = fingerprint, result, lease, ttl
        self.connection: Any = None

    def key(self, serial: str) -> str:
        return "asyncpg-" + serial

    def cycle(self, key: str) -> None:
        raise NotImplementedError("asyncpg has no sync API")

    def replay(self, key: str) -> None:
        raise NotImplementedError("asyncpg has no sync API")

    async def open_async(self) -> None:
        import asyncpg

        self.connection = await asyncpg.connect(self.url)

    async def acycle(self, key: str) -> None:
        connection = self.connection
        token = await connection.fetchval(self.insert, key, self.fingerprint, self.lease, self.ttl)
        if token is None:
            raise BenchError(f"asyncpg floor: INSERT of a new key {key!r} conflicted")
        done = await connection.execute(self.update, self.result, self.ttl, key, token)
        if done != "UPDATE 1":
            raise BenchError(f"asyncpg floor: UPDATE of {key!r} answered {done!r}")

    async def areplay(self, key: str) -> None:
        if await self.connection.fetchrow(self.select, key) is None:
            raise BenchError(f"asyncpg floor: SELECT of a completed key {key!r} found nothing")

    async def close_async(self) -> None:
        if self.connection is not None:
            await self.connection.close()

    def close(self) -> None:
        pass


def asyncpg_missing() -> str:
    """Why asyncpg's floor cannot be measured ('' when it can)."""
    try:
        import asyncpg  # noqa: F401
    except ImportError as exc:
        return f"asyncpg is not installed ({exc}): pip install asyncpg"
    return ""
