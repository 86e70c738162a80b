"""The Celery task option against a real broker (RabbitMQ); effects are PostgreSQL rows."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker
from kombu import Queue

from oncely import Status
from oncely.consumers import ConsumerPolicy, Delivery, Reason
from oncely.consumers.celery import IdempotentTask, _arguments, celery_options
from oncely.consumers.rabbitmq import dead_letter_arguments
from oncely.errors import ConfigurationError, FingerprintError, FingerprintMismatchError
from oncely.stores.redis import RedisStore
from tests._helpers import eventually
from tests.conftest import service_url
from tests.consumers._effects import FAST, Ledger, Worker

pytestmark = pytest.mark.rabbitmq


def make_app(queue: str) -> Celery:
    """A Celery app on RabbitMQ whose one queue dead-letters to ``<queue>.dead``."""
    app = Celery(queue, broker=service_url("ONCELY_TEST_RABBITMQ_URL"), set_as_current=False)
    app.conf.update(
        task_default_queue=queue,
        task_queues=[
            Queue(queue, routing_key=queue, queue_arguments=dead_letter_arguments(f"{queue}.dead"))
        ],
        task_ignore_result=True,
        broker_heartbeat=0,  # with AMQP heartbeats the test worker misses its stop signal
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        worker_redirect_stdouts=False,
        worker_prefetch_multiplier=4,
    )
    return app


@pytest.fixture
def app(name: str) -> Iterator[Celery]:
    made = make_app(name)
    with made.connection_for_write() as connection:  # where the queue's DLX routes to
        connection.default_channel.queue_declare(f"{name}.dead", durable=True, auto_delete=False)
    yield made
    with made.connection_for_write() as connection:
        channel = connection.default_channel
        channel.queue_delete(name)
        channel.queue_delete(f"{name}.dead")
    made.close()


def options(store: RedisStore, **extra: Any) -> dict[str, Any]:
    # shared=False: each test's app has its own "orders.charge".
    return {
        "base": IdempotentTask,
        "oncely_store": store,
        "oncely_policy": FAST,
        "shared": False,
        **extra,
    }


def runner(task: Any) -> Any:
    return task.oncely


def test_duplicates_take_effect_once(app: Celery, store: RedisStore, ledger: Ledger) -> None:
    """Each of three keys published three times (same task id): three effects, six replays."""

    @app.task(name="orders.charge", **options(store))
    def charge(order: str) -> str:
        ledger.write(order)
        return f"receipt-{order}"

    with start_worker(app, pool="solo", perform_ping_check=False, loglevel="WARNING"):
        for order in ["a", "b", "c"] * 3:
            charge.apply_async((order,), **celery_options(f"charge-{order}"))
        eventually(
            lambda: runner(charge).stats[Reason.PROCESSED] + runner(charge).stats["duplicate"] == 9,
            timeout=30,
        )
    assert ledger.counts() == {"a": 1, "b": 1, "c": 1}
    assert runner(charge).stats[Reason.DUPLICATE] == 6


def test_failing_task_is_retried_then_dead_lettered(
    app: Celery, store: RedisStore, ledger: Ledger, name: str
) -> None:
    """A task that raises is retried until max_attempts, then rejected to the DLX queue."""
    calls: list[str] = []

    @app.task(name="orders.charge", **options(store))
    def charge(order: str) -> None:
        calls.append(order)
        raise RuntimeError("the payment provider is down")

    with start_worker(app, pool="solo", perform_ping_check=False, loglevel="WARNING"):
        charge.apply_async(("a",), **celery_options("charge-a"))
        eventually(lambda: runner(charge).stats[Reason.EXHAUSTED] == 1, timeout=30)
    assert calls == ["a"] * FAST.max_attempts
    with app.connection_for_write() as connection:
        dead = connection.default_channel.basic_get(f"{name}.dead", no_ack=True)
    assert dead is not None
    assert dead.headers["id"].startswith("charge-a.")  # the key, then the arguments' digest
    assert ledger.counts() == {}


def test_worker_killed_mid_task_is_redelivered_and_applied_once(
    app: Celery, store: RedisStore, ledger: Ledger, name: str
) -> None:
    """SIGKILL of a worker before the write commits: RabbitMQ redelivers, the lease recovers."""

    @app.task(name="orders.charge", **options(store))
    def charge(order: str) -> None:
        ledger.write(order, "survivor")

    charge.apply_async(("a",), **celery_options("charge-a"))
    worker = Worker("celery", {"queue": name, "namespace": name, "table": ledger.table})
    try:
        assert worker.wait_ready() == "a"
    finally:
        worker.kill()
    with start_worker(app, pool="solo", perform_ping_check=False, loglevel="WARNING"):
        eventually(lambda: runner(charge).stats[Reason.PROCESSED] == 1, timeout=30)
    assert ledger.rows() == [("a", "survivor")]
    record = store.get(runner(charge).key_for(Delivery(b"", {"Idempotency-Key": "charge-a"})))
    assert record is not None
    assert record.status is Status.COMPLETED
    assert record.attempt == 2


def test_direct_calls_run_unprotected_and_missing_store_is_an_error(app: Celery) -> None:
    """Calling the task as a function just runs it; a task without a store cannot run."""

    @app.task(name="orders.direct", base=IdempotentTask, shared=False)
    def direct(order: str) -> str:
        return order.upper()

    assert direct("a") == "A"
    with pytest.raises(ConfigurationError, match="oncely_store"):
        _ = direct.oncely


def test_dead_letter_queue_option_keeps_a_copy(
    app: Celery, store: RedisStore, ledger: Ledger, name: str
) -> None:
    """oncely_dead_letter_queue: the exhausted task is copied there (same arguments)."""

    @app.task(name="orders.charge", **options(store, oncely_dead_letter_queue=f"{name}.parked"))
    def charge(order: str) -> None:
        raise RuntimeError("the payment provider is down")

    with start_worker(app, pool="solo", perform_ping_check=False, loglevel="WARNING"):
        charge.apply_async(("a",), **celery_options("charge-a"))
        eventually(lambda: runner(charge).stats[Reason.EXHAUSTED] == 1, timeout=30)
    with app.connection_for_write() as connection:
        channel = connection.default_channel
        try:
            parked = channel.basic_get(f"{name}.parked", no_ack=True)
        finally:
            channel.queue_delete(f"{name}.parked")
    assert parked is not None
    assert parked.headers["oncely-original-id"].startswith("charge-a.")
    assert parked.headers["oncely-dead-letter-reason"] == "exhausted"


def test_dead_letter_copy_is_a_new_task_that_runs_when_re_driven(
    app: Celery, store: RedisStore, ledger: Ledger, name: str
) -> None:
    """The copy in oncely_dead_letter_queue has its own task id and no idempotency key (the
    original's are in oncely-original-* headers), so a worker consuming that queue runs it once
    (a re-drive) instead of dead-lettering it again and again."""
    parked = f"{name}.parked"
    app.conf.task_queues = [*app.conf.task_queues, Queue(parked, routing_key=parked)]
    broken = [True]

    @app.task(name="orders.charge", **options(store, oncely_dead_letter_queue=parked))
    def charge(order: str) -> None:
        if broken[0]:
            raise RuntimeError("the payment provider is down")
        ledger.write(order)

    try:
        with start_worker(app, pool="solo", perform_ping_check=False, loglevel="WARNING"):
            charge.apply_async(("a",), **celery_options("charge-a"), queue=name)
            eventually(lambda: runner(charge).stats[Reason.EXHAUSTED] == 1, timeout=30)
            broken[0] = False  # fixed: the re-driven copy succeeds
            eventually(lambda: runner(charge).stats[Reason.PROCESSED] == 1, timeout=30)
    finally:
        with app.connection_for_write() as connection:
            connection.default_channel.queue_delete(parked)
    assert ledger.counts() == {"a": 1}
    assert runner(charge).stats[Reason.EXHAUSTED] == 1


def test_dead_letter_copy_headers(app: Celery, store: RedisStore, name: str) -> None:
    """The parked copy: a fresh task id, no key header, the original id and key as headers."""

    @app.task(name="orders.charge", **options(store, oncely_dead_letter_queue=f"{name}.parked"))
    def charge(order: str) -> None:
        raise RuntimeError("the payment provider is down")

    with start_worker(app, pool="solo", perform_ping_check=False, loglevel="WARNING"):
        charge.apply_async(("a",), **celery_options("charge-a"))
        eventually(lambda: runner(charge).stats[Reason.EXHAUSTED] == 1, timeout=30)
    with app.connection_for_write() as connection:
        channel = connection.default_channel
        try:
            parked = channel.basic_get(f"{name}.parked", no_ack=True)
        finally:
            channel.queue_delete(f"{name}.parked")
    assert parked is not None
    assert parked.headers["id"] != "charge-a"
    assert "Idempotency-Key" not in parked.headers
    assert parked.headers["oncely-original-id"].startswith("charge-a.")
    assert parked.headers["oncely-original-key"] == "charge-a"
    assert parked.headers["oncely-dead-letter-reason"] == "exhausted"


@dataclass
class Order:
    number: str


class Opaque:
    """An argument with no canonical form (its repr shows its address)."""


def test_arguments_without_a_stable_form_are_refused_at_call_time(
    app: Celery, store: RedisStore
) -> None:
    """A fingerprint from repr() would differ on each delivery: apply_async refuses such
    arguments with a FingerprintError; equal dataclass arguments share one body."""

    @app.task(name="orders.charge", **options(store))
    def charge(order: Any) -> None:
        pass

    with pytest.raises(FingerprintError, match=r"orders\.charge"):
        charge.apply_async((Opaque(),), **celery_options("charge-a"), serializer="pickle")
    assert _arguments((Order("1"),), {}) == _arguments((Order("1"),), {})

    @app.task(name="orders.loose", **options(store, oncely_fingerprint=None))
    def loose(order: Any) -> None:
        pass

    assert loose.oncely.fingerprint is None
    assert _arguments((Opaque(),), {}, required=False) == b""  # neither key nor fingerprint


def test_dead_letter_copy_that_cannot_be_sent_keeps_the_task(
    app: Celery, store: RedisStore, name: str
) -> None:
    """The dead-letter queue refuses the copy (RabbitMQ reserves amq.* names): the task is not
    acked away; it comes back and is dead-lettered again, without its handler running again."""
    calls: list[str] = []

    @app.task(name="orders.charge", **options(store, oncely_dead_letter_queue="amq.oncely"))
    def charge(order: str) -> None:
        calls.append(order)
        raise ValueError("not a valid order")

    charge.oncely_policy = ConsumerPolicy(
        lease=timedelta(seconds=1.5),
        ttl=timedelta(minutes=5),
        max_attempts=3,
        retry_delay=timedelta(milliseconds=100),
        dead_letter_on=(ValueError,),
    )
    with start_worker(app, pool="solo", perform_ping_check=False, loglevel="WARNING"):
        charge.apply_async(("a",), **celery_options("charge-a"))
        eventually(lambda: runner(charge).stats[Reason.HANDLER_FAILED] >= 3, timeout=60)
    assert calls == ["a"]


@pytest.mark.filterwarnings("ignore:Call to deprecated setex:DeprecationWarning")  # Celery's
def test_a_key_reused_with_other_arguments_fails_the_callers_result(
    app: Celery, store: RedisStore, ledger: Ledger, name: str, redis_url: str
) -> None:
    """The reuse is dead-lettered on the worker, and its caller's result says why; the first
    caller's result is still the first run's."""
    import redis

    app.conf.update(
        result_backend=redis_url,
        result_backend_transport_options={"global_keyprefix": f"{name}:"},
        task_ignore_result=False,
    )

    @app.task(name="orders.charge", **options(store))
    def charge(order: str, cents: int) -> str:
        ledger.write(order)
        return f"receipt-{order}-{cents}"

    try:
        with start_worker(app, pool="solo", perform_ping_check=False, loglevel="WARNING"):
            # One at a time: Celery follows one pending result per task id in a process.
            first = charge.apply_async(("a", 500), **celery_options("charge-a"))
            assert first.get(timeout=30) == "receipt-a-500"
            again = charge.apply_async(("a", 500), **celery_options("charge-a"))  # a retry
            assert (again.id, again.get(timeout=30)) == (first.id, "receipt-a-500")
            reused = charge.apply_async(("a", 900), **celery_options("charge-a"))
            with pytest.raises(FingerprintMismatchError):
                reused.get(timeout=30)
            assert app.AsyncResult(first.id).get(timeout=30) == "receipt-a-500"  # still
        assert ledger.counts() == {"a": 1}
        assert runner(charge).stats[Reason.MISMATCH] == 1
    finally:
        client = redis.Redis.from_url(redis_url)
        names = list(client.scan_iter(match=f"{name}:*", count=500))
        if names:
            client.delete(*names)
        client.close()
