"""Completions sent as their handlers return, while the next handlers run.

A batch's handler that returns yields `Settle`: its completion goes to the store at once,
without waiting for the answer (a handle answers it), and `Landed` waits for those handles.
Async, each completion is the shared settle flow (`completion`) over the run's
`oncely.stores._coalescing.CoalescingStore`, the one grouping of claims and completions into
batch calls that the async consumer and the ASGI middleware use too. Sync, its sync side
(`oncely.stores._coalesce.SyncCompletions`) sends them from a thread of its own, by the same
rules: one call at once, those queued meanwhile together as one ``complete_many`` call, at most
`oncely.stores._coalesce.MAX_BATCH` in one call; one whose first call did not land goes on
with the same settle flow (`settle_all`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from oncely import _execution
from oncely._core import codec as _codec
from oncely._core.codec import Codec
from oncely._core.flow import Flow
from oncely._log import fields, get_logger
from oncely.consumers._running import Running
from oncely.consumers._sharing import Slot
from oncely.errors import LeaseLostError, StoreError
from oncely.stores._coalesce import SyncCompletions

__all__ = [
    "Landed",
    "Settle",
    "acomplete",
    "completion",
    "encoded",
    "landed",
    "sent",
    "settle_all",
]

logger = get_logger(__name__)


@dataclass(frozen=True, slots=True, eq=False)
class Settle:
    """Send the completion of *lease* with *payload* now, without waiting for its answer:
    answers a handle (see `Landed`). *decided*, the key's `Slot`, is decided once it landed."""

    consumer: Running
    lease: _execution.Lease
    payload: bytes
    decided: Slot | None = None


@dataclass(frozen=True, slots=True, eq=False)
class Landed:
    """Wait for the completions of these `Settle` handles; answers theirs, in order: ``None``
    (completed), a `oncely.LeaseLost` or the error (`LeaseLostError`, `StoreError`)."""

    handles: Sequence[Any]


def completion(
    consumer: Running,
    lease: _execution.Lease,
    payload: bytes,
    first: tuple[Any, BaseException | None] | None = None,
) -> Flow[Any]:
    """Complete *lease* with *payload*, retrying while the store is briefly unavailable:
    ``None`` once completed, else the `LeaseLostError` or `StoreError` (logged where raised).
    *first* is the outcome of a first call already sent (see `oncely._execution.settle`)."""
    try:
        yield from _execution.settle(lease, "complete", payload, consumer._policy, first)
    except (LeaseLostError, StoreError) as exc:
        return exc
    return None


async def acomplete(consumer: Running, lease: _execution.Lease, payload: bytes, store: Any) -> Any:
    """`completion` against an async *store* (a `CoalescingStore`), its first call written
    out: one await when it lands, the settle flow only to retry or judge what it answered."""
    try:
        lost = await store.acomplete(lease.key, lease.token, payload, ttl=consumer._policy.ttl)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # retried, then judged, by the settle flow
        first: tuple[Any, BaseException | None] = (None, exc)
    else:
        if lost is None:
            return None
        first = (lost, None)
    return await _execution.arun(completion(consumer, lease, payload, first), store)


def encoded(lease: _execution.Lease, value: Any, codec: Codec) -> bytes:
    """The stored form of *value*; one that cannot be encoded is stored as unavailable."""
    try:
        return _codec.encode_value(codec.encode(value))
    except Exception as exc:
        logger.warning(
            "result of key=%s cannot be serialised (%s); replays will raise ResultUnavailableError",
            lease.key,
            exc,
            extra=fields(key=lease.key, token=lease.token, outcome="unserialisable"),
        )
        return _codec.encode_unavailable(f"{type(exc).__name__}: {exc}")


def sent(op: Settle, completions: SyncCompletions) -> tuple[Settle, Future[Any]]:
    """Sync `Settle`: *op*'s completion, queued for the sender thread of *completions* (the
    sync side of the one grouping); the handle that `settle_all` answers."""
    item = (op.lease.key, op.lease.token, op.payload)
    return op, completions.submit(item, {"ttl": op.consumer._policy.ttl})


def settle_all(
    handles: Sequence[tuple[Settle, Future[Any]]],
    completions: SyncCompletions,
    perform: Callable[[Any], Any],
) -> list[Any]:
    """Sync `landed`: the answers of these completions (`sent` handles), in order. One that
    did not land at once goes on with the settle flow (`completion`), as an async consumer's
    does; those flows go side by side, as its tasks would: in each round their completions
    go together through *completions* and their pauses are taken once for all (their other
    operations, to *perform*)."""
    answers: list[Any] = [None] * len(handles)
    flows: dict[int, Flow[Any]] = {}
    replies: dict[int, tuple[Any, BaseException | None]] = {}
    for i, (op, handle) in enumerate(handles):
        first = _outcome(handle)
        if first != (None, None):  # else landed: the common case
            flows[i] = completion(op.consumer, op.lease, op.payload, first)
            replies[i] = (None, None)
    while flows:
        pause = 0.0
        calls: dict[int, Future[Any]] = {}
        for i, flow in list(flows.items()):
            try:
                op = _advance(flow, replies[i], perform)
            except StopIteration as done:
                answers[i] = done.value
                del flows[i]
                continue
            if type(op) is _execution.Sleep:
                pause = max(pause, op.seconds)
                replies[i] = (None, None)
            else:
                calls[i] = completions.submit(op.args, op.kwargs)
        if pause:
            time.sleep(pause)
        for i, call in calls.items():
            replies[i] = _outcome(call)
    return answers


def _outcome(future: Future[Any]) -> tuple[Any, BaseException | None]:
    try:
        return future.result(), None
    except Exception as exc:
        return None, exc


def _advance(
    flow: Flow[Any], reply: tuple[Any, BaseException | None], perform: Callable[[Any], Any]
) -> Any:
    """Go on with *flow* from *reply* (its operation's answer, or error) to its next pause or
    completion call, which is returned (the rest performed by *perform*); StopIteration at its
    end."""
    value, error = reply
    while True:
        op = flow.throw(error) if error is not None else flow.send(value)
        if type(op) is _execution.Sleep or (
            type(op) is _execution.StoreCall and op.verb == "complete"
        ):
            return op
        try:
            value, error = perform(op), None
        except Exception as exc:  # the flow decides
            value, error = None, exc


async def landed(handles: Sequence[asyncio.Future[Any]]) -> list[Any]:
    """The answers of these completions (`Settle` handles). A caller cancelled meanwhile
    waits for them to land, then is cancelled: a consumer shutting down does not close its
    store under a completion, to leave the record in progress and the message to run again."""
    pending = [handle for handle in handles if not handle.done()]
    cancelled: asyncio.CancelledError | None = None
    while pending:
        try:
            await asyncio.wait(pending)
        except asyncio.CancelledError as exc:
            cancelled = exc
        pending = [handle for handle in pending if not handle.done()]
    if cancelled is not None:
        raise cancelled
    return [handle.result() for handle in handles]
