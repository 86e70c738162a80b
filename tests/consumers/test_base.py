"""The broker-agnostic runner: every row of the consumer contract (docs/guides/consumers.md)
as a decision, sync and async."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from oncely import ClaimResult, LeaseLost, Record, Status, Store, StoreUnavailableError
from oncely._core.flow import Flow
from oncely._core.keys import scope_key
from oncely.consumers import (
    Action,
    ConsumerPolicy,
    Delivery,
    IdempotentConsumer,
    Reason,
    Verdict,
)
from oncely.consumers._drivers import BrokerOp, Handle, Parallel, arun_with, run_with
from oncely.consumers._keys import body_value
from oncely.errors import ConfigurationError
from oncely.keys import content_hash
from oncely.stores.memory import MemoryStore
from oncely.stores.sqlite import SQLiteStore
from oncely.testing import FrozenClock
from tests.consumers._batching import SingleVerbs

LEASE = timedelta(seconds=10)
POLICY = ConsumerPolicy(lease=LEASE, max_attempts=3, retry_delay=timedelta(seconds=2))


class Boom(Exception):
    pass


class Poison(Exception):
    pass


@pytest.fixture
def clock() -> FrozenClock:
    return FrozenClock()


@pytest.fixture(params=["memory", "sqlite"])
def store(request: pytest.FixtureRequest, tmp_path: Path, clock: FrozenClock) -> Iterator[Store]:
    made: Store = (
        MemoryStore(clock=clock)
        if request.param == "memory"
        else SQLiteStore(tmp_path / "oncely.db", clock=clock)
    )
    yield made
    made.close()


Process = Callable[[IdempotentConsumer, Delivery, Callable[[], Any]], Verdict]


@pytest.fixture(params=["sync", "async"])
def process(request: pytest.FixtureRequest) -> Process:
    """Run the runner through `process` or through `aprocess`; the handler is the same."""
    if request.param == "sync":
        return lambda consumer, delivery, handler: consumer.process(delivery, handler)

    def run_async(consumer: IdempotentConsumer, delivery: Delivery, handler: Any) -> Verdict:
        async def call() -> Any:
            return handler()

        return asyncio.run(consumer.aprocess(delivery, call))

    return run_async


def message(key: str | None = "k-1", body: Any = None, **headers: Any) -> Delivery:
    if key is not None:
        headers.setdefault("Idempotency-Key", key)
    payload = json.dumps(body if body is not None else {"n": 1}).encode()
    return Delivery(payload, headers)


def consumer_for(store: Store, scope: str = "orders", **options: Any) -> IdempotentConsumer:
    options.setdefault("policy", POLICY)
    return IdempotentConsumer(store, scope=scope, **options)


class Calls:
    def __init__(self, result: Any = None, error: BaseException | None = None) -> None:
        self.count = 0
        self.result = result
        self.error = error

    def __call__(self) -> Any:
        self.count += 1
        if self.error is not None:
            raise self.error
        return self.result


# -- section 6, row by row ------------------------------------------------------------------------


def test_a_duplicate_returns_the_first_runs_value_equal_and_of_its_type(
    store: Store, process: Process
) -> None:
    """What Celery (and FastStream) hand back for a completed duplicate: the handler's value
    as it returned it (a Decimal, a datetime, a tuple...), never None or a lossy copy."""
    consumer = consumer_for(store)
    value = {
        "amount": Decimal("12.30"),
        "at": datetime(2026, 11, 23, 22, 0, tzinfo=timezone.utc),
        "ids": (uuid.UUID(int=7), 8),
        "tags": frozenset({"a"}),
    }
    first = process(consumer, message(), Calls(result=value))
    handler = Calls(result="never")
    again = process(consumer, message(), handler)
    assert (first.reason, again.reason) == (Reason.PROCESSED, Reason.DUPLICATE)
    assert handler.count == 0
    assert again.result == value
    assert type(again.result["ids"]) is tuple
    assert type(again.result["amount"]) is Decimal


def test_new_key_runs_once_and_acks_after_completion(store: Store, process: Process) -> None:
    """A new key runs the handler once; the verdict is ACK only once the record is completed."""
    consumer = consumer_for(store)
    handler = Calls(result={"ok": 1})
    verdict = process(consumer, message(), handler)
    assert handler.count == 1
    assert verdict.action is Action.ACK
    assert verdict.reason is Reason.PROCESSED
    assert verdict.result == {"ok": 1}
    assert verdict.attempt == 1
    record = store.get(consumer.key_for(message()))
    assert record is not None
    assert record.status is Status.COMPLETED


def test_completed_duplicate_is_skipped_logged_counted_and_acked(
    store: Store, process: Process, caplog: pytest.LogCaptureFixture
) -> None:
    """A completed duplicate: the handler is skipped, one INFO line is logged, it is acked."""
    consumer = consumer_for(store)
    handler = Calls()
    process(consumer, message(), handler)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="oncely"):
        verdict = process(consumer, message(), handler)
    assert handler.count == 1
    assert verdict.action is Action.ACK
    assert verdict.reason is Reason.DUPLICATE
    assert consumer.stats[Reason.DUPLICATE] == 1
    lines = [r for r in caplog.records if r.levelno >= logging.INFO]
    assert len(lines) == 1
    assert "duplicate" in lines[0].getMessage()
    assert "k-1" in lines[0].getMessage()


def test_duplicate_with_live_lease_is_redelivered_later(
    store: Store, process: Process, clock: FrozenClock
) -> None:
    """A duplicate whose lease is live elsewhere does not run and is retried after a delay."""
    consumer = consumer_for(store)
    key = consumer.key_for(message())
    store.claim(key, consumer.fingerprint_for(message()), lease=LEASE, ttl=POLICY.ttl)
    handler = Calls()
    verdict = process(consumer, message(), handler)
    assert handler.count == 0
    assert verdict.action is Action.RETRY
    assert verdict.reason is Reason.IN_PROGRESS
    assert verdict.delay == POLICY.retry_delay  # shorter than the lease's 10 s
    clock.advance(timedelta(seconds=9, milliseconds=500))
    verdict = process(consumer, message(), handler)
    assert verdict.delay == timedelta(milliseconds=500)  # never longer than the lease left


def test_handler_that_raises_releases_the_lease_for_the_broker_to_redeliver(
    store: Store, process: Process
) -> None:
    """A handler that raises: lease released, RETRY with the broker's own timing (no delay)."""
    consumer = consumer_for(store)
    verdict = process(consumer, message(), Calls(error=Boom("db down")))
    assert verdict.action is Action.RETRY
    assert verdict.reason is Reason.HANDLER_FAILED
    assert verdict.delay is None
    assert isinstance(verdict.error, Boom)
    record = store.get(consumer.key_for(message()))
    assert record is not None
    assert record.status is Status.RELEASED
    handler = Calls()
    assert process(consumer, message(), handler).reason is Reason.PROCESSED
    assert handler.count == 1


def test_attempts_are_exhausted_then_dead_lettered(store: Store, process: Process) -> None:
    """After max_attempts starts that raised, the message is dead-lettered, not retried."""
    consumer = consumer_for(store)
    failing = Calls(error=Boom())
    actions = [process(consumer, message(), failing).action for _ in range(3)]
    assert actions == [Action.RETRY, Action.RETRY, Action.DEAD_LETTER]
    assert failing.count == 3
    again = process(consumer, message(), failing)  # a late duplicate of the dead message
    assert again.action is Action.DEAD_LETTER
    assert again.reason is Reason.EXHAUSTED
    assert failing.count == 3


def test_attempts_survive_another_worker(store: Store, process: Process) -> None:
    """Attempts are counted in the record, so a second worker (consumer) continues the count."""
    first, second = consumer_for(store), consumer_for(store)
    failing = Calls(error=Boom())
    assert process(first, message(), failing).attempt == 1
    assert process(second, message(), failing).attempt == 2
    assert process(first, message(), failing).action is Action.DEAD_LETTER


def test_dead_letter_errors_skip_the_retries(store: Store, process: Process) -> None:
    """An exception type in dead_letter_on dead-letters the message on its first failure."""
    policy = ConsumerPolicy(lease=LEASE, dead_letter_on=(Poison,))
    consumer = consumer_for(store, policy=policy)
    verdict = process(consumer, message(), Calls(error=Poison()))
    assert verdict.action is Action.DEAD_LETTER
    assert verdict.reason is Reason.HANDLER_FAILED


def test_worker_killed_mid_handler_is_recovered_after_the_lease(
    store: Store, process: Process, clock: FrozenClock
) -> None:
    """A worker that died holding the lease: retried until the lease ends, then recovered."""
    consumer = consumer_for(store)
    key = consumer.key_for(message())
    store.claim(key, consumer.fingerprint_for(message()), lease=LEASE, ttl=POLICY.ttl)  # dies
    handler = Calls()
    assert process(consumer, message(), handler).action is Action.RETRY
    clock.advance(LEASE)
    verdict = process(consumer, message(), handler)
    assert verdict.reason is Reason.PROCESSED
    assert verdict.attempt == 2
    assert handler.count == 1


def test_a_message_that_kills_every_worker_is_dead_lettered(
    store: Store, process: Process, clock: FrozenClock
) -> None:
    """Crashes count as attempts: after max_attempts starts, the next claim dead-letters."""
    consumer = consumer_for(store)
    key, fp = consumer.key_for(message()), consumer.fingerprint_for(message())
    for _ in range(POLICY.max_attempts):  # each worker claims and is killed
        assert not isinstance(store.claim(key, fp, lease=LEASE, ttl=POLICY.ttl), LeaseLost)
        clock.advance(LEASE)
    handler = Calls()
    verdict = process(consumer, message(), handler)
    assert verdict.action is Action.DEAD_LETTER
    assert verdict.reason is Reason.EXHAUSTED
    assert handler.count == 0


# -- keys, scopes and fingerprints --------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [
        {"Idempotency-Key": "abc"},
        {"idempotency-key": b"abc"},
        {"x-idempotency-key": "abc"},
        {"X-Idempotency-Key": '"abc"'},
    ],
)
def test_key_from_either_header(store: Store, headers: dict[str, Any]) -> None:
    """The key comes from Idempotency-Key or x-idempotency-key, any case, quoted or bare."""
    consumer = consumer_for(store)
    assert consumer.key_for(Delivery(b"{}", headers)) == "orders|abc"


def test_key_falls_back_to_the_broker_message_id(store: Store) -> None:
    """Without a key header, the broker's message id (stable across redeliveries) is the key."""
    consumer = consumer_for(store)
    assert consumer.key_for(Delivery(b"{}", {}, message_id="orders/0/17")) == "orders|orders/0/17"


@pytest.mark.parametrize("scope", ["orders", "a|b", "s" * 65, "billing.handlers.on_order"])
def test_keys_are_scoped_as_scope_key_says(store: Store, scope: str) -> None:
    """The scope's prefix is made once per scope: every key is `scope_key(scope, key)`, long
    or odd scopes (digested) too, and a scope assigned later takes effect."""
    consumer = IdempotentConsumer(store, scope=scope, policy=POLICY)
    delivery = Delivery(b"{}", {"Idempotency-Key": "abc"})
    assert consumer.key_for(delivery) == scope_key(scope, "abc")
    consumer.scope = "other"
    assert consumer.key_for(delivery) == "other|abc"


@pytest.mark.parametrize(
    ("headers", "message_id"),
    [({}, None), ({"Idempotency-Key": ""}, None), ({"Idempotency-Key": "x" * 256}, "m")],
)
def test_missing_or_invalid_key_is_dead_lettered(
    store: Store, process: Process, headers: dict[str, Any], message_id: str | None
) -> None:
    """A message without a usable key never runs unprotected: it is dead-lettered."""
    consumer = consumer_for(store)
    handler = Calls()
    verdict = process(consumer, Delivery(b"{}", headers, message_id=message_id), handler)
    assert verdict.action is Action.DEAD_LETTER
    assert verdict.reason is Reason.INVALID_KEY
    assert handler.count == 0


def test_content_key_ignores_json_formatting(store: Store, process: Process) -> None:
    """key='content': the same JSON with other key order and number format is a duplicate."""
    consumer = consumer_for(store, key="content")
    handler = Calls()
    first = process(consumer, Delivery(b'{"a": 1, "b": [1.0, 2]}'), handler)
    second = process(consumer, Delivery(b'{"b":[1,2.00],"a":1.0}'), handler)
    other = process(consumer, Delivery(b'{"a": 2, "b": [1, 2]}'), handler)
    assert (first.reason, second.reason, other.reason) == (
        Reason.PROCESSED,
        Reason.DUPLICATE,
        Reason.PROCESSED,
    )
    assert handler.count == 2


_PAST_FLOAT = (
    b'{"order": 7, "rate": 0.1}',
    b'{"order": 7, "rate": 0.10000000000000000001}',
)
"""Two messages whose numbers differ only past a float's precision (both are the float 0.1)."""


def test_content_keys_are_exact(store: Store, process: Process) -> None:
    """key='content': numbers that differ past a float's precision are two operations, and both
    run (the old key read them as one float, and acked the second as a duplicate)."""
    consumer = consumer_for(store, key="content")
    first, second = (Delivery(body) for body in _PAST_FLOAT)
    assert consumer.key_for(first) != consumer.key_for(second)
    assert consumer.key_for(second).endswith(
        content_hash({"order": 7, "rate": Decimal("0.10000000000000000001")})
    )
    handler = Calls()
    verdicts = [process(consumer, delivery, handler) for delivery in (first, second, first)]
    assert [verdict.reason for verdict in verdicts] == [
        Reason.PROCESSED,
        Reason.PROCESSED,
        Reason.DUPLICATE,
    ]
    assert handler.count == 2


def test_body_value_reads_numbers_exactly() -> None:
    """`body_value` keeps every digit (Decimals), so keys built from it are exact too."""
    first, second = (body_value(body) for body in _PAST_FLOAT)
    assert second["rate"] == Decimal("0.10000000000000000001")
    assert first != second
    assert body_value(b"[" * 100_000) == b"[" * 100_000


@pytest.mark.parametrize("key", ["header", "content"])
@pytest.mark.parametrize(
    ("body", "same"),
    [
        (b'{"n": 1e1000000}', b'{"n":10E+999999}'),
        (b'{"n": -1e-1000000}', b'{"n":-0.1e-999999}'),
        (b"[" * 100_000, b"[" * 100_000),
        (b'{"n": NaN}', b'{"n": NaN}'),
        (b'{"n": 1e99999999999999999999999}', b'{"n": 1e99999999999999999999999}'),
    ],
    ids=["huge-exponent", "tiny-exponent", "deep", "nan", "out-of-range"],
)
def test_hostile_bodies_are_keyed_and_fingerprinted_promptly(
    store: Store, process: Process, key: str, body: bytes, same: bytes
) -> None:
    """A 16-byte number with a huge exponent, deep nesting, NaN, an exponent out of range: the
    message is keyed and fingerprinted at once (the old code built a million-digit integer for
    seconds, or raised), runs once, and its copy is a duplicate. Bodies without a canonical JSON
    form are identified by their bytes, as in the HTTP middleware."""
    consumer = consumer_for(store, key=key)
    handler = Calls()
    headers = {"Idempotency-Key": "k-hostile"}
    first = process(consumer, Delivery(body, headers), handler)
    again = process(consumer, Delivery(same, headers), handler)
    assert (first.reason, again.reason) == (Reason.PROCESSED, Reason.DUPLICATE)
    assert handler.count == 1


def test_key_from_a_callable(store: Store, process: Process) -> None:
    """A key callable sees the whole delivery."""
    consumer = consumer_for(store, key=lambda d: json.loads(d.body)["order"])
    handler = Calls()
    process(consumer, Delivery(b'{"order": "o-7", "at": 1}'), handler)
    assert process(consumer, Delivery(b'{"order": "o-7", "at": 1}'), handler).reason is (
        Reason.DUPLICATE
    )
    assert consumer.key_for(Delivery(b'{"order": "o-7"}')) == "orders|o-7"


def test_each_scope_processes_a_message_once(store: Store, process: Process) -> None:
    """Two consumer groups (scopes) each run the handler once for the same key."""
    handler = Calls()
    for scope in ("billing", "shipping", "billing", "shipping"):
        process(consumer_for(store, scope=scope), message(), handler)
    assert handler.count == 2


def test_same_key_other_body_is_dead_lettered_as_mismatch(store: Store, process: Process) -> None:
    """The same key with another payload is a producer bug: dead-lettered, never run."""
    consumer = consumer_for(store)
    handler = Calls()
    process(consumer, message(body={"n": 1}), handler)
    verdict = process(consumer, message(body={"n": 2}), handler)
    assert verdict.action is Action.DEAD_LETTER
    assert verdict.reason is Reason.MISMATCH
    assert handler.count == 1
    unchecked = consumer_for(store, fingerprint=None, scope="loose")
    process(unchecked, message(body={"n": 1}), handler)
    assert process(unchecked, message(body={"n": 2}), handler).reason is Reason.DUPLICATE


def test_body_fingerprint_is_canonical_and_exact(store: Store, process: Process) -> None:
    """The default fingerprint reads JSON bodies canonically (key order, spacing, 1 vs 1.0) and
    compares numbers exactly: a payload differing in the 20th digit is another payload."""
    consumer = consumer_for(store)
    same = [b'{"a": 1, "b": [1.0, 2.50]}', b'{"b":[1,2.5],"a":1.00}', b'{"b":[1e0,2.5],"a":1}']
    assert len({consumer.fingerprint_for(Delivery(body)) for body in same}) == 1
    exact = [b'{"x": 0.1}', b'{"x": 0.10000000000000000001}']
    assert len({consumer.fingerprint_for(Delivery(body)) for body in exact}) == 2
    raw = [b"not json", b"\xff\xfe binary"]
    assert len({consumer.fingerprint_for(Delivery(body)) for body in raw}) == 2
    # NaN has no canonical JSON form: the body is fingerprinted by its bytes, as the HTTP
    # middleware does, so the message runs and only a byte-identical copy is its duplicate.
    handler = Calls()
    headers = {"Idempotency-Key": "nan"}
    verdicts = [
        process(consumer, Delivery(body, headers), handler)
        for body in (b'{"n": NaN}', b'{"n": NaN}', b'{"n":NaN}')
    ]
    assert [verdict.reason for verdict in verdicts] == [
        Reason.PROCESSED,
        Reason.DUPLICATE,
        Reason.MISMATCH,
    ]
    assert handler.count == 1


# -- store outages: nothing acked that was not completed -------------------------------------------


class FlakyStore:
    """Delegates to *inner*, but raises StoreUnavailableError on the verbs listed in *down*
    (``claim`` covers ``claim_many`` and the async twins too)."""

    def __init__(self, inner: Store, down: set[str]) -> None:
        self.inner = inner
        self.down = down

    def __getattr__(self, name: str) -> Any:
        verb = name.removeprefix("a").removesuffix("_many")
        if verb in self.down:
            if name.startswith("a"):

                async def refuse_async(*args: Any, **kwargs: Any) -> Any:
                    raise StoreUnavailableError("down", backend="test")

                return refuse_async

            def refuse(*args: Any, **kwargs: Any) -> Any:
                raise StoreUnavailableError("down", backend="test")

            return refuse
        return getattr(self.inner, name)


@pytest.mark.parametrize("down", ["claim", "complete"])
def test_store_outage_never_acks(
    store: Store, process: Process, down: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Store down before the claim or at completion: the verdict is RETRY, never ACK."""
    monkeypatch.setattr("oncely._execution.flows.SETTLE_RETRY_DELAYS", (0.0,))
    flaky: Any = FlakyStore(store, {down})
    consumer = IdempotentConsumer(flaky, scope="orders", policy=POLICY)
    handler = Calls()
    verdict = process(consumer, message(), handler)
    assert verdict.action is Action.RETRY
    assert verdict.reason is Reason.STORE_UNAVAILABLE
    assert verdict.delay == POLICY.retry_delay
    assert handler.count == (0 if down == "claim" else 1)


def test_cancellation_releases_and_propagates(store: Store) -> None:
    """A cancelled async handler releases its lease and the cancellation propagates."""
    consumer = consumer_for(store)

    async def main() -> None:
        started = asyncio.Event()

        async def handler() -> None:
            started.set()
            await asyncio.Event().wait()

        task = asyncio.create_task(consumer.aprocess(message(), handler))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    record = store.get(consumer.key_for(message()))
    assert record is not None
    assert record.status is Status.RELEASED


class _GatedCompletions(MemoryStore):
    """A memory store whose completions wait for ``gate`` (a slow reply), after ``sent``."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = asyncio.Event()
        self.gate = asyncio.Event()

    async def acomplete(self, key: str, token: int, result: bytes, *, ttl: timedelta) -> Any:
        self.sent.set()
        await self.gate.wait()
        return await super().acomplete(key, token, result, ttl=ttl)

    async def acomplete_many(self, items: Any, *, ttl: timedelta) -> Any:
        self.sent.set()
        await self.gate.wait()
        return await super().acomplete_many(items, ttl=ttl)


@pytest.mark.parametrize("path", ["one", "coalesced", "batch", "batch-one-by-one"])
def test_cancelled_after_the_handler_returned_the_completion_still_lands(path: str) -> None:
    """Cancelled (a consumer shutting down) while its completion is on the way: the handler
    has run, so the completion goes on; the record does not stay in progress to run again."""

    async def main() -> tuple[Any, Any]:
        store = _GatedCompletions()
        seen = store if path != "batch-one-by-one" else SingleVerbs(store)
        policy = ConsumerPolicy(lease=LEASE, coalesce=path == "coalesced")
        consumer = IdempotentConsumer(seen, scope="s", policy=policy)

        async def handler(*_: Any) -> str:
            return "done"

        if path.startswith("batch"):
            call = consumer.aprocess_batch([message()], handler)
        else:
            call = consumer.aprocess(message(), handler)
        task = asyncio.ensure_future(call)
        await store.sent.wait()
        task.cancel()
        # The gate opens on its own: the caller may wait for the shielded completion to land
        # before its cancellation propagates, or propagate it at once and leave it to land.
        asyncio.get_running_loop().call_later(0.05, store.gate.set)
        with pytest.raises(asyncio.CancelledError):
            await task
        key = consumer.key_for(message())
        for _ in range(100):  # a few loop turns for the completion to land
            await asyncio.sleep(0)
        return store.get(key), consumer.stats.snapshot()

    record, _ = asyncio.run(main())
    assert record is not None
    assert record.status is Status.COMPLETED


def test_current_lease_is_visible_to_the_handler(store: Store, process: Process) -> None:
    """The handler sees its fencing token through oncely.current_lease()."""
    import oncely

    consumer = consumer_for(store)
    seen: list[Any] = []
    process(consumer, message(), lambda: seen.append(oncely.current_lease()))
    assert seen[0].token == 1
    assert seen[0].key == consumer.key_for(message())


# -- configuration and adapters' flows ----------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {"max_attempts": 0},
        {"max_attempts": True},
        {"lease": 0},
        {"ttl": 1, "lease": 10},
        {"dead_letter_on": ("nope",)},
    ],
)
def test_bad_policy_is_rejected(options: dict[str, Any]) -> None:
    """A nonsensical policy fails when it is built."""
    with pytest.raises(ConfigurationError):
        ConsumerPolicy(**options)


def test_bad_runner_options_are_rejected(store: Store) -> None:
    """Unknown key or fingerprint sources and an empty scope fail at construction."""
    with pytest.raises(ConfigurationError):
        IdempotentConsumer(store, scope="")
    with pytest.raises(ConfigurationError):
        IdempotentConsumer(store, scope="s", key="body")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        IdempotentConsumer(store, scope="s", fingerprint="headers")  # type: ignore[arg-type]


class Note(BrokerOp):
    def __init__(self, text: str) -> None:
        self.text = text


def test_adapter_flows_mix_broker_and_store_operations(store: Store) -> None:
    """run_with and arun_with send BrokerOps to the adapter and the rest to the store driver."""
    consumer = consumer_for(store)

    def flow(delivery: Delivery) -> Flow[list[str]]:
        verdict = yield Handle(delivery, consumer.flow(delivery))
        reply = yield Note(str(verdict.reason))
        [late] = yield Parallel([late_flow(delivery)])
        return [reply, late]

    def late_flow(delivery: Delivery) -> Flow[str]:
        verdict = yield Handle(delivery, consumer.flow(delivery))
        return str(verdict.reason)

    notes: list[str] = []

    def broker(op: BrokerOp) -> str:
        assert isinstance(op, Note)
        notes.append(op.text)
        return op.text.upper()

    async def abroker(op: BrokerOp) -> str:
        return broker(op)

    seen: list[Delivery] = []

    def handler(delivery: Delivery) -> None:
        seen.append(delivery)

    async def ahandler(delivery: Delivery) -> None:
        seen.append(delivery)

    replies = run_with(flow(message("a")), store, handler, broker)
    assert replies == ["PROCESSED", "duplicate"]
    replies = asyncio.run(arun_with(flow(message("b")), store, ahandler, abroker))
    assert replies == ["PROCESSED", "duplicate"]
    assert notes == ["processed", "processed"]
    assert [d.headers["Idempotency-Key"] for d in seen] == ["a", "b"]


def test_sync_store_only_is_refused_for_aprocess() -> None:
    """aprocess needs an AsyncStore: a sync-only store is a configuration error."""

    class SyncOnly:
        def claim(self, *a: Any, **k: Any) -> ClaimResult: ...
        def complete(self, *a: Any, **k: Any) -> LeaseLost | None: ...
        def fail(self, *a: Any, **k: Any) -> LeaseLost | None: ...
        def release(self, *a: Any, **k: Any) -> LeaseLost | None: ...
        def extend(self, *a: Any, **k: Any) -> LeaseLost | None: ...
        def get(self, key: str) -> Record | None: ...
        def close(self) -> None: ...

    consumer = IdempotentConsumer(SyncOnly(), scope="s")

    async def handler() -> None:
        return None

    with pytest.raises(ConfigurationError):
        asyncio.run(consumer.aprocess(message(), handler))


def test_a_key_callable_may_return_a_uuid_or_an_int(store: Store, process: Process) -> None:
    """Like the decorator and the guard, a consumer's key= callable may name UUIDs and ints."""
    order = uuid.UUID("8e03978e-40d5-43e8-bc93-6894a57f9324")
    for value in (order, 7):
        consumer = consumer_for(store, key=lambda delivery, value=value: value)
        calls = Calls(result="done")
        verdicts = [process(consumer, message(), calls) for _ in range(2)]
        assert [v.action for v in verdicts] == [Action.ACK, Action.ACK]
        assert verdicts[0].key == f"orders|{value}"
        assert calls.count == 1
