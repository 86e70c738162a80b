"""What only the Redis stores' batch verbs do: one script call per batch (per slot on a
cluster), answers in input order, a failing item in its own place, and whole-call failures.

The batch semantics every store shares are in the conformance suite (``test_batch_*``).
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.crc

from oncely import Acquired, InProgress, LeaseLost, Mismatch, Replay
from oncely.errors import CorruptRecordError, StoreError, StoreUnavailableError
from oncely.stores.redis import RedisClusterStore, RedisStore
from oncely.stores.redis._codec import Keyspace
from tests._servers import OwnRedis
from tests.stores.test_redis import (
    CORRUPTIONS,
    Sent,
    _free_port,
    _key,
)

LEASE = timedelta(seconds=30)
TTL = timedelta(minutes=5)
MODES = ["sync", "async"]


class Calls:
    """A store's batch verbs (and claim) as plain calls, sync or on one event loop."""

    def __init__(self, store: Any, mode: str) -> None:
        self.store = store
        self.loop = asyncio.new_event_loop() if mode == "async" else None

    def __call__(self, verb: str, *args: Any, **kwargs: Any) -> Any:
        if self.loop is None:
            return getattr(self.store, verb)(*args, **kwargs)
        return self.loop.run_until_complete(getattr(self.store, "a" + verb)(*args, **kwargs))

    def close(self) -> None:
        if self.loop is not None:
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()
        self.store.close()


@pytest.fixture
def namespace() -> str:
    return f"b{uuid.uuid4().hex[:12]}"


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def shared(mode: str, namespace: str) -> Iterator[Calls]:
    from tests.conftest import service_url

    calls = Calls(RedisStore(service_url("ONCELY_TEST_REDIS_URL"), namespace=namespace), mode)
    yield calls
    calls.close()


@pytest.fixture
def cluster(mode: str, namespace: str) -> Iterator[Calls]:
    from tests.conftest import service_url

    url = service_url("ONCELY_TEST_REDIS_CLUSTER_URL")
    calls = Calls(RedisClusterStore(url, namespace=namespace), mode)
    yield calls
    calls.close()


@pytest.mark.redis
class TestOneRoundTrip:
    def test_each_batch_is_one_fcall_and_nothing_for_an_empty_one(
        self, monkeypatch: pytest.MonkeyPatch, shared: Calls
    ) -> None:
        """claim_many and complete_many of 50 keys send one FCALL each; [] sends nothing."""
        keys = [_key() for _ in range(50)]
        shared("get", "warm-up")  # connects
        counter = Sent(monkeypatch)
        claimed = shared("claim_many", [(k, "fp") for k in keys], lease=LEASE, ttl=TTL)
        assert counter.take() == ["FCALL"]
        items = [(k, answer.token, b"r") for k, answer in zip(keys, claimed, strict=True)]
        assert shared("complete_many", items, ttl=TTL) == [None] * 50
        assert counter.take() == ["FCALL"]
        assert shared("claim_many", [], lease=LEASE, ttl=TTL) == []
        assert shared("complete_many", [], ttl=TTL) == []
        assert counter.take() == []

    def test_function_flush_reloads_the_library(
        self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, mode: str
    ) -> None:
        """After FUNCTION FLUSH a batch loads the library again (FCALL, FUNCTION LOAD, FCALL)
        and the next batch is one FCALL again.
        """
        server = OwnRedis(tmp_path, port=_free_port())
        server.start()
        calls = Calls(RedisStore(server.url, namespace="flush"), mode)
        try:
            claimed = calls("claim_many", [("a", "fp")], lease=LEASE, ttl=TTL)
            assert claimed == [Acquired(1)]
            with server.admin() as admin:
                admin.function_flush()
            counter = Sent(monkeypatch)
            counter.take()
            assert calls("complete_many", [("a", 1, b"r")], ttl=TTL) == [None]
            assert counter.take() == ["FCALL", "FUNCTION", "FCALL"]
            with server.admin() as admin:
                admin.function_flush()
            counter.take()
            replay = calls("claim_many", [("a", "fp"), ("b", "fp")], lease=LEASE, ttl=TTL)
            assert counter.take() == ["FCALL", "FUNCTION", "FCALL"]
            assert isinstance(replay[0], Replay)
            assert replay[1] == Acquired(1)
            assert calls("complete_many", [("b", 1, b"r")], ttl=TTL) == [None]
            assert counter.take() == ["FCALL"]  # one library: loaded for the claims
            assert calls("complete_many", [("b", 1, b"r")], ttl=TTL) == [LeaseLost()]
            assert counter.take() == ["FCALL"]
        finally:
            calls.close()
            server.stop()


@pytest.mark.redis
class TestItemsFailAlone:
    @pytest.mark.parametrize("case", ["string", "garbage status", "token not a number"])
    def test_corrupt_record_in_the_middle_is_its_own_error(
        self, shared: Calls, namespace: str, case: str
    ) -> None:
        """A foreign value at one item's record: CorruptRecordError in its place, the items
        around it answered as usual, in both verbs.
        """
        from tests.conftest import service_url

        before, corrupt, after = _key(), _key(), _key()
        admin = redis.Redis.from_url(service_url("ONCELY_TEST_REDIS_URL"))
        try:
            name = Keyspace("oncely:", namespace).name(corrupt)
            CORRUPTIONS[case](admin, name)
            admin.pexpire(name, 60_000)
        finally:
            admin.close()
        requests = [(before, "fp"), (corrupt, "fp"), (after, "fp"), (before, "fp")]
        first, bad, last, again = shared("claim_many", requests, lease=LEASE, ttl=TTL)
        assert (first, last) == (Acquired(1), Acquired(1))
        assert isinstance(again, InProgress)
        assert isinstance(bad, CorruptRecordError)
        assert bad.key == corrupt
        items = [(before, 1, b"x"), (corrupt, 1, b"y"), (after, 2, b"z")]
        done, bad, lost = shared("complete_many", items, ttl=TTL)
        assert done is None
        assert isinstance(bad, CorruptRecordError)
        assert bad.key == corrupt
        assert lost == LeaseLost()

    def test_a_refused_write_fails_its_item_and_keeps_the_others(
        self, tmp_path: Path, mode: str
    ) -> None:
        """maxmemory refusing writes: each item that writes is a StoreError in its place, the
        replay among them is still answered, and nothing is half-written.
        """
        server = OwnRedis(tmp_path, "--maxmemory-policy", "noeviction", port=_free_port())
        server.start()
        calls = Calls(RedisStore(server.url, namespace="oom"), mode)
        try:
            assert calls("claim_many", [("done", "fp"), ("busy", "fp")], lease=LEASE, ttl=TTL)
            assert calls("complete_many", [("done", 1, b"r")], ttl=TTL) == [None]
            with server.admin() as admin:
                admin.set("ballast", os.urandom(4 * 1024 * 1024))
                admin.config_set("maxmemory", 1024 * 1024)
            new, replay, busy = calls(
                "claim_many", [("new", "fp"), ("done", "fp"), ("busy", "fp")], lease=LEASE, ttl=TTL
            )
            assert type(new) is StoreError
            assert "new" in str(new)
            assert isinstance(replay, Replay)
            assert isinstance(busy, InProgress)
            (refused,) = calls("complete_many", [("busy", 1, b"big" * 1000)], ttl=TTL)
            assert type(refused) is StoreError
            assert calls("get", "new") is None
        finally:
            calls.close()
            server.stop()


class TestWholeCallFailures:
    def test_unreachable_server_raises(self, mode: str) -> None:
        """Nothing listens: both batch verbs raise StoreUnavailableError (not per item)."""
        calls = Calls(RedisStore(f"redis://127.0.0.1:{_free_port()}/0", retries=0), mode)
        try:
            with pytest.raises(StoreUnavailableError):
                calls("claim_many", [("a", "fp"), ("b", "fp")], lease=LEASE, ttl=TTL)
            with pytest.raises(StoreUnavailableError):
                calls("complete_many", [("a", 1, b"r")], ttl=TTL)
        finally:
            calls.close()

    def test_unreachable_cluster_raises(self, mode: str) -> None:
        """No startup node answers: the batch raises StoreUnavailableError."""
        store = RedisClusterStore(f"redis+cluster://127.0.0.1:{_free_port()}", retries=0)
        calls = Calls(store, mode)
        try:
            with pytest.raises(StoreUnavailableError):
                calls("claim_many", [(_key(), "fp") for _ in range(5)], lease=LEASE, ttl=TTL)
        finally:
            calls.close()

    @pytest.mark.redis
    def test_closed_store_raises(self, shared: Calls) -> None:
        """A closed store refuses a batch as it refuses a single verb."""
        shared.store.close()
        with pytest.raises(StoreError, match="closed"):
            shared("claim_many", [("a", "fp")], lease=LEASE, ttl=TTL)


def _slot_of(namespace: str) -> Callable[[str], int]:
    space = Keyspace("oncely:", namespace)
    return lambda key: redis.crc.key_slot(space.name(key))


@pytest.mark.redis_cluster
class TestCluster:
    def test_batch_spans_slots_and_nodes_in_input_order(
        self, monkeypatch: pytest.MonkeyPatch, cluster: Calls, namespace: str
    ) -> None:
        """200 keys over many slots (every node), a key repeated, a mismatch: every answer in
        its input place, one FCALL per slot.
        """
        keys = [_key() for _ in range(200)]
        slot = _slot_of(namespace)
        assert len({slot(k) // 5462 for k in keys}) == 3  # all three nodes' slot ranges
        requests = [(k, "fp") for k in keys] + [(keys[7], "fp"), (keys[9], "other")]
        warm_up = [(_key(), "fp") for _ in range(100)]  # connects, loads the script everywhere
        cluster("claim_many", warm_up, lease=LEASE, ttl=TTL)
        counter = Sent(monkeypatch)
        answers = cluster("claim_many", requests, lease=LEASE, ttl=TTL)
        slots = {slot(k) for k in keys}
        # (plus the handshakes of the connections the concurrent calls open)
        assert [name for name in counter.take() if name == "FCALL"] == ["FCALL"] * len(slots)
        assert answers[:200] == [Acquired(1)] * 200
        assert isinstance(answers[200], InProgress)
        assert answers[201] == Mismatch(stored_fingerprint="fp")
        items = [(k, 1, k.encode()) for k in reversed(keys)] + [(keys[0], 1, b"again")]
        assert cluster("complete_many", items, ttl=TTL) == [None] * 200 + [LeaseLost()]
        replays = cluster("claim_many", [(k, "fp") for k in keys], lease=LEASE, ttl=TTL)
        assert [answer.record.result for answer in replays] == [k.encode() for k in keys]

    def test_keys_of_one_slot_share_one_call(
        self, monkeypatch: pytest.MonkeyPatch, cluster: Calls, namespace: str
    ) -> None:
        """Keys that hash to one slot travel in one FCALL, in order."""
        slot = _slot_of(namespace)
        first = _key()
        same = [first] + [k for k in (_key() for _ in range(200_000)) if slot(k) == slot(first)]
        assert len(same) >= 3
        same = same[:3]
        cluster("claim_many", [(_key(), "fp") for _ in range(100)], lease=LEASE, ttl=TTL)
        counter = Sent(monkeypatch)
        requests = [(same[0], "fp"), (same[1], "fp"), (same[0], "fp"), (same[2], "x")]
        answers = cluster("claim_many", requests, lease=LEASE, ttl=TTL)
        assert [name for name in counter.take() if name in ("FCALL", "FUNCTION")] == ["FCALL"]
        assert answers[0] == answers[1] == answers[3] == Acquired(1)
        assert isinstance(answers[2], InProgress)

    def test_many_concurrent_slots_stay_under_max_connections(self, namespace: str) -> None:
        """An async batch of 1000 keys (about 1000 slots at once) with max_connections=20:
        the slots' calls queue for connections instead of failing.
        """
        from tests.conftest import service_url

        url = service_url("ONCELY_TEST_REDIS_CLUSTER_URL")

        async def run() -> list[Any]:
            async with RedisClusterStore(url, namespace=namespace, max_connections=20) as store:
                requests = [(f"k{i}", "fp") for i in range(1000)]
                return await store.aclaim_many(requests, lease=LEASE, ttl=TTL)

        assert asyncio.run(run()) == [Acquired(1)] * 1000


@pytest.mark.redis
def test_300_concurrent_claims_on_one_store_all_succeed(namespace: str) -> None:
    """More concurrent async calls than max_connections (100) queue instead of failing."""
    from tests.conftest import service_url

    async def run() -> list[Any]:
        async with RedisStore(service_url("ONCELY_TEST_REDIS_URL"), namespace=namespace) as store:
            calls = (store.aclaim(f"k{i}", "fp", lease=LEASE, ttl=TTL) for i in range(300))
            return await asyncio.gather(*calls, return_exceptions=True)

    assert asyncio.run(run()) == [Acquired(1)] * 300
