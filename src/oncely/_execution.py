"""The protected-operation flow shared by `Guard` and `@idempotent`, sync and async alike.

Each step (acquire, settle, replay) is written once as a sans-I/O flow that yields operations;
`run` and `arun` perform them against a sync or an async store. Heartbeats are the one place
that needs a worker of each kind: a shared timer thread and a small pool of extending threads for
sync callers, a task for async ones.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import heapq
import logging
import math
import os
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

from oncely import _events, _observed
from oncely._cancel import given_back_if_cancelled, shielded
from oncely._core import codec as _codec
from oncely._core.flow import Flow, drive
from oncely._core.machine import landed
from oncely._core.policy import Policy
from oncely._core.protocols import AsyncStore, SyncStore
from oncely._core.records import (
    Acquired,
    ClaimResult,
    InProgress,
    LeaseLost,
    Mismatch,
    Replay,
    Status,
)
from oncely._log import fields, get_logger
from oncely.errors import (
    CorruptRecordError,
    FingerprintMismatchError,
    InProgressError,
    LeaseLostError,
    ResultUnavailableError,
    StoreUnavailableError,
)

logger = get_logger("oncely")

T = TypeVar("T")

SETTLE_RETRY_DELAYS = (0.05, 0.2, 0.5, 1.0)
"""Pauses between attempts to complete, fail or release when the store is unavailable."""

# -- operations a flow yields ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StoreCall:
    """Call store verb *verb* (``aclaim`` for async callers) with these arguments.

    With *shield*, an async caller cancelled while the call is in flight lets it finish first
    (then the flow gets the cancellation): a result that must be recorded is not dropped.
    """

    verb: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    shield: bool = False


@dataclass(frozen=True, slots=True)
class Invoke:
    """Run the protected function under *lease* and send back what it returns."""

    lease: Lease


@dataclass(frozen=True, slots=True)
class Sleep:
    """Pause for *seconds*."""

    seconds: float


@dataclass(frozen=True, slots=True)
class StartHeartbeat:
    """Start extending the lease of *state* until `StopHeartbeat`."""

    state: Lease


@dataclass(frozen=True, slots=True)
class StopHeartbeat:
    """Stop the heartbeat of *state*, waiting for an extend in flight."""

    state: Lease


@dataclass(slots=True, eq=False)
class Lease:
    """What one acquired lease knows about itself while the operation runs."""

    key: str
    token: int
    lease: timedelta
    recovered: bool = False
    attempt: int = 1
    lost: bool = False
    heartbeat: Any = None
    settling: bool = False
    """Set once a settle call may have been sent: from then on only the settle's answer counts
    (an extend that lands after a complete answers `LeaseLost`, and means nothing)."""

    viewed: CurrentLease | None = None
    unstorable: Exception | None = None
    """Why the codec could not store the operation's value (see `outcome_of`)."""
    ttl: timedelta | None = None
    """How long the outcome is kept, for a settle made elsewhere (`committed`)."""
    committed: bool = False
    """Completed in the operation's own database transaction, now committed
    (`oncely.Inbox.transactional`): there is nothing left to settle."""

    def view(self) -> CurrentLease:
        """The public, read-only view of this lease (made once, when first asked for)."""
        if self.viewed is None:
            self.viewed = CurrentLease(self.key, self.token, self.attempt, self.recovered)
        return self.viewed


@dataclass(frozen=True, slots=True)
class CurrentLease:
    """The lease held by the protected function that is running now.

    Attributes:
        key: The scoped key.
        token: The fencing token: pass it to downstream writes so they can reject stale workers.
        attempt: How many times this operation has been started, this run included.
        recovered: True when the lease was taken over from a worker whose lease expired.

    .. versionadded:: 0.1.0
    """

    key: str
    token: int
    attempt: int
    recovered: bool


_CURRENT: contextvars.ContextVar[Lease | None] = contextvars.ContextVar(
    "oncely_current_lease", default=None
)


def current_lease() -> CurrentLease | None:
    """Return the lease of the `idempotent` function running in this context, or ``None``.

    .. code-block:: python

        @oncely.idempotent(store=store, key="payment_id")
        def charge(payment_id: str) -> None:
            lease = oncely.current_lease()
            bank.charge(payment_id, fencing_token=lease.token)

    .. versionadded:: 0.1.0
    """
    lease = _CURRENT.get()
    return None if lease is None else lease.view()


# -- flows ------------------------------------------------------------------------------------


def acquire(
    key: str, fingerprint: str, policy: Policy, first: ClaimResult | None = None
) -> Flow[Lease | Replay]:
    """Claim *key*; wait or raise on a live lease as the policy says; raise on a mismatch.

    *first* is the answer to a first claim already sent (see `call`): the flow goes on from it.
    """
    deadline = time.monotonic() + policy.wait_timeout.total_seconds()
    backoff = 0.01
    answer = first
    while True:
        if answer is None:
            answer = yield StoreCall(
                "claim", (key, fingerprint), {"lease": policy.lease, "ttl": policy.ttl}
            )
        if isinstance(answer, Acquired):
            lease = acquired(key, answer, policy)
            if policy.heartbeat:
                yield StartHeartbeat(lease)
            return lease
        if isinstance(answer, Replay):
            suppressed(key, answer)
            return answer
        if isinstance(answer, Mismatch):
            if _events.on:
                _observed.claimed(key, "mismatch")
            logger.info(
                "fingerprint mismatch key=%s", key, extra=fields(key=key, outcome="mismatch")
            )
            raise FingerprintMismatchError(key)
        if not isinstance(answer, InProgress):  # pragma: no cover - a store broke the contract
            raise TypeError(f"claim answered {answer!r}")
        remaining = deadline - time.monotonic()
        if policy.on_conflict == "raise" or remaining <= 0:
            if _events.on:
                _observed.claimed(key, "in_progress")
            logger.info(
                "duplicate in progress key=%s", key, extra=fields(key=key, outcome="in_progress")
            )
            raise InProgressError(key, retry_after=answer.retry_after)
        yield Sleep(min(answer.retry_after.total_seconds(), backoff, remaining))
        backoff = min(backoff * 2, 1.0)
        answer = None


def acquired(key: str, answer: Acquired, policy: Policy) -> Lease:
    """The lease of a claim that answered *answer* (logged if it was recovered)."""
    if _events.on:
        _observed.claimed(key, answer)
    if answer.recovered:
        logger.warning(
            "lease recovered key=%s token=%d attempt=%d",
            key,
            answer.token,
            answer.attempt,
            extra=fields(key=key, token=answer.token, attempt=answer.attempt, outcome="recovered"),
        )
    return Lease(key, answer.token, policy.lease, answer.recovered, answer.attempt, ttl=policy.ttl)


def suppressed(key: str, answer: Replay) -> None:
    """Log a duplicate answered from its finished record."""
    if _events.on:
        _observed.claimed(key, answer)
    if logger.isEnabledFor(logging.INFO):
        logger.info(
            "duplicate suppressed key=%s status=%s",
            key,
            answer.record.status.value,
            extra=fields(key=key, token=answer.record.token, outcome=answer.record.status),
        )


def settle(
    lease: Lease,
    verb: str,
    payload: bytes | None,
    policy: Policy,
    first: tuple[LeaseLost | None, BaseException | None] | None = None,
) -> Flow[None]:
    """Complete, fail or release *lease*, retrying while the store is briefly unavailable.

    *first* is the outcome (answer, or the exception it raised) of a first call already sent
    (see `call`): the flow goes on from it.

    Raises:
        LeaseLostError: The lease was lost before the operation could be completed or failed.
        StoreUnavailableError: The store stayed unavailable; the key recovers after the lease.
    """
    if lease.committed:  # completed in the operation's own transaction, already committed
        if lease.heartbeat is not None:
            yield StopHeartbeat(lease)
        return
    if verb == "release":
        call = StoreCall("release", (lease.key, lease.token))
    else:  # the operation ran: a cancelled caller still records its outcome
        call = StoreCall(verb, (lease.key, lease.token, payload), {"ttl": policy.ttl}, shield=True)
    lease.settling = True
    retried = False
    try:
        for delay in (*SETTLE_RETRY_DELAYS, None):
            try:
                if first is None:
                    answer = yield call
                else:
                    (answer, error), first = first, None
                    if error is not None:
                        raise error
            except StoreUnavailableError:
                retried = True
                if delay is None:
                    logger.error(
                        "could not %s key=%s token=%d: the store is unavailable; the key "
                        "recovers after its lease",
                        verb,
                        lease.key,
                        lease.token,
                        extra=fields(key=lease.key, token=lease.token, outcome="store_unavailable"),
                    )
                    raise
                yield Sleep(delay)
            else:
                break
    finally:
        if lease.heartbeat is not None:
            yield StopHeartbeat(lease)
    if isinstance(answer, LeaseLost) and retried:
        # An earlier attempt may have been applied with its reply lost on the way back: then
        # the record already shows this token settled, and the lease was not lost at all.
        record = yield StoreCall("get", (lease.key,))
        if landed(record, lease.token, verb, payload):
            return
    if isinstance(answer, LeaseLost):
        lease.lost = True
        if _events.on:
            _observed.lease_lost(lease.key, lease.token, verb)
        logger.error(
            "lease lost key=%s token=%d on %s",
            lease.key,
            lease.token,
            verb,
            extra=fields(key=lease.key, token=lease.token, outcome="lease_lost"),
        )
        if verb != "release":
            raise LeaseLostError(lease.key, token=lease.token)


def complete_with(lease: Lease, value: Any, codec: _codec.Codec, policy: Policy) -> Flow[None]:
    """Store *value* as the outcome; a value that cannot be encoded is stored as unavailable."""
    yield from settle(lease, "complete", outcome_of(lease, value, codec), policy)


def complete_or_raise(lease: Lease, value: Any, codec: _codec.Codec, policy: Policy) -> Flow[None]:
    """`complete_with`, then `raise_if_unstorable`: for callers that are handed the value back."""
    yield from complete_with(lease, value, codec, policy)
    raise_if_unstorable(lease)


def outcome_of(lease: Lease, value: Any, codec: _codec.Codec) -> bytes:
    """*value* framed as the stored outcome, or the unavailable marker if it cannot be encoded
    (then `Lease.unstorable` says why, for `raise_if_unstorable`)."""
    try:
        return _codec.encode_value(codec.encode(value))
    except Exception as exc:
        lease.unstorable = exc
        logger.warning(
            "result of key=%s cannot be serialised (%s); it is recorded as unavailable",
            lease.key,
            exc,
            extra=fields(key=lease.key, token=lease.token, outcome="unserialisable"),
        )
        return _codec.encode_unavailable(f"{type(exc).__name__}: {exc}")


def raise_if_unstorable(lease: Lease) -> None:
    """Tell the first caller, once the record is completed, that its value could not be stored:
    the same `ResultUnavailableError` every replay raises, so the mistake shows on the first
    call rather than on a retry in production."""
    exc = lease.unstorable
    if exc is not None:
        raise ResultUnavailableError(
            lease.key,
            f"the codec cannot store the returned value ({type(exc).__name__}: {exc}); the "
            "operation took effect once and will not run again",
        ) from exc


def settle_error(lease: Lease, exc: BaseException, policy: Policy) -> Flow[None]:
    """Store a final error, or release the lease for any other; never mask *exc*.

    Whatever settling raises (an `Exception`: a cancellation still propagates) is logged and
    chained to *exc*, which the caller sees; the lease recovers on expiry.
    """
    final = isinstance(exc, policy.final_errors)
    try:
        if final:
            yield from settle(lease, "fail", _codec.encode_error(exc), policy)
        else:
            yield from settle(lease, "release", None, policy)
    except Exception as settle_exc:
        logger.error(
            "could not record the failure of key=%s: %s",
            lease.key,
            settle_exc,
            extra=fields(key=lease.key, token=lease.token, outcome="not_recorded"),
        )
        _chain(exc, settle_exc)


def _chain(exc: BaseException, settle_exc: BaseException) -> None:
    """Attach *settle_exc* to *exc* (as its context when it has none, and as a note)."""
    if settle_exc is exc:
        return
    if settle_exc.__context__ is exc:  # raised while *exc* was handled: no cycle
        settle_exc.__context__ = None
    if exc.__context__ is None:
        exc.__context__ = settle_exc
    if sys.version_info >= (3, 11):
        exc.add_note(f"oncely could not record this failure: {settle_exc!r}")


def protected_call(
    key: str,
    fingerprint: str,
    policy: Policy,
    codec: _codec.Codec,
    annotation: Any,
    first: ClaimResult | None = None,
) -> Flow[Any]:
    """The whole decorated call: acquire, invoke, settle; or replay.

    `call` and `acall` run the common cases (a new key, a replay) in a straight line, and this
    flow for the others, from the first claim's answer *first*.
    """
    outcome = yield from acquire(key, fingerprint, policy, first)
    if isinstance(outcome, Replay):
        return replay(outcome, codec, annotation, policy)
    try:
        value = yield Invoke(outcome)
    except BaseException as exc:
        yield from settle_error(outcome, exc, policy)
        raise
    yield from complete_or_raise(outcome, value, codec, policy)
    return value


def replay(outcome: Replay, codec: _codec.Codec, annotation: Any, policy: Policy) -> Any:
    """Return the stored value, or raise the stored final error, of a finished operation."""
    record = outcome.record
    body = _codec.value_body(record.result) if record.status is Status.COMPLETED else None
    if body is not None:  # the common case, without decoding the outcome's frame
        return decoded(record.key, codec, body, annotation)
    try:
        stored = _codec.decode_outcome(record.result)
    except ValueError as exc:
        raise CorruptRecordError(str(exc), backend="record", key=record.key) from exc
    if stored.kind == "unavailable":
        raise ResultUnavailableError(record.key, stored.reason)
    if stored.kind == "error" or record.status is Status.FAILED:
        raise rebuild_error(record.key, stored, policy)
    return decoded(record.key, codec, stored.body, annotation)


def decoded(key: str, codec: _codec.Codec, body: bytes, annotation: Any) -> Any:
    """The stored value *body* of *key*, decoded."""
    try:
        return codec.decode(body, annotation)
    except Exception as exc:
        raise ResultUnavailableError(key, f"the stored value cannot be decoded: {exc}") from exc


def rebuild_error(key: str, stored: _codec.Outcome, policy: Policy) -> BaseException:
    """Rebuild a stored final error as its own declared type (or subclass), and only as such."""
    error = _codec.rebuild_error(stored, policy.final_errors)
    if error is not None:
        return error
    return ResultUnavailableError(
        key, f"it failed with {stored.error_type}, which is not one of the declared final errors"
    )


# -- drivers ----------------------------------------------------------------------------------


def run(flow: Flow[T], store: SyncStore, invoke: Callable[[], Any] | None = None) -> T:
    """Run *flow* against a sync store; *invoke* runs the protected function."""
    return drive(flow, lambda op: perform(op, store, invoke))


def perform(op: Any, store: SyncStore, invoke: Callable[[], Any] | None = None) -> Any:
    """Perform one operation of a flow against a sync store (what `run` does with each)."""
    if _events.on:
        store = _observed.timed(store)
    kind = type(op)
    if kind is StoreCall:
        return getattr(store, op.verb)(*op.args, **op.kwargs)
    if kind is Invoke and invoke is not None:
        return invoke_under(op.lease, invoke)
    if kind is StartHeartbeat:
        op.state.heartbeat = _SCHEDULER.start(store, op.state)
        return None
    if kind is StopHeartbeat:
        _SCHEDULER.stop(op.state)
        return None
    if kind is Sleep:
        time.sleep(op.seconds)
        return None
    raise TypeError(f"cannot perform {op!r}")


def invoke_under(lease: Lease, call: Callable[..., T], *args: Any) -> T:
    """Call ``call(*args)`` with *lease* as `current_lease`."""
    reset = _CURRENT.set(lease)
    try:
        return call(*args)
    finally:
        _CURRENT.reset(reset)


async def arun(
    flow: Flow[T], store: AsyncStore, invoke: Callable[[], Awaitable[Any]] | None = None
) -> T:
    """Run *flow* against an async store; *invoke* runs the protected coroutine function."""
    # `adrive`'s loop, written out: this driver runs three times per protected HTTP request,
    # so it creates no closure per flow, and store calls (most operations) no coroutine.
    if _events.on:
        store = _observed.timed(store)
    send: Any = None
    error: BaseException | None = None
    while True:
        try:
            op = flow.throw(error) if error is not None else flow.send(send)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        send, error = None, None
        try:
            if type(op) is StoreCall:
                send = await _astore_call(op, store)
            else:
                send = await aperform(op, store, invoke)
        except BaseException as exc:  # the flow decides: release the lease, map the error...
            error = exc


async def aperform(
    op: Any, store: AsyncStore, invoke: Callable[[], Awaitable[Any]] | None = None
) -> Any:
    """Perform one operation of a flow against an async store (what `arun` does with each)."""
    if _events.on:
        store = _observed.timed(store)
    kind = type(op)
    if kind is StoreCall:
        return await _astore_call(op, store)
    if kind is Invoke and invoke is not None:
        return await ainvoke_under(op.lease, invoke)
    if kind is StartHeartbeat:
        _start_async_heartbeat(store, op.state)
        return None
    if kind is StopHeartbeat:
        started = _stop_async_heartbeat(op.state)
        if started is not None:
            await asyncio.wait((started,))
        return None
    if kind is Sleep:
        await asyncio.sleep(op.seconds)
        return None
    raise TypeError(f"cannot perform {op!r}")


def _astore_call(op: StoreCall, store: AsyncStore) -> Awaitable[Any]:
    call = getattr(store, "a" + op.verb)(*op.args, **op.kwargs)
    if op.shield:
        return shielded(call)
    if op.verb == "claim":
        return given_back_if_cancelled(call, store, op.args[0])
    if op.verb == "claim_many":
        return given_back_if_cancelled(call, store, [key for key, _ in op.args[0]])
    return call  # type: ignore[no-any-return]


async def aclaim(
    store: AsyncStore, key: str, fingerprint: str, *, lease: timedelta, ttl: timedelta
) -> ClaimResult:
    """``store.aclaim(...)``, whose lease is given back if the caller is cancelled meanwhile
    (see `given_back_if_cancelled`)."""
    call = store.aclaim(key, fingerprint, lease=lease, ttl=ttl)
    if getattr(type(store), "_inline_async", None) is type(store):
        return await call  # never suspends: no claim is ever in flight
    return await given_back_if_cancelled(call, store, key)


def _stop_async_heartbeat(state: Lease) -> asyncio.Future[None] | None:
    """Stop the heartbeat of *state*; return its task, cancelled, if it had started: the caller
    awaits ``asyncio.wait((task,))`` (not the task under ``suppress(CancelledError)``, which
    would also swallow a cancellation of the caller landing meanwhile), so that no extend is
    in flight once it returns. Most calls end before their heartbeat task starts: no await."""
    beat, state.heartbeat = state.heartbeat, None
    if isinstance(beat, asyncio.Future):  # the heartbeat task
        beat.cancel()
        return beat
    if type(beat) is _AsyncStarts:  # its entry is dropped when due, or compacted away
        beat.stopped += 1
    return None


async def ainvoke_under(lease: Lease, call: Callable[..., Awaitable[T]], *args: Any) -> T:
    """Await ``call(*args)`` with *lease* as `current_lease`."""
    reset = _CURRENT.set(lease)
    try:
        return await call(*args)
    finally:
        _CURRENT.reset(reset)


def _start_async_heartbeat(store: AsyncStore, state: Lease) -> None:
    # A task only once the operation has outlived a third of its lease: short operations (most
    # requests and messages) never create and cancel a task, nor even a timer of their own.
    global _LAST_STARTS
    loop = asyncio.get_running_loop()
    last_loop, starts = _LAST_STARTS
    if last_loop() is not loop:  # another loop than the last one's (a weak reference)
        starts = _ASYNC_STARTS.get(loop) or _ASYNC_STARTS.setdefault(loop, _AsyncStarts())
        _LAST_STARTS = (weakref.ref(loop), starts)
    starts.add(loop, store, state)


class _AsyncStarts:
    """The async leases of one event loop whose heartbeat task is yet to start, on one timer.

    A lease waiting here has this object as its ``heartbeat``; stopping it is setting that to
    ``None``, and its entry is dropped when it comes due (with the entries due soon after it:
    the entries of calls that ended long ago cost one timer per slice of time, not one each).
    """

    def __init__(self) -> None:  # no reference to its loop, the key of `_ASYNC_STARTS`
        self.due: list[tuple[float, int, float, Lease, AsyncStore]] = []
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at = math.inf
        self.sequence = 0
        self.stopped = 0  # entries whose lease was stopped (about: not counted under a lock)

    def add(self, loop: asyncio.AbstractEventLoop, store: AsyncStore, lease: Lease) -> None:
        if self.stopped > _COMPACT_AT and self.stopped * 2 > len(self.due):
            self.due = [entry for entry in self.due if entry[3].heartbeat is self]
            heapq.heapify(self.due)
            self.stopped = 0
        interval = _interval(lease)
        when = loop.time() + interval
        self.sequence += 1
        heapq.heappush(self.due, (when, self.sequence, when - interval * _EARLY, lease, store))
        lease.heartbeat = self
        if when < self.timer_at:
            if self.timer is not None:
                self.timer.cancel()
            self.timer, self.timer_at = loop.call_at(when, self.fire), when

    def fire(self) -> None:
        loop = asyncio.get_running_loop()
        self.timer, self.timer_at = None, math.inf
        now = loop.time()
        while self.due and self.due[0][2] <= now:
            _, _, _, lease, store = heapq.heappop(self.due)
            if lease.heartbeat is self:
                lease.heartbeat = loop.create_task(_async_heartbeat(store, lease))
        if self.due:
            when = self.due[0][0]
            self.timer, self.timer_at = loop.call_at(when, self.fire), when


_ASYNC_STARTS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _AsyncStarts] = (
    weakref.WeakKeyDictionary()
)
_LAST_STARTS: tuple[Callable[[], asyncio.AbstractEventLoop | None], _AsyncStarts] = (
    lambda: None,
    _AsyncStarts(),
)
"""The loop that started a heartbeat last, and its `_AsyncStarts`: most programs have one."""


# -- the straight line ------------------------------------------------------------------------
#
# `call` and `acall` are `protected_call` run by `run` and `arun`, written out for the two
# common cases: a claim that acquires, a run, a complete that lands; and a claim that replays.
# Every decision is a helper the flows share (`acquired`, `suppressed`, `replay`, `outcome_of`);
# any other answer or error goes on in the flows, from the point reached.


def call(
    store: SyncStore,
    key: str,
    fingerprint: str,
    policy: Policy,
    codec: _codec.Codec,
    annotation: Any,
    invoke: Callable[[], T],
) -> T:
    """``run(protected_call(...), store, invoke)``, with no flow on the common paths."""
    answer = store.claim(key, fingerprint, lease=policy.lease, ttl=policy.ttl)
    if type(answer) is Replay:
        suppressed(key, answer)
        return replay(answer, codec, annotation, policy)  # type: ignore[no-any-return]
    if type(answer) is not Acquired:
        flow = protected_call(key, fingerprint, policy, codec, annotation, answer)
        return run(flow, store, invoke)  # type: ignore[no-any-return]
    lease = acquired(key, answer, policy)
    if policy.heartbeat:
        lease.heartbeat = _SCHEDULER.start(store, lease)
    try:
        value = invoke_under(lease, invoke)
    except BaseException as exc:
        run(settle_error(lease, exc, policy), store)
        raise
    if lease.committed:  # completed in its own transaction: `settle` only stops the heartbeat
        run(settle(lease, "complete", None, policy), store)
        if lease.unstorable is not None:
            raise_if_unstorable(lease)
        return value
    payload = outcome_of(lease, value, codec)
    lease.settling = True
    try:
        lost = store.complete(key, lease.token, payload, ttl=policy.ttl)
    except BaseException as exc:
        run(settle(lease, "complete", payload, policy, (None, exc)), store)
    else:
        if lost is not None:
            run(settle(lease, "complete", payload, policy, (lost, None)), store)
        elif lease.heartbeat is not None:
            _SCHEDULER.stop(lease)
    if lease.unstorable is not None:
        raise_if_unstorable(lease)
    return value


async def acall(
    store: AsyncStore,
    key: str,
    fingerprint: str,
    policy: Policy,
    codec: _codec.Codec,
    annotation: Any,
    invoke: Callable[[], Awaitable[T]],
) -> T:
    """``await arun(protected_call(...), store, invoke)``, with no flow on the common paths."""
    answer = await aclaim(store, key, fingerprint, lease=policy.lease, ttl=policy.ttl)
    if type(answer) is Replay:
        suppressed(key, answer)
        return replay(answer, codec, annotation, policy)  # type: ignore[no-any-return]
    if type(answer) is not Acquired:
        flow = protected_call(key, fingerprint, policy, codec, annotation, answer)
        return await arun(flow, store, invoke)
    lease = acquired(key, answer, policy)
    if policy.heartbeat:
        _start_async_heartbeat(store, lease)
    try:
        value = await ainvoke_under(lease, invoke)
    except BaseException as exc:
        await arun(settle_error(lease, exc, policy), store)
        raise
    if lease.committed:  # completed in its own transaction: `settle` only stops the heartbeat
        await arun(settle(lease, "complete", None, policy), store)
        if lease.unstorable is not None:
            raise_if_unstorable(lease)
        return value
    payload = outcome_of(lease, value, codec)
    lease.settling = True
    try:  # the operation ran: a cancelled caller still records its outcome
        completing = store.acomplete(key, lease.token, payload, ttl=policy.ttl)
        if getattr(type(store), "_inline_async", None) is not type(store):
            completing = shielded(completing)
        lost = await completing
    except BaseException as exc:
        await arun(settle(lease, "complete", payload, policy, (None, exc)), store)
    else:
        if lost is not None:
            await arun(settle(lease, "complete", payload, policy, (lost, None)), store)
        elif lease.heartbeat is not None:
            started = _stop_async_heartbeat(lease)
            if started is not None:
                await asyncio.wait((started,))
    if lease.unstorable is not None:
        raise_if_unstorable(lease)
    return value


# -- heartbeats -------------------------------------------------------------------------------


_COMPACT_AT = 64
"""A heap of heartbeats to come is rebuilt without the stopped ones once they are this many
and half of it: so its size follows the calls in flight, not the calls of the last interval."""

_EARLY = 1 / 16
"""A beat may be sent up to this fraction of its interval early, with a beat due before it."""

_MAX_IN_FLIGHT = 2
"""Extends of one sync lease sent at a time at most: one stuck on a slow connection, its retry."""


def _interval(lease: Lease) -> float:
    return _beat_interval(lease.lease)


@functools.lru_cache(maxsize=256)  # a program uses a handful of leases
def _beat_interval(lease: timedelta) -> float:
    return max(lease.total_seconds() / 3, 0.001)


def _beat_timeout(interval: float, expires: float, now: float) -> float:
    """How long an extend sent *now* may take: one interval, and no longer than the lease lasts."""
    left = expires - now
    return min(interval, left) if left > 0 else interval


def _beat_answered(lease: Lease, answer: LeaseLost | None) -> bool:
    """Record an extend's answer; return whether the heartbeat should go on."""
    if _events.on:
        _observed.beat_answered(lease.key, lease.token, answer, lease.settling)
    if isinstance(answer, LeaseLost):
        if not lease.settling:  # else the settle's own answer decides: this one may follow it
            lease.lost = True
            logger.error(
                "lease lost key=%s token=%d during heartbeat",
                lease.key,
                lease.token,
                extra=fields(key=lease.key, token=lease.token, outcome="lease_lost"),
            )
        return False
    return True


def _no_answer(lease: Lease, timeout: float) -> None:
    if _events.on:
        _observed.beat(lease.key, lease.token, False)
    logger.warning(
        "heartbeat failed key=%s: %s",
        lease.key,
        f"no answer within {timeout:.3f}s; the next beat tries again",
        extra=fields(key=lease.key, token=lease.token, outcome="heartbeat_failed"),
    )


async def _async_heartbeat(store: AsyncStore, lease: Lease) -> None:
    """Extend at once (a third of the lease has passed when this starts), then every third.

    An extend that has not answered within its `_beat_timeout` is a failed beat, but it is not
    cancelled: cancelling a query in flight costs its connection, and the next extend would
    first have to open one over the same slow network. The next beat sends another extend
    beside it (two at most in flight), and whichever answers moves the lease's known end.
    """
    loop = asyncio.get_running_loop()
    interval = _interval(lease)
    seconds = lease.lease.total_seconds()
    expires = loop.time() + seconds - interval
    this = asyncio.current_task()
    in_flight: list[tuple[float, asyncio.Future[LeaseLost | None]]] = []
    try:
        while lease.heartbeat is this:  # it goes on while a settle is retried; stopped after it
            sent = loop.time()
            if len(in_flight) < 2:
                extend = store.aextend(lease.key, lease.token, lease=lease.lease)
                in_flight.append((sent, asyncio.ensure_future(extend)))
            timeout = _beat_timeout(interval, expires, sent)
            done, _ = await asyncio.wait(
                [task for _, task in in_flight],
                timeout=timeout,
                return_when=asyncio.FIRST_COMPLETED,
            )
            if not done and not lease.settling:
                _no_answer(lease, timeout)
            for started, task in [pair for pair in in_flight if pair[1].done()]:
                in_flight.remove((started, task))
                try:
                    answer = task.result()
                except Exception as exc:  # the next beat may succeed; the lease is not lost yet
                    if not lease.settling:
                        if _events.on:
                            _observed.beat(lease.key, lease.token, False)
                        logger.warning(
                            "heartbeat failed key=%s: %s",
                            lease.key,
                            exc,
                            extra=fields(
                                key=lease.key, token=lease.token, outcome="heartbeat_failed"
                            ),
                        )
                else:
                    if not _beat_answered(lease, answer):
                        return
                    expires = max(expires, started + seconds)
            await asyncio.sleep(max(sent + interval - loop.time(), 0))
    finally:
        for _, task in in_flight:
            task.cancel()


@dataclass(slots=True, eq=False)
class _Beating:
    """A sync lease whose heartbeat is on, as the scheduler sees it."""

    lease: Lease
    store: SyncStore
    interval: float
    expires: float  # when the lease ends by this process's clock, as far as it knows
    in_flight: int = 0
    active: bool = True


@dataclass(slots=True, eq=False)
class _Extend:
    """One extend handed to the workers."""

    beating: _Beating
    sent: float
    timeout: float
    answered: bool = False


class _HeartbeatScheduler:
    """Extends the leases of every sync operation in this process.

    One timer thread knows when each lease is due, and hands its extend to a pool of worker
    threads, started as due extends need them (up to `max_workers`) and ended when idle, so a
    slow extend holds up no other lease. An extend that has not answered within its
    `_beat_timeout` is a failed beat: logged, and the next beat sends another whatever the first
    one does (the operation learns the truth at complete). Starting and stopping the heartbeat
    of a call shorter than a third of its lease (most calls) takes a lock and no thread.
    """

    max_workers = 32
    idle_seconds = 30.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._timer_wakeup = threading.Condition(self._lock)
        self._work_ready = threading.Condition(self._lock)
        self._timers: list[tuple[float, int, _Beating | _Extend]] = []
        self._ready: deque[_Extend] = deque()
        self._timer_running = False
        self._stopped = 0  # beats in the heap whose lease was stopped (about: no lock)
        self._workers = 0
        self._idle = 0
        self._sequence = 0

    def start(self, store: SyncStore, lease: Lease) -> _Beating:
        """Start the heartbeat of *lease* (its ``heartbeat`` is set before the first beat can
        be due, and returned)."""
        now = time.monotonic()
        interval = _interval(lease)
        beating = _Beating(lease, store, interval, now + lease.lease.total_seconds())
        earlier, lease.heartbeat = lease.heartbeat, beating
        if type(earlier) is _Beating:  # started again without a stop: one heartbeat per lease
            earlier.active = False
        with self._lock:
            if not self._timer_running:
                threading.Thread(
                    target=self._run_timers, name="oncely-heartbeat", daemon=True
                ).start()
                self._timer_running = True
            if self._stopped > _COMPACT_AT and self._stopped * 2 > len(self._timers):
                self._timers = [
                    entry
                    for entry in self._timers
                    if type(entry[2]) is not _Beating or entry[2].active
                ]
                heapq.heapify(self._timers)
                self._stopped = 0
            if self._at(now + interval, beating):
                self._timer_wakeup.notify()
        return beating

    def stop(self, lease: Lease) -> None:
        """Send no more extends for *lease*; one in flight is not waited for (see `settling`).

        No lock: a beat already handed to a worker checks ``active`` before it sends.
        """
        beating, lease.heartbeat = lease.heartbeat, None
        if type(beating) is _Beating:
            beating.active = False
            self._stopped += 1

    def idle(self) -> bool:
        """Whether no extend is queued or in flight (for tests)."""
        with self._lock:
            return not self._ready and self._idle == self._workers

    def _at(self, when: float, item: _Beating | _Extend) -> bool:
        """Schedule *item*; return whether it is the next one due."""
        self._sequence += 1
        entry = (when, self._sequence, item)
        heapq.heappush(self._timers, entry)
        return self._timers[0] is entry

    def _run_timers(self) -> None:
        try:
            self._run_timers_until_error()
        finally:
            with self._lock:  # the next start starts another
                self._timer_running = False

    def _run_timers_until_error(self) -> None:
        while True:
            with self._lock:
                while True:
                    now = time.monotonic()
                    if self._timers:
                        due, _, item = self._timers[0]
                        # Beats due soon go with this one: the beats of calls that ended long
                        # ago (most calls) cost one wake-up per slice of time, not one each.
                        if due <= now or (
                            type(item) is _Beating and due - item.interval * _EARLY <= now
                        ):
                            heapq.heappop(self._timers)
                            break
                    self._timer_wakeup.wait(self._timers[0][0] - now if self._timers else None)
                if isinstance(item, _Beating):
                    self._beat(item, due, now)
                    continue
                late = not item.answered and item.beating.active
            if late and not item.beating.lease.settling:
                _no_answer(item.beating.lease, item.timeout)

    def _beat(self, beating: _Beating, due: float, now: float) -> None:
        """Hand the extend of *beating* to a worker and schedule the next beat (lock held)."""
        if not beating.active:
            return
        if beating.in_flight < _MAX_IN_FLIGHT:
            beating.in_flight += 1
            timeout = _beat_timeout(beating.interval, beating.expires, now)
            extend = _Extend(beating, now, timeout)
            self._ready.append(extend)
            self._at(now + timeout, extend)
            if self._idle >= len(self._ready):
                self._work_ready.notify()
            elif self._workers < self.max_workers:
                self._workers += 1
                worker = threading.Thread(
                    target=self._run_extends, name="oncely-heartbeat-extend", daemon=True
                )
                worker.start()
        following = due + beating.interval
        self._at(following if following > now else now + beating.interval, beating)

    def _run_extends(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
                while not self._ready:
                    if not self._work_ready.wait(self.idle_seconds) and not self._ready:
                        self._idle -= 1
                        self._workers -= 1
                        return
                self._idle -= 1
                extend = self._ready.popleft()
            self._extend(extend)

    def _extend(self, extend: _Extend) -> None:
        beating = extend.beating
        lease = beating.lease
        answer: LeaseLost | None = None
        error: Exception | None = None
        if beating.active:
            try:
                answer = beating.store.extend(lease.key, lease.token, lease=lease.lease)
            except Exception as exc:
                error = exc
        with self._lock:
            extend.answered = True
            beating.in_flight -= 1
            if not beating.active:
                return
            if error is None and answer is None:
                beating.expires = max(beating.expires, extend.sent + lease.lease.total_seconds())
        if error is not None:  # the next beat may succeed; the lease is not lost yet
            if not lease.settling:
                if _events.on:
                    _observed.beat(lease.key, lease.token, False)
                logger.warning(
                    "heartbeat failed key=%s: %s",
                    lease.key,
                    error,
                    extra=fields(key=lease.key, token=lease.token, outcome="heartbeat_failed"),
                )
        elif not _beat_answered(lease, answer):
            beating.active = False


_SCHEDULER = _HeartbeatScheduler()


def _reset_scheduler_after_fork() -> None:
    # A forked child has no heartbeat threads and must not inherit the parent's leases or locks.
    global _SCHEDULER
    _SCHEDULER = _HeartbeatScheduler()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_scheduler_after_fork)
