"""End to end on PostgreSQL and Kafka, in real processes, each SIGKILLed at its worst point.

HTTP POST with an ``Idempotency-Key`` → uvicorn worker: inbox record + order + outbox event in
one psycopg transaction → relay (`KafkaPublisher`) → Kafka → `IdempotentKafkaConsumer` whose
handler writes the shipment with its own inbox record. In every run, one order key (chosen at
random) kills the API worker after its commit, before the response; one event kills the relay
after Kafka acknowledged it, before it was marked published; one event kills the consumer after
its shipment committed, before the ack; and the test SIGKILLs one of the three, chosen at random,
at a random moment. It restarts whatever died and checks: each request made exactly one order
and one shipment, nothing lost (see `tests/outbox/_e2e.py`).
"""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import psycopg
import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from psycopg import sql

from tests.conftest import service_url
from tests.outbox._e2e import message_id
from tests.outbox.conftest import Db
from tests.outbox.test_relay import env

pytestmark = [pytest.mark.postgres, pytest.mark.kafka]

ORDERS = 8
PARTITIONS = 2
ROLES = ("api", "relay", "consumer")
TIMEOUT = 60.0


@pytest.fixture
def topic() -> Iterator[str]:
    """A topic of the test's own, created explicitly and deleted afterwards."""
    bootstrap = service_url("ONCELY_TEST_KAFKA_BOOTSTRAP")
    name = f"oncely-e2e-{uuid.uuid4().hex[:10]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(name, num_partitions=PARTITIONS)]).values():
        future.result(10)
    yield name
    for future in admin.delete_topics([name]).values():
        future.result(10)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Processes:
    """The three processes; whatever was SIGKILLed is started again."""

    def __init__(self, config_path: Path, directory: Path) -> None:
        self.config_path = config_path
        self.directory = directory
        self.running: dict[str, subprocess.Popen[bytes]] = {}
        self.killed: Counter[str] = Counter()
        for role in ROLES:
            self.start(role)

    def start(self, role: str) -> None:
        stderr = (self.directory / f"{role}.err").open("ab")
        self.running[role] = subprocess.Popen(
            [sys.executable, "-m", "tests.outbox._e2e", role, str(self.config_path)],
            env=env(),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
        stderr.close()

    def restart_the_dead(self) -> None:
        for role, process in self.running.items():
            code = process.poll()
            if code is None:
                continue
            errors = (self.directory / f"{role}.err").read_text()
            assert code == -9, f"{role} exited with {code}: {errors[-3000:]}"
            self.killed[role] += 1
            self.start(role)

    def kill(self, role: str) -> None:
        """SIGKILL *role*'s live process: one that has just died where planned is started again
        first, so the random kill is never spent on a process already dead."""
        self.restart_the_dead()
        self.running[role].kill()

    def stop(self) -> None:
        for process in self.running.values():
            process.kill()
        for process in self.running.values():
            process.wait(10)


def send_orders(url: str, keys: list[str], twice: set[str], answers: dict[str, list[int]]) -> None:
    """POST every order (some twice), retrying with the same key until an answer comes."""
    with httpx.Client(base_url=url, timeout=10) as client:
        for key in keys:
            for _ in range(2 if key in twice else 1):
                while True:
                    try:
                        reply = client.post(
                            "/orders",
                            json={"item": f"sku-{key[-2:]}"},
                            headers={"Idempotency-Key": key},
                        )
                    except httpx.TransportError:  # the worker died (or is not up yet): retry
                        time.sleep(0.05)
                        continue
                    assert reply.status_code in (200, 201), reply.text
                    answers.setdefault(key, []).append(reply.json()["order_id"])
                    break


def committed_everything(bootstrap: str, group: str, topic: str) -> bool:
    """Has the group committed every partition's end offset (nothing left to consume)?"""
    probe = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    try:
        parts = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        committed = {p.partition: p.offset for p in probe.committed(parts, timeout=10)}
        for p in range(PARTITIONS):
            _, high = probe.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            if high > 0 and committed.get(p, -1) < high:
                return False
        return True
    finally:
        probe.close()


def records(bootstrap: str, topic: str, enough: Callable[[Counter[str]], bool]) -> Counter[str]:
    """How many records of each message id the topic holds: read from the start until
    *enough* says so (or for 15 s)."""
    reader = Consumer({"bootstrap.servers": bootstrap, "group.id": f"{topic}-reader"})
    try:
        reader.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(PARTITIONS)])
        seen: Counter[str] = Counter()
        deadline = time.monotonic() + 15
        while not enough(seen) and time.monotonic() < deadline:
            message = reader.poll(0.2)
            if message is not None and not message.error():
                seen[dict(message.headers())["Idempotency-Key"].decode()] += 1
        return seen
    finally:
        reader.close()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_kill_api_relay_and_consumer_each_request_makes_one_order_and_one_shipment(
    pg: Db, topic: str, tmp_path: Path, seed: int
) -> None:
    bootstrap = service_url("ONCELY_TEST_KAFKA_BOOTSTRAP")
    rng = random.Random(seed)
    keys = [f"{topic}-order-{n:02d}" for n in range(ORDERS)]
    victims = {role: rng.choice(keys) for role in ROLES}
    twice = set(rng.sample(keys, 2))
    # Besides the planned kills, one process SIGKILLed by the test at a random moment.
    stray_role, stray_delay = rng.choice(ROLES), rng.uniform(0.5, 3.0)
    with psycopg.connect(pg.base, autocommit=True) as conn:
        for statement in (
            "CREATE TABLE {}.orders (id bigserial PRIMARY KEY, request_key text, item text)",
            "CREATE TABLE {}.shipments (id bigserial PRIMARY KEY, order_id bigint, "
            "request_key text, message_id text)",
        ):  # no UNIQUE constraints: a second order or shipment would be a second row
            conn.execute(sql.SQL(statement).format(sql.Identifier(pg.schema)))
    config = {
        "store": pg.url,
        "database": pg.base,
        "schema": pg.schema,
        "bootstrap": bootstrap,
        "topic": topic,
        "group": f"{topic}-shipping",
        "port": free_port(),
        "victims": victims,
        "log": str(tmp_path / "log.jsonl"),
    }
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(config))

    processes = Processes(config_path, tmp_path)
    answers: dict[str, list[int]] = {}
    client = threading.Thread(
        target=send_orders, args=(f"http://127.0.0.1:{config['port']}", keys, twice, answers)
    )
    client.start()

    def shipped() -> int:
        return len(pg.query(f'SELECT 1 FROM "{pg.schema}".shipments'))

    try:
        started = time.monotonic()
        deadline = started + TIMEOUT
        stray = False
        while True:
            assert time.monotonic() < deadline, "the pipeline did not drain"
            if not stray and time.monotonic() > started + stray_delay:
                processes.kill(stray_role)
                stray = True
            processes.restart_the_dead()
            if (
                stray
                and not client.is_alive()
                and shipped() >= ORDERS
                and all(published for published, *_ in pg.states().values())
                and committed_everything(bootstrap, config["group"], topic)
            ):
                break
            time.sleep(0.1)
    finally:
        processes.stop()
        client.join(10)

    orders = pg.query(f'SELECT request_key, id FROM "{pg.schema}".orders')
    shipments = pg.query(f'SELECT request_key, order_id, message_id FROM "{pg.schema}".shipments')
    order_of = {key: order_id for key, order_id in orders}
    assert Counter(key for key, _ in orders) == Counter(keys)  # one order per request
    assert {key: set(ids) for key, ids in answers.items()} == {
        key: {order_of[key]} for key in keys
    }  # every answer, replayed or not, names that order
    assert sorted(pg.states()) == sorted(message_id(key) for key in keys)  # one event each
    assert Counter(key for key, _, _ in shipments) == Counter(keys)  # one shipment each
    assert all(order_of[key] == order_id for key, order_id, _ in shipments)
    assert all(mid == message_id(key) for key, _, mid in shipments)

    # Each process was killed where planned (and one more time at random); what that repeated
    # was deduplicated.
    assert processes.killed == Counter(dict.fromkeys(ROLES, 1)) + Counter([stray_role])
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    killed = {(entry["role"], entry["key"]) for entry in log if entry["kind"] == "killed"}
    assert killed == {
        ("api", victims["api"]),
        ("relay", message_id(victims["relay"])),
        ("consumer", message_id(victims["consumer"])),
    }
    # Published again after the relay's kill; the consumer's record of the key (completed)
    # answered the second copy without running the handler.
    expected = {message_id(key) for key in keys}
    republished = message_id(victims["relay"])
    in_topic = records(
        bootstrap, topic, lambda seen: set(seen) == expected and seen[republished] >= 2
    )
    assert set(in_topic) == expected
    assert in_topic[republished] >= 2
    # The consumer killed before completing its record ran the handler again on redelivery:
    # the inbox record, committed with the shipment, answered it.
    deduplicated = Counter(entry["key"] for entry in log if entry["kind"] == "deduplicated")
    assert deduplicated[message_id(victims["consumer"])] >= 1
