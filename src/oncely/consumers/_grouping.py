"""Completions sent as their handlers return, while the next handlers run.

A batch's handler that returns yields `Settle`: its completion goes to the store at once,
without waiting for the answer (a handle answers it), and `Landed` waits for those handles.
Async, each completion is the shared settle flow (`completion`) over the run's
`oncely.stores._coalesce.CoalescingStore`, the one grouping of claims and completions into
batch calls that the async consumer and the ASGI middleware use too. Sync, `GroupCommit` sends
them from a thread of its own: one at once, those queued meanwhile together as one
``complete_many`` call, at most `MAX_BATCH` in one call.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from oncely import _execution
from oncely._core import codec as _codec
from oncely._core.codec import Codec
from oncely._core.flow import Flow, drive
from oncely._log import fields, get_logger
from oncely.consumers._running import Running
from oncely.consumers._sharing import Slot
from oncely.errors import LeaseLostError, StoreError
from oncely.stores._coalesce import MAX_BATCH

__all__ = ["GroupCommit", "Landed", "Settle", "acomplete", "completion", "encoded", "landed"]

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


class GroupCommit:
    """The completions of one sync run (`run_with`), sent from a thread of their own while the
    next handlers run: one goes at once; those queued while it is in flight go together, as one
    ``complete_many`` call of the consumer that made them (its `_complete_many` flow)."""

    def __init__(self, perform: Callable[[Any], Any]) -> None:
        self._perform = perform
        self._lock = threading.Lock()
        self._queue: list[tuple[Settle, concurrent.futures.Future[Any]]] = []
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def submit(self, op: Settle) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            self._queue.append((op, future))
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="oncely-complete"
                )
        self._pool.submit(self._send)
        return future

    def _send(self) -> None:
        while True:
            with self._lock:
                queued, self._queue = self._queue[:MAX_BATCH], self._queue[MAX_BATCH:]
            if not queued:  # none: sent with an earlier one
                return
            batches: dict[int, list[tuple[Settle, concurrent.futures.Future[Any]]]] = {}
            for entry in queued:
                batches.setdefault(id(entry[0].consumer), []).append(entry)
            for batch in batches.values():
                items = [(op.lease.key, op.lease.token, op.payload) for op, _ in batch]
                try:
                    answers: list[Any] = drive(
                        batch[0][0].consumer._complete_many(items), self._perform
                    )
                except BaseException as exc:  # answered to each waiter, as a failed batch call
                    answers = [exc] * len(batch)
                for (_, future), answer in zip(batch, answers, strict=True):
                    future.set_result(answer)

    def close(self) -> None:
        """Wait for the completions sent: the handlers ran, their records must say so."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)


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
