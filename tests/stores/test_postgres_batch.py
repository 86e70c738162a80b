"""PostgreSQL's batch verbs as one set-based statement each: every item answered as its own
single verb would answer it, whatever the mix of verdicts in the batch."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from oncely import Acquired, InProgress, LeaseLost, Replay
from oncely.stores.postgres import PostgresStore
from tests.conftest import service_url

LEASE = timedelta(seconds=30)
TTL = timedelta(hours=1)

KEYS = ("new", "done", "other", "held", "lapsed", "released", "expired")

REQUESTS = [
    ("new", "fp"),
    ("done", "fp"),
    ("other", "fp"),
    ("held", "fp"),
    ("lapsed", "fp"),
    ("released", "fp"),
    ("expired", "fp"),
    ("new", "fp"),  # a key the batch itself claimed a moment before
    ("lapsed", "fp"),  # a lease the batch itself recovered
    ("done", "fp-2"),  # a mismatch on a replay
    ("fresh", "fp"),
    ("fresh", "fp-2"),  # a mismatch on the batch's own lease
]
"""A claim batch with every verdict, and keys repeated inside it."""


def _name(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def base_url() -> str:
    return service_url("ONCELY_TEST_POSTGRES_URL")


@pytest.fixture(scope="module")
def admin(base_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(base_url, autocommit=True) as connection:
        yield connection


@pytest.fixture(scope="module")
def schema(base_url: str, admin: psycopg.Connection[Any]) -> Iterator[str]:
    name = _name("oncely_pgb")
    with PostgresStore(base_url, schema=name) as store:
        store.migrate()
    yield name
    admin.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


def _prepare(store: PostgresStore, admin: psycopg.Connection[Any], schema: str) -> None:
    """Give *store* one record in each state of `KEYS` (none for ``new``)."""
    table = f'"{schema}".oncely_records'
    for key in KEYS[1:]:
        fingerprint = "fp-x" if key == "other" else "fp"
        store.claim(key, fingerprint, lease=LEASE, ttl=TTL)
    store.complete("done", 1, b"done", ttl=TTL)
    store.complete("expired", 1, b"old", ttl=TTL)
    store.release("released", 1)
    stored = f"{store.namespace}:"
    # Moved into the past on the server, as time passing would: no waiting in the test.
    admin.execute(
        f"UPDATE {table} SET lease_expires_at = now() - interval '1 second' WHERE key = %s",
        (stored + "lapsed",),
    )
    admin.execute(
        f"UPDATE {table} SET expires_at = now() - interval '1 second' WHERE key = %s",
        (stored + "expired",),
    )


def _verdict(answer: Any) -> Any:
    """What an answer says, without the times that move between two runs."""
    if isinstance(answer, Replay):
        record = answer.record
        return ("replay", record.status, record.token, record.attempt, record.result)
    if isinstance(answer, InProgress):
        return "in_progress"
    return answer


def _same(answers: list[Any], expected: list[Any]) -> None:
    assert [_verdict(answer) for answer in answers] == [_verdict(each) for each in expected]


@pytest.mark.parametrize(
    ("world", "driver"), [("sync", "psycopg"), ("async", "psycopg"), ("async", "asyncpg")]
)
def test_batch_of_every_verdict_answers_as_single_verbs(
    base_url: str, admin: psycopg.Connection[Any], schema: str, world: str, driver: str
) -> None:
    """One batch holding a new key, a replay, a mismatch, a live lease, a lapsed one, a
    tombstone, an expired record and repeats of keys (of the batch's own claims too): each
    item answers what `claim` answers for it, in order; then completions with leases held and
    lost, and extends, answer as `complete` and `extend` do."""
    with (
        PostgresStore(base_url, schema=schema, namespace=_name("one")) as singles,
        PostgresStore(
            base_url, schema=schema, namespace=_name("many"), async_driver=driver
        ) as batched,
    ):
        for each in (singles, batched):
            _prepare(each, admin, schema)
        expected = [singles.claim(key, fp, lease=LEASE, ttl=TTL) for key, fp in REQUESTS]
        if world == "sync":
            answers = batched.claim_many(REQUESTS, lease=LEASE, ttl=TTL)
        else:
            answers = asyncio.run(batched.aclaim_many(REQUESTS, lease=LEASE, ttl=TTL))
        _same(answers, expected)
        assert answers[0] == Acquired(1, recovered=False, attempt=1)
        assert isinstance(answers[7], InProgress)
        assert answers[4] == Acquired(2, recovered=True, attempt=2)
        # Distinct keys: one statement; tokens held, stale and of records already finished.
        items = [
            ("new", 1, b"n"),
            ("lapsed", 1, b"stale"),
            ("released", 2, b"r"),
            ("held", 1, b"h"),
            ("done", 1, b"again"),
            ("missing", 1, b"m"),
        ]
        settled = [singles.complete(key, token, result, ttl=TTL) for key, token, result in items]
        if world == "sync":
            completed = batched.complete_many(items, ttl=TTL)
        else:
            completed = asyncio.run(batched.acomplete_many(items, ttl=TTL))
        assert completed == settled == [None, LeaseLost(), None, None, LeaseLost(), LeaseLost()]
        records = [batched.get(key) for key, _, _ in items[:4]]
        assert [record.result if record else None for record in records] == [
            b"n",
            None,
            b"r",
            b"h",
        ]


@pytest.mark.parametrize("driver", ["psycopg", "asyncpg"])
def test_extends_of_distinct_keys_are_one_statement(
    base_url: str, schema: str, driver: str
) -> None:
    """Extends grouped over distinct keys: the leases held move, a lost one answers LeaseLost."""

    async def scenario(store: PostgresStore) -> list[Any]:
        for key in ("a", "b", "c"):
            await store.aclaim(key, "fp", lease=timedelta(seconds=5), ttl=TTL)
        items = [("c", 1), ("a", 1), ("b", 9)]
        return await store._aextend_many(items, lease=timedelta(minutes=10))

    with PostgresStore(
        base_url, schema=schema, namespace=_name("ext"), async_driver=driver
    ) as store:
        assert asyncio.run(scenario(store)) == [None, None, LeaseLost()]
        records = [store.get(key) for key in ("a", "b", "c")]
        a, b, c = (record.lease_expires_at_ms for record in records if record is not None)
        assert a - b > 60_000
        assert c - b > 60_000
