"""What only the Redis stores do: Lua scripts, hash slots, TTLs, round trips, and faults.

Fault tests run against redis-servers of their own, started on spare loopback ports and stopped
afterwards; the shared servers are never flushed, restarted or reconfigured.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio
import redis.asyncio.connection
import redis.connection
import redis.crc

import oncely
from oncely import Acquired, InProgress, LeaseLost, Record, Replay, Status
from oncely._core.keys import scope_key
from oncely.cli._app import _all_records
from oncely.errors import (
    ConfigurationError,
    CorruptRecordError,
    MissingDependencyError,
    StoreError,
    StoreUnavailableError,
)
from oncely.stores import open_store
from oncely.stores.redis import RedisClusterStore, RedisStore, _scripts
from oncely.stores.redis._codec import HEAD, Keyspace
from oncely.testing import FrozenClock
from oncely.testing.conformance import StoreCalls
from tests._helpers import eventually
from tests._proxy import Proxy
from tests._servers import OwnRedis, free_port
from tests.conftest import service_url
from tests.stores._cut import VERBS, assert_lost_reply_is_recognised

LEASE = timedelta(seconds=30)
TTL = timedelta(minutes=5)


# -- servers of our own --------------------------------------------------------------------------


def _free_port() -> int:
    """A loopback port nothing listens on, in 16390-16789: a block of 50 for each pytest-xdist
    worker, so that two workers never pick one port at once (spread by pid between test runs)."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")) % 8
    return free_port(range(16390 + 50 * worker, 16440 + 50 * worker))


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[OwnRedis]:
    """A redis-server without persistence, as on most caches."""
    server = OwnRedis(tmp_path, port=_free_port())
    server.start()
    yield server
    server.stop()


@pytest.fixture
def durable_server(tmp_path: Path) -> Iterator[OwnRedis]:
    """A redis-server that fsyncs its append-only file on every write."""
    server = OwnRedis(tmp_path, "--appendonly", "yes", "--appendfsync", "always", port=_free_port())
    server.start()
    yield server
    server.stop()


@pytest.fixture
def namespace() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def redis_url() -> str:
    return service_url("ONCELY_TEST_REDIS_URL")


@pytest.fixture
def cluster_url() -> str:
    return service_url("ONCELY_TEST_REDIS_CLUSTER_URL")


@pytest.fixture
def shared_store(redis_url: str, namespace: str) -> Iterator[RedisStore]:
    with RedisStore(redis_url, namespace=namespace) as store:
        yield store


@pytest.fixture
def shared_admin(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def _key() -> str:
    return f"key-{uuid.uuid4().hex}"


def _arun(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


# -- URLs, options and imports -------------------------------------------------------------------


@pytest.mark.redis
class TestSyncPool:
    """The sync client's pool: threads past ``max_connections`` wait for a free connection (as
    long as ``socket_timeout``), instead of failing at once like redis-py's default pool."""

    def test_threads_past_max_connections_wait_for_a_free_one(
        self, redis_url: str, namespace: str
    ) -> None:
        with RedisStore(redis_url, namespace=namespace, max_connections=2) as store:
            assert isinstance(store.claim(_key(), "fp", lease=LEASE, ttl=TTL), Acquired)
            pool = store._client.connection_pool
            held = [pool.get_connection(), pool.get_connection()]
            answers: list[Any] = []
            waiter = threading.Thread(
                target=lambda: answers.append(store.claim(_key(), "fp", lease=LEASE, ttl=TTL))
            )
            waiter.start()
            eventually(lambda: pool._waiting == 1)
            pool.release(held.pop())
            waiter.join(timeout=30)
            assert [type(answer) for answer in answers] == [Acquired]
            pool.release(held.pop())

    def test_many_threads_share_few_connections(self, redis_url: str, namespace: str) -> None:
        keys = [_key() for _ in range(200)]
        with RedisStore(redis_url, namespace=namespace, max_connections=2) as store:

            def work(mine: list[str]) -> None:
                for key in mine:
                    taken = store.claim(key, "fp", lease=LEASE, ttl=TTL)
                    assert isinstance(taken, Acquired)
                    assert store.complete(key, taken.token, b"r", ttl=TTL) is None

            threads = [threading.Thread(target=work, args=(keys[i::16],)) for i in range(16)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=60)
            replays = [store.claim(key, "fp", lease=LEASE, ttl=TTL) for key in keys]
            assert all(isinstance(answer, Replay) for answer in replays)
            assert len(store._client.connection_pool._in_use_connections) == 0

    def test_no_free_connection_within_the_timeout_is_unavailable(
        self, redis_url: str, namespace: str
    ) -> None:
        with RedisStore(
            redis_url, namespace=namespace, max_connections=1, socket_timeout=0.2
        ) as store:
            assert isinstance(store.claim(_key(), "fp", lease=LEASE, ttl=TTL), Acquired)
            pool = store._client.connection_pool
            held = pool.get_connection()
            with pytest.raises(StoreUnavailableError, match="No connection available"):
                store.claim(_key(), "fp", lease=LEASE, ttl=TTL)
            pool.release(held)
            assert isinstance(store.claim(_key(), "fp", lease=LEASE, ttl=TTL), Acquired)


@pytest.mark.redis
class TestOpening:
    def test_open_store_builds_the_standalone_store(self, redis_url: str) -> None:
        """redis:// opens a RedisStore, accepting and ignoring a clock."""
        with open_store(redis_url, namespace="n", clock=FrozenClock()) as store:
            assert isinstance(store, RedisStore)
            assert store.get(_key()) is None

    def test_cluster_url_names_every_startup_node(self) -> None:
        """redis+cluster:// takes several host:port pairs, credentials and query options."""
        store = RedisClusterStore.from_url(
            "redis+cluster://user:s%40cret@10.0.0.1:7000,10.0.0.2:7001,[::1]:7002?socket_timeout=3"
        )
        assert store.nodes == [("10.0.0.1", 7000), ("10.0.0.2", 7001), ("::1", 7002)]
        assert store._options["password"] == "s@cret"
        assert store._options["socket_timeout"] == 3.0
        assert "cret" not in repr(store)

    @pytest.mark.parametrize(
        "url",
        [
            "redis+cluster://",
            "redis+cluster://host:port",
            "redis+cluster://h:1/2",
            "redis+cluster://h:7\u00b2",  # a digit to str.isdigit, not to int
        ],
    )
    def test_malformed_cluster_url_is_a_configuration_error(self, url: str) -> None:
        """A cluster URL without nodes, with a bad port or a database other than 0 is refused."""
        with pytest.raises(ConfigurationError):
            RedisClusterStore.from_url(url)

    @pytest.mark.parametrize(
        "options",
        [{"decode_responses": True}, {"retry": None}, {"retries": -1}, {"prefix": "a{b}:"}],
    )
    def test_options_that_would_break_the_store_are_refused(
        self, redis_url: str, options: dict[str, Any]
    ) -> None:
        """decode_responses, a foreign retry policy, and braces in the prefix are refused."""
        with pytest.raises(ConfigurationError):
            RedisStore(redis_url, **options)

    @pytest.mark.parametrize(
        "url",
        [
            "redis://127.0.0.1:6379/",
            "redis://127.0.0.1:6379/0?max_connections=5&health_check_interval=3&client_name=x",
            "redis://127.0.0.1:6379?socket_keepalive=true",
            "rediss://127.0.0.1:6379/0?ssl_cert_reqs=none",
            "redis+cluster://127.0.0.1:7101?ssl=true&ssl_cert_reqs=none",
            "redis+cluster://127.0.0.1:7101?read_from_replicas=1",
        ],
    )
    def test_redis_py_url_parameters_are_accepted(self, url: str) -> None:
        """The parameters a connection (or the cluster client) takes still open the store."""
        open_store(url)

    @pytest.mark.parametrize(
        "url",
        [
            "redis://127.0.0.1:notaport/0",
            "redis://127.0.0.1:6379/0?decode_responses=true",
            "redis+cluster://127.0.0.1:7101?decode_responses=1",
            "redis://127.0.0.1:6379/cache",  # redis-py silently meant database 0
            "redis://127.0.0.1:6379/\u00b2",  # a digit to str.isdigit, not to int
            "redis://127.0.0.1:6379/0?bogus=1",  # a TypeError at the first command
            "rediss://127.0.0.1:6379/0?ssl_bogus=1",
            "redis+cluster://127.0.0.1:7101?bogus=1",
        ],
    )
    def test_malformed_url_is_a_configuration_error(self, url: str) -> None:
        """A URL redis-py cannot parse, one asking for decoded replies, naming a database that
        is not a number or a parameter no connection takes fails when the store is built, not
        on first use (nor silently on database 0).
        """
        with pytest.raises(ConfigurationError):
            open_store(url)

    def test_missing_driver_names_the_extra(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Without redis-py the store explains which extra to install."""
        monkeypatch.setitem(sys.modules, "redis", None)
        with pytest.raises(MissingDependencyError, match=r"oncely\[redis\]"):
            RedisStore("redis://127.0.0.1:6379/0")

    def test_importing_the_package_does_not_import_redis(self) -> None:
        """`import oncely` and the Redis store package load no driver until a store is built."""
        code = (
            "import sys, oncely, oncely.stores, oncely.stores.redis\n"
            "assert 'redis' not in sys.modules, 'redis was imported'\n"
        )
        subprocess.run([sys.executable, "-c", code], check=True)

    def test_closed_store_refuses_calls(self, redis_url: str) -> None:
        """A closed store raises StoreError instead of reconnecting."""
        store = RedisStore(redis_url, namespace="closed")
        store.close()
        store.close()
        with pytest.raises(StoreError, match="closed"):
            store.claim(_key(), "fp", lease=LEASE, ttl=TTL)
        with pytest.raises(StoreError, match="closed"):
            _arun(store.aget(_key()))


# -- record layout: one hash, one slot, a TTL ----------------------------------------------------


@pytest.mark.redis
class TestRecordLayout:
    def test_record_is_one_packed_string_named_by_prefix_namespace_and_key(
        self, shared_store: RedisStore, shared_admin: redis.Redis, namespace: str
    ) -> None:
        """The record of key k in namespace n is the string ``oncely:{n:k}``: the fixed head
        (`_codec.HEAD`), the fingerprint, the call id, then the result."""
        key = _key()
        token = shared_store.claim(key, "fp", lease=LEASE, ttl=TTL)
        assert isinstance(token, Acquired)
        shared_store.complete(key, token.token, b"\x00\xff", ttl=TTL)
        name = f"oncely:{{{namespace}:{key}}}".encode()
        assert shared_admin.type(name) == b"string"
        packed = shared_admin.get(name)
        assert packed is not None
        version, status, token_, attempt, lease, expires, created, updated, nfp, nop = (
            HEAD.unpack_from(packed)
        )
        assert (version, status, token_, attempt, nfp, nop) == (1, 2, 1, 1, 2, 16)
        assert lease == updated
        assert created <= updated < expires
        assert packed[HEAD.size : HEAD.size + 2] == b"fp"
        assert packed[HEAD.size + 2 + nop :] == b"\x00\xff"

    def test_long_fingerprint_and_call_id_round_trip(self, shared_store: RedisStore) -> None:
        """The packed layout's lengths hold any string Redis takes: a 70,000-character
        fingerprint (past two bytes of length) is stored and compared whole."""
        key, fingerprint = _key(), "f" * 70_000
        taken = shared_store.claim(key, fingerprint, lease=LEASE, ttl=TTL)
        assert isinstance(taken, Acquired)
        assert shared_store.complete(key, taken.token, b"result", ttl=TTL) is None
        answer = shared_store.claim(key, fingerprint, lease=LEASE, ttl=TTL)
        assert isinstance(answer, Replay)
        assert (answer.record.fingerprint, answer.record.result) == (fingerprint, b"result")
        other = shared_store.claim(key, fingerprint + "g", lease=LEASE, ttl=TTL)
        assert other == oncely.Mismatch(stored_fingerprint=fingerprint)
        ops = ["o" * 70_000]
        batch = shared_store.claim_many([(_key(), "fp")], lease=LEASE, ttl=TTL, ops=ops)
        assert isinstance(batch[0], Acquired)

    @pytest.mark.parametrize(
        "key", ["a}b", "}", "{", "{}", "}{", "a{b}c", "%7B", "a%b", "x:y", "é{ü}"]
    )
    def test_braces_in_keys_keep_one_nonempty_hash_tag(self, key: str) -> None:
        """Braces in a key are escaped: the tag spans the whole namespace and key, never less."""
        space = Keyspace("oncely:", "ns:1")
        name = space.name(key).decode()
        tag = name[name.index("{") + 1 : name.index("}")]
        assert name == f"oncely:{{{tag}}}"
        assert tag
        assert "{" not in tag
        assert space.key_of(space.name(key)) == key

    def test_escaping_keeps_names_distinct(self) -> None:
        """Keys and namespaces that differ only in escaped characters never share a record."""
        pairs = [("a", "b:c"), ("a:b", "c"), ("", "a}"), ("", "a%7D"), ("", "a%257D"), ("x", "{")]
        names = {Keyspace("p:", namespace).name(key) for namespace, key in pairs}
        assert len(names) == len(pairs)

    def test_ttl_is_set_on_every_record(
        self, shared_store: RedisStore, shared_admin: redis.Redis
    ) -> None:
        """In progress: PTTL covers the lease and then max(ttl, lease); an extend keeps that
        margin past the new lease end; completed: the ttl; Redis's expiry time is exactly the
        record's expires_at_ms.
        """
        key = _key()
        name = Keyspace("oncely:", shared_store.namespace).name(key)
        lease = timedelta(seconds=20)
        taken = shared_store.claim(key, "fp", lease=lease, ttl=timedelta(seconds=60))
        assert isinstance(taken, Acquired)
        assert 70_000 < shared_admin.pttl(name) <= 80_000
        record = shared_store.get(key)
        assert record is not None
        assert shared_admin.pexpiretime(name) == record.expires_at_ms
        shared_store.extend(key, taken.token, lease=timedelta(seconds=90))
        assert 170_000 < shared_admin.pttl(name) <= 180_000
        shared_store.complete(key, taken.token, b"r", ttl=timedelta(seconds=10))
        assert 0 < shared_admin.pttl(name) <= 10_000
        record = shared_store.get(key)
        assert record is not None
        assert shared_admin.pexpiretime(name) == record.expires_at_ms

    def test_in_progress_record_outlives_its_lease(
        self, shared_store: RedisStore, shared_admin: redis.Redis
    ) -> None:
        """With a ttl shorter than the lease, the record lives a lease past the lease's end."""
        key = _key()
        name = Keyspace("oncely:", shared_store.namespace).name(key)
        shared_store.claim(key, "fp", lease=timedelta(seconds=40), ttl=timedelta(seconds=1))
        assert shared_admin.pttl(name) > 70_000

    def test_release_keeps_the_expiry(
        self, shared_store: RedisStore, shared_admin: redis.Redis
    ) -> None:
        """A released tombstone keeps the record's expiry, hence its token."""
        key = _key()
        name = Keyspace("oncely:", shared_store.namespace).name(key)
        taken = shared_store.claim(key, "fp", lease=LEASE, ttl=TTL)
        assert isinstance(taken, Acquired)
        before = shared_admin.pexpiretime(name)
        assert shared_store.release(key, taken.token) is None
        assert shared_admin.pexpiretime(name) == before
        record = shared_store.get(key)
        assert record is not None
        assert record.status is Status.RELEASED

    def test_scan_lists_live_records_in_key_order(self, shared_store: RedisStore) -> None:
        """scan pages through this namespace's records by key, without results."""
        for key in ("b", "a", "c{x}", "d"):
            taken = shared_store.claim(key, "fp", lease=LEASE, ttl=TTL)
            assert isinstance(taken, Acquired)
            shared_store.complete(key, taken.token, b"big", ttl=TTL)
        first = shared_store.scan(limit=2)
        assert [record.key for record in first] == ["a", "b"]
        rest = shared_store.scan(after="b", limit=10)
        assert [record.key for record in rest] == ["c{x}", "d"]
        assert all(record.result is None for record in first + rest)
        assert shared_store.purge(batch=10) == 0  # Redis expires records itself
        shared_store.migrate()  # no schema: nothing to do

    def test_scan_pages_are_full_when_a_record_expires_under_it(
        self, shared_store: RedisStore, shared_admin: redis.Redis
    ) -> None:
        """A record SCAN lists that has expired by the time it is read does not shorten the
        page: a short page means the end, so paging (``oncely stats``, ``leases``) would stop
        there and miss every later record. PERSIST keeps the expired record's hash where SCAN
        sees it, standing for a record that expires between the SCAN and its read."""
        gone = "a"
        taken = shared_store.claim(gone, "fp", lease=LEASE, ttl=TTL)
        assert isinstance(taken, Acquired)
        shared_store.complete(gone, taken.token, b"r", ttl=timedelta(milliseconds=300))
        assert shared_admin.persist(Keyspace("oncely:", shared_store.namespace).name(gone))
        for key in ("b", "c", "d"):
            shared_store.claim(key, "fp", lease=LEASE, ttl=TTL)
        eventually(lambda: shared_store.get(gone) is None)
        assert [record.key for record in shared_store.scan(limit=2)] == ["b", "c"]
        assert [record.key for record in _all_records(shared_store, page=2)] == ["b", "c", "d"]


@pytest.mark.redis_cluster
class TestCluster:
    @pytest.fixture
    def cluster_store(self, cluster_url: str, namespace: str) -> Iterator[RedisClusterStore]:
        with RedisClusterStore(cluster_url, namespace=namespace) as store:
            yield store

    def test_each_record_lives_in_its_tags_slot_on_its_node(
        self, cluster_store: RedisClusterStore, cluster_url: str
    ) -> None:
        """CLUSTER KEYSLOT of each record is its tag's slot, and the record is on that node."""
        keys = [_key() + suffix for suffix in ("", "}", "{", "{}", "a}b{c", "é")]
        for key in keys:
            taken = cluster_store.claim(key, "fp", lease=LEASE, ttl=TTL)
            assert isinstance(taken, Acquired)
            assert cluster_store.complete(key, taken.token, b"r" * 1000, ttl=TTL) is None
        cluster = redis.RedisCluster(
            startup_nodes=[redis.cluster.ClusterNode(h, p) for h, p in cluster_store.nodes]
        )
        try:
            slots = set()
            for key in keys:
                name = Keyspace("oncely:", cluster_store.namespace).name(key)
                tag = name[name.index(b"{") + 1 : name.index(b"}")]
                slot = cluster.cluster_keyslot(name)
                assert slot == cluster.cluster_keyslot(tag)
                slots.add(slot)
                node = cluster.get_node_from_key(name)
                direct = redis.Redis(host=node.host, port=node.port)
                try:
                    packed = direct.get(name)
                    assert packed is not None
                    assert HEAD.unpack_from(packed)[1] == 2  # completed
                    assert direct.pttl(name) > 0
                finally:
                    direct.close()
            assert len(slots) > 1  # records spread over the cluster
        finally:
            cluster.close()

    def test_async_cluster_client_serves_the_same_records(
        self, cluster_store: RedisClusterStore
    ) -> None:
        """Sync and async cluster clients of one store see one record."""
        key = _key()
        taken = cluster_store.claim(key, "fp", lease=LEASE, ttl=TTL)
        assert isinstance(taken, Acquired)

        async def finish() -> Any:
            assert await cluster_store.acomplete(key, taken.token, b"done", ttl=TTL) is None
            return await cluster_store.aclaim(key, "fp", lease=LEASE, ttl=TTL)

        replay = _arun(finish())
        assert isinstance(replay, Replay)
        assert replay.record.result == b"done"

    def test_unreachable_cluster_is_unavailable(self) -> None:
        """No reachable startup node: StoreUnavailableError at once, sync and async, and each
        call tries again rather than remembering the failure.
        """
        port = _free_port()

        async def twice(store: RedisClusterStore) -> list[type[BaseException]]:
            raised = []
            for _ in range(2):
                with pytest.raises(StoreUnavailableError) as error:
                    await store.aclaim(_key(), "fp", lease=LEASE, ttl=TTL)
                raised.append(type(error.value))
            return raised

        with RedisClusterStore(f"redis+cluster://127.0.0.1:{port}") as store:
            with pytest.raises(StoreUnavailableError):
                store.claim(_key(), "fp", lease=LEASE, ttl=TTL)
            assert _arun(twice(store)) == [StoreUnavailableError, StoreUnavailableError]

    def test_cold_async_client_serves_concurrent_first_calls(self, cluster_url: str) -> None:
        """64 tasks hit a fresh store at once, again and again: one Acquired, no errors (the
        async cluster client learns the slot map before the first command is sent).
        """
        for _ in range(10):
            key = _key()
            with RedisClusterStore(cluster_url, namespace=f"cold{uuid.uuid4().hex[:8]}") as store:

                async def race(store: RedisClusterStore = store, key: str = key) -> list[Any]:
                    calls = (store.aclaim(key, "fp", lease=LEASE, ttl=TTL) for _ in range(64))
                    return await asyncio.gather(*calls, return_exceptions=True)

                answers = _arun(race())
            assert [type(answer) for answer in answers].count(Acquired) == 1, answers
            assert all(isinstance(answer, (Acquired, InProgress)) for answer in answers), answers


# -- round trips -------------------------------------------------------------------------------


class Sent:
    """Counts the commands written to any Redis server, sync and async, by name.

    Sync: what redis-py's connections send. Async: what any asyncio stream writes, which is
    where the store's own async path (`oncely.stores.redis._lanes`) writes its commands.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.names: list[str] = []
        sync_send = redis.connection.AbstractConnection.send_packed_command
        async_write = asyncio.StreamWriter.writelines
        sent = self

        def send(self: Any, command: Any, *args: Any, **kwargs: Any) -> Any:
            sent._record(command)
            return sync_send(self, command, *args, **kwargs)

        def awrite(self: Any, data: Any) -> None:
            data = list(data)
            sent._record(data)
            async_write(self, data)

        monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", send)
        monkeypatch.setattr(asyncio.StreamWriter, "writelines", awrite)

    def _record(self, command: Any) -> None:
        if not command:  # redis-py's wait for the rest of a command: nothing more is written
            return
        head = command if isinstance(command, (bytes, str)) else b"".join(list(command)[:1])
        head = head.encode() if isinstance(head, str) else head
        match = re.match(rb"\*\d+\r\n\$\d+\r\n([A-Za-z]+)", head)
        self.names.append(match.group(1).decode().upper() if match else "?")

    def take(self) -> list[str]:
        names, self.names = self.names, []
        return names


def _keys_in_one_slot(namespace: str) -> tuple[str, str]:
    """Two keys whose records share a cluster slot, hence a node and its pooled connection."""
    space = Keyspace("oncely:", namespace)
    first = _key()
    slot = redis.crc.key_slot(space.name(first))
    while True:
        second = _key()
        if redis.crc.key_slot(space.name(second)) == slot:
            return first, second


def _each_verb_once(store: Any, mode: str, counter: Sent) -> dict[str, list[str]]:
    """Run every verb once (after a warm-up of each) and return the commands each one sent."""
    sent: dict[str, list[str]] = {}
    warm_up, measured = _keys_in_one_slot(store.namespace)

    def verbs(key: str) -> list[tuple[str, Callable[[], Any]]]:
        def call(verb: str, *args: Any, **kwargs: Any) -> Callable[[], Any]:
            if mode == "sync":
                return lambda: getattr(store, verb)(*args, **kwargs)
            return lambda: _loop.run_until_complete(getattr(store, "a" + verb)(*args, **kwargs))

        return [
            ("claim", call("claim", key, "fp", lease=LEASE, ttl=TTL)),
            ("extend", call("extend", key, 1, lease=LEASE)),
            ("release", call("release", key, 1)),
            ("claim again", call("claim", key, "fp", lease=LEASE, ttl=TTL)),
            ("complete", call("complete", key, 2, b"x" * 100_000, ttl=TTL)),
            ("replay", call("claim", key, "fp", lease=LEASE, ttl=TTL)),
            ("get", call("get", key)),
            ("fail on a completed record", call("fail", key, 2, b"e", ttl=TTL)),
        ]

    _loop = asyncio.new_event_loop()
    try:
        for _, run in verbs(warm_up):  # connections open, scripts loaded
            run()
        counter.take()
        for name, run in verbs(measured):
            run()
            sent[name] = counter.take()
    finally:
        _loop.run_until_complete(_loop.shutdown_asyncgens())
        _loop.close()
    return sent


class TestRoundTrips:
    @pytest.mark.redis
    @pytest.mark.parametrize("mode", ["sync", "async"])
    def test_every_verb_is_one_fcall(
        self, monkeypatch: pytest.MonkeyPatch, redis_url: str, namespace: str, mode: str
    ) -> None:
        """claim, complete, replay, release, extend, get and fail each send exactly one FCALL."""
        counter = Sent(monkeypatch)
        with RedisStore(redis_url, namespace=namespace) as store:
            sent = _each_verb_once(store, mode, counter)
        assert sent == {name: ["FCALL"] for name in sent}, sent

    @pytest.mark.redis_cluster
    @pytest.mark.parametrize("mode", ["sync", "async"])
    def test_every_verb_is_one_fcall_on_the_cluster(
        self, monkeypatch: pytest.MonkeyPatch, cluster_url: str, namespace: str, mode: str
    ) -> None:
        """On a cluster too each verb is one FCALL, sent straight to the slot's node (redis-py
        alone would ask a node for the FCALL's keys first: COMMAND GETKEYS)."""
        counter = Sent(monkeypatch)
        with RedisClusterStore(cluster_url, namespace=namespace) as store:
            sent = _each_verb_once(store, mode, counter)
        assert sent == {name: ["FCALL"] for name in sent}, sent

    @pytest.mark.parametrize("mode", ["sync", "async"])
    def test_function_flush_costs_one_reload_then_one_round_trip(
        self, monkeypatch: pytest.MonkeyPatch, own_server: OwnRedis, mode: str
    ) -> None:
        """After FUNCTION FLUSH the next call loads the library (FCALL, FUNCTION LOAD, FCALL)
        transparently and the calls after it are one FCALL again; SCRIPT FLUSH costs nothing.
        """
        counter = Sent(monkeypatch)
        with _Calls(RedisStore(own_server.url, namespace="flush"), mode) as claim:
            assert isinstance(claim("warm-up"), Acquired)
            with own_server.admin() as admin:
                admin.function_flush()
            counter.take()
            assert isinstance(claim("after-flush"), Acquired)
            assert counter.take() == ["FCALL", "FUNCTION", "FCALL"]
            assert isinstance(claim("after-flush"), InProgress)
            assert counter.take() == ["FCALL"]
            with own_server.admin() as admin:
                admin.script_flush()
            counter.take()
            assert isinstance(claim("after-flush"), InProgress)
            assert counter.take() == ["FCALL"]

    @pytest.mark.parametrize("mode", ["sync", "async"])
    def test_a_server_without_functions_gets_scripts(
        self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, mode: str
    ) -> None:
        """A server that knows no FCALL (Redis < 7, here one that renamed it away) gets
        EVALSHA from the first call on, which reloads its script after SCRIPT FLUSH."""
        server = OwnRedis(tmp_path, "--rename-command", "FCALL", "", port=_free_port())
        server.start()
        counter = Sent(monkeypatch)
        try:
            with _Calls(RedisStore(server.url, namespace="old"), mode) as claim:
                assert isinstance(claim("a"), Acquired)
                sent = counter.take()  # after the connection's handshake
                assert sent[sent.index("FCALL") :] == ["FCALL", "EVALSHA", "SCRIPT", "EVALSHA"]
                assert isinstance(claim("a"), InProgress)
                assert counter.take() == ["EVALSHA"]
                with server.admin() as admin:
                    admin.script_flush()
                counter.take()
                assert isinstance(claim("b"), Acquired)
                assert counter.take() == ["EVALSHA", "SCRIPT", "EVALSHA"]
        finally:
            server.stop()

    @pytest.mark.parametrize("denied", ["+@all -fcall", "+@all -function"])
    def test_an_acl_that_refuses_functions_gets_scripts(
        self, monkeypatch: pytest.MonkeyPatch, own_server: OwnRedis, denied: str
    ) -> None:
        """A user that may not run FCALL, or may not load a library, gets EVALSHA."""
        with own_server.admin() as admin:
            admin.execute_command("ACL", "SETUSER", "app", "on", ">pw", "~*", *denied.split())
        url = own_server.url.replace("redis://", "redis://app:pw@")
        counter = Sent(monkeypatch)
        with RedisStore(url, namespace="acl") as store:
            assert isinstance(store.claim("a", "fp", lease=LEASE, ttl=TTL), Acquired)
            assert counter.take()[-1] == "EVALSHA"
            assert isinstance(store.claim("a", "fp", lease=LEASE, ttl=TTL), InProgress)
            assert counter.take() == ["EVALSHA"]


class _Calls:
    """A store's claim, sync or async (in a loop of its own), as one function of the key."""

    def __init__(self, store: RedisStore, mode: str) -> None:
        self.store, self.mode = store, mode
        self.loop = asyncio.new_event_loop()

    def __call__(self, key: str) -> Any:
        if self.mode == "sync":
            return self.store.claim(key, "fp", lease=LEASE, ttl=TTL)
        coroutine = self.store.aclaim(key, "fp", lease=LEASE, ttl=TTL)
        return self.loop.run_until_complete(coroutine)

    def __enter__(self) -> _Calls:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()
        self.store.close()


# -- faults ------------------------------------------------------------------------------------


class TestScriptsSurviveTheServer:
    @pytest.mark.parametrize("mode", ["sync", "async"])
    def test_calls_work_after_script_flush(self, own_server: OwnRedis, mode: str) -> None:
        """FUNCTION FLUSH and SCRIPT FLUSH between claim and complete: complete and the replay
        still work."""
        store = RedisStore(own_server.url, namespace="flush")

        async def scenario() -> None:
            taken = await store.aclaim("k", "fp", lease=LEASE, ttl=TTL)
            assert isinstance(taken, Acquired)
            with own_server.admin() as admin:
                admin.function_flush()
                admin.script_flush()
            assert await store.acomplete("k", taken.token, b"ok", ttl=TTL) is None
            with own_server.admin() as admin:
                admin.function_flush()
                admin.script_flush()
            replay = await store.aclaim("k", "fp", lease=LEASE, ttl=TTL)
            assert isinstance(replay, Replay)
            assert replay.record.result == b"ok"

        with store:
            if mode == "async":
                _arun(scenario())
            else:
                taken = store.claim("k", "fp", lease=LEASE, ttl=TTL)
                assert isinstance(taken, Acquired)
                with own_server.admin() as admin:
                    admin.function_flush()
                    admin.script_flush()
                assert store.complete("k", taken.token, b"ok", ttl=TTL) is None
                with own_server.admin() as admin:
                    admin.function_flush()
                    admin.script_flush()
                replay = store.claim("k", "fp", lease=LEASE, ttl=TTL)
                assert isinstance(replay, Replay)
                assert replay.record.result == b"ok"

    def test_calls_work_after_a_restart(self, own_server: OwnRedis) -> None:
        """A restarted server (scripts gone, pooled connections dead) serves the next call."""
        with RedisStore(own_server.url, namespace="restart") as store:
            assert isinstance(store.claim("a", "fp", lease=LEASE, ttl=TTL), Acquired)
            loop = asyncio.new_event_loop()
            try:
                loop.run_until_complete(store.aget("a"))
                own_server.restart()
                assert isinstance(store.claim("b", "fp", lease=LEASE, ttl=TTL), Acquired)
                answer = loop.run_until_complete(store.aclaim("c", "fp", lease=LEASE, ttl=TTL))
                assert isinstance(answer, Acquired)
            finally:
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()


class TestStoreGoesAway:
    def test_unreachable_before_claim_fails_fast_and_runs_nothing(self) -> None:
        """Nothing listens: StoreUnavailableError within a second; the function never ran."""
        calls: list[str] = []
        store = RedisStore(f"redis://127.0.0.1:{_free_port()}/0", namespace="down")

        @oncely.idempotent(store=store, key="order")
        def charge(order: str) -> str:
            calls.append(order)
            return order

        @oncely.idempotent(store=store, key="order")
        async def acharge(order: str) -> str:
            calls.append(order)
            return order

        started = time.monotonic()
        with pytest.raises(StoreUnavailableError):
            charge("o-1")
        with pytest.raises(StoreUnavailableError):
            _arun(acharge("o-1"))
        assert time.monotonic() - started < 2.0  # redis-py's default retries take ~3.5 s each
        assert calls == []
        store.close()

    @pytest.mark.parametrize("retries", [0, 1])
    @pytest.mark.parametrize("mode", ["sync", "async"])
    def test_connection_killed_between_claim_and_complete(
        self, monkeypatch: pytest.MonkeyPatch, own_server: OwnRedis, retries: int, mode: str
    ) -> None:
        """CLIENT KILL of the store's connections while the function runs: it ran once, the
        result is stored and replayed.

        The sync pool notices the dead connection when it is checked out and reconnects; the
        async client finds out when it sends complete, and re-sends it (``retries=1``) or
        raises StoreUnavailableError, which the decorator answers by retrying complete.
        """
        calls: list[str] = []
        outcomes: list[str] = []
        store = RedisStore(own_server.url, namespace="kill", retries=retries)
        for verb in ("complete", "acomplete"):
            original = getattr(store, verb)

            def spy(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                try:
                    answer = _original(*args, **kwargs)
                except StoreUnavailableError:
                    outcomes.append("unavailable")
                    raise
                outcomes.append("ok")
                return answer

            async def aspy(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                try:
                    answer = await _original(*args, **kwargs)
                except StoreUnavailableError:
                    outcomes.append("unavailable")
                    raise
                outcomes.append("ok")
                return answer

            monkeypatch.setattr(store, verb, aspy if verb.startswith("a") else spy)

        def kill_store_connections() -> None:
            with own_server.admin() as admin:
                assert admin.client_kill_filter(_type="normal", skipme=True) >= 1

        @oncely.idempotent(store=store, key="order", heartbeat=False)
        def charge(order: str) -> dict[str, str]:
            calls.append(order)
            kill_store_connections()
            return {"charged": order}

        @oncely.idempotent(store=store, key="order", heartbeat=False)
        async def acharge(order: str) -> dict[str, str]:
            calls.append(order)
            kill_store_connections()
            return {"charged": order}

        with store:
            if mode == "sync":
                assert charge("o-1") == {"charged": "o-1"}
                assert charge("o-1") == {"charged": "o-1"}
            else:

                async def twice() -> None:
                    assert await acharge("o-1") == {"charged": "o-1"}
                    assert await acharge("o-1") == {"charged": "o-1"}

                _arun(twice())
        assert calls == ["o-1"]
        if mode == "async" and retries == 0:
            assert outcomes == ["unavailable", "ok"]
        else:
            assert outcomes == ["ok"]

    @pytest.mark.parametrize("mode", ["sync", "async"])
    def test_store_down_between_claim_and_complete_is_retried(
        self, durable_server: OwnRedis, mode: str
    ) -> None:
        """The server is down when the function returns and back 0.3 s later: complete is
        retried by the decorator until it lands; the function ran once.
        """
        calls: list[str] = []
        store = RedisStore(durable_server.url, namespace="down-up", retries=0)
        restarted = threading.Event()

        def take_the_server_down_for_a_while() -> None:
            durable_server.stop()

            def back() -> None:
                time.sleep(0.3)
                durable_server.start()
                restarted.set()

            threading.Thread(target=back, daemon=True).start()

        @oncely.idempotent(store=store, key="order", heartbeat=False)
        def charge(order: str) -> str:
            calls.append(order)
            take_the_server_down_for_a_while()
            return order

        @oncely.idempotent(store=store, key="order", heartbeat=False)
        async def acharge(order: str) -> str:
            calls.append(order)
            take_the_server_down_for_a_while()
            return order

        with store:
            if mode == "sync":
                assert charge("o-1") == "o-1"
                assert restarted.is_set()
                assert charge("o-1") == "o-1"
            else:

                async def twice() -> None:
                    assert await acharge("o-1") == "o-1"
                    assert restarted.is_set()
                    assert await acharge("o-1") == "o-1"

                _arun(twice())
        assert calls == ["o-1"]

    def test_store_down_after_complete_fails_closed(self, own_server: OwnRedis) -> None:
        """After complete the server goes away: repeats raise StoreUnavailableError, never run."""
        calls: list[str] = []
        store = RedisStore(own_server.url, namespace="after", retries=0)

        @oncely.idempotent(store=store, key="order", heartbeat=False)
        def charge(order: str) -> str:
            calls.append(order)
            return order

        with store:
            assert charge("o-1") == "o-1"
            own_server.stop()
            with pytest.raises(StoreUnavailableError):
                charge("o-1")
        assert calls == ["o-1"]


class TestRestartWithLeasesInFlight:
    def test_without_persistence_a_restart_forgets_leases_and_tokens(
        self, own_server: OwnRedis
    ) -> None:
        """Documented hazard: a server without persistence loses every record on restart, so
        the key is claimable at once and its tokens start again at 1.
        """
        with RedisStore(own_server.url, namespace="volatile") as store:
            first = store.claim("k", "fp", lease=LEASE, ttl=TTL)
            assert first == Acquired(1)
            own_server.restart()
            assert store.get("k") is None
            assert store.claim("k", "fp", lease=LEASE, ttl=TTL) == Acquired(1)

    @pytest.mark.parametrize("mode", ["sync", "async"])
    def test_with_append_only_file_leases_survive_a_crash(
        self, durable_server: OwnRedis, mode: str
    ) -> None:
        """appendonly yes + appendfsync always: after kill -9 and restart the lease is still
        held, its holder completes it, the expiry is unchanged, and repeats replay.
        """
        with RedisStore(durable_server.url, namespace="durable") as store:
            taken = store.claim("k", "fp", lease=LEASE, ttl=TTL)
            assert isinstance(taken, Acquired)
            before = store.get("k")
            durable_server.restart(signal.SIGKILL)

            async def after() -> tuple[Any, Any, Any, Any]:
                return (
                    await store.aclaim("k", "fp", lease=LEASE, ttl=TTL),
                    await store.aget("k"),
                    await store.acomplete("k", taken.token, b"done", ttl=TTL),
                    await store.aclaim("k", "fp", lease=LEASE, ttl=TTL),
                )

            if mode == "sync":
                answers = (
                    store.claim("k", "fp", lease=LEASE, ttl=TTL),
                    store.get("k"),
                    store.complete("k", taken.token, b"done", ttl=TTL),
                    store.claim("k", "fp", lease=LEASE, ttl=TTL),
                )
            else:
                answers = _arun(after())
            in_progress, record, completed, replay = answers
            assert isinstance(in_progress, InProgress)
            assert record == before
            assert completed is None
            assert isinstance(replay, Replay)
            assert replay.record.result == b"done"


@pytest.mark.redis
class TestServerClock:
    @pytest.mark.parametrize("skew", [timedelta(minutes=10), -timedelta(minutes=10)])
    @pytest.mark.parametrize("mode", ["sync", "async"])
    def test_client_clock_skew_cannot_take_a_live_lease(
        self,
        monkeypatch: pytest.MonkeyPatch,
        shared_store: RedisStore,
        shared_admin: redis.Redis,
        skew: timedelta,
        mode: str,
    ) -> None:
        """A worker whose clock is minutes off still finds the lease live, and every timestamp
        in the record is the server's.
        """
        key = _key()
        taken = shared_store.claim(key, "fp", lease=timedelta(seconds=20), ttl=TTL)
        assert isinstance(taken, Acquired)
        real_time, real_time_ns = time.time, time.time_ns
        offset = skew.total_seconds()
        monkeypatch.setattr(time, "time", lambda: real_time() + offset)
        monkeypatch.setattr(time, "time_ns", lambda: real_time_ns() + int(offset * 1e9))
        if mode == "sync":
            answer = shared_store.claim(key, "fp", lease=timedelta(seconds=20), ttl=TTL)
            record = shared_store.get(key)
        else:

            async def skewed() -> tuple[Any, Any]:
                answer = await shared_store.aclaim(key, "fp", lease=timedelta(seconds=20), ttl=TTL)
                return answer, await shared_store.aget(key)

            answer, record = _arun(skewed())
        assert isinstance(answer, InProgress)
        assert timedelta(seconds=15) < answer.retry_after <= timedelta(seconds=20)
        seconds, microseconds = shared_admin.time()
        server_ms = seconds * 1000 + microseconds // 1000
        assert record is not None
        assert abs(record.created_at_ms - server_ms) < 5_000
        assert abs(record.lease_expires_at_ms - (server_ms + 20_000)) < 5_000


_GOOD = {
    "status": "completed",
    "fp": "fp",
    "token": "1",
    "attempt": "1",
    "lease": "1",
    "expires": "99999999999999",
    "created": "1",
    "updated": "1",
}
"""A valid completed record's fields in the hash layout of earlier versions, to spoil one at a
time."""


def _packed(version: int = 1, status: int = 2, fp: bytes = b"fp", nfp: int | None = None) -> bytes:
    """A completed record in the packed layout (`HEAD`), spoilt as asked."""
    head = HEAD.pack(
        version, status, 1, 1, 1, 99999999999999, 1, 1, len(fp) if nfp is None else nfp, 0
    )
    return head + fp + b"result"


CORRUPTIONS: dict[str, Callable[[redis.Redis, bytes], Any]] = {
    "string": lambda r, n: r.set(n, "hello"),
    "list": lambda r, n: r.rpush(n, "a"),
    "garbage status": lambda r, n: r.hset(n, mapping={**_GOOD, "status": "??"}),
    "no status": lambda r, n: r.hset(n, mapping={"fp": "fp", "token": "1"}),
    "token not a number": lambda r, n: r.hset(n, mapping={**_GOOD, "token": "one"}),
    "fingerprint not utf-8": lambda r, n: r.hset(n, mapping={**_GOOD, "fp": b"\xff\xfe"}),
    "packed, unknown version": lambda r, n: r.set(n, _packed(version=2)),
    "packed, unknown status": lambda r, n: r.set(n, _packed(status=9)),
    "packed, truncated": lambda r, n: r.set(n, _packed(nfp=200)),
    "packed, short head": lambda r, n: r.set(n, _packed()[:20]),
    "packed, fingerprint not utf-8": lambda r, n: r.set(n, _packed(fp=b"\xff\xfe")),
}
"""Foreign or damaged values at a record's name."""


@pytest.mark.redis
class TestCorruptRecords:
    @pytest.fixture
    def plant(
        self, shared_store: RedisStore, shared_admin: redis.Redis
    ) -> Callable[[str, Callable[[redis.Redis, bytes], Any]], str]:
        """Write something foreign at the name of a key's record; return the key."""

        def plant(key: str, write: Callable[[redis.Redis, bytes], Any]) -> str:
            name = Keyspace("oncely:", shared_store.namespace).name(key)
            write(shared_admin, name)
            shared_admin.pexpire(name, 60_000)
            return key

        return plant

    @pytest.mark.parametrize(
        ("case", "verb"),
        [
            (case, verb)
            for case in sorted(CORRUPTIONS)
            for verb in ("claim", "complete", "fail", "release", "extend", "get")
            # The settle verbs never read the fingerprint, so its encoding cannot hurt them.
            if "fingerprint not utf-8" not in case or verb in ("claim", "get")
        ],
    )
    @pytest.mark.parametrize("mode", ["sync", "async"])
    def test_every_verb_fails_closed_on_a_corrupt_record(
        self,
        plant: Callable[[str, Callable[[redis.Redis, bytes], Any]], str],
        shared_store: RedisStore,
        case: str,
        verb: str,
        mode: str,
    ) -> None:
        """A foreign value, a garbage status or an undecodable field: CorruptRecordError."""
        key = plant(_key(), CORRUPTIONS[case])
        args: dict[str, tuple[Any, dict[str, Any]]] = {
            "claim": ((key, "fp"), {"lease": LEASE, "ttl": TTL}),
            "complete": ((key, 1, b"r"), {"ttl": TTL}),
            "fail": ((key, 1, b"e"), {"ttl": TTL}),
            "release": ((key, 1), {}),
            "extend": ((key, 1), {"lease": LEASE}),
            "get": ((key,), {}),
        }
        positional, keywords = args[verb]
        with pytest.raises(CorruptRecordError) as raised:
            if mode == "sync":
                getattr(shared_store, verb)(*positional, **keywords)
            else:
                _arun(getattr(shared_store, "a" + verb)(*positional, **keywords))
        assert raised.value.key == key
        # The scripts recognise foreign values themselves (no WRONGTYPE error from Redis).
        assert not isinstance(raised.value.__cause__, redis.RedisError)

    @pytest.mark.parametrize("case", ["string", "garbage status"])
    def test_decorated_function_never_runs_over_a_corrupt_record(
        self,
        plant: Callable[[str, Callable[[redis.Redis, bytes], Any]], str],
        shared_store: RedisStore,
        case: str,
    ) -> None:
        """@idempotent over a corrupt record raises CorruptRecordError and does not execute."""
        calls: list[str] = []

        @oncely.idempotent(store=shared_store, key="order", scope="corrupt")
        def charge(order: str) -> str:
            calls.append(order)
            return order

        @oncely.idempotent(store=shared_store, key="order", scope="corrupt")
        async def acharge(order: str) -> str:
            calls.append(order)
            return order

        order = uuid.uuid4().hex
        plant(scope_key("corrupt", order), CORRUPTIONS[case])
        with pytest.raises(CorruptRecordError):
            charge(order)
        with pytest.raises(CorruptRecordError):
            _arun(acharge(order))
        assert calls == []

    def test_store_rejecting_a_write_is_a_store_error(self, tmp_path: Path) -> None:
        """maxmemory with noeviction refusing a result: StoreError (not unavailable, not
        corrupt), and the record is left as it was.
        """
        server = OwnRedis(tmp_path, "--maxmemory-policy", "noeviction", port=_free_port())
        server.start()
        try:
            with RedisStore(server.url, namespace="oom") as store:
                taken = store.claim("k", "fp", lease=LEASE, ttl=TTL)
                assert isinstance(taken, Acquired)
                blob = os.urandom(4 * 1024 * 1024)
                with server.admin() as admin:
                    admin.set("ballast", blob)
                    admin.config_set("maxmemory", 1024 * 1024)  # over it from now on
                with pytest.raises(StoreError) as raised:
                    store.complete("k", taken.token, blob, ttl=TTL)
                assert type(raised.value) is StoreError
                record = store.get("k")
                assert record is not None
                assert (record.status, record.token) == (Status.IN_PROGRESS, taken.token)
        finally:
            server.stop()


def _earlier_record(
    admin: redis.Redis, key: str, name: bytes, status: str, *, lease_ms: int, result: bytes = b""
) -> Record:
    """Write *key*'s record at *name* as oncely wrote it before the packed layout: a hash of one
    field each, expiring with PEXPIREAT at its ``expires`` (a minute from now); return it."""
    seconds, microseconds = admin.time()
    now = seconds * 1000 + microseconds // 1000
    numbers = {"lease": now + lease_ms, "expires": now + 60_000}
    numbers |= {"token": 3, "attempt": 2, "created": now - 5_000, "updated": now - 1_000}
    fields: dict[str, Any] = {"status": status, "fp": "fp", "op": "0123456789abcdef", **numbers}
    if result:
        fields["result"] = result
    admin.hset(name, mapping=fields)
    admin.pexpireat(name, numbers["expires"])
    return Record(
        key=key,
        status=Status(status),
        fingerprint="fp",
        token=3,
        attempt=2,
        lease_expires_at_ms=numbers["lease"],
        expires_at_ms=numbers["expires"],
        created_at_ms=numbers["created"],
        updated_at_ms=numbers["updated"],
        result=result or None,
    )


@pytest.mark.redis
class TestEarlierLayout:
    """Records written by oncely before the packed layout (one hash each) are read as they were,
    by every verb; the first write replaces such a record by the packed string."""

    @pytest.fixture
    def name_of(self, shared_store: RedisStore) -> Callable[[str], bytes]:
        return Keyspace("oncely:", shared_store.namespace).name

    def test_completed_record_replays_and_reads_whole(
        self, shared_store: RedisStore, shared_admin: redis.Redis, name_of: Callable[[str], bytes]
    ) -> None:
        key = _key()
        written = _earlier_record(
            shared_admin, key, name_of(key), "completed", lease_ms=-1_000, result=b"\x00r"
        )
        answer = shared_store.claim(key, "fp", lease=LEASE, ttl=TTL)
        assert isinstance(answer, Replay)
        assert answer.record == written
        assert shared_store.get(key) == written
        assert isinstance(shared_store.claim(key, "other", lease=LEASE, ttl=TTL), oncely.Mismatch)
        assert shared_admin.type(name_of(key)) == b"hash"  # reads leave it as it is

    @pytest.mark.parametrize("mode", ["sync", "async"])
    def test_lease_of_an_earlier_record_is_completed_by_its_token(
        self,
        shared_store: RedisStore,
        shared_admin: redis.Redis,
        name_of: Callable[[str], bytes],
        mode: str,
    ) -> None:
        """A live lease is respected, and its holder's token completes it: the record is then
        the packed string, with the tokens and times it had."""
        key = _key()
        written = _earlier_record(shared_admin, key, name_of(key), "in_progress", lease_ms=20_000)
        store = shared_store
        if mode == "sync":
            busy = store.claim(key, "fp", lease=LEASE, ttl=TTL)
            assert store.complete(key, 2, b"stale", ttl=TTL) == LeaseLost()
            assert store.extend(key, 3, lease=LEASE) is None
            assert store.complete(key, 3, b"done", ttl=TTL) is None
        else:
            busy = _arun(store.aclaim(key, "fp", lease=LEASE, ttl=TTL))
            assert _arun(store.acomplete(key, 2, b"stale", ttl=TTL)) == LeaseLost()
            assert _arun(store.aextend(key, 3, lease=LEASE)) is None
            assert _arun(store.acomplete(key, 3, b"done", ttl=TTL)) is None
        assert isinstance(busy, InProgress)
        assert shared_admin.type(name_of(key)) == b"string"
        answer = store.claim(key, "fp", lease=LEASE, ttl=TTL)
        assert isinstance(answer, Replay)
        assert (answer.record.token, answer.record.attempt, answer.record.result) == (3, 2, b"done")
        assert answer.record.created_at_ms == written.created_at_ms

    def test_lapsed_lease_of_an_earlier_record_is_taken_over(
        self, shared_store: RedisStore, shared_admin: redis.Redis, name_of: Callable[[str], bytes]
    ) -> None:
        key = _key()
        _earlier_record(shared_admin, key, name_of(key), "in_progress", lease_ms=-1)
        taken = shared_store.claim(key, "fp", lease=LEASE, ttl=TTL)
        assert taken == Acquired(4, recovered=True, attempt=3)
        assert shared_store.release(key, 3) == LeaseLost()
        assert shared_store.release(key, 4) is None
        again = shared_store.claim(key, "fp", lease=LEASE, ttl=TTL)
        assert again == Acquired(5, recovered=False, attempt=4)

    def test_earlier_record_without_a_call_id_is_forgotten(
        self, shared_store: RedisStore, shared_admin: redis.Redis, name_of: Callable[[str], bytes]
    ) -> None:
        """Records of the first versions have no ``op`` field."""
        key = _key()
        name = name_of(key)
        _earlier_record(shared_admin, key, name, "failed", lease_ms=-1_000, result=b"boom")
        shared_admin.hdel(name, "op")
        assert shared_store.forget(key) is Status.FAILED
        record = shared_store.get(key)
        assert record is not None
        assert (record.status, record.token, record.result) == (Status.RELEASED, 3, None)
        assert shared_admin.type(name) == b"string"
        assert shared_admin.pexpiretime(name) == record.expires_at_ms


def _packed_record(
    admin: redis.Redis, name: bytes, status: int, *, token: int, lease_ms: int, op: str
) -> tuple[int, int]:
    """Write a record at *name* byte for byte as the scripts of oncely before its function
    library packed it (`HEAD`, fingerprint ``fp``, call id *op*, result ``r`` when finished),
    expiring a minute from now; return its (created, expires)."""
    seconds, microseconds = admin.time()
    now = seconds * 1000 + microseconds // 1000
    created, expires = now - 5_000, now + 60_000
    head = HEAD.pack(1, status, token, 2, now + lease_ms, expires, created, now - 1_000, 2, len(op))
    admin.set(name, head + b"fp" + op.encode() + (b"r" if status in (2, 3) else b""))
    admin.pexpireat(name, expires)
    return created, expires


def _as_scripts(store: RedisStore) -> RedisStore:
    """*store*, made to run the code as scripts (EVALSHA), as on a server without functions."""
    store._sync_scripts().heads = _scripts._evalsha_heads()
    return store


@pytest.mark.redis
class TestRollingUpgrade:
    """Records written by the scripts of earlier versions (the same packed layout) are read and
    moved on by the function library, and the two take turns on one record."""

    @pytest.fixture
    def name_of(self, shared_store: RedisStore) -> Callable[[str], bytes]:
        return Keyspace("oncely:", shared_store.namespace).name

    def test_a_completed_record_replays(
        self, shared_store: RedisStore, shared_admin: redis.Redis, name_of: Callable[[str], bytes]
    ) -> None:
        key = _key()
        created, expires = _packed_record(
            shared_admin, name_of(key), 2, token=3, lease_ms=-1_000, op="0123456789abcdef"
        )
        answer = shared_store.claim(key, "fp", lease=LEASE, ttl=TTL)
        assert isinstance(answer, Replay)
        record = answer.record
        assert (record.status, record.token, record.attempt, record.result) == (
            Status.COMPLETED,
            3,
            2,
            b"r",
        )
        assert (record.created_at_ms, record.expires_at_ms) == (created, expires)
        assert shared_store.get(key) == record

    def test_a_lease_is_found_again_by_its_own_call_and_completed(
        self, shared_store: RedisStore, shared_admin: redis.Redis, name_of: Callable[[str], bytes]
    ) -> None:
        """The call id an earlier version stored is compared whole: the claim re-sent with it
        gets its own lease back, another call finds it busy, and its token completes it."""
        key, op = _key(), "f" * 16
        _packed_record(shared_admin, name_of(key), 1, token=3, lease_ms=20_000, op=op)
        again = shared_store.claim_many([(key, "fp")], lease=LEASE, ttl=TTL, ops=[op])
        assert again == [Acquired(3, attempt=2)]
        assert isinstance(shared_store.claim(key, "fp", lease=LEASE, ttl=TTL), InProgress)
        assert shared_store.complete(key, 2, b"stale", ttl=TTL) == LeaseLost()
        assert shared_store.extend(key, 3, lease=LEASE) is None
        assert shared_store.complete(key, 3, b"done", ttl=TTL) is None
        answer = shared_store.claim(key, "fp", lease=LEASE, ttl=TTL)
        assert isinstance(answer, Replay)
        assert (answer.record.token, answer.record.result) == (3, b"done")

    def test_a_lapsed_lease_is_taken_over(
        self, shared_store: RedisStore, shared_admin: redis.Redis, name_of: Callable[[str], bytes]
    ) -> None:
        key = _key()
        _packed_record(shared_admin, name_of(key), 1, token=3, lease_ms=-1, op="o")
        assert shared_store.claim(key, "fp", lease=LEASE, ttl=TTL) == Acquired(
            4, recovered=True, attempt=3
        )
        assert shared_store.release(key, 3) == LeaseLost()
        assert shared_store.release(key, 4) is None

    def test_functions_and_scripts_take_turns_on_a_record(
        self, redis_url: str, namespace: str
    ) -> None:
        """Workers of two versions side by side: each transition is judged the same, whichever
        of them wrote the record last."""
        with (
            RedisStore(redis_url, namespace=namespace) as new,
            _as_scripts(RedisStore(redis_url, namespace=namespace)) as old,
        ):
            key = _key()
            taken = old.claim(key, "fp", lease=LEASE, ttl=TTL)
            assert taken == Acquired(1)
            assert isinstance(new.claim(key, "fp", lease=LEASE, ttl=TTL), InProgress)
            assert new.extend(key, 1, lease=LEASE) is None
            assert old.release(key, 1) is None
            assert new.claim(key, "fp", lease=LEASE, ttl=TTL) == Acquired(2, attempt=2)
            assert old.complete(key, 1, b"stale", ttl=TTL) == LeaseLost()
            assert old.complete(key, 2, b"done", ttl=TTL) is None
            replays = [store.claim(key, "fp", lease=LEASE, ttl=TTL) for store in (new, old)]
            assert all(isinstance(answer, Replay) for answer in replays)
            assert [answer.record for answer in replays if isinstance(answer, Replay)] == [
                new.get(key),
                old.get(key),
            ]
            assert old.forget(key) is Status.COMPLETED
            assert new.claim(key, "fp", lease=LEASE, ttl=TTL) == Acquired(3, attempt=3)


class TestEventLoops:
    @pytest.mark.redis
    def test_one_store_serves_successive_event_loops_without_leaks(
        self, shared_store: RedisStore
    ) -> None:
        """asyncio.run twice on one store: each loop gets its own connections, which close with
        the loop (no ResourceWarning: warnings are errors in this suite).
        """
        key = _key()
        first = _arun(shared_store.aclaim(key, "fp", lease=LEASE, ttl=TTL))
        assert isinstance(first, Acquired)
        assert _arun(shared_store.acomplete(key, first.token, b"r", ttl=TTL)) is None
        assert isinstance(_arun(shared_store.aclaim(key, "fp", lease=LEASE, ttl=TTL)), Replay)
        gc.collect()

    @pytest.mark.redis
    def test_async_context_manager_closes_the_loops_client(self, redis_url: str) -> None:
        """`async with` closes the store from inside its loop."""

        async def use() -> LeaseLost | None:
            async with RedisStore(redis_url, namespace="ctx") as store:
                return await store.arelease(_key(), 1)

        assert _arun(use()) == LeaseLost()
        gc.collect()


# -- lost replies ---------------------------------------------------------------------------------


def _cluster_ports(cluster_url: str) -> list[int]:
    return [int(node.rpartition(":")[2]) for node in cluster_url.partition("://")[2].split(",")]


@contextlib.contextmanager
def _behind_cutters(kind: str, url: str, ns: str, **options: Any) -> Iterator[tuple[Any, Proxy]]:
    """A store whose every connection goes through one `Proxy` per server (node)."""
    if kind == "standalone":
        port = int(url.partition("://")[2].partition("/")[0].rpartition(":")[2])
        with (
            Proxy(port) as cutter,
            RedisStore(f"redis://127.0.0.1:{cutter.port}/0", namespace=ns, **options) as store,
        ):
            yield store, cutter
        return
    cutters = {port: Proxy(port) for port in _cluster_ports(url)}
    shared = _SharedCutter(list(cutters.values()))

    def remap(address: tuple[str, int]) -> tuple[str, int]:
        host, port = address
        return ("127.0.0.1", cutters[port].port) if port in cutters else (host, port)

    nodes = ",".join(f"127.0.0.1:{cutter.port}" for cutter in cutters.values())
    try:
        with RedisClusterStore(
            f"redis+cluster://{nodes}", namespace=ns, address_remap=remap, **options
        ) as store:
            yield store, shared  # type: ignore[misc]
    finally:
        for cutter in cutters.values():
            cutter.close()


class _SharedCutter:
    """Arms every node's cutter: whichever node serves the key cuts the reply."""

    def __init__(self, cutters: list[Proxy]) -> None:
        self._cutters = cutters

    def arm(self, marker: bytes, *, until: bytes = b"", hold: bool = False) -> None:
        for cutter in self._cutters:
            cutter.arm(marker, until=until, hold=hold)

    @property
    def cuts(self) -> int:
        return sum(cutter.cuts for cutter in self._cutters)


class TestLostReplies:
    """redis-py re-sends a script after a lost reply (a connection error or a timeout). The
    script already ran: the re-send must find its own effect and answer as the first reply
    would have, never InProgress to its own claim nor LeaseLost to its own settle."""

    @pytest.mark.parametrize("verb", VERBS)
    @pytest.mark.parametrize("mode", ["sync", "async"])
    @pytest.mark.parametrize(
        "kind",
        [
            pytest.param("standalone", marks=pytest.mark.redis),
            pytest.param("cluster", marks=pytest.mark.redis_cluster),
        ],
    )
    def test_resent_transition_answers_as_the_first_run(
        self, kind: str, mode: str, verb: str, namespace: str
    ) -> None:
        url = service_url(f"ONCELY_TEST_REDIS{'' if kind == 'standalone' else '_CLUSTER'}_URL")
        with _behind_cutters(kind, url, namespace) as (store, cutter):
            api = StoreCalls(store, mode)
            try:
                assert_lost_reply_is_recognised(api, cutter, verb, _key())  # type: ignore[arg-type]
            finally:
                api.close()

    @pytest.mark.redis
    @pytest.mark.parametrize("verb", VERBS)
    @pytest.mark.parametrize("mode", ["sync", "async"])
    def test_standalone_resend_after_a_timeout_answers_as_the_first_run(
        self, mode: str, verb: str, namespace: str
    ) -> None:
        """The script ran, its reply never came and the client timed out: the store re-sends
        it (same call id) on a fresh connection and the caller gets the first run's answer (its
        own lease, not a StoreUnavailableError and then InProgress until the lease ends)."""
        url = service_url("ONCELY_TEST_REDIS_URL")
        with _behind_cutters("standalone", url, namespace, socket_timeout=1.0) as (store, cutter):
            api = StoreCalls(store, mode)
            try:
                assert_lost_reply_is_recognised(api, cutter, verb, _key(), hold=True)  # type: ignore[arg-type]
            finally:
                api.close()

    @pytest.mark.redis_cluster
    @pytest.mark.parametrize("verb", VERBS)
    @pytest.mark.parametrize("mode", ["sync", "async"])
    def test_cluster_resend_after_a_timeout_answers_as_the_first_run(
        self, mode: str, verb: str, namespace: str
    ) -> None:
        """The cluster client re-sends after a timeout whatever the store asks: the script ran,
        its reply never came, and the re-send still answers as the first reply would have."""
        url = service_url("ONCELY_TEST_REDIS_CLUSTER_URL")
        with _behind_cutters("cluster", url, namespace, socket_timeout=1.0) as (store, cutter):
            api = StoreCalls(store, mode)
            try:
                assert_lost_reply_is_recognised(api, cutter, verb, _key(), hold=True)  # type: ignore[arg-type]
            finally:
                api.close()
