"""Versioned aggregates: optimistic locking in the caller's transaction, on real PostgreSQL and
SQLite, with concurrent writers in threads (each its own connection, as workers would be)."""

from __future__ import annotations

import asyncio
import random
import sqlite3
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

import oncely
from oncely.aggregates import VersionedTable
from oncely.inbox import Inbox
from tests.test_inbox import pg, pg_connect, pg_store, sqlite_connect, sqlite_path

__all__ = ["pg", "pg_store", "sqlite_path"]  # the inbox tests' fixtures, used here too

ACCOUNTS = """CREATE TABLE {name} (
    id text PRIMARY KEY, version integer NOT NULL, last_event_id text, balance integer NOT NULL
)"""


@pytest.fixture
def pg_accounts(pg: tuple[str, str]) -> str:
    """A fresh accounts table in the inbox tests' schema; its name."""
    name = f"accounts_{uuid.uuid4().hex[:8]}"
    with pg_connect(pg) as connection:
        connection.execute(ACCOUNTS.format(name=name))
        connection.execute(f"INSERT INTO {name} VALUES ('a', 0, NULL, 0)")
        connection.commit()
    return name


@pytest.fixture
def sqlite_accounts(sqlite_path: Path) -> str:
    with sqlite3.connect(sqlite_path) as connection:
        connection.execute(ACCOUNTS.format(name="accounts"))
        connection.execute("INSERT INTO accounts VALUES ('a', 0, NULL, 0)")
    return "accounts"


def deposit(amount: int) -> Callable[[dict[str, Any] | None], dict[str, int]]:
    return lambda row: {"balance": (row["balance"] if row else 0) + amount}


def deliveries(events: int, workers: int) -> list[list[tuple[str, int]]]:
    """Each event delivered twice, to two different workers, in shuffled orders."""
    rng = random.Random(7)
    share: list[list[tuple[str, int]]] = [[] for _ in range(workers)]
    for number in range(events):
        first, second = rng.sample(range(workers), 2)
        for worker in (first, second):
            share[worker].append((f"e-{number}", number + 1))
    for items in share:
        rng.shuffle(items)
    return share


def run_workers(
    share: list[list[tuple[str, int]]],
    deliver: Callable[[Any, str, int], None],
    connect: Callable[[], Any],
) -> None:
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(share))

    def worker(items: list[tuple[str, int]]) -> None:
        try:
            with connect() as connection:
                barrier.wait()
                for event, amount in items:
                    deliver(connection, event, amount)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(items,)) for items in share]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors


# -- PostgreSQL -----------------------------------------------------------------------------------


@pytest.mark.postgres
def test_postgres_concurrent_writers_lose_no_update_and_apply_each_event_once(
    pg: tuple[str, str], pg_store: Any, pg_accounts: str
) -> None:
    """Four workers, twenty events each delivered twice: every event's deposit lands once."""
    table = VersionedTable(pg_accounts)
    inbox = Inbox(pg_store, wait_timeout=30)

    def deliver(connection: psycopg.Connection[Any], event: str, amount: int) -> None:
        while True:  # a transaction that ran out of conflict retries is retried whole
            try:
                with (
                    connection.transaction(),
                    inbox.claim(connection, event, scope=pg_accounts) as entry,
                ):
                    if not entry.replayed:
                        applied = table.apply(connection, "a", event, deposit(amount))
                        entry.complete(applied.version)
                return
            except oncely.VersionConflictError:
                continue

    run_workers(deliveries(20, 4), deliver, lambda: pg_connect(pg))
    with pg_connect(pg) as connection:
        row = connection.execute(f"SELECT version, balance FROM {pg_accounts}").fetchone()
    assert row == (20, sum(range(1, 21)))


@pytest.mark.postgres
def test_postgres_conflicts_are_retried_then_typed(pg: tuple[str, str], pg_accounts: str) -> None:
    with pg_connect(pg) as connection, connection.transaction():
        races = iter(range(2))

        def raced(row: dict[str, Any] | None) -> dict[str, int]:
            # Another writer moves the row on between this read and the update, once.
            if next(races, None) is not None and row is not None and row["version"] == 0:
                connection.execute(f"UPDATE {pg_accounts} SET version = 1, balance = 7")
            return deposit(5)(row)

        applied = VersionedTable(pg_accounts).apply(connection, "a", "e-1", raced)
        assert (applied.applied, applied.version, applied.attempts) == (True, 2, 2)
        assert applied.row["balance"] == 12  # recomputed from the row as it was then

        again = VersionedTable(pg_accounts).apply(connection, "a", "e-1", deposit(5))
        assert (again.applied, again.version) == (False, 2)  # the event applied last

        def always_raced(row: dict[str, Any] | None) -> dict[str, int]:
            connection.execute(f"UPDATE {pg_accounts} SET version = version + 1")
            return deposit(1)(row)

        with pytest.raises(oncely.VersionConflictError) as raised:
            VersionedTable(pg_accounts, retries=2).apply(connection, "a", "e-2", always_raced)
        assert (raised.value.expected, raised.value.actual) == (4, 5)
        assert isinstance(raised.value, oncely.ConflictError)
        with pytest.raises(oncely.VersionConflictError, match="not at version 1"):
            VersionedTable(pg_accounts).apply(
                connection, "a", "e-3", deposit(1), expected_version=1
            )


@pytest.mark.postgres
def test_postgres_new_row_async_and_sqlalchemy(pg: tuple[str, str], pg_accounts: str) -> None:
    sqlalchemy = pytest.importorskip("sqlalchemy")
    from sqlalchemy.orm import Session

    base, schema = pg
    table = VersionedTable(pg_accounts, schema=schema)

    async def open_account() -> oncely.aggregates.Applied:
        async with (
            await psycopg.AsyncConnection.connect(base) as connection,
            connection.transaction(),
        ):
            return await table.aapply(connection, "b", "e-open", deposit(3))

    created = asyncio.run(open_account())
    assert (created.applied, created.version, created.row["balance"]) == (True, 1, 3)
    engine = sqlalchemy.create_engine(base.replace("postgresql://", "postgresql+psycopg://", 1))
    with Session(engine) as session, session.begin():
        applied = table.apply(session, "b", "e-2", deposit(4))
    engine.dispose()
    assert (applied.version, applied.row["balance"]) == (2, 7)


# -- SQLite ---------------------------------------------------------------------------------------


def test_sqlite_concurrent_writers_lose_no_update_and_apply_each_event_once(
    sqlite_path: Path, sqlite_accounts: str
) -> None:
    store = oncely.open_store(f"sqlite:///{sqlite_path}")
    table = VersionedTable(sqlite_accounts)
    inbox = Inbox(store)

    def deliver(connection: sqlite3.Connection, event: str, amount: int) -> None:
        connection.execute("BEGIN IMMEDIATE")
        try:
            with inbox.claim(connection, event, scope="accounts") as entry:
                if not entry.replayed:
                    entry.complete(table.apply(connection, "a", event, deposit(amount)).version)
        except BaseException:
            connection.execute("ROLLBACK")
            raise
        connection.execute("COMMIT")

    run_workers(deliveries(20, 4), deliver, lambda: _closing(sqlite_connect(sqlite_path)))
    check = sqlite_connect(sqlite_path)
    assert check.execute("SELECT version, balance FROM accounts").fetchone() == (20, 210)
    store.close()


def test_sqlite_conflict_and_redelivery(sqlite_path: Path, sqlite_accounts: str) -> None:
    connection = sqlite_connect(sqlite_path)
    connection.row_factory = sqlite3.Row  # the helper reads plain rows whatever the factory
    connection.execute("BEGIN IMMEDIATE")
    moved = iter([True])

    def raced(row: dict[str, Any] | None) -> dict[str, int]:
        if next(moved, False):
            connection.execute("UPDATE accounts SET version = version + 1")
        return deposit(2)(row)

    table = VersionedTable(sqlite_accounts)
    assert table.apply(connection, "a", "e-1", raced).attempts == 2
    assert not table.apply(connection, "a", "e-1", deposit(2)).applied
    with pytest.raises(oncely.VersionConflictError):
        table.apply(connection, "a", "e-2", deposit(1), expected_version=0)
    assert table.apply(connection, "new", "e-1", deposit(9)).version == 1
    connection.execute("COMMIT")
    rows = connection.execute("SELECT id, version, balance FROM accounts ORDER BY id").fetchall()
    assert [tuple(row) for row in rows] == [("a", 2, 2), ("new", 1, 9)]


def test_bad_names_and_changes_are_configuration_errors(
    sqlite_path: Path, sqlite_accounts: str
) -> None:
    for bad in ({"table": "accounts; DROP"}, {"table": "t", "id_column": "a b"}):
        with pytest.raises(oncely.ConfigurationError, match="plain SQL name"):
            VersionedTable(**bad)
    with pytest.raises(oncely.ConfigurationError, match="retries"):
        VersionedTable("t", retries=-1)
    connection = sqlite_connect(sqlite_path)
    connection.execute("BEGIN IMMEDIATE")
    with pytest.raises(oncely.ConfigurationError, match="maintains itself"):
        VersionedTable(sqlite_accounts).apply(connection, "a", "e", lambda row: {"version": 9})
    connection.execute("ROLLBACK")


class _closing:
    """sqlite3 connections' ``with`` ends a transaction, not the connection: close it."""

    def __init__(self, connection: sqlite3.Connection) -> None:
        self.connection = connection

    def __enter__(self) -> sqlite3.Connection:
        return self.connection

    def __exit__(self, *exc: object) -> None:
        self.connection.close()
