"""`Relay`: publishes committed outbox events, in each scope's commit order, at least once.

A scope is an ordering key and a destination. One cycle claims a batch (`oncely.outbox._store`
states what a claim promises, whatever the database), hands it to the `Publisher`, and records each
event's outcome: published, failed (counted, and retried after an exponential backoff),
dead-lettered after ``max_attempts`` failures, or left as it was (not attempted). A failure of
the whole publish call (the broker is down) counts against no event: the relay backs off and
tries again, and nothing is lost meanwhile. A call that times out is narrowed down to the event
it hangs on, whose failure it is (`Relay._publish`).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Awaitable, Sequence
from datetime import timedelta
from typing import Any

from oncely import _events as _stream
from oncely import _observed
from oncely._core.policy import Duration, to_timedelta
from oncely._log import fields, get_logger
from oncely.errors import ConfigurationError, MissingDependencyError, SchemaMissingError
from oncely.outbox._event import (
    NOT_ATTEMPTED,
    OutboxEvent,
    Outcome,
    Publisher,
    Scope,
    in_order,
    scope,
)
from oncely.outbox._store import ClaimedBatch, Failure, Settlement, backend_for

__all__ = ["Relay"]

logger = get_logger("oncely.outbox")

_MAX_BATCH = 10_000
_MAX_ERROR = 2000
"""Characters of an error message kept in ``last_error``."""
_SETUP_ERRORS = (ConfigurationError, MissingDependencyError, SchemaMissingError)


class Relay:
    """Publish the outbox's committed events through a `Publisher`.

    .. code-block:: python

        relay = Relay(store, KafkaPublisher.from_url("kafka://broker:9092"))
        await relay.run()            # until cancelled, or until the `stop` event given is set

    Several relays may run side by side on one PostgreSQL database: each claims its batch with
    ``FOR UPDATE SKIP LOCKED``, so in the normal case no event is published twice, and events of
    one ordering key to one destination (a *scope*) are published in commit order whichever
    relay takes them; a destination that refuses its events holds back only its own. Delivery
    is at least once: a relay that dies after the broker confirmed a batch but before it
    recorded that publishes nothing twice itself, but the next relay publishes the batch again;
    each message carries its message id as its idempotency key, for the consumer to
    deduplicate.

    Args:
        store: The `PostgresStore` or `SQLiteStore` the `Outbox` writes to.
        publisher: Sends batches to the broker (`oncely.outbox.Publisher`).
        batch_size: Events claimed and published per batch (what a batch holds in memory).
        poll_interval: How often to look for events without being woken. On PostgreSQL the
            relay also ``LISTEN``s for the outbox's ``NOTIFY`` and wakes at once.
        max_attempts: Failed attempts after which an event is dead-lettered: it is set aside
            (``dead_at``, ``last_error``), logged, and later events of its scope proceed.
        backoff: The wait before the first retry of a failed event; each further failure
            doubles it, up to *max_backoff*. The relay backs off the same way while the whole
            publish call fails.
        max_backoff: The longest wait between two attempts.
        retention: How long published events are kept before a purge deletes them.
        purge_interval: How often the relay purges.
        publish_timeout: How long one publish call may take. A call that takes longer is
            cancelled and its events published again in halves, until the call that times
            out holds one event: the timeout counts against that event. On SQLite the relay
            holds its claim on a batch about twice as long, renewed before each further call.
        listen: Wake on ``NOTIFY`` (PostgreSQL); ``False``: poll only.

    Raises:
        ConfigurationError: A bad setting, a store without SQL tables, or a publisher that is
            not one.

    .. versionadded:: 0.1.0
    """

    def __init__(
        self,
        store: Any,
        publisher: Publisher,
        *,
        batch_size: int = 100,
        poll_interval: Duration = 1.0,
        max_attempts: int = 10,
        backoff: Duration = 1.0,
        max_backoff: Duration = 300.0,
        retention: Duration = timedelta(days=1),
        purge_interval: Duration = 60.0,
        publish_timeout: Duration = 60.0,
        listen: bool = True,
    ) -> None:
        backend = backend_for(store, "the relay")
        if not isinstance(publisher, Publisher):
            raise ConfigurationError(
                f"a relay needs a Publisher (async publish and aclose), not "
                f"{type(publisher).__name__}"
            )
        for name, number, top in (
            ("batch_size", batch_size, _MAX_BATCH),
            ("max_attempts", max_attempts, 1_000_000),
        ):
            if isinstance(number, bool) or not isinstance(number, int) or not 1 <= number <= top:
                raise ConfigurationError(
                    f"{name} must be an integer from 1 to {top}, not {number!r}"
                )
        self.store = store
        self.publisher = publisher
        self.batch_size = batch_size
        self.max_attempts = max_attempts
        self.poll_interval = to_timedelta(poll_interval, "poll_interval")
        self.backoff = to_timedelta(backoff, "backoff")
        self.max_backoff = to_timedelta(max_backoff, "max_backoff")
        self.retention = to_timedelta(retention, "retention")
        self.purge_interval = to_timedelta(purge_interval, "purge_interval")
        self.publish_timeout = to_timedelta(publish_timeout, "publish_timeout")
        self.listen = listen
        self._backend = backend
        self._hold = self.publish_timeout * 2 + timedelta(seconds=5)
        """How long a claim lasts where it is a mark (SQLite), renewed before each call."""
        self._claimed = 0

    # -- one cycle -----------------------------------------------------------------------------

    async def run_once(self) -> int:
        """Claim one batch, publish it and record the outcomes; return how many were published.

        Raises:
            Exception: What the publisher raised for the whole call (the events it did not
                answer are left as they were, their ``last_error`` set), a `TimeoutError` when
                nothing was confirmed before a call timed out, or a `StoreError`.
        """
        self._claimed = 0
        async with self._backend.claim(self.batch_size, self._hold) as batch:
            events = batch.events
            self._claimed = len(events)
            if not events:
                return 0
            outcomes, failure = await self._publish(batch)
            note = None if failure is None else _describe(failure)
            settlement = self._settle(events, in_order(events, outcomes), note)
            await batch.settle(settlement)
        if failure is not None:
            raise failure
        return len(settlement.published)

    async def _publish(self, batch: ClaimedBatch) -> tuple[list[Outcome], Exception | None]:
        """Publish *batch*'s events; return their outcomes, and the failure that stopped it.

        A call that times out is cancelled and its events published again in two halves, and
        so on, until the call that times out holds one event: that timeout is the event's own
        failure, counted against it, and its scope's later events wait. Events the broker
        answered are not published again. When a lone event times out before anything was
        confirmed, the broker may be the one not answering: the rest is left for the next
        cycle (the timeout still counts against that event, the oldest one tried)."""
        events = batch.events
        outcomes: list[Outcome] = [NOT_ATTEMPTED] * len(events)
        blocked: set[Scope] = set()  # scopes with an event not confirmed: their later ones wait
        confirmed = False
        timeout = self.publish_timeout.total_seconds()
        parts = [list(range(len(events)))]  # a stack: the next part to try is the last
        calls = 0
        while parts:
            part = parts.pop()
            if blocked:
                part = [i for i in part if scope(events[i]) not in blocked]
            if not part:
                continue
            if calls:
                await batch.extend()
            calls += 1
            sent = events if calls == 1 else [events[i] for i in part]  # the first: all
            try:
                answers = await _within(self.publisher.publish(sent), timeout)
            except _TimedOut as exc:
                if len(part) > 1:
                    half = (len(part) + 1) // 2
                    parts += [part[half:], part[:half]]
                    continue
                outcomes[part[0]] = TimeoutError(f"the publish call holding it {exc}")
                if (where := scope(events[part[0]])) is not None:
                    blocked.add(where)
                if not confirmed:
                    return outcomes, TimeoutError(f"a publish call {exc}")
                continue
            except Exception as exc:
                return outcomes, exc
            if len(answers) != len(part):
                error = ValueError(
                    f"the publisher answered {len(answers)} outcomes for {len(part)} events"
                )
                return outcomes, error
            if calls == 1 and answers.count(None) == len(answers):  # all confirmed
                return list(answers), None
            for index, answer in zip(part, answers, strict=True):
                outcomes[index] = answer
                if answer is None:
                    confirmed = True
                elif (where := scope(events[index])) is not None:
                    blocked.add(where)
        return outcomes, None

    def _settle(
        self, events: Sequence[OutboxEvent], outcomes: Sequence[Outcome], note: str | None
    ) -> Settlement:
        if _stream.on:
            _observed.relayed(events, outcomes, self.max_attempts)
        settlement = Settlement(note=note)
        if outcomes.count(None) == len(outcomes):
            settlement.published = [event.id for event in events]
            return settlement
        for event, outcome in zip(events, outcomes, strict=True):
            if outcome is None:
                settlement.published.append(event.id)
            elif outcome is NOT_ATTEMPTED or not isinstance(outcome, BaseException):
                settlement.untouched.append(event.id)
            else:
                attempts = event.attempts + 1
                dead = attempts >= self.max_attempts
                error = _describe(outcome)
                delay = self._delay(attempts)
                settlement.failed.append(Failure(event.id, error, delay, dead))
                if dead:
                    logger.error(
                        "outbox event %s (message id %s, to %s) dead-lettered after %d "
                        "attempts: %s",
                        event.id,
                        event.message_id,
                        event.destination,
                        attempts,
                        error,
                        extra=fields(key=event.message_id, attempt=attempts, outcome="dead"),
                    )
                else:
                    logger.warning(
                        "outbox event %s (message id %s, to %s) failed, attempt %d of %d; "
                        "retrying in %.1f s: %s",
                        event.id,
                        event.message_id,
                        event.destination,
                        attempts,
                        self.max_attempts,
                        delay.total_seconds(),
                        error,
                        extra=fields(key=event.message_id, attempt=attempts, outcome="failed"),
                    )
        return settlement

    def _delay(self, failures: int) -> timedelta:
        delay: timedelta = self.backoff * 2 ** min(failures - 1, 40)
        return min(self.max_backoff, delay)

    # -- the loop ------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Publish until *stop* is set (or the task is cancelled); purge now and then.

        A batch under way when *stop* is set is finished first. A failing broker or database
        is logged and retried with backoff, never raised.

        Raises:
            SchemaMissingError: The outbox tables are missing: run ``migrate()``.
            ConfigurationError: A setting that waiting will not fix (from the publisher, say).
            MissingDependencyError: The publisher's client library is missing.
        """
        stop = stop if stop is not None else asyncio.Event()
        wake = asyncio.Event()
        listener = await self._backend.listen(wake) if self.listen else None
        failures = 0
        next_purge = time.monotonic()
        try:
            while not stop.is_set():
                wake.clear()  # a NOTIFY from here on wakes the pause below
                try:
                    if time.monotonic() >= next_purge:
                        next_purge = time.monotonic() + self.purge_interval.total_seconds()
                        await self.purge()
                    published = await self.run_once()
                    if _stream.on:
                        await _observed.backlog(self._backend)
                except _SETUP_ERRORS:
                    raise  # waiting would not help: the schema, a setting, a missing library
                except Exception as exc:
                    failures += 1
                    delay = self._delay(failures)
                    logger.warning(
                        "outbox relay: %s; trying again in %.1f s",
                        _describe(exc),
                        delay.total_seconds(),
                    )
                    await _pause(stop, None, delay)
                    continue
                failures = 0
                if published == 0 or self._claimed < self.batch_size:
                    await _pause(stop, wake, self.poll_interval)
        finally:
            if listener is not None:
                listener.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await listener

    def run_forever(self) -> None:
        """Run in a new event loop until SIGINT or SIGTERM, then close the publisher."""
        asyncio.run(self._until_signalled())

    async def _until_signalled(self) -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        handled = []
        for number in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(number, stop.set)
                handled.append(number)
            except (NotImplementedError, RuntimeError, ValueError):
                pass  # not the main thread, or no signals here: cancel the loop instead
        try:
            await self.run(stop)
        finally:
            for number in handled:
                loop.remove_signal_handler(number)
            await self.aclose()

    async def purge(self) -> int:
        """Delete events published longer than ``retention`` ago; return how many."""
        return await self._backend.purge(self.retention)

    async def aclose(self) -> None:
        """Close the publisher and the relay's own connections (not the store)."""
        try:
            await self.publisher.aclose()
        finally:
            await self._backend.aclose()


async def _pause(stop: asyncio.Event, wake: asyncio.Event | None, timeout: timedelta) -> None:
    """Wait until *stop* (or *wake*) is set, or *timeout* has passed."""
    waiters = [asyncio.ensure_future(stop.wait())]
    if wake is not None:
        waiters.append(asyncio.ensure_future(wake.wait()))
    try:
        await asyncio.wait(
            waiters, timeout=timeout.total_seconds(), return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        for waiter in waiters:
            waiter.cancel()


class _TimedOut(Exception):
    """A publish call the relay gave up on (not a `TimeoutError` the publisher raised)."""


async def _within(call: Awaitable[Sequence[Outcome]], timeout: float) -> Sequence[Outcome]:
    """Await *call*; cancel it and raise `_TimedOut` after *timeout* seconds."""
    task = asyncio.ensure_future(call)
    done, _ = await asyncio.wait((task,), timeout=timeout)
    if not done:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        raise _TimedOut(f"did not return in {timeout:g} s")
    return task.result()


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return text[:_MAX_ERROR]


def backend_stats(store: Any) -> dict[str, Any]:
    """The outbox's counts (for ``oncely outbox stats``): pending, dead, published, oldest."""
    backend = backend_for(store, "the outbox")

    async def count() -> dict[str, Any]:
        try:
            return await backend.stats()
        finally:
            await backend.aclose()

    return asyncio.run(count())
