"""The activity recorder: pure counting, flushing (and surviving a failing store), and every
backend's sink on its real server, with two processes writing to one store."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import oncely
import oncely.observe
from oncely import _events
from oncely.errors import ConfigurationError, InvalidKeyError
from oncely.observe.activity import (
    MINUTE_MS,
    MemorySink,
    Tally,
    activity_of,
    migrate_activity,
    read_activity,
    record_activity,
)
from tests.conftest import service_url

ROOT = Path(__file__).resolve().parent.parent.parent
NOW = 1_800_000_000_000  # a minute boundary: 30,000,000 minutes


def _op(outcome: str, surface: str = "function", **fields: Any) -> _events.Operation:
    return _events.Operation(surface, fields.pop("operation", "pay"), "memory", outcome, **fields)  # type: ignore[arg-type]


# -- pure -------------------------------------------------------------------------------------


def test_the_tally_counts_what_is_watched_by_minute_scope_and_kind() -> None:
    tally = Tally()
    tally.add(_op("replayed"), NOW)
    tally.add(_op("replayed"), NOW + 59_999)
    tally.add(_op("replayed", "consumer", operation="orders"), NOW)
    tally.add(_op("replayed", "inbox", operation="hooks"), NOW + MINUTE_MS)
    tally.add(_op("acquired"), NOW)
    tally.add(_op("recovered"), NOW)
    tally.add(_op("error"), NOW)
    tally.add(_op("in_progress"), NOW)
    tally.add(_op("mismatch", "http", error="FingerprintMismatchError", detail="422"), NOW + 5)
    tally.add(_op("refused", "http", operation="", detail="400"), NOW + 6)
    counts, recent = tally.drain()
    minute = NOW // MINUTE_MS
    assert counts == {
        (minute, "pay", "replayed"): 2,
        (minute, "orders", "duplicate"): 1,
        (minute + 1, "hooks", "duplicate"): 1,
        (minute, "pay", "in_progress"): 1,
        (minute, "pay", "mismatch"): 1,
        (minute, "(unscoped)", "refused"): 1,
    }
    assert recent == [
        (NOW + 5, "pay", "http", "mismatch", "FingerprintMismatchError"),
        (NOW + 6, "(unscoped)", "http", "refused", "400"),
    ]
    assert tally.drain() == ({}, [])


def test_the_tally_is_bounded_and_takes_back_a_failed_flush() -> None:
    tally = Tally(max_counts=2, max_recent=2)
    for scope in ("a", "b", "c"):
        tally.add(_op("replayed", operation=scope), NOW)
    assert tally.dropped == 1
    for n in range(3):
        tally.add(_op("mismatch", error=f"E{n}"), NOW + n)
    counts, recent = tally.drain()
    assert len(counts) == 2
    assert tally.dropped == 4  # the third scope, and the mismatches' counts (listed still)
    assert [row[4] for row in recent] == ["E1", "E2"]
    tally.add(_op("mismatch", error="E3"), NOW + 3)
    tally.add(_op("replayed", operation="a"), NOW)
    minute = NOW // MINUTE_MS
    tally.restore({**counts, (minute - 500, "old", "replayed"): 9}, recent, oldest_minute=minute)
    again, recent_again = tally.drain()
    # "a" merged; "b" finds the tally full again (dropped, counted); the old minute let go
    assert again == {(minute, "a", "replayed"): 2, (minute, "pay", "mismatch"): 1}
    assert tally.dropped == 5
    assert [row[4] for row in recent_again] == ["E2", "E3"]  # the newest kept


def test_stored_rows_fold_into_series_ending_at_now() -> None:
    minute = NOW // MINUTE_MS
    rows = [
        (minute, "pay", "replayed", 3),
        (minute, "ship", "replayed", 1),
        (minute - 2, "pay", "duplicate", 5),
        (minute - 3, "pay", "replayed", 7),  # before the window
        (minute + 1, "pay", "replayed", 7),  # after it
        (minute, "pay", "unknown-kind", 1),
    ]
    recent = [(NOW - 10, "pay", "http", "mismatch", "E"), (NOW - 5, "pay", "http", "refused", "R")]
    activity = activity_of(rows, recent, now_ms=NOW + 30_000, minutes=3)
    assert activity.first_minute_ms == (minute - 2) * MINUTE_MS
    assert activity.series["replayed"] == [0, 0, 4]
    assert activity.series["duplicate"] == [5, 0, 0]
    assert activity.by_scope == {"pay": {"replayed": 3, "duplicate": 5}, "ship": {"replayed": 1}}
    shown = activity.as_json()
    assert [each["reason"] for each in shown["recent"]] == ["R", "E"]  # newest first
    assert shown["totals"]["replayed"] == 4
    assert shown["minute_ms"] == MINUTE_MS
    assert shown["by_scope"][0] == {"scope": "pay", "replayed": 3, "duplicate": 5}


# -- the recorder -----------------------------------------------------------------------------


def _replays(store: Any, calls: int, scope: str = "ship") -> None:
    @oncely.idempotent(store=store, key="order", scope=scope, ttl=timedelta(hours=1))
    def ship(order: int) -> int:
        return order

    for n in range(calls):
        ship(n // 2)  # every other call is a replay


def test_nothing_is_subscribed_until_asked_nor_after_close() -> None:
    assert not _events.on
    store = oncely.open_store("memory://")
    with record_activity(store, interval=60):
        assert _events.on
    assert not _events.on


def test_replays_and_refusals_reach_the_store_and_read_back() -> None:
    store = oncely.open_store("memory://")
    with record_activity(store, interval=60) as recorder:
        _replays(store, 10)

        @oncely.idempotent(store=store, key="order", scope="pay", ttl=timedelta(hours=1))
        def pay(order: str) -> str:
            return order

        with pytest.raises(InvalidKeyError):
            pay("")
        assert recorder.flush()
    activity = read_activity(store, minutes=5)
    assert sum(activity.series["replayed"]) == 5
    assert activity.by_scope["ship"] == {"replayed": 5}
    assert [(each.kind, each.scope, each.surface) for each in activity.recent] == [
        ("refused", "pay", "function")
    ]
    assert read_activity(oncely.open_store("memory://")).recent == []  # another store's


def test_a_consumers_duplicates_are_counted_apart_from_replays() -> None:
    from oncely.consumers import Delivery, IdempotentConsumer

    store = oncely.open_store("memory://")
    consumer = IdempotentConsumer(store, scope="orders", fingerprint=None)
    with record_activity(store, interval=60):
        for _ in range(3):
            consumer.process(Delivery(b"{}", {"Idempotency-Key": "m-1"}, None, None), lambda: 1)
        batch = [Delivery(b"{}", {"Idempotency-Key": f"m-{n % 2}"}, None, None) for n in range(4)]
        consumer.process_batch(batch, lambda raw: 1)
    activity = read_activity(store, minutes=5)
    # one-by-one: two duplicates of m-1; the batch: m-1 twice more, m-0 once more
    assert activity.by_scope == {"orders": {"duplicate": 5}}
    assert sum(activity.series["replayed"]) == 0


class _FailingSink(MemorySink):
    def __init__(self) -> None:
        super().__init__()
        self.down = True

    def write(self, counts: Mapping[Any, int], recent: Sequence[Any], **kwargs: Any) -> None:
        if self.down:
            raise ConnectionError("the store is away")
        super().write(counts, recent, **kwargs)


def test_a_failing_flush_never_reaches_the_calls_and_is_retried(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from oncely.observe.activity import ActivityRecorder

    sink = _FailingSink()
    store = oncely.open_store("memory://")
    recorder = ActivityRecorder(sink, interval=60, retention=timedelta(hours=1), recent=10)
    try:
        _replays(store, 6)
        assert not recorder.flush()
        _replays(store, 4, scope="other")
        assert recorder.failures == 1
        assert "could not flush" in caplog.text
        sink.down = False
        assert recorder.flush()
    finally:
        recorder.close()
    rows, _ = sink.read(since_minute=0, until_minute=2**40, limit=10)
    assert sorted((scope, count) for _, scope, _, count in rows) == [("other", 2), ("ship", 3)]
    assert recorder.flushes == 1


def test_the_recorder_flushes_on_its_own() -> None:
    store = oncely.open_store("memory://")
    with record_activity(store, interval=0.05):
        _replays(store, 4)
        deadline = time.monotonic() + 5
        while sum(read_activity(store).series["replayed"]) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    assert sum(read_activity(store).series["replayed"]) == 2


def test_bad_options_and_foreign_stores_are_refused() -> None:
    store = oncely.open_store("memory://")
    with pytest.raises(ConfigurationError):
        record_activity(store, interval=0)
    with pytest.raises(ConfigurationError):
        record_activity(store, retention=timedelta(seconds=5))
    with pytest.raises(ConfigurationError):
        record_activity(object())
    with pytest.raises(ConfigurationError):
        read_activity(store, minutes=0)


# -- each backend on its server, two processes writing to one store ---------------------------


def _name(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


@pytest.fixture
def postgres_store() -> Iterator[tuple[str, dict[str, Any]]]:
    import psycopg

    url = service_url("ONCELY_TEST_POSTGRES_URL")
    schema = _name("oncely_act")
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute(f'CREATE SCHEMA "{schema}"')
        try:
            yield url, {"schema": schema, "namespace": _name("ns")}
        finally:
            admin.execute(f'DROP SCHEMA "{schema}" CASCADE')


@pytest.fixture
def redis_store() -> tuple[str, dict[str, Any]]:
    return service_url("ONCELY_TEST_REDIS_URL"), {"namespace": _name("act")}


@pytest.fixture
def cluster_store() -> tuple[str, dict[str, Any]]:
    return service_url("ONCELY_TEST_REDIS_CLUSTER_URL"), {"namespace": _name("act")}


@pytest.fixture
def sqlite_store(tmp_path: Path) -> tuple[str, dict[str, Any]]:
    return f"sqlite:///{tmp_path / 'activity.db'}", {"namespace": _name("ns")}


_CHILD = textwrap.dedent(
    """
    import json, sys
    from datetime import timedelta
    import oncely, oncely.observe
    url, options, calls = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    records = oncely.open_store("memory://")
    target = oncely.open_store(url, **options)
    recorder = oncely.observe.record_activity(target, interval=0.05, recent=5)

    @oncely.idempotent(store=records, key="order", scope="ship", ttl=timedelta(hours=1))
    def ship(order):
        return order

    @oncely.idempotent(store=records, key="order", scope="pay", ttl=timedelta(hours=1))
    def pay(order):
        return order

    for n in range(calls):
        ship(n // 2)
    for n in range(4):
        try:
            pay("")
        except oncely.InvalidKeyError:
            pass
    # exits without close(): the flush at exit must carry the rest
    """
)


@pytest.mark.parametrize(
    "backend", ["sqlite_store", "postgres_store", "redis_store", "cluster_store"]
)
def test_two_processes_write_to_one_store_and_a_third_reads_them(
    backend: str, request: pytest.FixtureRequest
) -> None:
    import json

    url, options = request.getfixturevalue(backend)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, url, json.dumps(options), str(calls)], env=env
        )
        for calls in (400, 200)
    ]
    assert [child.wait(timeout=60) for child in children] == [0, 0]
    store = oncely.open_store(url, **options)
    try:
        activity = read_activity(store, minutes=10, recent=3)
        assert sum(activity.series["replayed"]) == 300
        assert activity.by_scope["ship"] == {"replayed": 300}
        assert activity.by_scope["pay"] == {"refused": 8}
        assert len(activity.recent) == 3
        assert {(each.scope, each.kind, each.surface) for each in activity.recent} == {
            ("pay", "refused", "function")
        }
        # the sink keeps at most `recent` events (plus one flush's worth, at most, on SQL)
        everything = read_activity(store, minutes=10, recent=1000)
        assert 5 <= len(everything.recent) <= 5 + 4
        other = oncely.open_store(url, **{**options, "namespace": _name("other")})
        try:
            assert read_activity(other, minutes=10).by_scope == {}
        finally:
            other.close()
    finally:
        store.close()


def test_activity_tables_can_be_created_ahead_and_are_read_empty_before(
    postgres_store: tuple[str, dict[str, Any]],
) -> None:
    url, options = postgres_store
    store = oncely.open_store(url, **options)
    try:
        assert read_activity(store).by_scope == {}  # no table yet: nothing recorded
        migrate_activity(store)
        migrate_activity(store)
        assert read_activity(store).by_scope == {}
    finally:
        store.close()


def test_old_minutes_are_forgotten(sqlite_store: tuple[str, dict[str, Any]]) -> None:
    from oncely.stores.sqlite._activity import SQLiteActivity

    url, options = sqlite_store
    sink = SQLiteActivity(url.removeprefix("sqlite:///"), options["namespace"])
    minute = NOW // MINUTE_MS
    try:
        sink.write(
            {(minute - 100, "s", "replayed"): 1}, [], now_ms=NOW, keep_minutes=200, keep_recent=5
        )
        sink.write({(minute, "s", "replayed"): 2}, [], now_ms=NOW, keep_minutes=60, keep_recent=5)
        rows, _ = sink.read(since_minute=0, until_minute=minute, limit=5)
        assert rows == [(minute, "s", "replayed", 2)]
    finally:
        sink.close()


@pytest.mark.parametrize("backend", ["sqlite_store", "postgres_store", "redis_store"])
def test_a_forked_child_counts_apart_and_leaves_the_parents_connection(
    backend: str, request: pytest.FixtureRequest
) -> None:
    url, options = request.getfixturevalue(backend)
    records = oncely.open_store("memory://")
    target = oncely.open_store(url, **options)
    recorder = record_activity(target, interval=3600)
    try:
        _replays(records, 4)
        assert recorder.flush()  # the parent's connection is open now
        _replays(records, 2, scope="unflushed")  # the parent's to flush, not the child's
        pid = os.fork()
        if pid == 0:  # pragma: no cover (the child)
            code = 1
            try:
                _replays(records, 6, scope="child")
                code = 0 if recorder.flush() else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        _replays(records, 2, scope="after")
        assert recorder.flush()  # the child left the parent's connection working
        assert recorder.failures == 0
    finally:
        recorder.close()
    try:
        assert read_activity(target, minutes=10).by_scope == {
            "ship": {"replayed": 2},
            "unflushed": {"replayed": 1},
            "child": {"replayed": 3},
            "after": {"replayed": 1},
        }
    finally:
        target.close()


def test_redis_activity_names_share_one_slot_and_never_match_the_records() -> None:
    from redis.crc import key_slot

    from oncely.stores.redis._activity import RedisActivity

    for namespace in ("", "tenant-1", "odd{ns}"):
        sink = RedisActivity(None, "oncely:", namespace)
        names = [sink._minute(minute).encode() for minute in range(30_000_000, 30_000_200)]
        names.append(sink._recent.encode())
        assert len({key_slot(name) for name in names}) == 1, namespace
        assert all(not name.startswith(b"oncely:{") for name in names)
