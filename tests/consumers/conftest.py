"""Fixtures for the consumer tests: a Redis store, a PostgreSQL ledger of effects, names."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

import oncely
from oncely.stores.redis import RedisStore
from tests.conftest import service_url
from tests.consumers._effects import Ledger


@pytest.fixture
def name() -> str:
    """A unique name for this test's queue, stream, topic, subject and key namespace."""
    return f"oncely-t-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def redis_url() -> str:
    return service_url("ONCELY_TEST_REDIS_URL")


@pytest.fixture
def store(redis_url: str, name: str) -> Iterator[RedisStore]:
    """A Redis store in a namespace of its own, emptied afterwards."""
    made = oncely.open_store(redis_url, namespace=name)
    assert isinstance(made, RedisStore)
    yield made
    made.close()
    delete_namespace(redis_url, name)


def delete_namespace(redis_url: str, namespace: str) -> None:
    """Delete every record of *namespace* (never anything else) from the shared Redis."""
    import redis

    from oncely.stores.redis._codec import Keyspace

    client = redis.Redis.from_url(redis_url)
    try:
        names = list(client.scan_iter(match=Keyspace("oncely:", namespace).pattern(), count=500))
        if names:
            client.delete(*names)
    finally:
        client.close()


@pytest.fixture(params=["one-by-one", "batched"])
def any_store(request: pytest.FixtureRequest, store: RedisStore) -> Any:
    """The Redis store, seen without its batch verbs (one claim per message) or as it is
    (one claim per fetched batch, or per loop turn of concurrent deliveries)."""
    if request.param == "one-by-one":
        from tests.consumers._batching import SingleVerbs

        return SingleVerbs(store)
    return store


@pytest.fixture
def ledger(name: str) -> Iterator[Ledger]:
    """A PostgreSQL table of this test's own where handlers write their effect."""
    made = Ledger(service_url("ONCELY_TEST_POSTGRES_URL"), table=name.replace("-", "_"))
    made.create()
    yield made
    made.drop()
