"""Relays side by side, killed, woken by NOTIFY, and run from the command line."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

import oncely
from oncely.outbox import Outbox, Relay, publisher_from_url
from oncely.outbox._registry import SCHEMES, load_factory
from tests._helpers import eventually
from tests.outbox._publisher import FilePublisher, read
from tests.outbox._relaying import FAST, add_events, close, until
from tests.outbox.conftest import Db

ROOT = Path(__file__).resolve().parents[2]


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}", **extra}


@pytest.mark.postgres
def test_concurrent_writers_and_three_relays_keep_each_keys_commit_order(
    pg: Db, tmp_path: Path
) -> None:
    """4 writer threads and 3 relays (separate connections) at once: every event is published
    exactly once, and each key's events in commit order (seq order, each writer's own order,
    a transaction's events together)."""
    outbox = Outbox(pg.store())
    keys = ["k0", "k1", "k2"]
    transactions: list[list[str]] = []
    lock = threading.Lock()

    def writer(number: int) -> None:
        rng = random.Random(number)
        connection = pg.connect()
        try:
            for step in range(12):
                key = rng.choice([*keys, None])
                with pg.transaction(connection):
                    ids = [
                        outbox.add(connection, "d", f"w{number}-{step}-{part}", ordering_key=key)
                        for part in range(1 if key is None else 2)
                    ]
                with lock:
                    transactions.append(ids)
        finally:
            connection.close()

    publishers = [FilePublisher(tmp_path / "out") for _ in range(3)]  # one file, in order
    for number, publisher in enumerate(publishers):
        publisher.delay, publisher.tag = 0.002, f"relay-{number}"
    relays = [Relay(pg.store(), publisher, batch_size=3, **FAST) for publisher in publishers]

    async def scenario() -> None:
        stop = asyncio.Event()
        tasks = [asyncio.create_task(relay.run(stop)) for relay in relays]
        writers = [threading.Thread(target=writer, args=(number,)) for number in range(4)]
        for thread in writers:
            thread.start()
        await until(lambda: not any(thread.is_alive() for thread in writers), timeout=60)
        total = sum(len(ids) for ids in transactions)
        await until(lambda: len(read(tmp_path / "out")) >= total, timeout=60)
        stop.set()
        await asyncio.gather(*tasks)

    try:
        asyncio.run(scenario())
    finally:
        for relay in relays:
            close(relay)
    published = read(tmp_path / "out")
    sent = [event["message_id"] for event in published]
    assert len(sent) == len(set(sent)) == sum(len(ids) for ids in transactions)  # once each
    seqs = dict(pg.query("SELECT message_id, seq FROM {table}"))
    by_key: dict[object, list[dict[str, Any]]] = defaultdict(list)
    for event in published:
        by_key[event["key"]].append(event)
    for key in keys:
        order = [event["message_id"] for event in by_key[key]]
        assert [seqs[message_id] for message_id in order] == list(range(1, len(order) + 1))
        steps: dict[str, list[int]] = defaultdict(list)  # each writer's own order
        for event in by_key[key]:
            writer_name, step, _ = str(event["payload"]).split("-")
            steps[writer_name].append(int(step))
        assert all(found == sorted(found) for found in steps.values())
        for ids in transactions:  # a transaction's two events are adjacent
            if ids[0] in order:
                assert order.index(ids[1]) == order.index(ids[0]) + 1
    assert len({event["tag"] for event in published}) > 1  # the relays shared the work
    outbox.store.close()


RELAY = """
import sys
import oncely
from oncely.outbox import Relay
from tests.outbox._publisher import from_env

Relay(oncely.open_store(sys.argv[1]), from_env(), poll_interval=0.05).run_forever()
"""


def test_relay_killed_between_confirm_and_mark_republishes(db: Db, tmp_path: Path) -> None:
    """SIGKILL after the broker confirmed a batch, before it was marked: nothing is lost, and
    the next relay publishes the batch again (the consumer deduplicates by message id)."""
    outbox = Outbox(db.store())
    ids = add_events(db, outbox, [("a", "k"), ("b", "k"), ("c", None)])
    out, marker = tmp_path / "out", tmp_path / "confirmed"
    process = subprocess.Popen(
        [sys.executable, "-c", RELAY, db.url],
        env=env(ONCELY_TEST_OUTBOX_FILE=str(out), ONCELY_TEST_HANG=str(marker)),
    )
    try:
        eventually(marker.exists, timeout=30)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)
    finally:
        if process.poll() is None:
            process.kill()
    assert sorted(event["message_id"] for event in read(out)) == sorted(ids)
    assert not any(published for published, *_ in db.states().values())  # never marked
    if db.kind == "sqlite":  # its claim on the batch outlives it until it expires: let it
        db.execute("UPDATE {table} SET claimed_until_ms = 0")
    relay = Relay(db.store(), FilePublisher(out), **FAST)

    async def catch_up() -> None:
        # PostgreSQL ends the dead relay's transaction, and its locks, once it sees it gone.
        await until(lambda: all(state[0] for state in db.states().values()))

    async def run() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(relay.run(stop))
        await catch_up()
        stop.set()
        await task

    try:
        asyncio.run(run())
    finally:
        close(relay)
    sent = [event["message_id"] for event in read(out)]
    assert sorted(sent) == sorted(ids + ids)  # at least once: twice here, none lost
    keyed = [message_id for message_id in sent if message_id in ids[:2]]
    assert keyed == [ids[0], ids[1], ids[0], ids[1]]  # each publication in key order
    outbox.store.close()


@pytest.mark.postgres
def test_notify_wakes_the_relay_long_before_its_poll(pg: Db, tmp_path: Path) -> None:
    """With an hour between polls, an event committed while the relay sleeps is published:
    only the NOTIFY at commit can have woken it."""
    outbox = Outbox(pg.store())
    publisher = FilePublisher(tmp_path / "out")
    relay = Relay(pg.store(), publisher, poll_interval=3600)
    from oncely.stores.postgres._outbox import channel as outbox_channel

    channel = outbox_channel(pg.schema)

    def listening() -> bool:
        rows = pg.query(
            "SELECT count(*) FROM pg_stat_activity WHERE state = 'idle' "
            f"AND query = 'LISTEN \"{channel}\"'"
        )
        return rows[0][0] == 1

    async def scenario() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(relay.run(stop))
        await until(lambda: listening())
        await asyncio.sleep(0.1)  # the relay's first cycles are over; it sleeps
        first = (await asyncio.to_thread(add_events, pg, outbox, [("a", "k")]))[0]
        await until(lambda: pg.states()[first][0])
        second = (await asyncio.to_thread(add_events, pg, outbox, [("b", "k")]))[0]
        await until(lambda: pg.states()[second][0])
        stop.set()
        await task

    try:
        asyncio.run(scenario())
    finally:
        close(relay)
    assert len(publisher.published()) == 2
    outbox.store.close()


# -- the command line -----------------------------------------------------------------------------


def oncely_cli(*args: str, **extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "oncely.cli", *args],
        env=env(**extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_cli_relay_publishes_and_stops_on_sigterm(db: Db, tmp_path: Path) -> None:
    outbox = Outbox(db.store())
    ids = add_events(db, outbox, [("a", "k"), ("b", None)])
    out = tmp_path / "out"
    process = oncely_cli(
        "relay",
        "--publisher",
        "tests.outbox._publisher:from_env",
        "--poll-interval",
        "0.05",
        ONCELY_STORE_URL=db.url,
        ONCELY_TEST_OUTBOX_FILE=str(out),
    )
    try:
        eventually(lambda: len(read(out)) == 2, timeout=30)
        more = add_events(db, outbox, [("c", "k")])
        eventually(lambda: len(read(out)) == 3, timeout=30)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, stderr
    assert "relay: stopped" in stderr
    assert [event["message_id"] for event in read(out)] == ids + more
    stats = subprocess.run(
        [sys.executable, "-m", "oncely.cli", "--store", db.url, "--json", "outbox", "stats"],
        env=env(),
        capture_output=True,
        text=True,
        check=True,
    )
    assert '"published": 3' in stats.stdout
    assert '"pending": 0' in stats.stdout
    outbox.store.close()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "no broker"),
        (["--to", "gopher://x"], "no outbox publisher for gopher://"),
        (["--to", "nonsense"], "broker URL"),
        (["--publisher", "no_such_module_xyz:make"], "no_such_module_xyz"),
        (["--publisher", "tests.outbox._publisher:nope"], "no attribute"),
        (["--publisher", "nocolon"], "module:attribute"),
    ],
)
def test_cli_relay_bad_setup_exits_2(lite: Db, args: list[str], message: str) -> None:
    from click.testing import CliRunner

    from oncely.cli._app import cli

    result = CliRunner().invoke(cli, ["--store", lite.url, "relay", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_cli_outbox_stats_counts(lite: Db) -> None:
    from click.testing import CliRunner

    from oncely.cli._app import cli

    outbox = Outbox(lite.store())
    add_events(lite, outbox, [("a", "k"), ("b", None)])
    result = CliRunner().invoke(cli, ["--store", lite.url, "outbox", "stats"])
    assert result.exit_code == 0, result.output
    assert "pending         2" in result.output
    outbox.store.close()


# -- the publisher registry -----------------------------------------------------------------------


def test_registry_maps_each_broker_scheme_lazily() -> None:
    assert SCHEMES == {
        "amqp": "oncely.outbox.rabbitmq:RabbitMQPublisher",
        "amqps": "oncely.outbox.rabbitmq:RabbitMQPublisher",
        "kafka": "oncely.outbox.kafka:KafkaPublisher",
        "nats": "oncely.outbox.nats:NATSPublisher",
        "tls": "oncely.outbox.nats:NATSPublisher",
        "redis": "oncely.outbox.redis_streams:RedisStreamsPublisher",
        "rediss": "oncely.outbox.redis_streams:RedisStreamsPublisher",
    }
    code = "import sys, oncely.outbox; print(sorted(m for m in sys.modules if 'outbox.' in m))"
    loaded = subprocess.run(
        [sys.executable, "-c", code], env=env(), capture_output=True, text=True, check=True
    )
    assert not any(name in loaded.stdout for name in ("rabbitmq", "kafka", "nats", "redis_"))


def test_registry_refuses_what_it_cannot_open() -> None:
    for url in ("gopher://x", "no url", 5):
        with pytest.raises(oncely.ConfigurationError):
            publisher_from_url(url)  # type: ignore[arg-type]
    with pytest.raises(oncely.MissingDependencyError, match="no_such_module_xyz"):
        load_factory("no_such_module_xyz:make")
    with pytest.raises(oncely.ConfigurationError, match="no attribute"):
        load_factory("tests.outbox._publisher:nope")
    assert load_factory("tests.outbox._publisher:FilePublisher") is FilePublisher


def test_run_forever_stops_on_sigint(lite: Db, tmp_path: Path) -> None:
    """The sync convenience handles SIGINT like SIGTERM: the batch ends, then it returns."""
    add_events(lite, Outbox(lite.store()), [("a", None)])
    out = tmp_path / "out"
    process = subprocess.Popen(
        [sys.executable, "-c", RELAY, lite.url],
        env=env(ONCELY_TEST_OUTBOX_FILE=str(out)),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # Running (it published), not still importing: a SIGINT during the imports of a loaded
        # machine's slow start is Python's KeyboardInterrupt, before any handler exists.
        eventually(lambda: len(read(out)) == 1, timeout=30)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, stderr
