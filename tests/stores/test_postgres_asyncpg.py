"""The PostgreSQL store's async verbs on asyncpg (``async_driver="asyncpg"``), beyond the
conformance suite (which runs on it too): configuration, round trips, lost replies and dead
sessions, the pool's limit, cancellation."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Iterator
from typing import Any

import asyncpg
import psycopg
import psycopg.conninfo
import pytest

import oncely
from oncely import (
    Acquired,
    ConfigurationError,
    InProgress,
    Replay,
    SchemaMissingError,
    StoreError,
    StoreUnavailableError,
)
from oncely.stores.postgres import PostgresStore
from oncely.stores.postgres._asyncpg import numbered
from oncely.testing.conformance import StoreCalls
from tests._helpers import eventually
from tests._proxy import Proxy
from tests.stores._cut import VERBS, assert_lost_reply_is_recognised
from tests.stores.test_postgres import (
    _READY_FOR_QUERY,
    LEASE,
    TTL,
    _backends,
    _name,
    _ProtocolCounter,
    _terminate,
    _with,
)
from tests.stores.test_postgres import admin as admin
from tests.stores.test_postgres import app as app
from tests.stores.test_postgres import base_url as base_url
from tests.stores.test_postgres import counter as counter
from tests.stores.test_postgres import fresh_schema as fresh_schema
from tests.stores.test_postgres import schema as schema

pytestmark = pytest.mark.postgres


def _store(conninfo: str, **options: Any) -> PostgresStore:
    return PostgresStore(conninfo, async_driver="asyncpg", **options)


def test_placeholders_are_numbered_once_per_statement() -> None:
    """psycopg's positional and named placeholders become asyncpg's ``$n`` (a name used twice
    keeps its number), and ``%%`` a literal ``%``."""
    assert numbered("a = %s AND b = %s") == ("a = $1 AND b = $2", None)
    assert numbered("x = %(lease)s, y = %(key)s + %(lease)s, z = '%%'") == (
        "x = $1, y = $2 + $1, z = '%'",
        ("lease", "key"),
    )


def test_url_option_and_scheme_select_asyncpg(
    base_url: str, schema: str, admin: psycopg.Connection[Any], app: str
) -> None:
    """``?async_driver=asyncpg`` and ``postgresql+asyncpg://`` open a store whose async verbs
    run on asyncpg (its sessions carry the application name); the sync ones stay on psycopg."""
    separator = "&" if "?" in base_url else "?"
    query = f"{separator}schema={schema}&application_name={app}"
    for url in (
        f"{base_url}{query}&async_driver=asyncpg",
        base_url.replace("postgresql://", "postgresql+asyncpg://", 1) + query,
    ):
        with oncely.open_store(url, namespace="n") as store:
            assert isinstance(store, PostgresStore)

            async def claim(store: PostgresStore = store) -> Any:
                answer = await store.aclaim(_name("k"), "fp", lease=LEASE, ttl=TTL)
                assert _backends(admin, app)
                await store.aclose()
                return answer

            assert isinstance(asyncio.run(claim()), Acquired)


@pytest.mark.parametrize(
    ("url", "options"),
    [
        ("postgresql://127.0.0.1/x", {"async_driver": "aiopg"}),
        ("postgresql://127.0.0.1/x?krbsrvname=x", {"async_driver": "asyncpg"}),
    ],
)
def test_bad_driver_settings_are_configuration_errors(url: str, options: dict[str, Any]) -> None:
    """An unknown driver, or a libpq parameter asyncpg cannot take, fail when the store is built."""
    with pytest.raises(ConfigurationError):
        PostgresStore.from_url(url, **options)


@pytest.mark.parametrize(
    ("parts", "reason"),
    [
        ({"user": "oncely_no_such_role_x"}, r'role "oncely_no_such_role_x" does not exist'),
        ({"dbname": "oncely_no_such_db_x"}, r'database "oncely_no_such_db_x" does not exist'),
    ],
    ids=["role", "database"],
)
def test_refused_settings_are_configuration_errors(
    base_url: str, schema: str, parts: dict[str, str], reason: str
) -> None:
    """A role or database the server does not know: a ConfigurationError with its reason."""
    with _store(_with(base_url, **parts), schema=schema) as store:
        with pytest.raises(ConfigurationError, match=reason) as info:
            asyncio.run(store.aget("k"))
        assert isinstance(info.value.__cause__, asyncpg.PostgresError)


def test_unreachable_server_and_missing_schema(base_url: str, fresh_schema: str) -> None:
    """Nothing listening: StoreUnavailableError; no oncely schema: SchemaMissingError."""
    spare = socket.create_server(("127.0.0.1", 0))
    port = spare.getsockname()[1]
    spare.close()  # nothing listens there now
    closed = psycopg.conninfo.make_conninfo(base_url, host="127.0.0.1", port=port)
    with _store(closed, connect_timeout=2) as store, pytest.raises(StoreUnavailableError):
        asyncio.run(store.aget("k"))
    with _store(base_url, schema=fresh_schema) as store, pytest.raises(SchemaMissingError):
        asyncio.run(store.aclaim("k", "fp", lease=LEASE, ttl=TTL))


@pytest.fixture
def counted(base_url: str, schema: str, counter: _ProtocolCounter) -> Iterator[PostgresStore]:
    conninfo = psycopg.conninfo.make_conninfo(
        base_url, host="127.0.0.1", port=counter.port, sslmode="disable"
    )
    with _store(conninfo, schema=schema, namespace=_name("rt")) as store:
        yield store


def test_each_verb_is_one_round_trip(counted: PostgresStore, counter: _ProtocolCounter) -> None:
    """claim, extend, complete, replay and release: one round trip each once the connection has
    prepared the statement (asyncpg prepares in a round trip of its own, once; a heartbeat's
    extends as the connection opens)."""

    async def cost(call: Any) -> tuple[Any, int, int]:
        # asyncpg ends a preparation's round trip with a Flush (H), an execution's with a Sync.
        mark = len(counter.sent)
        answer = await call
        sent = counter.sent_since(mark)
        return answer, sum(sent.count(end) for end in "SHQ"), sent.count("P")

    async def main() -> None:
        store = counted
        # The connection prepares a heartbeat's two extends as it opens, then the claim, each
        # in a round trip of its own (no type lookups: their arrays are of text).
        assert (await cost(store.aclaim("warm-1", "fp", lease=LEASE, ttl=TTL)))[1:] == (4, 3)
        assert await cost(store.aextend("warm-1", 1, lease=LEASE)) == (None, 1, 0)
        await store.acomplete("warm-1", 1, b"r", ttl=TTL)
        await store.aclaim("warm-2", "fp", lease=LEASE, ttl=TTL)
        await store.arelease("warm-2", 1)

        acquired, *claim_cost = await cost(store.aclaim("k", "fp", lease=LEASE, ttl=TTL))
        assert isinstance(acquired, Acquired)
        assert claim_cost == [1, 0]
        extended, *extend_cost = await cost(store.aextend("k", acquired.token, lease=LEASE))
        assert (extended, extend_cost) == (None, [1, 0])
        done, *complete_cost = await cost(store.acomplete("k", acquired.token, b"r", ttl=TTL))
        assert (done, complete_cost) == (None, [1, 0])
        replay, *replay_cost = await cost(store.aclaim("k", "fp", lease=LEASE, ttl=TTL))
        assert isinstance(replay, Replay)
        assert replay.record.result == b"r"
        assert replay_cost == [1, 0]
        other = await store.aclaim("other", "fp", lease=LEASE, ttl=TTL)
        released, *release_cost = await cost(store.arelease("other", other.token))
        assert (released, release_cost) == (None, [1, 0])
        await store.aclose()

    asyncio.run(main())


def test_heartbeats_extends_are_one_round_trip_from_a_connections_first(
    counted: PostgresStore, counter: _ProtocolCounter
) -> None:
    """Concurrent heartbeats over connections that never extended, a lease's two beats among
    them: three calls of the loop's grouped extends, one round trip each and no preparation.
    (Under the campaign's ``latency`` fault, a round trip a quarter of the lease, the beats that
    queued behind the first two lost their leases: each first extend on a connection took a
    round trip to prepare, and a batch naming a lease twice ran one round trip per extend.)"""
    keys = [f"k{index}" for index in range(4)]

    async def main() -> tuple[list[Any], str]:
        store = counted
        # Four claims at once open four connections, each of which prepares only the claim.
        claims = await asyncio.gather(
            *(store.aclaim(key, "fp", lease=LEASE, ttl=TTL) for key in keys)
        )
        leases = [(key, claim.token) for key, claim in zip(keys, claims, strict=True)]
        mark = len(counter.sent)
        answers = await asyncio.gather(
            *(store.aextend(key, token, lease=LEASE) for key, token in leases + leases)
        )
        sent = counter.sent_since(mark)
        await store.aclose()
        return answers, sent

    answers, sent = asyncio.run(main())
    assert answers == [None] * 8
    # Two extends alone, then the six that queued behind them in one statement.
    assert (sum(sent.count(end) for end in "SHQ"), sent.count("P")) == (3, 0), sent


@pytest.mark.parametrize("verb", VERBS)
def test_resent_transition_answers_as_the_first_send(
    base_url: str, schema: str, app: str, verb: str
) -> None:
    """The statement commits, then the connection dies before its reply: asyncpg's path sends
    it again on a new connection and answers as the lost reply would have, as psycopg's does."""
    host = psycopg.conninfo.conninfo_to_dict(base_url)
    with Proxy(int(host.get("port") or 5432)) as cutter:
        conninfo = psycopg.conninfo.make_conninfo(base_url, host="127.0.0.1", port=cutter.port)
        with _store(conninfo, schema=schema, namespace=_name("ns"), application_name=app) as store:
            api = StoreCalls(store, "async")
            try:
                assert_lost_reply_is_recognised(
                    api, cutter, verb, _name("key"), until=_READY_FOR_QUERY
                )
            finally:
                api.close()


def test_sessions_killed_between_calls(
    base_url: str, schema: str, admin: psycopg.Connection[Any], app: str
) -> None:
    """Every session ends (a restart, a failover): the next call gets a new one and succeeds."""

    async def main() -> None:
        async with _store(
            base_url, schema=schema, namespace=_name("ns"), application_name=app
        ) as store:
            taken = await store.aclaim("k", "fp", lease=LEASE, ttl=TTL)
            assert isinstance(taken, Acquired)
            _terminate(admin, app)
            assert await store.acomplete("k", taken.token, b"r", ttl=TTL) is None
            _terminate(admin, app)
            assert isinstance(await store.aclaim("k", "fp", lease=LEASE, ttl=TTL), Replay)

    asyncio.run(main())


def test_a_full_pool_times_out_as_unavailable(
    base_url: str, schema: str, admin: psycopg.Connection[Any]
) -> None:
    """max_size connections in use (one, blocked on a row another session locks): the next
    call waits pool_timeout, then StoreUnavailableError; the blocked one lands afterwards."""

    async def main() -> None:
        async with _store(
            base_url, schema=schema, namespace=_name("ns"), max_size=1, pool_timeout=0.5
        ) as store:
            taken = await store.aclaim("k", "fp", lease=LEASE, ttl=TTL)
            with admin.transaction():
                admin.execute(
                    f'SELECT 1 FROM "{schema}".oncely_records WHERE key = %s FOR UPDATE',
                    (f"{store.namespace}:k",),
                )
                blocked = asyncio.ensure_future(store.acomplete("k", taken.token, b"r", ttl=TTL))
                await asyncio.sleep(0)  # it takes the one connection and waits for the row
                with pytest.raises(StoreUnavailableError, match="no connection"):
                    await store.aget("other")
                assert not blocked.done()
            assert await blocked is None
            assert isinstance(await store.aclaim("k", "fp", lease=LEASE, ttl=TTL), Replay)

    asyncio.run(main())


def test_cancelled_claim_gives_its_lease_back(
    base_url: str, schema: str, admin: psycopg.Connection[Any]
) -> None:
    """A caller cancelled while its claim waits on the server: the claim lands, its lease is
    given back (released), and the key is free for the next caller at once."""

    async def main() -> None:
        async with _store(base_url, schema=schema, namespace=_name("ns")) as store:
            stored = f"{store.namespace}:k"
            with admin.transaction():
                admin.execute(
                    f'INSERT INTO "{schema}".oncely_records (key, status, fingerprint, token, '
                    "attempt, lease_expires_at, expires_at, created_at, updated_at) VALUES "
                    "(%s, 'released', 'fp', 1, 1, now(), now() + interval '1 hour', now(), now())",
                    (stored,),
                )
                claim = asyncio.ensure_future(store.aclaim("k", "fp", lease=LEASE, ttl=TTL))
                await asyncio.sleep(0.2)  # the claim waits for the row lock
                claim.cancel()
            with pytest.raises(asyncio.CancelledError):
                await claim
            again = await store.aclaim("k", "fp", lease=LEASE, ttl=TTL)
            assert isinstance(again, Acquired), again
            assert not isinstance(again, InProgress)

    asyncio.run(main())


def test_closed_store_refuses(base_url: str, schema: str) -> None:
    store = _store(base_url, schema=schema)

    async def main() -> None:
        await store.aget("k")
        await store.aclose()
        with pytest.raises(StoreError, match="closed"):
            await store.aget("k")

    asyncio.run(main())


def test_unprepared_statements_behind_a_pooler(
    base_url: str, schema: str, counter: _ProtocolCounter
) -> None:
    """prepare=False: every statement runs unnamed (a pooler in transaction mode cannot keep
    named ones), so each is parsed again on every call; the answers are the same."""
    conninfo = psycopg.conninfo.make_conninfo(
        base_url, host="127.0.0.1", port=counter.port, sslmode="disable"
    )

    async def main() -> None:
        async with _store(conninfo, schema=schema, namespace=_name("np"), prepare=False) as store:
            for _ in range(2):
                mark = len(counter.sent)
                taken = await store.aclaim("k", "fp", lease=LEASE, ttl=TTL)
                assert counter.sent_since(mark).count("P") == 1
                if isinstance(taken, Acquired):
                    assert await store.acomplete("k", taken.token, b"r", ttl=TTL) is None
                else:
                    assert isinstance(taken, Replay)
                    assert taken.record.result == b"r"

    asyncio.run(main())


def test_each_event_loop_has_its_own_connections(
    base_url: str, schema: str, admin: psycopg.Connection[Any], app: str
) -> None:
    """A store used from one asyncio.run after another, never closed in between: each loop's
    connections close when that loop shuts down (no unclosed-connection warning), and the next
    loop opens its own."""
    store = _store(base_url, schema=schema, namespace=_name("ns"), application_name=app)

    async def claim(key: str) -> Any:
        return await store.aclaim(key, "fp", lease=LEASE, ttl=TTL)

    try:
        assert isinstance(asyncio.run(claim("a")), Acquired)
        eventually(lambda: not _backends(admin, app), timeout=10)  # closed with its loop
        assert isinstance(asyncio.run(claim("b")), Acquired)
    finally:
        store.close()


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (asyncpg.exceptions.UndefinedTableError("no table"), SchemaMissingError),
        (asyncpg.exceptions.UndefinedFunctionError("no function"), SchemaMissingError),
        (asyncpg.exceptions.AdminShutdownError("shutting down"), StoreUnavailableError),
        (asyncpg.exceptions.QueryCanceledError("statement timeout"), StoreUnavailableError),
        (asyncpg.exceptions.DeadlockDetectedError("deadlock"), StoreUnavailableError),
        (asyncpg.exceptions.ConnectionDoesNotExistError("closed mid-way"), StoreUnavailableError),
        (asyncpg.InterfaceError("connection is closed"), StoreUnavailableError),
        (ConnectionResetError("reset by peer"), StoreUnavailableError),
        (asyncpg.exceptions.UniqueViolationError("duplicate"), StoreError),
        (asyncpg.exceptions.ProtocolError("unexpected message"), StoreError),
        (ValueError("not the driver's"), type(None)),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, BaseException) else "",
)
def test_driver_errors_read_as_oncely_errors(
    base_url: str, exc: BaseException, expected: type
) -> None:
    """asyncpg's exceptions map as psycopg's do (`_errors.Boundary`): a missing schema, the
    classes psycopg raises as OperationalError (unavailable: a settle retries them), any other
    server or protocol error; anything else is not the driver's."""
    with _store(base_url) as store:
        assert store._driver is not None
        translated = store._driver.translated(exc, "'k'")
        assert type(translated) is expected, translated


@pytest.mark.filterwarnings("ignore:.*fork.*:DeprecationWarning")
def test_forked_child_opens_its_own_connections(
    base_url: str, schema: str, admin: psycopg.Connection[Any], app: str
) -> None:
    """A child forked while the parent's loop keeps asyncpg connections connects anew in a loop
    of its own; the parent's sessions survive and serve it afterwards."""
    store = _store(base_url, schema=schema, namespace=_name("ns"), application_name=app)
    loop = asyncio.new_event_loop()
    try:
        claim = store.aclaim
        assert isinstance(loop.run_until_complete(claim("p", "fp", lease=LEASE, ttl=TTL)), Acquired)
        parent_sessions = _backends(admin, app)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports through its exit status
            status = 1
            try:
                answer = asyncio.run(claim("c", "fp", lease=LEASE, ttl=TTL))
                status = 0 if isinstance(answer, Acquired) else 2
            finally:
                os._exit(status)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert set(parent_sessions) <= set(_backends(admin, app))
        again = loop.run_until_complete(claim("c", "fp", lease=LEASE, ttl=TTL))
        assert isinstance(again, InProgress)
        loop.run_until_complete(store.aclose())
    finally:
        store.close()
        loop.close()


def test_libpq_settings_become_asyncpg_arguments() -> None:
    """The store's libpq settings reach asyncpg: the statement timeout and ``options``' other
    ``-c`` settings as server settings, the application name, the connect timeout, sslmode."""
    store = _store(
        "postgresql://u:pw@db.internal:6543/shop?sslmode=require&options=-c%20lock_timeout%3D99",
        statement_timeout=2.5,
        connect_timeout=3,
        application_name="billing",
    )
    assert store._driver is not None
    assert store._driver.options == {
        "user": "u",
        "password": "pw",
        "host": "db.internal",
        "port": 6543,
        "database": "shop",
        "ssl": "require",
        "timeout": 3.0,
        "server_settings": {
            "lock_timeout": "99",
            "statement_timeout": "2500",
            "application_name": "billing",
        },
    }
