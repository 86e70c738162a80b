"""`Inbox.transaction`: the inbox opens the transaction, claims in it, and ends it.

The behaviours it shares with `Inbox.claim` run in both forms in test_inbox.py; here, what only
a transaction the inbox owns does: its round trips, how it ends (commit, rollback, a commit that
fails, a connection lost), the connections it takes and refuses, a process killed inside it.
Real PostgreSQL (psycopg sync and async) and SQLite files.
"""

from __future__ import annotations

import asyncio
import contextvars
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import pq

import oncely
from oncely.inbox import Inbox
from oncely.testing import disabled
from tests._proxy import Proxy
from tests.test_inbox import (
    Declined,
    pg,
    pg_connect,
    pg_orders,
    pg_store,
    round_trips,
    sqlite_connect,
    sqlite_path,
)

__all__ = ["pg", "pg_store", "sqlite_path"]  # the fixtures, shared with test_inbox.py

IDLE = pq.TransactionStatus.IDLE


def new_order() -> str:
    return f"o-{uuid.uuid4().hex[:8]}"


# -- round trips ----------------------------------------------------------------------------------


@pytest.mark.postgres
def test_two_round_trips_for_every_outcome(pg: tuple[str, str], pg_store: Any) -> None:
    """BEGIN and the claim are one round trip; the outcome and COMMIT one more, whatever it is:
    a value, none, a replay, a block that raises (ROLLBACK), a final error."""
    inbox = Inbox(pg_store, final_errors=(Declined,))
    order = new_order()

    def run(key: str, value: Any = None, error: BaseException | None = None) -> None:
        try:
            with inbox.transaction(connection, key, scope="s") as entry:
                if not entry.replayed and value is not None:
                    entry.complete(value)
                if error is not None:
                    raise error
        except (ValueError, Declined):
            pass

    with pg_connect(pg) as connection:
        run(order + "-warm", "x")  # the session's first claim prepares its statements
        assert round_trips(connection, lambda: run(order, "done")) == 2
        assert round_trips(connection, lambda: run(order)) == 2  # the replay's COMMIT
        assert round_trips(connection, lambda: run(order + "-none")) == 2
        assert round_trips(connection, lambda: run(order + "-x", error=ValueError())) == 2
        assert round_trips(connection, lambda: run(order + "-f", error=Declined("no"))) == 2
        assert connection.info.transaction_status == IDLE
    assert pg_store.get(f"s|{order}").status is oncely.Status.COMPLETED
    assert pg_store.get(f"s|{order}-none").status is oncely.Status.COMPLETED
    assert pg_store.get(f"s|{order}-x") is None
    assert pg_store.get(f"s|{order}-f").status is oncely.Status.FAILED


# -- the connections it takes ---------------------------------------------------------------------


@pytest.mark.postgres
@pytest.mark.parametrize("autocommit", [False, True], ids=["transactional", "autocommit"])
def test_a_nested_psycopg_transaction_is_a_savepoint(
    pg: tuple[str, str], pg_store: Any, autocommit: bool
) -> None:
    """psycopg sees the inbox's transaction: ``connection.transaction()`` inside the block is
    a savepoint (its rollback undoes only its part), and the connection is idle afterwards."""
    inbox = Inbox(pg_store)
    order = new_order()
    with pg_connect(pg) as connection:
        connection.autocommit = autocommit
        with inbox.transaction(connection, order, scope="s") as entry:
            connection.execute("INSERT INTO orders VALUES (%s, 1)", (order,))
            with pytest.raises(ValueError), connection.transaction():
                connection.execute("INSERT INTO orders VALUES (%s, 2)", (order + "-inner",))
                raise ValueError("the savepoint only")
            with connection.transaction():
                connection.execute("INSERT INTO orders VALUES (%s, 3)", (order + "-kept",))
            entry.complete("placed")
        assert connection.info.transaction_status == IDLE
        assert connection.execute("SELECT 1").fetchone() == (1,)
    ids = [row[0] for row in pg_orders(pg)]
    assert order in ids
    assert order + "-kept" in ids
    assert order + "-inner" not in ids
    assert pg_store.get(f"s|{order}").status is oncely.Status.COMPLETED


@pytest.mark.postgres
def test_the_connections_isolation_level_is_kept(pg: tuple[str, str], pg_store: Any) -> None:
    inbox = Inbox(pg_store)
    with pg_connect(pg) as connection:
        connection.isolation_level = psycopg.IsolationLevel.SERIALIZABLE
        with inbox.transaction(connection, new_order(), scope="s"):
            level = connection.execute("SHOW transaction_isolation").fetchone()
    assert level == ("serializable",)


@pytest.mark.postgres
def test_connections_it_refuses(pg: tuple[str, str], pg_store: Any) -> None:
    inbox = Inbox(pg_store)
    with pg_connect(pg) as connection:
        connection.execute("SELECT 1")  # psycopg began a transaction
        with pytest.raises(oncely.ConfigurationError, match=r"in a transaction already.*claim"):
            inbox.transaction(connection, "k", scope="s")
        connection.rollback()
        with connection.transaction(), pytest.raises(oncely.ConfigurationError, match="claim"):
            inbox.transaction(connection, "k", scope="s")
        with connection.pipeline(), pytest.raises(oncely.ConfigurationError, match="pipeline"):
            inbox.transaction(connection, "k", scope="s")
        with pytest.raises(oncely.ConfigurationError, match="claim"):
            inbox.transaction(connection.cursor(), "k", scope="s")
        with pytest.raises(oncely.ConfigurationError, match="AsyncConnection"):
            asyncio.run(_enter_async(inbox, connection))
        assert connection.info.transaction_status == IDLE


@pytest.mark.postgres
def test_a_client_encoding_other_than_utf8_is_refused(pg: tuple[str, str], pg_store: Any) -> None:
    with pg_connect(pg) as connection:
        connection.execute("SET client_encoding TO 'LATIN1'")
        connection.commit()
        with pytest.raises(oncely.ConfigurationError, match="UTF-8"):
            Inbox(pg_store).transaction(connection, "k", scope="s")


async def _enter_async(inbox: Inbox, connection: Any) -> None:
    async with inbox.atransaction(connection, "k", scope="s"):
        raise AssertionError("never runs")


@pytest.mark.postgres
def test_a_sqlalchemy_session_is_refused(pg: tuple[str, str], pg_store: Any) -> None:
    sqlalchemy = pytest.importorskip("sqlalchemy")
    from sqlalchemy.orm import Session

    engine = sqlalchemy.create_engine(pg[0].replace("postgresql://", "postgresql+psycopg://", 1))
    with (
        Session(engine) as session,
        pytest.raises(oncely.ConfigurationError, match=r"Inbox\.claim"),
    ):
        Inbox(pg_store).transaction(session, "k", scope="s")
    engine.dispose()


def test_sqlite_connections_it_refuses(sqlite_path: Path) -> None:
    store = oncely.open_store(f"sqlite:///{sqlite_path}")
    connection = sqlite_connect(sqlite_path)
    connection.execute("BEGIN")
    with pytest.raises(oncely.ConfigurationError, match=r"in a transaction already.*claim"):
        Inbox(store).transaction(connection, "k", scope="s")
    connection.execute("ROLLBACK")
    with pytest.raises(oncely.ConfigurationError, match="claim"):
        Inbox(store).transaction(connection.cursor(), "k", scope="s")
    store.close()


@pytest.mark.postgres
def test_async(pg: tuple[str, str], pg_store: Any) -> None:
    """`atransaction`: a value committed, a replay, a block that raises, a final error."""
    inbox = Inbox(pg_store, final_errors=(Declined,))
    order = new_order()
    base, schema = pg

    async def run() -> list[Any]:
        seen: list[Any] = []
        async with await psycopg.AsyncConnection.connect(base, autocommit=True) as connection:
            await connection.execute(f'SET search_path TO "{schema}"')
            for _ in range(2):
                async with inbox.atransaction(connection, order, scope="s") as entry:
                    if entry.replayed:
                        seen.append(entry.result)
                    else:
                        await connection.execute("INSERT INTO orders VALUES (%s, 1)", (order,))
                        entry.complete("async")
            with pytest.raises(ValueError):
                async with inbox.atransaction(connection, order + "-x", scope="s"):
                    await connection.execute("INSERT INTO orders VALUES (%s, 1)", (order + "-x",))
                    raise ValueError("rolled back")
            with pytest.raises(Declined):
                async with inbox.atransaction(connection, order + "-f", scope="s"):
                    raise Declined("declined")
            seen.append(connection.info.transaction_status)
        return seen

    assert asyncio.run(run()) == ["async", IDLE]
    ids = [row[0] for row in pg_orders(pg)]
    assert order in ids
    assert order + "-x" not in ids
    assert pg_store.get(f"s|{order}-x") is None
    assert pg_store.get(f"s|{order}-f").status is oncely.Status.FAILED


# -- how it ends ----------------------------------------------------------------------------------


@pytest.mark.postgres
def test_a_commit_that_fails_raises_the_drivers_error(pg: tuple[str, str], pg_store: Any) -> None:
    """A deferred constraint fails the COMMIT: psycopg's error propagates, nothing is kept, the
    connection is idle, and a retry runs."""
    inbox = Inbox(pg_store)
    order = new_order()
    table = f"deferred_{uuid.uuid4().hex[:8]}"
    with pg_connect(pg) as connection:
        connection.execute(
            f"CREATE TABLE {table} (id text PRIMARY KEY DEFERRABLE INITIALLY DEFERRED)"
        )
        connection.execute(f"INSERT INTO {table} VALUES ('taken')")
        connection.commit()
        for value in ("x", None):
            with (
                pytest.raises(psycopg.errors.UniqueViolation),
                inbox.transaction(connection, order, scope="s") as entry,
            ):
                connection.execute(f"INSERT INTO {table} VALUES ('taken')")
                entry.complete(value)
            assert connection.info.transaction_status == IDLE
            assert pg_store.get(f"s|{order}") is None
        with inbox.transaction(connection, order, scope="s") as entry:
            assert not entry.replayed
        connection.execute(f"DROP TABLE {table}")
        connection.commit()


@pytest.mark.postgres
@pytest.mark.parametrize("cut", ["request", "reply"])
def test_a_connection_lost_at_the_commit(pg: tuple[str, str], pg_store: Any, cut: str) -> None:
    """The COMMIT's request never arrives (nothing committed: a retry runs), or its reply is
    lost (committed: a retry replays). Either way the driver's error propagates."""
    inbox = Inbox(pg_store)
    order = new_order()
    proxy = Proxy(int(psycopg.conninfo.conninfo_to_dict(pg[0]).get("port") or 5432))
    url = psycopg.conninfo.make_conninfo(pg[0], host="127.0.0.1", port=proxy.port)
    try:
        with psycopg.connect(url) as connection:
            connection.execute(f'SET search_path TO "{pg[1]}"')
            connection.commit()
            if cut == "request":
                proxy.arm(b"COMMIT", request=True)
            else:
                proxy.cut_reply(b"COMMIT")
            with (
                pytest.raises(psycopg.OperationalError),
                inbox.transaction(connection, order, scope="s") as entry,
            ):
                connection.execute("INSERT INTO orders VALUES (%s, 1)", (order,))
                entry.complete("placed")
    finally:
        proxy.down()
    with pg_connect(pg) as connection, inbox.transaction(connection, order, scope="s") as entry:
        assert entry.replayed is (cut == "reply")
    assert (order in [row[0] for row in pg_orders(pg)]) is (cut == "reply")


@pytest.mark.postgres
def test_a_lock_wait_that_times_out_ends_the_transaction(
    pg: tuple[str, str], pg_store: Any
) -> None:
    """A duplicate waits for the transaction holding the key, up to ``wait_timeout``: then
    InProgressError, its transaction rolled back, the connection usable."""
    inbox = Inbox(pg_store, wait_timeout=0.3)
    order = new_order()
    with (
        pg_connect(pg) as holder,
        inbox.transaction(holder, order, scope="s") as entry,
        pg_connect(pg) as other,
    ):
        with (
            pytest.raises(oncely.InProgressError),
            inbox.transaction(other, order, scope="s"),
        ):
            raise AssertionError("never runs")
        assert other.info.transaction_status == IDLE
        assert other.execute("SHOW lock_timeout").fetchone() == ("0",)
        entry.complete("held")
    assert pg_store.get(f"s|{order}").status is oncely.Status.COMPLETED


@pytest.mark.postgres
def test_a_block_that_ends_the_transaction_itself_is_refused(
    pg: tuple[str, str], pg_store: Any
) -> None:
    inbox = Inbox(pg_store)
    with pg_connect(pg) as connection:
        with (
            pytest.raises(oncely.OncelyError, match="ended inside its block"),
            inbox.transaction(connection, new_order(), scope="s"),
        ):
            connection.rollback()
        assert connection.info.transaction_status == IDLE


@pytest.mark.postgres
def test_disabled_still_runs_the_block_in_a_transaction(pg: tuple[str, str], pg_store: Any) -> None:
    inbox = Inbox(pg_store)
    order = new_order()
    with pg_connect(pg) as connection, disabled():
        with pytest.raises(ValueError), inbox.transaction(connection, order, scope="s"):
            connection.execute("INSERT INTO orders VALUES (%s, 1)", (order + "-x",))
            raise ValueError("rolled back")
        with inbox.transaction(connection, order, scope="s") as entry:
            connection.execute("INSERT INTO orders VALUES (%s, 1)", (order,))
            entry.complete("x")
        assert connection.info.transaction_status == IDLE
    assert pg_store.get(f"s|{order}") is None
    ids = [row[0] for row in pg_orders(pg)]
    assert order in ids
    assert order + "-x" not in ids


# -- a process killed between the claim and the commit ---------------------------------------------

CRASH = """
import sys, time
import psycopg
import oncely

base, schema, order = sys.argv[1:]
store = oncely.open_store(base + ("&" if "?" in base else "?") + "schema=" + schema)
connection = psycopg.connect(base)
connection.execute(f'SET search_path TO "{schema}"')
connection.commit()
with oncely.Inbox(store).transaction(connection, order, scope="s") as entry:
    connection.execute("INSERT INTO orders VALUES (%s, 1)", (order,))
    entry.complete("placed")
    print("claimed", flush=True)
    time.sleep(60)  # killed here: after the claim and the writes, before the commit
"""


@pytest.mark.postgres
def test_a_process_killed_before_the_commit_leaves_nothing(
    pg: tuple[str, str], pg_store: Any
) -> None:
    order = new_order()
    command = [sys.executable, "-c", CRASH, pg[0], pg[1], order]
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as process:
        try:
            assert process.stdout is not None
            assert process.stdout.readline().strip() == "claimed"
        finally:
            process.send_signal(signal.SIGKILL)
            process.wait(30)
    ran = []
    for _ in range(2):  # the retry waits for the dead session's rollback, then runs, once
        with (
            pg_connect(pg) as connection,
            Inbox(pg_store, wait_timeout=20).transaction(connection, order, scope="s") as entry,
        ):
            if not entry.replayed:
                connection.execute("INSERT INTO orders VALUES (%s, 2)", (order,))
                entry.complete("retried")
                ran.append(order)
            else:
                assert entry.result == "retried"
    assert ran == [order]
    assert [row for row in pg_orders(pg) if row[0] == order] == [(order, 2)]


def test_sqlite_lease_lost_and_rollback_end_the_transaction(sqlite_path: Path) -> None:
    store = oncely.open_store(f"sqlite:///{sqlite_path}")
    inbox = Inbox(store)
    connection = sqlite_connect(sqlite_path)
    with pytest.raises(oncely.LeaseLostError), inbox.transaction(connection, "o-l", scope="s"):
        connection.execute("INSERT INTO orders VALUES ('o-l', 1)")
        connection.execute("DELETE FROM oncely_records")
    assert not connection.in_transaction
    with pytest.raises(ValueError), inbox.transaction(connection, "o-r", scope="s"):
        connection.execute("INSERT INTO orders VALUES ('o-r', 1)")
        raise ValueError("rolled back")
    assert not connection.in_transaction
    assert connection.execute("SELECT count(*) FROM orders").fetchone() == (0,)
    assert store.get("s|o-r") is None
    store.close()


@pytest.mark.postgres
def test_a_claim_cancelled_while_it_waits_ends_the_transaction(
    pg: tuple[str, str], pg_store: Any
) -> None:
    """A task cancelled while its claim waits for the transaction holding the key: the inbox's
    transaction is not left open on the connection."""
    inbox = Inbox(pg_store, wait_timeout=20)
    order = new_order()
    base, schema = pg

    async def run() -> Any:
        async with (
            await psycopg.AsyncConnection.connect(base, autocommit=True) as holder,
            await psycopg.AsyncConnection.connect(base, autocommit=True) as other,
        ):
            for connection in (holder, other):
                await connection.execute(f'SET search_path TO "{schema}"')
            async with inbox.atransaction(holder, order, scope="s") as entry:
                duplicate = _enter_and_hold(inbox, other, order)  # as another worker would:
                waiting = asyncio.create_task(duplicate, context=contextvars.Context())
                await asyncio.sleep(0.5)  # the duplicate waits in its claim
                waiting.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await waiting
                entry.complete("held")
            status = other.info.transaction_status
            await other.execute("SELECT 1")  # usable
            return status

    assert asyncio.run(run()) == IDLE
    assert pg_store.get(f"s|{order}").status is oncely.Status.COMPLETED


async def _enter_and_hold(inbox: Inbox, connection: Any, key: str) -> None:
    async with inbox.atransaction(connection, key, scope="s"):
        raise AssertionError("never runs: cancelled while waiting")


@pytest.mark.postgres
def test_claims_inside_the_inbox_transaction(pg: tuple[str, str], pg_store: Any) -> None:
    """`claim` inside `transaction`'s block is a claim in a transaction the caller (here the
    inbox) owns: its block's error undoes only that claim; the outer transaction commits."""
    inbox = Inbox(pg_store, final_errors=(Declined,))
    outer, inner, failed = new_order(), new_order(), new_order()
    with pg_connect(pg) as connection:
        with inbox.transaction(connection, outer, scope="s") as entry:
            with inbox.claim(connection, inner, scope="s") as nested:
                nested.complete("inner")
            with pytest.raises(ValueError), inbox.claim(connection, failed, scope="s"):
                connection.execute("INSERT INTO orders VALUES (%s, 1)", (failed,))
                raise ValueError("undone alone")
            connection.execute("INSERT INTO orders VALUES (%s, 1)", (outer,))
            entry.complete("outer")
        assert connection.info.transaction_status == IDLE
    assert pg_store.get(f"s|{outer}").status is oncely.Status.COMPLETED
    assert pg_store.get(f"s|{inner}").status is oncely.Status.COMPLETED
    assert pg_store.get(f"s|{failed}") is None
    ids = [row[0] for row in pg_orders(pg)]
    assert outer in ids
    assert failed not in ids
