"""`aprocess` (the grouped path) and the reference flow (`flow` driven by `arun`, what
``ONCELY_REFERENCE_FLOWS`` makes `aprocess` take) reach the same verdicts, delivery by delivery."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest

from oncely import _switches
from oncely.consumers import ConsumerPolicy, Delivery, IdempotentConsumer, Verdict
from oncely.testing import FrozenClock
from tests.consumers._batching import BatchingStore

POLICY = ConsumerPolicy(
    lease=timedelta(seconds=10),
    max_attempts=2,
    retry_delay=timedelta(seconds=1),
    dead_letter_on=(ValueError,),
)


def _delivery(key: str | None, body: Any = b'{"a": 1}') -> Delivery:
    headers = {} if key is None else {"Idempotency-Key": key}
    return Delivery(body, headers)


async def _scenario(consumer: IdempotentConsumer, clock: FrozenClock) -> list[Verdict]:
    async def ok() -> str:
        return "done"

    async def boom() -> None:
        raise RuntimeError("boom")

    async def poison() -> None:
        raise ValueError("poison")

    async def slow() -> str:
        await asyncio.sleep(0.01)
        return "slow"

    verdicts = [
        await consumer.aprocess(_delivery("new"), ok),
        await consumer.aprocess(_delivery("new"), ok),  # a completed duplicate
        await consumer.aprocess(_delivery("new", b'{"a": 2}'), ok),  # reused: mismatch
        await consumer.aprocess(_delivery(None), ok),  # no key
        await consumer.aprocess(_delivery("fails"), boom),  # attempt 1: retried
        await consumer.aprocess(_delivery("fails"), boom),  # attempt 2: exhausted
        await consumer.aprocess(_delivery("fails"), ok),  # dead-lettered before
        await consumer.aprocess(_delivery("poison"), poison),  # dead-lettered at once
    ]
    # a busy key: held by a lease of another worker
    store = consumer.store
    assert isinstance(store, BatchingStore)
    busy = _delivery("busy")
    store.claim(
        consumer.key_for(busy), consumer.fingerprint_for(busy), lease=POLICY.lease, ttl=POLICY.ttl
    )
    verdicts.append(await consumer.aprocess(_delivery("busy"), ok))
    clock.advance(timedelta(seconds=11))  # its worker died: taken over on attempt 2
    verdicts.append(await consumer.aprocess(_delivery("busy"), ok))
    # concurrent deliveries (a copy of one in flight waits for it on the grouped path: the
    # batch tests hold it to that; here each key comes once)
    concurrent = await asyncio.gather(
        *(consumer.aprocess(_delivery(key), slow) for key in ["c1", "c2", "c3", "c4"])
    )
    return [*verdicts, *concurrent]


def _verdicts(reference: bool, monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    monkeypatch.setattr(_switches, "reference_flows", reference)
    clock = FrozenClock()
    consumer = IdempotentConsumer(BatchingStore(clock=clock), scope="s", policy=POLICY)
    verdicts = asyncio.run(_scenario(consumer, clock))
    return [
        (v.action, v.reason, v.key, v.delay, v.attempt, type(v.error), v.result) for v in verdicts
    ]


def test_the_grouped_path_and_the_reference_flow_reach_the_same_verdicts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    grouped = _verdicts(False, monkeypatch)
    reference = _verdicts(True, monkeypatch)
    assert grouped == reference
    assert len({reason for _, reason, *_ in grouped}) >= 7  # the scenario covers the decisions
