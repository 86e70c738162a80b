"""The transactional inbox: the record commits or rolls back with the caller's own writes.

Real PostgreSQL (psycopg sync and async, SQLAlchemy) and SQLite (sqlite3) in files; concurrent
duplicates are separate connections in separate threads, as two workers would be. The behaviours
of a claim run in both forms (``form``): `Inbox.claim` in the caller's transaction, and
`Inbox.transaction`, the transaction the inbox owns (its own behaviours: test_inbox_owned.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

import oncely
from oncely.inbox import Inbox
from tests._helpers import DJANGO_SQLITE
from tests.conftest import service_url

# -- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pg() -> Iterator[tuple[str, str]]:
    """(base URL, schema): a schema of this module's own, migrated, with an orders table."""
    base = service_url("ONCELY_TEST_POSTGRES_URL")
    schema = f"oncely_inbox_{uuid.uuid4().hex[:10]}"
    url = f"{base}{'&' if '?' in base else '?'}schema={schema}"
    with oncely.open_store(url) as store:
        store.migrate()  # type: ignore[attr-defined]
    with psycopg.connect(base, autocommit=True) as connection:
        connection.execute(f'CREATE TABLE "{schema}".orders (id text PRIMARY KEY, amount int)')
    yield base, schema
    with psycopg.connect(base, autocommit=True) as connection:
        connection.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.fixture
def pg_store(pg: tuple[str, str]) -> Iterator[Any]:
    base, schema = pg
    store = oncely.open_store(f"{base}{'&' if '?' in base else '?'}schema={schema}")
    yield store
    store.close()


def pg_connect(pg: tuple[str, str]) -> psycopg.Connection[Any]:
    base, schema = pg
    connection = psycopg.connect(base)
    connection.execute(f'SET search_path TO "{schema}"')
    connection.commit()
    return connection


@pytest.fixture
def sqlite_path(tmp_path: Path) -> Path:
    path = tmp_path / "app.db"
    with oncely.open_store(f"sqlite:///{path}"):  # creates the oncely tables
        pass
    with sqlite3.connect(path) as connection:
        connection.execute("CREATE TABLE orders (id TEXT PRIMARY KEY, amount INTEGER)")
    return path


def sqlite_connect(path: Path) -> sqlite3.Connection:
    connection = sqlite3.connect(path, isolation_level=None, timeout=10)
    connection.execute("PRAGMA journal_mode=WAL")
    return connection


def pg_orders(pg: tuple[str, str]) -> list[tuple[str, int]]:
    with pg_connect(pg) as connection:
        return connection.execute("SELECT id, amount FROM orders ORDER BY id").fetchall()


FORMS = pytest.mark.parametrize("form", ["claim", "transaction"])
"""A claim in the caller's transaction (`Inbox.claim`), or in the inbox's (`Inbox.transaction`)."""


@contextlib.contextmanager
def pg_block(form: str, inbox: Inbox, connection: Any, key: str, **kwargs: Any) -> Iterator[Any]:
    """*key* claimed in *form*, on an idle psycopg connection: committed when the block ends
    (with a final error too: the caller of `claim` commits it, as `transaction` does)."""
    if form == "transaction":
        with inbox.transaction(connection, key, **kwargs) as entry:
            yield entry
        return
    final: BaseException | None = None
    with connection.transaction():
        try:
            with inbox.claim(connection, key, **kwargs) as entry:
                yield entry
        except inbox.policy.final_errors as exc:
            final = exc
    if final is not None:
        raise final


@contextlib.asynccontextmanager
async def apg_block(
    form: str, inbox: Inbox, connection: Any, key: str, **kwargs: Any
) -> AsyncIterator[Any]:
    """`pg_block` on an async psycopg connection."""
    if form == "transaction":
        async with inbox.atransaction(connection, key, **kwargs) as entry:
            yield entry
    else:
        async with connection.transaction(), inbox.aclaim(connection, key, **kwargs) as entry:
            yield entry


@contextlib.contextmanager
def sqlite_block(
    form: str, inbox: Inbox, connection: sqlite3.Connection, key: str, **kwargs: Any
) -> Iterator[Any]:
    """`pg_block` on sqlite3 (the caller's transaction is BEGIN IMMEDIATE)."""
    if form == "transaction":
        with inbox.transaction(connection, key, **kwargs) as entry:
            yield entry
        return
    connection.execute("BEGIN IMMEDIATE")
    try:
        with inbox.claim(connection, key, **kwargs) as entry:
            yield entry
    except inbox.policy.final_errors:
        connection.execute("COMMIT")  # the outcome, recorded
        raise
    except BaseException:
        connection.execute("ROLLBACK")
        raise
    connection.execute("COMMIT")


# -- PostgreSQL -----------------------------------------------------------------------------------


def place_order_pg(
    inbox: Inbox, connection: Any, order: str, amount: int, form: str = "claim"
) -> Any:
    with pg_block(
        form, inbox, connection, order, scope="orders.place", fingerprint={"amount": amount}
    ) as entry:
        if entry.replayed:
            return entry.result
        connection.execute("INSERT INTO orders VALUES (%s, %s)", (order, amount))
        entry.complete({"order": order, "token": entry.token})
    return {"order": order, "token": entry.token}


@pytest.mark.postgres
@FORMS
def test_postgres_commit_then_replay(pg: tuple[str, str], pg_store: Any, form: str) -> None:
    inbox = Inbox(pg_store)
    order = f"o-{uuid.uuid4().hex[:8]}"
    with pg_connect(pg) as connection:
        first = place_order_pg(inbox, connection, order, 500, form)
        again = place_order_pg(inbox, connection, order, 500, form)
        with pytest.raises(oncely.FingerprintMismatchError):
            place_order_pg(inbox, connection, order, 900, form)
        assert connection.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert first == again == {"order": order, "token": 1}
    assert [row for row in pg_orders(pg) if row[0] == order] == [(order, 500)]
    record = pg_store.get(f"orders.place|{order}")
    assert record.status is oncely.Status.COMPLETED


@pytest.mark.postgres
def test_postgres_rollback_leaves_nothing(pg: tuple[str, str], pg_store: Any) -> None:
    inbox = Inbox(pg_store)
    order = f"o-{uuid.uuid4().hex[:8]}"
    with pg_connect(pg) as connection:
        with pytest.raises(RuntimeError), connection.transaction():
            with inbox.claim(connection, order, scope="orders.place") as entry:
                connection.execute("INSERT INTO orders VALUES (%s, 1)", (order,))
                entry.complete("done")
            raise RuntimeError("the caller's transaction fails after the block")
        assert pg_store.get(f"orders.place|{order}") is None
        place_order_pg(inbox, connection, order, 1)  # runs: nothing was recorded
    assert [row for row in pg_orders(pg) if row[0] == order] == [(order, 1)]


@pytest.mark.postgres
def test_postgres_block_error_rolls_back_to_the_claim(pg: tuple[str, str], pg_store: Any) -> None:
    """The block raised: its writes and the claim are undone; the caller's transaction goes on."""
    inbox = Inbox(pg_store)
    order = f"o-{uuid.uuid4().hex[:8]}"
    with pg_connect(pg) as connection:
        with connection.transaction():
            connection.execute("INSERT INTO orders VALUES (%s, 7)", (order + "-before",))
            with pytest.raises(ValueError), inbox.claim(connection, order, scope="s"):
                connection.execute("INSERT INTO orders VALUES (%s, 1)", (order,))
                raise ValueError("declined")
        assert pg_store.get(f"s|{order}") is None
    ids = [row[0] for row in pg_orders(pg)]
    assert order + "-before" in ids
    assert order not in ids


@pytest.mark.postgres
@FORMS
@pytest.mark.parametrize("first_commits", [True, False], ids=["commits", "rolls-back"])
def test_postgres_concurrent_duplicate_waits_then_replays_or_runs(
    pg: tuple[str, str], pg_store: Any, first_commits: bool, form: str
) -> None:
    inbox = Inbox(pg_store, wait_timeout=20)
    order = f"o-{uuid.uuid4().hex[:8]}"
    claimed, finish = threading.Event(), threading.Event()
    outcome: dict[str, Any] = {}

    def first() -> None:
        with pg_connect(pg) as connection:
            try:
                with pg_block(form, inbox, connection, order, scope="s") as entry:
                    connection.execute("INSERT INTO orders VALUES (%s, 1)", (order,))
                    entry.complete("first")
                    claimed.set()
                    finish.wait(10)
                    if not first_commits:
                        raise RuntimeError("rolled back")
            except RuntimeError:
                pass

    def second() -> None:
        claimed.wait(10)
        with (
            pg_connect(pg) as connection,
            pg_block(form, inbox, connection, order, scope="s") as entry,
        ):
            if entry.replayed:
                outcome["second"] = ("replayed", entry.result)
            else:
                connection.execute("INSERT INTO orders VALUES (%s, 2)", (order,))
                entry.complete("second")
                outcome["second"] = ("ran", entry.token)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    claimed.wait(10)
    threading.Timer(0.5, finish.set).start()  # the second is waiting in its claim by then
    for thread in threads:
        thread.join(30)
    rows = [row for row in pg_orders(pg) if row[0] == order]
    if first_commits:
        assert outcome["second"] == ("replayed", "first")
        assert rows == [(order, 1)]
    else:
        assert outcome["second"][0] == "ran"
        assert rows == [(order, 2)]


@pytest.mark.postgres
@FORMS
def test_postgres_duplicate_raises_at_once_when_asked(
    pg: tuple[str, str], pg_store: Any, form: str
) -> None:
    inbox = Inbox(pg_store, on_conflict="raise")
    order = f"o-{uuid.uuid4().hex[:8]}"
    with pg_connect(pg) as holder, pg_block(form, inbox, holder, order, scope="s") as entry:
        entry.complete("x")
        with pg_connect(pg) as other:
            other.execute("SET lock_timeout = '4s'")
            other.commit()
            with (
                pytest.raises(oncely.InProgressError) as raised,
                pg_block(form, inbox, other, order, scope="s"),
            ):
                raise AssertionError("never runs")
            assert raised.value.retry_after <= timedelta(seconds=1)
            # The other connection is still usable, with its own lock_timeout.
            assert other.execute("SHOW lock_timeout").fetchone() == ("4s",)


@pytest.mark.postgres
def test_postgres_concurrent_replays_do_not_wait_for_each_other(
    pg: tuple[str, str], pg_store: Any
) -> None:
    """A replay holds nothing until its transaction ends: another transaction replays the
    same key at once (a new key's claim holds a lock on the key; a replay takes none)."""
    order = f"o-{uuid.uuid4().hex[:8]}"
    with pg_connect(pg) as connection:
        place_order_pg(Inbox(pg_store), connection, order, 5)
    inbox = Inbox(pg_store, on_conflict="raise")
    with (
        pg_connect(pg) as first,
        first.transaction(),
        inbox.claim(first, order, scope="orders.place", fingerprint={"amount": 5}) as held,
    ):
        assert held.replayed
        with pg_connect(pg) as second, second.transaction():
            assert place_order_pg(inbox, second, order, 5) == held.result


@pytest.mark.postgres
def test_postgres_a_key_claimed_after_a_rollback_is_still_waited_for_with_a_bound(
    pg: tuple[str, str], pg_store: Any
) -> None:
    """The first claimer rolls back while a second waits: the second claims the key (its own
    record, uncommitted), and a third's claim is bounded by its wait (InProgressError at once
    with ``on_conflict="raise"``), never left waiting for the second's transaction."""
    order = f"o-{uuid.uuid4().hex[:8]}"
    inbox = Inbox(pg_store, wait_timeout=20)
    holding, release = threading.Event(), threading.Event()
    outcome: dict[str, Any] = {}

    def second() -> None:
        with pg_connect(pg) as connection, connection.transaction():
            outcome["pid"] = connection.info.backend_pid
            started.set()
            with inbox.claim(connection, order, scope="s") as entry:
                outcome["second"] = entry.replayed
                entry.complete("second")
            holding.set()
            release.wait(10)

    started = threading.Event()
    waiting = "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s"
    with (
        pg_connect(pg) as first,
        pg_connect(pg) as watcher,
        first.transaction(),
        inbox.claim(first, order, scope="s"),
    ):
        thread = threading.Thread(target=second)
        thread.start()
        started.wait(10)
        while not watcher.execute(waiting, (outcome["pid"],)).fetchone()[0]:  # type: ignore[index]
            watcher.commit()  # a fresh snapshot of the activity
            threading.Event().wait(0.01)
        raise psycopg.Rollback()  # the first rolls back while the second waits
    try:
        holding.wait(10)
        assert outcome["second"] is False
        with (
            pg_connect(pg) as third,
            third.transaction(),
            pytest.raises(oncely.InProgressError),
        ):
            Inbox(pg_store, on_conflict="raise").claim(third, order, scope="s").__enter__()
    finally:
        release.set()
        thread.join(30)
    assert pg_store.get(f"s|{order}").status is oncely.Status.COMPLETED


@pytest.mark.postgres
@FORMS
def test_postgres_a_live_lease_elsewhere_is_respected(
    pg: tuple[str, str], pg_store: Any, form: str
) -> None:
    """A key claimed by the decorator (a lease, committed) is in progress for the inbox."""
    order = f"o-{uuid.uuid4().hex[:8]}"
    claim = pg_store.claim(f"s|{order}", "", lease=timedelta(seconds=30), ttl=timedelta(hours=1))
    assert isinstance(claim, oncely.Acquired)
    for inbox in (Inbox(pg_store, on_conflict="raise"), Inbox(pg_store, wait_timeout=0.2)):
        with pg_connect(pg) as connection:
            with (
                pytest.raises(oncely.InProgressError),
                pg_block(form, inbox, connection, order, scope="s"),
            ):
                raise AssertionError("never runs")
            assert connection.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


@pytest.mark.postgres
def test_postgres_needs_a_transaction(pg: tuple[str, str], pg_store: Any) -> None:
    with (
        psycopg.connect(pg[0], autocommit=True) as connection,
        pytest.raises(oncely.ConfigurationError, match="transaction"),
    ):
        Inbox(pg_store).claim(connection, "k", scope="s").__enter__()


@pytest.mark.postgres
@FORMS
def test_postgres_async(pg: tuple[str, str], pg_store: Any, form: str) -> None:
    inbox = Inbox(pg_store)
    order = f"o-{uuid.uuid4().hex[:8]}"
    base, schema = pg

    async def place() -> Any:
        async with await psycopg.AsyncConnection.connect(base) as connection:
            await connection.execute(f'SET search_path TO "{schema}"')
            await connection.commit()
            async with apg_block(form, inbox, connection, order, scope="s") as entry:
                if entry.replayed:
                    return entry.result
                await connection.execute("INSERT INTO orders VALUES (%s, 3)", (order,))
                entry.complete("async")
            return "ran"

    assert asyncio.run(place()) == "ran"
    assert asyncio.run(place()) == "async"
    assert [row for row in pg_orders(pg) if row[0] == order] == [(order, 3)]


@pytest.mark.postgres
def test_postgres_sqlalchemy_session(pg: tuple[str, str], pg_store: Any) -> None:
    sqlalchemy = pytest.importorskip("sqlalchemy")
    from sqlalchemy.orm import Session

    base, schema = pg
    engine = sqlalchemy.create_engine(base.replace("postgresql://", "postgresql+psycopg://", 1))
    inbox = Inbox(pg_store)
    order = f"o-{uuid.uuid4().hex[:8]}"
    for _ in range(2):
        with Session(engine) as session, session.begin():
            session.execute(sqlalchemy.text(f'SET LOCAL search_path TO "{schema}"'))
            with inbox.claim(session, order, scope="s") as entry:
                if not entry.replayed:
                    session.execute(
                        sqlalchemy.text("INSERT INTO orders VALUES (:id, 4)"), {"id": order}
                    )
    engine.dispose()
    assert [row for row in pg_orders(pg) if row[0] == order] == [(order, 4)]


# -- SQLite ---------------------------------------------------------------------------------------


def place_order_sqlite(
    inbox: Inbox, connection: sqlite3.Connection, order: str, form: str = "claim"
) -> Any:
    with sqlite_block(form, inbox, connection, order, scope="orders.place") as entry:
        if entry.replayed:
            result = entry.result
        else:
            connection.execute("INSERT INTO orders VALUES (?, 5)", (order,))
            entry.complete(result := {"order": order})
    return result


@FORMS
def test_sqlite_commit_then_replay(sqlite_path: Path, form: str) -> None:
    store = oncely.open_store(f"sqlite:///{sqlite_path}")
    inbox = Inbox(store)
    connection = sqlite_connect(sqlite_path)
    assert place_order_sqlite(inbox, connection, "o-1", form) == {"order": "o-1"}
    assert place_order_sqlite(inbox, connection, "o-1", form) == {"order": "o-1"}
    assert not connection.in_transaction
    assert connection.execute("SELECT count(*) FROM orders").fetchone() == (1,)
    record = store.get("orders.place|o-1")
    assert record is not None
    assert record.status is oncely.Status.COMPLETED
    store.close()


def test_sqlite_rollback_leaves_nothing(sqlite_path: Path) -> None:
    store = oncely.open_store(f"sqlite:///{sqlite_path}")
    inbox = Inbox(store)
    connection = sqlite_connect(sqlite_path)
    connection.execute("BEGIN IMMEDIATE")
    with inbox.claim(connection, "o-2", scope="s") as entry:
        connection.execute("INSERT INTO orders VALUES ('o-2', 1)")
        entry.complete("x")
    connection.execute("ROLLBACK")
    assert store.get("s|o-2") is None
    assert connection.execute("SELECT count(*) FROM orders").fetchone() == (0,)
    store.close()


@FORMS
def test_sqlite_concurrent_duplicates_run_once(sqlite_path: Path, form: str) -> None:
    """Eight connections race for one key: the write lock serialises them, one runs."""
    store = oncely.open_store(f"sqlite:///{sqlite_path}")
    inbox = Inbox(store)
    barrier = threading.Barrier(8)
    results: list[Any] = []

    def worker() -> None:
        connection = sqlite_connect(sqlite_path)
        barrier.wait()
        results.append(place_order_sqlite(inbox, connection, "o-3", form))
        connection.close()

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert results == [{"order": "o-3"}] * 8
    check = sqlite_connect(sqlite_path)
    assert check.execute("SELECT count(*) FROM orders").fetchone() == (1,)
    store.close()


def test_sqlite_needs_a_transaction(sqlite_path: Path) -> None:
    store = oncely.open_store(f"sqlite:///{sqlite_path}")
    with pytest.raises(oncely.ConfigurationError, match="BEGIN IMMEDIATE"):
        Inbox(store).claim(sqlite_connect(sqlite_path), "k", scope="s").__enter__()
    store.close()


def test_inbox_needs_a_sql_store() -> None:
    with pytest.raises(oncely.ConfigurationError, match="PostgresStore or an SQLiteStore"):
        Inbox(oncely.open_store("memory://"))


DJANGO_APP = (
    DJANGO_SQLITE
    + """

store = oncely.open_store("sqlite:///" + sys.argv[1])
inbox = oncely.Inbox(store)


def place(order):
    with transaction.atomic():
        with inbox.claim(connection, order, scope="orders.place") as entry:
            if entry.replayed:
                return entry.result
            with connection.cursor() as cursor:
                cursor.execute("INSERT INTO orders VALUES (%s, 6)", [order])
            entry.complete("placed " + order)
            return "ran"


print(place("o-9"), place("o-9"))
try:
    inbox.claim(connection, "o-10", scope="s").__enter__()
except oncely.ConfigurationError as exc:
    print("outside atomic:", "atomic" in str(exc))
with connection.cursor() as cursor:
    cursor.execute("SELECT count(*) FROM orders")
    print(cursor.fetchone()[0])
"""
)


def test_django_connection_inside_atomic(sqlite_path: Path, tmp_path: Path) -> None:
    """Django's connection inside transaction.atomic(): the order and its record commit as one."""
    import subprocess
    import sys

    script = tmp_path / "django_inbox.py"
    script.write_text(DJANGO_APP)
    result = subprocess.run(
        [sys.executable, str(script), str(sqlite_path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:3] == ["ran placed o-9", "outside atomic: True", "1"]


@pytest.mark.postgres
def test_postgres_sqlalchemy_async_session(pg: tuple[str, str], pg_store: Any) -> None:
    sqlalchemy = pytest.importorskip("sqlalchemy")
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    base, schema = pg
    inbox = Inbox(pg_store)
    order = f"o-{uuid.uuid4().hex[:8]}"

    async def place() -> str:
        engine = create_async_engine(base.replace("postgresql://", "postgresql+psycopg://", 1))
        try:
            async with AsyncSession(engine) as session, session.begin():
                await session.execute(sqlalchemy.text(f'SET LOCAL search_path TO "{schema}"'))
                async with inbox.aclaim(session, order, scope="s") as entry:
                    if entry.replayed:
                        return str(entry.result)
                    await session.execute(
                        sqlalchemy.text("INSERT INTO orders VALUES (:id, 8)"), {"id": order}
                    )
                    entry.complete("async session")
                    return "ran"
        finally:
            await engine.dispose()

    assert asyncio.run(place()) == "ran"
    assert asyncio.run(place()) == "async session"
    assert [row for row in pg_orders(pg) if row[0] == order] == [(order, 8)]


# -- round trips ----------------------------------------------------------------------------------


def round_trips(connection: psycopg.Connection[Any], block: Any) -> int:
    """How many times *block* waited for the server: its ReadyForQuery messages (libpq trace)."""
    import tempfile

    from psycopg import pq

    with tempfile.TemporaryFile("w+") as trace:
        connection.pgconn.trace(trace.fileno())
        connection.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS)
        try:
            block()
        finally:
            connection.pgconn.untrace()
        trace.seek(0)
        return sum("\tReadyForQuery\t" in line for line in trace)


@pytest.mark.postgres
def test_postgres_claim_costs_two_round_trips(pg: tuple[str, str], pg_store: Any) -> None:
    """Claim (savepoint, bounded wait, claim) is one round trip; recording a value, one more;
    a replay, or a block that records nothing, none more."""
    inbox = Inbox(pg_store, final_errors=(Declined,))
    order = f"o-{uuid.uuid4().hex[:8]}"

    def claim_and_complete(expect_replay: bool) -> None:
        with inbox.claim(connection, order, scope="s") as entry:
            assert entry.replayed is expect_replay
            if not expect_replay:
                entry.complete("done")

    def block_raises() -> None:
        with pytest.raises(ValueError), inbox.claim(connection, order + "-x", scope="s"):
            raise ValueError("rolled back to the claim")

    def records_nothing() -> None:
        with inbox.claim(connection, order + "-none", scope="s") as entry:
            assert not entry.replayed

    with pg_connect(pg) as connection, connection.transaction():
        connection.execute("SET LOCAL lock_timeout = '3s'")
        assert round_trips(connection, lambda: claim_and_complete(False)) == 2
        assert round_trips(connection, lambda: claim_and_complete(True)) == 1
        assert round_trips(connection, block_raises) == 2
        assert round_trips(connection, records_nothing) == 1
        assert connection.execute("SHOW lock_timeout").fetchone() == ("3s",)  # restored
    assert pg_store.get(f"s|{order}").status is oncely.Status.COMPLETED
    assert pg_store.get(f"s|{order}-x") is None
    assert pg_store.get(f"s|{order}-none").status is oncely.Status.COMPLETED


# -- final errors ---------------------------------------------------------------------------------


class Declined(Exception):
    """A final error: the outcome of the operation, replayed as such."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@pytest.mark.postgres
@FORMS
def test_postgres_final_error_is_recorded_without_the_block_writes(
    pg: tuple[str, str], pg_store: Any, form: str
) -> None:
    inbox = Inbox(pg_store, final_errors=(Declined,))
    order = f"o-{uuid.uuid4().hex[:8]}"
    with pg_connect(pg) as connection:
        with pytest.raises(Declined), pg_block(form, inbox, connection, order, scope="s"):
            connection.execute("INSERT INTO orders VALUES (%s, 1)", (order,))
            raise Declined("card declined")
        with pg_block(form, inbox, connection, order, scope="s") as entry:
            assert entry.replayed
            with pytest.raises(Declined) as replayed:
                entry.result  # noqa: B018 - the property raises
    assert replayed.value.reason == "card declined"
    assert pg_store.get(f"s|{order}").status is oncely.Status.FAILED
    assert order not in [row[0] for row in pg_orders(pg)]  # the block's writes were undone


@pytest.mark.postgres
def test_postgres_final_error_leaves_the_callers_transaction_going(
    pg: tuple[str, str], pg_store: Any
) -> None:
    inbox = Inbox(pg_store, final_errors=(Declined,))
    order = f"o-{uuid.uuid4().hex[:8]}"
    with pg_connect(pg) as connection, connection.transaction():
        with pytest.raises(Declined), inbox.claim(connection, order, scope="s"):
            connection.execute("INSERT INTO orders VALUES (%s, 1)", (order,))
            raise Declined("card declined")
        connection.execute("INSERT INTO orders VALUES (%s, 2)", (order + "-after",))
    assert pg_store.get(f"s|{order}").status is oncely.Status.FAILED
    ids = [row[0] for row in pg_orders(pg)]
    assert order not in ids  # the block's writes were undone
    assert order + "-after" in ids  # the caller's transaction went on


@pytest.mark.postgres
def test_postgres_final_error_recorded_by_the_decorator_replays_in_the_inbox(
    pg_store: Any, pg: tuple[str, str]
) -> None:
    order = f"o-{uuid.uuid4().hex[:8]}"

    @oncely.idempotent(
        store=pg_store, key="order", scope="s", fingerprint=None, final_errors=(Declined,)
    )
    def charge(order: str) -> None:
        raise Declined("no funds")

    with pytest.raises(Declined):
        charge(order)
    with pg_connect(pg) as connection, connection.transaction():
        entry = Inbox(pg_store, final_errors=(Declined,)).claim(connection, order, scope="s")
        with entry, pytest.raises(Declined, match="no funds"):
            entry.result  # noqa: B018
        # Without the declaration the stored error is not rebuilt: it was not declared final.
        with (
            Inbox(pg_store).claim(connection, order, scope="s") as undeclared,
            pytest.raises(oncely.ResultUnavailableError),
        ):
            undeclared.result  # noqa: B018


@pytest.mark.postgres
@FORMS
@pytest.mark.parametrize("existing", [False, True], ids=["new-key", "existing-row"])
def test_postgres_record_changed_in_the_transaction_is_a_lost_lease(
    pg: tuple[str, str], pg_store: Any, form: str, existing: bool
) -> None:
    """The finish updated no row (the block deleted the record): LeaseLostError, and the block's
    writes are rolled back to the claim; the caller's transaction stays usable (the inbox's,
    rolled back). A key with a row already (released) is claimed in progress, then finished."""
    inbox = Inbox(pg_store)
    order = f"o-{uuid.uuid4().hex[:8]}"
    if existing:
        claim = pg_store.claim(
            f"s|{order}", "", lease=timedelta(seconds=30), ttl=timedelta(hours=1)
        )
        pg_store.release(f"s|{order}", claim.token)
    with pg_connect(pg) as connection:
        with (
            pytest.raises(oncely.LeaseLostError),
            pg_block(form, inbox, connection, order, scope="s") as entry,
        ):
            connection.execute("INSERT INTO orders VALUES (%s, 1)", (order,))
            connection.execute("DELETE FROM oncely_records WHERE key = %s", (f"s|{order}",))
            entry.complete("x")
        count = connection.execute("SELECT count(*) FROM orders WHERE id = %s", (order,))
        assert count.fetchone() == (0,)


@FORMS
def test_sqlite_final_error_is_recorded_without_the_block_writes(
    sqlite_path: Path, form: str
) -> None:
    store = oncely.open_store(f"sqlite:///{sqlite_path}")
    inbox = Inbox(store, final_errors=(Declined,))
    connection = sqlite_connect(sqlite_path)
    with pytest.raises(Declined), sqlite_block(form, inbox, connection, "o-f", scope="s"):
        connection.execute("INSERT INTO orders VALUES ('o-f', 1)")
        raise Declined("card declined")
    with (
        sqlite_block(form, inbox, connection, "o-f", scope="s") as entry,
        pytest.raises(Declined),
    ):
        entry.result  # noqa: B018
    assert store.get("s|o-f").status is oncely.Status.FAILED
    assert connection.execute("SELECT count(*) FROM orders").fetchone() == (0,)
    store.close()


# -- the decorator form ---------------------------------------------------------------------------


@pytest.mark.postgres
def test_postgres_decorated_function_runs_once_per_key(pg: tuple[str, str], pg_store: Any) -> None:
    inbox = Inbox(pg_store, final_errors=(Declined,))
    calls: list[str] = []

    @inbox.idempotent(key="order", scope="orders.place")
    def place(conn: Any, order: str, amount: int) -> dict[str, Any]:
        calls.append(order)
        if amount < 0:
            raise Declined("negative")
        conn.execute("INSERT INTO orders VALUES (%s, %s)", (order, amount))
        return {"order": order, "amount": amount}

    order = f"o-{uuid.uuid4().hex[:8]}"
    for _ in range(2):  # a new connection each time: it is not part of the fingerprint
        with pg_connect(pg) as connection, connection.transaction():
            assert place(connection, order, 5) == {"order": order, "amount": 5}
    with pg_connect(pg) as connection, connection.transaction():
        with pytest.raises(oncely.FingerprintMismatchError):
            place(connection, order, 6)
        with pytest.raises(Declined):
            place(connection, order + "-neg", -1)
        with pytest.raises(Declined):
            place(conn=connection, order=order + "-neg", amount=-1)  # replayed
    assert calls == [order, order + "-neg"]
    assert [row for row in pg_orders(pg) if row[0] == order] == [(order, 5)]


@pytest.mark.postgres
def test_postgres_decorated_coroutine_with_a_key_callable(
    pg: tuple[str, str], pg_store: Any
) -> None:
    inbox = Inbox(pg_store)
    base, schema = pg
    order = f"o-{uuid.uuid4().hex[:8]}"

    @inbox.idempotent(key=lambda db, body: body["id"], connection="db", fingerprint=["body"])
    async def place(db: psycopg.AsyncConnection[Any], body: dict[str, Any]) -> str:
        await db.execute("INSERT INTO orders VALUES (%s, 9)", (body["id"],))
        return "placed"

    async def call() -> str:
        async with await psycopg.AsyncConnection.connect(base) as connection:
            await connection.execute(f'SET search_path TO "{schema}"')
            async with connection.transaction():
                return await place(connection, {"id": order})

    assert asyncio.run(call()) == "placed"
    assert asyncio.run(call()) == "placed"
    assert [row for row in pg_orders(pg) if row[0] == order] == [(order, 9)]


def test_sqlite_decorated_function_with_a_cursor(sqlite_path: Path) -> None:
    store = oncely.open_store(f"sqlite:///{sqlite_path}")
    inbox = Inbox(store)

    @inbox.idempotent(key="order")
    def place(cursor: sqlite3.Cursor, order: str) -> list[str]:
        cursor.execute("INSERT INTO orders VALUES (?, 1)", (order,))
        return [order]

    connection = sqlite_connect(sqlite_path)
    for _ in range(2):
        connection.execute("BEGIN IMMEDIATE")
        assert place(connection.cursor(), "o-c") == ["o-c"]
        connection.execute("COMMIT")
    assert connection.execute("SELECT count(*) FROM orders").fetchone() == (1,)
    store.close()


def test_decorator_form_is_checked_when_applied(sqlite_path: Path) -> None:
    store = oncely.open_store(f"sqlite:///{sqlite_path}")
    inbox = Inbox(store)
    with pytest.raises(oncely.ConfigurationError, match="connection="):
        inbox.idempotent(key="order")(lambda order: order)
    with pytest.raises(oncely.ConfigurationError, match="no parameter 'order_id'"):
        inbox.idempotent(key="order_id")(lambda conn, order: order)
    with pytest.raises(oncely.ConfigurationError, match="no parameter 'db'"):
        inbox.idempotent(key="order", connection="db")(lambda conn, order: order)
    with pytest.raises(oncely.ConfigurationError, match="list of parameter names"):
        inbox.idempotent(key="order", fingerprint="order")  # type: ignore[arg-type]
    store.close()


CRASH_SQLITE = """
import os, sqlite3, sys
import oncely

store = oncely.open_store("sqlite:///" + sys.argv[1])
connection = sqlite3.connect(sys.argv[1], isolation_level=None)
inbox = oncely.Inbox(store)
if sys.argv[2] == "transaction":
    block = inbox.transaction(connection, "o-crash", scope="s")
else:
    connection.execute("BEGIN IMMEDIATE")
    block = inbox.claim(connection, "o-crash", scope="s")
with block as entry:
    connection.execute("INSERT INTO orders VALUES ('o-crash', 1)")
    entry.complete("placed")
    os._exit(9)  # after the writes, before the commit: as a SIGKILL would
"""


@FORMS
def test_sqlite_process_killed_before_commit_leaves_neither(sqlite_path: Path, form: str) -> None:
    import subprocess
    import sys

    script = [sys.executable, "-c", CRASH_SQLITE, str(sqlite_path), form]
    crashed = subprocess.run(script, check=False)
    assert crashed.returncode == 9
    store = oncely.open_store(f"sqlite:///{sqlite_path}")
    assert store.get("s|o-crash") is None
    connection = sqlite_connect(sqlite_path)
    assert connection.execute("SELECT count(*) FROM orders").fetchone() == (0,)
    connection.execute("BEGIN IMMEDIATE")
    with Inbox(store).claim(connection, "o-crash", scope="s") as entry:
        assert not entry.replayed  # the retry runs
    connection.execute("COMMIT")
    store.close()


@pytest.mark.postgres
def test_postgres_nested_claims_roll_back_to_their_own_claim(
    pg: tuple[str, str], pg_store: Any
) -> None:
    """A claim inside another's block, finished without a round trip (its savepoint left to the
    commit), does not capture the outer claim's rollback: the outer block's error undoes both
    claims and both blocks' writes, and only those."""
    inbox = Inbox(pg_store)
    outer, inner, before = (f"o-{uuid.uuid4().hex[:8]}" for _ in range(3))
    with pg_connect(pg) as connection, connection.transaction():
        with inbox.claim(connection, before, scope="s") as entry:  # records nothing
            assert not entry.replayed
        with pytest.raises(ValueError), inbox.claim(connection, outer, scope="s"):
            connection.execute("INSERT INTO orders VALUES (%s, 1)", (outer,))
            with inbox.claim(connection, inner, scope="s") as entry:
                connection.execute("INSERT INTO orders VALUES (%s, 2)", (inner,))
            with inbox.claim(connection, inner, scope="s") as again:
                assert again.replayed
                assert again.result is None
            raise ValueError("the outer block fails after the inner ones")
        with inbox.claim(connection, outer, scope="s") as entry:  # runs again
            assert not entry.replayed
            entry.complete("second")
    assert pg_store.get(f"s|{inner}") is None
    assert pg_store.get(f"s|{before}").status is oncely.Status.COMPLETED
    assert pg_store.get(f"s|{outer}").status is oncely.Status.COMPLETED
    ids = [row[0] for row in pg_orders(pg)]
    assert outer not in ids
    assert inner not in ids
    with pg_connect(pg) as connection, connection.transaction():
        with inbox.claim(connection, outer, scope="s") as entry:
            assert entry.result == "second"
        with inbox.claim(connection, before, scope="s") as entry:
            assert entry.replayed
            assert entry.result is None


@pytest.mark.postgres
def test_postgres_a_key_with_a_row_records_even_a_none_outcome(
    pg: tuple[str, str], pg_store: Any
) -> None:
    """A key whose row exists (here a tombstone released by the decorator's path) is claimed in
    progress, not written complete: the block's None outcome is still recorded as completed."""
    inbox = Inbox(pg_store)
    order = f"o-{uuid.uuid4().hex[:8]}"
    claim = pg_store.claim(f"s|{order}", "", lease=timedelta(seconds=30), ttl=timedelta(hours=1))
    assert isinstance(claim, oncely.Acquired)
    pg_store.release(f"s|{order}", claim.token)
    with pg_connect(pg) as connection:
        with connection.transaction(), inbox.claim(connection, order, scope="s") as entry:
            assert not entry.replayed
            assert entry.token == claim.token + 1
        with connection.transaction(), inbox.claim(connection, order, scope="s") as entry:
            assert entry.replayed
            assert entry.result is None
    record = pg_store.get(f"s|{order}")
    assert record.status is oncely.Status.COMPLETED
    assert record.token == claim.token + 1


@pytest.mark.postgres
def test_postgres_in_the_callers_pipeline(pg: tuple[str, str], pg_store: Any) -> None:
    """A connection in pipeline mode: the claim syncs once; the value's UPDATE is queued with
    the caller's own statements and commit, costing no wait of its own."""
    inbox = Inbox(pg_store)
    order = f"o-{uuid.uuid4().hex[:8]}"

    def place(key: str, value: Any) -> Any:
        with (
            connection.pipeline(),
            connection.transaction(),
            inbox.claim(connection, key, scope="s") as entry,
        ):
            if entry.replayed:
                return entry.result
            connection.execute("INSERT INTO orders VALUES (%s, 8)", (key,))
            entry.complete(value)
        return "ran"

    def by_hand(key: str) -> None:  # the same transaction, deduplicated by hand
        with connection.pipeline(), connection.transaction():
            seen = connection.execute("SELECT count(*) FROM orders WHERE id = %s", (key,))
            if seen.fetchone() == (0,):
                connection.execute("INSERT INTO orders VALUES (%s, 8)", (key,))

    with pg_connect(pg) as connection:
        outcome: list[Any] = []
        floor = round_trips(connection, lambda: by_hand(order + "-h"))
        assert round_trips(connection, lambda: outcome.append(place(order, "v"))) == floor + 1
        assert round_trips(connection, lambda: outcome.append(place(order, "v"))) == floor + 1
        assert round_trips(connection, lambda: place(order + "-n", None)) == floor + 1
        with (
            pytest.raises(ValueError),
            connection.pipeline(),
            connection.transaction(),
            inbox.claim(connection, order + "-x", scope="s"),
        ):
            connection.execute("INSERT INTO orders VALUES (%s, 9)", (order + "-x",))
            raise ValueError("rolled back to the claim")
    assert outcome == ["ran", "v"]
    rows = [row for row in pg_orders(pg) if row[0].startswith(order)]
    assert sorted(rows) == [(order, 8), (order + "-h", 8), (order + "-n", 8)]
    assert pg_store.get(f"s|{order}").status is oncely.Status.COMPLETED
    assert pg_store.get(f"s|{order}-x") is None


@pytest.mark.postgres
def test_postgres_record_changed_in_a_pipelined_transaction_fails_it(
    pg: tuple[str, str], pg_store: Any
) -> None:
    """In pipeline mode the value's UPDATE is not waited for: a record changed under the block
    fails the caller's transaction when it syncs, and nothing of it commits."""
    inbox = Inbox(pg_store)
    order = f"o-{uuid.uuid4().hex[:8]}"
    with (
        pg_connect(pg) as connection,
        pytest.raises(psycopg.errors.InvalidTextRepresentation, match="changed"),
        connection.pipeline(),
        connection.transaction(),
        inbox.claim(connection, order, scope="s") as entry,
    ):
        connection.execute("INSERT INTO orders VALUES (%s, 1)", (order,))
        connection.execute("DELETE FROM oncely_records WHERE key = %s", (f"s|{order}",))
        entry.complete("x")
    assert pg_store.get(f"s|{order}") is None
    assert order not in [row[0] for row in pg_orders(pg)]


@pytest.mark.postgres
def test_postgres_async_in_the_callers_pipeline(pg: tuple[str, str], pg_store: Any) -> None:
    inbox = Inbox(pg_store)
    order = f"o-{uuid.uuid4().hex[:8]}"
    base, schema = pg

    async def place() -> Any:
        async with await psycopg.AsyncConnection.connect(base) as connection:
            await connection.execute(f'SET search_path TO "{schema}"')
            async with (
                connection.pipeline(),
                connection.transaction(),
                inbox.aclaim(connection, order, scope="s") as entry,
            ):
                if entry.replayed:
                    return entry.result
                await connection.execute("INSERT INTO orders VALUES (%s, 3)", (order,))
                entry.complete("async")
            return "ran"

    assert asyncio.run(place()) == "ran"
    assert asyncio.run(place()) == "async"
    assert [row for row in pg_orders(pg) if row[0] == order] == [(order, 3)]


@pytest.mark.postgres
def test_postgres_claim_begins_the_transaction_psycopg_would(
    pg: tuple[str, str], pg_store: Any
) -> None:
    """A connection out of autocommit whose transaction has not begun yet (Django's
    ``atomic``, a bare psycopg connection) has it begun by the claim, as psycopg would (its
    isolation level included), in the claim's one round trip; it ends with the caller's."""
    inbox = Inbox(pg_store)
    order = f"o-{uuid.uuid4().hex[:8]}"

    def claim() -> None:
        with inbox.claim(connection, order, scope="begun") as entry:
            assert not entry.replayed

    with pg_connect(pg) as connection:
        connection.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        assert connection.info.transaction_status is psycopg.pq.TransactionStatus.IDLE
        assert round_trips(connection, claim) == 1
        assert connection.info.transaction_status is psycopg.pq.TransactionStatus.INTRANS
        level = connection.execute("SHOW transaction_isolation").fetchone()
        assert level == ("repeatable read",)
        connection.rollback()
    assert pg_store.get(f"begun|{order}") is None  # rolled back with the caller's transaction


@pytest.mark.postgres
@FORMS
def test_postgres_store_without_prepare_sends_the_updates_unnamed(
    pg: tuple[str, str], form: str
) -> None:
    """A store made with ``prepare=False`` (behind a pooler): the UPDATE that records the
    block's value is not prepared on the caller's session (the claim is, in its transaction,
    and prepared again when a session does not have it)."""
    base, schema = pg
    order = f"o-{uuid.uuid4().hex[:8]}"
    url = f"{base}{'&' if '?' in base else '?'}schema={schema}&prepare=false"
    with oncely.open_store(url) as store:
        inbox = Inbox(store)
        with pg_connect(pg) as connection:
            for _ in range(2):
                with pg_block(form, inbox, connection, order, scope="np") as entry:
                    if not entry.replayed:
                        entry.complete({"order": order})
            assert entry.replayed
            assert entry.result == {"order": order}
            prepared = connection.execute("SELECT statement FROM pg_prepared_statements")
            assert [text for (text,) in prepared if "SET status" in text] == []


@pytest.mark.postgres
@FORMS
def test_postgres_claim_survives_a_reset_session(
    pg: tuple[str, str], pg_store: Any, form: str
) -> None:
    """The claim is prepared once per session: a session reset behind oncely's back (DISCARD
    ALL, a pooler's other server connection) is prepared again, and one prepared by someone
    else is used as it is, with the caller's transaction intact (the inbox's, begun again)."""
    inbox = Inbox(pg_store)
    order = f"o-{uuid.uuid4().hex[:8]}"
    with pg_connect(pg) as connection:
        place_order_pg(inbox, connection, order, 1, form)
        connection.execute("DEALLOCATE ALL")
        connection.commit()
        if form == "transaction":
            with inbox.transaction(connection, order + "-2", scope="orders.place") as entry:
                assert not entry.replayed
                connection.execute("INSERT INTO orders VALUES (%s, 2)", (order + "-before",))
                entry.complete("after a reset")
        else:
            with connection.transaction():
                connection.execute("INSERT INTO orders VALUES (%s, 2)", (order + "-before",))
                with inbox.claim(connection, order + "-2", scope="orders.place") as entry:
                    assert not entry.replayed
                    entry.complete("after a reset")
        with pg_connect(pg) as other:  # a session that has it, unknown to oncely's bookkeeping
            name = inbox._driver._statements.claim  # type: ignore[attr-defined]
            other.execute(inbox._driver._statements.prepare)  # type: ignore[attr-defined]
            assert other.execute(
                "SELECT count(*) FROM pg_prepared_statements WHERE name = %s", (name,)
            ).fetchone() == (1,)
            other.commit()
            place_order_pg(inbox, other, order + "-3", 3, form)
            assert place_order_pg(inbox, other, order + "-3", 3, form)["order"] == order + "-3"
    assert pg_store.get(f"orders.place|{order}-2").status is oncely.Status.COMPLETED
    ids = [row[0] for row in pg_orders(pg)]
    assert order + "-before" in ids
    assert order + "-3" in ids


@pytest.mark.postgres
@pytest.mark.parametrize("encoding", ["UTF8", "LATIN1"])
def test_postgres_keys_and_scopes_travel_as_literals(
    pg: tuple[str, str], pg_store: Any, encoding: str
) -> None:
    """The claim's parameters are data: quotes, backslashes and statement separators in a
    key, and any text in a scope, whether they go bound in binary (a UTF-8 connection, libpq's
    path) or as literals escaped by libpq (another client encoding, the cursor's path)."""
    inbox = Inbox(pg_store)
    order = f"o'; DELETE FROM orders; --\\{uuid.uuid4().hex[:8]}-{encoding}"
    scope = "ordérs ' \\ ;"
    with pg_connect(pg) as connection:
        connection.execute(f"SET client_encoding TO {encoding}")
        connection.commit()
        for _ in range(2):
            with (
                connection.transaction(),
                inbox.claim(connection, order, scope=scope, fingerprint="f'\\") as entry,
            ):
                if not entry.replayed:
                    connection.execute("INSERT INTO orders VALUES (%s, 6)", (order,))
                    entry.complete({"order": order})
        assert entry.replayed
        assert entry.result == {"order": order}
    assert pg_store.get(f"{scope}|{order}").status is oncely.Status.COMPLETED
    assert (order, 6) in pg_orders(pg)


@pytest.mark.postgres
@FORMS
def test_postgres_the_same_key_claimed_inside_its_own_block_is_in_progress(
    pg: tuple[str, str], pg_store: Any, form: str
) -> None:
    """A block's own key claimed again inside it (a re-entrant handler) is in progress: it never
    replays the provisional record, which would hand out an outcome the block has not made."""
    inbox = Inbox(pg_store)
    order = f"o-{uuid.uuid4().hex[:8]}"
    with (
        pg_connect(pg) as connection,
        pg_block(form, inbox, connection, order, scope="s") as entry,
    ):
        with pytest.raises(oncely.InProgressError), inbox.claim(connection, order, scope="s"):
            raise AssertionError("the nested block never runs")
        connection.execute("INSERT INTO orders VALUES (%s, 1)", (order,))
        entry.complete("made")
    with (
        pg_connect(pg) as connection,
        connection.transaction(),
        inbox.claim(connection, order, scope="s") as entry,
    ):
        assert entry.replayed
        assert entry.result == "made"


@pytest.mark.postgres
def test_postgres_async_the_same_key_claimed_inside_its_own_block_is_in_progress(
    pg: tuple[str, str], pg_store: Any
) -> None:
    inbox = Inbox(pg_store)
    order = f"o-{uuid.uuid4().hex[:8]}"

    async def place() -> None:
        async with await psycopg.AsyncConnection.connect(pg[0]) as connection:
            await connection.execute(f'SET search_path TO "{pg[1]}"')
            async with (
                connection.transaction(),
                inbox.aclaim(connection, order, scope="s") as entry,
            ):
                with pytest.raises(oncely.InProgressError):
                    async with inbox.aclaim(connection, order, scope="s"):
                        raise AssertionError("the nested block never runs")
                entry.complete("made")

    asyncio.run(place())
    assert pg_store.get(f"s|{order}").status is oncely.Status.COMPLETED


def test_sqlite_the_same_key_claimed_inside_its_own_block_is_in_progress(
    sqlite_path: Path,
) -> None:
    store = oncely.open_store(f"sqlite:///{sqlite_path}")
    inbox = Inbox(store)
    connection = sqlite_connect(sqlite_path)
    connection.execute("BEGIN IMMEDIATE")
    with inbox.claim(connection, "o-1", scope="s") as entry:
        with pytest.raises(oncely.InProgressError), inbox.claim(connection, "o-1", scope="s"):
            raise AssertionError("the nested block never runs")
        entry.complete("made")
    connection.execute("COMMIT")
    assert store.get("s|o-1").status is oncely.Status.COMPLETED
    store.close()


def _until_busy(connection: Any) -> None:
    """Wait until *connection* has a statement in flight (libpq's transaction status ACTIVE)."""
    for _ in range(2000):
        if connection.info.transaction_status == psycopg.pq.TransactionStatus.ACTIVE:
            return
        threading.Event().wait(0.005)
    raise AssertionError("the other statement never started")


@pytest.mark.postgres
def test_postgres_claim_waits_for_another_threads_statement_on_the_connection(
    pg: tuple[str, str], pg_store: Any
) -> None:
    # psycopg connections are thread-safe (statements are serialised by the connection's lock):
    # the inbox's own libpq path must take that lock too, not send beside a statement in flight.
    inbox = Inbox(pg_store)
    order = f"o-{uuid.uuid4().hex[:8]}"
    with pg_connect(pg) as connection, connection.transaction():
        other = threading.Thread(target=connection.execute, args=("SELECT pg_sleep(0.3)",))
        other.start()
        try:
            _until_busy(connection)
            with inbox.claim(connection, order, scope="shared") as entry:
                assert not entry.replayed
                connection.execute("INSERT INTO orders VALUES (%s, 7)", (order,))
                entry.complete("done")
        finally:
            other.join()
    assert [row for row in pg_orders(pg) if row[0] == order] == [(order, 7)]
    assert pg_store.get(f"shared|{order}").status is oncely.Status.COMPLETED


@pytest.mark.postgres
def test_postgres_async_claim_waits_for_another_tasks_statement_on_the_connection(
    pg: tuple[str, str], pg_store: Any
) -> None:
    inbox = Inbox(pg_store)
    order = f"o-{uuid.uuid4().hex[:8]}"
    base, schema = pg

    async def place() -> None:
        async with await psycopg.AsyncConnection.connect(base) as connection:
            await connection.execute(f'SET search_path TO "{schema}"')
            async with connection.transaction():
                other = asyncio.create_task(connection.execute("SELECT pg_sleep(0.3)"))
                for _ in range(2000):
                    if connection.info.transaction_status == psycopg.pq.TransactionStatus.ACTIVE:
                        break
                    await asyncio.sleep(0.005)
                async with inbox.aclaim(connection, order, scope="shared") as entry:
                    assert not entry.replayed
                    await connection.execute("INSERT INTO orders VALUES (%s, 8)", (order,))
                    entry.complete("done")
                await other

    asyncio.run(place())
    assert [row for row in pg_orders(pg) if row[0] == order] == [(order, 8)]
