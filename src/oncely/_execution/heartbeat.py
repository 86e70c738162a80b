"""Heartbeats: what extends the lease of an operation while it runs.

Sync operations share one timer thread and a small pool of extending threads (`SCHEDULER`);
async ones get a task per lease, started only once the operation has outlived a third of its
lease (most never do), from one timer per event loop.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import math
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from oncely import _events, _observed
from oncely._core.protocols import AsyncStore, SyncStore
from oncely._core.records import LeaseLost
from oncely._execution.lease import Lease
from oncely._log import fields, get_logger

__all__ = [
    "SCHEDULER",
    "start_async_heartbeat",
    "start_heartbeat",
    "stop_async_heartbeat",
    "stop_heartbeat",
]

logger = get_logger("oncely")

_COMPACT_AT = 64
"""A heap of heartbeats to come is rebuilt without the stopped ones once they are this many
and half of it: so its size follows the calls in flight, not the calls of the last interval."""

_EARLY = 1 / 16
"""A beat may be sent up to this fraction of its interval early, with a beat due before it."""

_MAX_IN_FLIGHT = 2
"""Extends of one sync lease sent at a time at most: one stuck on a slow connection, its retry."""


def _interval(lease: Lease) -> float:
    return _beat_times(lease.lease)[0]


@functools.lru_cache(maxsize=256)  # a program uses a handful of leases
def _beat_times(lease: timedelta) -> tuple[float, float]:
    """The beat interval of a lease this long, and its length in seconds."""
    seconds = lease.total_seconds()
    return max(seconds / 3, 0.001), seconds


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
        self.reset()

    def reset(self) -> None:
        """Forget every lease and thread (a forked child has none of the parent's threads, and
        must not inherit its leases or locks)."""
        self._lock = threading.Lock()
        self._timer_wakeup = threading.Condition(self._lock)
        self._work_ready = threading.Condition(self._lock)
        self._timers: list[tuple[float, int, _Beating | _Extend]] = []
        self._ready: deque[_Extend] = deque()
        self._timer_running = False
        self._wakes_at = -math.inf
        """When the timer thread wakes by itself: a beat due earlier wakes it (`start`). Minus
        infinity while it is awake (it reads the heap before it sleeps again): lock held."""
        self._stopped = 0  # beats in the heap whose lease was stopped (about: no lock)
        self._workers = 0
        self._idle = 0
        self._sequence = 0

    def start(self, store: SyncStore, lease: Lease) -> _Beating:
        """Start the heartbeat of *lease* (its ``heartbeat`` is set before the first beat can
        be due, and returned)."""
        now = time.monotonic()
        interval, seconds = _beat_times(lease.lease)
        beating = _Beating(lease, store, interval, now + seconds)
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
            when = now + interval
            self._at(when, beating)
            if when < self._wakes_at:  # else the timer finds it when it wakes (most calls)
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

    def _at(self, when: float, item: _Beating | _Extend) -> None:
        """Schedule *item* (lock held)."""
        self._sequence += 1
        heapq.heappush(self._timers, (when, self._sequence, item))

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
                    if self._timers:
                        self._wakes_at = self._timers[0][0]
                        self._timer_wakeup.wait(self._wakes_at - now)
                    else:
                        self._wakes_at = math.inf
                        self._timer_wakeup.wait()
                    self._wakes_at = -math.inf
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


SCHEDULER = _HeartbeatScheduler()
"""The heartbeats of this process's sync operations."""

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=SCHEDULER.reset)


def start_heartbeat(store: SyncStore, lease: Lease) -> None:
    """Start extending *lease* (of a sync operation) until `stop_heartbeat`."""
    lease.heartbeat = SCHEDULER.start(store, lease)


def stop_heartbeat(lease: Lease) -> None:
    """Stop the heartbeat of *lease* (of a sync operation); an extend in flight is not awaited."""
    SCHEDULER.stop(lease)


def stop_async_heartbeat(state: Lease) -> asyncio.Future[None] | None:
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


def start_async_heartbeat(store: AsyncStore, state: Lease) -> None:
    """Start extending *state* (of an async operation) until `stop_async_heartbeat`."""
    # A task only once the operation has outlived a third of its lease: short operations (most
    # requests and messages) never create and cancel a task, nor even a timer of their own.
    loop = asyncio.get_running_loop()
    last_loop, starts = _STARTS.last
    if last_loop() is not loop:  # another loop than the last one's (a weak reference)
        starts = _STARTS.of(loop)
    starts.add(loop, store, state)


class _AsyncStarts:
    """The async leases of one event loop whose heartbeat task is yet to start, on one timer.

    A lease waiting here has this object as its ``heartbeat``; stopping it is setting that to
    ``None``, and its entry is dropped when it comes due (with the entries due soon after it:
    the entries of calls that ended long ago cost one timer per slice of time, not one each).
    """

    def __init__(self) -> None:  # no reference to its loop, the key of `_StartsByLoop`
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


class _StartsByLoop:
    """The `_AsyncStarts` of each event loop (held weakly), and the last one used at hand."""

    def __init__(self) -> None:
        self.by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _AsyncStarts] = (
            weakref.WeakKeyDictionary()
        )
        self.last: tuple[Callable[[], asyncio.AbstractEventLoop | None], _AsyncStarts] = (
            lambda: None,
            _AsyncStarts(),
        )
        """The loop that started a heartbeat last, and its `_AsyncStarts`: most programs have
        one loop. One tuple, so that another thread's loop never reads half of it."""

    def of(self, loop: asyncio.AbstractEventLoop) -> _AsyncStarts:
        """The `_AsyncStarts` of *loop*, made the last one used."""
        starts = self.by_loop.get(loop) or self.by_loop.setdefault(loop, _AsyncStarts())
        self.last = (weakref.ref(loop), starts)
        return starts


_STARTS = _StartsByLoop()
