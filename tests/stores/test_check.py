"""check() / acheck(): the readiness probe answers what it found or raises the typed error.

The conformance suite holds every store to the answers of a working store; these tests are the
failures: a missing or old schema, a refused role, an unreachable server, a closed store.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest

from oncely import (
    CheckableStore,
    ConfigurationError,
    SchemaMissingError,
    StoreError,
    StoreHealth,
    StoreUnavailableError,
)
from oncely.stores import open_store
from oncely.stores.memory import MemoryStore
from oncely.stores.postgres import PostgresStore, _sql
from oncely.stores.sqlite import SQLiteStore
from oncely.stores.tiered import TieredStore
from tests.conftest import service_url

NOTHING_LISTENS = 27599
"""A loopback port of this helper's range where no server runs: connections are refused."""


def _both(store: Any) -> list[Callable[[], StoreHealth]]:
    return [store.check, lambda: asyncio.run(store.acheck())]


@pytest.fixture
def postgres_admin() -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(service_url("ONCELY_TEST_POSTGRES_URL"), autocommit=True) as connection:
        yield connection


@pytest.fixture
def pg_schema(postgres_admin: psycopg.Connection[Any]) -> Iterator[str]:
    name = f"oncely_check_{uuid.uuid4().hex[:10]}"
    yield name
    postgres_admin.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


def test_every_built_in_store_is_checkable(tmp_path: Path) -> None:
    """The probe is part of every built-in store (the protocol itself stays optional)."""
    with SQLiteStore(str(tmp_path / "db")) as sqlite:
        for store in (MemoryStore(), sqlite, TieredStore(MemoryStore())):
            assert isinstance(store, CheckableStore)
    assert issubclass(PostgresStore, CheckableStore)


def _set_sqlite_schema(path: Path, sql: str) -> None:
    with contextlib.closing(sqlite3.connect(path)) as connection, connection:
        connection.execute(sql)


def test_sqlite_check_needs_the_schema(tmp_path: Path) -> None:
    """Migrated, the check answers 2; an older or missing schema fails it naming migrate."""
    path = tmp_path / "db"
    with SQLiteStore(str(path)) as store:
        for call in _both(store):
            assert call().schema_version == 2
        _set_sqlite_schema(path, "UPDATE oncely_schema SET version = 0")
        for call in _both(store):
            with pytest.raises(SchemaMissingError, match="older"):
                call()
        _set_sqlite_schema(path, "DROP TABLE oncely_schema")
        for call in _both(store):
            with pytest.raises(SchemaMissingError, match="migrate"):
                call()


@pytest.mark.postgres
def test_postgres_check_needs_the_schema_at_this_version(
    pg_schema: str, postgres_admin: psycopg.Connection[Any]
) -> None:
    """Missing schema, then an older version: SchemaMissingError; migrated (or newer): ready."""
    with PostgresStore(service_url("ONCELY_TEST_POSTGRES_URL"), schema=pg_schema) as store:
        for call in _both(store):
            with pytest.raises(SchemaMissingError, match="migrate"):
                call()
        store.migrate()
        for call in _both(store):
            health = call()
            assert (health.backend, health.schema_version) == ("postgres", _sql.SCHEMA_VERSION)
        table = f'"{pg_schema}".oncely_schema'
        postgres_admin.execute(f"UPDATE {table} SET version = %s", (_sql.SCHEMA_VERSION - 1,))
        for call in _both(store):
            with pytest.raises(SchemaMissingError, match="older"):
                call()
        # A rolling upgrade: newer workers migrated, this older one stays ready.
        postgres_admin.execute(f"UPDATE {table} SET version = %s", (_sql.SCHEMA_VERSION + 1,))
        for call in _both(store):
            assert call().schema_version == _sql.SCHEMA_VERSION + 1


@pytest.mark.postgres
def test_postgres_check_says_what_is_wrong(pg_schema: str) -> None:
    """A role the server does not know: ConfigurationError; nothing listening: unavailable."""
    base = psycopg.conninfo.conninfo_to_dict(service_url("ONCELY_TEST_POSTGRES_URL"))
    wrong_role = psycopg.conninfo.make_conninfo(**{**base, "user": "oncely_no_such_role_c"})
    with PostgresStore(wrong_role, schema=pg_schema, pool_timeout=30) as store:
        for call in _both(store):
            with pytest.raises(ConfigurationError, match="oncely_no_such_role_c"):
                call()
    nowhere = psycopg.conninfo.make_conninfo(
        **{**base, "host": "127.0.0.1", "port": str(NOTHING_LISTENS)}
    )
    with PostgresStore(nowhere, schema=pg_schema, pool_timeout=1) as store:
        for call in _both(store):
            with pytest.raises(StoreUnavailableError):
                call()


@pytest.mark.redis
def test_redis_check_pings_and_fails_typed() -> None:
    """A reachable Redis answers without a schema; nothing listening: StoreUnavailableError."""
    with open_store(service_url("ONCELY_TEST_REDIS_URL"), namespace="check") as store:
        for call in _both(store):
            health = call()
            assert (health.backend, health.schema_version) == ("redis", None)
    with open_store(f"redis://127.0.0.1:{NOTHING_LISTENS}/0", namespace="check") as store:
        for call in _both(store):
            with pytest.raises(StoreUnavailableError):
                call()


@pytest.mark.postgres
@pytest.mark.redis
def test_closed_stores_fail_the_check(tmp_path: Path, pg_schema: str) -> None:
    """A closed store is not ready: StoreError."""
    stores = [
        SQLiteStore(str(tmp_path / "db")),
        PostgresStore(service_url("ONCELY_TEST_POSTGRES_URL"), schema=pg_schema),
        open_store(service_url("ONCELY_TEST_REDIS_URL"), namespace="check"),
    ]
    for store in stores:
        store.close()
        for call in _both(store):
            with pytest.raises(StoreError, match="closed"):
                call()


def test_tiered_check_is_the_inner_stores(tmp_path: Path) -> None:
    """A tiered store answers its inner store's check, and fails it the same way."""
    with SQLiteStore(str(tmp_path / "db")) as inner:
        tiered = TieredStore(inner)
        for call in _both(tiered):
            health = call()
            assert (health.backend, health.schema_version) == ("tiered", 2)
        _set_sqlite_schema(tmp_path / "db", "DROP TABLE oncely_schema")
        for call in _both(tiered):
            with pytest.raises(SchemaMissingError):
                call()


class _Plain(MemoryStore):
    """A store of one's own without the optional probe."""

    check = None  # type: ignore[assignment]  # hides the inherited probe, as a store without it
    acheck = None  # type: ignore[assignment]  # (the same)


def test_tiered_check_over_a_store_without_one_is_a_store_error() -> None:
    """Over an inner store that has no check(), the tiered store says so."""
    tiered = TieredStore(_Plain())
    for call in _both(tiered):
        with pytest.raises(StoreError, match="no check"):
            call()


@pytest.mark.redis
def test_redis_refusing_the_client_is_not_reported_as_an_outage() -> None:
    """A user or password Redis refuses fails at once as a StoreError carrying the server's
    reason, never as StoreUnavailableError (a StoreError, not a ConfigurationError, because
    Redis authenticates every new connection: it can happen after a handler ran, where the
    callers expect store failures to be StoreErrors)."""
    parts = urlsplit(service_url("ONCELY_TEST_REDIS_URL"))
    host = parts.netloc.rpartition("@")[2]
    url = urlunsplit(parts._replace(netloc=f"oncely_nobody:x@{host}"))
    with open_store(url, namespace="check") as store:
        for call in [*_both(store), lambda: store.get("k")]:
            with pytest.raises(StoreError, match="refused") as info:
                call()
            assert not isinstance(info.value, StoreUnavailableError)
            assert "invalid username-password pair" in str(info.value)
