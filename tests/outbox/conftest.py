"""Databases for the outbox tests: a fresh PostgreSQL schema or SQLite file per test."""

from __future__ import annotations

import contextlib
import sqlite3
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

import oncely
from tests.conftest import service_url


class Db:
    """One migrated database: its store URL, and the application's own connections to it."""

    def __init__(self, kind: str, url: str, *, base: str = "", schema: str = "", path: str = ""):
        self.kind = kind
        self.url = url
        self.base = base
        self.schema = schema
        self.path = path
        self.table = f'"{schema}".oncely_outbox' if kind == "postgres" else "oncely_outbox"

    def store(self) -> Any:
        return oncely.open_store(self.url)

    def connect(self) -> Any:
        if self.kind == "postgres":
            return psycopg.connect(self.base, autocommit=True)
        return sqlite3.connect(self.path, isolation_level=None, timeout=30)

    @contextlib.contextmanager
    def transaction(self, connection: Any = None) -> Iterator[Any]:
        """The application's transaction: committed at the end, rolled back on an exception."""
        own = connection is None
        connection = connection or self.connect()
        try:
            if self.kind == "postgres":
                with connection.transaction():
                    yield connection
            else:
                connection.execute("BEGIN IMMEDIATE")
                try:
                    yield connection
                except BaseException:
                    connection.execute("ROLLBACK")
                    raise
                connection.execute("COMMIT")
        finally:
            if own:
                connection.close()

    def query(self, sql: str) -> list[tuple[Any, ...]]:
        """Run *sql* (``{table}`` is the outbox) and return its rows."""
        with contextlib.closing(self.connect()) as connection:
            return list(connection.execute(sql.format(table=self.table)).fetchall())

    def execute(self, sql: str) -> None:
        with contextlib.closing(self.connect()) as connection:
            connection.execute(sql.format(table=self.table))

    def states(self) -> dict[str, tuple[bool, bool, int, str | None]]:
        """message id → (published, dead, attempts, last_error)."""
        rows = self.query(
            "SELECT message_id, published_at IS NOT NULL, dead_at IS NOT NULL, attempts, "
            "last_error FROM {table}"
            if self.kind == "postgres"
            else "SELECT message_id, published_at_ms IS NOT NULL, dead_at_ms IS NOT NULL, "
            "attempts, last_error FROM {table}"
        )
        return {row[0]: (bool(row[1]), bool(row[2]), row[3], row[4]) for row in rows}


def _postgres() -> Iterator[Db]:
    base = service_url("ONCELY_TEST_POSTGRES_URL")
    schema = f"oncely_outbox_{uuid.uuid4().hex[:10]}"
    url = f"{base}{'&' if '?' in base else '?'}schema={schema}"
    with oncely.open_store(url) as store:
        store.migrate()  # type: ignore[attr-defined]
    try:
        yield Db("postgres", url, base=base, schema=schema)
    finally:
        with psycopg.connect(base, autocommit=True) as connection:
            connection.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def _sqlite(tmp_path: Path) -> Iterator[Db]:
    path = tmp_path / "app.db"
    with oncely.open_store(f"sqlite:///{path}"):  # creates the tables
        pass
    yield Db("sqlite", f"sqlite:///{path}", path=str(path))


@pytest.fixture(params=["postgres", "sqlite"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Db]:
    """Each database the outbox supports, migrated and empty."""
    yield from _postgres() if request.param == "postgres" else _sqlite(tmp_path)


@pytest.fixture
def pg() -> Iterator[Db]:
    """A PostgreSQL schema of the test's own."""
    yield from _postgres()


@pytest.fixture
def lite(tmp_path: Path) -> Iterator[Db]:
    """A SQLite database file of the test's own."""
    yield from _sqlite(tmp_path)
