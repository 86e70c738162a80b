"""Claims and completions sent together as batch calls (group commit)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

from oncely import _execution
from oncely._cancel import give_back, shielded
from oncely._core import codec as _codec
from oncely._core.codec import Codec
from oncely._core.flow import Flow, adrive, drive
from oncely._core.records import LeaseLost
from oncely._log import fields, get_logger
from oncely.consumers._sharing import Slot

logger = get_logger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, slots=True, eq=False)
class _Complete:
    """Send the completion *item* now, without waiting for its answer: answers a handle.

    *many* is the flow that completes a list of items (`IdempotentConsumer._complete_many`);
    *decided*, the key's `Slot`, is decided once the completion has landed.
    """

    item: tuple[str, int, bytes]
    many: Callable[[list[tuple[str, int, bytes]]], Flow[list[Any]]]
    decided: Slot | None = None


@dataclass(frozen=True, slots=True, eq=False)
class _Claim:
    """Claim *item*, ``(key, fingerprint)``, with the claims made meanwhile: answers its
    claim answer (or the `StoreError` for it). *many* claims a list (`_claim_many`)."""

    item: tuple[str, str]
    many: Callable[[list[tuple[str, str]]], Flow[list[Any]]]


@dataclass(frozen=True, slots=True, eq=False)
class _Completed:
    """Wait for the completions of these `_Complete` handles; answers theirs, in order."""

    handles: Sequence[Any]


class _Settling:
    """An async store whose completions go on when their caller is cancelled (a consumer
    shutting down): the handler has returned, and a completion cut short would leave the
    record in progress, for the message to run again after the lease."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    async def acomplete(
        self, key: str, token: int, result: bytes, *, ttl: timedelta
    ) -> LeaseLost | None:
        answer: LeaseLost | None = await _finishing(
            self.store.acomplete(key, token, result, ttl=ttl)
        )
        return answer

    async def acomplete_many(
        self, items: Sequence[tuple[str, int, bytes]], *, ttl: timedelta
    ) -> list[Any]:
        answers: list[Any] = await _finishing(self.store.acomplete_many(items, ttl=ttl))
        return answers


async def _finishing(call: Awaitable[T]) -> T:
    """Await *call*, which goes on to its end if the caller is cancelled meanwhile."""
    task = asyncio.ensure_future(call)
    _SENDING.add(task)  # a reference, so the task is not collected mid-flight
    task.add_done_callback(_SENDING.discard)
    return await asyncio.shield(task)


def _encoded(lease: _execution.Lease, value: Any, codec: Codec) -> bytes:
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


class _Completions:
    """The completions of one `run_with`, sent from a thread of their own while the next
    handlers run: one goes at once; those queued while it is in flight go together, as one
    batch call (group commit)."""

    def __init__(self, perform: Callable[[Any], Any]) -> None:
        self._perform = perform
        self._lock = threading.Lock()
        self._queue: list[tuple[_Complete, concurrent.futures.Future[Any]]] = []
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def submit(self, op: _Complete) -> concurrent.futures.Future[Any]:
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
        with self._lock:
            queued, self._queue = self._queue, []
        for batch in _by_flow(queued):  # none: sent with an earlier one
            try:
                flow = batch[0][0].many([op.item for op, _ in batch])
                answers: list[Any] = drive(flow, self._perform)
            except BaseException as exc:  # answered to each waiter, as a failed batch call
                answers = [exc] * len(batch)
            for (_, future), answer in zip(batch, answers, strict=True):
                future.set_result(answer)

    def close(self) -> None:
        """Wait for the completions sent: the handlers ran, their records must say so."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)


class _AsyncCompletions:
    """Async `_Completions` (or claims, `_Claim`): a task sends them, at most `_MAX_BATCH` in
    one call; it is never cancelled with its caller, since the handlers have run. With
    *skip_cancelled* (claims), an item whose caller was cancelled before it was sent is not
    sent: it would take a lease nobody uses."""

    def __init__(
        self, perform: Callable[[Any], Awaitable[Any]], *, skip_cancelled: bool = False
    ) -> None:
        self._perform = perform
        self._skip_cancelled = skip_cancelled
        self._queue: list[tuple[Any, asyncio.Future[Any]]] = []  # _Complete or _Claim
        self._task: asyncio.Task[None] | None = None

    def submit(self, op: _Complete | _Claim) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._queue.append((op, future))
        if self._task is None:
            self._task = loop.create_task(self._send())
            _SENDING.add(self._task)  # a reference, so the task is not collected mid-flight
            self._task.add_done_callback(_SENDING.discard)
        return future

    async def _send(self) -> None:
        try:
            while self._queue:
                queued = self._queue[:_MAX_BATCH]
                del self._queue[:_MAX_BATCH]
                if self._skip_cancelled:
                    queued = [entry for entry in queued if not entry[1].done()]
                for batch in _by_flow(queued):
                    try:
                        flow = batch[0][0].many([op.item for op, _ in batch])
                        answers: list[Any] = await adrive(flow, self._perform)
                    except Exception as exc:
                        answers = [exc] * len(batch)
                    except BaseException:
                        for _, future in queued:
                            future.cancel()
                        raise
                    for (_, future), answer in zip(batch, answers, strict=True):
                        if not future.done():
                            future.set_result(answer)
        finally:
            self._task = None
            for _, future in self._queue:  # only if cancelled (the loop is closing)
                future.cancel()

    def queued(self, handle: asyncio.Future[Any]) -> bool:
        """Whether the item of *handle* is still waiting to be sent."""
        return any(future is handle for _, future in self._queue)

    def idle(self) -> asyncio.Future[Any]:
        """A future done once every item submitted so far has been sent and answered."""
        if self._task is None:
            done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done
        return self._task


_SENDING: set[asyncio.Future[Any]] = set()


def _direct(store: Any) -> Callable[[Any], Awaitable[Any]]:
    """How the task of an `_AsyncCompletions` performs its flows' operations: store calls
    straight, not shielded (no task each), since that task is never cancelled with a caller,
    only with its loop."""

    def perform(op: Any) -> Awaitable[Any]:
        if type(op) is _execution.StoreCall:
            call: Awaitable[Any] = getattr(store, "a" + op.verb)(*op.args, **op.kwargs)
            return call
        return _execution.aperform(op, store)

    return perform


_MAX_BATCH = 256


class _AsyncGroups:
    """The claim and the completion groups of `IdempotentConsumer.aprocess` on one event loop:
    each sends one call at a time, and the items submitted meanwhile go together in the next
    (group commit: as many round trips as the store can answer, however many deliveries)."""

    def __init__(self, store: Any) -> None:
        self.loop = asyncio.get_running_loop()
        self.store = store
        self.claims = _AsyncCompletions(self.perform, skip_cancelled=True)
        self.completions = _AsyncCompletions(self.perform)
        self.running: dict[str, asyncio.Future[None]] = {}
        """The keys of the deliveries being processed, each with a future done once it is."""

    def perform(self, op: Any) -> Awaitable[Any]:
        """Perform *op* (a store call, a heartbeat's start or stop) against the store."""
        return _execution.aperform(op, self.store)

    async def claim(self, op: _Claim) -> Any:
        """Send *op* with the claims made meanwhile; answer its claim answer. A caller
        cancelled before it was sent sends nothing; one cancelled while it is in flight waits
        for its answer and releases a lease it took, then is cancelled."""
        handle = self.claims.submit(op)
        try:
            return await asyncio.shield(handle)
        except asyncio.CancelledError:
            if self.claims.queued(handle):
                handle.cancel()  # never sent now: it would take a lease nobody uses
            elif not handle.cancelled():
                await shielded(give_back(handle, self.store, op.item[0]))
            raise

    async def complete(self, op: _Complete) -> Any:
        """Send *op* with the completions made meanwhile; answer its outcome. A caller
        cancelled meanwhile waits for it to land, then is cancelled (see `_landed`)."""
        handle = self.completions.submit(op)
        try:
            return await handle
        except asyncio.CancelledError:
            if handle.cancelled():  # by this caller, not by a closing loop: it is still sent
                await _landed([self.completions.idle()])
            raise


async def _landed(handles: Sequence[asyncio.Future[Any]]) -> list[Any]:
    """The answers of these completions (`_Complete` handles). A caller cancelled meanwhile
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


_F = TypeVar("_F")


def _by_flow(queued: list[tuple[_Complete, _F]]) -> list[list[tuple[_Complete, _F]]]:
    """*queued* in batches of one flow each (one consumer's completions, with its ttl; or its
    claims, `_Claim`)."""
    batches: dict[Any, list[tuple[_Complete, _F]]] = {}
    for entry in queued:
        batches.setdefault(entry[0].many, []).append(entry)
    return list(batches.values())
