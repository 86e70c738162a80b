"""The outbox writer and the relay engine on real PostgreSQL and SQLite.

The relay publishes through `FilePublisher`, which appends what it is handed to a file and
fails on request: the relay's behaviour is under test here, not a broker's.
"""

from __future__ import annotations

import asyncio
import sqlite3
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import oncely
from oncely.outbox import Outbox, Relay
from tests._helpers import DJANGO_SQLITE
from tests.outbox._publisher import FilePublisher
from tests.outbox._relaying import FAST, add_events, close, drain, relay_for, until
from tests.outbox.conftest import Db

# -- the writer -----------------------------------------------------------------------------------


def test_committed_event_is_published_once(db: Db, tmp_path: Path) -> None:
    """An event added in a committed transaction is published once, with its fields."""
    outbox = Outbox(db.store())
    with db.transaction() as connection:
        message_id = outbox.add(
            connection, "orders", '{"id": 1}', headers={"type": "placed"}, ordering_key="o-1"
        )
    publisher = FilePublisher(tmp_path / "out")
    relay = relay_for(db, publisher)
    try:
        assert asyncio.run(drain(relay)) == 1
        assert asyncio.run(drain(relay)) == 0
    finally:
        close(relay)
    [published] = publisher.published()
    assert published["message_id"] == message_id
    assert (published["destination"], published["key"], published["payload"]) == (
        "orders",
        "o-1",
        '{"id": 1}',
    )
    assert published["headers"] == {"type": "placed"}
    assert db.states()[message_id] == (True, False, 0, None)
    outbox.store.close()


def test_rolled_back_event_is_never_published(db: Db, tmp_path: Path) -> None:
    outbox = Outbox(db.store())
    with pytest.raises(RuntimeError), db.transaction() as connection:
        outbox.add(connection, "orders", b"lost", ordering_key="k")
        raise RuntimeError("the order failed")
    with db.transaction() as connection:
        kept = outbox.add(connection, "orders", b"kept", ordering_key="k")
    publisher = FilePublisher(tmp_path / "out")
    relay = relay_for(db, publisher)
    try:
        asyncio.run(drain(relay))
    finally:
        close(relay)
    assert [event["message_id"] for event in publisher.published()] == [kept]
    assert list(db.states()) == [kept]
    outbox.store.close()


def test_message_ids_are_unique_and_a_duplicate_leaves_the_transaction_usable(db: Db) -> None:
    outbox = Outbox(db.store())
    with db.transaction() as connection:
        generated = {outbox.add(connection, "d", b"x") for _ in range(3)}
        assert len(generated) == 3
        assert outbox.add(connection, "d", b"x", message_id="pay-1") == "pay-1"
        with pytest.raises(oncely.ConflictError, match="pay-1"):
            outbox.add(connection, "d", b"y", message_id="pay-1", ordering_key="k")
        outbox.add(connection, "d", b"z", ordering_key="k")  # still usable
    assert len(db.states()) == 5
    outbox.store.close()


@pytest.mark.parametrize(
    ("arguments", "error", "match"),
    [
        ({"destination": ""}, oncely.ConfigurationError, "destination"),
        ({"destination": 7}, oncely.ConfigurationError, "destination is a string"),
        ({"destination": "x" * 2000}, oncely.ConfigurationError, "destination"),
        ({"payload": 12}, oncely.ConfigurationError, "bytes or str"),
        ({"payload": None}, oncely.ConfigurationError, "bytes or str"),
        ({"headers": {"a": 1}}, oncely.ConfigurationError, "strings"),
        ({"headers": ["a"]}, oncely.ConfigurationError, "mapping"),
        ({"headers": {"": "v"}}, oncely.ConfigurationError, "empty"),
        ({"headers": {"a": "\x00"}}, oncely.ConfigurationError, "NUL"),
        ({"headers": {"Idempotency-Key": "k"}}, oncely.ConfigurationError, "message_id"),
        ({"ordering_key": ""}, oncely.ConfigurationError, "ordering_key"),
        ({"ordering_key": 3}, oncely.ConfigurationError, "ordering_key"),
        ({"message_id": ""}, oncely.InvalidKeyError, "empty"),
        ({"message_id": "x" * 300}, oncely.InvalidKeyError, "255"),
        ({"message_id": 5}, oncely.InvalidKeyError, "string"),
        ({"message_id": "a\nb"}, oncely.InvalidKeyError, "idempotency key"),
    ],
)
def test_bad_events_are_refused_before_the_database(
    lite: Db, arguments: dict[str, Any], error: type[Exception], match: str
) -> None:
    outbox = Outbox(lite.store())
    call: dict[str, Any] = {"destination": "d", "payload": b"p", **arguments}
    with lite.transaction() as connection, pytest.raises(error, match=match):
        outbox.add(connection, call.pop("destination"), call.pop("payload"), **call)
    assert lite.states() == {}
    outbox.store.close()


def test_no_transaction_is_refused(db: Db) -> None:
    outbox = Outbox(db.store())
    connection = db.connect()
    try:
        with pytest.raises(oncely.ConfigurationError, match="transaction"):
            outbox.add(connection, "d", b"p")
    finally:
        connection.close()
        outbox.store.close()


def test_outbox_and_relay_need_a_shared_sql_store(tmp_path: Path) -> None:
    for store in (oncely.open_store("memory://"), oncely.open_store("sqlite:///:memory:")):
        with pytest.raises(oncely.ConfigurationError):
            Outbox(store)
        with pytest.raises(oncely.ConfigurationError):
            Relay(store, FilePublisher(tmp_path / "out"))
        store.close()


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": True}, "batch_size"),
        ({"max_attempts": 0}, "max_attempts"),
        ({"poll_interval": -1}, "poll_interval"),
        ({"backoff": "soon"}, "backoff"),
        ({"retention": 0}, "retention"),
    ],
)
def test_bad_relay_settings(lite: Db, tmp_path: Path, options: dict[str, Any], match: str) -> None:
    store = lite.store()
    with pytest.raises(oncely.ConfigurationError, match=match):
        Relay(store, FilePublisher(tmp_path / "out"), **options)
    with pytest.raises(oncely.ConfigurationError, match="Publisher"):
        Relay(store, object())  # type: ignore[arg-type]
    store.close()


def test_sqlite_aadd_is_refused(lite: Db) -> None:
    outbox = Outbox(lite.store())
    with lite.transaction() as connection, pytest.raises(oncely.ConfigurationError, match="aadd"):
        asyncio.run(outbox.aadd(connection, "d", b"p"))
    outbox.store.close()


@pytest.mark.postgres
def test_async_psycopg_and_sqlalchemy(pg: Db, tmp_path: Path) -> None:
    """aadd on psycopg's AsyncConnection; add and aadd through SQLAlchemy sessions."""
    import psycopg
    import sqlalchemy
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
    from sqlalchemy.orm import Session

    outbox = Outbox(pg.store())
    dsn = pg.base.replace("postgresql://", "postgresql+psycopg://", 1)

    async def add_async() -> list[str]:
        ids = []
        connection = await psycopg.AsyncConnection.connect(pg.base)
        async with connection, connection.transaction():
            ids.append(await outbox.aadd(connection, "d", b"async", ordering_key="k"))
        engine = create_async_engine(dsn)
        async with AsyncSession(engine) as session, session.begin():
            ids.append(await outbox.aadd(session, "d", b"sa-async", ordering_key="k"))
        await engine.dispose()
        return ids

    ids = asyncio.run(add_async())
    engine = sqlalchemy.create_engine(dsn)
    with Session(engine) as session, session.begin():
        ids.append(outbox.add(session, "d", b"sa", ordering_key="k"))
    with Session(engine) as session:  # rolled back: never published
        session.begin()
        outbox.add(session, "d", b"gone", ordering_key="k")
        session.rollback()
    engine.dispose()
    publisher = FilePublisher(tmp_path / "out")
    relay = relay_for(pg, publisher)
    try:
        asyncio.run(drain(relay))
    finally:
        close(relay)
    assert [event["message_id"] for event in publisher.published()] == ids
    outbox.store.close()


# -- ordering, failures, dead letters, purge ------------------------------------------------------


def test_broker_down_backs_off_counts_nothing_and_catches_up(db: Db, tmp_path: Path) -> None:
    """While the whole publish call fails, nothing is lost or counted; then all goes out."""
    outbox = Outbox(db.store())
    ids = add_events(db, outbox, [("a", "k"), ("b", "k"), ("c", None)])
    publisher = FilePublisher(tmp_path / "out")
    publisher.down = True
    relay = relay_for(db, publisher)

    async def scenario() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(relay.run(stop))
        await until(lambda: publisher.calls >= 3)  # failing, backing off, trying again
        assert publisher.published() == []
        assert all(
            state == (False, False, 0, "ConnectionError: broker unreachable")
            for state in db.states().values()
        )
        publisher.down = False
        await until(lambda: len(publisher.published()) == 3)
        stop.set()
        await task

    try:
        asyncio.run(scenario())
    finally:
        close(relay)
    assert [event["message_id"] for event in publisher.published()] == ids
    assert all(published for published, *_ in db.states().values())
    outbox.store.close()


def test_failed_event_is_retried_after_backoff_in_key_order(db: Db, tmp_path: Path) -> None:
    """An event failing twice is retried after its backoff; its key's later events wait."""
    outbox = Outbox(db.store())
    ids = add_events(db, outbox, [("d", "k"), ("d", "k"), ("d", "k"), ("x", "other")])
    publisher = FilePublisher(tmp_path / "out")
    publisher.fail_times[ids[1]] = 2
    relay = relay_for(db, publisher, backoff=0.05)

    async def scenario() -> None:
        assert await relay.run_once() == 2  # a and x; b failed, c not attempted
        state = db.states()
        assert state[ids[1]][:3] == (False, False, 1)
        assert "Poisoned" in (state[ids[1]][3] or "")
        assert state[ids[2]] == (False, False, 0, None)
        assert await relay.run_once() == 0  # b is backing off, c waits for it
        while len(publisher.published()) < 4:
            await relay.run_once()
            await asyncio.sleep(0.02)

    try:
        asyncio.run(scenario())
    finally:
        close(relay)
    order = [event["message_id"] for event in publisher.published()]
    assert order == [ids[0], ids[3], ids[1], ids[2]]
    assert db.states()[ids[1]][:3] == (True, False, 2)
    outbox.store.close()


def test_a_key_held_up_with_a_long_backlog_does_not_hold_up_the_others(
    db: Db, tmp_path: Path
) -> None:
    """The oldest pending events are one key's, more than a claim looks at first, behind a
    failing head: the events of the other keys, and those without a key, are published."""
    outbox = Outbox(db.store())
    stuck = add_events(db, outbox, [("s", "stuck")] * 12)  # past the first look of batch 2
    others = add_events(db, outbox, [("o", "k1"), ("o", None), ("o", "k2")])
    publisher = FilePublisher(tmp_path / "out")
    publisher.fail_times[stuck[0]] = 1_000
    relay = relay_for(db, publisher, batch_size=2, backoff=60.0, max_backoff=60.0)

    async def scenario() -> None:
        await relay.run_once()  # the head fails, and backs off for a minute
        while len(publisher.published()) < 3:
            assert await relay.run_once() > 0

    try:
        asyncio.run(scenario())
    finally:
        close(relay)
    assert {event["message_id"] for event in publisher.published()} == set(others)
    outbox.store.close()


def test_poison_event_is_dead_lettered_and_its_key_proceeds(
    db: Db, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    outbox = Outbox(db.store())
    ids = add_events(db, outbox, [("d", "k"), ("d", "k"), ("d", "k")])
    publisher = FilePublisher(tmp_path / "out")
    publisher.fail_times[ids[1]] = 1_000
    relay = relay_for(db, publisher, max_attempts=3, backoff=0.001, max_backoff=0.001)

    async def scenario() -> None:
        while len(publisher.published()) < 2:
            await relay.run_once()
            await asyncio.sleep(0.005)

    try:
        with caplog.at_level("ERROR", logger="oncely.outbox"):
            asyncio.run(scenario())
    finally:
        close(relay)
    assert [event["message_id"] for event in publisher.published()] == [ids[0], ids[2]]
    published, dead, attempts, error = db.states()[ids[1]]
    assert (published, dead, attempts) == (False, True, 3)
    assert error == f"Poisoned: cannot publish {ids[1]}"
    assert any("dead-lettered after 3 attempts" in record.message for record in caplog.records)
    outbox.store.close()


def test_purge_deletes_old_published_events_only(db: Db, tmp_path: Path) -> None:
    outbox = Outbox(db.store())
    ids = add_events(db, outbox, [("a", "k"), ("b", "k"), ("c", None), ("d", "other")])
    publisher = FilePublisher(tmp_path / "out")
    publisher.poison.add("d")
    relay = relay_for(db, publisher, retention=3600, max_attempts=1)
    try:
        asyncio.run(drain(relay))
        backdate = (
            "UPDATE {table} SET published_at = published_at - interval '2 hours' "
            if db.kind == "postgres"
            else "UPDATE {table} SET published_at_ms = published_at_ms - 7200000 "
        )
        db.execute(backdate + f"WHERE message_id IN ('{ids[0]}', '{ids[2]}')")
        assert asyncio.run(relay.purge()) == 2
        assert asyncio.run(relay.purge()) == 0
    finally:
        close(relay)
    assert sorted(db.states()) == sorted([ids[1], ids[3]])  # recent, and the dead letter
    # The next event of a purged key still comes after nothing pending: a new head.
    later = add_events(db, outbox, [("e", "k")])
    relay = relay_for(db, FilePublisher(tmp_path / "out2"))
    try:
        assert asyncio.run(drain(relay)) == 1
    finally:
        close(relay)
    assert db.states()[later[0]][0]
    outbox.store.close()


def test_outbox_tables_come_with_migrate(lite: Db) -> None:
    with sqlite3.connect(lite.path) as connection:
        tables = {row[0] for row in connection.execute("SELECT name FROM sqlite_master")}
    assert {"oncely_outbox", "oncely_outbox_keys", "oncely_records"} <= tables


def test_events_keep_their_order_across_batches(db: Db, tmp_path: Path) -> None:
    """A batch smaller than a key's backlog: the key continues in the next batch."""
    outbox = Outbox(db.store())
    ids = add_events(db, outbox, [(f"e{i}", f"k{i % 2}") for i in range(7)])
    publisher = FilePublisher(tmp_path / "out")
    relay = relay_for(db, publisher, batch_size=2)
    try:
        assert asyncio.run(drain(relay)) == 7
    finally:
        close(relay)
    for key in ("k0", "k1"):
        sent = [event["message_id"] for event in publisher.published() if event["key"] == key]
        assert sent == [ids[i] for i in range(7) if f"k{i % 2}" == key]
    outbox.store.close()


@pytest.mark.postgres
@pytest.mark.parametrize("keys", [4, 1200])
def test_claiming_a_backlog_reads_less_than_a_page_per_pending_event(pg: Db, keys: int) -> None:
    """Finding the heads of 1200 pending events reads fewer pages than there are events, with
    a few keys with deep backlogs (testing each event against its key's others read three per
    event, so a relay catching up fell behind quadratically) as with a key per event (skipping
    from key to key through the index would take a descent per key)."""
    from oncely.stores.postgres._outbox import PostgresQueries

    outbox = Outbox(pg.store())
    with pg.transaction() as connection:
        for number in range(1200):
            outbox.add(connection, "d", b"x", ordering_key=f"k{number % keys}")
    heads = PostgresQueries(pg.schema).heads
    with pg.transaction() as connection:
        connection.execute(f'ANALYZE "{pg.schema}".oncely_outbox')
        plan = connection.execute(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + heads, {"limit": 100, "window": 400}
        ).fetchone()[0][0]["Plan"]
    assert plan["Actual Rows"] == min(keys, 100)  # one head per key
    assert plan["Shared Hit Blocks"] + plan["Shared Read Blocks"] < 1200
    outbox.store.close()


@pytest.mark.postgres
@pytest.mark.parametrize("keys", [4, 1200])
@pytest.mark.parametrize(
    ("statement", "arguments"), [("claim", "100, 400"), ("claim_first", "100")]
)
def test_a_prepared_claim_reads_a_backlog_through_indexes(
    pg: Db, keys: int, statement: str, arguments: str
) -> None:
    """The claim is a prepared statement, which PostgreSQL plans generically after a few runs:
    that plan too reads less than a page per pending event and returns a full batch (a limit
    computed in the statement once made the generic plan sort every pending event). So does
    the claim's first try."""
    from oncely.stores.postgres._outbox import PostgresQueries

    outbox = Outbox(pg.store())
    with pg.transaction() as connection:
        for number in range(1200):
            outbox.add(connection, "d", b"x", ordering_key=f"k{number % keys}")
    claim = getattr(PostgresQueries(pg.schema), statement)
    claim = claim.replace("%(limit)s", "$1::bigint").replace("%(window)s", "$2::bigint")
    with pg.transaction() as connection:
        connection.execute(f'ANALYZE "{pg.schema}".oncely_outbox')
        connection.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        connection.execute("PREPARE claim AS " + claim)
        plan = connection.execute(
            f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE claim({arguments})"
        ).fetchone()[0][0]["Plan"]
        connection.execute("DEALLOCATE claim")
    assert plan["Actual Rows"] == 100
    assert plan["Shared Hit Blocks"] + plan["Shared Read Blocks"] < 1200
    assert "oncely_outbox" not in _seq_scans(plan)
    outbox.store.close()


def _seq_scans(plan: dict[str, Any]) -> list[str]:
    """The relations *plan* (EXPLAIN's JSON) reads whole."""
    own = [plan["Relation Name"]] if plan["Node Type"] == "Seq Scan" else []
    return own + [name for child in plan.get("Plans", []) for name in _seq_scans(child)]


class _Stuck:
    """A publisher whose calls never return, until cancelled."""

    def __init__(self) -> None:
        self.calls = 0

    async def publish(self, events: Any) -> Any:
        self.calls += 1
        await asyncio.Event().wait()

    async def aclose(self) -> None:
        pass


def test_a_cycle_cancelled_mid_publish_leaves_its_batch_pending_and_the_relay_usable(
    db: Db, tmp_path: Path
) -> None:
    """Cancelling `run_once` while the publisher holds the batch lets go of the claim (rolls
    back on PostgreSQL) and records nothing: the next cycle publishes the whole batch."""
    outbox = Outbox(db.store())
    ids = add_events(db, outbox, [("a", "k"), ("b", "k"), ("c", None)])
    stuck = _Stuck()
    relay = Relay(db.store(), stuck, **FAST)
    publisher = FilePublisher(tmp_path / "out")

    async def scenario() -> None:
        task = asyncio.create_task(relay.run_once())
        await until(lambda: stuck.calls == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert all(state == (False, False, 0, None) for state in db.states().values())
        relay.publisher = publisher
        assert await drain(relay) == 3

    try:
        asyncio.run(scenario())
    finally:
        close(relay)
    assert [event["message_id"] for event in publisher.published()] == ids
    if db.kind == "postgres":
        idle = db.query(
            "SELECT count(*) FROM pg_stat_activity "
            f"WHERE state LIKE 'idle in transaction%' AND query LIKE '%{db.schema}%'"
        )
        assert idle == [(0,)]
    outbox.store.close()


def test_relay_run_stops_when_asked(db: Db, tmp_path: Path) -> None:
    publisher = FilePublisher(tmp_path / "out")
    relay = relay_for(db, publisher, poll_interval=timedelta(hours=1))

    async def scenario() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(relay.run(stop))
        await asyncio.sleep(0.05)
        stop.set()
        await asyncio.wait_for(task, 10)

    try:
        asyncio.run(scenario())
    finally:
        close(relay)


DJANGO_APP = (
    DJANGO_SQLITE
    + """

outbox = oncely.Outbox(oncely.open_store("sqlite:///" + sys.argv[1]))
with transaction.atomic():
    print(outbox.add(connection, "orders", b"kept", message_id="m-kept", ordering_key="k"))
try:
    with transaction.atomic():
        outbox.add(connection, "orders", b"lost", message_id="m-lost", ordering_key="k")
        raise RuntimeError
except RuntimeError:
    pass
try:
    outbox.add(connection, "orders", b"x")
except oncely.ConfigurationError as exc:
    print("outside atomic:", "atomic" in str(exc))
"""
)


def test_django_connection_inside_atomic(lite: Db, tmp_path: Path) -> None:
    """Django's connection inside transaction.atomic(): the event commits or rolls back with it."""
    import subprocess
    import sys

    script = tmp_path / "django_outbox.py"
    script.write_text(DJANGO_APP)
    result = subprocess.run(
        [sys.executable, str(script), lite.path], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["m-kept", "outside atomic: True"]
    assert list(lite.states()) == ["m-kept"]


def test_relay_run_raises_when_the_outbox_tables_are_missing(db: Db, tmp_path: Path) -> None:
    """A schema to migrate is no outage to wait out: run() raises at once."""
    db.execute("DROP TABLE {table}")
    # A SQLite store would create the table again on open: this one is opened without migrating.
    store = oncely.open_store(db.url, migrate=False) if db.kind == "sqlite" else db.store()
    relay = Relay(store, FilePublisher(tmp_path / "out"), poll_interval=0.05)
    try:
        with pytest.raises(oncely.SchemaMissingError):
            asyncio.run(relay.run())
    finally:
        close(relay)
