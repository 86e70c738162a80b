"""The sync and async drivers of the consumer's flows: `run_with` and `arun_with` perform what
the flows yield, hand `BrokerOp` values to the adapter and the rest to the store."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from oncely import _events, _execution, _observed
from oncely._core.flow import Flow, adrive, drive
from oncely._core.machine import landed as landed_in
from oncely._core.protocols import AsyncStore, SyncStore
from oncely.consumers._grouping import Landed, Settle, acomplete, landed, sent, settle_all
from oncely.consumers._sharing import Decide, Share, Slot, Wait
from oncely.errors import ConfigurationError, StoreError
from oncely.stores._coalesce import SyncCompletions
from oncely.stores._coalescing import CoalescingStore

T = TypeVar("T")


class BrokerOp:
    """Base class of the operations an adapter's flow yields for the adapter to perform."""


@dataclass(frozen=True, slots=True, eq=False)
class Handle(BrokerOp):
    """Run *flow* (usually `IdempotentConsumer.flow`) with the handler bound to *message*."""

    message: Any
    flow: Flow[Any]


@dataclass(frozen=True, slots=True, eq=False)
class Run(BrokerOp):
    """Run the handler on *message* under *lease* (the batch path's `Invoke`)."""

    message: Any
    lease: _execution.Lease


@dataclass(frozen=True, slots=True, eq=False)
class Parallel(BrokerOp):
    """Run *flows* (one per partition, say): concurrently when async, in order when sync."""

    flows: Sequence[Flow[Any]]
    shares: bool = True
    """Whether *flows* may claim the same keys (`Share`); false when each key is in one."""


@dataclass(frozen=True, slots=True, eq=False)
class Overlaps(BrokerOp):
    """Ask the driver whether it runs the flows of a `Parallel` concurrently (async)."""


@dataclass(frozen=True, slots=True, eq=False)
class SettleHere(BrokerOp):
    """*settle*, from a flow that is a task of its own with nothing left to do but wait for it
    (a handler run of an async batch): completed in that task, with no task of its own; answers
    a handle, done, as `Settle` does (async drivers only: see `Overlaps`)."""

    settle: Settle


def no_broker(op: BrokerOp) -> Any:
    """The *broker* of `run_with` for flows that yield no broker operation of their own."""
    raise TypeError(f"cannot perform {op!r}")


async def ano_broker(op: BrokerOp) -> Any:
    """Async `no_broker`."""
    raise TypeError(f"cannot perform {op!r}")


def _require(store: Any, kind: type[Any]) -> Any:
    if not isinstance(store, kind):
        article = "an" if kind.__name__[0] in "AEIOU" else "a"
        raise ConfigurationError(f"{type(store).__name__} is not {article} {kind.__name__}")
    return store


def run_with(
    flow: Flow[T],
    store: SyncStore,
    handler: Callable[[Any], Any],
    broker: Callable[[BrokerOp], Any],
) -> T:
    """Run an adapter's *flow* against a sync store.

    `Handle`, `Run` and `Parallel` are performed here; other `BrokerOp` values go to *broker*;
    the rest (store calls, the handler's invocation, heartbeats, sleeps) to
    `oncely._execution.perform`, with *handler* called on the message of the enclosing `Handle`.
    """
    completions: SyncCompletions | None = None

    def performer(message: Any) -> Callable[[Any], Any]:
        def perform(op: Any) -> Any:
            kind = type(op)
            if kind is Run:
                return _execution.invoke_under(op.lease, handler, op.message)
            if kind is Settle:
                nonlocal completions
                if completions is None:  # the sync side of the one grouping, see arun_with
                    completions = SyncCompletions(_observed.timed(store) if _events.on else store)
                return sent(op, completions)
            if kind is Landed:
                assert completions is not None
                return settle_all(
                    op.handles, completions, lambda each: _execution.perform(each, store)
                )
            if kind is Share:
                return {}  # the flows of a Parallel run one after the other
            if kind is Decide or kind is Wait:
                return None
            if kind is Handle:
                flow = _observed.handling(op.flow, op.message) if _events.on else op.flow
                return drive(flow, performer(op.message))
            if kind is Parallel:
                return [drive(each, perform) for each in op.flows]
            if kind is Overlaps:
                return False
            if isinstance(op, BrokerOp):
                return broker(op)
            if kind is _execution.Invoke:
                return _execution.invoke_under(op.lease, handler, message)
            return _execution.perform(op, store)

        return perform

    try:
        return drive(flow, performer(None))
    finally:
        if completions is not None:  # the handlers ran: their records must say so
            completions.close()


async def arun_with(
    flow: Flow[T],
    store: AsyncStore,
    handler: Callable[[Any], Awaitable[Any]],
    broker: Callable[[BrokerOp], Awaitable[Any]],
) -> T:
    """Async `run_with`: the flows of a `Parallel` run as concurrent tasks; completions go
    through their consumer's `CoalescingStore` (group commit, made once per store: see
    `IdempotentConsumer._calls_to`) as their handlers return."""

    settling: list[asyncio.Future[Any]] = []
    pruned = 0  # the length of *settling* when its landed completions were last dropped
    claimed: dict[str, Slot] = {}  # keys claimed by the flows of this run, see Share
    sharing = 0  # Parallel ops of several flows running now: their flows may share keys

    async def settle_here(op: Settle) -> asyncio.Future[Any]:
        grouped: CoalescingStore = op.consumer._calls_to(store)
        try:
            outcome = await acomplete(op.consumer, op.lease, op.payload, grouped)
        except asyncio.CancelledError:
            # Its first call lands all the same (the grouped store sees to it), its answer
            # lost to this task: a task of its own learns it, or completes again, as the task
            # of a `Settle` would have gone on doing.
            handle = asyncio.ensure_future(_complete_again(op, grouped))
            settling.append(handle)
            if op.decided is not None:
                handle.add_done_callback(op.decided.decide)
            raise
        if op.decided is not None:
            op.decided.decide()
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        done.set_result(outcome)
        return done

    def share(keys: tuple[str, ...]) -> dict[str, Slot]:
        slots: dict[str, Slot] = {}
        if not sharing:  # a lone flow: no other one claims its keys here
            return slots
        for key in keys:
            slot = claimed.get(key)
            if slot is None or slot.done.done():
                slot = claimed[key] = Slot(asyncio.get_running_loop().create_future())
            slot.flows += 1
            slot.claiming += 1
            slots[key] = slot
        return slots

    def performer(message: Any) -> Callable[[Any], Awaitable[Any]]:
        async def perform(op: Any) -> Any:
            kind = type(op)
            if kind is Run:
                return await _execution.ainvoke_under(op.lease, handler, op.message)
            if kind is SettleHere:
                return await settle_here(op.settle)
            if kind is Settle:
                sent = acomplete(op.consumer, op.lease, op.payload, op.consumer._calls_to(store))
                handle = asyncio.ensure_future(sent)
                settling.append(handle)
                nonlocal pruned
                if len(settling) >= 2 * pruned + 64:  # amortised: not a scan per completion
                    settling[:] = [each for each in settling if not each.done()]
                    pruned = len(settling)
                if op.decided is not None:
                    handle.add_done_callback(op.decided.decide)
                return handle
            if kind is Landed:
                return await landed(op.handles)
            if kind is Share:
                return share(op.keys)
            if kind is Wait:
                await asyncio.wait((op.slot.done,), timeout=op.timeout)
                return None
            if kind is Decide:
                for slot in op.slots:
                    slot.decide()
                return None
            if kind is Handle:
                flow = _observed.handling(op.flow, op.message) if _events.on else op.flow
                return await adrive(flow, performer(op.message))
            if kind is Overlaps:
                return True
            if kind is Parallel:
                nonlocal sharing
                several = len(op.flows) > 1 and op.shares
                sharing += several
                try:
                    return await gathered(
                        [asyncio.ensure_future(adrive(each, perform)) for each in op.flows]
                    )
                finally:
                    sharing -= several
            if isinstance(op, BrokerOp):
                return await broker(op)
            if kind is _execution.Invoke:
                return await _execution.ainvoke_under(op.lease, handler, message)
            return await _execution.aperform(op, store)

        return perform

    try:
        return await adrive(flow, performer(None))
    except BaseException:
        # Cancelled (a consumer shutting down) with completions on the way, say: their
        # handlers ran, so they land before the store may be closed (see `landed`).
        with contextlib.suppress(asyncio.CancelledError):  # what is raised is the first error
            await landed(settling)
        raise


async def _complete_again(op: Settle, store: CoalescingStore) -> Any:
    """The answer of a completion whose caller was cancelled after its first call landed: the
    record shows it completed, else it is sent again (retried as `acomplete` retries)."""
    lease = op.lease
    try:
        record = await store.aget(lease.key)
    except StoreError:
        record = None
    if landed_in(record, lease.token, "complete", op.payload):
        return None
    return await acomplete(op.consumer, lease, op.payload, store)


def mark_coroutine_function(handler: Any) -> None:
    """Make an instance whose ``__call__`` is async pass for a coroutine function.

    Clients choose how to call a callback by asking ``asyncio.iscoroutinefunction`` or
    ``inspect.iscoroutinefunction``, which answer no for such an instance: aio-pika 9.0 (on
    aiormq 6), for one, then never awaits what it returns. The markers make both answer yes
    (Python 3.12+ has `inspect.markcoroutinefunction` for the second).
    """
    mark = getattr(inspect, "markcoroutinefunction", None)
    if mark is not None:
        mark(handler)
    handler._is_coroutine = getattr(asyncio.coroutines, "_is_coroutine", None)


async def gathered(tasks: list[asyncio.Future[T]]) -> list[T]:
    """Await *tasks* together; on an error or a cancellation the others are cancelled and
    awaited before it propagates (no task is left running behind a failed batch)."""
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
