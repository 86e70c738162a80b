"""An async caller cancelled while its claim is in flight gives the lease back.

``asyncio.wait_for(charge(...), 0.3)`` against a slow store: the claim is applied, its reply
arrives after the caller was cancelled, and the body never started. The lease must be released
(the release itself shielded) before the cancellation propagates, so the retry runs at once
rather than getting `InProgressError` for a whole lease. The HTTP entry points have theirs in
``tests/http/test_cancelled_claim.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import pytest

import oncely
from oncely import Status
from oncely.consumers import ConsumerPolicy, Delivery, IdempotentConsumer
from oncely.stores._coalescing import CoalescingStore
from tests._gated import GatedClaims

LEASE = timedelta(seconds=30)


async def _cancel_in_flight(store: GatedClaims, call: Awaitable[Any]) -> None:
    """Start *call*, cancel it once its claim is applied and before it answers, then let the
    claim answer; the call ends cancelled."""
    task = asyncio.ensure_future(call)
    await store.sent.wait()
    task.cancel()
    store.open()
    with pytest.raises(asyncio.CancelledError):
        await task


def _entry(name: str, store: GatedClaims, runs: list[str]) -> Callable[[], Awaitable[Any]]:
    """A call of entry point *name* that appends to *runs* when its body runs."""
    if name == "decorator":

        @oncely.idempotent(store=store, key="payment_id", lease=LEASE)
        async def charge(payment_id: str) -> str:
            runs.append(payment_id)
            return "charged"

        return lambda: charge("p-1")
    if name == "guard":

        async def guarded() -> str:
            async with oncely.Guard(store, "p-1", lease=LEASE) as guard:
                if guard.replayed:
                    return "replayed"
                runs.append("p-1")
                await guard.acomplete("charged")
            return "charged"

        return guarded
    policy = ConsumerPolicy(lease=LEASE, coalesce=name == "consumer-coalesced")
    consumer = IdempotentConsumer(store, scope="s", policy=policy)
    delivery = Delivery(body=b"{}", headers={"Idempotency-Key": "p-1"})

    async def handler() -> str:
        runs.append("p-1")
        return "charged"

    async def process() -> Any:
        if name == "consumer-batch":
            (verdict,) = await consumer.aprocess_batch([delivery], lambda raw: handler())
        else:
            verdict = await consumer.aprocess(delivery, handler)
        return verdict.reason

    return process


@pytest.mark.parametrize(
    "name", ["decorator", "guard", "consumer", "consumer-coalesced", "consumer-batch"]
)
def test_a_call_cancelled_while_its_claim_is_in_flight_releases_the_lease(name: str) -> None:
    """The retry after the cancellation runs the body at once (no `InProgressError`)."""

    async def main() -> list[str]:
        store = GatedClaims()
        runs: list[str] = []
        call = _entry(name, store, runs)
        await _cancel_in_flight(store, call())
        assert runs == []
        await call()
        await call()  # the repeat of the completed call is answered from its record
        return runs

    assert asyncio.run(main()) == ["p-1"]


def test_a_coalesced_claim_cancelled_while_it_is_sent_alone_is_released() -> None:
    async def main() -> Any:
        store = GatedClaims()
        coalescing = CoalescingStore(store, max_in_flight=1)
        claim = coalescing.aclaim("k", "fp", lease=LEASE, ttl=LEASE)
        await _cancel_in_flight(store, claim)
        return store.get("k")

    record = asyncio.run(main())
    assert record is not None
    assert record.status is Status.RELEASED


def test_a_coalesced_claim_cancelled_while_its_batch_is_in_flight_is_released() -> None:
    """The second claim waits while the first is in flight, then goes in a batch call; its
    caller is cancelled while that batch is in flight: its lease is released when it answers."""

    async def main() -> tuple[Any, Any]:
        store = GatedClaims()
        coalescing = CoalescingStore(store, max_in_flight=1)
        first = asyncio.ensure_future(coalescing.aclaim("a", "fp", lease=LEASE, ttl=LEASE))
        await store.sent.wait()
        second = asyncio.ensure_future(coalescing.aclaim("b", "fp", lease=LEASE, ttl=LEASE))
        await asyncio.sleep(0)  # the second claim is queued behind the first
        store.gate.set()
        await store.batch_sent.wait()
        second.cancel()
        store.batch_gate.set()
        with pytest.raises(asyncio.CancelledError):
            await second
        await first
        await asyncio.gather(*coalescing._claims._sending)  # the batch's task sends the release
        return store.get("a"), store.get("b")

    first, second = asyncio.run(main())
    assert first is not None
    assert first.status is Status.IN_PROGRESS
    assert second is not None
    assert second.status is Status.RELEASED
