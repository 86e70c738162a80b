"""The conformance suite against a real PostgreSQL server, sync and async."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest

from oncely.stores.postgres import PostgresStore
from oncely.testing import StoreConformance
from tests.conftest import service_url

pytestmark = pytest.mark.postgres


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A store URL with a schema of this session's own, migrated once and dropped at the end."""
    base = service_url("ONCELY_TEST_POSTGRES_URL")
    schema = f"oncely_conf_{uuid.uuid4().hex[:10]}"
    separator = "&" if "?" in base else "?"
    url = f"{base}{separator}schema={schema}&application_name=oncely_conformance"
    with PostgresStore.from_url(url) as store:
        store.migrate()
    yield url
    with psycopg.connect(base, autocommit=True) as connection:
        connection.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


class TestPostgresStore(StoreConformance):
    controls_clock = False
    preload = ("psycopg", "psycopg_pool", "oncely.stores.postgres")

    @pytest.fixture(autouse=True)
    def _server(self, postgres_url: str) -> None:
        self.url = postgres_url

    def store_url(self) -> str:
        return self.url


class TestPostgresStoreAsyncpg(TestPostgresStore):
    """The same suite with the async verbs on asyncpg (``async_driver=asyncpg``)."""

    preload = ("psycopg", "psycopg_pool", "asyncpg", "oncely.stores.postgres")

    def store_url(self) -> str:
        return f"{self.url}&async_driver=asyncpg"
