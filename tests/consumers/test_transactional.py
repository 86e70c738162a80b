"""`Inbox.transactional`: a consumer's writes and its message's record commit together.

Real PostgreSQL (psycopg sync and async, a pool) and SQLite (sqlite3 in a file); RabbitMQ for the
adapter; real processes SIGKILLed at the commit and between the commit and the ack.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

import oncely
from oncely import Status
from oncely.consumers import (
    Action,
    ConsumerPolicy,
    Delivery,
    IdempotentConsumer,
    Reason,
)
from oncely.errors import ConfigurationError, ResultUnavailableError
from oncely.inbox import Inbox, current_transaction
from oncely.testing import disabled
from tests._helpers import DJANGO_SQLITE
from tests.conftest import service_url

POLICY = ConsumerPolicy(
    lease=timedelta(seconds=1), ttl=timedelta(minutes=5), retry_delay=timedelta(milliseconds=50)
)


def delivery(key: str, body: Any = None) -> Delivery:
    return Delivery(json.dumps(body or {"key": key}).encode(), {"Idempotency-Key": key}, raw=key)


# -- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pg() -> Iterator[tuple[str, str]]:
    """(base URL, schema): a migrated schema of this module's own, with a charges table."""
    base = service_url("ONCELY_TEST_POSTGRES_URL")
    schema = f"oncely_txc_{uuid.uuid4().hex[:10]}"
    with oncely.open_store(schema_url(base, schema)) as store:
        store.migrate()  # type: ignore[attr-defined]
    with psycopg.connect(base, autocommit=True) as connection:
        connection.execute(f'CREATE TABLE "{schema}".charges (key text, worker text)')
    yield base, schema
    with psycopg.connect(base, autocommit=True) as connection:
        connection.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def schema_url(base: str, schema: str) -> str:
    return f"{base}{'&' if '?' in base else '?'}schema={schema}"


@pytest.fixture
def pg_store(pg: tuple[str, str]) -> Iterator[Any]:
    store = oncely.open_store(schema_url(*pg))
    yield store
    store.close()


@pytest.fixture
def scope() -> str:
    return f"billing-{uuid.uuid4().hex[:8]}"


def pg_connect(pg: tuple[str, str]) -> psycopg.Connection[Any]:
    connection = psycopg.connect(pg[0])
    connection.execute(f'SET search_path TO "{pg[1]}"')
    connection.commit()
    return connection


def pg_begin(pg: tuple[str, str]) -> Any:
    """A *begin* for psycopg: a new connection, committed on a clean exit."""

    @contextmanager
    def begin() -> Iterator[psycopg.Connection[Any]]:
        with pg_connect(pg) as connection:  # psycopg commits (or rolls back) on exit
            yield connection

    return begin


def charges(pg: tuple[str, str], prefix: str) -> list[str]:
    with pg_connect(pg) as connection:
        rows = connection.execute(
            "SELECT key FROM charges WHERE key LIKE %s ORDER BY key", (f"{prefix}%",)
        ).fetchall()
    return [row[0] for row in rows]


def handler_for(message: Delivery) -> Any:
    def handler() -> str:
        key = json.loads(message.body)["key"]
        current_transaction().execute("INSERT INTO charges (key) VALUES (%s)", (key,))
        return f"charged {key}"

    return handler


# -- PostgreSQL, the runner ------------------------------------------------------------------------


def test_the_write_and_the_record_commit_together(
    pg: tuple[str, str], pg_store: Any, scope: str
) -> None:
    inbox = Inbox(pg_store)
    consumer = IdempotentConsumer(pg_store, scope=scope, policy=POLICY)
    message = delivery(f"{scope}-1")
    run = inbox.transactional(pg_begin(pg))

    first = consumer.process(message, run(handler_for(message)))
    again = consumer.process(message, run(handler_for(message)))

    assert (first.action, first.reason, first.result) == (
        Action.ACK,
        Reason.PROCESSED,
        f"charged {scope}-1",
    )
    assert (again.action, again.reason) == (Action.ACK, Reason.DUPLICATE)
    assert again.result == f"charged {scope}-1"  # replayed from the record it committed
    assert charges(pg, scope) == [f"{scope}-1"]
    record = pg_store.get(consumer.key_for(message))
    assert record.status is Status.COMPLETED
    assert record.token == 1
    assert record.expires_at_ms - record.updated_at_ms == POLICY.ttl // timedelta(milliseconds=1)


def test_a_handler_that_raises_leaves_neither_write_nor_record(
    pg: tuple[str, str], pg_store: Any, scope: str
) -> None:
    inbox = Inbox(pg_store)
    consumer = IdempotentConsumer(pg_store, scope=scope, policy=POLICY)
    message = delivery(f"{scope}-1")
    calls = []

    @inbox.transactional(pg_begin(pg))
    def flaky() -> None:
        calls.append(1)
        current_transaction().execute("INSERT INTO charges (key) VALUES (%s)", (f"{scope}-1",))
        if len(calls) == 1:
            raise RuntimeError("the first attempt fails after its write")

    failed = consumer.process(message, flaky)
    assert (failed.action, failed.reason) == (Action.RETRY, Reason.HANDLER_FAILED)
    assert charges(pg, scope) == []  # rolled back with the transaction
    record = pg_store.get(consumer.key_for(message))
    assert record is None or record.status is not Status.COMPLETED  # released: a retry runs

    retried = consumer.process(message, flaky)
    assert (retried.action, retried.reason, retried.attempt) == (Action.ACK, Reason.PROCESSED, 2)
    assert charges(pg, scope) == [f"{scope}-1"]


def test_an_overtaken_worker_is_fenced_out_and_rolls_back(
    pg: tuple[str, str], pg_store: Any, scope: str
) -> None:
    """A's lease lapses mid-handler; B takes the message over and commits; A's completion finds
    its token fenced out, so A's write rolls back: one charge, whatever A did meanwhile."""
    policy = ConsumerPolicy(
        lease=timedelta(milliseconds=300), ttl=timedelta(minutes=5), heartbeat=False
    )
    inbox = Inbox(pg_store)
    consumer_a = IdempotentConsumer(pg_store, scope=scope, policy=policy)
    consumer_b = IdempotentConsumer(pg_store, scope=scope, policy=policy)
    message = delivery(f"{scope}-1")
    a_wrote, b_done = threading.Event(), threading.Event()

    @inbox.transactional(pg_begin(pg))
    def slow() -> str:
        current_transaction().execute("INSERT INTO charges VALUES (%s, 'a')", (f"{scope}-1",))
        a_wrote.set()
        assert b_done.wait(10)
        return "a"

    @inbox.transactional(pg_begin(pg))
    def fast() -> str:
        current_transaction().execute("INSERT INTO charges VALUES (%s, 'b')", (f"{scope}-1",))
        return "b"

    verdicts: list[Any] = []
    worker_a = threading.Thread(target=lambda: verdicts.append(consumer_a.process(message, slow)))
    worker_a.start()
    assert a_wrote.wait(10)
    deadline = 0
    while (b := consumer_b.process(message, fast)).reason is Reason.IN_PROGRESS:
        deadline += 1
        assert deadline < 200
        threading.Event().wait(0.05)
    b_done.set()
    worker_a.join(10)

    assert (b.action, b.reason) == (Action.ACK, Reason.PROCESSED)
    assert (verdicts[0].action, verdicts[0].reason) == (Action.RETRY, Reason.LEASE_LOST)
    with pg_connect(pg) as connection:
        rows = connection.execute("SELECT worker FROM charges WHERE key = %s", (f"{scope}-1",))
        assert [row[0] for row in rows] == ["b"]
    record = pg_store.get(consumer_a.key_for(message))
    assert record.status is Status.COMPLETED
    assert record.token == 2
    again = consumer_a.process(message, slow)  # A's message, redelivered
    assert (again.action, again.reason) == (Action.ACK, Reason.DUPLICATE)


def test_a_fetched_batch_completes_each_message_in_its_own_transaction(
    pg: tuple[str, str], pg_store: Any, scope: str
) -> None:
    inbox = Inbox(pg_store)
    consumer = IdempotentConsumer(pg_store, scope=scope, policy=POLICY)
    fetched = [delivery(f"{scope}-{n}") for n in (1, 2, 1, 3)]
    written: list[str] = []

    @inbox.transactional(pg_begin(pg))
    def handle(key: str) -> str:
        current_transaction().execute("INSERT INTO charges (key) VALUES (%s)", (key,))
        written.append(key)
        return key

    verdicts = consumer.process_batch(fetched, handle)
    assert [v.reason for v in verdicts] == [
        Reason.PROCESSED,
        Reason.PROCESSED,
        Reason.DUPLICATE,
        Reason.PROCESSED,
    ]
    assert charges(pg, scope) == [f"{scope}-1", f"{scope}-2", f"{scope}-3"]
    for message in fetched:
        assert pg_store.get(consumer.key_for(message)).status is Status.COMPLETED
    assert [v.reason for v in consumer.process_batch(fetched, handle)] == [Reason.DUPLICATE] * 4
    assert len(written) == 3


def test_under_the_decorator_a_repeat_replays_what_the_transaction_committed(
    pg: tuple[str, str], pg_store: Any, scope: str
) -> None:
    inbox = Inbox(pg_store)

    @oncely.idempotent(store=pg_store, key="order", scope=scope)
    @inbox.transactional(pg_begin(pg))
    def place(order: str) -> dict[str, str]:
        current_transaction().execute("INSERT INTO charges (key) VALUES (%s)", (order,))
        return {"order": order}

    completes = _count_completes(pg_store)
    assert place(f"{scope}-1") == {"order": f"{scope}-1"}
    assert place(f"{scope}-1") == {"order": f"{scope}-1"}
    assert charges(pg, scope) == [f"{scope}-1"]
    assert completes == []  # committed with the write: no second round trip to complete it


def test_under_the_decorator_an_unstorable_value_is_still_reported(
    pg: tuple[str, str], pg_store: Any, scope: str
) -> None:
    @oncely.idempotent(store=pg_store, key="order", scope=scope)
    @Inbox(pg_store).transactional(pg_begin(pg))
    def place(order: str) -> Any:
        current_transaction().execute("INSERT INTO charges (key) VALUES (%s)", (order,))
        return object()

    for _ in range(2):  # the first call, then its replay
        with pytest.raises(ResultUnavailableError):
            place(f"{scope}-1")
    assert charges(pg, scope) == [f"{scope}-1"]


def test_under_the_decorator_an_async_function_commits_once(
    pg: tuple[str, str], pg_store: Any, scope: str
) -> None:
    from psycopg_pool import AsyncConnectionPool

    async def main() -> None:
        pool = AsyncConnectionPool(
            pg[0], min_size=1, max_size=2, open=False, kwargs={"options": f"-c search_path={pg[1]}"}
        )
        await pool.open()
        try:

            @oncely.idempotent(store=pg_store, key="order", scope=scope)
            @Inbox(pg_store).transactional(pool.connection)
            async def place(order: str) -> dict[str, str]:
                sql = "INSERT INTO charges (key) VALUES (%s)"
                await current_transaction().execute(sql, (order,))
                return {"order": order}

            assert await place(f"{scope}-1") == {"order": f"{scope}-1"}
            assert await place(f"{scope}-1") == {"order": f"{scope}-1"}
        finally:
            await pool.close()

    completes = _count_completes(pg_store)
    asyncio.run(main())
    assert charges(pg, scope) == [f"{scope}-1"]
    assert completes == []


def _count_completes(store: Any) -> list[str]:
    """The keys of the store's complete calls from now on (sync and async verbs)."""
    calls: list[str] = []
    complete, acomplete = store.complete, store.acomplete

    def counted(key: str, *args: Any, **kwargs: Any) -> Any:
        calls.append(key)
        return complete(key, *args, **kwargs)

    async def acounted(key: str, *args: Any, **kwargs: Any) -> Any:
        calls.append(key)
        return await acomplete(key, *args, **kwargs)

    store.complete, store.acomplete = counted, acounted
    return calls


def test_sqlalchemy_engine_begin(pg: tuple[str, str], pg_store: Any, scope: str) -> None:
    """SQLAlchemy's ``engine.begin``: the handler writes through the Connection it yields."""
    import sqlalchemy

    base, schema = pg
    engine = sqlalchemy.create_engine(
        base.replace("postgresql://", "postgresql+psycopg://", 1),
        connect_args={"options": f"-c search_path={schema}"},
    )
    inbox = Inbox(pg_store)
    consumer = IdempotentConsumer(pg_store, scope=scope, policy=POLICY)

    @inbox.transactional(engine.begin)
    def handle(key: str) -> None:
        insert = sqlalchemy.text("INSERT INTO charges (key) VALUES (:key)")
        current_transaction().execute(insert, {"key": key})

    fetched = [delivery(f"{scope}-1"), delivery(f"{scope}-2"), delivery(f"{scope}-1")]
    verdicts = [consumer.process(message, lambda m=message: handle(m.raw)) for message in fetched]
    assert [v.reason for v in verdicts] == [Reason.PROCESSED, Reason.PROCESSED, Reason.DUPLICATE]
    assert charges(pg, scope) == [f"{scope}-1", f"{scope}-2"]
    engine.dispose()


DJANGO_CONSUMER = (
    DJANGO_SQLITE
    + """
from oncely.consumers import Delivery, IdempotentConsumer

store = oncely.open_store("sqlite:///" + sys.argv[1])
consumer = IdempotentConsumer(store, scope="billing")


@contextmanager
def begin():
    with transaction.atomic():
        yield connection


@oncely.Inbox(store).transactional(begin)
def charge(key):
    with oncely.current_transaction().cursor() as cursor:
        cursor.execute("INSERT INTO charges VALUES (%s)", [key])


message = Delivery(b"{}", {"Idempotency-Key": "c-1"})
print(*(consumer.process(message, lambda: charge("c-1")).reason for _ in range(2)))
with connection.cursor() as cursor:
    cursor.execute("SELECT count(*) FROM charges")
    print(cursor.fetchone()[0], store.get("billing|c-1").status)
"""
)


def test_django_atomic(tmp_path: Path) -> None:
    """A *begin* around Django's ``transaction.atomic()`` that yields ``django.db.connection``."""
    path = tmp_path / "app.db"
    with oncely.open_store(f"sqlite:///{path}"), sqlite3.connect(path) as setup:
        setup.execute("CREATE TABLE charges (key TEXT)")
    script = tmp_path / "django_consumer.py"
    script.write_text(DJANGO_CONSUMER)
    result = subprocess.run(
        [sys.executable, str(script), str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["processed duplicate", "1 completed"]


def test_misuse_is_a_configuration_error(pg: tuple[str, str], pg_store: Any) -> None:
    inbox = Inbox(pg_store)

    @inbox.transactional(pg_begin(pg))
    def handle() -> None:
        pass

    with pytest.raises(ConfigurationError, match="runs under an oncely consumer"):
        handle()  # no lease: nothing claimed the key
    with pytest.raises(ConfigurationError, match=r"Inbox\.transactional"):
        current_transaction()
    with pytest.raises(ConfigurationError, match="decorates handlers"):
        inbox.transactional(pg_begin(pg))(42)  # type: ignore[type-var]

    @inbox.transactional(pg_begin(pg))  # a sync context manager for an async handler
    async def ahandle() -> None:
        pass

    consumer = IdempotentConsumer(pg_store, scope=f"misuse-{uuid.uuid4().hex[:8]}", policy=POLICY)
    with pytest.raises(ConfigurationError, match="async context manager"):
        asyncio.run(consumer.aprocess(delivery("m-1"), ahandle))  # to the app, not redelivered
    assert pg_store.get(consumer.key_for(delivery("m-1"))).status is Status.RELEASED


# -- a begin() that opens no transaction ----------------------------------------------------------


def test_a_begin_without_a_transaction_is_refused_before_the_handler_runs(
    pg: tuple[str, str], pg_store: Any, scope: str
) -> None:
    """A pool in autocommit: the handler's write would commit on its own, so it never runs; the
    error goes to the application (not a handler failure redelivered), the key is released."""
    from psycopg_pool import ConnectionPool

    consumer = IdempotentConsumer(pg_store, scope=scope, policy=POLICY)
    message = delivery(f"{scope}-1")
    with ConnectionPool(
        pg[0],
        min_size=1,
        max_size=1,
        kwargs={"autocommit": True, "options": f"-c search_path={pg[1]}"},
    ) as pool:
        run = Inbox(pg_store).transactional(pool.connection)(handler_for(message))
        for _ in range(3):  # each redelivery
            with pytest.raises(ConfigurationError, match="has none"):
                consumer.process(message, run)
    assert charges(pg, scope) == []
    assert pg_store.get(consumer.key_for(message)).status is Status.RELEASED


def test_a_sqlite_begin_without_begin_is_refused_before_the_handler_runs(tmp_path: Path) -> None:
    path = tmp_path / "app.db"
    store = oncely.open_store(f"sqlite:///{path}")
    db = sqlite3.connect(path, isolation_level=None)  # autocommit: no BEGIN in begin()
    db.execute("CREATE TABLE charges (key TEXT)")

    @contextmanager
    def begin() -> Iterator[sqlite3.Connection]:
        yield db

    @Inbox(store).transactional(begin)
    def handle() -> None:
        current_transaction().execute("INSERT INTO charges VALUES ('c-1')")

    consumer = IdempotentConsumer(store, scope="billing", policy=POLICY)
    for _ in range(3):
        with pytest.raises(ConfigurationError, match="BEGIN IMMEDIATE"):
            consumer.process(delivery("c-1"), handle)
    assert db.execute("SELECT count(*) FROM charges").fetchone() == (0,)
    db.close()
    store.close()


def test_under_the_decorator_a_begin_without_a_transaction_runs_nothing(
    pg: tuple[str, str], pg_store: Any, scope: str
) -> None:
    @contextmanager
    def begin() -> Iterator[psycopg.Connection[Any]]:
        with psycopg.connect(pg[0], autocommit=True) as connection:
            connection.execute(f'SET search_path TO "{pg[1]}"')
            yield connection

    @oncely.idempotent(store=pg_store, key="order", scope=scope)
    @Inbox(pg_store).transactional(begin)
    def place(order: str) -> None:
        current_transaction().execute("INSERT INTO charges (key) VALUES (%s)", (order,))

    for _ in range(2):
        with pytest.raises(ConfigurationError, match="has none"):
            place(f"{scope}-1")
    assert charges(pg, scope) == []


@pytest.mark.rabbitmq
def test_rabbitmq_a_begin_without_a_transaction_is_raised_not_redelivered(
    pg: tuple[str, str], scope: str
) -> None:
    """Under the adapter: the handler never runs, the error reaches the application, and the
    message is neither acked, requeued as a failure, nor dead-lettered (it waits, unacked)."""
    import aio_pika
    from psycopg_pool import AsyncConnectionPool

    from oncely.consumers.producer import amqp_message
    from oncely.consumers.rabbitmq import dead_letter_arguments, idempotent_handler

    key = f"{scope}-1"
    ran: list[str] = []

    async def main() -> None:
        store = oncely.open_store(schema_url(*pg))
        pool = AsyncConnectionPool(
            pg[0],
            min_size=1,
            max_size=1,
            open=False,
            kwargs={"autocommit": True, "options": f"-c search_path={pg[1]}"},
        )
        await pool.open()
        connection = await aio_pika.connect(service_url("ONCELY_TEST_RABBITMQ_URL"))
        try:
            channel = await connection.channel()
            queue = await channel.declare_queue(
                scope, arguments=dead_letter_arguments(f"{scope}.dead")
            )
            dead = await channel.declare_queue(f"{scope}.dead")

            @idempotent_handler(store, group=scope, policy=POLICY)
            @Inbox(store).transactional(pool.connection)
            async def handle(message: aio_pika.abc.AbstractIncomingMessage) -> None:
                ran.append(key)
                await current_transaction().execute("INSERT INTO charges (key) VALUES (%s)", (key,))

            body = json.dumps({"key": key}).encode()
            await channel.default_exchange.publish(amqp_message(body, key), routing_key=scope)
            for redelivered in (False, True):
                worker = await connection.channel()
                message = await (await worker.get_queue(scope)).get(timeout=10)
                assert message.redelivered is redelivered
                with pytest.raises(ConfigurationError, match="has none"):
                    await handle(message)
                await worker.close()  # unacked: back in the queue, not dead-lettered
            assert await dead.get(fail=False) is None
            await queue.delete(if_unused=False, if_empty=False)
            await dead.delete(if_unused=False, if_empty=False)
        finally:
            await connection.close()
            await pool.close()
            await store.aclose()

    asyncio.run(main())
    assert ran == []
    assert charges(pg, scope) == []


# -- SQLite ----------------------------------------------------------------------------------------


def test_sqlite_with_begin_immediate(tmp_path: Path) -> None:
    path = tmp_path / "app.db"
    store = oncely.open_store(f"sqlite:///{path}")
    with sqlite3.connect(path) as setup:
        setup.execute("CREATE TABLE charges (key TEXT)")
    db = sqlite3.connect(path, isolation_level=None, timeout=10, check_same_thread=False)

    @contextmanager
    def begin() -> Iterator[sqlite3.Connection]:
        db.execute("BEGIN IMMEDIATE")  # the write lock first: see the inbox guide
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    inbox = Inbox(store)
    consumer = IdempotentConsumer(store, scope="billing", policy=POLICY)
    attempts = []

    @inbox.transactional(begin)
    def handle() -> int:
        attempts.append(1)
        current_transaction().execute("INSERT INTO charges VALUES ('c-1')")
        if len(attempts) == 1:
            raise RuntimeError("fails once, after its write")
        return len(attempts)

    message = delivery("c-1")
    verdicts = [consumer.process(message, handle) for _ in range(3)]
    assert [v.reason for v in verdicts] == [
        Reason.HANDLER_FAILED,
        Reason.PROCESSED,
        Reason.DUPLICATE,
    ]
    assert db.execute("SELECT count(*) FROM charges").fetchone() == (1,)
    assert store.get(consumer.key_for(message)).status is Status.COMPLETED
    db.close()
    store.close()


# -- RabbitMQ, async psycopg pool ----------------------------------------------------------------


@pytest.mark.rabbitmq
def test_rabbitmq_handler_writes_in_its_records_transaction(
    pg: tuple[str, str], scope: str
) -> None:
    """Copies of 10 orders, one failing once after its write, to 2 consumers over a pool."""
    import aio_pika
    from psycopg_pool import AsyncConnectionPool

    from oncely.consumers.producer import amqp_message
    from oncely.consumers.rabbitmq import dead_letter_arguments, idempotent_handler

    keys = [f"{scope}-{n:02}" for n in range(10)]
    failed_once: set[str] = set()

    async def main() -> list[Any]:
        store = oncely.open_store(schema_url(*pg))
        pool = AsyncConnectionPool(
            pg[0], min_size=1, max_size=4, open=False, kwargs={"options": f"-c search_path={pg[1]}"}
        )
        await pool.open()
        inbox = Inbox(store)
        connection = await aio_pika.connect(service_url("ONCELY_TEST_RABBITMQ_URL"))
        handlers = []
        try:
            channel = await connection.channel()
            queue = await channel.declare_queue(
                scope, arguments=dead_letter_arguments(f"{scope}.dead")
            )
            for _ in range(2):

                @idempotent_handler(store, group=scope, policy=POLICY)
                @inbox.transactional(pool.connection)
                async def handle(message: aio_pika.abc.AbstractIncomingMessage) -> None:
                    key = str(message.headers["Idempotency-Key"])
                    conn = current_transaction()
                    await conn.execute("INSERT INTO charges (key) VALUES (%s)", (key,))
                    if key == keys[3] and key not in failed_once:
                        failed_once.add(key)
                        raise RuntimeError("fails once, after its write")

                consumer_channel = await connection.channel()
                await consumer_channel.set_qos(prefetch_count=8)
                await (await consumer_channel.get_queue(scope)).consume(handle)
                handlers.append(handle)
            for key in keys * 3:
                body = json.dumps({"key": key}).encode()
                await channel.default_exchange.publish(amqp_message(body, key), routing_key=scope)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while sum(h.stats[Reason.PROCESSED] for h in handlers) < len(keys):
                assert loop.time() < deadline
                await asyncio.sleep(0.05)
            while sum(h.stats[Reason.DUPLICATE] for h in handlers) < 2 * len(keys):
                assert loop.time() < deadline
                await asyncio.sleep(0.05)
            await queue.delete(if_unused=False, if_empty=False)
            await channel.queue_delete(f"{scope}.dead")
            return handlers
        finally:
            await connection.close()
            await pool.close()
            await store.aclose()

    asyncio.run(main())
    assert charges(pg, scope) == keys  # one each: the failed attempt's write rolled back
    assert failed_once == {keys[3]}


# -- processes killed at the commit and before the ack ---------------------------------------------

_WORKER = """
import json, os, signal, sys
from contextlib import contextmanager
from datetime import timedelta
import psycopg
import oncely
from oncely.consumers import ConsumerPolicy, Delivery, IdempotentConsumer
from oncely.inbox import Inbox, current_transaction

url, schema, scope, key, point = sys.argv[1:6]
store = oncely.open_store(f"{url}{'&' if '?' in url else '?'}schema={schema}")
policy = ConsumerPolicy(lease=timedelta(milliseconds=500), ttl=timedelta(minutes=5))
consumer = IdempotentConsumer(store, scope=scope, policy=policy)

@contextmanager
def begin():
    with psycopg.connect(url, options=f"-c search_path={schema}") as connection:
        yield connection
        if point == "commit":  # the write and the completion made, not committed
            os.kill(os.getpid(), signal.SIGKILL)

def handle():
    current_transaction().execute("INSERT INTO charges VALUES (%s, %s)", (key, str(os.getpid())))

message = Delivery(json.dumps({"key": key}).encode(), {"Idempotency-Key": key})
verdict = consumer.process(message, Inbox(store).transactional(begin)(handle))
if point == "ack":  # committed, not acked: the broker would redeliver
    os.kill(os.getpid(), signal.SIGKILL)
print(verdict.reason, flush=True)
"""


@pytest.mark.parametrize("point", ["commit", "ack"])
def test_a_worker_killed_at_the_commit_or_before_the_ack(
    pg: tuple[str, str], scope: str, point: str, tmp_path: Path
) -> None:
    """SIGKILL with the write and the completion made but not committed: neither is left, and
    the redelivery runs once the lease is over. SIGKILL after the commit, before the ack: both
    are left, and the redelivery is a duplicate. Either way, one charge."""
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    key = f"{scope}-1"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}

    def worker(at: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(script), pg[0], pg[1], scope, key, at],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )

    killed = worker(point)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert charges(pg, scope) == ([] if point == "commit" else [key])

    outcomes = []
    for _ in range(40):  # the redelivery, until it is decided (after the lease, if held)
        outcome = worker("none")
        assert outcome.returncode == 0, outcome.stderr
        outcomes.append(outcome.stdout.strip())
        if outcomes[-1] != "in_progress":
            break
        threading.Event().wait(0.1)
    assert outcomes[-1] == ("processed" if point == "commit" else "duplicate")
    assert charges(pg, scope) == [key]


# -- ONCELY_DISABLED -------------------------------------------------------------------------------


def test_disabled_inbox_runs_unprotected_and_writes_no_record(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "app.db"
    store = oncely.open_store(f"sqlite:///{path}")
    inbox = Inbox(store)
    db = sqlite3.connect(path, isolation_level=None)
    ran = []
    with disabled(), caplog.at_level(logging.WARNING, logger="oncely"):
        for _ in range(2):
            db.execute("BEGIN IMMEDIATE")
            with inbox.claim(db, "o-1", scope="orders") as entry:
                assert not entry.replayed
                ran.append(entry.token)
                entry.complete("done")
            db.execute("COMMIT")
    assert ran == [0, 0]
    assert store.get("orders|o-1") is None  # nothing read or written
    assert sum("runs UNPROTECTED" in r.getMessage() for r in caplog.records) == 2
    db.close()
    store.close()


def test_disabled_async_inbox(pg: tuple[str, str], pg_store: Any, scope: str) -> None:
    inbox = Inbox(pg_store)

    async def main() -> None:
        async with (
            await psycopg.AsyncConnection.connect(pg[0]) as connection,
            connection.transaction(),
            inbox.aclaim(connection, "o-1", scope=scope) as entry,
        ):
            assert not entry.replayed
            assert entry.token == 0

    with disabled():
        asyncio.run(main())
    assert pg_store.get(f"{scope}|o-1") is None


def test_disabled_consumer_runs_a_transactional_handler_unprotected(
    pg: tuple[str, str], pg_store: Any, scope: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The handler still gets its transaction (its writes commit); no record is written."""
    consumer = IdempotentConsumer(pg_store, scope=scope, policy=POLICY)
    message = delivery(f"{scope}-1")
    run = Inbox(pg_store).transactional(pg_begin(pg))(handler_for(message))
    with caplog.at_level(logging.WARNING, logger="oncely"), disabled():
        verdicts = [consumer.process(message, run) for _ in "ab"]
    assert [(v.reason, v.result) for v in verdicts] == [
        (Reason.PROCESSED, f"charged {scope}-1")
    ] * 2
    assert charges(pg, scope) == [f"{scope}-1"] * 2
    assert pg_store.get(consumer.key_for(message)) is None
    assert sum("runs UNPROTECTED" in r.getMessage() for r in caplog.records) == 2
