"""An unordered fetched batch against an async store, written out: what `batch_flow` does
(`oncely.consumers._batch.batched`) for it, without a flow's generators and operations per
delivery. The batch's keys are claimed in chunks sent at once (`CLAIM_CHUNK`), each acquired
delivery runs as a task of its own (`IdempotentConsumer._arun_acquired`, the tail of the
grouped per-delivery path) and is completed through the consumer's `CoalescingStore` (made once
per store, see `IdempotentConsumer._calls_to`) as it returns.

`batch_flow` driven by `arun_with` stays the reference: ``ONCELY_REFERENCE_FLOWS`` makes
`IdempotentConsumer.aprocess_batch` take it, and the batch tests hold both to the same
verdicts.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

from oncely import _execution
from oncely.consumers._batch import CLAIM_CHUNK, copies_decided, sorted_out
from oncely.consumers._drivers import gathered
from oncely.consumers._running import Running
from oncely.consumers._verdicts import Delivery, Verdict
from oncely.stores._coalescing import CoalescingStore

__all__ = ["abatched"]

T = TypeVar("T")


async def abatched(
    consumer: Running,
    deliveries: Sequence[Delivery],
    handler: Callable[[Any], Awaitable[Any]],
) -> list[Verdict]:
    """The verdicts of an unordered batch, in order (see `IdempotentConsumer.batch_flow`)."""
    verdicts: list[Verdict | None] = [None] * len(deliveries)
    firsts, copies, prints = sorted_out(consumer, deliveries, verdicts)
    if firsts:
        coalescing = consumer._calls_to(consumer.store)
        claims = list(firsts.items())
        await _all(
            [
                _claim_and_run(
                    consumer,
                    coalescing,
                    deliveries,
                    claims[at : at + CLAIM_CHUNK],
                    prints,
                    verdicts,
                    handler,
                )
                for at in range(0, len(claims), CLAIM_CHUNK)
            ]
        )
    return copies_decided(consumer, copies, verdicts)


async def _claim_and_run(
    consumer: Running,
    coalescing: CoalescingStore,
    deliveries: Sequence[Delivery],
    claims: list[tuple[str, int]],
    prints: dict[str, str],
    verdicts: list[Verdict | None],
    handler: Callable[[Any], Awaitable[Any]],
) -> None:
    """Claim *claims* (key, index of its first copy) in one call and run the handlers of those
    acquired, each completed as it returns; set their *verdicts*."""
    store = consumer.store
    answers = await _execution.arun(
        consumer._claim_many([(k, prints[k]) for k, _ in claims]), store
    )
    runs: list[tuple[int, _execution.Lease]] = []
    for (key, index), answer in zip(claims, answers, strict=True):
        verdict, lease = consumer._claimed(key, answer)
        if verdict is None:
            assert lease is not None
            runs.append((index, lease))
            continue
        if lease is not None:  # exhausted: given back, not run
            await _execution.arun(consumer._release(lease), store)
        verdicts[index] = consumer._verdict(verdict)
    ran = await _all(
        [
            consumer._arun_acquired(
                coalescing, lease, functools.partial(handler, deliveries[index].raw)
            )
            for index, lease in runs
        ]
    )
    for (index, _), verdict in zip(runs, ran, strict=True):
        verdicts[index] = verdict


async def _all(calls: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Await *calls* concurrently (one alone, in this task); on an error or a cancellation the
    others are cancelled and awaited before it propagates (see `arun_with`'s `Parallel`)."""
    if len(calls) == 1:
        return [await calls[0]]
    return await gathered([asyncio.ensure_future(call) for call in calls])
