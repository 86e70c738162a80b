"""The protected-operation flow shared by `Guard` and `@idempotent`, sync and async alike.

Each step (acquire, settle, replay) is written once as a sans-I/O flow that yields operations;
`run` and `arun` perform them against a sync or an async store. Heartbeats are the one place
that needs a worker of each kind: a single shared thread for sync callers, a task for async ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import heapq
import os
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

from oncely._core import codec as _codec
from oncely._core.flow import Flow, drive
from oncely._core.policy import Policy
from oncely._core.protocols import AsyncStore, SyncStore
from oncely._core.records import Acquired, InProgress, LeaseLost, Mismatch, Replay, Status
from oncely._log import get_logger
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

_SETTLED_STATUS = {
    "complete": Status.COMPLETED,
    "fail": Status.FAILED,
    "release": Status.RELEASED,
}


# -- operations a flow yields ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StoreCall:
    """Call store verb *verb* (``aclaim`` for async callers) with these arguments."""

    verb: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)


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

    def view(self) -> CurrentLease:
        """The public, read-only view of this lease."""
        return CurrentLease(self.key, self.token, self.attempt, self.recovered)


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


_CURRENT: contextvars.ContextVar[CurrentLease | None] = contextvars.ContextVar(
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
    return _CURRENT.get()


# -- flows ------------------------------------------------------------------------------------


def acquire(key: str, fingerprint: str, policy: Policy) -> Flow[Lease | Replay]:
    """Claim *key*; wait or raise on a live lease as the policy says; raise on a mismatch."""
    deadline = time.monotonic() + policy.wait_timeout.total_seconds()
    backoff = 0.01
    while True:
        answer = yield StoreCall(
            "claim", (key, fingerprint), {"lease": policy.lease, "ttl": policy.ttl}
        )
        if isinstance(answer, Acquired):
            lease = Lease(key, answer.token, policy.lease, answer.recovered, answer.attempt)
            if answer.recovered:
                logger.warning(
                    "lease recovered key=%s token=%d attempt=%d", key, answer.token, answer.attempt
                )
            if policy.heartbeat:
                yield StartHeartbeat(lease)
            return lease
        if isinstance(answer, Replay):
            logger.info("duplicate suppressed key=%s status=%s", key, answer.record.status.value)
            return answer
        if isinstance(answer, Mismatch):
            logger.info("fingerprint mismatch key=%s", key)
            raise FingerprintMismatchError(key)
        if not isinstance(answer, InProgress):  # pragma: no cover - a store broke the contract
            raise TypeError(f"claim answered {answer!r}")
        remaining = deadline - time.monotonic()
        if policy.on_conflict == "raise" or remaining <= 0:
            logger.info("duplicate in progress key=%s", key)
            raise InProgressError(key, retry_after=answer.retry_after)
        yield Sleep(min(answer.retry_after.total_seconds(), backoff, remaining))
        backoff = min(backoff * 2, 1.0)


def settle(lease: Lease, verb: str, payload: bytes | None, policy: Policy) -> Flow[None]:
    """Complete, fail or release *lease*, retrying while the store is briefly unavailable.

    Raises:
        LeaseLostError: The lease was lost before the operation could be completed or failed.
        StoreUnavailableError: The store stayed unavailable; the key recovers after the lease.
    """
    if verb == "release":
        call = StoreCall("release", (lease.key, lease.token))
    else:
        call = StoreCall(verb, (lease.key, lease.token, payload), {"ttl": policy.ttl})
    retried = False
    try:
        for delay in (*SETTLE_RETRY_DELAYS, None):
            try:
                answer = yield call
            except StoreUnavailableError:
                retried = True
                if delay is None:
                    logger.error(
                        "could not %s key=%s token=%d: the store is unavailable; the key "
                        "recovers after its lease",
                        verb,
                        lease.key,
                        lease.token,
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
        if (
            record is not None
            and record.token == lease.token
            and record.status is _SETTLED_STATUS[verb]
            and (payload is None or record.result == payload)
        ):
            return
    if isinstance(answer, LeaseLost):
        lease.lost = True
        logger.error("lease lost key=%s token=%d on %s", lease.key, lease.token, verb)
        if verb != "release":
            raise LeaseLostError(lease.key, token=lease.token)


def complete_with(lease: Lease, value: Any, codec: _codec.Codec, policy: Policy) -> Flow[None]:
    """Store *value* as the outcome; a value that cannot be encoded is stored as unavailable."""
    try:
        payload = _codec.encode_value(codec.encode(value))
    except Exception as exc:
        logger.warning(
            "result of key=%s cannot be serialised (%s); replays will raise ResultUnavailableError",
            lease.key,
            exc,
        )
        payload = _codec.encode_unavailable(f"{type(exc).__name__}: {exc}")
    yield from settle(lease, "complete", payload, policy)


def settle_error(lease: Lease, exc: BaseException, policy: Policy) -> Flow[None]:
    """Store a final error, or release the lease for any other; never mask *exc*."""
    final = isinstance(exc, policy.final_errors)
    try:
        if final:
            yield from settle(lease, "fail", _codec.encode_error(exc), policy)
        else:
            yield from settle(lease, "release", None, policy)
    except (StoreUnavailableError, LeaseLostError) as settle_exc:
        # The caller sees the operation's own exception; the lease recovers on expiry.
        logger.error("could not record the failure of key=%s: %s", lease.key, settle_exc)


def protected_call(
    key: str, fingerprint: str, policy: Policy, codec: _codec.Codec, annotation: Any
) -> Flow[Any]:
    """The whole decorated call: acquire, invoke, settle; or replay."""
    outcome = yield from acquire(key, fingerprint, policy)
    if isinstance(outcome, Replay):
        return replay(outcome, codec, annotation, policy)
    try:
        value = yield Invoke(outcome)
    except BaseException as exc:
        yield from settle_error(outcome, exc, policy)
        raise
    yield from complete_with(outcome, value, codec, policy)
    return value


def replay(outcome: Replay, codec: _codec.Codec, annotation: Any, policy: Policy) -> Any:
    """Return the stored value, or raise the stored final error, of a finished operation."""
    record = outcome.record
    try:
        stored = _codec.decode_outcome(record.result)
    except ValueError as exc:
        raise CorruptRecordError(str(exc), backend="record", key=record.key) from exc
    if stored.kind == "unavailable":
        raise ResultUnavailableError(record.key, stored.reason)
    if stored.kind == "error" or record.status is Status.FAILED:
        raise rebuild_error(record.key, stored, policy)
    try:
        return codec.decode(stored.body, annotation)
    except Exception as exc:
        raise ResultUnavailableError(
            record.key, f"the stored value cannot be decoded: {exc}"
        ) from exc


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
    reset = _CURRENT.set(lease.view())
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
                send = await getattr(store, "a" + op.verb)(*op.args, **op.kwargs)
            else:
                send = await aperform(op, store, invoke)
        except BaseException as exc:  # the flow decides: release the lease, map the error...
            error = exc


async def aperform(
    op: Any, store: AsyncStore, invoke: Callable[[], Awaitable[Any]] | None = None
) -> Any:
    """Perform one operation of a flow against an async store (what `arun` does with each)."""
    kind = type(op)
    if kind is StoreCall:
        return await getattr(store, "a" + op.verb)(*op.args, **op.kwargs)
    if kind is Invoke and invoke is not None:
        return await ainvoke_under(op.lease, invoke)
    if kind is StartHeartbeat:
        _start_async_heartbeat(store, op.state)
        return None
    if kind is StopHeartbeat:
        beat, op.state.heartbeat = op.state.heartbeat, None
        if isinstance(beat, asyncio.Future):  # the heartbeat task
            beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beat
        elif beat is not None:  # the timer (any loop's TimerHandle) that would start it
            beat.cancel()
        return None
    if kind is Sleep:
        await asyncio.sleep(op.seconds)
        return None
    raise TypeError(f"cannot perform {op!r}")


async def ainvoke_under(lease: Lease, call: Callable[..., Awaitable[T]], *args: Any) -> T:
    """Await ``call(*args)`` with *lease* as `current_lease`."""
    reset = _CURRENT.set(lease.view())
    try:
        return await call(*args)
    finally:
        _CURRENT.reset(reset)


def _start_async_heartbeat(store: AsyncStore, state: Lease) -> None:
    # A timer first, a task only once the operation has outlived a third of its lease: short
    # operations (most requests and messages) never create and cancel a task.
    loop = asyncio.get_running_loop()

    def launch() -> None:
        state.heartbeat = loop.create_task(_async_heartbeat(store, state))

    state.heartbeat = loop.call_later(_interval(state), launch)


# -- heartbeats -------------------------------------------------------------------------------


def _interval(lease: Lease) -> float:
    return max(lease.lease.total_seconds() / 3, 0.001)


def _beat_answered(lease: Lease, answer: LeaseLost | None) -> bool:
    """Record an extend's answer; return whether the heartbeat should go on."""
    if isinstance(answer, LeaseLost):
        lease.lost = True
        logger.error("lease lost key=%s token=%d during heartbeat", lease.key, lease.token)
        return False
    return True


async def _async_heartbeat(store: AsyncStore, lease: Lease) -> None:
    """Extend at once (a third of the lease has passed when this starts), then every third."""
    while True:
        try:
            answer = await store.aextend(lease.key, lease.token, lease=lease.lease)
        except Exception as exc:  # the next beat may succeed; the lease is not lost yet
            logger.warning("heartbeat failed key=%s: %s", lease.key, exc)
        else:
            if not _beat_answered(lease, answer):
                return
        await asyncio.sleep(_interval(lease))


class _HeartbeatScheduler:
    """One daemon thread extends the leases of every sync operation in this process."""

    def __init__(self) -> None:
        self._queue: list[tuple[float, int, Lease, SyncStore]] = []
        self._active: dict[int, Lease] = {}
        self._condition = threading.Condition()
        self._thread: threading.Thread | None = None
        self._busy: Lease | None = None  # the lease being extended right now
        self._sequence = 0

    def _schedule(self, store: SyncStore, lease: Lease) -> None:
        self._sequence += 1
        due = time.monotonic() + _interval(lease)
        heapq.heappush(self._queue, (due, self._sequence, lease, store))

    def _is_active(self, lease: Lease) -> bool:
        return self._active.get(id(lease)) is lease

    def start(self, store: SyncStore, lease: Lease) -> int:
        with self._condition:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._loop, name="oncely-heartbeat", daemon=True
                )
                self._thread.start()
            self._active[id(lease)] = lease
            self._schedule(store, lease)
            self._condition.notify()
        return id(lease)

    def stop(self, lease: Lease) -> None:
        with self._condition:
            if self._is_active(lease):
                del self._active[id(lease)]
            lease.heartbeat = None
            while self._busy is lease:  # let an extend in flight finish first
                self._condition.wait()

    def _loop(self) -> None:
        while True:
            with self._condition:
                while True:
                    while self._queue and not self._is_active(self._queue[0][2]):
                        heapq.heappop(self._queue)
                    if self._queue and self._queue[0][0] <= time.monotonic():
                        _, _, lease, store = heapq.heappop(self._queue)
                        self._busy = lease
                        break
                    timeout = self._queue[0][0] - time.monotonic() if self._queue else None
                    self._condition.wait(timeout)
            go_on = True
            try:
                go_on = _beat_answered(
                    lease, store.extend(lease.key, lease.token, lease=lease.lease)
                )
            except Exception as exc:
                logger.warning("heartbeat failed key=%s: %s", lease.key, exc)
            with self._condition:
                self._busy = None
                if go_on and self._is_active(lease):
                    self._schedule(store, lease)
                elif self._is_active(lease):
                    del self._active[id(lease)]
                self._condition.notify_all()


_SCHEDULER = _HeartbeatScheduler()


def _reset_scheduler_after_fork() -> None:
    # A forked child has no heartbeat thread and must not inherit the parent's leases or locks.
    global _SCHEDULER
    _SCHEDULER = _HeartbeatScheduler()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_scheduler_after_fork)
