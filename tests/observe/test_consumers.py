"""The broker-agnostic runner reports each verdict; a real broker adapter (Redis Streams) also
reports a CONSUMER span per delivery, a duplicate ending OK."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

import oncely
from oncely.consumers import ConsumerPolicy, Delivery, IdempotentConsumer
from oncely.consumers.producer import redis_fields
from oncely.consumers.redis_streams import RedisStreamConsumer, StreamEntry
from tests.conftest import service_url
from tests.observe.conftest import Sinks


def test_runner_reports_each_verdict(sinks: Sinks) -> None:
    store = oncely.open_store("memory://")
    consumer = IdempotentConsumer(store, scope="obs-billing", policy=ConsumerPolicy(max_attempts=1))

    def delivery(key: str, body: bytes = b"{}") -> Delivery:
        return Delivery(body, {"Idempotency-Key": key}, None, None)

    def boom() -> None:
        raise ValueError("handler bug")

    consumer.process(delivery("m-1"), lambda: None)
    consumer.process(delivery("m-1"), lambda: None)  # duplicate
    consumer.process(delivery("m-1", b"[1]"), lambda: None)  # mismatch: dead-lettered
    consumer.process(Delivery(b"{}", {}, None, None), lambda: None)  # no key: refused
    consumer.process(delivery("m-2"), boom)

    async def handled() -> None:
        return None

    asyncio.run(consumer.aprocess(delivery("m-3"), handled))
    outcomes = [event.outcome for event in sinks.operations(surface="consumer")]
    assert outcomes == ["acquired", "replayed", "mismatch", "refused", "acquired", "acquired"]
    labels = {"surface": "consumer", "operation": "obs-billing", "store": "memory"}
    assert sinks.prom("oncely_operations_total", **labels, outcome="replayed") == 1
    assert sinks.otel("oncely.operations", **labels, outcome="acquired") == 3
    verdicts = {"operation": "obs-billing"}
    assert (
        sinks.prom("oncely_consumer_verdicts_total", **verdicts, action="ack", reason="duplicate")
        == 1
    )
    assert (
        sinks.prom(
            "oncely_dead_letters_total",
            surface="consumer",
            operation="obs-billing",
            reason="mismatch",
        )
        == 1
    )
    assert sinks.otel("oncely.consumer.verdicts", reason="processed") == 2
    assert all(event.duration is not None for event in sinks.operations(surface="consumer"))
    assert sinks.prom("oncely_operation_duration_seconds_count", **labels, outcome="acquired") == 3
    spans = sinks.finished("process obs-billing")
    assert [span.attributes["oncely.reason"] for span in spans] == [
        "processed",
        "duplicate",
        "mismatch",
        "invalid_key",
        "exhausted",
        "processed",
    ]
    assert [span.status.is_ok for span in spans] == [True, True, False, True, False, True]


def test_a_consumer_span_links_to_the_producers_trace(sinks: Sinks) -> None:
    from opentelemetry.propagate import inject

    tracer = sinks.tracer_provider.get_tracer("producer")
    headers: dict[str, str] = {"Idempotency-Key": "t-1"}
    with tracer.start_as_current_span("send orders") as producer:
        inject(headers)
    store = oncely.open_store("memory://")
    consumer = IdempotentConsumer(store, scope="obs-linked")
    consumer.process(Delivery(b"{}", headers, None, None), lambda: None)
    (span,) = sinks.finished("process obs-linked")
    assert span.kind.name == "CONSUMER"
    producer_trace = producer.get_span_context().trace_id
    assert [link.context.trace_id for link in span.links] == [producer_trace]


@pytest.fixture
def stream() -> Iterator[tuple[redis.Redis, str]]:
    client = redis.Redis.from_url(service_url("ONCELY_TEST_REDIS_URL"))
    name = f"oncely-obs-{uuid.uuid4().hex[:12]}"
    yield client, name
    client.delete(name, f"{name}:dead")
    client.close()


@pytest.mark.redis
def test_redis_streams_adapter_spans_each_delivery(
    sinks: Sinks, stream: tuple[redis.Redis, str]
) -> None:
    client, name = stream
    handled: list[str] = []

    def handle(entry: StreamEntry) -> None:
        handled.append(entry.id)

    consumer = RedisStreamConsumer(
        client, name, "billing", handle, store=oncely.open_store("memory://"), block=0.05
    )
    consumer.create_group()
    for _ in range(2):  # the same key twice: processed, then a duplicate
        client.xadd(name, redis_fields("order-1", {"body": json.dumps({"order": 1})}))
    assert consumer.poll() == 2
    assert len(handled) == 1
    # Decided as one batch (claim_many): a span per delivery, named by the consumer's scope.
    spans = sinks.finished(f"process {name}:billing")
    assert [span.attributes["oncely.outcome"] for span in spans] == ["acquired", "replayed"]
    assert all(span.status.is_ok for span in spans)
    assert spans[0].kind.name == "CONSUMER"
    assert "order-1" not in str([dict(span.attributes) for span in spans])
    assert (
        sinks.prom(
            "oncely_consumer_verdicts_total",
            operation=f"{name}:billing",
            action="ack",
            reason="duplicate",
        )
        == 1
    )


def test_runner_reports_in_progress_and_store_errors(sinks: Sinks) -> None:
    from datetime import timedelta

    store = oncely.open_store("memory://")
    consumer = IdempotentConsumer(store, scope="obs-busy", fingerprint=None)
    store.claim("obs-busy|b-1", "", lease=timedelta(seconds=30), ttl=timedelta(hours=1))
    busy = consumer.process(Delivery(b"{}", {"Idempotency-Key": "b-1"}, None, None), lambda: None)
    assert busy.reason.value == "in_progress"

    class Down:
        backend = "broken"

        def claim(self, *args: object, **kwargs: object) -> object:
            raise oncely.StoreUnavailableError("down", backend="broken")

        def __getattr__(self, name: str) -> object:
            return getattr(store, name)

    broken = IdempotentConsumer(Down(), scope="obs-busy", fingerprint=None)  # type: ignore[arg-type]
    down = broken.process(Delivery(b"{}", {"Idempotency-Key": "b-2"}, None, None), lambda: None)
    assert down.reason.value == "store_unavailable"
    outcomes = [event.outcome for event in sinks.operations(operation="obs-busy")]
    assert outcomes == ["in_progress", "error"]
    assert (
        sinks.prom(
            "oncely_consumer_verdicts_total",
            operation="obs-busy",
            action="retry",
            reason="in_progress",
        )
        == 1
    )


@pytest.mark.rabbitmq
def test_rabbitmq_adapter_spans_each_delivery_by_its_queue(sinks: Sinks) -> None:
    """One delivery at a time (`aprocess`): timed, its span named by the queue and linked to
    the trace that published it; the duplicate ends OK."""
    import aio_pika
    from opentelemetry.propagate import inject

    from oncely.consumers.rabbitmq import IdempotentHandler

    name = f"oncely-obs-{uuid.uuid4().hex[:12]}"
    tracer = sinks.tracer_provider.get_tracer("producer")
    headers: dict[str, Any] = {"Idempotency-Key": "order-1"}
    with tracer.start_as_current_span("send orders") as producer:
        inject(headers)
    handled: list[bytes] = []

    async def on_order(message: Any) -> None:
        handled.append(message.body)

    async def scenario() -> None:
        connection = await aio_pika.connect_robust(service_url("ONCELY_TEST_RABBITMQ_URL"))
        async with connection:
            channel = await connection.channel()
            queue = await channel.declare_queue(name, auto_delete=False)
            try:
                handler = IdempotentHandler(
                    on_order, oncely.open_store("memory://"), group="obs-rabbit"
                )
                for _ in range(2):
                    await channel.default_exchange.publish(
                        aio_pika.Message(b"{}", headers=headers), routing_key=name
                    )
                for _ in range(2):
                    message = await queue.get(timeout=10, fail=True)
                    assert message is not None
                    await handler(message)
            finally:
                await queue.delete(if_unused=False, if_empty=False)

    asyncio.run(scenario())
    assert len(handled) == 1
    spans = sinks.finished(f"process {name}")
    assert [span.attributes["oncely.outcome"] for span in spans] == ["acquired", "replayed"]
    assert all(span.status.is_ok for span in spans)
    assert spans[0].attributes["messaging.destination.name"] == name
    producer_trace = producer.get_span_context().trace_id
    assert all([link.context.trace_id for link in span.links] == [producer_trace] for span in spans)
    timed = sinks.operations(surface="consumer", operation="obs-rabbit")
    assert [event.duration is not None for event in timed] == [True, True]
