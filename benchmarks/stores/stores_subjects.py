"""What the store benchmark measures: oncely's store verbs, the raw drivers doing the same
round trips, and decorated functions (oncely's, AWS Powertools'). The floors are in
`floors.py`."""

from __future__ import annotations

import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from stores_common import FINGERPRINT, LEASE, LEASE_MS, RESULT, TTL, TTL_S, BenchError

import oncely
from oncely import Acquired, Replay

# -- subjects: what is measured ----------------------------------------------------------------


class OncelySubject:
    """oncely's store verbs, as an entry point calls them."""

    def __init__(self, name: str, store: Any) -> None:
        self.name = name
        self.store = store

    def key(self, serial: str) -> str:
        return serial  # the store adds its prefix and namespace

    def cycle(self, key: str) -> None:
        claim = self.store.claim(key, FINGERPRINT, lease=LEASE, ttl=TTL)
        if not isinstance(claim, Acquired):
            raise BenchError(f"{self.name}: claim of a new key answered {claim!r}")
        if self.store.complete(key, claim.token, RESULT, ttl=TTL) is not None:
            raise BenchError(f"{self.name}: complete lost its lease")

    def replay(self, key: str) -> None:
        answer = self.store.claim(key, FINGERPRINT, lease=LEASE, ttl=TTL)
        if not isinstance(answer, Replay):
            raise BenchError(f"{self.name}: claim of a completed key answered {answer!r}")

    async def acycle(self, key: str) -> None:
        claim = await self.store.aclaim(key, FINGERPRINT, lease=LEASE, ttl=TTL)
        if not isinstance(claim, Acquired):
            raise BenchError(f"{self.name}: claim of a new key answered {claim!r}")
        if await self.store.acomplete(key, claim.token, RESULT, ttl=TTL) is not None:
            raise BenchError(f"{self.name}: complete lost its lease")

    async def areplay(self, key: str) -> None:
        answer = await self.store.aclaim(key, FINGERPRINT, lease=LEASE, ttl=TTL)
        if not isinstance(answer, Replay):
            raise BenchError(f"{self.name}: claim of a completed key answered {answer!r}")


class RawRedis:
    """redis-py doing the round trips of a Redis store: SET NX PX + SET EX, and GET."""

    name = "raw"

    def __init__(self, client: Any, prefix: str) -> None:
        self.client = client
        self.aclient: Any = None  # made in the event loop
        self.prefix = prefix
        self.claimed = b"in_progress|" + FINGERPRINT.encode()

    def key(self, serial: str) -> str:
        return self.prefix + serial

    def cycle(self, key: str) -> None:
        if not self.client.set(key, self.claimed, nx=True, px=LEASE_MS):
            raise BenchError(f"raw Redis: SET NX of a new key {key!r} failed")
        self.client.set(key, RESULT, ex=TTL_S)

    def replay(self, key: str) -> None:
        if self.client.get(key) is None:
            raise BenchError(f"raw Redis: GET of a completed key {key!r} found nothing")

    async def acycle(self, key: str) -> None:
        if not await self.aclient.set(key, self.claimed, nx=True, px=LEASE_MS):
            raise BenchError(f"raw Redis: SET NX of a new key {key!r} failed")
        await self.aclient.set(key, RESULT, ex=TTL_S)

    async def areplay(self, key: str) -> None:
        if await self.aclient.get(key) is None:
            raise BenchError(f"raw Redis: GET of a completed key {key!r} found nothing")


RAW_TABLE_SQL = """
CREATE TABLE {schema}.raw_records (
    key              text COLLATE "C" PRIMARY KEY,
    status           text        NOT NULL,
    fingerprint      text        NOT NULL,
    token            bigint      NOT NULL,
    attempt          integer     NOT NULL,
    lease_expires_at timestamptz NOT NULL,
    expires_at       timestamptz NOT NULL,
    created_at       timestamptz NOT NULL,
    updated_at       timestamptz NOT NULL,
    result           bytea
);
CREATE INDEX raw_records_expires_at ON {schema}.raw_records (expires_at);
"""
"""The same row and indexes as oncely's ``oncely_records``, so each write costs the same."""

RAW_INSERT = """
INSERT INTO {schema}.raw_records AS r
       (key, status, fingerprint, token, attempt, lease_expires_at, expires_at,
        created_at, updated_at)
VALUES (%s, 'in_progress', %s, 1, 1, now() + %s, now() + %s, now(), now())
ON CONFLICT (key) DO NOTHING
RETURNING r.token
"""

RAW_UPDATE = """
UPDATE {schema}.raw_records
   SET status = 'completed', result = %s, expires_at = now() + %s,
       lease_expires_at = now(), updated_at = now()
 WHERE key = %s AND token = %s AND status = 'in_progress'
"""

RAW_SELECT = """
SELECT status, fingerprint, token, attempt, lease_expires_at, expires_at, created_at,
       updated_at, result
  FROM {schema}.raw_records
 WHERE key = %s AND expires_at > now()
"""


class RawPostgres:
    """psycopg on a psycopg_pool pool: INSERT … ON CONFLICT DO NOTHING RETURNING + UPDATE,
    and SELECT; one pool checkout per statement, as oncely's store does."""

    name = "raw"

    def __init__(self, pool: Any, schema: str) -> None:
        self.pool = pool
        self.apool: Any = None  # made in the event loop
        self.insert = RAW_INSERT.format(schema=schema)
        self.update = RAW_UPDATE.format(schema=schema)
        self.select = RAW_SELECT.format(schema=schema)

    def key(self, serial: str) -> str:
        return serial

    def cycle(self, key: str) -> None:
        with self.pool.connection() as connection:
            row = connection.execute(self.insert, (key, FINGERPRINT, LEASE, TTL)).fetchone()
        if row is None:
            raise BenchError(f"raw PostgreSQL: INSERT of a new key {key!r} conflicted")
        with self.pool.connection() as connection:
            done = connection.execute(self.update, (RESULT, TTL, key, row[0]))
        if done.rowcount != 1:
            raise BenchError(f"raw PostgreSQL: UPDATE of {key!r} matched no row")

    def replay(self, key: str) -> None:
        with self.pool.connection() as connection:
            row = connection.execute(self.select, (key,)).fetchone()
        if row is None:
            raise BenchError(f"raw PostgreSQL: SELECT of a completed key {key!r} found nothing")

    async def acycle(self, key: str) -> None:
        async with self.apool.connection() as connection:
            cursor = await connection.execute(self.insert, (key, FINGERPRINT, LEASE, TTL))
            row = await cursor.fetchone()
        if row is None:
            raise BenchError(f"raw PostgreSQL: INSERT of a new key {key!r} conflicted")
        async with self.apool.connection() as connection:
            done = await connection.execute(self.update, (RESULT, TTL, key, row[0]))
        if done.rowcount != 1:
            raise BenchError(f"raw PostgreSQL: UPDATE of {key!r} matched no row")

    async def areplay(self, key: str) -> None:
        async with self.apool.connection() as connection:
            cursor = await connection.execute(self.select, (key,))
            row = await cursor.fetchone()
        if row is None:
            raise BenchError(f"raw PostgreSQL: SELECT of a completed key {key!r} found nothing")


class Decorated:
    """A decorated function (sync, and async with *acall*): its first call per key runs, the
    second replays."""

    def __init__(
        self,
        name: str,
        call: Callable[[str], Any] | None,
        key_prefix: str = "",
        acall: Callable[[str], Awaitable[Any]] | None = None,
    ) -> None:
        self.name = name
        self.call = call
        self.acall = acall
        self.key_prefix = key_prefix
        self.runs = 0

    def key(self, serial: str) -> str:
        return self.key_prefix + serial

    def cycle(self, key: str) -> None:
        if self.call is None:
            raise NotImplementedError
        self.call(key)

    def replay(self, key: str) -> None:
        self.cycle(key)

    async def acycle(self, key: str) -> None:
        if self.acall is None:
            raise NotImplementedError
        await self.acall(key)

    async def areplay(self, key: str) -> None:
        await self.acycle(key)


def oncely_decorated(store: Any, name: str = "oncely @idempotent", sync: bool = True) -> Decorated:
    """``@oncely.idempotent`` around a payment function, sync (unless not *sync*) and async,
    default policy."""
    options: dict[str, Any] = {"store": store, "key": "payment_id", "ttl": TTL, "lease": LEASE}

    @oncely.idempotent(**options)
    def charge(payment_id: str, amount_cents: int) -> dict[str, Any]:
        subject.runs += 1
        return {"payment_id": payment_id, "status": "captured", "amount_cents": amount_cents}

    @oncely.idempotent(**options)
    async def acharge(payment_id: str, amount_cents: int) -> dict[str, Any]:
        subject.runs += 1
        return {"payment_id": payment_id, "status": "captured", "amount_cents": amount_cents}

    subject = Decorated(
        name,
        (lambda key: charge(key, 1250)) if sync else None,
        acall=lambda key: acharge(key, 1250),
    )
    return subject


class _LambdaContext:
    """Just enough of a Lambda context for Powertools to set an in-progress expiry (a lease)."""

    function_name = "bench"
    aws_request_id = "bench"

    def get_remaining_time_in_millis(self) -> int:
        return LEASE_MS


def powertools_decorated(url: str, key_prefix: str) -> Decorated | str:
    """Powertools' ``idempotent_function`` on its Redis persistence layer, or why not."""
    try:
        from aws_lambda_powertools.utilities.idempotency import (
            IdempotencyConfig,
            idempotent_function,
        )
        from aws_lambda_powertools.utilities.idempotency.persistence.cache import (
            CachePersistenceLayer,
        )
    except ImportError as exc:
        return (
            f"aws-lambda-powertools is not usable ({exc}): "
            "pip install 'aws-lambda-powertools[redis,aws-sdk]'"
        )
    import redis

    client: Any = redis.Redis.from_url(url, decode_responses=True)
    layer = CachePersistenceLayer(client=client)
    config = IdempotencyConfig(
        event_key_jmespath="payment_id",
        # No payload_validation_jmespath: the Redis layer's _update_record drops the payload hash,
        # so with it every replay raises IdempotencyValidationError (aws-lambda-powertools 3.37).
        expires_after_seconds=TTL_S,
    )
    config.register_lambda_context(_LambdaContext())  # type: ignore[arg-type]

    decorate: Any = idempotent_function(
        data_keyword_argument="payment",
        persistence_store=layer,
        config=config,
        key_prefix=key_prefix,
    )

    def _charge(payment: dict[str, Any]) -> dict[str, Any]:
        subject.runs += 1
        return {"payment_id": payment["payment_id"], "status": "captured", "amount_cents": 1250}

    charge = decorate(_charge)

    subject = Decorated(
        "Powertools idempotent_function",
        lambda key: charge(payment={"payment_id": key, "amount_cents": 1250}),
    )
    return subject


def raw_sqlite_table() -> str:
    """oncely's ``oncely_records`` table and index in SQLite, renamed ``raw_records``: the same
    row and indexes, so each write costs the same."""
    from oncely.stores.sqlite import SQLiteStore

    script = SQLiteStore.schema_sql().split(";")
    return ";".join(each for each in script if "oncely_records" in each).replace(
        "oncely_records", "raw_records"
    )


RAW_SQLITE_INSERT = """
INSERT INTO raw_records (key, status, fingerprint, token, attempt, lease_expires_at_ms,
                         expires_at_ms, created_at_ms, updated_at_ms)
VALUES (?, 'in_progress', ?, 1, 1, ?, ?, ?, ?)
ON CONFLICT (key) DO NOTHING
RETURNING token
"""

RAW_SQLITE_UPDATE = """
UPDATE raw_records
   SET status = 'completed', result = ?, expires_at_ms = ?, lease_expires_at_ms = ?,
       updated_at_ms = ?
 WHERE key = ? AND token = ? AND status = 'in_progress'
"""

RAW_SQLITE_SELECT = """
SELECT status, fingerprint, token, attempt, lease_expires_at_ms, expires_at_ms, created_at_ms,
       updated_at_ms, result
  FROM raw_records WHERE key = ? AND expires_at_ms > ?
"""


class RawSQLite:
    """sqlite3 doing the transactions of a claim, a complete and a replay: each one statement
    in autocommit mode (its own transaction), writers of this process queued on a lock (as
    oncely's store queues them, rather than in SQLite's sleeping busy handler), a connection
    per thread, WAL mode and the store's ``synchronous``. Async calls run the same code inline
    on the event loop: the floor, with no hop to a thread."""

    name = "raw"

    def __init__(self, path: str, synchronous: str) -> None:
        self.path = path
        self.synchronous = synchronous
        self.local = threading.local()
        self.write = threading.Lock()
        self.connections: list[Any] = []

    def connection(self) -> Any:
        connection = getattr(self.local, "connection", None)
        if connection is None:
            import sqlite3

            connection = sqlite3.connect(
                self.path, timeout=30, isolation_level=None, check_same_thread=False
            )
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute(f"PRAGMA synchronous={self.synchronous}")
            connection.executescript(raw_sqlite_table())
            self.local.connection = connection
            self.connections.append(connection)
        return connection

    def key(self, serial: str) -> str:
        return serial

    def cycle(self, key: str) -> None:
        connection = self.connection()
        now = int(time.time() * 1000)
        with self.write:
            row = connection.execute(
                RAW_SQLITE_INSERT, (key, FINGERPRINT, now + LEASE_MS, now + TTL_S * 1000, now, now)
            ).fetchone()
        if row is None:
            raise BenchError(f"raw SQLite: INSERT of a new key {key!r} conflicted")
        now = int(time.time() * 1000)
        with self.write:
            done = connection.execute(
                RAW_SQLITE_UPDATE, (RESULT, now + TTL_S * 1000, now, now, key, row[0])
            )
        if done.rowcount != 1:
            raise BenchError(f"raw SQLite: UPDATE of {key!r} matched no row")

    def replay(self, key: str) -> None:
        now = int(time.time() * 1000)
        if self.connection().execute(RAW_SQLITE_SELECT, (key, now)).fetchone() is None:
            raise BenchError(f"raw SQLite: SELECT of a completed key {key!r} found nothing")

    async def acycle(self, key: str) -> None:
        self.cycle(key)

    async def areplay(self, key: str) -> None:
        self.replay(key)

    def close(self) -> None:
        for connection in self.connections:
            connection.close()
