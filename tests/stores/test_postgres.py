"""PostgreSQL specifics: schema, purge, corrupt rows, round trips, races and real faults."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import multiprocessing
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psycopg
import psycopg.conninfo
import pytest

import oncely
from oncely import (
    Acquired,
    ConfigurationError,
    CorruptRecordError,
    InProgress,
    InProgressError,
    LeaseLost,
    Replay,
    SchemaMissingError,
    Status,
    StoreError,
    StoreUnavailableError,
    _execution,
)
from oncely.stores.postgres import PostgresStore, _sql, _wire
from oncely.stores.postgres import store as postgres_store
from oncely.testing import FrozenClock
from oncely.testing.conformance import StoreCalls
from tests._helpers import eventually
from tests._proxy import Proxy
from tests.conftest import service_url
from tests.stores._cut import VERBS, assert_lost_reply_is_recognised

pytestmark = pytest.mark.postgres

LEASE = timedelta(seconds=30)
TTL = timedelta(hours=1)


def _name(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def base_url() -> str:
    return service_url("ONCELY_TEST_POSTGRES_URL")


@pytest.fixture(scope="module")
def admin(base_url: str) -> Iterator[psycopg.Connection[Any]]:
    """A plain autocommit connection for setting up and inspecting the server."""
    with psycopg.connect(base_url, autocommit=True) as connection:
        yield connection


@pytest.fixture(scope="module")
def schema(base_url: str, admin: psycopg.Connection[Any]) -> Iterator[str]:
    """A migrated schema of this module's own, dropped at the end."""
    name = _name("oncely_pgt")
    with PostgresStore(base_url, schema=name) as store:
        store.migrate()
    yield name
    admin.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


@pytest.fixture
def fresh_schema(admin: psycopg.Connection[Any]) -> Iterator[str]:
    """The name of a schema that does not exist yet; dropped afterwards if it was created."""
    name = _name("oncely_pgt_fresh")
    yield name
    admin.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


@pytest.fixture
def app() -> str:
    """An application_name no other session uses, so faults hit this test's connections only."""
    return _name("oncely_pgt_app")


@pytest.fixture
def store(base_url: str, schema: str, app: str) -> Iterator[PostgresStore]:
    with PostgresStore(
        base_url, schema=schema, namespace=_name("ns"), application_name=app
    ) as store:
        yield store


def _relay(source: socket.socket, sink: socket.socket) -> None:
    """Copy what *source* sends to *sink*, then pass the end on, as a network would: a client
    that goes away (mid-handshake too) must not leave its server session open behind a proxy."""
    with contextlib.suppress(OSError):
        while data := source.recv(65536):
            sink.sendall(data)
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)


def _backends(admin: psycopg.Connection[Any], app: str) -> list[int]:
    rows = admin.execute(
        "SELECT pid FROM pg_stat_activity WHERE application_name = %s ORDER BY pid", (app,)
    ).fetchall()
    return [row[0] for row in rows]


def _terminate(admin: psycopg.Connection[Any], app: str) -> None:
    """Kill every session of *app* and wait until the server has ended them."""
    admin.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
        (app,),
    )
    eventually(lambda: not _backends(admin, app), timeout=10)


def _table(schema: str) -> str:
    return f'"{schema}".oncely_records'


# -- URLs and options ------------------------------------------------------------------------


def test_open_store_accepts_both_schemes_and_store_options(
    base_url: str, schema: str, admin: psycopg.Connection[Any], app: str
) -> None:
    """postgres:// and postgresql:// open; store options leave the URL, libpq ones stay in it."""
    for scheme in ("postgresql", "postgres"):
        url = base_url.replace("postgresql://", f"{scheme}://", 1)
        separator = "&" if "?" in url else "?"
        url += f"{separator}schema={schema}&max_size=2&pool_timeout=2&application_name={app}"
        with oncely.open_store(url, namespace="n") as store:
            assert isinstance(store, PostgresStore)
            assert store.schema == schema
            assert isinstance(store.claim(_name("k"), "fp", lease=LEASE, ttl=TTL), Acquired)
            assert _backends(admin, app)


@pytest.mark.parametrize(
    ("url", "options"),
    [
        ("postgresql://127.0.0.1/x?max_size=many", {}),
        ("postgresql://127.0.0.1/x", {"min_size": 5, "max_size": 2}),
        ("postgresql://127.0.0.1/x", {"pool_timeout": 0}),
        ("postgresql://127.0.0.1/x?bogus_libpq_option=1", {}),
        ("postgresql://127.0.0.1/x", {"schema": ""}),
    ],
)
def test_bad_settings_are_configuration_errors(url: str, options: dict[str, Any]) -> None:
    """Malformed URLs and options fail when the store is built, before any connection."""
    with pytest.raises(ConfigurationError):
        PostgresStore.from_url(url, **options)


def _with(base_url: str, **parts: str) -> str:
    """*base_url* with its user or database replaced."""
    params = psycopg.conninfo.conninfo_to_dict(base_url)
    params.update(parts)
    return psycopg.conninfo.make_conninfo(**params)


@pytest.mark.parametrize(
    ("parts", "reason"),
    [
        ({"user": "oncely_no_such_role_x"}, r'role "oncely_no_such_role_x" does not exist'),
        ({"dbname": "oncely_no_such_db_x"}, r'database "oncely_no_such_db_x" does not exist'),
    ],
    ids=["role", "database"],
)
def test_refused_settings_are_configuration_errors_at_once(
    base_url: str, schema: str, parts: dict[str, str], reason: str
) -> None:
    """A role or database the server does not know is a ConfigurationError naming the server's
    reason, sync and async, not a pool timeout reported as an outage (pool_timeout is long
    enough here that an outage-style answer could not come first)."""
    conninfo = _with(base_url, **parts)
    with PostgresStore(conninfo, schema=schema, pool_timeout=30) as store:
        for call in (
            lambda: store.claim("k", "fp", lease=LEASE, ttl=TTL),
            lambda: asyncio.run(store.aget("k")),
            store.migrate,
        ):
            with pytest.raises(ConfigurationError, match=reason) as info:
                call()
            assert not isinstance(info.value, StoreError)
            assert isinstance(info.value.__cause__, psycopg.OperationalError)


def test_clock_option_is_accepted_and_ignored(base_url: str, schema: str) -> None:
    """A client clock may be passed (as to every store), but the server's clock judges."""
    frozen = FrozenClock(now_ms=0)
    with PostgresStore(base_url, schema=schema, clock=frozen, namespace=_name("n")) as store:
        key = _name("k")
        store.claim(key, "fp", lease=LEASE, ttl=TTL)
        record = store.get(key)
        assert record is not None
        assert abs(record.created_at_ms - time.time() * 1000) < 60_000


def test_scan_pages_through_one_namespace(store: PostgresStore, base_url: str, schema: str) -> None:
    """scan lists live records of this namespace only, in key order, without results."""
    with PostgresStore(base_url, schema=schema, namespace=store.namespace + "x") as neighbour:
        neighbour.claim("b", "fp", lease=LEASE, ttl=TTL)
    for key in ("c", "a", "b"):
        token = store.claim(key, "fp", lease=LEASE, ttl=TTL)
        assert isinstance(token, Acquired)
        store.complete(key, token.token, b"result", ttl=TTL)
    first = store.scan(limit=2)
    assert [record.key for record in first] == ["a", "b"]
    assert all(record.result is None for record in first)
    assert [record.key for record in store.scan(after="b")] == ["c"]


# -- schema ---------------------------------------------------------------------------------


def test_missing_schema_raises_schema_missing_error(
    base_url: str, fresh_schema: str, admin: psycopg.Connection[Any]
) -> None:
    """Until migrate() runs every verb fails naming it, and nothing is created on first use."""
    with PostgresStore(base_url, schema=fresh_schema) as store:
        for call in (
            lambda: store.claim("k", "fp", lease=LEASE, ttl=TTL),
            lambda: store.complete("k", 1, b"r", ttl=TTL),
            lambda: store.get("k"),
            lambda: asyncio.run(store.aclaim("k", "fp", lease=LEASE, ttl=TTL)),
        ):
            with pytest.raises(SchemaMissingError, match=r"migrate\(\)") as info:
                call()
            assert isinstance(info.value.__cause__, psycopg.Error)
    exists = admin.execute(
        "SELECT count(*) FROM pg_namespace WHERE nspname = %s", (fresh_schema,)
    ).fetchone()
    assert exists == (0,)


def test_migrate_is_idempotent_and_keeps_records(
    base_url: str, fresh_schema: str, admin: psycopg.Connection[Any]
) -> None:
    """migrate() run again (sync or async) changes nothing and loses no record."""
    with PostgresStore(base_url, schema=fresh_schema) as store:
        store.migrate()
        answer = store.claim("k", "fp", lease=LEASE, ttl=TTL)
        assert isinstance(answer, Acquired)
        store.migrate()
        asyncio.run(store.amigrate())
        assert isinstance(store.claim("k", "fp", lease=LEASE, ttl=TTL), InProgress)
    version = admin.execute(f'SELECT id, version FROM "{fresh_schema}".oncely_schema').fetchall()
    assert version == [(1, _sql.SCHEMA_VERSION)]


def _migrate_in_process(url: str, schema: str, barrier: Any, results: Any) -> None:
    try:
        store = PostgresStore(url, schema=schema)
        barrier.wait(timeout=60)
        store.migrate()
        store.close()
        results.put("ok")
    except BaseException as exc:
        results.put(repr(exc))


def test_concurrent_migrations_from_several_processes(
    base_url: str, fresh_schema: str, admin: psycopg.Connection[Any]
) -> None:
    """Processes migrating one new schema at the same moment all succeed (advisory lock)."""
    context = multiprocessing.get_context("forkserver")
    barrier = context.Barrier(6)
    results = context.Queue()
    workers = [
        context.Process(target=_migrate_in_process, args=(base_url, fresh_schema, barrier, results))
        for _ in range(6)
    ]
    for worker in workers:
        worker.start()
    try:
        outcomes = [results.get(timeout=60) for _ in workers]
    finally:
        for worker in workers:
            worker.join(timeout=30)
    assert outcomes == ["ok"] * 6
    functions = admin.execute(
        "SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
        "WHERE n.nspname = %s AND p.proname = 'oncely_claim'",
        (fresh_schema,),
    ).fetchone()
    assert functions == (1,)
    with PostgresStore(base_url, schema=fresh_schema) as store:
        assert isinstance(store.claim("k", "fp", lease=LEASE, ttl=TTL), Acquired)


def test_migrate_refuses_to_downgrade_a_newer_schema(
    base_url: str, fresh_schema: str, admin: psycopg.Connection[Any]
) -> None:
    """A schema migrated by a newer oncely is left alone, with a clear error."""
    with PostgresStore(base_url, schema=fresh_schema) as store:
        store.migrate()
        admin.execute(f'UPDATE "{fresh_schema}".oncely_schema SET version = 99')
        with pytest.raises(StoreError, match="newer version"):
            store.migrate()


# -- purge ----------------------------------------------------------------------------------


def test_purge_deletes_expired_records_in_batches(
    store: PostgresStore, schema: str, admin: psycopg.Connection[Any]
) -> None:
    """purge removes records past their expiry (batch by batch, up to a limit), not live ones."""
    for index in range(7):
        store.claim(f"k{index}", "fp", lease=LEASE, ttl=TTL)
    prefix = store.namespace + ":"
    admin.execute(
        f"UPDATE {_table(schema)} SET expires_at = now() - interval '1 second' "
        "WHERE key LIKE %s AND key <> %s",
        (prefix + "%", prefix + "k6"),
    )
    assert store.get("k0") is None
    assert store.purge(batch=2, limit=3) == 3
    assert asyncio.run(store.apurge(batch=2)) == 3
    assert store.purge() == 0
    remaining = admin.execute(
        f"SELECT key FROM {_table(schema)} WHERE key LIKE %s", (prefix + "%",)
    ).fetchall()
    assert remaining == [(prefix + "k6",)]


def test_purge_uses_the_expires_at_index(
    store: PostgresStore, schema: str, admin: psycopg.Connection[Any]
) -> None:
    """The batch query can be answered from the expires_at index (no sequential scan needed)."""
    admin.execute("SET enable_seqscan = off")
    try:
        plan = admin.execute(
            f"EXPLAIN SELECT key FROM {_table(schema)} WHERE expires_at <= now() "
            "ORDER BY expires_at LIMIT 10"
        ).fetchall()
    finally:
        admin.execute("RESET enable_seqscan")
    assert "oncely_records_expires_at" in " ".join(row[0] for row in plan)


# -- corrupt records ------------------------------------------------------------------------


@pytest.mark.parametrize("expired", [False, True])
def test_unknown_status_fails_closed(
    store: PostgresStore, schema: str, admin: psycopg.Connection[Any], expired: bool
) -> None:
    """A record with a status this version does not know is never overwritten or re-executed."""
    stored = f"{store.namespace}:k"
    admin.execute(
        f"INSERT INTO {_table(schema)} VALUES (%s, 'archived', 'fp', 7, 1, now(), "
        "now() + %s, now(), now(), 'x')",
        (stored, timedelta(seconds=-1 if expired else 3600)),
    )
    with pytest.raises(CorruptRecordError) as info:
        store.claim("k", "fp", lease=LEASE, ttl=TTL)
    assert info.value.key == "k"
    with pytest.raises(CorruptRecordError):
        asyncio.run(store.aclaim("k", "fp", lease=LEASE, ttl=TTL))
    if not expired:
        with pytest.raises(CorruptRecordError):
            store.get("k")
    assert store.complete("k", 7, b"r", ttl=TTL) == LeaseLost()
    row = admin.execute(
        f"SELECT status, token FROM {_table(schema)} WHERE key = %s", (stored,)
    ).fetchone()
    assert row == ("archived", 7)


def test_decorated_function_never_runs_over_a_corrupt_record(
    store: PostgresStore, schema: str, admin: psycopg.Connection[Any]
) -> None:
    """@idempotent fails closed on a corrupt record: the operation is not executed."""
    calls: list[str] = []

    @oncely.idempotent(store=store, key="order_id", scope="corrupt")
    def charge(order_id: str) -> str:
        calls.append(order_id)
        return "charged"

    admin.execute(
        f"INSERT INTO {_table(schema)} VALUES (%s, '', 'fp', 1, 1, now(), "
        "now() + interval '1 hour', now(), now(), NULL)",
        (f"{store.namespace}:corrupt|o-1",),
    )
    with pytest.raises(CorruptRecordError):
        charge("o-1")
    assert calls == []


# -- round trips ----------------------------------------------------------------------------


class _ProtocolCounter:
    """A loopback TCP proxy that counts what the client sends to PostgreSQL, message by message.

    In the extended protocol each round trip ends with one Sync message (the simple protocol's
    Query plays that part), after which the client waits for ReadyForQuery: so the number of
    Sync and Query messages is the number of round trips, independent of timing.
    """

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.counts: dict[str, int] = {}
        self.sent: list[str] = []  # every message's type, in order
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def round_trips(self) -> int:
        with self._lock:
            return self.counts.get("S", 0) + self.counts.get("Q", 0)

    def parses(self) -> int:
        with self._lock:
            return self.counts.get("P", 0)

    def sent_since(self, mark: int) -> str:
        """The types of the messages sent since `len(self.sent)` was *mark*, as one string."""
        with self._lock:
            return "".join(self.sent[mark:])

    def close(self) -> None:
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            self._sockets += [client, server]
            threading.Thread(target=self._frontend, args=(client, server), daemon=True).start()
            threading.Thread(target=_relay, args=(server, client), daemon=True).start()

    def _frontend(self, client: socket.socket, server: socket.socket) -> None:
        buffer = b""
        untyped = True  # the startup message (and an SSL or GSS request) have no type byte
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                buffer += data
                while True:
                    header = 4 if untyped else 5
                    if len(buffer) < header:
                        break
                    offset = 0 if untyped else 1
                    (length,) = struct.unpack("!i", buffer[offset : offset + 4])
                    if len(buffer) < offset + length:
                        break
                    message, buffer = buffer[: offset + length], buffer[offset + length :]
                    if untyped:
                        (code,) = struct.unpack("!i", message[4:8])
                        untyped = code in (80877103, 80877104)  # SSLRequest, GSSENCRequest
                    else:
                        kind = chr(message[0])
                        with self._lock:
                            self.counts[kind] = self.counts.get(kind, 0) + 1
                            self.sent.append(kind)
                    # Count first, forward second: the reply cannot overtake the count.
                    server.sendall(message)


@pytest.fixture
def counter(base_url: str) -> Iterator[_ProtocolCounter]:
    params = psycopg.conninfo.conninfo_to_dict(base_url)
    proxy = _ProtocolCounter(
        str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432)
    )
    yield proxy
    proxy.close()


@pytest.fixture
def counted_store(base_url: str, schema: str, counter: _ProtocolCounter) -> Iterator[PostgresStore]:
    conninfo = psycopg.conninfo.make_conninfo(
        base_url, host="127.0.0.1", port=counter.port, sslmode="disable", gssencmode="disable"
    )
    with PostgresStore(
        conninfo, schema=schema, namespace=_name("rt"), min_size=1, max_size=1
    ) as store:
        yield store


@dataclass
class _Verbs:
    """The store's verbs in one world, sync or async, as plain calls."""

    claim: Callable[[str], Any]
    complete: Callable[[str, int], Any]
    release: Callable[[str, int], Any]
    extend: Callable[[str, int], Any]


def _sync_verbs(store: PostgresStore) -> _Verbs:
    return _Verbs(
        claim=lambda key: store.claim(key, "fp", lease=LEASE, ttl=TTL),
        complete=lambda key, token: store.complete(key, token, b"r", ttl=TTL),
        release=lambda key, token: store.release(key, token),
        extend=lambda key, token: store.extend(key, token, lease=LEASE),
    )


def _async_verbs(store: PostgresStore, loop: asyncio.AbstractEventLoop) -> _Verbs:
    run = loop.run_until_complete
    return _Verbs(
        claim=lambda key: run(store.aclaim(key, "fp", lease=LEASE, ttl=TTL)),
        complete=lambda key, token: run(store.acomplete(key, token, b"r", ttl=TTL)),
        release=lambda key, token: run(store.arelease(key, token)),
        extend=lambda key, token: run(store.aextend(key, token, lease=LEASE)),
    )


@pytest.mark.parametrize("world", ["sync", "async"])
def test_each_verb_is_one_round_trip(
    counted_store: PostgresStore,
    counter: _ProtocolCounter,
    monkeypatch: pytest.MonkeyPatch,
    world: str,
) -> None:
    """claim, complete, replay, release and extend: one statement and one round trip each.

    A statement is prepared the first time a connection runs it (one extra round trip, once);
    afterwards it is only executed.
    """
    executed: list[str] = []
    for cls in (psycopg.Cursor, psycopg.AsyncCursor):  # connection.execute calls these too
        original = cls.execute

        def execute(self: Any, query: Any, *args: Any, _original: Any = original, **kw: Any) -> Any:
            executed.append(str(query))
            return _original(self, query, *args, **kw)

        monkeypatch.setattr(cls, "execute", execute)
    # The claim and the finishes go below the cursor, straight to libpq: counted there.
    for name in ("run", "arun"):
        original = getattr(_wire, name)

        def run(connection: Any, wire: Any, *args: Any, _original: Any = original) -> Any:
            executed.append(wire.sql.decode())
            return _original(connection, wire, *args)

        monkeypatch.setattr(_wire, name, run)

    loop = asyncio.new_event_loop()
    try:
        verbs = _sync_verbs(counted_store) if world == "sync" else _async_verbs(counted_store, loop)

        def cost(call: Callable[[], Any]) -> tuple[Any, int, int, int]:
            executed.clear()
            trips, parses = counter.round_trips(), counter.parses()
            answer = call()
            return answer, len(executed), counter.round_trips() - trips, counter.parses() - parses

        # First use on this connection: each statement is prepared once, then executed.
        first = cost(lambda: verbs.claim("warm-1"))
        assert first[1:] == (1, 2, 1)
        verbs.extend("warm-1", 1)
        verbs.complete("warm-1", 1)
        verbs.claim("warm-2")
        verbs.release("warm-2", 1)

        acquired, *claim_cost = cost(lambda: verbs.claim("k"))
        assert isinstance(acquired, Acquired)
        assert claim_cost == [1, 1, 0]
        extended, *extend_cost = cost(lambda: verbs.extend("k", acquired.token))
        assert extended is None
        assert extend_cost == [1, 1, 0]
        completed, *complete_cost = cost(lambda: verbs.complete("k", acquired.token))
        assert completed is None
        assert complete_cost == [1, 1, 0]
        replay, *replay_cost = cost(lambda: verbs.claim("k"))
        assert isinstance(replay, Replay)
        assert replay_cost == [1, 1, 0]
        second, *_ = cost(lambda: verbs.claim("other"))
        released, *release_cost = cost(lambda: verbs.release("other", second.token))
        assert released is None
        assert release_cost == [1, 1, 0]
    finally:
        if world == "async":
            loop.run_until_complete(counted_store.aclose())
        loop.close()


def _verdicts(verbs: _Verbs, claim_as: Callable[[str, str], Any], fail: Callable[..., Any]) -> None:
    """Every verdict of a claim, and both finishes, as the store must give them."""
    acquired = verbs.claim("café-1")
    assert isinstance(acquired, Acquired)
    assert not acquired.recovered
    assert acquired.attempt == 1
    busy = verbs.claim("café-1")
    assert isinstance(busy, InProgress)
    assert timedelta(0) < busy.retry_after <= LEASE
    assert verbs.complete("café-1", acquired.token + 1) == LeaseLost()
    assert verbs.complete("café-1", acquired.token) is None
    replay = verbs.claim("café-1")
    assert isinstance(replay, Replay)
    record = replay.record
    assert (record.key, record.status, record.fingerprint, record.token, record.result) == (
        "café-1",
        Status.COMPLETED,
        "fp",
        acquired.token,
        b"r",
    )
    assert record.created_at_ms <= record.updated_at_ms <= replay.judged_at_ms
    assert record.expires_at_ms - record.updated_at_ms in range(3_600_000 - 1, 3_600_000 + 2)
    assert claim_as("café-1", "other") == oncely.Mismatch(stored_fingerprint="fp")
    second = verbs.claim("café-2")
    assert fail("café-2", second.token) is None
    failed = verbs.claim("café-2")
    assert isinstance(failed, Replay)
    assert failed.record.status is Status.FAILED


@pytest.mark.parametrize("world", ["sync", "async"])
@pytest.mark.parametrize("setting", ["prepared", "unprepared", "latin1"])
def test_claim_and_finishes_give_every_verdict_in_each_setting(
    base_url: str, schema: str, world: str, setting: str
) -> None:
    """The claim and the finishes go straight to libpq (`_wire`), statements prepared; behind a
    pooler (``prepare=False``) unnamed; on a connection whose client encoding is not UTF-8
    through the cursor: the verdicts are the same in each, non-ASCII keys included."""
    url = base_url
    if setting == "latin1":
        url = psycopg.conninfo.make_conninfo(base_url, client_encoding="LATIN1")
    prepare = setting != "unprepared"
    with PostgresStore(url, schema=schema, namespace=_name("wire"), prepare=prepare) as store:
        if world == "sync":
            _verdicts(
                _sync_verbs(store),
                lambda key, fp: store.claim(key, fp, lease=LEASE, ttl=TTL),
                lambda key, token: store.fail(key, token, b"e", ttl=TTL),
            )
            assert store._parked is not None
            (connection,) = store._parked.idle
            named = connection.execute(
                "SELECT count(*) FROM pg_prepared_statements WHERE name LIKE 'oncely%'"
            ).fetchone()
            # The claim and the complete (which fail shares), prepared by the store itself (not
            # through psycopg, which prepares on the cursor's path).
            assert named == ((2 if setting == "prepared" else 0),)
            return
        loop = asyncio.new_event_loop()
        run = loop.run_until_complete
        try:
            _verdicts(
                _async_verbs(store, loop),
                lambda key, fp: run(store.aclaim(key, fp, lease=LEASE, ttl=TTL)),
                lambda key, token: run(store.afail(key, token, b"e", ttl=TTL)),
            )
        finally:
            run(store.aclose())
            loop.close()


def test_statements_deallocated_or_kept_behind_the_store_are_used_as_they_are(
    base_url: str, schema: str
) -> None:
    """A session whose prepared statements were deallocated (``DEALLOCATE ALL`` by someone
    else) has the claim and the finishes prepared again, and one that still has them when the
    store thinks not keeps them: the verdicts are unchanged."""
    with PostgresStore(base_url, schema=schema, namespace=_name("dealloc"), max_size=1) as store:
        verbs = _sync_verbs(store)
        token = verbs.claim("k").token
        assert store._parked is not None
        (connection,) = store._parked.idle
        connection.pgconn.exec_(b"DEALLOCATE ALL")
        assert verbs.complete("k", token) is None
        assert isinstance(verbs.claim("k"), Replay)
        assert store._parked.idle == [connection]
        # And the other way round: the session has them while the store lost track of them
        # (a prepare interrupted after the server took it, by Ctrl-C say): not an error.
        connection._oncely_prepared.clear()  # type: ignore[attr-defined]
        assert isinstance(verbs.claim("k"), Replay)
        assert store._parked.idle == [connection]


# -- races beyond the conformance suite -------------------------------------------------------


def _race(store: PostgresStore, key: str, racers: int) -> list[Any]:
    barrier = threading.Barrier(racers)

    def claim() -> Any:
        barrier.wait(timeout=30)
        return store.claim(key, "fp", lease=LEASE, ttl=TTL)

    with ThreadPoolExecutor(max_workers=racers) as pool:
        return list(pool.map(lambda _: claim(), range(racers)))


@pytest.fixture
def wide_store(
    base_url: str, schema: str, admin: psycopg.Connection[Any], app: str
) -> Iterator[PostgresStore]:
    """A store with a connection per racer, opened in advance, so claims really overlap."""
    with PostgresStore(
        base_url,
        schema=schema,
        namespace=_name("race"),
        min_size=16,
        max_size=16,
        application_name=app,
    ) as store:
        store.get("warm-up")
        eventually(lambda: len(_backends(admin, app)) == 16)
        yield store


def test_new_key_race_on_many_keys(wide_store: PostgresStore) -> None:
    """16 connections claim each of 25 new keys at once: exactly one Acquired per key."""
    for index in range(25):
        answers = _race(wide_store, f"new-{index}", 16)
        assert sum(isinstance(answer, Acquired) for answer in answers) == 1
        assert all(isinstance(answer, (Acquired, InProgress)) for answer in answers)


def test_takeover_race_after_lease_expiry(wide_store: PostgresStore) -> None:
    """16 claimers find one expired lease: exactly one recovers it, with the next token."""
    short = timedelta(milliseconds=200)
    for index in range(5):
        key = f"expired-{index}"
        first = wide_store.claim(key, "fp", lease=short, ttl=TTL)
        assert isinstance(first, Acquired)
        eventually(functools.partial(_lapsed, wide_store, key))
        answers = _race(wide_store, key, 16)
        winners = [answer for answer in answers if isinstance(answer, Acquired)]
        assert winners == [Acquired(2, recovered=True, attempt=2)]


def _lapsed(store: PostgresStore, key: str) -> bool:
    record = store.get(key)
    return record is not None and record.lease_expires_at_ms < time.time() * 1000 - 50


def test_reclaim_race_after_release(wide_store: PostgresStore) -> None:
    """16 claimers find one released tombstone: exactly one acquires it, token + 1."""
    for index in range(5):
        key = f"released-{index}"
        first = wide_store.claim(key, "fp", lease=LEASE, ttl=TTL)
        assert isinstance(first, Acquired)
        assert wide_store.release(key, first.token) is None
        answers = _race(wide_store, key, 16)
        winners = [answer for answer in answers if isinstance(answer, Acquired)]
        assert winners == [Acquired(2, recovered=False, attempt=2)]


# -- failures -------------------------------------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_UNREACHABLE = """
import asyncio, logging, sys
import oncely
from oncely.stores.postgres import PostgresStore

logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(name)s: %(message)s")
url, reachable = sys.argv[1:3]
stores = [oncely.open_store(url), PostgresStore(url)]  # the second is never closed
async def aget(store):
    return await store.aget("k")
for call in (lambda: stores[0].get("k"), lambda: asyncio.run(aget(stores[1])), stores[0].migrate):
    try:
        call()
    except oncely.StoreUnavailableError as exc:
        print(type(exc.__cause__).__module__, "|", exc, flush=True)
loop = asyncio.new_event_loop()  # a loop left open at exit, its pool with it
try:
    loop.run_until_complete(aget(stores[1]))
except oncely.StoreUnavailableError as exc:
    print(type(exc.__cause__).__module__, "|", exc, flush=True)
# Pools that opened, left open at exit: a sync one, and an async one in a loop left open.
opened = [oncely.open_store(reachable), oncely.open_store(reachable)]
for call in (lambda: opened[0].get("k"), lambda: loop.run_until_complete(aget(opened[1]))):
    try:
        call()
    except oncely.SchemaMissingError:  # the schema is not there: nothing is written
        pass
"""


def test_an_unreachable_server_fails_with_its_cause_quietly_and_exits_cleanly() -> None:
    """A refused port (sync, async, migrate): the error names host:port and quotes the
    driver's error (chained), no pool is left retrying in the background and logging, and the
    process exits with nothing on stderr (no pool finalised in a dying thread)."""
    port = _closed_port()
    url = f"postgresql://postgres@127.0.0.1:{port}/test"
    base = service_url("ONCELY_TEST_POSTGRES_URL")
    reachable = f"{base}{'&' if '?' in base else '?'}schema={_name('absent')}"  # never created
    done = subprocess.run(
        [sys.executable, "-c", _UNREACHABLE, url, reachable],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 4, done.stdout
    for line in lines:
        module, _, message = line.partition(" | ")
        assert module.startswith("psycopg"), line  # the driver's error, not a pool timeout
        assert f"127.0.0.1:{port}" in message, line
        assert "Connection refused" in message, line
    assert done.stderr == ""


@pytest.mark.parametrize("world", ["sync", "async"])
def test_unreachable_store_fails_fast_and_runs_nothing(world: str) -> None:
    """Nothing listening: StoreUnavailableError within the pool timeout; the function never ran."""
    store = PostgresStore(
        f"postgresql://postgres@127.0.0.1:{_closed_port()}/test", pool_timeout=0.5
    )
    calls: list[str] = []
    started = time.monotonic()
    with store:
        if world == "sync":

            @oncely.idempotent(store=store, key="order_id")
            def charge(order_id: str) -> str:
                calls.append(order_id)
                return "charged"

            with pytest.raises(StoreUnavailableError) as info:
                charge("o-1")
        else:

            @oncely.idempotent(store=store, key="order_id")
            async def acharge(order_id: str) -> str:
                calls.append(order_id)
                return "charged"

            with pytest.raises(StoreUnavailableError) as info:
                asyncio.run(acharge("o-1"))
    assert time.monotonic() - started < 3
    assert calls == []
    assert isinstance(info.value.__cause__, psycopg.Error)


def test_statement_timeout_is_store_unavailable(
    base_url: str, schema: str, admin: psycopg.Connection[Any]
) -> None:
    """A statement stuck behind a lock is cancelled by the server: StoreUnavailableError."""
    with PostgresStore(
        base_url, schema=schema, namespace=_name("st"), statement_timeout=0.3
    ) as store:
        token = store.claim("k", "fp", lease=LEASE, ttl=TTL)
        assert isinstance(token, Acquired)
        with psycopg.connect(base_url) as blocker, blocker.transaction():
            blocker.execute(
                f"SELECT 1 FROM {_table(schema)} WHERE key = %s FOR UPDATE",
                (f"{store.namespace}:k",),
            )
            with pytest.raises(StoreUnavailableError) as info:
                store.complete("k", token.token, b"r", ttl=TTL)
        assert isinstance(info.value.__cause__, psycopg.errors.QueryCanceled)
        assert store.complete("k", token.token, b"r", ttl=TTL) is None


def test_closed_store_raises_store_error(base_url: str, schema: str) -> None:
    """After close() every verb raises StoreError, sync and async; close is idempotent."""
    store = PostgresStore(base_url, schema=schema)
    store.get("k")
    store.close()
    store.close()
    with pytest.raises(StoreError, match="closed"):
        store.get("k")
    with pytest.raises(StoreError, match="closed"):
        asyncio.run(store.aget("k"))


@pytest.mark.parametrize("world", ["sync", "async"])
def test_connection_killed_between_claim_and_complete(
    store: PostgresStore,
    admin: psycopg.Connection[Any],
    app: str,
    world: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The session dies while the function runs: the store re-sends complete on a new
    connection (it carries its call's id, so a re-send is safe).

    The function ran once, the record is completed, and a repeat replays it.
    """
    calls: list[str] = []
    seen: list[list[int]] = []
    completions: list[str] = []
    verb = "complete" if world == "sync" else "acomplete"
    original = getattr(store, verb)

    def note(outcome: str) -> None:
        completions.append(outcome)

    if world == "sync":

        def complete(*args: Any, **kwargs: Any) -> Any:
            try:
                answer = original(*args, **kwargs)
            except StoreUnavailableError:
                note("unavailable")
                raise
            note(repr(answer))
            return answer

        monkeypatch.setattr(store, verb, complete)
    else:

        async def acomplete(*args: Any, **kwargs: Any) -> Any:
            try:
                answer = await original(*args, **kwargs)
            except StoreUnavailableError:
                note("unavailable")
                raise
            note(repr(answer))
            return answer

        monkeypatch.setattr(store, verb, acomplete)

    def kill() -> None:
        seen.append(_backends(admin, app))
        _terminate(admin, app)

    if world == "sync":

        @oncely.idempotent(store=store, key="order_id", heartbeat=False, scope="kill")
        def charge(order_id: str) -> str:
            calls.append(order_id)
            kill()
            return "charged"

        assert charge("o-1") == "charged"
        assert charge("o-1") == "charged"
    else:

        @oncely.idempotent(store=store, key="order_id", heartbeat=False, scope="kill")
        async def acharge(order_id: str) -> str:
            calls.append(order_id)
            await asyncio.to_thread(kill)
            return "charged"

        async def twice() -> list[str]:
            return [await acharge("o-1"), await acharge("o-1")]

        assert asyncio.run(twice()) == ["charged", "charged"]
    assert calls == ["o-1"]
    assert seen[0]
    assert completions == ["None"]
    record = store.get("kill|o-1")
    assert record is not None
    assert record.status is Status.COMPLETED
    assert not set(seen[0]) & set(_backends(admin, app)), "the dead sessions were not replaced"


@pytest.mark.filterwarnings("ignore:.*fork.*:DeprecationWarning")
def test_forked_child_opens_its_own_connections(
    store: PostgresStore, admin: psycopg.Connection[Any], app: str
) -> None:
    """A child forked after the store was used connects anew; the parent's sessions survive."""
    assert isinstance(store.claim("parent", "fp", lease=LEASE, ttl=TTL), Acquired)
    parent_sessions = _backends(admin, app)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit status
        status = 1
        try:
            answer = store.claim("child", "fp", lease=LEASE, ttl=TTL)
            status = 0 if isinstance(answer, Acquired) else 2
            store.close()
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert set(parent_sessions) <= set(_backends(admin, app))
    assert isinstance(store.claim("parent", "fp", lease=LEASE, ttl=TTL), InProgress)
    assert isinstance(store.claim("child", "fp", lease=LEASE, ttl=TTL), InProgress)


def test_event_loop_shutdown_closes_a_busy_loop_pool(
    base_url: str,
    schema: str,
    admin: psycopg.Connection[Any],
    app: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """asyncio.run ends while the loop's pool is still opening a connection: the loop finishes
    at once (psycopg_pool's workers alone would swallow the cancellation and keep it waiting)
    and takes the pool's sessions with it; the next loop gets a pool of its own."""
    # psycopg_pool logs each cancelled connection attempt with its traceback; pytest's log
    # capture would keep those records, their frames and so the half-open connection alive
    # until the test ends, and the session would count as leaked.
    monkeypatch.setattr(logging.getLogger("psycopg.pool"), "propagate", False)
    params = psycopg.conninfo.conninfo_to_dict(base_url)
    proxy = Proxy(
        int(params.get("port") or 5432),
        host=str(params.get("host") or "127.0.0.1"),
        connect_delay=1.5,
    )
    conninfo = psycopg.conninfo.make_conninfo(base_url, host="127.0.0.1", port=proxy.port)
    store = PostgresStore(
        conninfo, schema=schema, namespace=_name("loop"), min_size=2, application_name=app
    )

    def run_twice() -> None:
        for _ in range(2):
            answer = asyncio.run(store.aclaim("k", "fp", lease=LEASE, ttl=TTL))
            assert isinstance(answer, (Acquired, InProgress))

    try:
        runner = threading.Thread(target=run_twice, daemon=True)
        started = time.monotonic()
        runner.start()
        runner.join(timeout=20)
        assert not runner.is_alive(), "the event loop did not finish with its pool open"
        assert time.monotonic() - started < 6
        # A connection attempt the shutdown cancelled half-way is released by psycopg when it
        # is garbage collected: collect, so that only sessions still held are counted.
        eventually(lambda: gc.collect() >= 0 and not _backends(admin, app), timeout=10)
    finally:
        store.close()
        proxy.close()


# -- clock skew -----------------------------------------------------------------------------


@pytest.mark.parametrize("skew", [timedelta(minutes=-10), timedelta(minutes=10)])
def test_client_clock_skew_cannot_steal_or_keep_a_lease(
    store: PostgresStore, monkeypatch: pytest.MonkeyPatch, skew: timedelta
) -> None:
    """A worker whose clock is minutes off sees leases exactly as the server judges them."""
    owner = store.claim("live", "fp", lease=LEASE, ttl=TTL)
    assert isinstance(owner, Acquired)
    short = timedelta(milliseconds=200)
    lapsing = store.claim("lapsing", "fp", lease=short, ttl=TTL)
    assert isinstance(lapsing, Acquired)

    real_time, real_time_ns = time.time, time.time_ns
    monkeypatch.setattr(time, "time", lambda: real_time() + skew.total_seconds())
    monkeypatch.setattr(
        time, "time_ns", lambda: real_time_ns() + skew // timedelta(microseconds=1) * 1000
    )

    answer = store.claim("live", "fp", lease=LEASE, ttl=TTL)
    assert isinstance(answer, InProgress)
    assert timedelta(seconds=25) < answer.retry_after <= LEASE
    assert store.complete("live", owner.token + 1, b"thief", ttl=TTL) == LeaseLost()
    assert isinstance(asyncio.run(store.aclaim("live", "fp", lease=LEASE, ttl=TTL)), InProgress)

    recovered = eventually(
        lambda: _acquired_or_none(store.claim("lapsing", "fp", lease=short, ttl=TTL)), timeout=5
    )
    assert recovered == Acquired(2, recovered=True, attempt=2)
    assert store.complete("live", owner.token, b"mine", ttl=TTL) is None


def _acquired_or_none(answer: Any) -> Acquired | None:
    return answer if isinstance(answer, Acquired) else None


# -- faults against a server of our own --------------------------------------------------------


@dataclass
class _OwnServer:
    """A PostgreSQL cluster created for these tests, on a spare port, that they may restart."""

    version: str
    name: str
    port: int

    @property
    def admin_url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    @property
    def app_url(self) -> str:
        return f"postgresql://oncely_app@127.0.0.1:{self.port}/oncely"

    def ctl(self, action: str) -> None:
        subprocess.run(
            ["pg_ctlcluster", "--skip-systemctl-redirect", self.version, self.name, action],
            check=True,
            capture_output=True,
            timeout=60,
        )


@pytest.fixture(scope="module")
def own_server() -> Iterator[_OwnServer]:
    if shutil.which("pg_createcluster") is None or os.geteuid() != 0:
        pytest.fail("the fault tests need pg_createcluster (postgresql-common) and root")
    version = max(os.listdir("/usr/lib/postgresql"), key=lambda v: int(v.split(".")[0]))
    server = _OwnServer(version, f"oncely_fault_{os.getpid()}", _closed_port())
    subprocess.run(
        [
            *("pg_createcluster", version, server.name, "-p", str(server.port), "--start"),
            *("--", "--auth=trust"),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    try:
        with psycopg.connect(server.admin_url, autocommit=True) as connection:
            connection.execute("CREATE ROLE oncely_app LOGIN")
            connection.execute("CREATE DATABASE oncely OWNER oncely_app")
        with PostgresStore(server.app_url) as store:
            store.migrate()
        yield server
    finally:
        subprocess.run(
            ["pg_dropcluster", "--stop", version, server.name], capture_output=True, timeout=120
        )


def _claim_when_reachable(store: PostgresStore, key: str, lease: timedelta) -> Any:
    def attempt() -> Any:
        try:
            return store.claim(key, "fp", lease=lease, ttl=TTL)
        except StoreUnavailableError:
            return None

    return eventually(attempt, timeout=30, interval=0.1)


@pytest.mark.slow
def test_leases_survive_a_server_restart(own_server: _OwnServer) -> None:
    """A lease taken before a restart is still held after it: claims see InProgress."""
    with PostgresStore(own_server.app_url, namespace=_name("rs"), pool_timeout=1) as store:
        owner = store.claim("k", "fp", lease=LEASE, ttl=TTL)
        assert isinstance(owner, Acquired)
        own_server.ctl("restart")
        assert isinstance(_claim_when_reachable(store, "k", LEASE), InProgress)
        assert isinstance(asyncio.run(store.aclaim("k", "fp", lease=LEASE, ttl=TTL)), InProgress)
        assert store.complete("k", owner.token, b"done", ttl=TTL) is None
        replay = store.claim("k", "fp", lease=LEASE, ttl=TTL)
        assert isinstance(replay, Replay)
        assert replay.record.result == b"done"


@pytest.mark.slow
def test_store_lost_until_after_complete_recovers_only_after_the_lease(
    own_server: _OwnServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store goes away mid-operation and complete gives up: the key is never executed again
    while the lease is live, and is recovered (executed once more) after it."""
    monkeypatch.setattr(_execution.flows, "SETTLE_RETRY_DELAYS", (0.01, 0.01))
    namespace = _name("outage")
    lease = timedelta(seconds=3)
    calls: list[str] = []
    app = _name("oncely_outage")

    def outage(admin: psycopg.Connection[Any]) -> None:
        admin.execute("ALTER ROLE oncely_app NOLOGIN")
        _terminate(admin, app)

    with psycopg.connect(own_server.admin_url, autocommit=True) as admin:
        worker = PostgresStore(
            own_server.app_url, namespace=namespace, pool_timeout=0.2, application_name=app
        )

        @oncely.idempotent(store=worker, key="order_id", lease=lease, heartbeat=False, scope="o")
        def charge(order_id: str) -> str:
            calls.append(order_id)
            outage(admin)
            return "charged"

        try:
            with pytest.raises(StoreUnavailableError):
                charge("o-1")
        finally:
            admin.execute("ALTER ROLE oncely_app LOGIN")
            worker.close()
        assert calls == ["o-1"]

    with PostgresStore(own_server.app_url, namespace=namespace) as store:

        @oncely.idempotent(store=store, key="order_id", lease=lease, heartbeat=False, scope="o")
        def retry(order_id: str) -> str:
            calls.append(order_id)
            return "charged again"

        with pytest.raises(InProgressError):
            retry("o-1")
        assert calls == ["o-1"]
        assert eventually(lambda: _retry_after_lease(retry), timeout=10) == "charged again"
        assert calls == ["o-1", "o-1"]


def _retry_after_lease(call: Callable[[str], str]) -> str | None:
    try:
        return call("o-1")
    except InProgressError:
        return None


# -- batch verbs ------------------------------------------------------------------------------


class _Batches:
    """claim_many and complete_many in one world, sync or async, as plain calls."""

    def __init__(self, store: PostgresStore, world: str) -> None:
        self.store = store
        self.loop = asyncio.new_event_loop() if world == "async" else None

    def claim_many(self, requests: list[tuple[str, str]], lease: timedelta = LEASE) -> list[Any]:
        if self.loop is None:
            return list(self.store.claim_many(requests, lease=lease, ttl=TTL))
        return list(
            self.loop.run_until_complete(self.store.aclaim_many(requests, lease=lease, ttl=TTL))
        )

    def complete_many(self, items: list[tuple[str, int, bytes]]) -> list[Any]:
        if self.loop is None:
            return list(self.store.complete_many(items, ttl=TTL))
        return list(self.loop.run_until_complete(self.store.acomplete_many(items, ttl=TTL)))

    def close(self) -> None:
        if self.loop is not None:
            # As asyncio.run ends a loop: the loop's pool closes with it, the store stays open.
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()


@contextlib.contextmanager
def _batches(store: PostgresStore, world: str) -> Iterator[_Batches]:
    calls = _Batches(store, world)
    try:
        yield calls
    finally:
        calls.close()


@pytest.mark.parametrize("world", ["sync", "async"])
def test_each_batch_is_one_round_trip(
    counted_store: PostgresStore, counter: _ProtocolCounter, world: str
) -> None:
    """A batch of 50 claims or completions is one round trip: the client sends every
    statement, then one Sync (one transaction), and only then waits (a Flush may follow the
    Sync). The statement is prepared once, in that same trip; an empty batch sends nothing."""
    keys = [f"b{index:02}" for index in range(50)]
    with _batches(counted_store, world) as batches:

        def cost(call: Callable[[], Any]) -> tuple[Any, int, int]:
            mark = len(counter.sent)
            answer = call()
            sent = counter.sent_since(mark)
            if sent:
                assert sent.rstrip("H").endswith("S"), f"the client waited before its Sync: {sent}"
            return answer, sent.count("S") + sent.count("Q"), sent.count("P")

        counted_store.get("warm-up")  # connect first: the pool's own set-up is not counted
        assert cost(lambda: batches.claim_many([]))[1:] == (0, 0)
        assert cost(lambda: batches.complete_many([]))[1:] == (0, 0)
        claimed, *claim_cost = cost(lambda: batches.claim_many([(key, "fp") for key in keys]))
        assert claimed == [Acquired(1, recovered=False, attempt=1)] * 50
        assert claim_cost == [1, 1]
        items = [(key, 1, key.encode()) for key in keys]
        completed, *complete_cost = cost(lambda: batches.complete_many(items))
        assert completed == [None] * 50
        assert complete_cost == [1, 1]
        replays, *replay_cost = cost(lambda: batches.claim_many([(key, "fp") for key in keys]))
        assert [answer.record.result for answer in replays] == [key.encode() for key in keys]
        assert replay_cost == [1, 0]
        lost, *lost_cost = cost(lambda: batches.complete_many(items))
        assert lost == [LeaseLost()] * 50
        assert lost_cost == [1, 0]


@pytest.mark.parametrize("world", ["sync", "async"])
def test_batch_answers_a_corrupt_record_in_its_slot_only(
    store: PostgresStore, schema: str, admin: psycopg.Connection[Any], world: str
) -> None:
    """A corrupt record in the middle of a batch: CorruptRecordError in its slot, the other
    items answered (and their claims kept); the record itself is never overwritten."""
    stored = f"{store.namespace}:m"
    admin.execute(
        f"INSERT INTO {_table(schema)} VALUES (%s, 'archived', 'fp', 7, 1, now(), "
        "now() + interval '1 hour', now(), now(), 'x')",
        (stored,),
    )
    with _batches(store, world) as batches:
        first, corrupt, last = batches.claim_many([("a", "fp"), ("m", "fp"), ("z", "fp")])
        assert first == last == Acquired(1, recovered=False, attempt=1)
        assert isinstance(corrupt, CorruptRecordError)
        assert corrupt.key == "m"
        assert batches.complete_many([("a", 1, b"ra"), ("m", 7, b"rm"), ("z", 1, b"rz")]) == [
            None,
            LeaseLost(),  # as `complete` answers a record it cannot take
            None,
        ]
    row = admin.execute(
        f"SELECT status, token, result FROM {_table(schema)} WHERE key = %s", (stored,)
    ).fetchone()
    assert row == ("archived", 7, b"x")
    for key, result in (("a", b"ra"), ("z", b"rz")):
        record = store.get(key)
        assert record is not None
        assert (record.status, record.result) == (Status.COMPLETED, result)


@pytest.mark.parametrize("world", ["sync", "async"])
def test_batch_with_repeated_keys_answers_as_single_verbs(
    base_url: str, schema: str, world: str
) -> None:
    """Repeated keys in one batch: each item answers what the single verb would, in order."""
    requests = [("k", "fp"), ("j", "fp"), ("k", "fp"), ("k", "fp-2"), ("j", "fp-2"), ("a", "fp")]
    with (
        PostgresStore(base_url, schema=schema, namespace=_name("one")) as singles,
        PostgresStore(base_url, schema=schema, namespace=_name("many")) as batched,
        _batches(batched, world) as batches,
    ):
        expected = [singles.claim(key, fp, lease=LEASE, ttl=TTL) for key, fp in requests]
        answers = batches.claim_many(requests)
        assert [type(answer) for answer in answers] == [type(answer) for answer in expected]
        assert [a for a in answers if not isinstance(a, InProgress)] == [
            e for e in expected if not isinstance(e, InProgress)
        ]
        items = [("k", 1, b"first"), ("j", 2, b"stale"), ("k", 1, b"second"), ("j", 1, b"j")]
        settled = [singles.complete(key, token, result, ttl=TTL) for key, token, result in items]
        assert batches.complete_many(items) == settled == [None, LeaseLost(), LeaseLost(), None]
        replays = batches.claim_many([("k", "fp"), ("j", "fp")])
        assert [answer.record.result for answer in replays] == [b"first", b"j"]


def _batch_stuck_behind(
    admin: psycopg.Connection[Any], schema: str, stored: str, app: str
) -> psycopg.Connection[Any]:
    """A session holding an uncommitted insert of *stored*: a claim of it waits on the session."""
    blocker = psycopg.connect(service_url("ONCELY_TEST_POSTGRES_URL"))
    blocker.execute(
        f"INSERT INTO {_table(schema)} VALUES (%s, 'completed', 'fp', 1, 1, now(), "
        "now() + interval '1 hour', now(), now(), NULL)",
        (stored,),
    )
    return blocker


def _waiting_on_a_lock(admin: psycopg.Connection[Any], app: str) -> list[int]:
    rows = admin.execute(
        "SELECT pid FROM pg_stat_activity WHERE application_name = %s AND wait_event_type = 'Lock'",
        (app,),
    ).fetchall()
    return [row[0] for row in rows]


@pytest.mark.parametrize("world", ["sync", "async"])
def test_batch_whose_session_is_killed_raises_and_takes_nothing(
    store: PostgresStore,
    schema: str,
    admin: psycopg.Connection[Any],
    app: str,
    world: str,
) -> None:
    """The session dies in the middle of a batch, and so does the one that re-sends it:
    StoreUnavailableError, and no item of it took effect (one transaction); the next batch runs
    on a new session."""
    blocker = _batch_stuck_behind(admin, schema, f"{store.namespace}:m", app)
    requests = [("z", "fp"), ("a", "fp"), ("m", "fp"), ("b", "fp")]
    try:
        with _batches(store, world) as batches, ThreadPoolExecutor(max_workers=1) as pool:
            running = pool.submit(batches.claim_many, requests)
            killed: set[int] = set()
            for _ in range(2):  # the batch, then its re-send on a fresh session
                (waiting,) = eventually(
                    lambda: [pid for pid in _waiting_on_a_lock(admin, app) if pid not in killed]
                )
                admin.execute("SELECT pg_terminate_backend(%s)", (waiting,))
                killed.add(waiting)
            with pytest.raises(StoreUnavailableError) as info:
                running.result(timeout=30)
            assert isinstance(info.value.__cause__, psycopg.OperationalError)
            assert "a batch of 4 keys" in str(info.value)
            blocker.rollback()
            assert store.get("a") is None
            assert store.get("b") is None
            answers = batches.claim_many(requests)
            assert answers == [Acquired(1, recovered=False, attempt=1)] * 4
    finally:
        blocker.close()


@pytest.mark.parametrize("world", ["sync", "async"])
def test_batch_statement_timeout_raises_and_takes_nothing(
    base_url: str, schema: str, admin: psycopg.Connection[Any], app: str, world: str
) -> None:
    """A statement of the batch cancelled by the server: StoreUnavailableError for the call, and
    the items before it were rolled back with it."""
    with PostgresStore(
        base_url, schema=schema, namespace=_name("bt"), statement_timeout=0.3
    ) as store:
        blocker = _batch_stuck_behind(admin, schema, f"{store.namespace}:m", app)
        try:
            with _batches(store, world) as batches:
                with pytest.raises(StoreUnavailableError) as info:
                    batches.claim_many([("a", "fp"), ("m", "fp"), ("z", "fp")])
                assert isinstance(info.value.__cause__, psycopg.errors.QueryCanceled)
                assert store.get("a") is None
                blocker.rollback()
                assert (
                    batches.claim_many([("a", "fp"), ("m", "fp"), ("z", "fp")])
                    == [Acquired(1, recovered=False, attempt=1)] * 3
                )
        finally:
            blocker.close()


@pytest.mark.parametrize("world", ["sync", "async"])
def test_batch_failures_of_the_whole_call_are_typed(
    base_url: str, fresh_schema: str, world: str
) -> None:
    """Nothing listening: StoreUnavailableError; no schema: SchemaMissingError. Both raise."""
    unreachable = PostgresStore(
        f"postgresql://postgres@127.0.0.1:{_closed_port()}/test", pool_timeout=0.5
    )
    with _batches(unreachable, world) as batches:
        with pytest.raises(StoreUnavailableError):
            batches.claim_many([("a", "fp"), ("b", "fp")])
        with pytest.raises(StoreUnavailableError):
            batches.complete_many([("a", 1, b"r")])
    with PostgresStore(base_url, schema=fresh_schema) as store, _batches(store, world) as batches:
        with pytest.raises(SchemaMissingError, match=r"migrate\(\)"):
            batches.claim_many([("a", "fp"), ("b", "fp")])
        with pytest.raises(SchemaMissingError):
            batches.complete_many([("a", 1, b"r")])


def test_overlapping_batches_in_opposite_orders_never_deadlock(
    wide_store: PostgresStore,
) -> None:
    """8 threads claim batches of 50 of the same 100 keys at once, windows overlapping and in
    opposite orders: no batch deadlocks or fails, and each key is acquired exactly once."""
    racers = 8
    for round_ in range(5):
        keys = [f"r{round_}-{index:03}" for index in range(100)]
        barrier = threading.Barrier(racers)

        def claim(racer: int, keys: list[str] = keys, barrier: Any = barrier) -> list[Any]:
            window = [keys[(racer * 13 + index) % len(keys)] for index in range(50)]
            if racer % 2:
                window.reverse()
            barrier.wait(timeout=30)
            answers = wide_store.claim_many([(key, "fp") for key in window], lease=LEASE, ttl=TTL)
            return list(zip(window, answers, strict=True))

        with ThreadPoolExecutor(max_workers=racers) as pool:
            results = [pair for batch in pool.map(claim, range(racers)) for pair in batch]
        winners = [key for key, answer in results if isinstance(answer, Acquired)]
        assert all(isinstance(answer, (Acquired, InProgress)) for _, answer in results)
        assert sorted(winners) == sorted({key for key, _ in results})


@pytest.mark.parametrize("world", ["sync", "async"])
def test_batch_without_pipeline_mode_answers_the_same(
    store: PostgresStore, world: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a libpq older than 14 (no pipeline mode) a batch is one transaction all the same."""
    monkeypatch.setattr(postgres_store, "_PIPELINE", False)
    with _batches(store, world) as batches:
        answers = batches.claim_many([("b", "fp"), ("a", "fp"), ("b", "fp")])
        assert answers[:2] == [Acquired(1, recovered=False, attempt=1)] * 2
        assert isinstance(answers[2], InProgress)
        assert batches.complete_many([("a", 1, b"r"), ("a", 1, b"r")]) == [None, LeaseLost()]


# -- lost replies ---------------------------------------------------------------------------------

_READY_FOR_QUERY = b"Z\x00\x00\x00\x05"
"""The end of every reply: the statement (or the batch's transaction) has committed."""


@pytest.mark.parametrize("verb", VERBS)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_resent_transition_answers_as_the_first_send(
    base_url: str, schema: str, app: str, mode: str, verb: str
) -> None:
    """The statement commits, then the connection dies before its reply: the store sends it
    again on a new connection, and the answer is the one the lost reply carried (Acquired for
    its own claim, done for its own settle), never InProgress or LeaseLost."""
    host = psycopg.conninfo.conninfo_to_dict(base_url)
    with Proxy(int(host.get("port") or 5432)) as cutter:
        conninfo = psycopg.conninfo.make_conninfo(base_url, host="127.0.0.1", port=cutter.port)
        with PostgresStore(
            conninfo, schema=schema, namespace=_name("ns"), application_name=app
        ) as store:
            api = StoreCalls(store, mode)
            try:
                assert_lost_reply_is_recognised(
                    api, cutter, verb, _name("key"), until=_READY_FOR_QUERY
                )
            finally:
                api.close()


def test_migrate_upgrades_a_version_1_schema(
    base_url: str, fresh_schema: str, admin: psycopg.Connection[Any]
) -> None:
    """A schema of version 1 (no op column, the 4-argument claim function) keeps its records
    through migrate(); until then the store says the schema is out of date."""
    table = _table(fresh_schema)
    with PostgresStore(base_url, schema=fresh_schema) as store:
        store.migrate()
        taken = store.claim("old", "fp", lease=LEASE, ttl=TTL)
        assert isinstance(taken, Acquired)
        # Back to version 1's shape, with the record in it.
        admin.execute(f"ALTER TABLE {table} DROP COLUMN op")
        admin.execute(
            f'DROP FUNCTION "{fresh_schema}".oncely_claim(text, text, bigint, bigint, text)'
        )
        admin.execute(f'UPDATE "{fresh_schema}".oncely_schema SET version = 1')
        with pytest.raises(SchemaMissingError):
            store.claim("new", "fp", lease=LEASE, ttl=TTL)
        store.migrate()
        version = admin.execute(f'SELECT version FROM "{fresh_schema}".oncely_schema').fetchone()
        assert version == (_sql.SCHEMA_VERSION,) == (3,)
        assert store.complete("old", taken.token, b"kept", ttl=TTL) is None
        replay = store.claim("old", "fp", lease=LEASE, ttl=TTL)
        assert isinstance(replay, Replay)
        assert replay.record.result == b"kept"
        assert isinstance(store.claim("new", "fp", lease=LEASE, ttl=TTL), Acquired)


def test_concurrent_async_extends_share_round_trips(base_url: str, schema: str, app: str) -> None:
    """Heartbeats of many leases beat together: their extends go to the server in batches,
    over at most two connections of the loop's pool. Over a slow network the pool does not grow
    a connection per lease while the extends queue for one (each new connection costs round
    trips through that network, and each extend on it another to prepare): the extends that
    waited let their leases lapse while the store answered within a quarter of the lease."""
    host = psycopg.conninfo.conninfo_to_dict(base_url)
    namespace = _name("ns")
    keys = [f"k{index}" for index in range(8)]
    with PostgresStore(base_url, schema=schema, namespace=namespace) as direct:
        tokens = [direct.claim(key, "fp", lease=LEASE, ttl=TTL).token for key in keys]
        with Proxy(int(host.get("port") or 5432)) as proxy:
            conninfo = psycopg.conninfo.make_conninfo(base_url, host="127.0.0.1", port=proxy.port)
            store = PostgresStore(
                conninfo, schema=schema, namespace=namespace, application_name=app
            )

            async def main() -> list[Any]:
                assert await store.aget("absent") is None  # the pool is open: one connection
                opened = proxy.accepted
                proxy.latency = 0.3
                answers = await asyncio.gather(
                    *(
                        store.aextend(key, token, lease=LEASE)
                        for key, token in zip(keys, tokens, strict=True)
                    )
                )
                await store.aclose()
                return [answers, proxy.accepted - opened]

            answers, opened = asyncio.run(main())
            store.close()
        assert answers == [None] * len(keys)
        assert opened <= 1, f"{opened} connections opened for {len(keys)} concurrent extends"


_GONE = "Connection refused|server closed the connection unexpectedly"
"""The driver's reasons for a server that went away, as the store's error quotes them."""


@pytest.mark.parametrize("world", ["sync", "async"])
def test_a_server_lost_after_the_pool_opened_is_reported_with_its_reason_quietly(
    base_url: str, schema: str, caplog: pytest.LogCaptureFixture, world: str
) -> None:
    """The pool's background reconnections fail and are not logged; the call that fails says
    why: the reconnection refused, or, when the pool handed out a session the server had just
    cut before its check saw it, that session's end."""
    params = psycopg.conninfo.conninfo_to_dict(base_url)
    proxy = Proxy(int(params.get("port") or 5432), host=str(params.get("host") or "127.0.0.1"))
    conninfo = psycopg.conninfo.make_conninfo(base_url, host="127.0.0.1", port=proxy.port)
    with PostgresStore(conninfo, schema=schema, pool_timeout=1) as store:

        async def both() -> None:
            await store.aget("k")
            proxy.down(reset=False)  # the server is gone: sessions cut, new ones refused
            with pytest.raises(StoreUnavailableError, match=_GONE):
                await store.aget("k")

        with caplog.at_level(logging.INFO, logger="psycopg.pool"):
            if world == "async":
                asyncio.run(both())
            else:
                store.get("k")
                proxy.down(reset=False)
                with pytest.raises(StoreUnavailableError, match=_GONE):
                    store.get("k")
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


# -- connections kept between statements -----------------------------------------------------


def _sessions_that_claimed(admin: psycopg.Connection[Any], app: str) -> list[int]:
    rows = admin.execute(
        "SELECT pid FROM pg_stat_activity WHERE application_name = %s AND query LIKE %s",
        (app, "%oncely_records%"),
    ).fetchall()
    return [row[0] for row in rows]


@pytest.mark.parametrize("world", ["sync", "async"])
def test_a_sequential_caller_keeps_one_session(
    base_url: str, schema: str, admin: psycopg.Connection[Any], app: str, world: str
) -> None:
    """One caller's statements go to one server session, not to the pool's sessions in turn
    (each of which would then run with cold caches)."""
    with PostgresStore(
        base_url, schema=schema, namespace=_name("seq"), min_size=3, application_name=app
    ) as store:

        async def claims() -> None:
            await store.aget("warm-up")
            await asyncio.sleep(0.5)  # the pool opens its other sessions meanwhile
            for index in range(12):
                await store.aclaim(f"k{index}", "fp", lease=LEASE, ttl=TTL)
            assert len(_sessions_that_claimed(admin, app)) == 1
            await store.aclose()

        if world == "async":
            asyncio.run(claims())
        else:
            store.get("warm-up")
            eventually(lambda: len(_backends(admin, app)) >= 3)
            for index in range(12):
                store.claim(f"k{index}", "fp", lease=LEASE, ttl=TTL)
            assert len(_sessions_that_claimed(admin, app)) == 1


def test_threads_share_a_one_connection_pool(base_url: str, schema: str) -> None:
    """A kept connection never starves a caller waiting for the pool: with one connection
    and many threads, every call is served well within the pool timeout."""
    with PostgresStore(
        base_url, schema=schema, namespace=_name("one"), max_size=1, pool_timeout=5
    ) as store:

        def calls(thread: int) -> float:
            started = time.monotonic()
            for index in range(20):
                store.claim(f"t{thread}-{index}", "fp", lease=LEASE, ttl=TTL)
            return time.monotonic() - started

        with ThreadPoolExecutor(max_workers=8) as threads:
            durations = list(threads.map(calls, range(8)))
    assert max(durations) < 4


def test_a_direct_user_of_the_loop_pool_gets_the_kept_connection(
    base_url: str, schema: str
) -> None:
    """Code that takes connections from the store's loop pool itself (the outbox relay) is not
    kept waiting by a connection the verbs keep between statements."""
    with PostgresStore(
        base_url, schema=schema, namespace=_name("direct"), max_size=1, pool_timeout=2
    ) as store:

        async def main() -> None:
            await store.aclaim("k", "fp", lease=LEASE, ttl=TTL)
            pool = await store._async_pool()
            async with pool.connection(timeout=1) as connection:
                await connection.execute("SELECT 1")
            assert isinstance(await store.aclaim("k", "fp", lease=LEASE, ttl=TTL), InProgress)
            await store.aclose()

        asyncio.run(main())


def test_a_call_that_ends_after_close_leaves_no_session(
    base_url: str, schema: str, admin: psycopg.Connection[Any], app: str
) -> None:
    """A statement still running when another thread closes the store does not keep its
    connection: the session ends once the statement does."""
    store = PostgresStore(base_url, schema=schema, application_name=app)
    store.get("warm-up")
    slow = threading.Thread(target=store._execute, args=(_sql.Statement("SELECT pg_sleep(1)", ()),))
    slow.start()
    eventually(
        lambda: admin.execute(
            "SELECT 1 FROM pg_stat_activity WHERE application_name = %s AND query LIKE %s",
            (app, "%pg_sleep%"),
        ).fetchone()
    )
    store.close()
    slow.join(timeout=10)
    eventually(lambda: not _backends(admin, app), timeout=10)


# -- cancelled callers ------------------------------------------------------------------------


@pytest.mark.parametrize("cut", ["claim", "complete"])
def test_a_caller_cancelled_mid_statement_leaves_the_key_settled(
    base_url: str, schema: str, cut: str
) -> None:
    """The store's own answer to a cancelled caller (no shielding task around its verbs): a
    claim in flight is given back, so the retry runs at once; a completion in flight lands, so
    the retry replays."""
    port = int(psycopg.conninfo.conninfo_to_dict(base_url).get("port") or 5432)
    runs: list[str] = []
    with Proxy(port) as proxy:
        conninfo = psycopg.conninfo.make_conninfo(base_url, host="127.0.0.1", port=proxy.port)
        store = PostgresStore(conninfo, schema=schema, namespace=_name("cancel"))

        @oncely.idempotent(store=store, key="payment_id", lease=LEASE)
        async def charge(payment_id: str) -> str:
            runs.append(payment_id)
            if cut == "complete":
                proxy.latency = 0.4  # the completion is in flight when the caller gives up
            return "charged"

        async def main() -> Any:
            await store.aget("warm-up")
            if cut == "claim":
                proxy.latency = 0.4
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(charge("p-1"), 0.2)
            proxy.latency = 0
            answer = await charge("p-1")
            await store.aclose()
            return answer

        try:
            assert asyncio.run(main()) == "charged"
        finally:
            store.close()
    assert runs == ["p-1"]
