"""Group the claims and completions that many tasks make at once into batch calls.

A consumer that handles many deliveries concurrently (aio-pika runs a task per delivered
message), or an ASGI server under load, makes one ``aclaim`` and one ``acomplete`` per message
or request. `CoalescingStore` lets a few calls go to the store at once, as they come; while
that many are in flight, the calls that arrive wait, and go together as one ``aclaim_many``
(``acomplete_many``) call as soon as one of those returns: group commit. An idle store adds no
latency (a call goes out at once, as a single call), and a busy one gets batches as large as
the load. Each caller still gets exactly the answer (or the exception) its own single call
would have given: the batch verbs answer every item as the single verb would, in order.

A batch call that times out or loses its connection is resolved per caller: its items are
sent again once, and every answer that tells what happened replaces the error (a completion
found applied is a success). Claims are sent again with the same call ids (every built-in
store's ``aclaim_many`` takes them as ``ops``), so a claim applied with its reply lost answers
`Acquired` with its own token. A store of one's own without them cannot tell such a claim from
another worker's lease: it answers `InProgress`, and that caller keeps the error (the lease
expires on its own).

A caller cancelled meanwhile never cuts a call short, and its cancellation goes on once what
it asked for is settled: a claim not sent yet is never sent (it would take a lease nobody
uses), one in flight is released once it answers `Acquired` (a retry right after runs at once);
a completion (the work ran) is sent all the same and lands first (a consumer shutting down does
not close its store under it). `Coalescer.drain` waits for every call in flight.

`Coalescer` is the grouping itself, for any pair of a single and a batch verb (the PostgreSQL
store groups its extends with it); the consumers group their claims and completions with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta
from typing import Any, ClassVar

from oncely._cancel import give_back, shielded
from oncely._core.machine import landed
from oncely._core.records import ClaimResult, InProgress, LeaseLost, Record
from oncely._log import fields, get_logger
from oncely.errors import StoreError, StoreUnavailableError
from oncely.stores._batch import takes_ops

__all__ = ["Coalescer", "CoalescingStore", "MAX_BATCH", "unknown_claim"]

logger = get_logger(__name__)

_Waiting = list[tuple[Any, "asyncio.Future[Any]"]]


_UNKNOWN: Any = object()

MAX_BATCH = 256
"""The most items sent in one batch call: a store answers a batch call at once, and no other
call waits long behind it."""


def unknown_claim(key: str) -> None:
    """Say that a claim of *key* whose reply was lost may have been applied: the lease, if it
    was taken, expires on its own."""
    logger.warning(
        "claim of key=%s may have been applied; it recovers after its lease",
        key,
        extra=fields(key=key, outcome="store_unavailable"),
    )


SPARE_WINDOW = 0.02
"""Seconds over which the event loop's thread's CPU time is measured, to tell whether it has
CPU to spare (see `Coalescer`'s *burst*)."""

SPARE_BUSY = 0.8
"""The share of `SPARE_WINDOW` the loop's thread may spend on the CPU and still have some to
spare."""


class _LoopState:
    __slots__ = ("cpu", "in_flight", "sampled", "spare", "starting", "waiting")

    def __init__(self) -> None:
        self.in_flight = 0
        self.starting = False  # a call's task is created, its batch not taken yet
        self.waiting: dict[tuple[Any, ...], _Waiting] = {}  # by the call's options
        self.spare = True  # the loop's thread had CPU to spare over its last window
        self.sampled = time.monotonic()
        self.cpu = time.thread_time()

    def has_spare(self) -> bool:
        """Whether the loop's thread spent less than `SPARE_BUSY` of its last window (at least
        `SPARE_WINDOW` long, up to now) on the CPU."""
        now = time.monotonic()
        if now - self.sampled >= SPARE_WINDOW:
            cpu = time.thread_time()
            self.spare = cpu - self.cpu < SPARE_BUSY * (now - self.sampled)
            self.sampled, self.cpu = now, cpu
        return self.spare


class Coalescer:
    """At most *max_in_flight* calls at once per event loop; the rest wait and go in batches.

    With a *burst* over *max_in_flight*, up to *burst* calls go at once, alone, while the event
    loop's thread has CPU to spare (it spent less than `SPARE_BUSY` of the last `SPARE_WINDOW`
    on the CPU): a batch saves the CPU of its round trips, which only a loop short of CPU needs,
    and costs its callers the wait for a call in flight, which a loop with CPU to spare need
    not pay.
    """

    def __init__(
        self,
        single: Callable[..., Awaitable[Any]],
        many: Callable[..., Awaitable[list[Any]]],
        max_in_flight: int,
        max_batch: int,
        singles: bool = True,
        burst: int | None = None,
    ) -> None:
        self._singles = singles
        self._burst = max(burst or 0, max_in_flight)
        self._single = single
        self._many = many
        self._max_in_flight = max_in_flight
        self._max_batch = max_batch
        self._loops: dict[asyncio.AbstractEventLoop, _LoopState] = {}
        self._sending: set[asyncio.Task[Any]] = set()

    def _state(self, loop: asyncio.AbstractEventLoop) -> _LoopState:
        state = self._loops.get(loop)
        if state is None:
            for other in [other for other in self._loops if other.is_closed()]:
                self._loops.pop(other, None)
            state = self._loops[loop] = _LoopState()
        return state

    async def submit(self, item: tuple[Any, ...], options: dict[str, Any]) -> Any:
        """Send *item*, alone or with the items submitted meanwhile; answer its answer.

        A caller cancelled meanwhile is cancelled at once; its item is settled in the
        background (see `_abandoned`).
        """
        loop = asyncio.get_running_loop()
        state = self._state(loop)
        answer: asyncio.Future[Any]
        if (
            self._singles
            and not state.waiting
            and (
                state.in_flight < self._max_in_flight
                or (state.in_flight < self._burst and state.has_spare())
            )
        ):
            state.in_flight += 1  # the store is not busy, or the loop has CPU: go now, alone
            answer = loop.create_task(self._alone(loop, state, item, options))
            self._track(answer)
        else:
            answer = loop.create_future()
            state.waiting.setdefault(tuple(sorted(options.items())), []).append((item, answer))
            self._send_waiting(loop, state)
        try:
            return await asyncio.shield(answer)
        except asyncio.CancelledError:
            if not answer.cancelled():  # the caller was, not the call (with its loop)
                settling = self._abandoned(loop, state, item, answer)
                if settling is not None:
                    with contextlib.suppress(asyncio.CancelledError):
                        await shielded(settling)
            raise

    async def _alone(
        self,
        loop: asyncio.AbstractEventLoop,
        state: _LoopState,
        item: tuple[Any, ...],
        options: dict[str, Any],
    ) -> Any:
        try:
            return await self._call_single(item, options)
        finally:
            state.in_flight -= 1
            self._send_waiting(loop, state)

    def _track(self, task: asyncio.Task[Any]) -> None:
        self._sending.add(task)  # a reference, so the task is not collected mid-flight
        task.add_done_callback(self._sending.discard)

    def _abandoned(
        self,
        loop: asyncio.AbstractEventLoop,
        state: _LoopState,
        item: tuple[Any, ...],
        answer: asyncio.Future[Any],
    ) -> asyncio.Future[Any] | None:
        """The caller of *item* was cancelled before *answer*: by default the item is sent all
        the same, and lands before the caller goes on being cancelled (a completion: the work
        it records was done). What is returned, the caller waits for first."""
        return answer

    async def drain(self) -> None:
        """Wait until every call this event loop sent (or queued) meanwhile has answered."""
        loop = asyncio.get_running_loop()
        while True:
            state = self._loops.get(loop)
            waiting = [f for group in (state.waiting if state else {}).values() for _, f in group]
            pending: list[asyncio.Future[Any]] = [
                t for t in self._sending if t.get_loop() is loop and not t.done()
            ]
            pending += [f for f in waiting if not f.done()]
            if not pending:
                return
            await asyncio.wait(pending)

    def _send_waiting(self, loop: asyncio.AbstractEventLoop, state: _LoopState) -> None:
        """Start a call for what waits, if the store has room: its batch is taken when the
        call's task starts, with what this turn of the loop adds and without what the
        cancelled callers withdraw meanwhile."""
        if state.waiting and state.in_flight < self._max_in_flight and not state.starting:
            state.in_flight += 1
            state.starting = True
            self._track(loop.create_task(self._send_next(loop, state)))

    async def _send_next(self, loop: asyncio.AbstractEventLoop, state: _LoopState) -> None:
        state.starting = False
        while state.waiting:
            group = next(iter(state.waiting))
            waiting = state.waiting[group]
            batch = [(item, future) for item, future in waiting if not future.done()]
            batch, rest = batch[: self._max_batch], batch[self._max_batch :]
            if rest:
                state.waiting[group] = rest
            else:
                del state.waiting[group]
            if batch:
                self._send_waiting(loop, state)  # more waiting, and room: another call
                await self._send(loop, state, batch, dict(group))
                return
        state.in_flight -= 1  # every caller that waited was cancelled meanwhile

    async def _call_single(self, item: tuple[Any, ...], options: dict[str, Any]) -> Any:
        return await self._single(*item, **options)

    async def _call_many(self, items: list[tuple[Any, ...]], options: dict[str, Any]) -> list[Any]:
        return await self._many(items, **options)

    async def _send(
        self,
        loop: asyncio.AbstractEventLoop,
        state: _LoopState,
        batch: _Waiting,
        options: dict[str, Any],
    ) -> None:
        items = [item for item, _ in batch]
        try:
            try:
                answers: list[Any] = await self._call_many(items, options)
            except StoreUnavailableError as exc:  # the outcome of every item is unknown
                answers = [exc] * len(items)
            if any(isinstance(answer, StoreUnavailableError) for answer in answers):
                answers = await self._resolve(items, answers, options)
        except BaseException as exc:  # the whole call failed: every caller sees it
            for _, future in batch:
                if not future.done():
                    if isinstance(exc, asyncio.CancelledError):
                        future.cancel()
                    else:
                        future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        else:
            for (_, future), answer in zip(batch, answers, strict=True):
                if future.done():  # cancelled with its loop
                    continue
                if isinstance(answer, StoreError):
                    future.set_exception(answer)
                else:
                    future.set_result(answer)
        finally:
            state.in_flight -= 1
            self._send_waiting(loop, state)

    async def _resolve(
        self, items: list[tuple[Any, ...]], answers: list[Any], options: dict[str, Any]
    ) -> list[Any]:
        """Answer, each on its own, the items of a batch whose outcome is unknown (the call
        timed out, or its connection broke): they are sent again, as one batch call, and every
        answer that tells what happened replaces the error. An item whose first call may have
        been applied keeps its error when the answer cannot tell (see `_told`)."""
        unknown = [
            i for i, answer in enumerate(answers) if isinstance(answer, StoreUnavailableError)
        ]
        try:
            again = await self._call_many([items[i] for i in unknown], options)
        except StoreError:
            return answers  # still unreachable: the errors stand
        answers = list(answers)
        for i, answer in zip(unknown, again, strict=True):
            told = await self._told(items[i], answer)
            if told is not _UNKNOWN:
                answers[i] = told
        return answers

    async def _told(self, item: tuple[Any, ...], answer: Any) -> Any:
        """What a re-sent item's *answer* says about the item, or `_UNKNOWN`."""
        return _UNKNOWN if isinstance(answer, StoreError) else answer


class _Claims(Coalescer):
    """Claims, each item ``(key, fingerprint, op)``: *op* is the claim's call id, sent with it
    (both times) when the store's ``aclaim_many`` takes ``ops``."""

    def __init__(
        self, store: Any, max_in_flight: int, max_batch: int, singles: bool, burst: int | None
    ) -> None:
        super().__init__(store.aclaim, store.aclaim_many, max_in_flight, max_batch, singles, burst)
        self.takes_ops = takes_ops(store.aclaim_many)
        self._store = store

    async def _call_single(self, item: tuple[Any, ...], options: dict[str, Any]) -> Any:
        return await self._single(*item[:2], **options)

    def _abandoned(
        self,
        loop: asyncio.AbstractEventLoop,
        state: _LoopState,
        item: tuple[Any, ...],
        answer: asyncio.Future[Any],
    ) -> asyncio.Future[Any] | None:
        """A claim not sent yet is not sent (it would take a lease nobody uses); one in flight
        gives its lease back once it answers `Acquired`, before the caller goes on being
        cancelled (its retry then runs at once)."""
        for group in state.waiting.values():
            if any(future is answer for _, future in group):
                answer.cancel()
                return None
        releasing = loop.create_task(give_back(answer, self._store, item[0]))
        self._track(releasing)
        return releasing

    async def _call_many(self, items: list[tuple[Any, ...]], options: dict[str, Any]) -> list[Any]:
        requests = [item[:2] for item in items]
        if self.takes_ops:
            return await self._many(requests, ops=[item[2] for item in items], **options)
        return await self._many(requests, **options)

    async def _told(self, item: tuple[Any, ...], answer: Any) -> Any:
        # Sent again with the same call id, a claim applied the first time (reply lost) answers
        # Acquired with its own token: InProgress is then another worker's lease. Without ids,
        # InProgress may be this very claim, which is not known, and the caller keeps its error
        # (the lease, if it is ours, expires on its own).
        if self.takes_ops and not isinstance(answer, StoreError):
            return answer
        if isinstance(answer, (InProgress, StoreError)):
            unknown_claim(item[0])
            return _UNKNOWN
        return answer


class _Completions(Coalescer):
    def __init__(
        self, store: Any, max_in_flight: int, max_batch: int, singles: bool, burst: int | None
    ) -> None:
        super().__init__(
            store.acomplete, store.acomplete_many, max_in_flight, max_batch, singles, burst
        )
        self._store = store

    async def _told(self, item: tuple[Any, ...], answer: Any) -> Any:
        # A completion re-sent after its first call was applied answers LeaseLost: the record
        # then shows this token completed with this result, and the completion succeeded.
        if isinstance(answer, LeaseLost):
            key, token, result = item
            try:
                record = await self._store.aget(key)
            except StoreError:
                return _UNKNOWN
            if landed(record, token, "complete", result):
                return None
        return _UNKNOWN if isinstance(answer, StoreError) else answer


class CoalescingStore:
    """An async view of a store with the batch verbs that group concurrent claims and
    completions into batch calls (group commit).

    Args:
        store: A store with the `oncely.BatchStore` verbs.
        max_in_flight: Claims (and, separately, completions) sent at once per event loop before
            later ones wait to go together.
        max_batch: The most items sent in one batch call.
        singles: Send a call that need not wait alone, with the single verb; else every call
            goes with the batch verb (a consumer's: the same script, warm, for every call).
        burst: Claims (completions) sent at once, alone, while the event loop's thread has
            CPU to spare (see `Coalescer`); at most *max_in_flight* otherwise.
    """

    _cancel_safe: ClassVar[type[CoalescingStore]]
    """A cancelled caller's claim is settled here, its finish lands (see the module's
    docstring): `oncely._cancel.guards_itself` says so to the entry points."""

    def __init__(
        self,
        store: Any,
        *,
        max_in_flight: int = 4,
        max_batch: int = MAX_BATCH,
        singles: bool = True,
        burst: int | None = None,
    ) -> None:
        self.store = store
        self._ids = itertools.count()
        self._prefix = secrets.token_hex(8)  # call ids: unique per view, cheap per claim
        self._claims = _Claims(store, max_in_flight, max_batch, singles, burst)
        self._completions = _Completions(store, max_in_flight, max_batch, singles, burst)

    async def aclaim(
        self, key: str, fingerprint: str, *, lease: timedelta, ttl: timedelta
    ) -> ClaimResult:
        """`oncely.AsyncStore.aclaim`, batched with other claims while the store is busy."""
        options = {"lease": lease, "ttl": ttl}
        op = f"{self._prefix}.{next(self._ids)}"  # its call id, the same if it is sent again
        answer: ClaimResult = await self._claims.submit((key, fingerprint, op), options)
        return answer

    async def acomplete(
        self, key: str, token: int, result: bytes, *, ttl: timedelta
    ) -> LeaseLost | None:
        """`oncely.AsyncStore.acomplete`, batched with other completions while it is busy."""
        answer: LeaseLost | None = await self._completions.submit(
            (key, token, result), {"ttl": ttl}
        )
        return answer

    async def afail(
        self, key: str, token: int, error: bytes, *, ttl: timedelta
    ) -> LeaseLost | None:
        """`oncely.AsyncStore.afail` (not batched: failures are rare)."""
        answer: LeaseLost | None = await self.store.afail(key, token, error, ttl=ttl)
        return answer

    async def arelease(self, key: str, token: int) -> LeaseLost | None:
        """`oncely.AsyncStore.arelease`."""
        answer: LeaseLost | None = await self.store.arelease(key, token)
        return answer

    async def aextend(self, key: str, token: int, *, lease: timedelta) -> LeaseLost | None:
        """`oncely.AsyncStore.aextend`."""
        answer: LeaseLost | None = await self.store.aextend(key, token, lease=lease)
        return answer

    async def aget(self, key: str) -> Record | None:
        """`oncely.AsyncStore.aget`."""
        record: Record | None = await self.store.aget(key)
        return record

    async def aclaim_many(
        self,
        requests: Sequence[tuple[str, str]],
        *,
        lease: timedelta,
        ttl: timedelta,
        ops: Sequence[str] | None = None,
    ) -> list[ClaimResult | StoreError]:
        """`oncely.BatchStore.aclaim_many`, sent as it is (with the claims' call ids *ops* when
        given and the store takes them)."""
        if ops is not None and self._claims.takes_ops:
            answers: list[ClaimResult | StoreError] = await self.store.aclaim_many(
                requests, lease=lease, ttl=ttl, ops=ops
            )
        else:
            answers = await self.store.aclaim_many(requests, lease=lease, ttl=ttl)
        return answers

    async def acomplete_many(
        self, items: Sequence[tuple[str, int, bytes]], *, ttl: timedelta
    ) -> list[LeaseLost | StoreError | None]:
        """`oncely.BatchStore.acomplete_many`, sent as it is."""
        answers: list[LeaseLost | StoreError | None] = await self.store.acomplete_many(
            items, ttl=ttl
        )
        return answers

    async def adrain(self) -> None:
        """Wait until every claim and completion sent on this event loop has answered (those
        of cancelled callers included): before the store is closed."""
        await self._claims.drain()
        await self._completions.drain()

    async def aclose(self) -> None:
        """Close the store underneath, once the calls in flight have answered."""
        await self.adrain()
        await self.store.aclose()


CoalescingStore._cancel_safe = CoalescingStore
