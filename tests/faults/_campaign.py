"""Generate fault-injected histories from a seed, run them against real stores, check them.

A history is one store, one entry point and one fault: worker A runs a few operations and
meets the fault; worker B is a client retrying the same keys until it gets their results
(concurrently with A, or after it, as the fault needs). `run` returns every history's
anomalies (`tests.faults._checker`) and the faults injected, by kind.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import multiprocessing
import os
import random
import signal
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from tests._proxy import Proxy
from tests._servers import OwnRedis
from tests.faults import (
    _brokers,
    _celery_reuse,
    _edges,
    _http,
    _kafka,
    _relay,
    _retry_after,
    _streams,
    _tiered,
    _txn_begin,
    _workers,
)
from tests.faults._checker import Anomaly, check
from tests.faults._effects import Effects
from tests.faults._history import History, now
from tests.faults._servers import durable_redis, free_port

STORES = ("memory", "sqlite", "postgres", "redis", "redis_cluster", "tiered")
ENTRIES = (
    "sync",
    "async",
    "guard",
    "guard_async",
    "txn",
    "asgi",
    "wsgi",
    "httpx",
    "kafka",
    "redis_streams",
    "rabbitmq",
    "nats",
    "faststream",
    "celery",
    "kafka_group",
    _tiered.ENTRY,
    _relay.ENTRY,
    "identity",
    _txn_begin.ENTRY,
)
HTTP_ENTRIES = ("asgi", "wsgi", "httpx")
BROKER_ENTRIES = ("rabbitmq", "nats", "faststream", "celery")
"""Members of a queue or a JetStream consumer (`_brokers`); FastStream's and Celery workers on
RabbitMQ."""
KILLS = ("kill@claim", "kill@mid", "kill@effect", "kill@complete")
HTTP_KILLS = ("kill@mid", "kill@effect")
"""Where a uvicorn worker dies mid-request: between the middleware's claim and its complete."""
STOPS = ("stop@claim", "stop@mid")
PROXIED = ("cut@claim", "cut@complete", "latency", "reset")
FAULTS = (
    "none",
    *KILLS,
    *STOPS,
    "zombie@ttl=lease",
    "slow",
    "skew",
    *PROXIED,
    "restart",
    "disconnect",
    "redelivery",
    "rebalance@join",
    "rebalance@kill",
    *_tiered.FAULTS,
    *_relay.FAULTS,
    *_edges.FAULTS,
    *_retry_after.FAULTS,
    *_celery_reuse.FAULTS,
)
REBALANCES = ("rebalance@join", "rebalance@kill")

_SERVER_CLOCK = {"postgres", "redis", "redis_cluster", "tiered"}
_PROXYABLE = {"postgres", "redis", "tiered"}
_ASYNCPG = importlib.util.find_spec("asyncpg") is not None
"""The ``async`` entry's PostgreSQL store runs its verbs on asyncpg when it is installed (the
store's ``async_driver="asyncpg"``), so the faults meet that path too; ``guard_async`` keeps
psycopg's. Under ``latency`` its heartbeats once lost their leases: a connection's first
grouped extend prepared its statement in round trips of its own (asyncpg looking up the type of
its ``bigint[]``), and a group naming a lease twice ran as a transaction, a round trip per
extend; now a connection prepares the extends as it opens and a group extends a lease once."""


def applicable(store: str, entry: str, fault: str) -> bool:
    """Whether *fault* means something for *store* and *entry*."""
    if fault in _edges.FAULTS:
        return _edges.applicable(store, entry, fault)
    if fault in _retry_after.FAULTS:
        return _retry_after.applicable(store, entry)
    if fault in _celery_reuse.FAULTS:
        return _celery_reuse.applicable(store, entry)
    tiered = _tiered.applicable(store, entry, fault)
    if tiered is not None:
        return tiered
    if entry == _relay.ENTRY or fault in _relay.FAULTS:
        return _relay.applicable(store, entry, fault)
    if entry == _txn_begin.ENTRY:
        return _txn_begin.applicable(store, fault)
    if entry in HTTP_ENTRIES:  # a server process per store: Redis and PostgreSQL
        if entry == "asgi" and fault in HTTP_KILLS:  # uvicorn workers of the history's own
            return store in ("redis", "postgres")
        return store in ("redis", "postgres") and fault in ("none", "disconnect")
    if entry == "identity":  # clients whose credentials change between attempts (`_identity`)
        return store in ("redis", "postgres") and fault in ("none", "disconnect")
    if entry == "redis_streams":  # a member killed mid-handler, its entry reclaimed
        return store == "redis" and fault in ("none", "kill@mid")
    if entry in BROKER_ENTRIES:  # a member killed before or after its write, redelivered
        return store in ("redis", "postgres") and fault in ("kill@mid", "kill@effect")
    if entry == "kafka_group":  # partitions move between two members while records run
        return store in ("redis", "postgres") and fault in REBALANCES
    if entry == "kafka":  # ordered batches redelivered past their lease
        return store in ("redis", "postgres") and fault == "redelivery"
    if fault in ("disconnect", "redelivery", *REBALANCES):
        return False
    if entry == "txn":  # the effect and its record in one PostgreSQL transaction
        return store == "postgres" and fault != "restart"
    if store == "memory":  # one process: nothing to kill, stop or proxy
        return fault in ("none", "slow")
    if fault == "skew":
        return store in _SERVER_CLOCK  # SQLite judges time by the host's clock, by design
    if fault in PROXIED:
        return store in _PROXYABLE and not (store == "tiered" and fault == "cut@claim")
    if fault == "restart":
        return store in ("redis", "tiered")
    if fault == "zombie@ttl=lease":
        return store in ("redis", "redis_cluster", "tiered", "postgres", "sqlite")
    return True


@dataclass
class Plan:
    index: int
    store: str
    entry: str
    fault: str
    keys: int
    lease: float
    seed: int

    @property
    def name(self) -> str:
        return f"h{self.index}:{self.store}/{self.entry}/{self.fault}"


@dataclass
class Result:
    plan: Plan
    history: History
    anomalies: list[Anomaly]
    faults: list[str]
    seconds: float


@dataclass
class Services:
    """The servers a campaign uses, and what it made on them (dropped by `close`)."""

    postgres: str
    redis_cluster: str | None
    kafka: str | None = None
    rabbitmq: str | None = None
    nats: str | None = None
    run: str = field(default_factory=lambda: uuid.uuid4().hex[:10])
    redis: OwnRedis | None = None
    effects: Effects | None = None
    tmp: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="oncely-faults-"))
    restart_lock: threading.Lock = field(default_factory=threading.Lock)
    servers: dict[tuple[str, str], tuple[int, Any]] = field(default_factory=dict)
    server_events: History = field(default_factory=lambda: History("servers"))
    server_lock: threading.Lock = field(default_factory=threading.Lock)

    def server(self, kind: str, store: str, lease: float) -> int:
        """The port of the *kind* server (``asgi``/``wsgi``) on *store*, started on first use."""
        plan = Plan(-1, store, kind, "none", 0, lease, 0)
        return self.serve_once(kind, plan, functools.partial(_http.serve, kind))

    def serve_once(
        self, kind: str, plan: Plan, serve: Callable[[dict[str, Any], Any], None]
    ) -> int:
        """The port of the *kind* server on *plan*'s store and lease, started on first use:
        ``serve(config, pipe)`` in a process of its own, which sends its port and then its
        events down the pipe. It lives as long as the campaign; its events go to
        `server_events`."""
        with self.server_lock:
            if (kind, plan.store) not in self.servers:
                assert self.effects is not None
                config = {
                    "store": self.store_spec(plan, None),
                    "effects": {"url": self.effects.url, "schema": self.effects.schema},
                    "lease": plan.lease,
                    "ttl": 60.0,
                }
                ctx = multiprocessing.get_context("forkserver")
                reader, writer = ctx.Pipe(duplex=False)
                process = ctx.Process(target=serve, args=(config, writer), daemon=True)
                process.start()
                writer.close()
                # Generous: a loaded host's forkserver may be busy starting other workers.
                if not reader.poll(120):
                    process.kill()
                    raise RuntimeError(f"the {kind} server on {plan.store} did not start")
                port = int(reader.recv()["port"])
                threading.Thread(target=self._read_server, args=(reader,), daemon=True).start()
                self.servers[(kind, plan.store)] = (port, process)
            return int(self.servers[(kind, plan.store)][0])

    def _read_server(self, reader: Any) -> None:
        try:
            while True:
                event = reader.recv()
                with self.server_lock:
                    self.server_events.add(event)
        except (EOFError, OSError):
            pass

    def server_events_for(self, keys: Sequence[str]) -> list[dict[str, Any]]:
        with self.server_lock:
            return [event for event in self.server_events.events if event.get("key") in keys]

    @property
    def pg_store_url(self) -> str:
        sep = "&" if "?" in self.postgres else "?"
        return f"{self.postgres}{sep}schema=faults_store_{self.run}&application_name=oncely_faults"

    def open(self, stores: Sequence[str]) -> None:
        self.effects = Effects(self.postgres, f"faults_fx_{self.run}")
        self.effects.create()
        if "postgres" in stores:
            from oncely.stores.postgres import PostgresStore

            with PostgresStore.from_url(self.pg_store_url) as store:
                store.migrate()
        if {"redis", "tiered"} & set(stores):
            self.redis = durable_redis(free_port(24500 + random.randrange(1000)))
            self.redis.start()

    def close(self) -> None:
        import shutil

        import psycopg

        for _, process in self.servers.values():
            process.kill()
            process.join(5)
        if self.redis is not None:
            self.redis.close()
        if self.effects is not None:
            self.effects.drop()
        with psycopg.connect(self.postgres, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "faults_store_{self.run}" CASCADE')
        shutil.rmtree(self.tmp, ignore_errors=True)

    def store_spec(
        self, plan: Plan, proxy: Proxy | None, redis: OwnRedis | None = None
    ) -> dict[str, Any]:
        namespace = f"faults-{self.run}-{plan.index}"
        if plan.store == "memory":
            return {"url": "memory://"}
        if plan.store == "sqlite":
            return {"url": f"sqlite:///{self.tmp}/h{plan.index}.db"}
        if plan.store == "postgres":
            url = self.pg_store_url
            if proxy is not None:
                url = url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
            options: dict[str, Any] = {"namespace": namespace}
            if plan.entry == "async" and _ASYNCPG:
                options["async_driver"] = "asyncpg"
            return {"url": url, "options": options}
        if plan.store == "redis_cluster":
            assert self.redis_cluster is not None
            return {"url": self.redis_cluster, "options": {"namespace": namespace}}
        redis = redis or self.redis
        assert redis is not None
        port = proxy.port if proxy is not None else redis.port
        url = f"redis://127.0.0.1:{port}/0"
        if plan.store == "tiered":
            url = f"tiered+{url}"
        return {"url": url, "options": {"namespace": namespace}}

    def target_port(self, store: str) -> int:
        if store == "postgres":
            return 5432
        assert self.redis is not None
        return self.redis.port


def combinations(
    stores: Sequence[str] = STORES,
    entries: Sequence[str] = ENTRIES,
    faults: Sequence[str] = FAULTS,
) -> list[tuple[str, str, str]]:
    """Every applicable store x entry point x fault."""
    return [
        (store, entry, fault)
        for store, entry, fault in itertools.product(stores, entries, faults)
        if applicable(store, entry, fault)
    ]


def plans(
    seed: int,
    count: int,
    stores: Sequence[str] = STORES,
    entries: Sequence[str] = ENTRIES,
    faults: Sequence[str] = FAULTS,
    lease: float = 1.5,
) -> list[Plan]:
    """*count* plans, covering every applicable store x entry x fault before repeating."""
    rng = random.Random(seed)
    combos = combinations(stores, entries, faults)
    result: list[Plan] = []
    while combos and len(result) < count:
        rng.shuffle(combos)
        for store, entry, fault in combos[: count - len(result)]:
            keys = 1 if fault.startswith(("stop", "zombie")) else rng.randint(1, 3)
            plan_lease = lease
            if fault == "latency":
                keys = 6
                # The store stays a quarter of a lease away for two leases (`run_history`):
                # beats must ride it out. With at least LATENCY_LEASE the loaded two-core
                # machine's own delays (a busy event loop, a pool connection opened through the
                # slow proxy) stay small beside the lease, as they would be beside a real one.
                plan_lease = max(lease, LATENCY_LEASE)
            result.append(
                Plan(len(result), store, entry, fault, keys, plan_lease, rng.randrange(2**31))
            )
    return result


LATENCY_LEASE = 3.0
"""The shortest lease of a ``latency`` history, in seconds."""


# -- running one history ---------------------------------------------------------------------


class _Process:
    """A worker process (forkserver) and the thread that reads its events into the history."""

    def __init__(
        self,
        configs: Any,
        history: History,
        lock: threading.Lock,
        target: Callable[[Any, Any], None] = _workers.main,
    ) -> None:
        ctx = multiprocessing.get_context("forkserver")
        reader, writer = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=target, args=(configs, writer), daemon=True)
        self.process.start()
        writer.close()
        self.history = history
        self.lock = lock
        self.seen = threading.Condition(lock)
        self.thread = threading.Thread(target=self._read, args=(reader,), daemon=True)
        self.thread.start()

    def _read(self, reader: Any) -> None:
        try:
            while True:
                event = reader.recv()
                with self.seen:
                    self.history.add(event)
                    self.seen.notify_all()
        except (EOFError, OSError):
            pass
        finally:
            reader.close()
            with self.seen:
                self.seen.notify_all()

    def wait_for(self, test: Callable[[dict[str, Any]], bool], timeout: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout
        with self.seen:
            while True:
                if any(test(event) for event in self.history.events):
                    return True
                left = deadline - time.monotonic()
                if left <= 0 or not self.thread.is_alive():
                    return any(test(event) for event in self.history.events)
                self.seen.wait(min(left, 0.2))

    def wait_stopped(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with open(f"/proc/{self.process.pid}/stat") as stat:
                    if stat.read().rpartition(")")[2].split()[0] == "T":
                        return
            except OSError:
                return
            time.sleep(0.01)

    def join(self, timeout: float = 60.0) -> None:
        self.process.join(timeout)
        if self.process.is_alive():
            self.kill()
        self.thread.join(5)

    def kill(self) -> None:
        if self.process.is_alive():
            assert self.process.pid is not None
            os.kill(self.process.pid, 9)
            self.process.join(5)


def _patterns(store: str, verb: str) -> bytes:
    if store == "postgres":
        return {
            "complete": b"SET status = $1, result = $2",
            "claim": b"END AS claimed,",  # _sql.CLAIM's
        }[verb]
    from oncely.stores.redis._scripts import library

    return library()[1][verb].encode() + b"\r\n"  # FCALL's function name, in full


def run_http_history(plan: Plan, services: Services) -> Result:
    """Clients of one HTTP entry point; ``disconnect`` makes the first request's read time out
    between the two chunks of the response (the httpx transport's own retries included)."""
    started = now()
    keys = [f"h{plan.index}-{services.run}-k{n}" for n in range(plan.keys)]
    history = History(plan.name, ttl=60.0, keys=keys, lease=plan.lease)
    lock = threading.Lock()
    servers: list[_Process] = []
    fallback: int | None = None
    if plan.fault in HTTP_KILLS:  # A dies in its first request; the clients retry on B
        port, fallback = (
            _own_server(plan, services, history, lock, servers, kill)
            for kill in (plan.fault.partition("@")[2], None)
        )
    else:
        # The WSGI middleware sends a response once it is whole: the httpx transport meets a
        # body that stops midway on the ASGI server, which streams.
        port = services.server("wsgi" if plan.entry == "wsgi" else "asgi", plan.store, plan.lease)
    deadline = now() + 4 * plan.lease + 15
    threads = [
        threading.Thread(
            target=_http.call,
            args=(history, lock, port),
            kwargs={
                "entry": plan.entry,
                "order": key,
                "disconnect": plan.fault == "disconnect",
                "deadline": deadline,
                "fallback": fallback,
            },
        )
        for key in keys
    ]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        time.sleep(0.3)  # the servers' last events (a stream's end) are on their way
    finally:
        for server in servers:
            server.kill()
            server.join(5)
    with lock:
        events = [event for event in history.events if event["ev"] != "listening"]
    history.events = events + services.server_events_for(keys)
    history.events.sort(key=lambda event: event["t"])
    if plan.fault in HTTP_KILLS:  # counted only when the server died mid-request
        faults = [event["kind"] for event in history.of("fault") if not event.get("along")]
    else:
        faults = [plan.fault] if plan.fault != "none" else []
    assert services.effects is not None
    rows = services.effects.rows(keys)
    return Result(plan, history, check(history, rows), faults, now() - started)


def _own_server(
    plan: Plan,
    services: Services,
    history: History,
    lock: threading.Lock,
    servers: list[_Process],
    kill: str | None,
) -> int:
    """Start an ASGI server (uvicorn) of this history, dying where *kill* says; its port."""
    assert services.effects is not None
    config = {
        "store": services.store_spec(plan, None),
        "effects": {"url": services.effects.url, "schema": services.effects.schema},
        "lease": plan.lease,
        "ttl": 60.0,
        "kill": kill,
    }
    worker = "A" if kill else "B"
    config["worker"] = worker
    server = _Process(config, history, lock, functools.partial(_http.serve, "asgi"))
    servers.append(server)

    def listening(event: dict[str, Any]) -> bool:
        return event["ev"] == "listening" and event["worker"] == worker

    if not server.wait_for(listening):
        raise RuntimeError(f"the asgi server of {plan.name} did not start")
    with lock:
        return int(next(event["port"] for event in history.events if listening(event)))


def run_kafka_history(plan: Plan, services: Services) -> Result:
    """Two Kafka consumers of one scope, one batch redelivered past its lease (`_kafka`)."""
    started = now()
    keys = [f"h{plan.index}-{services.run}-k0"]
    history = History(plan.name, ttl=300.0, lease=plan.lease)
    assert services.effects is not None
    assert services.kafka is not None
    spec = services.store_spec(plan, None)
    faults = _kafka.run(
        history,
        threading.Lock(),
        bootstrap=services.kafka,
        store_url=spec["url"],
        namespace=spec["options"]["namespace"],
        effects=services.effects,
        keys=keys,
        lease=plan.lease,
    )
    rows = services.effects.rows([keys[0], f"{keys[0]}-blocker"])
    return Result(plan, history, check(history, rows), faults, now() - started)


def run_streams_history(plan: Plan, services: Services) -> Result:
    """Two members of a Redis Streams group; with ``kill@mid``, A dies in its first handler."""
    import redis

    started = now()
    keys = [f"h{plan.index}-{services.run}-k{n}" for n in range(plan.keys)]
    history = History(plan.name, ttl=300.0, keys=keys, lease=plan.lease)
    lock = threading.Lock()
    assert services.redis is not None
    assert services.effects is not None
    stream, group = f"oncely-faults-{services.run}-h{plan.index}", "members"
    with redis.Redis.from_url(services.redis.url) as client:
        client.xgroup_create(stream, group, id="0", mkstream=True)
        for key in keys:
            client.xadd(stream, {"Idempotency-Key": key, "body": key})
    base = {
        "redis": services.redis.url,
        "store": services.store_spec(plan, None),
        "effects": {"url": services.effects.url, "schema": services.effects.schema},
        "stream": stream,
        "group": group,
        "lease": plan.lease,
    }
    killed = plan.fault == "kill@mid"
    members: list[_Process] = []
    try:
        members.append(
            _Process({**base, "worker": "A", "kill_first": killed}, history, lock, _streams.member)
        )
        if killed:  # B joins once A has its first entry, so that A surely gets one
            members[0].wait_for(lambda event: event["ev"] == "fault")
        members.append(_Process({**base, "worker": "B"}, history, lock, _streams.member))
        acked = _streams.settle(services.redis.url, stream, group, keys, 4 * plan.lease + 15)
    finally:
        for each in members:
            if each.process.is_alive():
                assert each.process.pid is not None
                os.kill(each.process.pid, 15)
            each.join(10)
    with lock:
        for key in sorted(acked):
            history.add({"ev": "ack", "op": f"ack-{key}", "key": key, "worker": group, "t": now()})
    faults = [event["kind"] for event in history.of("fault")]
    rows = services.effects.rows(keys)
    return Result(plan, history, check(history, rows), faults, now() - started)


def run_broker_history(plan: Plan, services: Services) -> Result:
    """Two members of a RabbitMQ queue (aio-pika or FastStream) or a JetStream consumer; A dies
    in its first handler."""
    started = now()
    keys = [f"h{plan.index}-{services.run}-k{n}" for n in range(plan.keys)]
    history = History(plan.name, ttl=300.0, keys=keys)
    lock = threading.Lock()
    assert services.effects is not None
    name = f"oncely-faults-{services.run}-h{plan.index}"
    broker: _brokers.RabbitQueue | _brokers.NatsStream
    if plan.entry in ("rabbitmq", "faststream", "celery"):
        assert services.rabbitmq is not None
        queue = _brokers.CeleryQueue if plan.entry == "celery" else _brokers.RabbitQueue
        broker = queue(services.rabbitmq, name)
        base = {"url": services.rabbitmq, "queue": name}
    else:
        assert services.nats is not None
        broker = _brokers.NatsStream(services.nats, name)
        base = {"url": services.nats, "stream": name}
    base |= {
        "broker": plan.entry,
        "store": services.store_spec(plan, None),
        "effects": {"url": services.effects.url, "schema": services.effects.schema},
        "group": name,
        "lease": plan.lease,
    }
    members: list[_Process] = []

    def events() -> list[dict[str, Any]]:
        with lock:
            return list(history.events)

    try:
        broker.publish(keys)  # inside: the queue or stream is deleted whatever happens
        kill = plan.fault.partition("@")[2]
        members.append(
            _Process({**base, "worker": "A", "kill": kill}, history, lock, _brokers.member)
        )
        # B joins once A has its first message, so that A surely gets one
        members[0].wait_for(lambda event: event["ev"] == "fault")
        members.append(_Process({**base, "worker": "B"}, history, lock, _brokers.member))
        _brokers.wait_settled(events, keys, 4 * plan.lease + _brokers.ACK_WAIT + 15)
    finally:
        for each in members:
            if each.process.is_alive():
                assert each.process.pid is not None
                os.kill(each.process.pid, 15)
            each.join(10)
        unacked = broker.unacked()
    with lock:
        for key in keys:
            if key not in unacked:
                history.add(
                    {"ev": "ack", "op": f"ack-{key}", "key": key, "worker": name, "t": now()}
                )
    faults = [event["kind"] for event in history.of("fault") if not event.get("along")]
    rows = services.effects.rows(keys)
    return Result(plan, history, check(history, rows), faults, now() - started)


def run_group_history(plan: Plan, services: Services) -> Result:
    """Two members of one Kafka consumer group; partitions move while records are in flight."""
    started = now()
    keys = [f"h{plan.index}-{services.run}-k{n}" for n in range(6 * _kafka.PARTITIONS)]
    history = History(plan.name, ttl=300.0, keys=keys)
    lock = threading.Lock()
    assert services.effects is not None
    assert services.kafka is not None
    topic = f"oncely-faults-{services.run}-h{plan.index}"
    where = _kafka.create(services.kafka, topic, keys)
    base = {
        "bootstrap": services.kafka,
        "topic": topic,
        "group": topic,
        "store": services.store_spec(plan, None),
        "effects": {"url": services.effects.url, "schema": services.effects.schema},
        "lease": plan.lease,
        "hold": 0.3,
    }
    joined = plan.fault == "rebalance@join"
    members: list[_Process] = []
    faults: list[str] = []
    try:
        a = {**base, "worker": "A"} if joined else {**base, "worker": "A", "kill_at": 2}
        # aiokafka's members can lose partitions while their handlers run; confluent's only
        # between rounds (in a poll), so a confluent member is killed mid-handler instead.
        target = _kafka.async_member if joined else _kafka.member
        members.append(_Process(a, history, lock, target))
        if joined:  # B joins once A runs: A's partitions are revoked under its handlers
            members[0].wait_for(lambda event: event["ev"] == "run")
        members.append(_Process({**base, "worker": "B"}, history, lock, target))
        acked = _kafka.settle(services.kafka, topic, topic, where, 4 * plan.lease + 30)
        if joined:
            with lock:
                if any(e["ev"] == "revoked" and e["mid"] for e in history.events):
                    faults.append(plan.fault)  # counted only when it hit handlers in flight
    finally:
        for each in members:
            if each.process.is_alive():
                assert each.process.pid is not None
                os.kill(each.process.pid, 15)
            each.join(15)
        _kafka.drop(services.kafka, topic)
    with lock:
        for key in sorted(acked):
            history.add({"ev": "ack", "op": f"ack-{key}", "key": key, "worker": topic, "t": now()})
    faults += [event["kind"] for event in history.of("fault")]
    rows = services.effects.rows(keys)
    return Result(plan, history, check(history, rows), faults, now() - started)


def run_history(plan: Plan, services: Services) -> Result:
    """Run one history: its workers, its fault, then the check."""
    if plan.fault in _edges.FAULTS:
        started = now()
        return Result(plan, *_edges.run(plan, services), now() - started)
    if plan.fault in _retry_after.FAULTS:
        started = now()
        return Result(plan, *_retry_after.run(plan, services), now() - started)
    if plan.fault in _celery_reuse.FAULTS:
        return _celery_reuse.run_history(plan, services)
    if plan.entry == _tiered.ENTRY:
        return _tiered.run_history(plan, services)
    if plan.entry == _relay.ENTRY:
        return _relay.run_history(plan, services)  # type: ignore[no-any-return]
    if plan.entry == "kafka_group":
        return run_group_history(plan, services)
    if plan.entry in BROKER_ENTRIES:
        return run_broker_history(plan, services)
    if plan.entry == "redis_streams":
        return run_streams_history(plan, services)
    if plan.entry in HTTP_ENTRIES:
        return run_http_history(plan, services)
    if plan.entry == "kafka":
        return run_kafka_history(plan, services)
    if plan.entry == "identity":
        from tests.faults import _identity

        return _identity.run_history(plan, services)  # type: ignore[no-any-return]
    started = now()
    rng = random.Random(plan.seed)
    lease = plan.lease
    ttl = lease if plan.fault == "zombie@ttl=lease" else 60.0
    keys = [f"h{plan.index}-{services.run}-k{n}" for n in range(plan.keys)]
    history = History(plan.name, ttl=ttl, keys=keys, lease=plan.lease)
    lock = threading.Lock()
    own: OwnRedis | None = None
    if plan.fault == "restart":  # a server of its own: the crash must not reach other histories
        with services.restart_lock:
            own = durable_redis(free_port(24500 + rng.randrange(1500)))
    proxy: Proxy | None = None
    if plan.fault in PROXIED:
        proxy = Proxy(services.target_port(plan.store))
    assert services.effects is not None
    base: dict[str, Any] = {
        "entry": plan.entry,
        "lease": lease,
        "ttl": ttl,
        "effects": {"url": services.effects.url, "schema": services.effects.schema},
    }
    hold = 0.05
    if plan.fault in ("slow", "skew", "restart"):
        hold = 2 * lease
    elif plan.fault == "latency":
        hold = 3 * lease
    elif plan.fault == "reset":
        hold = lease / 2
    if plan.entry in ("txn", _txn_begin.ENTRY):
        base["txn_url"] = services.effects.url
    a = {
        **base,
        "worker": "A",
        "store": services.store_spec(plan, proxy, own),
        "ops": [{"op": f"A-{key}", "key": key, "hold": hold} for key in keys],
        "concurrent": plan.fault in ("slow", "skew", "latency", "restart"),
    }
    b = {
        **base,
        "worker": "B",
        "store": services.store_spec(plan, None, own),
        "ops": [{"op": f"B-{key}", "key": key} for key in keys],
        "retry_for": _txn_begin.RETRY_FOR if plan.entry == _txn_begin.ENTRY else 4 * lease + 15,
        "retry_gap": 0.1,
    }
    if plan.entry == "txn" and proxy is not None:  # A's transactions meet the store's faults
        a["txn_url"] = services.effects.url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
    faults: list[str] = []
    point = plan.fault.partition("@")[2]
    if plan.fault.startswith(("kill", "stop", "zombie")):
        action = "kill" if plan.fault.startswith("kill") else "stop"
        point = "mid" if action == "stop" and point not in ("claim", "mid") else point
        a["fault"] = {"op": f"A-{rng.choice(keys)}", "point": point, "action": action}
    if plan.fault == "skew":
        a["skew"] = rng.choice((-1, 1)) * 300.0
        b["skew"] = -a["skew"]
    if proxy is not None and plan.fault.startswith("cut"):
        proxy.cut_reply(_patterns(plan.store, point))
    processes: list[_Process] = []

    def start(*configs: dict[str, Any]) -> _Process:
        process = _Process(list(configs), history, lock)
        processes.append(process)
        return process

    def ran(event: dict[str, Any]) -> bool:
        return bool(event["ev"] == "run")

    try:
        if own is not None:
            with services.restart_lock:  # one server starting at a time: ports stay distinct
                own.start()
        if proxy is not None:
            proxy.up()
        if plan.store == "memory":  # one process: A and the retrying B are its threads
            start(a, b).join()
        elif plan.fault.startswith(("stop", "zombie")):
            worker = start(a)
            # B is started ahead, so that a loaded machine's process start does not delay its
            # takeover past the stopped lease's record retention (lease + max(ttl, lease)).
            ops = [{"op": f"B-{key}", "key": key} for key in keys]
            taker = start({**b, "ops": ops, "wait_go": True})
            assert worker.process.pid is not None
            assert taker.process.pid is not None
            if worker.wait_for(lambda event: event["ev"] == "fault") and taker.wait_for(
                lambda event: event["ev"] == "ready"
            ):
                worker.wait_stopped()
                # B retries at once: it takes the key over as soon as the lease has expired,
                # well within the record's retention (ttl), while A stays stopped.
                os.kill(taker.process.pid, signal.SIGUSR1)
                taker.join()
                os.kill(worker.process.pid, signal.SIGCONT)  # the zombie wakes up
            else:
                taker.kill()
            worker.join()
        elif plan.fault in ("slow", "skew", "restart", "latency", "reset"):
            worker = start(a)
            wanted = len(keys) if plan.fault == "latency" else 1
            worker.wait_for(lambda event: sum(map(ran, history.events)) >= wanted)
            retrier = start({**b, "ops": [{"op": f"B0-{key}", "key": key} for key in keys]})
            if plan.fault == "restart":
                assert own is not None
                own.restart()
                faults.append("restart")
            elif plan.fault == "reset":
                assert proxy is not None
                proxy.reset()
            elif plan.fault == "latency":
                assert proxy is not None
                # A hiccup a heartbeat must ride out: for two leases, each request takes a
                # quarter of the lease longer. Six leases extended one after the other (a
                # single heartbeat thread) take longer than a lease per round.
                proxy.latency = lease / 4
                time.sleep(lease * 2)
                proxy.latency = 0.0
            worker.join()
            retrier.join()
        else:
            start(a).join()
        if plan.store != "memory" and plan.fault != "zombie@ttl=lease":
            # The final read: every key's result, replayed. Not after a zombie with ttl=lease:
            # its outcome is kept one lease, which the zombie's wake-up may well outlast.
            start(b).join()
    finally:
        for process in processes:
            process.kill()
        if proxy is not None:
            proxy.close()
        if own is not None:
            own.close()
    with lock:
        events = list(history.events)
    history.events = events
    faults += [event["kind"] for event in events if event["ev"] == "fault"]
    if plan.fault in ("slow", "skew", "latency", "reset"):
        faults.append(plan.fault)
    if plan.fault.startswith("cut") and proxy is not None and proxy.cuts:
        faults.append(plan.fault)  # counted only when a reply was actually cut
    rows = services.effects.rows(keys)
    judge = _txn_begin.check if plan.entry == _txn_begin.ENTRY else check
    return Result(plan, history, judge(history, rows), faults, now() - started)


# -- a campaign ------------------------------------------------------------------------------


@dataclass
class Report:
    results: list[Result]
    seconds: float

    @property
    def anomalies(self) -> list[tuple[Plan, Anomaly]]:
        return [(result.plan, anomaly) for result in self.results for anomaly in result.anomalies]

    def faults(self) -> Counter[str]:
        return Counter(kind for result in self.results for kind in result.faults)

    def table(self) -> str:
        """A markdown summary: histories and anomalies per store x fault, faults by kind."""
        by = Counter((r.plan.store, r.plan.fault) for r in self.results)
        bad = Counter((r.plan.store, r.plan.fault) for r in self.results for _ in r.anomalies)
        stores = sorted({r.plan.store for r in self.results}, key=STORES.index)
        fault_names = sorted({r.plan.fault for r in self.results}, key=FAULTS.index)
        lines = [
            "| fault | " + " | ".join(stores) + " |",
            "|---|" + "---|" * len(stores),
        ]
        for fault in fault_names:
            cells = []
            for store in stores:
                count = by[(store, fault)]
                cells.append("" if not count else f"{count} / {bad[(store, fault)]}")
            lines.append(f"| {fault} | " + " | ".join(cells) + " |")
        return "\n".join(lines)

    def lines(self) -> Iterator[str]:
        for plan, anomaly in self.anomalies:
            yield f"ANOMALY seed={plan.seed} {plan.name}: {anomaly}"


def run(
    plans_: Sequence[Plan],
    *,
    postgres: str,
    redis_cluster: str | None,
    kafka: str | None = None,
    rabbitmq: str | None = None,
    nats: str | None = None,
    parallel: int = 4,
    progress: Callable[[Result], None] | None = None,
) -> Report:
    """Run *plans_* (at most *parallel* at once) against fresh services; always clean up."""
    started = now()
    # Workers fork from a server that imported the drivers once (a no-op once it runs).
    multiprocessing.get_context("forkserver").set_forkserver_preload(
        ["oncely", "redis", "redis.asyncio", "psycopg", "psycopg_pool", "tests.faults._workers"]
    )
    services = Services(postgres, redis_cluster, kafka, rabbitmq, nats)
    try:
        services.open(sorted({plan.store for plan in plans_}))
        results: list[Result] = []
        with ThreadPoolExecutor(parallel) as pool:
            for result in pool.map(lambda plan: run_history(plan, services), plans_):
                results.append(result)
                if progress is not None:
                    progress(result)
    finally:
        services.close()
    return Report(results, now() - started)
