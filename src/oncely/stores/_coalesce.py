"""Group the claims and completions that many tasks make at once into batch calls.

A consumer that handles many deliveries concurrently (aio-pika runs a task per delivered
message), or an ASGI server under load, makes one ``aclaim`` and one ``acomplete`` per message
or request. `CoalescingStore` (`oncely.stores._coalescing`) lets a few calls go to the store
at once, as they come; while that many are in flight, the calls that arrive wait, and go
together as one ``aclaim_many`` (``acomplete_many``) call as soon as one of those returns: group
commit. An idle store adds no latency (a call goes out at once, as a single call), and a busy
one gets batches as large as the load. Each caller still gets exactly the answer (or the
exception) its own single call would have given: the batch verbs answer every item as the single
verb would, in order.

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
`SyncCoalescer` is its sync side, for callers that block: one sender thread sends one batch call
at a time, of what was queued meanwhile. Both take their batches (`_take`: by options, at most
*max_batch* items) and answer a batch (`answers`: a lost reply resolved per item, each kind by
its rule, `ClaimRule` and `_CompletionRule`) by the same code, a flow each side drives; the
sync consumers complete with `SyncCompletions`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from oncely._cancel import shielded
from oncely._core.flow import Flow, adrive, drive
from oncely._core.machine import landed
from oncely._core.records import InProgress, LeaseLost
from oncely._log import fields, get_logger
from oncely.errors import StoreError, StoreUnavailableError

__all__ = [
    "ClaimRule",
    "Coalescer",
    "MAX_BATCH",
    "SyncCoalescer",
    "SyncCompletions",
    "unknown_claim",
]

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


@dataclass(frozen=True, slots=True)
class _Many:
    """The batch verb, on these arguments."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _Get:
    """The record of *key* (``aget`` or ``get``)."""

    key: str


def _group(options: dict[str, Any]) -> tuple[Any, ...]:
    """The group of a call with *options* (its batch goes with those of the same group): its
    options sorted by name; none, one or two (a claim's) without a sort (the same group)."""
    items = tuple(options.items())
    if len(items) < 2:
        return items
    if len(items) == 2:
        first, second = items
        return items if first[0] < second[0] else (second, first)
    return tuple(sorted(items))


def _take(
    waiting: dict[tuple[Any, ...], list[tuple[Any, Any]]], max_batch: int
) -> tuple[tuple[Any, ...], list[tuple[Any, Any]]] | None:
    """The next batch of what *waiting* holds (by the calls' options, oldest first): at most
    *max_batch* items of one group, without those whose caller has gone (its future done)."""
    while waiting:
        group = next(iter(waiting))
        batch = [(item, future) for item, future in waiting[group] if not future.done()]
        batch, rest = batch[:max_batch], batch[max_batch:]
        if rest:
            waiting[group] = rest
        else:
            del waiting[group]
        if batch:
            return group, batch
    return None


class _Batching:
    """What both sides of the grouping (`Coalescer`, `SyncCoalescer`) share: batches taken by
    `_take`, and a batch's answers (`answers`): a call whose outcome is unknown is resolved per
    item, the same way; the sides differ only in how they wait and perform what it yields."""

    def __init__(self, many: Callable[..., Any] | None, get: Callable[[str], Any] | None) -> None:
        self._many: Any = many
        self._get = get

    def _many_call(self, items: list[tuple[Any, ...]], options: dict[str, Any]) -> Any:
        """The operation that sends *items* with the batch verb (a subclass may yield its
        driver's own)."""
        return _Many((items,), options)

    def answers(self, items: list[tuple[Any, ...]], options: dict[str, Any]) -> Flow[list[Any]]:
        """The answers of one batch call of *items*, one per item (an item's `StoreError`
        among them); raises what the whole call raised, but a lost reply (see `_resolve`)."""
        try:
            answers: list[Any] = yield self._many_call(items, options)
        except StoreUnavailableError as exc:  # the outcome of every item is unknown
            answers = [exc] * len(items)
        if any(isinstance(answer, StoreUnavailableError) for answer in answers):
            answers = yield from self._resolve(items, answers, options)
        return answers

    def _resolve(
        self, items: list[tuple[Any, ...]], answers: list[Any], options: dict[str, Any]
    ) -> Flow[list[Any]]:
        """Answer, each on its own, the items of a batch whose outcome is unknown (the call
        timed out, or its connection broke): they are sent again, as one batch call, and every
        answer that tells what happened replaces the error. An item whose first call may have
        been applied keeps its error when the answer cannot tell (see `_told`)."""
        unknown = [
            i for i, answer in enumerate(answers) if isinstance(answer, StoreUnavailableError)
        ]
        try:
            again = yield self._many_call([items[i] for i in unknown], options)
        except StoreError:
            return answers  # still unreachable: the errors stand
        answers = list(answers)
        for i, answer in zip(unknown, again, strict=True):
            told = yield from self._told(items[i], answer)
            if told is not _UNKNOWN:
                answers[i] = told
        return answers

    def _told(self, item: tuple[Any, ...], answer: Any) -> Flow[Any]:
        """What a re-sent item's *answer* says about the item, or `_UNKNOWN`."""
        return _UNKNOWN if isinstance(answer, StoreError) else answer
        yield  # a flow: a rule may read the record (`_CompletionRule`)


class ClaimRule(_Batching):
    """Claims, each item ``(key, fingerprint, op)``: *op* is the claim's call id, sent with it
    (both times) when the store's batch verb takes ``ops`` (*takes_ops*).

    A batch consumer's own claim of a fetched batch (`oncely.consumers._batch.claim_many`)
    answers by this rule too: the flow `answers`, its batch call yielded as its driver's."""

    takes_ops = False

    def _many_call(self, items: list[tuple[Any, ...]], options: dict[str, Any]) -> Any:
        requests = [item[:2] for item in items]
        if self.takes_ops:
            return _Many((requests,), {**options, "ops": [item[2] for item in items]})
        return _Many((requests,), options)

    def _told(self, item: tuple[Any, ...], answer: Any) -> Flow[Any]:
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
        yield  # a flow, as every rule


class _CompletionRule(_Batching):
    """Completions, each item ``(key, token, result)``."""

    def _told(self, item: tuple[Any, ...], answer: Any) -> Flow[Any]:
        # A completion re-sent after its first call was applied answers LeaseLost: the record
        # then shows this token completed with this result, and the completion succeeded.
        if isinstance(answer, LeaseLost):
            key, token, result = item
            try:
                record = yield _Get(key)
            except StoreError:
                return _UNKNOWN
            if landed(record, token, "complete", result):
                return None
        return _UNKNOWN if isinstance(answer, StoreError) else answer


def _settle(batch: list[tuple[Any, Any]], answers: list[Any]) -> None:
    """Answer each caller of *batch* its answer (its own `StoreError` raised)."""
    for (_, future), answer in zip(batch, answers, strict=True):
        if future.done():  # cancelled with its loop
            continue
        if isinstance(answer, StoreError):
            future.set_exception(answer)
        else:
            future.set_result(answer)


def _tell_callers(batch: _Waiting, callers: dict[asyncio.Future[Any], asyncio.Future[Any]]) -> None:
    """Answer the callers still waiting for the items of *batch* as their answers say (each
    answer done by now, see `Coalescer._send`)."""
    for _, answer in batch:
        caller = callers.pop(answer, None)
        if caller is None or caller.done():
            continue
        if not answer.done() or answer.cancelled():
            caller.cancel()
            continue
        error = answer.exception()
        if error is not None:
            caller.set_exception(error)
        else:
            caller.set_result(answer.result())


SPARE_WINDOW = 0.02
"""Seconds over which the event loop's thread's CPU time is measured, to tell whether it has
CPU to spare (see `Coalescer`'s *burst*)."""

SPARE_BUSY = 0.8
"""The share of `SPARE_WINDOW` the loop's thread may spend on the CPU and still have some to
spare."""


class _LoopState:
    __slots__ = ("callers", "cpu", "in_flight", "sampled", "spare", "starting", "waiting")

    def __init__(self) -> None:
        self.in_flight = 0
        self.starting = False  # a call's task is created, its batch not taken yet
        self.waiting: dict[tuple[Any, ...], _Waiting] = {}  # by the call's options
        # A waiting item's answer -> the future its caller awaits, answered with it: what
        # `asyncio.shield` would do, without its callbacks and the loop turn they take.
        self.callers: dict[asyncio.Future[Any], asyncio.Future[Any]] = {}
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


class Coalescer(_Batching):
    """At most *max_in_flight* calls at once per event loop; the rest wait and go in batches.

    With a *burst* over *max_in_flight*, up to *burst* calls go at once, alone, while the event
    loop's thread has CPU to spare (it spent less than `SPARE_BUSY` of the last `SPARE_WINDOW`
    on the CPU): a batch saves the CPU of its round trips, which only a loop short of CPU needs,
    and costs its callers the wait for a call in flight, which a loop with CPU to spare need
    not pay.

    *get* (an item's record, async) is for a rule that reads it (completions).
    """

    def __init__(
        self,
        single: Callable[..., Awaitable[Any]],
        many: Callable[..., Awaitable[list[Any]]],
        max_in_flight: int,
        max_batch: int,
        singles: bool = True,
        get: Callable[[str], Awaitable[Any]] | None = None,
        burst: int | None = None,
    ) -> None:
        super().__init__(many, get)
        self._singles = singles
        self._burst = max(burst or 0, max_in_flight)
        self._single = single
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
            state.waiting.setdefault(_group(options), []).append((item, answer))
            caller = state.callers[answer] = loop.create_future()
            self._send_waiting(loop, state)
            try:
                return await caller
            except asyncio.CancelledError:
                state.callers.pop(answer, None)
                if not answer.cancelled():  # the caller was, not the call
                    settling = self._abandoned(loop, state, item, answer)
                    if settling is not None:
                        with contextlib.suppress(asyncio.CancelledError):
                            await shielded(settling)
                raise
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
        taken = _take(state.waiting, self._max_batch)
        if taken is None:
            state.in_flight -= 1  # every caller that waited was cancelled meanwhile
            return
        self._send_waiting(loop, state)  # more waiting, and room: another call
        await self._send(loop, state, taken[1], dict(taken[0]))

    async def _call_single(self, item: tuple[Any, ...], options: dict[str, Any]) -> Any:
        return await self._single(*item, **options)

    async def _perform(self, op: _Many | _Get) -> Any:
        if isinstance(op, _Many):
            return await self._many(*op.args, **op.kwargs)
        assert self._get is not None  # a rule that reads records has it
        return await self._get(op.key)

    async def _send(
        self,
        loop: asyncio.AbstractEventLoop,
        state: _LoopState,
        batch: _Waiting,
        options: dict[str, Any],
    ) -> None:
        items = [item for item, _ in batch]
        try:
            answers = await adrive(self.answers(items, options), self._perform)
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
            _settle(batch, answers)
        finally:
            _tell_callers(batch, state.callers)
            state.in_flight -= 1
            self._send_waiting(loop, state)


class SyncCoalescer(_Batching):
    """The sync side of `Coalescer`: callers in any thread `submit` their items, and one sender
    thread of its own sends them, one batch call at a time: the items submitted while one is in
    flight go together in the next, by the same rules (`_take`, `answers`), every item with
    the batch verb. The thread starts with the first item and ends at `close`.

    *get* (an item's record) is for a rule that reads it (completions).
    """

    def __init__(
        self,
        many: Callable[..., list[Any]],
        max_batch: int = MAX_BATCH,
        get: Callable[[str], Any] | None = None,
        name: str = "oncely-batches",
    ) -> None:
        super().__init__(many, get)
        self._max_batch = max_batch
        self._name = name
        self._lock = threading.Condition(threading.Lock())
        self._waiting: dict[tuple[Any, ...], list[tuple[Any, Any]]] = {}
        self._sender: threading.Thread | None = None
        self._closing = False

    def submit(
        self, item: tuple[Any, ...], options: dict[str, Any]
    ) -> concurrent.futures.Future[Any]:
        """Queue *item* for the sender thread; the future answers its answer (or raises its
        `StoreError`, or what the whole call raised)."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            self._waiting.setdefault(_group(options), []).append((item, future))
            if self._sender is None:
                self._sender = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._sender.start()
            else:
                self._lock.notify()
        return future

    def close(self) -> None:
        """Wait until every item submitted has answered; the sender thread then ends."""
        with self._lock:
            self._closing = True
            self._lock.notify()
            sender = self._sender
        if sender is not None:
            sender.join()

    def _run(self) -> None:
        while True:
            with self._lock:
                taken = _take(self._waiting, self._max_batch)
                while taken is None and not self._closing:
                    self._lock.wait()
                    taken = _take(self._waiting, self._max_batch)
            if taken is None:
                return
            self._send(taken[1], dict(taken[0]))

    def _perform(self, op: _Many | _Get) -> Any:
        if isinstance(op, _Many):
            return self._many(*op.args, **op.kwargs)
        assert self._get is not None  # a rule that reads records has it
        return self._get(op.key)

    def _send(self, batch: list[tuple[Any, Any]], options: dict[str, Any]) -> None:
        items = [item for item, _ in batch]
        try:
            answers = drive(self.answers(items, options), self._perform)
        except BaseException as exc:  # the whole call failed: every caller sees it
            for _, future in batch:
                future.set_exception(exc)
        else:
            _settle(batch, answers)


class SyncCompletions(_CompletionRule, SyncCoalescer):
    """Completions of a sync *store* (items ``(key, token, result)``, option ``ttl``), sent
    from a thread of their own (see `SyncCoalescer`): a sync consumer's, as its handlers
    return."""

    def __init__(self, store: Any, max_batch: int = MAX_BATCH) -> None:
        super().__init__(store.complete_many, max_batch, store.get, "oncely-complete")
